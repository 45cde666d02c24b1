"""Where one bucket's CPU update spends its time, against raw fused AdamW (CPU only).

Per worker thread count, in a ``CpuWorker`` thread as in training, each path timed round-robin
(one call of each in turn, ``--reps`` rounds, so the host's drift hits every path alike; the first
two calls of each, which allocate the optimizer state and the kept copies, are not timed). Paths, over the same elements
(a bucket shaped like a slice of a transformer layer: three large matrices, two biases, a norm):

- ``raw fused AdamW``: fp32 parameters with fp32 gradients in place, one
  ``torch.optim.AdamW(fused=True)`` over the bucket: the rate the host's update itself reaches;
- ``steps only, chunk X``: the bucket's own chunk optimizers stepped with fp32 gradients in place:
  what chunking and the class's Python work per ``step()`` cost, without any conversion;
- ``convert in`` / ``write back``: the bf16 -> fp32 gradient pass and the fp32 -> bf16 parameter
  pass alone, one ``copy_`` per parameter over the bucket (what they cost as separate passes);
- ``update, chunk X``: ``CpuBucket.update`` as the optimizer runs it: gradients read from a staging
  buffer laid out as ``transfer.Staging`` lays it out (64-byte aligned slices of one buffer),
  new parameters written back into the same slices (pinned gradients and parameters share them);
- ``update+keep, chunk X``: ``update(keep_previous=True)`` then ``commit()``: an *early* update
  (one started before ``step()`` validated the bucket), which first copies what it changes;
- ``update+GIL load, chunk X``: the update while another Python thread works (Python with a
  small op every 20 us or so, as the training thread's forward): what waiting for the GIL costs;
- ``old ...``: the same from another checkout's ``cpu_update.py`` (``--compare``), in the same
  rounds.

Chunk sizes are MiB of fp32 masters per ``optimizer.step()`` (``0``: one step per bucket;
``default``: the optimizer's default for the thread count, ``worker.default_chunk_bytes``). Each
line gives the best time as G elements/s and as a multiple of raw AdamW's best, the median's
multiple of raw's median, and page faults per call (0 in steady state: nothing is allocated).
Per thread count it also prints what one parallel region costs beyond its work after 30 us of
Python (``region_us``: OpenMP threads that went to sleep must be woken). ``--pinned`` puts the
staging in page-locked memory as training does (needs CUDA); ``--main-team`` starts the main
thread's OpenMP team first, as a training script does, ``--main-team K`` then shrinks it to K
threads (see ``microbench``).

Run (the H100 host: 16 cores; a few minutes; ``$OLD`` a checkout of the code to compare)::

    python benchmarks/cpu_update_bench.py --threads 15,8 --chunks 0,default,4,8 --pinned --compare $OLD

or through ``optim_benchmark.py --microbench-only`` (the same paths, its flags).
"""
from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

from bench_common import format_table, gc_paused, write_json  # noqa: F401 (puts the repo on sys.path)

import torch  # noqa: E402

from cpu_offload.optim import cpu_update, worker as worker_mod  # noqa: E402
from cpu_offload.optim.transfer import Staging  # noqa: E402
from cpu_offload.optim.worker import CpuWorker, worker_cores  # noqa: E402

KW = dict(lr=1e-4, weight_decay=0.1)
RAW = "raw fused AdamW"


