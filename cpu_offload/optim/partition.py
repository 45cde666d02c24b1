"""Which parameters the CPU updates, and in which groups (pure logic, no device work).

The CPU part should be the parameters whose gradients are final *earliest* in backward: their
copies and CPU update then overlap the rest of backward. In a layer stack that is the last layers,
i.e. the parameters registered last, so the default arrival order is the reverse of the parameter
order. ``grad_arrival_order`` measures the real order from one backward when a model differs.

Megatron-core and DeepSpeed offload the *first* parameters (embeddings, first layers), whose
gradients arrive last: nothing is left to overlap with.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable, Sequence

import torch

from ..core.errors import OffloadConfigError

DEFAULT_BUCKET_BYTES = 64 * 2**20  # model-dtype bytes per CPU update unit (one layer-ish)


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float in [0, 1], or an ``OffloadConfigError`` naming the fix."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise OffloadConfigError(
            f"offload_fraction must be a number in [0, 1], got {fraction!r}"
        )
    if math.isnan(float(fraction)) or not (0.0 <= float(fraction) <= 1.0):
        raise OffloadConfigError(
            f"offload_fraction={fraction} is outside [0, 1]: it is the share of parameter bytes "
            "updated on the CPU; use 0 (all on the GPU) to 1 (all on the CPU)"
        )
    return float(fraction)


def check_listed_once(entries: Sequence[tuple[int, torch.Tensor]]) -> None:
    """Each parameter appears once in ``(group index, parameter)`` ``entries``: torch's
    optimizers step a parameter listed twice twice per step (and warn that this will be an
    error); here the placement is keyed by the parameter, so the two would collide."""
    seen: set[int] = set()
    for gi, p in entries:
        if id(p) in seen:
            raise OffloadConfigError(
                f"parameter {tuple(p.shape)} is listed twice in param group {gi}: torch's "
                "optimizers step such a parameter twice per step (and warn that this will be an "
                "error); list each parameter once (model.parameters() does, tied weights included)")
        seen.add(id(p))


def check_offloadable(params: Sequence[torch.Tensor], chosen: Sequence[int]) -> None:
    """The parameters ``chosen`` for offloading are contiguous: their bytes are copied flat.
    Parameters kept on the device are not (the device part is the wrapped class over them)."""
    for i in chosen:
        if not params[i].is_contiguous():
            raise OffloadConfigError(
                f"parameter {i} ({tuple(params[i].shape)}) is not contiguous and falls in the "
                "offloaded share (offloaded bytes are copied flat): convert the model to the "
                "contiguous memory format (model.to(memory_format=torch.contiguous_format)) "
                "before building the optimizer, or lower offload_fraction")


def choose_offloaded(sizes: Sequence[int], arrival: Sequence[int], fraction: float) -> list[int]:
    """Indices (into ``sizes``) that go to the CPU: a prefix of ``arrival`` holding ``fraction``
    of the total bytes.

    ``arrival`` lists every index once, earliest gradient first. A parameter is taken while at
    least half of it fits under the target, so 0 takes nothing, 1 takes everything, and the
    offloaded bytes are within half a parameter of ``fraction * total``. Returned in arrival order.
    """
    fraction = check_fraction(fraction)
    if sorted(arrival) != list(range(len(sizes))):
        raise ValueError("arrival must list every parameter index exactly once")
    target = fraction * sum(sizes)
    chosen: list[int] = []
    taken = 0
    for i in arrival:
        if fraction >= 1.0 or taken + sizes[i] / 2 < target:
            chosen.append(i)
            taken += sizes[i]
        else:
            break
    return chosen


def make_buckets(order: Sequence[int], sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Split ``order`` into consecutive buckets of about ``bucket_bytes`` (a parameter is never
    split; one larger than ``bucket_bytes`` gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise OffloadConfigError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in order:
        if current and filled + sizes[i] > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
    if current:
        buckets.append(current)
    return buckets


def next_update(ready: Sequence[int], landed: Callable[[int], bool]) -> int:
    """Which of the ``ready`` buckets (queued for their CPU update) to update next, as a
    position in ``ready``.

    Buckets are numbered in gradient-arrival order (last layers first); the next forward needs
    them in reverse (first layers first). Of the buckets whose gradients have ``landed``, take
    the one the next forward needs first; if none has landed, the one that lands first (the
    lowest number: copies land in order). So the buckets still waiting when backward ends are
    updated first-layer-first and the next forward can start while the CPU works on later
    layers; in arrival order the first layers' buckets, whose gradients arrive last, would be
    updated last and the forward would wait for every update. Buckets are independent: the
    order changes no number.
    """
    done = [i for i, b in enumerate(ready) if landed(b)]
    pick = max if done else min
    return pick(done or range(len(ready)), key=lambda i: ready[i])


def default_arrival(n: int) -> list[int]:
    """Reverse registration order: the last registered parameters get their gradients first."""
    return list(range(n - 1, -1, -1))


def arrival_from_order(params: Sequence[torch.Tensor], measured: Iterable[torch.Tensor]) -> list[int]:
    """``measured`` (tensors in gradient-arrival order) as indices into ``params``; parameters it
    does not mention (no gradient in that backward) follow, last registered first."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: list[int] = []
    for t in measured:
        i = index.get(id(t))
        if i is not None and i not in seen:
            seen.append(i)
    rest = [i for i in default_arrival(len(params)) if i not in set(seen)]
    return seen + rest


def grad_arrival_order(
    params: Iterable[torch.Tensor], run_backward: Callable[[], object]
) -> list[torch.Tensor]:
    """Run ``run_backward()`` once and return ``params`` in the order their gradients became final.

    ``HybridDeviceOptimizer`` offloads the parameters whose gradients arrive first, so their
    CPU updates overlap the rest of backward. By default it assumes the reverse of registration
    order (the last layers' gradients arrive first). When the parameter order does not follow
    the layer order, measure the real order with this and pass it as ``grad_order=``.

    Args:
        params: the parameters (those without ``requires_grad`` are dropped).
        run_backward: runs one forward and backward of the model.

    Returns:
        The parameters that received a gradient, in arrival order. Gradients are left as the
        backward produced them (zero them before training).

    Example::

        >>> import torch
        >>> from cpu_offload.optim import grad_arrival_order
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> order = grad_arrival_order(
        ...     model.parameters(), lambda: model(torch.randn(2, 4)).sum().backward())
        >>> [name for p in order for name, q in model.named_parameters() if q is p]
        ['1.bias', '1.weight', '0.bias', '0.weight']
    """
    params = [p for p in params if p.requires_grad]
    order: list[torch.Tensor] = []
    handles = [p.register_post_accumulate_grad_hook(order.append) for p in params]
    try:
        run_backward()
    finally:
        for h in handles:
            h.remove()
    return order
