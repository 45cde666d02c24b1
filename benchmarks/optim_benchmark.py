"""Optimizer-state offloading benchmark: HybridDeviceOptimizer vs plain GPU AdamW.

Workload: a GPT-style stack of ``cpu_offload.examples.gpt`` blocks, about 1.5B parameters (hidden 2048,
30 layers, 16 heads, sequence 2048, batch 2), bf16 weights, fp32 optimizer state (AdamW with fp32
master weights). Rows, each on a freshly built model in the same process:

- ``plain``        fused AdamW on the GPU over fp32 masters (``optim.reference``), the baseline;
- ``f=0.25/0.5/1`` HybridDeviceOptimizer with that ``offload_fraction``, ``overlap="next_forward"``
  (fused CPU AdamW on the worker thread, fused GPU AdamW for the rest);
- ``f=1 none``     fraction 1 with ``overlap="none"``: everything inside ``step()`` (Megatron-style);
- ``f=1 +act``     fraction 1 plus activation offloading of half the layers (V2);
- ``split f=0.25/0.5/1`` that ``offload_fraction`` with ``stream_fraction="auto"``: part of the
  offloaded parameters updated on the GPU from state streamed through a bounded staging area,
  the rest on the CPU, split so both finish together (the other ``f=`` rows: ``stream_fraction=0``,
  everything offloaded on the CPU);
- ``torchao f=1``  torchao's ``CPUOffloadOptimizer`` (fused AdamW, ``offload_gradients=True``)
  when torchao is importable: the peer users compare with (it keeps bf16 state and no fp32
  masters, so it moves and touches fewer bytes; its loss differs accordingly);
- ``plain bf16``, ``split f=0.25/0.5/1 bf16`` the same precision as torchao's: fused AdamW on the
  bf16 parameters with bf16 state on the GPU, and the hybrid with ``fp32_masters=False`` (state
  in bf16, no masters). Their loss difference is to ``plain bf16``, and so is torchao's.

Split rows add: the streamed share chosen, link time each way (H2D ms, D2H ms: measured bytes
per step over the measured link rates), and the optimizer's own balanced estimate (``balanced
ms``: max of its expected CPU update and link times, from the rates it measured at
construction, ``split_estimate()``). Their link time for the bound is the larger direction (the
streamed part copies both ways at once), not the sum.

Per row: GPU peak memory (max allocated over the timed steps) and steady memory (allocated
after a step: weights plus GPU optimizer state), step time (wall clock per training iteration,
host and device, mean over ``--iters`` consecutive iterations in steady state: with
``next_forward`` each timed step absorbs the previous step's CPU update, and the last step's
update, still in flight at the end, is not charged), GPU forward+backward
time alone (same model, no optimizer), CPU update time (worker thread), bytes over the link per
step and the achieved rate, the share of the CPU update that ran before ``step()`` was called
(i.e. overlapped backward), the largest loss difference to ``plain`` over the same steps (Megatron's
bound: < 0.001), and the target: step <= 1.10 x max(fwd+bwd, CPU update, link time), link
time = bytes to host / D2H GB/s + bytes to device / H2D GB/s (measured here).

First (unless ``--no-probe``) ``benchmarks/host_rates.py`` measures the host with plain torch,
not this library: fused CPU AdamW, the CPU path of a bf16 parameter, the pinned link, each alone
and the CPU path and link together. Per hybrid row, ``probe bound ms`` is max(fwd+bwd, the
offloaded work at those together rates), with the offloaded parameters all on the CPU (``f=``
rows) or split at the streamed share ``probe s`` that minimizes the work (``split`` rows): what
no schedule of this row can beat on this host.

``--big`` adds a model that does not fit on one 80 GB GPU with plain AdamW (about 5.6B
parameters: 16 B/param = 90 GB) but trains with optimizer (f=1) + activation offloading
(needs about 80 GB of host memory), with and without the split. A CPU microbenchmark runs first
(``--microbench-only``: just that; ``benchmarks/cpu_update_bench.py``, CPU only): per worker
thread count, raw fused AdamW (fp32 gradients already in place) against one bucket's whole CPU
update path (``CpuBucket.update``: bf16 gradient -> fp32, the same fused AdamW, fp32 -> bf16
write-back, from a staging buffer) on the same elements, and its parts (the chunk steps alone,
each conversion as a pass, an early update that keeps what it changes), as G elements/s and
time relative to raw AdamW, for each chunk size in ``--microbench-chunks`` (MiB of fp32 masters
per ``optimizer.step()``; 0: one step per bucket; ``default``: the optimizer's default for that
thread count); ``--microbench-compare CHECKOUT`` adds another checkout's bucket update in the same
rounds. ``--cpu-chunk-mib`` sets the chunk size of the training rows.

GPU (H100 + 16-core host, about 3 minutes; with --big about 5)::

    python benchmarks/optim_benchmark.py --out bench_out

The split against CPU-only offloading, and core binding (compare with and without)::

    python benchmarks/optim_benchmark.py --no-microbench \
        --rows "plain,f=0.25,f=0.5,f=1,split f=0.25,split f=0.5,split f=1"
    python benchmarks/optim_benchmark.py --no-microbench --rows "plain,f=1,split f=1" --bind-cores

CPU smoke test (tiny model, SimulatedDevice; numbers mean nothing)::

    python benchmarks/optim_benchmark.py --device sim
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

import host_rates
from bench_common import BenchDevice, environment_info, format_table, gc_paused, write_json

import torch  # noqa: E402  (after bench_common, which puts the repo on sys.path)

import cpu_offload  # noqa: E402
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input, tiny_config  # noqa: E402
from cpu_offload.optim import HybridDeviceOptimizer, OptimizerOffloadOptions  # noqa: E402
from cpu_offload.optim.options import STREAM_CHOICES  # noqa: E402
from cpu_offload.optim.reference import MasterWeightOptimizer  # noqa: E402
from cpu_offload.optim.worker import default_cpu_threads  # noqa: E402
from cpu_update_bench import microbench, parse_chunks, table as micro_table  # noqa: E402
from offload_benchmark import measure_link  # noqa: E402

GIB = 1024**3
TARGET = 1.10
DEFAULT_CFG = GPTConfig(hidden=2048, heads=16, seq=2048, batch=2, layers=30, dtype=torch.bfloat16)
BIG_CFG = GPTConfig(hidden=4096, heads=32, seq=2048, batch=1, layers=28, dtype=torch.bfloat16)
ROWS = {  # label -> (offload_fraction or None for plain, overlap, activation offloading,
    #                  stream_fraction[, "bf16": state in the parameters' dtype, no fp32 masters])
    "plain": (None, None, False, 0),
    "f=0.25": (0.25, "next_forward", False, 0),
    "f=0.5": (0.5, "next_forward", False, 0),
    "f=1": (1.0, "next_forward", False, 0),
    "f=1 none": (1.0, "none", False, 0),
    "f=1 +act": (1.0, "next_forward", True, 0),
    "split f=0.25": (0.25, "next_forward", False, "auto"),
    "split f=0.5": (0.5, "next_forward", False, "auto"),
    "split f=1": (1.0, "next_forward", False, "auto"),
    "split f=1 +act": (1.0, "next_forward", True, "auto"),
    "plain bf16": (None, None, False, 0, "bf16"),
    "split f=0.25 bf16": (0.25, "next_forward", False, "auto", "bf16"),
    "split f=0.5 bf16": (0.5, "next_forward", False, "auto", "bf16"),
    "split f=1 bf16": (1.0, "next_forward", False, "auto", "bf16"),
    "torchao f=1": ("torchao", None, False, 0, "bf16"),
}
KW = dict(lr=1e-4, weight_decay=0.1)


def precision(label: str) -> str:
    """A row's optimizer-state precision: "fp32" (fp32 masters) or "bf16" (ROWS' 5th field)."""
    spec = ROWS[label]
    return spec[4] if len(spec) > 4 else "fp32"


@dataclass
class Row:
    label: str
    workload: str
    params: int = 0
    step_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    cpu_update_ms: Optional[float] = None
    link_ms: Optional[float] = None
    link_gbps: Optional[float] = None
    gb_per_step: Optional[float] = None
    overlap_pct: Optional[float] = None
    peak_gib: Optional[float] = None
    steady_gib: Optional[float] = None
    max_loss_diff: Optional[float] = None
    stream_pct: Optional[float] = None
    h2d_ms: Optional[float] = None
    d2h_ms: Optional[float] = None
    balanced_ms: Optional[float] = None
    bound_ratio: Optional[float] = None
    verdict: Optional[str] = None
    offloaded: int = 0  # parameters offloaded (CPU part and streamed part)
    probe_share: Optional[float] = None  # the probe's streamed share (0: CPU-only rows)
    probe_bound_ms: Optional[float] = None  # max(fwd+bwd, offloaded work at the probe's rates)
    probe_ratio: Optional[float] = None
    error: Optional[str] = None
    losses: Optional[list] = None


def build_optimizer(model: torch.nn.Module, fraction: Optional[float], overlap: Optional[str],
                    device: BenchDevice, threads: Optional[int], chunk_mib: Optional[float] = None,
                    stream: Any = 0, bind: bool = False, budget_mib: Optional[float] = None,
                    during_backward: bool = False, masters: bool = True) -> Any:
    if fraction is None and not masters:  # bf16 state, as torch.optim keeps it on bf16 weights
        return torch.optim.AdamW(model.parameters(), fused=True, **KW)
    if fraction is None:  # what a mixed-precision loop does without offloading
        return MasterWeightOptimizer(model.parameters(), follow_edits=False, **KW)
    if fraction == "torchao":  # the peer users compare with: bf16 state on the CPU, no masters
        try:
            from torchao.optim import CPUOffloadOptimizer
        except ImportError as exc:
            raise _Skipped(f"torchao is not installed ({exc}); pip install torchao") from exc
        return CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, offload_gradients=True,
                                   fused=True, **KW)
    opt = HybridDeviceOptimizer(
        model.parameters(), fraction, overlap=overlap, param_update_in_fp32=masters,
        fp32_masters=masters, stream_fraction=stream, bind_cpu_cores=bind,
        **({"stream_during_backward": True} if during_backward and stream != 0 else {}),
        **({} if budget_mib is None else {"stream_budget_bytes": int(budget_mib * 2**20)}),
        device=None if device.is_cuda else cpu_offload.SimulatedDevice(), cpu_threads=threads,
        cpu_chunk_bytes=None if chunk_mib is None else int(chunk_mib * 2**20),
        bucket_bytes=64 * 2**20 if device.is_cuda else 2**14, **KW)
    opt.register_forward_waits(model)
    return opt


def make_forward(model: torch.nn.Module, act: bool, device: BenchDevice, cfg: GPTConfig):
    if not act:
        return lambda x: model(x)
    extra = {} if device.is_cuda else {"device": cpu_offload.SimulatedDevice(),
                                       "min_tensor_size_to_offload": 1024}
    ctx, sync = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=cfg.layers // 2, model_layers=cfg.layers, **extra)
    return lambda x: model(x, ctx, sync)


def run_row(label: str, spec: tuple, cfg: GPTConfig, workload: str, device: BenchDevice,
            args: argparse.Namespace, link: dict) -> Row:
    fraction, overlap, act, stream = spec[:4]
    masters = precision(label) == "fp32"
    if stream == "auto":
        stream = args.stream_fraction
    row = Row(label, workload)
    model = opt = None
    try:
        model = build_model(cfg, device.torch_device, seed=args.seed)
        row.params = sum(p.numel() for p in model.parameters())
        xs = [make_input(cfg, device.torch_device, seed=100 + i, requires_grad=False) for i in range(3)]
        opt = build_optimizer(model, fraction, overlap, device, args.threads, args.cpu_chunk_mib,
                              stream, args.bind_cores, args.stream_budget_mib,
                              args.stream_during_backward, masters)
        forward = make_forward(model, act, device, cfg)
        hybrid = isinstance(opt, HybridDeviceOptimizer)
        losses, stats = [], []

        def train_step(i: int) -> None:
            loss = forward(xs[i % len(xs)]).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
            if hybrid and opt.last_step_stats:
                stats.append(dict(opt.last_step_stats))

        for i in range(args.warmup):
            train_step(i)
        device.synchronize()
        device.reset_peak()
        moved0 = _moved(opt) if hybrid else (0, 0)
        del stats[:]
        # Steady state, as a training loop sees it: the timed steps start and end in the same
        # phase (device drained, the last step's CPU update in flight under "next_forward"), so
        # they pay for exactly `iters` CPU updates. Draining the last one (wait_params) would
        # charge one update more than the steps did; it happens once per training run.
        with gc_paused():
            t0 = time.perf_counter()
            for i in range(args.warmup, args.warmup + args.iters):
                train_step(i)
            device.synchronize()
            row.step_ms = (time.perf_counter() - t0) * 1e3 / args.iters
        if hybrid:
            opt.wait_params()
        if hybrid and opt.last_step_stats and (not stats or stats[-1] != opt.last_step_stats):
            stats.append(dict(opt.last_step_stats))
        peak = device.max_memory_allocated()
        row.peak_gib = None if peak is None else peak / GIB
        mem = device.memory_allocated()
        row.steady_gib = None if mem is None else mem / GIB
        row.losses = [float(v) for v in losses]
        # forward + backward alone (no_sync: the hybrid's hooks copy nothing)
        device.synchronize()
        t0 = time.perf_counter()
        for i in range(args.iters):
            with opt.no_sync() if hybrid else _null():
                forward(xs[i % len(xs)]).float().square().mean().backward()
            opt.zero_grad()
        device.synchronize()
        row.fwd_bwd_ms = (time.perf_counter() - t0) * 1e3 / args.iters
        if hybrid:
            row.offloaded = sum(p.numel() for p in opt.offloaded_params() + opt.streamed_params())
            moved = _moved(opt)
            out = (moved[0] - moved0[0]) / args.iters
            into = (moved[1] - moved0[1]) / args.iters
            row.gb_per_step = (out + into) / 1e9
            row.link_gbps = row.gb_per_step / (row.step_ms / 1e3)
            row.d2h_ms = out / link["d2h_gbps"] / 1e6
            row.h2d_ms = into / link["h2d_gbps"] / 1e6
            row.link_ms = row.d2h_ms + row.h2d_ms
            if stream != 0:  # the streamed part copies both ways at once
                row.link_ms = max(row.d2h_ms, row.h2d_ms)
                row.stream_pct = 100 * (opt.stream_fraction or 0.0)
                est = opt.split_estimate()
                row.balanced_ms = None if est is None else 1e3 * est["bound_s"]
            if stats:
                row.cpu_update_ms = 1e3 * sum(s["cpu_update_s"] for s in stats) / len(stats)
                row.overlap_pct = 100 * sum(s["overlapped_with_backward"] for s in stats) / len(stats)
            bound = max(row.fwd_bwd_ms, row.cpu_update_ms or 0.0, row.link_ms)
            row.bound_ratio = row.step_ms / bound
            row.verdict = "PASS" if row.bound_ratio <= TARGET else "FAIL"
    except _Skipped as exc:
        row.error = f"skipped: {exc}"
    except torch.cuda.OutOfMemoryError as exc:
        row.error = "OOM: " + str(exc).split("\n")[0][:120]
    except Exception as exc:  # one failing row must not lose the others
        row.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if isinstance(opt, HybridDeviceOptimizer):
            opt.close()
        del model, opt
        device.free_memory()
    return row


def add_probe_bound(row: Row, label: str, rates: Optional[host_rates.HostRates]) -> None:
    """The bound of a hybrid row from the host's own rates (``host_rates``): its offloaded
    parameters split at the share that minimizes their work (a ``split`` row) or all on the
    CPU (an ``f=`` row), the work overlapping forward and backward at best."""
    if rates is None or row.error or not row.offloaded or row.fwd_bwd_ms is None:
        return
    if precision(label) != "fp32":  # host_rates models the fp32-master path only
        return
    bound = host_rates.split_bound(row.offloaded, rates, None if label.startswith("split") else 0.0)
    row.probe_share = bound.stream_fraction
    row.probe_bound_ms = 1e3 * host_rates.bound_step_s(row.fwd_bwd_ms / 1e3, bound.seconds)
    row.probe_ratio = row.step_ms / row.probe_bound_ms


def _moved(opt: HybridDeviceOptimizer) -> tuple[int, int]:
    """Bytes copied so far (to the host, to the device), CPU path and streamed part."""
    parts = opt._parts
    return (opt._engine.bytes_out + sum(p.bytes_out for p in parts),
            opt._engine.bytes_in + sum(p.bytes_in for p in parts))


class _Skipped(Exception):
    """A row that cannot run here (a peer library that is not installed)."""


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


HEADERS = ("workload", "row", "params", "step ms", "fwd+bwd ms", "CPU upd ms", "link ms",
           "GB/step", "link GB/s", "upd overl. %", "peak GiB", "steady GiB", "max dloss",
           "stream %", "H2D ms", "D2H ms", "balanced ms", "step/bound", "target",
           "probe s %", "probe bound ms", "step/probe")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def table_rows(rows: list[Row]) -> list[list[Any]]:
    out = []
    for r in rows:
        if r.error:
            out.append([r.workload, r.label, _count(r.params), r.error[:60]]
                       + [None] * (len(HEADERS) - 4))
            continue
        out.append([r.workload, r.label, _count(r.params), r.step_ms, r.fwd_bwd_ms,
                    r.cpu_update_ms, r.link_ms, r.gb_per_step, r.link_gbps, r.overlap_pct,
                    r.peak_gib, r.steady_gib, r.max_loss_diff, r.stream_pct, r.h2d_ms, r.d2h_ms,
                    r.balanced_ms, r.bound_ratio, r.verdict,
                    None if r.probe_share is None else 100 * r.probe_share, r.probe_bound_ms,
                    r.probe_ratio])
    return out


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for cells in table_rows(rows):
        lines.append("| " + " | ".join("" if c is None else (f"{c:.3g}" if isinstance(c, float) else str(c))
                                       for c in cells) + " |")
    return "\n".join(lines) + "\n"


def stream_fraction_arg(raw: str) -> Union[str, float]:
    """``--stream-fraction`` (an argparse ``type``): what ``HybridDeviceOptimizer`` accepts
    (``OptimizerOffloadOptions`` decides), refused at parsing rather than row by row.

    Args:
        raw: the flag's text: "auto", "measure" or a share in [0, 1].

    Example::

        >>> stream_fraction_arg("measure"), stream_fraction_arg("0.75")
        ('measure', 0.75)
    """
    try:
        value = raw if raw in STREAM_CHOICES else float(raw)
        return OptimizerOffloadOptions(stream_fraction=value).stream_fraction
    except ValueError:  # float()'s, and OffloadConfigError (a ValueError)
        raise argparse.ArgumentTypeError(f"'auto', 'measure' or a number in [0, 1], not {raw!r}") from None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    for name in ("hidden", "heads", "seq", "batch", "layers"):
        p.add_argument(f"--{name}", type=int, help=f"override the default workload's {name}")
    p.add_argument("--warmup", type=int, help="untimed steps per row (cuda 2, sim 1)")
    p.add_argument("--iters", type=int, help="timed steps per row (cuda 4, sim 2)")
    p.add_argument("--threads", type=int, help="CPU worker threads (default: all cores but one)")
    p.add_argument("--big", action="store_true", help="add the model that needs offloading to fit")
    p.add_argument("--no-microbench", action="store_true")
    p.add_argument("--microbench-only", action="store_true")
    p.add_argument("--microbench-elems", type=int,
                   help="elements per bucket (cuda 32M = one default 64 MiB bf16 bucket, sim 1M)")
    p.add_argument("--microbench-threads", help="comma list of worker thread counts "
                   "(default 1, 2, 4, 8, all cores but one, all cores)")
    p.add_argument("--microbench-reps", type=int, help="timed rounds (cuda 5, sim 2)")
    p.add_argument("--microbench-chunks", default="0,default",
                   help="comma list of CPU update chunk sizes to compare, MiB of fp32 masters "
                        "(0: one optimizer step per bucket, as before chunking; 'default': "
                        "the optimizer's default for the thread count)")
    p.add_argument("--microbench-compare", metavar="CHECKOUT",
                   help="another checkout (its root): its cpu_update.CpuBucket timed as 'old ...' rows "
                        "in the same rounds (benchmarks/cpu_update_bench.py)")
    p.add_argument("--cpu-chunk-mib", type=float,
                   help="HybridDeviceOptimizer(cpu_chunk_bytes=...) for the rows, in MiB (default: its own)")
    p.add_argument("--stream-fraction", default="auto", type=stream_fraction_arg,
                   help="stream_fraction of the 'split' rows: 'auto' (default), 'measure' (time this "
                        "host when each optimizer is built) or a number in [0, 1]")
    p.add_argument("--stream-budget-mib", type=float,
                   help="stream_budget_bytes of the rows, in MiB (default: the optimizer's, 384)")
    p.add_argument("--bind-cores", action="store_true",
                   help="HybridDeviceOptimizer(bind_cpu_cores=True) for the rows and the microbench: "
                        "the CPU worker on physical cores (of the GPU's NUMA node)")
    p.add_argument("--stream-during-backward", action="store_true",
                   help="HybridDeviceOptimizer(stream_during_backward=True) for the 'split' rows")
    p.add_argument("--no-probe", action="store_true",
                   help="skip the host-rate probe (benchmarks/host_rates.py) and its bound column")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> list[Row]:
    args = parse_args(argv)
    device = BenchDevice.from_flag(args.device)
    args.warmup = args.warmup if args.warmup is not None else (2 if device.is_cuda else 1)
    args.iters = max(1, args.iters if args.iters is not None else (4 if device.is_cuda else 2))
    cfg = DEFAULT_CFG if device.is_cuda else tiny_config().with_(layers=4)
    cfg = cfg.with_(**{n: getattr(args, n) for n in ("hidden", "heads", "seq", "batch", "layers")
                       if getattr(args, n) is not None})
    labels = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = set(labels) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown --rows {sorted(unknown)}; choose from {list(ROWS)}")
    threads = args.threads or default_cpu_threads()
    print(f"device: {device.describe()} | torch {torch.__version__} | CPU worker threads {threads}")
    print(f"workload: {cfg} | warmup {args.warmup}, timed {args.iters} steps per row", flush=True)
    t_start = time.perf_counter()

    micro = []
    if not args.no_microbench or args.microbench_only:
        elems = args.microbench_elems or (32 * 2**20 if device.is_cuda else 2**20)
        cores = torch.get_num_threads()
        counts = sorted({t for t in (1, 2, 4, 8, cores - 1, cores) if 1 <= t <= cores})
        if args.microbench_threads:
            counts = [int(t) for t in args.microbench_threads.split(",")]
        reps = args.microbench_reps or (5 if device.is_cuda else 2)
        micro = microbench(counts, elems, reps, parse_chunks(args.microbench_chunks), args.bind_cores,
                           compare=args.microbench_compare)
    rows: list[Row] = []
    link: dict = {}
    rates = None
    if not args.microbench_only and not args.no_probe:
        rates = host_rates.measure(elems=2**26 if device.is_cuda else 2**16, threads=threads,
                                   reps=3 if device.is_cuda else 1)
        print(host_rates.rates_table(rates), flush=True)
    if not args.microbench_only:
        link = measure_link(device, (1024 if device.is_cuda else 16) * 2**20, 5)
        print(f"link: D2H {link['d2h_gbps']:.1f} GB/s, H2D {link['h2d_gbps']:.1f} GB/s", flush=True)
        workloads = [("default", cfg, labels)]
        if args.big:
            big = BIG_CFG if device.is_cuda else cfg.with_(layers=6)
            workloads.append(("big", big, ["plain", "f=1 +act", "split f=1 +act"]))
        for name, wcfg, wlabels in workloads:
            bases: dict = {}  # precision -> its plain row
            for label in wlabels:
                row = run_row(label, ROWS[label], wcfg, name, device, args, link)
                base = bases.get(precision(label))
                if label in ("plain", "plain bf16"):
                    bases[precision(label)] = row
                elif base is not None and base.losses and row.losses:
                    row.max_loss_diff = max(abs(a - b) for a, b in zip(row.losses, base.losses))
                add_probe_bound(row, label, rates)
                rows.append(row)
                shown = row.error or f"{row.step_ms:.1f} ms/step"
                print(f"  {name:8s} {label:12s} {shown}", flush=True)

    print()
    if micro:
        print(micro_table(micro))
        print()
    if rows:
        print(format_table(HEADERS, table_rows(rows)))
        print(f"\nbound = max(fwd+bwd, CPU update, link); target step/bound <= {TARGET}. "
              "'upd overl. %': share of the CPU update that ran before step() was called. "
              "probe: benchmarks/host_rates.py's rates measured together in this run; 'probe "
              "bound' = max(fwd+bwd, offloaded work at the streamed share 'probe s' that "
              "minimizes it; CPU-only rows: none streamed).")
    print(f"total benchmark time {time.perf_counter() - t_start:.1f} s")
    if not device.is_cuda:
        print("NOTE: simulated device -- a smoke test of this script; numbers mean nothing.")
    out = Path(args.out)
    write_json(out / f"optim_benchmark_{device.kind}.json", {
        "environment": environment_info(device), "workload": str(cfg), "args": vars(args),
        "link": link, "host_rates": None if rates is None else asdict(rates),
        "microbench": micro, "rows": [asdict(r) for r in rows],
    })
    (out / f"optim_benchmark_{device.kind}.md").write_text(markdown(rows))
    print(f"wrote {out / f'optim_benchmark_{device.kind}.md'}")
    return rows


if __name__ == "__main__":
    main()
