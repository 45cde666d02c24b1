"""The host rates that bound CPU optimizer-state offloading, and the bound they give.

Measured with plain torch, not the library's optimizer: fused CPU AdamW; the CPU path of a
CPU-updated parameter (bf16 grad -> fp32, AdamW, fp32 -> bf16 param); pinned copies each way and
both at once; the CPU path under those copies and the copies under it. Then, per offloaded
fraction of ``--params``, the streamed share that minimizes the offloaded work. On a GPU::

    python benchmarks/host_rates.py

Without CUDA it is a smoke test: the "link" copies between two CPU buffers.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

# No bench_common: it imports cpu_offload (optimizer included); this probe must stay without it.
DEFAULT_ELEMS = 1 << 26  # 64M: far beyond the caches, as a model's optimizer state is
DEFAULT_THREADS = max(1, (os.cpu_count() or 2) - 1)  # one core left to the training thread
STATE_BYTES = 12  # fp32 master + exp_avg + exp_avg_sq, each way per streamed parameter
BF16_BYTES = 2  # bf16 grad down, bf16 param up, per CPU-updated parameter


@dataclass(frozen=True)
class HostRates:
    """Rates in G params/s (CPU work) and GB/s per direction (link), measured alone and
    together: offloading runs the CPU update and the copies at once, and both contend for the
    host's memory bandwidth, so the together rates are the ones a step sees."""

    adamw: float  # fused CPU AdamW alone, fp32 grads in place
    cpu_path: float  # bf16 grad -> fp32, AdamW, fp32 -> bf16 param, alone
    h2d: float
    d2h: float
    both: float  # both directions at once, each way
    cpu_path_under_dma: float  # cpu_path while the link copies both ways
    link_under_cpu: float  # both, each way, while the CPU path runs
    threads: int
    elems: int
    cuda: bool


@dataclass(frozen=True)
class SplitBound:
    """The offloaded work's time at stream share ``stream_fraction``: CPU and link run at once,
    so it takes ``seconds = max(cpu_s, link_s)``."""

    stream_fraction: float
    cpu_s: float
    link_s: float
    seconds: float


def split_bound(offloaded_params: int, rates: HostRates,
                stream_fraction: float | None = None) -> SplitBound:
    """Time of the offloaded work for ``offloaded_params`` P with a share s streamed.

    cpu_s = (1-s) P / C and link_s = P (12 s + 2 (1-s)) / L, where C is the CPU path's rate
    under DMA and L the link's per-direction rate under CPU load: in a step the two run together
    (the rates alone would overstate both), and the directions run at once, so one direction's
    bytes over the per-direction rate is the link's time. cpu_s falls and link_s rises with s, so
    max(cpu_s, link_s) is least where they cross: s* = (1 - 2r) / (1 + 10r) with r = C / L (the
    CPU's params/s over the link's B/s), clamped to [0, 1]. A given ``stream_fraction`` is
    evaluated instead of s*.
    """
    cpu_rate, link_rate = rates.cpu_path_under_dma * 1e9, rates.link_under_cpu * 1e9
    if not (cpu_rate > 0 and link_rate > 0):
        raise ValueError(f"rates must be positive: cpu {cpu_rate}, link {link_rate}")
    if stream_fraction is None:
        r = cpu_rate / link_rate
        s = 0.0 if math.isinf(r) else min(1.0, max(0.0, (1 - 2 * r) / (1 + 10 * r)))
    elif 0.0 <= stream_fraction <= 1.0:
        s = float(stream_fraction)
    else:
        raise ValueError(f"stream_fraction must be in [0, 1], got {stream_fraction}")
    cpu_s = (1 - s) * offloaded_params / cpu_rate
    link_s = offloaded_params * (STATE_BYTES * s + BF16_BYTES * (1 - s)) / link_rate
    return SplitBound(s, cpu_s, link_s, max(cpu_s, link_s))


