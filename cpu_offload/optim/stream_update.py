"""The streamed part of ``HybridDeviceOptimizer``: optimizer state in pinned CPU memory, the
update on the device, the state streamed through a bounded device staging area.

For the parameters of a ``StreamedPart`` the master weights (fp32 for bf16/fp16 parameters; an
fp32 or fp64 parameter is its own master and stays on the device) and the wrapped optimizer's
per-parameter state (``exp_avg``, ``exp_avg_sq``, ``step``...) live in pinned host memory. Inside
``step()`` the parameters are updated chunk by chunk (about ``budget_bytes / 2`` of staging each):

1. the chunk's masters and state are copied host -> device on a side stream (``h2d``) into one
   of two device slots;
2. the compute stream waits for that copy, converts the gradients to the master dtype in the
   slot, runs the device optimizer class (``gpu_optimizer_cls``, fused AdamW by default) over the
   slot views, and writes the new masters into the parameters (cast to their dtype);
3. masters and state are copied back device -> host on another side stream (``d2h``).

Two slots: the copy in of chunk ``i + 1`` overlaps the update of chunk ``i`` and the copy out of
chunk ``i - 1``; a slot is refilled only after the copy out of the chunk before has read it.
Device memory for it is allocated at the start of the update (compute stream) and dropped at
its end, after the compute stream has waited for the last copy out, so the next step's copies
in are ordered after this step's copies out, and outside ``step()`` the part holds no device
memory.

Overlapped (``overlap="next_forward"``): step 2 runs on a stream of the part's own
(``update_stream``, ``OffloadDevice.run_on``), which first waits for the compute stream (the
gradients are final, clipped; backward has read the parameters), and the chunks go in forward
order (the reverse of gradient arrival), so the first modules' chunks are done first.
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
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..core.device import Event, OffloadDevice
from ..core.errors import OffloadUsageError
from ..core.launcher import Launcher
from .amp import LossScale, run_step
from .cpu_update import (
    ALIGN_ELEMS, ELEMENTWISE, KeyedState, chunk_param_groups, chunk_state_dicts, master_dtype,
    part_param_groups, plan_chunks, sync_hyperparameters,
)
from .stream_backward import SLOT_ALIGN, SLOTS, SMALL_STATE_BYTES, BackwardUpdates, slot_aligned
from .transfer import flat_bytes, pack_pinned

DEFAULT_STREAM_BUDGET_BYTES = 256 * 2**20  # device staging of the streamed part (both slots)
MIN_STREAM_BUDGET_BYTES = 64 * 2**10  # two slots of at least 1024 elements each


def state_elems_per_param(make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> tuple[int, bool]:
    """How many per-element state tensors the optimizer class keeps (2 for Adam), found by one
    step on a CPU dummy parameter, and whether the class updates elements independently (its
    parameters may be split into chunks). Falls back to 2 if the dummy step fails."""
    x = torch.zeros(8, requires_grad=True)
    try:
        opt = make_optimizer([{"params": [x]}])
        elementwise = type(opt) in ELEMENTWISE
        x.grad = torch.zeros_like(x)
        opt.step()
        st = opt.state.get(x, {})
        return sum(1 for v in st.values() if torch.is_tensor(v) and v.shape == x.shape), elementwise
    except Exception:  # noqa: BLE001 - an estimate only (sizes the chunks)
        return 2, False


@dataclass
class _Piece:
    index: int  # parameter index in the part
    start: int
    stop: int
    key: torch.Tensor  # what the chunk's optimizer updates (a slot view set per step, or the param)
    split: bool
    streamed: dict = field(default_factory=dict)  # state name -> pinned host tensor (this piece)
    previous: dict = field(default_factory=dict)  # before load_state_dict: reused if they fit
    kept: dict = field(default_factory=dict)  # state entries that stay where they are
    # what the copies move, made once (``flat_bytes`` costs a few host calls, and a step makes
    # two copies per state tensor of every piece): the master's bytes, and each streamed
    # state's (kept in step with ``streamed``)
    master_bytes: Optional[torch.Tensor] = None
    streamed_bytes: dict = field(default_factory=dict)
    # updates started in backward (``stream_backward``) write the other host copy of both
    # (``spare_master``, ``spare``), and keep the new parameter values on the device until
    # ``step()``, which swaps the two copies (``flipped``) when it keeps such an update
    spare_master: Optional[torch.Tensor] = None
    spare: dict = field(default_factory=dict)
    spare_previous: dict = field(default_factory=dict)  # before load_state_dict: reused if they fit
    prepared: bool = False  # given its spares once (updated in step() before)
    param_bytes: Optional[torch.Tensor] = None  # the bytes of the parameter the new values go to
    flipped: bool = False

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class _Chunk:
    pieces: list[_Piece]
    optimizer: torch.optim.Optimizer
    group_ids: list[int]


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
    ) -> None:
        self._device = device
        # overlapped (``overlap="next_forward"``): the update runs on its own stream and step()
        # returns before it is done; each module's next forward waits for its own chunks
        self.overlapped = overlapped
        self.update_stream = device.new_stream() if overlapped else None
        self._ready: dict[int, tuple[int, Event]] = {}  # param -> (chunk position, its update done)
        self._held_grads: dict[int, torch.Tensor] = {}  # gradients the queued update still reads
        self._held: list[torch.Tensor] = []  # slots and device state queued work still uses
        self._early_grads: list[torch.Tensor] = []  # gradients read by the kept early updates
        self._updated: Optional[Event] = None  # the end of the last overlapped update
        self.params = list(params)
        self.group_of = list(group_ids)
        self.group_ids = list(dict.fromkeys(group_ids))
        self.budget_bytes = budget_bytes
        self.h2d = device.new_stream()
        self.d2h = device.new_stream()
        self._last: Optional[Event] = None  # the last copy out into host memory
        # pinned host memory for masters and per-element state, allocated here in large blocks
        # (torch's pinned allocator rounds every allocation up to a power of two)
        sizes = []
        for p in self.params:
            n = p.numel() * master_dtype(p.dtype).itemsize
            sizes += [n] * ((master_dtype(p.dtype) != p.dtype) + state_elems)
        bufs = iter(pack_pinned(device, sizes))
        self.masters: list[Optional[torch.Tensor]] = []
        self._reserved: list[list[torch.Tensor]] = []  # per param: host buffers for its state
        for p in self.params:
            md = master_dtype(p.dtype)
            self.masters.append(None if md == p.dtype else next(bufs).view(md).view(p.shape))
            self._reserved.append([next(bufs) for _ in range(state_elems)])
        lowp = [p.numel() * p.element_size() for p, m in zip(self.params, self.masters) if m is not None]
        self._io = device.alloc_host(min(IO_BYTES, max(lowp))) if lowp else None
        self.read_params()
        self.keys = [m if m is not None else p for p, m in zip(self.params, self.masters)]
        self._state_elems = state_elems
        slot = budget_bytes // SLOTS - (2 + state_elems) * SLOT_ALIGN
        per_elem = max([self._bytes_per_elem(i) for i in range(len(self.params))] or [1])
        chunk_elems = max(1, slot // max(1, per_elem))
        self.chunk_elems = chunk_elems // ALIGN_ELEMS * ALIGN_ELEMS or chunk_elems
        plan = plan_chunks([p.numel() for p in self.params], self.chunk_elems, elementwise)
        self.chunks = [self._build(c, hypers, make_optimizer) for c in self._regroup(plan, slot)]
        pieces = sum(len(c.pieces) for c in self.chunks)  # small state (AdamW's step): 2 each
        pool = device.alloc_host(pieces * 2 * SMALL_STATE_BYTES) if pieces else None
        self._small = [pool[k: k + SMALL_STATE_BYTES]
                       for k in range(0, pieces * 2 * SMALL_STATE_BYTES, SMALL_STATE_BYTES)]
        self.staging_bytes = 0  # device bytes of the slots in the last update
        self.bytes_in = 0
        self.bytes_out = 0
        self._full: dict[tuple[int, str], torch.Tensor] = {}  # (param, name) -> pinned host state
        self.state = KeyedState(self.state_keys, self.param_state)
        # updates started during backward (``early``: backward-update modes without clipping
        # inside step()), kept by step() when still valid
        self.backward: Optional[BackwardUpdates] = None
        if early:
            self.backward = BackwardUpdates(self, launcher or device.host_launcher(self.params[0].device))
        # the copies go through the driver (``OffloadDevice.copy_many``), which does not tell
        # torch's pinned allocator: at the part's end its pinned buffers go only after them
        weakref.finalize(self, _fence, device).atexit = False

    def _bytes_per_elem(self, i: int) -> int:
        p = self.params[i]
        lowp = self.masters[i] is not None
        return (8 if lowp else 0) + self._state_elems * master_dtype(p.dtype).itemsize

    def _regroup(self, plan: list[list[tuple[int, int, int]]], slot: int) -> list[list[tuple[int, int, int]]]:
        """Cut ``plan``'s chunks further so that each fits a slot with its regions aligned
        (many small parameters: alignment adds up)."""
        regions = 2 + self._state_elems
        out = []
        for chunk in plan:
            current, filled = [], 0
            for i, start, stop in chunk:
                need = (stop - start) * self._bytes_per_elem(i) + regions * SLOT_ALIGN
                if current and filled + need > slot:
                    out.append(current)
                    current, filled = [], 0
                current.append((i, start, stop))
                filled += need
            if current:
                out.append(current)
        return out

    def _build(self, pieces: Sequence[tuple[int, int, int]], hypers: Sequence[dict],
               make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> _Chunk:
        made = []
        for i, start, stop in pieces:
            p = self.params[i]
            split = (start, stop) != (0, p.numel())
            master_bytes = None
            if self.masters[i] is not None:  # a slot view, set for each update
                key = torch.empty(0, dtype=self.masters[i].dtype, device=p.device)
                master_bytes = flat_bytes(self.masters[i].view(-1)[start:stop])
            else:
                key = p.detach().view(-1)[start:stop] if split else p.detach()
            made.append(_Piece(i, start, stop, key, split, master_bytes=master_bytes))
        gids, groups = chunk_param_groups(made, self.group_of, hypers)
        return _Chunk(made, make_optimizer(groups), gids)

    # ------------------------------------------------------------------------------------------
    # host <-> device outside the update

    def _lowp(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p, m) for p, m in zip(self.params, self.masters) if m is not None]

    def _io_slices(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(parameter bytes, master elements, pinned buffer) slices of at most ``IO_BYTES`` of
        model dtype, through one pinned buffer allocated at construction."""
        for p, m in self._lowp():
            step = max(1, IO_BYTES // p.element_size())
            flat, mflat = flat_bytes(p), m.view(-1)
            for start in range(0, p.numel(), step):
                n = min(step, p.numel() - start)
                raw = self._io[: n * p.element_size()]
                yield flat[start * p.element_size(): (start + n) * p.element_size()], \
                    mflat[start: start + n], raw, raw.view(p.dtype)

    def read_params(self) -> None:
        """Masters from the current parameter values (construction, ``reload_master_weights``)."""
        dev = self._device
        self.sync()
        dev.wait_event(self.d2h, dev.record_event(dev.current_stream()))
        for pbytes, mpiece, raw, typed in self._io_slices():
            dev.copy(self.d2h, raw, pbytes)
            dev.wait_host(dev.record_event(self.d2h))
            mpiece.copy_(typed)

    def write_params(self) -> None:
        """Parameters from the masters (after ``load_state_dict``)."""
        dev = self._device
        dev.wait_event(self.h2d, dev.record_event(dev.current_stream()))
        for pbytes, mpiece, raw, typed in self._io_slices():
            dev.wait_host(dev.record_event(self.h2d))  # the previous slice has left the buffer
            typed.copy_(mpiece)
            dev.copy(self.h2d, pbytes, raw)
        dev.wait_event(dev.current_stream(), dev.record_event(self.h2d))
        dev.wait_host(dev.record_event(self.h2d))

    def wait_params(self, indices: Sequence[int]) -> None:
        """(Overlapped, a module's forward pre-hook.) The compute stream waits, device side, for
        the chunks of the last update that write parameters ``indices``, no other; the
        gradients those chunks read are released then. The forward that waits for the last
        chunk also waits for its copy out, and frees the staging (``finish``), so that it is not
        held through the rest of the forward and backward."""
        marks = [self._ready.pop(i) for i in indices if i in self._ready]
        if not marks:
            return
        self._wait_forward(max(marks, key=lambda m: m[0])[1])
        dev = self._device
        for i in indices:
            dev.will_read(self.params[i])
            grad = self._held_grads.pop(i, None)
            if grad is not None:
                dev.will_free(grad)
        if not self._ready:  # the last chunk's forward: free the staging (after its copy out)
            self.finish()

    def _wait_forward(self, event: Event) -> None:
        """The compute stream waits for a chunk's update before a forward reads its parameters
        (tests remove it: a hazard)."""
        self._device.wait_event(self._device.current_stream(), event)

    def order_params(self) -> None:
        """(Overlapped.) The compute stream waits, device side, for the whole last update:
        parameters written, gradients read (``wait_params``, the next backward, in-place
        ``zero_grad``). The host is not blocked."""
        if self._updated is None:
            return
        dev = self._device
        dev.wait_event(dev.current_stream(), self._updated)
        self._ready.clear()
        for grad in list(self._held_grads.values()) + self._early_grads:
            dev.will_free(grad)
        self._held_grads.clear()
        self._early_grads = []

    def finish(self) -> None:
        """(Overlapped.) ``order_params``, and the compute stream waits for the last copy out,
        so that the staging and device state the update used can be freed (dropped here). The
        host is not blocked."""
        if self._updated is None:
            return
        self.order_params()
        dev = self._device
        if self._last is not None:
            dev.wait_event(dev.current_stream(), self._last)
        for t in self._held:
            dev.will_free(t)
        self._held = []
        self._updated = None

    def sync(self) -> None:
        """Block until the last update's copies into host memory have landed (before the host
        reads masters or state: ``state_dict``, ``load_state_dict``); device work that reads
        or writes the parameters after this is ordered after the update. Updates queued in
        backward are queued on the device first (``BackwardUpdates.settle``)."""
        if getattr(self, "backward", None) is not None:
            self.backward.settle()
        self.finish()
        if self._last is not None:
            self._device.wait_host(self._last)
            self._last = None
        for c in getattr(self, "chunks", ()):  # the host reads the first copy: bring kept early updates there
            for pc in c.pieces:
                if pc.flipped:
                    if pc.spare_master is not None:
                        pc.spare_master.copy_(pc.master_bytes)
                    for name, flat in pc.streamed_bytes.items():
                        pc.spare[name].copy_(flat)
                    _flip(pc)

    # ------------------------------------------------------------------------------------------
    # the update

    def _layout(self, pieces: list[_Piece]) -> tuple[list[tuple], int]:
        """Per piece: (master offset | None, grad offset | None, {name: offset}) in a slot (a
        low-precision parameter's master and fp32 gradient, and the streamed state); total
        bytes."""
        out, offset = [], 0
        for pc in pieces:
            m_off = g_off = None
            p = self.params[pc.index]
            if self.masters[pc.index] is not None:
                n = slot_aligned(pc.numel * master_dtype(p.dtype).itemsize)
                m_off, g_off, offset = offset, offset + n, offset + 2 * n
            names = {}
            for name, host in pc.streamed.items():
                names[name] = offset
                offset += slot_aligned(host.numel() * host.element_size())
            out.append((m_off, g_off, names))
        return out, offset

    def _wait_slot(self, event: Event) -> None:
        """The copy in waits until its slot is free: allocated (the step's start) or read out by
        the copy out of the chunk before in it (tests remove it: corrupted state)."""
        self._device.wait_event(self.h2d, event)

    def _wait_chunk(self, event: Event) -> None:
        """The stream that updates (compute, or the update stream when overlapped) waits for a
        chunk's copy in (tests remove it: a hazard)."""
        self._device.wait_event(self.update_stream or self._device.current_stream(), event)

    def step(self, hypers: Sequence[dict], scale: Optional[LossScale] = None) -> None:
        """Update every parameter that has a gradient (inside ``HybridDeviceOptimizer.step``;
        the host is not blocked). On the compute stream, done when step() returns; overlapped:
        on ``update_stream``, chunks in forward order (the reverse of gradient arrival), still
        running when step() returns (see ``wait_params``, ``order_params``, ``finish``).
        Chunks updated during backward whose inputs did not change since (``backward``) are
        kept: only their new parameter values are copied in, first. ``scale``: the loss scale
        ``GradScaler`` handed to ``step()`` (each chunk's optimizer runs under it,
        ``amp.run_step``)."""
        for p in self.params:
            if p.grad is not None and p.grad.layout != torch.strided:
                raise OffloadUsageError(
                    f"parameter {tuple(p.shape)} has a sparse gradient: offloaded parameters need "
                    "dense gradients (e.g. nn.Embedding(sparse=False))"
                )
        kept = []
        if self.backward is not None:
            self.backward.settle()  # every update queued in backward is on the device now
            kept = self.backward.validate(hypers)
        taken = {rec.chunk for rec in kept}
        live = []
        for ci, c in enumerate(self.chunks):
            pieces = [pc for pc in c.pieces if self.params[pc.index].grad is not None]
            if pieces and ci not in taken:
                live.append((c, pieces, *self._layout(pieces)))
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
        slot_bytes = max([total for *_, total in live] or [0])
        slots = [dev.alloc_device(max(slot_bytes, 1), self.params[0].device)
                 for _ in range(min(SLOTS, len(live)))]
        self.staging_bytes = sum(s.numel() for s in slots)
        start = dev.record_event(compute)
        if self.overlapped:  # gradients final (clipped), parameters read by backward
            dev.wait_event(ustream, start)
        outs: list[Event] = []
        keep: list[torch.Tensor] = []  # device state the optimizer created, read by copies out
        fresh = False  # this chunk's class created state on the device (a parameter's first step)
        try:
            if kept:
                self._commit(kept, ustream)
            for i, (chunk, pieces, layout, total) in enumerate(live):
                slot = slots[i % SLOTS]
                self._wait_slot(start if i < SLOTS else outs[i - SLOTS])
                copies, views = self._stage_in(pieces, layout, slot)
                dev.copy_many(self.h2d, copies)
                self._wait_chunk(dev.record_event(self.h2d))
                if self.overlapped:
                    grads = [self.params[pc.index].grad for pc in pieces]
                    dev.run_on(ustream, lambda: self._chunk_update(chunk, pieces, views, slot[:total], hypers,
                                                                  scale=scale),
                               reads=grads + [slot], writes=[self._written(pc) for pc in pieces])
                    done = dev.record_event(ustream)
                    for pc, grad in zip(pieces, grads):
                        self._ready[pc.index] = (len(kept) + i, done)
                        self._held_grads[pc.index] = grad
                else:
                    self._chunk_update(chunk, pieces, views, slot[:total], hypers, scale=scale)
                    done = dev.record_event(compute)
                dev.wait_event(self.d2h, done)
                copies = []  # the chunk's copies out: queued together
                try:
                    for pc, (m, _, _, _) in zip(pieces, views):
                        if m is not None:
                            copies.append((pc.master_bytes, m))
                            self.bytes_out += m.numel()
                        fresh |= self._state_out(chunk, pc, keep, copies)
                finally:  # pieces before a failed one keep their update, on the host too
                    dev.copy_many(self.d2h, copies)
                outs.append(dev.record_event(self.d2h))
                if fresh:  # state the class just created: freed chunk by chunk, not at the end
                    self._free_after_copy_out(outs[-1], keep, ustream)
                    fresh = False
        except BaseException:
            # the chunks before keep their update (as on the CPU path); unbind this one's slot
            # views and order everything queued before the slots and state can be freed
            for c, pieces, *_ in live:
                for pc in pieces:
                    c.optimizer.state.pop(pc.key, None)
                    if self.masters[pc.index] is not None:
                        pc.key.set_()
            if self.overlapped:
                dev.wait_event(compute, dev.record_event(ustream))
                self._ready.clear()
                self._held_grads.clear()
            early, grads = self.backward.release() if self.backward is not None else ([], [])
            if self.backward is not None:
                dev.wait_event(compute, dev.record_event(self.backward.side))
            dev.wait_event(compute, dev.record_event(self.h2d))
            dev.wait_event(compute, dev.record_event(self.d2h))
            self._last = dev.record_event(self.d2h)
            for t in early + grads:
                dev.will_free(t)
            raise
        early, grads = self.backward.release() if self.backward is not None else ([], [])
        self._last = dev.record_event(self.d2h)  # every copy out, early ones included
        if self.backward is not None:
            self.backward.prepare([pc for _, pieces, *_ in live for pc in pieces])
        if self.overlapped:  # freed once the compute stream waited for them (finish)
            self._updated = dev.record_event(ustream)
            self._held = slots + keep + early
            self._early_grads = grads  # dropped once the compute stream waited (order_params)
            return
        dev.wait_event(compute, self._last)  # slots and new state may be freed; next step ordered
        if self.backward is not None:
            dev.wait_event(compute, dev.record_event(self.backward.side))
        for t in slots + keep + early + grads:
            dev.will_free(t)

    def _stage_in(self, pieces: list[_Piece], layout: list[tuple], slot: torch.Tensor,
                  pending: Optional[list[torch.Tensor]] = None) -> tuple[list, list]:
        """A chunk's views (per piece: master, fp32 gradient, new values, {state name: view};
        ``None`` where there is no region) and the ``(slot, host)`` byte pairs of its copies in:
        the current host copy of masters and state. An update started in backward also gets
        ``pending``, per piece its parameter's bytes on the device: a low-precision parameter's
        new values go there, and an fp32/fp64 parameter (its own master, not updated in place
        then) is staged there from the parameter by the update itself."""
        copies, views = [], []
        for k, (pc, (m_off, g_off, names)) in enumerate(zip(pieces, layout)):
            p = self.params[pc.index]
            m = g = new = None
            if m_off is not None:
                m = slot[m_off: m_off + pc.numel * master_dtype(p.dtype).itemsize]
                copies.append((m, pc.master_bytes))
                g = slot[g_off: g_off + m.numel()]
                if pending is not None:
                    new = pending[k]
            elif pending is not None:
                m = pending[k]
            st = {}
            for name, off in names.items():
                host, flat = pc.streamed[name], pc.streamed_bytes[name]
                raw = slot[off: off + flat.numel()]
                copies.append((raw, flat))
                st[name] = raw.view(host.dtype).view(host.shape)
            views.append((m, g, new, st))
        self.bytes_in += sum(dst.numel() for dst, _ in copies)
        return copies, views

    def _commit(self, kept: list, stream: Any) -> None:
        """Keep the updates started in backward of ``kept`` (``stream_backward._Early``, in the
        order the next forward needs them): their pieces' host copies swap roles, and their new
        parameter values, waiting on the device, are copied into the parameters on ``stream``,
        each chunk after its update."""
        dev = self._device
        for pos, rec in enumerate(kept):
            self.backward._wait_out(stream, rec.updated)
            dsts = []
            for pc in self.chunks[rec.chunk].pieces:
                _flip(pc)
                if pc.param_bytes is None:
                    pc.param_bytes = flat_bytes(self._written(pc))
                dsts.append(pc.param_bytes)
            dev.run_on(stream, lambda: self._copy_new(dsts, rec.new), reads=rec.new, writes=dsts)
            done = dev.record_event(stream)
            if self.overlapped:
                for index, grad, *_ in rec.seen:
                    self._ready[index] = (pos, done)
                    self._held_grads[index] = grad

    def _copy_new(self, dsts: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        """A kept chunk's new values into its parameters (on the stream current now)."""
        for t in new:
            self._device.will_read(t)
        copy_all(dsts, new)

    def _written(self, pc: _Piece) -> torch.Tensor:
        """The part of its parameter that piece ``pc``'s update writes."""
        p = self.params[pc.index].detach()
        return p.view(-1)[pc.start:pc.stop] if pc.split else p

    def _chunk_update(self, chunk: _Chunk, pieces: list[_Piece], views: list[tuple],
                      staged: torch.Tensor, hypers: Sequence[dict],
                      grads: Optional[list[torch.Tensor]] = None, *,
                      scale: Optional[LossScale] = None) -> None:
        """One chunk's update, on the stream current now (its copy in waited for); ``grads``:
        an update started in backward, from these gradients (see ``_update``)."""
        self._device.will_read(staged)
        sync_hyperparameters(chunk.optimizer, chunk.group_ids, hypers)
        self._update(chunk, pieces, views, grads, scale)
        for pc in pieces:  # copies out read flat storage: made contiguous on this stream
            st = chunk.optimizer.state.get(pc.key, {})
            for name, v in st.items():
                if torch.is_tensor(v) and not v.is_contiguous():
                    st[name] = v.contiguous()

    def _update(self, chunk: _Chunk, pieces: list[_Piece], views: list[tuple],
                grads: Optional[list[torch.Tensor]] = None, scale: Optional[LossScale] = None) -> None:
        """Step ``chunk``'s optimizer over its slot views ``views`` (per piece: master, fp32
        gradient, new values, {state name: view}) from the parameters' ``.grad``, and write the
        new parameter values into the parameters. With ``grads`` (per piece: its parameter's
        gradient), an update started in backward: from those, and the new values go into the
        device buffer that holds them until ``step()`` (new values of a low-precision
        parameter; an fp32/fp64 parameter is its own master, staged there from the parameter
        first and stepped in place)."""
        opt = chunk.optimizer
        early = grads is not None
        try:
            dsts, srcs = [], []  # gradients into the slot, converted to the master dtype
            for k, (pc, (m, g, _, st)) in enumerate(zip(pieces, views)):
                p = self.params[pc.index]
                grad = (grads[k] if early else p.grad).detach()
                grad = grad.reshape(-1)[pc.start:pc.stop] if pc.split else grad
                if m is not None:
                    if g is None:  # early, own master: stepped in the slot, not in place
                        m.copy_(flat_bytes(self._written(pc)))
                    pc.key.set_(m.view(pc.key.dtype).view((pc.numel,) if pc.split else p.shape))
                if g is not None:
                    gm = g.view(pc.key.dtype).view(pc.key.shape)
                    dsts.append(gm)
                    srcs.append(grad.view(pc.key.shape))
                    pc.key.grad = gm
                else:
                    pc.key.grad = grad
                if pc.streamed or pc.kept:
                    opt.state[pc.key] = {**pc.kept, **st}
            copy_all(dsts, srcs)
            run_step(opt, scale)
            with torch.no_grad():
                dsts, srcs = [], []  # new values, cast to the parameters' dtype
                for pc, (_, g, new, _) in zip(pieces, views):
                    if g is None:  # own master: updated where it is
                        continue
                    p = self.params[pc.index]
                    shape = (pc.numel,) if pc.split else p.shape
                    dsts.append(new.view(p.dtype).view(shape) if early else self._written(pc))
                    srcs.append(pc.key.view(shape))
                copy_all(dsts, srcs)
        finally:
            for pc in pieces:
                pc.key.grad = None

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

    def _state_out(self, chunk: _Chunk, pc: _Piece, created: list[torch.Tensor],
                   copies: list) -> bool:
        """The copies of piece ``pc``'s state back into host memory, appended to ``copies`` as
        ``(host bytes, device bytes)`` (first time: the host memory is allocated); appends the
        device tensors the copies read to ``created`` (to keep until they are done); True if
        the class created state on the device (none was in host memory yet)."""
        dev = self._device
        st = chunk.optimizer.state.pop(pc.key, None) or {}
        fresh = False
        key_device = self.params[pc.index].device
        for name, v in st.items():
            if not (torch.is_tensor(v) and v.device == key_device and dev.is_device_tensor(v)):
                pc.kept[name] = v
                continue
            flat = pc.streamed_bytes.get(name)
            if flat is None:
                host = pc.streamed[name] = self._host_state(pc, name, v)
                flat = pc.streamed_bytes[name] = flat_bytes(host)
                fresh = True
            v = v.contiguous()
            created.append(v)
            copies.append((flat, flat_bytes(v)))
            self.bytes_out += flat.numel()
        if self.masters[pc.index] is not None:
            pc.key.set_()  # drop the slot view
        return fresh

    def _host_state(self, pc: _Piece, name: str, v: torch.Tensor) -> torch.Tensor:
        """Pinned host memory for state ``name`` of piece ``pc`` (a view of one tensor per
        parameter for per-element state)."""
        if v.shape == pc.key.shape:  # per-element state
            p = self.params[pc.index]
            full = self._full.get((pc.index, name))
            if full is None or full.dtype != v.dtype:
                nbytes = p.numel() * v.element_size()
                reserved = self._reserved[pc.index]
                raw = (reserved.pop(0) if reserved and reserved[0].numel() == nbytes
                       else self._device.alloc_host(nbytes))
                full = self._full[(pc.index, name)] = raw.view(v.dtype).view(p.shape)
            return full.view(-1)[pc.start:pc.stop].view(v.shape)
        prev = pc.previous.pop(name, None)
        if prev is not None and prev.dtype == v.dtype and prev.shape == v.shape:
            return prev
        nbytes = v.numel() * v.element_size()
        raw = (self._small.pop()[:nbytes] if self._small and nbytes <= SMALL_STATE_BYTES
               else self._device.alloc_host(nbytes))
        return raw.view(v.dtype).view(v.shape)

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
        pieces = [pc for c in self.chunks for pc in c.pieces if pc.index == index]
        first = pieces[0]
        if not first.streamed and not first.kept:
            return {}
        out = dict(first.kept)
        for name, host in first.streamed.items():
            out[name] = self._full.get((index, name), host)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format over ``keys`` (grouped as ``param_groups``): each chunk's optimizer
        loads its entries (so they are cast as the wrapped class casts them), then the state
        moves into pinned host memory."""
        self.sync()
        dev = self._device
        shapes = [p.shape for p in self.params]
        for c, chunk_state in chunk_state_dicts(self.chunks, self.group_ids, self.group_of,
                                                state_dict, shapes):
            for pc in c.pieces:
                pc.previous, pc.streamed, pc.kept = pc.streamed, {}, {}
                pc.streamed_bytes, pc.spare, pc.spare_previous = {}, {}, pc.spare
                if self.masters[pc.index] is not None:  # shape and device for load's casts
                    pc.key.set_(torch.empty((pc.numel,) if pc.split else self.params[pc.index].shape,
                                            dtype=pc.key.dtype, device=pc.key.device))
            c.optimizer.load_state_dict(chunk_state)
            keep, copies = [], []
            dev.wait_event(self.d2h, dev.record_event(dev.current_stream()))
            try:
                for pc in c.pieces:
                    self._state_out(c, pc, keep, copies)
            finally:  # what was loaded before a failure reaches host memory
                dev.copy_many(self.d2h, copies)
            dev.wait_host(dev.record_event(self.d2h))
            for t in keep:
                dev.will_free(t)


IO_BYTES = 16 * 2**20  # pinned buffer for reading/writing low-precision parameters (load, reload)


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, casting as ``copy_`` does, in one call (one kernel
    launch per dtype pair on CUDA instead of one per tensor: a chunk's update costs the host
    less)."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _fence(device: OffloadDevice) -> None:
    """The part's end: wait for every queued copy before its pinned buffers go (a failing
    wait, at shutdown say, lets them go: nothing is left to wait for then)."""
    try:
        device.synchronize()
    except Exception:  # noqa: BLE001 - a finalizer must not raise
        pass


def _flip(pc: _Piece) -> None:
    """Swap piece ``pc``'s two host copies of master and state (the spare becomes current)."""
    if pc.spare_master is not None:
        pc.master_bytes, pc.spare_master = pc.spare_master, pc.master_bytes
    for name in pc.spare:
        pc.streamed_bytes[name], pc.spare[name] = pc.spare[name], pc.streamed_bytes[name]
    pc.flipped = not pc.flipped
