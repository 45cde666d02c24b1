"""Drop-in behaviour for callers of the reference implementation's ``get_cpu_offload_context``:
defaults, disabled contexts, deprecations, introspection and the environment switch behave as
callers of the reference rely on; where we deliberately differ, docs/from_reference.md says
why and these tests pin our behaviour."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import (
    OffloadUsageError,
    SimulatedDevice,
    get_cpu_offload_context,
    mark_activation_offload,
    start_offload,
)
from _support.parity_models import EXPECTED_WARNINGS

pytestmark = EXPECTED_WARNINGS  # see parity_models


def chain_step(layers, x0, ctx, sync, each=None):
    x = x0.clone().requires_grad_()
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        h = sync(h)
        if each is not None:
            each(i)
    return x, h


def test_default_size_threshold_is_256k_elements():
    for fn in (cpu_offload.get_cpu_offload_context, cpu_offload.v2.get_cpu_offload_context):
        assert inspect.signature(fn).parameters["min_tensor_size_to_offload"].default == 256 * 1024
    sim = SimulatedDevice()
    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2, device=sim)
    big = torch.randn(256 * 1024, requires_grad=True)
    small = torch.randn(256 * 1024 - 1, requires_grad=True)
    with ctx:
        y = big.exp().sum() + small.exp().sum()  # exp saves its outputs
    y = sync(y)
    with ctx:
        y = y * 1.0
    sync(y).backward()
    assert [c[2] for c in sim.copies("d2h")] == [256 * 1024 * 4]


@pytest.mark.parametrize("manual", [False, True])
def test_disabled_context_never_raises_and_returns_the_reference_shapes(backend, manual):
    kwargs = dict(enabled=False, offload_activations=False, offload_weights=False,
                  num_layers=5, model_layers=2, manual_synchronization=manual)
    if backend == "v1" and manual:
        pytest.skip("manual synchronization is V2's")
    out = get_cpu_offload_context(**kwargs)
    if manual:
        assert len(out) == 3 and out[2] is None  # callers test `if manual is not None`
    else:
        assert len(out) == 2
    ctx, sync = out[0], out[1]
    x = torch.randn(3, requires_grad=True)
    with ctx:
        y = x * 2
    assert sync(y) is y


def test_offload_weights_is_deprecated_and_ignored(backend):
    sim = SimulatedDevice()
    kw = {} if backend == "v1" else {"min_tensor_size_to_offload": 0}
    with pytest.warns(DeprecationWarning, match="offload_weights"):
        ctx, sync = get_cpu_offload_context(
            enabled=True, num_layers=1, model_layers=2, offload_weights=True, device=sim, **kw
        )
    lin = nn.Linear(64, 64)
    x = torch.randn(4, 64, requires_grad=True)
    mark_activation_offload(x)
    with ctx:
        y = lin(x)
    y = sync(y)
    with ctx:
        y = y * 1.0
    sync(y).sum().backward()
    weight_bytes = lin.weight.numel() * 4
    assert sim.copies("d2h") and all(c[2] != weight_bytes for c in sim.copies("d2h"))


def test_sync_accepts_a_tensor_that_needs_no_grad(backend):
    """We keep accepting it (the reference raises ValueError): evaluation loops and frozen first
    layers produce such outputs, and nothing is scheduled for them."""
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=SimulatedDevice()
    )
    with torch.no_grad():
        with ctx:
            y = torch.ones(3) * 2
        assert sync(y) is y
    frozen = torch.ones(3)
    assert sync(frozen) is frozen


# Under V1 the tensors are not tagged, so nothing is offloaded and V1 says so.
@pytest.mark.filterwarnings("ignore:cpu_offload \\(V1\\).*none is tagged:UserWarning")
def test_no_grad_forwards_need_no_sync_function(backend):
    """Evaluation loops that skip the sync function must not break (nothing is saved)."""
    layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, device=SimulatedDevice()
    )
    with torch.no_grad():
        for _ in range(2):
            h = torch.randn(2, 4)
            for layer in layers:
                with ctx:
                    h = layer(h)
    x, h = chain_step(layers, torch.randn(2, 4), ctx, sync)  # training still works afterwards
    h.sum().backward()
    assert x.grad is not None


def test_start_offload_of_a_base_lets_saved_views_copy_early(sim):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0, device=sim
    )
    recorded, waited = [], []
    record, wait = sim.record_event, sim.wait_event
    sim.record_event = lambda s: recorded.append(record(s)) or recorded[-1]
    sim.wait_event = lambda s, e: waited.append(e) or wait(s, e)
    x = torch.randn(4, 8, requires_grad=True)
    with ctx:
        qkv = x * 2
        q = qkv[:, :4]  # a view of the base
        start_offload(q, offload_base_tensor=True)
        ready = recorded[-1]
        y = (q.exp() * 3).sum()  # exp saves its output (own storage); mul saves nothing
        z = (qkv[:, 4:] * q).sum()  # saves two views of qkv: their copy waits for `ready`
    n_before = len(waited)
    y = sync(y + z)
    with ctx:
        y = y * 1.0
    sync(y).backward()
    assert any(e is ready for e in waited[:n_before])


def test_reference_introspection_spelling(sim):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0, device=sim
    )
    layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
    x, h = chain_step(layers, torch.randn(8, 16), ctx, sync)
    mb = ctx.offload_synchronizer.get_offloaded_total_size_mb()
    assert mb == sum(c[2] for c in sim.copies("d2h")) / 2**20 > 0
    h.sum().backward()


def test_retained_buffers_refuse_to_grow_and_accept_smaller_shapes(sim):
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, min_tensor_size_to_offload=0,
        retain_pinned_cpu_buffers=True, device=sim,
    )
    layers = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
    for rows in (8, 4):  # the first shape sizes the buffers; a smaller one fits
        x, h = chain_step(layers, torch.randn(rows, 16), ctx, sync)
        h.sum().backward()
    allocs = sim.host_allocs
    with pytest.raises(OffloadUsageError, match="pad to the largest"):
        chain_step(layers, torch.randn(16, 16), ctx, sync)
    assert sim.host_allocs == allocs


def test_each_layer_moves_once_when_layers_backpropagate_separately(sim):
    """The reference's manual pattern: every layer reloaded before backward, then each layer's
    output backpropagated on its own (as pipeline stages do)."""
    torch.manual_seed(0)
    layers = nn.ModuleList(
        [nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)) for _ in range(4)]
    )
    ctx, sync, manual = get_cpu_offload_context(
        enabled=True, model_layers=4, manual_synchronization=True, min_tensor_size_to_offload=0,
        device=sim,
    )
    inputs, outputs = [], []
    h = torch.randn(8, 16)
    for i, layer in enumerate(layers):
        x = h.detach().requires_grad_()
        with ctx:
            y = layer(x)
        y = sync(y)
        manual.start_offload_layer(i)
        inputs.append(x)
        outputs.append(y)
        h = y
    for i in range(4):
        manual.release_activation_forward_gpu_memory(i)
    for i in range(4):
        manual.start_reload_layer(i)
    grad = torch.ones(8, 16)
    for i in reversed(range(4)):
        outputs[i].backward(grad)
        grad = inputs[i].grad
    # Each layer saves its input and its tanh output: both move out once. The tanh output comes
    # back exactly once; the input is the previous layer's output, which this test holds for its
    # backward, so it is used where it is.
    assert len(sim.copies("d2h")) == 8
    assert len(sim.copies("h2d")) == 4


def test_backend_switch_is_read_on_every_call(monkeypatch):
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")  # set after import
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=SimulatedDevice()
    )
    assert type(ctx).__module__.startswith("cpu_offload.v1")
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1")
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=2, device=SimulatedDevice()
    )
    assert type(ctx).__module__.startswith("cpu_offload.v2")


def test_backend_switch_set_before_import():
    code = (
        "import cpu_offload;"
        "ctx, _ = cpu_offload.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2,"
        " device=cpu_offload.SimulatedDevice()); print(type(ctx).__module__)"
    )
    env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip().startswith("cpu_offload.v1")
