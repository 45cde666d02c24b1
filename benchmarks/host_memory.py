"""Pinned host memory against the bytes offloaded, by where the pinned pool's blocks come from.

Workload: ``apply_offloading(layers, num_layers=6)`` on 8 blocks ``x + Linear(f, h)(gelu(Linear(h,
f)(x)))`` in bf16, sequence 5000, 3 steps, for hidden/ffn 3000/9000 and 4096/16384. Each row runs
in a fresh process (RSS and torch's host allocator start clean), once per kind of memory:

- ``before``: a block per buffer from torch's pinned allocator at the size asked, as the pool
  took them before it carved: torch rounds each up to a power of two, and the pool counted the
  bytes it asked for;
- ``torch``: power-of-two blocks from torch's allocator, carved (the fallback where the driver
  refuses to page-lock memory; ``CudaDevice(exact_host_memory=False)``);
- ``exact``: page-locked at exact size on the GPU's NUMA node (the default);
- ``exact-no-numa``: the same, placed by the kernel's default policy.

Columns: offloaded bytes per step (``handle.stats()``), torch's host allocator bytes
(``torch.cuda.host_memory_stats()``, growth over the run), the pool's reserved bytes
(``pinned_host_bytes_reserved_peak``), the process's RSS growth, pinned / offloaded (pinned:
the larger of the two counts, which are the same memory for ``torch``), RSS growth / offloaded,
the first step's time and the host time spent reserving blocks, and a later step's time.

Then the copy bandwidth from each kind of buffer (driver copies on a side stream, as V2 queues
them), each way, against torch's pinned memory: bound to the GPU's NUMA node, left to the
kernel, and, on a host with several nodes, bound to another node.

Run on the GPU machine (about two minutes)::

    python benchmarks/host_memory.py --out bench_out

Smoke test on a CPU (tiny rows, ``SimulatedDevice``; no RSS or bandwidth)::

    python benchmarks/host_memory.py --device sim
"""
from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from bench_common import BenchDevice, environment_info, format_table, median, write_json

import torch  # noqa: E402  (bench_common puts the checkout on the path first)
from torch import nn  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.core.host_memory import CudaHostMemory, power_of_two  # noqa: E402
from cpu_offload.core.numa import gpu_numa_node  # noqa: E402
from cpu_offload.examples.mlp import ResidualMlp as Block  # noqa: E402

KINDS = ("before", "torch", "exact", "exact-no-numa")
MIB = 2**20


class TorchPerBuffer(cpu_offload.CudaDevice):
    """The pool's blocks as it took them before it carved: one per buffer, at the size asked,
    from torch's pinned allocator (which rounds it up to a power of two)."""

    def host_block_size(self, nbytes: int) -> int:
        return nbytes

    def reserve_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def host_memory_kind(self) -> str:
        return "torch's pinned allocator, a block per buffer"


class SimPow2(cpu_offload.SimulatedDevice):
    """The simulation of torch's power-of-two blocks."""

    def host_block_size(self, nbytes: int) -> int:
        return power_of_two(nbytes)

    def host_memory_kind(self) -> str:
        return "simulated power-of-two blocks"


def offload_device(kind: str, cuda: bool) -> Any:
    if not cuda:  # (in the simulation "before" counts the bytes asked; torch's column adds
        # the powers of two torch would reserve for them)
        if kind == "torch":
            return SimPow2()
        return cpu_offload.SimulatedDevice(host_page=1 if kind == "before" else 4096)
    if kind == "before":
        return TorchPerBuffer()
    return cpu_offload.CudaDevice(exact_host_memory=kind != "torch",
                                  numa_binding=kind == "exact")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def torch_pinned_bytes() -> Optional[int]:
    """Bytes of pinned blocks torch's host allocator holds (the key changed across releases)."""
    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "reserved_bytes.current", "segment_bytes.current"):
        if key in stats:
            return stats[key]
    return 0 if not stats else None  # (empty: nothing pinned by torch yet)


