"""``apply_offloading`` / ``plan_offloading`` / the audit's real-step mode on plain-torch layers
(simulated device): any signature and output type, exact gradients, undo, misuse, planning."""
from __future__ import annotations

import copy
import dataclasses
import pickle
import time

import weakref

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload.compat import top_saved_tensors_hooks
from cpu_offload import (
    OffloadConfigError,
    OffloadUsageError,
    apply_offloading,
    audit_offload_selection,
    offloading_handle,
    plan_offloading,
)
from cpu_offload.examples.gpt import build_model, make_input, tiny_config
from cpu_offload.tools.layers import hidden_state
from cpu_offload.plan.model import LayerProfile
from cpu_offload.plan.profile import profile_step
from cpu_offload.plan import search
from cpu_offload.plan.search import Plan
from cpu_offload.v2.selection import SelectionPolicy

from _support.kwarg_layers import KwargLayer, assert_equal, make_layers, step


def copies(sim) -> int:
    return sum(1 for e in sim.log if e[0] == "copy")


@pytest.fixture
def x0():
    torch.manual_seed(1)
    return torch.randn(4, 8, 32)


@pytest.mark.parametrize("out", ["tensor", "tuple", "list", "namedtuple", "dict", "tuple_first_none"])
def test_any_output_container_gives_bit_identical_gradients(out, x0, sim):
    layers = make_layers(out)
    ref = step(layers, x0)
    handle = apply_offloading(layers, num_layers=2, min_tensor_size_to_offload=64, device=sim)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    summary = handle.synchronizer.layer_summary()
    assert [s["offloaded"] for s in summary] == [True, True, False, False]
    assert all(s["bytes"] > 0 for s in summary[:2]) and copies(sim) > 0
    assert [m[0] for m in sim.milestones({"release"})] == ["release", "release"] * 2


def test_output_without_tensor_is_a_clear_error(sim):
    with pytest.raises(TypeError, match="holds no tensor"):
        hidden_state((None, 3))
    layer = nn.Module()
    layer.forward = lambda x: {"n": 1}
    handle = apply_offloading([layer, nn.Identity(), nn.Identity()], num_layers=1, device=sim)
    with pytest.raises(TypeError, match="hidden state"):
        layer(torch.ones(2, requires_grad=True))
    handle.remove()


def test_names_state_dict_and_remove_restore_exactly(x0, sim):
    layers = make_layers()
    names = [n for n, _ in layers.named_parameters()]
    keys = list(layers.state_dict())
    before = [(type(m), dict(m.__dict__)) for m in layers]
    ref = step(layers, x0)
    handle = apply_offloading(layers, num_layers=2, device=sim, min_tensor_size_to_offload=64)
    assert [n for n, _ in layers.named_parameters()] == names
    assert list(layers.state_dict()) == keys
    assert offloading_handle(layers[0]) is handle and "first 2 of 4" in repr(handle)
    step(layers, x0)
    handle.remove()
    handle.remove()  # idempotent
    assert handle.removed and offloading_handle(layers[0]) is None
    assert [(type(m), dict(m.__dict__)) for m in layers] == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in layers)
    n_copies = copies(sim)
    assert_equal(step(layers, x0), ref)
    assert copies(sim) == n_copies  # nothing offloaded any more
    assert top_saved_tensors_hooks() is None


def test_applying_twice_is_refused_with_the_fix(sim):
    layers = make_layers()
    handle = apply_offloading(layers, num_layers=1, device=sim)
    with pytest.raises(OffloadUsageError, match=r"already has offloading.*\.remove\(\)"):
        apply_offloading(layers[2:], num_layers=1, device=sim)
    handle.remove()
    apply_offloading(layers, num_layers=1, device=sim).remove()


