"""Per-module offload switch (seed 001, generalised to any ``nn.Module``).

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
``maybe_mark_activation_offload(sub_module, *tensors)``, the equivalent of seed 001's
``BasicOperation.maybe_mark_activation_offload``.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from . import markers
from .compat import register_forward_hook_always
from .facade import mark_activation_offload

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
    """Offload tensors saved while ``module`` runs (children included) only if ``enabled``.

    Calling it again replaces the setting (the hooks are installed once). ``enabled=None``
    removes the setting and the hooks: the module then follows its nearest ancestor with a
    setting, or the offload context's own selection if there is none.
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
    """The explicit setting of ``module`` itself (``None``: none; ancestors are not consulted)."""
    switch: Optional[_Switch] = module.__dict__.get(_SWITCH_ATTR)
    return None if switch is None else switch.enabled


def maybe_mark_activation_offload(module: nn.Module, *tensors: Optional[torch.Tensor]) -> None:
    """Mark tensors that ``module`` produced but a fused parent saves for backward.

    ``module`` opted out: ``mark_not_offload`` (both backends keep them). Otherwise they get the
    V1 ``activation_offloading`` tag, which V1 offloads by and V2 records for the audit. This can
    only opt tensors *out*: an explicit ``True`` on a sub-module cannot override an opted-out
    ancestor that is active when the fused parent saves.
    """
    if get_activation_offloading(module) is False:
        markers.mark_not_offload(*tensors)
    else:
        mark_activation_offload(*tensors)  # the facade dispatches to V1's tagger under V1
