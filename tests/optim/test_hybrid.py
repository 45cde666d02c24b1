"""HybridDeviceOptimizer on the simulated device: bit-exact against the wrapped optimizer run
directly, in every overlap mode and offload fraction; state dicts, schedulers, clipping,
errors, hygiene (no pinned allocation after construction, no hanging hooks or threads)."""
from __future__ import annotations

import copy
import gc
import io
import threading

import pytest
import torch
from torch import nn

from cpu_offload import OffloadConfigError, OffloadUsageError, SimulatedDevice
from cpu_offload.examples.gpt import build_model, make_input, tiny_config
from cpu_offload.optim import OVERLAP_MODES, HybridDeviceOptimizer, grad_arrival_order, to_wrapped_format
from cpu_offload.optim import cpu_update, transfer
from cpu_offload.optim.cpu_update import CpuBucket
from cpu_offload.optim.cpu_part import CpuPart
from cpu_offload.optim.cpu_step import Phase
from cpu_offload.optim.partition import next_update
from cpu_offload.optim.reference import MasterWeightOptimizer

from _support import optim_cuda

CFG = tiny_config().with_(layers=3)
KW = dict(lr=1e-2, weight_decay=0.1, foreach=False)
SMALL_BUCKETS = 48 * 1024  # a few buckets per layer: every bucket boundary gets exercised
SMALL_CHUNKS = 8 * 1024  # fp32 bytes: matrices are split into pieces, small params grouped


def model(dtype=torch.float32):
    return build_model(CFG.with_(dtype=dtype), seed=0)


def loss_of(m, i):
    x = make_input(CFG.with_(dtype=next(m.parameters()).dtype), seed=100 + i, requires_grad=False)
    return m(x).float().square().mean()


def hybrid(m, fraction=0.5, overlap="backward_update", cls=torch.optim.AdamW, **kw):
    # these tests exercise the CPU path: nothing streamed unless asked (test_stream_update.py
    # covers the split between the CPU path and the streamed device update)
    kw = {**KW, "stream_fraction": 0, **kw}
    opt = HybridDeviceOptimizer(
        kw.pop("params", None) or m.parameters(), fraction, cpu_optimizer_cls=cls, gpu_optimizer_cls=cls,
        device=kw.pop("device", None) or SimulatedDevice(), overlap=overlap,
        bucket_bytes=kw.pop("bucket_bytes", SMALL_BUCKETS),
        cpu_chunk_bytes=kw.pop("cpu_chunk_bytes", SMALL_CHUNKS), **kw)
    if overlap == "next_forward":
        opt.register_forward_waits(m)
    return opt


def train(m, opt, steps, start=0, clip=None, sched=None):
    losses = []
    for i in range(start, start + steps):
        loss = loss_of(m, i)
        loss.backward()
        if clip is not None:
            clip(m, opt)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    if isinstance(opt, HybridDeviceOptimizer):
        opt.wait_params()
    return losses


