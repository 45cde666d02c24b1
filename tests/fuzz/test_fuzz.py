"""The differential fuzzer in CI: a fixed budget of random programs (default 200, seed rotating
daily, printed), every failure reported in one assertion message with its reproducer; and tests
of the fuzzer itself (reproducible programs, standalone reproducers, comparison, shrinking).

    CPU_OFFLOAD_FUZZ_SEED=S CPU_OFFLOAD_FUZZ_COUNT=N python -m pytest tests/fuzz -q
    CPU_OFFLOAD_FUZZ_EXCLUDE='ckpt_stack=nonreentrant' ...   # leave out a known-defect feature
"""
from __future__ import annotations

import datetime
import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .codegen import program_source
from .prelude import Recorder, differences
from .runner import EXCLUDE_ENV, Isolated, Result, check, exclusions, run_many, without_excluded
from .shrink import report, shrink, spec_repr
from .spec import MISUSES, OPTIMIZERS, LayerSpec, OptSpec, ProgramSpec, features, generate, normalize

ROOT = Path(__file__).resolve().parents[2]
shrink_module = importlib.import_module(".shrink", __package__)  # the package exports shrink()
SEED_ENV, COUNT_ENV = "CPU_OFFLOAD_FUZZ_SEED", "CPU_OFFLOAD_FUZZ_COUNT"
SHRINK_ENV = "CPU_OFFLOAD_FUZZ_SHRINK_SECONDS"  # total shrinking time for the report (default 30)


def budget_seed() -> int:
    """``CPU_OFFLOAD_FUZZ_SEED``, else one seed per day (so a rerun the same day is identical)."""
    if os.environ.get(SEED_ENV):
        return int(os.environ[SEED_ENV])
    return (datetime.date.today() - datetime.date(2024, 1, 1)).days * 1000


def test_fuzz_budget(capsys):
    seed, count = budget_seed(), int(os.environ.get(COUNT_ENV, "200"))
    patterns = exclusions()
    with capsys.disabled():
        print(f"\nfuzz: programs {seed}..{seed + count - 1} ({SEED_ENV}={seed} {COUNT_ENV}={count}"
              f"{f' {EXCLUDE_ENV}=' + os.environ[EXCLUDE_ENV] if patterns else ''})")
    with Isolated() as isolated:  # crashes and hangs are reported, not fatal
        summary = run_many(seed, count, patterns, isolated=isolated)
        bad = summary.failures + summary.invalid
        if bad:
            _fail(summary, bad, count, isolated)


def _fail(summary, bad, count, isolated):
    deadline = time.perf_counter() + float(os.environ.get(SHRINK_ENV, "30"))
    texts, first = [], None
    for result in bad:
        if result.failed:
            left = deadline - time.perf_counter()
            small = shrink(result, min(left, 15.0), checker=isolated.check) if left > 0 else None
            texts.append(report(result, small))
            if first is None:
                first = program_source((small or result).spec)
        else:
            texts.append(f"seed {result.spec.seed}: the program fails without offloading too "
                         f"({result.invalid}): the generator must not make it\n  "
                         f"{spec_repr(result.spec)}")
    pytest.fail(
        f"{len(summary.failures)} of {count} fuzz programs differ with offloading "
        f"({len(summary.invalid)} invalid); rerun one with "
        f"`python -m tests.fuzz --seed S --count 1 --shrink` (docs/fuzzing.md)\n\n"
        + "\n\n".join(texts)
        + ("\n\nStandalone reproducer of the first failure:\n\n" + first if first else ""),
        pytrace=False,
    )


# --- the fuzzer itself ---------------------------------------------------------------------------


def test_a_seed_always_gives_the_same_program():
    for seed in range(40):
        assert generate(seed) == generate(seed)
        assert program_source(generate(seed)) == program_source(generate(seed))
        assert normalize(generate(seed)) == generate(seed)
    assert len({generate(s) for s in range(40)}) == 40


