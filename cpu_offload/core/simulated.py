"""A CPU stand-in for the accelerator: same calls as ``CudaDevice``, recorded and checked.

"Device" tensors are ordinary CPU tensors. The compute stream runs eagerly (the model's ops have
already happened when the scheduler sees them); side streams *defer* their work until something
waits on it. So a scheduler that forgets to wait for a reload hands autograd an unwritten buffer
(filled with a poison pattern) and gradients come out wrong; one that frees a buffer while a
copy still reads it trips ``will_free``; and one that drops a device buffer while a queued copy
still writes into it (a late write into memory the allocator may have handed out again) raises
when that copy runs, as the real device does not keep freed device memory alive. Pinned host
buffers (``alloc_host``) may be dropped early: torch's pinned allocator records the copy's stream
and reuses the block only after the copy, and so does the simulation. ``capture`` checks CUDA's
graph-capture rules. Device memory is handed out on the compute stream, and on a real device the
caching allocator may hand out memory that compute work queued earlier still uses: a side
stream that writes a fresh buffer must first wait for a compute event recorded after its
allocation (else ``SimulatedHazard``). ``use_stream`` makes another stream current on a
thread, as FSDP2 runs its gradient hooks on its reduce-scatter stream (memory allocated then is
that stream's); what work queued there writes (``queued_write``) compute may read only once
ordered after it through event waits. Every call is appended to ``log`` for schedule
assertions; copies are logged as ``("copy", stream, nbytes, "d2h" | "h2d")``. Calls may come from several threads (the
optimizer's CPU worker); one lock serialises them.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from ..compat import storage_use_count
from .checks import check_bool
from .device import OffloadDevice, bytes_of
from .launcher import DeferredLauncher, InlineLauncher, Launcher

POISON = 0xA5
# A pinned buffer let go while a copy queued through ``copy_after_compute`` still used it.
_UNGUARDED_HOST = (
    "a queued {} copy of {} bytes on {} uses a pinned host buffer that was let go before the copy "
    "was done; a batch of copies is queued without telling torch's pinned allocator (CudaDevice "
    "calls the driver), so keep the buffer until then (PinnedPool waits for the copy stream "
    "first)")


class SimulatedHazard(AssertionError):
    """The scheduler did something that would corrupt memory on a real device."""


@dataclass
class SimStream:
    name: str
    eager: bool = False
    queued: int = 0
    done: int = 0
    pending: deque = field(default_factory=deque)  # (seq, fn, reads: list[int], writes)
    capture: Optional[object] = None  # the graph capture this stream is part of, if any
    joined_back: int = 0  # during a capture: its last op that a captured stream waited for
    # the latest allocation (``SimulatedDevice._allocs``) this stream's work is ordered after:
    # through a wait for a compute event recorded after it, directly or through another stream
    allocs_seen: int = 0
    # per other stream (by id): the last of its operations this stream's work is ordered after,
    # through event waits, directly or through another stream (``queued_write``'s check)
    after: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"SimStream({self.name})"

    def order_after(self, event: "SimEvent") -> None:
        """This stream's later work runs after ``event`` (and what it was ordered after)."""
        for key, seq in list(event.after.items()) + [(id(event.stream), event.seq)]:
            if seq > self.after.get(key, 0):
                self.after[key] = seq


@dataclass(frozen=True)
class SimEvent:
    stream: SimStream
    seq: int
    capture: Optional[object] = field(default=None, compare=False)  # recorded during it
    allocs_seen: int = field(default=0, compare=False)  # its stream's ``allocs_seen`` then
    after: dict = field(default_factory=dict, compare=False)  # its stream's ``after`` then


