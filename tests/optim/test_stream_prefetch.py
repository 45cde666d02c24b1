"""The streamed part copies the first chunks of its next update in during backward
(``StreamedPart.prefetch``, ``stream_prefetch=True`` by default): ``step()`` then starts on
chunks already in their staging slots.

On the simulated device: every overlap mode stays equal to the wrapped class, moving the same
bytes as without prefetching; the slots are the only device memory it holds, from the part's
first gradient to the update's end, and ``zero_grad``/``sync`` without a step give them back;
state edited after backward (through a reference kept from before, or through ``opt.state``) is
seen by the step; a second backward before ``step()`` turns it off; a missing wait is a
``SimulatedHazard``.
On a GPU (``-m gpu``): bit-identical to ``stream_prefetch=False``, and memory returns to its
level without prefetching once the update is done."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_offload import OffloadConfigError
from cpu_offload.core.simulated import SimulatedHazard
from cpu_offload.optim import OVERLAP_MODES, HybridDeviceOptimizer
from cpu_offload.optim.stream_update import SLOTS, StreamedPart

from test_stream_update import DTYPES, KW, _cuda, _Tracking, assert_same, hybrid, loss_of, model, reference, train


def _staged(opt):
    return opt.last_step_stats["stream_prefetched_chunks"]


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefetched_update_equals_the_wrapped_class_and_moves_no_extra_bytes(dtype, mode):
    ref, ref_opt = reference(dtype)
    train(ref, ref_opt, 4)
    moved = {}
    for prefetch in (True, False):
        m = model(dtype)
        opt = hybrid(m, 1.0, 1.0, mode, stream_prefetch=prefetch)
        assert len(opt._parts[0].chunks) > SLOTS
        train(m, opt, 4)
        assert _staged(opt) == (SLOTS if prefetch else 0)
        assert_same(m, opt, ref, ref_opt)
        moved[prefetch] = opt.last_step_stats["stream_bytes_to_device"]
        opt.close()
    assert moved[True] == moved[False]  # a staged chunk is not copied in again


def test_the_slots_are_held_from_the_first_gradient_to_the_end_of_the_update():
    dev = _Tracking()
    m = model()
    opt = hybrid(m, 1.0, 1.0, device=dev)
    train(m, opt, 1)
    assert dev.live_device_buffers() == 0
    loss_of(m, 1).backward()
    assert dev.live_device_buffers() == SLOTS
    opt.step()
    assert dev.live_device_buffers() == 0 and _staged(opt) == SLOTS
    loss_of(m, 2).backward()
    opt.zero_grad()  # no step: the staged chunks are dropped with the backward
    assert dev.live_device_buffers() == 0
    loss_of(m, 3).backward()
    opt.state_dict()  # the host reads the state (sync): dropped too
    assert dev.live_device_buffers() == 0
    opt.close()


def test_off_holds_no_device_memory_after_backward():
    dev = _Tracking()
    m = model()
    opt = hybrid(m, 1.0, 1.0, device=dev, stream_prefetch=False)
    train(m, opt, 1)
    loss_of(m, 1).backward()
    assert dev.live_device_buffers() == 0
    opt.close()


@pytest.mark.parametrize("how", ["kept_reference", "opt_state", "state_dict"])
def test_state_edited_after_backward_reaches_the_step(how):
    """Host state changed between backward and ``step()``: through a tensor kept from before
    backward (its version counter moved: the staged copy is not used), or read again through
    ``opt.state`` or ``state_dict`` (the staged chunks are dropped)."""
    ref, ref_opt = reference(torch.float32)
    m = model()
    opt = hybrid(m, 1.0, 1.0)
    train(ref, ref_opt, 1)
    train(m, opt, 1)
    kept = [opt.state[p]["exp_avg"] for p in m.parameters()]
    loss_of(ref, 1).backward()
    loss_of(m, 1).backward()
    for q in ref.parameters():
        ref_opt.state[q]["exp_avg"].mul_(0.5)
    if how == "kept_reference":
        for t in kept:
            t.mul_(0.5)
    else:
        if how == "state_dict":
            opt.state_dict()
        for p in m.parameters():
            opt.state[p]["exp_avg"].mul_(0.5)
    ref_opt.step()
    opt.step()
    assert _staged(opt) == 0
    ref_opt.zero_grad()
    opt.zero_grad()
    train(ref, ref_opt, 2, start=2)
    train(m, opt, 2, start=2)
    assert _staged(opt) == SLOTS
    assert_same(m, opt, ref, ref_opt)
    opt.close()


@pytest.mark.parametrize("no_sync", [False, True])
def test_gradient_accumulation(no_sync):
    """Two backward passes per step: outside ``opt.no_sync()`` the second gradient of a
    parameter drops the staged chunks and turns prefetching off for the part (else the slots
    would be held through every micro-batch's forward); inside it nothing is staged until the
    last micro-batch."""
    dev = _Tracking()
    ref, ref_opt = reference(torch.float32)
    m = model()
    opt = hybrid(m, 1.0, 1.0, device=dev)
    for i in range(3):
        loss_of(ref, 2 * i).backward()
        loss_of(ref, 2 * i + 1).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if no_sync:
            with opt.no_sync():
                loss_of(m, 2 * i).backward()
            assert dev.live_device_buffers() == 0
        else:
            loss_of(m, 2 * i).backward()
        loss_of(m, 2 * i + 1).backward()
        assert dev.live_device_buffers() == (SLOTS if no_sync else 0)
        opt.step()
        opt.zero_grad()
        assert _staged(opt) == (SLOTS if no_sync else 0)
    assert opt._parts[0].prefetching == no_sync
    assert_same(m, opt, ref, ref_opt)
    opt.close()


def test_prefetch_that_does_not_wait_for_backward_is_a_hazard(monkeypatch):
    """The slots are allocated in a gradient hook, on the compute stream: copies into them
    before the compute stream reaches that point could write memory backward still uses (and
    read host state before the last step's copies out, which it waited for, have landed)."""
    m = model()
    opt = hybrid(m, 1.0, 1.0)
    train(m, opt, 1)
    monkeypatch.setattr(StreamedPart, "_wait_backward", lambda self, event: None)
    with pytest.raises(SimulatedHazard, match="the caching allocator may have handed out memory"):
        loss_of(m, 1).backward()
    monkeypatch.undo()
    opt.zero_grad()
    opt.close()


def test_bad_stream_prefetch():
    with pytest.raises(OffloadConfigError, match="stream_prefetch must be True or False, got 'no'"):
        hybrid(model(), 1.0, 1.0, stream_prefetch="no")


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("mode", ["none", "next_forward"])
def test_prefetch_is_bit_identical_and_gives_its_memory_back_on_cuda(mode):
    results, levels = {}, {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        base = torch.cuda.memory_allocated()
        m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
        opt = HybridDeviceOptimizer(m.parameters(), 1.0, stream_fraction=1.0, stream_budget_bytes=2**21,
                                    device=_cuda(), overlap=mode,
                                    stream_prefetch=prefetch, **KW)
        opt.register_forward_waits(m)
        for i in range(4):
            x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16,
                            generator=torch.Generator("cuda").manual_seed(i))
            m(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        opt.wait_params()
        torch.cuda.synchronize()
        levels[prefetch] = torch.cuda.memory_allocated() - base
        results[prefetch] = ([p.detach().clone() for p in m.parameters()], _staged(opt))
        opt.close()
        del m, opt
    (on, staged_on), (off, staged_off) = results[True], results[False]
    assert staged_on == SLOTS and staged_off == 0
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert levels[True] == levels[False]
