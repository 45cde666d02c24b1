"""``HybridDeviceOptimizer`` is exact whatever the user does around ``step()`` (issue 39, defects
1, 2, 4 and 8): GradScaler (which unscales with a kernel that does not bump ``.grad._version``),
writes to ``.grad`` that bypass the version counter (``.data``, numpy views, collectives),
tensor learning rates changed in place or by a scheduler, and parameters edited after
``step()``. Each test runs the same sequence with the wrapped torch optimizer over a copy of the
model and requires ``torch.equal`` parameters (and state), for every overlap mode, every
streamed share (all on the CPU, all streamed, both; and streaming during backward) and both
orders of the simulated device's side work (``_support.hybrid_cases``)."""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from cpu_offload import OffloadUsageError
from cpu_offload.optim.reference import MasterWeightOptimizer

from _support.hybrid_cases import (
    Split, assert_same_params, assert_same_state, devices, gloo, hybrid, loss_of, made, net,
    settle, splits,
)

assert gloo and made  # fixtures

OPTIMIZERS = {
    "SGD-momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
    "AdamW-fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "AdamW-for-loop": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=False)),
}
optimizers = pytest.mark.parametrize("name", list(OPTIMIZERS))


def pair(made, split, device, cls=None, **kw):
    """(hybrid, its model) and (wrapped class, its model): the same start; tensor arguments
    (a tensor lr) are cloned for the wrapped class, so that each has its own."""
    m, ref = net(), net()
    opt = hybrid(m, split, device, cpu_optimizer_cls=cls, gpu_optimizer_cls=cls, **kw)
    made.append(opt)
    kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    if cls is None:
        cls = torch.optim.AdamW
        kw = {"fused": True, **kw}
    return (m, opt), (ref, cls(ref.parameters(), **kw))


# --- defect 1: torch.amp.GradScaler ------------------------------------------------------------


def scaled_steps(m, opt, unscale: bool, clip: bool, inf_at: int = -1, steps: int = 3) -> list:
    """The AMP recipe; on step ``inf_at`` one gradient (the last layer's bias, offloaded) is
    inf, so the scaler must skip that step. Returns the scale after each ``update()``."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for i in range(steps):
        loss = loss_of(m, i)
        if i == inf_at:
            loss = loss + m.l3.bias.sum() * math.inf
        scaler.scale(loss).backward()
        if unscale:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    settle(opt)
    return scales


@pytest.mark.parametrize("unscale", ["step", "unscale_", "unscale_+clip"])
@optimizers
@devices
@splits()
def test_grad_scaler_equals_the_wrapped_optimizer(made, split, device, name, unscale):
    cls, kw = OPTIMIZERS[name]
    (m, opt), (ref, ref_opt) = pair(made, split, device, cls, **kw)
    flags = dict(unscale=unscale != "step", clip=unscale.endswith("clip"))
    assert scaled_steps(m, opt, **flags) == scaled_steps(ref, ref_opt, **flags)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@optimizers
@splits()
def test_grad_scaler_skips_an_inf_step_as_the_wrapped_optimizer(made, split, name):
    cls, kw = OPTIMIZERS[name]
    (m, opt), (ref, ref_opt) = pair(made, split, "early", cls, **kw)
    got = scaled_steps(m, opt, unscale=False, clip=False, inf_at=1)
    want = scaled_steps(ref, ref_opt, unscale=False, clip=False, inf_at=1)
    assert want == [1024.0, 512.0, 512.0]
    assert got == want
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


def test_grad_scaler_issue_example(made):
    """The issue's example: SGD, everything offloaded on the CPU, the CPU update finished
    before ``scaler.step`` (the sleep)."""
    (m, opt), (ref, ref_opt) = pair(made, Split("backward_update", 0.0), "late", torch.optim.SGD,
                                    lr=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(loss_of(model, 0)).backward()
        time.sleep(0.1)
        scaler.step(o)
        scaler.update()
    assert_same_params(m, ref)


# --- defect 2: gradient writes that do not bump the version counter ---------------------------


def _data_div(m):
    for p in m.parameters():
        p.grad.data /= 2


def _data_mul(m):
    for p in m.parameters():
        p.grad.data.mul_(0.3)


def _numpy(m):
    for p in m.parameters():
        p.grad.numpy()[:] *= 2


def _all_reduce(m):
    # one process: the sum is the gradient itself; this guards that the collective's write
    # (no version bump) is tolerated
    for p in m.parameters():
        dist.all_reduce(p.grad)


def _all_to_all(m):
    # a collective that changes the values in a one-process group, with no version bump
    for p in m.parameters():
        dist.all_to_all_single(p.grad, p.grad * 3)


GRAD_WRITES = {"grad.data /= 2": _data_div, "grad.data.mul_": _data_mul,
               "grad.numpy() *= 2": _numpy, "all_reduce": _all_reduce,
               "all_to_all_single": _all_to_all}


@pytest.mark.parametrize("write", list(GRAD_WRITES))
@devices
@splits()
def test_grad_writes_bypassing_the_version_counter(gloo, made, split, device, write):
    (m, opt), (ref, ref_opt) = pair(made, split, device, lr=1e-2, weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            GRAD_WRITES[write](model)
            o.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


# --- defect 4: tensor learning rates -----------------------------------------------------------


SCHEDULERS = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.3),
}


class SlowAdamW(torch.optim.AdamW):
    """AdamW whose every ``step()`` first sleeps: the CPU update of a ``next_forward`` step is
    surely still running when ``step()`` returns (the sleep changes no number)."""

    def step(self, closure=None):
        time.sleep(0.01)
        return super().step(closure)


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
@devices
@splits(("next_forward",))
def test_tensor_lr_scheduler_after_step_leaves_the_step_in_flight(made, split, device, scheduler):
    """``scheduler.step()`` right after ``opt.step()`` fills the tensor lr in place; the update
    that ``step()`` left running (``next_forward``) keeps the lr ``step()`` was called with."""
    (m, opt), (ref, ref_opt) = pair(made, split, device, SlowAdamW, lr=torch.tensor(0.01),
                                    weight_decay=0.1, fused=True)
    for model, o in ((m, opt), (ref, ref_opt)):
        sched = SCHEDULERS[scheduler](o)
        for i in range(3):
            loss_of(model, i).backward()
            o.step()
            sched.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@devices
@splits()
def test_tensor_lr_filled_between_backward_and_step(made, split, device):
    (m, opt), (ref, ref_opt) = pair(made, split, device, lr=torch.tensor(0.01), weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            for g in o.param_groups:
                g["lr"].fill_(0.01 * 3 ** -(i + 1))
            o.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


@devices
@splits()
def test_tensor_betas_filled_between_backward_and_step(made, split, device):
    """``betas`` as a tuple of 0-dim tensors, ``betas[0].fill_`` after the CPU part's early
    updates ran: the snapshot they were checked against held the same tuple (only top-level
    tensors were copied), so the change went unseen and the early updates, made with the old
    beta, were kept (a race before: here the worker is drained first, so it always lost)."""
    betas = lambda: (torch.tensor(0.9), torch.tensor(0.999))  # noqa: E731
    m, ref = net(), net()
    opt = hybrid(m, split, device, betas=betas(), weight_decay=0.1)
    made.append(opt)
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, lr=opt.param_groups[0]["lr"],
                                betas=betas(), weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            if o is opt:
                opt._worker.submit(lambda: None).result()  # the early updates are done
            for g in o.param_groups:
                g["betas"][0].fill_(0.9 - 0.1 * (i + 1))
            o.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


def _relaid(g, how):
    """``g``'s values in another memory layout: transposed storage, or a slice of a bigger one."""
    if how == "transposed" and g.dim() == 2:
        return g.t().contiguous().t()
    return torch.cat([g.reshape(-1, 1), torch.zeros_like(g).reshape(-1, 1)], 1)[:, 0].view(g.shape)


