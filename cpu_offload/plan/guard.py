"""Planning runs the user's training step many times; this keeps it from training the model.

``step_fn`` may well be the user's whole training step. ``plan_offloading`` and ``profile_step``
run it inside ``untouched(layers, step_fn)``, which

- refuses an optimizer's ``step()`` before it changes anything: a global optimizer step pre-hook
  raises ``OffloadConfigError`` naming how to write ``step_fn``. A step taken cannot be undone
  from outside (learning-rate schedulers and gradient scalers count steps where planning cannot
  see them), so none is taken;
- copies each parameter's gradient to host memory before the step first reaches it, and at the
  end writes the copy back into the same gradient tensor (and a gradient that was ``None`` is
  ``None`` again): the layers' parameters at the start, every other module's (embedding, head)
  when its forward first runs, seen by a global forward pre-hook during the first call of
  ``step_fn`` only (the timed calls run without it). The gradients stay where they are while
  planning runs, so the step is measured as it runs in training: persistent gradient buffers
  zeroed in place stay allocated, and code that zeroes them finds them;
- restores the buffers of those modules (BatchNorm statistics, counters) in place, from host
  copies too (device memory is what planning measures);
- restores torch's random number generators (the CPU's and every CUDA device's) and Python's
  ``random``,

also when planning raises. What ``step_fn`` changes elsewhere (a data iterator, its own
counters, gradients it zeroes in place before its forward reaches their module) stays changed.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compat import eager_between_graphs
from ..core.errors import OffloadConfigError

__all__ = ["untouched"]

STEP_REFUSED = (
    "step_fn called {name}.step(): planning runs step_fn many times to measure it and must not "
    "train the model, so optimizer steps are refused (this one was refused before it changed "
    "anything; the gradients, buffers and random state step_fn changed are restored). Pass a "
    "step_fn that runs the forward and backward only, e.g. `def step(): "
    "model(**batch).loss.backward()`: no optimizer.step(), scheduler.step() or scaler.step(); "
    "after a refused scaler.step(optimizer), call scaler.update() once before training"
)

_active = [False]  # plan_offloading calls profile_step: the outer guard does the work


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class _Snapshot:
    """Host copies of gradients and buffers, per tensor, each taken once."""

    def __init__(self) -> None:
        self.grads: dict = {}  # id(parameter) -> (parameter, its gradient, host copy)
        self.buffers: dict = {}  # (id(module), name) -> (module, name, buffer, host copy)

    def take(self, module: nn.Module, recurse: bool) -> None:
        for p in module.parameters(recurse=recurse):
            if id(p) not in self.grads:
                grad = p.grad
                self.grads[id(p)] = (p, grad, None if grad is None else _host_copy(grad))
        for m in module.modules() if recurse else (module,):
            for name, b in m.named_buffers(recurse=False):
                if (id(m), name) not in self.buffers:
                    self.buffers[(id(m), name)] = (m, name, b, _host_copy(b))

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad, saved in self.grads.values():
                if grad is not None and grad.layout == torch.strided:
                    grad.copy_(saved)  # the same tensor: views of it (DDP's buckets) stay so
                elif grad is not None:  # sparse: a copy
                    grad = saved.to(grad.device)
                p.grad = grad
            for m, name, b, saved in self.buffers.values():
                if getattr(m, name, None) is not b:  # replaced, not updated in place
                    setattr(m, name, b)
                b.copy_(saved)


def _refuse_step(optimizer: Any, args: tuple, kwargs: dict) -> None:
    raise OffloadConfigError(STEP_REFUSED.format(name=type(optimizer).__name__))


@contextlib.contextmanager
def untouched(layers: list, step_fn: Callable[[], Any]) -> Iterator[Callable[[], Any]]:
    """Run planning's calls of ``step_fn`` (the function this yields) leaving the model, its
    optimizers and the random state as they were (see the module docstring)."""
    if _active[0]:
        yield step_fn
        return
    snapshot = _Snapshot()
    for layer in layers:
        snapshot.take(layer, recurse=True)

    @eager_between_graphs  # also for compiled layers: it runs eagerly, between graphs
    def discover(module: nn.Module, args: tuple) -> None:
        snapshot.take(module, recurse=False)

    calls = [0]

    def step() -> Any:
        calls[0] += 1
        if calls[0] > 1:
            return step_fn()
        handle = register_module_forward_pre_hook(discover)
        try:
            return step_fn()
        finally:
            handle.remove()

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    python_rng = random.getstate()
    refuse = register_optimizer_step_pre_hook(_refuse_step)
    _active[0] = True
    try:
        with torch.random.fork_rng(devices=cuda):
            yield step
    finally:
        _active[0] = False
        refuse.remove()
        random.setstate(python_rng)
        snapshot.restore()
