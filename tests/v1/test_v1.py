"""Tests of the legacy V1 backend (``cpu_offload.v1``) on the simulated device, plus a few
``gpu``-marked duplicates that run on CUDA.

The simulated device defers side-stream copies until something waits for them and fills fresh
device buffers with a poison pattern, so a missing wait shows up as a wrong gradient here.
"""
from __future__ import annotations

import gc
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload.core.errors import OffloadConfigError
from cpu_offload.compat import top_saved_tensors_hooks
from cpu_offload.core.simulated import SimulatedHazard
from cpu_offload.v1 import (
    AsyncDoubleBufferGroupOffloadHandler,
    CpuOffloadHookWithOffloadHandler,
    CpuOffloadSavedTensorHook,
    OffloadHandler,
    SynchronizedGroupOffloadHandler,
    get_cpu_offload_context,
    group_prefetch_offload_commit,
    is_cpu_offload_enabled,
    is_current_layer_offloaded,
    layer_window_map,
    mark_activation_offload,
)

from _support.parity_models import (
    Scaled,
    ActivationWatch,
    TrackingSimDevice,
    assert_bit_identical,
    grads_of,
    loss_of,
    make_input,
    make_layers,
    run_layers,
    train_step,
    zero_grads,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def v1_selected(monkeypatch):
    """The model tags through the facade, which dispatches on the environment variable."""
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")


def v1_context(k, n, device=None, **kw):
    device = device if device is not None else TrackingSimDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=k, model_layers=n, device=device, **kw
    )
    return ctx, sync, device


# --- layer-window map --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k,n,expected",
    [
        (1, 1, {0: 0}),
        (1, 4, {0: 3}),
        (2, 4, {0: 1, 1: 3}),
        (2, 5, {0: 2, 1: 4}),
        (3, 8, {0: 2, 1: 5, 2: 7}),
        (4, 5, {0: 1, 1: 2, 2: 3, 3: 4}),
        (3, 10, {0: 3, 1: 6, 2: 9}),
        (0, 3, {}),
    ],
)
def test_layer_window_map_values(k, n, expected):
    assert layer_window_map(k, n) == expected


@pytest.mark.parametrize("n", range(2, 13))
def test_layer_window_map_properties(n):
    for k in range(1, n):
        m = layer_window_map(k, n)
        assert m[k - 1] == n - 1  # the last offloaded group is released by the last layer
        assert all(m[i] >= i + 1 for i in range(k))  # released after the next group was saved
        assert all(m[i] < m[i + 1] for i in range(k - 1))


# --- numerics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(1, 2), (2, 4), (3, 4), (2, 5), (3, 8), (0, 3)])
@pytest.mark.parametrize("double_buffering", [False, True])
def test_bit_identical_outputs_and_grads(k, n, double_buffering):
    layers, x = make_layers(n), make_input()
    ref_out, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(k, n, double_buffering=double_buffering)
    for _ in range(3):
        out, grads = train_step(layers, x, ctx, sync)
        assert torch.equal(out, ref_out)
        assert_bit_identical(grads, ref)
    assert bool(dev.copies()) == (k > 0)


def test_unsafe_double_buffer_reuse_gets_fresh_buffers():
    """k=3 of n=9: group 0 reloads (window 2) before group 2's backward ran, so the parity-0
    buffers are still in use; Transformer Engine would overwrite them."""
    layers, x = make_layers(9), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(3, 9, double_buffering=True)
    for _ in range(2):
        assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)


def test_double_buffers_allocated_once():
    layers, x = make_layers(4), make_input()
    ctx, sync, dev = v1_context(2, 4, double_buffering=True)
    train_step(layers, x, ctx, sync)
    allocs = dev.device_allocs
    for _ in range(3):
        train_step(layers, x, ctx, sync)
    assert dev.device_allocs == allocs
    assert dev.live_device_buffers() > 0  # the two sets persist, by design


