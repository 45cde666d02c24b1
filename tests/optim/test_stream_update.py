"""The streamed device update of ``HybridDeviceOptimizer`` (``stream_fraction``): part of the
offloaded parameters keep masters and state in pinned host memory and are updated on the device
chunk by chunk through a bounded staging area.

On the simulated device every split equals the wrapped class run without offloading, bit for bit
(parameters, state, master weights), in every overlap mode, with clipping between backward and
``step()``; checkpoints load across splits; the budget bounds the staging memory; a missing wait
is a ``SimulatedHazard``. GPU tests (``-m gpu``): the streamed part equals plain fused AdamW on
CUDA, and its peak memory stays within the budget."""
from __future__ import annotations

import copy
import io
import logging
import weakref

import pytest
import torch
from torch import nn

from cpu_offload import OffloadConfigError, OffloadUsageError, SimulatedDevice
from cpu_offload.core.simulated import SimulatedHazard
from cpu_offload.optim import OVERLAP_MODES, HybridDeviceOptimizer, to_wrapped_format
from cpu_offload.optim.balance import balanced_cpu_share, balanced_seconds
from cpu_offload.optim.reference import MasterWeightOptimizer
from cpu_offload.optim.stream_chunk import ChunkRunner
from cpu_offload.optim.stream_update import MIN_STREAM_BUDGET_BYTES, SLOTS, StreamedPart

from _support import optim_cuda

KW = dict(lr=1e-2, weight_decay=0.1)
BUDGET = MIN_STREAM_BUDGET_BYTES  # 1024-element chunks: big parameters are split
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def model(dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 80), nn.Tanh(),
                         nn.Linear(80, 40), nn.Linear(40, 3)).to(device=device, dtype=dtype)


def loss_of(m, i):
    p = next(m.parameters())
    gen = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 16, generator=gen).to(device=p.device, dtype=p.dtype)
    return m(x).float().square().mean()


def clip(m):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


def train(m, opt, steps, start=0, edit=clip):
    losses = []
    for i in range(start, start + steps):
        loss = loss_of(m, i)
        loss.backward()
        if edit is not None:
            edit(m)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, HybridDeviceOptimizer):
        opt.wait_params()
    return losses


def reference(dtype, device="cpu"):
    m = model(dtype, device)
    if dtype == torch.bfloat16:
        return m, MasterWeightOptimizer(m.parameters(), **KW)
    return m, torch.optim.AdamW(m.parameters(), fused=True, **KW)


def hybrid(m, fraction=1.0, stream=0.5, mode="none", device=None, **kw):
    opt = HybridDeviceOptimizer(
        m.parameters(), fraction, device=device or SimulatedDevice(), overlap=mode,
        stream_fraction=stream, stream_budget_bytes=kw.pop("budget", BUDGET), bucket_bytes=4096,
        cpu_chunk_bytes=4096 * 4, cpu_threads=1, param_update_in_fp32=True, **KW, **kw)
    if mode == "next_forward":
        opt.register_forward_waits(m)
    return opt


def ref_state(ref_opt):
    inner = ref_opt.optimizer if isinstance(ref_opt, MasterWeightOptimizer) else ref_opt
    return inner.state_dict()["state"]


def assert_same(m, opt, ref, ref_opt):
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert p.dtype == q.dtype and torch.equal(p, q), name
    sd = opt.state_dict()
    state, expected = to_wrapped_format(sd)["state"], ref_state(ref_opt)
    assert sorted(state) == sorted(expected)
    for i, entry in expected.items():
        assert sorted(state[i]) == sorted(entry)
        for k, v in entry.items():
            got = state[i][k].to(v.device)
            assert got.dtype == v.dtype and torch.equal(got, v), (i, k)
    if isinstance(ref_opt, MasterWeightOptimizer):
        masters = {i: e["master_weight"] for i, e in sd["state"].items() if "master_weight" in e}
        for i, w in enumerate(ref_opt.masters):
            assert torch.equal(masters[i].to(w.device), w), i


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("stream", [0.3, 1.0, "auto"])
@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_split_equals_the_wrapped_class(dtype, fraction, stream, mode):
    ref, ref_opt = reference(dtype)
    ref_losses = train(ref, ref_opt, 3)
    m = model(dtype)
    opt = hybrid(m, fraction, stream, mode)
    assert train(m, opt, 3) == ref_losses
    assert_same(m, opt, ref, ref_opt)
    streamed = opt.streamed_params()
    assert streamed and len(streamed) + len(opt.offloaded_params()) <= len(list(m.parameters()))
    assert (len(opt.offloaded_params()) == 0) == (stream == 1.0)
    opt.close()


@pytest.mark.parametrize("mode", ["backward_update", "next_forward"])
def test_gradient_edits_between_backward_and_step(mode):
    """Scaling, zeroing or dropping gradients of streamed parameters before step(): the streamed
    part reads .grad inside step(), so it is exact by construction."""
    def edit(mm):
        ps = list(mm.parameters())
        ps[0].grad.mul_(3.0)
        ps[2].grad = None
        ps[4].grad.zero_()

    ref, ref_opt = reference(torch.float32)
    ref_losses = train(ref, ref_opt, 3, edit=edit)
    m = model()
    opt = hybrid(m, 1.0, 0.6, mode)
    assert train(m, opt, 3, edit=edit) == ref_losses
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_max_grad_norm_clips_the_streamed_part_too():
    ref, ref_opt = reference(torch.float32)
    ref_losses = train(ref, ref_opt, 3)  # clip_grad_norm_(0.05) between backward and step
    m = model()
    opt = hybrid(m, 1.0, 0.5, "backward_update", max_grad_norm=0.05)
    assert train(m, opt, 3, edit=None) == ref_losses
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)  # the norm is summed in another order
    opt.close()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("load_with", [0.0, 0.7, 1.0])
