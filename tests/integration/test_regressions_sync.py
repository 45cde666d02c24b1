"""Issue 27, defects 3, 4 and 9: synchronization regressions and races.

- D3: manual synchronization with ``model_layers`` larger than the layers a forward runs (the
  reference implementation's own manual-synchronization test) raised in backward.
- D4: V1 dropped a reload buffer with its host-to-device copy still queued after a backward that
  raised; and after an exception between layers the simulated device reported a device-to-host
  copy into a dropped pinned buffer, which torch's pinned allocator makes safe on CUDA. V1's next
  step then also continued the abandoned step's layer count (the wrong layers were offloaded).
- D9: ``torch.cuda.make_graphed_callables`` (forward and backward captured as separate graphs)
  aborted the backward capture: the end of backward waited for the copy stream, which had no work
  in that capture (``cudaErrorStreamCaptureIsolation``). ``SimulatedDevice.capture`` models
  CUDA's capture rules, so the CPU suite catches this class of bug.

CPU tests run on ``SimulatedDevice``; the ``gpu``-marked ones need CUDA.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from cpu_offload import (
    SimulatedDevice,
    get_cpu_offload_context,
    mark_activation_offload,
    mark_not_offload,
)
from cpu_offload.core.simulated import SimulatedHazard
from _support.parity_models import EXPECTED_WARNINGS

pytestmark = EXPECTED_WARNINGS

D = 16


def grads(module, *inputs):
    return [t.grad.clone() for t in inputs] + [p.grad.clone() for p in module.parameters()]


def assert_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


# --- D3: manual synchronization, fewer layers than model_layers --------------------------------


def manual_step(layers, inp1, inp2, ctx, sync, manual):
    """The reference implementation's manual-synchronization test: two independent layers in a
    context made for ``model_layers=6``, offloaded, released and reloaded by hand, then one
    backward per output."""
    for p in layers.parameters():
        p.grad = None
    a, b = inp1.clone().requires_grad_(), inp2.clone().requires_grad_()
    with ctx:
        out_1 = layers[0](a)
    out_1 = sync(out_1)
    with ctx:
        out_2 = layers[1](b)
    out_2 = sync(out_2)
    mark_not_offload(out_1, out_2)
    if manual is not None:
        manual.start_offload_layer(0)
        manual.release_activation_forward_gpu_memory(0)
        manual.start_offload_layer(1)
        manual.release_activation_forward_gpu_memory(1)
        manual.start_reload_layer(0)
        manual.start_reload_layer(1)
    out_1.sum().backward()
    out_2.sum().backward()
    return [out_1.detach(), out_2.detach()] + grads(layers, a, b)


def two_layers(device="cpu"):
    torch.manual_seed(0)
    return nn.ModuleList(
        nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D)) for _ in range(2)
    ).to(device)


def test_manual_synchronization_with_fewer_layers_than_model_layers():
    sim = SimulatedDevice()
    layers = two_layers()
    inp1, inp2 = torch.randn(4, D), torch.randn(4, D)
    ref = manual_step(layers, inp1, inp2, contextlib.nullcontext(), lambda t: t, None)
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=6, manual_synchronization=True,
        min_tensor_size_to_offload=0, device=sim,
    )
    for _ in range(2):  # the second forward starts a new step: layer ids are 0 and 1 again
        sim.log.clear()
        assert_equal(manual_step(layers, inp1, inp2, ctx, sync, manual), ref)
        assert sim.milestones({"release", "reload"}) == [
            ("release", 0), ("release", 1), ("reload", 0), ("reload", 1)
        ]
        assert sim.copies("d2h") and sim.copies("h2d")
    assert ctx.synchronizer.held_device_bytes() == 0


def test_default_schedule_still_refuses_a_backward_after_too_few_layers():
    """The layer-count check stays where a schedule counts layers."""
    from cpu_offload import OffloadUsageError

    layers = two_layers()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=6, min_tensor_size_to_offload=0,
        device=SimulatedDevice(),
    )
    h = torch.randn(4, D, requires_grad=True)
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    with pytest.raises(OffloadUsageError, match="model_layers=6"):
        h.sum().backward()


@pytest.mark.gpu
def test_gpu_manual_synchronization_with_fewer_layers_than_model_layers(deterministic):
    layers = nn.ModuleList(
        nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 1024)) for _ in range(2)
    ).cuda()
    inp1, inp2 = (torch.randn(512, 1024, device="cuda") for _ in range(2))
    ref = manual_step(layers, inp1, inp2, contextlib.nullcontext(), lambda t: t, None)
    stream = torch.cuda.Stream()
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=6, manual_synchronization=True, offload_stream=stream,
    )
    for _ in range(2):
        assert_equal(manual_step(layers, inp1, inp2, ctx, sync, manual), ref)

    # The reference's memory checks: release frees device memory, reload brings it back.
    for p in layers.parameters():
        p.grad = None
    a, b = inp1.clone().requires_grad_(), inp2.clone().requires_grad_()
    with ctx:
        out_1 = layers[0](a)
    out_1 = sync(out_1)
    with ctx:
        out_2 = layers[1](b)
    out_2 = sync(out_2)
    mark_not_offload(out_1, out_2)
    del a, b
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in (0, 1):
        manual.start_offload_layer(i)
        manual.release_activation_forward_gpu_memory(i)
    # Freed: each layer's GELU input and output (2 MiB each); its input stays (autograd's leaf).
    assert torch.cuda.memory_allocated() <= before - 4 * 512 * 1024 * 4
    for i in (0, 1):
        manual.start_reload_layer(i)
    assert torch.cuda.memory_allocated() == pytest.approx(before, rel=0.01)
    out_1.sum().backward()
    out_2.sum().backward()
    torch.cuda.synchronize()


# --- D4: V1 recovery after exceptions ----------------------------------------------------------


class Tagged(nn.Module):
    """Saves its input and its Linear output (both tagged for V1); shares no storage with the
    next layer."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        mark_activation_offload(x)
        a = self.lin(x)
        mark_activation_offload(a)
        return torch.sin(a) * 1.0