def test_argument_errors_name_the_fix(sim):
    layers = make_layers()
    with pytest.raises(OffloadConfigError, match="num_layers=k .* or plan="):
        apply_offloading(layers, device=sim)
    with pytest.raises(OffloadConfigError, match="model_layers"):
        apply_offloading(layers, num_layers=1, model_layers=4, device=sim)
    with pytest.raises(OffloadConfigError, match="same module"):
        apply_offloading([layers[0], layers[0]], num_layers=1, device=sim)
    with pytest.raises(TypeError, match="one KwargLayer"):
        apply_offloading(layers[0], num_layers=1, device=sim)
    with pytest.raises(OffloadConfigError, match="must be smaller than model_layers"):
        apply_offloading(layers, num_layers=4, device=sim)
    assert all(type(m) is KwargLayer for m in layers)  # nothing installed by a failed call


def test_no_grad_and_eval_forwards_are_not_offloaded(x0, sim):
    layers = make_layers()
    handle = apply_offloading(layers, num_layers=2, device=sim, min_tensor_size_to_offload=64)
    with torch.no_grad():
        step_out = [layer(x0, scale=1.0) for layer in layers]
    with torch.inference_mode():
        layers[0](x0, scale=1.0)
    assert copies(sim) == 0 and step_out
    ref_free = make_layers()
    assert_equal(step(layers, x0), step(ref_free, x0))
    handle.remove()


def test_exception_in_a_layer_or_between_layers_leaves_the_next_step_exact(x0, sim):
    layers = make_layers()
    ref = step(layers, x0)
    handle = apply_offloading(layers, num_layers=2, device=sim, min_tensor_size_to_offload=64)
    with pytest.raises(TypeError):
        layers[0](x0, scale=1.0)
        layers[1](x0, scale="bad")  # raises inside layer 1's forward
    assert top_saved_tensors_hooks() is None
    assert_equal(step(layers, x0), ref)
    # Two layers ran, then the model raised outside them: the next forward starts afresh.
    h = layers[0](x0, scale=1.0)
    layers[1](h, scale=1.0)
    assert_equal(step(layers, x0), ref)
    with pytest.raises(OffloadUsageError, match="layer 2 ran while layer 0 was expected"):
        layers[2](x0, scale=1.0)
    handle.remove()


def test_checkpointed_layers_recompute_untouched(x0, sim):
    """torch.utils.checkpoint around a layer: the recomputation in backward is not a forward."""
    from torch.utils.checkpoint import checkpoint

    layers = make_layers()

    def ckpt_step():
        layers.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False, scale=0.5)
        h.square().sum().backward()
        return [h.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]

    ref = ckpt_step()
    handle = apply_offloading(layers, num_layers=2, device=sim, min_tensor_size_to_offload=64)
    for _ in range(2):
        assert_equal(ckpt_step(), ref)
    handle.remove()


def test_remove_refuses_when_a_wrapper_changed_the_class_afterwards(sim):
    """fully_shard (and similar wrappers) swap the class again: remove() must not undo theirs."""
    layers = make_layers()
    handle = apply_offloading(layers, num_layers=1, device=sim)
    wrapped = type("FSDPLike", (type(layers[2]),), {})
    layers[2].__class__ = wrapped
    with pytest.raises(OffloadUsageError, match="layer 2's class was changed after offloading"):
        handle.remove()
    assert type(layers[2]) is wrapped


def test_copies_and_pickles_are_plain_layers(sim):
    layers = make_layers()
    handle = apply_offloading(layers, num_layers=1, device=sim)
    clone = copy.deepcopy(layers)
    assert all(type(m) is KwargLayer for m in clone)
    assert all(type(m) is KwargLayer for m in pickle.loads(pickle.dumps(layers)))
    assert all("_cpu_offload_layer" not in m.__dict__ for m in clone)
    handle.remove()


def test_v1_backend_through_the_facade(monkeypatch, sim):
    """V1 offloads tagged tensors: the embedded GPT blocks tag theirs."""
    cfg = tiny_config()
    model = build_model(cfg)
    model.set_tag_activations(True)
    x0 = make_input(cfg, requires_grad=False)

    def gpt_step():
        model.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        out = model(x)
        out.square().sum().backward()
        return [out.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]

    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    ref = gpt_step()
    handle = apply_offloading(model.layers, num_layers=2, device=sim)
    assert handle.synchronizer is None  # V1's context
    for _ in range(2):
        assert_equal(gpt_step(), ref)
    assert copies(sim) > 0
    handle.remove()


