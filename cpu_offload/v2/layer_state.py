"""What V2 holds for one layer of one step: its offloaded storages and their transfer state.

Ownership is arranged so that offloading never extends or shortens a tensor's life:

- autograd's graph holds a ``SavedRef`` per saved tensor (what the pack hook returns);
- a ``SavedRef`` holds its ``Entry`` (one per storage, shared by views and duplicates);
- an ``Entry`` holds the host copy while any ``SavedRef`` to it is alive, the device storage
  until the schedule releases it, and the reloaded storage until its last unpack in a backward.

When the graph frees a saved variable, its ``SavedRef`` dies and, with the last one, the entry
gives its host buffer back to the pool. Nothing here refers to a tensor with a ``grad_fn``, so no
reference cycle can form (memory returns to baseline with ``gc.disable()``).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Hashable, Optional

import torch

from ..core.device import Event, OffloadDevice
from ..core.errors import OffloadUsageError, OffloadVerifyError, stacklevel_outside_package
from ..core.markers import READY_EVENT_ATTR
from ..core.pinned_pool import PinnedPool
from ..core.subclass import tensor_unflatten
from ..core.storage import (
    KeptRef,
    VersionWatch,
    ViewMeta,
    checksum,
    forget_storages,
    held_elsewhere,
    restore_view,
    storage_bytes,
)

_tuple_new = tuple.__new__
from .stats import LayerStats, StepStats

# Copies of storages smaller than this are batched: the device-to-host copies of a layer's small
# saved tensors are queued together (at the layer's end, or when this many bytes are waiting, or
# before a large copy), and small reloads share one completion event. A launch costs the host
# microseconds while this many bytes take the link about 20 us, so batching them delays nothing
# that matters; larger storages are copied, and waited for, one by one, as soon as possible.
BATCH_BYTES = 1 << 20


class Runtime:
    """Step-independent pieces shared by all layers of one offload context."""

    __slots__ = (
        "device", "stream", "pool", "retain", "verify", "max_host_bytes", "threshold", "warned",
        "byte_limits", "events", "checks_frees",
    )

    def __init__(
        self,
        device: OffloadDevice,
        stream: Any,
        pool: PinnedPool,
        retain: bool,
        verify: bool = False,
        max_host_bytes: Optional[int] = None,
        threshold: int = 0,
    ) -> None:
        self.device = device
        self.stream = stream
        self.pool = pool
        self.retain = retain
        self.verify = verify  # checksum every offloaded storage and check it after reload
        self.max_host_bytes = max_host_bytes  # pinned bytes in use beyond which tensors stay
        self.threshold = threshold  # min_tensor_size_to_offload, for messages
        self.warned: set = set()
        # layer -> the most bytes it offloads per step, in save order (a plan that offloads a
        # layer in part, to use the link up to its capacity); the rest stays on the device
        self.byte_limits: dict[int, int] = {}
        # (layer, direction) -> the event recorded last time, re-recorded every step
        self.events: dict[tuple, Event] = {}
        # whether the device checks frees (the simulation): a real device is not even called
        self.checks_frees = type(device).will_free is not OffloadDevice.will_free

    def record(self, key: tuple) -> Event:
        """Record the point reached on the copy stream, in the event kept for ``key``."""
        event = self.events[key] = self.device.rerecord_event(self.stream, self.events.get(key))
        return event

    def warn_once(self, message: str, key: Optional[str] = None) -> None:
        """A ``UserWarning`` pointing at the user's line, given once per context and key."""
        key = key or message
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(
                f"cpu_offload: {message} (this warning is given once per context)",
                UserWarning,
                stacklevel=stacklevel_outside_package(),
            )  # one-time warnings already given by this context


