"""What V2 holds for one layer of one step: its offloaded storages and their transfer state.

Ownership is arranged so that offloading never extends or shortens a tensor's life:

- autograd's graph holds a ``SavedRef`` per saved tensor (what the pack hook returns);
- a ``SavedRef`` holds its ``Entry`` (one per storage, shared by views and duplicates);
- an ``Entry`` holds the device storage and a detached alias per saved tensor until the
  schedule releases it, the host copy while any ``SavedRef`` to it is alive, and the reloaded
  storage until its last unpack in a backward.

When the graph frees a saved variable, its ``SavedRef`` dies and, with the last one, the entry
gives its host buffer back to the pool. Nothing here refers to a tensor with a ``grad_fn``, so no
reference cycle can form (memory returns to baseline with ``gc.disable()``).

Note [hot path calls]: the pack hook, the release, the reload and the unpack hook run for every
saved tensor or storage, so they make only the calls they must and spell out small helpers
(``benchmarks/call_count.py`` counts them, ``tests/v2/test_hot_path_calls.py`` pins the count):

- pack: the alias (``detach``: the version counter, and the memory until release), the storage
  (identity and size) and the geometry. Small storages are copied together (one pinned buffer,
  ``HostSlab``, a slice each) at the layer's end or once they add up to ``BATCH_BYTES``; a large
  one at once, or with the next batch while the link is busy (``OffloadDevice.link_busy``). One
  device call per batch for its copies (the layer's last also records its event: ``copy_batch``),
  which name the saved storages themselves as sources: no view is made of them.
- release: one device call for the layer's wait (``compute_wait``), then per storage one use
  count. A storage that nobody else references needs no in-place watch after release (nothing
  can change it any more): its aliases are simply dropped. One that something else holds keeps
  aliases that forget the memory but keep the version counter (``forget_storages``).
- reload: one device call for the layer (``reload_batch``: buffers, copies, event).
- unpack: the tensor rebuilt on the reloaded flat tensor (``new_empty`` + ``set_``); the layer's
  reload event is waited for once, by the first unpack (``compute_wait``).
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Hashable, Optional

import torch

from ..compat import (
    bytes_on_storage,
    is_parameter,
    is_traceable_wrapper_subclass,
    never_compiled,
    storage_use_counter,
)
from ..core.device import Event, OffloadDevice
from ..core.errors import OffloadUsageError, OffloadVerifyError, stacklevel_outside_package
from ..core.markers import MODULE_POLICY, READY_EVENT_ATTR, SKIP_ATTR
from ..core.pinned_pool import PinnedPool
from ..core.subclass import tensor_flatten, tensor_unflatten
from ..core.units import format_bytes
from ..core.storage import (
    KeptRef,
    ViewMeta,
    check_version,
    checksum,
    forget_aliases,
    restore_view,
    storage_bytes,
)
from .stats import LayerStats, StepStats

_new = object.__new__
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_strided = torch.strided
_storage_use_count = storage_use_counter()  # by a storage's _cdata; None where torch lacks it

# Copies of storages smaller than this are batched: the device-to-host copies of a layer's small
# saved tensors are queued together (at the layer's end, or when this many bytes are waiting). A
# launch costs the host microseconds while this many bytes take the link about 20 us, so batching
# them delays nothing that matters. Larger storages are copied as soon as they are saved, so that
# they overlap the rest of the layer's forward; while copies queued before still run (the link is
# busy), with the layer's next batch, which costs fewer host calls and starts no later in effect.
BATCH_BYTES = 1 << 20


class Runtime:
    """Step-independent pieces shared by all layers of one offload context."""

    __slots__ = (
        "device", "stream", "pool", "retain", "verify", "max_host_bytes", "threshold", "warned",
        "byte_limits", "events", "checks_frees", "policy", "device_type", "traces",
        "copy_tail", "mark_event",
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
        policy: Any = None,
    ) -> None:
        self.device = device
        self.stream = stream
        self.pool = pool
        self.retain = retain
        self.verify = verify  # checksum every offloaded storage and check it after reload
        self.max_host_bytes = max_host_bytes  # pinned bytes reserved beyond which tensors stay
        self.threshold = threshold  # min_tensor_size_to_offload, for messages
        self.warned: set = set()
        # layer -> the most bytes it offloads per step, in save order (a plan that offloads a
        # layer in part, to use the link up to its capacity); the rest stays on the device
        self.byte_limits: dict[int, int] = {}
        # (layer, direction) -> the event recorded last time, re-recorded every step
        self.events: dict[tuple, Event] = {}
        # The last event recorded on the copy stream after forward copies (a layer's offload
        # event, or ``mark_event``): while the device says the link is busy up to it, a large
        # storage waits for its layer's next batch (``OffloadDevice.link_busy``). ``mark_event``
        # is the one event re-recorded after each early batch of large storages (never a
        # layer's offload event, which a release waits for).
        self.copy_tail: Optional[Event] = None
        self.mark_event: Optional[Event] = None
        # whether the device checks frees (the simulation): a real device is not even called
        self.checks_frees = type(device).will_free is not OffloadDevice.will_free
        # whether the device records schedule milestones (the simulation): if not, no call
        self.traces = type(device).trace is not OffloadDevice.trace
        # The selection policy (``SelectionPolicy``) of the pack hook's general path. When it
        # tells device tensors by the device's own test and the device names the type of its
        # tensors (``OffloadDevice.tensor_device_type``), the fast path compares that instead.
        self.policy = policy
        self.device_type = (
            device.tensor_device_type
            if policy is not None and policy.is_device_tensor == device.is_device_tensor else None
        )

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
    and layers form no cycle. Made by ``LayerState.pack`` without ``__init__`` (every field is
    set there); ``Entry.new`` makes one elsewhere.
    """

    __slots__ = (
        "rt", "stats", "lstats", "layer", "pool_key", "nbytes", "device", "key", "version",
        "storage", "gpu", "aliases", "nrefs", "owner", "cpu", "reloaded",
        "ready_event", "reload_event", "reload_wait", "live", "pops", "generation", "checksum",
        "verified", "error", "recheck", "listed_by", "slab",
    )

    @classmethod
    def new(
        cls, rt: Runtime, stats: StepStats, lstats: LayerStats, layer: int,
        pool_key: Optional[Hashable], alias: torch.Tensor, storage: Any, nbytes: int,
        version: int,
    ) -> "Entry":
        entry = _new(cls)
        entry.rt = rt
        entry.stats = stats  # of the step that saved it (holds no tensors: no cycle)
        entry.lstats = lstats  # stats.layer(layer), looked up once: counted on every copy
        entry.layer = entry.listed_by = layer  # the first layer that saved it; the last to list it
        entry.pool_key = pool_key  # (layer, slot) when pinned buffers are retained
        entry.nbytes = nbytes
        entry.device = alias.device
        entry.key = storage._cdata  # the storage's identity while we hold it
        entry.version = version  # of the saved tensors' version counters when saved
        entry.storage = storage  # the device storage, until release
        entry.gpu = None  # flat uint8 over ``storage``, made only where needed (``flat``)
        entry.aliases = [alias]  # a detached alias per saved tensor, until release
        entry.nrefs = 1  # aliases made (SavedRef.index counts them)
        entry.owner = None  # after a release that freed nothing: the storage, weakly
        entry.cpu = entry.reloaded = None
        entry.ready_event = entry.reload_event = entry.reload_wait = None
        entry.live = entry.pops = entry.generation = 0
        entry.checksum = None
        entry.verified = -1  # the generation whose reload passed the verify check
        entry.error = None
        entry.recheck = False  # counted as held elsewhere when released; see ``recount``
        entry.slab = None  # the ``HostSlab`` that ``cpu`` is a part of, if any
        return entry

    def flat(self) -> torch.Tensor:
        """A flat ``uint8`` tensor over the device storage (made once, when first needed)."""
        gpu = self.gpu
        if gpu is None:
            gpu = self.gpu = storage_bytes(self.aliases[0], self.storage)
            if self.rt.verify:
                self.checksum = checksum(gpu)
        return gpu

    def still_on_device(self) -> Optional[torch.Tensor]:
        """After a release that freed nothing: the original storage, if something else kept it
        alive unchanged (then backward uses it, no reload)."""
        owner = self.owner
        storage = owner() if owner is not None else None
        if storage is None or storage.nbytes() != self.nbytes:
            return None  # freed since, or resized
        for alias in self.aliases or ():
            if alias._version != self.version:
                return None  # changed in place (unpacking it raises anyway)
        return bytes_on_storage(storage)

    def device_bytes_for_unpack(self) -> torch.Tensor:
        """The device bytes to rebuild a saved tensor from, waiting (device-side) for them."""
        if self.storage is not None:
            return self.flat()
        if self.reloaded is None:
            original = self.still_on_device() if self.owner is not None else None
            if original is not None:
                return original
            if self.cpu is None:
                raise OffloadUsageError(
                    "a saved tensor was used after its offload state was discarded (its forward "
                    "was aborted by an exception); run the forward pass again"
                )
            copy_in(self.rt, [self])  # not scheduled (custom schedule / partial backward): now
        if self.reload_wait[0] is not None:
            self.wait_reload()
        if self.checksum is not None:
            self.verify_reload()
        return self.reloaded

    def wait_reload(self) -> None:
        """Make compute wait (device-side) for the reload: the first unpack of what was
        reloaded together (a layer) waits for all of it, once."""
        wait = self.reload_wait
        event, wait[0] = wait[0], None
        self.rt.device.compute_wait(event, self.stats.waits)

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
        src = self.flat()
        self.cpu = rt.pool.acquire(self.nbytes, self.pool_key)
        if ready is not None:
            dev.wait_event(stream, ready)
        else:
            dev.wait_stream(stream, dev.current_stream())
        dev.copy(stream, self.cpu, src)
        self.lstats.copied_out_bytes += self.nbytes

    def release(self, recheck: bool = False) -> None:
        """Drop our references to the device storage (its copy is known done). If nothing else
        holds it, that frees it; otherwise it lives on and backward uses it without a reload.
        ``recheck``: the holder may be about to let go (released inside a layer's call, whose
        caller still holds its input): ``recount`` looks again when backward starts."""
        storage, aliases = self.storage, self.aliases
        # Ours: the storage object, one alias per saved tensor and the flat tensor, if made.
        count = _storage_use_count
        held = count is None or count(storage._cdata) > self.nrefs + 1 + (self.gpu is not None)
        changed = False
        if not held:
            for alias in aliases:
                if alias._version != self.version:
                    changed = True  # unpacking it must raise: keep its version counter
                    break
        if held or changed:
            forget_aliases(aliases)  # version counters kept, memory let go
            self.owner = weakref.ref(storage)
        else:
            self.aliases = None  # nothing can change the memory once we let go: no watch
        if held:
            self.lstats.held_elsewhere_bytes += self.nbytes
            self.recheck = recheck
        else:
            if self.rt.checks_frees:
                self.rt.device.will_free(storage)
            self.lstats.freed_bytes += self.nbytes
        self.gpu = self.storage = None

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
        if self.reloaded is None:
            return
        wait = self.reload_wait
        if wait is not None and wait[0] is not None:
            dev = self.rt.device
            dev.wait_event(dev.current_stream(), wait[0])
            wait[0] = None
        self.reloaded = self.reload_event = self.reload_wait = None
        self.pops = 0
        self.generation += 1

    def drop(self) -> None:
        """Give the host buffer back and forget every buffer."""
        if self.reloaded is not None:
            self.free_reload()
        if self.cpu is not None:
            slab = self.slab
            if slab is None:
                self.rt.pool.release(self.cpu, self.pool_key)
            else:
                slab.users -= 1
                if not slab.users:  # the last storage copied into it: the buffer goes back
                    self.rt.pool.release(slab.buf)
        self.cpu = self.gpu = self.storage = self.aliases = None


