"""One chunk's update on the device, the same for the update inside ``step()``
(``stream_update``) and for those started in backward (``stream_backward``).

Three moves, each on the stream its caller orders: stage the chunk's current host copy into a
slot (``stage_in``: the copies, and typed views of the slot); step the chunk's optimizer over
the slot views from the gradients, writing the new parameter values (``update``); and hand
the new state back to host memory (``state_out``: the copies, allocating host memory the first
time a state tensor appears). The caller owns the streams, events and slots: this module only
says what is read and written where.

The hyperparameters an update runs with are bound to the chunk's optimizer for that update
only (``bound_hypers``): between updates it holds its own copies, never the values a caller
passed (which may be a user's tensors, changed in place later). Device tensors among them are
read by the update's kernels on its stream: whoever queues an update there keeps them until
the compute stream has waited for it (``read_on_device``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from ..core.device import Event, OffloadDevice
from .cpu_update import IMPLEMENTATION_KEYS, master_dtype
from .guards import map_tensors
from .stream_plan import Chunk, Piece, SlotLayout, slot_layout
from .stream_store import HostCopy
from .transfer import flat_bytes
from .amp import LossScale, run_step


class Link:
    """A streamed part's two copy streams, what crossed them, and its last copy out."""

    def __init__(self, device: OffloadDevice) -> None:
        self.device = device
        self.h2d = device.new_stream()
        self.d2h = device.new_stream()
        self.bytes_in = 0
        self.bytes_out = 0
        self.last_out: Optional[Event] = None  # the last copy out the host has not waited for

    def copy_in(self, copies: list) -> None:
        """Queue ``(device, host)`` byte pairs on ``h2d`` (``OffloadDevice.copy_many``)."""
        self.device.copy_many(self.h2d, _nonempty(copies))

    def copy_out(self, copies: list) -> None:
        """Queue ``(host, device)`` byte pairs on ``d2h`` (``OffloadDevice.copy_many``)."""
        self.device.copy_many(self.d2h, _nonempty(copies))

    def mark_out(self) -> Event:
        """Every copy out queued so far ends at the event recorded now (``last_out``)."""
        self.last_out = self.device.record_event(self.d2h)
        return self.last_out