def assert_same_params(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


def reference(steps, cls=torch.optim.AdamW, clip=None, sched=None, **kw):
    ref = model()
    opt = cls(ref.parameters(), **{**KW, **kw})
    s = sched(opt) if sched else None
    return ref, train(ref, opt, steps, clip=clip, sched=s)


# ---------------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_bit_identical_to_the_wrapped_optimizer(fraction, mode):
    ref, ref_losses = reference(3)
    m = model()
    opt = hybrid(m, fraction, mode)
    assert train(m, opt, 3) == ref_losses
    assert_same_params(m, ref)
    n_cpu = len(opt.offloaded_params())
    assert (n_cpu == 0) == (fraction == 0) and (n_cpu == len(list(m.parameters()))) == (fraction == 1)
    opt.close()


@pytest.mark.parametrize("cls", [
    pytest.param(None, id="default-fused-adamw"),
    pytest.param(torch.optim.SGD, id="sgd-momentum"),
])
def test_other_classes_and_the_default(cls):
    kw = dict(lr=1e-2, momentum=0.9) if cls is torch.optim.SGD else dict(lr=1e-2)
    ref = model()
    ref_cls = cls or (lambda p, **k: torch.optim.AdamW(p, fused=True, **k))
    train(ref, ref_cls(ref.parameters(), **kw), 3)
    m = model()
    opt = HybridDeviceOptimizer(m.parameters(), 0.5, cls, cls, device=SimulatedDevice(),
                                bucket_bytes=SMALL_BUCKETS, cpu_chunk_bytes=SMALL_CHUNKS, **kw)
    train(m, opt, 3)
    assert_same_params(m, ref)


def test_bf16_params_keep_fp32_masters_and_match_a_master_weight_run():
    m = model(torch.bfloat16)
    opt = hybrid(m, 0.5, param_update_in_fp32=True)
    ref = model(torch.bfloat16)
    ref_opt = MasterWeightOptimizer(ref.parameters(), torch.optim.AdamW, **KW)
    masters = ref_opt.masters
    train(m, opt, 3)
    train(ref, ref_opt, 3)
    assert_same_params(m, ref)
    sd = opt.state_dict()
    for i, p in enumerate(m.parameters()):
        assert sd["state"][i]["master_weight"].dtype == torch.float32
        assert torch.equal(sd["state"][i]["master_weight"], masters[i])


def test_offloads_the_parameters_whose_gradients_arrive_first():
    m = model()
    params = list(m.parameters())
    opt = hybrid(m, 0.5)
    chosen = opt.offloaded_params()
    assert chosen[0] is params[-1]  # the last layer's parameters, last registered first
    assert all(any(p is q for q in m.layers[-1].parameters()) for p in chosen[:8])
    total = sum(p.numel() for p in params)
    assert abs(sum(p.numel() for p in chosen) / total - 0.5) < 0.1

    order = grad_arrival_order(m.parameters(), lambda: loss_of(m, 0).backward())
    m.zero_grad()
    assert order[0] in set(m.layers[-1].parameters()) and order[-1] in set(m.layers[0].parameters())
    rev = HybridDeviceOptimizer(m.parameters(), 0.25, device=SimulatedDevice(), stream_fraction=0,
                                grad_order=order[::-1], lr=1e-2)  # pretend layer 0 arrives first
    assert rev.offloaded_params()[0] is order[-1]


# ---------------------------------------------------------------------------------------------
# chunked CPU updates: pieces of parameters, stepped one chunk at a time, give the same bits

ODD_SHAPES = [(3001,), (129, 77), (64,), (5,), (2048,), (1000, 33)]  # numels not multiples of 16


def _bucket(chunk_elems, cls=torch.optim.AdamW, **kw):
    params = [torch.empty(s, dtype=torch.bfloat16) for s in ODD_SHAPES]
    gen = torch.Generator().manual_seed(0)
    initial = [torch.randn(s, generator=gen) for s in ODD_SHAPES]
    hypers = [{"lr": 1e-2, "weight_decay": 0.1}]
    bucket = CpuBucket(params, [0] * len(params), initial, hypers,
                       lambda groups: cls(groups, **kw), chunk_elems)
    return bucket, hypers


def _run_bucket(bucket, hypers, steps=3, clip=None):
    gen = torch.Generator().manual_seed(1)
    out = [torch.empty(p.shape, dtype=p.dtype) for p in bucket.params]
    scratch = torch.empty(bucket.scratch_elems)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in bucket.params]
        bucket.update(grads, out, scratch, hypers, clip)
    return out


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, dict(fused=True)), (torch.optim.AdamW, dict(foreach=False)),
    (torch.optim.Adam, dict(fused=True, amsgrad=True)), (torch.optim.SGD, dict(momentum=0.9, fused=True)),
], ids=["adamw-fused", "adamw-for-loop", "adam-amsgrad-fused", "sgd-fused"])
@pytest.mark.parametrize("chunk", [1000, 4096, 40_000])
def test_chunked_bucket_is_bit_identical_to_one_whole_step(cls, kw, chunk):
    whole, hypers = _bucket(0, cls, **kw)
    assert len(whole.chunks) == 1 and not any(pc.split for pc in whole.chunks[0].pieces)
    chunked, _ = _bucket(chunk, cls, **kw)
    assert len(chunked.chunks) > 1
    assert any(pc.split for c in chunked.chunks for pc in c.pieces)  # chunks are filled up
    coef = torch.tensor(0.5)
    for a, b in zip(_run_bucket(whole, hypers, clip=coef), _run_bucket(chunked, hypers, clip=coef)):
        assert torch.equal(a, b)
    for i, (ma, mb) in enumerate(zip(whole.masters, chunked.masters)):
        assert torch.equal(ma, mb)
        sa, sb = whole.param_state(i), chunked.param_state(i)
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
            assert sb[k].shape == sa[k].shape


def test_split_pieces_start_on_aligned_offsets_and_misaligned_ones_change_bits(monkeypatch):
    """Fused AdamW rounds its scalar tail differently from its vector loop: a piece boundary
    off the alignment puts other elements in a tail, and the bits change (this is what the
    alignment is for; if this test stops failing, the CPU kernels changed)."""
    bucket, _ = _bucket(1000)
    for c in bucket.chunks:
        for pc in c.pieces:
            assert pc.start % cpu_update.ALIGN_ELEMS == 0
            assert pc.stop % cpu_update.ALIGN_ELEMS == 0 or pc.stop == bucket.masters[pc.index].numel()
    whole, hypers = _bucket(0, fused=True)
    monkeypatch.setattr(cpu_update, "ALIGN_ELEMS", 1)
    misaligned, _ = _bucket(101, fused=True)
    _run_bucket(whole, hypers)
    _run_bucket(misaligned, hypers)
    assert any(not torch.equal(x, y) for x, y in zip(whole.masters, misaligned.masters))


def test_only_elementwise_classes_are_split():
    class MyAdamW(torch.optim.AdamW):  # may do anything per parameter: never split
        pass

    bucket, _ = _bucket(1000, MyAdamW)
    assert len(bucket.chunks) > 1  # whole parameters still grouped into chunks
    assert not any(pc.split for c in bucket.chunks for pc in c.pieces)
    assert all(type(o) is MyAdamW for o in bucket.optimizers)


@pytest.mark.parametrize("chunks", [(SMALL_CHUNKS, 0), (0, SMALL_CHUNKS), (SMALL_CHUNKS, 12 * 1024)])
def test_state_dict_round_trip_across_chunk_sizes(chunks):
    ref, _ = reference(4, fused=True, foreach=None)
    m = model()
    opt = hybrid(m, 1.0, "backward_update", cpu_chunk_bytes=chunks[0], fused=True, foreach=None)
    train(m, opt, 2)
    sd = _roundtrip(opt.state_dict())
    m2 = copy.deepcopy(m)
    opt2 = hybrid(m2, 1.0, "next_forward", cpu_chunk_bytes=chunks[1], fused=True, foreach=None)
    opt2.load_state_dict(sd)
    train(m2, opt2, 2, start=2)
    assert_same_params(m2, ref)
    # the state dict has the wrapped class's per-parameter shapes, and holds no copies
    sd = opt.state_dict()
    for i, p in enumerate(m.parameters()):
        assert sd["state"][i]["exp_avg"].shape == p.shape
        assert sd["state"][i]["step"].shape == ()
    assert opt.state_dict()["state"][2]["exp_avg"].data_ptr() == sd["state"][2]["exp_avg"].data_ptr()


def _update_order(monkeypatch, opt):
    order = []
    real = CpuPart._run_update

    def spy(self, st, b, *args):
        order.append(b)
        return real(self, st, b, *args)

    monkeypatch.setattr(CpuPart, "_run_update", spy)
    return order


def test_landed_buckets_update_first_layers_first(monkeypatch):
    """Buckets are numbered in gradient-arrival order (last layers first). Of the buckets whose
    gradients have landed (all of them at step() in this mode, with eager simulated copies), the
    worker updates first the one the next forward needs first."""
    ref, _ = reference(2)
    m = model()
    opt = hybrid(m, 1.0, "backward_copies", device=SimulatedDevice(defer=False))
    order = _update_order(monkeypatch, opt)
    train(m, opt, 2)
    assert order == list(range(len(opt._cpu.buckets) - 1, -1, -1)) * 2
    assert_same_params(m, ref)
    opt.close()


def test_next_update_prefers_landed_buckets_the_forward_needs_first():
    assert next_update([0, 1, 2, 3], lambda b: b in (0, 1, 2)) == 2
    assert next_update([3, 0, 1], lambda b: False) == 1  # none landed: the first to land
    assert next_update([4, 2], lambda b: b == 2) == 1


# ---------------------------------------------------------------------------------------------
# a missing synchronization must give wrong numbers in simulation


@pytest.mark.parametrize("broken", ["no_wait_for_gradient_copies", "no_wait_for_param_copies"])
def test_missing_wait_gives_wrong_results(monkeypatch, broken):
    ref, _ = reference(2)
    if broken == "no_wait_for_gradient_copies":
        monkeypatch.setattr(transfer.TransferEngine, "wait_landed", lambda self, ev: None)
    else:
        monkeypatch.setattr(transfer.TransferEngine, "fence_compute", lambda self, ev: None)
    m = model()
    opt = hybrid(m, 0.5, "backward_update")
    for i in range(2):
        loss_of(m, i).backward()
        # the CPU updates run now, before step() makes the compute stream wait for anything
        # (else step()'s own waits could run the copies first, by chance)
        for f in [bs.job.future for bs in opt._cpu.backward_step.buckets if bs.job is not None]:
            f.result()
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    diff = [not torch.equal(a, b) for a, b in zip(m.parameters(), ref.parameters())]
    assert any(diff)


def test_no_pinned_allocation_after_construction():
    dev = SimulatedDevice()
    m = model()
    opt = hybrid(m, 0.5, "next_forward", device=dev)
    allocs = dev.host_allocs
    assert 0 < allocs <= len(opt._cpu.buckets)
    train(m, opt, 3)
    opt.load_state_dict(opt.state_dict())
    train(m, opt, 1, start=3)
    assert dev.host_allocs == allocs


def test_pageable_buffers_when_not_pinned():
    dev = SimulatedDevice()
    ref, _ = reference(2)
    m = model()
    opt = hybrid(m, 1.0, pin_cpu_grads=False, pin_cpu_params=True, device=dev)
    assert dev.host_allocs == len(opt._cpu.buckets)  # only the param side is pinned
    train(m, opt, 2)
    assert_same_params(m, ref)


# ---------------------------------------------------------------------------------------------
# optimizer API: schedulers, clipping, state dicts, groups, accumulation


def test_lr_scheduler_drives_every_part():
    sched = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)  # noqa: E731
    ref, _ = reference(4, sched=sched)
    m = model()
    opt = hybrid(m, 0.5, "next_forward")
    train(m, opt, 4, sched=sched(opt))
    assert opt.param_groups[0]["lr"] == pytest.approx(KW["lr"] / 16)
    assert_same_params(m, ref)


def _torch_clip(m, opt):
    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)


