"""Where a forward pass begins and ends, for manual synchronization (fuzzer seeds 227, 391, 855,
958, 1272) and the steps an evaluation forward runs beside.

- An evaluation forward under ``torch.no_grad()`` between a training forward and its backward
  counted its layers into the training step: with ``model_layers`` larger than the layers run
  (allowed with manual synchronization since issue 27's D3), ``start_reload_layer(1)`` after it
  raised ``OffloadUsageError: layer_id=1 does not name a layer of the current forward pass``;
  with ``model_layers`` exact the evaluation forward replaced the training step, so
  ``start_reload_layer`` silently reloaded nothing (backward reloaded on demand, without
  overlap) and ``ctx.stats()`` described the evaluation forward.
- With ``model_layers`` larger than the layers run, a training loop that keeps the last loss
  alive (``loss = ...`` reassigned after the forward) kept the old step's graph alive, so the
  next forward extended the old step: ids named the old step's layers, then raised.

Layers run with grad disabled while a backward is pending now leave the step alone (and count
as its layers only when a layer with grad follows in the same forward: a reentrant checkpoint),
and a backward that builds no graph ends the step's forward pass.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cpu_offload import SimulatedDevice, get_cpu_offload_context
from _support.parity_models import EXPECTED_WARNINGS

pytestmark = EXPECTED_WARNINGS

D = 16
N = 3


def make_layers():
    torch.manual_seed(0)
    return nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                         for _ in range(N))


def inp(seed):
    return torch.randn(4, D, generator=torch.Generator().manual_seed(seed))


def manual_ctx(sim, model_layers):
    return get_cpu_offload_context(enabled=True, model_layers=model_layers,
                                   manual_synchronization=True, device=sim,
                                   min_tensor_size_to_offload=0)


def forward(layers, x, ctx, sync, manual=None):
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if manual is not None:
            manual.start_offload_layer(i)
    if manual is not None:
        for i in range(len(layers)):
            manual.release_activation_forward_gpu_memory(i)
    return h


def reference(layers, seeds):
    """Gradients (input and parameters) per step, without offloading."""
    out = []
    for s in seeds:
        layers.zero_grad(set_to_none=True)
        x = inp(s).requires_grad_()
        forward(layers, x, *get_cpu_offload_context(enabled=False)[:2]).square().sum().backward()
        out.append([x.grad.clone()] + [p.grad.clone() for p in layers.parameters()])
    return out


def assert_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


def reloads(sim):
    return [e[1] for e in sim.log if len(e) == 2 and e[0] == "reload"]


@pytest.mark.parametrize("extra", [0, 2], ids=["model_layers-exact", "model_layers-larger"])
def test_eval_forward_between_forward_and_backward_keeps_the_manual_ids(extra):
    layers = make_layers()
    ref = reference(layers, [1])
    sim = SimulatedDevice()
    ctx, sync, manual = manual_ctx(sim, N + extra)
    layers.zero_grad(set_to_none=True)
    x = inp(1).requires_grad_()
    loss = forward(layers, x, ctx, sync, manual).square().sum()
    with torch.no_grad():  # evaluation in between: the same layers, under the same context
        forward(layers, inp(50), ctx, sync)
    assert reloads(sim) == []
    for i in reversed(range(N)):
        manual.start_reload_layer(i)  # raised for extra > 0
    assert reloads(sim) == [2, 1, 0]  # queued by the calls, not on demand in backward
    loss.backward()
    assert_equal([x.grad] + [p.grad for p in layers.parameters()], ref[0])
    stats = ctx.stats().to_dict()  # the training step's, not the evaluation's
    assert stats["offloaded_tensors"] > 0 and stats["reloaded_bytes"] > 0


@pytest.mark.parametrize("extra", [0, 2], ids=["model_layers-exact", "model_layers-larger"])
def test_an_eval_forward_that_raises_leaves_the_training_step_alone(extra):
    layers = make_layers()
    ref = reference(layers, [1])
    sim = SimulatedDevice()
    ctx, sync, manual = manual_ctx(sim, N + extra)
    layers.zero_grad(set_to_none=True)
    x = inp(1).requires_grad_()
    loss = forward(layers, x, ctx, sync, manual).square().sum()
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        h = sync(layers[0](inp(50)))
        with ctx:
            h = layers[1](h)
            raise ZeroDivisionError("an evaluation layer raised")
    for i in reversed(range(N)):
        manual.start_reload_layer(i)
    assert reloads(sim) == [2, 1, 0]
    loss.backward()
    assert_equal([x.grad] + [p.grad for p in layers.parameters()], ref[0])


def test_a_loop_keeping_the_loss_alive_starts_a_new_step_each_forward():
    layers = make_layers()
    ref = reference(layers, [1, 2, 3])
    sim = SimulatedDevice()
    ctx, sync, manual = manual_ctx(sim, N + 2)  # a forward runs fewer layers than model_layers
    loss = None
    for step, s in enumerate([1, 2, 3]):
        layers.zero_grad(set_to_none=True)
        x = inp(s).requires_grad_()
        del sim.log[:]
        loss = forward(layers, x, ctx, sync, manual).square().sum()  # the old loss lives till here
        for i in reversed(range(N)):
            manual.start_reload_layer(i)
        assert reloads(sim) == [2, 1, 0], step
        loss.backward()
        assert_equal([x.grad] + [p.grad for p in layers.parameters()], ref[step])


def test_schedule_stats_after_an_eval_forward_describe_the_training_step():
    layers = make_layers()
    ref = reference(layers, [1])
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=N, device=sim,
                                        min_tensor_size_to_offload=0)
    x = inp(1).requires_grad_()
    loss = forward(layers, x, ctx, sync).square().sum()
    with torch.no_grad():
        forward(layers, inp(50), ctx, sync)
    layers.zero_grad(set_to_none=True)
    loss.backward()
    assert_equal([x.grad] + [p.grad for p in layers.parameters()], ref[0])
    assert ctx.stats().to_dict()["offloaded_tensors"] > 0


# --- what must not change ------------------------------------------------------------------------


def test_a_layer_without_grad_inside_the_forward_keeps_its_id():
    """A reentrant checkpoint runs its layer without grad: with manual synchronization it is
    still one of the forward's layers, so the ids of the layers after it do not shift."""
    layers = make_layers()
    sim = SimulatedDevice()
    ctx, sync, manual = manual_ctx(sim, N + 2)

    def body(layer, h):
        with ctx:
            return layer(h)

    def run(offload):
        layers.zero_grad(set_to_none=True)
        x = inp(1).requires_grad_()
        h = x
        for i, layer in enumerate(layers):
            if i == 1:
                h = checkpoint(body, layer, h, use_reentrant=True)
            elif offload:
                h = body(layer, h)
            else:
                h = layer(h)
            if offload:
                h = sync(h)
                manual.start_offload_layer(i)
        if offload:
            assert ctx.synchronizer.step.layers[2] is not None  # the third block is id 2
            for i in (0, 2):
                manual.release_activation_forward_gpu_memory(i)
            manual.start_reload_layer(2)
            manual.start_reload_layer(0)
        h.square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]

    ref = run(False)
    assert_equal(run(True), ref)
    assert reloads(sim) == [2, 0]


