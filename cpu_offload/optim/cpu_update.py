"""One bucket of CPU-updated parameters: fp32 master weights, its own wrapped optimizer, and the
update that reads gradients from staging and writes new parameter values back to it.

Each bucket has its own instance of the CPU optimizer class, so a bucket can be updated as soon
as its gradients land. That is bit-identical to one optimizer over all parameters for optimizers
that update each parameter independently (SGD, Adam, AdamW, ...), which the wrapper requires.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})


def sync_hyperparameters(opt: torch.optim.Optimizer, group_ids: Sequence[int], hypers: Sequence[dict]) -> None:
    """Copy the wrapper's hyperparameters (lr, betas, ...) into ``opt``'s groups; implementation
    choices (fused, foreach, ...) stay what ``opt`` was built with."""
    for group, gi in zip(opt.param_groups, group_ids):
        for k, v in hypers[gi].items():
            if k != "params" and k not in IMPLEMENTATION_KEYS:
                group[k] = v


class CpuBucket:
    """Master weights and optimizer for the CPU parameters of one bucket.

    ``params`` are the model's (device) parameters, ``group_ids`` their wrapper param-group
    indices. Masters are fp32 CPU tensors (for fp32 parameters, an fp32 copy).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        group_ids: Sequence[int],
        initial: Sequence[torch.Tensor],
        hypers: Sequence[dict],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
    ) -> None:
        self.params = list(params)
        self.masters = [torch.empty(p.shape, dtype=torch.float32).copy_(v) for p, v in zip(params, initial)]
        self.group_of = list(group_ids)
        self.group_ids = list(dict.fromkeys(group_ids))  # wrapper groups, in optimizer-group order
        groups = []
        for gi in self.group_ids:
            group = {k: v for k, v in hypers[gi].items() if k != "params"}
            group["params"] = [m for m, g in zip(self.masters, group_ids) if g == gi]
            groups.append(group)
        self.optimizer = make_optimizer(groups)
        self.fp32_grad_elems = sum(p.numel() for p in params if p.dtype != torch.float32)

    def update(
        self,
        grads: Sequence[Optional[torch.Tensor]],
        out: Sequence[torch.Tensor],
        scratch: torch.Tensor,
        hypers: Sequence[dict],
        clip_coef: Optional[torch.Tensor],
    ) -> None:
        """One optimizer step: ``grads`` (model dtype, ``None`` = no gradient this step) into the
        masters, then new values (cast to the model dtype) into ``out``."""
        offset = 0
        live = []
        for m, g in zip(self.masters, grads):
            if g is None:
                continue
            if g.dtype == torch.float32:
                m.grad = g
            else:
                m.grad = scratch[offset: offset + g.numel()].view(g.shape).copy_(g)
                offset += g.numel()
            live.append(m)
        if not live:
            return
        try:
            if clip_coef is not None:
                torch._foreach_mul_([m.grad for m in live], clip_coef)
            sync_hyperparameters(self.optimizer, self.group_ids, hypers)
            self.optimizer.step()
            for m, g, o in zip(self.masters, grads, out):
                if g is not None:
                    o.copy_(m)
        finally:
            for m in self.masters:
                m.grad = None

    def state_of(self, master: torch.Tensor) -> dict[str, Any]:
        return self.optimizer.state.get(master, {})
