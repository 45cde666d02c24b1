"""``plan_offloading(..., verify_candidates=N)``: the model's shortlist measured in the real step,
the fastest measured plan that fits returned. The measurement is replaced by a deterministic
stand-in (``_measure``) where the test needs one candidate to be the fastest."""
from __future__ import annotations

import pytest
import torch

import cpu_offload
from cpu_offload import OffloadConfigError, SimulatedDevice, plan_offloading

# The docstring example's step: 4 layers whose bytes decide (a 10 kB/s link).
KW = dict(min_tensor_size_to_offload=1, link_gbps=1e-5, selective=False, partial=False,
          repeats=1, warmup=1)
PROFILE_CALLS = 1 + 2 + 6 * 1  # warmup + 2 + 6 * repeats (no selective steps)


class Step:
    """One training step of 4 small layers; counts its calls and raises in those that
    ``fails(call)`` says."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4))
        self.x0 = torch.randn(8, 64)
        self.calls = 0
        self.fails = lambda call: False

    def __call__(self) -> None:
        self.calls += 1
        if self.fails(self.calls):
            raise RuntimeError("step failed")
        x = self.x0.clone().requires_grad_()
        for layer in self.layers:
            x = layer(x)
        x.sum().backward()

    def hooks(self) -> list:
        return [(len(m._forward_hooks), len(m._forward_pre_hooks), type(m).__name__)
                for m in self.layers.modules()]


def fixed(times: dict, peaks: dict = None):
    """A ``_measure`` stand-in: each candidate's time (and peak) by its layout."""
    peaks = peaks or {}
    return lambda plan, ms, peak: (times[plan.layout], peaks.get(plan.layout, peak))


def shortlist_of(step: Step, budget: float = 0.5) -> list:
    plan = plan_offloading(step, step.layers, budget, device=SimulatedDevice(),
                           verify_candidates=3, **KW)
    return [t.layout for t in plan.verified]


def test_verification_returns_the_measured_fastest_candidate():
    step = Step()
    layouts = shortlist_of(step)
    assert len(layouts) == 3 and len(set(layouts)) == 3
    for fastest in layouts:
        times = {lay: (1.0 if lay == fastest else 5.0 + i) for i, lay in enumerate(layouts)}
        step.calls = 0
        plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                               verify_candidates=3, _measure=fixed(times), **KW)
        assert plan.layout == fastest and plan.measured_ms == 1.0
        assert [(t.layout, t.measured_ms, t.rejected) for t in plan.verified] == [
            (lay, times[lay], None) for lay in layouts]  # the model's order
        assert step.calls == PROFILE_CALLS + 3 * 3 * 1  # the docstring's count
        assert "measured 1.0 ms in the real step, the fastest of 3 verified" in plan.describe()
        assert plan.peak_bytes <= plan.memory_budget_bytes  # every candidate fits the model
        handle = cpu_offload.apply_offloading(step.layers, plan=plan)  # on the plan's device
        step()
        handle.remove()


def test_the_shortlist_adds_each_simple_family_the_model_ranks_close():
    """After the model's best ``count``: the fastest fitting ``ckpt k``, ``off k`` and ``sel
    k`` not among them, each only if predicted within ``NEAR_TIME`` of the best (the model's
    error on times); one of each kind."""
    from dataclasses import replace

    from cpu_offload.plan import Plan
    from cpu_offload.plan.search import NEAR_TIME, shortlist

    best = Plan(3, recompute=(3,), model_layers=8, step_ms=100.0)
    mixed = Plan(4, recompute=(4,), model_layers=8, step_ms=100.5)
    mixed2 = Plan(4, recompute=(5,), model_layers=8, step_ms=100.7)
    off2 = Plan(2, model_layers=8, step_ms=103.0)
    off3 = Plan(3, model_layers=8, step_ms=104.0)  # not the fastest of its kind
    ckpt2 = Plan(0, recompute=(0, 1), model_layers=8, step_ms=100.0 * (1 + NEAR_TIME) + 0.1)
    sel1 = Plan(1, selective=tuple(range(8)), model_layers=8, step_ms=101.0)
    plan = replace(best, alternatives=[mixed, mixed2, off2, off3, ckpt2, sel1])
    layouts = [p.layout for p in shortlist(plan, 2)]
    assert layouts == [best.layout, mixed.layout, sel1.layout, off2.layout]  # ckpt 2: too slow
    assert [p.layout for p in shortlist(plan, 4)] == [  # sel 1 is among the 4: not twice
        best.layout, mixed.layout, mixed2.layout, sel1.layout, off2.layout]
    assert shortlist(plan, 0) == []


def test_verification_measures_the_shortlist_and_nothing_else():
    from cpu_offload.plan.search import shortlist

    step = Step()
    best = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                           verify_candidates=0, **KW)  # the model's best, unmeasured
    assert best.verified == ()
    expected = [p.layout for p in shortlist(best, 3, peaks_measured=False)]
    step.calls = 0
    plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                           verify_candidates=3, **KW)
    assert [t.layout for t in plan.verified] == expected and len(expected) >= 3
    assert step.calls == PROFILE_CALLS + len(expected) * 3 * 1