def bucket_shapes(elems: int) -> list[tuple[int, ...]]:
    """Parameter shapes of one CPU bucket holding about ``elems`` elements, like a slice of a
    transformer layer: three large matrices, their biases and a norm weight."""
    rows = max(1, elems // 4 // 2048)
    shapes: list[tuple[int, ...]] = [(rows, 2048), (2048,), (rows, 2048), (2048,), (rows, 2048)]
    rest = elems - sum(torch.Size(s).numel() for s in shapes)
    if rest > 0:
        shapes.append((rest,))
    return shapes


def load_compared(path: str) -> tuple[ModuleType, ModuleType]:
    """``cpu_update`` and ``worker`` of another checkout (its root, or its ``cpu_update.py``),
    imported under other names in this package (their relative imports resolve here)."""
    p = Path(path)
    root = p if p.is_dir() else p.parents[2]
    mods = []
    for name in ("cpu_update", "worker"):
        file = p if name == "cpu_update" and not p.is_dir() else root / "cpu_offload" / "optim" / f"{name}.py"
        full = f"cpu_offload.optim._compared_{name}"
        spec = importlib.util.spec_from_file_location(full, file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
        mods.append(mod)
    return mods[0], mods[1]


class Raw:
    """Fused AdamW over fp32 params with fp32 grads already in place: the baseline."""

    def __init__(self, shapes: list) -> None:
        params = [torch.randn(s) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        self.opt = torch.optim.AdamW(params, fused=True, **KW)

    def __call__(self) -> None:
        self.opt.step()


class _Pinned:
    """The one device call ``Staging`` makes for pinned buffers."""

    @staticmethod
    def alloc_host(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


PINNED = [False]  # staging buffers page-locked, as in training (``--pinned``; needs CUDA)


def _staging(params: list) -> Staging:
    staging = Staging(_Pinned() if PINNED[0] else None, pinned=PINNED[0])
    staging.add_bucket(params)
    return staging


def _new_bucket(module: ModuleType, shapes: list, chunk_bytes: int):
    """A bucket of bf16 parameters as ``CpuPart`` builds one: masters from the staging slices."""
    params = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    staging = _staging(params)
    views = [staging.typed(p) for p in params]
    for v in views:
        v.copy_(torch.randn(v.shape) * 1e-3)
    hypers = [dict(KW)]
    bucket = module.CpuBucket(params, [0] * len(params), views, hypers,
                              lambda groups: torch.optim.AdamW(groups, fused=True, **KW),
                              chunk_bytes // 4)
    return bucket, views, hypers


class Update:
    """``CpuBucket.update`` of ``module`` over a staging buffer (gradients in, new parameters
    out, the same slices); ``keep``: an early update (``keep_previous=True``, then ``commit``)."""

    def __init__(self, module: ModuleType, shapes: list, chunk_bytes: int, keep: bool = False) -> None:
        self.bucket, self.views, self.hypers = _new_bucket(module, shapes, chunk_bytes)
        self.scratch = torch.empty(self.bucket.scratch_elems)
        self.keep = keep

    def __call__(self) -> None:
        self.bucket.update(self.views, self.views, self.scratch, self.hypers, None,
                           keep_previous=self.keep)
        if self.keep:
            self.bucket.commit()


class StepsOnly:
    """The bucket's chunk optimizers stepped with fp32 gradients in place (no conversion)."""

    def __init__(self, module: ModuleType, shapes: list, chunk_bytes: int) -> None:
        self.bucket, _, _ = _new_bucket(module, shapes, chunk_bytes)
        for opt in self.bucket.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.randn_like(p) * 1e-3

    def __call__(self) -> None:
        for opt in self.bucket.optimizers:
            opt.step()


class PythonLoad:
    """Another Python thread working while ``active``, as the training thread does while the
    CPU update runs (forward: module code, a small op every ``work_us`` or so, each op
    releasing the GIL): the update's Python work then waits for the GIL."""

    def __init__(self, work_us: float = 20.0) -> None:
        self.active = threading.Event()
        self._stop = False
        self._work = max(1, int(work_us * 25))  # sum(range(n)): about 40 ns per element
        self._thread = threading.Thread(target=self._run, name="python-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = torch.zeros(16)
        while not self._stop:
            if not self.active.wait(0.05):
                continue
            sum(range(self._work))
            t.add_(1)

    def close(self) -> None:
        self._stop = True
        self.active.clear()
        self._thread.join()


class UnderLoad:
    """``fn`` while a ``PythonLoad`` works."""

    def __init__(self, fn: Callable, load: PythonLoad) -> None:
        self.fn, self.load = fn, load

    def __call__(self) -> None:
        self.load.active.set()
        try:
            self.fn()
        finally:
            self.load.active.clear()


class Convert:
    """One conversion pass over the bucket, a ``copy_`` per parameter: ``"in"`` bf16 staging ->
    fp32, ``"out"`` fp32 -> bf16 staging."""

    def __init__(self, shapes: list, direction: str) -> None:
        params = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        staging = _staging(params)
        low = [staging.typed(p) for p in params]
        high = [torch.randn(s) for s in shapes]
        self.pairs = list(zip(high, low)) if direction == "in" else list(zip(low, high))

    def __call__(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)


def chunk_bytes_of(mib: Optional[float], threads: int, worker: ModuleType = worker_mod) -> int:
    return worker.default_chunk_bytes(threads) if mib is None else int(mib * 2**20)


def chunk_name(mib: Optional[float], threads: int, worker: ModuleType = worker_mod) -> str:
    size = chunk_bytes_of(mib, threads, worker)
    text = "whole bucket" if size == 0 else f"chunk {size / 2**20:g} MiB"
    return text + (" (default)" if mib is None else "")


def build_paths(shapes: list, threads: int, chunks: Sequence[Optional[float]], parts: bool,
                keep: bool, compared: Optional[tuple[ModuleType, ModuleType]],
                load: Optional[PythonLoad] = None) -> dict[str, Callable]:
    """The paths to time at ``threads`` (see the module docstring); with ``load``, the default
    chunk's update also while that thread runs Python."""
    paths: dict[str, Callable] = {RAW: Raw(shapes)}
    if parts:
        paths["convert in (bucket pass)"] = Convert(shapes, "in")
        paths["write back (bucket pass)"] = Convert(shapes, "out")
    versions = [("", cpu_update, worker_mod)]
    if compared is not None:
        versions.append(("old ", *compared))
    for mib in dict.fromkeys(chunks):
        for prefix, module, worker in versions:
            size = chunk_bytes_of(mib, threads, worker)
            name = chunk_name(mib, threads, worker)
            if parts and not prefix and size:
                paths.setdefault(f"steps only, {name}", StepsOnly(module, shapes, size))
            paths.setdefault(f"{prefix}update, {name}", Update(module, shapes, size))
            if keep and mib is None:
                paths.setdefault(f"{prefix}update+keep, {name}", Update(module, shapes, size, keep=True))
            if load is not None and mib is None:
                paths.setdefault(f"{prefix}update+GIL load, {name}", UnderLoad(paths[f"{prefix}update, {name}"], load))
    return paths


def time_paths(paths: dict[str, Callable], reps: int) -> dict[str, dict[str, Any]]:
    """Round-robin timing: seconds of every call and page faults per call, per path."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    faults: dict[str, int] = dict.fromkeys(paths, 0)
    for fn in paths.values():  # state allocation (first call), kept copies (second): not timed
        fn()
        fn()
    with gc_paused():
        for _ in range(reps):
            for name, fn in paths.items():
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    return {name: {"times": times[name], "faults": faults[name] / reps} for name in paths}


def region_us(gap_s: float = 30e-6, count: int = 200, reps: int = 5) -> float:
    """Microseconds one parallel region costs beyond its work, after ``gap_s`` of Python (as
    between two chunks): a 64 Ki-element ``copy_`` (above torch's grain, so it forks) timed with
    the gap, minus the same copy done back to back and the gap itself (best of ``reps``)."""
    a, b = torch.empty(2**16), torch.randn(2**16)

    def run(gap: float) -> float:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(count):
                a.copy_(b)
                end = time.perf_counter() + gap
                while time.perf_counter() < end:
                    pass
            best = min(best, (time.perf_counter() - t0) / count - gap)
        return best

    run(0.0)
    with gc_paused():
        return 1e6 * (run(gap_s) - run(0.0))


def _job(shapes: list, threads: int, chunks: Sequence[Optional[float]], reps: int, parts: bool,
         keep: bool, compare: Optional[str], gil: bool) -> tuple[dict[str, dict[str, Any]], float]:
    compared = load_compared(compare) if compare else None
    load = PythonLoad() if gil else None
    try:
        paths = build_paths(shapes, threads, chunks, parts, keep, compared, load)
        return time_paths(paths, reps), region_us()
    finally:
        if load is not None:
            load.close()


def shrink_team(keep: int) -> None:
    """Shrink the calling thread's OpenMP team to ``keep`` threads, leaving its
    ``torch.get_num_threads()`` as it was. libgomp lets an idle thread spin briefly before it
    sleeps unless it manages more threads than there are CPUs; a training script's main thread
    (its team from model init) and the optimizer worker's team together do, so every parallel
    region of the update wakes sleeping threads. On the 2-CPU development machine a region cost
    0.5-2 us without the main thread's team and 30-48 us with it, and the update 1.24-1.46x raw
    AdamW against 1.70-1.87x. Whether the surplus threads end depends on the OpenMP runtime (the
    libgomp of torch 2.6's wheel keeps them), so the library does not do this to the user's
    thread; this measures what it would buy."""
    n = torch.get_num_threads()
    if n <= keep:
        return
    torch.set_num_threads(keep)
    try:
        torch.empty(keep * 2**15 + 1).fill_(0.0)  # above torch's grain: a region of ``keep`` threads
    finally:
        torch.set_num_threads(n)


def microbench(threads_list: Sequence[int], elems: int, reps: int,
               chunks: Sequence[Optional[float]] = (0, None), bind: bool = False, parts: bool = True,
               keep: bool = True, compare: Optional[str] = None, gil: bool = True,
               main_team: Optional[int] = None, pinned: bool = False) -> list[dict]:
    """Time every path per worker thread count (see the module docstring); one result per
    (threads, path), printed as it comes. ``main_team``: this (main) thread first runs a
    parallel op with all its threads, as a training script does (model init, data): libgomp
    then manages more threads than there are CPUs and makes idle ones sleep at once instead
    of spinning, so every parallel region wakes them (``region_us`` shows what that costs);
    ``main_team=K > 0``: then shrinks that team to K threads (``shrink_team``)."""
    shapes = bucket_shapes(elems)
    elems = sum(torch.Size(s).numel() for s in shapes)
    out = []
    PINNED[0] = pinned
    if main_team is not None:
        torch.randn(2**22).add_(1)
        if main_team > 0:
            shrink_team(main_team)
    print(f"CPU: {cpu_description()}; bucket of {elems / 2**20:g} Mi elements, {reps} rounds"
          + ("" if main_team is None else ", main thread's OpenMP team started"
             + (f", then shrunk to {main_team} threads" if main_team else ""))
          + (", pinned staging" if pinned else ""), flush=True)
    for threads in threads_list:
        worker = CpuWorker(threads, cores=worker_cores(threads) if bind else None)
        try:
            res, region = worker.submit(_job, shapes, threads, chunks, reps, parts, keep, compare, gil).result()
        finally:
            worker.shutdown()
        print(f"  threads {threads:3d} a parallel region after 30 us of Python costs {region:.1f} us "
              "beyond its work", flush=True)
        raw_best, raw_med = min(res[RAW]["times"]), statistics.median(res[RAW]["times"])
        for name, r in res.items():
            best, med = min(r["times"]), statistics.median(r["times"])
            row = {"path": name, "threads": threads, "elems": elems, "s_per_step": best,
                   "s_median": med, "g_elems_per_s": elems / best / 1e9, "vs_raw": best / raw_best,
                   "vs_raw_median": med / raw_med, "faults_per_call": r["faults"], "times": r["times"],
                   "region_us": region}
            out.append(row)
            print(f"  threads {threads:3d} {name:42s} {row['g_elems_per_s']:7.3f} G elements/s "
                  f"{row['vs_raw']:6.2f}x raw (median {row['vs_raw_median']:5.2f}x) "
                  f"{row['faults_per_call']:7.1f} faults/call", flush=True)
    return out


def table(micro: list[dict]) -> str:
    return format_table(
        ("threads", "CPU update path", "G elements/s", "x raw (best)", "x raw (median)", "faults/call"),
        [[m["threads"], m["path"], m["g_elems_per_s"], m["vs_raw"], m["vs_raw_median"], m["faults_per_call"]]
         for m in micro])


def cpu_description() -> str:
    """The CPU model, core count and cache sizes (Linux sysfs / procfs; what is readable)."""
    model = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    caches = []
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
            shared = (index / "shared_cpu_list").read_text().strip()
        except OSError:
            continue
        if kind != "Instruction":
            caches.append(f"L{level} {size} (cpus {shared})")
    import os
    return f"{model}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; " + ", ".join(caches)


def parse_chunks(text: str) -> list[Optional[float]]:
    return [None if c.strip() == "default" else float(c) for c in text.split(",") if c.strip()]


def main(argv: Optional[list[str]] = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", help="comma list of worker thread counts (default: all cores but one)")
    p.add_argument("--elems", type=int, default=32 * 2**20, help="elements per bucket (default 32 Mi)")
    p.add_argument("--reps", type=int, default=7, help="timed rounds")
    p.add_argument("--chunks", default="0,default", help="comma list: MiB of fp32 masters per step, "
                   "0 = whole bucket, 'default' = the optimizer's default")
    p.add_argument("--compare", help="another checkout (root, or its cpu_update.py) timed as 'old'")
    p.add_argument("--no-parts", action="store_true", help="skip steps-only and conversion passes")
    p.add_argument("--no-keep", action="store_true", help="skip the early (keep_previous) update")
    p.add_argument("--no-gil-load", action="store_true", help="skip the update under a Python thread's load")
    p.add_argument("--pinned", action="store_true", help="page-locked staging, as in training (needs CUDA)")
    p.add_argument("--main-team", type=int, nargs="?", const=0, metavar="K",
                   help="the main thread runs a parallel op first, as training does; with K, its team "
                        "is then shrunk to K threads (shrink_team; see microbench())")
    p.add_argument("--bind-cores", action="store_true")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else [worker_mod.default_cpu_threads()])
    micro = microbench(threads, args.elems, args.reps, parse_chunks(args.chunks), args.bind_cores,
                       not args.no_parts, not args.no_keep, args.compare, not args.no_gil_load,
                       args.main_team, args.pinned)
    print()
    print(table(micro))
    if args.out:
        write_json(Path(args.out), {"cpu": cpu_description(), "torch": torch.__version__,
                                    "args": vars(args), "microbench": micro})
    return micro


if __name__ == "__main__":
    main()