def test_state_dict_round_trips_across_splits(dtype, load_with):
    ref, ref_opt = reference(dtype)
    ref_losses = train(ref, ref_opt, 4)
    m = model(dtype)
    opt = hybrid(m, 1.0, 0.3, "backward_update")
    assert train(m, opt, 2) == ref_losses[:2]
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    m2 = model(dtype)
    m2.load_state_dict(saved["model"])
    opt2 = hybrid(m2, 1.0, load_with, "next_forward")
    opt2.load_state_dict(saved["opt"])
    assert train(m2, opt2, 2, start=2) == ref_losses[2:]
    assert_same(m2, opt2, ref, ref_opt)
    opt2.close()


def test_wrapped_state_dict_loads_into_the_streamed_part():
    ref, ref_opt = reference(torch.float32)
    train(ref, ref_opt, 2)
    m = copy.deepcopy(ref)
    opt = hybrid(m, 1.0, 1.0)
    opt.load_state_dict(ref_opt.state_dict())
    assert train(m, opt, 2, start=2) == train(ref, ref_opt, 2, start=2)
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("budget", [BUDGET, 3 * BUDGET, 2**20])
def test_budget_bounds_the_device_staging(budget):
    dev = SimulatedDevice()
    sizes = []
    alloc = dev.alloc_device

    def record(nbytes, where):
        sizes.append(nbytes)
        return alloc(nbytes, where)

    dev.alloc_device = record
    m = model()
    opt = hybrid(m, 1.0, 1.0, device=dev, budget=budget)
    train(m, opt, 2)
    assert sizes and sum(sizes) <= 2 * budget  # two steps, each within the budget
    assert all(s <= budget // SLOTS for s in sizes)
    stats = opt.last_step_stats
    assert 0 < stats["stream_staging_bytes"] <= stats["stream_budget_bytes"] == budget
    n = sum(p.numel() for p in m.parameters())
    if budget == BUDGET:  # 1024-element chunks: the 64x80 weight alone takes five
        assert len(sizes) == 2 * SLOTS  # every step allocates its slots
        assert opt.last_step_stats["stream_staging_bytes"] == sum(sizes[SLOTS:])
    # fp32 AdamW: exp_avg and exp_avg_sq (8 B/param) copied in at the second step (the first
    # creates them), and out at both
    assert 8 * n < stats["stream_bytes_to_device"] < 8 * n + 4096
    assert 16 * n < stats["stream_bytes_to_host"] < 16 * n + 4096
    opt.close()


@pytest.mark.parametrize("mode", ["none", "next_forward"])  # compute stream, update stream
@pytest.mark.parametrize("dtype", DTYPES)
def test_missing_wait_for_the_copy_in_is_a_hazard(monkeypatch, dtype, mode):
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, mode)
    train(m, opt, 1)  # fp32: the state to copy in exists from the second step on
    monkeypatch.setattr(StreamedPart, "_wait_chunk", lambda self, event: None)
    loss_of(m, 1).backward()
    with pytest.raises(SimulatedHazard, match="still writes"):
        opt.step()


# ---------------------------------------------------------------------------------------------
# next_forward: the streamed update on its own stream, overlapping the next forward

def _step_with_update_queued(dev, dtype=torch.float32, stream=1.0):
    m = model(dtype)
    opt = hybrid(m, 1.0, stream, "next_forward", device=dev)
    train(m, opt, 1)  # the first step creates the state (and waits for each chunk's copy out)
    loss_of(m, 1).backward()
    begin, before = len(dev.log), opt._parts[0].update_stream.queued
    opt.step()
    # what the compute stream waited for on the update stream, of this step's update
    waited = [e for e in dev.log[begin:]
              if e[:3] == ("wait", "compute", opt._parts[0].update_stream.name) and e[3] > before]
    return m, opt, dev.log[begin:], waited


@pytest.mark.parametrize("dtype", DTYPES)
def test_next_forward_returns_before_the_update_and_forwards_wait_for_their_own_chunks(dtype):
    dev = SimulatedDevice()
    m, opt, during_step, waited = _step_with_update_queued(dev, dtype)
    part = opt._parts[0]
    assert ("run_on", part.update_stream.name) in during_step and not waited
    queued = len(part.update_stream.pending)
    assert queued > 0  # still queued when step() returns
    layers = [c for c in m.children() if list(c.parameters())]
    left = []
    for layer in layers:
        layer.register_forward_hook(lambda *_: left.append(len(part.update_stream.pending)))
    opt.zero_grad()
    loss = loss_of(m, 2)
    # chunks in forward order: the first layer's forward waited for its own chunks only (the
    # last layers' are still queued after it), each later one for a few more, the last for all
    assert 0 < left[0] <= queued and left == sorted(left, reverse=True) and left[-1] == 0
    loss.backward()
    opt.step()
    opt.close()
    assert dev.pending_ops() == 0


def test_a_forward_that_does_not_wait_for_its_chunks_is_a_hazard(monkeypatch):
    m, opt, *_ = _step_with_update_queued(SimulatedDevice())
    monkeypatch.setattr(StreamedPart, "_wait_forward", lambda self, event: None)
    opt.zero_grad()
    with pytest.raises(SimulatedHazard, match="still writes"):
        loss_of(m, 2)


def test_an_update_stream_that_does_not_wait_for_the_copy_in_is_a_hazard(monkeypatch):
    m = model()
    opt = hybrid(m, 1.0, 1.0, "next_forward")
    train(m, opt, 1)
    waits = []
    monkeypatch.setattr(StreamedPart, "_wait_chunk", lambda self, event: waits.append(event))
    loss_of(m, 1).backward()
    with pytest.raises(SimulatedHazard, match="still writes"):
        opt.step()
    assert waits


def test_zeroing_gradients_in_place_waits_for_the_update_that_reads_them(monkeypatch):
    m, opt, *_ = _step_with_update_queued(SimulatedDevice())
    opt.zero_grad(set_to_none=False)  # ordered: fine
    opt.close()
    m, opt, *_ = _step_with_update_queued(SimulatedDevice())
    monkeypatch.setattr(StreamedPart, "order_params", lambda self: None)
    with pytest.raises(SimulatedHazard, match="still reads or writes"):
        opt.zero_grad(set_to_none=False)
    monkeypatch.undo()
    opt.close()