@pytest.mark.parametrize("how", ["transposed", "strided"])
@splits(("none", "backward_update", "next_forward"), during_backward=False)
def test_gradients_laid_out_unlike_their_parameter(made, split, how):
    """``p.grad`` given the same values in another layout between backward and ``step()``:
    fused kernels pair elements in memory order, so the device part (torch's class) stepped on
    scrambled values while the CPU part copied by value, and the result depended on the
    placement. Now every part steps on the values: the wrapped class over contiguous
    gradients; the user's gradient tensors are put back after ``step()``, and a closure's are
    re-laid after it ran."""
    (m, opt), (ref, ref_opt) = pair(made, split, "late", weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            def relay():
                loss_of(model, i).backward()
                if o is opt:
                    for p in model.parameters():
                        p.grad = _relaid(p.grad, how)
                        assert not p.grad.is_contiguous()

            if i == 2:  # from a closure: re-laid after it ran
                o.step(relay)
            else:
                relay()
                users = [p.grad for p in model.parameters()]
                o.step()
                if o is opt:  # the user's tensors are back (they may be views of a buffer)
                    assert all(p.grad is g for p, g in zip(model.parameters(), users))
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


# --- defect 8: parameters edited after step() --------------------------------------------------

CLIP = 0.1  # below the initial weights' range: clamping changes parameters every step


def _clamp_data(m):
    for p in m.parameters():
        p.data.clamp_(-CLIP, CLIP)


def _clamp_no_grad(m):
    with torch.no_grad():
        for p in m.parameters():
            p.clamp_(-CLIP, CLIP)


def _assign_data(m):
    """New memory each time (``p.data = t``): the streamed part kept writing into the old one,
    and its parameters stayed as assigned."""
    for p in m.parameters():
        p.data = p.data.clamp(-CLIP, CLIP)


PARAM_EDITS = {"p.data.clamp_": _clamp_data, "no_grad p.clamp_": _clamp_no_grad,
               "p.data = t": _assign_data}


@pytest.mark.parametrize("edit", list(PARAM_EDITS))
@devices
@splits()
def test_param_edits_after_step_are_kept(made, split, device, edit):
    """WGAN weight clipping after every step: kept for every placement (device part, CPU
    part, streamed part), as the wrapped optimizer keeps it."""
    (m, opt), (ref, ref_opt) = pair(made, split, device, lr=1e-2, weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            o.step()
            settle(o)  # next_forward: the parameters are read (and written) outside a forward
            PARAM_EDITS[edit](model)
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)


def reload_and_step(made, split, device, hybrid_pair, ref_pair, batch, **kw) -> None:
    """Save the hybrid's ``state_dict()``, rebuild it (everything offloaded) from it, and take
    one more step on both models: the saved masters must be what training continues from."""
    (m, opt), (ref, ref_opt) = hybrid_pair, ref_pair
    saved = opt.state_dict()
    opt.close()
    opt = hybrid(m, split, device, fraction=1.0, **kw)
    made.append(opt)
    opt.load_state_dict(saved)
    for model, o in ((m, opt), (ref, ref_opt)):
        loss_of(model, batch).backward()
        o.step()
        o.zero_grad()
        settle(o)
    assert_same_params(m, ref)


@splits()
def test_a_checkpoint_after_an_edit_keeps_the_edit(made, split):
    """A parameter clamped after step() and saved before the next one: the state dict's masters
    carry the edit, so an optimizer rebuilt from it continues as the wrapped class does (the
    edit was lost on reload while the masters still held the values before it)."""
    (m, opt), (ref, ref_opt) = pair(made, split, "late", lr=1e-2, weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        loss_of(model, 0).backward()
        o.step()
        o.zero_grad()
        settle(o)
        PARAM_EDITS["no_grad p.clamp_"](model)
    reload_and_step(made, split, "late", (m, opt), (ref, ref_opt), 1, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("edit", list(PARAM_EDITS))
@devices
@splits()
def test_bf16_param_edits_reach_the_fp32_masters(made, split, device, edit):
    """bf16 parameters, fp32 masters: a clamp after each step is taken into the masters where
    it changed a parameter (elsewhere they keep their precision), in the next step and in
    ``state_dict()``, as the master-weight reference does. The streamed part takes it on the
    device as it updates (and, outside a step, before saving), keeping no record."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    m, ref = net(torch.bfloat16), net(torch.bfloat16)
    opt = hybrid(m, split, device, param_update_in_fp32=True, **kw)  # a device part with masters
    made.append(opt)
    ref_opt = MasterWeightOptimizer(ref.parameters(), **kw)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            o.step()
            settle(o)
            PARAM_EDITS[edit](model)
            o.zero_grad()
    assert_same_params(m, ref)
    # saved after the last edit: its masters carry it
    reload_and_step(made, split, device, (m, opt), (ref, ref_opt), 3, param_update_in_fp32=True, **kw)


@pytest.mark.parametrize("when", ["before_backward", "before_step"])
@pytest.mark.parametrize("change", ["shape", "dtype", "strides"])
@splits(("none", "backward_update"), during_backward=False)
def test_data_of_another_layout_is_refused(made, split, change, when):
    """``p.data = t`` with ``t`` of another shape or dtype on an offloaded parameter: masters,
    state and staging were made for the old one (the CPU part copied the gradient into a
    staging slice of the old size: a truncated copy on CUDA); non-contiguous ``t`` is copied
    through a flat temporary, its update lost. The backward hook or ``step()`` names the fix
    instead."""
    (m, opt), _ = pair(made, split, "late", lr=1e-2)
    loss_of(m, 0).backward()
    opt.step()
    opt.zero_grad()
    settle(opt)
    w = m.l3.weight  # offloaded (among the last registered); 2-D, so it has strides to change
    assert id(w) in opt._streamed or opt._cpu.owns(w)

    def change_it():
        w.data = {"shape": lambda: torch.zeros(w.shape[0] + 1, *w.shape[1:]),
                  "dtype": lambda: w.data.double(),
                  "strides": lambda: w.data.t().contiguous().t()}[change]()

    fix = "assign t.contiguous()" if change == "strides" else "build a new HybridDeviceOptimizer"
    with pytest.raises(OffloadUsageError, match=rf"p\.data = .*{fix}"):
        if when == "before_backward":
            change_it()
            w.grad = None
            x = torch.randn(2, w.shape[1] if w.dim() > 1 else 1, dtype=w.dtype)
            (x @ w.t() if w.dim() > 1 else x * w).sum().backward()
        else:
            loss_of(m, 1).backward()
            change_it()
            w.grad = torch.zeros_like(w)
        opt.step()


@devices
@splits()
def test_gradients_zeroed_in_place_before_step(made, split, device):
    """``opt.zero_grad(set_to_none=False)`` between backward and step() (found by the fuzzer:
    with updates streamed during backward the zeroing raced their reads of ``.grad``): the early
    work is dropped first, and the step equals the wrapped class's over zero gradients."""
    (m, opt), (ref, ref_opt) = pair(made, split, device, lr=1e-2, weight_decay=0.1)
    for model, o in ((m, opt), (ref, ref_opt)):
        for i in range(3):
            loss_of(model, i).backward()
            if i == 1:
                o.zero_grad(set_to_none=False)
            o.step()
            o.zero_grad()
        settle(o)
    assert_same_params(m, ref)
    assert_same_state(opt, ref_opt)
