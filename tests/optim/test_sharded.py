"""``HybridDeviceOptimizer`` over FSDP2 (``fully_shard``) parameters in one process: a gloo group
of one rank, so every parameter is a DTensor whose local shard is all of it, and FSDP2 runs its
reduce path (and with it the sharded parameters' post-accumulate-grad hooks) as on more ranks.
On the simulated device every part runs the same CPU class, so the optimizer equals plain
``torch.optim.AdamW(fused=True)`` over the FSDP2 model, shards and DTensor state, in every
overlap mode and split. The two-rank cases (uneven shards, HSDP, DCP on disk) are
``fsdp2-optim`` in ``tests/_support/distributed_cases.py``."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from packaging.version import Version
from torch import nn

from _support.hybrid_cases import assert_same_state, devices, gloo, loss_of, made, net, settle, splits  # noqa: F401
from _support.hybrid_cases import hybrid as make_hybrid
from cpu_offload import SimulatedDevice
from cpu_offload.compat import TORCH_VERSION, fully_shard, is_dtensor
from cpu_offload.core.errors import OffloadConfigError, OffloadUsageError
from cpu_offload.optim import HybridDeviceOptimizer, grad_arrival_order, to_wrapped_format

# FSDP2 creates CUDA streams even for CPU parameters before torch 2.8 (distributed_cases.py)
pytestmark = pytest.mark.skipif(TORCH_VERSION < Version("2.8"), reason="FSDP2 on the CPU needs torch >= 2.8")

KW = dict(lr=1e-2, weight_decay=0.1)


def sharded(dtype: torch.dtype = torch.float32, **shard) -> nn.Module:
    """The tests' three-layer net, ``fully_shard`` on each layer and on the net."""
    m = net(dtype)
    for layer in (m.l1, m.l2, m.l3):
        fully_shard()(layer, **shard)
    fully_shard()(m, **shard)
    return m


def train(pairs, steps=range(3)) -> None:
    for i in steps:
        for m, o in pairs:
            loss_of(m, i).backward()
            o.step()
            o.zero_grad()
    for _, o in pairs:
        settle(o)


def shards(m: nn.Module) -> list:
    return [p.to_local().detach() for p in m.parameters()]


def assert_same_shards(a: nn.Module, b: nn.Module) -> None:
    for i, (x, y) in enumerate(zip(shards(a), shards(b))):
        assert torch.equal(x, y), f"parameter {i}"


@devices
@splits()
def test_equals_adamw_over_the_fsdp2_model(gloo, made, split, device):
    a, b = sharded(), sharded()
    opt = make_hybrid(a, split, device, **KW)
    made.append(opt)
    ref = torch.optim.AdamW(b.parameters(), fused=True, **KW)
    train([(a, opt), (b, ref)])
    assert_same_shards(a, b)
    assert opt.offloaded_params() + opt.streamed_params(), "nothing offloaded"
    assert all(is_dtensor(p) for p in opt.offloaded_params() + opt.streamed_params())
    sd, want = opt.state_dict(), ref.state_dict()
    for i, entry in want["state"].items():
        for name, v in entry.items():
            assert is_dtensor(sd["state"][i][name]) == is_dtensor(v), (i, name)
            if is_dtensor(v):
                assert sd["state"][i][name].placements == v.placements
            assert torch.equal(getattr(sd["state"][i][name], "to_local", lambda: sd["state"][i][name])(),
                               getattr(v, "to_local", lambda: v)()), (i, name)
    p = opt.offloaded_params()[0] if opt.offloaded_params() else opt.streamed_params()[0]
    live = opt.state[p]["exp_avg"]
    assert is_dtensor(live) and live.to_local().data_ptr() == opt.state[p]["exp_avg"].to_local().data_ptr()


@splits(during_backward=False)
def test_bf16_state_in_the_parameter_dtype_equals_adamw_over_the_fsdp2_model(gloo, made, split):
    """``fp32_masters=False`` over bf16 shards: bf16 DTensor state, as AdamW keeps it."""
    a, b = sharded(torch.bfloat16), sharded(torch.bfloat16)
    opt = make_hybrid(a, split, fp32_masters=False, **KW)
    made.append(opt)
    ref = torch.optim.AdamW(b.parameters(), fused=True, **KW)
    train([(a, opt), (b, ref)])
    assert_same_shards(a, b)
    for p, q in zip(a.parameters(), b.parameters()):
        mine, theirs = opt.state[p]["exp_avg"], ref.state[q]["exp_avg"]
        assert mine.dtype == torch.bfloat16 and torch.equal(mine.to_local(), theirs.to_local())


