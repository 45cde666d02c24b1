"""The GPT stack on CUDA for V2's ``gpu``-marked tests: a size where activations dominate
(``CFG``), one training step, and a bit-for-bit comparison. The model and input are the module-
scoped fixtures ``gpt_model`` and ``gpt_x0`` of ``tests/conftest.py``."""
from __future__ import annotations

import torch

from cpu_offload.examples.gpt import GPTConfig

CFG = GPTConfig(hidden=1024, heads=8, seq=1024, batch=2, layers=6, dtype=torch.bfloat16)


def step(model, x0, ctx=None, sync=None):
    for p in model.parameters():
        p.grad = None
    x = x0.clone().requires_grad_()
    out = model(x, ctx, sync)
    out.float().square().mean().backward()
    return out.detach(), x.grad, [p.grad for p in model.parameters()]


def assert_bit_identical(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for ga, gb in zip(a[2], b[2]):
        assert torch.equal(ga, gb)
