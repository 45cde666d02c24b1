"""Function calls per saved tensor: a deterministic proxy for the hooks' host cost.

Host time on a busy machine is noisy; the number of Python and C function calls the offloading
adds to a training step is not. This counts them with ``sys.setprofile`` on the CPU with
``SimulatedDevice``, on 16 layers ``Linear(64)`` + ``GELU`` (each saves 3 tensors: its input and
``weight.t()`` for ``addmm``, the GELU input): calls in one steady-state step (forward and
backward) with the method, minus calls in the same step without offloading, over the saved
tensors of the step. A call into the simulated device counts once; the calls it makes for its own
bookkeeping (its log, its hazard checks, the memcpy standing in for a copy) do not, as a real
device makes none of them.

Methods: ``hooks_only`` (a saved-tensor hook pair that does nothing around each layer: 2 calls
per tensor), ``v2`` (``num_layers=14`` of 16, every activation offloaded), ``v2_hooks_only`` (V2
with a size threshold nothing reaches), ``apply`` (V2 through ``apply_offloading``: the same
plus its per-layer driver), ``v1`` (legacy, tagged activations). Run::

    python benchmarks/call_count.py

``tests/v2/test_hot_path_calls.py`` pins V2's figure, so a change that adds calls to the hot path
fails CI.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

_REPO = Path(__file__).resolve().parents[1]
for _path in (_REPO, _REPO / "benchmarks"):  # the package, and hook_overhead's layer
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import cpu_offload  # noqa: E402
from cpu_offload.core import simulated  # noqa: E402
from hook_overhead import SmallLayer  # noqa: E402  (the same layer, the same saved tensors)

METHODS = ("hooks_only", "v2", "v2_hooks_only", "apply", "v1")
NEVER = 2**62  # a min_tensor_size_to_offload no tensor reaches
_SIMULATED_FILE = os.path.abspath(simulated.__file__)


class CallCounter:
    """``sys.setprofile`` counter of call events; frames of the simulated device's module count
    once when entered from outside it, and nothing called below them counts."""

    def __init__(self) -> None:
        self.calls = 0
        self._inside = 0  # depth of simulated-device frames on the stack

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code.co_filename == _SIMULATED_FILE:
                if not self._inside:
                    self.calls += 1
                self._inside += 1
            elif not self._inside:
                self.calls += 1
        elif event == "return":
            if frame.f_code.co_filename == _SIMULATED_FILE:
                self._inside -= 1
        elif event == "c_call" and not self._inside:
            self.calls += 1

    def count(self, fn: Callable[[], Any]) -> int:
        self.calls = self._inside = 0
        sys.setprofile(self)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return self.calls


def build(layers: int, width: int, batch: int) -> tuple[nn.ModuleList, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        stack = nn.ModuleList(SmallLayer(width) for _ in range(layers))
        x = torch.randn(batch, width, requires_grad=True)
    return stack, x


def make_step(method: str, stack: nn.ModuleList, x: torch.Tensor, k: int) -> Callable[[], None]:
    """One training step (forward and backward) of ``method``; ``None`` runs without offloading."""
    ctx = sync = None
    hooks = None
    if method == "hooks_only":  # one pair around the whole forward
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    elif method in ("v2", "v2_hooks_only", "v1"):
        for layer in stack:
            layer.tag_activations = method == "v1"
        kwargs: dict[str, Any] = dict(enabled=True, num_layers=k, model_layers=len(stack),
                                      device=cpu_offload.SimulatedDevice(defer=False))
        if method != "v1":
            kwargs["min_tensor_size_to_offload"] = NEVER if method == "v2_hooks_only" else 0
        if method == "v1":
            os.environ["NVTE_CPU_OFFLOAD_V1"] = "1"
        try:
            ctx, sync = cpu_offload.get_cpu_offload_context(**kwargs)
        finally:
            os.environ.pop("NVTE_CPU_OFFLOAD_V1", None)
    elif method == "apply":
        cpu_offload.apply_offloading(stack, num_layers=k, min_tensor_size_to_offload=0,
                                     device=cpu_offload.SimulatedDevice(defer=False))
    elif method is not None:
        raise ValueError(f"unknown method {method!r}; one of {METHODS}")

    def step() -> None:
        x.grad = None
        h = x
        if hooks is not None:
            with hooks:
                for layer in stack:
                    h = layer(h)
        for layer in stack if hooks is None else ():
            if ctx is not None:
                with ctx:
                    h = layer(h)
                h = sync(h)
            else:
                h = layer(h)
        h.sum().backward()

    return step


def saved_per_step(stack: nn.ModuleList, x: torch.Tensor) -> int:
    n = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal n
        n += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for layer in stack:
            h = layer(h)
    del h
    return n


def calls_per_saved_tensor(method: str, layers: int = 16, width: int = 64, batch: int = 8,
                           k: Optional[int] = None, warmup: int = 3) -> float:
    """(calls in a step of ``method`` - calls in the same step without offloading) / saved
    tensors per step, after ``warmup`` steps of each (pools, caches and schedules settled)."""
    stack, x = build(layers, width, batch)
    k = layers - 2 if k is None else k
    saved = saved_per_step(stack, x)
    counter = CallCounter()
    counts = {}
    for name in (None, method):
        step = make_step(name, stack, x, k)
        for _ in range(warmup):
            step()
        counts[name] = min(counter.count(step) for _ in range(2))
    for layer in stack:
        layer.tag_activations = False
    handle = cpu_offload.offloading_handle(stack)
    if handle is not None:
        handle.remove()
    return (counts[method] - counts[None]) / saved


def main(argv: Optional[list] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    args = p.parse_args(argv)
    out = {}
    print(f"{'method':<14} calls/saved tensor   ({args.layers} layers Linear({args.width})+GELU, "
          "SimulatedDevice)")
    for m in args.methods.split(","):
        out[m] = calls_per_saved_tensor(m, args.layers, args.width)
        print(f"{m:<14} {out[m]:8.1f}")
    return out


if __name__ == "__main__":
    main()
