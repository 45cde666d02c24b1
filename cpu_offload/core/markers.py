"""Per-tensor and per-module marks that steer which saved tensors are offloaded: the attributes,
the predicates the backends' pack hooks ask, and the per-module policy stack. Users set them
through ``cpu_offload.control`` (``mark_not_offload``, ``mark_weight``, ``offload_policy``, ...).

Marks are plain attributes on tensors, so they survive being passed through user code and cost one
attribute lookup in the saved-tensor hook. Both backends read them:

- ``activation_offloading`` -- the legacy V1 tag: V1 offloads exactly the tensors carrying it.
- ``_cpu_offload_skip`` -- ``mark_not_offload``: never offload this tensor (both backends).
- ``_cpu_offload_weight`` / ``is_weight`` -- a weight that is not an ``nn.Parameter``; V2 treats it
  like a parameter (kept on the device).
- ``_cpu_offload_ready_event`` -- set by ``start_offload``: the point on the compute stream after
  which the tensor is final, so its copy may start before it is saved for backward.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..compat import is_parameter, is_traceable_wrapper_subclass

SKIP_ATTR = "_cpu_offload_skip"
WEIGHT_ATTR = "_cpu_offload_weight"
V1_TAG_ATTR = "activation_offloading"
READY_EVENT_ATTR = "_cpu_offload_ready_event"


def component_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` and, for wrapper subclasses (``__tensor_flatten__``), every inner tensor, recursively."""
    out = [t]
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out.extend(component_tensors(inner))
    return out


def set_on_components(tensors: tuple, attr: str, value: object, storage_wide: bool = False) -> None:
    """Set the mark ``attr = value`` on each tensor and its inner tensors (``None`` skipped);
    ``storage_wide``: on the base of a view too, so that every view of that memory carries it."""
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected torch.Tensor or None, got {type(t).__name__}")
        for c in component_tensors(t):
            setattr(c, attr, value)
            if storage_wide and c._base is not None:
                setattr(c._base, attr, value)


def tag_activation_offload(*tensors: Optional[torch.Tensor], offload: bool = True) -> None:
    """Set the V1 ``activation_offloading`` tag (``offload=False`` clears it)."""
    set_on_components(tensors, V1_TAG_ATTR, offload)


def is_marked_not_offload(t: torch.Tensor) -> bool:
    return getattr(t, SKIP_ATTR, False) or (t._base is not None and getattr(t._base, SKIP_ATTR, False))


def is_weight(t: torch.Tensor) -> bool:
    """Parameters, views of parameters (``F.linear`` saves ``weight.t()``), and marked weights."""
    base = t._base
    return _is_weight_itself(t) or (base is not None and _is_weight_itself(base))


def _is_weight_itself(t: torch.Tensor) -> bool:
    return (
        is_parameter(t)
        or getattr(t, WEIGHT_ATTR, False)
        or getattr(t, "is_weight", False)
    )


# --- per-module opt-out: a stack of per-module policies; the innermost module with an
# explicit setting decides whether tensors saved while it runs may be offloaded.

# The stack itself is read by V2's pack hook (no call); it is only ever changed in place.
MODULE_POLICY: list[bool] = []


def module_opt_out_active() -> bool:
    """True while the innermost module with an explicit offload setting has it switched off."""
    return bool(MODULE_POLICY) and not MODULE_POLICY[-1]


def push_module_policy(enabled: bool) -> None:
    MODULE_POLICY.append(bool(enabled))


def pop_module_policy() -> None:
    if MODULE_POLICY:
        MODULE_POLICY.pop()