X = torch.randn(4, 8)


def v1_step(layers, ctx, sync):
    for p in layers.parameters():
        p.grad = None
    x = X.clone().requires_grad_()
    h = x
    for layer in layers:
        with ctx:
            h = layer(h)
        h = sync(h)
    h.square().sum().backward()
    return grads(layers, x)


@pytest.fixture
def v1(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    layers = nn.ModuleList(Tagged(i) for i in range(5))
    ref = v1_step(layers, contextlib.nullcontext(), lambda t: t)
    fresh = SimulatedDevice()
    v1_step(layers, *get_cpu_offload_context(enabled=True, num_layers=3, model_layers=5,
                                             device=fresh))
    schedule = fresh.milestones({"offload", "release", "reload"})
    assert schedule and ("reload", 0) in schedule
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=5, device=sim)
    return layers, ref, schedule, sim, ctx, sync


def assert_recovers(v1):
    """The next steps are exact and scheduled like a fresh context's (counted from layer 0)."""
    layers, ref, schedule, sim, ctx, sync = v1
    for _ in range(2):
        sim.log.clear()
        assert_equal(v1_step(layers, ctx, sync), ref)
        assert sim.milestones({"offload", "release", "reload"}) == schedule
    assert ctx.offload_handler.live_records() == 0


def test_v1_reload_buffer_not_dropped_while_its_copy_is_queued_after_backward_raises(v1):
    layers, ref, schedule, sim, ctx, sync = v1
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
    assert ("reload", 2) in sim.log  # queued, never waited for: the backward stopped before it
    assert sim.pending_ops()
    del loss, h, x  # frees the graph and its reload buffers: their copies must be fenced first
    sim.synchronize()  # runs every queued copy: one into a dropped buffer raises
    assert_recovers(v1)


def test_v1_exception_between_layers_then_next_steps_are_exact_and_fresh(v1):
    layers, ref, schedule, sim, ctx, sync = v1
    with pytest.raises(ValueError):
        h = X.clone().requires_grad_()
        for layer in layers[:3]:
            with ctx:
                h = layer(h)
            h = sync(h)
        raise ValueError("data loader broke between layers")
    assert sim.pending_ops()  # layer 2's copy to the host is still queued
    del h
    assert_recovers(v1)


def test_sim_copy_into_a_dropped_pinned_host_buffer_is_safe_but_into_a_device_buffer_not():
    """On CUDA the pinned (host caching) allocator records the copy's stream on a pinned block
    and reuses it only after the copy; device memory from the caching allocator is reusable at
    once. The simulated device models both."""
    sim = SimulatedDevice()
    side = sim.new_stream()
    src = torch.randn(16).view(torch.uint8)
    sim.copy(side, sim.alloc_host(src.numel()), src)  # d2h into a buffer nobody holds
    sim.synchronize()
    host = sim.alloc_host(src.numel())
    host.copy_(src)
    dst = sim.alloc_device(src.numel(), src.device)
    sim.wait_stream(side, sim.current_stream())  # a fresh buffer: after compute got there
    sim.copy(side, dst, host)
    del dst  # h2d into a dropped buffer
    with pytest.raises(SimulatedHazard, match="h2d copy .* dropped"):
        sim.synchronize()


# --- D9: CUDA graph capture, forward and backward as separate graphs ---------------------------