def test_state_dict_loads_into_adamw_and_back(gloo, made):
    """``to_wrapped_format`` of the hybrid's (DTensor) state loads into plain AdamW over the FSDP2
    model, and AdamW's own state dict into a hybrid; both continue as without the exchange."""
    a, b, c = sharded(), sharded(), sharded()
    opt = make_hybrid(a, fraction=1.0, **KW)
    made.append(opt)
    ref = torch.optim.AdamW(b.parameters(), fused=True, **KW)
    train([(a, opt), (b, ref)])
    torch.save(opt.state_dict(), io.BytesIO())  # DTensors over views of pinned buffers save
    plain = torch.optim.AdamW(c.parameters(), fused=True, **KW)
    with torch.no_grad():
        for x, y in zip(c.parameters(), a.parameters()):
            x.to_local().copy_(y.to_local())
    plain.load_state_dict(copy.deepcopy(to_wrapped_format(opt.state_dict())))  # torch keeps what it loads
    again = make_hybrid(b, fraction=0.5, **KW)  # over the reference's model: from AdamW's state
    made.append(again)
    again.load_state_dict(copy.deepcopy(ref.state_dict()))
    train([(a, opt), (c, plain), (b, again)], steps=range(3, 5))
    assert_same_shards(a, c)
    assert_same_shards(a, b)


def test_load_refuses_state_of_another_layout(gloo, made):
    a = sharded()
    opt = make_hybrid(a, fraction=1.0, **KW)
    made.append(opt)
    train([(a, opt)], steps=range(1))
    sd = opt.state_dict()
    full = copy.deepcopy(sd)
    full["state"][0]["exp_avg"] = torch.zeros(3, 3)  # neither the shard nor a DTensor
    with pytest.raises(ValueError, match="sharded state dict"):
        opt.load_state_dict(full)
    other = copy.deepcopy(sd)
    from torch.distributed.tensor import Replicate

    other["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].redistribute(placements=[Replicate()])
    with pytest.raises(ValueError, match="set_optimizer_state_dict"):
        opt.load_state_dict(other)
    opt.load_state_dict(sd)  # its own: fine


def test_refusals_name_the_fix(gloo, made):
    m = sharded()
    with pytest.raises(OffloadConfigError, match="clip_grad_norm_"):
        HybridDeviceOptimizer(m.parameters(), 0.5, max_grad_norm=1.0, device=SimulatedDevice())
    opt = HybridDeviceOptimizer(m.parameters(), 0.5, device=SimulatedDevice(), **KW)
    made.append(opt)
    with pytest.raises(OffloadUsageError, match="FSDP2"):
        opt.ddp_comm_hook()
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = sharded(offload_policy=CPUOffloadPolicy(pin_memory=False))
    on_cpu = HybridDeviceOptimizer(policy.parameters(), 0.5, device=SimulatedDevice(), **KW)
    made.append(on_cpu)
    with pytest.raises(OffloadConfigError, match="CPUOffloadPolicy"):
        on_cpu.register_forward_waits(policy)


@pytest.mark.parametrize("values", ["same", "other"])
def test_a_local_shard_in_new_memory_is_refused_at_step(gloo, made, values):
    """Updates to memory FSDP2 no longer all-gathers would be lost. Same values in new memory is
    what FSDP2's lazy initialization does to uneven shards before torch 2.11 (distributed_cases
    meets it on 2.8); other values, the user's replacement. Each error names its fix, and the
    parameters are left as they were."""
    m = sharded()
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, device=SimulatedDevice(), **KW)
    made.append(opt)
    p = next(m.parameters())
    moved = p._local_tensor.clone() + (0 if values == "same" else 1)
    p._local_tensor = moved
    before = shards(m)
    loss_of(m, 0).backward()
    fix = ("build the optimizer after one forward of the model" if values == "same"
           else "load weights in place")
    with pytest.raises(OffloadUsageError, match=fix):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, shards(m)))


def test_grad_arrival_order_sees_fsdp2_gradients(gloo, made):
    """FSDP2 runs the sharded parameters' post-accumulate-grad hooks, so the measured order can
    place the parameters (the last layer's first)."""
    m = sharded()
    order = grad_arrival_order(m.parameters(), lambda: loss_of(m, 0).backward())
    names = {id(p): n for n, p in m.named_parameters()}
    assert [names[id(p)].split(".")[0] for p in order][:2] == ["l3", "l3"]
    m.zero_grad()
    opt = HybridDeviceOptimizer(m.parameters(), 0.3, grad_order=order, device=SimulatedDevice(), **KW)
    made.append(opt)
    assert {names[id(p)] for p in opt.offloaded_params()} <= {"l3.weight", "l3.bias", "l2.weight", "l2.bias"}


@splits(("backward_update", "next_forward"), during_backward=False)
def test_clipping_between_backward_and_step_is_seen(gloo, made, split):
    """``clip_grad_norm_`` over the FSDP2 model scales the DTensor gradients in place after the
    hooks copied them: ``step()`` redoes that work (the first step; later ones start no early
    work while every step changes the gradients), as without FSDP2."""
    a, b = sharded(), sharded()
    opt = make_hybrid(a, split, fraction=1.0, **KW)
    made.append(opt)
    ref = torch.optim.AdamW(b.parameters(), fused=True, **KW)
    redone = []
    for i in range(3):
        for m, o in ((a, opt), (b, ref)):
            loss_of(m, i).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            o.step()
            o.zero_grad()
        settle(opt)
        redone.append(opt.last_step_stats.get("redone_buckets"))
    assert_same_shards(a, b)
    if opt.offloaded_params():
        assert redone[0] > 0, redone
