"""V2 on the simulated device: numerics, schedule, memory lifetime, error paths.

The simulated device defers side-stream copies until something waits for them and fills fresh
"device" buffers with a poison pattern, so a missing wait shows up here as wrong gradients.
"""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from cpu_offload import (
    OffloadUsageError,
    SimulatedDevice,
    get_cpu_offload_context,
    is_cpu_offload_enabled,
    mark_not_offload,
    start_offload,
)
from cpu_offload.compat import OutOfMemoryError, top_saved_tensors_hooks
from cpu_offload.core.simulated import SimulatedHazard
from cpu_offload.examples.gpt import GPTBlock, build_model, make_input, run_layers
from cpu_offload.v2.schedule import Schedule
from _support import gpt_cuda
from _support.parity_models import EXPECTED_WARNINGS, allocated_bytes, cyclic_garbage

pytestmark = EXPECTED_WARNINGS  # see parity_models

HIDDEN, HEADS = 32, 4


def make_layers(n: int, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList([GPTBlock(HIDDEN, HEADS) for _ in range(n)])


def run_step(layers, x0, ctx, sync, loss_fn=lambda y: y.square().sum()):
    """One training step with the library's usage pattern; returns output and all grads."""
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    h = run_layers(layers, x, ctx, sync)
    loss_fn(h).backward()
    return h.detach(), x.grad, [p.grad for p in layers.parameters()]


def assert_same(a, b):
    out_a, xg_a, grads_a = a
    out_b, xg_b, grads_b = b
    assert torch.equal(out_a, out_b)
    assert torch.equal(xg_a, xg_b)
    assert len(grads_a) == len(grads_b)
    for ga, gb in zip(grads_a, grads_b):
        assert torch.equal(ga, gb)


def offload_ctx(sim, k, n, **kw):
    kw.setdefault("min_tensor_size_to_offload", 0)
    return get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=sim, **kw)


def assert_release_wait_needed(sim, monkeypatch, step):
    """With only the release's per-layer wait (``compute_wait``) removed, ``step()`` frees
    device memory while its copy to the host is still queued, and the simulation says so."""

    def no_wait(event, waits=None, milestone=None):
        if milestone is not None:
            sim.trace(*milestone)

    monkeypatch.setattr(sim, "compute_wait", no_wait)
    with pytest.raises(SimulatedHazard, match="freed while a copy queued"):
        step()


def forward_copies(log):
    """The device-to-host copies a step's forward queued, and the copy stream's waits for
    compute (one per batch of copies), from a ``SimulatedDevice`` log of the step."""
    forward = log[:log.index(("bwd", 3))]
    d2h = [e for e in forward if e[0] == "copy" and e[3] == "d2h"]
    return d2h, [e for e in forward if e[:3] == ("wait", "side1", "compute")]


class BusyLink(SimulatedDevice):
    """A simulated device whose link is busy always, or every other time it is asked."""

    def __init__(self, every_other: bool = False):
        super().__init__()
        self.every_other = every_other
        self.queries = 0

    def link_busy(self, event):
        self.queries += 1
        return not self.every_other or self.queries % 2 == 0


@pytest.fixture
def x0():
    torch.manual_seed(1)
    return torch.randn(2, 16, HIDDEN)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
def test_gradients_bit_identical_to_no_offload(sim, x0, k):
    layers = make_layers(5)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    ctx, sync = offload_ctx(sim, k, 5)
    for _ in range(3):
        assert_same(run_step(layers, x0, ctx, sync), ref)
    copies = [e for e in sim.log if e[0] == "copy"]
    assert bool(copies) == (k > 0)


def test_missing_reload_wait_would_corrupt_gradients(sim, x0, monkeypatch):
    """The simulation catches a missing per-layer wait at unpack: the reloaded buffer is read
    (and dropped) before its copy ran."""
    from cpu_offload.v2 import layer_state

    layers = make_layers(4)

    def no_wait(entry):
        entry.reload_wait[0] = None  # as if waited: freeing the reload then makes no wait either

    monkeypatch.setattr(layer_state.Entry, "wait_reload", no_wait)
    with pytest.raises(SimulatedHazard, match="dropped before the copy was waited for"):
        run_step(layers, x0, *offload_ctx(sim, 2, 4))


