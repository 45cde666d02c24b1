"""Has anything changed since early work read it? One answer for gradients, parameters and
hyperparameters, so that work started before ``step()`` is kept only where it is still right.

Work that starts during backward (a gradient copied to the host, a CPU update) reads values that
user code may change before ``step()``: clipping, unscaling, ``p.grad.data /= world_size``, a
scheduler, ``group["lr"].fill_()``, a weight clamp after the last step. Three kinds of change are
possible, and each has its witness here:

- **A tensor's content** (``Fingerprint``): its identity, its ``_version``, and a sum of its
  raw bits (``bit_sum``) computed on its own device. The version sees every in-place change made through
  autograd-visible aliases; the sum also sees writes that bypass the version counter
  (``.data``, ``torch.amp`` unscaling kernels, numpy views, collectives writing into the buffer).
  A write that only permutes values through ``.data`` keeps the sum and is not seen; any other
  change keeps it only by a 2**-32 coincidence.
- **Hyperparameters** (``snapshot_hypers`` / ``same_hypers``): a copy of every group's entries
  taken when an update starts, tensors cloned, so that an update in flight never sees a later
  ``scheduler.step()`` and ``step()`` can tell an in-place ``fill_`` from no change.
- **A parameter edited after the optimizer wrote it** (``merge_edited``): the master keeps its
  extra precision wherever it still rounds to the parameter, and takes the parameter's value
  where the edit changed it.

The sums are computed as device kernels (no host synchronization); ``changed`` compares many
fingerprints with one transfer to the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..compat import is_dtensor
from ..core.errors import OffloadUsageError
from .cpu_update import IMPLEMENTATION_KEYS

__all__ = ["Fingerprint", "bit_sum", "bit_sums", "changed", "check_group_keys", "differs_from_rounded",
           "GradsLaidOutAsParams", "host_list", "map_tensors", "merge_edited", "same_hypers", "snapshot",
           "snapshot_hypers", "tensor_version"]


def tensor_version(t: torch.Tensor) -> int:
    """``t._version``; -1 where there is none (inference tensors: never counted unchanged)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def bit_sum(t: torch.Tensor) -> torch.Tensor:
    """A 1-d tensor of two float64 values on ``t``'s device that change when ``t``'s bits do:
    the sum of its raw bits as integer words, and the sum of its values.

    On the CPU the word sum is an exact (int64) sum of the bytes. On an accelerator it is taken modulo 2**32 in
    32-bit words: a sum into int64 would first convert the whole tensor (twice its bytes, at
    the peak of backward). A modular word sum misses one common edit, a power-of-two scaling of
    a tensor whose size has many factors of two (every word moves by the same amount); the
    value sum, accumulated in fp32 or wider without a copy, sees exactly that. Both are
    deterministic for the same tensor; equal bits give equal results.

    Example::

        >>> import torch
        >>> g = torch.ones(256)
        >>> before = bit_sum(g)
        >>> _ = g.data.mul_(2)                       # bypasses g._version's view of .data
        >>> bool((bit_sum(g) != before).any())
        True
    """
    return bit_sums([t])[0]


def bit_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``bit_sum`` of each of ``tensors`` (all on one device), as the rows of one ``(n, 2)``
    float64 tensor: the per-tensor sums are stacked and converted once for all, not one by one
    (step() fingerprints hundreds of tensors, and each small kernel adds host time to every
    step); an accelerator tensor made of aligned 32-bit words costs two reductions.

    Args:
        tensors: the tensors to fingerprint, all on one device.

    Returns:
        ``(len(tensors), 2)`` float64 on that device: row ``k`` is ``bit_sum(tensors[k])``.

    Example::

        >>> import torch
        >>> a, b = torch.ones(8), torch.arange(6, dtype=torch.bfloat16)
        >>> rows = bit_sums([a, b])
        >>> rows.shape, torch.equal(rows[1], bit_sum(b))
        (torch.Size([2, 2]), True)
    """
    if not tensors:
        return torch.empty((0, 2), dtype=torch.float64)
    # a gradient needs no detach (the value sum of a parameter would be recorded by autograd)
    sums = [_sums(t.detach() if t.requires_grad else t) for t in tensors]
    return torch.stack([torch.stack([w for w, _ in sums]).to(torch.float64),
                        torch.stack([v for _, v in sums]).to(torch.float64)], dim=1)


def _sums(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``d``'s word sum and value sum (see ``bit_sum``), 0-d tensors on its device."""
    words = word_sum(d, modular=d.device.type != "cpu")
    if d.is_floating_point() and d.numel():
        values = d.sum(dtype=torch.float32 if d.element_size() <= 4 else d.dtype)
    else:
        values = torch.zeros((), dtype=torch.float64, device=d.device)
    return words, values


def word_sum(d: torch.Tensor, modular: bool) -> torch.Tensor:
    """The sum of ``d``'s raw bits, a 0-d tensor on its device: exact (int64, of its bytes), or
    ``modular`` (int32, modulo 2**32, of its 32-bit words plus the bytes outside them: see
    ``bit_sum``). A contiguous tensor of whole aligned words, as tensors on an accelerator
    almost always are, takes one view and one reduction: the launch of each streamed chunk
    fingerprints a few of them on the host (``stream_backward``)."""
    nbytes = d.numel() * d.element_size()
    if not modular or nbytes < 4:
        return d.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)
    if d.is_contiguous() and nbytes % 4 == 0 and d.storage_offset() * d.element_size() % 4 == 0:
        return d.view(-1).view(torch.int32).sum(dtype=torch.int32)
    return _unaligned_word_sum(d)


def _unaligned_word_sum(d: torch.Tensor) -> torch.Tensor:
    """``word_sum(d, modular=True)`` of any tensor: its aligned 32-bit words, plus the bytes
    before the first and after the last."""
    raw = d.reshape(-1).view(torch.uint8)
    head = -raw.storage_offset() % 4
    body = max(0, raw.numel() - head) // 4 * 4
    parts = [raw[head: head + body].view(torch.int32).sum(dtype=torch.int32)] if body else []
    parts += [edge.sum(dtype=torch.int64) for edge in (raw[:head], raw[head + body:]) if edge.numel()]
    words = parts[0]
    for part in parts[1:]:
        words = words + part
    return words


