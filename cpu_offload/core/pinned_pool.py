"""Host buffers reused across training steps.

Steady-state training saves the same storages every step, so the pool hands back buffers of the
exact byte size it handed out last step: no pinned allocation (``cudaHostAlloc``) after the first
step, and no power-of-two rounding. ``trim`` (called at each step start) frees what the last step
did not use, so the pool tracks the working set instead of growing with shape changes.

With ``retain`` (CUDA graphs), buffers are bound to a stable key (layer, slot) and never returned:
a captured graph replays copies into fixed addresses. A keyed buffer serves one saved storage at a
time: a second forward pass started while the first one's graph still holds its buffers is
refused (sharing them would overwrite the first step's activations).

Buffers are let go (``trim``, or the pool's end) only after ``fence`` has waited for the copies
that may still use them: the device may queue copies without telling torch's pinned allocator
(``OffloadDevice.copy_after_compute``), which would otherwise hand the block out again while a
copy still reads or writes it.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Callable, Hashable, Optional

import torch

from .device import OffloadDevice
from .errors import OffloadUsageError


class PinnedPool:
    """Exact-size free lists of host buffers, trimmed to the last step's working set."""

    def __init__(self, device: OffloadDevice, fence: Optional[Callable[[], None]] = None) -> None:
        self._device = device
        # Blocks the host until no queued copy uses a buffer of this pool (called before buffers
        # are let go); None: torch's pinned allocator knows of every copy.
        self._fence = fence
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._used: dict[int, int] = defaultdict(int)  # buffers of each size acquired since trim
        self._retained: dict[Hashable, torch.Tensor] = {}
        if fence is not None:  # at the pool's end, its buffers go only after the fence
            weakref.finalize(self, _fenced_drop, fence, self._free, self._retained).atexit = False
        self._retained_in_use: set = set()
        self.allocations = 0
        self.in_use_bytes = 0  # handed out and not given back
        self.peak_in_use_bytes = 0  # the most in use at once since the last trim (step start)

    def acquire(self, nbytes: int, key: Optional[Hashable] = None) -> torch.Tensor:
        """A host buffer of exactly ``nbytes`` (a prefix of a retained buffer when ``key``)."""
        if key is not None:
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
                buf = self._retained[key] = self._allocate(nbytes)
            self._retained_in_use.add(key)
            self._count_in_use(nbytes)
            return buf[:nbytes]
        # (once per offloaded storage: no helper calls on the common path)
        self._used[nbytes] += 1
        free = self._free[nbytes] if nbytes in self._free else None
        buf = free.pop() if free else self._allocate(nbytes)
        in_use = self.in_use_bytes = self.in_use_bytes + nbytes
        if in_use > self.peak_in_use_bytes:
            self.peak_in_use_bytes = in_use
        return buf

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

    def _count_in_use(self, nbytes: int) -> None:
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)

    def release(self, buf: torch.Tensor, key: Optional[Hashable] = None) -> None:
        """Give a buffer back (retained buffers stay bound to their key, free for the next step)."""
        nbytes = buf.shape[0]
        self.in_use_bytes -= nbytes
        if key is None:
            self._free[nbytes].append(buf)
        else:
            self._retained_in_use.discard(key)

    def trim(self) -> None:
        """Free cached buffers beyond what the last step used, size by size (after the fence,
        if any is let go)."""
        if self._fence is not None and any(
                len(free) > self._used.get(nbytes, 0) for nbytes, free in self._free.items()):
            self._fence()
        for nbytes in list(self._free):
            keep = self._used.get(nbytes, 0)
            free = self._free[nbytes]
            del free[keep:]
            if not free:
                del self._free[nbytes]
        self._used.clear()
        self.peak_in_use_bytes = self.in_use_bytes

    def cached_bytes(self) -> int:
        """Bytes sitting in free lists (not counting retained or in-use buffers)."""
        return sum(n * len(bufs) for n, bufs in self._free.items())

    def retained_bytes(self) -> int:
        return sum(b.numel() for b in self._retained.values())

    def _allocate(self, nbytes: int) -> torch.Tensor:
        try:
            buf = self._device.alloc_host(nbytes)
        except RuntimeError as exc:
            raise OffloadUsageError(
                f"allocating {nbytes} bytes of pinned host memory failed ({exc}). Pass "
                "max_host_bytes=<bytes> to get_cpu_offload_context to keep tensors on the GPU "
                f"beyond a host budget (pinned now: {self.in_use_bytes} bytes in use)"
            ) from exc
        self.allocations += 1
        return buf


def _fenced_drop(fence: Callable[[], None], *holders: dict) -> None:
    """The pool's end: wait for its copies, then let its buffers go (a failing fence, at
    shutdown say, still lets them go: nothing is left to wait for then)."""
    try:
        fence()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass
    for holder in holders:
        holder.clear()
