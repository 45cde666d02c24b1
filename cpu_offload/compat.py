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


def top_saved_tensors_hooks() -> Any:
    """The innermost saved-tensor hooks installed now (``None`` if none): tests and checks."""
    get = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if get is None:  # pragma: no cover - very old torch
        return None
    try:
        return get(False)
    except TypeError:  # pragma: no cover - older signature without the flag
        return get()


def in_backward() -> bool:
    """True while the calling thread executes a backward pass (an autograd graph task): a
    forward running now is a recomputation (activation checkpointing), not a new step."""
    return graph_task_id() != -1


def storage_use_count(t: torch.Tensor) -> int:
    """How many references hold the storage behind ``t`` (tensors, storage objects), or 0 where
    torch cannot say. Used to tell whether dropping our reference would free any memory."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # pragma: no cover
        return 0
    storage = t.untyped_storage()
    return count(storage._cdata) - 1  # not counting the storage object made for the question


def set_version(t: torch.Tensor, version: int) -> None:
    """Put ``t``'s version counter (shared with every alias) back to ``version``."""
    fn = torch._C._autograd._unsafe_set_version_counter
    try:
        fn((t,), (version,))
    except TypeError:  # torch < 2.5 takes one tensor and one int
        fn(t, version)


def drop_storage_keep_version(alias: torch.Tensor) -> None:
    """Make ``alias`` (a detached alias of a saved tensor) let go of its storage while it keeps
    sharing the version counter: in-place changes stay detectable without holding memory."""
    version = alias._version
    alias.set_()  # a detached alias needs no grad mode switch; set_ counts as a change...
    set_version(alias, version)  # ...which is undone at once


def copy_view_bits(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Give ``dst`` the lazy conjugate / negative bits of ``src`` (complex views keep them as
    flags, not in the data, so a byte copy alone loses them)."""
    if src.is_conj():
        torch._C._set_conj(dst, True)
    if src.is_neg():
        torch._C._set_neg(dst, True)
    return dst


def graph_task_id() -> int:
    """An id of the backward pass running on this thread (-1 outside backward), so that a pass
    that ended in an exception, whose end-of-backward callback never ran, is told from the next."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else -1
