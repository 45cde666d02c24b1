"""Migration audit: classification, byte accounting, text and data output, agreement with V2."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from cpu_offload import (
    SimulatedDevice,
    get_cpu_offload_context,
    mark_activation_offload,
    mark_not_offload,
    mark_weight,
)
from cpu_offload.core import markers
from cpu_offload.tools.audit import AuditReport, audit_offload_selection
from cpu_offload.examples.gpt import GPTBlock, build_model, make_input, tiny_config
from cpu_offload.control import set_activation_offloading
from cpu_offload.v2.selection import SelectionPolicy


def on_cpu(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def float_on_cpu(t: torch.Tensor) -> bool:
    """Treat integer tensors as living elsewhere, to exercise the "not on the device" reason."""
    return t.device.type == "cpu" and t.is_floating_point()


class SaveMany(torch.autograd.Function):
    """Saves exactly the tensors it is given, in order (backward is never run by the audit)."""

    @staticmethod
    def forward(ctx, x, *others):
        ctx.save_for_backward(x, *others)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * (len(ctx.saved_tensors) - 1)


class Zoo(nn.Module):
    """One saved tensor per reason, plus views and duplicates of one storage."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))
        self.register_buffer("frozen", torch.randn(16, 16))
        mark_weight(self.frozen)

    def forward(self, x):  # x: (8, 64) float32 = 2 KiB
        big = x * 2
        view = big[:, :32]
        small = x.sum(1)
        kept = x + 1
        mark_not_offload(kept)
        tagged = x - 1
        mark_activation_offload(tagged)
        sliced_base = x * 3
        tagged_slice = sliced_base[:, :16]
        mark_activation_offload(tagged_slice)
        ints = torch.arange(512).view(8, 64)
        return SaveMany.apply(
            x, big, view, big, small, kept, tagged, tagged_slice, ints, self.weight, self.frozen
        )


ZOO_POLICY = SelectionPolicy(min_tensor_size_to_offload=64)
F32 = 4


@pytest.fixture
def zoo_report() -> AuditReport:
    x = torch.randn(8, 64, requires_grad=True)
    return audit_offload_selection(Zoo(), x, policy=ZOO_POLICY, is_device_tensor=float_on_cpu)


def test_every_skip_reason_is_reported(zoo_report):
    rows = zoo_report.layers[0].tensors
    assert [r.v2_reason for r in rows] == [
        None,  # x: the layer input is an activation
        None,  # big
        None,  # view of big
        None,  # big again
        "too small",
        "mark_not_offload",
        None,  # tagged
        None,  # tagged slice
        "not on the offload device",
        "parameter",
        "weight mark",
    ]
    assert [r.v1_reason for r in rows] == (
        ["not tagged"] * 6 + [None, None] + ["not tagged"] * 3
    )
    assert rows[9].shape == (16, 16) and rows[9].dtype == "float32"
    assert rows[8].dtype == "int64"


def test_bytes_count_each_whole_storage_once_per_layer(zoo_report):
    layer = zoo_report.layers[0]
    rows = layer.tensors
    # Storages moved by V2: x, big (shared by the view and the duplicate), tagged, sliced_base.
    assert layer.v2_count == 6
    assert layer.v2_storages == 4
    assert layer.v2_bytes == 4 * 8 * 64 * F32
    assert rows[2].storages == rows[1].storages == rows[3].storages == rows[1].v2_storages
    assert rows[1].storages != rows[0].storages
    assert rows[1].v2_new_bytes == 8 * 64 * F32
    assert rows[2].v2_new_bytes == rows[3].v2_new_bytes == 0
    # The tagged slice: its own bytes are a quarter of the storage that both backends move.
    assert rows[7].nbytes == 8 * 16 * F32
    assert rows[7].storage_nbytes == rows[7].v1_new_bytes == rows[7].v2_new_bytes == 8 * 64 * F32
    assert (layer.v1_count, layer.v1_storages, layer.v1_bytes) == (2, 2, 2 * 8 * 64 * F32)
    assert layer.v1_only == 0 and layer.v2_only == 4
    assert layer.v2_skipped() == {
        "too small": 1, "mark_not_offload": 1, "not on the offload device": 1, "parameter": 1,
        "weight mark": 1,
    }


