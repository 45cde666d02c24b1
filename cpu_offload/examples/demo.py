"""``python -m cpu_offload``: offloading on an embedded GPT stack, in one minute.

On a CUDA machine it trains a few steps without offloading and with ``k`` offloaded layers and
prints step time, peak memory above the pre-step baseline, and whether gradients are bit-identical.
Without CUDA it runs the same code on the simulated device and shows what was offloaded per layer
and the order of releases and reloads (the default schedule, README "Use (per layer, by hand)").
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional, Sequence

import torch

from ..api import get_cpu_offload_context
from ..core.simulated import SimulatedDevice
from .gpt import GPTConfig, build_model, make_input, reference_config, tiny_config

CUDA_DEMO = reference_config()  # README "Performance": 8 GPT blocks, hidden 4096, seq 4096, bf16


def _step(model, x0, ctx=None, sync=None):
    """One training step; weight gradients accumulate into buffers allocated once (zeroed in
    place), as in training loops, so peak memory measures activations, not gradients."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    x = x0.clone().requires_grad_()
    out = model(x, ctx, sync)
    out.float().square().mean().backward()
    return [x.grad] + [p.grad for p in model.parameters()]  # live buffers: clone to keep


def _measure_cuda(model, x0, ctx=None, sync=None, steps: int = 5) -> tuple[float, int]:
    _step(model, x0, ctx, sync)  # warm-up
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        _step(model, x0, ctx, sync)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - before
    return statistics.median(times) * 1e3, peak


def _deterministic_grads(model, x0, ctx=None, sync=None) -> list:
    """Gradients of one step with deterministic kernels: attention backward is not
    bit-reproducible otherwise, even between two runs without offloading."""
    torch.use_deterministic_algorithms(True)
    try:
        return [g.clone() for g in _step(model, x0, ctx, sync)]
    finally:
        torch.use_deterministic_algorithms(False)


def run_cuda(cfg: GPTConfig, ks: Sequence[int]) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    model = build_model(cfg, device="cuda")
    x0 = make_input(cfg, device="cuda", requires_grad=False)
    print(f"GPT stack on {torch.cuda.get_device_name()}: {cfg}")
    print("(peak = memory above the pre-step baseline; gradient buffers persist across steps)")
    ref = _deterministic_grads(model, x0)
    base_ms, base_peak = _measure_cuda(model, x0)
    print(f"{'offloaded layers':>16} {'step ms':>9} {'x none':>7} {'peak GiB':>9} {'x none':>7}  grads")
    print(f"{0:>16} {base_ms:9.1f} {1.0:7.3f} {base_peak / 2**30:9.2f} {1.0:7.3f}  reference")
    summaries = []
    for k in ks:
        ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=cfg.layers)
        ms, peak = _measure_cuda(model, x0, ctx, sync)
        grads = _deterministic_grads(model, x0, ctx, sync)
        exact = all(torch.equal(a, b) for a, b in zip(grads, ref))
        print(
            f"{k:>16} {ms:9.1f} {ms / base_ms:7.3f} {peak / 2**30:9.2f} {peak / base_peak:7.3f}  "
            f"{'bit-identical' if exact else 'DIFFERENT'}"
        )
        summaries.append((k, ctx.stats().summary()))
    for k, summary in summaries:
        print(f"\nWhat did it do? (num_layers={k}, last step: ctx.stats().summary())\n{summary}")


def run_simulated(cfg: GPTConfig, k: int) -> None:
    model = build_model(cfg)
    x0 = make_input(cfg, requires_grad=False)
    ref = _deterministic_grads(model, x0)
    device = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=k, model_layers=cfg.layers, min_tensor_size_to_offload=0,
        device=device,
    )
    grads = _deterministic_grads(model, x0, ctx, sync)
    exact = all(torch.equal(a, b) for a, b in zip(grads, ref))
    print(f"No CUDA here: simulated device, {cfg.layers} layers, first {k} offloaded ({cfg}).")
    print(f"{'layer':>5} {'offloaded':>9} {'storages':>8} {'bytes':>10}")
    for row in ctx.synchronizer.layer_summary():
        print(f"{row['layer']:>5} {str(row['offloaded']):>9} {row['storages']:>8} {row['bytes']:>10}")
    order = " ".join(f"{kind}{layer}" for kind, layer in device.milestones({"fwd", "bwd", "release", "reload"}))
    print(f"schedule: {order}")
    print(f"gradients vs no offloading: {'bit-identical' if exact else 'DIFFERENT'}")
    print(f"\nWhat did it do? (ctx.stats().summary())\n{ctx.stats().summary()}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cuda", "sim"], default="auto")
    parser.add_argument("--layers", type=int, default=None, help="model layers")
    parser.add_argument("--offload", type=int, nargs="*", default=None, help="offloaded layers k")
    args = parser.parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        cfg = CUDA_DEMO if args.layers is None else CUDA_DEMO.with_(layers=args.layers)
        run_cuda(cfg, args.offload or [2, 4, 6])
    else:
        cfg = tiny_config() if args.layers is None else tiny_config().with_(layers=args.layers)
        run_simulated(cfg, (args.offload or [2])[0])


if __name__ == "__main__":
    main()
