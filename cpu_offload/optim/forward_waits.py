"""The forward pre-hooks of ``overlap="next_forward"``: each module waits, before its forward,
for its own offloaded parameters from the last ``step()``, no others, so that the next forward
overlaps the rest of the update (``HybridDeviceOptimizer.register_forward_waits``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..compat import compiler_disable
from .sharded import fsdp_roots


@dataclass
class ForwardWaits:
    """The hooks one ``register_forward_waits`` call made, and the parameters they cover (ids of
    what the optimizer updates: a DTensor's local shard, else the parameter)."""

    handles: list[Any] = field(default_factory=list)
    covered: set[int] = field(default_factory=set)

    def remove(self) -> None:
        """Unregister the hooks: the parameters are no longer covered (``step()`` in
        ``next_forward`` then refuses, naming ``register_forward_waits``)."""
        for h in self.handles:
            h.remove()
        self.handles, self.covered = [], set()


def register(model: nn.Module, key: Callable[[torch.Tensor], torch.Tensor],
             cpu_bucket: Callable[[torch.Tensor], Optional[int]],
             streamed_at: Callable[[torch.Tensor], Optional[tuple[int, int]]],
             wait_cpu: Callable[[Sequence[int]], None],
             wait_streamed: Callable[[Sequence[tuple[int, list[int]]]], None],
             wait_all: Callable[[], None]) -> ForwardWaits:
    """Hooks on ``model``'s modules: a module owning CPU-updated parameters (``cpu_bucket``: the
    bucket of ``key(p)``, or ``None``) waits for those buckets, one owning streamed ones
    (``streamed_at``: ``(part position, index in the part)``, or ``None``) for their chunks. An
    FSDP2 root waits for everything (``wait_all``) before its pre-forward: FSDP2 orders its
    all-gathers after the compute stream there only. The waits run eagerly also inside a
    ``torch.compile``'d model: the compiled graph breaks at each instead of tracing into them
    (they read Python state that a graph cannot replay, and how far a trace got depended on
    what was in flight, so graphs, and their rounding, differed by overlap mode)."""
    wait_cpu, wait_streamed, wait_all = map(compiler_disable, (wait_cpu, wait_streamed, wait_all))
    out = ForwardWaits()
    under_fsdp: set[int] = set()  # ids of the parameters a root's hook covers
    for root in fsdp_roots(model):
        out.handles.append(root.register_forward_pre_hook(lambda m, a: wait_all(), prepend=True))
        under_fsdp.update(id(p) for p in root.parameters())
        out.covered.update(id(key(p)) for p in root.parameters())
    for module in model.modules():
        buckets: set[int] = set()
        streamed: dict[int, list[int]] = {}  # part position -> parameter indices in it
        for p in module.parameters(recurse=False):
            if id(p) in under_fsdp:
                continue
            updated = key(p)
            bucket, at = cpu_bucket(updated), streamed_at(updated)
            if bucket is not None:
                buckets.add(bucket)
            if at is not None:
                streamed.setdefault(at[0], []).append(at[1])
            if bucket is not None or at is not None:
                out.covered.add(id(updated))
        if buckets:
            out.handles.append(module.register_forward_pre_hook(
                lambda m, a, b=sorted(buckets): wait_cpu(b)))
        if streamed:
            marks = sorted(streamed.items())
            out.handles.append(module.register_forward_pre_hook(lambda m, a, s=marks: wait_streamed(s)))
    return out
