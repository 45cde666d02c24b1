"""Updates of the streamed part started in backward (``stream_backward``): a chunk's update
starts when its gradients land, and ``step()`` keeps it only if nothing it read changed since.

On the simulated device: the result equals the wrapped class bit for bit whether the early
updates are kept or redone (clipping, scaling, a changed learning rate, an fp32 parameter changed
in place, a second backward, an abandoned backward, an error during backward); parameters read
between backward and ``step()`` still hold the last step's values; a missing wait is a
``SimulatedHazard``; nothing stays queued or allocated. Each in both launch modes: the updates
deferred until ``step()`` waits for them (the simulated device's default: the latest a launcher
thread could run them) and run in the hooks. GPU (``-m gpu``): kept early updates equal plain
fused AdamW on CUDA, bit for bit, queued by the launcher thread."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from cpu_offload import OffloadConfigError, SimulatedDevice, compat
from cpu_offload.core.launcher import ThreadLauncher
from cpu_offload.core.simulated import SimulatedHazard
from cpu_offload.optim.reference import MasterWeightOptimizer
from cpu_offload.optim.stream_backward import BackwardUpdates
from cpu_offload.optim.stream_records import EarlyPhase

from test_stream_update import (
    DTYPES, KW, _cuda, _failing_chunk_update, _Tracking, assert_no_key_bound_to_a_slot, assert_same,
    loss_of, model, reference, reference_of, train, with_empty,
)
from test_stream_update import hybrid as plain_hybrid

MODES = ["backward_update", "next_forward"]
LAUNCHES = ["deferred", "inline"]


def hybrid(*args, launches="deferred", device=None, **kw):
    if device is None:
        device = SimulatedDevice(defer_launches=launches == "deferred")
    elif isinstance(device, SimulatedDevice):
        device.defer_launches = launches == "deferred"
    return plain_hybrid(*args, stream_during_backward=True, device=device, **kw)


def queued(opt):
    """Updates started in backward so far: launched, or waiting for the launcher."""
    bw = opt._parts[0].backward
    return bw.round.count(EarlyPhase.QUEUED, EarlyPhase.UPDATED)


def early_stats(opt):
    s = opt.last_step_stats
    return s["stream_early_chunks"], s["stream_early_kept"]


def chunks(opt):
    return sum(len(p.chunks) for p in opt._parts)


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [0.5, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_updates_started_in_backward_are_kept_and_exact(dtype, stream, mode, launches):
    ref, ref_opt = reference(dtype)
    ref_losses = train(ref, ref_opt, 4, edit=None)
    m = model(dtype)
    opt = hybrid(m, 1.0, stream, mode, launches=launches)
    assert train(m, opt, 4, edit=None) == ref_losses
    assert early_stats(opt) == (chunks(opt), chunks(opt))  # every chunk, kept
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_parameters_read_before_step_hold_the_last_steps_values(mode, launches):
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, mode, launches=launches)
    train(m, opt, 2, edit=None)  # the second step's backward already updated early
    before = [p.detach().clone() for p in m.parameters()]
    loss_of(m, 2).backward()
    opt._parts[0].backward.launcher.join()  # as a launcher thread would, before step()
    assert opt._parts[0].backward.round.done  # updates started, not visible yet
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    opt.step()
    opt.wait_params()
    assert not any(torch.equal(p, q) for p, q in zip(m.parameters(), before))
    opt.close()


EDITS = {
    "clip": lambda m, opt: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05),
    "scale_one": lambda m, opt: next(m.parameters()).grad.mul_(0.5),
    # through .data: no version bump, only the bit sums see it
    "scale_one_data": lambda m, opt: next(m.parameters()).grad.data.mul_(0.5),
    "param_data": lambda m, opt: list(m.parameters())[2].data.mul_(0.9),
    "drop_one": lambda m, opt: setattr(list(m.parameters())[-1], "grad", None),
    "lr": None,  # the learning rate changed (below)
    "param_in_place": lambda m, opt: torch.no_grad()(lambda: list(m.parameters())[2].mul_(0.9))(),
}


# what last_step_stats["stream_early_missed"] names for the chunks each edit makes step() redo
MISSED = {"clip": "gradient", "scale_one": "gradient", "scale_one_data": "gradient",
          "drop_one": "gradient", "lr": "hyperparameters", "param_data": "parameter",
          "param_in_place": "parameter"}


def missed(opt):
    return opt.last_step_stats["stream_early_missed"]


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("edit", sorted(EDITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_changes_before_step_redo_the_early_updates(dtype, edit, mode, launches):
    """What the early updates read changes between backward and step(): step() updates those
    chunks again from the gradients as they are then; the result is the wrapped class's. fp32:
    the parameter is its own master, read by the early update (in the hook); bf16: deferred
    updates run after the change, from the gradients backward left."""
    ref, ref_opt = reference(dtype)
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, mode, launches=launches)
    for i in range(4):
        for mm, o, h in ((ref, ref_opt, None), (m, opt, opt)):
            loss_of(mm, i).backward()
            if i >= 1:
                if edit == "lr":
                    getattr(o, "optimizer", o).param_groups[0]["lr"] = 3e-3 * i  # bf16: master-weight ref
                else:
                    EDITS[edit](mm, h)
            o.step()
            o.zero_grad()
        # the first early updates (step 1) were redone, at least in part (a bf16 parameter's
        # update reads its master, not the parameter: the step overwrites such a change; and
        # deferred updates launched after a change through .data read it, so they stand)
        if i == 1 and not (edit in ("param_in_place", "param_data") and dtype == torch.bfloat16
                           or edit.endswith("_data") and launches == "deferred"):
            started, kept = early_stats(opt) if mode != "next_forward" else (None, None)
            if started is not None:
                assert started == chunks(opt) and kept < started
                assert set(missed(opt)) == {MISSED[edit]}, missed(opt)
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
def test_hooks_take_no_bit_sums_each_launched_chunk_takes_them_once(monkeypatch, launches):
    """The post-accumulate-grad hook of a streamed parameter only notes its gradient: the bit
    sums that let ``step()`` see later changes are taken once per launched chunk, for all its
    parameters, where its update is queued (in the hooks they cost backward about 0.35 ms of
    host time per parameter on a GPU, two sums each)."""
    from cpu_offload.optim import guards

    calls = []
    real = guards.bit_sums
    monkeypatch.setattr(guards, "bit_sums", lambda ts: calls.append(len(ts)) or real(ts))
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update", launches=launches)
    train(m, opt, 1, edit=None)  # the first step prepares the spare copies: nothing early
    n = len(list(m.parameters()))
    hooks_ran = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda p: hooks_ran.append(len(calls)))
    calls.clear()
    loss_of(m, 1).backward()
    opt._parts[0].backward.settle()  # every update launched
    launched = queued(opt)
    assert launched == chunks(opt) > 1
    # two fingerprints (gradient, parameter) per parameter, each taken once, by the chunks
    assert sum(calls) == 2 * n and len(calls) <= launched
    if launches == "deferred":  # nothing was launched while backward ran: no sum in a hook
        assert hooks_ran and set(hooks_ran) == {0}
    opt.step()
    opt.zero_grad()
    assert early_stats(opt) == (launched, launched)
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("read", ["between", "in_backward"])
def test_reading_the_state_before_step_reads_the_last_steps_and_changes_nothing(read, mode, launches):
    """``opt.state[p]`` read between backward and step() (or from a hook in backward) shows the
    last step's state, as torch's optimizers do, and the training stays exact: the updates
    started in that backward are dropped and done again in step(). (Before, the read brought
    the spare host copies up to date over what those updates had written, and step() kept
    them: the state lost a step, every other step.)"""
    ref, ref_opt = reference(torch.float32)
    m = model(torch.float32)
    opt = hybrid(m, 1.0, 1.0, mode, launches=launches)
    weight = list(m.parameters())[2]
    seen = []

    def read_state():
        if weight not in opt.state:  # before the first step
            return
        st = opt.state[weight]
        seen.append((st["step"].item(), st["exp_avg"].clone()))

    if read == "in_backward":
        list(m.parameters())[0].register_post_accumulate_grad_hook(lambda p: read_state())
    for i in range(5):
        for mm, o in ((ref, ref_opt), (m, opt)):
            loss_of(mm, i).backward()
            if o is opt and read == "between":
                read_state()
            if o is ref_opt and i > 0:
                expected = (ref_opt.state[list(ref.parameters())[2]]["step"].item(),
                            ref_opt.state[list(ref.parameters())[2]]["exp_avg"].clone())
            o.step()
            o.zero_grad()
        if i > 0:
            assert seen[-1][0] == expected[0] and torch.equal(seen[-1][1], expected[1])
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_after_a_changed_step_the_next_backward_waits_then_resumes():
    """... and ``last_step_stats["stream_early_missed"]`` says why, per chunk."""
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update")
    n = chunks(opt)
    train(m, opt, 1, edit=None)  # the first step makes the state: nothing can start before
    assert early_stats(opt) == (0, 0) and missed(opt) == {"not_eligible": n}
    train(m, opt, 1, start=1, edit=None)
    assert early_stats(opt) == (n, n) and missed(opt) == {}
    train(m, opt, 1, start=2)  # clipped: every early update redone
    assert early_stats(opt) == (n, 0) and missed(opt) == {"gradient": n}
    train(m, opt, 1, start=3, edit=None)  # nothing started early (gradients changed last time)
    assert early_stats(opt) == (0, 0) and missed(opt) == {"off": n}
    train(m, opt, 1, start=4, edit=None)  # resumed
    assert early_stats(opt) == (n, n) and missed(opt) == {}
    opt.close()


def test_a_loss_scale_at_step_redoes_the_early_updates_and_says_so():
    """``GradScaler`` hands its scale to ``step()``: the early updates ran without it."""
    m = model(torch.float32)
    opt = hybrid(m, 1.0, 1.0, "backward_update")
    n = chunks(opt)
    train(m, opt, 2, edit=None)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss_of(m, 2)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert early_stats(opt) == (n, 0) and missed(opt) == {"loss_scale": n}
    train(m, opt, 1, start=3, edit=None)  # the backward after a scaled step starts none
    assert early_stats(opt) == (0, 0) and missed(opt) == {"off": n}
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_backward_before_step_is_exact(dtype, mode, launches):
    """Accumulation without no_sync(): the early updates of the first backward are stale
    (deferred: they run after the second backward accumulated into the gradients they read)."""
    ref, ref_opt = reference(dtype)
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, mode, launches=launches)
    n = chunks(opt)
    for i in range(4):
        for mm, o in ((ref, ref_opt), (m, opt)):
            loss_of(mm, i).backward()
            if i == 2:  # early updates started (steps 0 and 1 kept them): now stale
                assert mm is ref or queued(opt) == n
                loss_of(mm, i + 10).backward()
            o.step()
            o.zero_grad()
            if mm is m and mode == "backward_update" and i == 2:
                assert early_stats(opt) == (n, 0) and missed(opt) == {"second_gradient": n}
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_an_abandoned_backward_leaves_nothing_and_changes_nothing(mode, launches):
    dev = _Tracking()
    ref, ref_opt = reference(torch.bfloat16)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, mode, device=dev, launches=launches)
    for i in range(4):
        for mm, o in ((ref, ref_opt), (m, opt)):
            loss_of(mm, i).backward()
            if i == 2:  # abandoned: its early updates must not survive
                o.zero_grad()
                continue
            o.step()
            o.zero_grad()
    sd = opt.state_dict()  # the host reads the state: early copies are done and in place
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    assert sd["state"]
    opt.close()
    assert dev.pending_ops() == 0 and dev.live_device_buffers() == 0


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
def test_a_step_that_keeps_and_updates_nothing_holds_nothing(mode, launches):
    """Every gradient is dropped between backward and step(): no early update is kept and no
    chunk is updated, and step() still lets go of what the early updates held (their staging,
    the gradients they read), as after an update."""
    dev = _Tracking()
    ref, ref_opt = reference(torch.bfloat16)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, mode, device=dev, launches=launches)
    for i in range(3):
        for mm, o in ((ref, ref_opt), (m, opt)):
            loss_of(mm, i).backward()
            if i == 2:
                assert mm is ref or queued(opt)  # started early
                for p in mm.parameters():
                    p.grad = None
            o.step()
            o.zero_grad()
        if i == 2:
            assert dev.live_device_buffers() == 0
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()
    assert dev.pending_ops() == 0


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_an_error_in_an_early_update_raises_and_leaves_nothing(monkeypatch, mode, dtype, launches):
    """From backward where the update runs in the hook (inline launches, or an fp32 parameter:
    its own master), else from the step() that waits for it; either way the step's early work
    is dropped and training goes on exactly."""
    dev = _Tracking()
    ref, ref_opt = reference(dtype)
    m = model(dtype)
    opt = hybrid(m, 1.0, 1.0, mode, device=dev, launches=launches)
    train(m, opt, 2, edit=None)
    train(ref, ref_opt, 2, edit=None)
    _failing_chunk_update(monkeypatch, lambda n, early: early, "early update failed")
    if launches == "inline" or dtype == torch.float32:
        with pytest.raises(RuntimeError, match="early update failed"):
            loss_of(m, 2).backward()
    else:
        loss_of(m, 2).backward()
        with pytest.raises(RuntimeError, match="early update failed"):
            opt.step()
    monkeypatch.undo()
    opt.zero_grad()
    ref_opt.zero_grad()
    assert_no_key_bound_to_a_slot(opt)
    train(m, opt, 2, start=3, edit=None)
    train(ref, ref_opt, 2, start=3, edit=None)
    assert_same(m, opt, ref, ref_opt)
    opt.close()
    assert dev.pending_ops() == 0 and dev.live_device_buffers() == 0


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("state_dict_between", [False, True])
def test_checkpoints_after_kept_early_updates(mode, state_dict_between, launches):
    """state_dict() after steps that kept early updates (the host copies swapped roles) reads
    the current state; loading it back continues exactly."""
    ref, ref_opt = reference(torch.bfloat16)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 0.5, mode, launches=launches)
    for start in range(0, 6, 2):
        train(ref, ref_opt, 2, start=start, edit=None)
        train(m, opt, 2, start=start, edit=None)
        if state_dict_between:
            opt.load_state_dict(opt.state_dict())
        assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_off_by_default():
    opt = plain_hybrid(model(), 1.0, 1.0, "next_forward")
    assert opt._parts and all(part.backward is None for part in opt._parts)
    opt.close()


@pytest.mark.parametrize("kw, match", [
    (dict(mode="none"), "overlap='backward_update' or 'next_forward', not 'none'"),
    (dict(mode="backward_copies"), "not 'backward_copies'"),
    (dict(mode="backward_update", max_grad_norm=1.0), "cannot be combined with max_grad_norm"),
    (dict(mode="backward_update", stream=0), r"needs a streamed part: stream_fraction > 0"),
    (dict(mode="backward_update", flag="yes"), "stream_during_backward"),
])
def test_bad_configurations_name_the_fix(kw, match):
    stream = kw.pop("stream", 1.0)
    flag = kw.pop("flag", True)
    with pytest.raises(OffloadConfigError, match=match):
        plain_hybrid(model(), 1.0, stream, kw.pop("mode"), stream_during_backward=flag, **kw)


def test_a_missing_wait_for_the_copy_in_is_a_hazard(monkeypatch):
    monkeypatch.setattr(BackwardUpdates, "_wait_in", lambda self, stream, event: None)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update")
    with pytest.raises(SimulatedHazard):
        train(m, opt, 3, edit=None)


@pytest.mark.parametrize("launches", LAUNCHES)
def test_waiting_only_for_an_event_from_before_the_allocations_is_a_hazard(monkeypatch, launches):
    """The update's slots and new-values buffer come from the compute stream's pool, which may
    hand out memory that compute work queued before still uses; on a launcher thread, backward
    queued more since the hook. Waiting for an event recorded before allocating them (the
    hook's, say) is not enough."""
    allocate = BackwardUpdates._allocate

    def event_first(self, pieces):
        self.before = self.device.record_event(self.device.current_stream())
        return allocate(self, pieces)

    monkeypatch.setattr(BackwardUpdates, "_allocate", event_first)
    monkeypatch.setattr(BackwardUpdates, "_ready", lambda self: self.before)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update", launches=launches)
    with pytest.raises(SimulatedHazard, match="allocated on the compute stream"):
        train(m, opt, 3, edit=None)


def test_a_missing_wait_for_the_update_is_a_hazard(monkeypatch):
    """Without it a kept update's new values would be copied into the parameters before the
    update on the side stream has written them."""
    monkeypatch.setattr(BackwardUpdates, "_wait_out", lambda self, stream, event: None)
    m = model(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update")
    with pytest.raises(SimulatedHazard, match="still writes"):
        train(m, opt, 3, edit=None)


# ---------------------------------------------------------------------------------------------
# CUDA

@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_kept_early_updates_are_bit_identical_to_fused_adamw_on_cuda(dtype, mode):
    ref, ref_opt = reference(dtype, "cuda")
    ref_losses = train(ref, ref_opt, 4, edit=None)
    m = model(dtype, "cuda")
    opt = hybrid(m, 1.0, 1.0, mode, device=_cuda(), budget=2**20)
    assert isinstance(opt._parts[0].backward.launcher, ThreadLauncher)
    assert train(m, opt, 4, edit=None) == ref_losses
    assert early_stats(opt) == (chunks(opt), chunks(opt))
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("mode", MODES)
def test_kept_early_updates_in_bf16_state_are_plain_fused_adamw_on_cuda(mode):
    """``fp32_masters=False``, everything streamed and started in backward (the spare host
    copies hold bf16 state): bit for bit ``torch.optim.AdamW(fused=True)`` on the bf16 model."""
    ref = model(torch.bfloat16, "cuda")
    ref_opt = torch.optim.AdamW(ref.parameters(), fused=True, **KW)
    ref_losses = train(ref, ref_opt, 4, edit=None)
    m = model(torch.bfloat16, "cuda")
    opt = hybrid(m, 1.0, 1.0, mode, device=_cuda(), budget=2**20, fp32_masters=False)
    assert train(m, opt, 4, edit=None) == ref_losses
    assert early_stats(opt) == (chunks(opt), chunks(opt))
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def _wide(dtype):
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
    return torch.nn.Sequential(*layers).to(device="cuda", dtype=dtype)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("dtype", DTYPES)
def test_launches_lagging_behind_backward_stay_exact_on_cuda(monkeypatch, dtype):
    """The launcher thread queues the updates while backward goes on, freeing activations whose
    memory the launcher's allocations may get. Each launch made 2 ms late, on a model with
    16 MiB activations: the kept updates still equal plain fused AdamW, bit for bit."""
    launch = BackwardUpdates._launch

    def late(self, *args):
        time.sleep(0.002)
        launch(self, *args)

    monkeypatch.setattr(BackwardUpdates, "_launch", late)
    ref = _wide(dtype)
    ref_opt = (MasterWeightOptimizer(ref.parameters(), **KW) if dtype == torch.bfloat16
               else torch.optim.AdamW(ref.parameters(), fused=True, **KW))
    m = _wide(dtype)
    opt = hybrid(m, 1.0, 1.0, "next_forward", device=_cuda(), budget=2**20)
    for i in range(4):
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(8192, 512, generator=gen).to(device="cuda", dtype=dtype)
        for mm, o in ((ref, ref_opt), (m, opt)):
            mm(x).float().square().mean().backward()
            o.step()
            o.zero_grad()
    assert early_stats(opt) == (chunks(opt), chunks(opt))
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def hand_over(dev, m, loss, stream, use_stream, then=lambda: None):
    """Backward as FSDP2 ends it: the gradients computed, then set and their post-accumulate-
    grad hooks run with ``stream`` current (``use_stream``: its reduce-scatter stream), ``then``
    queued there (later reduce-scatters), and the compute stream waiting only for what was
    queued there before it."""
    params = list(m.parameters())
    grads = torch.autograd.grad(loss, params)  # no hook runs
    dev.wait_event(stream, dev.record_event(dev.current_stream()))
    with use_stream(stream):
        for p, g in reversed(list(zip(params, grads))):
            p.grad = g.clone()  # the reduce-scatter's output, on its stream
            for hook in p._post_accumulate_grad_hooks.values():
                hook(p)
        handed_over = dev.record_event(stream)
        then()
    dev.wait_event(dev.current_stream(), handed_over)


def train_handed_over(ref, ref_opt, m, opt, loss, hand_over_args, before=lambda: None):
    """Four steps: ``ref`` as usual, ``m`` ending each backward with ``hand_over``; from the
    second on every early update is kept; the result is ``ref``'s."""
    for i in range(4):
        loss(ref, i).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        before()
        hand_over(opt._device, m, loss(m, i), *hand_over_args)
        opt.step()
        opt.zero_grad()
        if i > 0:
            assert early_stats(opt) == (chunks(opt), chunks(opt)), missed(opt)
    opt.wait_params()
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("launches", LAUNCHES)
def test_gradients_handed_over_on_a_side_stream_are_compared_after_their_sums(launches):
    """FSDP2's hand-over (``hand_over``): a launch takes its bit sums on the stream its hook ran
    on, after the compute stream's wait (deferred: in step()); step() compares them only after
    waiting for that stream (before, it read them unfinished: a ``SimulatedHazard`` here; on
    two GPUs every update redone). Every update is kept, and the result is the wrapped class's."""
    ref, ref_opt = reference(torch.bfloat16)
    m = model(torch.bfloat16)
    dev = SimulatedDevice()
    opt = hybrid(m, 1.0, 1.0, "backward_update", device=dev, launches=launches)
    train_handed_over(ref, ref_opt, m, opt, loss_of, (dev.new_stream(), dev.use_stream))


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_gradients_handed_over_on_a_busy_side_stream_are_kept_on_cuda(monkeypatch):
    """FSDP2's hand-over: the gradients are written, and the post-accumulate-grad hooks run,
    on a side stream (its reduce-scatter stream), and the end of backward waits only for the
    work queued there before the hooks returned. The launches queue their bit sums there
    later, behind more reduce-scatters (here a 100 ms sleep); step() must wait for those sums
    before comparing them. Before, it read them unfinished: every update was redone
    (``stream_early_missed``) and the next backward started none (two GPUs, NCCL)."""
    launch, handed = BackwardUpdates._launch, threading.Event()

    def late(self, *args):  # the launcher thread runs after the hand-over has returned
        assert handed.wait(timeout=60)
        launch(self, *args)

    def later_reduce_scatters():  # a 100 ms sleep; the launches queue behind it
        compat.cuda_sleep(200_000_000)
        handed.set()

    monkeypatch.setattr(BackwardUpdates, "_launch", late)
    ref = _wide(torch.bfloat16)
    ref_opt = MasterWeightOptimizer(ref.parameters(), **KW)
    m = _wide(torch.bfloat16)
    opt = hybrid(m, 1.0, 1.0, "backward_update", device=_cuda(), budget=2**24)
    assert 1 < chunks(opt) <= 8  # queued in far less than the sleep

    def loss(mm, i):
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(4096, 512, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        return mm(x).float().square().mean()

    train_handed_over(ref, ref_opt, m, opt, loss,
                      (torch.cuda.Stream(), torch.cuda.stream, later_reduce_scatters), handed.clear)


@pytest.mark.parametrize("launches", LAUNCHES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_size_parameters_update_early_like_torch(dtype, mode, launches):
    """A zero-size parameter's gradient hook (KeyError before) counts it in its chunk: every
    chunk starts early and is kept, equal to the wrapped class."""
    ref = with_empty(dtype)
    ref_opt = reference_of(ref)
    m = with_empty(dtype)
    opt = hybrid(m, 1.0, 1.0, mode, launches=launches)
    assert train(m, opt, 4, edit=None) == train(ref, ref_opt, 4, edit=None)
    assert early_stats(opt) == (chunks(opt), chunks(opt))
    assert_same(m, opt, ref, ref_opt)
    opt.close()
