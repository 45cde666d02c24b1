"""Shared fixtures: the simulated device, a GPU skip marker, and a small layer stack."""
from __future__ import annotations

import pytest
import torch

from cpu_offload import SimulatedDevice


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the accelerator machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def sim() -> SimulatedDevice:
    return SimulatedDevice()


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """Tests run against V2 unless they select V1 themselves."""
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