def test_missing_offload_wait_is_a_hazard(x0, monkeypatch):
    """The simulation catches a release that does not wait for the layer's offload event: the
    device memory would be freed while its copy to the host is still queued."""
    from cpu_offload.v2 import layer_state

    def release_without_wait(layer, recheck=False):
        if layer.released:
            return
        for entry in layer.entries:
            if entry.storage is not None:
                entry.release(recheck)
        layer.released = True

    layers = make_layers(4)
    sim = SimulatedDevice()  # deferred copies: they run only when something waits for them
    run_step(layers, x0, *offload_ctx(sim, 2, 4))  # exact with the wait
    monkeypatch.setattr(layer_state.LayerState, "release", release_without_wait)
    with pytest.raises(SimulatedHazard, match="freed while a copy queued"):
        run_step(layers, x0, *offload_ctx(SimulatedDevice(), 2, 4))


def test_release_whose_compute_wait_is_removed_is_a_hazard(x0, monkeypatch):
    """The per-layer wait is one device call (``compute_wait``, which also records the
    milestone): with only that wait removed from an otherwise unchanged release, the device
    memory is freed while its copy to the host is still queued, and the simulation says so."""
    layers = make_layers(4)
    sim = SimulatedDevice()
    ctx, sync = offload_ctx(sim, 2, 4)
    run_step(layers, x0, ctx, sync)  # exact with the wait

    assert_release_wait_needed(sim, monkeypatch, lambda: run_step(layers, x0, ctx, sync))


@pytest.mark.parametrize("batch", [0, 4096, 1 << 20])
def test_small_copies_are_batched_and_stay_exact(sim, x0, monkeypatch, batch):
    """Host work per saved tensor: small storages' device-to-host copies are queued together
    (one stream wait per batch), and each layer's reload ends in one event that compute waits
    for once; gradients do not change, whatever the batch size."""
    from cpu_offload.v2 import layer_state

    monkeypatch.setattr(layer_state, "BATCH_BYTES", batch)
    layers = make_layers(4)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    ctx, sync = offload_ctx(sim, 2, 4)
    for _ in range(2):
        sim.log.clear()
        assert_same(run_step(layers, x0, ctx, sync), ref)
    log = sim.log
    first_bwd = log.index(("bwd", 3))
    d2h, side_waits = forward_copies(log)
    sizes = [e[2] for e in d2h]
    assert max(sizes) < 1 << 20 and min(sizes) < 4096 <= max(sizes)  # the cases below differ
    if batch == 0:
        assert len(side_waits) == len(d2h)  # every copy on its own
    elif batch == 4096:
        assert 2 < len(side_waits) < len(d2h)  # each storage of 4096 bytes or more flushes
    else:
        assert len(side_waits) == 2  # one batch per offloaded layer, at its end
    h2d = [e for e in log[first_bwd:] if e[0] == "copy" and e[3] == "h2d"]
    reload_waits = {e[3] for e in log[first_bwd:] if e[:3] == ("wait", "compute", "side1")}
    assert 0 < len(h2d) < len(d2h)  # the caller's input is still on the device: not reloaded
    # one wait per offloaded layer (2), and the join of the copy stream when backward ends
    assert len(reload_waits) <= 3 < len(h2d)


