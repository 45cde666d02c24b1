"""``CpuBucket`` over a staging buffer as the optimizer lays it out: masters mirror the staging
slices, each chunk's gradients come in and its new values go out in as few copies as possible,
and every result stays the wrapped class's, bit for bit."""
from __future__ import annotations

import pytest
import torch

from cpu_offload.optim import cpu_update
from cpu_offload.optim.cpu_update import LARGE_ELEMS, CpuBucket, coalesce, flat_offsets
from cpu_offload.optim.transfer import Staging

# odd numels: the staging pads each slice to 64 bytes, so runs span gaps
SHAPES = [(3001,), (129, 77), (5,), (2048,), (1000, 31), (70_001,)]
HYPERS = {"lr": 1e-2, "weight_decay": 0.1}


def _staged(dtypes):
    params = [torch.empty(s, dtype=d) for s, d in zip(SHAPES, dtypes)]
    staging = Staging(None, pinned=False)
    staging.add_bucket(params)
    views = [staging.typed(p) for p in params]
    gen = torch.Generator().manual_seed(0)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen))
    return params, views


def _reference(views, grads_per_step, clip, **kw):
    """The wrapped class run directly: fused AdamW over fp32 (or own-dtype) masters."""
    masters = [v.detach().to(cpu_update.master_dtype(v.dtype)).clone() for v in views]
    opt = torch.optim.AdamW(masters, fused=True, **HYPERS, **kw)
    outs = []
    for grads in grads_per_step:
        for m, g in zip(masters, grads):
            m.grad = None if g is None else g.to(m.dtype, copy=True)
            if g is not None and clip is not None:
                m.grad.mul_(clip)
        opt.step()
        outs.append([m.to(v.dtype, copy=True) for m, v in zip(masters, views)])
    return masters, opt, outs


@pytest.mark.parametrize("chunk", [0, 4096, 40_000, 100_000])
@pytest.mark.parametrize("mixed", [False, True], ids=["bf16", "bf16+fp32"])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_staged_bucket_equals_the_wrapped_class(chunk, mixed, clip):
    dtypes = [torch.bfloat16] * len(SHAPES)
    if mixed:
        dtypes[1] = dtypes[4] = torch.float32
    params, views = _staged(dtypes)
    hypers = [dict(HYPERS)]
    bucket = CpuBucket(params, [0] * len(params), views, hypers,
                       lambda groups: torch.optim.AdamW(groups, fused=True, **HYPERS), chunk)
    gen = torch.Generator().manual_seed(1)
    steps = []
    for step in range(3):
        grads = [torch.randn(s, generator=gen).to(d) for s, d in zip(SHAPES, dtypes)]
        if step == 1:
            grads[2] = grads[3] = None  # no gradient: skipped, its output untouched
        steps.append(grads)
    masters, opt, outs = _reference(views, steps, None if clip is None else torch.tensor(clip))
    coef = None if clip is None else torch.tensor(clip)
    scratch = torch.empty(bucket.scratch_elems)
    for grads, want in zip(steps, outs):
        before = [v.clone() for v in views]
        # gradients land in the staging slices; new values are written back into them
        staged = [None if g is None else v.copy_(g) for v, g in zip(views, grads)]
        bucket.update(staged, views, scratch, hypers, None if coef is None else coef.clone())
        for v, w, g, b in zip(views, want, grads, before):
            assert torch.equal(v, w if g is not None else b), (v.dtype, (v.float() - (w if g is not None else b).float()).abs().max())
    for i, (m, ref) in enumerate(zip(bucket.masters, masters)):
        assert torch.equal(m, ref)
        st, want = bucket.param_state(i), opt.state[ref]
        assert st.keys() == want.keys() and all(torch.equal(st[k], want[k]) for k in want)


