"""The thread that runs the CPU part of the optimizer step.

One worker thread (the hybrid optimizer picks which queued bucket each job updates, see
``partition.next_update``), with its own intra-op thread count (OpenMP's is per thread): the
thread that launches GPU work keeps its core. Jobs return ``concurrent.futures.Future``s; an
exception inside a job is re-raised by whoever waits for it.
"""
from __future__ import annotations

import os
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

# The GPU's NUMA node is found in core, where pinned host memory is placed on it too.
from ..core.numa import cpu_list as _cpu_list, gpu_numa_cpus


def default_cpu_threads(environ: Optional[dict] = None) -> int:
    """All but one of the threads this process should use (at least one): torch's thread count,
    or, in a process started by ``torchrun`` (``LOCAL_WORLD_SIZE`` set), its share of this
    host's physical cores. torchrun sets ``OMP_NUM_THREADS=1`` in every worker it starts, which
    would leave the CPU update one thread (measured on 2 GPUs: DDP with a quarter offloaded took
    3.0x plain AdamW's step with one thread, 2.0x with its share); ``cpu_threads=`` still sets it
    explicitly.

    Args:
        environ: the environment to read (default ``os.environ``).

    Example::

        >>> n = default_cpu_threads({"LOCAL_WORLD_SIZE": "2"})  # one of two ranks on this host
        >>> n >= 1
        True
    """
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) > 0:
        return max(1, len(physical_cores()) // int(local) - 1)
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1) - 1)


def default_chunk_bytes(threads: int) -> int:
    """fp32 master bytes per CPU update chunk: 1 MiB per intra-op thread (each thread's share of
    a chunk's fp32 gradient and master stays near its L2), at least 4 MiB: every chunk costs one
    ``optimizer.step()`` call, 40-70 us of Python on the 2-core development machine, and a
    1-thread step of 4 MiB takes about 1 ms there."""
    return max(4, threads) * 2**20


def physical_cores(cpus: Optional[Iterable[int]] = None, sys_cpu: str = "/sys/devices/system/cpu") -> list[int]:
    """One logical CPU per physical core among ``cpus`` (default: those this process may run
    on): the lowest-numbered hyperthread sibling present, from sysfs topology (a CPU whose
    topology is unreadable counts as its own core)."""
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    chosen, seen = [], set()
    for cpu in allowed:
        try:
            siblings = tuple(_cpu_list(Path(f"{sys_cpu}/cpu{cpu}/topology/thread_siblings_list").read_text()))
        except (OSError, ValueError):
            siblings = (cpu,)
        if siblings not in seen:
            seen.add(siblings)
            chosen.append(cpu)
    return chosen


def worker_cores(threads: int, cuda_index: Optional[int] = None) -> list[int]:
    """Cores for a worker with ``threads`` intra-op threads: physical cores (one hyperthread
    each) of the GPU's NUMA node where known and allowed, leaving the first to the thread that
    launches GPU work when there are enough."""
    allowed = set(os.sched_getaffinity(0))
    local = gpu_numa_cpus(cuda_index)
    pool = physical_cores(sorted(allowed & set(local)) if local and allowed & set(local) else allowed)
    if len(pool) < threads + 1:
        pool = physical_cores(allowed)
    return pool[1: threads + 1] if len(pool) > threads else pool


def _init_thread(threads: int, cuda_index: Optional[int], cores: Optional[Sequence[int]] = None) -> None:
    if cores:  # before any parallel work: the intra-op threads inherit this thread's mask
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    if cuda_index is not None:  # copies queued from this thread target the params' GPU
        torch.cuda.set_device(cuda_index)


class CpuWorker:
    """A single background thread with ``threads`` intra-op threads; with ``cores``, it (and
    the intra-op threads it starts) runs on those CPUs only."""

    def __init__(self, threads: int, cuda_index: Optional[int] = None,
                 cores: Optional[Sequence[int]] = None) -> None:
        if threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {threads}")
        self.threads = threads
        self.cores = list(cores) if cores else None
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cpu_offload-optim",
            initializer=_init_thread, initargs=(threads, cuda_index, self.cores),
        )
        self._finalizer = weakref.finalize(self, self._pool.shutdown, False)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        """Finish queued jobs and end the thread."""
        self._finalizer.detach()
        self._pool.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in getattr(self._pool, "_threads", ()))


def wait_all(futures: list[Future]) -> list[Any]:
    """Results of ``futures`` in order, after *all* of them finished; the first error re-raised."""
    results, error = [], None
    for f in futures:
        try:
            results.append(f.result())
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after draining the rest
            results.append(None)
            error = error or exc
    if error is not None:
        raise error
    return results
