"""Offloading under torch.distributed: 2 processes, one ``torchrun --standalone --nproc-per-node
2`` run of ``tests/_support/distributed_cases.py``.

On the CPU (CI): gloo and SimulatedDevice. One run executes every case; each test below checks
its case's outcome: gradients with offloading ``torch.equal`` to the same distributed run without
it, on both ranks, and copies actually made.

On one GPU (marker ``gpu``): every case but the pipelines (gloo cannot send CUDA tensors), both
ranks on GPU 0 over gloo (``--device cuda-shared``): real streams, and for the optimizer cases
the GPU's rounding against the CPU's, checked as on 2 GPUs.

On 2 GPUs (marker ``multigpu``; skipped with fewer): NCCL, one GPU per rank, deterministic
kernels, bf16 GPT blocks of hidden 1024 and sequence 2048, one run per case: gradients with
offloading ``torch.equal`` to the same run without it on both ranks, peak memory lower, and no
hang (killed after ``MULTIGPU_TIMEOUT``). Run on a 2-GPU host with::

    python -m pytest -m multigpu -v tests/integration/test_distributed.py
"""
from __future__ import annotations

import json
import pathlib
import shlex

import pytest
import torch
from packaging.version import Version

from cpu_offload.compat import TORCH_VERSION
from _support.distributed_cases import CASES, SHARED_GPU_CASES, launch, torchrun

# Seconds for the whole CPU run: ~15 s on 2 idle cores; a hang (a collective waiting forever)
# is killed after this and fails every case.
TIMEOUT = 240
MULTIGPU_TIMEOUT = 600  # seconds per 2-GPU case


@pytest.fixture(scope="module")
def cpu_run():
    return launch(list(CASES), "cpu", timeout=TIMEOUT)


def check_case(run, case: str) -> dict:
    code, out, results = run
    if case not in results:
        what = "timed out (hang?)" if code is None else f"exit code {code}"
        pytest.fail(f"case {case!r} reported no result: torchrun {what}\n{out[-6000:]}")
    result = results[case]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    return result


def test_ddp_distributed_gloo_simulated_exact_gradients(cpu_run):
    check_case(cpu_run, "ddp")


@pytest.mark.parametrize("case", [c for c in CASES if c != "ddp"])
def test_distributed_gloo_simulated_exact_gradients(cpu_run, case):
    check_case(cpu_run, case)


def test_distributed_run_ends_cleanly(cpu_run):
    """Exit code 0, and each rank reported its teardown: process group destroyed, no thread of
    ours left. Ranks then end without the interpreter's shutdown, where a gloo worker thread
    aborted some runs after every result was printed (``distributed_cases.exit_skipping_shutdown``
    says why)."""
    code, out, results = cpu_run
    assert code == 0, out[-6000:]
    assert set(results) == set(CASES)
    teardowns = [json.loads(line[len("TEARDOWN "):]) for line in out.splitlines()
                 if line.startswith("TEARDOWN ")]
    assert sorted(teardowns, key=lambda t: t["rank"]) == [
        {"rank": rank, "backend": "gloo", "python_threads": []} for rank in range(2)
    ], out[-6000:]


def test_distributed_benchmark_runs_on_cpu():
    """benchmarks/distributed_benchmark.py (2 GPUs) as a smoke test: gloo + SimulatedDevice."""
    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "distributed_benchmark.py"
    if not script.exists():
        pytest.skip("benchmarks/ not in this tree")
    if TORCH_VERSION < Version("2.4"):
        # The benchmark is for FSDP2 (torch >= 2.4). On 2.1.2 under tox its workers printed the
        # table and then never exited (twice, also with a barrier before teardown).
        pytest.skip("the distributed benchmark needs torch >= 2.4")
    # FSDP2 runs on the CPU from torch 2.8 (see distributed_cases.CPU_NEEDS_2_8)
    wrappers = ["single", "ddp"] + (["fsdp2"] if TORCH_VERSION >= Version("2.8") else [])
    code, out, _ = torchrun([str(script), "--device", "cpu", "--layers", "4", "--ks", "1,2",
                             "--warmup", "1", "--steps", "1", "--wrappers", ",".join(wrappers)],
                            timeout=TIMEOUT)
    assert code == 0, out[-6000:]
    for name in wrappers:
        assert f"{name} + offload k=2" in out, out[-3000:]
    for name in set(wrappers) & {"ddp", "fsdp2"}:  # the optimizer rows, exact
        assert f"{name} + hybrid f=0.25" in out and f"{name} + hybrid f=1 " in out, out[-3000:]
    assert " NO" not in out, out[-3000:]


def doc_torchrun_commands() -> list:
    """The ``torchrun`` lines of docs/distributed.md's bash blocks, each as its argument list."""
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md"
    if not doc.exists():
        return []
    return [shlex.split(line) for line in doc.read_text().splitlines()
            if line.startswith("torchrun ")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default of the scripts")
@pytest.mark.parametrize("command", doc_torchrun_commands(), ids=lambda c: pathlib.Path(c[4]).stem)
def test_the_documented_torchrun_commands_run_without_cuda(command, tmp_path, monkeypatch):
    """As written in the docs, on a machine without a GPU: the scripts fall back to the CPU
    (gloo, the simulated device) instead of failing in torch.cuda.set_device."""
    root = pathlib.Path(__file__).resolve().parents[2]
    assert command[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)  # --out bench_out lands here
    code, out, _ = torchrun([str(root / command[4]), *command[5:]], timeout=TIMEOUT)
    assert code == 0, out[-6000:]
    assert " NO" not in out and "Traceback" not in out, out[-3000:]


def check_gpu_case(case: str, device_kind: str) -> None:
    """Run ``case`` on the GPU(s) (``launch``): it must end with its result (every rank's
    gradients or parameters exact, checked inside the run), the memory it lowers lower."""
    code, out, results = launch([case], device_kind, timeout=MULTIGPU_TIMEOUT)
    if code is None:
        pytest.fail(f"{case}: no result after {MULTIGPU_TIMEOUT} s (hang?)\n{out[-8000:]}")
    assert code == 0 and case in results, out[-8000:]
    result = results[case]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert result["device"] == device_kind and result["world"] == 2, result
    if case == "fsdp2-optim":  # the device memory held by the model and its optimizer
        assert result["held_ratio"] < 1.0, result
    elif case not in ("ddp-optim-clip", "zero-optim"):  # exactness only, not memory
        assert result["peak_ratio"] < 1.0, result
    print(result)


@pytest.mark.multigpu
@pytest.mark.parametrize("case", CASES)
def test_multigpu_distributed_exact_gradients_and_lower_peak(case):
    check_gpu_case(case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHARED_GPU_CASES)
def test_two_ranks_on_one_gpu_exact_and_the_same_on_both_ranks(case):
    """Two ranks on one GPU over gloo: what a one-GPU machine can check of the 2-GPU cases.
    The optimizer cases compare each rank's parameters bit for bit with ``PlacedReference``
    (the CPU part rounded by the CPU class, the rest by the GPU's) and between the ranks:
    placement or rounding that differed between ranks would fail."""
    check_gpu_case(case, "cuda-shared")