def test_wait_params_orders_the_whole_update(monkeypatch):
    m, opt, *_ = _step_with_update_queued(SimulatedDevice())
    opt.wait_params()  # ordered: fine
    opt.close()
    m, opt, *_ = _step_with_update_queued(SimulatedDevice())
    monkeypatch.setattr(StreamedPart, "order_params", lambda self: None)
    monkeypatch.setattr(StreamedPart, "finish", lambda self: None)
    with pytest.raises(SimulatedHazard, match="still writes"):
        opt.wait_params()
    monkeypatch.undo()
    opt.close()


@pytest.mark.parametrize("edit", ["wait_params", "state_dict", "reload", "zero_in_place", "none"])
def test_next_forward_stays_exact_with_reads_between_steps(edit):
    """Between step() and the next forward: wait_params, state_dict (and loading it back),
    reload_master_weights, in-place zero_grad or nothing: the numbers stay the wrapped class's,
    and nothing is left queued or held on the device at close()."""
    ref, ref_opt = reference(torch.bfloat16)
    m = model(torch.bfloat16)
    dev = _Tracking()
    opt = hybrid(m, 1.0, 0.6, "next_forward", device=dev)
    for i in range(4):
        for mm, o in ((ref, ref_opt), (m, opt)):
            loss_of(mm, i).backward()
            o.step()
            if mm is m and edit == "wait_params":
                opt.wait_params()
                assert all(torch.isfinite(p).all() for p in m.parameters())
            elif mm is m and edit == "state_dict":
                opt.load_state_dict(opt.state_dict())
            elif edit == "reload":  # masters from the (bf16) parameters, on both sides
                if mm is m:
                    opt.reload_master_weights()
                else:
                    for w, q in zip(ref_opt.masters, ref.parameters()):
                        w.copy_(q)
            o.zero_grad(set_to_none=edit != "zero_in_place" or mm is ref)
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()
    assert dev.pending_ops() == 0 and dev.live_device_buffers() == 0


def test_next_forward_frees_the_staging_of_one_update_before_the_next():
    dev = _Tracking()
    m = model()
    opt = hybrid(m, 1.0, 1.0, "next_forward", device=dev)
    for i in range(3):
        loss_of(m, i).backward()
        opt.step()
        assert dev.live_device_buffers() == SLOTS  # this update's slots only
        opt.zero_grad()
    opt.wait_params()
    assert dev.live_device_buffers() == 0  # freed by wait_params (steady memory)
    loss_of(m, 3).backward()
    opt.step()
    opt.zero_grad()
    loss_of(m, 4)  # the forward that waits for the last chunk frees the staging
    assert dev.live_device_buffers() == 0
    opt.close()


def test_next_forward_needs_forward_waits_for_streamed_parameters_too():
    m = model()
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, device=SimulatedDevice(), overlap="next_forward",
                                stream_fraction=1.0, stream_budget_bytes=BUDGET, lr=1e-2)
    loss_of(m, 0).backward()
    with pytest.raises(OffloadUsageError, match="register_forward_waits"):
        opt.step()
    opt.register_forward_waits(m)
    opt.step()
    opt.close()


