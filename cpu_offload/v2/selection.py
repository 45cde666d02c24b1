"""Which saved tensors V2 offloads, and why the others are kept: one predicate, used by the hooks
and by the migration audit, so the audit can never disagree with what actually happens."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..core import markers
from ..compat import is_parameter

# Saved tensors with fewer elements stay on the device: the reference implementation's fixed
# threshold (256K elements, 512 KiB in bf16), below which a copy costs more than it frees.
DEFAULT_MIN_TENSOR_SIZE = 256 * 1024


@dataclass(frozen=True)
class SelectionPolicy:
    """V2's automatic activation detection, parametrised as in ``get_cpu_offload_context``.

    The predicate V2's saved-tensor hook applies to every saved tensor, and the one
    ``audit_offload_selection(..., policy=...)`` reports with: ``skip_reason(t)`` is ``None`` for
    a tensor V2 offloads, else why it stays (a parameter, a weight mark, ``mark_not_offload``,
    too small, not on the offload device, a module that opted out). ``is_device_tensor`` tells
    tensors on the offload device (default: CUDA tensors).

    Example::

        >>> import torch, cpu_offload
        >>> policy = cpu_offload.SelectionPolicy(
        ...     min_tensor_size_to_offload=16, is_device_tensor=lambda t: True)
        >>> print(policy.skip_reason(torch.randn(64)))
        None
        >>> policy.skip_reason(torch.randn(4))
        'too small'
        >>> policy.skip_reason(torch.nn.Parameter(torch.randn(64)))
        'parameter'
    """

    offload_activations: bool = True
    offload_weights: bool = False
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE
    is_device_tensor: Callable[[torch.Tensor], bool] = staticmethod(lambda t: t.is_cuda)

    def skip_reason(self, t: torch.Tensor) -> Optional[str]:
        """``None`` if ``t`` is offloaded, else a short reason why it stays where it is."""
        if markers.module_opt_out_active():
            return "module opted out"
        if markers.is_marked_not_offload(t):
            return "mark_not_offload"
        if not self.is_device_tensor(t):
            return "not on the offload device"
        if t.layout is not torch.strided or t.is_nested:
            return "not strided (sparse or nested)"
        if markers.is_weight(t):
            if not self.offload_weights:
                return "parameter" if is_parameter(t) else "weight mark"
        elif not self.offload_activations:
            return "activations not selected"
        if t.numel() < self.min_tensor_size_to_offload:
            return "too small"
        return None

    def wrapper_skip_reason(self, t: torch.Tensor) -> Optional[str]:
        """Opt-outs that apply to a wrapper subclass (``__tensor_flatten__``) as a whole; if none
        applies, its inner tensors are judged one by one with ``skip_reason``."""
        if markers.module_opt_out_active():
            return "module opted out"
        if markers.is_marked_not_offload(t):
            return "mark_not_offload"
        if markers.is_weight(t) and not self.offload_weights:
            return "parameter" if is_parameter(t) else "weight mark"
        return None