def test_masters_mirror_the_staging_and_runs_cover_whole_chunks():
    params, views = _staged([torch.bfloat16] * len(SHAPES))
    offsets = flat_offsets(views)
    assert offsets == [(v.data_ptr() - views[0].data_ptr()) // 2 for v in views]
    gaps = [b - a - v.numel() for a, b, v in zip(offsets, offsets[1:], views)]
    assert any(gaps) and not all(gaps)  # padded after some parameters
    hypers = [dict(HYPERS)]
    bucket = CpuBucket(params, [0] * len(params), views, hypers,
                       lambda groups: torch.optim.AdamW(groups, fused=True, **HYPERS), 0)
    assert [m.data_ptr() - bucket.masters[0].data_ptr() for m in bucket.masters] == [4 * o for o in offsets]
    # the staging's padding is not the update's to write: fill it, and see it stays
    buf = torch.empty(0, dtype=torch.bfloat16).set_(views[0].untyped_storage()).view(-1)
    padding = torch.ones(buf.numel(), dtype=torch.bool)
    for o, v in zip(offsets, views):
        padding[o: o + v.numel()] = False
    buf[padding] = 7.0
    bucket.update(views, views, torch.empty(bucket.scratch_elems), hypers, None)
    assert bool((buf[padding] == 7.0).all())
    plan = bucket._plans[0]
    # one large piece (70_001) and small ones: one copy in (over the padding, into the scratch);
    # out, one copy per stretch without padding
    assert len(plan.convert_dst) == 1
    assert len(plan.write_dst) == 1 + sum(1 for g in gaps if g)
    # tensors that are not one buffer's slices: packed
    assert flat_offsets([torch.zeros(3), torch.zeros(4)]) == [0, 3]


def test_coalesce_merges_neighbours_and_keeps_large_pieces_apart():
    src, dst = torch.arange(3 * LARGE_ELEMS, dtype=torch.float32), torch.zeros(3 * LARGE_ELEMS)
    small = [(dst[i * 100: i * 100 + 90], src[i * 100: i * 100 + 90]) for i in range(3)]  # gaps of 10
    runs = coalesce(small)
    assert len(runs) == 1 and runs[0][0].numel() == 290
    assert len(coalesce(small, max_gap=0)) == 3  # gaps not to be written: no merge
    assert len(coalesce(small[:1] + [None] + small[2:])) == 2  # no gradient between: two runs
    n = LARGE_ELEMS
    large = [(dst[:n], src[:n]), (dst[n: 2 * n], src[n: 2 * n]), (dst[2 * n: 2 * n + 5], src[2 * n: 2 * n + 5])]
    runs = coalesce(large)
    assert [d.numel() for d, _ in runs] == [n, n + 5]
    for d, s in runs:
        d.copy_(s)
    assert torch.equal(dst[: 2 * n + 5], src[: 2 * n + 5])
    shifted = [(dst[:10], src[:10]), (dst[20:30], src[40:50])]  # offsets differ: two copies
    assert len(coalesce(shifted)) == 2


def _packed_buckets(chunk):
    """A maker of buckets over bf16 parameters from copies of staged values (not one buffer's
    slices: packed masters), the staged views and the hyperparameters."""
    params, views = _staged([torch.bfloat16] * len(SHAPES))
    hypers = [dict(HYPERS)]

    def make():
        return CpuBucket(params, [0] * len(params), [v.clone() for v in views], hypers,
                         lambda groups: torch.optim.AdamW(groups, fused=True, **HYPERS), chunk)

    return make, views, hypers


@pytest.mark.parametrize("answers", [[True] * 9, [True, False], [False]])
def test_keep_previous_asked_per_chunk(answers):
    """A callable ``keep_previous`` is asked before each chunk; after its first no, nothing more
    is copied and the update can no longer be undone. The update itself is the same."""
    make, views, hypers = _packed_buckets(40_000)
    plain, asked = make(), make()
    assert len(plain.chunks) > 2
    gen = torch.Generator().manual_seed(2)
    for step in range(2):
        grads = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in SHAPES]
        out_a, out_b = [torch.empty_like(v) for v in views], [torch.empty_like(v) for v in views]
        before = [m.clone() for m in asked.masters]
        plain.update(grads, out_a, torch.empty(plain.scratch_elems), hypers, None)
        calls = iter(answers + [False] * 9)
        asked.update(grads, out_b, torch.empty(asked.scratch_elems), hypers, None,
                     keep_previous=lambda: next(calls))
        assert all(torch.equal(a, b) for a, b in zip(out_a, out_b))
        assert all(torch.equal(a, b) for a, b in zip(plain.masters, asked.masters))
        assert asked.restorable == all(answers[: len(asked.chunks)])
        if asked.restorable:
            asked.restore()
            assert all(torch.equal(m, b) for m, b in zip(asked.masters, before))
            plain = make()  # both from the start again
            asked = make()
        else:
            with pytest.raises(RuntimeError):
                asked.restore()


def test_a_failing_chunk_leaves_the_chunks_before_it_written_and_the_rest_untouched():
    make, views, hypers = _packed_buckets(20_000)
    good, failing = make(), make()
    assert len(good.chunks) > 3

    def boom():
        raise RuntimeError("boom")

    failing.chunks[2].optimizer.step = boom
    grads = [torch.randn(s).to(torch.bfloat16) for s in SHAPES]
    out_good = [torch.zeros_like(v) for v in views]
    out_failing = [torch.zeros_like(v) for v in views]
    good.update(grads, out_good, torch.empty(good.scratch_elems), hypers, None)
    with pytest.raises(RuntimeError, match="boom"):
        failing.update(grads, out_failing, torch.empty(failing.scratch_elems), hypers, None)
    for ci, chunk in enumerate(failing.chunks):
        for pc in chunk.pieces:
            got = out_failing[pc.index].view(-1)[pc.start:pc.stop]
            want = out_good[pc.index].view(-1)[pc.start:pc.stop] if ci < 2 else torch.zeros_like(got)
            assert torch.equal(got, want), (ci, pc.index)
