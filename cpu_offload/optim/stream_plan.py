"""The chunk plan of a streamed part: which element ranges of which parameters are updated
together, and where each piece of a chunk sits in a device staging slot.

A chunk is one device optimizer over its pieces (a piece: one parameter's elements
``[start, stop)``), staged through one of ``SLOTS`` slots. The plan is fixed at construction,
so the update inside ``step()`` (``stream_update``) and the updates started in backward
(``stream_backward``) walk the same chunks; only a slot's layout follows the state each piece
streams, which the optimizer class creates at its first step (or ``load_state_dict`` loads).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .cpu_update import ALIGN_ELEMS, chunk_param_groups, master_dtype, plan_chunks
from .stream_store import PieceHost

# Staging slots (of the update in step(), and of the updates started in backward). A chunk's copy
# in waits for the copy out of the chunk SLOTS before it, so with two the link idled while a
# chunk's update and the hops between streams ran: three kept it busier (H200, everything
# streamed, slots of 128 MiB: step 15-20% shorter; four no better; benchmarks/RESULTS.md,
# eighteenth session).
SLOTS = 3
SLOT_ALIGN = 256  # bytes: every region of a device buffer starts aligned (vectorized kernels)
# Pieces per chunk whose alignment padding a slot keeps room for (at most 1/16 of the slot): a
# chunk that ``plan_chunks`` filled to the element budget and that then needed its pieces'
# padding as well was cut in two by ``_regroup``, one of them small (GPT layers of hidden 2048 at
# 128 MiB slots: 80 chunks where 52 hold the elements, each costing a chunk's host time).
PADDED_PIECES = 16


def slot_aligned(n: int) -> int:
    """``n`` bytes rounded up to ``SLOT_ALIGN``: where the next region of a slot (or of a
    chunk's new values) may start.

    Example::

        >>> from cpu_offload.optim.stream_plan import slot_aligned
        >>> slot_aligned(1), slot_aligned(256), slot_aligned(257)
        (256, 256, 512)
    """
    return -(-n // SLOT_ALIGN) * SLOT_ALIGN


@dataclass(eq=False)
class Piece:
    """Elements ``[start, stop)`` of parameter ``index`` of the part, in one chunk."""

    index: int
    start: int
    stop: int
    key: torch.Tensor  # what the chunk's optimizer steps: a slot view bound per update, or the param
    split: bool  # a part of its parameter (else all of it)
    host: PieceHost  # its master and streamed state on the host
    target_bytes: Optional[torch.Tensor] = None  # the parameter bytes it writes (made once, lazily)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def shape(self, param: torch.Tensor) -> tuple:
        """The shape the optimizer sees: the parameter's, or flat for a split piece."""
        return (self.numel,) if self.split else tuple(param.shape)

    def written(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param`` this piece's update writes."""
        p = param.detach()
        return p.view(-1)[self.start:self.stop] if self.split else p

    def follow(self, param: torch.Tensor, own_master: bool) -> None:
        """``param`` was given new memory (``param.data = t``): what this piece keeps of the old
        one points at the new (its key, when the parameter is its own master; the bytes a kept
        early update writes)."""
        self.target_bytes = None
        if own_master:
            self.key.set_(self.written(param))


@dataclass(eq=False)
class Chunk:
    """Pieces updated together by one optimizer of the device class."""

    pieces: list[Piece]
    optimizer: torch.optim.Optimizer
    group_ids: list[int]  # per group of ``optimizer``: the part's group it holds

    def param_indices(self) -> list[int]:
        """The parameters with a piece in this chunk (each once, in piece order)."""
        return list(dict.fromkeys(pc.index for pc in self.pieces))


@dataclass(frozen=True)
class Regions:
    """Byte offsets of one piece's regions in a slot (``None``: no such region)."""

    master: Optional[int]  # a low-precision parameter's master (fp32)
    grad: Optional[int]  # its gradient, converted to the master dtype
    state: dict  # state name -> offset, per streamed state tensor
    keep: Optional[int] = None  # 1 byte per element: where the parameter is its master rounded


@dataclass(frozen=True)
class SlotLayout:
    """Where a chunk's pieces go in a slot, and the bytes it needs."""

    regions: list[Regions]
    total: int


def slot_layout(pieces: Sequence[Piece], params: Sequence[torch.Tensor],
                lowp: Sequence[bool]) -> SlotLayout:
    """Each piece's regions, aligned (a low-precision parameter's master, fp32 gradient and
    edit mask (``stream_chunk``), then its streamed state, as ``piece.host.streamed`` lists it
    now)."""
    out, offset = [], 0
    for pc in pieces:
        m_off = g_off = k_off = None
        if lowp[pc.index]:
            n = slot_aligned(pc.numel * master_dtype(params[pc.index].dtype).itemsize)
            m_off, g_off, k_off = offset, offset + n, offset + 2 * n
            offset = k_off + slot_aligned(pc.numel)
        names = {}
        for name, host in pc.host.streamed.items():
            names[name] = offset
            offset += slot_aligned(host.numel() * host.element_size())
        out.append(Regions(m_off, g_off, names, k_off))
    return SlotLayout(out, offset)


@dataclass
class ChunkPlan:
    """The part's chunks, and which chunks each parameter has pieces in."""

    chunk_elems: int  # elements per chunk the slots were sized for
    chunks: list[Chunk]
    chunks_of: dict[int, list[int]] = field(default_factory=dict)  # param -> its chunks

    def __post_init__(self) -> None:
        for ci, c in enumerate(self.chunks):
            for i in c.param_indices():
                self.chunks_of.setdefault(i, []).append(ci)

    @property
    def pieces(self) -> list[Piece]:
        return [pc for c in self.chunks for pc in c.pieces]


def bytes_per_elem(param: torch.Tensor, lowp: bool, state_elems: int) -> int:
    """Slot bytes an element of ``param`` takes: master, gradient and edit mask (low
    precision), state."""
    state_dtype = master_dtype(param.dtype) if lowp else param.dtype  # its own master: its dtype
    return (9 if lowp else 0) + state_elems * state_dtype.itemsize


def plan_ranges(params: Sequence[torch.Tensor], lowp: Sequence[bool], budget_bytes: int,
                state_elems: int, elementwise: bool) -> tuple[int, list[list[tuple[int, int, int]]]]:
    """The elements per chunk a slot of ``budget_bytes / SLOTS`` holds, and the chunks as lists
    of ``(param index, start, stop)``, each fitting a slot with its regions aligned."""
    regions = 3 + state_elems  # per piece: master, gradient, edit mask, each state tensor
    slot = budget_bytes // SLOTS - regions * SLOT_ALIGN
    padding = min(PADDED_PIECES * regions * SLOT_ALIGN, slot // 16)
    per_elem = [bytes_per_elem(p, lp, state_elems) for p, lp in zip(params, lowp)]
    chunk_elems = max(1, (slot - padding) // max(1, max(per_elem or [1])))
    chunk_elems = chunk_elems // ALIGN_ELEMS * ALIGN_ELEMS or chunk_elems
    ranges = plan_chunks([p.numel() for p in params], chunk_elems, elementwise)
    return chunk_elems, _regroup(_with_empty(ranges, params), per_elem, regions, slot)


def build_chunk(ranges: Sequence[tuple[int, int, int]], params: Sequence[torch.Tensor],
                masters: Sequence[Optional[torch.Tensor]], hypers: Sequence[dict],
                group_of: Sequence[int],
                make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> Chunk:
    """A chunk over ``ranges``, its optimizer built over its pieces' keys: the host master of a
    low-precision parameter (bound to a slot view for each update), else the parameter (its
    flat range for a split piece). A class that makes state at construction (Adagrad) is built
    again over keys of their real shape, bound to device memory: the caller moves that state
    to the host (``StreamedPart``)."""
    pieces = [_piece(i, start, stop, params[i], masters[i]) for i, start, stop in ranges]
    gids, groups = chunk_param_groups(pieces, group_of, hypers)
    opt = make_optimizer(groups)
    lowp = [pc for pc in pieces if masters[pc.index] is not None]
    if opt.state and lowp:
        for pc in lowp:
            pc.key.set_(torch.empty(pc.shape(params[pc.index]), dtype=pc.key.dtype,
                                    device=pc.key.device))
        gids, groups = chunk_param_groups(pieces, group_of, hypers)
        opt = make_optimizer(groups)
    return Chunk(pieces, opt, gids)


def _piece(index: int, start: int, stop: int, param: torch.Tensor,
           master: Optional[torch.Tensor]) -> Piece:
    split = (start, stop) != (0, param.numel())
    if master is not None:  # a slot view, bound for each update
        key = torch.empty(0, dtype=master.dtype, device=param.device)
        host = PieceHost.of(master.view(-1)[start:stop])
    else:
        key = param.detach().view(-1)[start:stop] if split else param.detach()
        host = PieceHost.of(None)
    return Piece(index, start, stop, key, split, host)


def _with_empty(ranges: list[list[tuple[int, int, int]]],
                params: Sequence[torch.Tensor]) -> list[list[tuple[int, int, int]]]:
    """``plan_chunks`` gives a zero-size parameter no piece when it splits: give it an empty
    one, next to the parameter before it, so that every parameter has state and a chunk (torch's
    optimizers keep state for zero-size parameters too)."""
    have = {i for c in ranges for i, _, _ in c}
    for i in (i for i, p in enumerate(params) if i not in have):
        for c in ranges:
            k = next((k for k, (j, _, _) in enumerate(c) if j > i), None)
            if k is not None:
                c.insert(k, (i, 0, 0))
                break
        else:
            if ranges:
                ranges[-1].append((i, 0, 0))
            else:
                ranges.append([(i, 0, 0)])
    return ranges


def _regroup(ranges: list[list[tuple[int, int, int]]], per_elem: Sequence[int], regions: int,
             slot: int) -> list[list[tuple[int, int, int]]]:
    """Cut ``ranges``' chunks further so that each fits a slot with its ``regions`` per piece
    aligned (many small parameters: alignment adds up)."""
    out = []
    for chunk in ranges:
        current, filled = [], 0
        for i, start, stop in chunk:
            need = (stop - start) * per_elem[i] + regions * SLOT_ALIGN
            if current and filled + need > slot:
                out.append(current)
                current, filled = [], 0
            current.append((i, start, stop))
            filled += need
        if current:
            out.append(current)
    return out