class Entry:
    """One device storage saved during one forward pass, offloaded once.

    Several layers may share it (a layer's output saved by the next layer too, a RoPE table saved
    by every layer): each lists it, the first release frees it, the first reload restores it. It
    refers to the step-independent ``Runtime`` only, never back to a ``LayerState``, so entries
    and layers form no cycle.
    """

    __slots__ = (
        "rt", "stats", "lstats", "layer", "pool_key", "nbytes", "device", "key", "version", "owner",
        "gpu", "cpu", "reloaded", "ready_event", "reload_event", "waited", "watches", "live",
        "pops", "generation", "checksum", "verified", "error", "recheck", "listed_by",
        "reload_waited",
    )

    def __init__(
        self,
        rt: Runtime,
        stats: StepStats,
        lstats: LayerStats,
        layer: int,
        pool_key: Optional[Hashable],
        t: torch.Tensor,
        storage: Any,
        nbytes: int,
        key: int,
    ) -> None:
        self.rt = rt
        self.stats = stats  # of the step that saved it (holds no tensors: no cycle)
        self.lstats = lstats  # stats.layer(layer), looked up once: counted on every copy
        self.layer = layer  # the first layer that saved it
        self.pool_key = pool_key  # (layer, slot) when pinned buffers are retained
        # flat uint8 over the storage (``storage_bytes``, spelled out for a plain tensor)
        self.gpu: Optional[torch.Tensor] = (
            t.new_empty(0, dtype=torch.uint8).set_(storage) if type(t) is torch.Tensor
            else storage_bytes(t, storage)
        )
        self.nbytes = nbytes
        self.device = t.device
        self.key = key
        self.version = t._version  # of the saved tensors' version counter at the copy
        # The tensor that owns the memory, weakly: if something else keeps it alive past our
        # release (the caller, a layer that is not offloaded), backward uses it, no reload.
        self.owner = weakref.ref(t if t._base is None else t._base)
        self.cpu: Optional[torch.Tensor] = None
        self.reloaded: Optional[torch.Tensor] = None
        self.ready_event: Optional[Event] = None
        self.reload_event: Optional[Event] = None
        self.waited = False
        self.watches: Optional[list] = []  # VersionWatch of each SavedRef, until release
        self.live = 0  # SavedRefs alive
        self.pops = 0  # live SavedRefs unpacked since the reload (each counted once)
        self.generation = 0  # bumped whenever the reload is dropped: a new round of unpacks
        self.checksum: Optional[torch.Tensor] = checksum(self.gpu) if rt.verify else None
        self.verified = -1  # the generation whose reload passed the verify check
        self.error: Optional[str] = None
        self.recheck = False  # counted as held elsewhere when released; see ``recount``
        self.listed_by = layer  # the last layer that listed it (each lists it once)
        # Shared by the entries reloaded together (one event): whether compute waited for it
        self.reload_waited: Optional[list] = None

    def matches(self, t: torch.Tensor, nbytes: int) -> bool:
        """Whether saving ``t`` again can reuse this entry: same storage, still on the device,
        unchanged since its copy was queued (an in-place change needs a fresh copy)."""
        return self.gpu is not None and self.nbytes == nbytes and self.version == t._version

    def still_on_device(self) -> Optional[torch.Tensor]:
        """After release: the original storage, if something else kept it alive unchanged."""
        owner = self.owner()
        if owner is None or owner._version != self.version:
            return None
        storage = owner.untyped_storage()
        if storage.data_ptr() != self.key or storage.nbytes() != self.nbytes:
            return None  # re-pointed with set_
        return storage_bytes(owner, storage)

    def device_bytes_for_unpack(self) -> torch.Tensor:
        """The device storage to rebuild a saved tensor from, waiting (device-side) for it."""
        if self.gpu is not None:
            return self.gpu
        if self.reloaded is None:
            original = self.still_on_device()
            if original is not None:
                return original
            if self.cpu is None:
                raise OffloadUsageError(
                    "a saved tensor was used after its offload state was discarded (its forward "
                    "was aborted by an exception); run the forward pass again"
                )
            copy_in(self.rt, [self])  # not scheduled (custom schedule / partial backward): now
        if not self.waited:
            together = self.reload_waited
            if together is None or not together[0]:
                dev = self.rt.device
                compute = dev.current_stream()
                if dev.times_events:
                    self.stats.record_wait(dev.record_event(compute), self.reload_event)
                dev.wait_event(compute, self.reload_event)
                if together is not None:
                    together[0] = True
            self.waited = True
            if self.checksum is not None:
                self.verify_reload()
        return self.reloaded

    def verify_reload(self) -> None:
        """Verify mode: the reloaded bytes must be the bytes that were saved (blocks the host)."""
        if self.verified == self.generation:
            return
        if not torch.equal(checksum(self.reloaded), self.checksum):
            raise OffloadVerifyError(
                f"verify: the storage of {self.nbytes} bytes saved by layer {self.layer} came back "
                f"different after its reload (awaited event {self.reload_event!r}): a copy was "
                "read before it finished, or the host buffer was overwritten. Please report this "
                "with the model, the schedule and the torch version"
            )
        self.verified = self.generation

    def copy_out(self, ready: Optional[Event]) -> None:
        """Queue the device-to-host copy once the storage is final (``ready`` or now)."""
        rt = self.rt
        dev, stream = rt.device, rt.stream
        self.cpu = rt.pool.acquire(self.nbytes, self.pool_key)
        if ready is not None:
            dev.wait_event(stream, ready)
        else:
            dev.wait_stream(stream, dev.current_stream())
        dev.copy(stream, self.cpu, self.gpu)
        self.lstats.copied_out_bytes += self.nbytes

    def release(self, recheck: bool = False) -> None:
        """Drop our references to the device storage (its copy is known done). If nothing else
        holds it, that frees it; otherwise it lives on and backward uses it without a reload.
        ``recheck``: the holder may be about to let go (released inside a layer's call, whose
        caller still holds its input): ``recount`` looks again when backward starts."""
        if self.watches:
            forget_storages(self.watches)  # the watches must not be what keeps the memory alive
        self.watches = []
        stats = self.lstats
        if held_elsewhere(self.gpu):
            stats.held_elsewhere_bytes += self.nbytes
            self.recheck = recheck
        else:
            if self.rt.checks_frees:
                self.rt.device.will_free(self.gpu)
            stats.freed_bytes += self.nbytes
        self.gpu = None

    def recount(self) -> None:
        """At backward start: memory counted as held elsewhere at its release, but whose owner
        let go since, was freed after all (the statistics say so)."""
        if self.recheck:
            self.recheck = False
            if self.still_on_device() is None:
                self.lstats.held_elsewhere_bytes -= self.nbytes
                self.lstats.freed_bytes += self.nbytes

    def free_reload(self) -> None:
        """Forget the reloaded storage; if its copy was never waited for, make compute wait for
        it first, so the allocator cannot hand the memory out while the copy still writes."""
        buf = self.reloaded
        if buf is None:
            return
        self.reloaded = None
        if not self.waited and self.reload_event is not None:
            dev = self.rt.device
            dev.wait_event(dev.current_stream(), self.reload_event)
        self.reload_event = None
        self.reload_waited = None
        self.waited = False
        self.pops = 0
        self.generation += 1

    def drop(self) -> None:
        """Give the host buffer back and forget every buffer."""
        if self.reloaded is not None:
            self.free_reload()
        if self.cpu is not None:
            self.rt.pool.release(self.cpu, self.pool_key)
        self.cpu = self.gpu = self.watches = None