class SimulatedDevice(OffloadDevice):
    """A simulated accelerator: runs offloading on a CPU-only machine, recorded and checked.

    Pass ``device=cpu_offload.SimulatedDevice()`` to ``get_cpu_offload_context``,
    ``apply_offloading``, ``plan_offloading`` or ``HybridDeviceOptimizer`` to run the exact
    schedule (the same stream, event and copy calls as on CUDA) without a GPU: to try
    offloading, write tests and CI for code that uses it, or see when each layer is released
    and reloaded. CPU tensors play the device tensors. The compute stream runs eagerly; side
    streams (the copies) are deferred until something waits for them, and freshly allocated
    "device" buffers are filled with a poison pattern, so a missing synchronization shows up as
    wrong results, and freeing or dropping a buffer a queued copy still uses raises. Times and
    memory are not those of a GPU.

    Args:
        defer: ``True`` (default): side-stream work runs only when waited for (catches missing
            waits). ``False``: it runs at once.
        defer_launches: ``True`` (default): host work queued from backward's hooks
            (``host_launcher``; on CUDA a thread of its own) runs only when waited for, the
            latest it could run. ``False``: at once, in the hook.
        host_page: the pinned pool's blocks (``reserve_host``) are rounded up to a multiple of
            this many bytes, as page-locked memory is to whole pages (``1``, the default:
            exact).

    Attributes:
        log: every call in order, e.g. ``("copy", stream, nbytes, "d2h" | "h2d")``,
            ``("wait", stream, event_stream, seq)``, ``("release", layer)``.
        host_allocs, host_bytes_allocated: pinned host buffers allocated so far (the pinned
            pool's blocks included: ``reserve_host`` allocates them with ``alloc_host``).
        device_allocs: "device" buffers allocated so far.

    Raises:
        SimulatedHazard: (an ``AssertionError``) when a schedule does something that would
            corrupt memory on a real device.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> layers = [torch.nn.Linear(8, 8) for _ in range(4)]
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=2, model_layers=4, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> h = torch.randn(4, 8, requires_grad=True) * 1
        >>> for layer in layers:
        ...     with ctx:
        ...         h = layer(h)
        ...     h = sync(h)
        >>> h.sum().backward()
        >>> sim.milestones({"fwd", "bwd", "release", "reload"})  # doctest: +NORMALIZE_WHITESPACE
        [('fwd', 0), ('fwd', 1), ('release', 0), ('fwd', 2), ('release', 1), ('fwd', 3),
         ('bwd', 3), ('reload', 1), ('bwd', 2), ('reload', 0), ('bwd', 1), ('bwd', 0)]
        >>> [(direction, nbytes) for _, _, nbytes, direction in sim.copies()]
        [('d2h', 128), ('d2h', 128), ('h2d', 128), ('h2d', 128)]
    """

    name = "simulated"
    display_name = "simulated device"
    tensor_device_type = "cpu"
    times_events = True  # with no clock: every wait reads as 0 ms once passed

    def __init__(self, defer: bool = True, defer_launches: bool = True,
                 host_page: int = 1) -> None:
        # a string is true: defer="no" would defer, the opposite of what it says
        check_bool("defer", defer)
        check_bool("defer_launches", defer_launches)
        self.defer = defer
        self.defer_launches = defer_launches
        self.host_page = host_page
        self._allocs = 0  # device buffers handed out so far (each one's number: ``_alloc_no``)
        self.compute = SimStream("compute", eager=True)
        self.streams: list[SimStream] = [self.compute]
        self.log: list[tuple] = []
        self.host_allocs = 0
        self.host_bytes_allocated = 0
        self.device_allocs = 0
        # pinned host buffers alive, by address (what a copy into them is: "d2h")
        self._host_bufs: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._lock = threading.RLock()
        self._capture: Optional[object] = None  # the graph capture in progress (``capture``)
        self._current = threading.local()  # per thread: the stream ``use_stream`` made current
        self._queued_writes: list = []  # ((start, end), stream, seq) of ``queued_write``

    # -- streams and events -------------------------------------------------------------------
    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu"

    def current_stream(self) -> SimStream:
        return getattr(self._current, "stream", None) or self.compute

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[None]:
        """Make ``stream`` this thread's current stream for the block, as
        ``torch.cuda.stream(s)`` does: FSDP2 runs the sharded parameters' gradient hooks so,
        on its reduce-scatter stream. Memory allocated meanwhile comes from that stream's pool
        (its work is ordered after the allocation). Launches submitted from such a hook run
        with it current (``host_launcher``).

        Example::

            >>> from cpu_offload import SimulatedDevice
            >>> dev = SimulatedDevice()
            >>> side = dev.new_stream()
            >>> with dev.use_stream(side):
            ...     dev.current_stream() is side
            True
            >>> dev.current_stream() is dev.compute
            True
        """
        previous = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    def new_stream(self) -> SimStream:
        s = SimStream(f"side{len(self.streams)}", eager=not self.defer)
        self.streams.append(s)
        return s

    def record_event(self, stream: SimStream) -> SimEvent:
        with self._lock:
            seen = self._allocs if stream is self.compute else stream.allocs_seen
            return SimEvent(stream, stream.queued, stream.capture, seen, dict(stream.after))

    def capturing(self, stream: SimStream) -> bool:
        return stream.capture is not None

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        with self._lock:
            self.log.append(("wait", stream.name, event.stream.name, event.seq))
            if event.stream is stream:
                return
            self._capture_rules(stream, event)
            stream.allocs_seen = max(stream.allocs_seen, event.allocs_seen)
            stream.order_after(event)
            if stream.eager:
                self._run_until(event.stream, event.seq)
            else:
                self._enqueue(stream, lambda: self._run_until(event.stream, event.seq), [])

    def wait_host(self, event: SimEvent) -> None:
        with self._lock:
            self.log.append(("wait_host", event.stream.name, event.seq))
            if event.capture is not None and event.capture is self._capture:
                raise SimulatedHazard(
                    "the host waited for an event recorded during graph capture: captured work "
                    "runs only when the graph is replayed (cudaErrorStreamCaptureUnsupported)"
                )
            self._run_until(event.stream, event.seq)
            self.compute.order_after(event)  # compute queued from now on runs after it

    def event_done(self, event: SimEvent) -> bool:
        return event.stream.done >= event.seq

    def elapsed_ms(self, start: SimEvent, end: SimEvent) -> Optional[float]:
        """The simulation has no clock: 0 once both events are passed."""
        return 0.0 if self.event_done(start) and self.event_done(end) else None

    def synchronize(self) -> None:
        with self._lock:
            if self._capture is not None:
                raise SimulatedHazard(
                    "device synchronize during graph capture (cudaErrorStreamCaptureUnsupported)"
                )
            for s in self.streams:
                self._run_until(s, s.queued)
                self.compute.order_after(SimEvent(s, s.queued))

    # -- memory -------------------------------------------------------------------------------
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        self.host_allocs += 1
        self.host_bytes_allocated += nbytes
        self.log.append(("alloc_host", nbytes))
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._host_bufs[buf.data_ptr()] = buf  # forgotten when freed: the address may be reused
        return buf

    def host_block_size(self, nbytes: int) -> int:
        page = self.host_page
        return -(-nbytes // page) * page

    def host_memory_kind(self) -> str:
        if self.host_page == 1:
            return "simulated, exact blocks"
        return f"simulated, blocks of whole {self.host_page}-byte pages"

    def alloc_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        self.device_allocs += 1
        buf = torch.full((nbytes,), POISON, dtype=torch.uint8)
        with self._lock:
            self._allocs += 1
            buf._alloc_no = self._allocs  # side streams write it once ordered after this
            current = self.current_stream()
            if current is not self.compute:  # from its own pool: ordered after by its order
                current.allocs_seen = self._allocs
        return buf

    def host_launcher(self, where: torch.device) -> Launcher:
        return DeferredLauncher(self.use_stream) if self.defer_launches else InlineLauncher()

    def _check_fresh(self, stream: SimStream, t: torch.Tensor, what: str) -> None:
        """``stream`` (not compute) is about to write device tensor ``t``: if ``t`` is (a view
        of) a buffer from ``alloc_device``, ``stream`` must be ordered after its allocation."""
        if stream is self.compute:
            return
        root = t._base if t._base is not None else t
        no = getattr(root, "_alloc_no", 0)
        if no > stream.allocs_seen:
            raise SimulatedHazard(
                f"{what} on {stream.name} writes a device buffer allocated on the compute stream "
                "(or on the stream current then) before that stream waited for an event recorded "
                "there after the allocation: "
                "the caching allocator may have handed out memory that compute work queued "
                "earlier still uses (record an event on the compute stream after allocating, "
                "and make the stream wait for it)")

    def copy(self, stream: SimStream, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._copy(stream, dst, src, False)

    def copy_many(self, stream: SimStream, pairs: list) -> None:
        # As ``CudaDevice`` queues them: through the driver, so each pinned host buffer must
        # stay referenced until its copy is done (else: a hazard).
        with self._lock:
            for dst, src in pairs:
                self._copy(stream, dst, src, True)

    def copy_after_compute(self, stream: SimStream, pairs: list) -> None:
        # As ``CudaDevice`` queues them (through the driver): the copy holds neither buffer. A
        # device storage named as the source is held weakly (freed before the copy ran: the
        # copy reads garbage), and torch's pinned allocator is not told, so each pinned host
        # buffer must stay referenced until its copy is done (else: a hazard).
        with self._lock:
            self.wait_stream(stream, self.current_stream())
            for dst, src in pairs:
                self._copy(stream, dst, src, True)

    def _copy(self, stream: SimStream, dst: torch.Tensor, src: object,
              unguarded: bool) -> None:
        """``copy``; ``unguarded``: as the driver queues it (``copy_after_compute``), and
        ``src`` may be a device ``UntypedStorage``."""
        weak_src = None
        if not isinstance(src, torch.Tensor):
            weak_src = weakref.ref(src)
            src_bytes, src_ptr = src.nbytes(), src.data_ptr()
            src = None
        else:
            src_bytes, src_ptr = src.numel(), src.data_ptr()
        if dst.numel() != src_bytes:
            raise SimulatedHazard(f"copy of {src_bytes} bytes into {dst.numel()}")
        # Into pinned host memory: a buffer from ``alloc_host`` or any view of its storage
        # (the pinned pool's buffers are views of its blocks that keep no ``_base``).
        storage = dst.untyped_storage()
        host = self._host_bufs.get(storage.data_ptr())
        to_host = host is not None and host.untyped_storage()._cdata == storage._cdata
        direction = "d2h" if to_host else "h2d"
        nbytes = dst.numel()

        def run() -> None:
            # On a real device a queued copy does not keep a device destination alive: the
            # caching allocator may hand that memory out again as soon as it is dropped. Here the
            # queue holds it; if nothing else does (no other reference to this tensor object, no
            # other tensor on its memory), that memory would have been freed and possibly reused.
            # A pinned host buffer copied with ``copy`` is different: torch's pinned (host
            # caching) allocator records an event on the copy's stream and reuses the block only
            # once the copy is done, so dropping it early is safe, as it is here. Copies queued
            # ``unguarded`` tell it nothing: there the host buffer must stay referenced too.
            if sys.getrefcount(dst) <= 2 and storage_use_count(dst) <= 1 and (
                    not to_host or unguarded):
                raise SimulatedHazard(
                    _UNGUARDED_HOST.format(direction, nbytes, stream.name) if to_host else
                    f"a queued {direction} copy of {nbytes} bytes on {stream.name} writes into a "
                    "buffer that was dropped before the copy was waited for"
                )
            if weak_src is None:
                if unguarded and not to_host and sys.getrefcount(src) <= 2 and (
                        storage_use_count(src) <= 1):
                    raise SimulatedHazard(_UNGUARDED_HOST.format(direction, nbytes, stream.name))
                dst.copy_(src)
                return
            storage = weak_src()
            if storage is None:
                # Freed before the copy ran (an abandoned forward drops its storages; a release
                # checks ``will_free`` first): a real copy would read whatever the allocator put
                # there since, so the host copy is garbage, and any use of it shows.
                dst.fill_(POISON)
                return
            dst.copy_(bytes_of(storage))

        with self._lock:
            if not to_host:
                self._check_fresh(stream, dst, f"a {direction} copy")
            self.log.append(("copy", stream.name, src_bytes, direction))
            start = dst.data_ptr()
            self._enqueue(stream, run, [src_ptr], (start, start + nbytes))

    # The batched calls of ``OffloadDevice``, run as one operation under the lock: each copy,
    # wait and allocation in them is checked as when made one by one.
    def copy_batch(self, stream: SimStream, pairs: list, event: Optional[SimEvent] = None,
                   milestone: Optional[tuple] = None) -> SimEvent:
        with self._lock:
            return super().copy_batch(stream, pairs, event, milestone)

    def reload_batch(self, stream: SimStream, sources: list, event: Optional[SimEvent] = None,
                     milestone: Optional[tuple] = None) -> tuple:
        with self._lock:
            return super().reload_batch(stream, sources, event, milestone)

    def compute_wait(self, event: SimEvent, waits: Optional[list] = None,
                     milestone: Optional[tuple] = None) -> None:
        with self._lock:
            super().compute_wait(event, waits, milestone)

    def will_free(self, t: object) -> None:
        ptr = t.data_ptr()
        with self._lock:
            for s in self.streams:
                for _, _, reads, _ in s.pending:
                    if ptr in reads:
                        raise SimulatedHazard(
                            f"device buffer freed while a copy queued on {s.name} still reads it"
                        )

    def nominal_rates(self) -> dict:
        """Fixed rates (no clock here): those measured on an H100 host (43 GB/s each way with
        both directions busy; fused CPU AdamW at 2.07 G params/s), so plans are reproducible."""
        return {"h2d_bytes_per_s": 43e9, "d2h_bytes_per_s": 43e9, "cpu_params_per_s": 2.07e9}

    def will_read(self, t: torch.Tensor) -> None:
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        with self._lock:
            after = self.compute.after
            self._queued_writes = [w for w in self._queued_writes if after.get(id(w[1]), 0) < w[2]]
            for (lo, hi), s, _ in self._queued_writes:
                if lo < end and start < hi:
                    raise SimulatedHazard(
                        f"compute reads a buffer that work queued on {s.name} writes, and the "
                        f"compute stream has not waited for an event on {s.name} recorded after "
                        "it (directly or through another stream): wait for that event first")
            for s in self.streams:
                for _, _, _, writes in s.pending:
                    if writes is not None and writes[0] < end and start < writes[1]:
                        raise SimulatedHazard(
                            f"compute reads a buffer that a copy queued on {s.name} still writes: "
                            "make the compute stream wait for that copy's event first"
                        )

    def run_on(self, stream: SimStream, fn: Callable[[], object], reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> object:
        """Run what ``stream`` has queued (its waits), then ``fn`` at once (the compute it
        queues runs eagerly here, like the compute stream's); then leave markers pending on
        ``stream`` that read ``reads`` and write ``writes`` until something waits for it (or
        ``stream`` runs more work), so that compute touching them before waiting for
        ``stream`` raises in ``will_read``, ``will_write`` or ``will_free``."""
        with self._lock:
            self.log.append(("run_on", stream.name))
            for t in writes:
                self._check_fresh(stream, t, "work")
            self._run_until(stream, stream.queued)
            out = fn()
            ptrs = [t.data_ptr() for t in reads]
            for t in list(writes) or [None]:
                span = None
                if t is not None:
                    start = t.data_ptr()
                    span = (start, start + t.numel() * t.element_size())
                self._enqueue(stream, lambda: None, ptrs, span)
            return out

    def queued_write(self, stream: SimStream, t: torch.Tensor) -> None:
        """Also when ``stream`` runs its work before compute waits for it (``run_on`` runs a
        stream's queue when more work comes to it): ``will_read`` checks the order, not only
        what is still queued.

        Example::

            >>> import torch
            >>> from cpu_offload import SimulatedDevice
            >>> dev = SimulatedDevice()
            >>> side, sums = dev.new_stream(), torch.zeros(4)
            >>> dev.queued_write(side, sums)      # e.g. bit sums taken on a hook's stream
            >>> dev.will_read(sums)   # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            cpu_offload.core.simulated.SimulatedHazard: compute reads a buffer that work ... first
            >>> dev.wait_event(dev.compute, dev.record_event(side))
            >>> dev.will_read(sums)               # ordered after the write now
        """
        start = t.data_ptr()
        span = (start, start + t.numel() * t.element_size())
        with self._lock:
            self.log.append(("queued_write", stream.name))
            self._enqueue(stream, lambda: None, [], span)
            if stream is not self.compute:
                self._queued_writes.append((span, stream, stream.queued))

    def will_write(self, t: torch.Tensor) -> None:
        ptr = t.data_ptr()
        start, end = ptr, ptr + t.numel() * t.element_size()
        with self._lock:
            for s in self.streams:
                for _, _, reads, writes in s.pending:
                    if ptr in reads or (writes is not None and writes[0] < end and start < writes[1]):
                        raise SimulatedHazard(
                            f"compute writes a buffer that work queued on {s.name} still reads or "
                            "writes: make the compute stream wait for that work's event first"
                        )

    def trace(self, what: str, layer: int) -> None:
        self.log.append((what, layer))

    # -- graph capture --------------------------------------------------------------------------
    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Model CUDA graph capture of the compute stream (``torch.cuda.graph``) for the block.

        Work still runs (the simulation has no replay), but CUDA's capture rules are checked as
        on the GPU, so a schedule that would abort a capture raises ``SimulatedHazard`` here:

        - a side stream joins the capture by waiting for an event recorded in it;
        - a captured stream must not wait for an event recorded outside this capture (before
          it, on a stream that is not captured, or in another capture):
          ``cudaErrorStreamCaptureIsolation``, "dependency created on uncaptured work in
          another stream";
        - every stream that joined must be joined back by the end of the capture (a captured
          stream waits for its last work): ``cudaErrorStreamCaptureUnjoined``;
        - the host must not wait for captured work (``synchronize``, ``wait_host``).

        Capture ``torch.cuda.make_graphed_callables`` style (forward and backward as separate
        graphs) with two blocks, or a whole step with one.

        Raises:
            SimulatedHazard: a capture rule was broken (also when the block raised nothing).

        Example::

            >>> import torch, cpu_offload
            >>> sim = cpu_offload.SimulatedDevice()
            >>> side = sim.new_stream()
            >>> before = sim.record_event(side)       # recorded outside the capture
            >>> with sim.capture():
            ...     sim.wait_stream(side, sim.current_stream())   # side joins the capture
            ...     sim.wait_stream(sim.current_stream(), side)   # and is joined back
            >>> with sim.capture():
            ...     sim.wait_event(sim.current_stream(), before)
            Traceback (most recent call last):
            ...
            cpu_offload.core.simulated.SimulatedHazard: ...cudaErrorStreamCaptureIsolation...
        """
        with self._lock:
            if self._capture is not None:
                raise SimulatedHazard("graph capture started while another one is in progress")
            token = self._capture = object()
            self.compute.capture = token
            self.compute.joined_back = 0
            self.log.append(("capture_begin",))
        ok = False
        try:
            yield
            ok = True
        finally:
            with self._lock:
                joined = [s for s in self.streams if s.capture is token and s is not self.compute]
                unjoined = [s for s in joined if s.joined_back < s.queued]
                for st in joined + [self.compute]:
                    st.capture = None
                self._capture = None
                self.log.append(("capture_end",))
            if ok and unjoined:
                raise SimulatedHazard(
                    f"graph capture ended with work on {', '.join(s.name for s in unjoined)} not "
                    "joined back into the capture stream (cudaErrorStreamCaptureUnjoined)"
                )

    def _capture_rules(self, stream: SimStream, event: SimEvent) -> None:
        """CUDA's rules for ``stream`` waiting on ``event`` while a capture is in progress."""
        if stream.capture is not None:
            if event.capture is not stream.capture:
                where = "before or outside" if event.capture is None else "in another"
                raise SimulatedHazard(
                    f"{stream.name} is being captured into a CUDA graph and waits for an event "
                    f"on {event.stream.name} recorded {where} this capture: dependency created "
                    "on uncaptured work in another stream (cudaErrorStreamCaptureIsolation)"
                )
            event.stream.joined_back = max(event.stream.joined_back, event.seq)
        elif event.capture is not None and event.capture is self._capture:
            stream.capture = event.capture  # waiting on captured work joins the capture
            stream.joined_back = stream.queued  # its earlier (eager) work is not in the graph

    # -- helpers for tests ----------------------------------------------------------------------
    def milestones(self, kinds: Optional[set] = None) -> list[tuple]:
        """The ('fwd'|'bwd'|'release'|'reload'|..., layer) entries of the log, in order."""
        keep = kinds or {"fwd", "bwd", "release", "reload", "offload", "end_bwd"}
        return [e for e in self.log if len(e) == 2 and e[0] in keep]

    def copies(self, direction: Optional[str] = None) -> list[tuple]:
        """The ``("copy", stream, nbytes, direction)`` log entries, optionally of one direction."""
        return [e for e in self.log if e[0] == "copy" and direction in (None, e[3])]

    def pending_ops(self) -> int:
        return sum(len(s.pending) for s in self.streams)

    # -- internals ------------------------------------------------------------------------------
    def _enqueue(self, stream: SimStream, fn: Callable[[], None], reads: list,
                 writes: Optional[tuple] = None) -> None:
        stream.queued += 1
        if stream.eager:
            fn()
            stream.done = stream.queued
        else:
            stream.pending.append((stream.queued, fn, reads, writes))

    def _run_until(self, stream: SimStream, seq: int) -> None:
        while stream.pending and stream.pending[0][0] <= seq:
            s, fn, _, _ = stream.pending.popleft()
            fn()
            stream.done = s
        stream.done = max(stream.done, min(seq, stream.queued))
