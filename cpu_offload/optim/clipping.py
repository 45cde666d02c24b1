"""``max_grad_norm``: the global-norm clip ``HybridDeviceOptimizer.step`` applies over every
gradient, the device's and the CPU part's (from its host copies), bit for bit as
``torch.nn.utils.clip_grad_norm_`` over all the parameters would."""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def clip_by_global_norm(params: Sequence[torch.Tensor], cpu_norms: dict[int, torch.Tensor],
                        max_norm: float, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global norm of the gradients of ``params`` (in param-group order; ``cpu_norms``:
    ``id(p)`` -> the norm of the host copy of a CPU-part gradient), computed in torch's grouping
    and order; scales the device gradients in place. Returns (total norm, the coefficient for
    the CPU part, on the CPU)."""
    clipped = [p for p in params if p.grad is not None or id(p) in cpu_norms]
    if not clipped:
        return torch.tensor(0.0), torch.tensor(1.0)
    # torch's own grouping, in its order: the norms are summed in that order, and a group order
    # of first appearance rounds differently when the dtypes are mixed
    grouped = _group_tensors_by_device_and_dtype([clipped], with_indices=True)
    groups = {key: [clipped[i] for i in indices] for key, (_, indices) in grouped.items()}
    first = clipped[0].device
    norms: list[torch.Tensor] = []
    for group in groups.values():
        on_device = [p.grad for p in group if id(p) not in cpu_norms]
        device_norms = iter(torch._foreach_norm(on_device, norm_type) if on_device else [])
        norms += [cpu_norms[id(p)] if id(p) in cpu_norms else next(device_norms) for p in group]
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for (dev, _), group in groups.items():
        grads = [p.grad for p in group if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(dev))
    return total, coef.to("cpu")