def differs_from_rounded(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         group_bytes: int = 256 * 2**20) -> list[bool]:
    """Per ``(master, param)`` (same shape and device): whether ``param`` holds anything but
    ``master`` rounded to ``param``'s dtype, i.e. whether it was edited since the optimizer
    wrote it (a write through ``.data`` or a permutation too). One host synchronization for
    all pairs, and a few batched (``torch._foreach_*``) kernels per ``group_bytes`` of
    parameters, through one scratch buffer of at most that size: a kernel per parameter would
    cost every step hundreds of launches. ``NaN`` anywhere counts as an edit (the caller's merge
    keeps what still rounds alike).

    Args:
        pairs: ``(master, param)`` per parameter; the master in any dtype, rounded to the
            parameter's for the comparison.
        group_bytes: the most parameter bytes compared through one scratch buffer.

    Returns:
        Per pair, whether the parameter was edited.

    Example::

        >>> import torch
        >>> master = torch.tensor([1.001, 2.0, 3.0])
        >>> param = master.to(torch.bfloat16)          # what the optimizer wrote
        >>> differs_from_rounded([(master, param)])
        [False]
        >>> _ = param.data.clamp_(max=2.5)               # an edit the version counter misses
        >>> differs_from_rounded([(master, param)])
        [True]
    """
    out = [False] * len(pairs)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (_, p) in enumerate(pairs):
        if p.numel():
            groups.setdefault((p.device, p.dtype), []).append(i)
    maxima: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
    for (device, dtype), idx in groups.items():
        limit = max(1, group_bytes // pairs[idx[0]][1].element_size())
        start = 0
        while start < len(idx):
            stop, n = start + 1, pairs[idx[start]][1].numel()
            while stop < len(idx) and n + pairs[idx[stop]][1].numel() <= limit:
                n += pairs[idx[stop]][1].numel()
                stop += 1
            chunk = idx[start:stop]
            scratch = torch.empty(n, dtype=dtype, device=device)
            views, offset = [], 0
            for i in chunk:
                p = pairs[i][1]
                views.append(scratch[offset: offset + p.numel()].view(p.shape))
                offset += p.numel()
            torch._foreach_copy_(views, [pairs[i][0].detach() for i in chunk])  # the master, rounded
            torch._foreach_sub_(views, [pairs[i][1].detach() for i in chunk])  # 0 only where equal
            norms = torch._foreach_norm(views, float("inf"))
            maxima.setdefault(device, []).append((chunk, torch.stack(norms).float()))
            start = stop
    for found in maxima.values():
        values = host_list(torch.cat([m for _, m in found]))
        for i, v in zip((i for chunk, _ in found for i in chunk), values):
            out[i] = v != 0.0  # NaN too
    return out


def host_list(t: torch.Tensor) -> list:
    """``t.tolist()``, waiting for a CUDA tensor without spinning: ``tolist`` waits in a loop
    that keeps a core busy (CUDA's default for a process with fewer GPUs than cores), and
    ``step()``'s checks wait here until backward's end, while the CPU update runs on every
    other core: one core less for its thread team slows it all (the team waits for its
    slowest thread). A blocking event lets the core go.

    Args:
        t: the tensor to read, on any device (a CPU tensor is read at once).

    Returns:
        ``t.tolist()``.

    Example::

        >>> import torch
        >>> host_list(torch.tensor([1.5, 2.0]) > 1.75)
        [False, True]
    """
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
    return host.tolist()


@dataclass
class Fingerprint:
    """What a tensor was when early work read it: the tensor, its version, its bit sum.

    ``bits`` may be left ``None`` (``pending``) and taken later in one batch for many tensors
    (``take_bits``): a backward hook then records only the tensor and its version, and the
    sums run where the work that reads the tensor is queued. Until then, ``changed`` judges the
    fingerprint by object and version alone."""

    tensor: torch.Tensor
    version: int
    bits: Optional[torch.Tensor]

    @classmethod
    def of(cls, t: torch.Tensor) -> "Fingerprint":
        return cls(t, tensor_version(t), bit_sum(t))

    @classmethod
    def pending(cls, t: torch.Tensor) -> "Fingerprint":
        """The tensor and its version now; its bit sum later (``take_bits``)."""
        return cls(t, tensor_version(t), None)

    @staticmethod
    def take_bits(prints: Sequence["Fingerprint"]) -> Optional[torch.Tensor]:
        """Take the bit sums of those of ``prints`` still pending (their tensors all on one
        device), in one batch, on the current stream: the content they fingerprint is the one
        work queued after this on that stream reads, or that work queued on another stream
        after an event recorded after this reads, once nothing changes it in between (and any
        change after this shows at ``changed``, on a stream ordered after this one). Returns
        the tensor the sums are rows of (None if none was pending)."""
        todo = list({id(fp): fp for fp in prints if fp.bits is None}.values())
        if not todo:
            return None
        sums = bit_sums([fp.tensor for fp in todo])
        for fp, row in zip(todo, sums.unbind(0)):
            fp.bits = row
        return sums

    @classmethod
    def of_all(cls, tensors: Sequence[torch.Tensor]) -> list["Fingerprint"]:
        """Fingerprints of ``tensors`` (all on one device) whose sums share one allocation: the
        fingerprints an optimizer keeps between steps cost one small block per call, not one
        per tensor."""
        if not tensors:
            return []
        sums = bit_sums(tensors)
        return [cls(t, tensor_version(t), row) for t, row in zip(tensors, sums.unbind(0))]

    def same_object(self, now: Optional[torch.Tensor]) -> bool:
        """``now`` is the very tensor read, at the same version (content still to compare)."""
        return now is self.tensor and 0 <= self.version == tensor_version(now)


def changed(pairs: Sequence[tuple[Fingerprint, Optional[torch.Tensor]]]) -> list[bool]:
    """Per ``(fingerprint, tensor now)``: whether the tensor differs from what was read. Object
    and version first (no device work); the bit sums of the rest with one host transfer. A
    fingerprint whose bits are still pending (no work read its tensor) is judged by object and
    version alone."""
    out = [not fp.same_object(now) for fp, now in pairs]
    todo = [i for i, c in enumerate(out) if not c and pairs[i][0].bits is not None]
    if not todo:
        return out
    by_device: dict[torch.device, list[int]] = {}
    for i in todo:
        by_device.setdefault(pairs[i][0].bits.device, []).append(i)
    for idx in by_device.values():
        before = torch.stack([pairs[i][0].bits for i in idx])
        now = bit_sums([pairs[i][1] for i in idx])
        for i, diff in zip(idx, host_list((before != now).any(dim=1))):
            out[i] = bool(diff)
    return out


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with ``fn(t)`` for every tensor ``t`` in it, also inside tuples and lists (a
    hyperparameter such as ``betas``)."""
    if torch.is_tensor(value):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    return value


def snapshot(value: Any) -> Any:
    """``value`` with every tensor in it (also inside tuples and lists) replaced by a copy."""
    return map_tensors(value, lambda t: t.detach().clone())


def snapshot_hypers(param_groups: Sequence[dict]) -> list[dict]:
    """Every group's entries but ``params``, tensors cloned (detached, also inside tuples such
    as ``betas``): what an update uses, untouched by later changes to the user's groups, and
    what chunk optimizers are built with (they never hold the caller's tensors)."""
    return [{k: snapshot(v) for k, v in g.items() if k != "params"} for g in param_groups]


def _same(x: Any, y: Any) -> bool:
    """Equal values; tensors (also inside tuples and lists: ``betas`` of 0-dim tensors, which
    the user may ``fill_`` in place) by value, never by identity."""
    if torch.is_tensor(x) or torch.is_tensor(y):
        return (torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape
                and x.dtype == y.dtype and x.device == y.device and bool(torch.equal(x, y)))
    if isinstance(x, (tuple, list)) or isinstance(y, (tuple, list)):
        return (type(x) is type(y) and len(x) == len(y)
                and all(_same(a, b) for a, b in zip(x, y)))
    if x is y:
        return True
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - incomparable values count as changed
        return False


def same_hypers(a: Sequence[dict], b: Sequence[dict]) -> bool:
    """Two ``snapshot_hypers`` (or live groups) hold the same values (tensors by value)."""
    return len(a) == len(b) and all(
        ga.keys() - {"params"} == gb.keys() - {"params"}
        and all(_same(ga[k], gb[k]) for k in ga if k != "params") for ga, gb in zip(a, b))


def check_group_keys(param_groups: Sequence[dict], defaults: dict,
                     only: Optional[Iterable[int]] = None) -> None:
    """Every group still has the optimizer's keys, and no implementation key: the parts copy
    only the keys a group has (a deleted one would keep its old value, where torch's classes
    raise ``KeyError``), and their classes keep the implementation (``fused``, ``foreach``...)
    they were built with (the groups never hold those keys; ``state_dict`` adds them)."""
    for gi in range(len(param_groups)) if only is None else only:
        g = param_groups[gi]
        missing = sorted(k for k in defaults if k not in g)
        if missing:
            raise OffloadUsageError(
                f"param group {gi} lacks {missing} (deleted from opt.param_groups?): the parts "
                "would keep the old values, and torch's optimizers raise KeyError; set them again")
        if IMPLEMENTATION_KEYS & g.keys():
            raise OffloadUsageError(
                f"param group {gi} sets {sorted(IMPLEMENTATION_KEYS & g.keys())}: the parts' classes "
                "keep the implementation they were built with; delete the key, or build a new "
                "HybridDeviceOptimizer with it (e.g. fused=False)")


def _dense_strides(t: torch.Tensor) -> bool:
    """``t``'s elements fill its memory without gaps or overlaps, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(x == y for x, y, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


class GradsLaidOutAsParams:
    """Each dense gradient whose layout differs from its (dense) parameter's (a user's ``p.grad
    = t.t()``, a slice of a bigger buffer, an ``expand``) replaced by a copy laid out as the
    parameter, as autograd lays out the gradients it makes, until ``restore()`` puts the user's
    tensors back (they may be views of a buffer the user zeroes and accumulates into). Fused
    kernels pair parameter and gradient elements in memory order, so on such a gradient torch's
    fused classes step on scrambled values, while the CPU part copies gradients by value: which
    parameters it takes would decide the result. The copy is a new tensor: work started in
    backward from the user's is redone; the parts keep what they still read."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.swapped = []
        for p in params:
            g = p.grad
            if g is None or g.layout != torch.strided or g.stride() == p.stride():  # the rule
                continue
            if (p.numel() and not is_dtensor(p)
                    and not _same_layout(g, p) and _dense_strides(p)):
                self.swapped.append((p, g))
                p.grad = torch.empty_strided(p.shape, p.stride(), dtype=g.dtype, device=g.device).copy_(g)

    def restore(self) -> None:
        for p, g in self.swapped:
            p.grad = g
        self.swapped = []