class Stack(nn.Module):
    """The reference's "numerics with CUDA graphs" module: 2 layers, each inside the context."""

    def __init__(self, kind, ctx=None, sync=None, d=D, device="cpu"):
        super().__init__()
        torch.manual_seed(0)

        def layer():
            if kind == "linear":  # saves only its input: layer 0's is the caller's static input
                return nn.Linear(d, d)
            return nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

        self.layers = nn.ModuleList(layer() for _ in range(2)).to(device)
        self.ctx = ctx if ctx is not None else contextlib.nullcontext()
        self.sync = sync

    def forward(self, x):
        for layer in self.layers:
            with self.ctx:
                x = layer(x)
            if self.sync is not None:
                x = self.sync(x)
        return x


def graphed_like_torch(sim, module, x, warmup=3):
    """What ``torch.cuda.make_graphed_callables(module, (x,))`` does with the offload context:
    warm-up iterations, then the forward captured as one graph and the backward as another
    (``torch.autograd.grad`` of the static outputs). Returns (static output, gradients)."""
    inputs = (x, *module.parameters())
    for _ in range(warmup):
        out = module(x)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    with sim.capture():
        out = module(x)
    with sim.capture():
        got = torch.autograd.grad(out, inputs, torch.ones_like(out))
    return [out.detach(), *got]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_separate_forward_and_backward_captures(kind):
    x = torch.randn(4, D, requires_grad=True)
    plain = Stack(kind)
    ref = graphed_like_torch(SimulatedDevice(), plain, x)
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, retain_pinned_cpu_buffers=True,
        min_tensor_size_to_offload=0, device=sim,
    )
    got = graphed_like_torch(sim, Stack(kind, ctx, sync), x)
    assert_equal(got, ref)
    assert sim.copies("d2h")
    if kind == "mlp":
        assert sim.copies("h2d")  # reloads inside the backward capture, joined back


def test_whole_step_capture():
    x = torch.randn(4, D, requires_grad=True)
    ref_module = Stack("mlp")
    out = ref_module(x)
    out.sum().backward()
    ref = [out.detach()] + grads(ref_module, x)
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, retain_pinned_cpu_buffers=True,
        min_tensor_size_to_offload=0, device=sim,
    )
    module = Stack("mlp", ctx, sync)
    for capture in (contextlib.nullcontext(), sim.capture()):
        x.grad = None
        module.zero_grad(set_to_none=True)
        with capture:
            out = module(x)
            out.sum().backward()
        assert_equal([out.detach()] + grads(module, x), ref)
    assert sim.copies("h2d")


def test_sim_capture_refuses_uncaptured_dependencies_and_unjoined_work():
    sim = SimulatedDevice()
    compute, side = sim.current_stream(), sim.new_stream()
    outside = sim.record_event(side)
    with pytest.raises(SimulatedHazard, match="cudaErrorStreamCaptureIsolation"):
        with sim.capture():
            sim.wait_event(compute, outside)
    with pytest.raises(SimulatedHazard, match="cudaErrorStreamCaptureIsolation"):
        with sim.capture():
            sim.wait_event(compute, sim.record_event(side))  # side is not in the capture
    dst = torch.empty(4, dtype=torch.uint8)
    with pytest.raises(SimulatedHazard, match="cudaErrorStreamCaptureUnjoined"):
        with sim.capture():
            sim.wait_stream(side, compute)  # joins
            sim.copy(side, dst, torch.zeros(4, dtype=torch.uint8))
    with sim.capture():
        sim.wait_stream(compute, side)  # not in the capture: nothing to wait for, skipped
        sim.wait_stream(side, compute)
        sim.wait_stream(compute, side)
    with pytest.raises(SimulatedHazard, match="synchronize during graph capture"):
        with sim.capture():
            sim.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_gpu_make_graphed_callables_bit_exact(deterministic, kind):
    """The reference's "numerics with CUDA graphs" test: both modules graphed with
    ``make_graphed_callables``, the offloaded one bit-exact against the one without."""
    d = 1024
    x = torch.randn(2048, d, device="cuda")
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, retain_pinned_cpu_buffers=True,
    )
    offload = Stack(kind, ctx, sync, d=d, device="cuda")
    plain = Stack(kind, d=d, device="cuda")
    graphed_offload = torch.cuda.make_graphed_callables(offload, (x,))
    graphed_plain = torch.cuda.make_graphed_callables(plain, (x,))

    def step(module, params, inp):
        for p in params:
            p.grad = None
        out = module(inp)
        out.sum().backward()
        return [out.detach().clone()] + [p.grad.clone() for p in params]

    for seed in (5, 6):
        x.copy_(torch.randn(2048, d, device="cuda",
                            generator=torch.Generator("cuda").manual_seed(seed)))
        got = step(graphed_offload, list(offload.parameters()), x)
        want = step(graphed_plain, list(plain.parameters()), x)
        torch.cuda.synchronize()
        assert_equal(got, want)
    torch.randn(8, device="cuda")  # the CUDA generator is not left in capture state
