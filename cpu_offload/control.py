"""What gets offloaded: marks on tensors, switches on modules and blocks.

The offload context selects saved tensors by itself (V2: every saved activation above
``min_tensor_size_to_offload``; V1: the tagged ones). The functions here narrow or steer that
selection, with both backends:

- tensors: ``mark_not_offload`` (keep), ``mark_weight`` (treat as a parameter: keep),
  ``mark_activation_offload`` (V1's tag; V2 records it for the audit), ``start_offload`` (final
  now: the copy may start early, V2);
- modules: ``set_activation_offloading(module, False)`` keeps every tensor saved while ``module``
  (or any of its children) runs on the device, without touching the surrounding offload
  context; ``get_activation_offloading``; ``maybe_mark_activation_offload`` for fused modules;
- blocks: ``offload_policy(enabled)`` and ``offload_opt_out()``.

The innermost module or block with an explicit setting wins, so a child can switch offloading
back on inside an opted-out parent. How: a forward pre-hook pushes the module's setting on the
policy stack of ``core.markers`` and a forward hook registered with ``always_call=True`` pops it,
so an exception inside ``forward`` still leaves the stack balanced. Both backends consult
``markers.module_opt_out_active()`` in their pack hook, i.e. at the moment a tensor is saved.

Fused modules that save their sub-modules' tensors in one ``autograd.Function`` (the tensors are
saved in the parent's forward, after the sub-modules' settings were popped) use
``maybe_mark_activation_offload(sub_module, *tensors)`` (the per-operation helper of the same name
in Transformer Engine's fused ``BasicOperation``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from .api import use_v1
from .compat import register_forward_hook_always
from .core import markers
from .core.checks import check_bool
from .v2.context import start_offload as v2_start_offload

__all__ = [
    "get_activation_offloading",
    "mark_activation_offload",
    "mark_not_offload",
    "mark_weight",
    "maybe_mark_activation_offload",
    "offload_opt_out",
    "offload_policy",
    "set_activation_offloading",
    "start_offload",
]


# --- tensors ---------------------------------------------------------------------------------


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
    markers.set_on_components(tensors, markers.SKIP_ATTR, True, storage_wide=True)


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
    markers.set_on_components(tensors, markers.WEIGHT_ATTR, True, storage_wide=True)


def mark_activation_offload(*tensors: Optional[torch.Tensor], offload: bool = True) -> None:
    """Tag tensors as activations to offload (the ``activation_offloading`` attribute).

    The legacy V1 backend (``NVTE_CPU_OFFLOAD_V1=1``) offloads exactly the tensors carrying this
    tag, so code written for it tags each activation it wants moved. The default V2 backend
    detects activations automatically and only records the tag, so that
    ``audit_offload_selection`` can compare both selections when you migrate (README, "Control
    and migration").

    Args:
        *tensors: the tensors to tag; ``None`` entries are skipped. For tensor subclasses with
            ``__tensor_flatten__`` the inner tensors are tagged too.
        offload: ``False`` sets the tag to ``False`` (V1 then keeps the tensor).

    Raises:
        TypeError: an argument is neither a tensor nor ``None``.

    Example::

        >>> import torch, cpu_offload
        >>> t = torch.randn(4)
        >>> cpu_offload.mark_activation_offload(t)
        >>> t.activation_offloading
        True
    """
    check_bool("offload", offload)
    if use_v1():
        # V1 is imported only when selected (cpu_offload.api says why).
        from .v1 import mark_activation_offload as v1_mark

        v1_mark(*tensors, offload=offload)
    else:
        markers.tag_activation_offload(*tensors, offload=offload)


def start_offload(*tensors: Optional[torch.Tensor], offload_base_tensor: bool = False) -> None:
    """Declare these tensors final now, so their copy to the CPU may start early (V2).

    Normally a tensor's copy to the CPU is queued when autograd saves it, ordered after
    everything the compute stream has queued by then. Call ``start_offload(t)`` right after the
    last kernel that writes ``t`` to order the copy after that point instead, so it can overlap
    the kernels that run until ``t`` is saved (e.g. a fused kernel that saves its input late).
    Do not modify ``t`` afterwards. Outside an enabled context, and under V1, it does nothing.

    Args:
        *tensors: tensors that are final at this point; ``None`` entries are skipped.
        offload_base_tensor: mark the base of a view instead of the view (the whole storage is
            copied either way).

    Example::

        >>> import torch, cpu_offload
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=cpu_offload.SimulatedDevice())
        >>> x = torch.randn(8, 8, requires_grad=True)
        >>> with ctx:
        ...     h = x * 2
        ...     cpu_offload.start_offload(h)   # h is final: its copy may start here
        ...     y = h.sin()                    # saves h for backward
    """
    check_bool("offload_base_tensor", offload_base_tensor)
    if use_v1():
        return
    v2_start_offload(*tensors, offload_base_tensor=offload_base_tensor)


# --- modules and blocks ----------------------------------------------------------------------

_SWITCH_ATTR = "_cpu_offload_switch"


class _Switch:
    """The hooks and setting of one module.

    A module-level class (not closures) so that modules with a switch still ``deepcopy`` and
    pickle. ``pushed`` counts pushes not yet popped by this module: if another pre-hook raises
    before ours ran, the always-called forward hook must not pop someone else's entry.
    """

    __slots__ = ("enabled", "pushed", "pre_handle", "post_handle")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.pushed = 0
        self.pre_handle: Any = None
        self.post_handle: Any = None

    def pre_hook(self, module: nn.Module, args: Any) -> None:
        markers.push_module_policy(self.enabled)
        self.pushed += 1

    def post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.pushed:
            self.pushed -= 1
            markers.pop_module_policy()

    def remove(self) -> None:
        self.pre_handle.remove()
        self.post_handle.remove()


def set_activation_offloading(module: nn.Module, enabled: Optional[bool]) -> None:
    """Switch offloading off (or back on) for everything a module saves for backward.

    Tensors saved while ``module`` runs, its children included, are offloaded only if
    ``enabled``. Use it to keep a sub-module's activations on the device without touching the
    layer loop: small or latency-critical parts (norms, routers, the attention mask), or a
    module whose saved tensors something else still holds. The innermost module with a setting
    wins, so a child can switch offloading back on inside an opted-out parent. It can only
    restrict what the context selects; it never offloads a tensor the backend would keep.
    Works with both backends; a module with a setting can still be deep-copied and pickled.

    Args:
        module: any ``nn.Module``.
        enabled: ``False``: keep its saved tensors on the device. ``True``: the context's own
            selection applies inside it (overrides an opted-out ancestor). ``None``: remove the
            setting and its hooks; the module follows its nearest ancestor with a setting, or
            the context's own selection. Calling again replaces the setting.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or ``enabled`` is not ``True``,
            ``False`` or ``None``.
        RuntimeError: ``enabled=None`` inside that module's own forward.

    Example::

        >>> import torch, cpu_offload
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        >>> cpu_offload.set_activation_offloading(block[1], False)   # keep the norm's tensors
        >>> cpu_offload.get_activation_offloading(block[1])
        False
        >>> sim = cpu_offload.SimulatedDevice()
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim)
        >>> with ctx:
        ...     y = block(torch.randn(4, 8, requires_grad=True))
        >>> len(sim.copies("d2h"))       # only the Linear's input was offloaded
        1
        >>> cpu_offload.set_activation_offloading(block[1], None)    # back to the default
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}")
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    switch: Optional[_Switch] = module.__dict__.get(_SWITCH_ATTR)
    if enabled is None:
        if switch is not None:
            if switch.pushed:
                raise RuntimeError(
                    "set_activation_offloading(module, None) called inside that module's own "
                    "forward; change the setting between forward passes"
                )
            switch.remove()
            del module.__dict__[_SWITCH_ATTR]
        return
    if switch is not None:
        switch.enabled = enabled  # read at the next forward's pre-hook
        return
    switch = _Switch(enabled)
    # First pre-hook and last forward hook: the setting covers the module's other hooks too.
    switch.pre_handle = module.register_forward_pre_hook(switch.pre_hook, prepend=True)
    switch.post_handle = register_forward_hook_always(module, switch.post_hook)
    module.__dict__[_SWITCH_ATTR] = switch