def test_schedule_milestones():
    """k=2 of n=5: windows {0: 2, 1: 4}."""
    layers, x = make_layers(5), make_input()
    ctx, sync, dev = v1_context(2, 5)

    def on_layer(i, out):
        dev.trace("fwd_done", i)
        out.register_hook(lambda g, i=i: dev.trace("bwd", i))

    out = run_layers(layers, x, ctx, sync, on_layer=on_layer)
    loss_of(out).backward()
    got = dev.milestones({"fwd_done", "bwd", "offload", "release", "reload"})
    assert got == [
        ("fwd_done", 0), ("offload", 0),
        ("fwd_done", 1),
        ("fwd_done", 2), ("release", 0), ("offload", 1),
        ("fwd_done", 3),
        ("fwd_done", 4), ("release", 1),
        ("reload", 1), ("bwd", 4),
        ("bwd", 3),
        ("reload", 0), ("bwd", 2),
        ("bwd", 1),
        ("bwd", 0),
    ]


class TwoOps(nn.Module):
    """Saves one tagged and one untagged tensor."""

    def forward(self, x):
        a = x * 2
        mark_activation_offload(a)
        b = x * 3
        return a.sin() + b.cos()


def test_only_tagged_tensors_are_copied():
    layers, x = nn.ModuleList(TwoOps() for _ in range(4)), torch.randn(8, 16, requires_grad=True)
    ref = torch.autograd.grad(run_layers(layers, x).sum(), x)[0]
    ctx, sync, dev = v1_context(2, 4)
    got = torch.autograd.grad(run_layers(layers, x, ctx, sync).sum(), x)[0]
    assert torch.equal(got, ref)
    nbytes = x.numel() * x.element_size()
    assert dev.copies("side1") == [nbytes, nbytes]  # D2H: one tagged storage per offloaded group
    assert dev.copies("side2") == [nbytes, nbytes]  # H2D
    assert dev.copies("compute") == []


def test_views_of_one_storage_are_copied_once():
    layers, x = make_layers(2), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(1, 2)
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)
    handler_storages = 8  # x, ln1 out, qkv (q, k, v), attention out (a), x2, ln2 out, fc1, gelu
    assert len(dev.copies("side1")) == handler_storages


# Every tagged tensor is opted out again, so nothing is offloaded and V1 says so.
@pytest.mark.filterwarnings("ignore:cpu_offload \\(V1\\).*none is tagged:UserWarning")
def test_mark_not_offload_and_module_opt_out_win_over_tags():
    layers, x = nn.ModuleList(TwoOps() for _ in range(3)), torch.randn(8, 16, requires_grad=True)

    class Skipping(TwoOps):
        def forward(self, x):
            a = x * 2
            mark_activation_offload(a)
            cpu_offload.mark_not_offload(a)
            return a.sin()

    ctx, sync, dev = v1_context(2, 3)
    with cpu_offload.offload_opt_out():
        run_layers(layers, x, ctx, sync).sum().backward()
    assert dev.copies() == []
    ctx, sync, dev = v1_context(2, 3)
    run_layers(nn.ModuleList(Skipping() for _ in range(3)), x, ctx, sync).sum().backward()
    assert dev.copies() == []


# --- geometry and subclasses -------------------------------------------------------------------


class SaveViews(torch.autograd.Function):
    """Saves three views of one non-contiguous base and checks them in backward."""

    checked = []

    @staticmethod
    def forward(ctx, x):
        base = x * 2  # (B, S, H, D) buffer
        views = (
            base.transpose(1, 2),  # (B, H, S, D): like flash attention's output
            base.transpose(1, 2).transpose(1, 2).reshape(x.shape[0] * x.shape[1], -1),
            base[:, 1:, :, 2:],  # non-zero storage offset
        )
        mark_activation_offload(*views)
        ctx.save_for_backward(*views)
        ctx.expected = [(v.clone(), v.size(), v.stride(), v.storage_offset()) for v in views]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        views = ctx.saved_tensors
        for v, (val, size, stride, offset) in zip(views, ctx.expected):
            assert (v.size(), v.stride(), v.storage_offset()) == (size, stride, offset)
            assert torch.equal(v, val)
        ptrs = {v.untyped_storage().data_ptr() for v in views}
        assert len(ptrs) == 1, "views of one base must share a base again"
        SaveViews.checked.append(True)
        return grad * 2


