"""DDP and FSDP2 with and without activation offloading: step time and peak memory per rank.

Run on a host with 2 GPUs (one process per GPU, NCCL)::

    torchrun --standalone --nproc-per-node 2 benchmarks/distributed_benchmark.py --out bench_out

Workload (defaults): 8 plain-torch GPT blocks (``cpu_offload.examples.gpt``), hidden
2048, 16 heads, sequence 4096, batch 1 per rank, bf16, deterministic kernels; offloading the first
k of the 8 layers (``--ks``, default 2 and 4) with the default V2 schedule. Wrappers: ``single``
(no wrapper: each rank trains its own copy, both at once, the control that shares the host and
its PCIe links the same way but has no collectives), ``ddp`` (DDP around the whole stack) and
``fsdp2`` (``fully_shard`` on every block and on the stack).

For each row: median step time over ``--steps`` timed steps (after ``--warmup``); "host ms", the
median time until ``backward()`` returned (the host's share: near the step time means the host,
not the GPU, sets the pace); peak allocated memory above the memory held before the step; the
ratio of both to the same wrapper without offloading; the bytes each rank copied to the host per
step and "link ms", those bytes at the device-to-host bandwidth measured with both ranks copying
at once (a lower bound for the copies alone); and whether every gradient on this rank is
``torch.equal`` to the wrapper's run without offloading. Rank 0 prints the table (the maximum over
ranks) and writes ``distributed.json`` under ``--out``.

Optimizer rows (``--optim-fractions``, default 0.25 and 1; empty for none), for ``ddp`` and
``fsdp2``: a full training step (forward, backward, ``step()``, ``zero_grad()``) with plain fused
AdamW on the GPU, then with ``HybridDeviceOptimizer`` at each fraction (default overlap and
split; under DDP through its communication hook, under FSDP2 over each rank's shards). "peak GiB"
there is the whole allocated peak (model, gradients, optimizer state, activations) and "held GiB"
what stays allocated between steps, so the offloaded state shows; "exact" says that the
parameters (each rank's shards under FSDP2) after the timed steps equal, bit for bit, those of
``PlacedReference`` built from the hybrid's placement and stepped on the same inputs, and under
DDP that both ranks hold the same bits.

``--reference-size`` is the specification's reference workload per rank: hidden 4096, 32 heads,
sequence 4096, 8 layers (``--hidden 4096 --heads 32 --seq 4096 --layers 8``).

``--device cpu`` runs the same code on the CPU with gloo and the simulated device (a smoke test
of the script: times there mean nothing); it is the default where CUDA is not available.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from pathlib import Path

from bench_common import format_table, median, write_json  # also puts the checkout on sys.path

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cpu_offload import SimulatedDevice, compat, get_cpu_offload_context  # noqa: E402
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input  # noqa: E402
from cpu_offload.optim import HybridDeviceOptimizer  # noqa: E402
from cpu_offload.optim.reference import PlacedReference  # noqa: E402


DEFAULT_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPTIM_KW = {"lr": 1e-4, "weight_decay": 0.1}  # the optimizer rows' hyperparameters


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=DEFAULT_DEVICE,
                   help="default: cuda where CUDA is available, else cpu (gloo, simulated device)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ks", default="2,4", help="layers offloaded (the first k), comma-separated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--wrappers", default=None,
                   help="comma-separated among single, ddp, fsdp2; default: all three (on the CPU "
                        "fsdp2 only from torch 2.8, where FSDP2 runs on gloo)")
    p.add_argument("--link-mib", type=int, default=1024, help="buffer for the link measurement")
    p.add_argument("--optim-fractions", default="0.25,1",
                   help="offload_fraction of the HybridDeviceOptimizer rows (ddp, fsdp2); '' for none")
    p.add_argument("--reference-size", action="store_true",
                   help="hidden 4096, 32 heads, seq 4096, 8 layers per rank (the reference workload)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.reference_size:
        args.hidden, args.heads, args.seq, args.layers = 4096, 32, 4096, 8
    fsdp2_here = args.device == "cuda" or compat.TORCH_VERSION >= compat.Version("2.8")
    if args.wrappers is None:
        args.wrappers = "single,ddp,fsdp2" if fsdp2_here else "single,ddp"
        if not fsdp2_here:
            print(f"distributed_benchmark: no fsdp2 rows: FSDP2 runs on the CPU (gloo) from torch "
                  f"2.8, this is {torch.__version__}", flush=True)
    elif "fsdp2" in args.wrappers.split(",") and not fsdp2_here:
        p.error(f"--wrappers fsdp2 on the CPU needs torch >= 2.8 (FSDP2 on gloo), this is "
                f"{torch.__version__}: run it on GPUs or leave fsdp2 out")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available here; run with --device cpu (gloo and "
                "the simulated device), the default on such machines")
    return args


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = args.device == "cuda"
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        if self.cuda:
            local = int(os.environ.get("LOCAL_RANK", self.rank))
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
            self.cfg = GPTConfig(args.hidden, args.heads, args.seq, args.batch, args.layers,
                                 dtype=torch.bfloat16)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(1)
            self.cfg = GPTConfig(32, 4, 16, 2, args.layers)
        dist.init_process_group("nccl" if self.cuda else "gloo",
                                timeout=datetime.timedelta(seconds=600))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def wrap(self, name: str) -> torch.nn.Module:
        model = build_model(self.cfg, self.device, seed=0)
        if name == "single":
            return model
        if name == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            return DDP(model, device_ids=[self.device.index] if self.cuda else None)
        return fully_shard_stack(model)

    def step(self, model, x, ctx, sync) -> float:
        """One training step; returns the host seconds until ``backward()`` returned."""
        t0 = time.perf_counter()
        forward_backward(model, x, ctx, sync)
        return time.perf_counter() - t0

    def link_gbps(self) -> float:
        """Device-to-host GB/s into pinned memory with every rank copying at once (the slowest
        rank's), the median of 5 copies of ``--link-mib``."""
        if not self.cuda:
            return 50.0
        n = self.args.link_mib * 2**20
        src = torch.empty(n, dtype=torch.uint8, device=self.device)
        dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        times = []
        for _ in range(6):
            self.sync()
            dist.barrier()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            self.sync()
            times.append(time.perf_counter() - t0)
        return -self.gather_max(-n / median(times[1:]) / 1e9)

    def measure(self, name: str, k: int) -> dict:
        model = self.wrap(name)
        x = make_input(self.cfg, self.device, seed=10 + self.rank)
        if k:
            kw = {} if self.cuda else {"device": SimulatedDevice(), "min_tensor_size_to_offload": 0}
            ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k,
                                                model_layers=self.cfg.layers, **kw)
        else:
            ctx = sync = None
        for _ in range(self.args.warmup):
            self.step(model, x, ctx, sync)
        times, hosts, peaks = [], [], []
        for _ in range(self.args.steps):
            self.sync()
            dist.barrier()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if self.cuda else 0
            t0 = time.perf_counter()
            hosts.append(self.step(model, x, ctx, sync))
            self.sync()
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() - base if self.cuda else 0)
        grads = [compat_local(p.grad).detach().clone() for p in model.parameters()]
        grads.append(x.grad.detach().clone())
        out_bytes = ctx.stats().to_dict()["copied_out_bytes"] if k else 0
        del model
        return {"time_s": median(times), "host_s": median(hosts), "peak_bytes": max(peaks),
                "out_bytes": out_bytes, "grads": grads}

    def optimizer(self, name: str, model: torch.nn.Module, fraction) -> object:
        """Plain fused AdamW (``fraction`` None), or ``HybridDeviceOptimizer`` (under DDP through
        its communication hook)."""
        if fraction is None:
            return torch.optim.AdamW(model.parameters(), fused=True, **OPTIM_KW)
        kw = {} if self.cuda else {"device": SimulatedDevice()}
        opt = HybridDeviceOptimizer(model.parameters(), fraction, **kw, **OPTIM_KW)
        if name == "ddp":
            model.register_comm_hook(*opt.ddp_comm_hook())
        return opt

    def train_step(self, model, opt, x) -> float:
        """Forward, backward, ``step()``, ``zero_grad()``; returns the host seconds until
        ``backward()`` returned."""
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        host = time.perf_counter() - t0
        opt.step()
        opt.zero_grad()
        return host

    def measure_optim(self, name: str, fraction) -> dict:
        """A training step of wrapper ``name`` with plain AdamW (``fraction`` None) or the
        hybrid at ``fraction``: times, whole peak and held memory, and whether the parameters
        after the timed steps are the reference's (see the module docstring). Memory counts
        from what this process held before the row built its model (earlier rows' results).
        Earlier rows' models and optimizers are collected first: a hybrid optimizer and its hooks
        form reference cycles, and freed in the middle of a later row they made its held and
        peak memory negative (FSDP2 at fraction 1, reference size, 2026-11-28)."""
        gc.collect()
        self.sync()
        base = torch.cuda.memory_allocated() if self.cuda else 0
        model = self.wrap(name)
        x = make_input(self.cfg, self.device, seed=10 + self.rank, requires_grad=False)
        opt = self.optimizer(name, model, fraction)
        for _ in range(self.args.warmup):
            self.train_step(model, opt, x)
        times, hosts, peaks, held = [], [], [], []
        for _ in range(self.args.steps):
            self.sync()
            dist.barrier()
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
                held.append(torch.cuda.memory_allocated() - base)
            t0 = time.perf_counter()
            hosts.append(self.train_step(model, opt, x))
            self.sync()
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() - base if self.cuda else 0)
        exact = True
        got = [compat_local(p).detach().clone() for p in model.parameters()]
        if fraction is not None:
            opt.wait_params()
            got = [compat_local(p).detach().clone() for p in model.parameters()]
            ref_model = self.wrap(name)
            ref = PlacedReference.like(opt, list(model.parameters()), ref_model.parameters(), **OPTIM_KW)
            for _ in range(self.args.warmup + self.args.steps):
                self.train_step(ref_model, ref, x)
            exact = all(torch.equal(a, compat_local(b).detach()) for a, b in zip(got, ref_model.parameters()))
            opt.close()
            del ref_model, ref
        if name == "ddp":  # replicas: every rank the same bits
            for t in got:
                theirs = t.clone()
                dist.broadcast(theirs, src=0)
                exact = exact and torch.equal(theirs, t)
        del model, opt, got
        return {"time_s": median(times), "host_s": median(hosts), "peak_bytes": max(peaks),
                "held_bytes": max(held) if held else 0, "exact": exact}

    def gather_max(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64,
                         device=self.device if self.cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()


def fully_shard_stack(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` on every block of a ``cpu_offload.examples.gpt`` stack, then on the stack
    (FSDP2's usual layout: one all-gather per block); returns ``model``. Needs a process group.

    Args:
        model: a stack with a ``layers`` list of blocks, sharded in place.
    """
    fully_shard = compat.fully_shard()
    if fully_shard is None:
        raise SystemExit(f"FSDP2 needs torch >= 2.4, found {torch.__version__}")
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def forward_backward(model: torch.nn.Module, x: torch.Tensor, ctx=None, sync=None) -> None:
    """The rows' forward and backward: gradients of the parameters and of ``x`` set anew (not
    accumulated).

    Args:
        model: a ``cpu_offload.examples.gpt`` stack (or one wrapped by DDP/FSDP2).
        x: its input, a leaf that requires grad.
        ctx, sync: the offload context and its sync function, or ``None`` for no offloading.
    """
    for p in model.parameters():
        p.grad = None
    x.grad = None
    model(x, ctx, sync).float().square().mean().backward()


def compat_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optim_rows(r: Runner, fractions: list) -> tuple:
    """The optimizer rows (DDP and FSDP2 among ``--wrappers``): table rows and records."""
    rows, records = [], []
    for name in [w for w in r.args.wrappers.split(",") if w in ("ddp", "fsdp2")]:
        t0 = p0 = None
        for fraction in [None] + fractions:
            m = r.measure_optim(name, fraction)
            exact = r.gather_max(0.0 if m["exact"] else 1.0) == 0.0
            t, peak = r.gather_max(m["time_s"]), r.gather_max(m["peak_bytes"])
            host, held = r.gather_max(m["host_s"]), r.gather_max(m["held_bytes"])
            t0, p0 = (t, peak) if fraction is None else (t0, p0)
            method = f"{name} + AdamW" if fraction is None else f"{name} + hybrid f={fraction:g}"
            rec = {"method": method, "offload_fraction": fraction, "step_ms": t * 1e3,
                   "host_ms": host * 1e3, "time_x": t / t0, "peak_gib": peak / 2**30,
                   "peak_x": (peak / p0) if p0 else None, "held_gib": held / 2**30, "exact": exact}
            records.append(rec)
            rows.append([method, f"{rec['step_ms']:.1f}", f"{rec['host_ms']:.1f}", f"{rec['time_x']:.3f}",
                         f"{rec['peak_gib']:.2f}", "" if rec["peak_x"] is None else f"{rec['peak_x']:.3f}",
                         f"{rec['held_gib']:.2f}", "yes" if exact else "NO"])
    return rows, records


def main(argv=None) -> None:
    args = parse_args(argv)
    r = Runner(args)
    ks = [int(k) for k in args.ks.split(",") if k]
    fractions = [float(f) for f in args.optim_fractions.split(",") if f]
    rows, records = [], []
    try:
        gbps = r.link_gbps()
        for name in args.wrappers.split(","):
            base = r.measure(name, 0)
            t0, p0 = r.gather_max(base["time_s"]), r.gather_max(base["peak_bytes"])
            for k in [0] + ks:
                m = base if k == 0 else r.measure(name, k)
                exact = all(torch.equal(a, b) for a, b in zip(m["grads"], base["grads"]))
                all_exact = r.gather_max(0.0 if exact else 1.0) == 0.0
                t, peak = r.gather_max(m["time_s"]), r.gather_max(m["peak_bytes"])
                host, out = r.gather_max(m["host_s"]), r.gather_max(m["out_bytes"])
                rec = {"method": name if k == 0 else f"{name} + offload k={k}", "k": k,
                       "step_ms": t * 1e3, "host_ms": host * 1e3, "time_x": t / t0,
                       "peak_gib": peak / 2**30, "peak_x": (peak / p0) if p0 else None,
                       "out_gb": out / 1e9, "link_ms": out / 1e9 / gbps * 1e3,
                       "exact": all_exact}
                records.append(rec)
                rows.append([rec["method"], f"{rec['step_ms']:.1f}", f"{rec['host_ms']:.1f}",
                             f"{rec['time_x']:.3f}", f"{rec['peak_gib']:.2f}",
                             "" if rec["peak_x"] is None else f"{rec['peak_x']:.3f}",
                             f"{rec['out_gb']:.2f}", f"{rec['link_ms']:.1f}",
                             "yes" if all_exact else "NO"])
        opt_rows, opt_records = optim_rows(r, fractions) if fractions else ([], [])
        if r.rank == 0:
            cfg = r.cfg
            print(f"torch {torch.__version__} | {r.world} ranks | {args.device} | hidden "
                  f"{cfg.hidden}, heads {cfg.heads}, seq {cfg.seq}, batch {cfg.batch}/rank, "
                  f"{cfg.layers} layers, {str(cfg.dtype).replace('torch.', '')} | "
                  f"D2H {gbps:.1f} GB/s per rank with both ranks copying")
            print(format_table(["method", "step ms", "host ms", "time x", "peak GiB", "peak x",
                                "GB out", "link ms", "exact"], rows))
            if opt_rows:
                print("\nwith an optimizer (whole peak; held: between steps):")
                print(format_table(["method", "step ms", "host ms", "time x", "peak GiB", "peak x",
                                    "held GiB", "exact"], opt_rows))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                write_json(args.out / "distributed.json",
                           {"args": {k: str(v) for k, v in vars(args).items()},
                            "torch": torch.__version__, "world": r.world, "d2h_gbps": gbps,
                            "rows": records, "optim_rows": opt_records})
        dist.barrier()  # gloo on torch 2.1 hangs in teardown when one rank gets there first
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: with gloo on the CPU (torch 2.13) a rank sometimes aborts
    # there ("terminate called without an active exception", one run in ten), after the process
    # group was destroyed and every result printed. Exiting here keeps that from failing a run.
    os._exit(code or 0)