class _Tracking(SimulatedDevice):
    """The simulated device, remembering (weakly) every device buffer it handed out."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def alloc_device(self, nbytes, device):
        t = super().alloc_device(nbytes, device)
        self.refs.append(weakref.ref(t))
        return t

    def live_device_buffers(self):
        return sum(r() is not None for r in self.refs)


def test_zero_streams_nothing():
    m = model()
    opt = hybrid(m, 1.0, 0)
    train(m, opt, 1)
    assert opt.streamed_params() == [] and opt.stream_fraction == 0.0
    assert opt.last_step_stats["stream_bytes_to_device"] == 0
    assert len(opt.offloaded_params()) == len(list(m.parameters()))
    opt.close()


def test_auto_is_reproducible_on_the_simulated_device_and_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="cpu_offload"):
        m = model(torch.bfloat16)
        opt = hybrid(m, 1.0, "auto")
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))]})
    logged = [r for r in caplog.records if "stream_fraction='auto'" in r.getMessage()]
    assert len(logged) == 1
    share = 1 - balanced_cpu_share(2.07e9, 43e9, 2, 12)  # SimulatedDevice.nominal_rates
    assert opt.stream_fraction == pytest.approx(share) and 0.55 < share < 0.65
    again = hybrid(model(torch.bfloat16), 1.0, "auto")
    assert again.stream_fraction == opt.stream_fraction
    assert [p.shape for p in again.streamed_params()] == [p.shape for p in opt.streamed_params()[:-1]]
    opt.close()
    again.close()


def test_balance_matches_the_issue_estimate():
    x = balanced_cpu_share(2.07e9, 43e9, 2, 12)
    assert x == pytest.approx(0.39, abs=0.01)
    rates = {"cpu_params_per_s": 2.07e9, "h2d_bytes_per_s": 43e9, "d2h_bytes_per_s": 43e9}
    t = balanced_seconds(1.51e9, x, rates, 2, 12)
    assert t["cpu_s"] == pytest.approx(t["h2d_s"]) and 0.27 < t["bound_s"] < 0.30


@pytest.mark.parametrize("value", ["half", -0.1, 1.5, True, float("nan"), None, "AUTO"])
def test_bad_stream_fraction(value):
    with pytest.raises(OffloadConfigError, match="stream_fraction must be 'auto' or a number in"):
        hybrid(model(), 1.0, value)


@pytest.mark.parametrize("hidden, budget", [(2048, 384 * 2**20), (256, 3 * 2**20)])
def test_full_chunks_are_not_cut_by_their_padding(hidden, budget):
    """The chunks of GPT layers (bf16, AdamW) are as few as the elements need: each chunk's
    host work costs a step time, and a chunk filled to the element budget used to be cut in
    two by its pieces' alignment padding (80 chunks instead of 52 for eight layers of hidden
    2048 at the default budget)."""
    from cpu_offload.examples.gpt import GPTConfig, build_model
    from cpu_offload.optim.stream_plan import plan_ranges
    cfg = GPTConfig(hidden=hidden, heads=4, seq=8, batch=1, layers=8, dtype=torch.bfloat16)
    params = list(build_model(cfg, "meta").parameters())
    chunk_elems, ranges = plan_ranges(params, [True] * len(params), budget, 2, True)
    total = sum(p.numel() for p in params)
    assert len(ranges) == -(-total // chunk_elems)
    assert chunk_elems * 17 <= budget // SLOTS  # master, gradient, mask, exp_avg, exp_avg_sq


@pytest.mark.parametrize("value", [1000, 2.5, True, None])
def test_bad_stream_budget(value):
    with pytest.raises(OffloadConfigError, match="stream_budget_bytes"):
        hybrid(model(), 1.0, 0.5, budget=value)


# ---------------------------------------------------------------------------------------------
# CUDA

@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")  # also fills fresh slots: copies in must follow it
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [BUDGET, 2**20])
@pytest.mark.parametrize("mode", ["backward_update", "next_forward"])
def test_streamed_part_is_bit_identical_to_fused_adamw_on_cuda(dtype, budget, mode):
    """next_forward: the update runs on its own stream while the next forward runs; each
    step's forward in ``train`` waits only for its own chunks."""
    ref, ref_opt = reference(dtype, "cuda")
    ref_losses = train(ref, ref_opt, 4)
    m = model(dtype, "cuda")
    opt = hybrid(m, 1.0, 1.0, mode, device=_cuda(), budget=budget)
    assert train(m, opt, 4) == ref_losses
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_streamed_peak_memory_within_the_budget_on_cuda():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    budget = 2**20 * 2
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, stream_fraction=1.0, stream_budget_bytes=budget,
                                device=_cuda(), lr=1e-3)
    for i in range(3):
        m(torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        # the first step lets AdamW create its state on the device, one chunk at a time
        # (2 x 4 B/param of a chunk; a chunk is a slot, at 12 B/param)
        assert peak <= (budget if i else budget + budget // SLOTS), (i, peak, budget)
        opt.zero_grad()
    assert 0 < opt.last_step_stats["stream_staging_bytes"] <= budget
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_next_forward_holds_staging_only_until_the_update_is_waited_for_on_cuda():
    """next_forward: step() returns with the update queued, holding the slots (and the gradients
    it reads); wait_params (or the forward that reaches the last chunk) gives them back."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    budget = 2**20 * 2
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, stream_fraction=1.0, stream_budget_bytes=budget,
                                device=_cuda(), overlap="next_forward", lr=1e-3)
    opt.register_forward_waits(m)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    base = None
    for i in range(3):
        m(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        held = torch.cuda.memory_allocated()
        opt.wait_params()
        torch.cuda.synchronize()
        if base is not None:
            grads = sum(p.numel() * p.element_size() for p in m.parameters())
            assert 0 < held - base <= budget + grads, (i, held - base)
            assert torch.cuda.memory_allocated() == base, i
        base = torch.cuda.memory_allocated()
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("mode", ["backward_update", "next_forward"])
def test_auto_split_on_cuda_each_part_equals_its_class(mode):
    """The measured "auto" split on a GPT stack: CPU-path parameters equal fused AdamW on the
    CPU, streamed ones fused AdamW on the GPU (fp32 masters), bit for bit."""
    m = optim_cuda.model()
    opt = optim_cuda.hybrid(m, 1.0, mode, stream_fraction="auto", param_update_in_fp32=True)
    streamed = {id(p) for p in opt.streamed_params()}
    on_cpu = {id(p) for p in opt.offloaded_params()}
    assert streamed and on_cpu and opt.split_estimate()["bound_s"] > 0
    cpu_ref = optim_cuda.CpuReference(m)
    gpu_ref = MasterWeightOptimizer([p.detach().clone().requires_grad_() for p in m.parameters()],
                                    **optim_cuda.KW)
    for i in range(3):
        optim_cuda.loss_of(m, i).backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        opt.zero_grad()
        want_cpu = cpu_ref.step(grads)
        for q, g in zip(gpu_ref.params, grads):
            q.grad = g
        gpu_ref.step()
        opt.wait_params()
        for p, a, b in zip(m.parameters(), want_cpu, gpu_ref.params):
            if id(p) in streamed:
                assert torch.equal(p, b)
            else:
                assert torch.equal(p.detach().cpu(), a)
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_the_rest_queued_by_the_launcher_thread_equals_the_class_on_cuda():
    """next_forward on CUDA: the chunks after the first are queued by the launcher's thread
    while the caller zeroes the gradients and runs the next forward; every parameter equals
    fused AdamW on the GPU over fp32 masters, bit for bit."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, stream_fraction=1.0,
                                stream_budget_bytes=2 * 2**20, device=_cuda(),
                                overlap="next_forward", lr=1e-3)
    opt.register_forward_waits(m)
    part = opt._parts[0]
    part.ahead_chunks = 1
    assert len(part.chunks) > 8
    ref = MasterWeightOptimizer([p.detach().clone().requires_grad_() for p in m.parameters()], lr=1e-3)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    deferred = 0
    for i in range(3):
        m(x * (i + 1)).float().square().mean().backward()
        grads = [p.grad.clone() for p in m.parameters()]
        opt.step()
        deferred += part._rest_pending
        opt.zero_grad()
        for q, g in zip(ref.params, grads):
            q.grad = g
        ref.step()
    opt.wait_params()
    assert deferred == 3
    for p, q in zip(m.parameters(), ref.params):
        assert torch.equal(p, q)
    opt.close()


def _failing_chunk_update(monkeypatch, fails, message="update failed"):
    """Patch ``ChunkRunner._step`` so that a chunk update raises ``RuntimeError(message)`` where
    ``fails(n, early)`` says so (``n``: its number, from 1; ``early``: started in backward);
    returns the list that gets one entry per chunk update, failed ones included."""
    calls = []
    update = ChunkRunner._step

    def failing(self, chunk, pieces, views, grads, scale=None, early=False):
        calls.append(1)
        if fails(len(calls), early):
            raise RuntimeError(message)
        update(self, chunk, pieces, views, grads, scale, early)

    monkeypatch.setattr(ChunkRunner, "_step", failing)
    return calls


def _cuda():
    from cpu_offload import CudaDevice
    return CudaDevice()


@pytest.mark.parametrize("dtype", DTYPES)
def test_pinned_memory_is_allocated_at_construction_only(dtype):
    dev = SimulatedDevice()
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, device=dev)
    allocs, nbytes = dev.host_allocs, dev.host_bytes_allocated
    train(m, opt, 3)
    assert (dev.host_allocs, dev.host_bytes_allocated) == (allocs, nbytes)
    state = sum(p.numel() for p in m.parameters()) * 4 * (3 if dtype == torch.bfloat16 else 2)
    assert state <= nbytes <= 2 * state  # masters and state, packed (not rounded per tensor)
    opt.close()


