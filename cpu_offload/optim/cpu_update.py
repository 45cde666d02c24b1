"""One bucket of CPU-updated parameters: master weights, the wrapped optimizer, and the
update that reads gradients from staging and writes new parameter values back to it.

**Master dtype** (``master_dtype``): fp32 for low-precision parameters (bf16, fp16), the
parameter's own dtype otherwise (fp32, fp64): an fp64 parameter keeps fp64 masters and state,
as the wrapped class run on it directly would, so nothing is rounded away. With
``fp32_masters=False`` every parameter is its own master (state in its dtype).

Each bucket has its own instances of the CPU optimizer class, so a bucket can be updated as soon
as its gradients land. That is bit-identical to one optimizer over all parameters for optimizers
that update each parameter independently (SGD, Adam, AdamW, ...), which the wrapper requires.

**Chunks.** A bucket is updated chunk by chunk (``chunk_elems`` elements each, about the CPU's
cache): convert the chunk's gradients to the master dtype, step, write the chunk's new values
back, then the next chunk, so the fp32 gradient and the fresh master are still in cache when
they are read again (a whole-bucket pass reads both back from memory: about 1.4-1.9x the time
of the AdamW step itself). Each chunk has its own optimizer instance over its pieces of
parameters, so a step's Python work is per chunk, not per bucket. Whole parameters are grouped
into chunks for any optimizer class; a parameter larger than a chunk is split into pieces (flat
views of its master) only for the classes in ``ELEMENTWISE``, whose update of an element reads
nothing but that element's own state. Piece boundaries are multiples of ``ALIGN_ELEMS`` from the
parameter's start: CPU kernels run a vector loop with a scalar tail, and fused AdamW's tail
rounds differently, so a piece must put exactly the parameter's own tail elements (its last
``numel % vector width``) in its scalar tail -- then each element sees the same instructions as
in a whole-tensor step, and the result is bit-identical (tested against whole-tensor steps).
A split parameter's per-element state (``exp_avg``...) lives in one tensor of the parameter's
shape; each piece's optimizer state holds a view of it, so ``state`` shows per-parameter state
as the wrapped class would, without copies.

**Runs.** The masters of a bucket are views of one flat buffer laid out as the staging buffer
(the same gaps between parameters), and a chunk's fp32 gradients sit in the scratch as their
masters do. So the pieces of a chunk come in from the staging in one copy (``coalesce``; the
padding between parameters is converted along into the scratch, where nothing reads it) and go
out in one copy per stretch without padding (the staging's padding is not the update's to
write). A run holds at most one piece large enough to be split over the threads, so that the
copy splits it as the optimizer's kernel does and each thread converts the elements it then
updates. Each chunk makes one copy call: the previous chunk's new values out, its own gradients
in (each call gives up the GIL, which the training thread may then hold for a while). Only the
conversions change: bf16 -> fp32 is exact, and fp32 -> bf16 rounds to nearest even in any
implementation, so every bit is the wrapped class's.

**Early updates** (``update(keep_previous=...)``) first copy what a chunk's step changes, so that
the update can be undone: with fp32 AdamW that is 12 more bytes read and written per element,
about as much as the update itself (``benchmarks/cpu_update_bench.py``). A callable
``keep_previous`` lets the caller stop those copies as soon as it knows the update will stand.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch

from ..core.errors import OffloadUsageError
from .amp import LossScale, run_step

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # exact classes only
ALIGN_ELEMS = 1024  # piece boundaries (elements): a multiple of every CPU vector width


def master_dtype(dtype: torch.dtype, fp32_masters: bool = True) -> torch.dtype:
    """The dtype of the CPU master weights (and so of the optimizer state) of a parameter of
    ``dtype``: ``torch.float32`` for floating dtypes narrower than fp32 (bf16, fp16), else
    ``dtype`` itself, so fp32 and fp64 parameters are updated in their own precision (exactly
    as the wrapped optimizer class run on them directly). ``fp32_masters=False``
    (``OptimizerOffloadOptions.fp32_masters``): every parameter is its own master, and its
    state has its dtype, as the wrapped class keeps it on the parameter itself.

    Example::

        >>> import torch
        >>> from cpu_offload.optim.cpu_update import master_dtype
        >>> master_dtype(torch.bfloat16), master_dtype(torch.float64)
        (torch.float32, torch.float64)
        >>> master_dtype(torch.bfloat16, fp32_masters=False)
        torch.bfloat16
    """
    if fp32_masters and dtype.is_floating_point and dtype.itemsize < 4:
        return torch.float32
    return dtype


def sync_hyperparameters(opt: torch.optim.Optimizer, group_ids: Sequence[int], hypers: Sequence[dict]) -> None:
    """Copy the wrapper's hyperparameters (lr, betas, ...) into ``opt``'s groups; implementation
    choices (fused, foreach, ...) stay what ``opt`` was built with."""
    for group, gi in zip(opt.param_groups, group_ids):
        for k, v in hypers[gi].items():
            if k != "params" and k not in IMPLEMENTATION_KEYS:
                group[k] = v


def same_hyperparameters(a: Sequence[dict], b: Sequence[dict]) -> bool:
    """Hyperparameters ``a`` and ``b`` (lists of group entries) are the same (tensors by
    identity, other values by equality)."""
    def same(x: Any, y: Any) -> bool:
        if x is y:
            return True
        if torch.is_tensor(x) or torch.is_tensor(y):
            return False
        try:
            return bool(x == y)
        except Exception:  # noqa: BLE001 - incomparable values count as changed
            return False

    return len(a) == len(b) and all(
        ga.keys() == gb.keys() and all(same(ga[k], gb[k]) for k in ga) for ga, gb in zip(a, b))


def tensor_version(t: torch.Tensor) -> int:
    """``t._version`` (bumped by every in-place change, through any alias but ``.data``); -1
    where there is none (inference tensors): such a tensor never counts as unchanged."""
    try:
        return t._version
    except RuntimeError:
        return -1


def plan_chunks(numels: Sequence[int], chunk_elems: int, split: bool) -> list[list[tuple[int, int, int]]]:
    """Chunks of about ``chunk_elems`` elements, as lists of ``(param index, start, stop)``
    pieces, in parameter order. ``chunk_elems <= 0``: one chunk of whole parameters. Without
    ``split`` a parameter is never cut (one larger than a chunk gets a chunk of its own); with
    it, pieces start at multiples of ``ALIGN_ELEMS`` and a parameter's last piece ends at its end.
    """
    whole = [[(i, 0, n) for i, n in enumerate(numels)]]
    if chunk_elems <= 0:
        return whole
    size = max(ALIGN_ELEMS, -(-chunk_elems // ALIGN_ELEMS) * ALIGN_ELEMS)
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    filled = 0
    for i, n in enumerate(numels):
        if not split:
            if current and filled + n > size:
                chunks.append(current)
                current, filled = [], 0
            current.append((i, 0, n))
            filled += n
            continue
        start = 0
        while start < n:
            room = size - filled
            take = n - start if n - start <= room else room // ALIGN_ELEMS * ALIGN_ELEMS
            if take == 0:
                chunks.append(current)
                current, filled = [], 0
                continue
            current.append((i, start, start + take))
            filled += take
            start += take
    if current:
        chunks.append(current)
    return chunks


MAX_GAP_ELEMS = 64  # padding between a staging buffer's slices (``transfer.ALIGN`` bytes) a run spans
LARGE_ELEMS = 2**15  # torch's grain: smaller copies run on one thread (see ``coalesce``)


def flat_offsets(initial: Sequence[torch.Tensor]) -> list[int]:
    """Element offsets for the masters of a bucket in one flat buffer: as the ``initial`` values
    lie in memory where they are slices, in order, of one host buffer (the staging buffer, whose
    gradient and parameter slices are laid out alike), so that a run of pieces moves between
    staging and masters in one copy; else packed one after the other."""
    packed, total = [], 0
    for t in initial:
        packed.append(total)
        total += t.numel()
    if not initial or any(t.device.type != "cpu" or t.dtype != initial[0].dtype or not t.is_contiguous()
                          for t in initial):
        return packed
    try:
        base = initial[0].untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() != base for t in initial):
            return packed
    except (RuntimeError, NotImplementedError):  # tensors without storage (fakes, ...)
        return packed
    size, first = initial[0].element_size(), initial[0].data_ptr()
    offsets, end = [], None
    for t in initial:
        delta, rest = divmod(t.data_ptr() - first, size)
        if rest or (end is not None and not end <= delta <= end + MAX_GAP_ELEMS):
            return packed
        offsets.append(delta)
        end = delta + t.numel()
    return offsets


def _elem_delta(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    """Elements from ``a``'s start to ``b``'s, where both view one storage with one dtype."""
    if a.dtype != b.dtype or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    delta, rest = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    return None if rest else delta


def coalesce(pairs: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]],
             max_gap: int = MAX_GAP_ELEMS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies ``(dst, src)`` (consecutive pieces of a chunk; ``None`` breaks a run) as few
    copies: consecutive flat contiguous pairs merge where both sides go on in their buffer at the
    same element offset from the run's start. The gaps between them (at most ``max_gap``
    elements: the staging buffer's padding between parameters, mirrored in the masters and the
    scratch) are copied along, so ``dst``'s gaps must be free to overwrite (the scratch's are;
    the update writes into the staging with ``max_gap=0``). A run holds at most one piece of
    ``LARGE_ELEMS`` or more: a copy splits its range evenly over the threads as the optimizer's
    kernel splits each piece, so that each thread converts the elements it then updates (in its
    own cache)."""
    runs: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: Optional[list] = None  # [dst, src, elements, holds a large piece]
    for pair in pairs:
        flat = pair is not None and all(t.dim() == 1 and t.is_contiguous() for t in pair)
        if flat and run is not None:
            dst, src = pair
            large = dst.numel() >= LARGE_ELEMS
            delta = _elem_delta(run[0], dst)
            if (delta is not None and delta == _elem_delta(run[1], src)
                    and run[2] <= delta <= run[2] + max_gap and not (large and run[3])):
                run[2], run[3] = delta + dst.numel(), run[3] or large
                continue
        if run is not None:
            runs.append(_extended(run))
            run = None
        if flat:
            run = [pair[0], pair[1], pair[0].numel(), pair[0].numel() >= LARGE_ELEMS]
        elif pair is not None:
            runs.append(pair)  # not flat: a copy of its own
    if run is not None:
        runs.append(_extended(run))
    return runs


