"""Loss scaling (``torch.amp.GradScaler``) for an optimizer that keeps copies of the gradients.

``GradScaler.unscale_`` rewrites ``.grad`` in place with a kernel that does not bump the version
counter, and ``GradScaler.step`` skips ``optimizer.step()`` when it finds an inf. Gradients the
hybrid optimizer copied to the host during backward would miss both. So it declares
``_step_supports_amp_scaling`` as torch's fused optimizers do: ``GradScaler.step`` then checks
for infs itself and hands ``grad_scale`` (``None`` after an explicit ``unscale_``) and
``found_inf`` to ``step()`` as attributes, touching no gradient. ``LossScale`` carries them to
every optimizer the hybrid runs, and ``run_step`` applies them exactly as ``GradScaler`` would to
that optimizer run on its own: a class that supports the protocol gets the two tensors; any
other class has its gradients unscaled in place by torch's own kernel and is skipped after an
inf. Each part therefore equals its wrapped class under the same scaler, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..compat import amp_unscale_

__all__ = ["LossScale", "run_step"]


@dataclass(frozen=True)
class LossScale:
    """What ``GradScaler.step`` handed to ``step()``: the scale still in the gradients
    (``None`` once ``unscale_`` ran) and the inf flag, both 0-dim tensors."""

    grad_scale: Optional[torch.Tensor]
    found_inf: torch.Tensor

    @classmethod
    def take(cls, optimizer: Any) -> Optional["LossScale"]:
        """The scale ``GradScaler.step`` set on ``optimizer`` for this step, if any."""
        if not hasattr(optimizer, "found_inf"):
            return None
        return cls(getattr(optimizer, "grad_scale", None), optimizer.found_inf)

    @property
    def skip(self) -> bool:
        """An inf was found: the step changes nothing (a host synchronization)."""
        return bool(self.found_inf.item())


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def run_step(optimizer: torch.optim.Optimizer, scale: Optional[LossScale]) -> None:
    """``optimizer.step()`` as ``GradScaler.step`` runs it under ``scale`` (plain without one)."""
    if scale is None:
        optimizer.step()
        return
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale = scale.grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = scale.found_inf  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        return
    if scale.skip:
        return
    if scale.grad_scale is not None:
        # GradScaler.unscale_'s arithmetic: the reciprocal in fp64, torch's kernel in place, per
        # device and dtype
        inv = scale.grad_scale.double().reciprocal().float()
        groups: dict[tuple, list[torch.Tensor]] = {}
        for g in _grads(optimizer):
            groups.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), grads in groups.items():
            flag = torch.zeros((), dtype=torch.float32, device=device)
            amp_unscale_(grads, flag, inv.to(device))
    optimizer.step()