class HostSlab:
    """One pinned host buffer holding the copies of a batch of small storages (a layer's,
    copied together), each in a slice of it: one pool call per batch instead of one per
    storage. It goes back to the pool when the last of those storages is dropped. Made without
    ``__init__`` (``buf`` and ``users`` are set where it is made)."""

    __slots__ = ("buf", "users")


def copy_in(rt: Runtime, entries: list) -> None:
    """A reload on demand (not scheduled: a custom schedule, a partial backward): allocate
    device storages on the compute stream and queue the host-to-device copies, one event per
    group of small copies and per large copy. All buffers are allocated before any entry
    changes, so an out-of-memory error leaves every entry as it was. (A layer's scheduled
    reload is ``LayerState.start_reload``.)"""
    dev, stream = rt.device, rt.stream
    alloc = dev.alloc_device
    buffers = [alloc(entry.nbytes, entry.device) for entry in entries]
    pairs = [(b, e.cpu) for b, e in zip(buffers, entries)]
    # The new buffers were allocated on the compute stream: copy once compute got there.
    dev.wait_stream(stream, dev.current_stream())
    events = dev.copy_and_record(stream, pairs, BATCH_BYTES)
    for entry, buf, event in zip(entries, buffers, events):
        entry.lstats.reloaded_bytes += entry.nbytes
        entry.reloaded = buf
        entry.reload_event = event
        entry.reload_wait = [event]


