"""One test suite, both backends: every test runs once with ``NVTE_CPU_OFFLOAD_V1=1`` (legacy,
tag-based) and once without (V2, automatic detection), through the facade only.

On the CPU the offload device is simulated (copies deferred until waited on, fresh device buffers
poisoned), so missing synchronization shows up as a wrong bit; the ``gpu`` tests run the same
checks on CUDA. The model tags its activations with ``mark_activation_offload``: V1 offloads
exactly those, V2 ignores tags and finds activations itself (``min_tensor_size_to_offload=0`` so
that the small test tensors qualify).
"""
from __future__ import annotations

import gc
import importlib.util
from typing import Any, Dict

import pytest
import torch

import cpu_offload
from cpu_offload.compat import top_saved_tensors_hooks

from _support.parity_models import (
    ActivationWatch,
    Block,
    TrackingSimDevice,
    assert_bit_identical,
    allocated_bytes,
    cyclic_garbage,
    loss_of,
    make_input,
    make_layers,
    run_layers,
    train_step,
    zero_grads,
)

ENV = "NVTE_CPU_OFFLOAD_V1"
HAVE_V2 = importlib.util.find_spec("cpu_offload.v2") is not None


class Backend:
    """Selects a backend through the environment and builds contexts through the facade."""

    def __init__(self, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.name = name
        self.monkeypatch = monkeypatch
        self.select()

    def select(self) -> None:
        if self.name == "v1":
            self.monkeypatch.setenv(ENV, "1")
        else:
            self.monkeypatch.delenv(ENV, raising=False)

    def extra(self) -> Dict[str, Any]:
        return {} if self.name == "v1" else {"min_tensor_size_to_offload": 0}

    def context(self, k: int, n: int, device: Any = None, **kw: Any):
        self.select()
        ctx, sync = cpu_offload.get_cpu_offload_context(
            enabled=True, num_layers=k, model_layers=n, device=device, **self.extra(), **kw
        )
        return ctx, sync


@pytest.fixture(params=["v1", "v2"])
def backend(request, monkeypatch) -> Backend:
    if request.param == "v2" and not HAVE_V2:
        pytest.skip("cpu_offload.v2 not available yet")
    return Backend(request.param, monkeypatch)


class Boom(RuntimeError):
    pass


class FailingBlock(Block):
    """A block that raises after it has saved tensors, when armed."""

    armed = False

    def forward(self, x):
        y = super().forward(x)
        if self.armed:
            raise Boom("layer failed")
        return y


# --- numerics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("k,n", [(1, 3), (2, 4), (3, 5)])
def test_bit_identical_outputs_and_gradients(backend, k, n):
    layers, x = make_layers(n), make_input()
    ref_out, ref = train_step(layers, x)
    dev = TrackingSimDevice()
    ctx, sync = backend.context(k, n, device=dev)
    out, grads = train_step(layers, x, ctx, sync)
    assert torch.equal(out, ref_out)
    assert_bit_identical(grads, ref)
    assert dev.copies(), "nothing was offloaded: the test would prove nothing"


def test_repeated_iterations_with_changing_inputs(backend):
    layers = make_layers(4)
    dev = TrackingSimDevice()
    ctx, sync = backend.context(2, 4, device=dev)
    for step in range(5):
        x = make_input(seed=100 + step)
        ref_out, ref = train_step(layers, x)
        out, grads = train_step(layers, x, ctx, sync)
        assert torch.equal(out, ref_out)
        assert_bit_identical(grads, ref)


def test_retain_graph_double_backward(backend):
    layers, x = make_layers(4), make_input()
    _, ref = train_step(layers, x, backwards=2)
    ctx, sync = backend.context(2, 4, device=TrackingSimDevice())
    for _ in range(2):
        assert_bit_identical(train_step(layers, x, ctx, sync, backwards=2)[1], ref)


def test_autograd_grad(backend):
    layers, x = make_layers(4), make_input()
    inputs = [x, *layers.parameters()]
    ref = torch.autograd.grad(loss_of(run_layers(layers, x)), inputs)
    ctx, sync = backend.context(2, 4, device=TrackingSimDevice())
    for _ in range(2):
        got = torch.autograd.grad(loss_of(run_layers(layers, x, ctx, sync)), inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_no_grad_forward(backend):
    layers, x = make_layers(4), make_input()
    ref_out, ref = train_step(layers, x)
    ctx, sync = backend.context(2, 4, device=TrackingSimDevice())
    with torch.no_grad():
        assert torch.equal(run_layers(layers, x, ctx, sync), ref_out)
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)
    with torch.no_grad():  # also between a forward and its backward
        zero_grads(layers, x)
        out = run_layers(layers, x, ctx, sync)
        assert torch.equal(out, ref_out)
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)


def test_tensors_that_never_reach_backward(backend):
    layers, x = make_layers(4, aux=True), make_input()
    _, ref = train_step(layers, x)
    dev = TrackingSimDevice()
    ctx, sync = backend.context(2, 4, device=dev)
    watch = ActivationWatch(layers)
    gc.collect()
    gc.disable()
    try:
        run_layers(layers, x, ctx, sync)  # a forward whose graph is dropped
        assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)
        assert watch.alive() == 0
        assert dev.live_device_buffers() == 0
    finally:
        gc.enable()
        watch.remove()


# --- lifetimes ---------------------------------------------------------------------------------


