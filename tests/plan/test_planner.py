"""The planner's step model and search (pure), and layer profiling on the CPU."""
from dataclasses import replace

import pytest
import torch

from cpu_offload.core.errors import OffloadConfigError
from cpu_offload.core.units import format_bytes
from cpu_offload.examples.gpt import build_model, make_input, tiny_config
from cpu_offload.plan.model import LayerProfile, memory_segments, simulate
from cpu_offload.plan.profile import StepProfile, profile_layers
from cpu_offload.plan.search import plan

MIB = 1 << 20
# The reference workload (README "Performance") as measured on an H100: 512 MiB per layer,
# 2.84 / 6.5 ms per layer.
REFERENCE = [LayerProfile(512 * MIB, 32 * MIB, 2.84, 6.5)] * 8


def measured(profiles, gbps=55, **kw):
    """A step of these layer costs on a link of ``gbps`` GB/s each way, for ``plan``."""
    return StepProfile(profiles, d2h_gbps=gbps, h2d_gbps=gbps, **kw)


def test_without_offloading_time_is_compute_and_all_layers_peak_together():
    ms, peak = simulate(REFERENCE, 0)
    assert ms == pytest.approx(8 * (2.84 + 6.5))
    assert peak == 8 * 512 * MIB


@pytest.mark.parametrize("k", range(0, 8))
def test_peak_follows_the_n_minus_k_rule(k):
    _, peak = simulate(REFERENCE, k, (), 55, 55)
    assert peak == (8 - k) * 512 * MIB


def test_transfers_hide_until_the_link_is_the_bottleneck():
    base, _ = simulate(REFERENCE, 0)
    assert simulate(REFERENCE, 2, (), 55, 55)[0] == pytest.approx(base)  # 1 GiB hides
    slow, _ = simulate(REFERENCE, 6, (), 55, 55)
    # Forward waits for five layers' copies (~49 ms), backward for the reloads: > 1.6x.
    assert slow / base > 1.6
    assert simulate(REFERENCE, 6, (), 5000, 5000)[0] == pytest.approx(base)


def test_recompute_costs_a_forward_and_keeps_only_the_input():
    base, base_peak = simulate(REFERENCE, 0)
    ms, peak = simulate(REFERENCE, 0, (0, 1))
    assert ms == pytest.approx(base + 2 * 2.84)
    assert peak < base_peak


def test_a_measured_recompute_cost_replaces_the_forward_time():
    cheap = [replace(p, recompute_ms=1.0) for p in REFERENCE]
    base, _ = simulate(cheap, 0)
    assert simulate(cheap, 0, (0, 1))[0] == pytest.approx(base + 2 * 1.0)
    assert simulate(REFERENCE, 0, (0, 1))[0] == pytest.approx(base + 2 * 2.84)  # unmeasured


def test_a_checkpointed_offloaded_layer_holds_nothing_and_moves_its_input():
    _, kept = simulate(REFERENCE, 2, (2, 3), 55, 55)
    ms, away = simulate(REFERENCE, 4, (2, 3), 55, 55)
    assert away <= kept - 2 * 32 * MIB  # the two checkpoint inputs are off the device
    # Their 64 MiB of copies are short, but the default schedule still counts them among the
    # offloaded layers (at most n - k layers resident): cheaper than offloading 4 layers whole.
    assert ms < simulate(REFERENCE, 4, (), 55, 55)[0]


def test_plans_go_below_the_peak_of_checkpointing_every_layer():
    all_ckpt = simulate(REFERENCE, 0, tuple(range(8)), 55, 55)
    chosen = plan(measured(REFERENCE), int(0.9 * all_ckpt[1]))
    assert chosen.peak_bytes <= 0.9 * all_ckpt[1]
    assert set(chosen.recompute) & set(range(chosen.num_layers))  # checkpointed and offloaded
    assert chosen.step_ms <= all_ckpt[0] * 1.01


def test_plan_meets_a_tight_budget_by_mixing_offload_and_recompute():
    base_peak = simulate(REFERENCE, 0)[1]
    chosen = plan(measured(REFERENCE), int(0.64 * base_peak))
    assert chosen.peak_bytes <= 0.64 * base_peak
    assert chosen.num_layers >= 1 and chosen.recompute  # both tools used
    assert chosen.time_ratio < simulate(REFERENCE, 6, (), 55, 55)[0] / chosen.baseline_ms
    assert "get_cpu_offload_context(num_layers=" in chosen.describe()


