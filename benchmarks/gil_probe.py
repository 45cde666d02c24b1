"""How much the interpreter lock slows the CPU optimizer update when the training thread is busy.

The CPU part updates its buckets on a worker thread, chunk by chunk: each chunk is a few large
torch calls (which let the interpreter lock go while they run) and some Python between them
(which needs it back). Meanwhile the training thread runs ``step()``'s Python (queuing the
streamed chunks, the device part) and the next forward. This probe, with plain torch (no
``cpu_offload``), times the CPU path of a chunked update (bf16 gradient to fp32, fused AdamW,
fp32 to the bf16 parameter) on a worker thread while the main thread is idle, runs Python that
calls a small torch op now and then (as queuing code does), or runs Python only, under the
interpreter's default switch interval (5 ms) and a shorter one::

    python benchmarks/gil_probe.py

Prints per case the update's time and its ratio to the idle main thread measured in the same
round (best of ``--rounds``).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Callable, Optional

import torch

from plain_table import format_table

CASES = ("idle", "python + torch calls", "python only")


class ChunkedUpdate:
    """The CPU path of one bucket of ``elems`` parameters, ``chunk`` elements at a time: the
    fused kernel called directly, or (``optimizer=True``) one ``torch.optim.AdamW(fused=True)``
    per chunk stepped as the library's CPU part steps its chunk optimizers (``step()``'s own
    Python and small torch calls each take the lock back)."""

    def __init__(self, elems: int, chunk: int, optimizer: bool = False) -> None:
        self.param = torch.zeros(elems, dtype=torch.bfloat16)
        self.grad = torch.randn(elems).to(torch.bfloat16)
        self.master = torch.zeros(elems)
        self.g32 = torch.empty(chunk)
        self.m, self.v = torch.zeros(elems), torch.zeros(elems)
        self.step = torch.ones(())  # the first step (0 would divide by zero in the bias correction)
        self.ranges = [(i, min(i + chunk, elems)) for i in range(0, elems, chunk)]
        self.optimizers = None
        if optimizer:
            self.keys = [self.master[a:b].view(b - a) for a, b in self.ranges]
            self.optimizers = [torch.optim.AdamW([k], lr=1e-3, weight_decay=0.01, fused=True)
                               for k in self.keys]

    def run(self) -> float:
        """Seconds for one update of every chunk."""
        t0 = time.perf_counter()
        for k, (a, b) in enumerate(self.ranges):
            g = self.g32[: b - a]
            g.copy_(self.grad[a:b])
            if self.optimizers is not None:
                self.keys[k].grad = g
                self.optimizers[k].step()
                self.keys[k].grad = None
            else:
                torch._fused_adamw_([self.master[a:b]], [g], [self.m[a:b]], [self.v[a:b]], [],
                                    [self.step], lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                                    eps=1e-8, amsgrad=False, maximize=False)
            self.param[a:b].copy_(self.master[a:b])
        return time.perf_counter() - t0


def main_thread_load(case: str, stop: threading.Event) -> Callable[[], None]:
    """What the main thread does while the worker updates."""
    small = torch.zeros(16)

    def load() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            if case == "python + torch calls" and n % 200 == 0:
                small.add_(1)  # a launch-sized torch call: lets the lock go for a moment
    return load


def timed(update: ChunkedUpdate, case: str) -> float:
    stop, out = threading.Event(), []
    worker = threading.Thread(target=lambda: out.append(update.run()))
    worker.start()
    if case != "idle":
        load = threading.Thread(target=main_thread_load(case, stop))  # stands in for the main thread
        load.start()
    worker.join()
    stop.set()
    if case != "idle":
        load.join()
    return out[0]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elems", type=int, default=1 << 25, help="parameters updated (default 32M)")
    p.add_argument("--chunk", type=int, default=1 << 21, help="elements per chunk (default 2M)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--intervals-ms", default="5,0.5", help="comma list of switch intervals")
    p.add_argument("--paths", default="kernel,optimizer",
                   help="comma list: 'kernel' (the fused kernel called directly), 'optimizer' "
                        "(torch.optim.AdamW(fused=True).step() per chunk)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    paths = args.paths.split(",")
    if not set(paths) <= {"kernel", "optimizer"}:
        p.error(f"--paths: 'kernel' and/or 'optimizer', not {args.paths!r}")
    updates = {path: ChunkedUpdate(args.elems, args.chunk, optimizer=path == "optimizer")
               for path in paths}
    for update in updates.values():
        update.run()  # warm-up: pages touched, kernels loaded
    before = sys.getswitchinterval()
    rows = []
    try:
        for ms in (float(x) for x in args.intervals_ms.split(",")):
            sys.setswitchinterval(ms / 1e3)
            for path, update in updates.items():
                best = {c: min(timed(update, c) for _ in range(args.rounds)) for c in CASES}
                for c in CASES:
                    rows.append({"switch ms": ms, "path": path, "main thread": c,
                                 "update ms": best[c] * 1e3, "x idle": best[c] / best["idle"]})
    finally:
        sys.setswitchinterval(before)
    n_chunks = len(next(iter(updates.values())).ranges)
    print(f"{args.elems / 1e6:.0f}M params in {n_chunks} chunks, {args.threads} threads")
    print(format_table(["switch ms", "path", "main thread", "update ms", "x idle"],
                       [[f"{r['switch ms']:.1f}", r["path"], r["main thread"], f"{r['update ms']:.1f}",
                         f"{r['x idle']:.2f}"] for r in rows]))
    return rows


if __name__ == "__main__":
    main()
