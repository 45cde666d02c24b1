"""The streamed part of ``HybridDeviceOptimizer``: optimizer state in pinned CPU memory, the
update on the device, the state streamed through a bounded device staging area.

For the parameters of a ``StreamedPart`` the master weights (fp32 for bf16/fp16 parameters; an
fp32 or fp64 parameter is its own master and stays on the device) and the wrapped optimizer's
per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``...) live in pinned host memory. Inside
``step()`` the parameters are updated chunk by chunk (about ``budget_bytes / SLOTS`` of staging each):

1. the chunk's masters and state are copied host -> device on a side stream (``h2d``) into one
   of ``SLOTS`` (three) device slots;
2. the compute stream waits for that copy, takes into each master any edit of its parameter
   since the part wrote it (``stream_chunk.merge_edits``: the part keeps no record of what it
   wrote), converts the gradients to the master dtype in the slot, runs the device optimizer
   class (``gpu_optimizer_cls``, fused AdamW by default) over the slot views, and writes the
   new masters into the parameters (cast to their dtype);
3. masters and state are copied back device -> host on another side stream (``d2h``).

Three slots: the copy in of chunk ``i + 1`` overlaps the update of chunk ``i`` and the copy out of
chunk ``i - 1``; a slot is refilled only after the copy out of the chunk ``SLOTS`` before has read
it, so with three the copy in does not wait for the update and the copy out just before it (with
two it did, and each copy stream idled about a fifth of the streaming).
Device memory for it is allocated at the start of the update (compute stream) and dropped at
its end, after the compute stream has waited for the last copy out, so the next step's copies
in are ordered after this step's copies out, and outside ``step()`` the part holds no device
memory.

Overlapped (``overlap="next_forward"``): step 2 runs on a stream of the part's own
(``update_stream``, ``OffloadDevice.run_on``), which first waits for the compute stream (the
gradients are final, clipped; backward has read the parameters), and the chunks go in forward
order (the reverse of gradient arrival), so the first modules' chunks are done first. Inside
``HybridDeviceOptimizer.step`` only the first ``STREAM_AHEAD_CHUNKS`` chunks are queued before
its CPU and device parts, the rest after them (``step(ahead=...)``, ``queue_rest``), by a
launcher (on CUDA a thread of its own, ``OffloadDevice.host_launcher``): queuing a chunk costs
about as much host time as the link takes to move it, so ``step()`` returns while the rest is
queued, and the next forward's first modules (those not streamed) run under the streaming.
Every other entry point into the part waits for that queuing first (``_settle_rest``); the
gradients each chunk reads are taken when ``step()`` runs (``zero_grad`` may follow at once).
``step()`` returns with the update queued; each module's forward pre-hook makes the compute
stream wait only for the chunks that write its parameters (``wait_params``), and the one that
waits for the last chunk also waits for its copy out and frees the slots (``finish``). Until
then the part holds the slots and the gradients the update reads (a gradient set to ``None`` by
``zero_grad`` is not freed under it); everything else that touches them is ordered after the
update on the device: the next ``step()`` (``finish``), ``wait_params``/the next backward
(``order_params``), and whatever reads masters or state on the host (``sync``). State the
class creates on a first step is allocated on the update stream and freed there, after that
stream has waited for its copy out.

The update is the device class stepping over the same values as without offloading
(gradients read from ``.grad`` inside ``step()``, after any clipping), so its result is bit for
bit the wrapped class run on the device over fp32 masters (or over the parameters themselves).

Chunks split parameters for the classes in ``cpu_update.ELEMENTWISE`` (element ranges starting
at multiples of ``ALIGN_ELEMS``, as on the CPU); other classes get whole parameters per chunk
(a parameter larger than a chunk then gets a chunk of its own, over the budget).

The first update of a parameter lets the optimizer class create its state on the device (outside
the staging budget); it is then copied into pinned host memory allocated for it, and freed before
the next chunk's update, so that step holds at most one chunk's new state beyond the budget.
State a class makes in its constructor (Adagrad's ``sum``) is made over keys of the right
shape, one chunk at a time, and moved into pinned host memory at construction, as loaded state
is (``load_state_dict``).

The part is split by job: ``stream_plan`` (the chunks and a slot's layout), ``stream_store``
(pinned host memory: masters, state, the spare copy), ``stream_chunk`` (one chunk's copies in,
update and copies out), ``stream_records`` (what is in flight, and its phases),
``stream_backward`` (updates started in backward); this module orders them on the streams
(``StreamedPart.step``) and is what ``HybridDeviceOptimizer`` sees.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..core.device import Event, OffloadDevice
from ..core.errors import OffloadUsageError
from ..core.launcher import Launcher
from .cpu_update import (
    ELEMENTWISE, KeyedState, StateEntry, chunk_state_dicts, part_param_groups,
)
from .classes import ONE_STEP_SHAPE, one_step
from .stream_backward import BackwardUpdates
from .stream_chunk import ChunkRunner, Link
from .stream_plan import SLOTS, Chunk, ChunkPlan, Piece, SlotLayout, build_chunk, plan_ranges
from .stream_records import ChunkMark, QueuedUpdate, UpdatePhase
from .stream_store import HostCopy, ParamIO
from .amp import LossScale
from .guards import check_layout, merge_edited, snapshot, snapshot_hypers

__all__ = [
    "DEFAULT_STREAM_BUDGET_BYTES", "MIN_STREAM_BUDGET_BYTES", "SLOTS", "STREAM_AHEAD_CHUNKS",
    "StreamedPart",
    "state_elems_per_param",
]

# chunks ``step(ahead=...)`` queues before the caller's CPU and device parts: enough to keep the
# link busy while the host waits for backward's end and queues their work (a chunk of the
# default budget moves about 1-2 ms each way on a PCIe 5 link), few enough (about 13 launches
# each) to stay far below the ~1000 launches a stream may have waiting before CUDA blocks the
# host. 24 measured best of 8, 24 and all (benchmarks/RESULTS.md, sixteenth session)
STREAM_AHEAD_CHUNKS = 24
DEFAULT_STREAM_BUDGET_BYTES = 384 * 2**20  # device staging of the streamed part (SLOTS of 128 MiB)
MIN_STREAM_BUDGET_BYTES = 96 * 2**10  # SLOTS slots of at least 1024 elements each


def state_elems_per_param(make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> tuple[int, bool]:
    """How many per-element state tensors the optimizer class keeps (2 for Adam), found by one
    step on a CPU dummy parameter, and whether the class updates elements independently (its
    parameters may be split into chunks). Falls back to 2 if the dummy step fails."""
    stepped = one_step(make_optimizer)
    if stepped is None:  # an estimate only (sizes the chunks)
        return 2, False
    opt, st = stepped
    per_element = sum(1 for v in st.values() if torch.is_tensor(v) and v.shape == ONE_STEP_SHAPE)
    return per_element, type(opt) in ELEMENTWISE


@dataclass(eq=False)
class _Live:
    """A chunk ``step()`` updates: the pieces of it that have a gradient, and their layout."""

    chunk: Chunk
    pieces: list[Piece]
    layout: SlotLayout
    # per piece, its parameter's ``.grad`` when ``step()`` ran: the rest may be queued after
    # ``step()`` returned (``queue_rest(defer=True)``), when ``zero_grad`` may have cleared it
    grads: list[torch.Tensor]


@dataclass(eq=False)
class _Queuing:
    """A step's update while its chunks are being queued (``step`` to ``queue_rest``)."""

    live: list[_Live]  # the chunks to update, in queuing order
    hypers: Sequence[dict]
    scale: Optional[LossScale]
    slots: list[torch.Tensor]  # the staging slots, used in turn
    start: Event  # on the compute stream: gradients final, the slots allocated
    compute: Any  # the compute stream
    ustream: Any  # the stream that updates (compute, or ``update_stream`` when overlapped)
    marks: dict = field(default_factory=dict)  # overlapped: what each forward waits for
    outs: list = field(default_factory=list)  # per queued chunk: its copies out's end
    keep: list = field(default_factory=list)  # device state the class created, read by copies out
    first_position: int = 0  # the place of the first chunk in the update's order (after kept)
    queued: int = 0  # chunks of ``live`` queued so far