def bound_step_s(fwd_bwd_s: float, offloaded_s: float) -> float:
    """A training step's lower bound: at best the offloaded work (each layer's update starts
    once backward has made its gradient, its parameters go back during the next forward)
    overlaps the forward+backward entirely, so the step takes the longer of the two."""
    return max(fwd_bwd_s, offloaded_s)


def _median_s(fn: Callable[[], None], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after a warmup (allocations, page faults)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _loop(fn: Callable[[], None], stop: threading.Event,
          started: threading.Event) -> list[tuple[float, float]]:
    """Call ``fn`` back to back until ``stop``; the span of each call (``started`` after one)."""
    spans = []
    while not stop.is_set():
        t0 = time.perf_counter()
        fn()
        spans.append((t0, time.perf_counter()))
        started.set()
    return spans


def _under_load(load_pool: ThreadPoolExecutor, load: Callable[[], None],
                pool: ThreadPoolExecutor, fn: Callable[[], None], reps: int, what: str) -> float:
    """``_median_s(fn)`` in ``pool`` while ``load`` loops in ``load_pool``: the load has done one
    call before timing starts and stops after it ends, and its calls' spans must cover 95% of the
    timed window, else a warning (the overlap is checked, not assumed)."""
    stop, started = threading.Event(), threading.Event()
    fut = load_pool.submit(_loop, load, stop, started)
    while not started.wait(0.05):
        if fut.done():
            fut.result()  # the load failed: raise its error
    t0 = time.perf_counter()
    try:
        median = pool.submit(_median_s, fn, reps).result()
    finally:
        t1 = time.perf_counter()
        stop.set()
        spans = fut.result()
    covered = sum(max(0.0, min(b, t1) - max(a, t0)) for a, b in spans) / (t1 - t0)
    if covered < 0.95:
        warnings.warn(f"{what}: the load covered only {covered:.0%} of the timed window")
    return median


def measure(elems: int = DEFAULT_ELEMS, threads: int = DEFAULT_THREADS, reps: int = 5,
            device: torch.device | None = None) -> HostRates:
    """Measure the rates (median of ``reps`` after one warmup) on ``elems`` elements each.

    CPU work runs in one worker thread that calls ``torch.set_num_threads(threads)``: OpenMP
    keeps the count per calling thread, but torch also stores it process-wide (threads that
    start parallel work later inherit it), so the caller's count is restored at the end. Link
    copies are driven from a second thread (pinned buffers of ``elems`` fp32 each way, one CUDA
    stream per direction); without CUDA they are CPU copies and their numbers mean nothing.
    A together rate times one side while the other loops back to back in its own thread; the
    loop's calls must cover the timed window (``_under_load`` checks it and warns otherwise).
    """
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    prev_threads = torch.get_num_threads()
    worker = ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    side = ThreadPoolExecutor(1)  # the link's thread (each stream context sets its device)
    try:
        master = torch.randn(elems, requires_grad=True)
        master.grad = torch.randn(elems) * 1e-3
        opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
        grad16 = torch.empty(elems, dtype=torch.bfloat16, pin_memory=cuda).copy_(master.grad)
        param16 = torch.empty(elems, dtype=torch.bfloat16, pin_memory=cuda)
        host_src, host_dst = (torch.zeros(elems, pin_memory=cuda) for _ in range(2))
        dev_src, dev_dst = (torch.zeros(elems, device=device) for _ in range(2))
        streams = [torch.cuda.Stream(device) for _ in range(2)] if cuda else []
        nbytes = host_src.numel() * host_src.element_size()

        @torch.no_grad()
        def cpu_path() -> None:
            master.grad.copy_(grad16)
            opt.step()
            param16.copy_(master)

        pairs = [(dev_dst, host_src), (host_dst, dev_src)]  # h2d, d2h

        def link(dirs: tuple[int, ...], n: int = 1) -> Callable[[], None]:
            """``n`` copies in each direction of ``dirs`` (one stream each), then wait for all."""
            def run() -> None:
                for _ in range(n):
                    for i in dirs:
                        with torch.cuda.stream(streams[i]) if cuda else contextlib.nullcontext():
                            pairs[i][0].copy_(pairs[i][1], non_blocking=cuda)
                for stream in streams:  # blocking events: a spinning wait would take a core
                    done = torch.cuda.Event(blocking=True)  # from the CPU path it runs beside
                    done.record(stream)
                    done.synchronize()
            return run

        if cuda:
            torch.cuda.synchronize(device)
        t_adamw, t_cpu = (worker.submit(_median_s, f, reps).result() for f in (opt.step, cpu_path))
        t_h2d, t_d2h, t_both = (side.submit(_median_s, link(d), reps).result()
                                for d in ((0,), (1,), (0, 1)))
        # One link call of n copies each way lasts about one CPU path: each covers the other's
        # calls, all of their phases (convert, update, write back) included.
        n = max(1, math.ceil(t_cpu / t_both))
        both_n = link((0, 1), n)
        t_cpu_dma = _under_load(side, both_n, worker, cpu_path, reps, "cpu_path_under_dma")
        t_link_cpu = _under_load(worker, cpu_path, side, both_n, reps, "link_under_cpu")
    finally:
        worker.shutdown()
        side.shutdown()
        torch.set_num_threads(prev_threads)
    return HostRates(
        adamw=elems / t_adamw / 1e9, cpu_path=elems / t_cpu / 1e9,
        h2d=nbytes / t_h2d / 1e9, d2h=nbytes / t_d2h / 1e9, both=nbytes / t_both / 1e9,
        cpu_path_under_dma=elems / t_cpu_dma / 1e9, link_under_cpu=n * nbytes / t_link_cpu / 1e9,
        threads=threads, elems=elems, cuda=cuda)


def rates_table(r: HostRates) -> str:
    """Markdown: each rate alone and, where measured, together with the other work."""
    rows = [("fused AdamW (G params/s)", r.adamw, None),
            ("CPU path (G params/s)", r.cpu_path, r.cpu_path_under_dma),
            ("h2d (GB/s)", r.h2d, None), ("d2h (GB/s)", r.d2h, None),
            ("both ways (GB/s each way)", r.both, r.link_under_cpu)]
    lines = ["| rate | alone | together | together/alone |", "| --- | ---: | ---: | ---: |"]
    for name, alone, together in rows:
        cells = ("-", "-") if together is None else (f"{together:.3f}", f"{together / alone:.2f}")
        lines.append(f"| {name} | {alone:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> HostRates:
    """Measure, print the rates and the split bound per offload fraction, write the JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elems", type=int, default=DEFAULT_ELEMS, help="elements per measurement")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, help="the CPU worker's threads")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--params", type=int, default=1_510_000_000, help="the model's parameters")
    p.add_argument("--fractions", default="0.25,0.5,1", help="offloaded fractions of --params")
    p.add_argument("--out", default="bench_out", help="directory for host_rates.json")
    args = p.parse_args(argv)
    rates = measure(args.elems, args.threads, args.reps)
    where = (torch.cuda.get_device_name() if rates.cuda
             else "CPU only: the link rates are CPU copies and mean nothing")
    print(f"{where}; {rates.threads} threads, {rates.elems} elements, median of {args.reps}\n")
    print(rates_table(rates))
    bounds = []
    print("\n| offloaded | params | stream share | CPU ms | link ms | bound ms |\n"
          "| ---: | ---: | ---: | ---: | ---: | ---: |")
    for f in (float(x) for x in args.fractions.split(",")):
        b = split_bound(params := round(f * args.params), rates)
        bounds.append({"fraction": f, "params": params, **asdict(b)})
        print(f"| {f:g} | {params} | {b.stream_fraction:.3f} | "
              f"{b.cpu_s * 1e3:.1f} | {b.link_s * 1e3:.1f} | {b.seconds * 1e3:.1f} |")
    path = Path(args.out) / "host_rates.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": where, "torch": torch.__version__,
                                "rates": asdict(rates), "bounds": bounds}, indent=2) + "\n")
    print(f"wrote {path}")
    return rates


if __name__ == "__main__":
    main()