@pytest.mark.parametrize("busy", ["always", "every other query"])
def test_large_copies_wait_for_a_later_batch_while_the_link_is_busy(x0, monkeypatch, busy):
    """While the device says the copies queued before are still running (``link_busy``), a
    large storage waits for its layer's next batch instead of being queued at once: fewer
    stream waits and host calls, the same gradients, host buffers reused whatever the timing
    (each large storage has its own), and a missing release wait still caught."""
    from cpu_offload.v2 import layer_state

    monkeypatch.setattr(layer_state, "BATCH_BYTES", 4096)  # storages from 4096 bytes are large
    layers = make_layers(4)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    sim = BusyLink(every_other=busy != "always")
    ctx, sync = offload_ctx(sim, 2, 4)
    allocs = []
    for _ in range(3):
        sim.log.clear()
        assert_same(run_step(layers, x0, ctx, sync), ref)
        allocs.append(sim.host_allocs)
    assert allocs[1] == allocs[2]  # the third step allocated no host buffer
    d2h, side_waits = forward_copies(sim.log)
    assert sim.queries > 0
    if busy == "always":
        assert len(side_waits) == 2 < len(d2h)  # one batch per offloaded layer, at its end
    else:
        assert 2 < len(side_waits) < len(d2h)

    assert_release_wait_needed(sim, monkeypatch, lambda: run_step(layers, x0, ctx, sync))


def test_a_layer_released_at_the_next_layers_start_queues_its_copies_at_once(x0, monkeypatch):
    """With 3 of 4 layers offloaded each is released when the next one starts: its copies have
    no other layer's time to finish in, so none waits for the link, even if it is busy."""
    from cpu_offload.v2 import layer_state

    monkeypatch.setattr(layer_state, "BATCH_BYTES", 0)  # every storage is large
    layers = make_layers(4)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    sim = BusyLink()
    ctx, sync = offload_ctx(sim, 3, 4)
    for _ in range(2):
        sim.log.clear()
        assert_same(run_step(layers, x0, ctx, sync), ref)
    d2h, side_waits = forward_copies(sim.log)
    assert sim.queries == 0 and len(side_waits) == len(d2h)  # every copy queued as it was saved