@pytest.mark.parametrize("mode", ["none", "backward_copies"])
def test_clip_grad_norm_matches_torch(mode):
    ref, _ = reference(3, clip=_torch_clip)
    m = model()
    opt = hybrid(m, 0.5, mode)
    norms = []
    train(m, opt, 3, clip=lambda m, o: norms.append(o.clip_grad_norm_(0.05)))
    assert_same_params(m, ref)
    # the returned norm is torch's total norm of the same gradients
    loss_of(m, 9).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in m.parameters()])
    assert torch.equal(opt.clip_grad_norm_(0.05), expected)
    assert norms[0] > 0.05  # clipping really happened


@pytest.mark.parametrize("mode", ["backward_update", "next_forward"])
def test_max_grad_norm_clips_inside_step(mode):
    ref, _ = reference(3, clip=_torch_clip)
    m = model()
    opt = hybrid(m, 0.5, mode, max_grad_norm=0.05)
    train(m, opt, 3)
    assert_same_params(m, ref)
    assert opt.last_step_stats["redone_buckets"] == 0  # clipping inside step() redoes nothing
    # (opt.clip_grad_norm_ between backward and step() works in these modes too, by redoing the
    # early updates: tests/test_optim_grad_changes.py)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("fractions", [(0.5, 0.5), (0.5, 1.0), (1.0, 0.0)])
def test_state_dict_round_trip_continues_bit_exact(fractions):
    ref, _ = reference(4)
    m = model()
    opt = hybrid(m, fractions[0], "next_forward")
    train(m, opt, 2)
    sd = _roundtrip(opt.state_dict())
    m2 = copy.deepcopy(m)
    opt2 = hybrid(m2, fractions[1], "backward_copies")
    opt2.load_state_dict(sd)
    train(m2, opt2, 2, start=2)
    assert_same_params(m2, ref)


def test_state_dict_converts_to_and_from_the_wrapped_format():
    m = model()
    opt = hybrid(m, 0.5)
    train(m, opt, 2)
    plain_model = copy.deepcopy(m)
    plain = torch.optim.AdamW(plain_model.parameters(), **KW)
    plain.load_state_dict(_roundtrip(to_wrapped_format(opt.state_dict())))
    ref, _ = reference(4)
    train(plain_model, plain, 2, start=2)
    assert_same_params(plain_model, ref)
    # and back: a plain torch state dict loads into the hybrid optimizer
    ref2, _ = reference(3)
    half = model()
    half_opt = torch.optim.AdamW(half.parameters(), **KW)
    train(half, half_opt, 2)
    opt3 = hybrid(half, 1.0)
    opt3.load_state_dict(_roundtrip(half_opt.state_dict()))
    train(half, opt3, 1, start=2)
    assert_same_params(half, ref2)


def test_add_param_group_and_per_group_hyperparameters():
    ref = model()
    groups = lambda m: [  # noqa: E731
        {"params": list(m.layers[0].parameters()) + list(m.layers[1].parameters())},
        {"params": list(m.layers[2].parameters()), "lr": 3e-2, "weight_decay": 0.0},
    ]
    rg = groups(ref)
    ref_opt = torch.optim.AdamW(rg[:1], **KW)
    ref_opt.add_param_group(rg[1])
    train(ref, ref_opt, 3)
    m = model()
    g = groups(m)
    opt = HybridDeviceOptimizer(g[:1], 0.5, torch.optim.AdamW, torch.optim.AdamW,
                                device=SimulatedDevice(), bucket_bytes=4 * SMALL_BUCKETS,
                                cpu_chunk_bytes=SMALL_CHUNKS, **KW)
    opt.add_param_group(g[1])
    assert opt.param_groups[1]["lr"] == 3e-2
    train(m, opt, 3)
    assert_same_params(m, ref)


def test_add_param_group_in_next_forward_names_the_second_registration():
    """``overlap="next_forward"``: a group added mid-training has no forward waits until
    ``register_forward_waits`` runs again; ``step()`` says so (and does nothing), and after the
    second registration training is exact."""
    groups = lambda m: [list(m.layers[0].parameters()) + list(m.layers[1].parameters()),  # noqa: E731
                        list(m.layers[2].parameters())]
    ref = model()
    ref_opt = torch.optim.AdamW(groups(ref)[0], **KW)
    train(ref, ref_opt, 2)
    ref_opt.add_param_group({"params": groups(ref)[1]})
    train(ref, ref_opt, 2, start=2)
    m = model()
    opt = hybrid(m, 0.5, overlap="next_forward", stream_fraction=0.5, params=groups(m)[0])
    train(m, opt, 2)
    opt.add_param_group({"params": groups(m)[1]})
    loss_of(m, 2).backward()
    with pytest.raises(OffloadUsageError, match=r"register_forward_waits\(model\) .*after "
                       "add_param_group call it again"):
        opt.step()
    opt.register_forward_waits(m)
    opt.step()
    opt.zero_grad()
    train(m, opt, 1, start=3)
    opt.wait_params()
    assert_same_params(m, ref)
    opt.close()


