"""``PinnedPool``: a layer's host buffers in one call, all or none; and buffers let go only after
the copies that use them (the fence)."""
from __future__ import annotations

import gc

import pytest
import torch

import cpu_offload
from cpu_offload import SimulatedDevice
from cpu_offload.core.errors import OffloadUsageError
from cpu_offload.core.pinned_pool import PinnedPool
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
    if fenced:
        assert sim.pending_ops() == 0
    else:
        with pytest.raises(SimulatedHazard, match="pinned host buffer that was let go"):
            sim.synchronize()


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
