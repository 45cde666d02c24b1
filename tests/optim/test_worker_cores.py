"""``bind_cpu_cores=True``: the CPU worker (and the intra-op threads it starts) runs on physical
cores only; the launching thread keeps its own affinity."""
from __future__ import annotations

import os

import pytest
import torch

from cpu_offload import OffloadConfigError, SimulatedDevice
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload.optim import worker
from cpu_offload.optim.worker import physical_cores


def test_physical_cores_takes_one_hyperthread_per_core(tmp_path):
    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4"}
    for cpu, text in siblings.items():
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    assert physical_cores([0, 1, 2, 3, 4], sys_cpu=str(tmp_path)) == [0, 1, 4]
    assert physical_cores([2, 3], sys_cpu=str(tmp_path)) == [2, 3]
    assert physical_cores([5], sys_cpu=str(tmp_path)) == [5]  # no topology: its own core


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity")
def test_bound_worker_runs_on_its_cores_only():
    before = os.sched_getaffinity(0)
    opt = HybridDeviceOptimizer(torch.nn.Linear(4, 4).parameters(), 1.0, device=SimulatedDevice(),
                                cpu_threads=1, bind_cpu_cores=True, lr=1e-2)
    cores = opt.cpu_cores
    assert cores and set(cores) <= before
    inside = opt._worker.submit(os.sched_getaffinity, 0).result()
    assert inside == set(cores)
    assert os.sched_getaffinity(0) == before  # the launching thread is untouched
    opt.close()
    plain = HybridDeviceOptimizer(torch.nn.Linear(4, 4).parameters(), 1.0, device=SimulatedDevice(),
                                  lr=1e-2)
    assert plain.cpu_cores is None
    plain.close()


def test_bind_cpu_cores_must_be_a_bool():
    with pytest.raises(OffloadConfigError, match="bind_cpu_cores must be True or False"):
        HybridDeviceOptimizer(torch.nn.Linear(4, 4).parameters(), 1.0, device=SimulatedDevice(),
                              bind_cpu_cores="yes", lr=1e-2)


def test_default_threads_under_torchrun_are_this_process_share_of_the_cores(monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 in its workers: the CPU update would get one thread. A
    process it started (LOCAL_WORLD_SIZE set) takes its share of the physical cores instead,
    less one for the thread that launches GPU work."""
    monkeypatch.setattr(worker, "physical_cores", lambda *a, **k: list(range(32)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert worker.default_cpu_threads({"LOCAL_WORLD_SIZE": "2"}) == 15
    assert worker.default_cpu_threads({"LOCAL_WORLD_SIZE": "8"}) == 3
    assert worker.default_cpu_threads({"LOCAL_WORLD_SIZE": "64"}) == 1
    assert worker.default_cpu_threads({}) == 1  # not under torchrun: torch's own count
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert worker.default_cpu_threads({}) == max(1, min(8, os.cpu_count() or 1) - 1)
