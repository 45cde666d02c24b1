"""How the offloaded parameters are split between the CPU update and the streamed device update
(``stream_fraction``): the argument check, the rates it balances, and the balance itself.

The CPU path moves the model dtype's bytes per parameter each way (gradient out, parameter in)
and is bound by the CPU update rate; the streamed path moves the master weights and the state
each way (12 B for bf16 AdamW, 8 B for fp32: an fp32 parameter is its own master) and is bound by
the link. Both run at once (the CPU worker during the streamed update), so the CPU share ``x``
of ``N`` offloaded parameters is chosen so that they finish together::

    x * N / cpu_rate = (x * cpu_bytes + (1 - x) * stream_bytes) * N / link_rate
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..core.device import OffloadDevice
from .cpu_update import CpuBucket, master_dtype
from .partition import choose_offloaded

_log = logging.getLogger("cpu_offload")

PROBE_ELEMS = 2**22  # CPU update probe: 4 Mi parameters
PROBE_LINK_BYTES = 64 * 2**20
# What stream_fraction="auto" plans with where the device has no nominal rates of its own: a
# model, not a timing, so that every run and every rank choose the same split. The figures are
# in-step rates of H100/H200 hosts (PCIe Gen5, 16 cores): the CPU update path inside a training
# step (1.3-1.55 G params/s, measured on both), the pinned link while the CPU works (35-46 GB/s
# each way on the H100 host, 55 on the H200 one). They give 69% streamed for bf16 AdamW; on the
# H200 host that beat 78% (the 0.9 G params/s of older measurements) at fractions 0.25 and 1,
# and tied at 0.5. On H100 hosts the best share follows the host's CPU (64-69%), and 69% loses
# least where it is not the best (docs/optimizer.md, "The host's bound"). "measure" times this
# host instead.
MODEL_RATES = {"h2d_bytes_per_s": 40e9, "d2h_bytes_per_s": 40e9, "cpu_params_per_s": 1.4e9}


def balanced_cpu_share(cpu_params_per_s: float, link_bytes_per_s: float, cpu_bytes: float,
                       stream_bytes: float) -> float:
    """The CPU share ``x`` (see the module docstring), in [0, 1].

    Example::

        >>> round(balanced_cpu_share(2.07e9, 43e9, 2, 12), 2)   # bf16 AdamW on an H100 host
        0.39
    """
    per_cpu = 1.0 / cpu_params_per_s
    denom = per_cpu + (stream_bytes - cpu_bytes) / link_bytes_per_s
    if denom <= 0:
        return 0.0
    return min(1.0, max(0.0, (stream_bytes / link_bytes_per_s) / denom))


def balanced_seconds(n_params: int, cpu_share: float, rates: dict, cpu_bytes: float,
                     stream_bytes: float) -> dict:
    """Expected CPU seconds, link seconds (each way) and their bound (the larger) for
    ``n_params`` offloaded parameters split with ``cpu_share`` on the CPU."""
    cpu = cpu_share * n_params / rates["cpu_params_per_s"]
    each_way = (cpu_share * cpu_bytes + (1 - cpu_share) * stream_bytes) * n_params
    h2d = each_way / rates["h2d_bytes_per_s"]
    d2h = each_way / rates["d2h_bytes_per_s"]
    return {"cpu_s": cpu, "h2d_s": h2d, "d2h_s": d2h, "bound_s": max(cpu, h2d, d2h)}


class LinkProbe:
    """Pinned host and device buffers of ``nbytes`` and two side streams, for timing copies in
    both directions at once (through ``device``)."""

    def __init__(self, device: OffloadDevice, where: torch.device, nbytes: int = PROBE_LINK_BYTES) -> None:
        self.device, self.nbytes = device, nbytes
        self.up, self.down = device.alloc_host(nbytes), device.alloc_host(nbytes)
        self.dev_a, self.dev_b = device.alloc_device(nbytes, where), device.alloc_device(nbytes, where)
        self.s1, self.s2 = device.new_stream(), device.new_stream()
        start = device.record_event(device.current_stream())
        device.wait_event(self.s1, start)
        device.wait_event(self.s2, start)

    def round(self) -> float:
        """One copy each way, at once; seconds until both have landed."""
        dev = self.device
        t0 = time.perf_counter()
        dev.copy(self.s1, self.dev_a, self.up)
        dev.copy(self.s2, self.down, self.dev_b)
        dev.wait_host(dev.record_event(self.s1))
        dev.wait_host(dev.record_event(self.s2))
        return time.perf_counter() - t0

    def rate(self, repeats: int = 3) -> float:
        """Bytes per second each way, both directions copying at once: the best of ``repeats``
        rounds after a warm-up one."""
        self.round()
        return self.nbytes / max(min(self.round() for _ in range(repeats)), 1e-9)

    def close(self) -> None:
        """The compute stream waits for the copies (the device buffers may be freed)."""
        compute = self.device.current_stream()
        self.device.wait_event(compute, self.device.record_event(self.s1))
        self.device.wait_event(compute, self.device.record_event(self.s2))


def measure_link(device: OffloadDevice, where: torch.device, nbytes: int = PROBE_LINK_BYTES,
                 repeats: int = 3) -> tuple[float, float]:
    """Bytes per second host -> device and device -> host with both directions copying at once
    (pinned memory, through ``device``); the best of ``repeats`` after a warm-up."""
    probe = LinkProbe(device, where, nbytes)
    try:
        rate = probe.rate(repeats)
    finally:
        probe.close()
    return rate, rate


def measure_cpu_rate(update: Callable[[], None], threads: int, elems: int, repeats: int = 2,
                     busy: Optional[Callable[[], Any]] = None) -> float:
    """Parameters per second of ``update`` (one CPU update of ``elems`` parameters), run on a
    thread with ``threads`` intra-op threads as the worker does; the best of ``repeats`` after
    a warm-up. ``busy``: called over and over on the calling thread meanwhile (copies over the
    link: in a step the CPU update shares host memory bandwidth with them)."""
    result: list[float] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            torch.set_num_threads(threads)
            update()
            best = math.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                update()
                best = min(best, time.perf_counter() - t0)
            result.append(elems / max(best, 1e-9))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            error.append(exc)

    t = threading.Thread(target=run, name="cpu_offload-optim-probe")
    t.start()
    while busy is not None and t.is_alive():
        busy()
    t.join()
    if error:
        raise error[0]
    return result[0]


def cpu_update_probe(dtype: torch.dtype, make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                     hypers: dict, chunk_elems: int, elems: int = PROBE_ELEMS,
                     fp32_masters: bool = True) -> tuple[Callable[[], None], int]:
    """A CPU update of ``elems`` parameters of ``dtype`` as the CPU path runs it (a ``CpuBucket``:
    conversion, chunked steps, write-back), and ``elems``; for ``measure_cpu_rate``."""
    x = torch.zeros(elems, dtype=dtype)
    bucket = CpuBucket([x], [0], [x], [hypers], make_optimizer, chunk_elems, fp32_masters)
    grad, out = torch.full_like(x, 1e-3), torch.empty_like(x)
    scratch = torch.empty(bucket.scratch_elems, dtype=torch.float32)
    return (lambda: bucket.update([grad], [out], scratch, [hypers], None)), elems


def planning_rates(device: OffloadDevice) -> dict:
    """The rates ``stream_fraction="auto"`` plans with: the device's nominal ones (simulations),
    else ``MODEL_RATES``. No timing: the same on every run and rank."""
    fixed = device.nominal_rates()
    return dict(fixed if fixed is not None else MODEL_RATES)


def agreed(rates: dict) -> dict:
    """Rank 0's ``rates`` on every rank of the default process group (if one is running), so
    that every replica chooses the same split."""
    try:
        import torch.distributed as dist
    except ImportError:  # torch built without distributed
        return rates
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return rates
    box = [rates]
    dist.broadcast_object_list(box, src=0)
    return dict(box[0])


def rates(device: OffloadDevice, where: torch.device,
          make_cpu_probe: Callable[[], tuple[Callable[[], None], int]], threads: int) -> dict:
    """``device.nominal_rates()`` if it has them (simulations), else measured: the link both ways
    at once, then the CPU update while that traffic keeps running (as in a step); rank 0's
    measurement on every rank (``agreed``). ``make_cpu_probe()`` returns ``cpu_update_probe``'s
    pair; it is called only to measure."""
    fixed = device.nominal_rates()
    if fixed is not None:
        return dict(fixed)
    cpu_probe, elems = make_cpu_probe()
    link = LinkProbe(device, where)
    try:
        rate = link.rate()
        cpu = measure_cpu_rate(cpu_probe, threads, elems, busy=link.round)  # under link traffic
    finally:
        link.close()
    return agreed({"h2d_bytes_per_s": rate, "d2h_bytes_per_s": rate, "cpu_params_per_s": cpu})


def stream_share(fraction: Union[str, float], rates_fn: Callable[[], dict], cpu_bytes: float,
                 stream_bytes: float) -> tuple[float, Optional[dict]]:
    """The streamed share for ``fraction`` (``"auto"``/``"measure"``: balanced from
    ``rates_fn()``), and the rates used (``None`` for a fixed fraction)."""
    if not isinstance(fraction, str):
        return float(fraction), None
    r = rates_fn()
    link = min(r["h2d_bytes_per_s"], r["d2h_bytes_per_s"])
    return 1.0 - balanced_cpu_share(r["cpu_params_per_s"], link, cpu_bytes, stream_bytes), r


def split(params: Sequence[torch.Tensor], fraction: Union[str, float], state_elems: int,
          rates_fn: Callable[[], dict], log: bool = True, fp32_masters: bool = True) -> tuple[set, dict]:
    """Which of ``params`` (offloaded, earliest gradient first) stay on the CPU path: the first
    ``1 - share`` of the elements, where ``share`` is ``fraction`` or, for ``"auto"``, the
    balanced streamed share (logged when ``log``). Returns their positions and the plan
    (``stream_fraction``, bytes per parameter each way on each path, the rates used or None).

    Bytes per parameter each way: the CPU path moves the model dtype (gradient out, parameter
    in); the streamed one the master (low-precision parameters with ``fp32_masters`` only:
    others are their own master) and ``state_elems`` state tensors of the master dtype.
    """
    numels = [p.numel() for p in params]
    total = sum(numels) or 1
    cpu_bytes = sum(n * p.element_size() for n, p in zip(numels, params)) / total
    md = [master_dtype(p.dtype, fp32_masters) for p in params]
    stream_bytes = sum(n * ((m.itemsize if m != p.dtype else 0) + state_elems * m.itemsize)
                       for n, p, m in zip(numels, params, md)) / total
    share, used = stream_share(fraction, rates_fn, cpu_bytes, stream_bytes)
    if used is not None and log:
        _log.info("HybridDeviceOptimizer: stream_fraction=%r chose %.3f of the offloaded "
                  "parameters streamed (CPU update %.2f G params/s, link %.1f / %.1f GB/s "
                  "host->device / device->host; %.1f B/param streamed, %.1f on the CPU path)",
                  fraction, share, used["cpu_params_per_s"] / 1e9, used["h2d_bytes_per_s"] / 1e9,
                  used["d2h_bytes_per_s"] / 1e9, stream_bytes, cpu_bytes)
    on_cpu = set(choose_offloaded(numels, list(range(len(params))), 1.0 - share))
    return on_cpu, {"stream_fraction": share, "cpu_bytes": cpu_bytes,
                    "stream_bytes": stream_bytes, "rates": used}


__all__ = ["agreed", "balanced_cpu_share", "balanced_seconds", "cpu_update_probe", "planning_rates",
           "LinkProbe", "measure_cpu_rate", "measure_link", "rates", "split", "stream_share"]