def test_a_storage_freed_before_its_batched_copy_is_not_copied(sim):
    """A saved tensor autograd drops inside the layer (its graph branch is discarded) leaves
    the batch before the copy is queued: nothing is copied for it, and nothing else changes."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def step(ctx, sync):
        with ctx:
            dropped = (x * 3.0).sin()  # sin saves x * 3, a storage of its own, dropped below
            del dropped
            h = (x @ w).tanh()
        h = sync(h)
        with ctx:
            out = (h * h).sum()
        sync(out).backward()
        grads = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
        return grads

    ref = step(*get_cpu_offload_context(enabled=False))
    ctx, sync = offload_ctx(sim, 1, 2)
    got = step(ctx, sync)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # Layer 0 saved x, w (a parameter of this test, offloaded: it is not an nn.Parameter), x * 3
    # and tanh's output; x * 3 died before the layer's batch was queued.
    assert len(sim.copies("d2h")) == 3
    assert ctx.stats().layer(0).offloaded_tensors == 4
    assert sim.pending_ops() == 0


def milestones_to_residency(milestones):
    """Replay the recorded fwd/bwd/release/reload order; count layers resident at each start."""
    resident, counts = set(), []
    for kind, layer in milestones:
        if kind == "fwd":
            resident.add(layer)
            counts.append(len(resident))
        elif kind == "release":
            resident.discard(layer)
        elif kind == "reload":
            resident.add(layer)
        elif kind == "bwd":
            resident.discard(layer + 1)  # the previous backward finished
            counts.append(len(resident | {layer}))
    return counts


@pytest.mark.parametrize("n, k", [(5, 2), (5, 3), (6, 4), (4, 1), (8, 6)])
def test_recorded_schedule_matches_the_default_schedule(sim, n, k):
    layers = make_layers(n)
    run_step(layers, torch.randn(2, 8, HIDDEN), *offload_ctx(sim, k, n))
    ms = sim.milestones({"fwd", "bwd", "release", "reload"})
    # Layer i is released just before forward of layer n-k+i starts...
    for i in range(k):
        assert ms[ms.index(("fwd", n - k + i)) - 1] == ("release", i)
    # ...and its reload starts once backward of layer n-k+i is over (before the next one).
    for i in range(k):
        assert ms[ms.index(("bwd", n - k + i - 1)) - 1] == ("reload", i)
    residency = milestones_to_residency(ms)
    assert max(residency) == n - k
    assert residency == Schedule.default(k, n).resident_profile()


def test_memory_returns_to_baseline_without_gc(sim, x0):
    layers = make_layers(4)
    ctx, sync = offload_ctx(sim, 2, 4)
    run_step(layers, x0, ctx, sync)
    pool = ctx.synchronizer.rt.pool
    allocations, cached = pool.allocations, pool.cached_bytes()
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            run_step(layers, x0, ctx, sync)
            assert ctx.synchronizer.held_device_bytes() == 0
            assert ctx.synchronizer.held_host_bytes() == 0
            assert sim.pending_ops() == 0
        assert pool.allocations == allocations  # host buffers reused, none allocated per step
        assert pool.cached_bytes() == cached
        assert gc.collect() == 0  # nothing was waiting for the cycle collector
    finally:
        gc.enable()


def test_saved_tensors_die_with_the_graph(sim, x0):
    """Tensors that never reach backward: dropping the graph frees their host copies."""
    layers = make_layers(3)
    ctx, sync = offload_ctx(sim, 1, 3)
    h = run_layers(layers, x0.clone().requires_grad_(), ctx, sync)
    assert ctx.synchronizer.held_host_bytes() > 0
    del h
    assert ctx.synchronizer.held_host_bytes() == 0
    assert ctx.synchronizer.held_device_bytes() == 0


def test_exception_inside_context_leaves_no_hooks_and_no_tensors(sim, x0):
    layers = make_layers(3)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    ctx, sync = offload_ctx(sim, 1, 3)
    h = x0.clone().requires_grad_()
    with ctx:
        h = layers[0](h)
    h = sync(h)
    with pytest.raises(RuntimeError, match="boom"):
        with ctx:
            layers[1](h)
            raise RuntimeError("boom")
    assert not is_cpu_offload_enabled()
    assert top_saved_tensors_hooks() is None
    assert ctx.synchronizer.held_device_bytes() == 0
    assert ctx.synchronizer.held_host_bytes() == 0
    # The partial graph from the aborted step says what happened if used...
    with pytest.raises(RuntimeError, match="interrupted by an exception"):
        h.sum().backward()
    del h
    # ...and the next step works and is exact.
    assert_same(run_step(layers, x0, ctx, sync), ref)


def test_out_of_memory_inside_context_is_cleaned_up_like_any_error(sim, x0):
    layers = make_layers(2)
    ctx, sync = offload_ctx(sim, 1, 2)
    with pytest.raises(OutOfMemoryError):
        with ctx:
            layers[0](x0.requires_grad_())
            raise OutOfMemoryError("simulated OOM")
    assert top_saved_tensors_hooks() is None
    assert ctx.synchronizer.held_host_bytes() == 0
    run_step(layers, x0.detach(), ctx, sync)


def test_retain_graph_double_backward(sim, x0):
    layers = make_layers(4)
    ctx, sync = offload_ctx(sim, 2, 4)
    x = x0.clone().requires_grad_()
    h = run_layers(layers, x, ctx, sync)
    loss = h.square().sum()
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)
    (g2,) = torch.autograd.grad(loss, x)
    assert torch.equal(g1, g2)
    x_ref = x0.clone().requires_grad_()
    h = run_layers(layers, x_ref)
    (g_ref,) = torch.autograd.grad(h.square().sum(), x_ref)
    assert torch.equal(g1, g_ref)
    assert sum(1 for e in sim.log if e == ("reload", 0)) == 2  # reloaded once per backward


def test_no_grad_forward_saves_nothing_and_training_still_works(sim, x0):
    layers = make_layers(3)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    ctx, sync = offload_ctx(sim, 1, 3)
    with torch.no_grad():
        run_layers(layers, x0, ctx, sync)
    assert not [e for e in sim.log if e[0] == "copy"]
    assert_same(run_step(layers, x0, ctx, sync), ref)


def test_partial_backward_with_autograd_grad(sim, x0):
    """Backward to an intermediate tensor only: unreached layers keep their state, none leaks."""
    layers = make_layers(4)
    ctx, sync = offload_ctx(sim, 2, 4)
    h = x0.clone().requires_grad_()
    outs = []
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
        outs.append(h)
    (g,) = torch.autograd.grad(outs[-1].sum(), outs[1])
    ref_h = outs[1].detach().requires_grad_()
    r = ref_h
    for layer in layers[2:]:
        r = layer(r)
    (g_ref,) = torch.autograd.grad(r.sum(), ref_h)
    assert torch.equal(g, g_ref)
    del outs, h
    assert ctx.synchronizer.held_host_bytes() == 0


def test_views_share_a_base_and_keep_geometry(sim):
    """q, k, v views of one qkv storage are offloaded once and restored as views of one base."""
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            ctx.save_for_backward(*ts)
            return ts[0].sum() + sum(t.sum() for t in ts[1:])

        @staticmethod
        def backward(ctx, g):
            saved = ctx.saved_tensors
            seen["saved"] = saved
            return tuple(torch.ones_like(t) * g for t in saved)

    base = torch.randn(2, 8, 3 * 16, requires_grad=True)
    qkv = base * 1.0
    q, k, v = qkv.view(2, 8, 3, 4, 4).permute(2, 0, 3, 1, 4)
    merged = q.transpose(1, 2).reshape(2, 8, 16)  # still a view of qkv: heads*dim merge
    weird = qkv.transpose(0, 2)[1::2]  # non-contiguous, offset view
    own = (qkv + 1).transpose(1, 2)  # another storage
    tensors = (q, k, v, q, merged, weird, own)
    ctx, sync = offload_ctx(sim, 1, 2)
    with ctx:
        y = Probe.apply(*tensors)
    y = sync(y)
    with ctx:
        y = y * 2
    y = sync(y)
    copies = [e for e in sim.log if e[0] == "copy"]
    assert len(copies) == 2  # the qkv storage once for six views, the other storage once
    expected = [(t.clone(), t.shape, t.stride(), t.storage_offset(), t.dtype) for t in tensors]
    del qkv, q, k, v, merged, weird, own, tensors  # only the saved copies remain: reloaded
    y.backward()
    restored = seen["saved"]
    assert len(sim.copies("h2d")) == 2
    for (value, shape, stride, offset, dtype), back in zip(expected, restored):
        assert back.shape == shape and back.stride() == stride
        assert back.storage_offset() == offset and back.dtype == dtype
        assert torch.equal(back, value)
    storages = {t.untyped_storage().data_ptr() for t in restored[:6]}
    assert len(storages) == 1


def test_contiguous_view_of_non_contiguous_base_round_trips(sim):
    """SDPA output -> transpose().reshape(): the case a reference implementation gets wrong."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    w = torch.randn(64, 64, requires_grad=True)

    def block(q, k, v):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        flat = a.transpose(1, 2).reshape(2, 8, 64)  # a view of a permuted-contiguous output
        return (flat @ w).tanh()

    ref = torch.autograd.grad(block(q, k, v).sum(), (q, k, v, w))
    ctx, sync = offload_ctx(sim, 1, 2)
    with ctx:
        y = block(q, k, v)
    y = sync(y)
    with ctx:
        y = y * 1
    y = sync(y)
    got = torch.autograd.grad(y.sum(), (q, k, v, w))
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
     torch.float8_e4m3fn, torch.int8, torch.bool, torch.uint8, torch.int64],
)
def test_any_dtype_restores_exactly(sim, dtype):
    captured = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, payload):
            ctx.save_for_backward(payload)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (captured["back"],) = ctx.saved_tensors
            return g * 2, None

    payload = (torch.randn(4, 6) * 10).to(dtype).t()
    x = torch.randn(3, requires_grad=True)
    ctx, sync = offload_ctx(sim, 1, 2)
    with ctx:
        y = Keep.apply(x, payload)
    y = sync(y)
    with ctx:
        y = y + 0
    y = sync(y)
    y.sum().backward()
    back = captured["back"]
    assert back.dtype == dtype and back.stride() == payload.stride()
    assert torch.equal(back.contiguous().view(torch.uint8), payload.contiguous().view(torch.uint8))


