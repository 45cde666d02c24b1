"""The baseline the hybrid optimizer is compared with: a plain optimizer over fp32 master copies
of the parameters, on the parameters' own device (what mixed-precision training does without
offloading). Used by the GPU tests and the benchmark's "plain" row."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch


class MasterWeightOptimizer:
    """``optimizer_cls`` (default: fused AdamW) over fp32 copies of ``params``.

    ``step()`` converts each gradient to fp32, steps, and copies the masters back (rounded to
    the parameter dtype). ``optimizer`` is the wrapped optimizer (for LR schedulers).
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
                 **kwargs: Any) -> None:
        self.params = list(params)
        self.masters = [p.detach().float().clone() for p in self.params]
        if optimizer_cls is None:
            kwargs.setdefault("fused", True)
            optimizer_cls = torch.optim.AdamW
        self.optimizer = optimizer_cls(self.masters, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            m.grad = None if p.grad is None else p.grad.float()
        self.optimizer.step()
        for m, p in zip(self.masters, self.params):
            if m.grad is not None:
                p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
