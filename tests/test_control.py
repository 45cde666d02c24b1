"""Per-module offload switch: stack discipline, nesting, fused modules, and effect on V2."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_offload import SimulatedDevice, get_cpu_offload_context
from cpu_offload.core import markers
from cpu_offload.tools.audit import audit_offload_selection
from cpu_offload.examples.gpt import run_layers
from cpu_offload.control import (
    get_activation_offloading,
    maybe_mark_activation_offload,
    offload_opt_out,
    set_activation_offloading,
)
from cpu_offload.v2.selection import SelectionPolicy
from _support.parity_models import EXPECTED_WARNINGS

CPU_POLICY = SelectionPolicy(min_tensor_size_to_offload=0)
pytestmark = EXPECTED_WARNINGS  # see parity_models


def on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


@pytest.fixture(autouse=True)
def _empty_policy_stack():
    """Every test starts and must end with no module policy pushed."""
    assert markers.MODULE_POLICY == []
    yield
    leaked = list(markers.MODULE_POLICY)
    markers.MODULE_POLICY.clear()
    assert leaked == [], "a test left module policies on the stack"


class Probe(nn.Module):
    """Records whether offloading is opted out while it runs, then applies a Linear."""

    def __init__(self, width: int = 8, child: nn.Module | None = None) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.child = child
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(markers.module_opt_out_active())
        x = self.lin(x)
        if self.child is not None:
            x = self.child(x)
        self.seen.append(markers.module_opt_out_active())
        return x


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


# --- the switch itself ----------------------------------------------------------------------------


def test_setting_is_replaced_not_stacked_and_none_removes_it():
    m = Probe()
    assert get_activation_offloading(m) is None
    set_activation_offloading(m, False)
    set_activation_offloading(m, False)
    set_activation_offloading(m, True)
    assert get_activation_offloading(m) is True
    assert len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1
    set_activation_offloading(m, False)
    m(torch.randn(2, 8))
    assert m.seen == [True, True]
    set_activation_offloading(m, None)
    assert get_activation_offloading(m) is None
    assert len(m._forward_pre_hooks) == 0 and len(m._forward_hooks) == 0
    m.seen.clear()
    m(torch.randn(2, 8))
    assert m.seen == [False, False]


def test_rejects_non_bool_settings_and_non_modules():
    with pytest.raises(TypeError, match="True, False or None"):
        set_activation_offloading(Probe(), 0)
    with pytest.raises(TypeError, match="nn.Module"):
        set_activation_offloading(torch.randn(2), False)


def test_innermost_explicit_setting_wins():
    grandchild = Probe()
    child = Probe(child=grandchild)
    parent = Probe(child=child)
    set_activation_offloading(parent, False)
    set_activation_offloading(grandchild, True)
    parent(torch.randn(2, 8))
    assert parent.seen == [True, True]
    assert child.seen == [True, True]  # no setting of its own: inherits the parent's opt-out
    assert grandchild.seen == [False, False]  # re-enabled inside the opted-out parent
    assert not markers.module_opt_out_active()


def test_setting_covers_only_the_modules_forward():
    m = Probe()
    set_activation_offloading(m, False)
    m(torch.randn(2, 8))
    assert not markers.module_opt_out_active()
    outside = Probe()
    outside(torch.randn(2, 8))
    assert outside.seen == [False, False]


def test_exception_inside_forward_leaves_the_policy_stack_empty():
    inner = nn.Sequential(nn.Linear(8, 8), Boom())
    outer = nn.Sequential(nn.Linear(8, 8), inner)
    set_activation_offloading(outer, False)
    set_activation_offloading(inner, True)
    with pytest.raises(RuntimeError, match="boom"):
        outer(torch.randn(2, 8))
    assert markers.MODULE_POLICY == []
    probe = Probe()
    probe(torch.randn(2, 8))
    assert probe.seen == [False, False]


def test_failing_foreign_pre_hook_does_not_pop_an_outer_policy():
    """If a pre-hook that runs before ours raises, our always-called hook must not pop."""
    m = Probe()
    set_activation_offloading(m, True)

    def failing_pre_hook(module, args):
        raise ValueError("pre-hook failed")

    m.register_forward_pre_hook(failing_pre_hook, prepend=True)
    with offload_opt_out():
        with pytest.raises(ValueError, match="pre-hook failed"):
            m(torch.randn(2, 8))
        assert markers.MODULE_POLICY == [False]
    assert markers.MODULE_POLICY == []


def test_removing_the_setting_inside_forward_is_refused():
    class SelfRemoving(nn.Module):
        def forward(self, x):
            set_activation_offloading(self, None)
            return x

    m = SelfRemoving()
    set_activation_offloading(m, False)
    with pytest.raises(RuntimeError, match="between forward passes"):
        m(torch.randn(2))
    assert get_activation_offloading(m) is False


def test_deepcopy_and_pickle_keep_an_independent_setting():
    m = Probe()
    set_activation_offloading(m, False)
    clone = copy.deepcopy(m)
    assert get_activation_offloading(clone) is False
    set_activation_offloading(clone, True)
    assert get_activation_offloading(m) is False
    clone(torch.randn(2, 8))
    m(torch.randn(2, 8))
    assert clone.seen == [False, False] and m.seen == [True, True]
    restored = pickle.loads(pickle.dumps(m))
    restored.seen.clear()
    restored(torch.randn(2, 8))
    assert restored.seen == [True, True]


# --- effect on what is selected (audit, same predicate as V2) -------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.mlp(torch.tanh(self.attn(x)))


def test_audit_sees_module_opt_out_and_child_re_enable():
    block = Block()
    set_activation_offloading(block, False)
    set_activation_offloading(block.mlp[1], True)  # only the GELU offloads
    report = audit_offload_selection(block, torch.randn(4, 8), policy=CPU_POLICY,
                                     is_device_tensor=on_cpu)
    by_module = {}
    for t in report.layers[0].tensors:
        by_module.setdefault(t.module, set()).add(t.v2_reason)
    assert by_module["mlp.1"] == {None}
    assert by_module["attn"] == {"module opted out"}
    assert by_module["mlp.0"] == {"module opted out"}
    assert by_module[""] == {"module opted out"}  # tanh, in the block's own forward


# --- fused-style module: several sub-modules' tensors saved in one autograd.Function --------------


class FusedMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, owner):
        h = x @ w1.t()
        a = F.gelu(h)
        y = a @ w2.t()
        maybe_mark_activation_offload(owner.fc1, x)
        maybe_mark_activation_offload(owner.act, h)
        maybe_mark_activation_offload(owner.fc2, a)
        ctx.save_for_backward(x, h, a, w1, w2)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, h, a, w1, w2 = ctx.saved_tensors
        ga = gy @ w2
        gw2 = gy.t() @ a
        with torch.enable_grad():
            hh = h.detach().requires_grad_()
            (gh,) = torch.autograd.grad(F.gelu(hh), hh, ga)
        return gh @ w1, gh.t() @ x, gw2, None


class FusedMLP(nn.Module):
    """Sub-modules only carry settings; the parent computes and saves everything at once."""

    def __init__(self, width: int = 8, hidden: int = 24) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden, bias=False)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return FusedMLPFunction.apply(x, self.fc1.weight, self.fc2.weight, self)


def test_fused_module_opts_out_one_sub_module_in_audit():
    torch.manual_seed(0)
    fused = FusedMLP()
    set_activation_offloading(fused.act, False)
    x = torch.randn(4, 8, requires_grad=True)
    report = audit_offload_selection(fused, x, policy=CPU_POLICY, is_device_tensor=on_cpu)
    rows = report.layers[0].tensors
    assert [r.shape for r in rows] == [(4, 8), (4, 24), (4, 24), (24, 8), (8, 24)]
    assert [r.v2_reason for r in rows] == [None, "mark_not_offload", None, "parameter", "parameter"]
    # V1 offloads by tag: the opted-out sub-module's tensor is simply not tagged.
    assert [r.v1_reason for r in rows] == [None, "not tagged", None, "not tagged", "not tagged"]


def _forward_copies(device: SimulatedDevice) -> list:
    return [e[2] for e in device.log if e[0] == "copy"]


def _train_step(layers, x0, ctx, sync):
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    run_layers(layers, x, ctx, sync).square().sum().backward()
    return x.grad, [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("opted_out", [None, "fc1", "act", "fc2"])
def test_fused_module_opt_out_with_v2(opted_out):
    torch.manual_seed(0)
    layers = nn.ModuleList([FusedMLP(), FusedMLP()])
    x0 = torch.randn(4, 8)
    ref = _train_step(layers, x0, *get_cpu_offload_context(enabled=False))
    if opted_out is not None:
        set_activation_offloading(getattr(layers[0], opted_out), False)
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0, device=sim
    )
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    with ctx:
        h = layers[0](x)
    h = sync(h)
    copies = _forward_copies(sim)  # layer 0 is the offloaded one; its copies start at save time
    with ctx:
        h = layers[1](h)
    h = sync(h)
    h.square().sum().backward()
    expected = {None: [4 * 8 * 4, 4 * 24 * 4, 4 * 24 * 4], "fc1": [4 * 24 * 4, 4 * 24 * 4],
                "act": [4 * 8 * 4, 4 * 24 * 4], "fc2": [4 * 8 * 4, 4 * 24 * 4]}[opted_out]
    assert sorted(copies) == sorted(expected)
    assert torch.equal(x.grad, ref[0])
    for p, g in zip(layers.parameters(), ref[1]):
        assert torch.equal(p.grad, g)


# --- whole modules with V2 ------------------------------------------------------------------------


def _offloaded_bytes_of_layer0(block: nn.Module, x0: torch.Tensor) -> int:
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0, device=sim
    )
    x = x0.clone().requires_grad_()
    with ctx:
        h = block(x)
    h = sync(h)
    nbytes = sum(_forward_copies(sim))
    with ctx:
        h = nn.Identity()(h * 1.0)
    sync(h).sum().backward()
    return nbytes


def test_v2_offloads_only_where_the_innermost_setting_allows():
    torch.manual_seed(0)
    block = Block()
    x0 = torch.randn(4, 8)
    everything = _offloaded_bytes_of_layer0(block, x0)
    assert everything > 0

    set_activation_offloading(block, False)
    assert _offloaded_bytes_of_layer0(block, x0) == 0

    set_activation_offloading(block.mlp[1], True)  # GELU saves its 4x16 float input
    assert _offloaded_bytes_of_layer0(block, x0) == 4 * 16 * 4

    set_activation_offloading(block, None)  # GELU's explicit True stays, the rest is default
    assert _offloaded_bytes_of_layer0(block, x0) == everything
    assert markers.MODULE_POLICY == []


def test_v2_exception_in_opted_out_module_leaves_stack_and_context_clean():
    torch.manual_seed(0)
    bad = nn.Sequential(nn.Linear(8, 8), Boom())
    set_activation_offloading(bad, False)
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0, device=sim
    )
    with pytest.raises(RuntimeError, match="boom"):
        with ctx:
            bad(torch.randn(4, 8, requires_grad=True))
    assert markers.MODULE_POLICY == []
    good = nn.ModuleList([Block(), Block()])
    x0 = torch.randn(4, 8)
    ref = _train_step(good, x0, *get_cpu_offload_context(enabled=False))
    got = _train_step(good, x0, ctx, sync)
    assert torch.equal(got[0], ref[0])


# --- V1: the switch also governs the legacy, tag-based backend -----------------------------------


def _v1_forward_copy_bytes(layers: nn.ModuleList, x0: torch.Tensor) -> int:
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=len(layers), device=sim
    )
    h = x0.clone().requires_grad_()
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    nbytes = sum(_forward_copies(sim))
    h.sum().backward()
    return nbytes


def test_v1_honours_the_switch(monkeypatch):
    from cpu_offload.examples.gpt import build_model, make_input, tiny_config

    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    cfg = tiny_config()
    model = build_model(cfg)
    model.set_tag_activations(True)
    x0 = make_input(cfg, requires_grad=False)
    tagged = _v1_forward_copy_bytes(model.layers, x0)
    assert tagged > 0
    set_activation_offloading(model.layers[0], False)
    assert _v1_forward_copy_bytes(model.layers, x0) == 0
    set_activation_offloading(model.layers[0].act, True)  # GELU's input, tagged as ``u``
    batch_tokens = cfg.batch * cfg.seq
    assert _v1_forward_copy_bytes(model.layers, x0) == batch_tokens * cfg.mlp_ratio * cfg.hidden * 4
    set_activation_offloading(model.layers[0], None)
    assert _v1_forward_copy_bytes(model.layers, x0) == tagged
