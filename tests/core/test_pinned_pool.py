"""``PinnedPool.acquire_many``: a layer's host buffers in one call, all or none."""
from __future__ import annotations

import pytest

from cpu_offload import SimulatedDevice
from cpu_offload.core.errors import OffloadUsageError
from cpu_offload.core.pinned_pool import PinnedPool


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
