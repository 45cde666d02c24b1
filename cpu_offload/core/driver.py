"""Asynchronous copies through the CUDA driver (``cuMemcpyAsync``), from raw addresses.

V2 queues one copy per saved storage, and on a host-bound model that host time is the step's
(``benchmarks/hook_overhead.py``). Through torch, each copy needs a tensor on each side, so the
device side of a copy out needs a flat view made per storage, the copy switches the current
stream, and torch's pinned allocator records an event for the host block. Through the driver it
is one call on two addresses and a stream handle, and no view is made (``benchmarks/RESULTS.md``
has what that saved).

What the driver does not do: tell torch's pinned (host caching) allocator that a copy uses a host
block. So a pinned buffer copied this way must stay referenced until its copy is done
(``PinnedPool`` waits for the copy stream before it lets buffers go), and ``SimulatedDevice``
checks that rule for the copies it stands in for.

``CPU_OFFLOAD_DRIVER_COPIES=0`` turns it off (torch's ``copy_`` is used instead); so does a
platform without the CUDA driver library (ROCm, CPU-only builds).
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Optional

import torch

CopyAsync = Callable[[int, int, int, int], int]  # (dst, src, nbytes, stream handle) -> CUresult

_loaded: Optional[list] = None  # [the copy function or None], once looked up


def driver_copy_async() -> Optional[CopyAsync]:
    """``cuMemcpyAsync(dst, src, nbytes, stream)`` as a Python callable returning the driver's
    result code (0: queued), or ``None`` where it is unavailable or switched off. Looked up
    once per process.

    Example::

        >>> from cpu_offload.core.driver import driver_copy_async
        >>> copy = driver_copy_async()   # None on a machine without the CUDA driver
        >>> copy is None or callable(copy)
        True
    """
    global _loaded
    if _loaded is None:
        _loaded = [_load()]
    return _loaded[0]


def _load() -> Optional[CopyAsync]:
    if os.environ.get("CPU_OFFLOAD_DRIVER_COPIES", "1").strip().lower() in ("0", "false", "no"):
        return None
    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        return None
    name = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
    try:
        lib = ctypes.CDLL(name)
        fn = lib.cuMemcpyAsync
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn
