"""Tensor subclasses the backends save: wrapper subclasses (``__tensor_flatten__``: DTensor,
``AsyncCollectiveTensor``, low-precision formats) are offloaded by their inner tensors and rebuilt
from them.

``tensor_flatten``/``tensor_unflatten`` are the two halves both backends use: they keep the
non-tensor inner attributes some subclasses list (DTensor's ``device_mesh`` on recent torch)
aside, await a collective that may still write the tensor (``wait_pending_collective``), and
call ``__tensor_unflatten__`` with the arguments this torch release passes.
"""
from __future__ import annotations

import inspect
from typing import Any, Tuple

import torch

__all__ = ["tensor_flatten", "tensor_unflatten", "wait_pending_collective"]


class _FlattenCtx:
    """``tensor_flatten``'s context when a subclass listed non-tensor attributes as inner."""

    __slots__ = ("ctx", "opaque")

    def __init__(self, ctx: Any, opaque: dict) -> None:
        self.ctx = ctx
        self.opaque = opaque


def tensor_flatten(t: torch.Tensor) -> Tuple[list, Any]:
    """``t.__tensor_flatten__()`` for saving ``t``'s inner tensors elsewhere; pair it with
    ``tensor_unflatten``.

    - Only names of inner *tensors* are returned. Some subclasses list other objects among their
      inner attributes (DTensor lists its ``device_mesh`` from torch 2.10 or so, an opaque
      object for PT2); those travel in the returned context and ``tensor_unflatten`` puts them
      back.
    - A tensor whose data is still being written by a collective (``AsyncCollectiveTensor``) is
      awaited first (``wait_pending_collective``), so copies of its inner tensors ordered after
      the current stream read final data.
    """
    wait_pending_collective(t)
    names, ctx = t.__tensor_flatten__()
    tensors, opaque = [], {}
    for name in names:
        value = getattr(t, name)
        if isinstance(value, torch.Tensor):
            tensors.append(name)
        else:
            opaque[name] = value
    return tensors, (_FlattenCtx(ctx, opaque) if opaque else ctx)


_unflatten_arity: dict = {}


def tensor_unflatten(cls: type, inner: dict, ctx: Any, size: torch.Size, stride: tuple) -> Any:
    """``cls.__tensor_unflatten__``: ``(inner, ctx)`` before torch 2.2, plus size/stride after.
    Accepts ``tensor_flatten``'s context as well as the subclass's own."""
    if isinstance(ctx, _FlattenCtx):
        inner = {**inner, **ctx.opaque}
        ctx = ctx.ctx
    arity = _unflatten_arity.get(cls)
    if arity is None:
        arity = _unflatten_arity[cls] = len(inspect.signature(cls.__tensor_unflatten__).parameters)
    if arity >= 4:
        return cls.__tensor_unflatten__(inner, ctx, size, stride)
    return cls.__tensor_unflatten__(inner, ctx)


def wait_pending_collective(t: torch.Tensor) -> torch.Tensor:
    """Make the current stream wait for the collective that produces ``t``, if one may still run.

    Tensor parallelism's ``RowwiseParallel`` returns an ``AsyncCollectiveTensor``: its data is
    final only after the all-reduce, which is awaited at the tensor's first use. Autograd saves an
    op's inputs *before* running the op, so a saved-tensor hook sees it not yet awaited, and a
    side-stream copy ordered after the current stream would read it while the collective still
    writes it. Waiting here orders the collective before anything queued next on this stream.
    Returns ``t`` (still the same object); anything else is returned untouched.
    """
    # ``completed`` exists from torch 2.2 or so; before, waiting again is a no-op (idempotent).
    if type(t).__name__ == "AsyncCollectiveTensor" and not getattr(t, "completed", False):
        t.trigger_wait()
    return t