def test_create_graph_backward_in_mid_forward_does_not_end_the_forward():
    layers = make_layers()
    sim = SimulatedDevice()
    ctx, sync, manual = manual_ctx(sim, N + 2)
    x = inp(1).requires_grad_()
    with ctx:
        h = layers[0](x)
    h = sync(h)
    (g,) = torch.autograd.grad(h.square().sum(), x, create_graph=True)  # a gradient penalty
    h = h + g
    for i in (1, 2):
        with ctx:
            h = layers[i](h)
        h = sync(h)
    assert len(ctx.synchronizer.step.layers) == N  # one forward pass: ids 0..2
    manual.start_offload_layer(2)
    h.square().sum().backward()


def test_a_second_forward_run_by_reentrant_checkpoints_gets_its_own_step():
    """Layers run without grad whose outputs join a graph (a reentrant checkpoint around each
    `with ctx:`) are a training forward's, even while another forward's backward is pending:
    they get their own step (its stats say why nothing was offloaded), not the pending one's."""
    layers = make_layers()
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=N, device=sim,
                                        min_tensor_size_to_offload=0)

    def body(layer, h):
        with ctx:
            return layer(h)

    def run(offload):
        layers.zero_grad(set_to_none=True)
        x, y = inp(1).requires_grad_(), inp(2).requires_grad_()
        a = forward(layers, x, ctx, sync) if offload else forward(
            layers, x, *get_cpu_offload_context(enabled=False)[:2])
        first = ctx.synchronizer.step
        b = y
        for layer in layers:
            b = checkpoint(body if offload else (lambda l, h: l(h)), layer, b, use_reentrant=True)
            b = sync(b) if offload else b
        if offload:
            assert ctx.synchronizer.step is not first and ctx.synchronizer.step.fwd_count == N
            assert ctx.stats().to_dict()["layers_without_grad"] == 1  # the offloaded one
        (a.square().sum() + b.square().sum()).backward()
        return [x.grad.clone(), y.grad.clone()] + [p.grad.clone() for p in layers.parameters()]

    assert_equal(run(True), run(False))
