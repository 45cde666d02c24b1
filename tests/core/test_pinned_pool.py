"""``PinnedPool``: exact-size buffers carved from pinned blocks, reused step after step and
trimmed to what a step needs; a layer's host buffers in one call, all or none; a host budget;
and blocks let go only after the copies that use them (the fence)."""
from __future__ import annotations

import gc
import random

import pytest
import torch

import cpu_offload
from cpu_offload import SimulatedDevice
from cpu_offload.core.errors import OffloadUsageError
from cpu_offload.core.pinned_pool import TOLERANCE, PinnedPool
from cpu_offload.core.simulated import SimulatedHazard


class FailingDevice(SimulatedDevice):
    """Pinned allocations of ``fail_at`` bytes fail, as when the host runs out."""

    fail_at = 3000

    def alloc_host(self, nbytes):
        if nbytes == self.fail_at:
            raise RuntimeError("out of pinned memory")
        return super().alloc_host(nbytes)


@pytest.mark.parametrize("retained", [False, True])
def test_a_failed_allocation_gives_back_the_buffers_acquired_before_it(retained):
    pool = PinnedPool(FailingDevice())
    keys = [(0, 0), (0, 1), (0, 2)] if retained else None
    with pytest.raises(OffloadUsageError, match="pinned host memory failed"):
        pool.acquire_many([1000, 2000, 3000], keys)
    assert pool.in_use_bytes == 0
    # the next step gets the same buffers again (a retained key is free, not "still held")
    bufs = pool.acquire_many([1000, 2000], keys[:2] if retained else None)
    assert [b.numel() for b in bufs] == [1000, 2000] and pool.in_use_bytes == 3000


def _queued_copy_out(sim, pool, nbytes=256):
    """A buffer from ``pool`` with a device-to-host copy into it queued as V2 queues its batches
    (``copy_after_compute``: the driver path on CUDA, which does not tell torch's pinned
    allocator), then given back to the pool before the copy ran."""
    side = sim.new_stream()  # deferred: the copy runs only when something waits for it
    buf = pool.acquire(nbytes)
    src = torch.arange(nbytes, dtype=torch.int64).to(torch.uint8)
    sim.copy_after_compute(side, [(buf, src.untyped_storage())])
    pool.release(buf)
    return side, src


def assert_blocks_went_after_their_copies(sim, fenced: bool) -> None:
    """With the fence, the pool waited for the queued copy before letting its block go (nothing
    is pending); without it, the copy runs into memory that was let go: the simulation's hazard."""
    if fenced:
        assert sim.pending_ops() == 0
    else:
        with pytest.raises(SimulatedHazard, match="pinned host buffer that was let go"):
            sim.synchronize()


@pytest.mark.parametrize("fenced", [True, False])
def test_trim_lets_buffers_go_only_after_their_copies(fenced):
    """A step that uses fewer buffers than the last trims the rest. Without the fence the
    buffer would go back to torch's pinned allocator while a copy still writes into it, and
    the simulation says so; with it, the copy is done first."""
    sim = SimulatedDevice()
    fence = (lambda: sim.wait_host(sim.record_event(side))) if fenced else None
    pool = PinnedPool(sim, fence)
    side, _ = _queued_copy_out(sim, pool)
    pool.trim()  # the step that queued the copy: the buffer was used, it stays
    assert pool.cached_bytes() == 256 and sim.pending_ops() == 2  # the wait and the copy
    pool.trim()  # a step that used none: it goes
    assert pool.cached_bytes() == 0
    assert_blocks_went_after_their_copies(sim, fenced)


def test_the_pools_end_waits_for_its_copies():
    sim = SimulatedDevice()
    side = sim.new_stream()
    pool = PinnedPool(sim, lambda: sim.wait_host(sim.record_event(side)))
    buf = pool.acquire(64)
    sim.copy_after_compute(side, [(buf, torch.ones(64, dtype=torch.uint8).untyped_storage())])
    pool.release(buf)
    del buf, pool
    gc.collect()
    assert sim.pending_ops() == 0  # the finalizer waited before the buffer went


def test_v2_contexts_fence_their_pool():
    """V2's pool waits for V2's copy stream before it lets a buffer go. (A V2 forward that
    fails fences its copies on the device, which the simulation's compute stream runs at once;
    on a GPU the host may be steps ahead of those copies when it trims.)"""
    sim = SimulatedDevice()
    ctx, _ = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, device=sim, min_tensor_size_to_offload=0)
    rt = ctx.synchronizer.rt
    buf = rt.pool.acquire(64)
    sim.copy_after_compute(rt.stream, [(buf, torch.ones(64, dtype=torch.uint8).untyped_storage())])
    rt.pool.release(buf)
    rt.pool.trim()
    rt.pool.trim()  # lets it go
    assert rt.pool.cached_bytes() == 0 and sim.pending_ops() == 0


PAGE = 4096


