"""Performance benchmark: step time and peak memory of activation offloading vs baselines.

All methods run in one process on one model, so ratios compare like with like:

- ``none``         no offloading (the reference for every ratio and for bit-exactness);
- ``checkpoint``   ``torch.utils.checkpoint`` around each layer (``use_reentrant=False``);
- ``save_on_cpu``  ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the whole forward;
- ``v2`` / ``v1``  this library, ``get_cpu_offload_context(enabled=True, num_layers=k,
  model_layers=n)`` for each k of ``--ks``; V1 via ``NVTE_CPU_OFFLOAD_V1=1``, with the blocks'
  ``tag_activations`` switched on because V1 offloads only tagged tensors (see ``cpu_offload.examples.gpt``);
- ``v2 verify``    V2 at k=2 (else the smallest k of ``--ks``) with ``verify=True`` (a device checksum of every
  offloaded storage, checked after its reload; the check blocks the host): the cost of verify mode.

Per method: ``--warmup`` untimed steps, then ``--iters`` timed steps (CUDA events, median).
Then ``--rounds`` more rounds (default 3 on CUDA) time every method again, in turn
(``bench_common.interleaved_rounds``: every other round in reverse order, ``none`` first and
last), so that drift hits every method alike: ``time x`` is the median over the rounds of the
method's step time over ``none``'s in the same round, ``spread %`` the range of those per-round
ratios over it, and ``step ms`` the median of the rounds (``fwd ms``, ``bwd ms`` and the peak
come from the first pass).
Peak memory is ``max_memory_allocated() - memory_allocated()`` taken right before each step (the
max over timed steps), i.e. above what the step starts with. Weight gradients are preallocated and
zeroed in place before each step (``zero_grad(set_to_none=False)``, as training loops with
persistent gradient buffers do), so the peak measures activations and temporaries, not the 3.2 GB
of weight gradients; ``--grads-set-to-none`` measures the other convention.

Bit-exactness: after its timed steps each method runs one more step with
``torch.use_deterministic_algorithms(True)`` (timed steps use the ordinary, faster kernels; flash
attention's backward is not bit-reproducible without it), and its output, weight gradients and
input gradient are compared with ``none``'s by ``torch.equal``. The ``none`` baseline runs two
such steps and reports whether they agree with each other (its ``exact`` cell).

Offloaded bytes are not reported by the library; they are computed once per layer by a counting
saved-tensor hook (outside any offload context) that applies V2's own selection predicate and
counts each storage once, as V2 moves whole storages once; V1 counts tagged tensors, save_on_cpu
every saved tensor (it copies each one, parameters included). ``D2H GB/s`` = offloaded bytes /
forward time and ``H2D GB/s`` = offloaded bytes / backward time: with the default schedule every
offload finishes inside the forward and every reload inside the backward, so these are lower
bounds of the achieved transfer rate, close to it when the pass is transfer-bound (k=6).

Run on the GPU machine (one to two minutes for the default reference workload)::

    python benchmarks/offload_benchmark.py --out bench_out

Smoke test of the script on a CPU (tiny model, ``SimulatedDevice``; numbers mean nothing)::

    python benchmarks/offload_benchmark.py --device sim
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from bench_common import (
    BenchDevice,
    backend,
    environment_info,
    format_table,
    gc_paused,
    interleaved_rounds,
    median,
    deterministic_algorithms,
    plottable,
    prepare_determinism,
    ratio_stats,
    save_plot,
    write_json,
)

import torch  # noqa: E402  (after bench_common, which puts the repo on sys.path)
from torch.utils.checkpoint import checkpoint  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input, reference_config, tiny_config  # noqa: E402
from cpu_offload.plan import Plan, StepProfile, plan as make_plan, profile_layers  # noqa: E402
from cpu_offload.v2.selection import DEFAULT_MIN_TENSOR_SIZE, SelectionPolicy  # noqa: E402

GIB = 1024**3
# Performance targets: k -> (max step-time ratio, max peak-memory ratio), 8-layer stack.
TARGETS = {2: (1.01, 0.88), 6: (1.45, 0.64)}
BASELINES = ("none", "checkpoint", "save_on_cpu")
LIBRARY = ("v2", "v1")
VERIFY = "verify"  # --methods name of the "v2 verify" row
VERIFY_TAG = " verify"
PLANNED = "plan"  # cpu_offload.plan: offload + recompute chosen for a memory budget
PLANS: dict[str, Plan] = {}  # method label -> the plan it runs
SIM_MIN_TENSOR_SIZE = 1024  # tiny model: offload what a real model would (skip LN stats, lse)


# ---------------------------------------------------------------------------------------------
# workload


@dataclass(frozen=True)
class Method:
    name: str
    k: Optional[int] = None
    tag: str = ""

    @property
    def label(self) -> str:
        return self.name + (f" k={self.k}" if self.k is not None else "") + self.tag


class Workload:
    """Model, input, fixed output gradient and gradient buffers shared by every method."""

    def __init__(self, cfg: GPTConfig, device: BenchDevice, seed: int, grads_to_none: bool) -> None:
        self.cfg = cfg
        self.model = build_model(cfg, device.torch_device, seed=seed)
        self.x = make_input(cfg, device.torch_device, seed=seed + 1)
        self.grad_out = make_input(cfg, device.torch_device, seed=seed + 2, requires_grad=False)
        self.grads_to_none = grads_to_none
        self.layers = self.model.layers
        self.leaves = [self.x] + list(self.model.parameters())
        if not grads_to_none:
            for t in self.leaves:
                t.grad = torch.zeros_like(t)

    def reset_grads(self) -> None:
        if self.grads_to_none:
            for t in self.leaves:
                t.grad = None
        else:
            torch._foreach_zero_([t.grad for t in self.leaves])

    def step(self) -> torch.Tensor:
        """One training step of the plain model (offloading, if any, installed on ``layers`` by
        ``apply_offloading``); returns the detached output. The step interface of the HF
        workload (``hf_llama_benchmark.Workload.step``), so ``frontier.py`` drives both alike."""
        self.reset_grads()
        out = self.model(self.x)
        out.backward(self.grad_out)
        return out.detach()

    def snapshot(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the output and of all gradients, for bit-exact comparison."""
        return [out.detach().clone()] + [t.grad.detach().clone() for t in self.leaves]

    def matches(self, reference: list[torch.Tensor], out: torch.Tensor) -> bool:
        current = [out] + [t.grad for t in self.leaves]
        return all(g is not None and torch.equal(r, g) for r, g in zip(reference, current))