def test_generation_covers_every_dimension():
    seen = set()
    for seed in range(1000):
        seen |= features(generate(seed))
    expected = {
        "backend=v1", "backend=v2", "entry=ctx", "entry=sync_dict", "entry=manual", "entry=apply",
        "entry=apply_dict", "entry=plan", "dtype=float32", "dtype=float64", "dtype=bfloat16",
        "ckpt_stack=reentrant", "ckpt_stack=nonreentrant", "ckpt_layer=reentrant",
        "ckpt_layer=nonreentrant", "selective", "selective_scope=layer", "plan_recompute",
        "plan_spread", "plan_partial", "sync_dict", "manual_extra_model_layers", "out=tuple",
        "out=dict", "accumulation", "backward=retain_double", "backward=autograd_grad",
        "fault=fwd", "fault=bwd", "fault=between", "eval=inside", "eval=before", "optimizer",
        "overlap=none", "overlap=backward_copies", "overlap=backward_update",
        "overlap=next_forward", "edit=clip", "edit=scale", "edit=zero", "edit=none",
        "edit=zero_grad", "max_grad_norm", "stream", "stream_overlapped",
        "min_size=default", "min_size>0", "steps>1",
        # issue #39: what the optimizer programs combine besides fused AdamW and a float lr
        "dtype=float16", "mixed_dtypes", "zero_size", "scalar_param", "frozen", "lr=tensor",
        "groups>1", "sched=lambda", "sched=step", "scaler=step", "scaler=unscale",
        "scaler=unscale_clip", "scaler_inf_step", "edit=data_div", "edit=data_mul",
        "edit=clip_value", "edit=lr_fill", "edit=lr_set", "param_edit=clamp_data",
        "param_edit=clamp_nograd", "save=state_dict", "save=dcp", "close_reuse", "close_via_torch", "close_via_dcp", "ddp",
        "chunk_bytes_small", "pageable_grads", "pageable_params", "numpy_args",
        "stream_fraction=auto", "stream_fraction=1", "stream_fraction=part",
        "stream_during_backward", "stream_queued_in_two_parts", "stream_rest_deferred",
        "state_in_param_dtype",
        "state_read", "data_assign", "hook_stream",
    } | {f"layer={k}" for k in ("mlp", "attention", "conv1d", "conv2d", "rnn", "custom_function",
                                "inplace", "inplace_after_recipe", "views", "odd_params")} | {
        f"optim={name}" for name in OPTIMIZERS} | {f"misuse={m}" for m in MISUSES}
    assert expected <= seen, sorted(expected - seen)


SMALL = ProgramSpec(seed=5, layers=(LayerSpec("mlp"), LayerSpec("attention"), LayerSpec("views")),
                    num_layers=1)


def _standalone_agrees(spec):
    script = program_source(spec)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "the runs agree" in out.stdout


def test_a_program_that_agrees_passes_and_its_standalone_reproducer_runs():
    result = check(SMALL)
    assert not result.failed and result.invalid is None, result.problems
    _standalone_agrees(SMALL)


# Nothing offloaded (offload_fraction=0): the hybrid optimizer is the torch class on the
# device, so this program agrees on every version; its standalone reproducer exercises the
# optimizer features of issue #39 (DDP, GradScaler, groups, tensor lr, scheduler, mixed dtypes,
# zero-size, 0-dim and frozen parameters, .grad.data writes, clip_grad_value_, saves).
FEATURES = ProgramSpec(
    seed=6, layers=(LayerSpec("mlp"), LayerSpec("odd_params", dtype="bfloat16"),
                    LayerSpec("attention", ckpt="nonreentrant")),
    backwards=(("backward", "backward"), ("backward",), ("backward",)), frozen=(1,),
    optimizer=OptSpec(
        fraction=0.0, cls="sgd_nesterov", lr_tensor=True, groups=((("lr", 0.05),),),
        scheduler="step", scaler="unscale", inf_step=1, ddp=True,
        edits=(("data_div", 2, 3.0), ("clip_value", 0.01), ("lr", 1, 0.02)),
        saves=((0, "state_dict"), (2, "state_dict"))))


def test_the_optimizer_features_run_standalone():
    assert {"ddp", "scaler=unscale", "scaler_inf_step", "groups>1", "lr=tensor", "sched=step",
            "mixed_dtypes", "zero_size", "frozen", "edit=data_div", "edit=clip_value",
            "edit=lr_fill", "save=state_dict"} <= features(FEATURES)
    assert normalize(FEATURES) == FEATURES
    _standalone_agrees(FEATURES)


