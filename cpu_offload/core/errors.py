"""Exceptions raised for misuse, so callers can catch configuration mistakes specifically."""
import sys
from typing import Any

import torch


class OffloadConfigError(ValueError):
    """An argument, or a combination of them, that cannot work.

    Raised by ``get_cpu_offload_context``, ``apply_offloading``, ``plan_offloading``, the
    configs' ``validate()`` and ``HybridDeviceOptimizer`` before anything runs; the message
    names the fix. A ``ValueError``, so existing ``except ValueError`` handlers catch it.

    Example::

        >>> import cpu_offload
        >>> try:
        ...     cpu_offload.get_cpu_offload_context(enabled=True, num_layers=4, model_layers=4,
        ...                                         device=cpu_offload.SimulatedDevice())
        ... except cpu_offload.OffloadConfigError as e:
        ...     print(e)
        num_layers=4 must be smaller than model_layers=4: at least one layer's activations stay on the GPU; use num_layers <= 2 for full overlap
    """


class OffloadUsageError(RuntimeError):
    """Offloading was used in a way or order that cannot work, found while it runs.

    For example ``apply_offloading`` applied twice to the same layers, layers running out of
    order or skipped, a manual synchronizer given an unknown layer id, or an optimizer method
    called at the wrong point of the step. The message names the fix. A ``RuntimeError``.

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> sim = cpu_offload.SimulatedDevice()
        >>> handle = cpu_offload.apply_offloading(layers, num_layers=2, device=sim)
        >>> try:
        ...     cpu_offload.apply_offloading(layers, num_layers=2, device=sim)
        ... except cpu_offload.OffloadUsageError as e:
        ...     print(e)
        layer 0 (OffloadedLinear) already has offloading or profiling installed; call .remove() on the handle apply_offloading returned (also available as cpu_offload.offloading_handle(layer)) before applying again
        >>> handle.remove()
    """


class OffloadVerifyError(RuntimeError):
    """Verify mode found a reloaded storage that differs from the bytes that were saved.

    With ``get_cpu_offload_context(..., verify=True)`` (or ``CPU_OFFLOAD_VERIFY=1``) every
    offloaded storage gets a device checksum when its copy is queued, checked again after its
    reload. A mismatch (a copy read before it finished, a host buffer overwritten) raises this
    during backward, naming the layer, the size and the awaited event, instead of letting wrong
    gradients through. A ``RuntimeError``.

    Example::

        >>> import torch, cpu_offload
        >>> sim = cpu_offload.SimulatedDevice()
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1,
        ...     device=sim, verify=True)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(torch.tanh(x))
        ...     x = sync(x)
        >>> saved = next(e for e in ctx.synchronizer.step.layers[0].entries if e.cpu is not None)
        >>> _ = saved.cpu.bitwise_not_()   # corrupt the host copy, as a stream race would
        >>> try:
        ...     x.sum().backward()
        ... except cpu_offload.OffloadVerifyError as e:
        ...     print(str(e)[:69])
        verify: the storage of 128 bytes saved by layer 0 came back different
    """


def check_sync_argument(tensor: Any) -> None:
    """The sync function (both backends) marks a layer boundary on one tensor: refuse others."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"the sync function takes the layer's output tensor, got {type(tensor).__name__}; "
            "for a layer returning a tuple or dict, pass its hidden-state tensor: "
            "`out = (sync(out[0]), *out[1:])`"
        )


# Frames of torch's dynamo-disable wrappers (``compat.compiler_disable``) around our hooks: on
# torch 2.6 they sit between the user's line and ours, and are not the user's line either.
_PASS_THROUGH = ("cpu_offload", "torch._dynamo.eval_frame", "torch._compile")


def stacklevel_outside_package() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the first caller outside
    ``cpu_offload`` (the user's line), however deep inside the package the warning is raised,
    and through torch's dynamo-disable wrappers of our hooks."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PASS_THROUGH):
        frame, level = frame.f_back, level + 1
    return level


def public_caller(default: str) -> str:
    """The package's function or class the user called, for messages that tell them what to
    pass to it: the outermost frame inside ``cpu_offload`` of the current call chain, not a
    decorator's ``wrapper`` (a method names its class: ``OffloadCallback``, also when the
    Trainer called it), else ``default``."""
    frame, inside = sys._getframe(1), []
    while frame is not None and frame.f_globals.get("__name__", "").startswith("cpu_offload"):
        inside.append(frame)
        frame = frame.f_back
    for entry in reversed(inside):
        if entry.f_code.co_name != "wrapper":
            owner = entry.f_locals.get("self")
            return type(owner).__name__ if owner is not None else entry.f_code.co_name
    return default


# Tracebacks and reprs name the exceptions where users import them from (``cpu_offload``), not
# the module that happens to define them.
for _cls in (OffloadConfigError, OffloadUsageError, OffloadVerifyError):
    _cls.__module__ = "cpu_offload"
del _cls
