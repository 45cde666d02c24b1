"""Time/memory frontier: for a memory budget, the fastest training step each method achieves.

Per workload (``--workload gpt``: the 8-layer GPT stack of ``offload_benchmark.py``; ``hf``: the
16-layer ``LlamaForCausalLM`` of ``hf_llama_benchmark.py``; ``both``, the default, one after the
other in this process), every configuration of three methods is measured on one model:

- ``ckpt k``  the first k layers under non-reentrant ``torch.utils.checkpoint``, k = 1..n
  (``apply_offloading(layers, plan=Plan(0, tuple(range(k))))``: nothing offloaded, so the
  layers only run checkpointed);
- ``off k``   ``apply_offloading(layers, num_layers=k)``, k = 1..n-1;
- ``sel k``   ``apply_offloading(layers, num_layers=k, selective=True)``, k = 0..n-1: every
  layer recomputes its cheap saved tensors (norm, activation, elementwise outputs), the first
  k layers offload the rest;
- ``plan @b`` one ``profile_step`` of the real step, then ``cpu_offload.plan.plan(prof, b)`` for each
  budget b of ``--budgets`` (fractions of the peak without offloading); with ``--verify N``
  (default 3 on CUDA) the model's N best candidates are measured in the real step and the
  fastest that fits is taken, as ``plan_offloading`` does; applied with
  ``apply_offloading(layers, plan=plan)``. The plan's predicted time and peak ratios (the
  planner's model) are kept next to the measured ones.

``none`` (nothing installed) is the reference of every ratio and of exactness. Every
configuration is measured in ``--rounds`` rounds (default 3; every other round in reverse
order), ``none`` timed at the start and end of each round and after every ``--none-every``
configurations (default 4). In each round a configuration's time ratio is to the ``none`` time
interpolated between the two ``none`` measurements around it, so that the machine's drift (the
H100 host: up to +7% in a minute) does not show as a cost of the configurations measured late;
its time ratio is the median over the rounds, and ``spread`` the (max - min) / median of its
per-round ratios. A plan equal to an ``off k`` / ``ckpt k`` configuration (or to another
budget's plan) reuses that configuration's measurements. Each measurement is ``--warmup``
untimed steps, then ``--iters`` timed steps (CUDA events, median); in the first round, peak =
``max_memory_allocated`` above what the step starts with (max over the timed steps; gradient
buffers persist and are zeroed in place), exactly as the two workloads' own scripts measure.
Unless ``--no-exact``, one more step runs (first round) with deterministic algorithms and its
loss/output and every gradient are compared with ``none``'s by ``torch.equal``.

Then, per budget b and method, the method's best point: the fastest measured configuration
whose measured peak is at most b x ``none``'s peak ("-" if none fits), the overall winner,
how much slower the planner's pick measured than the winner (``pick - winner``, marked
"~ within spread" where the difference is within the two configurations' per-round range: the
claim then says nothing), and what the planner chose for b (flagged when its measured peak is
over b). Where the pick is not the winner, the two are then timed head to head
(``--confirm`` blocks each, default 6 on CUDA: the configurations installed in turns, every
step timed): the ratio of their median steps, with a 90% bootstrap interval, settles a
difference of about 1% that the rounds' spread cannot. The plot
(``frontier_<workload>_<device>.png``) draws each method's Pareto-optimal measured points, the
planner's predicted points (dashed) and the budgets; ``frontier_<workload>_<device>.json``
holds every measurement.

GPU (H100, 3 rounds, plans verified as ``plan_offloading`` does: gpt about 2 minutes, hf about 5)::

    python benchmarks/frontier.py --out bench_out
    python benchmarks/frontier.py --workload gpt --out bench_out   # one workload

CPU smoke test (tiny models on ``SimulatedDevice``; timings mean nothing and peak memory is not
measured, so every budget cell is "-")::

    python benchmarks/frontier.py --device sim --no-plot
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from bench_common import (
    BenchDevice, environment_info, format_table, plottable, prepare_determinism, ratio_interval,
    ratio_stats, save_plot, within_noise, write_json,
)

import hf_llama_benchmark as hf_bench  # noqa: E402  (after bench_common: repo on sys.path)
import offload_benchmark as gpt_bench  # noqa: E402

import torch  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.plan import Plan, StepProfile, profile_step, search  # noqa: E402
from cpu_offload.v2.selection import DEFAULT_MIN_TENSOR_SIZE  # noqa: E402

GIB = 1024**3
WORKLOADS = ("gpt", "hf")
METHODS = ("ckpt", "off", "sel", "plan")
NO_OVERLAP_WARNING = "num_layers=model_layers-1"  # off n-1 is measured on purpose


# --- configurations -------------------------------------------------------------------------------


@dataclass
class Point(hf_bench.Row):
    """One measured configuration: offload the first ``num_layers`` layers (the last of them
    only ``partial_bytes``, if set) and checkpoint the ``recompute`` layers. A ``Row`` of the HF
    script (its ``run_row`` measures it) whose ``method`` is the configuration's label."""

    num_layers: int = 0
    recompute: tuple = ()
    partial_fraction: float = 1.0
    partial_bytes: Optional[int] = None
    selective: tuple = ()  # layers whose cheap saved tensors are recomputed
    offloaded: tuple = ()  # which layers, when a plan spread them (else the first num_layers)
    names: dict = field(default_factory=dict)  # method -> its name for this configuration
    budgets: list = field(default_factory=list)  # the budgets whose plan is this configuration
    predicted_time_ratio: Optional[float] = None  # the planner's model (plans only)
    predicted_peak_ratio: Optional[float] = None
    sim_copies: Optional[int] = None  # simulated device: copies made (proof something moved)
    baseline_ms: Optional[float] = None  # the none time this point's time ratio is to
    # Per round, the time ratio to none measured around it in that round; ``time_ratio`` is
    # their median, ``spread`` their (max - min) / median and ``ratio_range`` max - min.
    round_ratios: list = field(default_factory=list)
    ratio_range: Optional[float] = None

    @property
    def label(self) -> str:
        return self.method

    @property
    def key(self) -> tuple:
        """What makes two configurations the same (then measured once)."""
        return (self.num_layers, tuple(sorted(self.recompute)), self.partial_bytes,
                tuple(sorted(self.selective)), self.offloaded)

    @property
    def measured(self) -> bool:
        return self.error is None and self.step_ms is not None


