"""The only place where offloading touches streams, events and memory.

The schedulers (``synchronizer.py``, ``v1``) speak to an ``OffloadDevice``; ``CudaDevice`` issues real
CUDA work, ``SimulatedDevice`` (``simulated.py``) replays the same calls on the CPU and records them,
so every schedule decision is testable without a GPU.

Rules every implementation follows:

- All device memory is allocated on the compute stream. Work on the side stream that touches it is
  fenced with events, never with ``record_stream``, so freed memory is reusable at once. A side
  stream writes a fresh buffer only after waiting for a compute event recorded after its
  allocation: the allocator may hand out memory that compute work queued earlier still uses.
- Nothing here blocks the host, except ``synchronize`` and ``wait_host`` (which only CPU consumers
  of copied data call, e.g. the optimizer's CPU worker thread).
- Copies move flat ``uint8`` views of whole storages: one DMA per storage, no kernels. A batch
  (``copy_after_compute`` and the calls built on it) may name a device storage itself as a
  source (``bytes_of``), and may be queued without telling torch's pinned allocator
  (``CudaDevice`` calls the driver): its host buffers stay referenced until the copies are done.
  So do blocks from ``reserve_host`` for every copy (``CudaDevice``'s are not torch's memory).
- During CUDA graph capture, a captured stream never waits for a stream that has no work in the
  capture (``wait_stream`` skips it): CUDA refuses such a dependency
  (``cudaErrorStreamCaptureIsolation``), and the graph could not replay it anyway.
"""
from __future__ import annotations

import abc
import os
import threading
from typing import Any, Callable, Optional, Sequence

import torch

from ..compat import bytes_on_storage
from .driver import driver_copy_async
from .errors import public_caller
from .checks import env_flag
from .host_memory import CudaHostMemory
from .launcher import InlineLauncher, Launcher, ThreadLauncher

Stream = Any
Event = Any


