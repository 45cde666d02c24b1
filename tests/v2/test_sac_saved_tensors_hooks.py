"""torch >= 2.15: ``checkpoint(..., respect_saved_tensors_hooks=)`` decides whether the tensors
selective activation checkpointing (SAC) caches go through the saved-tensor hooks around the
checkpoint, the offload engine's included. Left at ``None`` it warns (``FutureWarning``) and is to
become an error, then ``True``. The package chooses ``False`` (Note [SAC-cached tensors and the
offload hooks], ``cpu_offload/v2/policies.py``); these tests run both values and show why:
both are exact and free what they move, but only ``False`` keeps ``MUST_SAVE`` on the device as
documented, and ``True`` would make the engine take each ``MUST_CPU_OFFLOAD`` output twice."""
from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import cpu_offload
import cpu_offload.v2.context as v2_context
import cpu_offload.v2.policies as policies
from cpu_offload.compat import (
    CHECKPOINT_HAS_SAC_HOOKS_ARG, TorchDispatchMode, cpu_offload_policies, in_backward,
)
from cpu_offload.tools import layers as layer_seam

from _support.parity_models import TrackingSimDevice

pytestmark = pytest.mark.skipif(
    not (CHECKPOINT_HAS_SAC_HOOKS_ARG and cpu_offload_policies()),
    reason="torch < 2.15: checkpoint has no respect_saved_tensors_hooks")

MM = torch.ops.aten.mm.default
DIM, ROWS = 32, 64
INPUT_BYTES = ROWS * DIM * 4
MM_BYTES = ROWS * 4 * DIM * 4 + ROWS * DIM * 4  # x @ w1 and gelu(...) @ w2


def policy_for(answer: str):
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        return getattr(CheckpointPolicy, answer) if op is MM else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class Block(torch.nn.Module):
    """mm -> gelu -> mm under a non-reentrant checkpoint with ``context_fn`` and, unless
    ``respect`` is ``"omit"``, ``respect_saved_tensors_hooks=respect``."""

    def __init__(self, context_fn, respect) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(DIM, 4 * DIM) / DIM ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(4 * DIM, DIM) / DIM ** 0.5)
        self.context_fn, self.respect = context_fn, respect

    def body(self, x):
        return x + torch.nn.functional.gelu(x @ self.w1) @ self.w2

    def forward(self, x):
        kw = {} if self.respect == "omit" else {"respect_saved_tensors_hooks": self.respect}
        return checkpoint(self.body, x, use_reentrant=False, context_fn=self.context_fn, **kw)


def stack(make_contexts, answer: str, respect="omit", n: int = 4):
    torch.manual_seed(0)
    context_fn = functools.partial(make_contexts, policy_for(answer))
    return torch.nn.ModuleList(Block(context_fn, respect) for _ in range(n))


