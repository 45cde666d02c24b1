"""Adversarial cases: each once gave silent wrong gradients, a memory hazard, a broken state or
an unclear error. One test per defect; all run on the simulated device (which defers side-stream
copies and poisons fresh device buffers, so a missing wait shows up as wrong numbers, and freeing
a buffer that a queued copy reads or writes raises ``SimulatedHazard``).
"""
from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import (
    OffloadConfigError,
    OffloadUsageError,
    SimulatedDevice,
    get_cpu_offload_context,
    mark_activation_offload,
    mark_not_offload,
    mark_weight,
)
from cpu_offload.compat import OutOfMemoryError, neg_view, top_saved_tensors_hooks
from _support.parity_models import EXPECTED_WARNINGS

pytestmark = EXPECTED_WARNINGS  # see parity_models


def ctx_for(sim, k, n, **kw):
    kw.setdefault("min_tensor_size_to_offload", 0)
    return get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n, device=sim, **kw)


def copies(sim, direction=None):
    return [e for e in sim.log if e[0] == "copy"]


class Lin(nn.Module):
    """Linear then tanh: tanh saves its output, and the next layer's Linear saves it again."""

    def __init__(self, d=8, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Sep(Lin):
    """Saves only storages of its own (its input, its exp output): layers share no storage."""

    def forward(self, x):
        return torch.exp(self.lin(x) * 0.1) * 1.0


def chain(n, d=8, cls=Lin):
    return nn.ModuleList([cls(d, seed=i) for i in range(n)])


def run(layers, x, ctx, sync, loss=lambda y: y.square().sum()):
    for p in layers.parameters():
        p.grad = None
    x = x.clone().requires_grad_()
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    loss(h).backward()
    return [x.grad] + [p.grad.clone() for p in layers.parameters()]


def reference(layers, x, loss=lambda y: y.square().sum()):
    return run(layers, x, *get_cpu_offload_context(enabled=False), loss=loss)


def assert_equal_grads(a, b):
    assert len(a) == len(b)
    for ga, gb in zip(a, b):
        assert torch.equal(ga, gb)


X = torch.randn(4, 8)


# --- 1. a reload buffer must not be freed while its host-to-device copy is queued -------------


class SkipSaved(torch.autograd.Function):
    """``y = a * b``; backward reads the saved tensors only if ``b`` needs a gradient."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        if not ctx.needs_input_grad[1]:
            return g.clone(), None  # a toy rule that ignores b: the point is skipping the unpack
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_reload_not_freed_while_its_copy_is_queued_when_backward_skips_saved_tensors(sim):
    w = torch.randn(4, 8)  # does not need grad: SkipSaved never unpacks
    lin = nn.Linear(8, 8)

    class L(nn.Module):
        def forward(self, x):
            return torch.tanh(SkipSaved.apply(lin(x), w * 1.0))

    layers = nn.ModuleList([L(), L(), L()])
    ref = reference(layers, X)
    ctx, sync = ctx_for(sim, 2, 4)
    layers.append(L())
    ref = reference(layers, X)
    for _ in range(3):  # raises SimulatedHazard if a reload buffer is dropped while written
        assert_equal_grads(run(layers, X, ctx, sync), ref)
    assert sim.copies("h2d")


def test_reload_not_freed_while_queued_after_a_backward_hook_raises(sim):
    layers = chain(5, cls=Sep)
    ctx, sync = ctx_for(sim, 3, 5)
    x = X.clone().requires_grad_()
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if i == 2:
            def boom(grad):
                raise RuntimeError("hook failed")
            h.register_hook(boom)
    loss = h.square().sum()
    with pytest.raises(RuntimeError, match="hook failed"):
        loss.backward()
    assert ("reload", 2) in sim.log and ("bwd", 2) not in sim.log  # a reload is queued
    del loss, h, x  # frees the graph: reloads that were started must be fenced first
    ref = reference(layers, X)
    assert_equal_grads(run(layers, X, ctx, sync), ref)


# --- 2. out-of-memory during a reload, then a retried backward ---------------------------------


class FailingAlloc(SimulatedDevice):
    def __init__(self):
        super().__init__()
        self.fail_at = None
        self.calls = 0

    def alloc_device(self, nbytes, device):
        self.calls += 1
        if self.fail_at is not None and self.calls == self.fail_at:
            raise OutOfMemoryError("simulated out of memory")
        return super().alloc_device(nbytes, device)


@pytest.mark.parametrize("first_backward_ok", [True, False])
@pytest.mark.parametrize("fail_at", [2, 3])  # 2: the second of two buffers of one layer
def test_oom_during_reload_then_retried_backward_is_exact(first_backward_ok, fail_at):
    sim = FailingAlloc()
    layers = chain(4)
    ref = reference(layers, X)
    ctx, sync = ctx_for(sim, 3, 4)
    for p in layers.parameters():
        p.grad = None
    x = X.clone().requires_grad_()
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    loss = h.square().sum()
    if first_backward_ok:
        loss.backward(retain_graph=True)
        for p in layers.parameters():
            p.grad = None
        x.grad = None
    sim.calls, sim.fail_at = 0, fail_at
    with pytest.raises(OutOfMemoryError):
        loss.backward(retain_graph=True)
    sim.fail_at = None
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    loss.backward()
    assert_equal_grads([x.grad] + [p.grad for p in layers.parameters()], ref)
    # And the context keeps working.
    assert_equal_grads(run(layers, X, ctx, sync), ref)


# --- 3. retained pinned buffers must never be shared by two forwards in flight -----------------


def test_retained_pinned_buffers_with_two_forwards_in_flight(sim):
    layers = chain(3)
    ctx, sync = ctx_for(sim, 2, 3, retain_pinned_cpu_buffers=True)

    def fwd(x):
        h = x
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        return h.square().sum()

    xa = torch.randn(4, 8)
    la = fwd(xa)
    with pytest.raises(OffloadUsageError, match="retain_pinned_cpu_buffers"):
        fwd(torch.randn(4, 8))
    la.backward()  # the first step is unharmed
    # After the first step's backward, the buffers are free again.
    ref = reference(layers, X)
    assert_equal_grads(run(layers, X, ctx, sync), ref)


# --- 4. conj and neg bits survive the round trip ------------------------------------------------


def test_conj_and_neg_bits_survive(backend):
    sim = SimulatedDevice()
    w = torch.randn(6, dtype=torch.complex64, requires_grad=True)

    class Conj(nn.Module):
        def forward(self, x):
            c = x.conj()  # conj bit set: mul saves the conj view
            mark_activation_offload(c)
            out = c * w
            n = neg_view(out)  # neg bit set
            mark_activation_offload(n)
            return (n * w).real.sum(-1, keepdim=True) * x

    layers = nn.ModuleList([Conj(), Conj()])
    x0 = torch.randn(3, 6, dtype=torch.complex64)

    def step(ctx, sync):
        w.grad = None
        h = x0.clone().requires_grad_()
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
        h.abs().sum().backward()
        return w.grad.clone()

    ref = step(*get_cpu_offload_context(enabled=False))
    kw = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    got = step(*get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=sim, **kw))
    assert copies(sim)
    assert torch.equal(got, ref)


# --- 5. in-place change after release is detected -----------------------------------------------


def test_inplace_change_after_release_raises(sim):
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    layers = nn.ModuleList([Exp(), Exp(), Exp()])
    ctx, sync = ctx_for(sim, 1, 3)
    x = torch.randn(4, 8, requires_grad=True)
    outs = []
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
        outs.append(h)
    assert any(e == ("release", 0) for e in sim.log)
    with torch.no_grad():
        outs[0].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


def test_inplace_change_after_release_then_tensor_dropped_still_raises(sim):
    class Exp(nn.Module):
        def forward(self, x):
            return torch.exp(x)

    layers = nn.ModuleList([Exp(), Exp(), Exp()])
    ctx, sync = ctx_for(sim, 1, 3)
    x = torch.randn(4, 8, requires_grad=True)
    with ctx:
        h0 = layers[0](x)
    h0 = sync(h0)
    h = h0
    for layer in layers[1:]:
        with ctx:
            h = layer(h)
        h = sync(h)
    with torch.no_grad():
        h0.mul_(2)
    del h0  # modified, then the last Python reference is gone: still a stale saved value
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        h.sum().backward()


# --- 6. a context recovers after a bad step -----------------------------------------------------


# Under V1 nothing here is tagged, so nothing is offloaded and V1 says so: the point is the state.
@pytest.mark.filterwarnings("ignore:cpu_offload \\(V1\\).*none is tagged:UserWarning")
def test_exception_between_layers_then_correct_steps_work(backend):
    sim = SimulatedDevice()
    layers = chain(3)
    ref = reference(layers, X)
    kw = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, device=sim, **kw)
    with pytest.raises(ValueError):
        h = X.clone().requires_grad_()
        with ctx:
            h = layers[0](h)
        h = sync(h)
        raise ValueError("data loader broke between layers")
    del h
    for _ in range(2):
        assert_equal_grads(run(layers, X, ctx, sync), ref)


def test_step_with_wrong_layer_count_then_correct_steps_work():
    sim = SimulatedDevice()
    layers = chain(3)
    ref = reference(layers, X)
    ctx, sync = ctx_for(sim, 1, 3)
    with pytest.raises(OffloadUsageError, match="model_layers"):
        run(layers[:2], X, ctx, sync)
    for _ in range(2):
        assert_equal_grads(run(layers, X, ctx, sync), ref)


def test_entered_twice_error_then_fresh_step_works(backend):
    sim = SimulatedDevice()
    layers = chain(3)
    for layer in layers:  # V1 offloads tagged tensors only
        layer.register_forward_pre_hook(lambda m, a: mark_activation_offload(*a))
    ref = reference(layers, X)
    kw = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=3, device=sim, **kw)
    h = X.clone().requires_grad_()
    with ctx:
        h = layers[0](h)
    with pytest.raises(OffloadUsageError, match="sync function"):
        with ctx:
            layers[1](h)
    del h
    # The user restarts the step from scratch.
    for _ in range(2):
        assert_equal_grads(run(layers, X, ctx, sync), ref)
    assert copies(sim)


# --- 7. torch.utils.checkpoint around each layer's `with ctx:` ----------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_around_the_context(backend, reentrant):
    from torch.utils.checkpoint import checkpoint

    sim = SimulatedDevice()
    layers = chain(4)
    ref = reference(layers, X)
    kw = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, device=sim, **kw)

    def body(layer, h):
        mark_activation_offload(h)
        with ctx:
            return layer(h)

    for _ in range(2):
        for p in layers.parameters():
            p.grad = None
        x = X.clone().requires_grad_()
        h = x
        for i, layer in enumerate(layers):
            if i % 2 == 0:
                h = checkpoint(body, layer, h, use_reentrant=reentrant)
            else:
                h = body(layer, h)
            h = sync(h)
        h.square().sum().backward()
        assert_equal_grads([x.grad] + [p.grad for p in layers.parameters()], ref)


# --- 8. sparse saved tensors stay on the device --------------------------------------------------


def test_sparse_saved_tensor_is_kept(sim):
    n = 64
    idx = torch.randint(0, n, (2, 300))
    adj = torch.sparse_coo_tensor(idx, torch.rand(300), (n, n), check_invariants=True).coalesce()

    class GCN(nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

        def forward(self, x):
            return torch.tanh(torch.sparse.mm(adj, x @ self.w))

    layers = nn.ModuleList([GCN(0), GCN(1), GCN(2)])
    x0 = torch.randn(n, 8)
    ref = reference(layers, x0)
    got = run(layers, x0, *ctx_for(sim, 2, 3))
    assert copies(sim)
    assert_equal_grads(got, ref)


# --- 9. torch.autograd.grad through earlier layers in mid-forward -------------------------------


def test_autograd_grad_mid_forward(sim):
    layers = chain(4)

    def step(ctx, sync):
        for p in layers.parameters():
            p.grad = None
        x = X.clone().requires_grad_()
        h = x
        penalty = 0
        for i, layer in enumerate(layers):
            with ctx:
                h = layer(h)
            h = sync(h)
            if i == 1:  # physics-informed: d h / d x enters the loss
                (g,) = torch.autograd.grad(h.sum(), x, create_graph=True)
                penalty = g.square().sum()
        (h.square().sum() + penalty).backward()
        return [x.grad] + [p.grad.clone() for p in layers.parameters()]

    ref = step(*get_cpu_offload_context(enabled=False))
    ctx, sync = ctx_for(sim, 2, 4)
    for _ in range(2):
        assert_equal_grads(step(ctx, sync), ref)
    assert copies(sim)


# --- 10. no spurious in-place error for a saved tensor that backward never reads ---------------


def test_no_spurious_inplace_error_for_unused_saved_tensor(sim):
    class Aux(nn.Module):
        def __init__(self, seed):
            super().__init__()
            torch.manual_seed(seed)
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            self.aux = h.pow(2).mean()  # saves h; never reaches backward
            torch.relu_(h)  # saves h again (its output), at a newer version
            return h

    layers = nn.ModuleList([Aux(0), Aux(1), Aux(2)])
    ref = reference(layers, X)
    got = run(layers, X, *ctx_for(sim, 2, 3))
    assert_equal_grads(got, ref)


# --- 11. manual start_offload_layer(i) called inside layer i -------------------------------------


def test_manual_start_offload_inside_the_layer_copies_later_saves(sim):
    layers = chain(3)
    ref = reference(layers, X)
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=3, manual_synchronization=True, min_tensor_size_to_offload=0,
        device=sim,
    )
    for p in layers.parameters():
        p.grad = None
    x = X.clone().requires_grad_()
    with ctx:
        a = layers[0].lin(x)
        manual.start_offload_layer(0)  # inside the layer: tanh's output is saved afterwards
        h = torch.tanh(a)
    h = sync(h)
    manual.release_activation_forward_gpu_memory(0)
    for layer in layers[1:]:
        with ctx:
            h = layer(h)
        h = sync(h)
    manual.start_reload_layer(0)
    h.square().sum().backward()
    assert_equal_grads([x.grad] + [p.grad for p in layers.parameters()], ref)


# --- 12. marks apply to the storage, also when a view is saved ----------------------------------


def offload_first_of_two(sim, first_layer):
    """Run ``first_layer()`` as the offloaded layer of two, then backward."""
    ctx, sync = ctx_for(sim, 1, 2)
    with ctx:
        y = first_layer()
    y = sync(y)
    with ctx:
        y = y * 1.0
    sync(y).sum().backward()


def test_mark_not_offload_applies_to_saved_views(sim):
    lin = nn.Linear(8, 8)
    h = torch.randn(2, 3, 8, requires_grad=True) * 1.0
    mark_not_offload(h)
    offload_first_of_two(sim, lambda: lin(h))  # Linear on 3-D input saves a 2-D view of h
    assert not copies(sim)


def test_mark_weight_applies_to_the_transposed_view(sim):
    w = torch.randn(8, 8)  # a weight that is no nn.Parameter (frozen, or managed elsewhere)
    mark_weight(w)
    x = torch.randn(4, 8, requires_grad=True)  # F.linear saves only w (as w.t()) for x's grad
    offload_first_of_two(sim, lambda: nn.functional.linear(x, w))
    assert not copies(sim)


# --- 13. one storage saved by two offloaded layers moves once ------------------------------------


def test_storage_saved_by_two_offloaded_layers_moves_once(sim):
    layers = chain(5)
    ref = reference(layers, X)
    got = run(layers, X, *ctx_for(sim, 3, 5))
    assert_equal_grads(got, ref)
    # Saved storages per layer: the Linear input and tanh's output; layer i's tanh output is
    # layer i+1's Linear input. Layers 0-2 are offloaded: x, t0, t1, t2 move out once each;
    # t0-t2 come back once each, and x, which the caller holds, is used where it is.
    assert len(sim.copies("d2h")) == 4
    assert len(sim.copies("h2d")) == 3


def test_tensor_saved_by_every_layer_and_held_by_the_caller(sim):
    """RoPE cos/sin or an attention mask: created once, saved by every layer, held by the caller.
    Offloading it would free nothing: it moves at most once and is never reloaded."""
    c = torch.randn(1, 8)  # a size no other saved storage has
    layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def step(ctx, sync):
        for p in layers.parameters():
            p.grad = None
        x = X.clone().requires_grad_()
        h = x
        for layer in layers:
            with ctx:
                h = layer(h) * c
            h = sync(h)
        h.square().sum().backward()
        return [x.grad] + [p.grad.clone() for p in layers.parameters()]

    ref = step(*get_cpu_offload_context(enabled=False))
    ctx, sync = ctx_for(sim, 2, 4)
    for _ in range(2):
        assert_equal_grads(step(ctx, sync), ref)
    c_bytes = c.numel() * c.element_size()
    assert len([e for e in sim.copies("d2h") if e[2] == c_bytes]) == 2  # once per step
    assert not [e for e in sim.copies("h2d") if e[2] == c_bytes]  # used where it is
    assert sim.copies("h2d")  # the layers' own activations do come back


def test_failed_pinned_allocation_then_healthy_step():
    class FailingHost(SimulatedDevice):
        def __init__(self):
            super().__init__()
            self.n = 0
            self.fail = True

        def alloc_host(self, nbytes):
            self.n += 1
            if self.fail and self.n == 3:
                raise RuntimeError("pinned allocation failed")
            return super().alloc_host(nbytes)

    sim = FailingHost()
    layers = chain(4)
    ref = reference(layers, X)
    ctx, sync = ctx_for(sim, 3, 4)
    x_shared = X.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="pinned allocation failed"):
        h = x_shared
        for layer in layers:
            with ctx:
                h = layer(h)
            h = sync(h)
    assert top_saved_tensors_hooks() is None
    sim.fail = False
    for p in layers.parameters():
        p.grad = None
    x_shared.grad = None
    h = x_shared  # the same input as the aborted step, whose copies may still be queued
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.square().sum().backward()
    assert_equal_grads([x_shared.grad] + [p.grad for p in layers.parameters()], ref)


# --- 14. contexts are per thread ------------------------------------------------------------------


def test_contexts_exited_out_of_order_by_two_threads_leave_nothing_active():
    sim = SimulatedDevice()
    ca, _ = ctx_for(sim, 1, 2)
    cb, _ = ctx_for(sim, 1, 2)
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with ca:
            a_in.set()
            b_in.wait()
        a_out.set()
        seen["a"] = cpu_offload.is_cpu_offload_enabled()

    def thread_b():
        a_in.wait()
        with cb:
            b_in.set()
            a_out.wait()
            seen["b_inside"] = cpu_offload.is_cpu_offload_enabled()
        seen["b"] = cpu_offload.is_cpu_offload_enabled()

    ts = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {"a": False, "b_inside": True, "b": False}
    assert not cpu_offload.is_cpu_offload_enabled()


# --- 15. clear errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [torch.device("cpu"), "cpu", 3])
def test_non_offload_device_argument(backend, device):
    with pytest.raises(OffloadConfigError, match="SimulatedDevice"):
        get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=device)


@pytest.mark.parametrize("value", [(torch.ones(1),), [torch.ones(1)], 3, None])
def test_sync_function_needs_a_tensor(backend, value):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=SimulatedDevice()
    )
    with pytest.raises(TypeError, match="tensor"):
        sync(value)


@pytest.mark.parametrize("field", ["cpu_offloading", "cpu_offloading_activations"])
def test_config_flags_must_be_booleans(field):
    from cpu_offload import ActivationOffloadConfig

    cfg = ActivationOffloadConfig(cpu_offloading=True, cpu_offloading_num_layers=1, num_layers=2)
    setattr(cfg, field, "false")
    with pytest.raises(OffloadConfigError, match=f"{field} must be True or False"):
        cfg.validate()


# --- the same hazards on the GPU (items 1-3) --------------------------------------------------


def _cuda_step(layers, x0, ctx, sync, fail_at_layer=None):
    for p in layers.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if i == fail_at_layer:
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("hook failed")))
    return x, h.square().sum()


def _cuda_grads(x, layers):
    return [x.grad] + [p.grad.clone() for p in layers.parameters()]


@pytest.mark.gpu
def test_gpu_reloads_skipped_by_backward_and_failed_backward_stay_exact(deterministic):
    torch.manual_seed(0)
    d = 1024
    layers = nn.ModuleList([Sep(d, seed=i) for i in range(6)]).cuda()
    x0 = torch.randn(2048, d, device="cuda")
    x, loss = _cuda_step(layers, x0, *get_cpu_offload_context(enabled=False))
    loss.backward()
    ref = _cuda_grads(x, layers)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=6)
    for _ in range(3):
        x, loss = _cuda_step(layers, x0, ctx, sync, fail_at_layer=3)  # reload 3 is queued then
        with pytest.raises(RuntimeError, match="hook failed"):
            loss.backward()
        del x, loss
        # Memory freed with queued reloads is reused at once by the next step.
        x, loss = _cuda_step(layers, x0, ctx, sync)
        loss.backward()
        assert_equal_grads(_cuda_grads(x, layers), ref)


@pytest.mark.gpu
def test_gpu_oom_during_reload_then_retried_backward(deterministic):
    from cpu_offload import CudaDevice

    class FailingCuda(CudaDevice):
        fail_at = None
        calls = 0

        def alloc_device(self, nbytes, device):
            self.calls += 1
            if self.calls == self.fail_at:
                raise OutOfMemoryError("simulated out of memory")
            return super().alloc_device(nbytes, device)

    dev = FailingCuda()
    torch.manual_seed(0)
    layers = nn.ModuleList([Lin(512, seed=i) for i in range(5)]).cuda()
    x0 = torch.randn(1024, 512, device="cuda")
    x, loss = _cuda_step(layers, x0, *get_cpu_offload_context(enabled=False))
    loss.backward()
    ref = _cuda_grads(x, layers)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=3, model_layers=5, min_tensor_size_to_offload=0, device=dev
    )
    x, loss = _cuda_step(layers, x0, ctx, sync)
    loss.backward(retain_graph=True)
    dev.calls, dev.fail_at = 0, 2
    with pytest.raises(OutOfMemoryError):
        loss.backward(retain_graph=True)
    dev.fail_at = None
    for p in layers.parameters():
        p.grad = None
    x.grad = None
    loss.backward()
    assert_equal_grads(_cuda_grads(x, layers), ref)


@pytest.mark.gpu
def test_gpu_retained_pinned_buffers_refuse_a_second_forward_in_flight(deterministic):
    torch.manual_seed(0)
    layers = nn.ModuleList([Lin(512, seed=i) for i in range(4)]).cuda()
    x0 = torch.randn(1024, 512, device="cuda")
    x, loss = _cuda_step(layers, x0, *get_cpu_offload_context(enabled=False))
    loss.backward()
    ref = _cuda_grads(x, layers)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=4, retain_pinned_cpu_buffers=True,
        min_tensor_size_to_offload=0,
    )
    x, loss = _cuda_step(layers, x0, ctx, sync)
    with pytest.raises(OffloadUsageError, match="retain_pinned_cpu_buffers"):
        _cuda_step(layers, x0 * 2, ctx, sync)
    loss.backward()
    assert_equal_grads(_cuda_grads(x, layers), ref)
    x, loss = _cuda_step(layers, x0, ctx, sync)
    loss.backward()
    assert_equal_grads(_cuda_grads(x, layers), ref)