def measure(cfg: dict) -> dict:
    """One row and kind: offloaded, reserved and RSS growth over ``steps`` steps."""
    cuda = cfg["device"] == "cuda"
    where = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(where):  # initialised where it runs: a CPU init of 1G parameters is slow
        layers = nn.ModuleList([Block(cfg["hidden"], cfg["ffn"]) for _ in range(cfg["layers"])])
    layers = layers.to(dtype)
    x = torch.randn(cfg["seq"], cfg["hidden"], device=where, dtype=dtype, requires_grad=True)

    def step() -> float:
        sync()
        start = time.perf_counter()
        h = x
        for layer in layers:
            h = layer(h)
        h.float().square().mean().backward()
        sync()
        return (time.perf_counter() - start) * 1e3

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    step()  # without offloading: kernels, cuBLAS workspaces and gradients settled
    gc.collect()
    rss0, torch0 = rss_bytes(), torch_pinned_bytes()
    dev = offload_device(cfg["kind"], cuda)
    # (the simulation's tiny tensors are under the default threshold: every one is offloaded)
    handle = cpu_offload.apply_offloading(layers, num_layers=cfg["k"], device=dev,
                                          **({} if cuda else {"min_tensor_size_to_offload": 1}))
    pool = handle.synchronizer.rt.pool
    rows = []
    for _ in range(cfg["steps"]):
        ms = step()
        d = handle.stats().to_dict()
        torch_now = torch_pinned_bytes()
        if torch_now is not None:
            torch_now -= torch0
        elif cfg["kind"] in ("before", "torch"):  # simulated: what torch would reserve
            torch_now = sum(power_of_two(b.numel()) for b in pool._blocks.values())
        rows.append({"ms": ms, "offloaded": d["copied_out_bytes"],
                     "ours": d["pinned_host_bytes_reserved_peak"], "torch": torch_now or 0,
                     "rss": rss_bytes() - rss0 if cuda else None})
    return {
        **cfg, "steps_measured": rows, "memory": d["pinned_host_memory"],
        "allocation_s": pool.allocation_seconds, "blocks": pool.allocations,
        "offloaded": max(r["offloaded"] for r in rows), "ours": max(r["ours"] for r in rows),
        "torch": max(r["torch"] for r in rows),
        "rss": max(r["rss"] for r in rows) if cuda else None,
        "first_ms": rows[0]["ms"], "later_ms": median([r["ms"] for r in rows[1:]] or [0.0]),
    }


