"""Differences between torch releases, in one place.

Everything version-dependent that the rest of the package needs goes through here, so the
backends read as plain code and a new torch release means editing one module.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])
MIN_TORCH = Version("2.1")

if TORCH_VERSION < MIN_TORCH:  # pragma: no cover - guarded by setup.cfg too
    raise ImportError(f"cpu_offload needs torch>={MIN_TORCH}, found {torch.__version__}")

try:  # torch >= 2.1
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError:  # pragma: no cover

    def is_traceable_wrapper_subclass(t: Any) -> bool:  # type: ignore[misc]
        return hasattr(t, "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__")


# Public since torch 1.10; kept behind a name so V1 and V2 share one entry point.
saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks


def untyped_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind ``t`` (``Tensor.untyped_storage`` exists from torch 2.0)."""
    return t.untyped_storage()


def tensor_on_storage(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    device: torch.device,
    size: torch.Size,
    stride: tuple,
    storage_offset: int,
) -> torch.Tensor:
    """A tensor viewing ``storage`` with exactly the given geometry (any strides, any offset)."""
    return torch.empty(0, dtype=dtype, device=device).set_(storage, storage_offset, size, stride)


_unflatten_arity: dict = {}


def tensor_unflatten(cls: type, inner: dict, ctx: Any, size: torch.Size, stride: tuple) -> Any:
    """``cls.__tensor_unflatten__``: ``(inner, ctx)`` before torch 2.2, plus size/stride after."""
    arity = _unflatten_arity.get(cls)
    if arity is None:
        arity = _unflatten_arity[cls] = len(inspect.signature(cls.__tensor_unflatten__).parameters)
    if arity >= 4:
        return cls.__tensor_unflatten__(inner, ctx, size, stride)
    return cls.__tensor_unflatten__(inner, ctx)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass that is executing now has finished.

    Only valid while the autograd engine runs (e.g. from a grad_fn pre-hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def register_forward_hook_always(module: torch.nn.Module, hook: Callable) -> Any:
    """Forward hook that also runs when forward raises (``always_call`` exists from torch 2.1)."""
    return module.register_forward_hook(hook, always_call=True)
