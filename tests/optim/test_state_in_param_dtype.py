"""``fp32_masters=False``: offloaded bf16/fp16 parameters keep their optimizer state in their own
dtype, as the wrapped class keeps it on the parameters themselves (and as torchao's
``CPUOffloadOptimizer`` does), with no fp32 master. On the simulated device parameters and state
equal (``torch.equal``) ``torch.optim.AdamW(fused=True)`` run on the parameters without
offloading, for every split and overlap mode; the pinned host memory drops to about a third for
the streamed part. The GPU version is in ``test_reproducible_gpu.py``."""
from __future__ import annotations

import copy

import pytest
import torch

from cpu_offload import OffloadConfigError, SimulatedDevice
from cpu_offload.optim import OVERLAP_MODES, HybridDeviceOptimizer, to_wrapped_format
from cpu_offload.optim.cpu_update import master_dtype

from test_optim_dtypes import (KW, _roundtrip, assert_same, check_state_dict_round_trips, fused_adamw, hybrid,
                               model, train, trained_like_fused_adamw)

LOW = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def test_master_dtype_without_fp32_masters_is_the_parameter_dtype():
    assert master_dtype(torch.bfloat16, fp32_masters=False) == torch.bfloat16
    assert master_dtype(torch.float16, fp32_masters=False) == torch.float16
    assert master_dtype(torch.float64, fp32_masters=False) == torch.float64


def test_fp32_masters_must_be_a_bool():
    with pytest.raises(OffloadConfigError, match="fp32_masters must be True or False"):
        HybridDeviceOptimizer([torch.nn.Parameter(torch.ones(4))], device=SimulatedDevice(),
                              fp32_masters="no")


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("stream_fraction", [0.0, 0.5, 1.0, "auto"])
@pytest.mark.parametrize("dtype", LOW)
def test_equals_the_wrapped_class_on_the_parameters(dtype, stream_fraction, mode):
    _, opt = trained_like_fused_adamw(dtype, 1.0, mode, stream_fraction=stream_fraction,
                                      fp32_masters=False)  # parameters and state equal
    assert opt.offloaded_params() or opt.streamed_params()
    assert all(e["exp_avg"].dtype == dtype for e in opt.state_dict()["state"].values())
    opt.close()


@pytest.mark.parametrize("dtype", LOW)
def test_state_dict_round_trips_keep_the_dtype_and_continue_exactly(dtype):
    check_state_dict_round_trips(dtype, fp32_masters=False)


def state_bytes(opt) -> int:
    """Bytes of the per-parameter state and masters the optimizer keeps (``state_dict()``)."""
    return sum(v.nbytes for e in opt.state_dict()["state"].values() for v in e.values()
               if isinstance(v, torch.Tensor) and v.dim() > 0)


@pytest.mark.parametrize("stream_fraction", [0.0, 1.0])
def test_host_memory_drops_without_fp32_masters(stream_fraction):
    """Per offloaded bf16 AdamW parameter the saved state and master take 12 B (fp32 master,
    exp_avg, exp_avg_sq) with masters; without, 4 B (bf16 state; the CPU part's bf16 copy of
    the parameter equals it and is not saved), and the streamed part's pinned host copies
    shrink with it."""
    kept, pinned = {}, {}
    for fp32 in (True, False):
        dev = SimulatedDevice()
        m = model(torch.bfloat16)
        opt = HybridDeviceOptimizer(m.parameters(), 1.0, device=dev, stream_fraction=stream_fraction,
                                    fp32_masters=fp32, **KW)
        train(m, opt, 2)
        kept[fp32], pinned[fp32] = state_bytes(opt), dev.host_bytes_allocated
        opt.close()
    n = sum(p.numel() for p in model(torch.bfloat16).parameters())
    assert kept[True] == 12 * n  # the streamed parameters are their own masters without fp32
    assert kept[False] == 4 * n
    if stream_fraction == 1.0:
        assert pinned[False] <= 0.4 * pinned[True], pinned