def in_fresh_process(cfg: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)],
                          capture_output=True, text=True)
    if proc.returncode:
        return {**cfg, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def memory_table(results: list) -> str:
    rows = []
    for r in results:
        if "error" in r:
            rows.append([f"{r['hidden']}/{r['ffn']}", r["kind"], "error: " + " ".join(r["error"])]
                        + [None] * 9)
            continue
        pinned = max(r["ours"], r["torch"])
        rows.append([
            f"{r['hidden']}/{r['ffn']}", r["kind"], round(r["offloaded"] / MIB),
            round(r["torch"] / MIB), round(r["ours"] / MIB),
            None if r["rss"] is None else round(r["rss"] / MIB),
            pinned / r["offloaded"], None if r["rss"] is None else r["rss"] / r["offloaded"],
            round(r["first_ms"]), round(r["allocation_s"] * 1e3), round(r["later_ms"]),
        ])
    return format_table(["hidden/ffn", "memory", "offloaded MiB", "torch alloc MiB",
                         "reserved MiB", "RSS growth MiB", "ratio", "RSS ratio",
                         "first step ms", "alloc ms", "later step ms"], rows)


def bandwidth(mib: int, reps: int) -> dict:
    """GB/s of driver copies between a GPU buffer and each kind of host buffer, each way."""
    dev = cpu_offload.CudaDevice()
    index = torch.cuda.current_device()
    n = mib * MIB
    gpu = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    node = gpu_numa_node(index)
    hosts = {"torch pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True)}
    for label, numa in (("exact, GPU's node", True), ("exact, kernel's placement", False)):
        mem = CudaHostMemory(index, numa=numa)
        hosts[label] = mem.allocate(n)
        hosts[label + " kind"] = mem.kind
    nodes = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
    far = next((m for m in nodes if node is not None and m != node), None)
    if far is not None:
        mem = CudaHostMemory(index)
        mem._node = far  # (bound to a node that is not the GPU's: what NUMA placement avoids)
        hosts[f"exact, node {far}"] = mem.allocate(n)
    stream = dev.new_stream()
    out: dict = {"numa_node": node, "nodes": nodes, "mib": mib, "reps": reps, "gbps": {}}
    for label, host in hosts.items():
        if label.endswith(" kind"):
            out[label] = host
            continue
        for direction, pairs in (("D2H", [(host, gpu)]), ("H2D", [(gpu, host)])):
            dev.copy_after_compute(stream, pairs)  # warm
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            for _ in range(reps):
                dev.copy_after_compute(stream, pairs)
            end.record(stream)
            torch.cuda.synchronize()
            out["gbps"][f"{label} {direction}"] = n * reps / start.elapsed_time(end) / 1e6
    return out


def bandwidth_table(bw: dict) -> str:
    labels = sorted({k.rsplit(" ", 1)[0] for k in bw["gbps"]}, key=lambda s: s != "torch pinned")
    rows = []
    for label in labels:
        d2h, h2d = bw["gbps"][f"{label} D2H"], bw["gbps"][f"{label} H2D"]
        rows.append([label, d2h, h2d, d2h / bw["gbps"]["torch pinned D2H"],
                     h2d / bw["gbps"]["torch pinned H2D"]])
    return format_table(["host buffer", "D2H GB/s", "H2D GB/s", "D2H x torch", "H2D x torch"],
                        rows)


def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto")
    p.add_argument("--rows", help="hidden/ffn pairs (cuda: 3000/9000,4096/16384; sim: 48/144)")
    p.add_argument("--seq", type=int, help="sequence length (cuda 5000, sim 500)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--k", type=int, default=6, help="offloaded layers")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--bandwidth-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-bandwidth", action="store_true")
    p.add_argument("--out", default="bench_out", help="directory for host_memory.json")
    p.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, as JSON, in this process
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return {}
    device = BenchDevice.from_flag(args.device)
    cuda = device.is_cuda
    rows = args.rows or ("3000/9000,4096/16384" if cuda else "48/144")
    results = []
    for row in rows.split(","):
        hidden, ffn = (int(v) for v in row.split("/"))
        for kind in args.kinds.split(","):
            cfg = {"device": device.kind, "hidden": hidden, "ffn": ffn, "kind": kind,
                   "seq": args.seq or (5000 if cuda else 500), "layers": args.layers,
                   "k": args.k, "steps": args.steps}
            results.append(in_fresh_process(cfg) if cuda else measure(cfg))
            print(f"measured {row} {kind}", flush=True)
    print(f"\npinned host memory, {results[0]['layers']} blocks, k={args.k}, seq "
          f"{results[0]['seq']}, {args.steps} steps, on {device.describe()}")
    print(memory_table(results))
    for r in results:
        print(f"  {r['hidden']}/{r['ffn']} {r['kind']}: {r.get('memory', r.get('error'))}")
    bw = None
    if cuda and not args.no_bandwidth:
        bw = bandwidth(args.bandwidth_mib, args.reps)
        print(f"\ncopy bandwidth, {args.bandwidth_mib} MiB x {args.reps} each way, GPU's NUMA "
              f"node {bw['numa_node']} of nodes {bw['nodes']}")
        print(bandwidth_table(bw))
    payload = {"env": environment_info(device), "memory": results, "bandwidth": bw}
    write_json(Path(args.out) / "host_memory.json", payload)
    return payload


if __name__ == "__main__":
    main()