def test_mark_not_offload_parameters_and_small_tensors_stay(sim, x0):
    layer = torch.nn.Linear(HIDDEN, HIDDEN)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=sim, min_tensor_size_to_offload=100
    )
    a = torch.randn(4, HIDDEN, requires_grad=True) * 1  # 128 elements: offloaded
    b = torch.randn(4, HIDDEN, requires_grad=True) * 1  # marked: kept
    c = torch.randn(2, 4, requires_grad=True) * 1  # 8 elements: too small
    mark_not_offload(b)
    with ctx:
        y = (layer(a) * b).sum() + (c * c).sum()  # Linear saves a and its weight (a Parameter)
    y = sync(y)
    with ctx:
        y = y * 1
    sync(y)
    sizes = sorted(e[2] for e in sim.log if e[0] == "copy")
    assert sizes == [4 * HIDDEN * 4, 4 * HIDDEN * 4]  # a, and layer(a) saved by the multiply


def test_start_offload_lets_copy_wait_on_an_earlier_point(sim):
    ctx, sync = offload_ctx(sim, 1, 2)
    x = torch.randn(64, requires_grad=True)
    with ctx:
        h = x * 3
        start_offload(h)
        event = h._cpu_offload_ready_event
        y = h.sin()
    assert ("wait", "side1", "compute", event.seq) in sim.log
    y = sync(y)
    with ctx:
        y = y * 1
    sync(y).sum().backward()
    assert torch.equal(x.grad, 3 * (x * 3).cos())