def test_v1_checks_marks_and_device_of_tagged_tensors():
    class Tagged(nn.Module):
        def forward(self, x):
            a, b, c = x * 1, x * 2, torch.arange(64).view(8, 8)
            mark_activation_offload(a, b, c)
            mark_not_offload(b)
            return SaveMany.apply(x, a, b, c, a)

    report = audit_offload_selection(
        Tagged(), torch.randn(8, 8, requires_grad=True), policy=ZOO_POLICY,
        is_device_tensor=float_on_cpu,
    )
    rows = report.layers[0].tensors
    assert [r.v1_reason for r in rows] == [
        "not tagged", None, "mark_not_offload", "not on the offload device", None
    ]
    assert report.layers[0].v1_bytes == 8 * 8 * F32  # the duplicate of ``a`` is moved once
    assert rows[4].v1_new_bytes == 0


def test_default_policy_on_cpu_reports_not_on_device():
    """Without ``is_device_tensor`` the audit judges like V2 on CUDA: CPU tensors are not moved."""
    report = audit_offload_selection(nn.Linear(8, 8), torch.randn(4, 8))
    reasons = {r.v2_reason for r in report.layers[0].tensors}
    assert reasons == {"not on the offload device"}
    assert report.layers[0].v2_bytes == 0
    assert report.policy["min_tensor_size_to_offload"] == 256 * 1024


def test_weight_views_saved_by_linear_are_not_activations():
    """``F.linear`` saves ``weight.t()``, a plain tensor viewing a Parameter: V2 must keep it."""
    report = audit_offload_selection(
        nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True),
        policy=SelectionPolicy(min_tensor_size_to_offload=0),
        is_device_tensor=on_cpu,
    )
    rows = report.layers[0].tensors
    weight_rows = [r for r in rows if r.shape == (8, 8)]
    assert [r.v2_reason for r in weight_rows] == ["parameter view"]
    assert [r.v2_selected for r in rows if r.shape == (4, 8)] == [True]


def test_module_opt_out_shows_in_both_columns():
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    class Tag(nn.Module):
        def forward(self, x):
            mark_activation_offload(x)
            return x

    layer = nn.Sequential(Tag(), block)
    set_activation_offloading(block, False)
    report = audit_offload_selection(
        [layer], torch.randn(4, 8), policy=SelectionPolicy(min_tensor_size_to_offload=0),
        is_device_tensor=on_cpu,
    )
    rows = report.layers[0].tensors
    assert {r.module for r in rows} == {"1.0", "1.1"}
    assert {r.v2_reason for r in rows} == {"module opted out"}
    tagged = [r for r in rows if r.v1_reason != "not tagged"]
    assert [(r.module, r.v1_reason) for r in tagged] == [("1.0", "module opted out")]
    assert markers.MODULE_POLICY == []


def test_layers_are_chained_and_indexed():
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    report = audit_offload_selection(
        seq, torch.randn(4, 8), policy=SelectionPolicy(min_tensor_size_to_offload=0),
        is_device_tensor=on_cpu,
    )
    assert [(a.index, a.name) for a in report.layers] == [(0, "Linear"), (1, "Tanh"), (2, "Linear")]
    assert [r.shape for r in report.layers[1].tensors] == [(4, 16)]  # tanh saves its output
    assert [r.shape for r in report.layers[2].tensors if r.v2_selected] == [(4, 16)]
    single = audit_offload_selection(seq[0], torch.randn(4, 8))
    assert len(single.layers) == 1


def test_tuple_inputs_are_splatted_and_call_layer_is_used():
    class Add(nn.Module):
        def forward(self, a, b):
            return a * b

    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    report = audit_offload_selection(
        Add(), (a, b), policy=SelectionPolicy(min_tensor_size_to_offload=0), is_device_tensor=on_cpu
    )
    assert report.layers[0].v2_count == 2
    calls = []
    audit_offload_selection(
        [nn.Identity(), nn.Identity()], a, call_layer=lambda layer, x: calls.append(layer) or x
    )
    assert len(calls) == 2


def test_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Modules"):
        audit_offload_selection([nn.Identity(), "layer"], torch.randn(2))


def test_exception_in_a_layer_removes_the_audit_hooks():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    layer = nn.Sequential(nn.Linear(8, 8), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        audit_offload_selection([layer], torch.randn(4, 8))
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in layer.modules())
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        layer[0](torch.randn(4, 8, requires_grad=True))
    assert len(seen) == 2  # our hook is the innermost again: the audit's hooks are gone


