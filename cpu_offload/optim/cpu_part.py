"""The CPU part of ``HybridDeviceOptimizer``: parameters whose master weights, optimizer state
and update live on the host.

Data moves in one direction per phase, as Megatron's ``hybrid_optimizer.py`` names it: gradients
device -> host as backward makes them final (``on_grad``), the update on the CPU worker
(``_run_update``), parameters host -> device once the update is known valid (``_send``). What
each bucket is doing is a ``cpu_step.Phase``; ``CpuStep`` holds one step's records.

Work started before ``step()`` is *early* and may turn out stale (``cpu_step`` says when);
``validate`` is the one place that decides, and stale buckets are undone and done again inside
``step()``. After a step whose gradients changed the next backward starts no early work (it only
fingerprints the gradients) until one step shows they stay untouched; after a step that brought
a loss scale or changed hyperparameters in place, early updates wait for ``step()`` (the copies
still start in backward).
"""
from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..core.device import Event, OffloadDevice
from ..core.errors import OffloadUsageError
from .amp import LossScale
from .cpu_step import BucketStep, CpuStep, GradCopy, Phase, UpdateJob
from .cpu_update import CpuBucket
from .guards import Fingerprint, changed, check_layout, map_tensors, merge_edited, same_hypers
from .overlap import OverlapMode
from .partition import next_update
from .transfer import TransferEngine
from .worker import CpuWorker, wait_all

__all__ = ["CpuPart"]


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _on_host(hypers: Sequence[dict]) -> list[dict]:
    """Tensor hyperparameters (also inside tuples: ``betas``) moved to the CPU, where the CPU
    class reads them."""
    return [{k: map_tensors(v, lambda t: t.to("cpu")) for k, v in g.items()} for g in hypers]