def page_rounded(n):
    return -(-n // PAGE) * PAGE


def run_step(pool, sizes):
    """One step's buffers: acquired in order (the forward), given back in reverse (the
    backward), each filled with its own byte to check that no two share memory."""
    pool.trim()
    bufs = [pool.acquire(n) for n in sizes]
    for i, b in enumerate(bufs):
        b.fill_(i % 251)
    for i, b in enumerate(bufs):
        assert b.numel() == sizes[i] and bool((b == i % 251).all())
    for b in reversed(bufs):
        pool.release(b)
    return [b.data_ptr() for b in bufs]


SIZES = [5_000, 100, 70_000, 3, 1 << 20, 12_345, 100, 5_000]


def test_buffers_are_exact_views_of_blocks_rounded_to_whole_pages():
    """torch's pinned allocator would reserve a power of two per buffer (2.0 MiB for these);
    the pool reserves their page-rounded bytes, small buffers sharing pages."""
    sim = SimulatedDevice(host_page=PAGE)
    pool = PinnedPool(sim)
    run_step(pool, SIZES)
    assert pool.reserved_bytes <= sum(page_rounded(n) for n in SIZES)
    assert pool.reserved_bytes == sim.host_bytes_allocated
    assert pool.peak_in_use_bytes == sum(SIZES)
    assert pool.reserved_bytes / sum(SIZES) < 1.02


def test_the_same_sizes_reuse_the_same_buffers_with_no_allocation():
    sim = SimulatedDevice(host_page=PAGE)
    pool = PinnedPool(sim)
    first = run_step(pool, SIZES)
    allocations, reserved = pool.allocations, pool.reserved_bytes
    for _ in range(5):
        assert run_step(pool, SIZES) == first
    assert (pool.allocations, pool.reserved_bytes) == (allocations, reserved)
    assert pool.in_use_bytes == 0 and pool.cached_bytes() == reserved


def test_slightly_smaller_shapes_fit_the_blocks_already_there():
    pool = PinnedPool(SimulatedDevice(host_page=PAGE))
    run_step(pool, SIZES)
    allocations, reserved = pool.allocations, pool.reserved_bytes
    smaller = [n - n // 50 for n in SIZES]  # 2% less: within the tolerance
    for _ in range(3):
        run_step(pool, smaller)
    assert (pool.allocations, pool.reserved_bytes) == (allocations, reserved)


@pytest.mark.parametrize("scale", [0.5, 1.7])
def test_changed_shapes_are_back_within_five_percent_after_one_step(scale):
    """A step whose shapes change carves from the blocks there and adds what it lacks; the next
    step's start lets go of what that step did not need, so from then on the pool holds at most
    5% over the exact blocks of the new shapes."""
    pool = PinnedPool(SimulatedDevice(host_page=PAGE))
    run_step(pool, SIZES)
    new = [max(1, int(n * scale)) for n in SIZES]
    need = sum(page_rounded(n) for n in new)
    run_step(pool, new)  # carved from the old blocks, and new ones where they do not fit
    for _ in range(3):
        run_step(pool, new)
        assert pool.reserved_bytes <= TOLERANCE * need
    allocations = pool.allocations
    run_step(pool, new)
    assert pool.allocations == allocations  # settled: reused, no allocation per step


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_every_other_step_never_leave_more_than_five_percent(seed):
    rng = random.Random(seed)
    pool = PinnedPool(SimulatedDevice(host_page=PAGE))
    for _ in range(10):
        sizes = [rng.choice([rng.randrange(1, 3_000), rng.randrange(1, 400_000)])
                 for _ in range(rng.randrange(1, 12))]
        run_step(pool, sizes)  # shapes change: whatever it takes
        run_step(pool, sizes)  # the same again: trimmed to them
        assert pool.reserved_bytes <= max(TOLERANCE * sum(page_rounded(n) for n in sizes),
                                          sum(page_rounded(n) for n in sizes))


def test_a_budget_lets_unused_blocks_go_before_it_grows_past_it():
    sim = SimulatedDevice(host_page=PAGE)
    side = sim.new_stream()
    pool = PinnedPool(sim, lambda: sim.wait_host(sim.record_event(side)), budget=8 * PAGE)
    run_step(pool, [6 * PAGE])
    assert pool.reserved_for(6 * PAGE) == 6 * PAGE  # its buffer waits for it
    assert pool.reserved_for(7 * PAGE) == 7 * PAGE  # a new block, once the idle one goes
    pool.trim()
    buf = pool.acquire(7 * PAGE)
    sim.copy_after_compute(side, [(buf, torch.ones(7 * PAGE, dtype=torch.uint8).untyped_storage())])
    assert pool.reserved_bytes == 7 * PAGE <= pool.budget and pool.allocations == 2
    assert pool.reserved_for(2 * PAGE) == 9 * PAGE  # more than the budget: the caller keeps it
    pool.release(buf)
    sim.synchronize()


@pytest.mark.parametrize("fenced", [True, False])
def test_a_budget_lets_blocks_go_only_after_their_copies(fenced):
    sim = SimulatedDevice(host_page=PAGE)
    fence = (lambda: sim.wait_host(sim.record_event(side))) if fenced else None
    pool = PinnedPool(sim, fence, budget=4 * PAGE)
    side, _ = _queued_copy_out(sim, pool, 3 * PAGE)
    pool.acquire(4 * PAGE)  # the 3-page block must go first, its copy still queued
    assert pool.reserved_bytes == 4 * PAGE
    assert_blocks_went_after_their_copies(sim, fenced)


def test_a_buffer_reused_while_its_last_copy_is_queued_needs_no_fence():
    """Copies into and out of one pool's buffers go on one copy stream, in order: a buffer
    carved again from a block (a new shape) is written after the copy that read it before."""
    sim = SimulatedDevice(host_page=PAGE)
    fences = []
    pool = PinnedPool(sim, fence=lambda: fences.append(1))
    side, src = _queued_copy_out(sim, pool, 3 * PAGE)
    again = pool.acquire(2 * PAGE)  # a new size: carved from the same block
    assert pool.allocations == 1
    sevens = torch.full((2 * PAGE,), 7, dtype=torch.uint8)
    sim.copy_after_compute(side, [(again, sevens.untyped_storage())])
    assert not fences
    sim.synchronize()
    assert bool((again == 7).all())
