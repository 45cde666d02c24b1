"""Where the GPU memory of a training step goes, with and without optimizer-state offloading.

Plain AdamW keeps, per parameter: the weight, its gradient and two state tensors. With
``offload_fraction=1`` the state leaves the GPU, but weights, gradients and activations stay, and
the offloaded path adds its own buffers. This measures each phase of a steady-state step (peak
allocated bytes above what was allocated before the phase) and prints it in units of ``P``, the
parameter bytes, so that every row can be accounted for:

- ``plain``: fused AdamW on the GPU (state 2P for fp32 parameters);
- ``f=1 cpu``: ``HybridDeviceOptimizer(offload_fraction=1, stream_fraction=0)``: the CPU path;
- ``f=1 streamed``: ``stream_fraction=1``: every parameter updated on the GPU from state streamed
  through ``stream_budget_bytes`` of staging, allocated inside ``step()`` only.

Workload: ``--layers`` ``Linear(--width)`` fp32 layers with ``ReLU``, a batch of ``--batch`` rows
(activations are small against the parameters, as in the issue's check). Run on a GPU::

    python benchmarks/optim_memory.py

On the CPU it runs on ``SimulatedDevice`` with no memory figures (a smoke test).
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import Any, Callable, Optional

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.optim import HybridDeviceOptimizer  # noqa: E402

PHASES = ("forward", "backward", "step", "zero_grad")


def build(width: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods).to(device)


def workspaces() -> int:
    """Bytes allocated after a small forward and backward: cuBLAS keeps a workspace per stream
    in the caching allocator (32 MiB on Hopper), whatever the model. Not counted in the rows."""
    torch.cuda.synchronize()
    lin = nn.Linear(64, 64).cuda()
    lin(torch.randn(8, 64, device="cuda")).sum().backward()
    del lin
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def make_optimizer(kind: str, model: nn.Module, budget: int, sim: bool) -> Any:
    dev = cpu_offload.SimulatedDevice() if sim else None
    if kind == "plain":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=not sim)
    stream = {"f=1 cpu": 0.0, "f=1 streamed": 1.0}[kind]
    return HybridDeviceOptimizer(model.parameters(), 1.0, stream_fraction=stream,
                                 stream_budget_bytes=budget, device=dev, lr=1e-3)


def measure(kind: str, args: argparse.Namespace) -> dict[str, float]:
    """Peak bytes above the start of each phase, and the bytes held between steps, of the last
    of ``args.steps`` steps (in units of the parameter bytes P, or zeros on the CPU)."""
    cuda = torch.cuda.is_available() and not args.sim
    gc.collect()  # the rows before (optimizers keep reference cycles through their hooks)
    base = workspaces() if cuda else 0
    model = build(args.width, args.layers, "cuda" if cuda else "cpu")
    opt = make_optimizer(kind, model, args.budget_mib * 2**20, not cuda)
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(args.batch, args.width, device="cuda" if cuda else "cpu")
    out: dict[str, float] = {}
    for _ in range(args.steps):
        loss_box: list = []
        actions: dict[str, Callable[[], None]] = {
            "forward": lambda: loss_box.append(model(x).square().mean()),
            "backward": lambda: loss_box.pop().backward(),
            "step": opt.step,
            "zero_grad": opt.zero_grad,
        }
        for phase in PHASES:
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            actions[phase]()
            if cuda:
                torch.cuda.synchronize()
                out[phase] = (torch.cuda.max_memory_allocated() - before) / p_bytes
        if cuda:
            out["between steps"] = (torch.cuda.memory_allocated() - base) / p_bytes
            out["whole step"] = 0.0
    if cuda:  # the step's peak above zero: between-step bytes plus the largest phase's rise
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        out["whole step"] = (torch.cuda.max_memory_allocated() - base) / p_bytes
    if hasattr(opt, "close"):
        opt.close()
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-mib", type=int, default=256, help="stream_budget_bytes, MiB")
    p.add_argument("--sim", action="store_true", help="SimulatedDevice even with a GPU")
    args = p.parse_args(argv)
    results = {k: measure(k, args) for k in ("plain", "f=1 cpu", "f=1 streamed")}
    n = sum(w.numel() for w in build(args.width, args.layers, "cpu").parameters())
    print(f"{args.layers} x Linear({args.width}) fp32, batch {args.batch}: P = {n * 4 / 2**20:.0f} MiB"
          f" ({n / 1e6:.1f} M params); stream budget {args.budget_mib} MiB; "
          "in units of P: peak above the phase's start, held between steps, the step's peak; "
          "without the cuBLAS workspaces")
    cols = [*PHASES, "between steps", "whole step"]
    print(f"{'row':<14}" + "".join(f"{c:>15}" for c in cols))
    for kind, r in results.items():
        print(f"{kind:<14}" + "".join(f"{r.get(c, float('nan')):>15.3f}" for c in cols))
    return results


if __name__ == "__main__":
    main()
