"""The free bytes of a few host blocks: best-fit carving and coalescing, in offsets only.

The pinned pool carves its buffers out of large pinned blocks (``pinned_pool``); this module
keeps, per block, which byte ranges are free, with no tensors, so that the bookkeeping is
tested on its own. A carve takes the smallest free range that holds the request (best fit: an
exact fit leaves nothing behind), rounded up to ``ALIGN`` bytes so that every buffer starts
aligned; what it gives back merges with its free neighbours, so a block whose buffers are all
back is one free range again, whatever the order they came back in.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Optional

ALIGN = 64  # a buffer's start within its block: a cache line, as torch aligns host tensors


class FreeSpace:
    """Free ranges ``[start, end)`` of blocks named by integers.

    Example::

        >>> from cpu_offload.core.free_space import FreeSpace
        >>> space = FreeSpace()
        >>> space.add_block(0, 1000)
        >>> a, b = space.carve(100), space.carve(300)   # (block, start, bytes taken)
        >>> a, b
        ((0, 0, 128), (0, 128, 320))
        >>> space.carve(2000) is None                   # nothing holds it: a new block is needed
        True
        >>> space.give_back(*a); space.give_back(*b)
        >>> space.entirely_free(0), space.free_bytes
        (True, 1000)
    """

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}  # block -> its size
        self.free_bytes = 0
        self._by_length: list[tuple[int, int, int]] = []  # (length, block, start), sorted
        self._end_of: dict[tuple[int, int], int] = {}  # (block, start) -> end of a free range
        self._start_of: dict[tuple[int, int], int] = {}  # (block, end) -> start of a free range

    def add_block(self, block: int, size: int) -> None:
        """A new block, all of it free."""
        self.sizes[block] = size
        self._insert(block, 0, size)
        self.free_bytes += size

    def remove_block(self, block: int) -> None:
        """Forget a block whose bytes are all free (``entirely_free``)."""
        size = self.sizes.pop(block)
        self._remove(block, 0, size)
        self.free_bytes -= size

    def entirely_free(self, block: int) -> bool:
        return self._end_of.get((block, 0)) == self.sizes[block]

    def largest(self) -> int:
        """The longest free range: the largest request a carve can serve now."""
        return self._by_length[-1][0] if self._by_length else 0

    def carve(self, nbytes: int) -> Optional[tuple[int, int, int]]:
        """``(block, start, taken)`` for ``nbytes`` from the smallest free range that holds
        them (``taken``: ``nbytes`` rounded up to ``ALIGN``, or the range's rest if smaller);
        None if no range does."""
        ranges = self._by_length
        i = bisect_left(ranges, (nbytes,))
        if i == len(ranges):
            return None
        length, block, start = ranges.pop(i)
        end = start + length
        del self._end_of[(block, start)]
        taken = -(-nbytes // ALIGN) * ALIGN
        if taken < length:
            rest = start + taken
            insort(ranges, (length - taken, block, rest))
            self._end_of[(block, rest)] = end
            self._start_of[(block, end)] = rest
        else:
            taken = length
            del self._start_of[(block, end)]
        self.free_bytes -= taken
        return block, start, taken

    def give_back(self, block: int, start: int, taken: int) -> None:
        """Free what ``carve`` returned, merged with the free ranges on either side."""
        self.free_bytes += taken
        end = start + taken
        after = self._end_of.get((block, end))
        if after is not None:  # a free range starts where this one ends
            self._remove(block, end, after)
            end = after
        before = self._start_of.get((block, start))
        if before is not None:  # a free range ends where this one starts
            self._remove(block, before, start)
            start = before
        self._insert(block, start, end)

    def _insert(self, block: int, start: int, end: int) -> None:
        insort(self._by_length, (end - start, block, start))
        self._end_of[(block, start)] = end
        self._start_of[(block, end)] = start

    def _remove(self, block: int, start: int, end: int) -> None:
        ranges = self._by_length
        del ranges[bisect_left(ranges, (end - start, block, start))]
        del self._end_of[(block, start)]
        del self._start_of[(block, end)]