@pytest.mark.parametrize("backwards, inf_step, kept", [
    ((("backward",), ("backward",)), 0, False),          # the first step skipped
    ((("autograd_grad",), ("backward",)), 1, False),     # the first step is the second iteration's
    ((("autograd_grad",), ("backward",)), 0, True),      # no step there: nothing made
    ((("backward",), ("backward",)), 1, True),           # the buffers exist by then
])
def test_fused_sgd_never_skips_its_first_step_for_an_inf(backwards, inf_step, kept):
    """torch's fused SGD makes its momentum buffers with ``empty_like`` at a parameter's first
    step and leaves them unwritten when the scaler skips that step for an inf: reference and
    hybrid would then hold different uninitialized memory (seed 3070192: the first step came
    in the second iteration, after one of ``autograd.grad`` only, which calls no step)."""
    spec = ProgramSpec(seed=1, layers=(LayerSpec("mlp"),), backwards=backwards,
                       optimizer=OptSpec(fraction=0.0, cls="sgd_fused", scaler="step", inf_step=inf_step))
    assert normalize(spec).optimizer.inf_step == (inf_step if kept else None)


def test_a_hang_is_reported_and_the_worker_restarted():
    """``Isolated`` kills a worker that gives no result in time (here: still starting) and
    starts a new one for the next program."""
    with Isolated(timeout_s=0.2) as isolated:
        hung = isolated.check(SMALL)
        assert hung.signature == "timeout", hung.problems
        isolated.timeout_s = 300
        result = isolated.check(SMALL)
    assert not result.failed and result.invalid is None, result.problems


def test_differences_name_every_kind_of_disagreement():
    a, b = Recorder(), Recorder()
    for rec, value in ((a, torch.ones(2)), (b, torch.ones(2))):
        rec.put("step0.mb0.out", value)
        rec.put("step0.grads", [value, None])
    assert differences(a, b) == []
    b.items[1] = ("step0.grads", (torch.ones(2), torch.zeros(2)))
    assert differences(a, b) == ["step0.grads: entries [1] differ"]
    b.items[1] = a.items[1]
    b.items[0] = ("step0.mb0.out", torch.tensor([1.0, 1.0 + 2**-20]))
    assert differences(a, b) == ["step0.mb0.out: tensor(2,) torch.float32 != tensor(2,) torch.float32"]
    b.items[0] = a.items[0]
    b.error = RuntimeError("boom")
    assert differences(a, b)[0].startswith("exception: without offloading NoneType")
    b.refused = True  # a loud refusal where the program allows one is not a difference
    assert differences(a, b) == []


def test_shrinking_keeps_the_failure_and_drops_everything_else(monkeypatch):
    """With a stand-in for ``check`` that fails exactly on a nonreentrant stack checkpoint, the
    smallest program has one plain layer and nothing else."""
    def fake_check(spec):
        failed = spec.stack_ckpt == "nonreentrant"
        return Result(spec, ["step0.mb0.x_grad: differs"] if failed else [], 0.0)

    monkeypatch.setattr(shrink_module, "check", fake_check)
    spec = next(s for s in map(generate, range(1000))
                if s.stack_ckpt == "nonreentrant" and s.n >= 3 and s.optimizer is not None)
    small = shrink(fake_check(spec), budget_s=60).spec
    assert small == ProgramSpec(seed=spec.seed, layers=(LayerSpec("mlp"),),
                                stack_ckpt="nonreentrant"), spec_repr(small)
    assert "ProgramSpec(seed=" in report(fake_check(spec), fake_check(small))


def test_excluded_features_are_removed_and_nothing_else():
    patterns = exclusions("ckpt_stack=nonreentrant, overlap=backward_update+edit=*")
    assert exclusions("") == []
    changed = 0
    for seed in range(300):
        spec = generate(seed)
        kept = without_excluded(spec, patterns)
        have = features(kept)
        assert "ckpt_stack=nonreentrant" not in have
        assert not ("overlap=backward_update" in have and any(f.startswith("edit=") for f in have))
        if kept != spec:
            changed += 1
            assert kept.n == spec.n  # features go before layers do
    assert changed > 20
