"""Decoder-style layers for ``apply_offloading`` and the planner's tests: keyword arguments in,
any output container out, and the training step that calls them."""
from __future__ import annotations

import collections

import torch
from torch import nn

from cpu_offload.tools.layers import hidden_state

Pair = collections.namedtuple("Pair", "hidden aux")


class KwargLayer(nn.Module):
    """A decoder-style layer: keyword arguments in, a configurable output container out."""

    def __init__(self, width: int, out: str = "tensor") -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.out = out

    def forward(self, x, *, scale=None, mask=None):
        h = torch.tanh(self.lin(x)) * scale + x
        if mask is not None:
            h = h * mask
        aux = h.sum()
        return {
            "tensor": lambda: h,
            "tuple": lambda: (h, aux),
            "list": lambda: [h, aux],
            "namedtuple": lambda: Pair(h, aux),
            "dict": lambda: {"aux": aux, "hidden_states": h},
            "tuple_first_none": lambda: (None, h),
        }[self.out]()


def make_layers(out: str = "tensor", n: int = 4, width: int = 32) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(KwargLayer(width, out) for _ in range(n))


def step(layers, x0):
    """A training step of a model that calls its layers with keyword arguments."""
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    scale = torch.full((x0.shape[-1],), 0.5)
    mask = torch.ones(x0.shape[:-1] + (1,))
    h = x
    for layer in layers:
        out = layer(h, scale=scale, mask=mask)
        h, _ = hidden_state(out)
    h.square().sum().backward()
    return [h.detach(), x.grad] + [p.grad.clone() for p in layers.parameters()]


def assert_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