@dataclass(eq=False)
class PieceViews:
    """One piece's views of a slot for an update (``None``: no such region)."""

    master: Optional[torch.Tensor]  # its master (bytes); an early update's own master: its staging
    grad: Optional[torch.Tensor]  # its gradient in the master dtype (low-precision parameters)
    new: Optional[torch.Tensor]  # an early update's new values of a low-precision parameter
    state: dict  # name -> the state tensor, typed
    keep: Optional[torch.Tensor] = None  # low precision: the edit mask (bytes, one per element)
    raw: dict = field(default_factory=dict)  # name -> the bytes of ``state[name]``

    def state_bytes(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """``flat_bytes(t)`` of the state tensor ``t`` named ``name`` after an update: its
        slot bytes, already at hand, where ``t`` is still the view staged there (the class
        stepped it in place, and did not ``set_`` it elsewhere)."""
        raw = self.raw.get(name)
        if (raw is not None and self.state.get(name) is t and t.data_ptr() == raw.data_ptr()
                and t.nbytes == raw.nbytes):
            return raw
        return flat_bytes(t)


def _nonempty(copies: list) -> list:
    """The pairs that move bytes: a zero-size parameter's regions move none (and all zero-size
    tensors may share one address, which would make them look like each other)."""
    return [c for c in copies if c[0].numel()]


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, casting as ``copy_`` does, in one call (one kernel
    launch per dtype pair on CUDA instead of one per tensor: a chunk's update costs the host
    less)."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def typed_view(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int], bases: dict) -> torch.Tensor:
    """``raw[:n].view(dtype).view(shape)`` (``raw``: contiguous bytes of a device buffer, ``n``
    the bytes of ``shape`` in ``dtype``) in one torch call instead of four (slice, view, the
    detach inside a dtype view, view): an ``as_strided`` of the whole buffer viewed as
    ``dtype``, which ``bases`` keeps for the next view of the same buffer and dtype. A chunk's
    update makes a few dozen such views, and every call is host time of every launch.

    Args:
        raw: flat uint8, a view of a buffer (a slot, a chunk's new values) or the buffer.
        dtype: the view's dtype.
        shape: the view's shape; its bytes may be fewer than ``raw``'s (a prefix).
        bases: ``{(id(buffer), dtype): typed buffer}``, one dict per update (the buffers must
            outlive it).

    Example::

        >>> import torch
        >>> slot, bases = torch.zeros(1024, dtype=torch.uint8), {}
        >>> v = typed_view(slot[256:512], torch.float32, (4, 8), bases)
        >>> _ = v.fill_(1.0)
        >>> torch.equal(slot[256:384].view(torch.float32), torch.ones(32)), v.is_contiguous()
        (True, True)
    """
    size = dtype.itemsize
    n = math.prod(shape)
    base = raw if raw._base is None else raw._base
    offset = raw.storage_offset()
    if (not n or n * size > raw.numel() or offset % size or base.dtype != torch.uint8
            or base.storage_offset() % size or base.numel() % size or not raw.is_contiguous()):
        return raw[: n * size].view(dtype).view(tuple(shape))
    key = (id(base), dtype)
    typed = bases.get(key)
    if typed is None:
        typed = bases[key] = base.view(dtype)
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return typed.as_strided(tuple(shape), tuple(reversed(strides)), offset // size)


def tensors_in(hypers: Sequence[dict]) -> list[torch.Tensor]:
    """The tensors among ``hypers``' values (also inside tuples and lists)."""
    out: list[torch.Tensor] = []
    for g in hypers:
        for k, v in g.items():
            if k != "params":
                map_tensors(v, out.append)
    return out


@contextlib.contextmanager
def bound_hypers(opt: torch.optim.Optimizer, group_ids: Sequence[int],
                 hypers: Sequence[dict]) -> Iterator[None]:
    """``opt``'s groups take the hyperparameters of the part's groups ``group_ids`` from
    ``hypers`` (implementation choices, fused and the like, stay what ``opt`` was built with),
    and get back what they held before when the block ends."""
    saved = []
    for group, gi in zip(opt.param_groups, group_ids):
        keys = [k for k in hypers[gi] if k != "params" and k not in IMPLEMENTATION_KEYS]
        saved.append((group, keys, {k: group[k] for k in keys if k in group}))
        for k in keys:
            group[k] = hypers[gi][k]
    try:
        yield
    finally:
        for group, keys, before in saved:
            for k in keys:
                if k in before:
                    group[k] = before[k]
                else:
                    del group[k]


def merge_edits(masters: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                scratch: Sequence[torch.Tensor], keep: Sequence[torch.Tensor],
                bases: Optional[dict] = None) -> None:
    """``guards.merge_edited`` for each ``(master, param)`` of a chunk, without allocating (so
    the update stays within the staging budget) and in few kernels: per piece, ``scratch`` (its
    gradient region, 4 bytes per element, filled only after this) takes the master rounded,
    ``keep`` (its edit mask region) where that equals the parameter, then the scratch takes
    the parameter in the master dtype (``torch.where`` of mixed dtypes would copy it) and the
    master becomes the parameter where the mask is off. The roundings and widenings are one
    batched kernel each for the chunk. Where nothing was edited the master is unchanged.

    Args:
        masters: per piece, its master (fp32), changed in place.
        params: per piece, the parameter's elements (bf16/fp16), shaped as its master.
        scratch: per piece, 4 bytes per element (uint8), overwritten.
        keep: per piece, 1 byte per element (uint8), overwritten.
        bases: ``typed_view``'s cache of the buffers these regions are views of, if any.

    Example::

        >>> import torch
        >>> master = torch.tensor([1.001, 2.0, 3.0])
        >>> param = master.to(torch.bfloat16)
        >>> param[2] = 0.5                                    # the user's edit
        >>> merge_edits([master], [param], [torch.empty(12, dtype=torch.uint8)],
        ...             [torch.empty(3, dtype=torch.uint8)])
        >>> master                                            # 1.001 kept: it still rounds alike
        tensor([1.0010, 2.0000, 0.5000])
    """
    if not masters:
        return
    bases = {} if bases is None else bases
    rounded = [typed_view(s, p.dtype, p.shape, bases) for s, p in zip(scratch, params)]
    masks = [typed_view(k, torch.bool, p.shape, bases) for k, p in zip(keep, params)]
    copy_all(rounded, list(masters))
    for r, p, k in zip(rounded, params, masks):
        torch.eq(r, p, out=k)
    wide = [typed_view(s, m.dtype, m.shape, bases) for s, m in zip(scratch, masters)]
    copy_all(wide, list(params))
    for m, w, k in zip(masters, wide, masks):
        torch.where(k, m, w, out=m)


class ChunkRunner:
    """Stages, updates and stores back the chunks of one streamed part (module docstring)."""

    def __init__(self, device: OffloadDevice, params: Sequence[torch.Tensor], store: HostCopy,
                 link: Link) -> None:
        self.device = device
        self.params = list(params)
        self.lowp = [m is not None for m in store.masters]  # low precision: a host master
        self.store = store
        self.link = link

    def read_on_device(self, hypers: Sequence[dict]) -> list[torch.Tensor]:
        """The device tensors among ``hypers``: an update queued on a side stream reads them
        there, so whoever queued it keeps them until the compute stream has waited for it."""
        return [t for t in tensors_in(hypers) if self.device.is_device_tensor(t)]

    def layout(self, pieces: Sequence[Piece]) -> SlotLayout:
        return slot_layout(pieces, self.params, self.lowp)

    def stage_in(self, pieces: Sequence[Piece], layout: SlotLayout, slot: torch.Tensor,
                 pending: Optional[list[torch.Tensor]] = None) -> tuple[list, list[PieceViews]]:
        """A chunk's views of ``slot`` and the ``(slot, host)`` byte pairs of its copies in: the
        current host copy of masters and state. An update started in backward also gets
        ``pending``, per piece its parameter's bytes on the device: a low-precision parameter's
        new values go there, and an fp32/fp64 parameter (its own master, not updated in place
        then) is staged there from the parameter by the update itself."""
        copies, views, bases = [], [], {}
        for k, (pc, reg) in enumerate(zip(pieces, layout.regions)):
            p = self.params[pc.index]
            m = g = new = keep = None
            if reg.master is not None:
                m = slot[reg.master: reg.master + pc.numel * master_dtype(p.dtype).itemsize]
                copies.append((m, pc.host.current.master))
                g = slot[reg.grad: reg.grad + m.numel()]
                keep = slot[reg.keep: reg.keep + pc.numel]
                if pending is not None:
                    new = pending[k]
            elif pending is not None:
                m = pending[k]
            st, raws = {}, {}
            for name, off in reg.state.items():
                host, flat = pc.host.streamed[name], pc.host.current.state[name]
                raw = raws[name] = slot[off: off + flat.numel()]
                copies.append((raw, flat))
                st[name] = typed_view(raw, host.dtype, host.shape, bases)
            views.append(PieceViews(m, g, new, st, keep, raws))
        self.link.bytes_in += sum(dst.numel() for dst, _ in copies)
        return copies, views

    def update(self, chunk: Chunk, pieces: Sequence[Piece], views: Sequence[PieceViews],
               staged: torch.Tensor, hypers: Sequence[dict], grads: list[torch.Tensor],
               scale: Optional[LossScale] = None, early: bool = False) -> None:
        """One chunk's update, on the stream current now (its copy in waited for), from
        ``grads`` (per piece, its parameter's gradient as ``step()`` or the backward hook took
        it); ``scale``: the loss scale ``GradScaler`` handed to ``step()`` (``amp.run_step``);
        ``early``: an update started in backward (see ``_step``)."""
        self.device.will_read(staged)
        with bound_hypers(chunk.optimizer, chunk.group_ids, hypers):
            self._step(chunk, pieces, views, grads, scale, early)
        for pc in pieces:  # copies out read flat storage: made contiguous on this stream
            st = chunk.optimizer.state.get(pc.key, {})
            for name, v in st.items():
                if torch.is_tensor(v) and not v.is_contiguous():
                    st[name] = v.contiguous()

    def _step(self, chunk: Chunk, pieces: Sequence[Piece], views: Sequence[PieceViews],
              grads: list[torch.Tensor], scale: Optional[LossScale] = None, early: bool = False) -> None:
        """Step ``chunk``'s optimizer over its slot ``views`` from ``grads`` (per piece), and
        write the new values into the parameters. ``early`` (an update started in backward):
        the new values go into the device buffer that holds them until ``step()`` (new values
        of a low-precision parameter; an fp32/fp64 parameter is its own master, staged there
        from the parameter first and stepped in place)."""
        opt = chunk.optimizer
        bases: dict = {}  # ``typed_view``'s, for this update
        try:
            dsts, srcs = [], []  # gradients into the slot, converted to the master dtype
            edits: list = []  # (master, parameter, gradient region, mask region) per piece
            for k, (pc, v) in enumerate(zip(pieces, views)):  # few views: a launch's host time
                p = self.params[pc.index]
                shape = pc.shape(p)  # of the key, the gradient piece and ``pc.written(p)``
                grad = grads[k].detach() if grads[k].requires_grad else grads[k]
                grad = grad.reshape(-1)[pc.start:pc.stop] if pc.split else grad
                if v.master is not None:
                    if v.grad is None:  # early, own master: stepped in the slot, not in place
                        v.master.copy_(flat_bytes(pc.written(p)))
                    pc.key.set_(typed_view(v.master, pc.key.dtype, shape, bases))
                if v.grad is not None:  # a user's edit of the parameter since the part wrote it
                    edits.append((pc.key, pc.written(p), v.grad, v.keep))
                    gm = typed_view(v.grad, pc.key.dtype, shape, bases)
                    dsts.append(gm)
                    srcs.append(grad if grad.shape == shape else grad.view(shape))
                    pc.key.grad = gm
                else:
                    pc.key.grad = grad
                if pc.host.streamed or pc.host.kept:
                    opt.state[pc.key] = {**pc.host.kept, **v.state}
            if edits:
                merge_edits(*map(list, zip(*edits)), bases=bases)
            copy_all(dsts, srcs)
            run_step(opt, scale)
            with torch.no_grad():
                dsts, srcs = [], []  # new values, cast to the parameters' dtype
                for pc, v in zip(pieces, views):
                    if v.grad is None:  # own master: updated where it is
                        continue
                    p = self.params[pc.index]
                    dsts.append(typed_view(v.new, p.dtype, pc.key.shape, bases) if early else pc.written(p))
                    srcs.append(pc.key)  # bound to the slot above, in the piece's shape
                copy_all(dsts, srcs)
        finally:
            for pc in pieces:
                pc.key.grad = None

    def state_out(self, chunk: Chunk, pc: Piece, created: list[torch.Tensor], copies: list,
                  views: Optional[PieceViews] = None) -> bool:
        """The copies of piece ``pc``'s state back into host memory, appended to ``copies`` as
        ``(host bytes, device bytes)`` (first time: the host memory is allocated); appends the
        device tensors the copies read to ``created`` (to keep until they are done); True if
        the class created state on the device (none was in host memory yet). ``views``: the
        piece's slot views of the update, if any (``PieceViews.state_bytes``)."""
        st = chunk.optimizer.state.pop(pc.key, None) or {}
        fresh = False
        key_device = self.params[pc.index].device
        for name, v in st.items():
            if not (torch.is_tensor(v) and v.device == key_device and self.device.is_device_tensor(v)):
                pc.host.kept[name] = v
                continue
            flat = pc.host.current.state.get(name)
            if flat is None:
                flat = pc.host.add_streamed(name, self._host_state(pc, name, v))
                fresh = True
            v = v.contiguous()
            created.append(v)
            copies.append((flat, views.state_bytes(name, v) if views is not None else flat_bytes(v)))
            self.link.bytes_out += flat.numel()
        if self.lowp[pc.index]:
            pc.key.set_()  # drop the slot view
        return fresh

    def _host_state(self, pc: Piece, name: str, v: torch.Tensor) -> torch.Tensor:
        """Pinned host memory for state ``name`` of piece ``pc`` (a view of one tensor per
        parameter for per-element state)."""
        if v.shape == pc.key.shape:  # per-element state
            full = self.store.per_element(pc.index, name, v.dtype)
            return full.view(-1)[pc.start:pc.stop].view(v.shape)
        prev = pc.host.previous_of(name, v.dtype, v.shape)
        if prev is not None:
            return prev
        return self.store.small(v.numel() * v.element_size()).view(v.dtype).view(v.shape)
