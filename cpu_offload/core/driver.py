"""What we ask of the CUDA driver directly: asynchronous copies between raw addresses
(``cuMemcpyAsync``), and page-locking host memory that we allocated (``cuMemHostRegister``).

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

Host registration (``host_registration``) is the driver's, not the runtime's
(``cudaHostRegister``), because a failed runtime call leaves an error behind that torch's next
kernel-launch check would report as its own; the driver keeps no such state. Each call makes
the GPU's primary context (the one torch uses) current for its duration, so a block may be let
go from any thread (a finalizer, the autograd engine's).
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Callable, Optional

import torch

from .checks import env_flag

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
    if not env_flag("CPU_OFFLOAD_DRIVER_COPIES"):
        return None
    lib = _library()
    fn = getattr(lib, "cuMemcpyAsync", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _library() -> Optional[ctypes.CDLL]:
    """The CUDA driver library, or None (a build of torch without CUDA, ROCm, no driver)."""
    if torch.version.cuda is None or getattr(torch.version, "hip", None):
        return None
    try:
        return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None


CU_MEMHOSTREGISTER_PORTABLE = 1  # pinned for every context, not only the registering one
CUDA_ERROR_OUT_OF_MEMORY = 2


class HostRegistration:
    """``cuMemHostRegister`` and ``cuMemHostUnregister`` of host ranges for GPU ``index``'s
    primary context (pushed current for each call). Results are the driver's codes (0: done).

    Example::

        >>> from cpu_offload.core.driver import host_registration
        >>> reg = host_registration()   # None on a machine without the CUDA driver
        >>> reg is None or callable(reg.register)
        True
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        def fn(*names: str, args: tuple) -> Callable[..., int]:
            for name in names:  # cuda.h maps each call to its newest version
                f = getattr(lib, name, None)
                if f is not None:
                    f.argtypes, f.restype = list(args), ctypes.c_int
                    return f
            raise AttributeError(names[0])

        ptr, u = ctypes.c_void_p, ctypes.c_uint
        self._init = fn("cuInit", args=(u,))
        self._device_get = fn("cuDeviceGet", args=(ctypes.POINTER(ctypes.c_int), ctypes.c_int))
        self._retain = fn("cuDevicePrimaryCtxRetain", args=(ctypes.POINTER(ptr), ctypes.c_int))
        self._push = fn("cuCtxPushCurrent_v2", "cuCtxPushCurrent", args=(ptr,))
        self._pop = fn("cuCtxPopCurrent_v2", "cuCtxPopCurrent", args=(ctypes.POINTER(ptr),))
        self._register = fn("cuMemHostRegister_v2", "cuMemHostRegister",
                            args=(ptr, ctypes.c_size_t, u))
        self._unregister = fn("cuMemHostUnregister", args=(ptr,))
        self._contexts: dict[int, ptr] = {}  # GPU index -> its primary context, retained once
        self._lock = threading.Lock()

    def register(self, address: int, nbytes: int, index: int) -> int:
        """Page-lock ``[address, address + nbytes)`` for asynchronous copies with any GPU."""
        return self._in_context(index, self._register, ctypes.c_void_p(address),
                                ctypes.c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE)

    def unregister(self, address: int, index: int) -> int:
        """Undo ``register`` of the range that starts at ``address``."""
        return self._in_context(index, self._unregister, ctypes.c_void_p(address))

    def _in_context(self, index: int, call: Callable[..., int], *args: object) -> int:
        ctx = self._context(index)
        if not isinstance(ctx, ctypes.c_void_p):
            return ctx  # the driver's error
        rc = self._push(ctx)
        if rc:
            return rc
        try:
            return call(*args)
        finally:
            self._pop(ctypes.byref(ctypes.c_void_p()))

    def _context(self, index: int) -> object:
        with self._lock:
            ctx = self._contexts.get(index)
            if ctx is not None:
                return ctx
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            rc = (self._init(0) or self._device_get(ctypes.byref(dev), index)
                  or self._retain(ctypes.byref(ctx), dev))
            if rc:
                return rc
            self._contexts[index] = ctx
            return ctx


_registration: Optional[list] = None


def host_registration() -> Optional[HostRegistration]:
    """The driver's host registration calls, or None where the driver is not there. Looked up
    once per process."""
    global _registration
    if _registration is None:
        lib = _library()
        try:
            _registration = [HostRegistration(lib) if lib is not None else None]
        except AttributeError:
            _registration = [None]
    return _registration[0]
