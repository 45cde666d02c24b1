"""Where a training step with ``HybridDeviceOptimizer`` waits: a ``torch.profiler`` trace of
real steps, summarized per host phase and per CUDA stream.

    python3 benchmarks/optim_trace.py --fraction 0.25                       # "split f=0.25"
    python3 benchmarks/optim_trace.py --fraction 0.25 --stream-fraction 1   # all of it streamed

``optim_benchmark.py`` says how long a step takes; this says which resource it waits on. It
builds ``optim_benchmark.py``'s model and optimizer (same defaults: the 1.51B GPT on CUDA,
``overlap="next_forward"``, ``stream_fraction="auto"``), runs ``--warmup`` steps, then traces
``--steps`` steps (at least 3) and summarizes the middle one, from its forward's start to the
next forward's start:

- the host time of each phase of the untraced steps (``time.perf_counter`` around each call,
  no synchronization: ``step`` long against the link's work means the host queues it slowly);
- the host phases of the training thread: ``forward``, ``backward``, ``step``, ``zero_grad``
  (when each started and ended on the host, in ms from the window's start);
- per CUDA stream and kind of work (kernels, H2D, D2H, D2D copies): busy ms, first and last ms,
  operations, and the longest gap between them. A link stream busy for much less than its span
  while the host is still in ``step()`` means the host, not the link, paces the copies.

- with ``--bins MS``, the same window as a timeline: per stream and kind of work, the percent of
  each ``MS`` bin it was busy (which resource idles while which other works);
- the streamed chunks queued per untraced step, in ``step()`` (and its launcher thread) and in
  backward (``--stream-during-backward``), the host time each took, and (in one more step, not
  timed) the torch calls each made (``ChunkLaunchClock``);
- the CPU part's updates over the untraced steps (``CpuBucket.update`` timed on the worker):
  parameters per step, busy ms and G params/s, split into updates started with undo copies
  (before ``step()`` validated their bucket; the copies stop once it has) and the rest: the
  in-step CPU rate against ``host_rates.py``'s.

The profiler adds host time to every operation (the traced step is slower than the untraced
one, printed first), so read the shape, not the totals. The window is the host's: with
``next_forward`` the host may run ahead of the device in one step and wait in the next. The full trace goes to
``--out/optim_trace.json.gz`` (chrome://tracing, Perfetto), the summary to
``optim_trace_summary.json``. On a machine without CUDA it runs
the same steps on a small model with the simulated device (host phases only, no streams): a
smoke test of the script.
"""
from __future__ import annotations

import argparse
import gzip
import importlib
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from bench_common import BenchDevice, format_table, write_json

import torch  # noqa: E402  (after bench_common, which puts the repo on sys.path)
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import optim_benchmark  # noqa: E402
from cpu_offload.compat import TorchDispatchMode  # noqa: E402
from cpu_offload.examples.gpt import build_model, make_input, tiny_config  # noqa: E402

PHASES = ("forward", "backward", "step", "zero_grad")


@dataclass
class Phase:
    name: str
    start_ms: float
    end_ms: float


@dataclass
class StreamWork:
    stream: int
    kind: str  # "kernel", "H2D", "D2H", "D2D", "memset"
    busy_ms: float
    first_ms: float
    last_ms: float
    ops: int
    longest_gap_ms: float


def _kind(event: dict) -> Optional[str]:
    cat, name = event.get("cat"), event.get("name", "")
    if cat == "kernel":
        return "kernel"
    if cat == "gpu_memset":
        return "memset"
    if cat == "gpu_memcpy":
        for key, kind in (("HtoD", "H2D"), ("DtoH", "D2H"), ("DtoD", "D2D")):
            if key in name:
                return kind
        return "copy"
    return None


def _window(events: Sequence[dict], step_index: int, who: str) -> tuple[float, float]:
    """The traced window of step ``step_index``: from its ``forward`` annotation to the next
    one (trace timestamps, us). ``who`` names the caller in the error."""
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X"
                    and e.get("cat") == "user_annotation" and e.get("name") == "forward")
    if len(starts) < step_index + 2:
        raise ValueError(f"{who} needs {step_index + 2} forward annotations (trace "
                         f"{step_index + 2} steps or more), found {len(starts)}")
    return starts[step_index], starts[step_index + 1]


