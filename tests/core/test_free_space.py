"""``FreeSpace``: the pinned pool's free ranges, best fit and merged back (``core/free_space.py``)."""
from __future__ import annotations

import random

import pytest

from cpu_offload.core.free_space import ALIGN, FreeSpace


def test_a_request_takes_the_smallest_range_that_holds_it():
    space = FreeSpace()
    space.add_block(0, 10_000)
    space.add_block(1, 3_000)
    space.add_block(2, 5_000)
    assert space.carve(2_900) == (1, 0, 2_944)  # not the first block, nor the largest
    assert space.carve(5_000) == (2, 0, 5_000)  # an exact fit leaves nothing behind
    assert space.carve(9_999) == (0, 0, 10_000)  # the aligned size, but no more than is left
    assert space.carve(1) == (1, 2_944, 56)  # the rest of block 1
    assert space.carve(1) is None and space.free_bytes == 0


def test_buffers_start_aligned_and_never_overlap():
    space = FreeSpace()
    space.add_block(7, 1 << 20)
    rng = random.Random(0)
    spans = []
    while (spot := space.carve(rng.randrange(1, 5_000))) is not None:
        block, start, taken = spot
        assert block == 7 and start % ALIGN == 0
        spans.append((start, start + taken))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert sum(e - s for s, e in spans) + space.free_bytes == 1 << 20


@pytest.mark.parametrize("seed", range(5))
def test_ranges_given_back_in_any_order_merge_into_whole_blocks(seed):
    rng = random.Random(seed)
    space = FreeSpace()
    for block in range(3):
        space.add_block(block, rng.randrange(10_000, 50_000))
    taken = []
    while (spot := space.carve(rng.randrange(1, 4_000))) is not None:
        taken.append(spot)
    rng.shuffle(taken)
    for spot in taken:
        space.give_back(*spot)
    assert all(space.entirely_free(b) for b in range(3))
    assert space.largest() == max(space.sizes.values())
    for block in range(3):
        space.remove_block(block)
    assert space.free_bytes == 0 and space.largest() == 0