def test_a_refused_param_group_is_not_added_and_training_stays_exact():
    """A group whose parameters fail the checks raises and leaves the optimizer as it was: kept
    in ``param_groups`` but never partitioned, ``step()`` would skip its parameters."""
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    train(ref, ref_opt, 3)
    m = model()
    opt = hybrid(m, 0.5)
    refused = [nn.Parameter(torch.randn(8, 4).t()) for _ in range(2)]  # not contiguous; one offloaded
    with pytest.raises(OffloadConfigError, match="not contiguous and falls in the offloaded share"):
        opt.add_param_group({"params": refused})
    assert len(opt.param_groups) == 1 and len(opt.state_dict()["param_groups"]) == 1
    train(m, opt, 3)
    assert_same_params(m, ref)
    opt.close()
    with pytest.raises(OffloadUsageError, match="close"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("fraction,earliest", [(0.0, True), (0.5, False), (0.5, True), (1.0, True)])
def test_a_non_contiguous_parameter_is_refused_only_where_offloaded(fraction, earliest):
    """Offloaded bytes are copied flat, so an offloaded parameter must be contiguous; one kept on
    the device is the wrapped class's as in torch (before, any non-contiguous parameter was
    refused, even at ``offload_fraction=0``)."""
    def with_transposed_first(m):  # the first matrix, as the transpose of a contiguous one
        first = next(p for p in m.parameters() if p.dim() == 2)
        for mod in m.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                if p is first:
                    setattr(mod, name, nn.Parameter(first.detach().t().contiguous().t()))
        return m

    ref = with_transposed_first(model())
    assert not all(p.is_contiguous() for p in ref.parameters())
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    m = with_transposed_first(model())
    order = sorted(m.parameters(), key=lambda p: p.is_contiguous())  # the transposed one first
    kw = dict(grad_order=order if earliest else order[::-1])
    if fraction == 0.0 or not earliest:
        opt = hybrid(m, fraction, **kw)
        train(ref, ref_opt, 3)
        train(m, opt, 3)
        assert_same_params(m, ref)
        assert not all(p.is_contiguous() for p in m.parameters())
        opt.close()
        return
    with pytest.raises(OffloadConfigError, match=r"parameter \d+ \(.*\) is not contiguous and falls in "
                       r"the offloaded share .*contiguous_format.* or lower offload_fraction"):
        hybrid(m, fraction, **kw)


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_a_parameter_listed_twice_is_refused(fraction):
    """torch's optimizers step a parameter listed twice twice per step (with a warning that it
    will be an error); here the placement was keyed by the parameter, so the two entries
    overwrote each other and the result differed from torch's, by placement and mode."""
    m = model()
    params = list(m.parameters())
    with pytest.warns(UserWarning, match="duplicate"), \
            pytest.raises(OffloadConfigError, match=r"listed twice in param group 0.*once"):
        HybridDeviceOptimizer(params + params[-1:], fraction, device=SimulatedDevice(), **KW)
    opt = hybrid(m, 0.5)
    with pytest.raises(OffloadConfigError, match=r"listed twice in param group 1"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4))] * 2})
    assert len(opt.param_groups) == 1
    opt.close()


def test_parameters_put_into_param_groups_by_hand_are_refused_at_step():
    """torch's optimizers step whatever ``param_groups[i]["params"]`` holds; here a parameter
    appended there has no place (no master, state or part) and would silently stay as it is."""
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    train(ref, ref_opt, 3)
    m = model()
    opt = hybrid(m, 0.5)
    extra = nn.Parameter(torch.randn(4, 4))
    opt.param_groups[0]["params"].append(extra)
    loss_of(m, 0).backward()
    with pytest.raises(OffloadUsageError, match=r"parameters of param group 0 changed .*add_param_group"):
        opt.step()
    opt.param_groups[0]["params"].pop()
    opt.zero_grad()
    train(m, opt, 3)  # nothing was stepped by the refused call
    assert_same_params(m, ref)
    opt.param_groups.append({"params": [extra], **opt.defaults})
    with pytest.raises(OffloadUsageError, match=rf"parameters of param group {len(opt.param_groups) - 1} changed"):
        opt.step()
    opt.close()


def test_gradient_accumulation_with_no_sync():
    ref = model()
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    m = model()
    opt = hybrid(m, 0.5, "backward_update")
    for mm, o, ns in ((ref, ref_opt, None), (m, opt, opt.no_sync)):
        for step in range(2):
            for micro in range(3):
                last = micro == 2
                ctx = ns() if (ns and not last) else torch.enable_grad()
                with ctx:
                    loss_of(mm, 3 * step + micro).backward()
            o.step()
            o.zero_grad()
    assert_same_params(m, ref)
    assert opt.last_step_stats["redone_buckets"] == 0  # no_sync(): nothing to redo
    # (accumulating without no_sync() is exact too, by redoing: tests/test_optim_grad_changes.py)


def test_closure_and_unused_parameters():
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    m = copy.deepcopy(ref)
    x = torch.randn(3, 4)
    # layer 1 unused: its parameters get no gradient and must not move

    def run(net, opt):
        def closure():
            opt.zero_grad()
            loss = net[2](net[0](x)).square().mean()
            loss.backward()
            return loss
        return [opt.step(closure).item() for _ in range(3)]

    a = run(ref, torch.optim.AdamW(ref.parameters(), **KW))
    b = run(m, hybrid(m, 1.0, "backward_update", bucket_bytes=1))
    assert a == b
    assert_same_params(m, ref)


