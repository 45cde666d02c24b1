"""``HybridDeviceOptimizer`` is reproducible (issue 39): the same script gives the same placement
and the same bits on every run, and no timing decides which parameter is updated where.

On a GPU the CPU and the device round differently, so the split between the CPU part and the
streamed part is part of the result. ``SimulatedDevice`` plans with fixed nominal rates; the
device here (``UntimedDevice``) has none, as a real GPU has none, so whatever the default
(``stream_fraction="auto"``) decides must not come from clocks: the clocks are jittered
(``time.perf_counter``/``time.monotonic``, a different jitter per construction) and three
constructions must place every parameter alike. The GPU version: ``test_reproducible_gpu.py``.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from cpu_offload import SimulatedDevice
from cpu_offload.optim import HybridDeviceOptimizer

from _support.hybrid_cases import loss_of, made, net, settle

assert made  # fixture


class UntimedDevice(SimulatedDevice):
    """A simulated device without nominal rates (``OffloadDevice.nominal_rates`` returns
    ``None`` on CUDA): a plan from timings would see this host's clocks."""

    def nominal_rates(self):
        return None


def jitter(monkeypatch, seed: int) -> None:
    """Clocks that run ahead by random amounts (monotonic), differently for each ``seed``."""
    rng = random.Random(seed)
    for name in ("perf_counter", "monotonic"):
        real, ahead = getattr(time, name), [0.0]

        def clock(real=real, ahead=ahead):
            ahead[0] += rng.random() * 0.01
            return real() + ahead[0]

        monkeypatch.setattr(time, name, clock)


def placement(opt: HybridDeviceOptimizer, params: list) -> tuple:
    """Positions of the CPU-updated and the streamed parameters."""
    pos = {id(p): i for i, p in enumerate(params)}
    return (tuple(pos[id(p)] for p in opt.offloaded_params()),
            tuple(pos[id(p)] for p in opt.streamed_params()))


def run(made, monkeypatch, seed, **kw) -> tuple:
    """Construct with the defaults but ``kw`` and train 3 steps, under clocks jittered by
    ``seed`` (if not None); the choice, the placement and the parameters."""
    m = net(torch.bfloat16)
    params = list(m.parameters())
    with monkeypatch.context() as mp:
        if seed is not None:
            jitter(mp, seed)
        opt = HybridDeviceOptimizer(params, lr=1e-3, device=UntimedDevice(), **kw)
        made.append(opt)
        for i in range(3):
            loss_of(m, i).backward()
            opt.step()
            opt.zero_grad()
        settle(opt)
    return opt.stream_fraction, placement(opt, params), [p.detach().clone() for p in params]


def assert_same_runs(runs: list) -> None:
    (fraction, where, params), rest = runs[0], runs[1:]
    for k, (f, w, ps) in enumerate(rest, 1):
        assert f == fraction, f"run {k} chose stream_fraction {f}, run 0 {fraction}"
        assert w == where, f"run {k} placed (CPU, streamed) {w}, run 0 {where}"
        for i, (a, b) in enumerate(zip(ps, params)):
            assert torch.equal(a, b), f"run {k}: parameter {i} differs"


@pytest.mark.parametrize("offload_fraction", [1.0, 0.5])
def test_default_placement_does_not_depend_on_timing(made, monkeypatch, offload_fraction):
    assert_same_runs([run(made, monkeypatch, seed, offload_fraction=offload_fraction)
                      for seed in (1, 2, 3)])


def test_default_placement_same_in_three_constructions(made, monkeypatch):
    """Real clocks, as a user re-running a script (or the ranks of a job) sees them."""
    assert_same_runs([run(made, monkeypatch, None, offload_fraction=1.0) for _ in range(3)])


@pytest.mark.parametrize("stream_fraction", [0.0, 0.5, 1.0])
def test_fixed_stream_fraction_places_alike(made, monkeypatch, stream_fraction):
    runs = [run(made, monkeypatch, seed, offload_fraction=1.0, stream_fraction=stream_fraction)
            for seed in (1, 2, 3)]
    assert runs[0][0] == stream_fraction
    assert_same_runs(runs)


@pytest.mark.parametrize("update_in_fp32", [False, True])
@pytest.mark.parametrize("stream_fraction", [0.0, 0.5, 1.0])
def test_placed_reference_on_the_simulated_device(made, stream_fraction, update_in_fp32):
    """``PlacedReference`` (the GPU tests' exact reference, built from the hybrid's placement)
    equals the hybrid on the simulated device, where every part runs the same CPU class:
    bf16 parameters, a device part (stepped in place, or on fp32 masters), a CPU part and a
    streamed part."""
    from cpu_offload.optim.reference import PlacedReference

    m, ref = net(torch.bfloat16), net(torch.bfloat16)
    opt = HybridDeviceOptimizer(m.parameters(), 0.5, lr=1e-2, device=SimulatedDevice(),
                                stream_fraction=stream_fraction,
                                param_update_in_fp32=update_in_fp32)
    made.append(opt)
    ref_opt = PlacedReference.like(opt, list(m.parameters()), ref.parameters(), lr=1e-2)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_measure_times_this_host_and_keeps_the_choice(made, monkeypatch):
    """``stream_fraction="measure"`` is the one timed choice: on a device without nominal
    rates it measures the link and the CPU update here (its probe runs), and ``state_dict()``
    keeps the split it chose, so that a resumed run repeats it."""
    from cpu_offload.optim import balance

    fraction, _, _ = run(made, monkeypatch, None, offload_fraction=1.0, stream_fraction="measure")
    opt = made[-1]
    assert isinstance(fraction, float) and 0.0 <= fraction <= 1.0
    rates = opt.split_estimate()["rates"]
    assert rates["cpu_params_per_s"] > 0 and rates["h2d_bytes_per_s"] > 0
    assert rates != balance.planning_rates(opt._device)  # measured, not the planning model
    assert opt.state_dict()["hybrid"]["stream_fraction"] == fraction