def copy_in(rt: Runtime, entries: list, event_key: Optional[tuple] = None) -> None:
    """Allocate device storages on the compute stream and queue the host-to-device copies.

    All buffers are allocated before any entry changes, so an out-of-memory error leaves every
    entry as it was (a retried backward reloads them again). ``event_key``: a layer's reload,
    ended by one event (``Runtime.record``) that the first unpack of any of its entries waits
    for, on behalf of all; without it (a reload on demand), one event per group of small
    copies and per large copy."""
    dev, stream = rt.device, rt.stream
    buffers = [dev.alloc_device(entry.nbytes, entry.device) for entry in entries]
    pairs = [(b, e.cpu) for b, e in zip(buffers, entries)]
    # The new buffers were allocated on the compute stream: copy once compute got there.
    if event_key is not None:
        dev.copy_after_compute(stream, pairs)
        events = [rt.record(event_key)] * len(entries)
        together: Optional[list] = [False]
    else:
        dev.wait_stream(stream, dev.current_stream())
        events = dev.copy_and_record(stream, pairs, BATCH_BYTES)
        together = None
    for entry, buf, event in zip(entries, buffers, events):
        entry.lstats.reloaded_bytes += entry.nbytes
        entry.reloaded = buf
        entry.reload_event = event
        entry.reload_waited = together
        entry.waited = False