# ---------------------------------------------------------------------------------------------
# bad input, failures, hygiene


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan"), "half", True])
def test_fraction_outside_unit_interval(fraction):
    with pytest.raises(OffloadConfigError, match="offload_fraction"):
        HybridDeviceOptimizer(model().parameters(), fraction, device=SimulatedDevice(), lr=1.0)


def test_mixed_devices_and_bad_classes():
    m = model()
    stray = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(OffloadConfigError, match="parameter 1 is on meta"):
        HybridDeviceOptimizer([next(m.parameters()), stray], device=SimulatedDevice(), lr=1.0)

    class NotAnOptimizer:
        def __init__(self, params, lr):
            self.param_groups = [{"params": list(params), "lr": lr}]

        def step(self):
            pass

    with pytest.raises(OffloadConfigError, match="lacks zero_grad, state_dict, load_state_dict, "
                                                 "add_param_group, state, defaults"):
        HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=NotAnOptimizer,
                              device=SimulatedDevice(), lr=1.0)
    with pytest.raises(OffloadConfigError, match="could not be built .*'betas_typo'"):
        HybridDeviceOptimizer(m.parameters(), device=SimulatedDevice(), lr=1.0, betas_typo=1)
    with pytest.raises(OffloadConfigError, match="overlap='sometimes' is not one of"):
        HybridDeviceOptimizer(m.parameters(), device=SimulatedDevice(), overlap="sometimes")


