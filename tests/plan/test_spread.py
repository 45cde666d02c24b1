"""Spread offloading: the planner's host model, and plans that offload layers 1, 3, 5 instead of
0, 1, 2 where offloading the first layers would make the GPU wait for the host."""
from __future__ import annotations

import pytest
import torch

from cpu_offload import OffloadConfigError, apply_offloading
from cpu_offload.plan import profile as sp
from cpu_offload.plan import search as planner
from cpu_offload.plan.model import (
    HostCost,
    LayerProfile,
    host_stall_ms,
    simulate,
    spread_layers,
)
from cpu_offload.plan.profile import StepProfile
from cpu_offload.plan.search import Plan
from cpu_offload.v2.schedule import (
    Schedule,
    default_synchronization_dict,
    spread_synchronization_dict,
)

from _support.kwarg_layers import assert_equal, make_layers, step

GB = 10**9


def hf_like(n: int = 8, host: float = 1.2, first_host: float = 2.3) -> list:
    """Layers shaped like a Hugging Face decoder layer at batch 2 on an H100: 2.66 ms on the
    GPU, issued by the host in 1.2 ms (the first one, which also waits for the embedding,
    3.3 ms and 2.3 ms); 0.77 GB saved each."""
    p = [LayerProfile(77 * GB // 100, 32 << 20, fwd_ms=2.66, bwd_ms=5.6, host_fwd_ms=host)
         for _ in range(n)]
    p[0] = LayerProfile(77 * GB // 100, 32 << 20, fwd_ms=3.3, bwd_ms=5.6, host_fwd_ms=first_host)
    return p


@pytest.fixture
def x0():
    torch.manual_seed(1)
    return torch.randn(4, 8, 32)


def test_the_host_lead_decides_where_offloading_stalls_the_gpu():
    """2.2 ms more host time per offloaded layer (as measured on the H100): the first layers
    (no lead yet) stall the GPU; every other layer from layer 1 on does not, since the plain
    layer between lets the host get ahead again."""
    p = hf_like()
    moved = lambda layers: [p[j].activation_bytes if j in layers else 0 for j in range(8)]  # noqa
    per_gb = HostCost(ms_per_gb=2.2 / 0.77)
    prefix = host_stall_ms(p, (0, 1, 2), moved((0, 1, 2)), per_gb)
    # layer 0: 2.3 + 2.2 - 3.3; layers 1 and 2: 1.2 + 2.2 - 2.66 each
    assert prefix == pytest.approx(1.2 + 0.74 + 0.74)
    assert host_stall_ms(p, (1, 3, 5), moved((1, 3, 5)), per_gb) == 0.0
    assert host_stall_ms(p, (), moved(()), per_gb) == 0.0
    # simulate charges exactly that stall (a link fast enough to hide every copy)
    base = simulate(p, 0, (), 1e4, 1e4, host_cost=per_gb)[0]
    first = simulate(p, 3, (), 1e4, 1e4, host_cost=per_gb)[0]
    spread = simulate(p, 3, (), 1e4, 1e4, offloaded=(1, 3, 5), host_cost=per_gb)[0]
    assert first - base == pytest.approx(prefix, abs=1e-4)
    assert spread == pytest.approx(base, abs=1e-4)
    # without host times (profile_layers, the simulated device) the model is the link's alone
    no_host = [LayerProfile(p0.activation_bytes, p0.input_bytes, p0.fwd_ms, p0.bwd_ms) for p0 in p]
    assert simulate(no_host, 3, (), 1e4, 1e4, host_cost=per_gb)[0] == simulate(
        no_host, 0, (), 1e4, 1e4)[0]
    # Layers after the first offloaded one issue slower while copies run (0.5 ms each here):
    # layers 3 and 4 back to back then stall the GPU, every other layer still does not.
    slow = HostCost(ms_per_gb=2.2 / 0.77, slowdown_ms=0.5)
    assert host_stall_ms(p, (1, 3, 4), moved((1, 3, 4)), per_gb) == 0.0
    assert host_stall_ms(p, (1, 3, 4), moved((1, 3, 4)), slow) == pytest.approx(0.26)
    assert host_stall_ms(p, (1, 3, 5), moved((1, 3, 5)), slow) == 0.0


def test_spread_layers_skips_a_layer_only_where_the_host_gains_during_it():
    p = hf_like()
    nbytes = [x.activation_bytes for x in p]
    # Layer 0 would stall; after it the host leads by 1 ms, enough for layer 1 (2.2 ms more
    # host time, 1.46 ms less than the GPU's); layer 2 would stall again; then 3 and 4 fit.
    cost = HostCost(ms_per_gb=2.2 / 0.77)
    assert spread_layers(p, 3, nbytes, cost) == (1, 3, 4)
    assert host_stall_ms(p, (1, 3, 4), [b if j in (1, 3, 4) else 0 for j, b in enumerate(nbytes)],
                         cost) == 0.0
    # The plain layers' slowdown while copies run leaves less lead: a gap after every one.
    assert spread_layers(p, 3, nbytes, HostCost(2.2 / 0.77, slowdown_ms=0.4)) == (1, 3, 5)
    assert spread_layers(p, 3, nbytes, HostCost()) == (0, 1, 2)  # free: the first layers
    # A host-bound model (the host is slower than the GPU everywhere): waiting never helps.
    bound = hf_like(host=3.0, first_host=4.0)
    assert spread_layers(bound, 3, nbytes, cost) == (0, 1, 2)
    # Cheap enough to be covered from the start: no gaps.
    assert spread_layers(p, 3, nbytes, HostCost(ms_per_gb=0.5)) == (0, 1, 2)
    # Not enough layers to spread k over: the last ones are taken where the schedule needs them
    # (the j-th offloaded layer must be released, before layer n-k+j, after its own forward).
    for k in range(1, 8):
        layers = spread_layers(p, k, nbytes, HostCost(ms_per_gb=10.0))
        assert len(layers) == k
        spread_synchronization_dict(layers, 8)  # a valid schedule


def test_spread_schedule_is_the_default_timing_for_other_layers():
    assert spread_synchronization_dict([0, 1, 2], 8) == default_synchronization_dict(3, 8)
    sync = spread_synchronization_dict([1, 3, 5], 8)
    assert sync == {1: (True, 6, False, 4), 3: (True, 7, False, 3), 5: (True, 8, False, 2)}
    schedule = Schedule(8, sync)
    assert [schedule.is_offloaded(j) for j in range(8)] == [j in (1, 3, 5) for j in range(8)]
    with pytest.raises(OffloadConfigError, match="increasing order"):
        spread_synchronization_dict([3, 1], 8)
    with pytest.raises(OffloadConfigError, match="before its own forward ends"):
        spread_synchronization_dict([1, 7], 8)  # layer 7 would be released before it ran


def test_the_planner_spreads_offloaded_layers_where_the_host_has_no_lead():
    p = hf_like(n=16)
    per_gb = HostCost(ms_per_gb=2.2 / 0.77)
    budget = int(0.8 * 16 * 0.77 * GB)
    prof = StepProfile(p, d2h_gbps=55.0, h2d_gbps=55.0, offload_host_cost=per_gb)
    spread = planner.plan(prof, budget)
    assert spread.offloaded and spread.offloaded != tuple(range(spread.num_layers))
    assert len(spread.offloaded) == spread.num_layers
    assert "offload layers " + ", ".join(map(str, spread.offloaded)) in spread.describe()
    assert spread.peak_bytes <= budget
    first = planner.plan(prof, budget, spread=False)
    assert first.offloaded == () and first.step_ms > spread.step_ms
    # The prediction is simulate's, layer for layer.
    ms, peak = simulate(p, spread.num_layers, spread.recompute, 55.0, 55.0,
                        spread.partial_fraction, None, spread.selective, 0.0, spread.offloaded,
                        per_gb)
    assert (ms, peak) == (pytest.approx(spread.step_ms), spread.peak_bytes)
    # No host cost measured: the planner never spreads.
    free = StepProfile(p, d2h_gbps=55.0, h2d_gbps=55.0, offload_host_cost=HostCost())
    assert planner.plan(free, budget).offloaded == ()


def test_a_spread_plan_is_applied_exactly(x0, sim):
    """Offloading layers 1 and 3 of 6: exact gradients, exactly those layers copy and free
    their activations, the last of them only up to its byte limit."""
    layers = make_layers(n=6)
    ref = step(layers, x0)
    plan = Plan(2, (), offloaded=(1, 3), partial_fraction=0.5, partial_bytes=x0.nbytes,
                model_layers=6)
    handle = apply_offloading(layers, plan=plan, device=sim, min_tensor_size_to_offload=64)
    assert handle.offloaded == (1, 3) and "offload layers [1, 3] of 6" in repr(handle)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    stats = handle.stats().to_dict()["layers"]
    assert sorted(i for i, s in stats.items() if s["copied_out_bytes"]) == [1, 3]
    assert stats[3]["copied_out_bytes"] <= x0.nbytes < stats[1]["copied_out_bytes"]
    assert stats[1]["freed_bytes"] > 0
    handle.remove()
    assert_equal(step(layers, x0), ref)


def test_a_spread_plan_names_the_fix_where_it_cannot_apply(x0, sim, monkeypatch):
    layers = make_layers(n=6)
    plan = Plan(2, (), offloaded=(1, 3), model_layers=6)
    with pytest.raises(OffloadConfigError, match=r"offloads layers \[1, 3\].*spread=False"):
        apply_offloading(layers, plan=plan, device=sim,
                         synchronization_dict=default_synchronization_dict(2, 6))
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError, match="unset NVTE_CPU_OFFLOAD_V1"):
        apply_offloading(layers, plan=plan, device=sim)
    assert all(type(m).__name__ == "KwargLayer" for m in layers)  # nothing left installed


def test_the_probe_measures_host_time_and_charges_only_what_the_stall_leaves(monkeypatch):
    """The probe's offloaded layers issue 2 ms more per layer on the host: that is the host
    model's cost per GB; the step time beyond the model (stall included) is the charge."""
    p = hf_like(n=4)
    plain = iter([100.0, 101.0, 99.5, 100.5, 102.0, 99.8])

    def fake_run(self, kind, driver=None, recompute=()):
        host = [x.host_fwd_ms for x in p]
        if kind == "plain":
            ms = next(plain)
        else:
            ms = 110.0
            host = [h + (2.0 if j < driver else 0.3) for j, h in enumerate(host)]
        self.runs.setdefault(kind, []).append(([0.0] * self.n, [0.0] * self.n, ms, host))

    monkeypatch.setattr(sp._Timing, "run", fake_run)
    monkeypatch.setattr(sp, "_Wrapped", lambda *a, num_layers, **k: num_layers)
    notes: list = []
    per_gb, host = sp._offload_overhead(lambda: None, [None] * 4, None, None, p, 1e4, 1e4,
                                        1, 3, notes)
    k = int(notes[0].split()[1])
    moved_gb = k * p[0].activation_bytes / GB
    assert host.ms_per_gb == pytest.approx(2.0 * k / moved_gb)
    assert host.slowdown_ms == pytest.approx(0.3)
    base = simulate(p, 0, (), 1e4, 1e4)[0]
    stall = simulate(p, k, (), 1e4, 1e4, host_cost=host)[0] - base
    assert stall > 0
    assert per_gb == pytest.approx((110.0 - 99.8 - stall) / moved_gb)


def test_a_plan_with_a_whole_layer_among_checkpointed_offloaded_ones_is_exact(x0, sim):
    """Any layer of a checkpointed, offloaded run may be offloaded whole instead (not only the
    first ones): exact, and it alone copies more than its input."""
    layers = make_layers(n=6)
    ref = step(layers, x0)
    plan = Plan(6, (0, 2, 3, 4, 5), model_layers=6)  # all offloaded, layer 1 whole
    handle = apply_offloading(layers, plan=plan, device=sim, min_tensor_size_to_offload=64)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    out = {i: s["copied_out_bytes"] for i, s in handle.stats().to_dict()["layers"].items()}
    assert out[1] > x0.nbytes  # a whole layer: its input and what its ops saved
    assert all(out[i] == x0.nbytes for i in (0, 2, 3, 4, 5))  # checkpointed: the input only
    handle.remove()


def test_checkpointed_layers_may_fill_the_gaps_between_spread_offloaded_ones():
    """Offloading one layer whole and checkpointing all the others: the spread layout puts the
    offloaded layer where the host leads (layer 1) and checkpoints the rest, layer 0 included.
    Where the step peaks in the loss (a language model's timeline) that holds no more than
    checkpointing every layer, and spares one recomputation."""
    p = hf_like(n=16)
    act, loss = p[1].activation_bytes, 3 * GB
    timeline = ([0] + [(j + 1) * act for j in range(16)] + [16 * act + loss]
                + [(j + 1) * act for j in reversed(range(16))])
    cost = HostCost(ms_per_gb=2.2 / 0.77)
    every = tuple(range(16))
    layouts = planner._spread_layouts(p, 1, 1.0, every[1:], (), cost)
    assert layouts == [((1,), (0,) + every[2:], ())]  # the roles only fit in between
    offl, rec, _ = layouts[0]
    kw = dict(memory_timeline=timeline, host_cost=cost)
    ckpt_ms, ckpt_peak = simulate(p, 0, every, 55.0, 55.0, **kw)
    ms, peak = simulate(p, 1, rec, 55.0, 55.0, offloaded=offl, **kw)
    first_ms, _ = simulate(p, 1, every[1:], 55.0, 55.0, **kw)  # layer 0 offloaded: stalls
    assert peak <= ckpt_peak and ms < first_ms < ckpt_ms


def test_the_simulated_device_has_no_host_model(x0, sim):
    """On the simulated device the host runs the "device" work itself: the profile records no
    host times and no host cost, so plans offload the first layers, as before."""
    layers = make_layers(n=4)
    prof = sp.profile_step(lambda: step(layers, x0), layers, device=sim,
                           min_tensor_size_to_offload=64, link_gbps=1e4, repeats=1)
    assert all(p.host_fwd_ms is None for p in prof.layers)
    assert prof.offload_host_cost.is_free
    assert planner.plan(prof, 0.6).offloaded == ()


def test_host_time_is_charged_per_offloaded_tensor():
    """The probe's host time per tensor it moved: a whole offloaded layer of 20 tensors pays
    20 of them, one offloaded in part its share, a checkpointed one (its input) one."""
    p = [LayerProfile(GB, GB // 64, fwd_ms=2.0, bwd_ms=4.0, host_fwd_ms=2.0, saved_tensors=20)
         for _ in range(4)]
    cost = HostCost.from_probe([2.0, 2.0, 0.0, 0.0], k=2, moved_bytes=2 * GB, moved_tensors=40)
    assert (cost.ms_per_tensor, cost.ms_per_gb, cost.slowdown_ms) == (0.1, 0.0, 0.0)
    fast = 1e6  # GB/s: no link time, only the host's

    def added(k, rec=(), frac=1.0):
        return (simulate(p, k, rec, fast, fast, frac, host_cost=cost)[0]
                - simulate(p, 0, rec, fast, fast)[0])

    assert added(1) == pytest.approx(2.0)  # no host lead: the GPU waits for every tensor
    assert added(1, frac=0.5) == pytest.approx(1.0)
    assert added(1, rec=(0,)) == pytest.approx(0.1)
    assert host_stall_ms(p, [0], [GB, 0, 0, 0], cost) == pytest.approx(2.0)


def test_the_profile_counts_the_saved_tensors_v2_offloads(x0, sim):
    layers = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh()) for _ in range(3))

    def run():
        h = x0.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        h.sum().backward()

    prof = sp.profile_step(run, layers, device=sim, min_tensor_size_to_offload=1,
                           link_gbps=1e4, repeats=1, selective=False)
    # Layer 0: the step's input and its Tanh output; then each Tanh output (the Linear saves
    # its input, the previous layer's output, counted there; weights are not offloaded).
    assert [q.saved_tensors for q in prof.layers] == [2, 1, 1]
