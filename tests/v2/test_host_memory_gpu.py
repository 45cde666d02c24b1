"""Pinned host memory at the byte on a real GPU (marked ``gpu``, skipped without CUDA): blocks
page-locked at exact size by the driver, unregistered with their last view, on the GPU's NUMA
node; V2 within 5% of what it offloads, reported, with torch's allocator untouched."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from cpu_offload import CudaDevice, apply_offloading
from cpu_offload.core import driver
from cpu_offload.core.host_memory import page_rounded
from cpu_offload.core.numa import gpu_numa_node
from cpu_offload.examples.mlp import ResidualMlp as Block

from test_host_memory import assert_same

pytestmark = pytest.mark.gpu


def torch_pinned_bytes() -> int:
    """Bytes of pinned blocks torch's host allocator holds (the key changed across releases)."""
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current", "segment_bytes.current"):
        if key in stats:
            return stats[key]
    if not stats:  # nothing pinned by torch yet
        return 0
    raise AssertionError(f"no byte count among torch.cuda.host_memory_stats(): {sorted(stats)}")


def test_blocks_are_page_locked_at_page_rounded_size_and_copy_exactly():
    dev = CudaDevice()
    block = dev.reserve_host(5000)
    assert dev.host_memory().exact, dev.host_memory_kind()  # the reason, where it is not
    assert block.numel() == page_rounded(5000) == dev.host_block_size(5000)
    assert block.is_pinned()
    src = torch.randint(0, 256, (block.numel(),), dtype=torch.uint8, device="cuda")
    back = torch.empty_like(src)
    stream = dev.new_stream()
    dev.copy_after_compute(stream, [(block, src.untyped_storage())])  # as V2 queues them
    dev.wait_stream(dev.current_stream(), stream)
    dev.copy_after_compute(stream, [(back, block)])
    torch.cuda.synchronize()
    assert torch.equal(back, src) and torch.equal(block, src.cpu())


def test_a_block_is_unregistered_when_its_last_view_dies(monkeypatch):
    reg = driver.host_registration()
    results = []
    unregister = reg.unregister
    monkeypatch.setattr(reg, "unregister", lambda a, i: results.append(unregister(a, i)) or 0)
    block = CudaDevice().reserve_host(1 << 20)
    view = block[4096:8192]
    del block
    gc.collect()
    assert results == []  # the view keeps the mapping, registered
    del view
    assert results == [0]  # unregistered by the driver, then unmapped


def test_blocks_sit_on_the_gpus_numa_node():
    node = gpu_numa_node(torch.cuda.current_device())
    if node is None:
        pytest.skip("the host exposes no NUMA node for this GPU")
    dev = CudaDevice()
    block = dev.reserve_host(4 << 20)
    assert dev.host_memory_kind().endswith(f"on NUMA node {node}")
    with open("/proc/self/numa_maps") as f:
        line = next(ln for ln in f if int(ln.split()[0], 16) == block.data_ptr())
    assert f"prefer:{node}" in line and f" N{node}=" in line, line


def gpu_blocks(hidden=1024, ffn=4096, n=8):
    torch.manual_seed(0)
    return nn.ModuleList([Block(hidden, ffn) for _ in range(n)]).cuda().to(torch.bfloat16)


def gpu_step(layers, x):
    h = x * 1.0
    for layer in layers:
        h = layer(h)
    h.float().square().mean().backward()
    out = [h.detach(), x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    x.grad = None
    for p in layers.parameters():
        p.grad = None
    return out


def test_v2_reserves_within_five_percent_of_what_it_offloads(deterministic):
    layers = gpu_blocks()
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = gpu_step(layers, x)
    torch_before = torch_pinned_bytes()
    handle = apply_offloading(layers, num_layers=6)
    for _ in range(3):
        assert_same(gpu_step(layers, x), ref)
        d = handle.stats().to_dict()
        assert d["copied_out_bytes"] > 100 * 2**20
        assert d["pinned_host_bytes_reserved_peak"] <= 1.05 * d["copied_out_bytes"], d
    assert "page-locked at exact size (cuMemHostRegister)" in handle.stats().summary()
    assert torch_pinned_bytes() == torch_before  # none of it from torch's allocator
    handle.remove()


def test_torch_pinned_blocks_are_reported_at_the_size_torch_reserves(deterministic):
    layers = gpu_blocks(512, 2048)
    x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ref = gpu_step(layers, x)
    handle = apply_offloading(layers, num_layers=6, device=CudaDevice(exact_host_memory=False))
    assert_same(gpu_step(layers, x), ref)
    d = handle.stats().to_dict()
    blocks = list(handle.synchronizer.rt.pool._blocks.values())
    assert all(b.numel() & (b.numel() - 1) == 0 for b in blocks)  # powers of two
    assert d["pinned_host_bytes_reserved"] == sum(b.numel() for b in blocks)
    assert torch_pinned_bytes() >= d["pinned_host_bytes_reserved"]  # torch holds them
    assert d["pinned_host_memory"].startswith("torch's pinned allocator (power-of-two blocks)")
    handle.remove()
