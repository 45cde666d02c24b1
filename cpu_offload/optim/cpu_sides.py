"""Two copies ("sides") of a CPU bucket's masters and per-element optimizer state, so that an
early update can be undone without saving what it changes.

The CPU part starts a bucket's update in backward, before ``step()`` has checked that its
gradients will stand, so that update must be undoable. Saving what each chunk's step changes
and then stepping in place reads the originals, writes the saved copy, and writes the originals
back: with fp32 AdamW 12 more bytes per element than the step itself, which already moves them
(``benchmarks/undo_probe.py``). Here the chunk is copied onto the *spare* side instead, and the
step runs there, while the copy is still in cache: the originals are only read. Undoing is then
free (the tensors go back to the untouched side), and keeping the update makes the spare side
the current one.

"Going to a side" rebinds tensors, it does not copy: every tensor that views a side (masters,
the chunk optimizers' keys and state, views built from them) gets the same offset, sizes and
strides in the other side's storage (``Tensor.set_``), so the objects the optimizers and the
caller hold stay the same. That needs each side to be a few flat buffers laid out alike: the
masters' flat buffer (``None``) and one per state name, with the masters' offsets.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch


class BucketSides:
    """The current and spare flat buffers of one bucket, by name (``None``: the masters).

    Example::

        >>> import torch
        >>> from cpu_offload.optim.cpu_sides import BucketSides
        >>> sides = BucketSides(torch.arange(4.0))
        >>> master = sides.current[None][1:3]
        >>> sides.prepare()
        >>> for dst, src in sides.copies([(1, 3)]):
        ...     _ = dst.copy_(src)
        >>> sides.move([master], to_spare=True)
        >>> _ = master.add_(10)                         # an update on the spare side
        >>> sides.current[None]                         # the current side is untouched
        tensor([0., 1., 2., 3.])
        >>> sides.move([master], to_spare=False)        # undone: back where it was
        >>> master
        tensor([1., 2.])
    """

    def __init__(self, masters: torch.Tensor) -> None:
        self.current: dict[Optional[str], torch.Tensor] = {None: masters}
        self.spare: dict[Optional[str], torch.Tensor] = {}

    def home(self, name: str, like: torch.Tensor) -> Optional[torch.Tensor]:
        """The current side's flat buffer for state ``name`` (zeros, made at first use), or
        ``None`` where state like ``like`` cannot live there (another dtype than the buffer's,
        or not on the CPU)."""
        flat = self.current.get(name)
        if flat is None:
            if like.device.type != "cpu":
                return None
            flat = self.current[name] = torch.zeros(self.current[None].numel(), dtype=like.dtype)
            self.spare.pop(name, None)
        return flat if flat.dtype == like.dtype and like.device == flat.device else None

    def prepare(self) -> None:
        """Allocate the spare side's buffers that are missing (once: they are reused)."""
        for name, flat in self.current.items():
            if name not in self.spare:
                self.spare[name] = torch.empty_like(flat)

    def copies(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(spare, current)`` views of every buffer over the element ``ranges``."""
        return [(self.spare[name][lo:hi], flat[lo:hi]) for name, flat in self.current.items()
                for lo, hi in ranges]

    def move(self, tensors: Iterable[torch.Tensor], to_spare: bool) -> None:
        """Rebind each of ``tensors`` that views one side's buffer to the same place in the
        other side's (``to_spare``: current -> spare; else back); others are left alone."""
        frm, to = (self.current, self.spare) if to_spare else (self.spare, self.current)
        where = {flat.untyped_storage().data_ptr(): name for name, flat in frm.items()}
        for t in tensors:
            name = where.get(t.untyped_storage().data_ptr(), _NONE)
            if name is not _NONE:
                t.set_(to[name].untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def swap(self) -> None:
        """The spare side becomes the current one (after ``move(..., to_spare=True)``)."""
        self.current, self.spare = self.spare, self.current


_NONE = object()