# --- planning and auditing from a real step ------------------------------------------------------


def test_plan_from_a_real_step_is_applied_exactly(x0, sim):
    layers = make_layers(n=6)
    ref = step(layers, x0)
    kw = dict(device=sim, min_tensor_size_to_offload=64, link_gbps=(0.05, 0.05), repeats=1)
    plan = plan_offloading(lambda: step(layers, x0), layers, 0.4, **kw)
    assert all(type(m) is KwargLayer for m in layers)  # the profiler left nothing behind
    assert len(plan.profiles) == 6 and all(p.activation_bytes > 0 for p in plan.profiles)
    assert plan.peak_bytes <= plan.memory_budget_bytes
    assert plan.num_layers + len(plan.recompute) >= 3
    assert plan.min_tensor_size_to_offload == 64 and "apply_offloading" in plan.describe()
    handle = apply_offloading(layers, plan=plan, device=sim)
    assert handle.recompute == plan.recompute and handle.num_layers == plan.num_layers
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    handle.remove()
    # A fast link: offloading only. (What offloading measures beyond the link is host time on
    # the simulated device, noise on a busy machine: this asks about the link alone.)
    prof = profile_step(lambda: step(layers, x0), layers, **{**kw, "link_gbps": 1e4})
    fast = search.plan(dataclasses.replace(prof, offload_ms_per_gb=0.0), 0.4)
    assert fast.recompute == () and fast.num_layers >= 3


def test_a_plan_applies_on_the_device_it_was_made_on(x0, sim):
    """apply_offloading(layers, plan=plan) needs no device= again: the plan remembers the device
    it was measured on (here the simulated one; without it a CPU-only machine has none)."""
    layers = make_layers(n=6)
    ref = step(layers, x0)
    kw = dict(device=sim, min_tensor_size_to_offload=64, link_gbps=1e4, repeats=1)
    assert plan_offloading(lambda: step(layers, x0), layers, 0.9, **kw).device is sim
    prof = profile_step(lambda: step(layers, x0), layers, **kw)
    plan = search.plan(dataclasses.replace(prof, offload_ms_per_gb=0.0), 0.5)
    assert plan.num_layers > 0 and plan.device is sim
    before = copies(sim)
    with apply_offloading(layers, plan=plan):
        assert_equal(step(layers, x0), ref)
    assert copies(sim) > before


def test_checkpointed_offloaded_layers_move_only_their_inputs(x0, sim, monkeypatch):
    """A plan may checkpoint offloaded layers: the checkpoint keeps only the layer's input,
    and that input goes to the host too, so nothing of the layer stays on the device between
    its forward and backward. Gradients stay exact; those layers copy exactly their input."""
    layers = make_layers(n=5)
    ref = step(layers, x0)
    plan = Plan(3, (1, 2))  # layer 0 offloaded whole, 1-2 checkpointed with inputs offloaded
    handle = apply_offloading(layers, plan=plan, device=sim, min_tensor_size_to_offload=64)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    out = {i: s["copied_out_bytes"] for i, s in handle.stats().to_dict()["layers"].items()}
    assert out[1] == out[2] == x0.nbytes  # the hidden-state input, nothing else
    assert out[0] > x0.nbytes  # a whole layer: its input and what its ops saved
    assert 3 not in out or out[3] == 0
    assert "(of which 1, 2 offload their checkpointed inputs)" in plan.describe()
    handle.remove()
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError, match=r"checkpoints layers \[1, 2\] and offloads"):
        apply_offloading(layers, plan=plan, device=sim)
    assert all(type(m) is KwargLayer for m in layers)  # the refused apply left nothing behind