class MMOutputs(TorchDispatchMode):
    """Weak references to every mm output of the forward (what SAC caches under MUST_SAVE)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is MM and not in_backward():
            self.refs.append(weakref.ref(out))
        return out


def step(layers, x0, watch=None):
    x = x0.clone().requires_grad_()
    h = x
    with watch if watch is not None else contextlib.nullcontext():
        for layer in layers:
            h = layer(h)
    h.square().sum().backward()
    return [x.grad] + [p.grad.clone() for p in layers.parameters()]


def offloaded_step(layers, x0, device, watch=None):
    handle = cpu_offload.apply_offloading(
        layers, num_layers=2, min_tensor_size_to_offload=1, device=device)
    try:
        got = step(layers, x0, watch)
        return got, handle.stats().to_dict()
    finally:
        handle.remove()


@pytest.mark.parametrize("respect", [False, True])
def test_both_values_are_exact_and_free_what_they_move(respect):
    """torch's own SAC contexts, ``MUST_SAVE`` on the mms, inside offloaded layers: with either
    value the gradients are bit-identical and, with the cycle collector off, every mm output
    and every device buffer is gone after the step. What differs is where ``MUST_SAVE``
    outputs live: on the device (``False``) or moved by the engine (``True``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_contexts

    x0 = torch.randn(ROWS, DIM)
    expected = step(stack(torch_contexts, "MUST_SAVE", respect), x0)
    sim, watch = TrackingSimDevice(), MMOutputs()
    gc.disable()
    try:
        got, stats = offloaded_step(stack(torch_contexts, "MUST_SAVE", respect), x0, sim, watch)
        assert all(map(torch.equal, got, expected))
        assert watch.refs and all(r() is None for r in watch.refs)
        assert sim.live_device_buffers() == 0
    finally:
        gc.enable()
    layer1 = stats["layers"][1]
    moved = INPUT_BYTES + (MM_BYTES if respect else 0)
    assert layer1["copied_out_bytes"] == layer1["freed_bytes"] == moved


@pytest.mark.parametrize("respect", ["omit", False, True])
def test_our_contexts_keep_must_save_on_the_device_whatever_checkpoint_is_passed(respect):
    """``cpu_offload.create_selective_checkpoint_contexts`` inside offloaded layers: the
    documented table (``MUST_SAVE`` kept on the device, ``MUST_CPU_OFFLOAD`` moved) holds on
    every value a caller passes (HF passes none), and no ``FutureWarning`` is raised."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_contexts

    x0 = torch.randn(ROWS, DIM)
    for answer, moved in (("MUST_SAVE", INPUT_BYTES), ("MUST_CPU_OFFLOAD", INPUT_BYTES + MM_BYTES)):
        expected = step(stack(torch_contexts, "MUST_SAVE"), x0)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            got, stats = offloaded_step(
                stack(cpu_offload.create_selective_checkpoint_contexts, answer, respect), x0,
                cpu_offload.SimulatedDevice())
        assert all(map(torch.equal, got, expected))
        assert stats["layers"][1]["copied_out_bytes"] == moved, answer


@pytest.mark.parametrize("respect", [False, True])
def test_true_would_hand_each_cpu_offload_output_to_the_engine_twice(respect, monkeypatch):
    """Why our contexts choose ``False``: with ``True`` torch packs the ``MUST_CPU_OFFLOAD``
    outputs through the engine's hooks, and the forward context, which hands them to the
    engine itself (as it must on torch < 2.15), unpacks them while the forward runs to pack
    them again: unpacks in forward, and the tensors counted twice."""
    monkeypatch.setattr(policies, "SAC_RESPECTS_OFFLOAD_HOOKS", respect)
    unpacks = {"forward": 0}
    real_unpack = v2_context.unpack

    def counting_unpack(packed):
        unpacks["forward"] += not in_backward()
        return real_unpack(packed)

    monkeypatch.setattr(v2_context, "unpack", counting_unpack)
    x0 = torch.randn(ROWS, DIM)
    got, stats = offloaded_step(
        stack(cpu_offload.create_selective_checkpoint_contexts, "MUST_CPU_OFFLOAD"), x0,
        cpu_offload.SimulatedDevice())
    from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_contexts
    assert all(map(torch.equal, got, step(stack(torch_contexts, "MUST_SAVE"), x0)))
    # per offloaded layer: its input and the two mm outputs
    distinct = 2 * 3
    if respect:
        assert unpacks["forward"] > 0 and stats["offloaded_tensors"] > distinct
    else:
        assert unpacks["forward"] == 0 and stats["offloaded_tensors"] == distinct


def test_the_package_checkpoints_pass_the_choice_explicitly(monkeypatch):
    """apply_offloading's own checkpoints (a plan's recompute layers, ``selective=<policy>``)
    pass ``respect_saved_tensors_hooks=False``; none leaves it to torch's default."""
    from cpu_offload.plan.search import Plan

    seen = []

    def spy(fn, *args, **kwargs):
        seen.append(kwargs.get("respect_saved_tensors_hooks", "missing"))
        return checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(layer_seam, "checkpoint", spy)
    x0 = torch.randn(ROWS, DIM)
    linears = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(4))
    for kwargs in ({"plan": Plan(2, (1, 2))}, {"num_layers": 2, "selective": policy_for("MUST_SAVE")}):
        seen.clear()
        handle = cpu_offload.apply_offloading(
            linears, min_tensor_size_to_offload=1, device=cpu_offload.SimulatedDevice(), **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            step(linears, x0)
        handle.remove()
        assert seen and set(seen) == {policies.SAC_RESPECTS_OFFLOAD_HOOKS}, kwargs
