"""Per-tensor and per-module marks that steer which saved tensors are offloaded.

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

import contextlib
from typing import Iterator, Optional

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


def _set_on_components(tensors: tuple, attr: str, value: object, storage_wide: bool = False) -> None:
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected torch.Tensor or None, got {type(t).__name__}")
        for c in component_tensors(t):
            setattr(c, attr, value)
            if storage_wide and c._base is not None:
                setattr(c._base, attr, value)


def mark_not_offload(*tensors: Optional[torch.Tensor]) -> None:
    """Keep these tensors on the device: never offload them (both backends).

    Use it for saved tensors that are cheap to keep or that something else still holds (copying
    them frees no memory), e.g. a cache shared across layers, rotary embedding tables or the
    attention mask. The mark covers the memory, not one tensor object: views of a marked tensor
    (``Linear`` on 3-D input saves ``x.view(-1, d)``), and every view of the same base, stay on
    the device too. Inner tensors of wrapper subclasses (``__tensor_flatten__``) are marked as
    well. To keep everything a module saves, use ``set_activation_offloading(module, False)``.

    Args:
        *tensors: the tensors to keep; ``None`` entries are skipped.

    Raises:
        TypeError: an argument is neither a tensor nor ``None``.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> cpu_offload.mark_not_offload(x)
        >>> with ctx:
        ...     y = x.sin()        # saves x, which stays where it is
        >>> sim.copies("d2h")
        []
    """
    _set_on_components(tensors, SKIP_ATTR, True, storage_wide=True)


def mark_weight(*tensors: Optional[torch.Tensor]) -> None:
    """Declare tensors as weights, so V2 treats them like parameters.

    V2 offloads every saved tensor that is not a parameter; a weight that is a plain tensor
    (a dequantized or gathered copy, a weight held by a custom container) would otherwise be
    copied to the CPU on every forward, freeing nothing while the module still holds it. Marked
    weights stay on the device, like parameters. Views of a marked weight
    (``F.linear`` saves ``w.t()``) count as weights too. A tensor attribute ``is_weight = True``
    has the same effect.

    Args:
        *tensors: the weights; ``None`` entries are skipped.

    Raises:
        TypeError: an argument is neither a tensor nor ``None``.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> w = torch.randn(8, 8, requires_grad=True)   # a weight, not an nn.Parameter
        >>> cpu_offload.mark_weight(w)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> with ctx:
        ...     y = torch.nn.functional.linear(x, w)   # saves x (offloaded) and w (kept)
        >>> len(sim.copies("d2h"))
        1
    """
    _set_on_components(tensors, WEIGHT_ATTR, True, storage_wide=True)


def tag_activation_offload(*tensors: Optional[torch.Tensor], offload: bool = True) -> None:
    """Set the V1 ``activation_offloading`` tag (``offload=False`` clears it)."""
    _set_on_components(tensors, V1_TAG_ATTR, offload)


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

_module_policy: list[bool] = []


def module_opt_out_active() -> bool:
    """True while the innermost module with an explicit offload setting has it switched off."""
    return bool(_module_policy) and not _module_policy[-1]


def push_module_policy(enabled: bool) -> None:
    _module_policy.append(bool(enabled))


def pop_module_policy() -> None:
    if _module_policy:
        _module_policy.pop()


@contextlib.contextmanager
def offload_policy(enabled: bool) -> Iterator[None]:
    """A ``with`` block inside which saved tensors are offloaded only if ``enabled``.

    The block-scoped form of ``set_activation_offloading``: the innermost setting wins, so
    ``offload_policy(True)`` inside ``offload_opt_out()`` switches offloading back on. Blocks and
    module settings share one stack. Works with both backends; it can only restrict what the
    context selects, never offload a tensor the backend would keep.

    Args:
        enabled: ``False``: no tensor saved inside the block is offloaded. ``True``: the
            context's own selection applies again.

    Returns:
        A context manager.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> with ctx:
        ...     with cpu_offload.offload_policy(False):
        ...         a = x.sin()          # x stays on the device
        ...     b = (x * 2).cos()        # x * 2 is offloaded
        >>> len(sim.copies("d2h"))
        1
    """
    push_module_policy(enabled)
    try:
        yield
    finally:
        pop_module_policy()


def offload_opt_out() -> contextlib.AbstractContextManager:
    """A ``with`` block inside which no saved tensor is offloaded.

    Shorthand for ``offload_policy(False)``: wrap the part of a layer whose saved tensors
    should stay on the device (small, reused, or needed early in backward). Works with both
    backends.

    Returns:
        A context manager.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> with ctx, cpu_offload.offload_opt_out():
        ...     y = x.sin()
        >>> sim.copies("d2h")
        []
    """
    return offload_policy(False)
