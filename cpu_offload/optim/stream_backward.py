"""Updates of the streamed part started in backward, and kept by ``step()`` if still valid.

``StreamedPart`` (``stream_update``) updates its chunks from ``step()`` on: their link time
(12 B/param each way for bf16 AdamW) then sits between backward's end and the next forward's use
of those parameters. ``BackwardUpdates`` starts a chunk's update as soon as backward has made the
gradients of all its parameters final (post-accumulate-grad hooks), so that it overlaps the
rest of backward:

- the hook only notes the gradient; the chunk's update is queued by a ``launcher``
  (``OffloadDevice.host_launcher``: on CUDA a thread of its own, so that its host time, about
  1 ms per chunk, does not hold up backward's kernels). It takes the gradients as the hook saw
  them and orders its device work after the hook's stream's (the compute stream; FSDP2's
  reduce-scatter stream) with an event recorded when it runs, after its allocations and the
  bit sums of what it reads; ``step()`` waits for that event before comparing the sums. A
  chunk with an fp32/fp64 parameter (its own master, read from the parameter) is updated in
  the hook itself, after the queued ones: user code may change such a parameter once backward
  returns. ``step()`` waits for the launcher first.
- the chunk's masters and state are copied in (``h2d``) into one of the staging slots of its
  own, the device optimizer class steps over them on a side stream (``update_stream`` under
  ``next_forward``), and the new masters and state are copied out (``d2h``) into each piece's
  *spare* host copy. The new parameter values wait on the device, in a buffer of the chunk's
  own. The parameters and the current host copy are not touched: code that reads them before
  ``step()`` sees the last step's values, as with any torch optimizer.
- ``step()`` keeps an early update (``validate``) if every gradient it read is still ``.grad``
  and unchanged (``guards.Fingerprint``), no second gradient arrived for its parameters, the
  hyperparameters are the same, and no parameter changed since its hook (an edit made
  before it is taken into the master by the update itself, ``guards.merge_edited``). Then the
  pieces' two host copies swap roles and the new values are copied into the parameters,
  device to device (``commit``). Otherwise ``StreamedPart.step`` updates the chunk again from
  the current host copy, as without early updates.

So the result is bit for bit that of the update inside ``step()``. The costs: a second pinned
host copy of the streamed masters and state (12 B/param for bf16 AdamW, allocated with the
part), the staging slots from the first early update of a backward to the end of the update
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

import collections
from typing import Any, Optional, Sequence

import torch

from ..compat import set_versions
from ..core.device import Event
from ..core.launcher import Launcher
from .cpu_update import ELEMENTWISE, tensor_version
from .stream_chunk import ChunkRunner, PieceViews, copy_all
from .stream_plan import SLOTS, Chunk, ChunkPlan, Piece, slot_aligned
from .guards import Fingerprint, changed, same_hypers
from .stream_records import BackwardRound, EarlyMiss, EarlyPhase, EarlyUpdate, Landed
from .stream_store import HostCopy
from .transfer import flat_bytes


def _landed_miss(stale: bool, changed_flags: Sequence[bool]) -> Optional[EarlyMiss]:
    """Why work that read one ``Landed`` may not be kept (``Landed.checks``' order: gradient,
    parameter), or None."""
    if stale:
        return EarlyMiss.SECOND_GRADIENT
    grad_changed, param_changed = changed_flags
    return EarlyMiss.GRADIENT if grad_changed else EarlyMiss.PARAMETER if param_changed else None


class BackwardUpdates:
    """The early updates of one ``StreamedPart`` (see the module docstring): its ``plan``'s
    chunks, run by its ``runner`` on stream ``side``, queued by ``launcher``; the spare host
    copy (``spares``) is allocated here, with the part."""

    def __init__(self, runner: ChunkRunner, plan: ChunkPlan, side: Any, launcher: Launcher,
                 state_elems: int) -> None:
        self.runner = runner
        self.device = runner.device
        self.link = runner.link
        self.chunks = plan.chunks
        self.chunks_of = plan.chunks_of
        self.launcher = launcher
        self.side = side
        self.enabled = True  # off after a step whose gradients changed after backward
        self.started = self.kept = 0  # early updates of the last step, and how many it kept
        self.missed: collections.Counter = collections.Counter()  # ``EarlyMiss`` name -> chunks
        self.needed = [len(c.param_indices()) for c in self.chunks]  # gradients per chunk
        # the spare copy: pinned memory allocated with the part (later would stall a step)
        self.spares = HostCopy(self.device, runner.params, state_elems, runner.store.fp32_masters)
        self.spares.reserve_small(len(plan.pieces))
        self.round = BackwardRound.start(self.needed)

    # ------------------------------------------------------------------------------------------
    # backward

    def on_grad(self, index: int, grad: torch.Tensor, hypers: Sequence[dict]) -> None:
        """Parameter ``index``'s gradient is final (its post-accumulate-grad hook): start the
        update of every chunk whose parameters have all landed now."""
        r = self.round
        if index in r.landed:  # a second gradient before step(): early work on it is stale
            r.landed[index] = r.landed[index].made_stale()
            return
        param = self.runner.params[index]
        r.landed[index] = Landed.of(grad, param)
        for ci in self.chunks_of[index]:
            r.waiting[ci] -= 1
            if r.waiting[ci] == 0:
                if self.enabled and self._eligible(ci):
                    r.move(ci, EarlyPhase.QUEUED)
                    self._queue(ci, hypers)
                else:
                    r.move(ci, EarlyPhase.SKIPPED)
                    r.why[ci] = EarlyMiss.NOT_ELIGIBLE if self.enabled else EarlyMiss.OFF

    def _queue(self, ci: int, hypers: Sequence[dict]) -> None:
        """Hand chunk ``ci``'s update to the launcher, with what it reads as backward left it."""
        r, chunk = self.round, self.chunks[ci]
        grads = [r.landed[pc.index].grad.tensor for pc in chunk.pieces]
        seen = [(i, r.landed[i]) for i in chunk.param_indices()]
        if any(not self.runner.lowp[pc.index] for pc in chunk.pieces):
            self.launcher.join()  # its own master is the parameter: read it now, in order
            self._launch(ci, hypers, grads, seen)
            return
        self.launcher.submit(lambda: self._launch(ci, hypers, grads, seen),
                             self.device.current_stream())

    def _eligible(self, ci: int) -> bool:
        c, landed = self.chunks[ci], self.round.landed
        return type(c.optimizer) in ELEMENTWISE and all(
            pc.host.prepared and not pc.host.kept and not landed[pc.index].stale
            for pc in c.pieces)

    def _launch(self, ci: int, hypers: Sequence[dict], grads: list[torch.Tensor], seen: list) -> None:
        """Queue chunk ``ci``'s update (on the launcher, or in the hook), from ``grads`` (per
        piece) and ``seen`` (per parameter: index, ``Landed``) as the hook saw them."""
        r, run, link, dev = self.round, self.runner, self.link, self.device
        chunk = self.chunks[ci]
        pieces = chunk.pieces
        # what the update reads, fingerprinted where it is queued (the hook's stream, before
        # the event it waits for), not in the hooks: a change after this shows at ``validate``
        sums = Fingerprint.take_bits([fp for _, landed in seen for fp in landed.fingerprints()])
        stream = dev.current_stream()
        if sums is not None:
            dev.queued_write(stream, sums)
        first = not r.slots
        buffer, new = self._allocate(pieces)
        ready = self._ready()
        r.fingerprinted[id(stream)] = (stream, ready)  # the sums are done once it has passed
        if first:
            r.free = [ready] * SLOTS
            if link.last_out is not None:  # the last step's copies out wrote what is read here
                dev.wait_event(link.h2d, link.last_out)
        k = r.launched % SLOTS
        r.launched += 1
        slot = r.slots[k]
        layout = r.layouts[ci]
        dev.wait_event(link.h2d, r.free[k])  # the slot's last copy out has read it
        copies, views = run.stage_in(pieces, layout, slot, new)
        link.copy_in(copies)
        self._wait_in(self.side, dev.record_event(link.h2d))
        dev.wait_event(self.side, ready)
        own = [pc.written(run.params[pc.index]) for pc, v in zip(pieces, views) if v.grad is None]
        # an own master's key is an alias of its parameter: binding it to the slot and stepping
        # it there count as changes of the parameter, undone below (it did not change)
        versions = [tensor_version(t) for t in own]
        created: list[torch.Tensor] = []
        r.grads += grads
        try:
            dev.run_on(self.side, lambda: run.update(chunk, pieces, views, slot[:layout.total], hypers,
                                                     grads, early=True),
                       reads=grads + own + [slot], writes=new)
            copies = self._copies_out(chunk, views, created)
        finally:
            for pc in pieces:
                chunk.optimizer.state.pop(pc.key, None)
                p = run.params[pc.index]
                pc.key.set_() if run.lowp[pc.index] else pc.key.set_(pc.written(p))
            if own:
                set_versions(own, versions)
        r.held += created + [buffer] + run.read_on_device(hypers)
        if copies is None:  # the class changed its state's layout: step() updates the chunk
            r.move(ci, EarlyPhase.DROPPED)
            r.why[ci] = EarlyMiss.LAYOUT
            return
        updated = dev.record_event(self.side)
        dev.wait_event(link.d2h, updated)
        link.copy_out(copies)
        link.bytes_out += sum(dst.numel() for dst, _ in copies)
        r.free[k] = dev.record_event(link.d2h)
        r.done[ci] = EarlyUpdate(ci, seen, hypers, updated, new)
        r.move(ci, EarlyPhase.UPDATED)

    def _allocate(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The device memory of a chunk's update, from the pool of the stream current in its
        hook (the compute stream; FSDP2's reduce-scatter stream): at the first update of a
        backward the staging slots, and the chunk's new-values buffer (``_new_values``)."""
        r, run = self.round, self.runner
        if not r.slots:  # the layouts hold for the round: state appears only in step()
            r.layouts = [run.layout(c.pieces) for c in self.chunks]
            size = max(lay.total for lay in r.layouts)
            r.slots = [self.device.alloc_device(max(size, 1), run.params[0].device)
                       for _ in range(SLOTS)]
        return self._new_values(pieces)

    def _ready(self) -> Event:
        """An event on the hook's stream (``_allocate``), recorded after the allocations and the
        bit sums: the gradients are final and the parameters read (the hook came before), and
        the work queued before that may have used the memory just allocated is done once it
        has passed. The copies in and the update wait for it, and ``validate`` before reading
        the sums (tests record it before the allocations: a hazard)."""
        return self.device.record_event(self.device.current_stream())

    def _new_values(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A device buffer for the new values of a chunk's parameters, which wait there until
        ``step()`` keeps them (allocated as ``_allocate`` says), and its view per piece."""
        params = self.runner.params
        sizes = [pc.numel * params[pc.index].element_size() for pc in pieces]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + slot_aligned(n))
        buf = self.device.alloc_device(max(starts[-1], 1), params[0].device)
        return buf, [buf[a: a + n] for a, n in zip(starts, sizes)]

    def _wait_in(self, stream: Any, event: Event) -> None:
        """The update waits for its chunk's copy in (tests remove it: a hazard)."""
        self.device.wait_event(stream, event)

    def _wait_out(self, stream: Any, event: Event) -> None:
        """A kept update's new values are copied into the parameters after its update (tests
        remove it: a hazard)."""
        self.device.wait_event(stream, event)

    def _copies_out(self, chunk: Chunk, views: list[PieceViews], created: list) -> Optional[list]:
        """``(host, device)`` byte pairs of a chunk's early update: new state and masters into
        the spare copies; None if the state is not what the spares were made for."""
        copies = []
        for pc, v in zip(chunk.pieces, views):
            st = chunk.optimizer.state.get(pc.key) or {}
            spare = pc.host.spare
            if set(st) != set(spare.state) or not all(torch.is_tensor(t) for t in st.values()):
                return None
            if v.grad is not None:
                copies.append((spare.master, v.master))
            for name, t in st.items():
                created.append(t)
                copies.append((spare.state[name], v.state_bytes(name, t)))
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

    def validate(self, hypers: Sequence[dict], scaled: bool = False) -> list[EarlyUpdate]:
        """The early updates ``step()`` keeps (in chunk order): each gradient and parameter
        they read is unchanged (``guards.changed``: one host synchronization), the
        hyperparameters are the same, and no loss scale came (``scaled``: they ran without it).
        Decides whether the next backward starts any."""
        r, params = self.round, self.runner.params
        # The launches took their sums on the stream the hooks ran on, which need not be this
        # one, nor one this stream already waited for: FSDP2 runs the hooks on its
        # reduce-scatter stream, and the end of its backward waits only for what was queued
        # there before the hooks returned, not for a launch queued after (two GPUs over NCCL:
        # the sums were read unfinished, every update redone, and the next backward started none)
        compute = self.device.current_stream()
        for stream, event in r.fingerprinted.values():  # the last launch on each stream
            if stream != compute:
                self.device.wait_event(compute, event)
        order = sorted(r.landed)
        checks = [r.landed[i].checks(params[i]) for i in order]
        for fp, _ in (c for group in checks for c in group):
            if fp.bits is not None:
                self.device.will_read(fp.bits)
        flags = iter(changed([c for group in checks for c in group]))
        miss = {i: _landed_miss(r.landed[i].stale, [next(flags) for _ in group])
                for i, group in zip(order, checks)}
        kept = []
        for ci, rec in sorted(r.done.items()):
            assert all(fp.bits is not None for _, landed in rec.seen for fp in landed.fingerprints()), \
                "an early update kept no fingerprint of what it read"
            if scaled:
                why = EarlyMiss.LOSS_SCALE
            elif not same_hypers(rec.hypers, hypers):
                why = EarlyMiss.HYPERPARAMETERS
            else:
                why = next((miss[i] for i, _ in rec.seen if miss[i] is not None), None)
            r.move(ci, EarlyPhase.REDONE if why else EarlyPhase.KEPT)
            if why:
                r.why[ci] = why
            else:
                kept.append(rec)
        r.why.update((ci, EarlyMiss.NO_GRADIENT) for ci, phase in enumerate(r.phases)
                     if phase is EarlyPhase.WAITING)
        self.started, self.kept = len(r.done), len(kept)
        self.missed = collections.Counter(w.name.lower() for w in r.why.values())
        self.enabled = not any(miss.values()) and not scaled
        return kept

    def commit(self, kept: Sequence[EarlyUpdate], stream: Any) -> list[Event]:
        """Keep the updates ``kept`` (in the order the next forward needs them): their pieces'
        host copies trade places, and their new parameter values, waiting on the device, are
        copied into the parameters on ``stream``, each chunk after its update. Per update: the
        event its parameters are written by."""
        dev, params = self.device, self.runner.params
        done = []
        for rec in kept:
            self._wait_out(stream, rec.updated)
            dsts = []
            for pc in self.chunks[rec.chunk].pieces:
                pc.host.flip()
                if pc.target_bytes is None:
                    pc.target_bytes = flat_bytes(pc.written(params[pc.index]))
                dsts.append(pc.target_bytes)
            dev.run_on(stream, lambda: self._copy_new(dsts, rec.new), reads=rec.new, writes=dsts)
            done.append(dev.record_event(stream))
        return done

    def _copy_new(self, dsts: list[torch.Tensor], new: list[torch.Tensor]) -> None:
        """A kept chunk's new values into its parameters (on the stream current now)."""
        for t in new:
            self.device.will_read(t)
        copy_all(dsts, new)

    def release(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """End of the step: what the early work used, (device buffers: slots and state; the
        gradients it read), for the part to drop once the compute stream has waited for
        ``side`` and the copies; forget the rest."""
        r = self.round
        self.round = BackwardRound.start(self.needed)
        return r.slots + r.held, r.grads

    def abandon(self) -> None:
        """A backward that never reached ``step()`` (``zero_grad``, an error): drop its early
        updates, after the compute stream has waited for them. Updates not launched yet are
        dropped unlaunched (an error of one that ran is dropped with it: its work is)."""
        self.launcher.cancel()
        if self.round.idle:
            self.round = BackwardRound.start(self.needed)
            return
        dev, link = self.device, self.link
        compute = dev.current_stream()
        for stream in (self.side, link.h2d, link.d2h):
            dev.wait_event(compute, dev.record_event(stream))
        link.mark_out()  # ``sync`` waits for its copies into the spares
        buffers, grads = self.release()
        for t in buffers + grads:
            dev.will_free(t)

    def prepare(self, pieces: Sequence[Piece]) -> None:
        """After ``pieces`` were updated in ``step()`` (so their state exists): give them the
        spare copies they lack, from the memory reserved at construction (reused after
        ``load_state_dict``)."""
        for pc in pieces:
            host = pc.host
            if host.kept:
                continue
            host.prepared = True
            if self.runner.lowp[pc.index] and host.spare.master is None:
                host.spare.master = self.spares.master_bytes(pc.index, pc.start, pc.stop)
            for name, flat in host.current.state.items():
                if name not in host.spare.state:
                    host.spare.state[name] = self._spare_state(pc, name, flat.numel())

    def _spare_state(self, pc: Piece, name: str, nbytes: int) -> torch.Tensor:
        full = self.runner.store.full(pc.index, name)
        if full is not None:  # per-element state: a slice of one spare per parameter
            return self.spares.per_element_bytes(pc.index, name, full.dtype, pc.start, pc.stop)
        old = pc.host.spare_previous_of(name, nbytes)
        return old if old is not None else self.spares.small(nbytes)
