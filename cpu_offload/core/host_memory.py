"""Pinned host memory at the size asked, on the GPU's NUMA node: where ``CudaDevice`` gets the
blocks that the pinned pool carves its buffers from.

torch's pinned (caching host) allocator rounds every block up to a power of two, so buffers
taken from it one by one cost up to twice the bytes offloaded (1.44-1.64x measured on the
reference workloads). Here a block is an anonymous mapping of whole pages (``mmap``), bound to
the GPU's NUMA node before its first touch (``numa.bind_to_node``), then page-locked by the
driver (``driver.HostRegistration``): the host reserves the bytes asked, rounded up to a page.
The block is unregistered and unmapped when the last tensor over it dies (the tensor holds the
mapping), so whoever frees a block must first wait for the copies that use it, as for any
memory the device copies without torch's allocator knowing (``PinnedPool``'s fence).

Where that cannot work (no driver library, registration refused, as on some virtualised hosts)
or is switched off (``CPU_OFFLOAD_EXACT_PINNED=0``), blocks come from torch's allocator at the
power of two it would reserve anyway, so that the pool can use all of it, and ``kind`` says
why. ``CPU_OFFLOAD_PINNED_NUMA=0`` leaves placement to the kernel's default policy.
"""
from __future__ import annotations

import mmap
import threading
from typing import Optional

import torch

from .driver import CUDA_ERROR_OUT_OF_MEMORY, host_registration
from .numa import bind_to_node, gpu_numa_node

PAGE = mmap.PAGESIZE


def page_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages: what an exact block of that size reserves.

    Example::

        >>> from cpu_offload.core.host_memory import PAGE, page_rounded
        >>> page_rounded(1) == PAGE and page_rounded(PAGE + 1) == 2 * PAGE
        True
    """
    return -(-max(nbytes, 1) // PAGE) * PAGE


def power_of_two(nbytes: int) -> int:
    """The block torch's pinned allocator reserves for ``nbytes``: the next power of two.

    Example::

        >>> from cpu_offload.core.host_memory import power_of_two
        >>> power_of_two(600 << 20) == 1 << 30
        True
    """
    return 1 << max(nbytes - 1, 0).bit_length()


class CudaHostMemory:
    """Pinned blocks for GPU ``index``: page-locked at exact size on the GPU's NUMA node
    (``exact``, ``numa``), else from torch's allocator (power-of-two blocks).

    ``block_size(n)`` is what ``allocate(n)`` reserves and returns (all of it usable), known
    before allocating (a host budget needs it); ``kind`` says which memory it is and why.

    Example::

        >>> from cpu_offload.core.host_memory import CudaHostMemory
        >>> mem = CudaHostMemory(0, exact=False)     # nothing is allocated until asked
        >>> mem.block_size(3000), mem.kind
        (4096, "torch's pinned allocator (power-of-two blocks): exact-size blocks are switched off")
    """

    def __init__(self, index: int, exact: bool = True, numa: bool = True) -> None:
        self.index = index
        self.numa = numa
        self._lock = threading.Lock()
        self._node: Optional[int] = None
        self._placement = "NUMA placement not tried yet"
        self._fallback: Optional[str] = None  # why blocks come from torch's allocator
        if not exact:
            self._fallback = "exact-size blocks are switched off"
        elif host_registration() is None:
            self._fallback = "the CUDA driver library is not available to register host memory"

    @property
    def exact(self) -> bool:
        return self._fallback is None

    @property
    def kind(self) -> str:
        if self._fallback is not None:
            return f"torch's pinned allocator (power-of-two blocks): {self._fallback}"
        return f"page-locked at exact size (cuMemHostRegister), {self._placement}"

    def block_size(self, nbytes: int) -> int:
        return page_rounded(nbytes) if self._fallback is None else power_of_two(nbytes)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat ``uint8`` pinned tensor of ``block_size(nbytes)`` bytes.

        Raises:
            RuntimeError: the host has not that much memory to pin.
        """
        if self._fallback is None:
            block = self._registered(page_rounded(nbytes))
            if block is not None:
                return block
        return torch.empty(power_of_two(nbytes), dtype=torch.uint8, pin_memory=True)

    def _registered(self, size: int) -> Optional[torch.Tensor]:
        """A page-locked mapping of ``size`` bytes; None after switching to torch's allocator
        (registration refused for a reason other than memory)."""
        try:
            mapping = _PageLocked(-1, size, flags=mmap.MAP_PRIVATE)
        except OSError as exc:
            raise RuntimeError(f"mmap of {size} bytes failed: {exc}") from exc
        try:  # a forked child (a data loader's worker) must not copy pinned pages
            mapping.madvise(mmap.MADV_DONTFORK)
        except (AttributeError, OSError):
            pass
        block = torch.frombuffer(mapping, dtype=torch.uint8)
        address = block.data_ptr()
        self._place(address, size)
        driver = host_registration()
        rc = driver.register(address, size, self.index)
        if rc == CUDA_ERROR_OUT_OF_MEMORY:
            raise RuntimeError(f"page-locking {size} bytes failed: out of memory (CUresult 2)")
        if rc:
            with self._lock:
                self._fallback = f"cuMemHostRegister failed with CUresult {rc}"
            return None
        mapping.registration = (driver, address, self.index)
        return block

    def _place(self, address: int, size: int) -> None:
        """Bind the pages of a fresh block to the GPU's NUMA node, if known and asked for."""
        if not self.numa:
            self._placement = "NUMA placement off"
            return
        if self._node is None:
            self._node = gpu_numa_node(self.index)
            if self._node is None:
                self._placement = "the host exposes no NUMA node for this GPU"
                self.numa = False
                return
        why = bind_to_node(address, size, self._node)
        self._placement = f"on NUMA node {self._node}" if why is None else why


class _PageLocked(mmap.mmap):
    """An anonymous mapping page-locked by the driver: unregistered just before it is unmapped,
    which is when the last tensor over it dies (``torch.frombuffer`` keeps the mapping)."""

    registration: Optional[tuple] = None  # (HostRegistration, address, GPU index) once locked

    def __del__(self) -> None:
        registration, self.registration = self.registration, None
        if registration is not None:
            driver, address, index = registration
            try:
                driver.unregister(address, index)
            except Exception:  # noqa: BLE001 - at interpreter exit, say; the unmap still frees it
                pass