def method_points(n: int, methods: list[str]) -> list[Point]:
    """``ckpt 1..n``, ``off 1..n-1`` and ``sel 0..n-1`` (those of ``methods``), each named
    by its method."""
    points = []
    if "ckpt" in methods:
        points += [Point(f"ckpt {k}", recompute=tuple(range(k)), names={"ckpt": f"ckpt {k}"})
                   for k in range(1, n + 1)]
    if "off" in methods:
        points += [Point(f"off {k}", num_layers=k, names={"off": f"off {k}"}) for k in range(1, n)]
    if "sel" in methods:
        points += [Point(f"sel {k}", num_layers=k, selective=tuple(range(n)),
                         names={"sel": f"sel {k}"}) for k in range(n)]
    return points


def plan_label(plan: Plan) -> str:
    part = f" part={plan.partial_fraction:g}" if plan.partial_bytes is not None else ""
    sel = f" sel={list(plan.selective)}" if plan.selective else ""
    where = f" at {list(plan.offloaded)}" if plan.offloaded else ""
    return f"plan k={plan.num_layers}{where}{part} rec={list(plan.recompute)}{sel}"


def add_plans(
    points: list[Point], prof: StepProfile, budgets: list[float], notes: list[str],
    verify: Optional[Callable[[Plan, str], Plan]] = None,
) -> dict[float, Optional[Point]]:
    """The planner's choice per budget (``verify``: the model's best measured in the real step
    first, as ``plan_offloading`` does), merged into ``points``: a plan equal to a
    configuration already there is that point (measured once), else a new point. Returns
    budget -> point."""
    by_key = {p.key: p for p in points}
    chosen: dict[float, Optional[Point]] = {}
    for b in budgets:
        try:
            plan = search.plan(prof, b)
        except cpu_offload.OffloadConfigError as exc:
            notes.append(f"plan @{b:g}: no plan fits ({exc})")
            chosen[b] = None
            continue
        if verify is not None:
            plan = verify(plan, f"plan @{b:g}")
        new = Point(plan_label(plan), num_layers=plan.num_layers, recompute=tuple(plan.recompute),
                    partial_fraction=plan.partial_fraction, partial_bytes=plan.partial_bytes,
                    selective=tuple(plan.selective), offloaded=tuple(plan.offloaded))
        point = by_key.setdefault(new.key, new)
        if point is new:
            points.append(point)
        point.names["plan"] = plan_label(plan)
        point.budgets.append(b)
        point.predicted_time_ratio, point.predicted_peak_ratio = plan.time_ratio, plan.peak_ratio
        chosen[b] = point
        notes.append(f"plan @{b:g}: {plan.describe()}")
    return chosen