def test_strides_offsets_and_shared_base_preserved():
    SaveViews.checked.clear()

    class L(nn.Module):
        def forward(self, x):
            return SaveViews.apply(x)

    layers = nn.ModuleList(L() for _ in range(3))
    x = torch.randn(2, 5, 3, 4, requires_grad=True)
    ctx, sync, dev = v1_context(2, 3)
    run_layers(layers, x, ctx, sync).sum().backward()
    assert len(SaveViews.checked) == 3
    assert torch.equal(x.grad, torch.full_like(x, 8.0))
    assert len(dev.copies("side1")) == 2  # one storage per offloaded group


class QuantMul(torch.autograd.Function):
    """Saves a quantized copy of its input and also keeps the wrapper in ctx (as TE layers do)."""

    inner_seen = []

    @staticmethod
    def forward(ctx, x, tag):
        q = Scaled.quantize(x)
        if tag:
            mark_activation_offload(q)
        ctx.q_object = q  # the reference that force-clear exists for
        QuantMul.inner_seen.append(q._data)
        ctx.save_for_backward(q)
        return x * q.dequantize()

    @staticmethod
    def backward(ctx, grad):
        (q,) = ctx.saved_tensors
        assert type(q) is Scaled and q._data.dtype == torch.float16
        return 2 * grad * q.dequantize(), None


class QuantLayer(nn.Module):
    def __init__(self, tag=True):
        super().__init__()
        self.tag = tag

    def forward(self, x):
        return QuantMul.apply(x, self.tag)


def test_mark_activation_offload_tags_inner_tensors_and_force_clear():
    q = Scaled.quantize(torch.randn(4))
    mark_activation_offload(q)
    assert q._data.activation_offloading and q._data.needs_force_clear
    plain = torch.randn(3)
    mark_activation_offload(plain, None)
    assert plain.activation_offloading and not getattr(plain, "needs_force_clear", False)
    mark_activation_offload(plain, offload=False)
    assert not plain.activation_offloading


def test_subclass_round_trip_and_force_clear():
    layers = nn.ModuleList(QuantLayer() for _ in range(4))
    x = torch.randn(6, 8, requires_grad=True)
    ref = torch.autograd.grad(run_layers(layers, x).sum(), x)[0]
    QuantMul.inner_seen.clear()
    ctx, sync, dev = v1_context(2, 4)
    out = run_layers(layers, x, ctx, sync)
    inner = list(QuantMul.inner_seen)
    # The two offloaded groups were released in forward: their inner tensors were emptied in
    # place although each layer's ctx still holds the wrapper; the others are untouched.
    assert [t.numel() for t in inner] == [0, 0, 48, 48]
    got = torch.autograd.grad(out.sum(), x)[0]
    assert torch.equal(got, ref)
    assert dev.copies("side1") == [48 * 2, 48 * 2]  # float16 inner data, bytes


@pytest.mark.filterwarnings("ignore:cpu_offload \\(V1\\).*none is tagged:UserWarning")
def test_untagged_subclass_is_kept_whole():
    layers = nn.ModuleList(QuantLayer(tag=False) for _ in range(3))
    x = torch.randn(6, 8, requires_grad=True)
    ref = torch.autograd.grad(run_layers(layers, x).sum(), x)[0]
    ctx, sync, dev = v1_context(2, 3)
    assert torch.equal(torch.autograd.grad(run_layers(layers, x, ctx, sync).sum(), x)[0], ref)
    assert dev.copies() == []


