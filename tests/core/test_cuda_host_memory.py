"""``CudaHostMemory`` on the CPU, with the driver's registration stood in for: blocks of whole
pages bound to the GPU's NUMA node, registered, unregistered with their last view; and the
fallback to torch's power-of-two blocks, with the reason in ``kind``."""
from __future__ import annotations

import gc

import pytest

from cpu_offload.core import host_memory
from cpu_offload.core.host_memory import PAGE, CudaHostMemory, page_rounded, power_of_two


class FakeDriver:
    """``HostRegistration``'s calls, recorded; ``register`` answers ``rc``."""

    def __init__(self, rc=0):
        self.rc = rc
        self.registered, self.unregistered = [], []

    def register(self, address, nbytes, index):
        self.registered.append((address, nbytes, index))
        return self.rc

    def unregister(self, address, index):
        self.unregistered.append((address, index))
        return 0


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(host_memory, "host_registration", lambda: driver)
    monkeypatch.setattr(host_memory, "gpu_numa_node", lambda index: 0)
    return driver


def test_a_block_is_whole_pages_registered_and_unregistered_with_its_last_view(fake):
    mem = CudaHostMemory(3)
    assert mem.block_size(5000) == page_rounded(5000) == 2 * PAGE
    block = mem.allocate(5000)
    address = block.data_ptr()
    assert block.numel() == 2 * PAGE and address % PAGE == 0
    assert fake.registered == [(address, 2 * PAGE, 3)]
    view = block[100:200]
    del block
    gc.collect()
    assert fake.unregistered == []
    view.fill_(1)  # the mapping is still there
    del view
    assert fake.unregistered == [(address, 3)]


def test_blocks_are_bound_to_the_gpus_node_before_they_are_touched(fake):
    mem = CudaHostMemory(0)
    block = mem.allocate(PAGE)
    assert mem.kind == "page-locked at exact size (cuMemHostRegister), on NUMA node 0"
    with open("/proc/self/numa_maps") as f:
        line = next(ln for ln in f if int(ln.split()[0], 16) == block.data_ptr())
    assert "prefer:0" in line


def test_placement_is_left_to_the_kernel_when_switched_off_or_unknown(fake, monkeypatch):
    mem = CudaHostMemory(0, numa=False)
    mem.allocate(PAGE)
    assert mem.kind.endswith("NUMA placement off")
    monkeypatch.setattr(host_memory, "gpu_numa_node", lambda index: None)
    mem = CudaHostMemory(0)
    mem.allocate(PAGE)
    assert mem.kind.endswith("the host exposes no NUMA node for this GPU")


def test_a_refused_registration_falls_back_to_torch_and_says_why(fake):
    fake.rc = 801  # CUDA_ERROR_NOT_SUPPORTED
    mem = CudaHostMemory(0)
    assert mem._registered(PAGE) is None
    assert not mem.exact and mem.block_size(5000) == power_of_two(5000) == 8192
    assert mem.kind == ("torch's pinned allocator (power-of-two blocks): cuMemHostRegister "
                        "failed with CUresult 801")


def test_out_of_memory_is_an_error_not_a_fallback(fake):
    fake.rc = 2
    mem = CudaHostMemory(0)
    with pytest.raises(RuntimeError, match="page-locking 4096 bytes failed: out of memory"):
        mem.allocate(PAGE)
    assert mem.exact


def test_without_the_driver_or_switched_off_blocks_come_from_torch(monkeypatch):
    monkeypatch.setattr(host_memory, "host_registration", lambda: None)
    assert CudaHostMemory(0).kind.endswith(
        "the CUDA driver library is not available to register host memory")
    assert CudaHostMemory(0, exact=False).kind.endswith("exact-size blocks are switched off")


def test_the_environment_switches_reach_the_cuda_device(monkeypatch):
    from cpu_offload import CudaDevice

    monkeypatch.setenv("CPU_OFFLOAD_EXACT_PINNED", "0")
    monkeypatch.setenv("CPU_OFFLOAD_PINNED_NUMA", "off")
    dev = CudaDevice()
    assert (dev.exact_host_memory, dev.numa_binding) == (False, False)
    dev = CudaDevice(exact_host_memory=True, numa_binding=True)
    assert (dev.exact_host_memory, dev.numa_binding) == (True, True)
