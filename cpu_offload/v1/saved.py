"""What V1 hands autograd for each saved tensor, and how the tensor comes back.

The packed object *owns* the saved data; the handler only keeps what its schedule still has to act
on. Autograd therefore decides lifetimes exactly as it does without offloading: a retained graph
keeps its tensors, a graph that never reaches backward frees them when it dies, and a backward the
schedule did not foresee (a partial ``autograd.grad``, a second backward of a retained graph) still
finds every tensor, reloading it on the compute stream if it has to. Nothing here holds a tensor
with autograd history, so no reference cycle can form through a saved tensor's own ``grad_fn``.

A tensor is offloaded as the whole storage it views (``storage.storage_bytes``), once per group
however many saved tensors share it, and restored with identical geometry (``restore_view``).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from ..compat import is_traceable_wrapper_subclass
from ..core.device import Event, OffloadDevice, Stream
from ..core.storage import KeptRef as Kept
from ..core.storage import ViewMeta, check_version, restore_view, storage_bytes
from ..core.subclass import tensor_flatten, tensor_unflatten
from .marking import needs_force_clear

try:  # tensors of torch.compile tracing are never offloaded (Transformer Engine does the same)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor as _FunctionalTensor

    _STRAY_TYPES: Tuple[type, ...] = (_FakeTensor, _FunctionalTensor)
except ImportError:  # pragma: no cover
    _STRAY_TYPES = ()


class ReloadBufferSet:
    """One of the two double-buffering sets: device buffers reused by every other offloaded group.

    ``generation`` changes whenever the set is refilled, so a tensor restored from an older fill
    (kept alive by a retained graph) knows its bytes were overwritten and reloads on demand.
    """

    def __init__(self) -> None:
        self.buffers: List[torch.Tensor] = []
        self.generation = 0
        self.owner: Optional[Tuple[int, int]] = None  # (step, group) of the current fill

    def busy(self, step: int, current_group: int) -> bool:
        """Whether the current fill may still be read: its group's backward has not run yet
        (groups above ``current_group`` have finished their backward)."""
        return self.owner is not None and self.owner[0] == step and self.owner[1] <= current_group

    def take(
        self, owner: Tuple[int, int], sizes: List[int], device: OffloadDevice, where: torch.device
    ) -> List[torch.Tensor]:
        """Buffers of at least ``sizes`` bytes (prefix views), growing the set where needed."""
        self.generation += 1
        self.owner = owner
        out = []
        for i, nbytes in enumerate(sizes):
            if i == len(self.buffers):
                self.buffers.append(device.alloc_device(nbytes, where))
            elif self.buffers[i].numel() < nbytes:
                device.will_free(self.buffers[i])
                self.buffers[i] = device.alloc_device(nbytes, where)
            out.append(self.buffers[i][:nbytes])
        return out


class StorageRecord:
    """One storage of one group: its device bytes until released, its host copy, its reload."""

    __slots__ = (
        "device",
        "where",
        "nbytes",
        "device_flat",
        "host",
        "offload_event",
        "reloaded",
        "reload_event",
        "reload_pending",
        "reload_fence",
        "slot",
        "users",
        "version_refs",
        "force_clear",
        "__weakref__",  # the handler lists the records it reloaded, weakly
    )

    def __init__(self, device: OffloadDevice, t: torch.Tensor) -> None:
        self.device = device
        self.where = t.device
        self.device_flat: Optional[torch.Tensor] = storage_bytes(t)
        self.nbytes = self.device_flat.numel()
        self.host: Optional[torch.Tensor] = None
        self.offload_event: Optional[Event] = None
        self.reloaded: Optional[torch.Tensor] = None
        self.reload_event: Optional[Event] = None
        self.reload_pending = False
        self.reload_fence: Optional[Stream] = None  # the stream the reload buffer belongs to
        self.slot: Optional[Tuple[ReloadBufferSet, int]] = None
        self.users: List[weakref.ref] = []  # the PackedTensors restored from this record
        self.version_refs: List[torch.Tensor] = []  # aliases emptied at release, see release_device
        self.force_clear: List[torch.Tensor] = []

    def alive(self) -> bool:
        """Whether any saved tensor restored from this record can still be unpacked."""
        return any(u() is not None for u in self.users)

    def start_offload(self, stream: Stream) -> None:
        """Queue the device-to-host copy on ``stream`` (the caller fences it after compute)."""
        if self.host is None and self.device_flat is not None:
            self.host = self.device.alloc_host(self.nbytes)
            self.device.copy(stream, self.host, self.device_flat)

    def release_device(self) -> None:
        """Drop the device bytes; the caller has made compute wait for the offload copy.

        The version-tracking aliases keep their version counter but let go of the storage, and
        force-clear tensors (inner tensors of wrappers kept in ``ctx``) are emptied in place.
        """
        if self.device_flat is None or self.host is None:
            return
        self.device.will_free(self.device_flat)
        self.device_flat = None
        for alias in self.version_refs:
            alias.data = alias.new_empty(0)
        self.version_refs = []
        self.drop_force_clear(clear=True)

    def drop_force_clear(self, clear: bool) -> None:
        for t in self.force_clear:
            if clear:
                t.data = t.new_empty(0)
        self.force_clear = []

    def needs_reload(self) -> bool:
        return self.device_flat is None and self.host is not None and not self._reload_valid()

    def start_reload(
        self, stream: Stream, buf: torch.Tensor, slot: Optional[Tuple[ReloadBufferSet, int]]
    ) -> None:
        """Queue the host-to-device copy into ``buf`` (allocated on the compute stream, which is
        current now)."""
        self.device.copy(stream, buf, self.host)
        self.reloaded, self.slot, self.reload_pending = buf, slot, True
        self.reload_fence = self.device.current_stream()

    def drop_reload(self) -> None:
        """Let go of the reload buffer (the step it was made for was abandoned): a graph that
        outlives the step, e.g. one torch 2.6 keeps alive after a backward raised in a
        checkpointed ``autograd.Function``, then holds only the host copy and reloads on demand.
        As in ``__del__``, a copy never waited for is first ordered before the buffer's stream
        reuses its memory."""
        if self.reloaded is None:
            return
        self._fence_pending_reload()
        self.reloaded, self.slot, self.reload_pending = None, None, False

    def _fence_pending_reload(self) -> None:
        """If the reload copy was never waited for, make the stream its buffer was allocated on
        wait for it, so that the caching allocator cannot hand that memory to a new tensor the
        late copy then overwrites (nor a double-buffer set free or refill it while the copy
        still writes)."""
        fence = getattr(self, "reload_fence", None)  # None also if __init__ did not finish
        if fence is not None and self.reload_pending and self.reload_event is not None:
            self.device.wait_event(fence, self.reload_event)

    def __del__(self) -> None:
        # The graph that owns this record is gone (a backward that raised, a graph dropped after
        # a partial backward): a reload buffer of our own dies with it.
        self._fence_pending_reload()

    def _reload_valid(self) -> bool:
        if self.reloaded is None:
            return False
        return self.slot is None or self.slot[0].generation == self.slot[1]

    def device_bytes(self) -> torch.Tensor:
        """The saved bytes on the device, ordered before compute issued from now on."""
        dev = self.device
        if self.device_flat is not None:
            return self.device_flat
        compute = dev.current_stream()
        if self._reload_valid():
            if self.reload_pending:
                dev.wait_event(compute, self.reload_event)
                self.reload_pending = False
            return self.reloaded  # type: ignore[return-value]
        # Not reloaded by the schedule (or the double buffer was refilled since): reload now.
        if self.offload_event is not None:
            dev.wait_event(compute, self.offload_event)
        buf = dev.alloc_device(self.nbytes, self.where)
        dev.copy(compute, buf, self.host)
        self.reloaded, self.slot, self.reload_pending = buf, None, False
        return buf


class Offloaded:
    """A saved tensor whose storage is moved through a ``StorageRecord``."""

    __slots__ = ("meta", "record", "alias", "version")

    def __init__(self, t: torch.Tensor, record: StorageRecord) -> None:
        self.meta = ViewMeta.of(t)
        self.record = record
        self.alias = t.detach()  # shares the version counter; emptied when the record releases
        self.version = t._version
        record.version_refs.append(self.alias)

    def unpack(self) -> torch.Tensor:
        check_version(self.alias, self.version, self.meta.size)
        return restore_view(self.record.device_bytes(), self.meta)


Entry = Union[Kept, Offloaded, "Wrapped"]


class Wrapped:
    """A wrapper subclass (``__tensor_flatten__``) whose inner tensors are packed one by one."""

    __slots__ = ("cls", "ctx", "inner", "size", "stride")

    def __init__(self, t: torch.Tensor, ctx: Any, inner: Dict[str, Entry]) -> None:
        self.cls, self.ctx, self.inner = type(t), ctx, inner
        self.size, self.stride = t.size(), t.stride()

    def unpack(self) -> torch.Tensor:
        inner = {name: entry.unpack() for name, entry in self.inner.items()}
        return tensor_unflatten(self.cls, inner, self.ctx, self.size, self.stride)


class PackedTensor:
    """What autograd stores for one saved tensor: the V1 tag ``(group, index)`` and its entry."""

    __slots__ = ("tag", "entry", "__weakref__")

    def __init__(self, tag: Tuple[int, int]) -> None:
        self.tag = tag
        self.entry: Optional[Entry] = None

    def __repr__(self) -> str:
        return f"PackedTensor(tag={self.tag}, {type(self.entry).__name__})"


RecordFor = Callable[[torch.Tensor], Optional[StorageRecord]]


def pack_tensor(t: torch.Tensor, owner: PackedTensor, record_for: RecordFor) -> Entry:
    """Pack ``t`` for ``owner``; ``record_for(leaf)`` returns the record to offload a plain
    tensor through, or ``None`` to keep it."""
    if _STRAY_TYPES and isinstance(t, _STRAY_TYPES):
        return Kept(t)
    if is_traceable_wrapper_subclass(t):
        names, ctx = tensor_flatten(t)
        inner = {name: pack_tensor(getattr(t, name), owner, record_for) for name in names}
        if all(isinstance(e, Kept) for e in inner.values()):
            return Kept(t)
        return Wrapped(t, ctx, inner)
    record = record_for(t)
    if record is None:
        return Kept(t)
    record.users.append(weakref.ref(owner))
    if needs_force_clear(t) and t.grad_fn is None:
        record.force_clear.append(t)  # the object a wrapper in ctx holds; emptied at release
    return Offloaded(t, record)