def test_plan_prefers_offloading_on_a_fast_link_and_recompute_on_a_slow_one():
    base_peak = simulate(REFERENCE, 0)[1]
    fast = plan(measured(REFERENCE, 5000), int(0.3 * base_peak))
    assert fast.recompute == () and fast.num_layers >= 6
    slow = plan(measured(REFERENCE, 1), int(0.3 * base_peak))
    assert slow.num_layers <= 1 and len(slow.recompute) >= 5


def test_impossible_budget_and_bad_arguments_are_refused():
    with pytest.raises(OffloadConfigError, match="no plan fits"):
        plan(measured(REFERENCE), 1)
    with pytest.raises(OffloadConfigError, match="num_layers must be in"):
        simulate(REFERENCE, 8)
    with pytest.raises(OffloadConfigError, match="recomputed layers in"):
        simulate(REFERENCE, 2, (8,))


def test_profile_layers_measures_bytes_and_times_without_touching_grads():
    cfg = tiny_config()
    model = build_model(cfg)
    x = make_input(cfg, requires_grad=False)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    profiles = profile_layers(list(model.layers), x, min_tensor_size_to_offload=0, repeats=1)
    assert len(profiles) == cfg.layers
    assert all(p.activation_bytes > p.input_bytes == x.nbytes for p in profiles)
    assert all(p.fwd_ms > 0 and p.bwd_ms > 0 for p in profiles)
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in model.parameters())


def test_transient_workspace_is_added_to_every_peak():
    with_ws = [LayerProfile(512 * MIB, 32 * MIB, 2.84, 6.5, transient_bytes=300 * MIB)] * 8
    assert simulate(with_ws, 2)[1] == simulate(REFERENCE, 2)[1] + 300 * MIB


def test_measured_baseline_peak_calibrates_every_plan():
    base_peak = simulate(REFERENCE, 0)[1]
    calibrated = plan(measured(REFERENCE, peak_bytes=base_peak + 400 * MIB), None)
    assert calibrated.baseline_peak_bytes == base_peak + 400 * MIB
    assert calibrated.peak_bytes == simulate(REFERENCE, calibrated.num_layers)[1] + 400 * MIB


# A link-bound stack (as HF Llama on an H100): the link moves about 3.6 layers' bytes during the
# 16-layer forward, so 3 whole layers leave it idle and 4 make the forward wait.
LINK_BOUND = [LayerProfile(370 * MIB, 16 * MIB, 1.6, 3.4)] * 16


def test_a_partial_last_layer_moves_and_frees_its_share_only():
    base, base_peak = simulate(LINK_BOUND, 0)
    _, whole3 = simulate(LINK_BOUND, 3, (), 55, 55)
    _, whole4 = simulate(LINK_BOUND, 4, (), 55, 55)
    ms, half4 = simulate(LINK_BOUND, 4, (), 55, 55, partial_fraction=0.5)
    assert half4 == whole3 - 185 * MIB and whole4 == whole3 - 370 * MIB
    assert simulate(LINK_BOUND, 4, (), 55, 55)[0] > ms > base  # half a layer less to wait for
    with pytest.raises(OffloadConfigError, match="partial_fraction"):
        simulate(LINK_BOUND, 4, (), 55, 55, partial_fraction=0.0)


def test_partial_plans_use_the_link_up_to_its_capacity():
    base_peak = simulate(LINK_BOUND, 0)[1]
    budget = int(0.81 * base_peak)  # 0.80 after the planner's 1% margin
    whole = plan(measured(LINK_BOUND), budget, partial=False)
    part = plan(measured(LINK_BOUND), budget)
    assert whole.partial_bytes is None and whole.recompute  # whole layers: recompute one
    assert part.peak_bytes <= budget - 0.01 * base_peak and part.step_ms < whole.step_ms
    assert part.time_ratio == pytest.approx(1.0)  # every copy hidden, nothing recomputed
    assert part.partial_bytes == int(370 * MIB * part.partial_fraction) < 370 * MIB
    assert f"of layer {part.num_layers - 1} only its first" in part.describe()