class SavedRef:
    """What autograd stores instead of an offloaded tensor: its storage entry, which of the
    entry's aliases is its own (``index``), and its geometry. Made by ``LayerState.pack``
    without ``__init__``; ``SavedRef.new`` makes one elsewhere."""

    __slots__ = ("entry", "index", "dtype", "size", "stride", "offset", "bits", "cls", "popped")

    @classmethod
    def new(cls, entry: Entry, index: int, meta: ViewMeta, tensor_cls: type) -> "SavedRef":
        ref = _new(cls)
        ref.dtype, ref.size, ref.stride, ref.offset, ref.bits = meta
        ref.cls = tensor_cls
        ref.index = index
        ref.popped = -1  # the entry generation in which this was last unpacked
        ref.entry = entry
        entry.live += 1
        return ref

    @property
    def meta(self) -> ViewMeta:
        return ViewMeta(self.dtype, self.size, self.stride, self.offset, self.bits)

    def __del__(self) -> None:
        try:
            entry = self.entry
        except AttributeError:  # never finished (an exception while it was made)
            return
        entry.live -= 1
        if self.popped == entry.generation:
            entry.pops -= 1  # autograd freed it after its node ran: it no longer waits
        if entry.live == 0:
            entry.drop()

    def unpack(self) -> torch.Tensor:
        return unpack(self)


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
    """The unpack hook of every V2 layer: the inverse of the pack hook (``SavedRef`` spelled
    out, see Note [hot path calls])."""
    cls = type(packed)
    if cls is not SavedRef:
        if cls is KeptRef:  # ``KeptRef.unpack``, spelled out
            alias = packed.alias
            if alias._version != packed.version:
                packed.check()
            return alias
        return packed.unpack()
    entry = packed.entry
    aliases = entry.aliases
    if aliases is not None:  # before release, or held elsewhere: as autograd checks
        alias = aliases[packed.index]
        if alias._version != entry.version:
            check_version(alias, entry.version, packed.size)
    if entry.error is not None:
        raise OffloadUsageError(entry.error)
    flat = entry.reloaded
    if flat is None or entry.checksum is not None:
        flat = entry.device_bytes_for_unpack()
    elif entry.reload_wait[0] is not None:
        entry.wait_reload()  # the first unpack of what was reloaded together
    if packed.bits is None:  # ``restore_view``, spelled out for the common case (``flat``
        # starts its storage: the offset is the storage's)
        t = flat.new_empty(0, dtype=packed.dtype).set_(
            flat, packed.offset, packed.size, packed.stride)
    else:
        t = restore_view(flat, packed.meta)
    if packed.cls is not _Tensor:
        t = t.as_subclass(packed.cls)
    if packed.popped != entry.generation:
        packed.popped = entry.generation
        entry.pops += 1
    if entry.pops >= entry.live and entry.storage is None and entry.reloaded is not None:
        # Last unpack of this backward: autograd now owns the only reference, so the reloaded
        # memory is freed as soon as the backward node is done with it (``free_reload``; the
        # copy was waited for above).
        entry.reloaded = entry.reload_event = entry.reload_wait = None
        entry.pops = 0
        entry.generation += 1
    return t


