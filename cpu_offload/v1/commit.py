"""``GroupCommitFunction``: the identity op on each layer's output that closes a group in forward
and, when its backward runs, tells the handler that the group's backward is about to start."""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from ..compat import in_backward
from ..core.errors import check_sync_argument


class GroupCommitFunction(torch.autograd.Function):
    """Identity; forward calls ``handler.on_group_commit_forward()``, backward
    ``handler.on_group_commit_backward()``.

    The ctx keeps the handler's step token, so the backward of a retained graph run a second time,
    or of a graph from an earlier step, does not move the current step's schedule. The ctx holds
    only the handler, which holds no graph objects: no reference cycle.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cpu_offload_handler: Any) -> torch.Tensor:
        cpu_offload_handler.on_group_commit_forward()
        ctx.cpu_offload_handler = cpu_offload_handler
        token = getattr(cpu_offload_handler, "group_commit_token", None)
        ctx.commit_token = token() if token is not None else None
        return tensor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, Optional[Any]]:
        handler = ctx.cpu_offload_handler
        accept = getattr(handler, "accept_group_commit_backward", None)
        if accept is None or accept(ctx.commit_token):
            handler.on_group_commit_backward()
        return grad_output, None


def group_prefetch_offload_commit(tensor: torch.Tensor, cpu_offload_handler: Any) -> torch.Tensor:
    """Commit the current group. Outside grad mode (or for a tensor that needs no grad) no backward
    will ever come for it, so the schedule is left alone and the tensor returned as is."""
    check_sync_argument(tensor)
    if in_backward():
        return tensor  # recomputation (activation checkpointing): the layer was counted in forward
    if not (torch.is_grad_enabled() and tensor.requires_grad):
        skipped = getattr(cpu_offload_handler, "on_group_commit_skipped", None)
        if skipped is not None:
            skipped()
        return tensor
    note = getattr(cpu_offload_handler, "note_group_output", None)
    if note is not None:
        note(tensor)
    return GroupCommitFunction.apply(tensor, cpu_offload_handler)