def test_the_typical_step_decides_not_the_fastest_few():
    """A candidate fast in a third of its steps and slow in the rest loses to one steady in
    between: training pays for every step (the median decides; a lower quartile would not)."""
    from cpu_offload.plan.verify import TIMED_STEPS

    step = Step()
    layouts = shortlist_of(step)
    seen: dict = {}

    def uneven(plan, ms, peak):
        n = seen[plan.layout] = seen.get(plan.layout, 0) + 1
        if plan.layout == layouts[0]:
            return (1.0 if n <= 2 else 9.0), peak  # 2 fast steps of 3 * TIMED_STEPS
        return 5.0 + layouts.index(plan.layout), peak

    step.calls = 0
    plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                           verify_candidates=3, _measure=uneven, **KW | dict(repeats=3))
    assert seen[layouts[0]] == 3 * TIMED_STEPS
    assert plan.layout == layouts[1] and plan.measured_ms == 6.0
    assert plan.verified[0].measured_ms == 9.0


def test_a_candidate_whose_measured_peak_is_over_the_budget_is_rejected():
    step = Step()
    layouts = shortlist_of(step)
    times = {lay: 1.0 + i for i, lay in enumerate(layouts)}  # the first is the fastest
    over = {layouts[0]: 10**9}
    plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                           verify_candidates=3, _measure=fixed(times, over), **KW)
    assert plan.layout == layouts[1]
    assert "over the budget" in plan.verified[0].rejected
    assert plan.verified[0].measured_ms == 1.0  # measured, then rejected
    # Every one over: the lowest measured peak, with a warning that names the fix.
    over = {lay: 10**9 - i for i, lay in enumerate(layouts)}
    with pytest.warns(UserWarning, match="every verified plan measured a peak over the memory "
                                         "budget.*raise peak_margin"):
        plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                               verify_candidates=3, _measure=fixed(times, over), **KW)
    assert plan.layout == layouts[2]


@pytest.mark.filterwarnings("ignore:cpu_offload. an offload step freed no")
def test_a_step_that_raises_during_verification_leaves_no_plan_applied():
    step = Step()
    before = step.hooks()
    step.fails = lambda call: call > PROFILE_CALLS  # every verification step
    with pytest.raises(RuntimeError, match="step failed"):
        plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(), verify_candidates=3,
                        **KW)
    assert step.calls == PROFILE_CALLS + 3  # each candidate tried once, then given up
    assert step.hooks() == before
    step.fails = lambda call: False
    handle = cpu_offload.apply_offloading(step.layers, num_layers=1, device=SimulatedDevice(),
                                          min_tensor_size_to_offload=1)  # nothing in the way
    step()
    handle.remove()


def test_a_candidate_that_raises_is_rejected_and_the_others_decide():
    step = Step()
    layouts = shortlist_of(step)
    step.calls = 0
    step.fails = lambda call: call == PROFILE_CALLS + 1  # the first candidate's first step
    times = {lay: 1.0 + i for i, lay in enumerate(layouts)}
    plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                           verify_candidates=3, _measure=fixed(times), **KW)
    assert plan.verified[0][2:] == (None, None, "failed: RuntimeError: step failed")
    assert plan.layout == layouts[1]
    assert step.hooks() == Step().hooks()
    assert "offload" in plan.describe().split("(the others: ")[1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_verify_candidates_must_be_a_count(bad):
    step = Step()
    with pytest.raises(OffloadConfigError, match=r"verify_candidates must be None \(measure 3 "
                                                 r"candidates on CUDA.*or an int >= 0"):
        plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(),
                        verify_candidates=bad, **KW)
    assert step.calls == 0  # refused before the step runs


def test_without_cuda_the_default_measures_nothing():
    step = Step()
    plan = plan_offloading(step, step.layers, 0.5, device=SimulatedDevice(), **KW)
    assert plan.verified == () and plan.measured_ms is None
    assert step.calls == PROFILE_CALLS
    assert "verified" not in plan.describe()


@pytest.mark.gpu
def test_on_cuda_the_default_verifies_the_shortlist_and_measures_peaks():
    """On a GPU: the model's 3 best candidates and the simple families it ranks close measured
    (CUDA events, max_memory_allocated), the returned one
    the fastest of those within the budget, nothing left applied, and the plan exact."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024)) for _ in range(6)).cuda()
    x0 = torch.randn(4096, 1024, device="cuda")
    calls = []

    def step():
        calls.append(1)
        h = x0
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()

    types = [type(m) for m in layers]
    plan = plan_offloading(step, layers, 0.5)
    assert 3 <= len(plan.verified) <= 6 and types == [type(m) for m in layers]
    fits = [t for t in plan.verified if t.rejected is None]
    assert all(t.measured_ms > 0 and t.peak_bytes > 0 for t in plan.verified)
    assert all(t.peak_bytes <= plan.memory_budget_bytes for t in fits)
    assert plan.measured_ms == min(t.measured_ms for t in fits)
    assert len(calls) == 1 + 2 + 6 * 3 + 1 + 3 + len(plan.verified) * 3 * 3  # the docstring's
    layers.zero_grad()
    step()
    want = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    with cpu_offload.apply_offloading(layers, plan=plan):
        step()
    assert all(torch.equal(a, p.grad) for a, p in zip(want, layers.parameters()))