def test_in_place_change_after_save_raises_like_autograd(sim):
    ctx, sync = offload_ctx(sim, 1, 3)
    x = torch.randn(16, requires_grad=True)
    with ctx:
        h = x * 2
        y = h.exp()  # saves its output
        y.mul_(3)  # autograd would refuse this in backward
    y = sync(y)
    for _ in range(2):
        with ctx:
            y = y * 1
        y = sync(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_manual_synchronization(sim, x0):
    layers = make_layers(4)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    stream = sim.new_stream()
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=4, manual_synchronization=True, offload_stream=stream,
        min_tensor_size_to_offload=0, device=sim,
    )
    assert manual.offload_stream is stream
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if i < 2:  # layers 2 and 3 are simply not offloaded
            manual.start_offload_layer(i)
    for i in range(2):
        manual.release_activation_forward_gpu_memory(i)
    assert ctx.synchronizer.step.layers[0].held_device_bytes() == 0
    for i in range(2):
        manual.start_reload_layer(i)
    h.square().sum().backward()
    assert_same((h.detach(), x.grad, [p.grad for p in layers.parameters()]), ref)
    with pytest.raises(OffloadUsageError, match="does not name a layer"):
        manual.start_reload_layer(7)


def test_manual_release_before_offload_is_refused(sim, x0):
    layers = make_layers(2)
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=2, manual_synchronization=True, min_tensor_size_to_offload=0,
        device=sim,
    )
    with ctx:
        h = layers[0](x0.requires_grad_())
    sync(h)
    with pytest.raises(OffloadUsageError, match="start_offload_layer"):
        manual.release_activation_forward_gpu_memory(0)


def test_custom_synchronization_dict(sim, x0):
    """Layer 1 only; released when layer 3 starts forward, reloaded at the first backward."""
    layers = make_layers(4)
    ref = run_step(layers, x0, *get_cpu_offload_context(enabled=False))
    ctx, sync = get_cpu_offload_context(
        enabled=True, model_layers=4, synchronization_dict={1: (True, 4, False, 1)},
        min_tensor_size_to_offload=0, device=sim,
    )
    assert_same(run_step(layers, x0, ctx, sync), ref)
    ms = sim.milestones({"fwd", "bwd", "release", "reload"})
    assert ms == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("release", 1), ("fwd", 3), ("reload", 1),
                  ("bwd", 3), ("bwd", 2), ("bwd", 1), ("bwd", 0)]