def summarize(events: Sequence[dict], step_index: int = 1) -> tuple[list[Phase], list[StreamWork]]:
    """The host phases and the per-stream work of one traced step, from chrome-trace events
    (``torch.profiler``'s ``export_chrome_trace``): the window runs from the ``forward``
    annotation number ``step_index`` to the next one; times in ms from its start. Work that
    straddles an edge counts only inside the window.

    Args:
        events: the trace's ``traceEvents``.
        step_index: which step: the window starts at that forward annotation (0 is the first).

    Returns:
        The host phases that start in the window, and per stream and kind of work its
        ``StreamWork``, in order of first activity.

    Raises:
        ValueError: fewer than ``step_index + 2`` forward annotations (trace at least that many
            steps).

    Example::

        >>> ev = [{"ph": "X", "cat": "user_annotation", "name": "forward", "ts": t, "dur": 5, "tid": 1}
        ...       for t in (0, 100)]
        >>> ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)",
        ...            "ts": 20, "dur": 30, "tid": 7})
        >>> phases, work = summarize(ev, step_index=0)
        >>> [(p.name, p.start_ms) for p in phases], (work[0].kind, work[0].busy_ms)
        ([('forward', 0.0), ('forward', 0.1)], ('H2D', 0.03))
    """
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
             and e.get("name") in PHASES]
    w0, w1 = _window(spans, step_index, "summarize")
    ms = lambda t: round((t - w0) / 1e3, 3)  # noqa: E731
    phases = [Phase(e["name"], ms(e["ts"]), ms(e["ts"] + e["dur"]))
              for e in sorted(spans, key=lambda e: e["ts"]) if w0 <= e["ts"] <= w1]
    by_stream: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        kind = _kind(e) if e.get("ph") == "X" else None
        if kind is None:
            continue
        a, b = max(e["ts"], w0), min(e["ts"] + e["dur"], w1)
        if b > a or (b == a and w0 <= e["ts"] < w1):
            by_stream.setdefault((e["tid"], kind), []).append((a, b))
    work = []
    for (stream, kind), spans_ in by_stream.items():
        spans_.sort()
        gaps = [max(0.0, nxt[0] - cur[1]) for cur, nxt in zip(spans_, spans_[1:])]
        work.append(StreamWork(int(stream), kind, round(sum(b - a for a, b in spans_) / 1e3, 3),
                               ms(spans_[0][0]), ms(spans_[-1][1]), len(spans_),
                               round(max(gaps, default=0.0) / 1e3, 3)))
    work.sort(key=lambda w: (w.first_ms, w.stream, w.kind))
    return phases, work


