"""The GPU's NUMA node from sysfs, and host memory bound to a node (``core/numa.py``)."""
from __future__ import annotations

import mmap
import types

import pytest
import torch

from cpu_offload.core import numa


def fake_sysfs(tmp_path, node: str, cpus: str = "0-3,8"):
    """A sysfs tree with one GPU at PCI 0000:1b:00.0 on ``node``."""
    dev = tmp_path / "bus/pci/devices/0000:1b:00.0"
    dev.mkdir(parents=True)
    (dev / "numa_node").write_text(node + "\n")
    n = tmp_path / "devices/system/node/node1"
    n.mkdir(parents=True)
    (n / "cpulist").write_text(cpus + "\n")
    return str(tmp_path)


@pytest.fixture
def gpu_on_bus_1b(monkeypatch):
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


def test_the_gpus_node_and_its_cpus_come_from_its_pci_device(tmp_path, gpu_on_bus_1b):
    root = fake_sysfs(tmp_path, "1")
    assert numa.gpu_numa_node(0, root) == 1
    assert numa.gpu_numa_cpus(0, root) == [0, 1, 2, 3, 8]


def test_a_host_that_exposes_no_node_answers_none(tmp_path, gpu_on_bus_1b):
    assert numa.gpu_numa_node(0, fake_sysfs(tmp_path, "-1")) is None
    assert numa.gpu_numa_node(0, str(tmp_path / "nothing")) is None
    assert numa.gpu_numa_cpus(0, str(tmp_path / "nothing")) is None


def test_the_optimizers_import_path_still_works():
    from cpu_offload.optim import worker

    assert worker.gpu_numa_cpus is numa.gpu_numa_cpus
    assert worker._cpu_list("2-3") == [2, 3]


def test_bound_memory_is_placed_by_the_preferred_policy():
    """On Linux the kernel records the policy of the range (``/proc/self/numa_maps``)."""
    m = mmap.mmap(-1, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    why = numa.bind_to_node(t.data_ptr(), len(m), 0)
    if why is not None:
        pytest.skip(why)
    t.fill_(1)  # first touch: pages placed now
    with open("/proc/self/numa_maps") as f:
        line = next(ln for ln in f if int(ln.split()[0], 16) == t.data_ptr())
    assert "prefer:0" in line