def timeline_of(profiles, loss_bytes):
    """Segment peaks of a step whose layers hold their activations from forward to backward and
    whose loss segment adds ``loss_bytes`` on top of all of them (logits and their gradient)."""
    n = len(profiles)
    act = [p.activation_bytes for p in profiles]
    fwd = [sum(act[: j + 1]) for j in range(n)]
    bwd = [sum(act[: j + 1]) for j in range(n - 1, -1, -1)]
    return [0] + fwd + [sum(act) + loss_bytes] + bwd


def test_the_memory_timeline_charges_a_plan_where_the_step_peaks():
    assert memory_segments(2) == [
        "before the layers", "forward 0", "forward 1", "loss", "backward 1", "backward 0",
    ]
    loss = 3 * 512 * MIB
    timeline = timeline_of(REFERENCE, loss)
    assert simulate(REFERENCE, 0, memory_timeline=timeline)[1] == 8 * 512 * MIB + loss
    for k in range(1, 7):  # released before the loss, reloaded after it: all k layers count
        _, peak = simulate(REFERENCE, k, (), 55, 55, memory_timeline=timeline)
        assert peak == (8 - k) * 512 * MIB + loss
    # A checkpointed layer keeps only its input during the loss, the last layer included (its
    # activations come back only when its backward recomputes them).
    kept = (512 - 32) * MIB
    for layer in (0, 7):
        _, peak = simulate(REFERENCE, 0, (layer,), memory_timeline=timeline)
        assert peak == 8 * 512 * MIB + loss - kept
    _, everything = simulate(REFERENCE, 0, tuple(range(8)), memory_timeline=timeline)
    assert everything == 8 * 512 * MIB + loss - 8 * kept
    with pytest.raises(OffloadConfigError, match="memory_timeline has 3 segments; 8 layers need 18"):
        simulate(REFERENCE, 0, memory_timeline=[1, 2, 3])


def test_the_timeline_peak_equals_a_segment_by_segment_sum_for_every_layout():
    """The peak search runs once per candidate plan; its difference-array form must equal the
    plain definition: per segment, the measured peak minus every window covering it."""
    import random

    from cpu_offload.plan import model, search
    from cpu_offload.v2.schedule import Schedule, plan_synchronization_dict

    rng = random.Random(0)
    n = 6
    profiles = [LayerProfile(rng.randint(100, 900) * MIB, rng.randint(1, 90) * MIB, 1.0, 2.0,
                             selective_bytes=rng.randint(0, 90) * MIB) for _ in range(n)]
    timeline = [rng.randint(1000, 5000) * MIB for _ in range(2 * n + 2)]
    checked = 0
    for k, frac, rec, sel in search._layouts(profiles, True, True):
        stored = [p.input_bytes if j in rec else p.activation_bytes -
                  (p.selective_bytes if j in sel else 0) for j, p in enumerate(profiles)]
        moved = list(stored)
        if k:
            moved[k - 1] = int(moved[k - 1] * frac)
        schedule = Schedule(n, plan_synchronization_dict(k, n))
        windows = [(*(model._segment_at(pos, n) for pos in schedule.window(j)), moved[j])
                   for j in schedule.sync if not schedule.released_at_forward_end(j)]
        if k == n:  # the last layer's input is away in the loss segment (n + 1) only
            windows.append((n + 1, n + 2, moved[n - 1]))
        windows += [(j + 2, 2 * n + 1 - j, profiles[j].activation_bytes - profiles[j].input_bytes)
                    for j in rec]
        windows += [(j + 2, 2 * n + 1 - j, profiles[j].selective_bytes) for j in sel]
        expected = max(seg - sum(b for a, z, b in windows if a <= i < z)
                       for i, seg in enumerate(timeline))
        got = model._peak_from_timeline(
            timeline, profiles, tuple(range(k)), set(rec), moved, set(sel))
        assert got == expected, (k, frac, rec, sel)
        checked += 1
    assert checked > 500  # every layout of 6 layers


