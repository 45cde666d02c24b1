"""Unpack order is not pack order reversed: torch documents (pytorch issue 198014) that the order
in which backward unpacks saved tensors is unspecified. Both backends, with reloads: a custom
``autograd.Function`` that unpacks its saved tensors in the order they were packed, and one that
unpacks only some of the tensors packed in its layer (none of its own), next to each other in
offloaded layers. Gradients stay bit-identical, each step leaves nothing behind, and the next step
is as exact, so nothing in either backend assumes last-in first-out.
"""
from __future__ import annotations

import gc

import pytest
import torch

import cpu_offload
from cpu_offload.compat import saved_tensors_hooks

from _support.parity_models import EXPECTED_WARNINGS, TrackingSimDevice, run_layers

pytestmark = EXPECTED_WARNINGS

N_LAYERS, OFFLOADED = 4, 2


class PackOrder(torch.autograd.Function):
    """``sin(x) * cos(x) + x * x``: saves ``(sin x, cos x, x)``; its backward unpacks all three in
    that order, the order torch packed them (``save_for_backward`` packs its arguments in order,
    and ``ctx.saved_tensors`` unpacks them in the same order)."""

    @staticmethod
    def forward(ctx, x):
        a, b = torch.sin(x), torch.cos(x)
        cpu_offload.mark_activation_offload(a, b, x)  # what V1 offloads; V2 finds them itself
        ctx.save_for_backward(a, b, x)
        return a * b + x * x

    @staticmethod
    def backward(ctx, grad):
        a, b, x = ctx.saved_tensors
        return grad * (b * b - a * a + 2 * x)


class StraightThrough(torch.autograd.Function):
    """A straight-through rounding (as quantization-aware training does): saves its input and
    output for clipping, and with ``clip=False`` its backward unpacks neither: of what its layer
    packs, only a subset is ever unpacked."""

    @staticmethod
    def forward(ctx, x, clip):
        q = torch.round(x * 8) / 8
        cpu_offload.mark_activation_offload(x, q)
        ctx.clip = clip
        ctx.save_for_backward(x, q)
        return q

    @staticmethod
    def backward(ctx, grad):
        if not ctx.clip:
            return grad, None
        x, _ = ctx.saved_tensors
        return grad * (x.abs() <= 1), None


class Layer(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = PackOrder.apply(self.fc(x))
        return x + StraightThrough.apply(h, False) + h


def make_layers(dim: int = 64):
    torch.manual_seed(0)
    return torch.nn.ModuleList(Layer(dim) for _ in range(N_LAYERS))


def step(layers, x0, ctx=None, sync=None):
    layers.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    # x * 1.0: the first layer's input is an activation too, not the caller's tensor
    run_layers(layers, x * 1.0, ctx, sync).square().sum().backward()
    return [x.grad] + [p.grad for p in layers.parameters()]


def test_pack_order_premise():
    """What the tests below rely on: ``PackOrder``'s tensors come back in pack order, and
    ``StraightThrough``'s are packed but never unpacked."""
    packed, unpacked = [], []

    def pack(t):
        packed.append(t)
        return len(packed) - 1

    def unpack(i):
        unpacked.append(i)
        return packed[i]

    x = torch.randn(8, requires_grad=True)
    with saved_tensors_hooks(pack, unpack):
        y = PackOrder.apply(x)
    y.sum().backward()
    assert unpacked == [0, 1, 2]
    packed.clear(), unpacked.clear()
    with saved_tensors_hooks(pack, unpack):
        y = StraightThrough.apply(x * 1.0, False)
    y.sum().backward()
    assert len(packed) == 2 and unpacked == []


def test_pack_order_and_subset_unpacks_are_exact_with_reloads(backend):
    x0 = torch.randn(32, 64)
    layers = make_layers()
    expected = step(layers, x0)
    sim = TrackingSimDevice()
    ctx, sync = cpu_offload.get_cpu_offload_context(
        enabled=True, num_layers=OFFLOADED, model_layers=N_LAYERS, device=sim,
        **({} if backend == "v1" else {"min_tensor_size_to_offload": 1}))
    gc.disable()
    try:
        for _ in range(3):  # the next step is as exact: nothing left from the unpacked subset
            got = step(layers, x0, ctx, sync)
            assert all(map(torch.equal, got, expected))
            del got
            assert sim.live_device_buffers() == 0
    finally:
        gc.enable()
    reloaded = [e for e in sim.log if e[0] == "copy" and e[3] == "h2d"]
    offloaded = [e for e in sim.log if e[0] == "copy" and e[3] == "d2h"]
    assert offloaded and reloaded, "the offloaded layers must be reloaded for backward"
    if backend == "v2":  # each offloaded layer released in forward and reloaded in backward
        assert sim.milestones({"release", "reload"}) == [
            ("release", 0), ("release", 1), ("reload", 1), ("reload", 0)] * 3
