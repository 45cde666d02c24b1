"""Megatron-style config: every constraint Megatron documents for CPU offloading (error type and
fix), and the context."""
from __future__ import annotations

import contextlib
import types

import pytest
import torch

from cpu_offload import OffloadConfigError, SimulatedDevice
from cpu_offload.config import ActivationOffloadConfig, build_offload_context
from cpu_offload.examples.gpt import build_model, make_input, run_layers, tiny_config


def enabled(**fields) -> ActivationOffloadConfig:
    fields.setdefault("num_layers", 8)
    fields.setdefault("cpu_offloading_num_layers", 2)
    return ActivationOffloadConfig(cpu_offloading=True, **fields)


def test_megatron_defaults():
    cfg = ActivationOffloadConfig(num_layers=4)
    assert (cfg.cpu_offloading, cfg.cpu_offloading_num_layers) == (False, 0)
    assert cfg.cpu_offloading_activations and not cfg.cpu_offloading_weights
    assert not cfg.cpu_offloading_double_buffering
    assert not cfg.cpu_offloading_retain_pinned_cpu_buffers
    assert (cfg.pipeline_model_parallel_size, cfg.recompute_granularity) == (1, None)
    assert cfg.cuda_graph_impl == "none"
    assert cfg.validate() is cfg


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_layers=8, cpu_offloading_num_layers=6),
        dict(num_layers=8, cpu_offloading_num_layers=0),
        dict(num_layers=1, cpu_offloading_num_layers=0),
        dict(pipeline_model_parallel_size=4, manual_synchronization=True),
        dict(cuda_graph_impl="local", cpu_offloading_retain_pinned_cpu_buffers=True),
        dict(cpu_offloading_activations=False, cpu_offloading_weights=True),
        dict(manual_synchronization=True, cpu_offloading_num_layers=99),
    ],
)
def test_valid_configs(fields):
    enabled(**fields).validate()


def test_disabled_offloading_skips_the_offloading_constraints():
    ActivationOffloadConfig(
        num_layers=2, cpu_offloading_num_layers=5, pipeline_model_parallel_size=8,
        recompute_granularity="full", cuda_graph_impl="local",
        fine_grained_activation_offloading=True, cpu_offloading_activations=False,
    ).validate()


@pytest.mark.parametrize(
    "fields, needles",
    [
        (dict(num_layers=8, cpu_offloading_num_layers=7),
         ["cpu_offloading_num_layers=7", "[0, num_layers-1)", "cpu_offloading_num_layers <= 6"]),
        (dict(num_layers=8, cpu_offloading_num_layers=8), ["cpu_offloading_num_layers <= 6"]),
        (dict(num_layers=8, cpu_offloading_num_layers=-1), ["cpu_offloading_num_layers=-1"]),
        (dict(num_layers=1, cpu_offloading_num_layers=1), ["cpu_offloading_num_layers <= 0"]),
        (dict(cpu_offloading_num_layers=2.0), ["cpu_offloading_num_layers must be an int"]),
        (dict(num_layers=0), ["num_layers must be the model's layer count"]),
        (dict(pipeline_model_parallel_size=2),
         ["pipeline_model_parallel_size=2", "manual_synchronization=True",
          "pipeline_model_parallel_size=1"]),
        (dict(pipeline_model_parallel_size=0),
         ["pipeline_model_parallel_size must be an int >= 1"]),
        (dict(recompute_granularity="selective"),
         ["recompute_granularity='selective'", "recompute_granularity=None"]),
        (dict(cuda_graph_impl="transformer_engine"),
         ["cuda_graph_impl='transformer_engine'", "cpu_offloading_retain_pinned_cpu_buffers=True",
          "cuda_graph_impl='none'"]),
        (dict(fine_grained_activation_offloading=True),
         ["fine_grained_activation_offloading cannot be combined with cpu_offloading"]),
        (dict(cpu_offloading_activations=False, cpu_offloading_weights=False),
         ["neither cpu_offloading_activations nor cpu_offloading_weights",
          "cpu_offloading_activations=True"]),
    ],
)
def test_each_constraint_raises_with_its_fix(fields, needles):
    with pytest.raises(OffloadConfigError) as info:
        enabled(**fields).validate()
    message = str(info.value)
    for needle in needles:
        assert needle in message
    assert isinstance(info.value, ValueError)  # frameworks that catch ValueError keep working