def test_many_layers_are_searched_coarsely_then_refined_near_the_best(monkeypatch):
    """Above COARSE_LAYERS layers the search steps through layer counts, then tries every
    layout within one stride of the best: a small share of the candidates, and a plan within
    2% of the exhaustive search's (predicted) time, within the same budget."""
    import random

    from cpu_offload.plan import search as planner

    rng = random.Random(1)
    n = 26
    profiles = [LayerProfile(rng.randint(400, 900) * MIB, 33 * MIB, rng.uniform(2, 4),
                             rng.uniform(5, 8), 100 * MIB, rng.randint(50, 300) * MIB,
                             rng.uniform(0, 0.5), rng.uniform(0, 0.5)) for _ in range(n)]
    timeline = [2000 * MIB + 700 * MIB * min(i, 2 * n + 1 - i) for i in range(2 * n + 2)]
    budget = int(0.5 * max(timeline))
    calls = {"n": 0}
    real = planner.simulate

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "simulate", counting)
    coarse = plan(measured(profiles, memory_timeline=timeline), budget)
    coarse_calls, calls["n"] = calls["n"], 0
    monkeypatch.setattr(planner, "COARSE_LAYERS", n)  # every layout
    full = plan(measured(profiles, memory_timeline=timeline), budget)
    assert coarse_calls * 4 < calls["n"]
    assert coarse.peak_bytes <= budget and full.peak_bytes <= budget
    assert full.step_ms <= coarse.step_ms <= full.step_ms * 1.02


def test_a_step_that_peaks_before_the_layers_cannot_be_planned_below_it():
    timeline = timeline_of(REFERENCE, 0)
    timeline[0] = 10 * 512 * MIB  # e.g. an embedding workspace larger than every activation
    base = plan(measured(REFERENCE, memory_timeline=timeline), None)
    assert base.baseline_peak_bytes == 10 * 512 * MIB
    with pytest.raises(OffloadConfigError, match="no plan fits"):
        plan(measured(REFERENCE, memory_timeline=timeline), 9 * 512 * MIB)


def test_plans_keep_a_margin_under_the_budget():
    base_peak = simulate(REFERENCE, 0)[1]
    exactly_k2 = simulate(REFERENCE, 2, (), 55, 55)[1]  # 6 of 8 layers: 0.75 of the peak
    chosen = plan(measured(REFERENCE), exactly_k2)
    assert chosen.peak_bytes <= exactly_k2 - 0.01 * base_peak  # k=2 itself would be too tight
    with pytest.raises(OffloadConfigError, match=r"keep peak_margin=1.0% of the peak without") as err:
        plan(measured(REFERENCE), simulate(REFERENCE, 7, (), 1e9, 1e9)[1])
    lowest = err.value.lowest_peak_bytes  # the budget that fits a plan, with no margin
    assert plan(measured(REFERENCE), lowest, peak_margin=0.0).peak_bytes == lowest
    with pytest.raises(OffloadConfigError, match="no plan fits"):
        plan(measured(REFERENCE), lowest - 1, peak_margin=0.0)
    # peak_margin=0 trusts the prediction: k=2 exactly at the budget is a candidate again.
    exact = plan(measured(REFERENCE), exactly_k2, peak_margin=0.0)
    assert exact.peak_bytes <= exactly_k2 and exact.peak_bytes > chosen.peak_bytes
    with pytest.raises(OffloadConfigError, match=r"peak_margin is a fraction .* in \[0, 1\)"):
        plan(measured(REFERENCE), exactly_k2, peak_margin=1.5)


def test_every_layer_checkpointed_and_offloaded_moves_the_last_input_at_the_forward_end():
    """Checkpointing every layer and offloading every input, the last one included, holds no
    layer input during the loss: the peak of a loss-peaked step falls by that input, and the
    time pays for the last input's copies (out before the loss, back before its backward)."""
    n, layer_in = 8, 32 * MIB
    profiles = [LayerProfile(512 * MIB, layer_in, 2.84, 6.5)] * n
    timeline = [0] + [512 * MIB * (j + 1) for j in range(n)] + [512 * MIB * n + 2048 * MIB] + [
        512 * MIB * (n - c) for c in range(n)]
    everything = tuple(range(n))
    ms_all, peak_all = simulate(profiles, n, everything, 55, 55, memory_timeline=timeline)
    ms_prev, peak_prev = simulate(profiles, n - 1, everything, 55, 55, memory_timeline=timeline)
    assert peak_prev - peak_all == layer_in
    link_ms = layer_in / 55e6
    assert ms_prev < ms_all <= ms_prev + 2 * link_ms + 1e-9
    with pytest.raises(OffloadConfigError, match=r"or 8 with layer 7 recomputed"):
        simulate(profiles, n, everything[:-1], 55, 55)
    chosen = plan(measured(profiles, memory_timeline=timeline), peak_all, peak_margin=0.0)
    assert (chosen.num_layers, chosen.recompute, chosen.peak_bytes) == (n, everything, peak_all)
    assert "offload all 8 layers (the last one's input when the forward pass ends" in chosen.describe()


