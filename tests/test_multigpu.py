"""Offloading under torch.distributed on 2 GPUs (marker ``multigpu``; skipped with fewer).

Each test launches ``torchrun --standalone --nproc-per-node 2 tests/distributed_cases.py`` for
one case (NCCL, one GPU per rank, deterministic kernels, bf16 GPT blocks of hidden 1024 and
sequence 2048): gradients with offloading ``torch.equal`` to the same run without it on both
ranks, peak memory lower, and no hang (killed after ``TIMEOUT``). Run on a 2-GPU host with::

    python -m pytest -m multigpu -v tests/test_multigpu.py
"""
from __future__ import annotations

import pytest

from distributed_cases import CASES, launch

TIMEOUT = 600

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("case", CASES)
def test_multigpu_distributed_exact_gradients_and_lower_peak(case):
    code, out, results = launch([case], "cuda", timeout=TIMEOUT)
    if code is None:
        pytest.fail(f"{case}: no result after {TIMEOUT} s (hang?)\n{out[-8000:]}")
    assert code == 0 and case in results, out[-8000:]
    result = results[case]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["peak_ratio"] < 1.0, result
    print(result)
