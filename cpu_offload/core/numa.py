"""Which NUMA node a GPU hangs off, and host memory placed on it.

A copy between a GPU and host memory on another socket crosses the inter-socket link as well as
PCIe; where the host exposes the GPU's node (sysfs ``numa_node`` of its PCI device), pinned
buffers go there (``bind_to_node``) and the optimizer's CPU worker runs on its cores. Everything
here reads sysfs or asks the kernel, and answers ``None`` where the host does not say: a
single-node machine, a container without sysfs, a kernel without ``mbind``.
"""
from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path
from typing import Optional

import torch

SYSFS = "/sys"
# mbind(2)'s system call number by machine (glibc has no wrapper; libnuma is not always there).
_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259}
_MPOL_PREFERRED = 1  # pages on the node while it has free memory, elsewhere after that


def cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (a sysfs CPU or node list) as numbers.

    Example::

        >>> from cpu_offload.core.numa import cpu_list
        >>> cpu_list("0-3,8,10-11\\n")
        [0, 1, 2, 3, 8, 10, 11]
    """
    out: list[int] = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def gpu_numa_node(cuda_index: Optional[int], sysfs: str = SYSFS) -> Optional[int]:
    """The NUMA node of GPU ``cuda_index`` where the host exposes it (its PCI device's
    ``numa_node`` in sysfs), else None (also for ``-1``, what single-node hosts report).

    Example::

        >>> from cpu_offload.core.numa import gpu_numa_node
        >>> gpu_numa_node(None) is None
        True
    """
    if cuda_index is None:
        return None
    try:
        props = torch.cuda.get_device_properties(cuda_index)
        bdf = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        node = int(Path(f"{sysfs}/bus/pci/devices/{bdf}/numa_node").read_text())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None
    return node if node >= 0 else None


def gpu_numa_cpus(cuda_index: Optional[int], sysfs: str = SYSFS) -> Optional[list[int]]:
    """The CPUs of the NUMA node of GPU ``cuda_index`` where the host exposes it, else None.

    Example::

        >>> from cpu_offload.core.numa import gpu_numa_cpus
        >>> gpu_numa_cpus(None) is None
        True
    """
    node = gpu_numa_node(cuda_index, sysfs)
    if node is None:
        return None
    try:
        return cpu_list(Path(f"{sysfs}/devices/system/node/node{node}/cpulist").read_text())
    except (OSError, ValueError):
        return None


def bind_to_node(address: int, length: int, node: int) -> Optional[str]:
    """Ask the kernel to place the pages of ``[address, address + length)`` (a mapping not
    touched yet) on NUMA node ``node``, falling back to other nodes once it is full
    (``MPOL_PREFERRED``). Returns None on success, else why not (the memory is then placed as
    the process's policy says, which is no error).

    Example::

        >>> import mmap, torch
        >>> from cpu_offload.core.numa import bind_to_node
        >>> m = mmap.mmap(-1, mmap.PAGESIZE)
        >>> why = bind_to_node(torch.frombuffer(m, dtype=torch.uint8).data_ptr(), len(m), 0)
        >>> why is None or isinstance(why, str)
        True
    """
    number = _MBIND.get(platform.machine())
    if number is None or not hasattr(os, "sched_getaffinity"):
        return f"mbind is not known on {platform.system()} {platform.machine()}"
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode counts one more than the mask's bits: the kernel reads maxnode - 1 of them.
    rc = libc.syscall(number, ctypes.c_void_p(address), ctypes.c_ulong(length),
                      ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(words * 64 + 1),
                      ctypes.c_uint(0))
    if rc != 0:
        return f"mbind to node {node} failed: {os.strerror(ctypes.get_errno())}"
    return None
