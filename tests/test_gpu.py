"""V2 on a real CUDA GPU (marked ``gpu``; skipped without CUDA, run on the accelerator machine).

These check what the simulation cannot: real streams, pinned memory, the caching allocator,
kernels that depend on layouts (flash attention), and CUDA graphs.
"""
from __future__ import annotations

import gc

import pytest
import torch

from cpu_offload import get_cpu_offload_context
from cpu_offload.compat import top_saved_tensors_hooks
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input
from _support.parity_models import allocated_bytes, cyclic_garbage

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("deterministic")]

CFG = GPTConfig(hidden=1024, heads=8, seq=1024, batch=2, layers=6, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def model():
    return build_model(CFG, device="cuda", seed=0)


@pytest.fixture(scope="module")
def x0():
    return make_input(CFG, device="cuda", seed=1, requires_grad=False)


def step(model, x0, ctx=None, sync=None):
    for p in model.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    out = model(x, ctx, sync)
    out.float().square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def assert_bit_identical(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for ga, gb in zip(a[2], b[2]):
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_gpt_gradients_bit_identical(model, x0, k):
    ref = step(model, x0)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=CFG.layers)
    for _ in range(2):
        assert_bit_identical(step(model, x0, ctx, sync), ref)


def test_memory_returns_to_baseline_for_200_steps_without_gc(model, x0):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=CFG.layers)
    for _ in range(2):
        step(model, x0, ctx, sync)
    torch.cuda.synchronize()
    pool = ctx.synchronizer.rt.pool
    allocations = pool.allocations
    for p in model.parameters():
        p.grad = None
    gc.collect()
    baseline = allocated_bytes()
    gc.disable()
    try:
        for _ in range(200):
            step(model, x0, ctx, sync)
            for p in model.parameters():
                p.grad = None
            assert allocated_bytes() == baseline
        assert pool.allocations == allocations  # pinned buffers reused, none allocated
        assert cyclic_garbage() == []
    finally:
        gc.enable()


def test_offloading_lowers_peak_memory(model, x0):
    def peak(ctx=None, sync=None):
        for p in model.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(model, x0, ctx, sync)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    base = peak()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=4, model_layers=CFG.layers)
    peak(ctx, sync)
    assert peak(ctx, sync) < 0.75 * base


def test_forward_and_backward_never_block_the_host(model, x0):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=3, model_layers=CFG.layers)
    step(model, x0, ctx, sync)  # warm-up: pinned buffers allocated once
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = x0.clone().requires_grad_()
        out = model(x, ctx, sync)
        out.float().square().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_exception_inside_context_frees_everything(model, x0):
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=2, model_layers=CFG.layers)
    step(model, x0, ctx, sync)
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()

    def failing_forward():
        x = x0.clone().requires_grad_()
        for i, layer in enumerate(model.layers):
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
    ref = step(model, x0)
    assert_bit_identical(step(model, x0, ctx, sync), ref)


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


def test_cuda_graph_capture_replays_bit_exact():
    """Whole forward+backward captured once, replayed: copies hit retained pinned buffers."""
    cfg = CFG.with_(layers=4, seq=512)
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


# --- statistics and verify mode on the real device ---------------------------------------------


def test_stats_count_every_byte_and_reading_them_never_blocks_the_next_step(model, x0):
    from cpu_offload import CudaDevice

    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=CFG.layers, device=CudaDevice(time_waits=True)
    )
    step(model, x0, ctx, sync)  # warm-up: pinned buffers allocated once
    torch.cuda.synchronize()
    step(model, x0, ctx, sync)
    torch.cuda.synchronize()
    d = ctx.stats().to_dict()
    assert sorted(d["layers"]) == [0, 1]
    for i, layer in d["layers"].items():
        held = x0.nbytes if i == 0 else 0  # the caller's input, copied but not freed
        assert layer["held_elsewhere_bytes"] == held and layer["copied_out_bytes"] > 0
        assert layer["freed_bytes"] == layer["reloaded_bytes"] == layer["copied_out_bytes"] - held
    assert d["pinned_host_bytes_peak"] == d["copied_out_bytes"]
    assert d["pinned_host_bytes_in_use"] == 0 and d["waits_pending"] == 0
    assert d["compute_wait_ms"] is not None and d["compute_wait_ms"] >= 0.0
    # Read the statistics while the next step's work is still queued: nothing may sync the host.
    for p in model.parameters():
        p.grad = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        x = x0.clone().requires_grad_()
        out = model(x, ctx, sync)
        ctx.stats().summary()
        ctx.stats().to_dict()
        out.float().square().mean().backward()
        ctx.stats().summary()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_verify_mode_is_exact_and_catches_a_corrupted_host_copy(model, x0):
    from cpu_offload import OffloadVerifyError

    ref = step(model, x0)
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=CFG.layers, verify=True
    )
    for _ in range(2):
        assert_bit_identical(step(model, x0, ctx, sync), ref)
    for p in model.parameters():
        p.grad = None
    out = model(x0.clone().requires_grad_(), ctx, sync)
    torch.cuda.synchronize()  # every copy to the host has landed
    entry = next(e for e in ctx.synchronizer.step.layers[1].entries if e.cpu is not None)
    entry.cpu.bitwise_not_()  # what a racing writer or a reused host buffer would do
    with pytest.raises(OffloadVerifyError, match="saved by layer 1 came back different"):
        out.float().square().mean().backward()


@pytest.mark.parametrize("k", [0, 2])
def test_selective_recompute_is_bit_identical_and_lowers_peak(model, x0, k):
    """Selective recomputation on real kernels: LayerNorm and GELU reruns give the same bits,
    and the stored bytes (6 of 16 units per block) come off the peak."""
    ref = step(model, x0)
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=CFG.layers)
    for _ in range(2):
        assert_bit_identical(step(model, x0, ctx, sync), ref)
    peaks = {}
    for selective in (False, True):
        ctx.synchronizer.set_selective(range(CFG.layers) if selective else ())
        step(model, x0, ctx, sync)
        torch.cuda.synchronize()
        before = allocated_bytes()
        torch.cuda.reset_peak_memory_stats()
        got = step(model, x0, ctx, sync)
        torch.cuda.synchronize()
        peaks[selective] = torch.cuda.max_memory_allocated() - before
        if selective:
            assert_bit_identical(got, ref)
            unit = CFG.batch * CFG.seq * CFG.hidden * 2
            stats = ctx.stats()
            assert all(stats.layers[i].recipe_bytes == 6 * unit for i in range(CFG.layers))
    assert peaks[True] < peaks[False]