# Selective recomputation: per GPT block, both LayerNorm outputs and the GELU output (6 of 16
# units of batch*seq*hidden) are recomputed in backward instead of stored.
SELECTIVE = [LayerProfile(512 * MIB, 32 * MIB, 2.84, 6.5, selective_bytes=192 * MIB,
                          selective_ms=0.3)] * 8


def test_selective_layers_store_less_and_pay_their_recompute_in_backward():
    base, base_peak = simulate(SELECTIVE, 0)
    ms, peak = simulate(SELECTIVE, 0, (), selective=range(8))
    assert ms == pytest.approx(base + 8 * 0.3)
    # a layer holds all of its bytes at its own forward start (the model's conservative point)
    assert peak == 7 * 320 * MIB + 512 * MIB and base_peak == 8 * 512 * MIB
    loss = 3 * 512 * MIB
    _, timed = simulate(SELECTIVE, 0, (), memory_timeline=timeline_of(SELECTIVE, loss),
                        selective=(0, 5))
    assert timed == 8 * 512 * MIB + loss - 2 * 192 * MIB
    with pytest.raises(OffloadConfigError, match="selective layers must be in"):
        simulate(SELECTIVE, 0, (1,), selective=(1,))


def test_selective_forward_cost_is_charged_and_can_rule_it_out():
    """Recording a selective layer's ops costs host time in forward (a host-bound layer, such as
    a Hugging Face decoder layer with its many small ops, slows down); the planner charges it,
    and where it exceeds a whole-layer recompute, checkpointing wins."""
    ms, _ = simulate(SELECTIVE, 0, (), selective=range(8))
    host_bound = [replace(p, selective_fwd_ms=4.0) for p in SELECTIVE]
    slow, _ = simulate(host_bound, 0, (), selective=range(8))
    assert slow == pytest.approx(ms + 8 * 4.0)
    budget = int(0.72 * simulate(SELECTIVE, 0)[1])
    assert plan(measured(SELECTIVE), budget).selective
    chosen = plan(measured(host_bound), budget)
    assert not chosen.selective and chosen.recompute


def test_offloaded_selective_layers_move_only_what_they_store():
    # a link that moves one stored block during the whole forward
    slow = 512 * MIB / (8 * 2.84) / 1e6 * 1.05  # GB/s
    whole, _ = simulate(SELECTIVE, 2, (), slow, slow)
    part, _ = simulate(SELECTIVE, 2, (), slow, slow, selective=(0, 1))
    assert part < whole
    _, peak = simulate(SELECTIVE, 2, (), 1e6, 1e6, selective=(0, 1))
    _, plain = simulate(SELECTIVE, 2, (), 1e6, 1e6)
    assert peak == plain  # offloaded layers are away at the peak either way


def test_plan_prefers_selective_over_checkpointing_when_it_is_cheaper():
    base_peak = simulate(SELECTIVE, 0)[1]
    budget = int(0.72 * base_peak)
    without = plan(measured(REFERENCE), budget)
    chosen = plan(measured(SELECTIVE), budget)
    assert chosen.selective and chosen.step_ms < without.step_ms
    assert chosen.peak_bytes <= budget - 0.01 * base_peak
    ms, peak = simulate(SELECTIVE, chosen.num_layers, chosen.recompute, 55, 55,
                        chosen.partial_fraction, None, chosen.selective)
    assert (chosen.step_ms, chosen.peak_bytes) == (pytest.approx(ms), peak)
    assert "selective layers: " in chosen.describe()
    # without selective_bytes the search is the one before: no selective plans at all
    assert all(not c.selective for c in without.alternatives)


def test_describe_scales_its_units_with_the_size():
    """A model of a few MiB is described in KiB and MiB, not as "0.00 GiB"."""
    small = [LayerProfile(600 * 1024, 40 * 1024, 1.0, 2.0)] * 4
    chosen = plan(measured(small), 0.7)
    text = chosen.describe()
    assert f"peak activations {format_bytes(chosen.peak_bytes)} (" in text
    assert "MiB" in text and "GiB" not in text