@pytest.mark.parametrize("mode", ["none", "next_forward"])
def test_an_error_in_the_update_leaves_nothing_queued(monkeypatch, mode):
    dev = SimulatedDevice()
    m = model()
    opt = hybrid(m, 1.0, 1.0, mode, device=dev)
    train(m, opt, 1)
    _failing_chunk_update(monkeypatch, lambda n, early: n == 2 and not early)  # in step()
    loss_of(m, 1).backward()
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    assert dev.pending_ops() == 0
    _next_step_works(monkeypatch, m, opt, start=2)  # slots freed in order, nothing bound to them


def test_a_failed_state_allocation_keeps_the_chunks_earlier_pieces_on_the_host(monkeypatch):
    # A chunk's copies out are queued together; a piece whose host state cannot be allocated
    # (first step) must not keep the pieces before it, already updated on the device, from
    # reaching host memory.
    dev = SimulatedDevice()
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, device=dev, budget=2**22)
    part = opt._parts[0]
    seen = []
    host_state = ChunkRunner._host_state

    def failing(self, pc, name, v):
        seen.append(pc)
        if pc is not seen[0]:
            raise RuntimeError("no pinned memory")
        return host_state(self, pc, name, v)

    monkeypatch.setattr(ChunkRunner, "_host_state", failing)
    before = [p.detach().clone() for p in part.params]
    loss_of(m, 0).backward()
    with pytest.raises(RuntimeError, match="no pinned memory"):
        opt.step()
    dev.synchronize()
    assert dev.pending_ops() == 0
    first = seen[0]
    param = part.params[first.index].detach().view(-1)[first.start:first.stop]
    master = part.masters()[first.index].view(-1)[first.start:first.stop]
    assert not torch.equal(param, before[first.index].view(-1)[first.start:first.stop])  # updated
    assert torch.equal(master.to(torch.bfloat16), param)  # and its master copied out
    opt.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_param_group_and_reload_master_weights(dtype):
    ref, ref_opt = reference(dtype)
    m = model(dtype)
    layers = list(m.children())
    opt = HybridDeviceOptimizer(
        layers[0].parameters(), 1.0, device=SimulatedDevice(), stream_fraction=0.5,
        stream_budget_bytes=BUDGET, cpu_threads=1, param_update_in_fp32=True, **KW)
    for layer in layers[1:]:
        if list(layer.parameters()):
            opt.add_param_group({"params": list(layer.parameters())})
    assert len(opt.streamed_params()) > 1
    assert train(m, opt, 2) == train(ref, ref_opt, 2)
    assert_same(m, opt, ref, ref_opt)
    with torch.no_grad():  # parameters changed outside the optimizer, on both sides
        for p, q in zip(m.parameters(), ref.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
    opt.reload_master_weights()
    if isinstance(ref_opt, MasterWeightOptimizer):
        for w, q in zip(ref_opt.masters, ref.parameters()):
            w.copy_(q)
    assert train(m, opt, 2, start=2) == train(ref, ref_opt, 2, start=2)
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_refilling_a_slot_before_its_copy_out_is_caught(monkeypatch):
    """Without the wait for the copy out of the chunk two before, the copy in of the next chunk
    overwrites a slot whose state has not reached the host yet: the simulation defers the copy
    out past it, so the state goes wrong."""
    ref, ref_opt = reference(torch.float32)
    ref_losses = train(ref, ref_opt, 3)
    m = model()
    opt = hybrid(m, 1.0, 1.0)

    def only_after_compute(self, event):  # the slot is allocated, its copy out not waited for
        self._device.wait_event(self.h2d, self._device.record_event(self._device.current_stream()))

    monkeypatch.setattr(StreamedPart, "_wait_slot", only_after_compute)
    assert len(opt._parts[0].chunks) > SLOTS
    losses = train(m, opt, 3)
    same = all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))
    assert losses != ref_losses or not same
    opt.close()


def test_measured_rates_run_through_the_device():
    """What "auto" measures on a real device (here run on the simulated one, whose copies are
    plain CPU copies): the link both ways through the device interface, the CPU update while
    that traffic runs."""
    from cpu_offload.optim import balance
    dev = SimulatedDevice()
    calls = []
    probe = lambda: calls.append(torch.ones(1000).sum())  # noqa: E731
    r = balance.rates(_NoNominal(dev), torch.device("cpu"), lambda: (probe, 1000), 1)
    assert r["h2d_bytes_per_s"] > 0 and r["cpu_params_per_s"] > 0 and len(calls) == 3
    assert len(dev.copies("h2d")) >= 4 and len(dev.copies("d2h")) >= 4 and dev.pending_ops() == 0