def test_sparse_gradient_is_rejected():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = HybridDeviceOptimizer(emb.parameters(), 1.0, torch.optim.SGD, torch.optim.SGD,
                                device=SimulatedDevice(), lr=0.1, stream_fraction=0)
    with pytest.raises(OffloadUsageError, match="sparse gradient"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt.close()
    streamed = HybridDeviceOptimizer(emb.parameters(), 1.0, torch.optim.SGD, torch.optim.SGD,
                                     device=SimulatedDevice(), lr=0.1, stream_fraction=1)
    emb.zero_grad()
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(OffloadUsageError, match="sparse gradient"):
        streamed.step()
    streamed.close()


def test_next_forward_requires_forward_waits():
    m = model()
    opt = HybridDeviceOptimizer(m.parameters(), 0.5, device=SimulatedDevice(), overlap="next_forward", lr=1e-2)
    loss_of(m, 0).backward()
    with pytest.raises(OffloadUsageError, match="register_forward_waits"):
        opt.step()


class Boom(Exception):
    pass


class FailingAdamW(torch.optim.AdamW):
    fail_at = 2

    def step(self, closure=None):
        FailingAdamW.calls += 1
        if FailingAdamW.calls == self.fail_at:
            raise Boom("cpu update failed")
        return super().step(closure)


def _worker_threads():
    return [t for t in threading.enumerate() if t.name.startswith("cpu_offload-optim")]


@pytest.mark.parametrize("mode", OVERLAP_MODES)
def test_exception_in_a_step_leaves_nothing_hanging(mode):
    FailingAdamW.calls = 0
    m = model()
    dev = SimulatedDevice()
    opt = hybrid(m, 1.0, mode, cls=FailingAdamW, device=dev)
    with pytest.raises(Boom):
        train(m, opt, 3)
    assert dev.pending_ops() == 0 or mode == "next_forward"
    opt.zero_grad()
    train(m, opt, 1)  # still usable
    opt.close()
    assert not opt._hooks and not opt._module_hooks and not opt._worker.alive
    assert dev.pending_ops() == 0


def test_exception_in_backward_then_zero_grad_recovers():
    ref, _ = reference(2)
    m = model()
    opt = hybrid(m, 0.5, "backward_copies")

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise Boom("backward failed")

    x = make_input(CFG, seed=5, requires_grad=False)
    out = m(Fail.apply(m.layers[0](x)))  # layer 0 runs again after the failing node...
    with pytest.raises(Boom):
        out.square().mean().backward()  # ...so later layers' gradients were copied already
    opt.zero_grad()
    train(m, opt, 2)
    assert_same_params(m, ref)
    opt.close()


def test_dropped_optimizer_stops_copying():
    import gc
    import weakref

    m = model()
    opt = hybrid(m, 1.0)
    ref = weakref.ref(opt)
    opt._worker.shutdown()
    del opt
    gc.collect()
    assert ref() is None
    loss_of(m, 0).backward()  # hooks still registered, but hold the optimizer weakly


def test_overlap_modes_really_overlap():
    """backward_update: buckets are updated before step() is called; next_forward: step()
    returns with parameter copies still queued, and each layer's forward waits for its own."""
    dev = SimulatedDevice()
    m = model()
    opt = hybrid(m, 1.0, "next_forward", device=dev)
    loss_of(m, 0).backward()
    started = {b: bs.job.future for b, bs in enumerate(opt._cpu.backward_step.buckets) if bs.job is not None}
    assert len(started) == len(opt._cpu.buckets)  # every bucket's update was queued during backward
    opt.step()
    for f in started.values():
        f.result()
    assert opt.last_step_stats == {} and dev.pending_ops() > 0  # copies back not yet waited for
    before = [p.detach().clone() for p in m.layers[0].parameters()]
    x = make_input(CFG, seed=1, requires_grad=False)
    st = opt._cpu.inflight
    with torch.no_grad():
        m.layers[2](x)  # waits for the buckets holding layer 2's parameters only
    fenced = {b for b, bs in enumerate(st.buckets) if bs.phase is Phase.FENCED}
    assert fenced == {opt._cpu.where[id(p)][0] for p in m.layers[2].parameters()}
    assert opt._cpu.inflight is st  # the other buckets are not waited for yet
    opt.wait_params()
    assert not any(torch.equal(a, b) for a, b in zip(before, m.layers[0].parameters()))
    assert 0 <= opt.last_step_stats["overlapped_with_backward"] <= 1  # timing: GPU bench checks it
    assert opt.last_step_stats["bytes_to_host"] == sum(p.numel() * 4 for p in m.parameters())
    opt.close()


# --- on CUDA (marked gpu): real streams racing, pinned memory, CPU vs GPU kernels ---


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("mode", OVERLAP_MODES)
def test_offloaded_part_bit_equal_to_the_cpu_optimizer(mode):
    m = optim_cuda.model()
    opt = optim_cuda.hybrid(m, 1.0, mode)
    for got, expected in optim_cuda.train(m, opt, 3, optim_cuda.CpuReference(m)):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_device_part_within_tolerance_of_the_cpu_optimizer():
    m = optim_cuda.model()
    opt = optim_cuda.hybrid(m, 0.5, "next_forward", param_update_in_fp32=True)
    offloaded = {id(p) for p in opt.offloaded_params()}
    assert 0 < len(offloaded) < len(list(m.parameters()))
    for got, expected in optim_cuda.train(m, opt, 3, optim_cuda.CpuReference(m)):
        for p, a, b in zip(m.parameters(), got, expected):
            if id(p) in offloaded:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, rtol=optim_cuda.GPU_PART_RTOL, atol=1e-6)
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
@pytest.mark.parametrize("mode", OVERLAP_MODES[1:])
def test_every_overlap_mode_gives_the_bits_of_none(mode):
    results = {}
    for overlap in ("none", mode):
        m = optim_cuda.model()
        opt = optim_cuda.hybrid(m, 0.5, overlap, max_grad_norm=0.5)
        optim_cuda.train(m, opt, 4)
        results[overlap] = [p.detach().clone() for p in m.parameters()]
        opt.close()
    for a, b in zip(results["none"], results[mode]):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_fraction_one_holds_no_optimizer_state_on_the_gpu_and_no_late_pinned_allocation():
    gc.collect()  # garbage of earlier tests, freed later, would lower the count below
    dev = optim_cuda.CountingCuda()
    m = optim_cuda.model()
    torch.cuda.synchronize()
    params_only = torch.cuda.memory_allocated()
    opt = HybridDeviceOptimizer(m.parameters(), 1.0, device=dev, overlap="next_forward",
                                **optim_cuda.KW)
    opt.register_forward_waits(m)
    allocs = dev.host_allocs
    assert allocs > 0
    optim_cuda.train(m, opt, 3)
    opt.load_state_dict(opt.state_dict())
    optim_cuda.train(m, opt, 1)
    torch.cuda.synchronize()
    assert dev.host_allocs == allocs
    assert opt._dev_part.optimizer is None
    sd = opt.state_dict()
    assert all(t.device.type == "cpu" for s in sd["state"].values() for t in s.values()
               if isinstance(t, torch.Tensor))
    # gradients were set to None; what stays is the fingerprints of what the optimizer wrote
    # (to tell a user's later edit from its own write): one 512-byte block per CPU bucket and per
    # module waiting for streamed parameters, never more than one per offloaded parameter
    fingerprints = 512 * (len(opt.offloaded_params()) + len(opt.streamed_params()))
    assert params_only <= torch.cuda.memory_allocated() <= params_only + fingerprints
    opt.close()


@pytest.mark.gpu
@pytest.mark.usefixtures("deterministic")
def test_loss_matches_the_gpu_baseline_and_checkpoint_scheduler_clipping():
    """Megatron's documented bound: loss within 0.001 of the non-offloaded baseline; plus a
    checkpoint round trip with an LR scheduler and clipping that continues bit-exact."""
    base = optim_cuda.model()
    base_opt = MasterWeightOptimizer(base.parameters(), **optim_cuda.KW)
    base_sched = torch.optim.lr_scheduler.StepLR(base_opt.optimizer, 2, gamma=0.5)
    base_losses, base_norms = [], []
    for i in range(6):
        loss = optim_cuda.loss_of(base, i)
        loss.backward()
        base_norms.append(torch.nn.utils.clip_grad_norm_(base.parameters(), 0.5))
        base_opt.step()
        base_opt.zero_grad()
        base_sched.step()
        base_losses.append(loss.item())

    def run(m, opt, sched, steps, start=0):
        losses, norms = [], []
        for i in range(start, start + steps):
            loss = optim_cuda.loss_of(m, i)
            loss.backward()
            norms.append(opt.clip_grad_norm_(0.5))
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.item())
        return losses, norms

    def fresh():
        m = optim_cuda.model()
        opt = optim_cuda.hybrid(m, 0.5, "backward_copies", param_update_in_fp32=True)
        return m, opt, torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)

    m, opt, sched = fresh()
    losses, norms = run(m, opt, sched, 3)
    sd, sched_sd = copy.deepcopy(opt.state_dict()), sched.state_dict()  # references, as torch's
    model_sd = {k: v.clone() for k, v in m.state_dict().items()}
    more, _ = run(m, opt, sched, 3, start=3)
    assert max(abs(a - b) for a, b in zip(losses + more, base_losses)) < 1e-3
    torch.testing.assert_close(norms[0].float().cpu(), base_norms[0].float().cpu(), rtol=1e-2, atol=0)

    m2, opt2, sched2 = fresh()
    m2.load_state_dict(model_sd)
    opt2.load_state_dict(sd)
    sched2.load_state_dict(sched_sd)
    more2, _ = run(m2, opt2, sched2, 3, start=3)
    assert more2 == more
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)