# --- lifetimes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("double_buffering", [False, True])
def test_no_cycles_and_memory_back_to_baseline(double_buffering):
    layers, x = make_layers(4, aux=True), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4, double_buffering=double_buffering)
    handler = ctx.offload_handler
    watch = ActivationWatch(layers)
    gc.collect()
    gc.disable()
    try:
        baseline_dev = None
        for step in range(60):
            watch.clear()
            out, grads = train_step(layers, x, ctx, sync)
            if step % 20 == 0:
                assert_bit_identical(grads, ref)
            del out, grads
            assert watch.alive() == 0
            assert handler.live_records() == 0
            assert dev.live_host_buffers() == 0
            assert dev.pending_ops() == 0
            if baseline_dev is None:
                baseline_dev = dev.live_device_buffers()  # 0, or the two double-buffer sets
            assert dev.live_device_buffers() == baseline_dev
        assert baseline_dev == (16 if double_buffering else 0)
        assert gc.collect() == 0, "reference cycles were created"
    finally:
        gc.enable()
        watch.remove()


def test_exception_inside_context_leaves_nothing_behind():
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4)
    handler = ctx.offload_handler

    class Boom(RuntimeError):
        pass

    def failing(i, out):
        if i == 2:
            raise Boom()

    gc.disable()
    try:
        watch = ActivationWatch(layers)
        with pytest.raises(Boom):
            with ctx:
                h = layers[0](x)
                raise Boom()
        with pytest.raises(Boom):
            for i, layer in enumerate(layers):
                with ctx:
                    x1 = layer(x if i == 0 else h)
                    failing(i, x1)
                h = sync(x1)
        assert top_saved_tensors_hooks() is None
        assert not is_cpu_offload_enabled()
        assert handler.live_records() == 0 and handler.current_group == 0
        del h, x1
        assert watch.alive() == 0
        assert dev.live_host_buffers() == 0 and dev.live_device_buffers() == 0
        watch.remove()
    finally:
        gc.enable()
    n_copies = len(dev.copies())
    train_step(layers, x)  # outside the context: nothing packed
    assert len(dev.copies()) == n_copies
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)


def run_with_hook_after_sync(layers, x, ctx, sync, hook):
    """``run_layers`` with ``hook`` on the first layer's output after its sync function, so that
    a hook that raises stops backward before that group commit: the step is left half done.
    Returns the output and the hook's handle."""
    h, handle = x, None
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if i == 0:
            handle = h.register_hook(hook)
    return h, handle


def test_a_graph_outliving_a_failed_backward_holds_no_reload_buffer():
    """A backward raised after a group's reload was queued, and its graph outlives the step
    (kept here with ``retain_graph``; torch 2.6 keeps one so itself after a checkpointed
    ``autograd.Function``, the fuzzer's seed 1070147): the next step's first entry lets go of
    the reload buffers, and the old graph still backwards exactly, reloading on demand."""
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4, double_buffering=False)  # reload buffers of its own

    class Boom(RuntimeError):
        pass

    def boom(grad):
        raise Boom()

    zero_grads(layers, x)
    h, hook = run_with_hook_after_sync(layers, x, ctx, sync, boom)
    old = loss_of(h)
    with pytest.raises(Boom):
        old.backward(retain_graph=True)
    assert dev.live_device_buffers() > 0  # the reload buffers, held by the graph's records
    hook.remove()
    new = run_layers(layers, x, ctx, sync)  # a new step: the failed one is abandoned
    assert dev.live_device_buffers() == 0
    zero_grads(layers, x)
    loss_of(new).backward()
    assert_bit_identical(grads_of(layers, x), ref)
    zero_grads(layers, x)
    old.backward()  # the old graph, after all
    assert_bit_identical(grads_of(layers, x), ref)


def test_a_graph_dropped_after_a_failed_backward_frees_its_reload_buffers_at_once():
    """The handler's list of what it reloaded in the step is weak: dropping the graph of a
    backward that raised frees its reload buffers then, not at the next step."""
    layers, x = make_layers(4), make_input()
    ctx, sync, dev = v1_context(2, 4, double_buffering=False)

    def boom(grad):
        raise RuntimeError("boom")

    h, _ = run_with_hook_after_sync(layers, x, ctx, sync, boom)
    loss = loss_of(h)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert dev.live_device_buffers() > 0
    del loss, h
    assert dev.live_device_buffers() == 0