class _NoNominal:
    """A simulated device that asks to be measured."""

    def __init__(self, dev):
        self._dev = dev

    def nominal_rates(self):
        return None

    def __getattr__(self, name):
        return getattr(self._dev, name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_pinned_allocation_after_construction_with_checkpoints(dtype):
    dev = SimulatedDevice()
    m = model(dtype)
    opt = hybrid(m, 1.0, 0.6, device=dev, mode="next_forward")
    allocs = dev.host_allocs
    train(m, opt, 2)
    opt.load_state_dict(opt.state_dict())
    opt.reload_master_weights()
    train(m, opt, 1, start=2)
    assert dev.host_allocs == allocs
    opt.close()


@pytest.mark.parametrize("fence", [True, False], ids=["fenced", "unfenced"])
def test_dropping_the_optimizer_waits_for_its_queued_copies(monkeypatch, fence):
    """The streamed part's copies go through the driver on CUDA (``copy_many``), which does not
    tell torch's pinned allocator; so an optimizer dropped (without ``close``) while its copies
    are still queued lets its pinned buffers go only after them. Without that wait the
    simulated device catches a copy whose pinned buffer was let go."""
    if not fence:
        monkeypatch.setattr("cpu_offload.optim.stream_update._fence", lambda device: None)
    import gc
    dev = SimulatedDevice()
    m = model(torch.bfloat16)
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, stream_fraction=1.0, overlap="next_forward",
                                stream_budget_bytes=BUDGET, device=dev, **KW)
    opt.register_forward_waits(m)
    for i in range(3):  # the first step creates the state, chunk by chunk, waiting for each
        loss_of(m, i).backward()
        opt.step()  # returns with the update and its copies queued
        opt.zero_grad()
    assert dev.pending_ops() > 0
    for h in opt._hooks + opt._module_hooks:
        h.remove()
    opt._worker.shutdown()
    opt._finalizer.detach()  # the parts dropped with their copies queued: only the fence waits
    del opt
    gc.collect()
    if fence:
        dev.synchronize()
    else:
        with pytest.raises(SimulatedHazard, match="pinned host buffer that was let go"):
            dev.synchronize()


# ---------------------------------------------------------------------------------------------
# parameters torch's optimizers handle that the streamed part must too

class _WithEmpty(nn.Module):
    """Zero-size parameters between and after the others (their gradients are zero-size)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.empty = nn.Parameter(torch.zeros(0, 8))
        self.b = nn.Linear(64, 3)
        self.empty_last = nn.Parameter(torch.zeros(5, 0))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) + self.empty.sum() + self.empty_last.sum()


def with_empty(dtype):
    torch.manual_seed(0)
    return _WithEmpty().to(dtype)


def reference_of(m, cls=None, **kw):
    """What the part must equal: the class over fp32 masters (bf16/fp16), or over ``m``
    (``KW`` unless ``kw`` are given)."""
    kw = kw or KW
    if next(m.parameters()).dtype != torch.float32:
        return MasterWeightOptimizer(m.parameters(), cls, **kw)
    return (cls or torch.optim.AdamW)(m.parameters(), **({"fused": True} if cls is None else {}), **kw)


@pytest.mark.parametrize("mode", ["none", "next_forward"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size_parameters_are_streamed_like_torch(dtype, mode):
    """torch's AdamW keeps state for zero-size parameters. They stay in the device part (there
    is nothing to offload), so that step(), state_dict() (IndexError before) and
    load_state_dict() work and agree with torch."""
    ref = with_empty(dtype)
    ref_opt = reference_of(ref)
    m = with_empty(dtype)
    opt = hybrid(m, 1.0, 1.0, mode)
    assert len(opt.streamed_params()) == sum(p.numel() > 0 for p in m.parameters())
    assert train(m, opt, 3) == train(ref, ref_opt, 3)
    assert_same(m, opt, ref, ref_opt)
    opt.load_state_dict(opt.state_dict())
    assert train(m, opt, 2, start=3) == train(ref, ref_opt, 2, start=3)
    assert_same(m, opt, ref, ref_opt)
    opt.close()


ADAGRAD = dict(lr=0.05, initial_accumulator_value=0.1, lr_decay=0.01)


@pytest.mark.parametrize("mode", ["none", "next_forward"])
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float16, id="fp16")])
def test_state_made_at_construction_is_streamed(dtype, mode):
    """Adagrad makes its state in its constructor: over a low-precision parameter's master that
    was an empty slot key (the first step raised "size of tensor a (0) must match"). The part
    keeps that state in host memory from construction on; state_dict() before any step, and
    every step after, equal the class over fp32 masters (bf16/fp16) or over the parameters."""
    torch.manual_seed(0)
    ref = model(dtype)
    ref_opt = reference_of(ref, torch.optim.Adagrad, **ADAGRAD)
    m = model(dtype)
    opt = HybridDeviceOptimizer(
        m.parameters(), 1.0, torch.optim.Adagrad, torch.optim.Adagrad, device=SimulatedDevice(),
        overlap=mode, stream_fraction=1.0, stream_budget_bytes=BUDGET, cpu_threads=1, **ADAGRAD)
    if mode == "next_forward":
        opt.register_forward_waits(m)
    assert len(opt.streamed_params()) == len(list(m.parameters()))
    assert_same(m, opt, ref, ref_opt)  # the state made at construction, before any step
    assert train(m, opt, 3) == train(ref, ref_opt, 3)
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("early", [False, True], ids=["step", "early"])
@pytest.mark.parametrize("overlapped", [False, True], ids=["none", "next_forward"])
def test_the_part_keeps_no_hyperparameter_tensor_it_was_given(overlapped, early):
    """Tensors among the hyperparameters given to the part (its constructor, its optimizer
    class's keyword arguments, ``step()``, ``on_grad()``) may be a user's, changed in place or
    by a scheduler later: none is held once the update that used it is done (and, overlapped,
    waited for). An update started in backward with a copy of the values step() gets is kept."""
    import gc
    dev = SimulatedDevice()
    m = model(torch.bfloat16)
    params = list(m.parameters())
    refs = []

    def given(lr=1e-2):
        lr = torch.tensor(lr)
        refs.append(weakref.ref(lr))
        return [{"lr": lr, "weight_decay": 0.1}]

    kw_lr = torch.tensor(1e-2)
    refs.append(weakref.ref(kw_lr))
    part = StreamedPart(dev, params, [0] * len(params), given(),
                        lambda groups: torch.optim.AdamW(groups, lr=kw_lr, fused=True),
                        BUDGET, overlapped=overlapped, early=early)
    del kw_lr
    for i in range(3):
        loss_of(m, i).backward()
        if early and i:
            for k, p in enumerate(params):
                part.backward.on_grad(k, p.grad, given())
        part.step(given())
        part.finish()
        for p in params:
            p.grad = None
    if early:
        assert part.backward.started == part.backward.kept == len(part.chunks)
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
    part.sync()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_chunk_updates_edit_merge_allocates_nothing(dtype):
    """A streamed chunk's update takes the user's edits into the slot's masters through the
    pieces' gradient and mask regions of the slot: no allocation (``torch.profiler``'s memory
    events, which see the temporaries inside an op), so the staging budget holds. On an H200
    an earlier version went 0.23 MiB over a 2 MiB budget: ``torch.where`` over fp32 and bf16
    made an fp32 copy. The result is ``guards.merge_edited``'s, bit for bit."""
    from torch.profiler import ProfilerActivity, profile

    from cpu_offload.optim.guards import merge_edited
    from cpu_offload.optim.stream_chunk import merge_edits

    g = torch.Generator().manual_seed(0)
    masters, params, want = [], [], []
    for shape in [(1,), (3,), (3, 4), (4097,), (65537,)]:
        master = torch.randn(shape, generator=g)
        param = master.to(dtype)
        param.view(-1)[::3] = 0.25  # edited
        expected = master.clone()
        merge_edited(expected, param)
        masters.append(master)
        params.append(param)
        want.append(expected)
    scratch = [torch.empty(4 * p.numel(), dtype=torch.uint8) for p in params]
    masks = [torch.empty(p.numel(), dtype=torch.uint8) for p in params]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        merge_edits(masters, params, scratch, masks)
    allocated = [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]
    assert allocated == []
    for got, expected in zip(masters, want):
        assert torch.equal(got, expected)