class SavedRef:
    """What autograd stores instead of an offloaded tensor: its storage entry and geometry."""

    __slots__ = ("entry", "meta", "cls", "watch", "popped")

    def __init__(self, entry: Entry, meta: ViewMeta, cls: type, watch: VersionWatch) -> None:
        self.entry = entry
        self.meta = meta
        self.cls = cls
        self.watch = watch
        self.popped = -1  # the entry generation in which this was last unpacked
        entry.live += 1

    def __del__(self) -> None:
        entry = getattr(self, "entry", None)
        if entry is None:  # __init__ did not finish (torch 2.1 can drop a half-built ref)
            return
        entry.live -= 1
        if self.popped == entry.generation:
            entry.pops -= 1  # autograd freed it after its node ran: it no longer waits
        if entry.live == 0:
            entry.drop()

    def unpack(self) -> torch.Tensor:
        watch = self.watch  # per saved tensor, as autograd itself checks
        if watch.alias._version != watch.version:
            watch.check()
        entry = self.entry
        if entry.error is not None:
            raise OffloadUsageError(entry.error)
        flat = entry.gpu
        if flat is None:
            flat = entry.device_bytes_for_unpack()
        meta = self.meta
        if meta.bits_of is None:  # ``restore_view``, spelled out for the common case
            t = flat.new_empty(0, dtype=meta.dtype).set_(
                flat.untyped_storage(), meta.storage_offset, meta.size, meta.stride)
        else:
            t = restore_view(flat, meta)
        if self.cls is not torch.Tensor:
            t = t.as_subclass(self.cls)
        if self.popped != entry.generation:
            self.popped = entry.generation
            entry.pops += 1
        if entry.pops >= entry.live and entry.gpu is None:
            # Last unpack of this backward: autograd now owns the only reference, so the
            # reloaded memory is freed as soon as the backward node is done with it.
            entry.free_reload()
        return t


class SavedSubclassRef:
    """A wrapper subclass (``__tensor_flatten__``) whose inner tensors were offloaded."""

    __slots__ = ("cls", "ctx", "inner", "size", "stride")

    def __init__(self, t: torch.Tensor, ctx: Any, inner: dict) -> None:
        self.cls = type(t)
        self.ctx = ctx
        self.inner = inner
        self.size = t.size()
        self.stride = t.stride()

    def unpack(self) -> torch.Tensor:
        inner = {name: unpack(v) for name, v in self.inner.items()}
        return tensor_unflatten(self.cls, inner, self.ctx, self.size, self.stride)


def unpack(packed: Any) -> Any:
    """Inverse of the synchronizer's push."""
    return packed.unpack()


