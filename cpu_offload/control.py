"""Per-module offload switch for any ``nn.Module``.

``set_activation_offloading(module, False)`` keeps every tensor saved for backward while
``module`` (or any of its children) runs on the device, without touching the surrounding offload
context. The innermost module with an explicit setting wins, so a child can switch offloading back
on inside an opted-out parent.

How: a forward pre-hook pushes the module's setting on the policy stack of ``markers`` and a
forward hook registered with ``always_call=True`` pops it, so an exception inside ``forward``
still leaves the stack balanced. Both backends consult ``markers.module_opt_out_active()`` in
their pack hook, i.e. at the moment a tensor is saved.

Fused modules that save their sub-modules' tensors in one ``autograd.Function`` (the tensors are
saved in the parent's forward, after the sub-modules' settings were popped) use
``maybe_mark_activation_offload(sub_module, *tensors)`` (the per-operation helper of the same name
in Transformer Engine's fused ``BasicOperation``).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from .core import markers
from .compat import register_forward_hook_always
from .api import mark_activation_offload

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
        markers.mark_not_offload(*tensors)
    else:
        mark_activation_offload(*tensors)  # the facade dispatches to V1's tagger under V1