def test_all_problems_are_reported_at_once():
    cfg = enabled(pipeline_model_parallel_size=2, recompute_granularity="full",
                  cpu_offloading_num_layers=9)
    assert len(cfg.problems()) == 3
    with pytest.raises(OffloadConfigError) as info:
        cfg.validate()
    message = str(info.value)
    assert message.count("\n  - ") == 3
    for needle in ("pipeline_model_parallel_size=1", "recompute_granularity=None",
                   "cpu_offloading_num_layers <= 6"):
        assert needle in message


def test_from_object_picks_fields_by_name():
    megatron_like = types.SimpleNamespace(
        num_layers=12, cpu_offloading=True, cpu_offloading_num_layers=4, hidden_size=4096,
        pipeline_model_parallel_size=1, recompute_granularity=None,
    )
    cfg = ActivationOffloadConfig.from_object(megatron_like)
    assert (cfg.num_layers, cfg.cpu_offloading, cfg.cpu_offloading_num_layers) == (12, True, 4)
    cfg = ActivationOffloadConfig.from_object({"cpu_offloading": True}, num_layers=3)
    assert (cfg.num_layers, cfg.cpu_offloading) == (3, True)
    with pytest.raises(OffloadConfigError, match="num_layers=..."):
        ActivationOffloadConfig.from_object({"cpu_offloading": True})


def test_build_validates_first():
    with pytest.raises(OffloadConfigError, match="recompute_granularity=None"):
        build_offload_context(enabled(recompute_granularity="full"), device=SimulatedDevice())


def test_build_refuses_to_override_config_fields():
    with pytest.raises(OffloadConfigError, match="ActivationOffloadConfig field"):
        build_offload_context(enabled(), num_layers=3, device=SimulatedDevice())


def test_build_disabled_is_a_no_op_context():
    ctx, sync = build_offload_context(ActivationOffloadConfig(num_layers=4))
    x = torch.ones(2)
    with ctx:
        pass
    assert sync(x) is x


def test_build_passes_the_fields_to_the_facade(monkeypatch):
    seen = {}

    def fake(**kwargs):
        seen.update(kwargs)
        return contextlib.nullcontext(), (lambda t: t)

    monkeypatch.setattr("cpu_offload.config.get_cpu_offload_context", fake)
    cfg = enabled(num_layers=6, cpu_offloading_num_layers=3, cpu_offloading_weights=True,
                  cpu_offloading_double_buffering=True,
                  cpu_offloading_retain_pinned_cpu_buffers=True)
    build_offload_context(cfg, min_tensor_size_to_offload=7)
    assert seen == dict(
        enabled=True, num_layers=3, model_layers=6, offload_activations=True,
        offload_weights=True, double_buffering=True, retain_pinned_cpu_buffers=True,
        manual_synchronization=False, min_tensor_size_to_offload=7,
    )


def test_built_context_offloads_and_keeps_gradients_exact():
    tiny = tiny_config()
    model = build_model(tiny)
    x = make_input(tiny)
    ref_out = run_layers(model.layers, x)
    ref_out.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    sim = SimulatedDevice()
    cfg = ActivationOffloadConfig(num_layers=tiny.layers, cpu_offloading=True,
                                  cpu_offloading_num_layers=2)
    ctx, sync = build_offload_context(cfg, device=sim, min_tensor_size_to_offload=0)
    out = run_layers(model.layers, x, ctx, sync)
    out.square().sum().backward()
    assert torch.equal(out, ref_out)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
    assert [e for e in sim.milestones({"release"})] == [("release", 0), ("release", 1)]


def test_built_manual_context_returns_the_synchronizer():
    cfg = enabled(num_layers=4, pipeline_model_parallel_size=2, manual_synchronization=True)
    ctx, sync, manual = build_offload_context(cfg, device=SimulatedDevice())
    assert hasattr(manual, "start_offload_layer")
