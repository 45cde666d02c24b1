"""Host overhead of the saved-tensor hooks, per saved tensor.

A model with many small layers must not be slowed by offloading. This benchmark
builds exactly that: ``--layers`` (64) tiny ``Linear + GELU`` layers on a small batch, so compute
is negligible and the Python work in the pack/unpack hooks and the schedule dominates the step.

Methods, timed with the host clock (forward + backward + device synchronize, median per step):

- ``none``            no offloading;
- ``v2``              V2 with ``num_layers=k`` (default ``layers - 2``) and
                      ``min_tensor_size_to_offload=0``: every activation of those layers offloaded;
- ``v2_hooks_only``   V2 with a size threshold nothing reaches: the hooks run on every saved
                      tensor but nothing is copied (the pure bookkeeping cost);
- ``save_on_cpu``     ``torch.autograd.graph.save_on_cpu`` (pinned on CUDA): torch's own hooks;
- ``v1``              legacy V1 (``NVTE_CPU_OFFLOAD_V1=1``), layers tag their activations;
- ``floor``           a minimal exact offloader (``floor.FloorOffloader``), the host's floor:
                      per tensor the hook pair, a pinned allocation, one copy out, one device
                      allocation, one copy back; per layer one event record and one stream wait
                      each way, events reused across steps; V2's default schedule; no
                      deduplication, view handling or in-place checks (parameters and their
                      views stay, as V2 keeps them).

Saved tensors per step are counted once with a counting pack hook (no offloading): each layer
saves its input and ``weight.t()`` (``addmm``) and the GELU input. Overhead per saved tensor =
(step time - ``none`` step time) / saved tensors per step (all of them pass through the hooks);
per offloaded tensor = the same over the tensors that are actually offloaded; per layer = the same
over the layers (context entry/exit, sync function and schedule work are per layer, not per
tensor, so read the three columns together). Methods take turns step by step (``--rounds``
defaults to ``--iters``), so drift (clocks, other processes) hits all of them alike; a host-bound
step is noisy, so ``us/saved p20`` repeats ``us/saved`` from each method's 20th-percentile step
(noise only ever adds time).

On a CPU with ``SimulatedDevice`` the numbers measure the pure Python cost of the hooks plus the
simulated copies (which are real host memcpys), not a GPU. Run::

    python benchmarks/hook_overhead.py                 # CUDA if available, else simulated
    python benchmarks/hook_overhead.py --device sim --iters 20
"""
from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from bench_common import (
    BenchDevice,
    backend,
    environment_info,
    format_table,
    gc_paused,
    median,
    quantile,
    write_json,
)

import torch  # noqa: E402
from floor import FloorOffloader  # noqa: E402
from torch import nn  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.core import markers  # noqa: E402

METHODS = ("none", "floor", "v2", "v2_hooks_only", "save_on_cpu", "v1")
NEVER = 2**62  # a min_tensor_size_to_offload no tensor reaches