def test_typed_views_of_a_slot_equal_the_view_chain_in_one_call_each():
    """``typed_view`` gives what ``raw[:n].view(dtype).view(shape)`` gives (same memory, shape,
    contiguity) in one torch call once the buffer's typed view is made, and falls back to that
    chain where the buffer has no view of that dtype (its size not a multiple of it, a buffer
    that is not bytes) or the view no elements."""
    from cpu_offload.compat import TorchDispatchMode
    from cpu_offload.optim.stream_chunk import typed_view

    class Calls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.n += 1
            return func(*args, **(kwargs or {}))

    slot, bases = torch.arange(4096, dtype=torch.int64).to(torch.uint8), {}
    cases = [(256, 512, torch.float32, (4, 8)), (512, 1024, torch.bfloat16, (16, 16)),
             (1024, 1088, torch.bool, (8, 8)), (1280, 1536, torch.bfloat16, (3, 5)),  # a prefix
             (1536, 1540, torch.float32, ()), (2048, 2560, torch.float64, (64,))]
    for start, stop, dtype, shape in cases:
        raw = slot[start:stop]
        n = torch.Size(shape).numel() * dtype.itemsize
        want = raw[:n].view(dtype).view(shape)
        typed_view(raw, dtype, shape, bases)  # the buffer's typed view, made once
        Calls.n = 0
        with Calls():
            got = typed_view(raw, dtype, shape, bases)
        assert Calls.n == 1, (dtype, shape)
        assert (got.shape, got.dtype, got.data_ptr(), got.is_contiguous()) == \
            (want.shape, want.dtype, want.data_ptr(), True)
        assert torch.equal(got.flatten().view(torch.uint8), want.flatten().view(torch.uint8))
    for raw, dtype, shape in [(torch.zeros(10, dtype=torch.uint8)[4:8], torch.float32, (1,)),  # 10 bytes
                              (slot[256:256], torch.float32, (0,)),    # no elements
                              (torch.zeros(16).view(-1)[4:8].view(torch.uint8), torch.float32, (4,))]:
        got = typed_view(raw, dtype, shape, {})
        assert got.data_ptr() == raw.data_ptr() and got.shape == torch.Size(shape)


def test_state_is_copied_out_from_its_slot_bytes_only_while_it_is_the_staged_view():
    """The copies out of a chunk's state reuse the slot bytes staged for it (one view fewer per
    state tensor at each launch) only while the class's state is that very view, at that
    address: a tensor the class put in its place, or ``set_`` elsewhere, is copied from its
    own bytes."""
    from cpu_offload.optim.stream_chunk import PieceViews
    from cpu_offload.optim.transfer import flat_bytes

    slot = torch.arange(64, dtype=torch.uint8)
    raw = slot[16:48]
    staged = raw.view(torch.float32).view(2, 4)
    views = PieceViews(None, None, None, {"exp_avg": staged}, raw={"exp_avg": raw})
    assert views.state_bytes("exp_avg", staged) is raw
    other = staged.clone()
    got = views.state_bytes("exp_avg", other)
    assert got is not raw and got.data_ptr() == other.data_ptr() and torch.equal(got, flat_bytes(other))
    elsewhere = torch.zeros(8)
    staged.set_(elsewhere)  # same object, other memory
    assert views.state_bytes("exp_avg", staged).data_ptr() == elsewhere.data_ptr()
    assert views.state_bytes("step", torch.ones(1)).data_ptr() != raw.data_ptr()  # not staged