def test_memory_returns_to_baseline_every_step(backend):
    layers, x = make_layers(4, aux=True), make_input()
    _, ref = train_step(layers, x)
    dev = TrackingSimDevice()
    ctx, sync = backend.context(2, 4, device=dev)
    watch = ActivationWatch(layers)
    gc.collect()
    gc.disable()
    try:
        host_after_first = None
        for step in range(50):
            watch.clear()
            out, grads = train_step(layers, x, ctx, sync)
            if step % 10 == 0:
                assert_bit_identical(grads, ref)
            del out, grads
            assert watch.alive() == 0, "activations outlived their step"
            assert dev.live_device_buffers() == 0, "reload buffers outlived their step"
            if host_after_first is None:
                host_after_first = dev.live_host_buffers()
            assert dev.live_host_buffers() <= host_after_first, "pinned memory grows"
        assert gc.collect() == 0, "reference cycles were created"
    finally:
        gc.enable()
        watch.remove()


def test_exception_inside_context_leaves_no_hooks_and_nothing_held(backend):
    n = 4
    torch.manual_seed(0)
    layers = make_layers(n)
    failing = FailingBlock(32, 4, 16)
    failing.load_state_dict(layers[2].state_dict())
    x = make_input()
    _, ref = train_step(layers, x)
    dev = TrackingSimDevice()
    ctx, sync = backend.context(2, n, device=dev)
    train_step(layers, x, ctx, sync)
    host_working_set = dev.live_host_buffers()  # a backend may pool pinned buffers across steps
    watch = ActivationWatch(layers)
    gc.collect()
    gc.disable()
    try:
        failing.armed = True
        h = x
        with pytest.raises(Boom):
            for layer in [layers[0], layers[1], failing, layers[3]]:
                with ctx:
                    h = layer(h)
                h = sync(h)
        assert top_saved_tensors_hooks() is None, "a saved-tensor hook is still installed"
        assert not cpu_offload.is_cpu_offload_enabled()
        del h
        assert watch.alive() == 0
        assert dev.live_device_buffers() == 0
        assert dev.live_host_buffers() <= host_working_set
    finally:
        gc.enable()
        watch.remove()
    copies = len(dev.log)
    train_step(layers, x)  # outside the context nothing is packed any more
    assert len(dev.log) == copies
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref)  # and the next step works


# --- migration ---------------------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_V2, reason="cpu_offload.v2 not available yet")
def test_v1_caller_gets_same_numerics_under_v2(monkeypatch):
    """A V1 caller (tags with mark_activation_offload) switches to V2 by unsetting the env var."""
    layers, x = make_layers(4), make_input()
    ref_out, ref = train_step(layers, x)
    results = {}
    for name in ("v1", "v2"):
        b = Backend(name, monkeypatch)
        dev = TrackingSimDevice()
        ctx, sync = b.context(2, 4, device=dev)
        results[name] = train_step(layers, x, ctx, sync)
        assert dev.copies()
    for out, grads in results.values():
        assert torch.equal(out, ref_out)
        assert_bit_identical(grads, ref)
    assert torch.equal(results["v1"][0], results["v2"][0])


# --- GPU ---------------------------------------------------------------------------------------


def gpu_model(n: int):
    kw = dict(device="cuda", dtype=torch.bfloat16)
    return make_layers(n, hidden=256, heads=4, seq=128, **kw), make_input(2, 128, 256, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(2, 4), (3, 6)])
def test_gpu_bit_identical_and_memory_baseline(backend, deterministic, k, n):
    layers, x = gpu_model(n)
    ref_out, ref = train_step(layers, x)
    ctx, sync = backend.context(k, n)

    def checked_step():
        out, grads = train_step(layers, x, ctx, sync)
        assert torch.equal(out, ref_out)
        assert_bit_identical(grads, ref)
        del out, grads
        torch.cuda.synchronize()
        return allocated_bytes()

    # Warm-up runs the whole loop body once: allocator, pinned pool, and the lazy imports that
    # first calls of torch.cuda memory/stream helpers do (one-time garbage, not a cycle per step).
    checked_step()
    gc.collect()
    base = checked_step()
    gc.disable()
    try:
        for _ in range(20):
            assert checked_step() == base
        assert cyclic_garbage() == []
    finally:
        gc.enable()


@pytest.mark.gpu
def test_gpu_retain_graph_no_grad_and_exception(backend, deterministic):
    layers, x = gpu_model(4)
    ref_out, ref2 = train_step(layers, x, backwards=2)
    ctx, sync = backend.context(2, 4)
    assert_bit_identical(train_step(layers, x, ctx, sync, backwards=2)[1], ref2)
    with torch.no_grad():
        assert torch.equal(run_layers(layers, x, ctx, sync), ref_out)
    with pytest.raises(Boom):
        with ctx:
            layers[0](x)
            raise Boom()
    assert top_saved_tensors_hooks() is None
    _, ref1 = train_step(layers, x)
    assert_bit_identical(train_step(layers, x, ctx, sync)[1], ref1)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_V2, reason="cpu_offload.v2 not available yet")
def test_gpu_v1_caller_gets_same_numerics_under_v2(monkeypatch, deterministic):
    layers, x = gpu_model(4)
    ref_out, ref = train_step(layers, x)
    for name in ("v1", "v2"):
        ctx, sync = Backend(name, monkeypatch).context(2, 4)
        out, grads = train_step(layers, x, ctx, sync)
        assert torch.equal(out, ref_out)
        assert_bit_identical(grads, ref)
