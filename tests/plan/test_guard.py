"""Planning does not train the model (``cpu_offload.plan.guard``): ``plan_offloading`` runs
``step_fn`` many times, so it refuses an optimizer step before it changes anything, and leaves
gradients, buffers and random state as they were, whether it returns or raises."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import cpu_offload
from cpu_offload import OffloadConfigError


class Net(nn.Module):
    """An embedding-like input layer and a head outside the planned layers; dropout and
    BatchNorm inside them (random state and buffers that a forward changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.Tanh())
            for _ in range(4))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def state_of(net: Net, opt=None, sched=None) -> dict:
    out = {f"param {n}": p.detach().clone() for n, p in net.named_parameters()}
    out.update({f"grad object {n}": p.grad for n, p in net.named_parameters()})  # the tensors themselves
    out.update({f"grad value {n}": p.grad.clone() for n, p in net.named_parameters()})
    out.update({f"buffer {n}": b.clone() for n, b in net.named_buffers()})
    out["torch rng"] = torch.get_rng_state()
    if opt is not None:
        for i, s in enumerate(opt.state.values()):
            out.update({f"opt {i} {k}": v.clone() for k, v in s.items()})
        out["lr"] = opt.param_groups[0]["lr"]
        out["sched"] = sched.last_epoch
    return out


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key, value in before.items():
        if key.startswith("grad object "):  # the same tensor object, untouched
            assert after[key] is value, key
        elif isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key


def setup():
    torch.manual_seed(0)
    net = Net().train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(8, 16)
    net(x).square().mean().backward()  # a training step before planning: state and gradients
    opt.step()
    sched.step()
    net(x).square().mean().backward()
    return net, opt, sched, x


def plan(step, net):
    return cpu_offload.plan_offloading(
        step, net.layers, 0.6, device=cpu_offload.SimulatedDevice(),
        min_tensor_size_to_offload=1, link_gbps=1e-5, selective=False, partial=False,
        repeats=1)


def test_an_optimizer_step_in_step_fn_is_refused_before_it_changes_anything():
    net, opt, sched, x = setup()
    random.seed(5)
    before, python_rng = state_of(net, opt, sched), random.getstate()

    def training_step():  # what users pass: their whole training step
        net(x).square().mean().backward()
        opt.step()
        sched.step()

    with pytest.raises(OffloadConfigError, match=r"called AdamW.step\(\).*forward and backward"):
        plan(training_step, net)
    assert_same(before, state_of(net, opt, sched))
    assert random.getstate() == python_rng
    # and the optimizer still works: planning left no hook behind
    opt.step()
    assert not torch.equal(net.head.weight, before["param head.weight"])


def test_planning_leaves_gradients_buffers_and_random_state_as_they_were():
    net, opt, sched, x = setup()
    before = state_of(net)

    def forward_backward():
        net(x).square().mean().backward()

    p = plan(forward_backward, net)
    assert p.num_layers + len(p.recompute) > 0  # it planned, with ~10 calls of the step
    assert_same(before, state_of(net))


def test_restored_also_when_step_fn_raises():
    net, opt, sched, x = setup()
    before = state_of(net)
    calls = []

    def fails_on_the_third_call():
        calls.append(1)
        net(x).square().mean().backward()
        if len(calls) == 3:
            raise RuntimeError("data loader ran dry")

    with pytest.raises(RuntimeError, match="ran dry"):
        plan(fails_on_the_third_call, net)
    assert_same(before, state_of(net))


def test_persistent_gradient_buffers_zeroed_in_place_by_the_step():
    """A step that zeroes its gradient buffers in place (persistent buffers, as the reference
    workload keeps them) finds them during planning, and the layers' come back. (The other
    modules' are copied when the step's forward first reaches them: after this step zeroed
    them, so they stay zero, as the step leaves them; see cpu_offload.plan.guard.)"""
    net, opt, sched, x = setup()
    before = state_of(net)
    grads = [p.grad for p in net.parameters()]

    def zeroing_step():
        for g in grads:
            g.zero_()
        net(x).square().mean().backward()

    plan(zeroing_step, net)
    after = state_of(net)
    outside = ("embed.", "head.")
    assert_same({k: v for k, v in before.items() if "grad value" not in k or "layers." in k},
                {k: v for k, v in after.items() if "grad value" not in k or "layers." in k})
    assert all(not after[k].any() for k in after if k.startswith("grad value")
               and k.split()[-1].startswith(outside))