@pytest.mark.parametrize("ahead", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunks_queued_after_the_device_part_stay_exact(dtype, ahead):
    """next_forward queues the first chunks, then the device part's update, then the rest
    (``StreamedPart.step(ahead=...)``): the split changes the order on the host only."""
    ref, ref_opt = reference(dtype)
    ref_losses = train(ref, ref_opt, 3)
    m = model(dtype)
    opt = hybrid(m, 0.8, 1.0, "next_forward")
    part = opt._parts[0]
    part.ahead_chunks = ahead
    assert len(part.chunks) > ahead  # some chunks are queued after the device part
    assert opt._dev_part.optimizer is not None  # which updates parameters of its own
    assert train(m, opt, 3) == ref_losses
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_step_returns_before_the_rest_is_queued_and_the_rest_reads_the_gradients_step_saw(dtype):
    """next_forward: ``step()`` queues the first chunks and the device part, and hands the rest
    to a launcher (on the simulated device it runs when something waits for it, the latest it
    could): ``step()`` returns with chunks not queued yet, so the next forward's first modules
    can run under the streaming. Those chunks read the gradients ``step()`` saw, though
    ``zero_grad()`` has dropped them since, and every step is exact."""
    ref, ref_opt = reference(dtype)
    ref_losses = train(ref, ref_opt, 3)
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, "next_forward")
    part = opt._parts[0]
    part.ahead_chunks = 1
    losses = []
    for i in range(3):
        loss = loss_of(m, i)  # its forward waits for the last step's chunks: all are queued then
        loss.backward()
        clip(m)
        opt.step()
        q = part._queuing
        assert q is not None and q.queued == 1 < len(q.live)  # the rest is not queued yet
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_params()
    assert part._queuing is None
    assert losses == ref_losses
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_an_error_in_the_deferred_rest_raises_at_the_next_wait_and_the_next_step_works(monkeypatch):
    """A chunk of the rest fails after ``step()`` returned: the error is raised where the
    optimizer is next waited for (here the next forward's wait for its parameters), nothing is
    left queued or half bound, and training goes on."""
    dev = SimulatedDevice()
    m = model()
    opt = hybrid(m, 1.0, 1.0, "next_forward", device=dev)
    part = opt._parts[0]
    part.ahead_chunks = 1
    train(m, opt, 1)
    calls = _failing_chunk_update(monkeypatch, lambda n, early: n == 2)  # the rest's first chunk
    loss_of(m, 1).backward()
    opt.step()  # returns: the failing chunk is not queued yet
    assert len(calls) == 1
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="update failed"):
        loss_of(m, 2)
    assert part._queuing is None and len(calls) == 2  # nothing queued after the failure
    monkeypatch.undo()
    opt.wait_params()
    assert dev.pending_ops() == 0
    assert_no_key_bound_to_a_slot(opt)
    train(m, opt, 1, start=3)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    opt.close()


def test_an_error_between_the_first_chunks_and_the_rest_queues_the_rest(monkeypatch):
    """The device part fails after the streamed part queued its first chunks: the streamed
    update is queued whole (as when it was queued first), nothing is left half queued, and
    the next step works."""
    dev = SimulatedDevice()
    m = model()
    opt = hybrid(m, 1.0, 0.5, "next_forward", device=dev)
    part = opt._parts[0]
    part.ahead_chunks = 1
    assert len(part.chunks) > 1
    train(m, opt, 1)
    before = [p.detach().clone() for p in part.params]

    def failing(*args, **kwargs):
        raise RuntimeError("device part failed")

    monkeypatch.setattr(opt._dev_part, "step", failing)
    loss_of(m, 1).backward()
    with pytest.raises(RuntimeError, match="device part failed"):
        opt.step()
    assert part._queuing is None
    opt.wait_params()
    assert dev.pending_ops() == 0
    assert all(not torch.equal(p, b) for p, b in zip(part.params, before))  # every chunk ran
    _next_step_works(monkeypatch, m, opt, start=2)


def assert_no_key_bound_to_a_slot(opt):
    """Every streamed piece's key is unbound (empty), or its parameter itself (an own master)."""
    assert all(k.numel() == 0 or k.untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
               for part in opt._parts for c in part.chunks for pc in c.pieces
               for k, p in [(pc.key, part.params[pc.index])])


def _next_step_works(monkeypatch, m, opt, start):
    """After a failure: with the patches undone, the next step trains (finite parameters)."""
    monkeypatch.undo()
    opt.zero_grad()
    train(m, opt, 1, start=start)
    assert all(torch.isfinite(p).all() for p in m.parameters())
    opt.close()


def _two_parts_failing_first_chunk(monkeypatch):
    """Two streamed parts (a group added later gets its own) whose chunks all come after the
    device part (``ahead_chunks = 0``), one step trained, then the first chunk queued fails:
    ``(device, model, optimizer, parts, calls)``; ``calls`` counts the chunk updates."""
    dev = SimulatedDevice()
    m = model()
    layers = [layer for layer in m.children() if list(layer.parameters())]
    opt = HybridDeviceOptimizer(
        layers[0].parameters(), 1.0, device=dev, overlap="next_forward", stream_fraction=1.0,
        stream_budget_bytes=BUDGET, cpu_threads=1, **KW)
    for layer in layers[1:]:
        opt.add_param_group({"params": list(layer.parameters())})
    opt.register_forward_waits(m)
    parts = opt._parts
    assert len(parts) >= 2
    for part in parts:
        part.ahead_chunks = 0
    train(m, opt, 1)
    return dev, m, opt, parts, _failing_chunk_update(monkeypatch, lambda n, early: n == 1)


def test_a_part_failing_in_its_deferred_rest_leaves_no_other_part_half_queued(monkeypatch):
    """Two streamed parts share the launcher that queues their rest after ``step()`` returns;
    the first part's rest fails there, and a launcher drops the work queued behind a failure:
    the error is raised once, the other parts queue their own rest when they are next waited
    for, and the next step works."""
    dev, m, opt, parts, calls = _two_parts_failing_first_chunk(monkeypatch)
    loss_of(m, 1).backward()
    opt.step()  # returns: nothing is queued yet
    assert calls == [] and all(part._queuing is not None for part in parts)
    with pytest.raises(RuntimeError, match="update failed"):
        opt.wait_params()
    opt.wait_params()  # raised once; the other parts' rest is queued by their next wait
    assert all(part._queuing is None for part in parts)
    assert len(calls) > 1
    assert dev.pending_ops() == 0
    _next_step_works(monkeypatch, m, opt, start=2)


def test_a_part_failing_in_its_second_half_leaves_no_other_part_half_queued(monkeypatch):
    """Two streamed parts (a group added later gets its own), both queued in two parts; the
    device part fails, and then, while the parts' rest is queued on the way out, the first part
    fails too: the second still queues its rest, the error is raised (the device part's as its
    context), and the next step works."""
    dev, m, opt, parts, calls = _two_parts_failing_first_chunk(monkeypatch)

    def device_fails(*args, **kwargs):
        raise RuntimeError("device part failed")

    monkeypatch.setattr(opt._dev_part, "step", device_fails)
    loss_of(m, 1).backward()
    with pytest.raises(RuntimeError, match="update failed") as raised:
        opt.step()
    assert "device part failed" in str(raised.value.__context__)
    assert all(part._queuing is None for part in parts)
    assert len(calls) > 1  # the other parts' chunks were queued
    opt.wait_params()
    assert dev.pending_ops() == 0
    _next_step_works(monkeypatch, m, opt, start=2)