def test_a_plan_offloading_every_layer_frees_the_last_input_before_the_loss(x0, sim):
    """Every layer checkpointed with its input offloaded, the last one too: when the forward
    pass returns, no layer input is left on the device (the last one was released at the
    forward's end, once its copy was done), and backward reloads it. Gradients stay exact."""
    layers = make_layers(n=4)
    ref = step(layers, x0)
    plan = Plan(4, (0, 1, 2, 3), model_layers=4)
    handle = apply_offloading(layers, plan=plan, device=sim, min_tensor_size_to_offload=64)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    layers.zero_grad(set_to_none=True)
    h = x0.clone().requires_grad_()
    scale, mask = torch.full((x0.shape[-1],), 0.5), torch.ones(x0.shape[:-1] + (1,))
    inputs = []
    for layer in layers:
        inputs.append(weakref.ref(h))
        h = layer(h, scale=scale, mask=mask)
    assert handle.synchronizer.held_device_bytes() == 0
    assert [r() is None for r in inputs] == [False, True, True, True]  # the caller holds x only
    h.square().sum().backward()
    layer_stats = handle.stats().to_dict()["layers"]
    assert {i: s["copied_out_bytes"] for i, s in layer_stats.items()} == {
        i: x0.nbytes for i in range(4)}
    # Released inside its own call, the last input was held by the caller for a moment: the
    # statistics count it freed, as it was once the call returned (only x stays held).
    assert [layer_stats[i]["freed_bytes"] for i in range(4)] == [0] + [x0.nbytes] * 3
    assert "offload all 4 layers" in plan.describe()
    handle.remove()
    with pytest.raises(OffloadConfigError, match="needs layer 3 recomputed"):
        apply_offloading(layers, plan=Plan(4, (0, 1, 2)), device=sim)
    assert all(type(m) is KwargLayer for m in layers)


def test_the_profile_charges_what_offloading_costs_beyond_the_link(x0, sim, monkeypatch):
    """What offloaded steps take beyond the planner's link model (here: every batch of
    device-to-host copies costs 10 ms of host time, with a link fast enough to hide any copy)
    is measured per GB moved and charged to every plan in proportion to what it moves."""
    from cpu_offload.plan import model as planner

    layers = make_layers(n=5)
    batches = []
    copy_batch = sim.copy_after_compute

    def slow_copy_batch(stream, pairs):
        batches.append(len(pairs))
        time.sleep(0.01)
        return copy_batch(stream, pairs)

    monkeypatch.setattr(sim, "copy_after_compute", slow_copy_batch)
    prof = profile_step(lambda: step(layers, x0), layers, device=sim, selective=False,
                        warmup=0, repeats=3, min_tensor_size_to_offload=64, link_gbps=1e4)
    (note,) = [m for m in prof.notes if "per GB moved is charged" in m]
    k = int(note.split()[1])  # "offloading {k} layers (...)"
    moved = sum(p.activation_bytes for p in prof.layers[:k])
    batches_per_step = len(batches) // (1 + 6)  # one warm-up and 2 * 3 timed offloaded steps
    assert batches_per_step >= k
    charged_ms = prof.offload_ms_per_gb * moved / 1e9
    assert charged_ms >= 0.9 * 10 * batches_per_step
    plain, _ = planner.simulate(prof.layers, k, (), 1e4, 1e4)
    charged, _ = planner.simulate(prof.layers, k, (), 1e4, 1e4,
                                  offload_ms_per_gb=prof.offload_ms_per_gb)
    assert charged - plain == pytest.approx(charged_ms)
    nothing, _ = planner.simulate(prof.layers, 0, (), 1e4, 1e4, offload_ms_per_gb=1e6)
    assert nothing == planner.simulate(prof.layers, 0, (), 1e4, 1e4)[0]