def timeline(events: Sequence[dict], step_index: int = 1,
             bin_ms: float = 5.0) -> tuple[list[str], list[list[float]]]:
    """Per ``bin_ms`` bin of the window ``summarize`` uses: the percent of the bin each stream
    and kind of work (``"H2D@7"``) was busy.

    Args:
        events: the trace's ``traceEvents``.
        step_index: which step (``summarize``'s window).
        bin_ms: the bins' length.

    Returns:
        The column names, and one row per bin: its start in ms, then the percents.

    Example::

        >>> ev = [{"ph": "X", "cat": "user_annotation", "name": "forward", "ts": t, "dur": 5, "tid": 1}
        ...       for t in (0, 10_000)]
        >>> ev.append({"ph": "X", "cat": "kernel", "name": "k", "ts": 2_500, "dur": 5_000, "tid": 7})
        >>> timeline(ev, step_index=0, bin_ms=5.0)
        (['kernel@7'], [[0.0, 50.0], [5.0, 50.0]])
    """
    w0, w1 = _window(events, step_index, "timeline")
    width = bin_ms * 1e3
    nbins = max(1, math.ceil((w1 - w0) / width))
    busy: dict[str, list[float]] = {}
    for e in events:
        kind = _kind(e) if e.get("ph") == "X" else None
        if kind is None:
            continue
        row = busy.setdefault(f"{kind}@{e['tid']}", [0.0] * nbins)
        a, b = max(e["ts"], w0), min(e["ts"] + e["dur"], w1)
        while a < b:  # split the span over the bins it covers
            i = min(int((a - w0) // width), nbins - 1)
            edge = min(b, w0 + (i + 1) * width)
            row[i] += edge - a
            a = edge
    names = sorted(busy)
    return names, [[round(i * bin_ms, 3)] + [round(100 * busy[n][i] / width, 1) for n in names]
                   for i in range(nbins)]


class CpuUpdateClock:
    """Times every ``CpuBucket.update`` (the CPU part's bucket updates, on its worker) while
    installed: per call its start, end, parameters with a gradient, and whether it started with
    undo copies (an update started before ``step()`` validated its bucket copies what it
    changes first, until ``step()`` has validated it: ``cpu_update``'s module docstring).

    Example (calls as the wrapper records them: start s, end s, parameters, with copies)::

        >>> clock = CpuUpdateClock()
        >>> clock.calls += [(0.0, 0.5, 10**9, True), (0.5, 0.75, 5 * 10**8, False)]
        >>> s = clock.summary(steps=1)
        >>> s["all_busy_ms_per_step"], s["kept_g_params_per_s"], s["plain_g_params_per_s"]
        (750.0, 2.0, 2.0)
    """

    def __init__(self) -> None:
        self.calls: list[tuple[float, float, int, bool]] = []
        self._original: Any = None

    def __enter__(self) -> "CpuUpdateClock":
        from cpu_offload.optim.cpu_update import CpuBucket
        self._original = original = CpuBucket.update
        calls = self.calls

        def update(bucket: Any, grads: Sequence[Any], *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            try:
                original(bucket, grads, *args, **kwargs)
            finally:
                n = sum(m.numel() for m, g in zip(bucket.masters, grads) if g is not None)
                calls.append((t0, time.perf_counter(), n, bool(kwargs.get("keep_previous"))))

        CpuBucket.update = update
        return self

    def __exit__(self, *exc: Any) -> None:
        from cpu_offload.optim.cpu_update import CpuBucket
        CpuBucket.update = self._original

    def summary(self, steps: int) -> dict[str, float]:
        """Per step: parameters updated, busy ms and G params/s, all calls and split by undo
        copies (``kept_*``: started with them; ``plain_*``: the rest).

        Args:
            steps: the steps the recorded calls belong to (the per-step divisor)."""
        out: dict[str, float] = {}
        for tag, calls in (("all", self.calls), ("kept", [c for c in self.calls if c[3]]),
                           ("plain", [c for c in self.calls if not c[3]])):
            params = sum(c[2] for c in calls)
            busy = sum(c[1] - c[0] for c in calls)
            out[f"{tag}_params_per_step"] = params / max(steps, 1)
            out[f"{tag}_busy_ms_per_step"] = 1e3 * busy / max(steps, 1)
            out[f"{tag}_g_params_per_s"] = params / busy / 1e9 if busy > 0 else 0.0
        return out


class _CallCount(TorchDispatchMode):
    """Counts the torch operations dispatched on the thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


class ChunkLaunchClock:
    """Times the host work of queuing each streamed chunk while installed: in ``step()`` and
    by its launcher thread (``StreamedPart._queue_chunk``), and in backward
    (``BackwardUpdates._launch``, ``stream_during_backward``). Queuing a chunk is a few dozen
    small torch calls (copies, the device class's ``step()``, bit sums); the number of chunks
    and the time each takes say whether the host or the link paces the streamed part.

    With ``count_calls=True`` it also counts the torch operations each launch dispatches (a
    ``TorchDispatchMode`` on the launching thread): the host cost of a launch in a unit that
    does not move with the host's speed, comparable between trees on any machine, the
    simulated device included. Counting slows the launches: count in steps you do not time.

    Example (calls as the wrapper records them: where, seconds, torch operations)::

        >>> clock = ChunkLaunchClock()
        >>> clock.calls += [("backward", 0.001, 90), ("backward", 0.003, 110), ("step", 0.002, 70)]
        >>> s = clock.summary(steps=1)
        >>> s["backward_chunks_per_step"], s["backward_median_ms"], s["backward_ms_per_step"]
        (2.0, 2.0, 4.0)
        >>> s["backward_median_torch_calls"], s["step_median_torch_calls"]
        (100.0, 70.0)
    """

    WHERE = {"step": ("cpu_offload.optim.stream_update", "StreamedPart", "_queue_chunk"),
             "backward": ("cpu_offload.optim.stream_backward", "BackwardUpdates", "_launch")}

    def __init__(self, count_calls: bool = False) -> None:
        self.count_calls = count_calls
        self.calls: list[tuple[str, float, int]] = []  # where, seconds, torch operations (0: not counted)
        self._originals: dict[str, tuple[Any, Any]] = {}

    def __enter__(self) -> "ChunkLaunchClock":
        for where, (module, cls_name, method) in self.WHERE.items():
            cls = getattr(importlib.import_module(module), cls_name)
            original = getattr(cls, method)
            self._originals[where] = (cls, original)
            setattr(cls, method, self._timed(where, original))
        return self

    def _timed(self, where: str, original: Any) -> Any:
        calls, count = self.calls, self.count_calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            counter = _CallCount() if count else None
            t0 = time.perf_counter()
            try:
                if counter is None:
                    return original(*args, **kwargs)
                with counter:
                    return original(*args, **kwargs)
            finally:
                calls.append((where, time.perf_counter() - t0, counter.n if counter else 0))
        return timed

    def __exit__(self, *exc: Any) -> None:
        for where, (cls, original) in self._originals.items():
            setattr(cls, self.WHERE[where][2], original)

    def summary(self, steps: int) -> dict[str, float]:
        """Per place (``step``, ``backward``): chunks queued per step, the median host ms of
        one, the host ms per step, and the median torch operations of one (0 if not counted).

        Args:
            steps: the steps the recorded calls belong to (the per-step divisor)."""
        out: dict[str, float] = {}
        for where in self.WHERE:
            times = [t for w, t, _ in self.calls if w == where]
            ops = [n for w, _, n in self.calls if w == where]
            out[f"{where}_chunks_per_step"] = len(times) / max(steps, 1)
            out[f"{where}_median_ms"] = 1e3 * statistics.median(times) if times else 0.0
            out[f"{where}_ms_per_step"] = 1e3 * sum(times) / max(steps, 1)
            out[f"{where}_median_torch_calls"] = float(statistics.median(ops)) if ops else 0.0
        return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda where available (else cpu: simulated device, small model)")
    p.add_argument("--fraction", type=float, default=0.25, help="offload_fraction")
    p.add_argument("--stream-fraction", default="auto", type=optim_benchmark.stream_fraction_arg,
                   help="'auto', 'measure' or a number in [0, 1]")
    p.add_argument("--overlap", default="next_forward")
    p.add_argument("--stream-during-backward", action="store_true")
    p.add_argument("--stream-budget-mib", type=float, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="traced steps (at least 3)")
    p.add_argument("--bins", type=float, default=0.0, metavar="MS",
                   help="also print the window as a timeline of MS-long bins (0: not)")
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    if args.bins < 0:
        p.error("--bins: a bin length in ms, or 0 for no timeline")
    if args.steps < 3:
        p.error("--steps: at least 3 (the middle steps are summarized)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    flag = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = BenchDevice.from_flag(flag)
    cfg = optim_benchmark.DEFAULT_CFG if device.is_cuda else tiny_config().with_(layers=4)
    model = build_model(cfg, device.torch_device, seed=0)
    xs = [make_input(cfg, device.torch_device, seed=100 + i, requires_grad=False) for i in range(3)]
    opt = optim_benchmark.build_optimizer(
        model, args.fraction, args.overlap, device, None, None, args.stream_fraction, False,
        args.stream_budget_mib, args.stream_during_backward)

    host = {name: 0.0 for name in PHASES}  # host seconds per phase over the untraced steps

    def train_step(i: int) -> None:
        t = [time.perf_counter()]
        with record_function("forward"):
            loss = model(xs[i % len(xs)]).float().square().mean()
        t.append(time.perf_counter())
        with record_function("backward"):
            loss.backward()
        t.append(time.perf_counter())
        with record_function("step"):
            opt.step()
        t.append(time.perf_counter())
        with record_function("zero_grad"):
            opt.zero_grad()
        t.append(time.perf_counter())
        for name, a, b in zip(PHASES, t, t[1:]):
            host[name] += b - a

    try:
        for i in range(args.warmup):
            train_step(i)
        device.synchronize()
        host.update((name, 0.0) for name in PHASES)
        t0 = time.perf_counter()
        with CpuUpdateClock() as clock, ChunkLaunchClock() as launches:
            for i in range(args.steps):
                train_step(i)
            device.synchronize()
            untraced_ms = (time.perf_counter() - t0) * 1e3 / args.steps
            opt.wait_params()  # the last step's CPU update, timed with the others
        cpu = clock.summary(args.steps)
        chunks = launches.summary(args.steps)
        host_ms = {name: 1e3 * s / args.steps for name, s in host.items()}
        with ChunkLaunchClock(count_calls=True) as counted:  # one more step, not timed
            train_step(args.steps)
            device.synchronize()
        for where, calls in counted.summary(1).items():
            if where.endswith("_median_torch_calls"):
                chunks[where] = calls
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.is_cuda else [])
        with profile(activities=activities) as prof:
            for i in range(args.steps):
                train_step(i)
            device.synchronize()
    finally:
        opt.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "optim_trace.json.gz"
    prof.export_chrome_trace(str(trace))  # torch gzips a path ending in .gz
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    phases, work = summarize(events, step_index=(args.steps - 1) // 2)
    window = max(p.start_ms for p in phases if p.name == "forward")  # the next step's start
    print(f"{device.describe()} | torch {torch.__version__} | {cfg}")
    print(f"offload_fraction {args.fraction}, stream_fraction {opt.stream_fraction}, overlap "
          f"{args.overlap}{', streamed during backward' if args.stream_during_backward else ''}"
          f" | untraced step {untraced_ms:.1f} ms; traced window (host) {window:.1f} ms")
    print("untraced host ms per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in host_ms.items()))
    if cpu["all_params_per_step"]:
        print("CPU part per untraced step: " + "; ".join(
            f"{label} {cpu[tag + '_params_per_step'] / 1e6:.1f}M params in "
            f"{cpu[tag + '_busy_ms_per_step']:.1f} ms ({cpu[tag + '_g_params_per_s']:.2f} G params/s)"
            for tag, label in (("all", "all"), ("kept", "started with undo copies"), ("plain", "without"))))
    for where in ChunkLaunchClock.WHERE:
        if chunks[f"{where}_chunks_per_step"]:
            print(f"streamed chunks queued in {where} per untraced step: "
                  f"{chunks[where + '_chunks_per_step']:.0f}, {chunks[where + '_median_ms']:.2f} ms "
                  f"of host time each (median), {chunks[where + '_ms_per_step']:.1f} ms in all; "
                  f"{chunks[where + '_median_torch_calls']:.0f} torch calls each (median, one "
                  "more step)")
    print(format_table(("host phase", "start ms", "end ms"),
                       [[p.name, f"{p.start_ms:.1f}", f"{p.end_ms:.1f}"] for p in phases]))
    if work:
        print(format_table(("stream", "work", "busy ms", "first ms", "last ms", "ops", "longest gap ms"),
                           [[w.stream, w.kind, f"{w.busy_ms:.1f}", f"{w.first_ms:.1f}",
                             f"{w.last_ms:.1f}", w.ops, f"{w.longest_gap_ms:.1f}"] for w in work]))
    if args.bins:
        names, rows = timeline(events, step_index=(args.steps - 1) // 2, bin_ms=args.bins)
        print(f"busy % per {args.bins:g} ms bin (stream work: kind@stream):")
        print(format_table(["bin ms"] + names, [[f"{r[0]:.0f}"] + [f"{v:.0f}" for v in r[1:]] for r in rows]))
    result = {"untraced_step_ms": untraced_ms, "untraced_host_ms": host_ms, "cpu_updates": cpu,
              "chunk_launches": chunks,
              "stream_fraction": opt.stream_fraction,
              "args": {k: v for k, v in vars(args).items()},
              "phases": [asdict(p) for p in phases], "streams": [asdict(w) for w in work]}
    write_json(out / "optim_trace_summary.json", result)
    return result


if __name__ == "__main__":
    main()