def test_retained_pinned_buffers_are_stable_across_steps(sim, x0):
    layers = make_layers(3)
    ctx, sync = offload_ctx(sim, 1, 3, retain_pinned_cpu_buffers=True)
    pool = ctx.synchronizer.rt.pool
    run_step(layers, x0, ctx, sync)
    first = {k: v.data_ptr() for k, v in pool._retained.items()}
    for _ in range(3):
        run_step(layers, x0, ctx, sync)
    assert {k: v.data_ptr() for k, v in pool._retained.items()} == first
    assert pool.cached_bytes() == 0


def test_model_layers_mismatch_is_reported(sim, x0):
    layers = make_layers(3)
    ctx, sync = offload_ctx(sim, 1, 4)
    h = run_layers(layers, x0.clone().requires_grad_(), ctx, sync)
    with pytest.raises(OffloadUsageError, match="model_layers=4"):
        h.sum().backward()


def test_entering_twice_without_sync_and_nesting_are_refused(sim):
    ctx, sync = offload_ctx(sim, 1, 3)
    with ctx:
        pass
    with pytest.raises(OffloadUsageError, match="without calling the sync function"):
        with ctx:
            pass
    ctx, sync = offload_ctx(sim, 1, 3)
    with ctx:
        with pytest.raises(OffloadUsageError, match="nested"):
            with ctx:
                pass
        with pytest.raises(OffloadUsageError, match="after the `with ctx:` block"):
            sync(torch.zeros(1))