def test_no_grad_forward():
    layers, x = make_layers(4), make_input()
    ref_out, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4)
    with torch.no_grad():
        out = run_layers(layers, x, ctx, sync)
    assert torch.equal(out, ref_out)
    assert ctx.offload_handler.current_group == 0 and dev.copies() == []
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)


@pytest.mark.parametrize("double_buffering", [False, True])
def test_retain_graph_double_backward(double_buffering):
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x, backwards=2)
    ctx, sync, dev = v1_context(2, 4, double_buffering=double_buffering)
    for _ in range(2):
        assert_bit_identical(train_step(layers, x, ctx, sync, backwards=2)[1], ref)


def test_retained_graph_survives_refilled_double_buffers():
    """A graph kept across a later step: its reloads lived in the double buffers, which the later
    step refilled; its next backward must notice and reload from its own host copies."""
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4, double_buffering=True)
    zero_grads(layers, x)
    kept = loss_of(run_layers(layers, x, ctx, sync))
    kept.backward(retain_graph=True)
    assert_bit_identical(grads_of(layers, x), ref)
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)  # refills both buffer sets
    assert dev.copies("compute") == []
    for _ in range(2):
        zero_grads(layers, x)
        kept.backward(retain_graph=True)
        assert_bit_identical(grads_of(layers, x), ref)
    assert dev.copies("compute"), "stale double-buffer reloads were not detected"


def test_autograd_grad_full_and_partial():
    layers, x = make_layers(4), make_input()
    params = list(layers.parameters())
    ref = torch.autograd.grad(loss_of(run_layers(layers, x)), [x, *params])
    ctx, sync, dev = v1_context(2, 4)
    got = torch.autograd.grad(loss_of(run_layers(layers, x, ctx, sync)), [x, *params])
    assert all(torch.equal(a, b) for a, b in zip(got, ref))

    # Partial backward: only down to layer 2's input; the rest of the graph is never reached.
    mids = []
    out = run_layers(layers, x, on_layer=lambda i, o: mids.append(o))
    ref_mid = torch.autograd.grad(loss_of(out), mids[1])[0]
    mids = []
    out = run_layers(layers, x, ctx, sync, on_layer=lambda i, o: mids.append(o))
    assert torch.equal(torch.autograd.grad(loss_of(out), mids[1])[0], ref_mid)
    assert ctx.offload_handler.live_records() == 0  # closed by the end-of-backward callback
    del out, mids
    grads = train_step(layers, x, ctx, sync)[1]  # the next step is not disturbed
    assert torch.equal(grads.pop("<input>"), ref[0])
    assert all(torch.equal(g, r) for g, r in zip(grads.values(), ref[1:]))


def test_more_layers_than_model_layers_warns_and_stays_correct():
    layers, x = make_layers(6), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(1, 3)
    with pytest.warns(UserWarning, match="pass model_layers="):
        assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)


def test_tensors_that_never_reach_backward():
    layers, x = make_layers(4, aux=True), make_input()
    _, ref = train_step(layers, x)
    ctx, sync, dev = v1_context(2, 4)
    watch = ActivationWatch(layers)
    gc.disable()
    try:
        run_layers(layers, x, ctx, sync)  # forward whose graph is dropped at once
        assert watch.alive() == 0
        watch.clear()
        assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)  # next step drops the rest
        assert watch.alive() == 0
        assert ctx.offload_handler.live_records() == 0
        assert dev.live_host_buffers() == 0 and dev.live_device_buffers() == 0
    finally:
        gc.enable()
        watch.remove()