class CpuPart:
    """The CPU-updated parameters, in buckets (``CpuBucket``) of gradient-arrival order.

    ``engine`` moves the bytes, ``worker`` runs the updates, ``mode`` says which work starts in
    backward. ``max_grad_norm`` defers early updates until the global norm is known.
    """

    def __init__(self, device: OffloadDevice, engine: TransferEngine, worker: CpuWorker,
                 mode: OverlapMode, max_grad_norm: Optional[float], fp32_masters: bool = True) -> None:
        self.device = device
        self.engine = engine
        self.worker = worker
        self.mode = mode
        self.max_grad_norm = max_grad_norm
        self.fp32_masters = fp32_masters  # fp32 masters for bf16/fp16 parameters (cpu_update.master_dtype)
        self.buckets: list[CpuBucket] = []
        self.where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, position)
        self.layouts: dict[int, tuple[torch.Size, torch.dtype]] = {}  # id(param) -> as placed
        self.early_copies = True
        self.early_updates = True
        self._scratch = torch.empty(0, dtype=torch.float32)
        self.backward_step: Optional[CpuStep] = None  # the step record backward is filling
        self.inflight: Optional[CpuStep] = None  # a step whose updates outlive step()
        self._written: dict[int, Fingerprint] = {}  # id(param) -> what the optimizer wrote last
        self.stats: dict[str, Any] = {}

    # -- construction ---------------------------------------------------------------------

    def add_bucket(self, params: Sequence[torch.Tensor], group_ids: Sequence[int], hypers: Sequence[dict],
                   make_optimizer: Callable[[list[dict]], torch.optim.Optimizer], chunk_elems: int) -> None:
        """A new bucket over ``params`` (their current values become the masters)."""
        self.engine.add_bucket(params)
        self.engine.read_params(params)
        bucket = CpuBucket(params, group_ids, [self.engine.params.typed(p) for p in params],
                           _on_host(hypers), make_optimizer, chunk_elems, self.fp32_masters)
        for k, p in enumerate(params):
            self.where[id(p)] = (len(self.buckets), k)
            self.layouts[id(p)] = (p.shape, p.dtype)
        self._wrote(params)
        self.buckets.append(bucket)
        if bucket.scratch_elems > self._scratch.numel():
            self._scratch = torch.empty(bucket.scratch_elems, dtype=torch.float32)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for b in self.buckets for p in b.params]

    def check_layouts(self) -> None:
        """Every parameter has the shape and dtype it was placed with (``guards.check_layout``;
        new memory of the same layout, ``p.data = t``, is followed: the buckets read and write
        the parameter itself)."""
        for b in self.buckets:
            for p in b.params:
                check_layout(p, *self.layouts[id(p)])

    def owns(self, p: torch.Tensor) -> bool:
        return id(p) in self.where

    def master(self, p: torch.Tensor) -> torch.Tensor:
        b, k = self.where[id(p)]
        return self.buckets[b].masters[k]

    # -- backward: gradients to the host ---------------------------------------------------

    def _current(self) -> CpuStep:
        if self.backward_step is None:
            self.finish()
            self.backward_step = CpuStep([BucketStep(sum(1 for p in b.params if p.requires_grad))
                                  for b in self.buckets])
        return self.backward_step

    def on_grad(self, p: torch.Tensor, grad: torch.Tensor, hypers: Callable[[], list[dict]],
                reduced: bool = False) -> None:
        """Backward made ``p``'s gradient final: ``p.grad`` (or, ``reduced``, DDP's all-reduced
        slice, which DDP writes into ``p.grad`` at the end of backward). ``hypers()`` snapshots
        the hyperparameters, for an early update."""
        if grad.layout != torch.strided:
            raise OffloadUsageError(
                f"parameter {tuple(p.shape)} has a sparse gradient: offloaded parameters need "
                "dense gradients (e.g. nn.Embedding(sparse=False))")
        check_layout(p, *self.layouts[id(p)])
        st = self._current()
        b, k = self.where[id(p)]
        bs = st.buckets[b]
        with st.lock:
            if not self.early_copies:
                again = id(p) in st.watch
                st.watch[id(p)] = None if again or reduced else Fingerprint.of(grad)
                if reduced:
                    st.pending[id(p)] = not again
                return
            if k in bs.copies:  # a second backward reached p before step(): stale
                bs.copies[k].stale = True
                return
            if bs.phase is not Phase.IDLE and bs.phase is not Phase.COPYING:
                return  # landed already (a late hook after step() flushed): step() redoes it
            src = grad if grad.is_contiguous() and grad.dtype == p.dtype else grad.contiguous().to(p.dtype)
            self.engine.grad_out(p, src)
            bs.copies[k] = GradCopy(None if reduced else Fingerprint.of(grad),
                                    keep=src if src is not grad else None)
            if reduced:
                st.pending[id(p)] = True
            if bs.phase is Phase.IDLE:
                bs.move(Phase.COPYING)
            bs.remaining -= 1
            if bs.remaining:
                return
            self._land(bs)
            if not self.mode.updates_in_backward:
                return
            if self.max_grad_norm is not None:
                bs.norms = self.worker.submit(self._norms, b, st)
                return
            if not self.early_updates:
                return
            if st.early_hypers is None:
                st.early_hypers = hypers()
            self._queue(st, [b], st.early_hypers, None, None, early=True, locked=True)

    def record_reduced(self) -> None:
        """DDP's end of backward: ``.grad`` now holds the reduced gradients the hooks copied
        (DDP writes them from the buckets the copies read); fingerprint them, for ``step()``
        to see later changes."""
        st = self.backward_step
        if st is None:
            return
        with st.lock:
            for pid, seen in st.pending.items():
                b, k = self.where[pid]
                g = self._param(pid).grad
                rec = Fingerprint.of(g) if g is not None and seen else None
                copy = st.buckets[b].copies.get(k)
                if copy is not None and copy.fingerprint is None:
                    copy.fingerprint = rec
                if pid in st.watch:
                    st.watch[pid] = rec
            st.pending.clear()

    def ddp_record_needed(self) -> bool:
        """Whether the end-of-backward record still has to be queued for this step."""
        st = self._current()
        with st.lock:
            needed, st.ddp_record_queued = not st.ddp_record_queued, True
        return needed

    def _land(self, bs: BucketStep) -> None:
        bs.landed = self.engine.mark_landed()
        bs.move(Phase.LANDED)

    # -- step(): validate early work, then the rest ------------------------------------------

    def take_step(self) -> CpuStep:
        """The step record backward filled (a new one if backward copied nothing)."""
        st = self._current()
        self.backward_step = None
        return st

    def validate(self, st: CpuStep, hypers: list[dict], scale: Optional[LossScale]) -> int:
        """``step()``'s check of the early work (see ``cpu_step``): keeps what is valid, undoes
        and forgets what is stale, and takes parameters edited since the optimizer wrote them
        into their masters. One host synchronization. Returns the number of stale buckets."""
        params = self.params
        checks, owners = [], []
        for b, bs in enumerate(st.buckets):
            for k, copy in bs.copies.items():
                if copy.fingerprint is not None and not copy.stale:
                    checks.append((copy.fingerprint, self.buckets[b].params[k].grad))
                    owners.append(b)
        watched = [(pid, fp) for pid, fp in st.watch.items() if fp is not None]
        flags = changed(checks + [(fp, self._param(pid).grad) for pid, fp in watched]
                        + [(self._written[id(p)], p) for p in params])
        n, m = len(checks), len(checks) + len(watched)
        grads_changed = {b for b, f in zip(owners, flags[:n]) if f}
        watch_changed = any(flags[n:m]) or len(watched) < len(st.watch)
        edited = [p for p, f in zip(params, flags[m:]) if f]
        stale = grads_changed | {self.where[id(p)][0] for p in edited}
        for b, bs in enumerate(st.buckets):
            if any(c.stale or c.fingerprint is None for c in bs.copies.values()):
                stale.add(b)
            if bs.phase not in (Phase.IDLE, Phase.COPYING) and any(
                    p.grad is not None and k not in bs.copies for k, p in enumerate(self.buckets[b].params)):
                stale.add(b)  # a gradient appeared where none was copied
            if bs.job is not None and bs.job.early and (scale is not None or not same_hypers(bs.job.hypers, hypers)):
                stale.add(b)
        self.early_copies = not grads_changed and not watch_changed and not any(
            c.stale for bs in st.buckets for c in bs.copies.values())
        self.early_updates = self.early_copies and scale is None and not any(
            bs.job is not None and bs.job.early and not same_hypers(bs.job.hypers, hypers) for bs in st.buckets)
        with st.lock:
            st.validated = True
            self._take_back(st, stale)
            for b, bs in enumerate(st.buckets):
                bs.verdict = b not in stale
            for b, bs in enumerate(st.buckets):
                if bs.phase is Phase.UPDATED and b not in stale:
                    self._send(st, b)
        for b in sorted(stale):
            self._reset(st, b)
        self._merge(edited)
        return len(stale)

    def take_edits(self) -> None:
        """Outside a step (``state_dict``): parameters edited since the optimizer wrote them
        into their masters, so that the masters saved are what training continues from."""
        params = self.params
        self._merge([p for p, f in zip(params, changed([(self._written[id(p)], p) for p in params])) if f])

    def _merge(self, edited: Sequence[torch.Tensor]) -> None:
        for p in edited:
            merge_edited(self.master(p), p)
        self._wrote(edited)

    def _param(self, pid: int) -> torch.Tensor:
        b, k = self.where[pid]
        return self.buckets[b].params[k]

    def pre_state_read(self, p: torch.Tensor) -> None:
        """Before ``p``'s state is read outside ``step()`` (``opt.state[p]``): an update of its
        bucket that backward started is undone (``_reset``, after it ran; one not started yet
        never runs). The read then sees the last step's state, as a torch optimizer's, and no
        update writes that state meanwhile; ``step()`` copies and updates the bucket again (the
        same result, bit for bit; only that bucket's overlap is lost)."""
        st = self.backward_step
        if st is None:
            return
        b = self.where[id(p)][0]
        bs = st.buckets[b]
        if bs.job is None:
            return  # no update queued: the state is the last step's
        with st.lock:
            self._take_back(st, {b})  # if queued and not started
        self._reset(st, b)

    @staticmethod
    def _take_back(st: CpuStep, buckets: set) -> None:
        """Under ``st.lock``: the updates of ``buckets`` still queued (not started) leave the
        queue and never run (their waiters get ``None``); those buckets are idle again."""
        taken = [b for b in st.ready if b in buckets]
        st.ready = [b for b in st.ready if b not in buckets]
        for b in taken:
            bs = st.buckets[b]
            bs.job.future.set_result(None)
            bs.job = None
            bs.move(Phase.IDLE)

    def _reset(self, st: CpuStep, b: int) -> None:
        """Forget bucket ``b``'s early work: wait for its jobs, undo an early update, drop its
        copies (their temporaries stay alive until the step is fenced)."""
        bs = st.buckets[b]
        for job in (bs.norms, bs.job.future if bs.job is not None else None):
            if job is not None:
                try:
                    job.result()  # it reads the staging buffers the new copies write into
                except BaseException:  # noqa: BLE001 - stale work: its error no longer matters
                    pass
        with st.lock:
            if bs.phase is Phase.UPDATED:
                self.buckets[b].restore()
            if bs.phase is not Phase.IDLE or bs.copies:
                st.redone += 1
            keep = [c.keep for c in bs.copies.values() if c.keep is not None]
            grads = [c.fingerprint.tensor for c in bs.copies.values() if c.fingerprint is not None]
            if bs.landed is None and bs.copies:  # copies queued into a bucket that never closed
                bs.landed = self.engine.mark_landed()
            if bs.landed is not None:
                self.engine.fence_compute(bs.landed)  # the copies read those tensors
            del keep, grads
            st.buckets[b] = BucketStep(sum(1 for p in self.buckets[b].params if p.requires_grad))

    def flush(self, st: CpuStep) -> None:
        """Copy the gradients no hook copied (mode "none", gradients set by hand, stale buckets)
        and close every bucket."""
        for b, bs in enumerate(st.buckets):
            if bs.phase is not Phase.IDLE and bs.phase is not Phase.COPYING:
                continue
            for k, p in enumerate(self.buckets[b].params):
                if k not in bs.copies and p.grad is not None:
                    if p.grad.layout != torch.strided:
                        raise OffloadUsageError(
                            f"parameter {tuple(p.shape)} has a sparse gradient: offloaded "
                            "parameters need dense gradients (e.g. nn.Embedding(sparse=False))")
                    src = p.grad if p.grad.is_contiguous() and p.grad.dtype == p.dtype else \
                        p.grad.contiguous().to(p.dtype)
                    self.engine.grad_out(p, src)
                    bs.copies[k] = GradCopy(None, keep=src if src is not p.grad else None)
            self._land(bs)
            bs.verdict = True

    def norms(self, st: CpuStep, norm_type: float) -> dict[int, torch.Tensor]:
        """Per copied parameter (by id) the norm of its host gradient copy."""
        for b, bs in enumerate(st.buckets):
            if bs.norms is None:
                bs.norms = self.worker.submit(self._norms, b, st, norm_type)
        out: dict[int, torch.Tensor] = {}
        for part in wait_all([bs.norms for bs in st.buckets]):
            out.update(part)
        for bs in st.buckets:  # the device gradients are scaled next
            self.engine.fence_compute(bs.landed)
        return out

    def _norms(self, b: int, st: CpuStep, norm_type: float = 2.0) -> dict[int, torch.Tensor]:
        bs = st.buckets[b]
        self.engine.wait_landed(bs.landed)
        params = [p for k, p in enumerate(self.buckets[b].params) if k in bs.copies]
        grads = [self.engine.grads.typed(p) for p in params]
        return dict(zip(map(id, params), torch._foreach_norm(grads, norm_type) if grads else []))

    def queue_rest(self, st: CpuStep, hypers: list[dict], coef: Optional[torch.Tensor],
                   scale: Optional[LossScale]) -> None:
        """Queue the update of every bucket that has none (after ``flush``)."""
        todo = [b for b, bs in enumerate(st.buckets) if bs.phase is Phase.LANDED]
        self._queue(st, todo, hypers, coef, scale, early=False)

    def _queue(self, st: CpuStep, buckets: Sequence[int], hypers: list[dict], coef: Optional[torch.Tensor],
               scale: Optional[LossScale], early: bool, locked: bool = False) -> None:
        """Queue the updates of ``buckets``, all before any worker job may pick one; each job
        runs the queued bucket that matters most then (``partition.next_update``)."""
        if not buckets:
            return
        if locked:
            self._enqueue(st, buckets, hypers, coef, scale, early)
        else:
            with st.lock:
                self._enqueue(st, buckets, hypers, coef, scale, early)
        for _ in buckets:
            self.worker.submit(self._run_next, st)

    def _enqueue(self, st: CpuStep, buckets: Sequence[int], hypers: list[dict],
                 coef: Optional[torch.Tensor], scale: Optional[LossScale], early: bool) -> None:
        for b in buckets:
            bs = st.buckets[b]
            bs.job = UpdateJob(Future(), hypers, coef, scale, early)
            bs.move(Phase.QUEUED)
            st.ready.append(b)

    # -- the worker ---------------------------------------------------------------------------

    def _run_next(self, st: CpuStep) -> None:
        with st.lock:
            if not st.ready:
                return  # step() took its bucket back, or the step was abandoned
            i = next_update(st.ready, lambda b: self.device.event_done(st.buckets[b].landed))
            b = st.ready.pop(i)
            bs = st.buckets[b]
            bs.move(Phase.RUNNING)
            job = bs.job
            # queued in backward but starting after step() found it valid: nothing to keep
            speculative = job.early and bs.verdict is not True
        job.future.set_running_or_notify_cancel()
        try:
            job.future.set_result(self._run_update(st, b, job, speculative))
        except BaseException as exc:  # noqa: BLE001 - raised to whoever waits for the bucket
            job.future.set_exception(exc)

    def _run_update(self, st: CpuStep, b: int, job: UpdateJob, speculative: bool) -> Optional[Event]:
        """Update bucket ``b``; a ``speculative`` one (started before ``step()`` found the bucket
        valid) keeps a copy of what it changes (restorable) and stays on the host until then.
        Its copies stop at the first chunk after ``step()`` found the bucket valid: that update
        stands, and the copies cost about as much as the update itself. Returns the event of
        its parameters' copy in."""
        t0 = time.perf_counter()
        bs = st.buckets[b]
        self.engine.wait_landed(bs.landed)
        t1 = time.perf_counter()
        bucket = self.buckets[b]
        grads = [self.engine.grads.typed(p) if k in bs.copies else None for k, p in enumerate(bucket.params)]
        out = [self.engine.params.typed(p) for p in bucket.params]
        try:
            bucket.update(grads, out, self._scratch, _on_host(job.hypers), job.coef,
                          keep_previous=(lambda: bs.verdict is not True) if speculative else False,
                          scale=job.scale)
        except BaseException:
            if bucket.restorable:  # an early update that failed leaves no trace
                bucket.restore()
            with st.lock:
                bs.move(Phase.FAILED)
            raise
        t2 = time.perf_counter()
        with st.lock:
            st.cpu_update_s += t2 - t1
            st.jobs.append((t0, t1, t2))
            if speculative and bs.verdict is not True:
                bs.move(Phase.UPDATED)
                return None
            return self._send(st, b)

    def _send(self, st: CpuStep, b: int) -> Optional[Event]:
        """Commit bucket ``b``'s update and queue its new parameters to the device (under
        ``st.lock``); the optimizer remembers what it wrote, to see later edits."""
        bs = st.buckets[b]
        bucket = self.buckets[b]
        bucket.commit()
        params = [p for k, p in enumerate(bucket.params) if k in bs.copies]
        bs.sent = self.engine.params_in(params, bs.landed)
        bs.move(Phase.SENT)
        if bs.job is not None and bs.job.future.done():
            bs.job.future = _done(bs.sent)  # committed by step(): waiters get the event
        return bs.sent

    # -- after step(): wait, finish, abandon ---------------------------------------------------

    def wait(self, st: CpuStep, buckets: Iterable[int]) -> None:
        """The compute stream waits for the new parameters of ``buckets`` (host blocks until
        their updates ran); the first update error is raised after the others are fenced."""
        error = None
        for b in buckets:
            bs = st.buckets[b]
            if bs.phase is Phase.FENCED or bs.job is None:
                continue
            try:
                ev = bs.job.future.result()
            except BaseException as exc:  # noqa: BLE001 - raised after the others are fenced
                error = error or exc
                ev = None
            with st.lock:
                self.engine.fence_compute(ev if ev is not None else bs.sent)
                if bs.phase is Phase.SENT:  # what the compute stream sees now is ours
                    self._wrote([p for k, p in enumerate(self.buckets[b].params) if k in bs.copies])
                if bs.phase in (Phase.SENT, Phase.FAILED):
                    bs.move(Phase.FENCED)
        self._record_stats(st)
        if error is not None:
            raise error

    def wait_all(self, st: CpuStep) -> None:
        self.wait(st, range(len(st.buckets)))

    def release_grads(self, st: CpuStep) -> None:
        """After ``step()`` validated ``st`` and fenced its copies: forget the gradients its
        records hold (fingerprints, cast temporaries). Only which parameters were copied is
        still read; holding the tensors would keep every offloaded gradient on the device
        after ``zero_grad()``, through the next forward, until the updates in flight finish."""
        with st.lock:
            for bs in st.buckets:
                for c in bs.copies.values():
                    c.fingerprint, c.keep = None, None
            st.watch = dict.fromkeys(st.watch)

    def leave_inflight(self, st: CpuStep) -> None:
        """``next_forward``: the updates run on; modules wait for their buckets (``wait_for``)."""
        self.inflight = st

    def wait_for(self, buckets: Sequence[int]) -> None:
        st = self.inflight
        if st is None:
            return
        try:
            self.wait(st, buckets)
        except BaseException:
            self.inflight = None
            self.abandon(st)
            raise
        if all(bs.phase is Phase.FENCED or bs.job is None for bs in st.buckets):
            self.inflight = None

    def finish(self) -> None:
        """Wait for every update still in flight."""
        st, self.inflight = self.inflight, None
        if st is not None:
            try:
                self.wait_all(st)
            except BaseException:
                self.abandon(st)
                raise

    def abandon(self, st: Optional[CpuStep] = None) -> None:
        """After an error or a backward that never reached ``step()``: cancel queued updates,
        wait for running ones, undo uncommitted early updates, fence every queued copy,
        swallow job errors. Parameters and state are those of the last ``step()``."""
        if st is None:
            st, self.backward_step = self.backward_step, None
            if st is None:
                return
        with st.lock:
            if not st.validated:
                self._take_back(st, set(st.ready))
            for bs in st.buckets:
                bs.verdict = bs.verdict if st.validated else False
        for bs in st.buckets:
            for f in (bs.norms, bs.job.future if bs.job is not None else None):
                if f is None:
                    continue
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 - the caller is already raising (or abandoning)
                    pass
        with st.lock:
            for b, bs in enumerate(st.buckets):
                if bs.phase is Phase.UPDATED:
                    self.buckets[b].restore()
                    bs.move(Phase.IDLE)
                if bs.landed is None and bs.copies:
                    bs.landed = self.engine.mark_landed()
                self.engine.fence_compute(bs.landed)
                self.engine.fence_compute(bs.sent)

    def _record_stats(self, st: CpuStep) -> None:
        if st.step_called is None or any(
                bs.phase is not Phase.FENCED and bs.job is not None for bs in st.buckets):
            return
        before = sum(max(0.0, min(t2, st.step_called) - t1) for _, t1, t2 in st.jobs)
        total = st.cpu_update_s
        self.stats = {
            "cpu_update_s": total,
            "cpu_update_before_step_s": before,
            "overlapped_with_backward": before / total if total else 0.0,
            "redone_buckets": st.redone,
            "bytes_to_host": self.engine.bytes_out,
            "bytes_to_device": self.engine.bytes_in,
        }

    # -- outside a step ---------------------------------------------------------------------

    def reload(self) -> None:
        """Masters from the parameters as they are now (``reload_master_weights``)."""
        for bucket in self.buckets:
            self.engine.read_params(bucket.params)
            for p, m in zip(bucket.params, bucket.masters):
                m.copy_(self.engine.params.typed(p))
            self._wrote(bucket.params)

    def write_params(self) -> None:
        """Parameters from the masters (after ``load_state_dict``)."""
        for bucket in self.buckets:
            for p, m in zip(bucket.params, bucket.masters):
                self.engine.params.typed(p).copy_(m)
            self.engine.fence_compute(self.engine.params_in(bucket.params, self.engine.compute_event()))
            self._wrote(bucket.params)

    def _wrote(self, params: Sequence[torch.Tensor]) -> None:
        """Remember what ``params`` hold now (the optimizer wrote them, and the compute stream
        sees it): a later difference is a user's edit."""
        self._written.update((id(fp.tensor), fp) for fp in Fingerprint.of_all(params))

    def free_grads(self) -> None:
        """``zero_grad(set_to_none=True)`` is about to drop the gradients (simulation check)."""
        for p in self.params:
            if p.grad is not None and p.grad.layout == torch.strided:  # (sparse: never copied)
                self.device.will_free(p.grad)


def weak_call(obj: Any, name: str) -> Callable[..., None]:
    """A function calling ``obj.name(...)`` that holds ``obj`` weakly (hooks must not keep an
    optimizer alive: a dropped optimizer stops copying)."""
    ref = weakref.ref(obj)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            getattr(target, name)(*args)

    return call