def get_activation_offloading(module: nn.Module) -> Optional[bool]:
    """The offload setting made with ``set_activation_offloading`` on ``module`` itself.

    Args:
        module: any ``nn.Module``.

    Returns:
        ``True`` or ``False`` as set, or ``None`` if ``module`` has no setting of its own
        (ancestors are not consulted).

    Example::

        >>> import torch, cpu_offload
        >>> norm = torch.nn.LayerNorm(8)
        >>> print(cpu_offload.get_activation_offloading(norm))
        None
        >>> cpu_offload.set_activation_offloading(norm, False)
        >>> cpu_offload.get_activation_offloading(norm)
        False
    """
    switch: Optional[_Switch] = module.__dict__.get(_SWITCH_ATTR)
    return None if switch is None else switch.enabled


def maybe_mark_activation_offload(module: nn.Module, *tensors: Optional[torch.Tensor]) -> None:
    """Mark tensors that ``module`` produced but a fused parent saves for backward.

    A fused module that runs its sub-modules' computations in one ``autograd.Function`` saves
    their tensors in its own forward, after the sub-modules' settings from
    ``set_activation_offloading`` have ended. Call this in the fused forward, once per
    sub-module, so their settings still apply: if ``module`` opted out, the tensors are marked
    ``mark_not_offload`` (both backends keep them); otherwise they get the V1
    ``activation_offloading`` tag (``mark_activation_offload``), which V1 offloads by and V2
    records for the audit. This can only opt tensors *out*: an explicit ``True`` on a
    sub-module cannot override an opted-out ancestor that is active when the fused parent saves.

    Args:
        module: the sub-module whose setting applies.
        *tensors: the tensors it produced; ``None`` entries are skipped.

    Raises:
        TypeError: an argument in ``tensors`` is neither a tensor nor ``None``.

    Example::

        >>> import torch, cpu_offload
        >>> norm = torch.nn.LayerNorm(8)
        >>> cpu_offload.set_activation_offloading(norm, False)
        >>> h = torch.randn(4, 8)
        >>> cpu_offload.maybe_mark_activation_offload(norm, h)   # h will stay on the device
        >>> h._cpu_offload_skip
        True
    """
    if get_activation_offloading(module) is False:
        mark_not_offload(*tensors)
    else:
        mark_activation_offload(*tensors)  # V1's tagger under V1


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
    markers.push_module_policy(enabled)
    try:
        yield
    finally:
        markers.pop_module_policy()


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