def test_backward_of_an_earlier_graph_after_a_new_forward():
    layers, x = make_layers(3), make_input()
    ref_out = run_layers(layers, x)
    ref = torch.autograd.grad(loss_of(ref_out), x)[0]
    ctx, sync, dev = v1_context(1, 3)
    first = run_layers(layers, x, ctx, sync)
    with pytest.warns(UserWarning, match="model_layers=3"):
        second = run_layers(layers, x, ctx, sync)
    assert torch.equal(torch.autograd.grad(loss_of(first), x)[0], ref)
    assert torch.equal(torch.autograd.grad(loss_of(second), x)[0], ref)


class InplaceAfterSave(nn.Module):
    def forward(self, x):
        a = x * 2
        mark_activation_offload(a)
        y = a.sin()
        with torch.no_grad():
            a.add_(1)  # invalidates what sin saved
        return y


def test_inplace_modification_after_save_raises_like_autograd():
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        InplaceAfterSave()(x).sum().backward()  # autograd's own error, for reference
    for k in (1, 0):  # offloaded and kept
        layers = nn.ModuleList(InplaceAfterSave() for _ in range(2))
        ctx, sync, dev = v1_context(k, 2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run_layers(layers, x, ctx, sync).sum().backward()


def test_inplace_after_release_is_still_detected():
    x = torch.randn(5, requires_grad=True)
    keep = []

    class Saver(nn.Module):
        def forward(self, x):
            a = x * 2
            mark_activation_offload(a)
            keep.append(a)
            return a.sin()

    layers = nn.ModuleList(Saver() for _ in range(3))
    ctx, sync, dev = v1_context(1, 3)
    out = run_layers(layers, x, ctx, sync)  # group 0 released at window 2
    with torch.no_grad():
        keep[0].mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


# --- API and configuration ---------------------------------------------------------------------


def test_config_errors_and_warnings():
    with pytest.raises(OffloadConfigError, match="offload_activations=True"):
        get_cpu_offload_context(enabled=True, offload_activations=False, offload_weights=False)
    assert issubclass(OffloadConfigError, ValueError)
    with pytest.warns(DeprecationWarning, match="has no effect"):
        ctx, sync = get_cpu_offload_context(
            enabled=True, num_layers=1, model_layers=2, offload_weights=True,
            offload_activations=False,
        )
    t = torch.randn(2)
    assert isinstance(ctx, nullcontext) and sync(t) is t
    with pytest.warns(DeprecationWarning):
        ctx, _ = get_cpu_offload_context(
            enabled=True, num_layers=1, model_layers=2, offload_weights=True,
            device=TrackingSimDevice(),
        )
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    for k, n, match in [
        (2, 2, "smaller than model_layers"),
        (3, 2, "smaller than model_layers"),
        (1, 1, "smaller than model_layers"),
        (-1, 3, "num_layers"),
        (None, 3, "num_layers"),
        (1.5, 3, "num_layers"),
        (1, 0, "model_layers"),
    ]:
        with pytest.raises(OffloadConfigError, match=match):
            get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n,
                                    device=TrackingSimDevice())
    ctx, sync = get_cpu_offload_context(enabled=False, num_layers=5, model_layers=1)
    assert isinstance(ctx, nullcontext) and sync(t) is t


def test_facade_selects_v1_and_passes_device():
    dev = TrackingSimDevice()
    ctx, sync = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=dev
    )
    assert isinstance(ctx, CpuOffloadHookWithOffloadHandler)
    assert ctx.offload_handler.device is dev
    t = torch.randn(3)
    cpu_offload.mark_activation_offload(t)
    assert t.activation_offloading


def test_global_queries():
    ctx, sync, dev = v1_context(1, 3)
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append((is_cpu_offload_enabled(), is_current_layer_offloaded()))
            return x * 2

    assert not is_cpu_offload_enabled() and not is_current_layer_offloaded()
    run_layers(nn.ModuleList(Probe() for _ in range(3)), torch.randn(2, requires_grad=True),
               ctx, sync)
    assert seen == [(True, True), (True, False), (True, False)]
    assert not is_cpu_offload_enabled()
    assert top_saved_tensors_hooks() is None