def install(point: Point, layers: Any, device: BenchDevice, min_size: int) -> Optional[Any]:
    """Apply ``point`` to ``layers``; the handle (``None`` for ``none``)."""
    if point.num_layers == 0 and not point.recompute and not point.selective:
        return None
    kw: dict[str, Any] = {"min_tensor_size_to_offload": min_size}
    if point.num_layers or point.selective:  # a fresh SimulatedDevice per context (sim only)
        kw["device"] = device.offload_device()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=NO_OVERLAP_WARNING)
        if not point.recompute and point.partial_bytes is None and not point.offloaded:
            return cpu_offload.apply_offloading(layers, num_layers=point.num_layers,
                                                selective=point.selective, **kw)
        plan = Plan(point.num_layers, point.recompute, partial_fraction=point.partial_fraction,
                    partial_bytes=point.partial_bytes, selective=point.selective,
                    offloaded=point.offloaded, model_layers=len(layers))
        return cpu_offload.apply_offloading(layers, plan=plan, **kw)


def measure(
    point: Point, wl: Any, device: BenchDevice, args: argparse.Namespace, min_size: int,
    reference: Optional[list],
) -> Optional[list]:
    """Install, time, check exactness against ``reference`` and remove, with the HF script's
    ``run_row`` (same warm-up, timing, peak and exactness step for both workloads). Returns the
    snapshot of the deterministic step when ``reference`` is ``None`` (the ``none`` point)."""

    def setup() -> tuple[str, Callable[[], None]]:
        handle = install(point, wl.layers, device, min_size)
        return point.label, (handle.remove if handle is not None else _nothing)

    snapshot = hf_bench.run_row(point, setup, wl, device, args, reference, [], {})
    point.sim_copies = device.take_copy_count()
    return snapshot


def _nothing() -> None:
    """Teardown of ``none``: nothing was installed."""


# --- workloads ------------------------------------------------------------------------------------


def build_workload(name: str, args: argparse.Namespace, device: BenchDevice) -> tuple[Any, str, int]:
    """``(workload, description, min_tensor_size_to_offload)``: the other scripts' workloads,
    each with ``.step()``, ``.layers``, ``.snapshot()`` and ``.matches()``."""
    if name == "gpt":
        ns = argparse.Namespace(hidden=args.hidden, heads=None, seq=args.seq, batch=args.batch,
                                layers=args.layers, dtype=None)
        cfg = gpt_bench.workload_config(ns, device)
        wl = gpt_bench.Workload(cfg, device, args.seed, grads_to_none=False)
        sim_min = gpt_bench.SIM_MIN_TENSOR_SIZE
        desc = f"GPT stack {cfg}"
    else:
        ns = argparse.Namespace(layers=args.layers, hidden=args.hidden, seq=args.seq,
                                batch=args.batch or 1, seed=args.seed)
        wl = hf_bench.Workload(ns, device)
        sim_min = hf_bench.SIM_MIN_TENSOR_SIZE
        c = wl.config
        desc = (f"LlamaForCausalLM {c.num_hidden_layers} layers, hidden {c.hidden_size}, seq "
                f"{wl.seq}, batch {ns.batch}, {wl.dtype}")
    min_size = args.min_tensor_size
    if min_size is None:
        min_size = DEFAULT_MIN_TENSOR_SIZE if device.is_cuda else sim_min
    return wl, desc, min_size


def profile(
    wl: Any, device: BenchDevice, min_size: int, link_gbps: Optional[float], notes: list[str]
) -> StepProfile:
    """One ``profile_step`` of the real step (nothing installed), the planner's input; the link
    is measured on CUDA unless ``link_gbps`` is given (50 GB/s assumed on sim)."""
    prof = profile_step(
        wl.step, wl.layers, device=device.offload_device(),  # None: CUDA
        min_tensor_size_to_offload=min_size, link_gbps=link_gbps,
        warmup=1 if device.is_cuda else 0, repeats=3 if device.is_cuda else 1,
    )
    device.take_copy_count()
    device.free_memory()
    notes.extend(prof.notes)
    peak = "-" if prof.peak_bytes is None else f"{prof.peak_bytes / GIB:.2f} GiB"
    notes.append(f"profile: link {prof.d2h_gbps:.1f} / {prof.h2d_gbps:.1f} GB/s, step "
                 f"{prof.step_ms:.1f} ms, peak {peak}")
    return prof


