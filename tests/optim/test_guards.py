"""``optim.guards``: the change detectors that decide whether early work is kept.

``bit_sums`` must give, tensor by tensor, what ``bit_sum`` gives (fingerprints taken one way are
compared with sums taken the other), and ``differs_from_rounded`` must see every edit of a
parameter against its master, including those that bypass ``_version``, in one host
synchronization however many parameters there are.
"""
from __future__ import annotations

import pytest
import torch

from cpu_offload.optim.guards import (
    Fingerprint, _unaligned_word_sum, bit_sum, bit_sums, changed, differs_from_rounded, host_list,
    merge_edited, word_sum,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tensors(device: str) -> list:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=g)
    return [
        base[:1024].to(device, torch.bfloat16),
        base[1:1024].to(device),                    # fp32 at an odd element offset below
        base.to(device)[3:1000],                    # a view not aligned to 4 bytes? (fp32: aligned)
        base.to(device, torch.bfloat16)[1:998],     # bf16 at a 2-byte offset: not word aligned
        base[:7].to(device, torch.float16),         # 14 bytes: not whole words
        torch.arange(10, device=device),            # integers
        torch.empty(0, device=device),
        base[:12].to(device).view(3, 4).t(),        # non-contiguous
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bit_sums_equal_bit_sum_row_by_row(device):
    ts = _tensors(device)
    rows = bit_sums(ts)
    assert rows.shape == (len(ts), 2) and rows.dtype == torch.float64
    for t, row in zip(ts, rows):
        assert torch.equal(row, bit_sum(t)), t


@pytest.mark.parametrize("device", DEVICES)
def test_modular_word_sum_of_aligned_words_equals_the_general_one(device):
    """The accelerator's word sum takes a contiguous tensor of whole aligned words in one
    reduction, and anything else bytes-and-words: the two agree wherever both apply (the CPU
    runs both here, as the simulated device never takes the modular sum)."""
    ts = _tensors(device)
    aligned = [t for t in ts if t.is_contiguous() and t.numel() * t.element_size() % 4 == 0
               and t.storage_offset() * t.element_size() % 4 == 0 and t.numel()]
    assert len(aligned) == 4  # bf16, fp32 at offset 1 and 3 (4-byte words), int64
    for t in aligned:
        fast = word_sum(t, modular=True)
        assert fast.dtype == torch.int32 and torch.equal(fast, _unaligned_word_sum(t)), t
    for t in aligned[:2]:  # and it sees a write through .data
        before = word_sum(t, modular=True)
        t.data[5] += 1
        assert not torch.equal(before, word_sum(t, modular=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", ["data_mul_2", "data_neg", "clamp_via_data", "one_element"])
def test_bit_sums_see_writes_that_bypass_the_version_counter(device, edit):
    ts = [torch.randn(4096, device=device), torch.randn(4096, device=device).bfloat16()]
    before = bit_sums(ts)
    for t in ts:
        v0 = t._version
        if edit == "data_mul_2":
            t.data.mul_(2)
        elif edit == "data_neg":
            t.data.neg_()
        elif edit == "clamp_via_data":
            t.data.clamp_(-0.5, 0.5)
        else:
            t.data[17] += 1
        assert t._version == v0  # the version counter did not see it
    now = bit_sums(ts)
    assert (before != now).any(dim=1).all(), (before, now)


@pytest.mark.parametrize("device", DEVICES)
def test_pending_fingerprints_see_versions_then_contents_once_their_bits_are_taken(device):
    """A fingerprint taken in a hook records object and version only; its bits come later in
    one batch (``take_bits``), and from then on writes through ``.data`` show too. Writes
    before the bits were taken are part of what is fingerprinted."""
    a, b, c = (torch.randn(4096, device=device) for _ in range(3))
    prints = [Fingerprint.pending(t) for t in (a, b, c)]
    b.data.mul_(2)  # before the bits: fingerprinted as it is now
    c.mul_(2)  # a version bump: seen with or without bits
    assert changed([(fp, t) for fp, t in zip(prints, (a, b, c))]) == [False, False, True]
    Fingerprint.take_bits(prints + prints[:1])  # a repeated fingerprint is taken once
    assert all(fp.bits is not None for fp in prints)
    a.data.add_(1)  # after the bits: seen
    assert changed([(fp, t) for fp, t in zip(prints, (a, b, c))]) == [True, False, True]
    assert changed([(prints[1], a)]) == [True]  # another tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_bytes", [64, 2**20])
def test_differs_from_rounded_finds_exactly_the_edited_parameters(device, group_bytes):
    """Parameters written as their masters rounded are unchanged; one edited through ``.data``
    in one element, one permuted, one scaled, one set to NaN are found; zero-size parameters
    and fp32 parameters with fp32 masters are handled; small ``group_bytes`` splits the work
    into many groups, large puts it in one."""
    torch.manual_seed(0)
    masters = [torch.randn(n, device=device) for n in (300, 1, 0, 64, 257, 33, 128)]
    params = [m.to(torch.bfloat16) for m in masters]
    masters.append(torch.randn(40, device=device))
    params.append(masters[-1].clone())  # fp32 parameter: its master is its own dtype
    assert differs_from_rounded(list(zip(masters, params)), group_bytes) == [False] * len(params)
    params[0].data[123] += 1                        # one element, through .data
    params[3].data.copy_(params[3].flip(0))         # a permutation
    params[4].data.mul_(2)                          # a power-of-two scaling
    params[5].data[0] = float("nan")
    params[7].data[5] = -params[7][5]
    want = [True, False, False, True, True, True, False, True]
    assert differs_from_rounded(list(zip(masters, params)), group_bytes) == want
    for m, p, edited in zip(masters, params, want):  # the merge then makes them agree
        if edited:
            merge_edited(m, p)
    params[5].data[0] = 0.0
    masters[5][0] = 0.0
    assert differs_from_rounded(list(zip(masters, params)), group_bytes) == [False] * len(params)


def test_differs_from_rounded_of_nothing():
    assert differs_from_rounded([]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_host_list_is_tolist_after_queued_work(device):
    """``host_list`` waits for the work queued before it (here a long chain of kernels) and
    gives ``tolist()``'s values, in every dtype the checks read."""
    x = torch.ones(2**20, device=device)
    for _ in range(50):
        x = x * 1.0001
    for t in (x[:3], x.sum().reshape(1) > 1, torch.stack([x.sum(), x.max()]).double()):
        assert host_list(t) == t.tolist()