class OffloadDevice(abc.ABC):
    """Streams, events, allocation and copies for one accelerator (or a simulation of one).

    The schedulers of both backends and the hybrid optimizer do all their device work through
    this interface, passed as ``device=`` (``get_cpu_offload_context``, ``apply_offloading``,
    ``plan_offloading``, ``HybridDeviceOptimizer``). Two implementations ship: ``CudaDevice``
    (the default, ``device=None``) and ``SimulatedDevice`` (the same calls on a CPU, checked).
    Implement it to offload from another accelerator, following the rules in this module's
    docstring: device memory allocated on the compute stream, side-stream work fenced with
    events, nothing blocking the host except ``synchronize`` and ``wait_host``.

    Example::

        >>> import cpu_offload
        >>> isinstance(cpu_offload.SimulatedDevice(), cpu_offload.OffloadDevice)
        True
        >>> sorted(cpu_offload.OffloadDevice.__abstractmethods__)[:4]
        ['alloc_device', 'alloc_host', 'copy', 'current_stream']
    """

    name: str = "abstract"
    display_name: str = "device"  # what messages call it: "freed 1.0 MiB of <display_name> memory"
    times_events: bool = False  # whether elapsed_ms can answer (statistics' copy-wait time)
    # ``t.device.type`` of exactly the tensors ``is_device_tensor`` accepts, if one type tells
    # them (the pack hook then compares it instead of calling); None: ask ``is_device_tensor``.
    tensor_device_type: Optional[str] = None

    @abc.abstractmethod
    def is_device_tensor(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in the memory this device offloads from."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream compute is issued on right now."""

    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A side stream for copies."""

    @abc.abstractmethod
    def record_event(self, stream: Stream) -> Event:
        """An event marking all work queued on ``stream`` so far."""

    def rerecord_event(self, stream: Stream, event: Optional[Event]) -> Event:
        """``record_event(stream)``, reusing ``event`` (one this device returned before) where
        the device can: the schedulers record one event per layer and direction every step,
        and creating a CUDA event costs the host far more than re-recording one. A wait already
        queued on ``event`` keeps the point it was queued for (``cudaStreamWaitEvent`` reads
        the event at call time). The default makes a new event."""
        return self.record_event(stream)

    @abc.abstractmethod
    def wait_event(self, stream: Stream, event: Event) -> None:
        """Make future work on ``stream`` wait for ``event`` (device side, host not blocked)."""

    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        """Make future work on ``waiter`` wait for everything queued on ``waitee`` so far.

        Skipped when ``waiter`` is being captured into a graph and ``waitee`` has no work in that
        capture (``capture_isolated``)."""
        if self.capture_isolated(waiter, waitee):
            return
        self.wait_event(waiter, self.record_event(waitee))

    def capturing(self, stream: Stream) -> bool:
        """Whether ``stream`` is being captured into a graph right now (it began the capture, or
        joined it by waiting for captured work). Devices without graphs: never."""
        return False

    def capture_isolated(self, waiter: Stream, waitee: Stream) -> bool:
        """Whether ``waiter`` is being captured and ``waitee`` is not: then ``waitee`` holds no
        work of this capture (whatever it ran before the capture began is not part of the graph),
        and a wait for it is both impossible to capture and unnecessary on replay."""
        return self.capturing(waiter) and not self.capturing(waitee)

    @abc.abstractmethod
    def event_done(self, event: Event) -> bool:
        """Non-blocking: has the device passed ``event``?"""

    def link_busy(self, event: Event) -> bool:
        """Whether copies queued before ``event`` (recorded on a copy stream) still run, so that
        copies queued now would wait behind them anyway. V2's pack hook then leaves a large
        storage for a later batch of its layer (the next one it queues, or the layer's end)
        instead of queuing it at once: fewer host calls, and the link no less busy. The
        default, False, queues every large storage at once; a real device answers without
        blocking (``CudaDevice``: the event's query).

        Args:
            event: an event this device recorded on a copy stream.

        Example::

            >>> import cpu_offload
            >>> sim = cpu_offload.SimulatedDevice()   # keeps the default
            >>> sim.link_busy(sim.record_event(sim.new_stream()))
            False
        """
        return False

    @abc.abstractmethod
    def wait_host(self, event: Event) -> None:
        """Block the calling host thread until the device has passed ``event``.

        For CPU code that reads what a copy wrote (``cpu_offload.optim``'s worker thread); the
        thread that launches GPU work never calls it during a step.
        """

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until all queued work is done (tests and teardown only)."""

    @abc.abstractmethod
    def alloc_host(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer the device can copy to and from asynchronously (pinned)."""

    def host_block_size(self, nbytes: int) -> int:
        """The bytes ``reserve_host(nbytes)`` reserves, known before it is called (a host budget
        is checked with it). The default: exactly ``nbytes``."""
        return nbytes

    def reserve_host(self, nbytes: int) -> torch.Tensor:
        """A pinned block for the pinned pool, which carves its buffers out of it: a flat
        ``uint8`` host tensor of ``host_block_size(nbytes)`` bytes, all of them usable, so its
        size is what the host reserved for it. Whoever drops it waits first for every copy
        that uses it (it need not be memory that torch's pinned allocator tracks). The
        default: ``alloc_host`` of that size.

        Example::

            >>> import cpu_offload
            >>> sim = cpu_offload.SimulatedDevice(host_page=4096)   # rounds to whole pages
            >>> sim.host_block_size(5000), sim.reserve_host(5000).numel()
            (8192, 8192)
        """
        return self.alloc_host(self.host_block_size(nbytes))

    def host_memory_kind(self) -> str:
        """Which memory ``reserve_host`` gives, for statistics and warnings (why, if it is not
        the exact kind)."""
        return "alloc_host blocks"

    @abc.abstractmethod
    def alloc_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 device buffer, allocated on the current (compute) stream."""

    @abc.abstractmethod
    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (both flat uint8 of equal size)."""

    def copy_many(self, stream: Stream, pairs: list) -> None:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)`` on ``stream``, in order, with no
        stream wait: ``copy`` for each pair, in one call. The streamed optimizer queues a chunk's
        copies in, and its copies out, this way. As with ``copy_after_compute``, the pinned host
        buffer of each pair must stay referenced until the copy is done (``CudaDevice`` queues
        the copies through the driver, which does not tell torch's pinned allocator).

        Args:
            stream: a side stream of this device.
            pairs: ``(dst, src)`` flat uint8 tensors of equal size, one of each pair in host
                memory (``alloc_host``), the other in device memory.

        Example::

            >>> import torch, cpu_offload
            >>> sim = cpu_offload.SimulatedDevice()
            >>> src = sim.alloc_device(4, torch.device("cpu")).copy_(torch.arange(4))
            >>> dst = sim.alloc_host(4)
            >>> sim.copy_many(sim.new_stream(), [(dst, src)])
            >>> sim.synchronize()
            >>> dst.tolist()
            [0, 1, 2, 3]
        """
        for dst, src in pairs:
            self.copy(stream, dst, src)

    def copy_after_compute(self, stream: Stream, pairs: list) -> None:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)`` on ``stream``, after everything
        queued on the current (compute) stream so far: one stream wait for the whole batch.

        ``dst`` is a flat uint8 tensor; ``src`` one of the same size, or a device
        ``UntypedStorage`` of that many bytes (``bytes_of``: V2's copies out name the saved
        storage itself, which saves a view per storage). The pinned host buffer of each pair
        must stay referenced until the copy is done: an implementation may queue these copies
        without telling torch's pinned allocator (``CudaDevice`` does, through the driver)."""
        self.wait_stream(stream, self.current_stream())
        for dst, src in pairs:
            self.copy(stream, dst, bytes_of(src))

    def copy_batch(self, stream: Stream, pairs: list, event: Optional[Event] = None,
                   milestone: Optional[tuple] = None) -> Event:
        """A layer's copies in one call: ``copy_after_compute(stream, pairs)`` (nothing when
        ``pairs`` is empty), then the end of the batch marked on ``stream`` in ``event``
        (``rerecord_event``: the event the last batch returned, or None) and returned; then
        ``trace(*milestone)`` if given. The schedulers call it once per layer and direction, so
        an implementation should do it with the fewest host calls it can (``CudaDevice``
        switches streams once)."""
        if pairs:
            self.copy_after_compute(stream, pairs)
        event = self.rerecord_event(stream, event)
        if milestone is not None:
            self.trace(*milestone)
        return event

    def reload_batch(self, stream: Stream, sources: list, event: Optional[Event] = None,
                     milestone: Optional[tuple] = None) -> tuple:
        """A layer's reload in one call: for each ``(host_buffer, device)`` in ``sources``, a
        new flat ``uint8`` buffer of its size on ``device`` (``alloc_device``: on the compute
        stream, all allocated before any copy is queued), filled from it by ``copy_batch``.
        Returns ``(buffers, event)``, ``event`` marking the end of the copies."""
        buffers = [self.alloc_device(src.numel(), device) for src, device in sources]
        event = self.copy_batch(
            stream, [(dst, src) for dst, (src, _) in zip(buffers, sources)], event, milestone)
        return buffers, event

    def compute_wait(self, event: Event, waits: Optional[list] = None,
                     milestone: Optional[tuple] = None) -> None:
        """Make the current (compute) stream wait for ``event`` (device side). ``waits``: if
        the device times events, ``(event recorded on compute now, event)`` is appended to it
        (the statistics' copy-wait time). Then ``trace(*milestone)`` if given."""
        compute = self.current_stream()
        if waits is not None and self.times_events:
            waits.append((self.record_event(compute), event))
        self.wait_event(compute, event)
        if milestone is not None:
            self.trace(*milestone)

    def copy_and_record(self, stream: Stream, pairs: list, group_bytes: int = 0) -> list:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)``; return one event per pair, marking
        (at least) the end of its copy.

        Small copies share an event (see ``event_groups``), which saves host calls; ``0``: one
        event per copy."""
        events: list = []
        for group in event_groups(pairs, group_bytes):
            for dst, src in group:
                self.copy(stream, dst, src)
            events += [self.record_event(stream)] * len(group)
        return events

    def elapsed_ms(self, start: Event, end: Event) -> Optional[float]:
        """Milliseconds from ``start`` to ``end`` if the device has passed both, else None.
        Never blocks (statistics are read lazily)."""
        return None

    def will_free(self, t: Any) -> None:
        """The scheduler is about to drop its last reference to device buffer ``t`` (a tensor,
        or an ``UntypedStorage``).

        A real device needs nothing; the simulation checks that no queued copy still reads it.
        """

    def host_launcher(self, where: torch.device) -> Launcher:
        """Where host work queued from backward's hooks runs (``launcher``): the default runs it
        at once, in the hook. Work for ``where`` (a device of this kind)."""
        return InlineLauncher()

    def nominal_rates(self) -> Optional[dict]:
        """Fixed rates to plan with instead of measured ones, or ``None`` (measure them).

        A dict with ``"h2d_bytes_per_s"``, ``"d2h_bytes_per_s"`` (copies running in both
        directions at once) and ``"cpu_params_per_s"`` (the CPU optimizer update); used by
        ``HybridDeviceOptimizer(stream_fraction="auto")``. Simulations return fixed ones, so a
        plan made on them is reproducible.
        """
        return None

    def will_read(self, t: torch.Tensor) -> None:
        """Compute is about to read device buffer ``t`` (a copy's destination).

        A real device needs nothing (the compute stream's event waits order it); the simulation
        checks that no copy still queued on a side stream writes into ``t``.
        """

    def run_on(self, stream: Stream, fn: Callable[[], Any], reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> Any:
        """Call ``fn`` (host code that queues device compute) so that its work runs on ``stream``,
        in that stream's order (after the waits queued on it), not on the compute stream;
        returns what ``fn`` returns. Memory ``fn`` allocates belongs to ``stream``: free it only
        after ``stream`` has waited for every other stream that uses it.

        ``reads`` and ``writes``: device tensors that work reads and writes, for checks (a real
        device needs nothing; the simulation keeps them pending on ``stream`` until something
        waits for it, so ``will_read``/``will_write``/``will_free`` of them before then raise).
        The default runs ``fn`` on the current stream, fenced both ways with ``stream``: the
        same order, without concurrency.
        """
        current = self.current_stream()
        self.wait_stream(current, stream)
        out = fn()
        self.wait_stream(stream, current)
        return out

    def queued_write(self, stream: Stream, t: torch.Tensor) -> None:
        """Work just queued on ``stream`` outside ``run_on`` (the stream current then) writes
        device tensor ``t``.

        A real device needs nothing; the simulation holds ``t`` as being written until the
        compute stream has waited for an event on ``stream`` recorded after it (directly or
        through another stream), so compute that reads it first raises in ``will_read``.
        """

    def will_write(self, t: torch.Tensor) -> None:
        """Compute is about to write device tensor ``t`` in place (e.g. zero a gradient).

        A real device needs nothing; the simulation checks that no work still queued on
        another stream reads or writes ``t``.
        """

    def trace(self, what: str, layer: int) -> None:
        """Schedule milestones ('fwd', 'bwd', 'release', 'reload', ...); recorded by simulations."""


class CudaDevice(OffloadDevice):
    """The CUDA device: streams, events, pinned host memory, the caching allocator.

    What ``device=None`` (or ``"cuda"``) selects; create one yourself only to pass it
    explicitly. Copies are asynchronous on side streams, fenced with CUDA events, into pinned
    host buffers; device memory is allocated on the current (compute) stream. Constructing it
    does not touch CUDA; using it needs a CUDA build of torch and a GPU.

    Args:
        time_waits: record timed CUDA events, so that ``ctx.stats()`` reports how long compute
            waited for copies (costs a little on every stream wait). ``None``: on if the
            environment variable ``CPU_OFFLOAD_TIME_WAITS=1``.
        exact_host_memory: the pinned pool's blocks are page-locked at exact size by the
            driver (``core/host_memory.py``), instead of taken from torch's pinned allocator,
            which rounds each up to a power of two. ``None``: on unless
            ``CPU_OFFLOAD_EXACT_PINNED=0``. Where the driver refuses, torch's allocator is used
            and ``ctx.stats().summary()`` says why.
        numa_binding: those blocks are placed on the GPU's NUMA node where the host exposes it.
            ``None``: on unless ``CPU_OFFLOAD_PINNED_NUMA=0``.

    Example::

        >>> import torch, cpu_offload
        >>> dev = cpu_offload.CudaDevice()
        >>> dev.name, dev.is_device_tensor(torch.zeros(1))   # a CPU tensor is not offloaded
        ('cuda', False)

    The hooks run inside every op that saves a tensor, so this class avoids the Python layers of
    ``torch.cuda`` on the hot path: the current stream is looked up by its raw handle, stream
    waits reuse one fence event per device (``cudaStreamWaitEvent`` captures the event's state at
    call time, so re-recording it later is safe), and copies switch streams without a context
    manager.
    """

    name = "cuda"
    display_name = "GPU"
    tensor_device_type = "cuda"

    def __init__(self, time_waits: Optional[bool] = None,
                 exact_host_memory: Optional[bool] = None,
                 numa_binding: Optional[bool] = None) -> None:
        # Timed events cost a little on every stream wait, so timing the copy waits in the
        # statistics is opt-in: CudaDevice(time_waits=True) or CPU_OFFLOAD_TIME_WAITS=1.
        if time_waits is None:
            time_waits = os.environ.get("CPU_OFFLOAD_TIME_WAITS", "0").strip() in ("1", "true")
        self.times_events = bool(time_waits)
        self.exact_host_memory = (env_flag("CPU_OFFLOAD_EXACT_PINNED")
                                  if exact_host_memory is None else bool(exact_host_memory))
        self.numa_binding = (env_flag("CPU_OFFLOAD_PINNED_NUMA")
                             if numa_binding is None else bool(numa_binding))
        self._host_memory: dict[int, CudaHostMemory] = {}  # GPU index -> where blocks come from
        self._streams: dict[tuple, Stream] = {}
        # One reusable fence event per device and thread: a fence is recorded and waited on in one
        # call, and the autograd engine's device threads or the optimizer's worker must not
        # re-record another thread's fence in between.
        self._fences = threading.local()

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def current_stream(self) -> Stream:
        index = torch._C._cuda_getDevice()
        key = (index, torch._C._cuda_getCurrentRawStream(index))
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = torch.cuda.current_stream(index)
        return stream

    def new_stream(self) -> Stream:
        return torch.cuda.Stream()

    def host_launcher(self, where: torch.device) -> Launcher:
        """A thread of its own: backward's device thread keeps queuing kernels meanwhile."""
        return ThreadLauncher(setup=lambda: torch.cuda.set_device(where),
                              make_current=torch.cuda.set_stream)

    def record_event(self, stream: Stream) -> Event:
        # Timed, so statistics can report copy waits; not while a CUDA graph is being captured
        # (capture needs plain events, and statistics of a replay are not recorded anyway).
        ev = torch.cuda.Event(
            enable_timing=self.times_events and not torch.cuda.is_current_stream_capturing()
        )
        ev.record(stream)
        return ev

    def rerecord_event(self, stream: Stream, event: Optional[Event]) -> Event:
        # Timed events stay one per record (statistics read them later). A capture records
        # fresh ones, never reused: an event recorded in a graph is recorded again by each replay.
        if torch.cuda.is_current_stream_capturing():
            event = self.record_event(stream)
            event.captured = True
            return event
        if event is None or self.times_events or getattr(event, "captured", False):
            return self.record_event(stream)
        event.record(stream)
        return event

    def elapsed_ms(self, start: Event, end: Event) -> Optional[float]:
        try:
            if not (start.query() and end.query()):
                return None
            return start.elapsed_time(end)
        except RuntimeError:  # an untimed event (recorded during graph capture)
            return None

    def wait_event(self, stream: Stream, event: Event) -> None:
        stream.wait_event(event)

    def capturing(self, stream: Stream) -> bool:
        previous = self.current_stream()
        if stream == previous:
            return torch.cuda.is_current_stream_capturing()
        torch.cuda.set_stream(stream)
        try:
            return torch.cuda.is_current_stream_capturing()
        finally:
            torch.cuda.set_stream(previous)

    def capture_isolated(self, waiter: Stream, waitee: Stream) -> bool:
        # Our streams join a capture only by waiting for the capturing (current) stream, so
        # outside a capture of the current stream one cheap query answers.
        if not torch.cuda.is_current_stream_capturing():
            return False
        return self.capturing(waiter) and not self.capturing(waitee)

    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        if waiter == waitee or self.capture_isolated(waiter, waitee):
            return
        fences = self._fences.__dict__
        fence = fences.get(waitee.device_index)
        if fence is None:
            fence = fences[waitee.device_index] = torch.cuda.Event()
        fence.record(waitee)
        waiter.wait_event(fence)

    def event_done(self, event: Event) -> bool:
        return event.query()

    def link_busy(self, event: Event) -> bool:
        # Never a query while capturing a graph (an unsafe call there): queue at once, as before.
        return not torch.cuda.is_current_stream_capturing() and not event.query()

    def wait_host(self, event: Event) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_memory(self) -> CudaHostMemory:
        """Where the current GPU's pinned blocks come from (made when first asked)."""
        index = torch._C._cuda_getDevice()
        memory = self._host_memory.get(index)
        if memory is None:
            memory = self._host_memory[index] = CudaHostMemory(
                index, self.exact_host_memory, self.numa_binding)
        return memory

    def host_block_size(self, nbytes: int) -> int:
        return self.host_memory().block_size(nbytes)

    def reserve_host(self, nbytes: int) -> torch.Tensor:
        return self.host_memory().allocate(nbytes)

    def host_memory_kind(self) -> str:
        return self.host_memory().kind

    def alloc_device(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, stream: Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        previous = self.current_stream()
        torch.cuda.set_stream(stream)
        try:
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(previous)

    def copy_many(self, stream: Stream, pairs: list) -> None:
        _driver_copies(stream, pairs, self.current_stream())

    def copy_after_compute(self, stream: Stream, pairs: list) -> None:
        previous = self.current_stream()
        self.wait_stream(stream, previous)
        _driver_copies(stream, pairs, previous)

    def run_on(self, stream: Stream, fn: Callable[[], Any], reads: Sequence[torch.Tensor] = (),
               writes: Sequence[torch.Tensor] = ()) -> Any:
        previous = self.current_stream()
        torch.cuda.set_stream(stream)
        try:
            return fn()
        finally:
            torch.cuda.set_stream(previous)

    def copy_and_record(self, stream: Stream, pairs: list, group_bytes: int = 0) -> list:
        previous = self.current_stream()
        timing = self.times_events and not torch.cuda.is_current_stream_capturing()
        torch.cuda.set_stream(stream)
        events: list = []
        try:
            for group in event_groups(pairs, group_bytes):
                for dst, src in group:
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event(enable_timing=timing)
                ev.record(stream)
                events += [ev] * len(group)
        finally:
            torch.cuda.set_stream(previous)
        return events


def bytes_of(src: Any) -> torch.Tensor:
    """``src`` as a flat uint8 tensor: itself if it is a tensor, else (an ``UntypedStorage``) a
    flat view over all its bytes.

    Example::

        >>> import torch
        >>> from cpu_offload.core.device import bytes_of
        >>> bytes_of(torch.zeros(2, dtype=torch.float32).untyped_storage()).shape
        torch.Size([8])
    """
    return src if isinstance(src, torch.Tensor) else bytes_on_storage(src)


def _driver_copies(stream: Stream, pairs: list, previous: Stream) -> None:
    """``(dst, src)`` copies queued on CUDA ``stream`` through the driver, one call on two
    addresses each (``src`` a tensor or a device storage); where the driver is unavailable or
    refuses one, torch's copies for the rest (and torch's error, if it has one)."""
    raw = driver_copy_async()
    queued = 0
    if raw is not None:
        handle = stream.cuda_stream
        for dst, src in pairs:
            if raw(dst.data_ptr(), src.data_ptr(), dst.nbytes, handle):
                break  # not queued (no current driver context on this thread, say)
            queued += 1
    if queued < len(pairs):
        _copies_on(stream, [(d, bytes_of(s)) for d, s in pairs[queued:]], previous)


def _copies_on(stream: Stream, pairs: list, previous: Stream) -> None:
    """``dst.copy_(src)`` for each pair on CUDA ``stream``, then ``previous`` is current again:
    one stream switch for the whole batch."""
    torch.cuda.set_stream(stream)
    try:
        for dst, src in pairs:
            dst.copy_(src, non_blocking=True)
    finally:
        torch.cuda.set_stream(previous)


def event_groups(pairs: list, group_bytes: int) -> list:
    """Split ``(dst, src)`` copies, in order, into groups that end in one shared event.

    A group closes once it holds ``group_bytes``; a copy of ``group_bytes`` or more closes the
    group before it and stands alone, so small copies never wait behind a large one. With
    ``group_bytes=0`` every copy is its own group.

    Example::

        >>> import torch
        >>> from cpu_offload.core.device import event_groups
        >>> pairs = [(torch.empty(n, dtype=torch.uint8), None) for n in (10, 20, 100, 30, 40)]
        >>> [[d.numel() for d, _ in g] for g in event_groups(pairs, 50)]
        [[10, 20], [100], [30, 40]]
    """
    groups: list = []
    group: list = []
    queued = 0
    for pair in pairs:
        n = pair[0].numel()
        if group and n >= group_bytes:
            groups.append(group)
            group, queued = [], 0
        group.append(pair)
        queued += n
        if queued >= group_bytes:
            groups.append(group)
            group, queued = [], 0
    if group:
        groups.append(group)
    return groups


_default_device: Optional[OffloadDevice] = None


def check_cuda_available() -> None:
    """What ``default_device`` raises without CUDA, naming the function or class the user
    called (``apply_offloading``, ``OffloadCallback``, ...), for callers that check early."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "cpu_offload: CUDA is not available. Offloading moves activations from a CUDA GPU; "
            "on a CPU-only machine pass device=cpu_offload.SimulatedDevice() to "
            f"{public_caller('get_cpu_offload_context')} to run the schedule in simulation."
        )


def default_device() -> OffloadDevice:
    """The CUDA device; a clear error on machines without CUDA."""
    global _default_device
    if _default_device is None:
        check_cuda_available()
        _default_device = CudaDevice()
    return _default_device