@pytest.mark.parametrize("offload_ms, charged", [
    ((100.6, 101.4, 99.7, 100.9, 102.5, 100.2), False),  # +0.5 ms: inside the quartile spread
    ((106.0, 107.0, 105.5, 106.5, 108.0, 105.8), True),  # +6 ms: above it
])
def test_the_offload_probe_charges_nothing_within_the_steps_own_noise(offload_ms, charged,
                                                                      monkeypatch):
    """Step times of the probe (plain and offloaded steps taking turns) decide the charge: the
    lower quartiles are compared, and a difference inside the plain steps' quartile spread is
    noise, not a cost."""
    from cpu_offload.plan import profile as sp

    plain_ms = iter([100.0, 101.0, 99.5, 100.5, 102.0, 99.8])
    offloaded = iter((offload_ms[0],) + offload_ms)  # the warm-up step first

    def fake_run(self, kind, driver=None, recompute=()):
        ms = next(plain_ms) if kind == "plain" else next(offloaded)
        self.runs.setdefault(kind, []).append(([0.0] * self.n, [0.0] * self.n, ms, [0.0] * self.n))

    monkeypatch.setattr(sp._Timing, "run", fake_run)
    monkeypatch.setattr(sp, "_Wrapped", lambda *a, **k: None)
    profiles = [LayerProfile(2**30, 2**20, 10.0, 20.0)] * 4
    notes: list = []
    per_gb, host = sp._offload_overhead(lambda: None, [None] * 4, None, None, profiles,
                                        1e4, 1e4, 1, 3, notes)
    assert host.is_free  # no host times in the profiles: no host model
    quartile = lambda v: sorted(v)[1]  # noqa: E731 - the lower quartile of 6 steps
    extra = quartile(offload_ms) - quartile([100.0, 101.0, 99.5, 100.5, 102.0, 99.8])
    k = int(notes[0].split()[1])
    if charged:
        assert per_gb == pytest.approx(extra / (k * 2**30 / 1e9))
    else:
        assert per_gb == 0.0 and "within the step's own noise" in notes[0]


class TanhLayer(nn.Module):
    """``tanh(lin(x))``; ``SlowForward`` sleeps 20 ms (host time, the simulated device's clock)
    in forward, ``NoRecompute`` cannot run again inside backward (as some stateful layers)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class SlowForward(TanhLayer):
    def forward(self, x):
        time.sleep(0.02)
        return super().forward(x)


class NoRecompute(TanhLayer):
    def forward(self, x):
        if cpu_offload.compat.graph_task_id() != -1:
            raise RuntimeError("this layer cannot be recomputed")
        return super().forward(x)


def profile_three(cls, x0, sim):
    """Three ``cls`` layers profiled on the simulated device (plain + checkpointed steps)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(cls(32) for _ in range(3))

    def step():
        h = x0.clone().requires_grad_()
        for layer in layers:
            h = layer(h)
        h.sum().backward()

    prof = profile_step(step, layers, device=sim, selective=False, warmup=0, repeats=2,
                        min_tensor_size_to_offload=64)
    assert all(type(m) is cls for m in layers)  # nothing left installed
    return prof


def test_the_profile_measures_what_checkpointing_adds_to_backward(x0, sim):
    prof = profile_three(SlowForward, x0, sim)
    # A checkpointed layer reruns its forward, sleep included, inside its backward.
    assert all(p.recompute_ms is not None and p.recompute_ms > 15 for p in prof.layers)


def test_a_model_that_cannot_be_checkpointed_is_still_profiled(x0, sim):
    prof = profile_three(NoRecompute, x0, sim)
    assert all(p.recompute_ms is None and p.fwd_ms > 0 for p in prof.layers)
    assert any("checkpointed steps failed (RuntimeError: this layer cannot be recomputed)" in n
               for n in prof.notes)