class LayerState:
    """Storages saved by one offloaded layer, and where they are: device, host, or both."""

    __slots__ = (
        "index", "rt", "stats", "lstats", "entries", "shared", "eager", "offload_event",
        "released", "reload_started", "limit", "flushed", "pending_bytes", "small_bytes",
        "may_wait",
    )

    def __init__(
        self, index: int, rt: Runtime, eager: bool, shared: dict, stats: StepStats,
        may_wait: bool = False,
    ) -> None:
        self.index = index
        self.rt = rt
        self.stats = stats
        self.lstats: Optional[LayerStats] = None  # made when first counted (see layer_stats)
        self.entries: list[Entry] = []
        self.shared = shared  # storage key -> Entry, for the whole forward pass of a step
        self.eager = eager  # copy at the layer's end (default schedule, or manual after start)
        self.offload_event: Optional[Event] = None
        self.released = False
        self.reload_started = False
        # bytes this layer may still offload, if limited
        self.limit = rt.byte_limits.get(index) if rt.byte_limits else None
        # entries[:flushed] were considered for copying; of the storages after them, pending_bytes
        # are not copied yet. Large ones (BATCH_BYTES or more) are copied as soon as they are
        # saved (with ``may_wait``, while the link is busy: with the layer's next batch), each
        # into its own host buffer; small ones (small_bytes of them pending) together, in one
        # host buffer, once they reach BATCH_BYTES and at the layer's end. So the host buffers'
        # sizes do not depend on timing, and the pool reuses them step after step.
        self.flushed = 0
        self.pending_bytes = 0
        self.small_bytes = 0
        # whether large copies may wait for a busy link (``Schedule.copies_can_wait``): not
        # when the layer is released at the next layer's start, nor with CUDA-graph buffers
        self.may_wait = may_wait and not rt.retain

    # -- forward ---------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor, ready: Optional[Event] = None, selected: bool = False
             ) -> Any:
        """The pack hook of an offloaded layer (Note [hot path calls]). A plain tensor without
        marks (nothing in its or its base's ``__dict__``) outside an opted-out module is judged
        here with attribute reads only; anything else goes through ``pack_checked``, which
        comes back with ``selected=True`` for a tensor the selection policy offloads (and
        ``ready``: the tensor is final from that event on, ``start_offload``). The storage's
        copy to the host is queued at the layer's end (or at once, for a large one)."""
        if not selected:
            base = t._base
            if (not _FAST_PATH or type(t) is not _Tensor or t.__dict__
                    or (MODULE_POLICY and not MODULE_POLICY[-1]) or t.layout is not _strided):
                return self.pack_checked(t)
            rt = self.rt
            if base is not None:
                if type(base) is _Parameter and SKIP_ATTR not in base.__dict__ and (
                        rt.device_type == t.device.type):
                    # A view of a parameter (``F.linear`` saves ``weight.t()``): kept.
                    lstats = self.lstats if self.lstats is not None else self.layer_stats()
                    lstats.skipped_bytes["parameter"] += t.nbytes
                    return KeptRef(t)
                if type(base) is not _Tensor or base.__dict__:
                    return self.pack_checked(t)
            if (rt.device_type != t.device.type or t.is_nested
                    or (rt.threshold and t.nbytes < rt.threshold * t.itemsize)):
                return self.pack_checked(t)
        storage = t.untyped_storage()
        key = storage._cdata
        shared = self.shared
        entry = shared[key] if key in shared else None
        if (entry is None or entry.storage is None or entry.version != t._version
                or entry.nbytes != storage.nbytes()):
            # Saved for the first time in this forward (or changed since: a fresh copy).
            nbytes = storage.nbytes()
            if nbytes == 0:
                return KeptRef(t)
            if self.released:
                raise OffloadUsageError(
                    f"layer {self.index} saved a tensor for backward after "
                    f"release_activation_forward_gpu_memory({self.index}); release a layer only "
                    "after its forward is over"
                )
            rt = self.rt
            budget = rt.max_host_bytes
            if budget is not None:
                needed = rt.pool.reserved_for(self.pending_bytes + nbytes)
                if needed > budget:
                    return self._over_host_budget(t, nbytes, budget, needed)
            if self.limit is not None:
                if nbytes > self.limit:
                    reason = "over the layer's byte limit (a partial plan)"
                    self.layer_stats().skipped_bytes[reason] += nbytes
                    return KeptRef(t)
                self.limit -= nbytes
            alias = t.detach()
            lstats = self.lstats if self.lstats is not None else self.layer_stats()
            entry = Entry()  # ``Entry.new``, spelled out (no ``__init__``: every slot set here)
            entry.rt = rt
            entry.stats = self.stats
            entry.lstats = lstats
            entry.layer = entry.listed_by = self.index
            entry.pool_key = (self.index, len(self.entries)) if rt.retain else None
            entry.nbytes = nbytes
            entry.device = alias.device
            entry.key = key
            entry.version = t._version
            entry.storage = storage
            entry.gpu = None
            entry.aliases = [alias]
            entry.nrefs = 1
            entry.owner = entry.cpu = entry.reloaded = None
            entry.ready_event = entry.reload_event = entry.reload_wait = None
            entry.live = entry.pops = entry.generation = 0
            entry.checksum = entry.error = None
            entry.verified = -1
            entry.recheck = False
            entry.slab = None
            shared[key] = entry
            index = 0
            if self.eager and (ready is not None or self.offload_event is not None):
                # Final since ``ready`` (start_offload), or manual with the offload started:
                # copied at once, after the storages saved before it.
                self.flush_copies()
                self.entries.append(entry)
                self.flushed += 1
                entry.copy_out(ready)
                if self.offload_event is not None:
                    self.offload_event = rt.device.record_event(rt.stream)
            else:
                self.entries.append(entry)
                if self.eager:
                    # The automatic schedule: a large storage copied at once (unless the link
                    # is still busy with earlier copies), small ones in batches.
                    self.pending_bytes += nbytes
                    if nbytes >= BATCH_BYTES:
                        if (not self.may_wait or rt.copy_tail is None
                                or not rt.device.link_busy(rt.copy_tail)):
                            self.flush_copies(large=True)
                    else:
                        self.small_bytes += nbytes
                        if self.small_bytes >= BATCH_BYTES:
                            self.flush_copies(large=False)
                else:  # manual, before start_offload: copied from when it is final
                    entry.ready_event = ready or rt.device.record_event(
                        rt.device.current_stream())
        else:
            if entry.listed_by != self.index:  # saved before, by an earlier layer
                entry.listed_by = self.index
                self.entries.append(entry)
            alias = t.detach()
            index = entry.nrefs
            entry.nrefs = index + 1
            entry.aliases.append(alias)
            lstats = self.lstats if self.lstats is not None else self.layer_stats()
        lstats.offloaded_tensors += 1
        ref = SavedRef()  # ``SavedRef.new``, spelled out (no ``__init__``: every slot set here)
        ref.entry = entry
        ref.index = index
        ref.dtype = t.dtype
        ref.size = t.shape
        ref.stride = t.stride()
        ref.offset = t.storage_offset()
        ref.bits = None
        if t.is_neg() or (t.dtype.is_complex and t.is_conj()):
            ref.bits = ViewMeta.of(t).bits_of
        cls = type(t)
        ref.cls = _Tensor if cls is _Parameter else cls
        ref.popped = -1
        entry.live += 1
        return ref

    def pack_checked(self, t: torch.Tensor) -> Any:
        """The pack hook's general path: the selection policy decides (and the statistics say
        why a tensor stays); wrapper subclasses are taken apart, inner tensor by inner tensor."""
        policy = self.rt.policy
        if type(t) is not _Tensor and is_traceable_wrapper_subclass(t):
            if policy.wrapper_skip_reason(t) is not None:
                return KeptRef(t)
            names, ctx = tensor_flatten(t)
            inner = {name: self.pack_checked(getattr(t, name)) for name in names}
            if all(type(v) is KeptRef for v in inner.values()):
                return KeptRef(t)  # nothing inside was offloaded
            return SavedSubclassRef(t, ctx, inner)
        reason = policy.skip_reason(t)
        if reason is not None:
            if reason == "weight mark" and is_parameter(t._base):
                reason = "parameter"  # F.linear saves weight.t()
            self.layer_stats().skipped_bytes[reason] += t.numel() * t.element_size()
            return KeptRef(t)
        ready = getattr(t, READY_EVENT_ATTR, None)
        if ready is None and t._base is not None:  # start_offload(offload_base_tensor=True)
            ready = getattr(t._base, READY_EVENT_ATTR, None)
        return self.pack(t, ready, True)

    def layer_stats(self) -> LayerStats:
        """This layer's counters, looked up once. Made only when something is counted, so a
        layer that saved nothing has none (as the statistics report it)."""
        lstats = self.lstats
        if lstats is None:  # ``StepStats.layer``, spelled out
            layers, index = self.stats.layers, self.index
            lstats = layers[index] if index in layers else None
            if lstats is None:
                lstats = layers[index] = LayerStats()
            self.lstats = lstats
        return lstats

    def _over_host_budget(self, t: torch.Tensor, nbytes: int, budget: int, needed: int
                          ) -> KeptRef:
        self.layer_stats().skipped_bytes["over max_host_bytes"] += nbytes
        self.rt.warn_once(
            f"pinned host memory would exceed max_host_bytes={budget} "
            f"({format_bytes(budget)}): layer {self.index} saves a tensor of {nbytes} bytes, "
            f"which needs {needed} bytes of "
            f"pinned memory reserved ({self.rt.pool.reserved_bytes} are now). It stays on the "
            "GPU, as do the saved tensors after it that do not fit. ctx.stats().to_dict()"
            "['pinned_host_bytes_needed'] says what a whole step needs: raise max_host_bytes "
            "to it, or offload fewer layers (num_layers)",
            key="over max_host_bytes",
        )
        return KeptRef(t)

    def flush_copies(self, end: bool = False, large: Optional[bool] = None) -> None:
        """Queue the device-to-host copies of the storages saved since the last flush (after the
        compute that produced them): pinned buffers, one stream wait and one batch for all.
        ``large``: only the large storages (``True``, the pack hook's early batch, whose end
        ``Runtime.mark_event`` marks for ``link_busy``) or only the small ones (``False``);
        ``None``: all. ``end``: the layer's forward is over; the same device call also marks
        where its copies end on the copy stream (one event per layer, re-recorded every step).

        Each large storage gets its own host buffer and the small ones of a batch share one
        (``HostSlab``), so buffer sizes do not depend on when the link let a batch go."""
        entries = self.entries
        n = len(entries)
        if self.flushed == n:
            if end:
                self._end_copies(())
            return
        pending = entries[self.flushed:]
        if large is None:
            for e in pending:
                if e.cpu is not None or e.storage is None:
                    # Not those an earlier layer saved (copied by it), nor those whose saved
                    # tensors autograd already freed (dropped: nothing to copy).
                    pending = [e for e in pending if e.cpu is None and e.storage is not None]
                    break
            self.flushed = n
            self.pending_bytes = self.small_bytes = 0
        else:
            pending = [e for e in pending if e.cpu is None and e.storage is not None
                       and (e.nbytes >= BATCH_BYTES) is large]
            for e in pending:
                self.pending_bytes -= e.nbytes
            if not large:
                self.small_bytes = 0
        if not pending:
            if end:
                self._end_copies(())
            return
        rt = self.rt
        if rt.retain:  # a buffer bound to each (layer, slot): CUDA graphs copy into it
            for entry, buf in zip(pending, rt.pool.acquire_many(
                    [e.nbytes for e in pending], [e.pool_key for e in pending])):
                entry.cpu = buf
        else:
            # A buffer per large storage, one for the small ones together (a slice each); all
            # acquired before any entry changes, so a failed allocation changes nothing.
            small = pending
            total = 0
            for entry in pending:
                if entry.nbytes >= BATCH_BYTES:
                    small = [e for e in pending if e.nbytes < BATCH_BYTES]
                    break
                total += entry.nbytes
            if small is pending:  # small ones only (a small layer's batch): one pool call
                slab_buf = rt.pool.acquire(total)
            else:
                total = sum(e.nbytes for e in small)
                big = [e for e in pending if e.nbytes >= BATCH_BYTES]
                bufs = rt.pool.acquire_many([e.nbytes for e in big] + ([total] if small else []))
                for entry, buf in zip(big, bufs):
                    entry.cpu = buf
                slab_buf = bufs[-1] if small else None
            if small:
                slab = HostSlab()
                slab.buf = slab_buf
                slab.users = len(small)
                start = 0
                for entry in small:
                    stop = start + entry.nbytes
                    entry.cpu = slab_buf[start:stop]
                    entry.slab = slab
                    start = stop
        if large is not None:  # entries[:flushed] are all copied (or dropped) now
            i = self.flushed
            while i < n and (entries[i].cpu is not None or entries[i].storage is None):
                i += 1
            self.flushed = i
        verify = rt.verify
        for entry in pending:
            if verify:
                entry.checksum = checksum(entry.flat())
            entry.lstats.copied_out_bytes += entry.nbytes
        # The storage itself is the source (``OffloadDevice.copy_after_compute``): no view of
        # it is made, which was most of the pack hook's host time beyond the floor's.
        pairs = [(e.cpu, e.storage) for e in pending]
        if end:
            self._end_copies(pairs)
        elif large and not rt.retain:
            rt.copy_tail = rt.mark_event = rt.device.copy_batch(rt.stream, pairs, rt.mark_event)
        else:
            rt.device.copy_after_compute(rt.stream, pairs)

    def _end_copies(self, pairs: Any) -> None:
        """Queue the last copies of the layer's forward and record its offload event after
        them (``copy_batch``: one device call)."""
        rt = self.rt
        events, key = rt.events, (self.index, "offload")
        self.offload_event = rt.copy_tail = events[key] = rt.device.copy_batch(
            rt.stream, pairs, events[key] if key in events else None)

    def start_offload(self) -> None:
        """Manual mode: queue the copies of every entry not copied yet; tensors this layer saves
        from now on are copied as they are saved."""
        for entry in self.entries:
            if entry.cpu is None and entry.storage is not None:
                entry.copy_out(entry.ready_event)
        self.eager = True
        self.offload_event = self.rt.device.record_event(self.rt.stream)
        self.flushed = len(self.entries)
        if self.rt.traces:
            self.rt.device.trace("offload", self.index)

    def release(self, recheck: bool = False) -> None:
        """Free the device storages once their copies are done (device-side wait, host free).
        ``recheck``: see ``Entry.release``."""
        if self.released:
            return
        on_device = self.entries
        for e in on_device:
            if e.storage is None:  # released by an earlier layer, or dropped
                on_device = [e for e in self.entries if e.storage is not None]
                break
        for e in on_device:
            if e.cpu is None:
                raise OffloadUsageError(
                    f"release_activation_forward_gpu_memory({self.index}) before "
                    f"start_offload_layer({self.index}): start the offload first"
                )
        rt = self.rt
        dev = rt.device
        milestone = ("release", self.index) if rt.traces else None
        if not on_device:
            self.released = True
            if milestone is not None:
                dev.trace(*milestone)
            return
        # One device call: compute waits for the layer's copies (timed, if the device times
        # events), then the milestone.
        dev.compute_wait(self.offload_event, self.stats.waits, milestone)
        count = _storage_use_count
        checks_frees = rt.checks_frees
        for entry in on_device:
            # ``Entry.release``, spelled out for a storage that nobody else references and
            # that is unchanged since it was saved: its aliases are simply dropped.
            if count is None or count(entry.storage._cdata) > (
                    entry.nrefs + 1 + (entry.gpu is not None)):
                entry.release(recheck)  # held elsewhere
                continue
            version = entry.version
            for alias in entry.aliases:
                if alias._version != version:
                    break
            else:
                entry.aliases = None
                if checks_frees:
                    dev.will_free(entry.storage)
                entry.lstats.freed_bytes += entry.nbytes
                entry.gpu = entry.storage = None
                continue
            entry.release(recheck)  # changed in place: its unpack must raise
        self.released = True

    # -- backward --------------------------------------------------------------------------------
    def start_reload(self) -> None:
        """Allocate device storages on the compute stream and queue the copies back."""
        if not self.released or self.reload_started:
            return
        todo = self.entries[::-1]
        for e in todo:
            if not e.live or e.storage is not None or e.reloaded is not None or e.cpu is None or (
                    e.owner is not None):
                for entry in todo:
                    if entry.recheck:
                        entry.recount()
                todo = [
                    e for e in todo
                    if e.live and e.storage is None and e.reloaded is None and e.cpu is not None
                    and (e.owner is None or e.still_on_device() is None)
                ]
                break
        rt = self.rt
        if todo:
            # One device call: the buffers (allocated on the compute stream, all before any
            # entry changes, so an out-of-memory error leaves every entry as it was), the
            # copies once compute got there, and the layer's event re-recorded at their end,
            # which the first unpack of any of them waits for, on behalf of all.
            events, key = rt.events, (self.index, "reload")
            buffers, event = rt.device.reload_batch(
                rt.stream, [(e.cpu, e.device) for e in todo],
                events[key] if key in events else None,
                ("reload", self.index) if rt.traces else None)
            events[key] = event
            wait = [event]
            for entry, buf in zip(todo, buffers):
                entry.lstats.reloaded_bytes += entry.nbytes
                entry.reloaded = buf
                entry.reload_event = event
                entry.reload_wait = wait
        elif rt.traces:
            rt.device.trace("reload", self.index)
        self.reload_started = True

    # -- lifetime ------------------------------------------------------------------------------
    def abort(self, reason: Optional[str] = None) -> None:
        """The forward was interrupted: hold nothing any more (pending copies are fenced).
        ``reason``: what unpacking one of its saved tensors raises (default: an exception)."""
        dev = self.rt.device
        dev.wait_stream(dev.current_stream(), self.rt.stream)
        self.flushed = len(self.entries)  # never queued
        self.pending_bytes = self.small_bytes = 0
        for entry in self.entries:
            entry.error = reason or (
                "this saved tensor belongs to a forward pass interrupted by an exception inside "
                "the cpu_offload context; run the forward pass again"
            )
            entry.drop()

    def held_device_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries
                   if e.storage is not None or e.reloaded is not None)

    def held_host_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.cpu is not None)


# The hooks read tensors' ``__dict__``, which TorchDynamo cannot trace: they run only where
# torch can keep Dynamo from compiling them (autograd calls them also from eager code that a
# compiled module runs between graphs). Elsewhere (torch < 2.7) every saved tensor takes the
# general path, which Dynamo traces.
_FAST_PATH = never_compiled(LayerState.pack, unpack)
