"""The device part of ``HybridDeviceOptimizer``: parameters that stay on the accelerator and are
updated there by the wrapped device class, inside ``step()``, as without offloading.

With ``param_update_in_fp32`` a bf16/fp16 parameter gets an fp32 master on the device (Megatron's
option): the class steps the master from the gradient cast to fp32, and the parameter is the
master rounded. A parameter edited in place after ``step()`` is taken into its master
(``guards.merge_edited``), as in the other parts. An edit is found by comparing each parameter
with its master rounded (``guards.differs_from_rounded``: a few batched kernels for all of
them), not by fingerprints: the part keeps no record between steps, and sees every edit.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .amp import LossScale, run_step
from .cpu_update import sync_hyperparameters
from .guards import differs_from_rounded, merge_edited

LOW_PRECISION = (torch.bfloat16, torch.float16)

__all__ = ["DevicePart"]


class DevicePart:
    """``make_optimizer`` over the device parameters, one optimizer group per wrapper group."""

    def __init__(self, make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
                 fp32_masters: bool) -> None:
        self._make = make_optimizer
        self.fp32_masters = fp32_masters
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.group_ids: list[int] = []  # wrapper group of each optimizer group
        self.masters: dict[int, torch.Tensor] = {}  # id(param) -> fp32 master
        self._params: list[torch.Tensor] = []

    def add_groups(self, groups: Sequence[tuple[int, Sequence[torch.Tensor], dict]]) -> None:
        """``(wrapper group, its device parameters, its hyperparameters)`` per group, all at
        once: a class that makes state in its constructor (Adagrad) makes it for every group,
        as it would over the same groups without offloading (``add_param_group`` makes none)."""
        made = []
        for gi, params, hypers in groups:
            keys = []
            for p in params:
                if self.fp32_masters and p.dtype in LOW_PRECISION:
                    self.masters[id(p)] = p.detach().float()
                    keys.append(self.masters[id(p)])
                else:
                    keys.append(p)
                self._params.append(p)
            made.append({**hypers, "params": keys})
            self.group_ids.append(gi)
        if not made:
            return
        if self.optimizer is None:
            self.optimizer = self._make(made)
        else:  # a group added after construction (HybridDeviceOptimizer.add_param_group)
            for group in made:
                self.optimizer.add_param_group(group)

    def key(self, p: torch.Tensor) -> torch.Tensor:
        """What the optimizer updates for ``p``: its master, or ``p`` itself."""
        return self.masters.get(id(p), p)

    def step(self, hypers: Sequence[dict], scale: Optional[LossScale]) -> None:
        """Update on the device, from ``.grad`` as it is now."""
        opt = self.optimizer
        if opt is None:
            return
        sync_hyperparameters(opt, self.group_ids, hypers)
        pairs = [(p, self.masters[id(p)]) for p in self._params if id(p) in self.masters]
        self.take_edits()
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.float()
        try:
            run_step(opt, scale)
            written = [(p, m) for p, m in pairs if p.grad is not None]
            if written:  # each parameter its master rounded, in one batched launch
                torch._foreach_copy_([p for p, _ in written], [m for _, m in written])
        finally:
            for _, m in pairs:
                m.grad = None

    def take_edits(self) -> None:
        """Parameters edited since the optimizer wrote them into their masters (each parameter
        is its master rounded until someone edits it)."""
        own = [p for p in self._params if id(p) in self.masters]
        for p, edited in zip(own, differs_from_rounded([(self.masters[id(p)], p) for p in own])):
            if edited:
                merge_edited(self.masters[id(p)], p)

    def reload(self) -> None:
        """Masters from the parameters as they are now."""
        for p in self._params:
            if id(p) in self.masters:
                self.masters[id(p)].copy_(p)

    def write_params(self) -> None:
        """Parameters from their masters (after ``load_state_dict``)."""
        with torch.no_grad():
            for p in self._params:
                if id(p) in self.masters:
                    p.copy_(self.masters[id(p)])

    def state_of(self, p: torch.Tensor) -> Optional[dict[str, Any]]:
        if self.optimizer is None:
            return None
        return self.optimizer.state.get(self.key(p))
