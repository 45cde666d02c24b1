"""Byte-exact capture and restore of a tensor's storage, shared by both backends.

A saved tensor is offloaded as its *whole storage*, moved as one flat ``uint8`` buffer, and
restored with ``set_`` to exactly the same dtype, size, strides and storage offset. Any stride
pattern therefore round-trips (including contiguous views of non-contiguous bases, as produced by
``scaled_dot_product_attention`` + ``transpose().reshape()``), no copy kernel ever runs on the
side stream, and views of one base restore as views of one new base.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .compat import tensor_on_storage, untyped_storage


class ViewMeta(NamedTuple):
    """Geometry of one tensor inside its storage."""

    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    storage_offset: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "ViewMeta":
        return cls(t.dtype, t.size(), t.stride(), t.storage_offset())


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory behind ``t``: views of one base share it."""
    return untyped_storage(t).data_ptr()


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` tensor over the whole storage of ``t`` (no grad history, no copy)."""
    return tensor_on_storage(
        untyped_storage(t), torch.uint8, t.device, torch.Size([untyped_storage(t).nbytes()]), (1,), 0
    )


def restore_view(flat: torch.Tensor, meta: ViewMeta) -> torch.Tensor:
    """The tensor described by ``meta``, viewing the storage of ``flat`` (a ``storage_bytes``)."""
    return tensor_on_storage(
        untyped_storage(flat), meta.dtype, flat.device, meta.size, meta.stride, meta.storage_offset
    )
