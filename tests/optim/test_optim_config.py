"""The Megatron-style optimizer-offloading config: defaults, every constraint (error names the fix),
and the builder. The DDP communication-hook path runs as cases ``ddp-optim`` and
``ddp-optim-clip`` of tests/_support/distributed_cases.py (tests/integration/test_distributed.py)."""
from __future__ import annotations


import pytest
import torch

from cpu_offload import (
    OffloadConfigError, OptimizerOffloadConfig, SimulatedDevice, build_hybrid_optimizer,
)
from cpu_offload.examples.gpt import build_model, tiny_config
from cpu_offload.optim import HybridDeviceOptimizer


def test_megatron_defaults_and_field_names():
    cfg = OptimizerOffloadConfig()
    assert (cfg.optimizer_cpu_offload, cfg.optimizer_offload_fraction) == (False, 0.0)
    assert not cfg.overlap_cpu_optimizer_d2h_h2d and not cfg.use_torch_optimizer_for_cpu_offload
    assert cfg.pin_cpu_grads and cfg.pin_cpu_params
    megatron = {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "lr": 1e-4,
                "use_distributed_optimizer": True}
    assert OptimizerOffloadConfig.from_object(megatron).validate().optimizer_offload_fraction == 0.5


@pytest.mark.parametrize("fields, needles", [
    (dict(optimizer_offload_fraction=1.5), ["optimizer_offload_fraction=1.5", "[0.0, 1.0]"]),
    (dict(optimizer_offload_fraction=-0.1), ["must be in [0.0, 1.0]"]),
    (dict(use_distributed_optimizer=False), ["requires use_distributed_optimizer=True"]),
    (dict(optimizer="sgd"), ["optimizer='sgd'", "set optimizer='adam'"]),
    (dict(decoupled_weight_decay=False), ["set decoupled_weight_decay=True"]),
    (dict(main_params_dtype=torch.bfloat16), ["set main_params_dtype=torch.float32"]),
    (dict(fp16=True), ["train in bf16 (fp16=False)"]),
    (dict(pin_cpu_grads="yes"), ["pin_cpu_grads must be True or False"]),
    (dict(clip_grad=-1.0), ["clip_grad must be >= 0"]),
])
def test_each_constraint_names_the_fix(fields, needles):
    cfg = OptimizerOffloadConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    for k, v in fields.items():
        setattr(cfg, k, v)
    with pytest.raises(OffloadConfigError) as err:
        cfg.validate()
    for needle in needles:
        assert needle in str(err.value)


def test_constraints_apply_only_when_offloading_and_are_all_listed():
    OptimizerOffloadConfig(optimizer="sgd", fp16=True, use_distributed_optimizer=False).validate()
    cfg = OptimizerOffloadConfig(optimizer_cpu_offload=True, optimizer="sgd", fp16=True)
    with pytest.raises(OffloadConfigError, match=r"(?s)optimizer='sgd'.*fp16=True"):
        cfg.validate()


def test_builder():
    model = build_model(tiny_config(), seed=0)
    plain = build_hybrid_optimizer(OptimizerOffloadConfig(), model.parameters(), lr=1e-3)
    assert type(plain) is torch.optim.AdamW
    cfg = OptimizerOffloadConfig(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0,
                                 overlap_cpu_optimizer_d2h_h2d=True, clip_grad=1.0,
                                 use_torch_optimizer_for_cpu_offload=True)
    opt = build_hybrid_optimizer(cfg, model.parameters(), lr=1e-3, device=SimulatedDevice())
    assert isinstance(opt, HybridDeviceOptimizer)
    assert (opt.overlap, opt.max_grad_norm, opt.offload_fraction) == ("backward_update", 1.0, 1.0)
    assert type(opt._cpu.buckets[0].optimizers[0]) is torch.optim.AdamW
    assert opt._cpu.buckets[0].optimizers[0].defaults["fused"] is None  # plain torch AdamW, as given
    with pytest.raises(OffloadConfigError, match="offload_fraction come from the config"):
        build_hybrid_optimizer(cfg, model.parameters(), offload_fraction=0.5)
    with pytest.raises(OffloadConfigError, match="optimizer_offload_fraction=2"):
        build_hybrid_optimizer(OptimizerOffloadConfig(True, 2), model.parameters())
    opt.close()