def merge_edited(master: torch.Tensor, param: torch.Tensor) -> None:
    """Take an edited parameter's values into its master (in place, on the master's device):
    where the master still rounds to the parameter it is kept (its extra precision with it),
    elsewhere it becomes the parameter's value. For a master of the parameter's own dtype this
    is a plain copy. No change where nothing was edited, so it may run on every parameter
    instead of keeping a record of what the optimizer wrote: the streamed part does (its chunk
    update applies this rule batched, without allocating: ``stream_chunk.merge_edits``).

    Example::

        >>> import torch
        >>> master = torch.tensor([1.001, 2.0, 3.0])
        >>> merge_edited(master, torch.tensor([1.0, 2.0, 0.5], dtype=torch.bfloat16))
        >>> master
        tensor([1.0010, 2.0000, 0.5000])
    """
    value = param.detach().to(master.device)
    if value.dtype == master.dtype:
        master.copy_(value)
        return
    torch.where(master.to(value.dtype) == value, master, value.to(master.dtype), out=master)


def check_layout(param: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> None:
    """``param`` still has the ``shape`` and ``dtype`` the optimizer placed it with, contiguous:
    ``p.data = t`` with another shape or dtype would leave masters, state and staging made for
    the old one (copies of the wrong size, or torch's fused kernels over mismatched state), and
    non-contiguous data would be copied through a flat temporary and the update lost."""
    if param.shape != shape or param.dtype != dtype:
        raise OffloadUsageError(
            f"parameter {tuple(shape)} ({dtype}) was given data of shape {tuple(param.shape)} "
            f"({param.dtype}) after the optimizer placed it (p.data = ..., or model.to(dtype)): "
            "its optimizer state was made for the old shape and dtype; build a new "
            "HybridDeviceOptimizer after changing the model (or copy values in: p.data.copy_(t))")
    if not param.is_contiguous():
        raise OffloadUsageError(
            f"parameter {tuple(shape)} was given non-contiguous data (p.data = ...): offloaded "
            "parameters are copied as flat bytes and must stay contiguous; assign t.contiguous()")