def test_dict_is_json_and_matches_the_layers(zoo_report):
    data = json.loads(json.dumps(zoo_report.to_dict()))
    (layer,) = data["layers"]
    assert layer["v2_bytes"] == zoo_report.layers[0].v2_bytes
    assert layer["v1_count"] == 2
    assert len(layer["tensors"]) == 11
    assert layer["tensors"][4]["v2_reason"] == "too small"
    assert data["totals"]["v2_storages"] == 4
    assert "once per layer" in " ".join(data["notes"])


def test_table_is_fixed_width_and_names_reasons(zoo_report):
    text = str(zoo_report)
    assert text == zoo_report.table()
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    # The column after "V2 bytes" starts at the same offset on every summary row.
    col = lines[header].index("V1 only")
    for row in lines[header + 2: header + 4]:
        assert row[col - 2: col] == "  " and row[col - 3] != " "
    assert "4.0 KiB" in lines[header + 2] and "8.0 KiB" in lines[header + 2]  # V1, V2 bytes
    assert "mark_not_offload 1" in text and "weight mark 1" in text
    assert "keep: not on the offload device" in text
    assert "offload (storage already moved)" in text
    assert "once per layer" in text
    short = zoo_report.table(details=False)
    assert "already moved" not in short and short in text


def test_audit_agrees_with_what_v2_copies():
    """Per layer, the audit's V2 bytes equal the bytes V2 actually copies to the host."""
    cfg = tiny_config()
    model = build_model(cfg)
    x = make_input(cfg)
    policy = SelectionPolicy(min_tensor_size_to_offload=256)
    report = audit_offload_selection(model.layers, x, policy=policy, is_device_tensor=on_cpu)

    n = cfg.layers
    sim = SimulatedDevice()
    copied = []
    h = x
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_layers = model_layers - 1 warns about overlap
        ctx, sync = get_cpu_offload_context(
            enabled=True, num_layers=n - 1, model_layers=n, min_tensor_size_to_offload=256,
            device=sim,
        )
        for layer in model.layers:
            before = len(sim.log)
            with ctx:
                h = layer(h)
            h = sync(h)
            copied.append(sum(e[2] for e in sim.log[before:] if e[0] == "copy"))
    h.sum().backward()
    assert copied[:-1] == [a.v2_bytes for a in report.layers[:-1]]
    assert all(c > 0 for c in copied[:-1]) and copied[-1] == 0  # the last layer is not offloaded


def test_tags_of_the_reference_block_are_a_subset_of_v2():
    """GPTBlock's V1 tags mirror TE's: V2 detects all of them (nothing is lost by migrating)."""
    torch.manual_seed(0)
    block = GPTBlock(32, 4)
    block.tag_activations = True
    report = audit_offload_selection(
        block, torch.randn(2, 8, 32, requires_grad=True),
        policy=SelectionPolicy(min_tensor_size_to_offload=0), is_device_tensor=on_cpu,
    )
    layer = report.layers[0]
    assert layer.v1_count > 0
    assert layer.v1_only == 0
    assert layer.v2_only > 0  # e.g. SDPA's output and LayerNorm statistics are not taggable


def test_audit_agrees_with_what_v1_copies(monkeypatch):
    """The V1 column equals the bytes the legacy backend copies for its offloaded layer."""
    cfg = tiny_config()
    model = build_model(cfg)
    model.set_tag_activations(True)
    x = make_input(cfg)
    report = audit_offload_selection(model.layers, x, is_device_tensor=on_cpu)
    assert report.layers[0].v1_count > 0

    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=cfg.layers, device=sim
    )
    h = x
    for layer in model.layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    forward_bytes = sum(e[2] for e in sim.log if e[0] == "copy")
    h.sum().backward()
    assert forward_bytes == report.layers[0].v1_bytes


@pytest.mark.gpu
def test_audit_on_cuda_with_the_default_policy():
    """On a GPU no device override is needed: the default policy is exactly V2's."""
    layer = nn.Linear(1024, 1024).cuda()
    x = torch.randn(512, 1024, device="cuda", requires_grad=True)  # above the 256K-element threshold
    report = audit_offload_selection(layer, x)
    rows = report.layers[0].tensors
    assert {r.v2_reason for r in rows} == {None, "parameter view"}
    assert report.layers[0].v2_bytes == 512 * 1024 * 4
    small = audit_offload_selection(layer, x[:8])
    assert {r.v2_reason for r in small.layers[0].tensors} == {"too small", "parameter view"}
