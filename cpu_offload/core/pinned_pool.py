"""Host buffers reused across training steps, carved out of a few pinned blocks.

Each buffer the pool hands out is a view of exactly the bytes asked for, carved (best fit,
``free_space``) out of a pinned block that the device reserves when nothing free holds the
request (``OffloadDevice.reserve_host``: on CUDA, page-locked at exact size on the GPU's NUMA
node). So the host reserves what is offloaded, not the power of two that torch's pinned
allocator rounds each buffer up to. Steady-state training saves the same storages every step:
a buffer given back waits in an exact-size free list for the next request of its size (the
common path, a list pop). The first request that finds none (a new shape) gives the waiting
buffers back to their blocks, where they merge, and carves from there; only if nothing holds
it does the pool reserve another block.

At each step start, ``trim`` compares what the pool holds with what the last step needed at its
peak (what exact blocks for the buffers it held at once would reserve). More than 5% over, it
lets go of the blocks that no buffer uses, and the next step reserves what it needs. With
``budget`` (``max_host_bytes``), it lets them go before it would grow past the budget;
``reserved_for`` tells the pack hook what one more storage would cost.

With ``retain`` (CUDA graphs), buffers are bound to a stable key (layer, slot) and never returned:
a captured graph replays copies into fixed addresses. A keyed buffer serves one saved storage at a
time: a second forward pass started while the first one's graph still holds its buffers is
refused (sharing them would overwrite the first step's activations).

Blocks are let go (``trim``, the budget, or the pool's end) only after ``fence`` has waited for
the copies that may still use them: the device may queue copies without telling torch's pinned
allocator (``OffloadDevice.copy_after_compute``), and a block from ``reserve_host`` may not be
torch's at all, so nothing else would keep it alive while a copy still reads or writes it.
Buffers are carved and given back by one thread at a time (as the hooks run).
"""
from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Callable, Hashable, Optional

import torch

from .device import OffloadDevice
from .errors import OffloadUsageError
from .free_space import FreeSpace

# How far over the last step's need (exact blocks for the buffers it held at once) the pool may
# stay before ``trim`` lets go of its unused blocks.
TOLERANCE = 1.05