class LayerState:
    """Storages saved by one offloaded layer, and where they are: device, host, or both."""

    __slots__ = (
        "index", "rt", "stats", "lstats", "entries", "shared", "eager", "offload_event",
        "released", "reload_started", "limit", "pending", "pending_bytes",
    )

    def __init__(
        self, index: int, rt: Runtime, eager: bool, shared: dict, stats: StepStats
    ) -> None:
        self.index = index
        self.rt = rt
        self.stats = stats
        self.lstats: Optional[LayerStats] = None  # made when first counted (see layer_stats)
        self.entries: list[Entry] = []
        self.shared = shared  # storage address -> Entry, for the whole forward pass of a step
        self.eager = eager  # copy at save time (default schedule, or manual after start_offload)
        self.offload_event: Optional[Event] = None
        self.released = False
        self.reload_started = False
        self.limit = rt.byte_limits.get(index)  # bytes this layer may still offload, if limited
        self.pending: list[Entry] = []  # small storages whose copies are batched (BATCH_BYTES)
        self.pending_bytes = 0

    # -- forward ---------------------------------------------------------------------------------
    def push(self, t: torch.Tensor) -> Any:
        """Register a saved tensor; its storage's copy to the host starts now (eager mode).

        Note [hot path calls]: this runs for every offloaded saved tensor, so it makes only
        the calls it must (storage, geometry, version alias) and spells out small helpers;
        ``benchmarks/call_count.py`` counts them and ``tests/v2/test_hot_path_calls.py`` pins
        the count."""
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return KeptRef(t)
        if self.released:
            raise OffloadUsageError(
                f"layer {self.index} saved a tensor for backward after "
                f"release_activation_forward_gpu_memory({self.index}); release a layer only after "
                "its forward is over"
            )
        key = storage.data_ptr()
        shared = self.shared
        entry = shared[key] if key in shared else None
        if entry is None or not entry.matches(t, nbytes):
            budget = self.rt.max_host_bytes
            if budget is not None and self.rt.pool.in_use_bytes + nbytes > budget:
                return self._over_host_budget(t, nbytes, budget)
            if self.limit is not None:
                if nbytes > self.limit:
                    reason = "over the layer's byte limit (a partial plan)"
                    self.layer_stats().skipped_bytes[reason] += nbytes
                    return KeptRef(t)
                self.limit -= nbytes
            entry = self._new_entry(t, storage, key, nbytes)
        elif entry.listed_by != self.index:  # saved before, by an earlier layer
            entry.listed_by = self.index
            self.entries.append(entry)
        watch = VersionWatch(t)
        entry.watches.append(watch)
        lstats = self.lstats if self.lstats is not None else self.layer_stats()
        lstats.offloaded_tensors += 1
        cls = type(t)
        if cls is not torch.Tensor and cls is torch.nn.Parameter:
            cls = torch.Tensor
        if t.is_neg() or t.is_conj():
            meta = ViewMeta.of(t)
        else:  # ``ViewMeta.of`` spelled out (tensors without lazy bits)
            meta = _tuple_new(ViewMeta, (t.dtype, t.shape, t.stride(), t.storage_offset(), None))
        return SavedRef(entry, meta, cls, watch)

    def _new_entry(self, t: torch.Tensor, storage: Any, key: int, nbytes: int) -> Entry:
        """A storage saved for the first time in this forward (or changed since): list it and
        start its copy (eager), or note when it is final (the copy starts later)."""
        rt = self.rt
        pool_key = (self.index, len(self.entries)) if rt.retain else None
        lstats = self.lstats if self.lstats is not None else self.layer_stats()
        entry = Entry(rt, self.stats, lstats, self.index, pool_key, t, storage, nbytes, key)
        self.shared[key] = entry
        ready = getattr(t, READY_EVENT_ATTR, None)
        if ready is None and t._base is not None:  # start_offload(offload_base_tensor=True)
            ready = getattr(t._base, READY_EVENT_ATTR, None)
        if self.eager and ready is None and self.offload_event is None:
            # The automatic schedule: batch small copies, queue a large one (and the batch
            # before it) at once, so it overlaps the rest of the layer's forward.
            entry.cpu = rt.pool.acquire(entry.nbytes, pool_key)
            self.pending.append(entry)
            self.pending_bytes += entry.nbytes
            if entry.nbytes >= BATCH_BYTES or self.pending_bytes >= BATCH_BYTES:
                self.flush_copies()
        elif self.eager:
            self.flush_copies()
            entry.copy_out(ready)
            if self.offload_event is not None:  # manual: offload already started
                self.offload_event = rt.device.record_event(rt.stream)
        else:
            entry.ready_event = ready or rt.device.record_event(rt.device.current_stream())
        self.entries.append(entry)
        return entry

    def layer_stats(self) -> LayerStats:
        """This layer's counters, looked up once. Made only when something is counted, so a
        layer that saved nothing has none (as the statistics report it)."""
        lstats = self.lstats
        if lstats is None:
            lstats = self.lstats = self.stats.layer(self.index)
        return lstats

    def _over_host_budget(self, t: torch.Tensor, nbytes: int, budget: int) -> KeptRef:
        self.layer_stats().skipped_bytes["over max_host_bytes"] += nbytes
        self.rt.warn_once(
            f"pinned host memory reached max_host_bytes={budget}; saved tensors beyond it stay "
            "on the GPU"
        )
        return KeptRef(t)

    def flush_copies(self) -> None:
        """Queue the batched device-to-host copies (after the compute that produced them)."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        self.pending_bytes = 0
        # An entry whose saved tensors autograd already freed was dropped: nothing to copy.
        pending = [e for e in pending if e.gpu is not None]
        if not pending:
            return
        self.rt.device.copy_after_compute(self.rt.stream, [(e.cpu, e.gpu) for e in pending])
        for entry in pending:
            entry.lstats.copied_out_bytes += entry.nbytes

    def finish_forward(self) -> None:
        """End of this layer's forward: mark where its offload copies end on the copy stream
        (one event per layer, re-recorded every step)."""
        if self.eager and self.entries:
            self.flush_copies()
            self.offload_event = self.rt.record((self.index, "offload"))

    def start_offload(self) -> None:
        """Manual mode: queue the copies of every entry not copied yet; tensors this layer saves
        from now on are copied as they are saved."""
        for entry in self.entries:
            if entry.cpu is None and entry.gpu is not None:
                entry.copy_out(entry.ready_event)
        self.eager = True
        self.offload_event = self.rt.device.record_event(self.rt.stream)
        self.rt.device.trace("offload", self.index)

    def release(self, recheck: bool = False) -> None:
        """Free the device storages once their copies are done (device-side wait, host free).
        ``recheck``: see ``Entry.release``."""
        if self.released:
            return
        on_device = [e for e in self.entries if e.gpu is not None]
        if None in [e.cpu for e in on_device]:
            raise OffloadUsageError(
                f"release_activation_forward_gpu_memory({self.index}) before "
                f"start_offload_layer({self.index}): start the offload first"
            )
        dev = self.rt.device
        if on_device:
            compute = dev.current_stream()
            if dev.times_events:
                self.stats.record_wait(dev.record_event(compute), self.offload_event)
            dev.wait_event(compute, self.offload_event)
        watches = [w for e in on_device if e.watches for w in e.watches]
        if watches:  # forgotten together: one version-counter call for the layer
            forget_storages(watches)
        for entry in on_device:
            entry.watches = []
            entry.release(recheck)
        self.released = True
        dev.trace("release", self.index)

    # -- backward --------------------------------------------------------------------------------
    def start_reload(self) -> None:
        """Allocate device storages on the compute stream and queue the copies back."""
        if not self.released or self.reload_started:
            return
        for entry in self.entries:
            if entry.recheck:
                entry.recount()
        todo = [
            e for e in reversed(self.entries)
            if e.live and e.gpu is None and e.reloaded is None and e.cpu is not None
            and e.still_on_device() is None
        ]
        if todo:
            copy_in(self.rt, todo, (self.index, "reload"))
        self.reload_started = True
        self.rt.device.trace("reload", self.index)

    def end_backward(self) -> None:
        """After a backward pass: drop reloads nobody unpacked; allow another reload."""
        self.reload_started = False
        for entry in self.entries:
            if entry.reloaded is not None:
                entry.free_reload()

    # -- lifetime ------------------------------------------------------------------------------
    def abort(self, reason: Optional[str] = None) -> None:
        """The forward was interrupted: hold nothing any more (pending copies are fenced).
        ``reason``: what unpacking one of its saved tensors raises (default: an exception)."""
        dev = self.rt.device
        dev.wait_stream(dev.current_stream(), self.rt.stream)
        self.pending = []  # never queued: their host buffers go back below
        for entry in self.entries:
            entry.error = reason or (
                "this saved tensor belongs to a forward pass interrupted by an exception inside "
                "the cpu_offload context; run the forward pass again"
            )
            entry.drop()

    def held_device_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.gpu is not None or e.reloaded is not None)

    def held_host_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.cpu is not None)