class SmallLayer(nn.Module):
    """``GELU(Linear(x))`` on a 2D input, so ``addmm`` saves the very tensor V1's tag is on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.tag_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tag_activations:
            cpu_offload.mark_activation_offload(x)
        u = self.fc(x)
        if self.tag_activations:
            cpu_offload.mark_activation_offload(u)
        return self.act(u)


def build(args: argparse.Namespace, device: BenchDevice) -> tuple[nn.ModuleList, torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    with torch.random.fork_rng(devices=[]):  # built on the CPU, then moved: CPU RNG only
        torch.manual_seed(args.seed)
        layers = nn.ModuleList(SmallLayer(args.width) for _ in range(args.layers))
        x = torch.randn(args.batch, args.width)
    layers = layers.to(device=device.torch_device, dtype=dtype)
    x = x.to(device=device.torch_device, dtype=dtype).requires_grad_(True)
    return layers, x


def run(layers: nn.ModuleList, x: torch.Tensor, ctx: Any = None, sync: Any = None) -> torch.Tensor:
    for layer in layers:
        if ctx is None:
            x = layer(x)
        else:
            with ctx:
                x = layer(x)
            x = sync(x)
    return x


def count_saved(layers: nn.ModuleList, x: torch.Tensor, device: BenchDevice) -> dict[str, int]:
    """Saved tensors per step, and how many of them one layer saves that are activations."""
    counts = {"total": 0, "activations": 0}
    is_dev = (lambda t: t.is_cuda) if device.is_cuda else (lambda t: t.device.type == "cpu")

    def pack(t: torch.Tensor) -> torch.Tensor:
        counts["total"] += 1
        if is_dev(t) and not markers.is_weight(t):
            counts["activations"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(layers, x)
    del out
    return counts


def make_forward(name: str, layers: nn.ModuleList, k: int, device: BenchDevice) -> Callable:
    """The forward function of a method (call inside ``backend(name)``)."""
    if name == "none":
        return lambda x: run(layers, x)
    if name == "floor":
        floor = FloorOffloader(k, len(layers), device.is_cuda, min_elements=0,
                               schedule="on_demand")

        def forward(x: torch.Tensor) -> torch.Tensor:
            for i, layer in enumerate(layers):
                floor.before(i)
                x = layer(x)
                floor.after(i, x)
            return x

        return forward
    if name == "save_on_cpu":

        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.autograd.graph.save_on_cpu(pin_memory=device.is_cuda):
                return run(layers, x)

        return forward
    kwargs: dict[str, Any] = dict(
        enabled=True, num_layers=k, model_layers=len(layers), device=device.offload_device()
    )
    if name.startswith("v2"):
        kwargs["min_tensor_size_to_offload"] = NEVER if name == "v2_hooks_only" else 0
    ctx, sync = cpu_offload.get_cpu_offload_context(**kwargs)
    return lambda x: run(layers, x, ctx, sync)


def timed_step(forward: Callable, x: torch.Tensor, device: BenchDevice) -> tuple[float, float]:
    """(forward host ms, step ms): the forward returns once its work is queued; the step ends
    when the device has finished the backward."""
    x.grad = None
    t0 = time.perf_counter()
    out = forward(x)
    t1 = time.perf_counter()
    out.sum().backward()
    device.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def set_tags(layers: nn.ModuleList, on: bool) -> None:
    for layer in layers:
        layer.tag_activations = on


def measure_all(args: argparse.Namespace, device: BenchDevice, layers: nn.ModuleList,
                x: torch.Tensor) -> dict[str, dict]:
    """Warm up each method, then run interleaved rounds of timed steps."""
    forwards: dict[str, Callable] = {}
    results: dict[str, dict] = {}
    for name in args.methods:
        try:
            with backend(name):
                forwards[name] = make_forward(name, layers, args.k, device)
                set_tags(layers, name == "v1")
                for _ in range(args.warmup):
                    timed_step(forwards[name], x, device)
            results[name] = {"fwd_ms": [], "step_ms": []}
        except Exception as exc:  # report and go on with the other methods
            results[name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            forwards.pop(name, None)
        finally:
            set_tags(layers, False)
    per_round = max(1, args.iters // args.rounds)
    with gc_paused():
        for _ in range(args.rounds):
            for name, forward in forwards.items():
                with backend(name):
                    set_tags(layers, name == "v1")
                    for _ in range(per_round):
                        fwd, step = timed_step(forward, x, device)
                        results[name]["fwd_ms"].append(fwd)
                        results[name]["step_ms"].append(step)
                    set_tags(layers, False)
    return results


def summarize(results: dict[str, dict], saved: dict[str, int], args: argparse.Namespace) -> list[list]:
    """Rows of the report; fills ``results`` with medians and per-tensor overheads."""
    base = median(results.get("none", {}).get("step_ms", []))
    base_low = quantile(results.get("none", {}).get("step_ms", []), 0.2)
    base_fwd = median(results.get("none", {}).get("fwd_ms", []))
    per_k = saved["activations_per_layer"] * args.k
    offloaded = {"v2": per_k, "v1": per_k, "floor": per_k,
                 "v2_hooks_only": 0, "save_on_cpu": saved["total"], "none": 0}
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "ERROR (below)"] + [None] * (len(HEADERS) - 2))
            continue
        r["step_ms_median"] = step = median(r["step_ms"])
        r["fwd_ms_median"] = fwd = median(r["fwd_ms"])
        r["offloaded_per_step"] = offloaded.get(name, 0)
        over = None if base is None else step - base
        r["overhead_ms"] = over
        r["fwd_overhead_ms"] = None if base_fwd is None else fwd - base_fwd
        r["us_per_saved_tensor"] = None if over is None or name == "none" else over * 1e3 / saved["total"]
        n_off = offloaded.get(name, 0)
        r["us_per_offloaded_tensor"] = None if over is None or not n_off else over * 1e3 / n_off
        r["us_per_layer"] = None if over is None or name == "none" else over * 1e3 / args.layers
        low = quantile(r["step_ms"], 0.2)
        r["us_per_saved_tensor_p20"] = (
            None if base_low is None or name == "none" else (low - base_low) * 1e3 / saved["total"]
        )
        fwd_over = r["fwd_overhead_ms"]
        r["fwd_us_per_offloaded_tensor"] = (
            None if fwd_over is None or not n_off else fwd_over * 1e3 / n_off)
        rows.append([name, step, fwd, over, saved["total"], n_off, r["us_per_saved_tensor"],
                     r["us_per_saved_tensor_p20"], r["us_per_offloaded_tensor"],
                     r["fwd_us_per_offloaded_tensor"], r["us_per_layer"]])
    floor = results.get("floor", {})
    for row, (name, r) in zip(rows, results.items()):  # ratios to the floor, per offloaded tensor
        ok = "error" not in r and "error" not in floor and floor and r.get("offloaded_per_step")
        row += [_ratio(r.get("fwd_us_per_offloaded_tensor"),
                       floor.get("fwd_us_per_offloaded_tensor")) if ok else None,
                _ratio(r.get("us_per_offloaded_tensor"),
                       floor.get("us_per_offloaded_tensor")) if ok else None]
        r["x_floor_fwd"], r["x_floor_step"] = row[-2], row[-1]
    return rows


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b <= 0 else a / b


HEADERS = ("method", "step ms", "fwd host ms", "overhead ms", "saved/step", "offloaded/step",
           "us/saved", "us/saved p20", "us/offloaded", "fwd us/offloaded", "us/layer",
           "x floor fwd", "x floor step")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cuda", "sim"), default="auto")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {METHODS}")
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--k", type=int, help="offloaded layers (default layers - 2)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=60, help="timed steps per method")
    p.add_argument("--rounds", type=int, help="interleaved rounds over the methods (default: "
                   "--iters, one step per method per round)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}")
    if "none" not in args.methods:
        args.methods.insert(0, "none")
    args.k = args.k if args.k is not None else max(1, args.layers - 2)
    args.rounds = args.rounds or args.iters
    if not 1 <= args.k < args.layers:
        p.error(f"--k must be in [1, layers={args.layers})")
    return args


def calls_per_saved_tensor() -> Optional[float]:
    """The deterministic proxy (benchmarks/call_count.py) for V2, or None if it fails."""
    try:
        import call_count

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return call_count.calls_per_saved_tensor("v2")
    except Exception as exc:  # a report line, not a reason to lose the table
        print(f"(call count failed: {type(exc).__name__}: {exc})")
        return None


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    device = BenchDevice.from_flag(args.device)
    layers, x = build(args, device)
    saved = count_saved(layers, x, device)
    saved["activations_per_layer"] = saved.pop("activations") // args.layers
    print(f"device: {device.describe()} | {args.layers} layers Linear({args.width})+GELU, "
          f"batch {args.batch}, {args.dtype}; k={args.k}; {saved['total']} saved tensors per step")
    results = measure_all(args, device, layers, x)
    rows = summarize(results, saved, args)
    print()
    print(format_table(HEADERS, rows))
    for name, r in results.items():
        if "error" in r:
            print(f"ERROR {name}: {r['error']}")
    print("x floor: per offloaded tensor, forward host time (fwd) and whole step (step), "
          "over the floor row of the same run")
    calls = calls_per_saved_tensor()
    if calls is not None:
        print(f"calls per saved tensor (benchmarks/call_count.py, CPU proxy): V2 {calls:.1f}")
    if not device.is_cuda:
        print("NOTE: simulated device: this is the pure host (Python) cost of the hooks, with "
              "simulated copies as host memcpys.")
    payload = {"environment": environment_info(device), "args": vars(args), "saved": saved,
               "results": results}
    write_json(Path(args.out) / f"hook_overhead_{device.kind}.json", payload)
    return payload


if __name__ == "__main__":
    main()