def test_wrapper_subclass_offloads_its_inner_tensors_and_rebuilds(sim):
    """Low-precision formats (``__tensor_flatten__``): inner data moves, the wrapper comes back."""
    from _support.parity_models import Scaled

    seen = {}

    class QuantMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            q = Scaled.quantize(x)
            ctx.save_for_backward(q)
            return x * q.dequantize()

        @staticmethod
        def backward(ctx, grad):
            (q,) = ctx.saved_tensors
            seen["q"] = q
            return 2 * grad * q.dequantize()

    torch.manual_seed(4)
    x = torch.randn(64, 16, requires_grad=True)
    (ref,) = torch.autograd.grad(QuantMul.apply(x).sum(), x)
    ctx, sync = offload_ctx(sim, 1, 2)
    with ctx:
        y = QuantMul.apply(x)
    y = sync(y)
    with ctx:
        y = y * 1
    y = sync(y)
    assert sim.copies() == [("copy", "side1", 64 * 16 * 2, "d2h")]  # fp16 data
    (got,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(got, ref)
    q = seen["q"]
    assert type(q) is Scaled and q._data.dtype == torch.float16 and q._scale == 0.5
    assert torch.equal(q._data, Scaled.quantize(x)._data)


# --- on CUDA (marked gpu): the GPT stack of _support/gpt_cuda.py, real streams and kernels ---


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpt_gradients_bit_identical(gpt_model, gpt_x0, k):
    ref = gpt_cuda.step(gpt_model, gpt_x0)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=k, model_layers=gpt_cuda.CFG.layers)
    for _ in range(2):
        gpt_cuda.assert_bit_identical(gpt_cuda.step(gpt_model, gpt_x0, ctx, sync), ref)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_memory_returns_to_baseline_for_200_steps_without_gc(gpt_model, gpt_x0):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=gpt_cuda.CFG.layers)
    for _ in range(2):
        gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
    torch.cuda.synchronize()
    pool = ctx.synchronizer.rt.pool
    allocations = pool.allocations
    for p in gpt_model.parameters():
        p.grad = None
    gc.collect()
    baseline = allocated_bytes()
    gc.disable()
    try:
        for _ in range(200):
            gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
            for p in gpt_model.parameters():
                p.grad = None
            assert allocated_bytes() == baseline
        assert pool.allocations == allocations  # pinned buffers reused, none allocated
        assert cyclic_garbage() == []
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_offloading_lowers_peak_memory(gpt_model, gpt_x0):
    def peak(ctx=None, sync=None):
        for p in gpt_model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    base = peak()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=4, model_layers=gpt_cuda.CFG.layers)
    peak(ctx, sync)
    assert peak(ctx, sync) < 0.75 * base


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_forward_and_backward_never_block_the_host(gpt_model, gpt_x0):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=gpt_cuda.CFG.layers)
    gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)  # warm-up: pinned buffers allocated once
    for p in gpt_model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = gpt_x0.clone().requires_grad_()
        out = gpt_model(x, ctx, sync)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_exception_inside_context_frees_everything(gpt_model, gpt_x0):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=gpt_cuda.CFG.layers)
    gpt_cuda.step(gpt_model, gpt_x0, ctx, sync)
    for p in gpt_model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()

    def failing_forward():
        x = gpt_x0.clone().requires_grad_()
        for i, layer in enumerate(gpt_model.layers):
            with ctx:
                x = layer(x)
                if i == 3:
                    raise ValueError("bad argument in layer 3")
            x = sync(x)

    with pytest.raises(ValueError, match="bad argument"):
        failing_forward()
    assert top_saved_tensors_hooks() is None
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == baseline
    ref = gpt_cuda.step(gpt_model, gpt_x0)
    gpt_cuda.assert_bit_identical(gpt_cuda.step(gpt_model, gpt_x0, ctx, sync), ref)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_in_place_modification_is_detected_on_gpu():
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=0
    )
    x = torch.randn(1 << 16, device="cuda", requires_grad=True)
    with ctx:
        y = (x * 2).exp()
        y.add_(1)
    y = sync(y)
    for _ in range(2):
        with ctx:
            y = y * 1
        y = sync(y)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_cuda_graph_capture_replays_bit_exact():
    """Whole forward+backward captured once, replayed: copies hit retained pinned buffers."""
    cfg = gpt_cuda.CFG.with_(layers=4, seq=512)
    model = build_model(cfg, device="cuda", seed=0)
    static_x = make_input(cfg, device="cuda", seed=1)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=cfg.layers, retain_pinned_cpu_buffers=True
    )

    def fwd_bwd():
        out = model(static_x, ctx, sync)
        out.float().square().mean().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up allocates and retains the pinned buffers
            for p in model.parameters():
                p.grad = None
            static_x.grad = None
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad = None
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fwd_bwd()
    static_grads = [static_x.grad] + [p.grad for p in model.parameters()]

    for seed in (5, 6):
        new_x = make_input(cfg, device="cuda", seed=seed, requires_grad=False)
        static_x.data.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        ref_x = new_x.clone().requires_grad_()
        ref_out = model(ref_x)
        ref_grads = torch.autograd.grad(
            ref_out.float().square().mean(), [ref_x, *model.parameters()]
        )
        assert torch.equal(static_out, ref_out.detach())
        for got, want in zip(static_grads, ref_grads):
            assert torch.equal(got, want)


def test_contexts_left_out_of_order_on_one_thread_leave_the_others_active():
    """The active contexts of a thread are a chain; one left before an inner one leaves the
    chain as it was without it (the innermost still names the synchronizer of the block the
    code runs in)."""
    from cpu_offload.v2.context import active_synchronizer

    contexts = [offload_ctx(SimulatedDevice(), 1, 2)[0] for _ in range(3)]
    with torch.no_grad():  # no hooks: only the chain of active contexts is exercised
        for c in contexts:
            c.__enter__()
        assert active_synchronizer() is contexts[2].synchronizer
        contexts[1].__exit__(None, None, None)
        assert active_synchronizer() is contexts[2].synchronizer
        contexts[2].__exit__(None, None, None)
        assert active_synchronizer() is contexts[0].synchronizer and is_cpu_offload_enabled()
        contexts[0].__exit__(None, None, None)
    assert active_synchronizer() is None and not is_cpu_offload_enabled()