def _extended(run: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A run's copy: its first pair's views, extended over its elements."""
    dst, src, n, _ = run
    return (dst, src) if n == dst.numel() else (dst.as_strided((n,), (1,)), src.as_strided((n,), (1,)))


@dataclass
class _Piece:
    index: int  # the parameter's position in the bucket
    start: int  # flat element range of the parameter
    stop: int
    key: torch.Tensor  # what the chunk's optimizer updates: the master, or a flat view of it
    split: bool
    offset: int  # element offset of the piece in its chunk's scratch layout


@dataclass
class _Chunk:
    pieces: list[_Piece]
    optimizer: torch.optim.Optimizer
    group_ids: list[int]  # wrapper group of each optimizer group
    bound: bool = False  # every split piece's per-element state is a view of its parameter's (_bind)


@dataclass
class _Plan:
    """One chunk's update over the current buffers (built once, reused while they come back)."""

    live: list[_Piece]  # the pieces with a gradient
    grads: list[torch.Tensor]  # theirs, in the master dtype (a scratch view, or the source itself)
    convert_dst: list[torch.Tensor]  # runs of scratch <- runs of staging: gradients to the master dtype
    convert_src: list[torch.Tensor]
    scale: list[torch.Tensor]  # what a clip coefficient multiplies: the gradients, as runs
    write_dst: list[torch.Tensor]  # runs of output <- runs of masters: the new values out
    write_src: list[torch.Tensor]


class CpuBucket:
    """Master weights and optimizers for the CPU parameters of one bucket.

    ``params`` are the model's (device) parameters, ``group_ids`` their wrapper param-group
    indices. Masters are CPU tensors of ``master_dtype(param.dtype, fp32_masters)``: fp32 for
    bf16/fp16 parameters (unless ``fp32_masters=False``), a copy in the parameter's dtype
    otherwise. Masters of one dtype are
    views of one flat buffer, laid out as ``initial`` is where that is one buffer's slices (the
    staging buffer), so that a chunk's gradients come in and its new values go out in one copy
    each (see ``flat_offsets``, ``coalesce``).
    ``chunk_elems``: elements per chunk (see the module docstring); ``0``: one optimizer step
    over the whole bucket.

    For the hybrid optimizer's ``state_dict`` the bucket looks like one optimizer over
    ``masters``: ``param_groups`` (one per wrapper group), ``state`` (per master) and
    ``load_state_dict`` in torch's format.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group_ids: Sequence[int],
        initial: Sequence[torch.Tensor],
        hypers: Sequence[dict],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        chunk_elems: int = 0,
        fp32_masters: bool = True,
    ) -> None:
        self.params = list(params)
        dtypes = {master_dtype(p.dtype, fp32_masters) for p in self.params}
        if len(dtypes) == 1:
            self._offsets: Optional[list[int]] = flat_offsets(initial)
            flat = torch.zeros(max((o + p.numel() for o, p in zip(self._offsets, params)), default=0),
                               dtype=dtypes.pop())  # zeros: the gaps (copied along) are defined
            self.masters = [flat[o: o + p.numel()].view(p.shape).copy_(v)
                            for o, p, v in zip(self._offsets, params, initial)]
        else:
            self._offsets = None
            self.masters = [torch.empty(p.shape, dtype=master_dtype(p.dtype, fp32_masters)).copy_(v)
                            for p, v in zip(params, initial)]
        self.group_of = list(group_ids)
        self.group_ids = list(dict.fromkeys(group_ids))  # wrapper groups, in optimizer-group order
        self._make_optimizer = make_optimizer
        first = self._build([(i, 0, m.numel()) for i, m in enumerate(self.masters)], hypers)
        split = type(first.optimizer) in ELEMENTWISE
        plan = plan_chunks([m.numel() for m in self.masters], chunk_elems, split)
        self.chunks = [first] if len(plan) == 1 else [self._build(c, hypers) for c in plan]
        self.scratch_elems = max((pc.offset + pc.stop - pc.start for c in self.chunks for pc in c.pieces
                                  if self._converts(pc)), default=0)  # elements to convert gradients into
        self._full: dict[tuple[int, str], torch.Tensor] = {}  # (param, state key) -> split state
        self._synced: list[dict] = []
        self._plans_sig: Optional[tuple] = None
        self._plans: list[_Plan] = []
        self._kept: Optional[list[tuple]] = None  # what the last update(keep_previous=True) changed
        self._kept_bufs: dict[tuple, torch.Tensor] = {}  # reused copies for it
        self.state = KeyedState(self.state_keys, self.param_state)

    def _converts(self, pc: _Piece) -> bool:
        """The piece's gradient is converted to the master dtype (into the scratch)."""
        return self.params[pc.index].dtype != pc.key.dtype

    def _build(self, pieces: Sequence[tuple[int, int, int]], hypers: Sequence[dict]) -> _Chunk:
        made = []
        for i, start, stop in pieces:
            m = self.masters[i]
            split = (start, stop) != (0, m.numel())
            made.append(_Piece(i, start, stop, m.view(-1)[start:stop] if split else m, split, 0))
        self._place_in_scratch([pc for pc in made if self._converts(pc)])
        gids, groups = chunk_param_groups(made, self.group_of, hypers)
        return _Chunk(made, self._make_optimizer(groups), gids)

    def _place_in_scratch(self, pieces: list[_Piece]) -> None:
        """Scratch offsets of a chunk's converted ``pieces``: as their masters lie, relative to
        the first (the gaps between them as small as the staging's), else packed."""
        packed, total = [], 0
        for pc in pieces:
            packed.append(total)
            total += pc.stop - pc.start
        offsets = packed
        if self._offsets is not None and pieces:
            at = [self._offsets[pc.index] + pc.start for pc in pieces]
            mirrored = [a - at[0] for a in at]
            if mirrored[-1] + pieces[-1].stop - pieces[-1].start <= total + MAX_GAP_ELEMS * len(pieces):
                offsets = mirrored
        for pc, off in zip(pieces, offsets):
            pc.offset = off

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [c.optimizer for c in self.chunks]

    def _sync(self, hypers: Sequence[dict]) -> None:
        """The wrapper's hyperparameters into every chunk's optimizer, when they changed."""
        mine = [hypers[gi] for gi in self.group_ids]
        if len(mine) == len(self._synced) and all(
                a.keys() == b.keys() and all(a[k] is b[k] for k in a) for a, b in zip(mine, self._synced)):
            return
        for c in self.chunks:
            sync_hyperparameters(c.optimizer, c.group_ids, hypers)
        self._synced = [dict(h) for h in mine]

    def update(
        self,
        grads: Sequence[Optional[torch.Tensor]],
        out: Sequence[torch.Tensor],
        scratch: torch.Tensor,
        hypers: Sequence[dict],
        clip_coef: Optional[torch.Tensor],
        keep_previous: Union[bool, Callable[[], bool]] = False,
        scale: Optional[LossScale] = None,
    ) -> None:
        """One optimizer step: ``grads`` (model dtype, ``None`` = no gradient this step; converted
        to the master dtype in ``scratch`` where it differs) into the masters, then new values
        (cast to the model dtype) into ``out``, chunk by chunk, each chunk's optimizer run as
        ``GradScaler`` would run it under ``scale`` (``amp.run_step``). If a chunk's step raises,
        the chunks before it keep their update.

        ``keep_previous``: first copy what each chunk's step will change (the stepped masters,
        their optimizer state, the chunk optimizers' group entries), chunk by chunk while the
        data is in cache, so that ``restore()`` undoes this update exactly (``commit()`` drops
        that possibility). The copies are reused from update to update: one more copy of the
        bucket's masters and state, allocated the first time. A callable is asked before each
        chunk whether that is still wanted: once it answers no (the caller knows by then that
        it will keep this update, e.g. ``step()`` found an early update valid), the rest is not
        copied and the update can no longer be restored (``restorable`` is false)."""
        self._kept = [] if keep_previous else None
        ask = keep_previous if callable(keep_previous) else None
        if all(g is None for g in grads):
            return
        self._sync(hypers)
        plans = self._plan(grads, out, scratch)
        # One copy call per chunk: the previous chunk's new values out, this chunk's copies to
        # keep, its gradients in (each call releases and takes back the GIL, which the training
        # thread may hold meanwhile).
        written: tuple[list, list] = ([], [])  # the last stepped chunk's write-back, not done yet
        try:
            for ci, (chunk, plan) in enumerate(zip(self.chunks, plans)):
                if not plan.live:
                    continue
                if ask is not None and self._kept is not None and not ask():
                    self._kept, ask = None, None  # the caller keeps this update: stop copying
                dsts, srcs = written[0] + plan.convert_dst, written[1] + plan.convert_src
                if self._kept is not None:
                    entry, bufs, kept = self._keep(ci, chunk, plan.live)
                    self._kept.append(entry)
                    dsts, srcs = written[0] + bufs + plan.convert_dst, written[1] + kept + plan.convert_src
                written = ([], [])
                self._step_chunk(chunk, plan, dsts, srcs, clip_coef, scale)
                written = (plan.write_dst, plan.write_src)
        finally:
            if written[0]:
                torch._foreach_copy_(*written)

    @property
    def restorable(self) -> bool:
        """The last ``update(keep_previous=True)`` can still be undone by ``restore()``."""
        return self._kept is not None

    def commit(self) -> None:
        """Keep the last update for good (``restore()`` is no longer possible)."""
        self._kept = None

    def restore(self) -> None:
        """Undo the last ``update(keep_previous=True)``: masters, optimizer state and group entries
        become bit for bit what they were before it (state the step created is removed). The
        output buffers are not restored: they are rewritten by the next update."""
        kept, self._kept = self._kept, None
        if kept is None:
            raise RuntimeError("CpuBucket.restore() without a preceding update(keep_previous=True)")
        for chunk, groups, pieces in reversed(kept):
            chunk.bound = False  # state may be replaced below: bind it again after the next step
            state = chunk.optimizer.state
            for key, master, saved in pieces:
                key.copy_(master)
                if saved is None:
                    state.pop(key, None)
                    continue
                current = state[key]
                for k in [k for k in current if k not in saved]:
                    del current[k]
                for k, v in saved.items():
                    now = current.get(k)
                    if (torch.is_tensor(v) and torch.is_tensor(now) and now.shape == v.shape
                            and now.dtype == v.dtype and now.device == v.device):
                        now.copy_(v)  # in place: split pieces' state stays a view (see _bind)
                    else:
                        current[k] = v.clone() if torch.is_tensor(v) else v
            for group, entries in zip(chunk.optimizer.param_groups, groups):
                group.update(entries)
        self._synced = []  # group entries may differ from the wrapper's now: sync again

    def _keep(self, ci: int, chunk: _Chunk, live: list[_Piece]) -> tuple[tuple, list, list]:
        """What stepping ``live`` pieces of ``chunk`` (number ``ci``) changes: the entry
        ``restore`` reads, and the copies that fill it (buffers reused from update to update,
        and their sources), for the caller to make before the step."""
        bufs: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []

        def copy(name: tuple, t: torch.Tensor) -> torch.Tensor:
            buf = self._kept_bufs.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                buf = self._kept_bufs[name] = torch.empty_like(t)
            bufs.append(buf)
            srcs.append(t)
            return buf

        pieces = []
        for pc in live:
            st = chunk.optimizer.state.get(pc.key)
            saved = None
            if st:
                saved = {k: copy((ci, pc.index, pc.start, k), v) if torch.is_tensor(v) else v
                         for k, v in st.items()}
            pieces.append((pc.key, copy((ci, pc.index, pc.start, None), pc.key), saved))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in chunk.optimizer.param_groups]
        return (chunk, groups, pieces), bufs, srcs

    def _plan(self, grads: Sequence[Optional[torch.Tensor]], out: Sequence[torch.Tensor],
              scratch: torch.Tensor) -> list[_Plan]:
        """Per chunk, what its update reads, converts, steps and writes (``_Plan``), built once
        and reused while the same buffers come back (the staging buffers do, every step):
        making views costs about as much Python time per piece as a small copy."""
        sig = (scratch.data_ptr(),) + tuple(
            (-1, None) if g is None else (g.data_ptr(), g.dtype) for g in grads) + tuple(
            o.data_ptr() for o in out)
        if sig == self._plans_sig:
            return self._plans
        plans = []
        for chunk in self.chunks:
            live, ready, direct, convert, write = [], [], [], [], []
            for pc in chunk.pieces:
                g, o = grads[pc.index], out[pc.index]
                if g is None:
                    convert.append(None)  # no gradient: runs stop here
                    write.append(None)
                    continue
                if pc.split:
                    g, o = g.view(-1)[pc.start:pc.stop], o.view(-1)[pc.start:pc.stop]
                live.append(pc)
                if g.dtype == pc.key.dtype:
                    ready.append(g)
                    direct.append(g)
                    convert.append(None)
                else:
                    dst = scratch[pc.offset: pc.offset + pc.stop - pc.start]
                    ready.append(dst.view(g.shape))
                    convert.append((dst, g.view(-1)) if g.is_contiguous() else (dst.view(g.shape), g))
                write.append((o.view(-1), pc.key.view(-1)) if o.is_contiguous() else (o, pc.key))
            runs, writes = coalesce(convert), coalesce(write, max_gap=0)  # the staging's gaps: not ours
            plans.append(_Plan(live, ready, [d for d, _ in runs], [s for _, s in runs], [d for d, _ in runs] + direct,
                               [d for d, _ in writes], [s for _, s in writes]))
        self._plans_sig, self._plans = sig, plans
        return plans

    def _step_chunk(self, chunk: _Chunk, plan: _Plan, dsts: list[torch.Tensor], srcs: list[torch.Tensor],
                    clip_coef: Optional[torch.Tensor], scale: Optional[LossScale]) -> None:
        """Make the copies ``dsts <- srcs`` (among them the chunk's gradients in), then step it."""
        try:
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            for pc, g in zip(plan.live, plan.grads):
                pc.key.grad = g
            if clip_coef is not None:
                torch._foreach_mul_(plan.scale, clip_coef)
            run_step(chunk.optimizer, scale)
        finally:
            for pc in plan.live:
                pc.key.grad = None
            if not chunk.bound:
                chunk.bound = self._bind(chunk)

    def _bind(self, chunk: _Chunk) -> bool:
        """Make the per-element state of split pieces views of one tensor per parameter (the
        optimizer allocates it per piece on its first step, and ``load_state_dict`` replaces it).
        True when every split piece has state and all of it is bound: the optimizer updates it
        in place from then on, so nothing is left to do until it is replaced again."""
        done = True
        for pc in chunk.pieces:
            if not pc.split:
                continue
            st = chunk.optimizer.state.get(pc.key)
            if not st:
                done = False
                continue
            for k, v in st.items():
                if not (torch.is_tensor(v) and v.shape == pc.key.shape):
                    continue
                full = self._full.get((pc.index, k))
                if full is not None and v.data_ptr() == full.data_ptr() + pc.start * full.element_size():
                    continue  # bound already
                if full is None or full.dtype != v.dtype or full.device != v.device:
                    full = self._full[(pc.index, k)] = torch.empty(
                        self.masters[pc.index].shape, dtype=v.dtype, device=v.device)
                st[k] = full.view(-1)[pc.start:pc.stop].copy_(v)
        return done

    # -- the bucket as one optimizer over ``masters`` (state_dict support) ---------------------

    @property
    def param_groups(self) -> list[dict]:
        return part_param_groups(self.chunks, self.group_ids, self.group_of, self.masters)

    def state_keys(self) -> list[torch.Tensor]:
        """The tensors ``state`` is keyed by: the masters."""
        return self.masters

    def _pieces_of(self, index: int) -> list[tuple[_Chunk, _Piece]]:
        return [(c, pc) for c in self.chunks for pc in c.pieces if pc.index == index]

    def param_state(self, index: int) -> dict[str, Any]:
        """Optimizer state of parameter ``index`` as the wrapped class keeps it (no copies)."""
        c, pc = self._pieces_of(index)[0]
        st = c.optimizer.state.get(pc.key) or {}
        if not pc.split or not st:
            return st
        return StateEntry({k: self._full.get((index, k), v) if torch.is_tensor(v) and v.shape == pc.key.shape else v
                           for k, v in st.items()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format over ``masters`` (grouped as ``param_groups``)."""
        self._synced = []  # the chunks' groups take the saved hyperparameters: sync them again
        shapes = [m.shape for m in self.masters]
        for c, chunk_state in chunk_state_dicts(self.chunks, self.group_ids, self.group_of,
                                                state_dict, shapes):
            c.optimizer.load_state_dict(chunk_state)
            c.bound = self._bind(c)


def chunk_param_groups(pieces: Sequence[Any], group_of: Sequence[int],
                       hypers: Sequence[dict]) -> tuple[list[int], list[dict]]:
    """The groups a chunk's optimizer is built with: the ids of the part's groups its
    ``pieces`` belong to (in order of first appearance), and per group its hyperparameters
    (``hypers[id]``) with the pieces' keys as ``params``."""
    gids = list(dict.fromkeys(group_of[pc.index] for pc in pieces))
    groups = []
    for gi in gids:
        group = {k: v for k, v in hypers[gi].items() if k != "params"}
        group["params"] = [pc.key for pc in pieces if group_of[pc.index] == gi]
        groups.append(group)
    return gids, groups


def part_param_groups(chunks: Sequence[Any], group_ids: Sequence[int], group_of: Sequence[int],
                      keys: Sequence[torch.Tensor]) -> list[dict]:
    """torch's ``param_groups`` of a part whose parameters ``keys`` (``keys[i]`` in group
    ``group_of[i]``) are updated by one optimizer per chunk (a ``CpuBucket``, a streamed part):
    each group's hyperparameters from a chunk optimizer that has it (they all hold the same
    ones), its ``params`` the part's keys in that group."""
    out = []
    for gi in group_ids:
        g = next(g for c in chunks for g, cg in zip(c.optimizer.param_groups, c.group_ids)
                 if cg == gi)
        out.append({**{k: v for k, v in g.items() if k != "params"},
                    "params": [k for k, og in zip(keys, group_of) if og == gi]})
    return out


def chunk_state_dicts(
    chunks: Sequence[Any], group_ids: Sequence[int], group_of: Sequence[int],
    state_dict: dict[str, Any], shapes: Sequence[torch.Size],
) -> Iterator[tuple[Any, dict]]:
    """``(chunk, its state dict)`` for loading torch's format (as ``part_param_groups`` groups
    the part) into each chunk's optimizer: the saved hyperparameters of the chunk's groups, and
    the entries of its pieces; a piece of a split parameter (``shapes[i]``: the whole
    parameter's shape) gets the elements it updates of every per-element state tensor, and a
    copy of the other tensors."""
    local = {i: pos for pos, i in enumerate(
        i for gi in group_ids for i, og in enumerate(group_of) if og == gi)}
    saved_groups = dict(zip(group_ids, state_dict["param_groups"]))
    for c in chunks:
        state, groups, n = {}, [], 0
        for group, gi in zip(c.optimizer.param_groups, c.group_ids):
            ids = []
            for key in group["params"]:
                pc = next(pc for pc in c.pieces if pc.key is key)
                entry = state_dict["state"].get(local[pc.index])
                if entry is not None:
                    state[n] = _slice(entry, pc, shapes[pc.index]) if pc.split else entry
                ids.append(n)
                n += 1
            groups.append({**{k: v for k, v in saved_groups[gi].items() if k != "params"},
                           "params": ids})
        yield c, {"state": state, "param_groups": groups}


def _slice(entry: dict, pc: Any, shape: torch.Size) -> dict:
    return {k: (v.reshape(-1)[pc.start:pc.stop] if v.shape == shape else v.clone())
            if torch.is_tensor(v) else v for k, v in entry.items()}


STATE_WRITE_FIX = ("change its tensors in place (opt.state[p]['exp_avg'].zero_()), or load a "
                   "state dict (opt.load_state_dict(sd)); to start afresh, build a new "
                   "HybridDeviceOptimizer")


class StateEntry(dict):
    """One parameter's state assembled for ``opt.state[p]`` (a streamed parameter, or one split
    over CPU chunks): a copy of the mapping over the live tensors, so that setting or removing
    a key would change nothing; those raise instead."""

    why = "this parameter's state is kept in pieces (streamed, or split over CPU chunks)"

    def _refuse(self, *_: Any, **__: Any) -> None:
        raise OffloadUsageError(f"{self.why}: a key cannot be set or removed here; {STATE_WRITE_FIX}")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:  # pickled, deep-copied: a plain dict of the same items
        return dict, (dict(self),)


class KeyedState(Mapping):
    """``optimizer.state`` of a part that keeps its state itself (a ``CpuBucket``, a streamed
    part): ``state[key]`` is the per-parameter state of ``keys()[i]``, built on demand by
    ``state_of(i)``; only keys with state are listed. Bound methods are held weakly, so the
    part's own ``state`` attribute makes no reference cycle (a dropped part frees its memory
    at once, without the cycle collector)."""

    def __init__(self, keys: Callable[[], Sequence[torch.Tensor]],
                 state_of: Callable[[int], Optional[dict]]) -> None:
        self._keys, self._state_of = _weak(keys), _weak(state_of)

    def __getitem__(self, key: torch.Tensor) -> dict[str, Any]:
        i = next((i for i, k in enumerate(self._keys()()) if k is key), None)
        st = self._state_of()(i) if i is not None else None
        if not st:
            raise KeyError(key)
        return st

    def __iter__(self) -> Iterator[torch.Tensor]:
        state_of = self._state_of()
        return (k for i, k in enumerate(self._keys()()) if state_of(i))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _weak(fn: Callable) -> Callable[[], Callable]:
    """A getter of ``fn``: weak for bound methods (``weakref.WeakMethod``), strong otherwise."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn
