"""Shared fixtures: the simulated device, GPU skipping, deterministic kernels for GPU tests."""
from __future__ import annotations

import os

# cuBLAS reads this when its first handle is created, so it must be set before any GPU test runs;
# it is what deterministic mode requires and does not change which kernels run.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

# The suite's tensors are tiny: OpenMP threads only oversubscribe CI's 2 cores (measured: ~80x
# slower with the default thread count under load).
torch.set_num_threads(1)

from cpu_offload import SimulatedDevice
from cpu_offload.compat import cpu_offload_policies
from cpu_offload.examples.gpt import build_model, make_input

from _support import gpt_cuda

# CPU_OFFLOAD_STRICT_WARNINGS=1 (tox's newest-torch env): torch's deprecations of our calls fail
from _support.strict_warnings import pytest_configure  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_multigpu = pytest.mark.skip(reason=f"needs 2 GPUs, found {gpus}")
    # The docstring examples of torch's CPU-offload checkpoint policies need the policies.
    skip_policies = None if cpu_offload_policies() else pytest.mark.skip(
        reason="needs torch's CheckpointPolicy.MUST_CPU_OFFLOAD (absent in this torch release)")
    for item in items:
        if skip_policies is not None and item.name.startswith("cpu_offload.v2.policies."):
            item.add_marker(skip_policies)
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multigpu)


@pytest.fixture
def sim() -> SimulatedDevice:
    return SimulatedDevice()


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """Tests run against V2 unless they select V1 themselves."""
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)


@pytest.fixture(params=["v2", "v1"])
def backend(request, monkeypatch) -> str:
    """Run the test once per backend, selected as users do: through NVTE_CPU_OFFLOAD_V1."""
    if request.param == "v1":
        monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    return request.param


@pytest.fixture
def deterministic():
    """Bit-identical comparisons on CUDA need deterministic kernels (attention backward
    accumulates with atomics otherwise; even two runs without offloading differ). Deterministic
    mode also fills fresh memory, which checks that copies into newly allocated buffers are
    ordered after the allocation."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(prev, warn_only=prev_warn_only)


# The GPT stack on CUDA that V2's gpu-marked tests share (tests/_support/gpt_cuda.py): built once
# per test module, and only when a test that runs asks for it.
@pytest.fixture(scope="module")
def gpt_model():
    return build_model(gpt_cuda.CFG, device="cuda", seed=0)


@pytest.fixture(scope="module")
def gpt_x0():
    return make_input(gpt_cuda.CFG, device="cuda", seed=1, requires_grad=False)
