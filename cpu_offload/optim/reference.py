"""The baseline the hybrid optimizer is compared with: a plain optimizer over master copies of
the parameters (fp32 for bf16/fp16 parameters, the parameter's dtype for fp32/fp64 ones, as the
hybrid optimizer's CPU part keeps them), on the parameters' own device (what mixed-precision
training does without offloading). Used by the GPU tests and the benchmark's "plain" row."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from .cpu_update import master_dtype
from .guards import merge_edited


class MasterWeightOptimizer:
    """``optimizer_cls`` (default: fused AdamW) over master copies of ``params``: fp32 for
    bf16/fp16 parameters, the parameter's own dtype otherwise (``cpu_update.master_dtype``).

    ``step()`` takes edits of the parameters since the last step into the masters
    (``guards.merge_edited``), converts each gradient to the master dtype, steps, and copies the
    masters back (rounded to the parameter dtype). ``optimizer`` is the wrapped optimizer (for LR schedulers).
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
                 **kwargs: Any) -> None:
        self.params = list(params)
        self.masters = [p.detach().to(master_dtype(p.dtype), copy=True) for p in self.params]
        if optimizer_cls is None:
            kwargs.setdefault("fused", True)
            optimizer_cls = torch.optim.AdamW
        self.optimizer = optimizer_cls(self.masters, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        for m, p in zip(self.masters, self.params):
            merge_edited(m, p)  # a parameter edited since the last step: its master follows
        for m, p in zip(self.masters, self.params):
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
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
