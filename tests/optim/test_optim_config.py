"""The Megatron-style optimizer-offloading config: defaults, every constraint (error names the fix),
and the builder; plus the DDP communication-hook path on gloo (two CPU processes)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from cpu_offload import (
    OffloadConfigError, OptimizerOffloadConfig, SimulatedDevice, build_hybrid_optimizer,
)
from cpu_offload.examples.gpt import build_model, make_input, tiny_config
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
    assert type(opt._buckets[0].optimizers[0]) is torch.optim.AdamW
    assert opt._buckets[0].optimizers[0].defaults["fused"] is None  # plain torch AdamW, as given
    with pytest.raises(OffloadConfigError, match="offload_fraction come from the config"):
        build_hybrid_optimizer(cfg, model.parameters(), offload_fraction=0.5)
    with pytest.raises(OffloadConfigError, match="optimizer_offload_fraction=2"):
        build_hybrid_optimizer(OptimizerOffloadConfig(True, 2), model.parameters())
    opt.close()


# ---------------------------------------------------------------------------------------------
# DDP: offloaded gradients are taken after the all-reduce (communication hook)


def _ddp_worker(rank: int, world: int, port: int, result_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = tiny_config().with_(layers=2)
    kw = dict(lr=1e-2, foreach=False)
    ref = DDP(build_model(cfg, seed=0))
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    ddp = DDP(build_model(cfg, seed=0), bucket_cap_mb=0.05)
    opt = HybridDeviceOptimizer(ddp.parameters(), 0.5, torch.optim.AdamW, torch.optim.AdamW,
                                device=SimulatedDevice(), overlap="backward_update", **kw)
    ddp.register_comm_hook(*opt.ddp_comm_hook())
    for step in range(2):
        x = make_input(cfg, seed=10 * step + rank, requires_grad=False)  # different per rank
        for net, o in ((ref, ref_opt), (ddp, opt)):
            net(x).square().mean().backward()
            o.step()
            o.zero_grad()
    same = all(torch.equal(a, b) for a, b in zip(ref.parameters(), ddp.parameters()))
    moved = not all(torch.equal(a, b) for a, b in
                    zip(build_model(cfg, seed=0).parameters(), ddp.parameters()))
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(f"{same} {moved}")
    opt.close()
    dist.destroy_process_group()


def test_ddp_comm_hook_takes_reduced_gradients(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork: the children skip re-importing torch (the suite runs torch single-threaded, so no
    # OpenMP pool is forked)
    mp.start_processes(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    for rank in range(2):
        assert (tmp_path / f"rank{rank}").read_text() == "True True"