def _set_after_validate(monkeypatch):
    """An event set each time ``step()`` has checked the early work (``CpuPart.validate``)."""
    import threading

    done, real_validate = threading.Event(), CpuPart.validate

    def validate(self, *args, **kw):
        out = real_validate(self, *args, **kw)
        done.set()
        return out

    monkeypatch.setattr(CpuPart, "validate", validate)
    return done


def test_updates_starting_after_step_found_them_valid_keep_no_copy(monkeypatch):
    """An update queued during backward but started after ``step()`` validated its bucket (the
    CPU behind: the usual case at large fractions) is final: it keeps no copy to undo itself
    (one more read and write of its masters and state). Only the one that started before is
    speculative."""
    import threading

    gate, started, kept = _set_after_validate(monkeypatch), threading.Event(), []
    real_update = CpuBucket.update

    def update(self, *args, keep_previous=False, **kw):
        started.set()
        gate.wait(30)  # the first update starts before step(), the others queue behind it
        kept.append(keep_previous)
        return real_update(self, *args, keep_previous=keep_previous, **kw)

    monkeypatch.setattr(CpuBucket, "update", update)
    ref, _ = reference(1)
    m = model()
    opt = hybrid(m, 1.0, "backward_update", bucket_bytes=2**14)
    loss_of(m, 0).backward()
    assert started.wait(30)  # the worker took the first update before step() (a loaded host)
    opt.step()
    opt.zero_grad()
    assert len(kept) == len(opt._cpu.buckets) > 2
    assert kept[0] and not any(kept[1:]), kept
    assert_same_params(m, ref)
    opt.close()


def test_a_speculative_update_stops_its_copies_once_step_found_its_bucket_valid(monkeypatch):
    """An update started before ``step()`` copies what each chunk changes, so that it can be
    undone. Once ``step()`` has found its bucket valid the update stands: its remaining chunks
    copy nothing (the copies cost about as much as the update), and the result is exact."""
    import threading

    started, validated, answers, gated = threading.Event(), _set_after_validate(monkeypatch), [], []
    real_update = CpuBucket.update

    def update(self, *args, keep_previous=False, **kw):
        if not callable(keep_previous) or gated:  # only the first update is held
            return real_update(self, *args, keep_previous=keep_previous, **kw)
        gated.append(self)

        def ask():
            answer = keep_previous()
            answers.append(answer)
            if len(answers) == 1:  # its first chunk copies, then waits for step()'s check
                started.set()
                assert validated.wait(30)
            return answer

        return real_update(self, *args, keep_previous=ask, **kw)

    monkeypatch.setattr(CpuBucket, "update", update)
    ref, _ = reference(1)
    m = model()
    opt = hybrid(m, 1.0, "backward_update", bucket_bytes=2**18, cpu_chunk_bytes=4096)
    loss_of(m, 0).backward()
    assert started.wait(30)
    opt.step()
    opt.zero_grad()
    bucket = gated[0]
    assert len(bucket.chunks) > 2
    assert answers == [True, False]  # asked again at the second chunk, then no more
    assert not bucket.restorable
    assert_same_params(m, ref)
    opt.close()


@pytest.mark.parametrize("overlap", OVERLAP_MODES)
def test_zero_grad_frees_the_offloaded_gradients(overlap):
    """After ``step()`` and ``zero_grad()`` no gradient is kept alive by the CPU part's records
    (with ``next_forward`` they held every offloaded gradient until the updates in flight
    finished: memory a plain optimizer frees at ``zero_grad()``)."""
    import weakref

    cfg = tiny_config()
    model = build_model(cfg, torch.device("cpu"), seed=0)
    opt = HybridDeviceOptimizer(model.parameters(), 1.0, overlap=overlap, stream_fraction=0.0,
                                device=SimulatedDevice(), lr=1e-2)
    if overlap == "next_forward":
        opt.register_forward_waits(model)
    for i in range(2):
        model(make_input(cfg, torch.device("cpu"), seed=i)).float().square().mean().backward()
        grads = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad()
        gc.collect()
        assert grads and not [g for g in grads if g() is not None], overlap
    opt.close()
