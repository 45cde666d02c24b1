"""How many kernel launches may wait on the device before CUDA blocks the host.

The streamed optimizer queues each chunk's kernels on a stream that waits for the chunk's copy
in, so they wait for the link. This probe, with plain torch (no ``cpu_offload``), makes a
stream wait for a sleeping one and launches small kernels on it, timing each launch on the
host: the first launch that blocks tells how deep the queue is; a second case spreads the
waiting launches over two streams (is the limit per stream or per device?). On a GPU::

    python benchmarks/launch_queue_probe.py

Prints a table: per case, the launches queued before the first one that blocked the host, how
long that one blocked (about the sleep: it waits until the device starts draining), and the
median launch time against launches that do not wait (the baseline, same run).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional, Sequence

import torch

from plain_table import format_table

BLOCKED_S = 1e-3  # a launch this slow waited for the device, not for the host


def first_blocked(times_s: Sequence[float], threshold_s: float = BLOCKED_S) -> Optional[int]:
    """The index of the first launch that took ``threshold_s`` or more (``None``: none did).

    Example::

        >>> first_blocked([5e-6, 6e-6, 0.2, 5e-6])
        2
        >>> first_blocked([5e-6, 6e-6]) is None
        True
    """
    return next((i for i, t in enumerate(times_s) if t >= threshold_s), None)


def launches(streams: list, launches_per_stream: int, sleep_s: float) -> list[float]:
    """Host seconds of each launch: each of ``streams`` waits for a stream that sleeps
    ``sleep_s`` (none if 0), then takes ``launches_per_stream`` small kernels, in turns."""
    x = torch.zeros(1024, device="cuda")
    sleeper = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(sleeper):
        if sleep_s:
            torch.cuda._sleep(int(sleep_s * 2e9))  # cycles: about ``sleep_s`` at 1.5-2 GHz
        ev = torch.cuda.Event()
        ev.record(sleeper)
    for s in streams:
        s.wait_event(ev)
    out = []
    for _ in range(launches_per_stream):
        for s in streams:
            with torch.cuda.stream(s):
                t0 = time.perf_counter()
                x.add_(1)
                out.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return out


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=3000, help="launches per case (default 3000)")
    p.add_argument("--sleep-s", type=float, default=0.3, help="how long the waited-for stream sleeps")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_queue_probe: needs CUDA (it measures the GPU's launch queue); nothing to do")
        return []
    launches([torch.cuda.Stream()], 100, 0.0)  # warm-up: context, kernels loaded
    cases = [("no wait (baseline)", 1, 0.0), ("one waiting stream", 1, args.sleep_s),
             ("two waiting streams", 2, args.sleep_s)]
    rows = []
    for name, n, sleep_s in cases:
        t = launches([torch.cuda.Stream() for _ in range(n)], args.launches // n, sleep_s)
        k = first_blocked(t)
        rows.append({"case": name, "queued before blocking": k,
                     "blocked ms": None if k is None else round(t[k] * 1e3, 1),
                     "median launch us": round(statistics.median(t) * 1e6, 1)})
    base = rows[0]["median launch us"]
    print(format_table(["case", "queued before blocking", "blocked ms", "median launch us", "x baseline"],
                       [[*r.values(), f"{r['median launch us'] / base:.2f}"] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