def test_partial_plan_offloads_the_last_layer_up_to_its_byte_limit(x0, sim, monkeypatch):
    layers = make_layers(n=4)
    ref = step(layers, x0)
    limit = x0.nbytes + x0.nbytes // 2  # room for one of the layer's storages, not two
    plan = Plan(2, (), partial_fraction=0.5, partial_bytes=limit)
    handle = apply_offloading(layers, plan=plan, device=sim, min_tensor_size_to_offload=64)
    for _ in range(2):
        assert_equal(step(layers, x0), ref)
    per_layer = handle.stats().to_dict()["layers"]
    assert per_layer[1]["copied_out_bytes"] == x0.nbytes  # storages in save order, to the limit
    assert per_layer[1]["skipped_bytes"]["over the layer's byte limit (a partial plan)"] > 0
    assert per_layer[0]["copied_out_bytes"] > limit  # only the last offloaded layer is limited
    assert "only its first 50% of saved bytes" in plan.describe()
    handle.remove()
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    with pytest.raises(OffloadConfigError, match="only the V2 backend can do; unset NVTE_CPU"):
        apply_offloading(layers, plan=plan, device=sim)
    assert all(type(m) is KwargLayer for m in layers)  # the refused apply left nothing behind


def test_plan_budget_and_mismatch_errors(x0, sim):
    layers = make_layers()
    run = lambda: step(layers, x0)  # noqa: E731
    for bad in (0.0, 1.5, -3, True, "half"):
        with pytest.raises(OffloadConfigError, match="memory_budget"):
            plan_offloading(run, layers, bad, device=sim)
    with pytest.raises(OffloadConfigError, match="no plan fits"):
        plan_offloading(run, layers, 1, device=sim, min_tensor_size_to_offload=64, repeats=1)
    with pytest.raises(OffloadConfigError, match="ran none of the layers"):
        plan_offloading(lambda: None, layers, 0.5, device=sim, repeats=1)
    plan = plan_offloading(run, layers, 0.9, device=sim, min_tensor_size_to_offload=64, repeats=1)
    with pytest.raises(OffloadConfigError, match="made for 4 layers, but 3"):
        apply_offloading(layers[:3], plan=plan, device=sim)
    with pytest.raises(OffloadConfigError, match="conflicts with plan.num_layers"):
        apply_offloading(layers, plan=plan, num_layers=plan.num_layers + 1, device=sim)


def test_audit_real_step_matches_the_chain_audit(x0):
    layers = make_layers()
    policy = SelectionPolicy(min_tensor_size_to_offload=64, is_device_tensor=lambda t: True)
    stepped = audit_offload_selection(layers, step_fn=lambda: step(layers, x0), policy=policy)
    chained = audit_offload_selection(
        layers, x0.requires_grad_(), policy=policy,
        call_layer=lambda layer, h: layer(h, scale=torch.full((32,), 0.5), mask=torch.ones(4, 8, 1)),
    )
    assert [a.v2_bytes for a in stepped.layers] == [a.v2_bytes for a in chained.layers]
    assert all(a.v2_bytes > 0 and a.saved_count > 0 for a in stepped.layers)
    assert all(type(m) is KwargLayer for m in layers)
    with pytest.raises(TypeError, match="exactly one of example_input"):
        audit_offload_selection(layers)


def test_the_step_profile_records_one_memory_segment_per_phase(x0, monkeypatch):
    """The memory timeline's segments, in order (the allocator is faked: CUDA-only on a GPU)."""
    from cpu_offload.plan import profile as step_profile
    from cpu_offload.plan.model import memory_segments

    layers = make_layers(n=3)
    closed = []
    monkeypatch.setattr(step_profile, "_allocated", lambda: 0)
    monkeypatch.setattr(step_profile, "_max_allocated", lambda: len(closed) + 100)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: closed.append(1))
    recorder = step_profile._StepRecorder(3, step_profile.StepClock(False), None, memory=True)
    step_profile._run(lambda: step(layers, x0), list(layers), recorder)
    timeline = recorder.memory_timeline(before=100)
    names = memory_segments(3)
    assert len(timeline) == len(names) == 8
    assert timeline == list(range(8))  # closed in order: each segment's peak read once
    assert names[4] == "loss" and names[5] == "backward 2"
