"""Byte-exact capture and restore of a tensor's storage, shared by both backends.

A saved tensor is offloaded as its *whole storage*, moved as one flat ``uint8`` buffer, and
restored with ``set_`` to exactly the same dtype, size, strides and storage offset. Any stride
pattern therefore round-trips (including contiguous views of non-contiguous bases, as produced by
``scaled_dot_product_attention`` + ``transpose().reshape()``), no copy kernel ever runs on the
side stream, and views of one base restore as views of one new base.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..compat import (
    bytes_on_storage,
    copy_view_bits,
    set_versions,
    tensor_on_storage,
)


_tuple_new = tuple.__new__
_Tensor = torch.Tensor
_uint8 = torch.uint8


class ViewMeta(NamedTuple):
    """Geometry of one tensor inside its storage, and the lazy conj/neg bits of complex views
    (flags on the tensor, not in its bytes)."""

    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    storage_offset: int
    bits_of: Optional[torch.Tensor] = None  # a tensor whose conj/neg bits to restore, if any

    @classmethod
    def of(cls, t: torch.Tensor) -> "ViewMeta":
        # (the conjugate bit exists only on complex dtypes: no call to ask a real tensor)
        bits = _bits_carrier(t) if t.is_neg() or (t.dtype.is_complex and t.is_conj()) else None
        # tuple.__new__ directly: NamedTuple's generated __new__ is one more Python call, and
        # this runs for every offloaded saved tensor.
        return _tuple_new(cls, (t.dtype, t.size(), t.stride(), t.storage_offset(), bits))


def _bits_carrier(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor with ``t``'s conj/neg bits (holds no memory of ``t``)."""
    return copy_view_bits(t, torch.empty(0, dtype=t.dtype))


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory behind ``t``: views of one base share it."""
    return t.untyped_storage().data_ptr()


def storage_bytes(t: torch.Tensor, storage: Optional[torch.UntypedStorage] = None) -> torch.Tensor:
    """A flat ``uint8`` tensor over the whole storage of ``t`` (no grad history, no copy).

    Pass ``storage`` when the caller already fetched ``t.untyped_storage()`` (hot path)."""
    if storage is None:
        storage = t.untyped_storage()
    if type(t) is _Tensor:  # ``bytes_on_storage``, spelled out for a plain tensor
        return t.new_empty(0, dtype=_uint8).set_(storage)
    return bytes_on_storage(storage, t)


def restore_view(flat: torch.Tensor, meta: ViewMeta) -> torch.Tensor:
    """The tensor described by ``meta``, viewing the storage of ``flat`` (a ``storage_bytes``)."""
    if type(flat) is _Tensor:  # ``tensor_on_storage``, spelled out for a plain tensor
        t = flat.new_empty(0, dtype=meta.dtype).set_(
            flat.untyped_storage(), meta.storage_offset, meta.size, meta.stride)
    else:
        t = tensor_on_storage(
            flat.untyped_storage(), meta.dtype, flat.device, meta.size, meta.stride,
            meta.storage_offset, like=flat,
        )
    return t if meta.bits_of is None else copy_view_bits(meta.bits_of, t)


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """A device-side checksum of a flat ``uint8`` storage (verify mode): its bytes summed as
    64-bit words where the size allows (wrapping is fine: only equality matters), else as bytes."""
    if flat.numel() % 8 == 0:
        return flat.view(torch.int64).sum()
    return flat.sum(dtype=torch.int64)


def check_version(alias: torch.Tensor, saved_version: int, size: torch.Size) -> None:
    """Raise autograd's error if the saved tensor was modified in place after saving.

    Autograd skips its version check for tensors packed by saved-tensor hooks, so both backends
    do it here. ``alias`` is a detached alias of the saved tensor (it shares the version
    counter); ``size`` is the saved shape, since the alias's memory may have been released.
    """
    current = alias._version
    if current != saved_version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{alias.type()} {list(size)}] is at version {current}; expected "
            f"version {saved_version} instead. Hint: the tensor was saved for backward inside a "
            "cpu_offload context and modified in place afterwards; clone it before modifying "
            "it, or exclude it with cpu_offload.mark_not_offload."
        )


class VersionWatch:
    """Detects an in-place change to a saved tensor, as autograd does for tensors it saves itself
    (it skips the check for tensors packed by saved-tensor hooks).

    Holds a detached alias, which shares the saved tensor's version counter. ``forget_storage``
    makes the alias let go of the memory while it keeps the counter, so a change made after the
    device copy was freed is still caught, even if the tensor itself is gone by then.
    """

    __slots__ = ("alias", "version", "size")

    def __init__(self, t: torch.Tensor) -> None:
        self.alias = t.detach()
        self.version = t._version
        self.size = t.shape

    def forget_storage(self) -> None:
        forget_storages([self])

    def check(self) -> None:
        if self.alias._version != self.version:  # the common case (unchanged) costs no call
            check_version(self.alias, self.version, self.size)


def forget_storages(watches: list) -> None:
    """``forget_storage`` for each watch, with one version-counter call for all of them."""
    forget_aliases([w.alias for w in watches])


def forget_aliases(aliases: list) -> None:
    """Make detached aliases let go of their memory while they keep their version counters
    (shared with the saved tensors), with one version-counter call for all of them."""
    versions = [a._version for a in aliases]
    for alias in aliases:
        alias.set_()  # a detached alias needs no grad mode switch; set_ counts as a change...
    set_versions(aliases, versions)  # ...which is undone at once


class KeptRef(VersionWatch):
    """A saved tensor that stays on the device, stored detached (its ``VersionWatch`` alias).

    Returning the tensor itself from a pack hook makes autograd keep a node alive through its own
    saved output (node -> saved variable -> tensor -> grad_fn -> node): an uncollectable cycle in
    C++. A detached alias shares storage and version counter but has no ``grad_fn``.
    """

    __slots__ = ()

    def unpack(self) -> torch.Tensor:
        self.check()
        return self.alias
