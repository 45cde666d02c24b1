"""A residual MLP block, ``x + Linear(f, h)(gelu(Linear(h, f)(x)))``: the host-memory
benchmark's workload (``benchmarks/host_memory.py``) and its tests. It saves storages of two
sizes per layer (the hidden state and the wide activations), which is what shows how a pinned
allocator rounds them."""
from __future__ import annotations

import torch
from torch import nn


class ResidualMlp(nn.Module):
    """``x + Linear(ffn, hidden)(gelu(Linear(hidden, ffn)(x)))``.

    Example::

        >>> import torch
        >>> from cpu_offload.examples.mlp import ResidualMlp
        >>> ResidualMlp(8, 32)(torch.zeros(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))