def saved_bytes_per_layer(wl: Workload, select: Callable[[torch.Tensor], bool], dedup: bool) -> int:
    """Bytes of the tensors one layer saves for backward that ``select`` accepts.

    ``dedup``: count each storage once, whole (what V2 moves); else each tensor's own bytes."""
    per_storage: dict[int, int] = {}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if select(t):
            if dedup:
                per_storage[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            else:
                total += t.numel() * t.element_size()
        return t

    x = wl.x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = wl.model.layers[0](x)
    del out
    return total + sum(per_storage.values())


def offload_bytes_table(wl: Workload, device: BenchDevice, min_size: int) -> dict[str, int]:
    """Per-layer offloaded bytes for each method (see module docstring)."""
    is_dev = (lambda t: t.is_cuda) if device.is_cuda else (lambda t: t.device.type == "cpu")
    policy = SelectionPolicy(min_tensor_size_to_offload=min_size, is_device_tensor=is_dev)
    wl.model.set_tag_activations(True)
    try:
        with backend("v2"):  # tags become plain attributes; V1 itself is not needed to count
            v1 = saved_bytes_per_layer(
                wl, lambda t: is_dev(t) and getattr(t, "activation_offloading", False), dedup=True
            )
    finally:
        wl.model.set_tag_activations(False)
    return {
        "v2": saved_bytes_per_layer(wl, lambda t: policy.skip_reason(t) is None, dedup=True),
        "v1": v1,
        "save_on_cpu": saved_bytes_per_layer(wl, is_dev, dedup=False),
        "all_activations": saved_bytes_per_layer(
            wl, lambda t: is_dev(t) and not cpu_offload.core.markers.is_weight(t), dedup=True
        ),
    }


# ---------------------------------------------------------------------------------------------
# one step, one method


@dataclass
class StepStats:
    fwd_ms: float
    bwd_ms: float
    peak: Optional[int]
    before: Optional[int]

    @property
    def step_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def run_step(
    forward: Callable[[torch.Tensor], torch.Tensor], wl: Workload, device: BenchDevice
) -> tuple[StepStats, torch.Tensor]:
    """Forward + backward with ``wl.grad_out``; returns the stats and the detached output."""
    wl.reset_grads()
    device.synchronize()
    before = device.memory_allocated()
    device.reset_peak()
    t0 = device.mark()
    out = forward(wl.x)
    t1 = device.mark()
    out.backward(wl.grad_out)
    t2 = device.mark()
    device.synchronize()
    peak = device.max_memory_allocated()
    stats = StepStats(
        fwd_ms=device.elapsed_ms(t0, t1),
        bwd_ms=device.elapsed_ms(t1, t2),
        peak=None if peak is None else peak - before,
        before=before,
    )
    return stats, out.detach()


def make_forward(method: Method, wl: Workload, device: BenchDevice, min_size: Optional[int]):
    """The forward function of ``method`` (call inside ``backend(method.name)``)."""
    model = wl.model
    if method.name == "none":
        return lambda x: model(x)
    if method.name == "checkpoint":
        return lambda x: model(x, layer_fn=_checkpointed)
    if method.name == "save_on_cpu":

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.save_on_cpu(pin_memory=device.is_cuda):
                return model(x)

        return forward
    kwargs: dict[str, Any] = dict(
        enabled=True,
        num_layers=method.k,
        model_layers=len(model.layers),
        device=device.offload_device(),
    )
    if method.name == "v2" and min_size is not None:
        kwargs["min_tensor_size_to_offload"] = min_size  # V1 rejects this V2-only argument
    if method.tag == VERIFY_TAG:
        kwargs["verify"] = True
    if method.name == PLANNED:
        chosen = PLANS[method.label]
        kwargs["num_layers"] = chosen.num_layers
        recompute = {id(model.layers[i]) for i in chosen.recompute}

        def layer_fn(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return _checkpointed(layer, x) if id(layer) in recompute else layer(x)

        if min_size is not None:
            kwargs["min_tensor_size_to_offload"] = min_size
        if chosen.num_layers == 0:
            return lambda x: model(x, layer_fn=layer_fn)
        ctx, sync = cpu_offload.get_cpu_offload_context(**kwargs)
        if chosen.partial_bytes is not None:  # the last offloaded layer moves only part
            ctx.synchronizer.limit_layer_bytes(chosen.num_layers - 1, chosen.partial_bytes)
        return lambda x: model(x, ctx, sync, layer_fn)
    ctx, sync = cpu_offload.get_cpu_offload_context(**kwargs)
    model.set_tag_activations(method.name == "v1")
    return lambda x: model(x, ctx, sync)


def _checkpointed(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(layer, x, use_reentrant=False)


@dataclass
class Result:
    method: str
    k: Optional[int]
    label: str
    tag: str = ""
    step_ms: Optional[float] = None
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    peak_bytes: Optional[int] = None
    mem_growth_bytes: Optional[int] = None
    bit_exact: Optional[bool] = None
    offloaded_bytes: int = 0
    time_ratio: Optional[float] = None
    peak_ratio: Optional[float] = None
    d2h_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None
    target: Optional[str] = None
    verdict: Optional[str] = None
    error: Optional[str] = None
    exact_error: Optional[str] = None
    sim_copies: Optional[int] = None  # simulated device only: copy operations it performed
    step_ms_all: list = field(default_factory=list)
    round_ms: list = field(default_factory=list)  # step time (median) of each timing round
    round_ratios: list = field(default_factory=list)  # per round: step time / none's
    spread: Optional[float] = None  # (max - min) / median of round_ratios


def measure(
    method: Method, wl: Workload, device: BenchDevice, args: argparse.Namespace,
    reference: Optional[list[torch.Tensor]], baseline: bool = False,
) -> tuple[Result, Optional[list[list[torch.Tensor]]]]:
    """Warm up, time ``args.iters`` steps, then check bit-exactness against ``reference``.

    The ``baseline`` returns snapshots of two deterministic steps instead."""
    res = Result(method.name, method.k, method.label, method.tag)
    snapshots = None
    try:
        with backend(method.name):
            forward = make_forward(method, wl, device, args.min_tensor_size)
            try:
                _fill_timings(res, time_steps(forward, wl, device, args))
            except Exception as exc:  # one failing method must not lose the others' numbers
                res.error = _one_line(exc)
            if res.error is None and not args.no_exact and (baseline or reference is not None):
                try:
                    snapshots = exactness_check(forward, wl, device, None if baseline else reference, res)
                except Exception as exc:
                    res.exact_error = _one_line(exc)
            del forward
            res.sim_copies = device.take_copy_count()
    except Exception as exc:  # the context could not be created
        res.error = _one_line(exc)
    finally:
        wl.model.set_tag_activations(False)
        device.free_memory()
    return res, snapshots


def timing_rounds(plan: list[Method], results: list[Result], wl: Workload, device: BenchDevice,
                  args: argparse.Namespace) -> None:
    """``args.rounds`` interleaved rounds of every method that ran (not the ``none`` re-check at
    the end, a drift check of the first pass); sets ``round_ms``, ``round_ratios`` and
    ``step_ms`` (the median of the rounds)."""
    runs = {r.label: m for m, r in zip(plan, results) if r.error is None and m.tag != "@end"}
    if not args.rounds or results[0].label not in runs:
        return

    def time_one(label: str) -> float:
        method = runs[label]
        try:
            with backend(method.name):
                forward = make_forward(method, wl, device, args.min_tensor_size)
                return median([s.step_ms for s in time_steps(forward, wl, device, args)])
        finally:
            wl.model.set_tag_activations(False)
            device.free_memory()

    times = interleaved_rounds(list(runs), time_one, args.rounds)
    base = times[results[0].label]
    for r in results:
        if r.label in times:
            r.round_ms = times[r.label]
            r.step_ms = median(r.round_ms)
            r.round_ratios = [ms / b for ms, b in zip(r.round_ms, base)]


def time_steps(forward: Callable, wl: Workload, device: BenchDevice, args: argparse.Namespace) -> list[StepStats]:
    """Warm-up steps, then timed steps with the cyclic GC paused (memory must not grow)."""
    for _ in range(args.warmup):
        run_step(forward, wl, device)
    steps = []
    with gc_paused():
        for _ in range(args.iters):
            steps.append(run_step(forward, wl, device)[0])
    return steps


def exactness_check(
    forward: Callable, wl: Workload, device: BenchDevice,
    reference: Optional[list[torch.Tensor]], res: Result,
) -> Optional[list[list[torch.Tensor]]]:
    """One step with deterministic algorithms on (flash-attention backward otherwise
    accumulates with atomics), compared with ``reference`` by ``torch.equal``; the baseline
    runs two such steps and returns both snapshots."""
    with deterministic_algorithms():
        _, out = run_step(forward, wl, device)
        if reference is not None:
            res.bit_exact = wl.matches(reference, out)
            return None
        first = wl.snapshot(out)
        del out
        _, out = run_step(forward, wl, device)
        return [first, wl.snapshot(out)]


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def _fill_timings(res: Result, steps: list[StepStats]) -> None:
    res.step_ms_all = [round(s.step_ms, 3) for s in steps]
    res.step_ms = median([s.step_ms for s in steps])
    res.fwd_ms = median([s.fwd_ms for s in steps])
    res.bwd_ms = median([s.bwd_ms for s in steps])
    if steps and steps[0].peak is not None:
        res.peak_bytes = max(s.peak for s in steps)
        res.mem_growth_bytes = steps[-1].before - steps[0].before


def derive(res: Result, base: Result, per_layer: dict[str, int], n_layers: int) -> None:
    """Ratios vs ``none``, offloaded bytes, achieved GB/s and the verdict against the target."""
    if res.error or res.step_ms is None:
        return
    if res.method in LIBRARY:
        res.offloaded_bytes = per_layer[res.method] * res.k
    elif res.method == PLANNED:
        chosen = PLANS.get(res.label)
        part = chosen.partial_bytes if chosen is not None else None
        res.offloaded_bytes = per_layer["v2"] * (res.k - (part is not None)) + (part or 0)
    elif res.method == "save_on_cpu":
        res.offloaded_bytes = per_layer["save_on_cpu"] * n_layers
    if res.round_ratios:
        res.time_ratio, res.spread, _ = ratio_stats(res.round_ratios)
    elif base.step_ms:
        res.time_ratio = res.step_ms / base.step_ms
    if base.peak_bytes and res.peak_bytes is not None:
        res.peak_ratio = res.peak_bytes / base.peak_bytes
    if res.offloaded_bytes:
        res.d2h_gbps = res.offloaded_bytes / 1e9 / (res.fwd_ms / 1e3)
        res.h2d_gbps = res.offloaded_bytes / 1e9 / (res.bwd_ms / 1e3)
    target = TARGETS.get(res.k) if res.method in LIBRARY and not res.tag else None
    if res.method == PLANNED:  # judged by the target whose memory bound it was planned for
        budget = float(res.tag.split("@")[1].split()[0])
        target = next((t for t in TARGETS.values() if abs(t[1] - budget) < 1e-9), None)
    if target is not None and n_layers == 8:
        t_max, m_max = target
        res.target = f"t<={t_max} m<={m_max}"
        if res.time_ratio is None or res.peak_ratio is None:
            res.verdict = "n/a"
        else:
            ok = res.time_ratio <= t_max and res.peak_ratio <= m_max and res.bit_exact is not False
            res.verdict = "PASS" if ok else "FAIL"


# ---------------------------------------------------------------------------------------------
# the link


def measure_link(device: BenchDevice, nbytes: int, reps: int) -> dict:
    """Pinned host <-> device copy rates (GB/s = 1e9 B/s): D2H, H2D, and both at once on two
    streams (per-direction rate and the sum). On the simulated device: host memcpy (meaningless)."""
    if device.is_cuda:
        host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        dev = [torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device) for _ in range(2)]
    else:
        host = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
        dev = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
    copies = {
        "d2h": [(host[0], dev[0])],
        "h2d": [(dev[1], host[1])],
        "both": [(host[0], dev[0]), (dev[1], host[1])],
    }
    out: dict[str, Any] = {"bytes": nbytes, "reps": reps}
    for name, pairs in copies.items():
        _timed_copies(device, pairs)  # warm-up
        ms = median([_timed_copies(device, pairs) for _ in range(reps)])
        out[f"{name}_gbps"] = nbytes / 1e9 / (ms / 1e3)
    out["both_total_gbps"] = 2 * out["both_gbps"]
    del host, dev, copies
    device.free_memory()
    if device.is_cuda and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # give the 2 GiB of pinned buffers back to the OS
    return out


def _timed_copies(device: BenchDevice, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Milliseconds to run the ``(dst, src)`` copies concurrently, one side stream each."""
    if not device.is_cuda:
        t0 = time.perf_counter()
        for dst, src in pairs:
            dst.copy_(src)
        return (time.perf_counter() - t0) * 1e3
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    ends = []
    for dst, src in pairs:
        stream = torch.cuda.Stream()
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
        ends.append(end)
    torch.cuda.synchronize()
    return max(start.elapsed_time(e) for e in ends)


# ---------------------------------------------------------------------------------------------
# report


HEADERS = (
    "method", "k", "step ms", "fwd ms", "bwd ms", "time x", "spread %", "peak GiB", "peak x",
    "exact", "offl GiB", "D2H GB/s", "H2D GB/s", "target", "verdict",
)


def result_row(r: Result) -> list[Any]:
    name = r.method + r.tag
    if r.error:
        return [name, r.k, "ERROR (below)"] + [None] * (len(HEADERS) - 3)
    gib = (lambda b: None if b is None else b / GIB)
    return [
        name, r.k, r.step_ms, r.fwd_ms, r.bwd_ms, r.time_ratio,
        None if r.spread is None else 100 * r.spread, gib(r.peak_bytes), r.peak_ratio,
        r.bit_exact, gib(r.offloaded_bytes) if r.offloaded_bytes else None, r.d2h_gbps,
        r.h2d_gbps, r.target, r.verdict,
    ]


def print_report(results: list[Result], link: Optional[dict], device: BenchDevice, notes: list[str]) -> None:
    print()
    print(format_table(HEADERS, [result_row(r) for r in results]))
    if link:
        print(
            f"\nlink (pinned, {link['bytes'] / GIB:.2f} GiB buffers, median of {link['reps']}): "
            f"D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s, "
            f"both at once {link['both_gbps']:.1f} GB/s each way ({link['both_total_gbps']:.1f} total)"
        )
    for r in results:
        if r.error:
            print(f"ERROR {r.label}: {r.error}")
        if r.exact_error:
            print(f"ERROR {r.label} (exactness step, deterministic algorithms on): {r.exact_error}")
        if r.mem_growth_bytes:
            print(f"WARNING {r.label}: memory held before the step grew by {r.mem_growth_bytes} B "
                  "over the timed steps (leak or reference cycle?)")
    for note in notes:
        print(note)
    if not device.is_cuda:
        print("simulated copy operations per method: " + ", ".join(
            f"{r.label} {r.sim_copies}" for r in results if r.sim_copies is not None))
        print("NOTE: simulated device -- a smoke test of this script; timings mean nothing and "
              "peak memory is not measured.")


def plot(results: list[Result], path: Path) -> None:
    """Time ratio vs peak-memory ratio per method, with the target regions shaded."""
    plt, points = plottable(results)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for k, (t_max, m_max) in TARGETS.items():
        ax.add_patch(plt.Rectangle((0, 0), m_max, t_max, alpha=0.08, color=f"C{k}"))
        ax.annotate(f"target k={k}", (m_max, t_max), fontsize=8, ha="right", va="bottom")
    markers = {"none": "o", "checkpoint": "s", "save_on_cpu": "D", "v2": "^", "v1": "v", "plan": "*"}
    for i, name in enumerate(dict.fromkeys(r.method for r in points)):
        group = [r for r in points if r.method == name]
        ax.scatter([r.peak_ratio for r in group], [r.time_ratio for r in group],
                   marker=markers.get(name, "x"), label=name, color=f"C{i}")
        for r in group:
            if r.k is not None:
                ax.annotate(f"k={r.k}", (r.peak_ratio, r.time_ratio), fontsize=8,
                            xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("peak memory / none")
    ax.set_ylabel("step time / none")
    ax.set_xlim(0, max(1.1, max(r.peak_ratio for r in points) * 1.05))
    ax.set_ylim(min(0.9, min(r.time_ratio for r in points) * 0.95), max(r.time_ratio for r in points) * 1.05)
    save_plot(plt, fig, ax, "activation offloading: time vs memory (lower-left is better)", path)


# ---------------------------------------------------------------------------------------------
# main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto",
                   help="cuda: real GPU; sim: CPU + SimulatedDevice smoke test (default: auto)")
    p.add_argument("--methods", default="none,checkpoint,save_on_cpu,v2,v1,verify,plan",
                   help="comma list of none,checkpoint,save_on_cpu,v2,v1,plan (none always runs)")
    p.add_argument("--ks", default="1,2,4,6", help="offloaded layers k for v2/v1")
    p.add_argument("--plan-budgets", default="0.88,0.64",
                   help="comma list of peak-memory budgets (fractions of none) for the "
                        "'plan' method: cpu_offload.plan picks offload + recompute for each")
    for name in ("hidden", "heads", "seq", "batch", "layers"):
        p.add_argument(f"--{name}", type=int, help=f"override the workload's {name}")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--warmup", type=int, help="untimed steps per method (cuda 3, sim 1)")
    p.add_argument("--iters", type=int, help="timed steps per method (cuda 10, sim 2)")
    p.add_argument("--rounds", type=int, help="interleaved timing rounds after the first pass "
                   "(cuda 3, sim 1): time x is the median of the per-round ratios to none")
    p.add_argument("--min-tensor-size", type=int,
                   help="v2 min_tensor_size_to_offload (library default on cuda, "
                        f"{SIM_MIN_TENSOR_SIZE} on sim)")
    p.add_argument("--link-mib", type=int, help="link test buffer size (cuda 1024, sim 16)")
    p.add_argument("--link-reps", type=int, default=5)
    p.add_argument("--no-link", action="store_true", help="skip the link measurement")
    p.add_argument("--no-recheck", action="store_true",
                   help="skip re-running none at the end (drift check)")
    p.add_argument("--grads-set-to-none", action="store_true",
                   help="allocate weight grads during backward instead of zeroing them in place")
    p.add_argument("--no-exact", action="store_true",
                   help="skip the bit-exactness step (deterministic algorithms) after the timing")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out", help="directory for JSON and PNG")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


def workload_config(args: argparse.Namespace, device: BenchDevice) -> GPTConfig:
    cfg = reference_config() if device.is_cuda else tiny_config().with_(layers=8)
    changes = {n: getattr(args, n) for n in ("hidden", "heads", "seq", "batch", "layers")
               if getattr(args, n) is not None}
    if args.dtype:
        changes["dtype"] = getattr(torch, args.dtype)
    return cfg.with_(**changes)


def plan_methods(args: argparse.Namespace, n_layers: int, notes: list[str]) -> list[Method]:
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(names) - set(BASELINES) - set(LIBRARY) - {PLANNED, VERIFY}
    if unknown:
        raise SystemExit(
            f"unknown --methods {sorted(unknown)}; choose from "
            f"{BASELINES + LIBRARY + (VERIFY, PLANNED)}"
        )
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    too_big = [k for k in ks if not 1 <= k < n_layers]
    if too_big:
        notes.append(f"skipped k={too_big}: need 1 <= k < model_layers={n_layers}")
    ks = [k for k in ks if 1 <= k < n_layers]
    plan = [Method("none")]
    plan += [Method(n) for n in BASELINES[1:] if n in names]
    plan += [Method(n, k) for n in LIBRARY if n in names for k in ks]
    if VERIFY in names and ks:
        plan.append(Method("v2", 2 if 2 in ks else min(ks), tag=VERIFY_TAG))
    if not args.no_recheck:
        plan.append(Method("none", tag="@end"))
    return plan


def planned_methods(
    args: argparse.Namespace, wl: Workload, link: Optional[dict], min_size: int, notes: list[str]
) -> list[Method]:
    """Profile the layers and let the planner choose a plan per memory budget."""
    profiles = profile_layers(list(wl.model.layers), wl.x, min_size)
    d2h = link["d2h_gbps"] if link else 50.0
    h2d = link["h2d_gbps"] if link else 50.0
    if not link:
        notes.append("plan: no link measurement (--no-link), assumed 50 GB/s each way")
    methods = []
    measured = getattr(args, "measured_none_peak", None)
    prof = StepProfile(profiles, peak_bytes=measured, d2h_gbps=d2h, h2d_gbps=h2d)
    for budget in (float(b) for b in args.plan_budgets.split(",") if b.strip()):
        base_peak = make_plan(prof).baseline_peak_bytes
        chosen = make_plan(prof, int(budget * base_peak))
        part = f" part={chosen.partial_fraction:g}" if chosen.partial_bytes is not None else ""
        method = Method(
            PLANNED, chosen.num_layers, f"@{budget}{part} rec={list(chosen.recompute)}"
        )
        PLANS[method.label] = chosen
        notes.append(f"plan @{budget}: {chosen.describe()}")
        methods.append(method)
    return methods


def main(argv: Optional[list[str]] = None) -> list[Result]:
    args = parse_args(argv)
    device = BenchDevice.from_flag(args.device)
    prepare_determinism(device)
    args.warmup = args.warmup if args.warmup is not None else (3 if device.is_cuda else 1)
    args.iters = max(1, args.iters if args.iters is not None else (10 if device.is_cuda else 2))
    args.rounds = max(0, args.rounds if args.rounds is not None else (3 if device.is_cuda else 1))
    if args.min_tensor_size is None and not device.is_cuda:
        args.min_tensor_size = SIM_MIN_TENSOR_SIZE
    link_mib = args.link_mib or (1024 if device.is_cuda else 16)
    cfg = workload_config(args, device)
    notes: list[str] = []
    plan = plan_methods(args, cfg.layers, notes)
    print(f"device: {device.describe()} | torch {torch.__version__}")
    print(f"workload: {cfg} | warmup {args.warmup}, timed {args.iters} steps per method")

    t_start = time.perf_counter()
    link = None if args.no_link else measure_link(device, link_mib * 1024**2, args.link_reps)
    wl = Workload(cfg, device, args.seed, args.grads_set_to_none)
    min_size = args.min_tensor_size if args.min_tensor_size is not None else DEFAULT_MIN_TENSOR_SIZE
    per_layer = offload_bytes_table(wl, device, min_size)
    warm, _ = run_step(lambda x: wl.model(x), wl, device)  # global warm-up (kernels, allocator)
    args.measured_none_peak = warm.peak
    device.free_memory()
    print("saved bytes per layer (MiB): " + ", ".join(f"{k} {v / 2**20:.3f}" for k, v in per_layer.items()))
    if PLANNED in args.methods.split(","):
        at = len(plan) - (0 if args.no_recheck else 1)
        plan[at:at] = planned_methods(args, wl, link, min_size, notes)

    results: list[Result] = []
    reference = None
    for i, method in enumerate(plan):
        res, snapshots = measure(method, wl, device, args, reference, baseline=i == 0)
        if i == 0:  # the none baseline
            if res.error:
                raise SystemExit(f"the none baseline failed, nothing to compare with: {res.error}")
            if snapshots is not None:
                first, reference = snapshots
                res.bit_exact = all(torch.equal(a, b) for a, b in zip(first, reference))
                if not res.bit_exact:
                    notes.append("WARNING: the none baseline is not bit-reproducible even with "
                                 "deterministic algorithms: the exact column is meaningless")
                del first, snapshots
        results.append(res)
        shown = "ERROR " + res.error if res.error else f"{res.step_ms:.2f} ms"
        print(f"  {res.label:<16} {shown}", flush=True)
    timing_rounds(plan, results, wl, device, args)
    base = results[0]
    for r in results:
        derive(r, base, per_layer, cfg.layers)
    notes.append(f"total benchmark time {time.perf_counter() - t_start:.1f} s")

    print_report(results, link, device, notes)
    out_dir = Path(args.out)
    write_json(out_dir / f"offload_benchmark_{device.kind}.json", {
        "environment": environment_info(device),
        "workload": {**{k: v for k, v in asdict(cfg).items() if k != "dtype"}, "dtype": str(cfg.dtype)},
        "args": vars(args),
        "saved_bytes_per_layer": per_layer,
        "link": link,
        "targets": {str(k): {"time_ratio": t, "peak_ratio": m} for k, (t, m) in TARGETS.items()},
        "results": [asdict(r) for r in results],
        "notes": notes,
    })
    if not args.no_plot:
        plot(results, out_dir / f"offload_benchmark_{device.kind}.png")
    return results


if __name__ == "__main__":
    main()