def test_nested_contexts_restore_state():
    outer, _, _ = v1_context(1, 3)
    inner, _, _ = v1_context(1, 3)
    with outer:
        with inner:
            assert is_cpu_offload_enabled()
        assert is_cpu_offload_enabled()
        assert top_saved_tensors_hooks() is not None
    assert not is_cpu_offload_enabled() and top_saved_tensors_hooks() is None


def test_synchronized_handler():
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x)
    dev = TrackingSimDevice()
    handler = SynchronizedGroupOffloadHandler(
        num_offload_group=2,
        tensor_need_offloading_checker=lambda t: getattr(t, "activation_offloading", False),
        device=dev,
    )
    ctx = CpuOffloadHookWithOffloadHandler(handler)
    sync = lambda t: group_prefetch_offload_commit(t, handler)  # noqa: E731
    for _ in range(2):
        assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)
        assert handler.current_group == 0 and handler.live_records() == 0
    assert dev.copies("compute") and not dev.copies("side1")


def test_base_classes_raise_not_implemented():
    with pytest.raises(NotImplementedError):
        OffloadHandler().tensor_push(torch.randn(1))
    with pytest.raises(NotImplementedError):
        OffloadHandler().tensor_pop(None)
    with pytest.raises(NotImplementedError):
        with CpuOffloadSavedTensorHook():
            torch.randn(2, requires_grad=True).exp()
    assert top_saved_tensors_hooks() is None


def test_async_handler_direct_use_and_tags():
    dev = TrackingSimDevice()
    handler = AsyncDoubleBufferGroupOffloadHandler(1, 2, device=dev)
    ctx = CpuOffloadHookWithOffloadHandler(handler, handler_extra_kwargs={})
    tags = []
    orig_push = handler.tensor_push

    def push(t, **kw):
        packed = orig_push(t, **kw)
        tags.append(packed.tag)
        return packed

    handler.tensor_push = push
    x = torch.randn(4, requires_grad=True)
    with ctx:
        y = x.sin().cos()
    y = group_prefetch_offload_commit(y, handler)
    with ctx:
        z = y.exp()
    z = group_prefetch_offload_commit(z, handler)
    z.sum().backward()
    assert tags == [(0, 0), (0, 1), (1, 0)]
    assert torch.allclose(x.grad, (x.sin().cos().exp() * -x.sin().sin() * x.cos()))


def test_sim_hazard_is_reported_when_freeing_under_a_copy():
    """The device buffer of a group is only dropped after compute waited for its copy."""
    dev = TrackingSimDevice()
    buf = dev.alloc_device(8, torch.device("cpu"))
    s = dev.new_stream()
    dev.copy(s, dev.alloc_host(8), buf)
    with pytest.raises(SimulatedHazard):
        dev.will_free(buf)


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("double_buffering", [False, True])
def test_gpu_bit_identical_and_memory(deterministic, double_buffering):
    kw = dict(device="cuda", dtype=torch.bfloat16)
    layers = make_layers(6, hidden=256, heads=4, seq=128, **kw)
    x = make_input(batch=2, seq=128, hidden=256, **kw)
    ref_out, ref = train_step(layers, x)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=6, double_buffering=double_buffering
    )
    gc.collect()
    gc.disable()
    try:
        train_step(layers, x, ctx, sync)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(20):
            out, grads = train_step(layers, x, ctx, sync)
            assert torch.equal(out, ref_out)
            assert_bit_identical(grads, ref)
            del out, grads
            torch.cuda.synchronize()
            assert torch.cuda.memory_allocated() == base
    finally:
        gc.enable()


@pytest.mark.gpu
@cuda
def test_gpu_offload_lowers_peak_memory():
    kw = dict(device="cuda", dtype=torch.bfloat16)
    layers = make_layers(6, hidden=512, heads=8, seq=512, **kw)
    x = make_input(batch=2, seq=512, hidden=512, **kw)

    def peak(ctx=None, sync=None):
        train_step(layers, x, ctx, sync)
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = run_layers(layers, x, ctx, sync)
        loss_of(out).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=6)
    assert peak(ctx, sync) < 0.8 * peak()
