"""Updates of the streamed part started in backward, and kept by ``step()`` if still valid.

``StreamedPart`` (``stream_update``) updates its chunks from ``step()`` on: their link time
(12 B/param each way for bf16 AdamW) then sits between backward's end and the next forward's use
of those parameters. ``BackwardUpdates`` starts a chunk's update as soon as backward has made the
gradients of all its parameters final (post-accumulate-grad hooks), so that it overlaps the
rest of backward:

- the hook only notes the gradient; the chunk's update is queued by a ``launcher``
  (``OffloadDevice.host_launcher``: on CUDA a thread of its own, so that its host time, about
  1 ms per chunk, does not hold up backward's kernels). It takes the gradients as the hook saw
  them and orders its device work after the compute stream's with an event recorded when it
  runs, after its allocations. A chunk with an fp32/fp64 parameter (its own master, read from
  the parameter) is updated in the hook itself, after the queued ones: user code may change
  such a parameter once backward returns. ``step()`` waits for the launcher first.
- the chunk's masters and state are copied in (``h2d``) into one of two staging slots of its
  own, the device optimizer class steps over them on a side stream (``update_stream`` under
  ``next_forward``), and the new masters and state are copied out (``d2h``) into each piece's
  *spare* host copy. The new parameter values wait on the device, in a buffer of the chunk's
  own. The parameters and the current host copy are not touched: code that reads them before
  ``step()`` sees the last step's values, as with any torch optimizer.
- ``step()`` keeps an early update (``validate``) if every gradient it read is still ``.grad``
  and unchanged (``_version``), no second gradient arrived for its parameters, the
  hyperparameters are the same, and no fp32/fp64 parameter (its own master) was changed in
  place. Then the pieces' two host copies swap roles and the new values are copied into the
  parameters, device to device (``StreamedPart._commit``). Otherwise ``StreamedPart.step``
  updates the chunk again from the current host copy, as without early updates.

So the result is bit for bit that of the update inside ``step()``. The costs: a second pinned
host copy of the streamed masters and state (12 B/param for bf16 AdamW, allocated with the
part), two staging slots from the first early update of a backward to the end of the update
(``stream_budget_bytes``), and on the device the new values of the chunks updated early (the
parameters' size: 2 B/param for bf16), from their update to ``step()`` (``next_forward``: to
the next forward of their modules). They are alive with every gradient at the end of backward,
so the step's peak grows by about their size (``benchmarks/optim_benchmark.py`` reports the
peak). In exchange the link moves only what the update inside ``step()`` moves (12 B/param
each way), not the new values out and back as well. Only for
``Adam``, ``AdamW`` and ``SGD`` (``cpu_update.ELEMENTWISE``) with all their state on the device
(fused AdamW, the default). After a step that changed gradients (e.g. ``clip_grad_norm_``), the
next backward starts nothing early, as on the CPU path; early updates resume after a step whose
gradients stayed as backward left them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from ..compat import set_versions
from ..core.device import Event
from ..core.launcher import Launcher
from .cpu_update import ELEMENTWISE, master_dtype, same_hyperparameters, tensor_version
from .transfer import flat_bytes, pack_pinned

SLOTS = 2  # staging slots (of the streamed part, and of its early updates)
SMALL_STATE_BYTES = 64  # host bytes reserved per small (non per-element) state tensor
SLOT_ALIGN = 256  # bytes: every region of a device buffer starts aligned (vectorized kernels)


def slot_aligned(n: int) -> int:
    """``n`` bytes rounded up to ``SLOT_ALIGN``: where the next region of a slot (or of a
    chunk's new values) may start.

    Example::

        >>> from cpu_offload.optim.stream_backward import slot_aligned
        >>> slot_aligned(1), slot_aligned(256), slot_aligned(257)
        (256, 256, 512)
    """
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


@dataclass
class _Early:
    """One chunk's update started in backward."""

    chunk: int
    seen: list  # per parameter: (index, gradient, its version, parameter version | None)
    hypers: Sequence[dict]
    updated: Event  # its update is done (the new values are in ``new``)
    new: list  # per piece: its parameter's new bytes, on the device until ``step()``


class BackwardUpdates:
    """The early updates of one ``StreamedPart`` (see the module docstring)."""

    def __init__(self, part: Any, launcher: Launcher) -> None:  # a ``stream_update.StreamedPart``
        self.part = part
        self.launcher = launcher
        self.enabled = True  # off after a step whose gradients changed after backward
        self.side = part.update_stream or part._device.new_stream()
        self._chunks_of: dict[int, list[int]] = {}
        for ci, c in enumerate(part.chunks):
            for pc in c.pieces:
                chunks = self._chunks_of.setdefault(pc.index, [])
                if ci not in chunks:
                    chunks.append(ci)
        self._needed = [len({pc.index for pc in c.pieces}) for c in part.chunks]
        self.started = self.kept = 0  # early updates of the last step, and how many it kept
        self._reserve()
        self._reset()

    def _reset(self) -> None:
        self._landed: dict[int, Optional[tuple]] = {}  # param -> (grad, version, param version)
        self._waiting: Optional[list[int]] = None  # per chunk: parameters still to land
        self._done: dict[int, _Early] = {}
        self._slots: list[torch.Tensor] = []
        self._free: list[Event] = []  # per slot: its last copy out
        self._launched = 0
        self._held: list[torch.Tensor] = []  # device buffers queued early work uses
        self._grads: list[torch.Tensor] = []  # the gradients it reads

    # ------------------------------------------------------------------------------------------
    # backward

    def on_grad(self, index: int, grad: torch.Tensor, hypers: Sequence[dict]) -> None:
        """Parameter ``index``'s gradient is final (its post-accumulate-grad hook): start the
        update of every chunk whose parameters have all landed now."""
        part = self.part
        if self._waiting is None:
            self._waiting = list(self._needed)
        if index in self._landed:  # a second gradient before step(): early work on it is stale
            self._landed[index] = None
            return
        own = part.masters[index] is None
        self._landed[index] = (grad, tensor_version(grad),
                               tensor_version(part.params[index]) if own else None)
        for ci in self._chunks_of[index]:
            self._waiting[ci] -= 1
            if self._waiting[ci] == 0 and self.enabled and self._eligible(ci):
                self._queue(ci, hypers)

    def _queue(self, ci: int, hypers: Sequence[dict]) -> None:
        """Hand chunk ``ci``'s update to the launcher, with what it reads as backward left it."""
        part = self.part
        pieces = part.chunks[ci].pieces
        grads = [self._landed[pc.index][0] for pc in pieces]
        seen = [(i, *self._landed[i]) for i in dict.fromkeys(pc.index for pc in pieces)]
        if any(part.masters[pc.index] is None for pc in pieces):
            self.launcher.join()  # its own master is the parameter: read it now, in order
            self._launch(ci, hypers, grads, seen)
            return
        self.launcher.submit(lambda: self._launch(ci, hypers, grads, seen),
                             part._device.current_stream())

    def _eligible(self, ci: int) -> bool:
        c = self.part.chunks[ci]
        return type(c.optimizer) in ELEMENTWISE and all(
            pc.prepared and not pc.kept and self._landed.get(pc.index) is not None
            for pc in c.pieces)

    def _launch(self, ci: int, hypers: Sequence[dict], grads: list[torch.Tensor], seen: list) -> None:
        """Queue chunk ``ci``'s update (on the launcher, or in the hook), from ``grads`` (per
        piece) and ``seen`` (per parameter: index, gradient, versions) as the hook saw them."""
        part = self.part
        dev = part._device
        chunk = part.chunks[ci]
        pieces = chunk.pieces
        first = not self._slots
        buffer, new = self._allocate(pieces)
        ready = self._ready()
        if first:
            self._free = [ready] * SLOTS
            if part._last is not None:  # the last step's copies out wrote what is read here
                dev.wait_event(part.h2d, part._last)
        k = self._launched % SLOTS
        self._launched += 1
        slot = self._slots[k]
        layout, total = part._layout(pieces)
        dev.wait_event(part.h2d, self._free[k])  # the slot's last copy out has read it
        copies, views = part._stage_in(pieces, layout, slot, new)
        dev.copy_many(part.h2d, copies)
        self._wait_in(self.side, dev.record_event(part.h2d))
        dev.wait_event(self.side, ready)
        own = [part._written(pc) for pc, v in zip(pieces, views) if v[1] is None]
        # an own master's key is an alias of its parameter: binding it to the slot and stepping
        # it there count as changes of the parameter, undone below (it did not change)
        versions = [tensor_version(t) for t in own]
        created: list[torch.Tensor] = []
        self._grads += grads
        try:
            dev.run_on(self.side, lambda: part._chunk_update(chunk, pieces, views, slot[:total], hypers,
                                                             grads=grads),
                       reads=grads + own + [slot], writes=new)
            copies = self._copies_out(chunk, views, created)
        finally:
            for pc in pieces:
                chunk.optimizer.state.pop(pc.key, None)
                pc.key.set_() if part.masters[pc.index] is not None else pc.key.set_(part._written(pc))
            if own:
                set_versions(own, versions)
        self._held += created + [buffer]
        if copies is None:  # the class changed its state's layout: step() updates the chunk
            return
        updated = dev.record_event(self.side)
        dev.wait_event(part.d2h, updated)
        dev.copy_many(part.d2h, copies)
        part.bytes_out += sum(dst.numel() for dst, _ in copies)
        self._free[k] = dev.record_event(part.d2h)
        self._done[ci] = _Early(ci, seen, hypers, updated, new)

    def _allocate(self, pieces: Sequence[Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The device memory of a chunk's update, from the compute stream's pool: at the first
        update of a backward the two staging slots, and the chunk's new-values buffer
        (``_new_values``)."""
        part = self.part
        if not self._slots:
            size = max(part._layout(c.pieces)[1] for c in part.chunks)
            self._slots = [part._device.alloc_device(max(size, 1), part.params[0].device)
                           for _ in range(SLOTS)]
        return self._new_values(pieces)

    def _ready(self) -> Event:
        """An event on the compute stream, recorded after ``_allocate``: the gradients are final
        and the parameters read (the hook came before), and the compute work queued before
        that may have used the memory just allocated is done once it has passed. The copies in
        and the update wait for it (tests record it before the allocations: a hazard)."""
        dev = self.part._device
        return dev.record_event(dev.current_stream())

    def _new_values(self, pieces: Sequence[Any]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A device buffer for the new values of a chunk's parameters, which wait there until
        ``step()`` keeps them (allocated on the compute stream), and its view per piece."""
        part = self.part
        sizes = [pc.numel * part.params[pc.index].element_size() for pc in pieces]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + slot_aligned(n))
        buf = part._device.alloc_device(max(starts[-1], 1), part.params[0].device)
        return buf, [buf[a: a + n] for a, n in zip(starts, sizes)]

    def _wait_in(self, stream: Any, event: Event) -> None:
        """The update waits for its chunk's copy in (tests remove it: a hazard)."""
        self.part._device.wait_event(stream, event)

    def _wait_out(self, stream: Any, event: Event) -> None:
        """A kept update's new values are copied into the parameters after its update (tests
        remove it: a hazard)."""
        self.part._device.wait_event(stream, event)

    def _copies_out(self, chunk: Any, views: list[tuple], created: list) -> Optional[list]:
        """``(host, device)`` byte pairs of a chunk's early update: new state and masters into
        the spare copies; None if the state is not what the spares were made for."""
        copies = []
        for pc, (m, g, _, _) in zip(chunk.pieces, views):
            st = chunk.optimizer.state.get(pc.key) or {}
            if set(st) != set(pc.spare) or not all(torch.is_tensor(v) for v in st.values()):
                return None
            if g is not None:
                copies.append((pc.spare_master, m))
            for name, v in st.items():
                created.append(v)
                copies.append((pc.spare[name], flat_bytes(v)))
        return copies

    # ------------------------------------------------------------------------------------------
    # step

    def settle(self) -> None:
        """Wait until every queued update is queued on the device (``step()``, ``sync()``); if
        one failed, drop the early work (``abandon``) and raise its error."""
        try:
            self.launcher.join()
        except BaseException:
            self.abandon()
            raise

    def validate(self, hypers: Sequence[dict]) -> list[_Early]:
        """The early updates ``step()`` keeps (in chunk order); decides whether the next
        backward starts any."""
        params = self.part.params
        # per parameter: the gradient an early update read (``_landed``, also in its ``seen``)
        # is still ``.grad``, unchanged, and no second one came; an own master is unchanged
        ok = {i: v is not None and params[i].grad is v[0] and 0 <= v[1] == tensor_version(v[0])
              and (v[2] is None or v[2] == tensor_version(params[i]))
              for i, v in self._landed.items()}
        kept = [rec for _, rec in sorted(self._done.items())
                if same_hyperparameters(rec.hypers, hypers) and all(ok[i] for i, *_ in rec.seen)]
        self.started, self.kept = len(self._done), len(kept)
        self.enabled = all(ok.values())
        return kept

    def release(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """End of the step: what the early work used, (device buffers: slots and state; the
        gradients it read), for the part to drop once the compute stream has waited for
        ``side`` and the copies; forget the rest."""
        held = (self._slots + self._held, self._grads)
        self._reset()
        return held

    def abandon(self) -> None:
        """A backward that never reached ``step()`` (``zero_grad``, an error): drop its early
        updates, after the compute stream has waited for them. Updates not launched yet are
        dropped unlaunched (an error of one that ran is dropped with it: its work is)."""
        self.launcher.cancel()
        if not self._slots and not self._grads:
            self._reset()
            return
        part, dev = self.part, self.part._device
        compute = dev.current_stream()
        for stream in (self.side, part.h2d, part.d2h):
            dev.wait_event(compute, dev.record_event(stream))
        part._last = dev.record_event(part.d2h)  # ``sync`` waits for its copies into the spares
        buffers, grads = self.release()
        for t in buffers + grads:
            dev.will_free(t)

    def _reserve(self) -> None:
        """Pinned host memory for the spare copies, allocated with the part (allocating pinned
        memory later would stall a step): per parameter a spare master (low precision) and one
        spare per per-element state tensor; small state (AdamW's ``step``) from a pool."""
        part = self.part
        sizes = []
        for p, m in zip(part.params, part.masters):
            sizes += [p.numel() * master_dtype(p.dtype).itemsize] * ((m is not None) + part._state_elems)
        bufs = iter(pack_pinned(part._device, sizes))
        self._master_full, self._state_free = [], []
        for m in part.masters:
            self._master_full.append(next(bufs) if m is not None else None)
            self._state_free.append([next(bufs) for _ in range(part._state_elems)])
        self._state_full: dict[tuple[int, str], torch.Tensor] = {}
        pieces = sum(len(c.pieces) for c in part.chunks)
        pool = part._device.alloc_host(pieces * 2 * SMALL_STATE_BYTES) if pieces else None
        self._small = [pool[k: k + SMALL_STATE_BYTES] for k in range(0, pieces * 2 * SMALL_STATE_BYTES,
                                                                      SMALL_STATE_BYTES)]

    def prepare(self, pieces: Sequence[Any]) -> None:
        """After ``pieces`` were updated in ``step()`` (so their state exists): give them the
        spare copies they lack, from the memory reserved at construction (reused after
        ``load_state_dict``)."""
        part = self.part
        for pc in pieces:
            if pc.kept:
                continue
            pc.prepared = True
            if part.masters[pc.index] is not None and pc.spare_master is None:
                size = part.masters[pc.index].element_size()
                pc.spare_master = self._master_full[pc.index][pc.start * size: pc.stop * size]
            for name, flat in pc.streamed_bytes.items():
                if name not in pc.spare:
                    pc.spare[name] = self._spare_state(pc, name, flat.numel())

    def _spare_state(self, pc: Any, name: str, nbytes: int) -> torch.Tensor:
        part = self.part
        if (pc.index, name) in part._full:  # per-element state: a slice of one spare per parameter
            size = part._full[(pc.index, name)].element_size()
            full = self._state_full.get((pc.index, name))
            total = part.params[pc.index].numel() * size
            if full is None or full.numel() != total:
                free = self._state_free[pc.index]
                fits = [b for b in free if b.numel() == total]
                if fits:
                    free.remove(fits[0])
                full = self._state_full[(pc.index, name)] = (
                    fits[0] if fits else part._device.alloc_host(total))
            return full[pc.start * size: pc.stop * size]
        old = pc.spare_previous.pop(name, None)
        if old is not None and old.numel() == nbytes:
            return old
        if self._small and nbytes <= self._small[-1].numel():
            return self._small.pop()[:nbytes]
        return part._device.alloc_host(nbytes)
