"""What an undoable CPU update costs, and what a spare copy would save (CPU only, plain torch).

The CPU part of ``HybridDeviceOptimizer`` starts a bucket's update in backward, before
``step()`` has checked that the gradients will stand; such an update must be undoable. Today it
copies what each chunk's step changes (fp32 master and AdamW state, 12 B/param) aside, then
steps in place: the originals are read, the copy is written, and the originals are written
back dirty. The alternative measured here copies the chunk into a *spare* and steps the spare
while it is in cache: the originals stay clean (the spare becomes current on success, a pointer
swap). Per chunk, with ``torch._fused_adamw_`` over fp32 masters and a bf16 gradient converted
into a scratch, as the CPU part runs it:

- ``plain``: convert, step in place, write the bf16 parameter (an update that cannot be undone);
- ``undo copy``: copy masters and state aside first, then as ``plain`` (today's early update);
- ``spare``: copy masters and state into the spare, step the spare, write from it.

Each path runs over the same elements in turn (``--rounds`` rounds), best and median G params/s
and the ratio to ``plain`` in the same round::

    python benchmarks/undo_probe.py --elems 134217728 --threads 15

On the H100 host (2026-12-06, 128M params, 15 threads, median rate against ``plain``): chunks of
15 / 4 / 1 MiB, undo copy 0.52x / 0.39x / 0.49x, spare 0.54x / 0.43x / 0.52x. The copy itself
is the cost, not writing the originals back: the spare side saves 4-9%, and the CPU part built
on it was no faster in a training step (``benchmarks/RESULTS.md``, twenty-fourth session), so
the CPU part keeps the undo copies.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional

import torch

from plain_table import format_table


def make(n: int) -> dict:
    g = torch.Generator().manual_seed(0)
    f = lambda: torch.randn(n, generator=g)  # noqa: E731
    return {"p": f(), "m": f().abs(), "v": f().abs(), "sp": torch.empty(n), "sm": torch.empty(n),
            "sv": torch.empty(n), "g16": f().to(torch.bfloat16), "out16": torch.empty(n, dtype=torch.bfloat16)}


def step(p, g, m, v, steps) -> None:
    torch._foreach_add_(steps, 1)
    torch._fused_adamw_([p], [g], [m], [v], [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                        weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)


def run(path: str, t: dict, chunk: int, scratch: torch.Tensor, steps: list) -> float:
    n = t["p"].numel()
    t0 = time.perf_counter()
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        g = scratch[: e - s]
        p, m, v = t["p"][s:e], t["m"][s:e], t["v"][s:e]
        if path == "plain":
            g.copy_(t["g16"][s:e])
        elif path == "undo copy":
            torch._foreach_copy_([t["sp"][s:e], t["sm"][s:e], t["sv"][s:e], g], [p, m, v, t["g16"][s:e]])
        else:  # spare
            torch._foreach_copy_([t["sp"][s:e], t["sm"][s:e], t["sv"][s:e], g], [p, m, v, t["g16"][s:e]])
            p, m, v = t["sp"][s:e], t["sm"][s:e], t["sv"][s:e]
        step(p, g, m, v, steps)
        t["out16"][s:e].copy_(p)
    return n / (time.perf_counter() - t0) / 1e9


def main(argv: Optional[list[str]] = None) -> dict:
    """Print the table; return the rates per path (G params/s per round)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=int, default=2**25)
    ap.add_argument("--chunk-mib", type=float, default=None, help="fp32 MiB per chunk (default: threads x 1 MiB, at least 4)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    chunk = int((a.chunk_mib or max(4, threads)) * 2**20 // 4)
    t = make(a.elems)
    scratch = torch.empty(chunk)
    steps = [torch.zeros(())]
    paths = ("plain", "undo copy", "spare")
    for path in paths:  # warm: page faults, first-touch
        run(path, t, chunk, scratch, steps)
    rates: dict = {p: [] for p in paths}
    for _ in range(a.rounds):
        for path in paths:
            rates[path].append(run(path, t, chunk, scratch, steps))
    rows = []
    for path in paths:
        ratio = statistics.median(r / b for r, b in zip(rates[path], rates["plain"]))
        rows.append([path, f"{max(rates[path]):.2f}", f"{statistics.median(rates[path]):.2f}", f"{ratio:.2f}x"])
    print(f"{a.elems} params, chunks of {chunk} elements, {threads} threads, {a.rounds} rounds")
    print(format_table(["path", "best G params/s", "median", "median rate / plain"], rows))
    return rates


if __name__ == "__main__":
    main()
