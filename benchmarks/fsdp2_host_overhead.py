"""Host time that activation offloading adds to a step, without and under FSDP2.

    python3 benchmarks/fsdp2_host_overhead.py --rounds 3

On 2 GPUs, FSDP2 + offload k=2 added 11.5 ms of host time per step against 6.8 ms without FSDP2
(docs/distributed.md). This separates the library's own host work from the GPU's: one process
(world size 1, gloo), on the CPU, with the simulated device, so there is no GPU to wait for and
the time is Python and dispatch. Four rows, timed in interleaved rounds (the host's rate drifts):
the GPT stack of ``cpu_offload.examples.gpt`` plain and under ``fully_shard`` (each block and the
stack), each without offloading and with ``--k`` layers offloaded (``min_tensor_size_to_offload=0``:
every activation of those layers). "offloaded" and "MiB out" (per step) check that both offload
the same tensors; "offload ms" is what offloading adds to the same wrapper's
forward + backward (median of the rounds' per-step means); the last column, that against
the plain stack's. A ratio near 1 means FSDP2 makes the library's hooks no dearer. FSDP2 on
gloo needs torch 2.8 or later.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Optional, Sequence

from bench_common import format_table

import torch  # noqa: E402  (after bench_common, which puts the repo on sys.path)
import torch.distributed as dist  # noqa: E402

from cpu_offload import SimulatedDevice, compat, get_cpu_offload_context  # noqa: E402
from cpu_offload.examples.gpt import GPTConfig, build_model, make_input  # noqa: E402
from distributed_benchmark import forward_backward, fully_shard_stack  # noqa: E402

WRAPPERS = ("plain", "fsdp2")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--k", type=int, default=2, help="layers offloaded (the first k)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per row and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    if not 0 < args.k < args.layers:
        p.error(f"--k must be in 1..{args.layers - 1} (--layers {args.layers})")
    if compat.TORCH_VERSION < compat.Version("2.8"):
        p.error(f"FSDP2 runs on gloo from torch 2.8; this is {torch.__version__}")
    return args


class Row:
    """One wrapper with or without offloading: its model, input and step."""

    def __init__(self, cfg: GPTConfig, wrapper: str, k: int) -> None:
        self.model = build_model(cfg, torch.device("cpu"), seed=0)
        if wrapper == "fsdp2":
            fully_shard_stack(self.model)
        self.x = make_input(cfg, torch.device("cpu"), seed=1)
        self.ctx = self.sync = None
        if k:
            self.ctx, self.sync = get_cpu_offload_context(
                enabled=True, num_layers=k, model_layers=cfg.layers, device=SimulatedDevice(),
                min_tensor_size_to_offload=0)

    def copied(self) -> tuple[int, float]:
        """Tensors offloaded and MiB copied to the host by the last step (0 without offloading)."""
        if self.ctx is None:
            return 0, 0.0
        stats = self.ctx.stats().to_dict()
        return stats["offloaded_tensors"], stats["copied_out_bytes"] / 2**20

    def timed(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            forward_backward(self.model, self.x, self.ctx, self.sync)
        return (time.perf_counter() - t0) / steps * 1e3


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:  # an in-process store: no port to find, no environment variables set
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = GPTConfig(args.hidden, 4, args.seq, 2, args.layers)
        rows = {(w, k): Row(cfg, w, k) for w in WRAPPERS for k in (0, args.k)}
        for row in rows.values():  # warm up: first steps allocate and compile kernels
            row.timed(3)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in rows}
        for _ in range(args.rounds):
            for key, row in rows.items():
                times[key].append(row.timed(args.steps))
        copied = {key: row.copied() for key, row in rows.items()}
    finally:
        if own_group:
            dist.destroy_process_group()
    med = {key: statistics.median(v) for key, v in times.items()}
    extra = {w: med[(w, args.k)] - med[(w, 0)] for w in WRAPPERS}
    ratio = extra["fsdp2"] / extra["plain"] if extra["plain"] > 0 else float("nan")
    print(f"torch {torch.__version__} | CPU, simulated device, 1 process | {cfg} | k={args.k} | "
          f"{args.rounds} rounds of {args.steps} steps")
    print(format_table(
        ("wrapper", "step ms", f"step ms, k={args.k}", "offloaded", "MiB out", "offload ms",
         "offload ms x plain"),
        [[w, f"{med[(w, 0)]:.2f}", f"{med[(w, args.k)]:.2f}", copied[(w, args.k)][0],
          f"{copied[(w, args.k)][1]:.2f}", f"{extra[w]:.2f}",
          f"{extra[w] / extra['plain']:.2f}" if extra["plain"] > 0 else "-"] for w in WRAPPERS]))
    return {"plain_ms": med[("plain", 0)], "plain_offload_ms": extra["plain"],
            "fsdp2_ms": med[("fsdp2", 0)], "fsdp2_offload_ms": extra["fsdp2"], "ratio": ratio,
            "plain_offloaded": copied[("plain", args.k)], "fsdp2_offloaded": copied[("fsdp2", args.k)]}


if __name__ == "__main__":
    main()