class PinnedPool:
    """Exact-size host buffers carved from pinned blocks, trimmed to the last step's need.

    Example::

        >>> import cpu_offload
        >>> from cpu_offload.core.pinned_pool import PinnedPool
        >>> pool = PinnedPool(cpu_offload.SimulatedDevice(host_page=4096))
        >>> a, b = pool.acquire(1000), pool.acquire(3000)   # both from one 4 KiB block
        >>> a.numel(), b.numel(), pool.reserved_bytes, pool.allocations
        (1000, 3000, 4096, 1)
        >>> pool.release(a); pool.release(b)
        >>> pool.acquire(1000).data_ptr() == a.data_ptr()     # the next step: the same buffer
        True
    """

    def __init__(self, device: OffloadDevice, fence: Optional[Callable[[], None]] = None,
                 budget: Optional[int] = None) -> None:
        self._device = device
        # Blocks the host until no queued copy uses a buffer of this pool (called before blocks
        # are let go); None: torch's pinned allocator knows of every copy.
        self._fence = fence
        self.budget = budget  # reserved bytes the pool stays within while it can
        self._space = FreeSpace()  # the blocks' free ranges
        self._blocks: dict[int, torch.Tensor] = {}  # block number -> the pinned block
        self._users: dict[int, int] = {}  # block number -> its buffers handed out
        # nbytes -> carved buffers given back; each carries ``_carve``: (block, start, bytes
        # taken from the block, what an exact block for it would reserve)
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._exact: dict[int, int] = {}  # nbytes -> device.host_block_size(nbytes)
        self._retained: dict[Hashable, torch.Tensor] = {}
        if fence is not None:  # at the pool's end, its blocks go only after the fence
            weakref.finalize(self, _fenced_drop, fence, self._free, self._blocks,
                             self._retained).atexit = False
        self._retained_in_use: set = set()
        self._next_block = 0
        self.allocations = 0  # blocks reserved so far
        self.allocation_seconds = 0.0  # host time spent reserving them
        self.in_use_bytes = 0  # handed out and not given back
        self.peak_in_use_bytes = 0  # the most in use at once since the last trim (step start)
        self.last_peak_in_use_bytes = 0  # the same, of the step before the last trim
        self.reserved_bytes = 0  # of every block, retained ones included
        self.peak_reserved_bytes = 0  # the most reserved at once since the last trim
        self.idle_bytes = 0  # of blocks no buffer is using (what a budget may let go)
        self._retained_reserved = 0
        self._exact_in_use = 0  # exact blocks for the buffers in use would reserve this much
        self._exact_peak = 0  # its most since the last trim: what the step needed

    def acquire(self, nbytes: int, key: Optional[Hashable] = None) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` (a prefix of a retained buffer when ``key``)."""
        if key is not None:
            return self._acquire_retained(nbytes, key)
        # (once per offloaded storage or batch: no helper calls on the common path)
        free = self._free[nbytes] if nbytes in self._free else None
        buf = free.pop() if free else self._carve(nbytes)
        carve = buf._carve
        block = carve[0]
        users = self._users[block]
        if not users:
            self.idle_bytes -= self._space.sizes[block]
        self._users[block] = users + 1
        in_use = self.in_use_bytes = self.in_use_bytes + nbytes
        if in_use > self.peak_in_use_bytes:
            self.peak_in_use_bytes = in_use
        exact = self._exact_in_use = self._exact_in_use + carve[3]
        if exact > self._exact_peak:
            self._exact_peak = exact
        return buf

    def _acquire_retained(self, nbytes: int, key: Hashable) -> torch.Tensor:
        if key in self._retained_in_use:
            layer, slot = key
            raise OffloadUsageError(
                f"retain_pinned_cpu_buffers=True binds one host buffer to each saved storage "
                f"(layer {layer}, slot {slot}), but it still holds the activations of an "
                "earlier forward pass whose graph is alive. Run that step's backward (or drop "
                "its graph) before the next forward, or use retain_pinned_cpu_buffers=False "
                "(needed only for CUDA graph capture)"
            )
        buf = self._retained.get(key)
        if buf is not None and buf.numel() < nbytes:
            layer, slot = key
            raise OffloadUsageError(
                f"retain_pinned_cpu_buffers=True: layer {layer}, slot {slot} now saves "
                f"{nbytes} bytes, more than the {buf.numel()} its retained host buffer was "
                "made for. A captured CUDA graph copies into that buffer, so it cannot be "
                "replaced: keep shapes fixed (pad to the largest), or use one context per "
                "shape (the reference implementation refuses this too)"
            )
        if buf is None:
            buf = self._retained[key] = self._reserve(nbytes)
            self._retained_reserved += buf.numel()
        self._retained_in_use.add(key)
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buf[:nbytes]

    def acquire_many(self, sizes: list, keys: Optional[list] = None) -> list:
        """``acquire`` for each size (and key, if given): a layer's buffers at its end. A failed
        allocation gives back those acquired before it, retained ones included."""
        keys = keys if keys is not None else [None] * len(sizes)
        out: list = []
        try:
            for nbytes, key in zip(sizes, keys):
                out.append(self.acquire(nbytes, key))
        except BaseException:
            for buf, key in zip(out, keys):
                self.release(buf, key)
            raise
        return out

    def release(self, buf: torch.Tensor, key: Optional[Hashable] = None) -> None:
        """Give a buffer back (retained buffers stay bound to their key, free for the next step)."""
        nbytes = buf.shape[0]
        self.in_use_bytes -= nbytes
        if key is not None:
            self._retained_in_use.discard(key)
            return
        carve = buf._carve
        self._exact_in_use -= carve[3]
        block = carve[0]
        users = self._users[block] - 1
        self._users[block] = users
        if not users:
            self.idle_bytes += self._space.sizes[block]
        self._free[nbytes].append(buf)

    def reserved_for(self, extra: int) -> int:
        """The bytes the pool must reserve to hand out ``extra`` more in one buffer: what it
        holds now if a waiting buffer of that size or a free range holds them; else that plus
        a new block, less the blocks no buffer uses (let go first when over the budget)."""
        free = self._free[extra] if extra in self._free else None
        if free or extra <= self._space.largest():
            return self.reserved_bytes
        return self.reserved_bytes - self.idle_bytes + self._device.host_block_size(extra)

    def trim(self) -> None:
        """At a step's start: past ``TOLERANCE`` times what the last step needed, let go of
        the blocks no buffer uses (after the fence); then start counting the new step."""
        self.last_peak_in_use_bytes = self.peak_in_use_bytes
        arena = self.reserved_bytes - self._retained_reserved
        if self.idle_bytes and arena > TOLERANCE * self._exact_peak:
            self._drop_idle()
        self.peak_in_use_bytes = self.in_use_bytes
        self.peak_reserved_bytes = self.reserved_bytes
        self._exact_peak = self._exact_in_use

    def cached_bytes(self) -> int:
        """Bytes of blocks not handed out (free ranges and waiting buffers; retained ones not
        counted)."""
        waiting = sum(b._carve[2] for bufs in self._free.values() for b in bufs)
        return self._space.free_bytes + waiting

    def retained_bytes(self) -> int:
        return self._retained_reserved

    def _carve(self, nbytes: int) -> torch.Tensor:
        """A new buffer of ``nbytes``: the buffers waiting in the free lists go back to their
        blocks first (a new shape: they merge), then the best fit, else a new block."""
        if self._free:
            self._flush()
        spot = self._space.carve(nbytes)
        if spot is None:
            self._grow(nbytes)
            spot = self._space.carve(nbytes)
        block, start, taken = spot
        exact = self._exact.get(nbytes)
        if exact is None:
            exact = self._exact[nbytes] = self._device.host_block_size(nbytes)
        # A view of the block's storage with no ``_base``: once the pool lets the block go, a
        # buffer still handed out is the only thing keeping the memory (as the simulation
        # checks for copies queued into it).
        whole = self._blocks[block]
        buf = whole.new_empty(0).set_(whole.untyped_storage(), start, (nbytes,))
        buf._carve = (block, start, taken, exact)
        return buf

    def _flush(self) -> None:
        """Waiting buffers back into their blocks' free ranges."""
        give_back = self._space.give_back
        for bufs in self._free.values():
            for buf in bufs:
                block, start, taken, _ = buf._carve
                give_back(block, start, taken)
        self._free.clear()

    def _grow(self, nbytes: int) -> None:
        """A new block that holds ``nbytes``; within a budget, unused blocks go first."""
        if self.budget is not None and (
                self.reserved_bytes + self._device.host_block_size(nbytes) > self.budget):
            self._drop_idle()
        block = self._reserve(nbytes)
        name = self._next_block
        self._next_block += 1
        self._blocks[name] = block
        self._space.add_block(name, block.numel())
        self._users[name] = 0
        self.idle_bytes += block.numel()

    def _drop_idle(self) -> None:
        """Let go of every block no buffer uses, once the copies that used them are done."""
        self._flush()
        idle = [name for name, users in self._users.items() if not users]
        if not idle:
            return
        if self._fence is not None:
            self._fence()
        for name in idle:
            self._space.remove_block(name)
            size = self._blocks.pop(name).numel()
            del self._users[name]
            self.reserved_bytes -= size
            self.idle_bytes -= size

    def _reserve(self, nbytes: int) -> torch.Tensor:
        """A pinned block for ``nbytes`` from the device (counted, timed)."""
        start = time.perf_counter()
        try:
            block = self._device.reserve_host(nbytes)
        except RuntimeError as exc:
            raise OffloadUsageError(
                f"allocating {nbytes} bytes of pinned host memory failed ({exc}). Pass "
                "max_host_bytes=<bytes> to get_cpu_offload_context (or apply_offloading) to "
                "keep saved tensors on the GPU beyond a host budget, or offload fewer layers "
                f"(pinned now: {self.reserved_bytes} bytes reserved, {self.in_use_bytes} in use)"
            ) from exc
        self.allocation_seconds += time.perf_counter() - start
        self.allocations += 1
        self.reserved_bytes += block.numel()
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)
        return block


def _fenced_drop(fence: Callable[[], None], *holders: dict) -> None:
    """The pool's end: wait for its copies, then let its blocks go (a failing fence, at
    shutdown say, still lets them go: nothing is left to wait for then)."""
    try:
        fence()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass
    for holder in holders:
        holder.clear()
