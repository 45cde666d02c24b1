"""DistributedDataParallel: the communication hook that hands DDP's reduced gradient buckets to
``HybridDeviceOptimizer`` (``HybridDeviceOptimizer.ddp_comm_hook``).

Under DDP a post-accumulate-grad hook sees the local, unreduced gradient; the offloaded part must
copy the reduced one, which exists only inside DDP's communication hook.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..compat import queue_backward_callback

__all__ = ["after_ddp_writes_grads", "comm_hook"]


def comm_hook(
    on_reduced: Callable[[Sequence[torch.Tensor], torch.Tensor], None],
    inner: Optional[Callable] = None,
    on_start: Optional[Callable[[], None]] = None,
) -> tuple[Any, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``:
    ``inner`` (default: DDP's ``allreduce_hook`` on the default group) reduces each bucket,
    then ``on_reduced(params, flat)`` gets the bucket's parameters and its reduced flat
    gradient. ``on_start()``, if given, runs as each bucket is handed to DDP (before it is
    reduced)."""
    # torch.distributed is optional (torch builds without it exist): imported only under DDP.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = inner or default_hooks.allreduce_hook

    def hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        if on_start is not None:
            on_start()

        def then(fut: Any) -> torch.Tensor:
            reduced = fut.value()
            reduced = reduced[0] if isinstance(reduced, (list, tuple)) else reduced
            on_reduced(bucket.parameters(), reduced)
            return reduced

        return inner(state, bucket).then(then)

    return None, hook


def after_ddp_writes_grads(callback: Callable[[], None]) -> None:
    """(Backward's thread, inside a bucket's hook.) Run ``callback`` once DDP's own
    end-of-backward callback has written the reduced gradients into ``.grad``: DDP queues it
    after the last bucket's hook, so a callback queued now runs before it, and one that
    callback queues runs after it. Outside a backward nothing is queued (``step()`` then finds
    nothing recorded and copies again)."""
    try:
        queue_backward_callback(lambda: queue_backward_callback(callback))
    except RuntimeError:  # not inside a backward
        pass