# --- the frontier ---------------------------------------------------------------------------------


def derive(points: list[Point], base: Point, nones: Optional[list] = None) -> None:
    """Time ratios to ``none`` interpolated at each point's place in the run (``nones``:
    ``(position, ms)`` of every ``none`` measurement, positions as in ``points``; default: the
    first one only), peak ratios to the first ``none``."""
    nones = sorted(n for n in (nones or [(0.0, base.step_ms)]) if n[1])
    for i, p in enumerate(points):
        if p.measured and nones:
            p.baseline_ms = interpolate(nones, float(i)) if p is not base else base.step_ms
            p.time_ratio = p.step_ms / p.baseline_ms
        if p.peak_bytes is not None and base.peak_bytes:
            p.peak_ratio = p.peak_bytes / base.peak_bytes


def interpolate(samples: list, x: float) -> float:
    """Piecewise-linear value at ``x`` of sorted ``(x, y)`` samples, flat beyond the ends.

    >>> interpolate([(0.0, 10.0), (4.0, 14.0)], 1.0)
    11.0
    """
    if x <= samples[0][0]:
        return samples[0][1]
    for (x0, y0), (x1, y1) in zip(samples, samples[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return samples[-1][1]


def best_point(points: list[Point], method: str, budget: float) -> Optional[Point]:
    """The fastest measured configuration of ``method`` whose measured peak ratio is within
    ``budget``; ``None`` when none fits or peaks are not measured (simulated device). Fastest
    by time ratio (the drift-corrected figure every table shows), not by raw step time, which
    drifts with the machine over the call."""
    fits = [p for p in points if method in p.names and p.measured and p.peak_ratio is not None
            and p.peak_ratio <= budget + 1e-9]
    return min(fits, key=lambda p: (p.time_ratio, p.peak_ratio), default=None)


def frontier(
    points: list[Point], budgets: list[float], chosen: dict[float, Optional[Point]],
    methods: list[str],
) -> list[dict]:
    """Per budget: each method's best point, the winner and the planner's own choice."""
    rows = []
    for b in budgets:
        best = {m: best_point(points, m, b) for m in methods}
        found = [(p.time_ratio, m, p) for m, p in best.items() if p is not None]
        win = min(found, key=lambda t: t[0], default=None)
        pick = chosen.get(b)
        gap = None  # how much slower the planner's pick measured than the winner (ratio)
        if win is not None and pick is not None and pick.time_ratio is not None:
            gap = pick.time_ratio - win[2].time_ratio
        rows.append({
            "budget": b,
            "best": {m: None if p is None else p.label for m, p in best.items()},
            "winner": None if win is None else win[2].names[win[1]],
            "winner_time_ratio": None if win is None else win[2].time_ratio,
            "planner_pick": None if pick is None else pick.names["plan"],
            "planner_pick_over_budget": None if pick is None or pick.peak_ratio is None
            else pick.peak_ratio > b + 1e-9,
            "pick_minus_winner": gap,
            # The claim "the winner is faster than the plan" (or the reverse) is within the
            # per-round range of the two: it says nothing.
            "within_spread": None if gap is None else within_noise(
                gap, pick.ratio_range, win[2].ratio_range),
            "_points": best,
            "_pick": pick,
            "_winner": None if win is None else win[2],
        })
    return rows


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats in both peak and time, by increasing peak."""
    out: list[Point] = []
    for p in sorted(points, key=lambda p: (p.peak_ratio, p.time_ratio)):
        if not out or p.time_ratio < out[-1].time_ratio:
            out.append(p)
    return out


# --- report ---------------------------------------------------------------------------------------


def _ratio_cell(p: Optional[Point], name: str) -> str:
    if p is None:
        return "-"
    exact = "" if p.exact is not False else " NOT EXACT"
    return f"{p.time_ratio:.3f} / {p.peak_ratio:.3f} {p.names[name]}{exact}"


def _gap_cell(row: dict) -> Optional[str]:
    """``+0.021`` (the pick measured that much slower than the winner), marked ``~`` when the
    difference is within the two configurations' per-round range (it claims nothing)."""
    gap = row["pick_minus_winner"]
    if gap is None:
        return None
    cell = f"{gap:+.3f}" + (" ~ within spread" if row["within_spread"] else "")
    h = row.get("head_to_head")
    if h is not None:
        cell += f"; head to head {h['ratio'] - 1:+.3f} ({h['low'] - 1:+.3f}..{h['high'] - 1:+.3f})"
    return cell


def frontier_table(rows: list[dict], methods: list[str]) -> str:
    """Rows = budgets; per method ``time x / peak x`` of its best point (and the plan's
    predicted time x), the winner, and the planner's own pick for the budget."""
    planned = "plan" in methods
    headers = ["budget"] + [f"{m}: time x / peak x" for m in methods]
    headers += (["plan pred time x", "winner", "pick - winner", "planner's pick @budget"]
                if planned else ["winner"])
    table = []
    for r in rows:
        cells: list[Any] = [r["budget"]] + [_ratio_cell(r["_points"][m], m) for m in methods]
        if planned:
            best_plan = r["_points"]["plan"]
            cells.append(None if best_plan is None else best_plan.predicted_time_ratio)
        cells.append(r["winner"])
        if planned:
            cells.append(_gap_cell(r))
            over = " (measured over budget)" if r["planner_pick_over_budget"] else ""
            cells.append((r["planner_pick"] or "no plan fits") + over)
        table.append(cells)
    return format_table(headers, table)


def points_table(points: list[Point]) -> str:
    """Every measurement: its methods, measured and predicted ratios, exactness, the budgets
    whose plan it is. Errors are printed below the table."""
    headers = ("configuration", "methods", "step ms", "time x", "spread %", "peak GiB",
               "peak x", "pred time x", "pred peak x", "exact", "plan for")
    return format_table(headers, [
        [p.label, ",".join(p.names) or "ref", "ERROR (below)" if p.error else p.step_ms,
         p.time_ratio, None if p.spread is None else 100 * p.spread,
         None if p.peak_bytes is None else p.peak_bytes / GIB, p.peak_ratio,
         p.predicted_time_ratio, p.predicted_peak_ratio, p.exact,
         ",".join(f"{b:g}" for b in p.budgets) or None]
        for p in points
    ])


def drift_note(start: Point, end: Point) -> str:
    """``none`` at the start vs at the end: how much the machine drifted meanwhile."""
    if not (start.measured and end.measured):
        return f"none drift: not measured ({end.error or start.error})"
    note = (f"none drift: {start.step_ms:.2f} ms at the start, {end.step_ms:.2f} ms at the end "
            f"({100 * (end.step_ms / start.step_ms - 1):+.1f}%)")
    if start.peak_bytes and end.peak_bytes is not None:
        note += f", peak {100 * (end.peak_bytes / start.peak_bytes - 1):+.1f}%"
    return note


def plot(points: list[Point], budgets: list[float], methods: list[str], path: Path, title: str) -> None:
    """Time ratio vs peak ratio: each method's Pareto line, the planner's model, the budgets."""
    plt, have = plottable(points)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, m in enumerate(methods):
        front = pareto([p for p in have if m in p.names])
        if front:
            ax.plot([p.peak_ratio for p in front], [p.time_ratio for p in front], marker="o",
                    color=f"C{i}", label=m)
    model = sorted({(p.predicted_peak_ratio, p.predicted_time_ratio) for p in points
                    if p.predicted_time_ratio is not None and math.isfinite(p.predicted_peak_ratio)})
    if model:
        ax.plot(*zip(*model), linestyle="--", marker="x", color="gray", label="planner model")
    ax.plot([1.0], [1.0], marker="*", markersize=12, color="black", linestyle="", label="none")
    for b in budgets:
        ax.axvline(b, linestyle=":", color="gray", alpha=0.6)
        ax.text(b, 0.01, f"{b:g}", transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7, color="gray")
    ax.set_xlabel("peak memory / none")
    ax.set_ylabel("step time / none")
    save_plot(plt, fig, ax, f"{title}: time vs memory frontier (lower-left is better)", path)


# --- main -----------------------------------------------------------------------------------------


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=("gpt", "hf", "both"), default="both")
    p.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                   help="cuda: real GPU; sim: CPU + SimulatedDevice smoke test (default: auto)")
    p.add_argument("--budgets", default="0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.25",
                   help="peak-memory budgets, fractions of none's peak")
    p.add_argument("--methods", default=",".join(METHODS), help="comma list of ckpt,off,sel,plan")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--hidden", type=int, help="override the hidden size")
    p.add_argument("--seq", type=int, help="override the sequence length")
    p.add_argument("--batch", type=int, help="override the batch size")
    p.add_argument("--warmup", type=int, help="untimed steps per configuration (cuda 2, sim 0)")
    p.add_argument("--iters", type=int, help="timed steps per configuration (cuda 5, sim 1)")
    p.add_argument("--min-tensor-size", type=int,
                   help="min_tensor_size_to_offload (library default on cuda; the workload "
                        "script's sim value on sim)")
    p.add_argument("--link-gbps", type=float,
                   help="host link speed the planner assumes, GB/s each way (default: measured "
                        "on cuda, 50 on sim; a low value on sim makes plans mix recompute and "
                        "partial offload)")
    p.add_argument("--no-exact", action="store_true", help="skip the deterministic exactness step")
    p.add_argument("--none-every", type=int, default=4,
                   help="measure none again after this many configurations (0: only first and "
                        "last); time ratios are to the none time interpolated around each one")
    p.add_argument("--verify", type=int,
                   help="plans: measure this many of the model's best plans per budget in the "
                        "real step and take the fastest, as plan_offloading does by default on "
                        "CUDA (cuda 3, sim 0; 0: the model's best)")
    p.add_argument("--confirm", type=int,
                   help="where the planner's pick is not the winner, time the two head to head "
                        "in this many blocks each (--warmup + --iters steps per block, in "
                        "turns); cuda 6, sim 0")
    p.add_argument("--rounds", type=int, default=3,
                   help="times each configuration is measured, interleaved with none (every "
                        "other round in reverse order); the time ratio is the median over the "
                        "rounds, the spread (max - min) / median of the per-round ratios")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def parse_lists(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    bad = [b for b in budgets if not 0.0 < b <= 1.0]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if bad or unknown:
        raise SystemExit(f"--budgets must be in (0, 1] (got {bad}); --methods from {METHODS} "
                         f"(got {unknown})")
    return budgets, [m for m in METHODS if m in methods]


def run_workload(
    name: str, args: argparse.Namespace, device: BenchDevice, budgets: list[float],
    methods: list[str],
) -> dict:
    """Measure every configuration of one workload, report it, write JSON (and the plot).
    Returns the JSON payload plus ``point_objects`` (the ``Point``s, for tests)."""
    t_start = time.perf_counter()
    wl, desc, min_size = build_workload(name, args, device)
    notes: list[str] = []
    print(f"\n=== {name}: {desc} | warmup {args.warmup}, timed {args.iters} steps per configuration")
    points, chosen = measure_all(wl, device, args, min_size, budgets, methods, notes)
    rows = frontier(points[:-1], budgets, chosen, methods)
    head_to_heads(rows, wl, device, args, min_size, notes)
    del wl  # the model and its gradients, before the next workload is built
    device.free_memory()
    elapsed = time.perf_counter() - t_start
    notes.append(f"{name}: {len(points)} measurements, total {elapsed:.1f} s")
    report(name, points, rows, methods, notes, device)
    stem = Path(args.out) / f"frontier_{name}_{device.kind}"
    payload = {
        "environment": environment_info(device), "workload": desc, "args": vars(args),
        "min_tensor_size_to_offload": min_size, "budgets": budgets,
        "points": [asdict(p) for p in points],
        "frontier": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "notes": notes, "seconds": elapsed,
    }
    write_json(stem.with_suffix(".json"), payload)
    if not args.no_plot:
        plot(points[:-1], budgets, methods, stem.with_suffix(".png"), name)
    return {**payload, "point_objects": points}


def measure_all(
    wl: Any, device: BenchDevice, args: argparse.Namespace, min_size: int,
    budgets: list[float], methods: list[str], notes: list[str],
) -> tuple[list[Point], dict[float, Optional[Point]]]:
    """``none``, then ``args.rounds`` rounds of every configuration (the first one measures
    peak and exactness too; every other round runs them in reverse order), ``none`` timed
    again at the start and end of each round and after every ``--none-every`` configurations;
    then ``none (end)`` (the last point, its exactness is ``none`` against itself). A
    configuration's time ratio is the median over the rounds of its ratio to the ``none`` time
    interpolated around it in that round. Also returns budget -> plan."""
    none = Point("none")
    reference = measure(none, wl, device, args, min_size, None)
    if none.error:
        raise SystemExit(f"the none reference failed: {none.error}")
    freeze_live()  # the first step imports lazily (~100k objects on the simulated device)
    points = [none] + method_points(len(wl.layers), methods)
    chosen: dict[float, Optional[Point]] = {}
    if "plan" in methods:
        try:
            prof = profile(wl, device, min_size, args.link_gbps, notes)
        except Exception as exc:  # the measured configurations are still worth having
            notes.append(f"plan: profile_step failed, no plans: {type(exc).__name__}: {exc}")
            device.free_memory()
        else:
            verify = None
            if args.verify:
                def verify(plan: Plan, name: str) -> Plan:
                    return hf_bench.verified(plan, wl, device, args, notes, name)
            chosen = add_plans(points, prof, budgets, notes, verify)
    configs = points[1:]
    count = 0
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        start = none.step_ms if r == 0 else retime(none, wl, device, args, min_size)
        nones = [(0.0, start)]
        timed = []
        for i, p in enumerate(order, start=1):
            if p.error:
                continue
            if r == 0:
                measure(p, wl, device, args, min_size, reference)
                ms = p.step_ms
            else:
                ms = retime(p, wl, device, args, min_size)
            if ms is not None and not p.error:
                timed.append((float(i), p, ms))
            if args.none_every and i % args.none_every == 0 and i < len(order):
                nones.append((i + 0.5, retime(none, wl, device, args, min_size)))
        if r == args.rounds - 1:
            end = Point("none (end)")
            measure(end, wl, device, args, min_size, reference)
            nones.append((len(order) + 0.5, end.step_ms))
        else:
            nones.append((len(order) + 0.5, retime(none, wl, device, args, min_size)))
        count += len(nones)
        nones = sorted(n for n in nones if n[1])
        for pos, p, ms in timed:
            p.round_ratios.append(ms / interpolate(nones, pos))
    combine_rounds(points, none)
    derive([end], none)  # the end against the start: the drift
    notes.insert(0, drift_note(none, end) + f"; {args.rounds} rounds, {count} none "
                 "measurements, time ratios to none interpolated around each configuration in "
                 "its round, median over the rounds")
    return points + [end], chosen


@contextlib.contextmanager
def installed(point: Point, wl: Any, device: BenchDevice, min_size: int) -> Iterator[None]:
    """``point`` installed on ``wl``'s layers for the block; then removed, and its copies and
    memory let go, whatever happens."""
    handle = install(point, wl.layers, device, min_size)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
        device.take_copy_count()
        device.free_memory()


def retime(point: Point, wl: Any, device: BenchDevice, args: argparse.Namespace,
           min_size: int) -> Optional[float]:
    """One more timing of ``point`` (installed, warmed up, timed, removed): its median step
    time, also appended to ``round_ms``; None (and ``error`` set) if it fails."""
    try:
        with installed(point, wl, device, min_size):
            ms = hf_bench.time_steps(wl, device, args)
    except Exception as exc:  # one failing configuration must not lose the others
        point.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return None
    point.round_ms.append(ms)
    return ms


def head_to_head(a: Point, b: Point, wl: Any, device: BenchDevice, args: argparse.Namespace,
                 min_size: int) -> Optional[dict]:
    """``a`` against ``b`` in turns: ``args.confirm`` blocks each (every other pair in reverse
    order), a block being ``args.warmup`` untimed and ``args.iters`` timed steps with the
    configuration installed. Returns ``ratio`` (median step of ``a`` over ``b``'s), its 90%
    bootstrap interval ``low``/``high`` and ``steps`` per side; None if either fails."""
    times: dict = {id(a): [], id(b): []}
    try:
        for block in range(args.confirm):
            for p in ((a, b) if block % 2 == 0 else (b, a)):
                with installed(p, wl, device, min_size):
                    times[id(p)] += hf_bench.step_times(wl, device, args.warmup, args.iters)
    except Exception:  # noqa: BLE001 - the rounds' comparison stands alone then
        return None
    ratio, low, high = ratio_interval(times[id(a)], times[id(b)])
    return {"ratio": ratio, "low": low, "high": high, "steps": len(times[id(a)])}


def head_to_heads(rows: list[dict], wl: Any, device: BenchDevice, args: argparse.Namespace,
                  min_size: int, notes: list[str]) -> None:
    """Where the planner's pick is not the winner, measure the two head to head
    (``head_to_head``, ``--confirm`` blocks; each pair once) and keep it in the row: the
    rounds' medians of a few steps each differ by a few percent from round to round, a
    head-to-head of many steps in turns settles a difference of about 1%."""
    done: dict = {}
    for row in rows:
        row["head_to_head"] = None
        pick, win = row["_pick"], row["_winner"]
        if not args.confirm or pick is None or win is None or pick is win:
            continue
        key = (pick.key, win.key)
        if key not in done:
            done[key] = head_to_head(pick, win, wl, device, args, min_size)
        h = row["head_to_head"] = done[key]
        if h is not None:
            notes.append(
                f"@{row['budget']:g}: head to head, {pick.label} / {win.label} = "
                f"{h['ratio']:.3f} (90% interval {h['low']:.3f}-{h['high']:.3f}; "
                f"{h['steps']} steps each, in turns)")


def combine_rounds(points: list[Point], base: Point) -> None:
    """Each point's time ratio, spread and range from its per-round ratios (``none``: 1);
    its step time the median of its rounds'; peak ratios to ``base``."""
    for p in points:
        if p is base:
            p.time_ratio, p.baseline_ms = 1.0, p.step_ms
        elif p.measured and p.round_ratios:
            p.time_ratio, p.spread, p.ratio_range = ratio_stats(p.round_ratios)
            p.step_ms = statistics.median(p.round_ms)
            p.baseline_ms = p.step_ms / p.time_ratio
        if p.peak_bytes is not None and base.peak_bytes:
            p.peak_ratio = p.peak_bytes / base.peak_bytes


def report(
    name: str, points: list[Point], rows: list[dict], methods: list[str], notes: list[str],
    device: BenchDevice,
) -> None:
    print(f"\n{name}: every measured configuration (time ratios to none measured around it)")
    print(points_table(points))
    print(f"\n{name}: fastest configuration per method within each peak budget (x none)")
    print(frontier_table(rows, methods))
    for note in notes:
        print(note)
    for p in points:
        if p.error:
            print(f"ERROR {p.label}: {p.error}")
        if p.exact is False:
            print(f"WARNING {p.label}: not bit-exact with none")
    if not device.is_cuda:
        print("NOTE: simulated device -- a smoke test of this script; timings mean nothing and "
              "peak memory is not measured, so no configuration fits a budget ('-').")


def main(argv: Optional[list[str]] = None) -> dict:
    """Run the chosen workloads; returns ``{workload: payload}`` (skipped ones absent)."""
    args = parse_args(argv)
    budgets, methods = parse_lists(args)
    device = BenchDevice.from_flag(args.device)
    prepare_determinism(device)
    args.warmup = args.warmup if args.warmup is not None else (2 if device.is_cuda else 0)
    args.iters = max(1, args.iters if args.iters is not None else (5 if device.is_cuda else 1))
    args.rounds = max(1, args.rounds)
    args.confirm = max(0, args.confirm if args.confirm is not None else (6 if device.is_cuda else 0))
    args.verify = max(0, args.verify if args.verify is not None else (3 if device.is_cuda else 0))
    if not device.is_cuda:
        torch.set_num_threads(1)  # tiny tensors: more threads only oversubscribe small machines
    print(f"device: {device.describe()} | torch {torch.__version__}")
    results = {}
    for name in (WORKLOADS if args.workload == "both" else (args.workload,)):
        if name == "hf" and not _have_transformers():
            print("\nhf: skipped, transformers is not installed (pip install 'transformers>=5')")
            continue
        with _heap_frozen():
            results[name] = run_workload(name, args, device, budgets, methods)
        device.free_memory()  # unfrozen again: whatever cycles the workload left go now
    return results


@contextlib.contextmanager
def _heap_frozen() -> Iterator[None]:
    """Keep what is alive now out of the cyclic GC (``freeze_live``), until the end."""
    freeze_live()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_live() -> None:
    """Collect, then move every object still alive (torch, transformers, the model: ~0.1 s per
    full collection) out of the cyclic GC's reach: each measurement collects twice (before its
    timed steps, after its teardown), dozens of times per workload, and then scans only what
    the measurement made."""
    gc.collect()
    gc.freeze()


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