class StreamedPart:
    """The streamed parameters of one ``HybridDeviceOptimizer`` attach (see the module docstring).

    For ``state_dict`` it looks like one optimizer over ``keys`` (the host master of a
    low-precision parameter, the parameter itself otherwise): ``param_groups`` (one per wrapper
    group), ``state`` and ``load_state_dict`` in torch's format.
    """

    def __init__(
        self,
        device: OffloadDevice,
        params: Sequence[torch.Tensor],
        group_ids: Sequence[int],
        hypers: Sequence[dict],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        budget_bytes: int = DEFAULT_STREAM_BUDGET_BYTES,
        state_elems: int = 2,
        elementwise: bool = True,
        overlapped: bool = False,
        early: bool = False,
        launcher: Optional[Launcher] = None,
        fp32_masters: bool = True,
    ) -> None:
        self._device = device
        # overlapped (``overlap="next_forward"``): the update runs on its own stream and step()
        # returns before it is done; each module's next forward waits for its own chunks
        self.overlapped = overlapped
        self.update_stream = device.new_stream() if overlapped else None
        self._queued: Optional[QueuedUpdate] = None  # the overlapped update step() left running
        self._queuing: Optional[_Queuing] = None  # step(ahead=...) until queue_rest()
        # overlapped, no updates in backward: queue_rest(defer=True) hands the rest to this
        # launcher; _rest_pending until an entry point has waited for it (_settle_rest)
        self._rest_launcher: Optional[Launcher] = None
        if overlapped and not early:
            self._rest_launcher = launcher or device.host_launcher(params[0].device)
        self._rest_pending = False
        self.ahead_chunks = STREAM_AHEAD_CHUNKS  # what the optimizer's step() passes as ``ahead``
        self.backward: Optional[BackwardUpdates] = None
        self.chunks: list[Chunk] = []
        self.params = list(params)
        # where each parameter's memory was when the pieces last looked (``follow_params``)
        self._memory = [(p.data_ptr(), p.shape, p.dtype) for p in self.params]
        self.group_of = list(group_ids)
        self.group_ids = list(dict.fromkeys(group_ids))
        self.budget_bytes = budget_bytes
        self._link = Link(device)
        self.h2d, self.d2h = self._link.h2d, self._link.d2h
        self._store = HostCopy(device, self.params, state_elems, fp32_masters)
        self._io = ParamIO(device, self.params, self._store.masters)
        self.read_params()
        self.keys = [m if m is not None else p for p, m in zip(self.params, self._store.masters)]
        self._runner = ChunkRunner(device, self.params, self._store, self._link)
        self.chunk_elems, ranges = plan_ranges(self.params, self._runner.lowp, budget_bytes,
                                               state_elems, elementwise)
        self._store.reserve_small(sum(len(r) for r in ranges))  # small state (AdamW's step)
        own = snapshot_hypers(hypers)  # the chunks' optimizers never hold the caller's tensors
        build = lambda groups: _own_defaults(make_optimizer(groups))  # noqa: E731
        for r in ranges:
            chunk = build_chunk(r, self.params, self._store.masters, own, self.group_of, build)
            if chunk.optimizer.state:  # made at construction (Adagrad): kept in host memory
                self._state_home(chunk)
            self.chunks.append(chunk)
        self._plan = ChunkPlan(self.chunk_elems, self.chunks)
        self.staging_bytes = 0  # device bytes of the slots in the last update
        self.state = KeyedState(self.state_keys, self.param_state)
        # updates started during backward (``early``: backward-update modes without clipping
        # inside step()), kept by step() when still valid
        if early:
            side = self.update_stream or device.new_stream()
            self.backward = BackwardUpdates(self._runner, self._plan, side,
                                            launcher or device.host_launcher(self.params[0].device),
                                            state_elems)
        # the copies go through the driver (``OffloadDevice.copy_many``), which does not tell
        # torch's pinned allocator: at the part's end its pinned buffers go only after them
        weakref.finalize(self, _fence, device).atexit = False

    @property
    def bytes_in(self) -> int:
        """Bytes copied host to device so far."""
        self._settle_rest()
        return self._link.bytes_in

    @property
    def bytes_out(self) -> int:
        """Bytes copied device to host so far."""
        self._settle_rest()
        return self._link.bytes_out

    def masters(self) -> list[Optional[torch.Tensor]]:
        """Per parameter its master in pinned host memory (fp32 for a bf16/fp16 parameter), or
        ``None`` where the parameter is its own master (fp32, fp64). Call ``sync()`` before
        reading them."""
        return list(self._store.masters)

    def in_flight(self) -> list[torch.Tensor]:
        """The device buffers the update ``step()`` left running holds (``next_forward``:
        staging, device state, early updates' buffers), until ``finish``."""
        self._settle_rest()
        return list(self._queued.held) if self._queued is not None else []

    # ------------------------------------------------------------------------------------------
    # host <-> device outside the update

    def read_params(self) -> None:
        """Masters from the current parameter values (construction, ``reload_master_weights``)."""
        self.sync()
        self._io.read(self.d2h)

    def write_params(self) -> None:
        """Parameters from the masters (after ``load_state_dict``)."""
        self._settle_rest()
        self._io.write(self.h2d)

    # ------------------------------------------------------------------------------------------
    # ordering the overlapped update with what comes after it

    def wait_params(self, indices: Sequence[int]) -> None:
        """(Overlapped, a module's forward pre-hook.) The compute stream waits, device side, for
        the chunks of the last update that write parameters ``indices``, no other; the
        gradients those chunks read are released then. The forward that waits for the last
        chunk also waits for its copy out, and frees the staging (``finish``), so that it is not
        held through the rest of the forward and backward."""
        self._settle_rest()
        q = self._queued
        marks = {i: q.marks.pop(i) for i in indices if q is not None and i in q.marks}
        if not marks:
            return
        self._wait_forward(max(marks.values(), key=lambda m: m.position).done)
        dev = self._device
        for i in indices:
            dev.will_read(self.params[i])
            if i in marks:
                dev.will_free(marks[i].grad)
        if not q.marks:  # the last chunk's forward: free the staging (after its copy out)
            self.finish()

    def _wait_forward(self, event: Event) -> None:
        """The compute stream waits for a chunk's update before a forward reads its parameters
        (tests remove it: a hazard)."""
        self._device.wait_event(self._device.current_stream(), event)

    def order_params(self) -> None:
        """(Overlapped.) The compute stream waits, device side, for the whole last update:
        parameters written, gradients read (``wait_params``, the next backward, in-place
        ``zero_grad``). The host is not blocked."""
        self._settle_rest()
        q = self._queued
        if q is None:
            return
        dev = self._device
        dev.wait_event(dev.current_stream(), q.updated)
        q.phase = q.phase.to(UpdatePhase.ORDERED)
        for grad in [m.grad for m in q.marks.values()] + q.early_grads:
            dev.will_free(grad)
        q.marks.clear()
        q.early_grads = []

    def finish(self) -> None:
        """(Overlapped.) ``order_params``, and the compute stream waits for the last copy out,
        so that the staging and device state the update used can be freed (dropped here). The
        host is not blocked."""
        self._settle_rest()
        assert self._queuing is None, "queue_rest() was not called after step(ahead=...)"
        q = self._queued
        if q is None:
            return
        self.order_params()
        dev = self._device
        if self._link.last_out is not None:
            dev.wait_event(dev.current_stream(), self._link.last_out)
        for t in q.held:
            dev.will_free(t)
        q.phase = q.phase.to(UpdatePhase.FINISHED)
        self._queued = None

    def take_edits(self) -> None:
        """Outside a step (``state_dict``): parameters edited since the part wrote them, into
        their host masters, once nothing reads or writes those (``sync``). The update inside
        ``step()`` does the same on the device, chunk by chunk (``ChunkRunner``), so the part
        keeps no record of what it wrote; here each parameter comes to its host master
        (unchanged where nothing was edited)."""
        self.sync()
        for p, master in zip(self.params, self._store.masters):
            if master is not None and p.numel():
                merge_edited(master, p)

    def follow_params(self, indices: Optional[Sequence[int]] = None) -> None:
        """Parameters (``indices``, default all) given new memory since the part last looked
        (``p.data = t``, as torch's optimizers allow): their pieces follow it, as the CPU and
        device parts do (before, the update kept writing into the old memory and the parameter
        stayed as assigned). New memory of another shape or dtype, or not contiguous, is
        refused (``guards.check_layout``)."""
        self._settle_rest()
        for i in range(len(self.params)) if indices is None else indices:
            p = self.params[i]
            ptr, shape, dtype = self._memory[i]
            if p.data_ptr() == ptr and p.shape == shape and p.dtype == dtype:
                continue
            check_layout(p, shape, dtype)
            for pc in self._plan.pieces:
                if pc.index == i:
                    pc.follow(p, own_master=not self._runner.lowp[i])
            self._memory[i] = (p.data_ptr(), p.shape, p.dtype)

    def sync(self) -> None:
        """Block until the last update's copies into host memory have landed (before the host
        reads masters or state: ``opt.state[p]``, ``state_dict``, ``load_state_dict``); device
        work that reads or writes the parameters after this is ordered after the update.
        Updates started in this backward are dropped (``BackwardUpdates.abandon``; ``step()``
        updates their chunks again): they wrote the spare copies, which the host may now read
        or bring up to date (``PieceHost.settle``), and state read before ``step()`` is the
        last step's, as with torch's optimizers."""
        if self.backward is not None:
            self.backward.abandon()
        self.finish()
        if self._link.last_out is not None:
            self._device.wait_host(self._link.last_out)
            self._link.last_out = None
        for c in self.chunks:  # the host reads the first copy: bring kept early updates there
            for pc in c.pieces:
                pc.host.settle()

    # ------------------------------------------------------------------------------------------
    # the update

    def _wait_slot(self, event: Event) -> None:
        """The copy in waits until its slot is free: allocated (the step's start) or read out by
        the copy out of the chunk before in it (tests remove it: corrupted state)."""
        self._device.wait_event(self.h2d, event)

    def _wait_chunk(self, event: Event) -> None:
        """The stream that updates (compute, or the update stream when overlapped) waits for a
        chunk's copy in (tests remove it: a hazard)."""
        self._device.wait_event(self.update_stream or self._device.current_stream(), event)

    def step(self, hypers: Sequence[dict], scale: Optional[LossScale] = None,
             ahead: Optional[int] = None) -> None:
        """Update every parameter that has a gradient (inside ``HybridDeviceOptimizer.step``;
        the host is not blocked). On the compute stream, done when step() returns; overlapped:
        on ``update_stream``, chunks in forward order (the reverse of gradient arrival), still
        running when step() returns (see ``wait_params``, ``order_params``, ``finish``).
        Chunks updated during backward whose inputs did not change since (``backward``) are
        kept: only their new parameter values are copied in, first. ``scale``: the loss scale
        ``GradScaler`` handed to ``step()`` (each chunk's optimizer runs under it): early
        updates, which ran without it, are redone. A parameter the user changed since the part
        wrote it passes the change into its master before the update (``guards.merge_edited``,
        on the device).

        ``ahead``: queue only the first ``ahead`` chunks now, the rest at ``queue_rest`` (which
        the caller must call before anything else touches the part). The link works through
        the queued chunks while the caller queues the rest of its step: a chunk's kernels wait
        on the device for its copy in, and once about a thousand launches wait there, CUDA
        blocks the host in the next launch (``benchmarks/launch_queue_probe.py``), so queuing
        every chunk first would hold back the device part's update until the link is nearly
        done."""
        self._settle_rest()
        assert self._queuing is None, "queue_rest() was not called after step(ahead=...)"
        self.follow_params()
        for p in self.params:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise OffloadUsageError(
                    f"parameter {tuple(p.shape)} has a sparse gradient: offloaded parameters need "
                    "dense gradients (e.g. nn.Embedding(sparse=False))"
                )
        kept = []
        if self.backward is not None:
            self.backward.settle()  # every update queued in backward is on the device now
            kept = self.backward.validate(hypers, scale is not None)
        taken = {rec.chunk for rec in kept}
        live = []
        for ci, c in enumerate(self.chunks):
            pieces = [pc for pc in c.pieces if self.params[pc.index].grad is not None]
            if pieces and ci not in taken:  # the gradients as they are now (see _Live)
                live.append(_Live(c, pieces, self._runner.layout(pieces),
                                  [self.params[pc.index].grad for pc in pieces]))
        self.finish()  # overlapped: the last update is ordered before this one
        if not live and not kept:
            if self.backward is not None:  # updates started in backward, none kept: dropped
                self.backward.abandon()
            return
        # no host wait: the previous step's copies out are ordered before ``start`` (the compute
        # stream waited for them), and the host reads no state here
        dev = self._device
        compute = dev.current_stream()
        ustream = self.update_stream or compute
        if self.overlapped:
            live.reverse()  # forward order: the next forward's first modules wait least
            kept.reverse()
        slot_bytes = max([lc.layout.total for lc in live] or [0])
        slots = [dev.alloc_device(max(slot_bytes, 1), self.params[0].device)
                 for _ in range(min(SLOTS, len(live)))]
        self.staging_bytes = sum(s.numel() for s in slots)
        start = dev.record_event(compute)
        if self.overlapped:  # gradients final (clipped), parameters read by backward
            dev.wait_event(ustream, start)
        q = self._queuing = _Queuing(live, hypers, scale, slots, start, compute, ustream)
        try:
            if kept:
                for pos, (rec, done) in enumerate(zip(kept, self.backward.commit(kept, ustream))):
                    if self.overlapped:
                        for index, landed in rec.seen:
                            q.marks[index] = ChunkMark(pos, done, landed.grad.tensor)
            q.first_position = len(kept)
        except BaseException:
            self._fail(q)
            raise
        self._queue(q, ahead)

    def queue_rest(self, defer: bool = False) -> None:
        """Queue the chunks ``step(ahead=...)`` left (nothing if none). ``defer``: hand them to
        the part's launcher (overlapped parts without updates in backward; see the module
        docstring) and return; every other entry point waits for it first, and an error it
        raised is raised there."""
        self._settle_rest()  # after a deferred rest (an error in step() after it): done there
        q = self._queuing
        if q is None:
            return
        if not defer or self._rest_launcher is None:
            self._queue(q, None)
            return
        self._rest_pending = True
        self._rest_launcher.submit(lambda: self._queue(q, None), q.compute)

    def _settle_rest(self) -> None:
        """Wait until the launcher has queued what ``queue_rest(defer=True)`` handed it (its
        error, if it had one, is raised here). A launcher drops the work queued behind a
        failed one (another part's rest, say): this part's rest is then queued here, so that
        no part stays half queued."""
        if self._rest_pending:
            self._rest_pending = False
            try:
                self._rest_launcher.join()
            finally:
                if self._queuing is not None:
                    self._queue(self._queuing, None)

    def _queue(self, q: "_Queuing", limit: Optional[int]) -> None:
        """Queue ``q``'s chunks from the first not queued, at most ``limit`` of them; once all
        are, close the update (``_close``)."""
        try:
            while q.queued < len(q.live) and (limit is None or q.queued < limit):
                self._queue_chunk(q, q.queued)
                q.queued += 1
        except BaseException:
            self._fail(q)
            raise
        if q.queued == len(q.live):
            self._close(q)

    def _queue_chunk(self, q: "_Queuing", i: int) -> None:
        """Chunk ``i`` of ``q``: its copy in, its update, its copies out."""
        dev, run = self._device, self._runner
        lc = q.live[i]
        chunk, pieces, layout = lc.chunk, lc.pieces, lc.layout
        slot = q.slots[i % SLOTS]
        self._wait_slot(q.start if i < SLOTS else q.outs[i - SLOTS])
        copies, views = run.stage_in(pieces, layout, slot)
        self._link.copy_in(copies)
        self._wait_chunk(dev.record_event(self.h2d))
        hypers, scale = q.hypers, q.scale
        grads = lc.grads
        if self.overlapped:
            dev.run_on(q.ustream, lambda: run.update(chunk, pieces, views, slot[:layout.total], hypers,
                                                     grads, scale=scale),
                       reads=grads + [slot],
                       writes=[pc.written(self.params[pc.index]) for pc in pieces])
            done = dev.record_event(q.ustream)
            for pc, grad in zip(pieces, grads):
                q.marks[pc.index] = ChunkMark(q.first_position + i, done, grad)
        else:
            run.update(chunk, pieces, views, slot[:layout.total], hypers, grads, scale=scale)
            done = dev.record_event(q.compute)
        dev.wait_event(self.d2h, done)
        copies = []  # the chunk's copies out: queued together
        fresh = False  # the class created state on the device (a parameter's first step)
        try:
            for pc, v in zip(pieces, views):
                if v.master is not None:
                    copies.append((pc.host.current.master, v.master))
                    self._link.bytes_out += v.master.numel()
                fresh |= run.state_out(chunk, pc, q.keep, copies, v)
        finally:  # pieces before a failed one keep their update, on the host too
            self._link.copy_out(copies)
        q.outs.append(dev.record_event(self.d2h))
        if fresh:  # state the class just created: freed chunk by chunk, not at the end
            self._free_after_copy_out(q.outs[-1], q.keep, q.ustream)

    def _fail(self, q: "_Queuing") -> None:
        """A chunk failed: the chunks before keep their update (as on the CPU path); unbind
        every chunk's slot views and order everything queued before the slots and state can be
        freed."""
        self._queuing = None
        dev, run = self._device, self._runner
        for lc in q.live:
            for pc in lc.pieces:
                lc.chunk.optimizer.state.pop(pc.key, None)
                if run.lowp[pc.index]:
                    pc.key.set_()
        if self.overlapped:
            dev.wait_event(q.compute, dev.record_event(q.ustream))
        early, grads = self.backward.release() if self.backward is not None else ([], [])
        if self.backward is not None:
            dev.wait_event(q.compute, dev.record_event(self.backward.side))
        dev.wait_event(q.compute, dev.record_event(self.h2d))
        dev.wait_event(q.compute, dev.record_event(self.d2h))
        self._link.mark_out()
        for t in early + grads:
            dev.will_free(t)

    def _close(self, q: "_Queuing") -> None:
        """Every chunk of ``q`` is queued: overlapped, leave it running (``QueuedUpdate``);
        else the compute stream waits for its copies out and the staging is freed."""
        self._queuing = None
        dev = self._device
        early, grads = self.backward.release() if self.backward is not None else ([], [])
        last = self._link.mark_out()  # every copy out, early ones included
        if self.backward is not None:
            self.backward.prepare([pc for lc in q.live for pc in lc.pieces])
        if self.overlapped:  # freed once the compute stream waited for them (finish)
            held = q.slots + q.keep + early + self._runner.read_on_device(q.hypers)
            self._queued = QueuedUpdate(dev.record_event(q.ustream), q.marks, held, grads)
            return
        dev.wait_event(q.compute, last)  # slots and new state may be freed; next step ordered
        if self.backward is not None:
            dev.wait_event(q.compute, dev.record_event(self.backward.side))
        for t in q.slots + q.keep + early + grads:
            dev.will_free(t)

    def _free_after_copy_out(self, copied: Event, keep: list[torch.Tensor], stream: Any) -> None:
        """Drop the device tensors in ``keep`` once the copy out recorded by ``copied`` has read
        them: ``stream`` (the one that updates, where they were allocated) waits for it first.
        Only after a first step's chunk, so that its new state (8 B/param for AdamW) never adds
        up on the device beyond one chunk; it costs that step's overlap of the update with the
        copies out."""
        dev = self._device
        dev.wait_event(stream, copied)
        if stream is dev.current_stream():
            for t in keep:
                dev.will_free(t)
        else:
            dev.run_on(stream, lambda: [dev.will_free(t) for t in keep])
        keep.clear()

    def _state_home(self, chunk: Chunk) -> None:
        """Move the state ``chunk``'s optimizer holds on the device (made at construction, or
        loaded) into host memory, and wait for it there."""
        dev = self._device
        keep, copies = [], []
        dev.wait_event(self.d2h, dev.record_event(dev.current_stream()))
        try:
            for pc in chunk.pieces:
                self._runner.state_out(chunk, pc, keep, copies)
        finally:  # what was loaded before a failure reaches host memory
            self._link.copy_out(copies)
        dev.wait_host(dev.record_event(self.d2h))
        for t in keep:
            dev.will_free(t)

    # -- the part as one optimizer over ``keys`` (state_dict support) ---------------------------

    @property
    def param_groups(self) -> list[dict]:
        return part_param_groups(self.chunks, self.group_ids, self.group_of, self.keys)

    def state_keys(self) -> list[torch.Tensor]:
        """The tensors ``state`` is keyed by (``keys``)."""
        return self.keys

    def param_state(self, index: int) -> dict[str, Any]:
        """Optimizer state of parameter ``index`` as the wrapped class keeps it (host tensors;
        call ``sync()`` first)."""
        first = next(pc for pc in self._plan.pieces if pc.index == index).host
        if not first.streamed and not first.kept:
            return {}
        out = dict(first.kept)
        for name, host in first.streamed.items():
            full = self._store.full(index, name)
            out[name] = full if full is not None else host
        return StateEntry(out)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format over ``keys`` (grouped as ``param_groups``): each chunk's optimizer
        loads its entries (so they are cast as the wrapped class casts them), then the state
        moves into pinned host memory."""
        self.sync()
        shapes = [p.shape for p in self.params]
        for c, chunk_state in chunk_state_dicts(self.chunks, self.group_ids, self.group_of,
                                                state_dict, shapes):
            for pc in c.pieces:
                pc.host.forget_state()
                if self._runner.lowp[pc.index]:  # shape and device for load's casts
                    pc.key.set_(torch.empty(pc.shape(self.params[pc.index]), dtype=pc.key.dtype,
                                            device=pc.key.device))
            c.optimizer.load_state_dict(chunk_state)
            self._state_home(c)


def _own_defaults(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``opt`` with copies of the tensors among its defaults (the caller's keyword arguments)."""
    opt.defaults = {k: snapshot(v) for k, v in opt.defaults.items()}
    return opt


def _fence(device: OffloadDevice) -> None:
    """The part's end: wait for every queued copy before its pinned buffers go (a failing
    wait, at shutdown say, lets them go: nothing is left to wait for then)."""
    try:
        device.synchronize()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass
