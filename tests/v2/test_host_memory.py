"""Pinned host memory of V2 at the byte, on the simulated device: what is reserved stays within 5%
of what a step offloads, ``stats()`` reports it, a warning says so once when it does not, and
``max_host_bytes`` counts reserved bytes. Gradients stay bit-identical and nothing grows."""
from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch
from torch import nn

from cpu_offload import SimulatedDevice, apply_offloading
from cpu_offload.examples.mlp import ResidualMlp as Block

PAGE = 4096


class Pow2Device(SimulatedDevice):
    """Blocks rounded up to a power of two, as torch's pinned allocator reserves them."""

    def host_block_size(self, nbytes):
        return 1 << max(nbytes - 1, 0).bit_length()

    def host_memory_kind(self):
        return "power-of-two blocks (simulated)"


def make_blocks(hidden=40, ffn=104, n=8):
    torch.manual_seed(0)
    return nn.ModuleList([Block(hidden, ffn) for _ in range(n)])


def train_step(layers, seq):
    """Output and gradients of one step on a fixed input of ``seq`` rows."""
    torch.manual_seed(seq)
    x = torch.randn(seq, layers[0].up.in_features, requires_grad=True)
    h = x * 1.0
    for layer in layers:
        h = layer(h)
    h.square().mean().backward()
    out = [h.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]
    for p in layers.parameters():
        p.grad = None
    return out


def assert_same(got, ref):
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("hidden, ffn, seq", [(40, 104, 1000), (33, 97, 777), (64, 256, 3001)])
def test_reserved_host_memory_is_within_five_percent_of_the_offloaded_bytes(hidden, ffn, seq):
    """Any tensor sizes (odd ones too): blocks rounded to whole pages, buffers carved at the
    byte, reused every step with no allocation after the first."""
    layers = make_blocks(hidden, ffn)
    ref = train_step(layers, seq)
    sim = SimulatedDevice(host_page=PAGE)
    handle = apply_offloading(layers, num_layers=6, device=sim, min_tensor_size_to_offload=1)
    allocations = []
    for _ in range(4):
        assert_same(train_step(layers, seq), ref)
        d = handle.stats().to_dict()
        assert d["pinned_host_bytes_peak"] == d["copied_out_bytes"]
        assert d["pinned_host_bytes_reserved_peak"] <= 1.05 * d["copied_out_bytes"]
        assert d["pinned_host_bytes_reserved"] == sim.host_bytes_allocated
        allocations.append(sim.host_allocs)
    assert allocations[0] == allocations[-1]


def test_stats_and_summary_report_the_reserved_bytes():
    layers = make_blocks()
    sim = SimulatedDevice(host_page=PAGE)
    handle = apply_offloading(layers, num_layers=6, device=sim, min_tensor_size_to_offload=1)
    train_step(layers, 1000)
    d = handle.stats().to_dict()
    assert d["pinned_host_bytes_reserved"] == d["pinned_host_bytes_reserved_peak"] > 0
    assert d["pinned_host_bytes_needed"] == d["pinned_host_bytes_reserved_peak"]
    assert d["pinned_host_memory"] == "simulated, blocks of whole 4096-byte pages"
    line = next(ln for ln in handle.stats().summary().splitlines() if "reserved" in ln)
    mib = d["pinned_host_bytes_reserved"] / 2**20
    ratio = d["pinned_host_bytes_reserved_peak"] / d["pinned_host_bytes_peak"]
    assert line == (f"pinned host memory reserved: {mib:.1f} MiB at most ({ratio:.2f}x the peak "
                    f"in use), {mib:.1f} MiB now; simulated, blocks of whole 4096-byte pages")


def test_reserved_memory_over_ten_percent_is_warned_about_once():
    """Power-of-two blocks (torch's allocator) reserve about 1.4x here: once the first step is
    over, one warning says how much, for how much offloaded, and where the blocks come from."""
    layers = make_blocks(64, 256)
    handle = apply_offloading(layers, num_layers=6, device=Pow2Device(),
                              min_tensor_size_to_offload=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(4):
            train_step(layers, 1000)
    ours = [str(w.message) for w in record if "pinned host memory is reserved" in str(w.message)]
    assert len(ours) == 1
    d = handle.stats().to_dict()
    reserved, held = d["pinned_host_bytes_reserved"], d["pinned_host_bytes_peak"]
    assert reserved > 1.1 * held
    assert f"({reserved / held:.2f}x, over 1.10x)" in ours[0]
    assert "Its blocks are power-of-two blocks (simulated)" in ours[0]
    assert record[0].filename == __file__  # points at the caller's line


def test_exact_blocks_give_no_such_warning():
    layers = make_blocks()
    apply_offloading(layers, num_layers=6, device=SimulatedDevice(host_page=PAGE),
                     min_tensor_size_to_offload=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            train_step(layers, 1000)
    assert not [w for w in record if "cpu_offload" in str(w.message)]


@pytest.mark.parametrize("device", [SimulatedDevice, Pow2Device])
def test_max_host_bytes_counts_reserved_bytes(device):
    """The budget holds for what the host reserves (page or power-of-two rounding included),
    the rest stays on the device, gradients are unchanged, and the warning names the budget,
    the bytes needed and the fix."""
    layers = make_blocks()
    ref = train_step(layers, 1000)
    probe = apply_offloading(layers, num_layers=6, device=device(),
                             min_tensor_size_to_offload=1)
    train_step(layers, 1000)
    everything = probe.stats().to_dict()["pinned_host_bytes_reserved"]
    probe.remove()
    budget = everything // 2
    sim = device()
    seen = []
    handle = apply_offloading(layers, num_layers=6, device=sim, min_tensor_size_to_offload=1,
                              max_host_bytes=budget)
    pool = handle.synchronizer.rt.pool
    for layer in layers:  # the pool's reservation after every layer's forward
        layer.register_forward_hook(lambda *a: seen.append(pool.reserved_bytes))
    with pytest.warns(UserWarning) as record:
        assert_same(train_step(layers, 1000), ref)
    for _ in range(2):
        assert_same(train_step(layers, 1000), ref)
    assert max(seen) <= budget and sim.host_bytes_allocated <= budget
    d = handle.stats().to_dict()
    kept = d["skipped_bytes"]["over max_host_bytes"]
    assert kept > 0 and d["pinned_host_bytes_needed"] == d["pinned_host_bytes_reserved_peak"] + kept
    message = next(str(w.message) for w in record if "max_host_bytes" in str(w.message))
    assert re.search(
        rf"would exceed max_host_bytes={budget} \(.*\): layer \d saves a tensor of \d+ bytes, "
        r"which needs \d+ bytes of pinned memory reserved.*raise max_host_bytes.*offload fewer "
        r"layers \(num_layers\)", message)


def test_changing_shapes_stay_exact_and_the_reservation_follows_them():
    """Sequence lengths that change between steps (every shape twice): bit-identical steps,
    and from the second step of each shape on, within 5% of what it offloads."""
    layers = make_blocks()
    refs = {seq: train_step(layers, seq) for seq in (1000, 600, 1500)}
    sim = SimulatedDevice(host_page=PAGE)
    handle = apply_offloading(layers, num_layers=6, device=sim, min_tensor_size_to_offload=1)
    previous = None
    for seq in (1000, 1000, 600, 600, 1500, 1500, 1000, 1000):
        assert_same(train_step(layers, seq), refs[seq])
        d = handle.stats().to_dict()
        if seq == previous:
            assert d["pinned_host_bytes_reserved_peak"] <= 1.05 * d["copied_out_bytes"], seq
        previous = seq


def test_host_memory_does_not_grow_over_hundreds_of_steps():
    layers = make_blocks(16, 48, n=4)
    sim = SimulatedDevice(host_page=PAGE)
    handle = apply_offloading(layers, num_layers=2, device=sim, min_tensor_size_to_offload=1)
    train_step(layers, 300)
    pool = handle.synchronizer.rt.pool
    reserved, allocations = pool.reserved_bytes, pool.allocations
    gc.collect()
    gc.disable()
    try:
        for _ in range(200):
            train_step(layers, 300)
            assert handle.synchronizer.held_host_bytes() == 0 and pool.in_use_bytes == 0
            assert sim.pending_ops() == 0
        assert (pool.reserved_bytes, pool.allocations) == (reserved, allocations)
        assert gc.collect() == 0
    finally:
        gc.enable()