@pytest.mark.parametrize("stream_fraction", [0.0, 0.5, 1.0])
def test_a_checkpoint_with_fp32_masters_loads_as_torch_loads_it(stream_fraction):
    """A checkpoint saved with fp32 masters, loaded with ``fp32_masters=False``: the state is
    cast to bf16, as ``torch.optim.AdamW`` on the bf16 parameters casts it when it loads the
    same checkpoint (in its own format), and training continues equal to that."""
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, "backward_update", stream_fraction=stream_fraction)
    train(m, opt, 2)
    sd = opt.state_dict()
    opt.close()
    mine, theirs = copy.deepcopy(m), copy.deepcopy(m)
    opt2 = hybrid(mine, 1.0, "next_forward", stream_fraction=stream_fraction, fp32_masters=False)
    opt2.load_state_dict(_roundtrip(sd))  # each its own copy: torch keeps the loaded step tensors
    ref_opt = fused_adamw(theirs.parameters(), **KW)
    ref_opt.load_state_dict(_roundtrip(to_wrapped_format(sd)))
    assert train(mine, opt2, 2, start=2) == train(theirs, ref_opt, 2, start=2)
    assert_same(mine, opt2, theirs, ref_opt)
    opt2.close()


def _fused_sgd_error_free(dtype: torch.dtype) -> bool:
    """Whether this torch's fused CPU SGD with momentum updates a ``dtype`` parameter as torch's
    fp32 SGD does, to within the ``dtype``'s rounding of each step."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4096 + 5).to(dtype))
    ref = torch.nn.Parameter(p.detach().float())
    fused = torch.optim.SGD([p], lr=0.1, momentum=0.9, fused=True)
    exact = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for _ in range(3):
        g = (torch.randn(p.shape) * 0.1).to(dtype)
        p.grad, ref.grad = g, g.float()
        fused.step()
        exact.step()
    # three roundings of values below 5: at most 3 ulps of 4 apart (bf16: 0.094); momentum makes
    # the third update about 0.27 x the gradient, so skipped updates go past that
    tolerance = 3 * 4 * torch.finfo(dtype).eps
    return bool((p.detach().float() - ref.detach()).abs().max() <= tolerance)


@pytest.mark.parametrize("dtype", LOW)
def test_refusing_fused_cpu_sgd_matches_the_torch_releases_that_get_it_wrong(dtype):
    """torch's fused CPU SGD skips whole vector blocks of bf16/fp16 tensors before 2.14
    (pytorch/pytorch#191763): the refusal below is bound to the releases that have the bug."""
    from cpu_offload.compat import TORCH_VERSION
    from cpu_offload.optim.classes import FUSED_CPU_SGD_LOW_PRECISION_FIXED

    assert _fused_sgd_error_free(dtype) == (TORCH_VERSION >= FUSED_CPU_SGD_LOW_PRECISION_FIXED)


@pytest.mark.parametrize("version,refused", [("2.13.0", True), ("2.14.1", False)])
@pytest.mark.parametrize("dtype", LOW)
def test_fused_cpu_sgd_on_low_precision_state_is_refused_before_torch_2_14(monkeypatch, dtype, version, refused):
    from packaging.version import Version

    monkeypatch.setattr("cpu_offload.optim.classes.TORCH_VERSION", Version(version))
    params = [torch.nn.Parameter(torch.randn(64, 64).to(dtype)) for _ in range(2)]

    def build(**kw):
        return HybridDeviceOptimizer(params, 1.0, torch.optim.SGD, torch.optim.SGD, device=SimulatedDevice(),
                                     stream_fraction=0.5, lr=0.1, momentum=0.9, **kw)

    if refused:
        with pytest.raises(OffloadConfigError, match=r"fused CPU SGD updates (bfloat16|float16) tensors wrongly"
                           r".*#191763.*keep fp32_masters=True, pass fused=False"):
            build(fused=True, fp32_masters=False)
    else:
        build(fused=True, fp32_masters=False).close()
    for kw in (dict(fused=True), dict(fp32_masters=False), dict(fused=False, fp32_masters=False)):
        build(**kw).close()  # fp32 masters, or SGD not fused: right on every release
