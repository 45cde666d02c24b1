"""Make a failing program small: try one simplification at a time (drop a layer, a feature, a
micro-batch...) and keep it while the program still fails the same way; and write reproducers."""
from __future__ import annotations

import time
from dataclasses import fields, replace
from typing import Callable, Iterator, Optional, Tuple

from .codegen import program_source
from .runner import Result, check
from .spec import LayerSpec, OptSpec, ProgramSpec, feature_counts, features, normalize


def _remap(index: int, dropped: int) -> Optional[int]:
    return None if index == dropped else index - (index > dropped)


def drop_layer(spec: ProgramSpec, i: int) -> ProgramSpec:
    """``spec`` without layer ``i``; indices that named later layers move down."""
    def many(indices: tuple) -> tuple:
        return tuple(j for j in (_remap(k, i) for k in indices) if j is not None)

    manual = tuple(
        (j, r if r < 0 else max(j, r - (r > i)))
        for layer, r in spec.manual if (j := _remap(layer, i)) is not None
    )
    sync = tuple((j, e) for layer, e in spec.sync_dict if (j := _remap(layer, i)) is not None)
    fault = ()
    if spec.fault and spec.fault[1] != i:
        fault = (spec.fault[0], _remap(spec.fault[1], i))
    return replace(
        spec, layers=spec.layers[:i] + spec.layers[i + 1:], manual=manual, sync_dict=sync,
        recompute=many(spec.recompute), spread=many(spec.spread), selective=many(spec.selective),
        fault=fault,
    )


def reductions(spec: ProgramSpec) -> Iterator[Tuple[str, ProgramSpec]]:
    """Every one-step simplification of ``spec`` (not yet normalized)."""
    n = spec.n
    if n > 1:
        for i in range(n):
            yield f"drop layer {i}", drop_layer(spec, i)
    simpler = [
        ("optimizer", None), ("fault", ()), ("stack_ckpt", "none"), ("eval_forward", "none"),
        ("selective", ()), ("spread", ()), ("partial_bytes", None), ("extra_model_layers", 0),
        ("backend", "v2"), ("dtype", "float32"), ("width", 8), ("recompute", ()), ("frozen", ()),
    ]
    for name, value in simpler:
        if getattr(spec, name) != value:
            yield f"{name}={value!r}", replace(spec, **{name: value})
    entry = {"plan": "apply", "apply_dict": "apply", "apply": "ctx", "sync_dict": "ctx", "manual": "ctx"}
    if spec.entry in entry:
        yield f"entry={entry[spec.entry]!r}", replace(spec, entry=entry[spec.entry])
    if spec.num_layers > 0:
        yield f"num_layers={spec.num_layers - 1}", replace(spec, num_layers=spec.num_layers - 1)
    if spec.min_size != 0:
        yield "min_size=0", replace(spec, min_size=0)
    if spec.batch_bytes is not None:
        yield "batch_bytes=None", replace(spec, batch_bytes=None)
    for name in ("recompute", "selective", "sync_dict", "manual", "frozen"):
        items = getattr(spec, name)
        for j in range(len(items)):
            yield f"drop {name}[{j}]", replace(spec, **{name: items[:j] + items[j + 1:]})
    steps = spec.backwards

    def with_step(s: int, step: tuple) -> ProgramSpec:
        return replace(spec, backwards=steps[:s] + (step,) + steps[s + 1:])

    for s in range(len(steps)):
        if len(steps) > 1:
            yield f"drop step {s}", replace(spec, backwards=steps[:s] + steps[s + 1:])
        for m, how in enumerate(steps[s]):
            if len(steps[s]) > 1:
                yield f"drop micro-batch {s}.{m}", with_step(s, steps[s][:m] + steps[s][m + 1:])
            if how != "backward":
                plain = steps[s][:m] + ("backward",) + steps[s][m + 1:]
                yield f"plain backward {s}.{m}", with_step(s, plain)
    for i, layer in enumerate(spec.layers):
        for name, value in (("ckpt", "none"), ("out", "tensor"), ("variant", 0), ("kind", "mlp"),
                            ("dtype", None)):
            if getattr(layer, name) != value:
                layers = spec.layers[:i] + (replace(layer, **{name: value}),) + spec.layers[i + 1:]
                yield f"layer {i} {name}={value!r}", replace(spec, layers=layers)
    opt = spec.optimizer
    if opt is not None:
        for name in ("edits", "groups", "saves", "param_edits"):
            items = getattr(opt, name)
            for j in range(len(items)):
                fewer = items[:j] + items[j + 1:]
                yield (f"drop {name[:-1]} {items[j]}",
                       replace(spec, optimizer=replace(opt, **{name: fewer})))
        default = OptSpec()
        for f in fields(OptSpec):
            value = getattr(default, f.name)
            if f.name not in ("edits", "groups", "saves", "param_edits") and getattr(opt, f.name) != value:
                yield (f"optimizer {f.name}={value!r}",
                       replace(spec, optimizer=replace(opt, **{f.name: value})))


def remove_feature(spec: ProgramSpec, feature: str) -> ProgramSpec:
    """The first simplification of ``spec`` that has ``feature`` fewer times (dropping a layer
    is the last resort)."""
    have = feature_counts(spec)[feature]
    candidates = sorted(reductions(spec), key=lambda c: c[0].startswith("drop layer"))
    for _, candidate in candidates:
        candidate = normalize(candidate)
        if feature_counts(candidate)[feature] < have:
            return candidate
    raise ValueError(f"no simplification removes {feature!r}; it cannot be excluded")


def shrink(result: Result, budget_s: float = 60.0,
           log: Optional[Callable[[str], None]] = None,
           checker: Optional[Callable[[ProgramSpec], Result]] = None) -> Result:
    """The smallest program found that fails like ``result`` (same ``signature``), trying one
    simplification at a time, for at most ``budget_s`` seconds. ``checker``: how a candidate
    runs (default ``check``, in this process; ``runner.Isolated().check`` survives crashes)."""
    checker = checker or check
    best = result
    deadline = time.perf_counter() + budget_s
    progress = True
    while progress and time.perf_counter() < deadline:
        progress = False
        for what, candidate in reductions(best.spec):
            candidate = normalize(candidate)
            if candidate == best.spec:
                continue
            r = checker(candidate)
            if r.failed and r.signature == best.signature:
                best, progress = r, True
                if log:
                    log(f"  shrink: {what}")
                break
            if time.perf_counter() > deadline:
                break
    return best


# --- reproducers ---------------------------------------------------------------------------------


def spec_repr(spec: ProgramSpec) -> str:
    """``spec`` as a constructor call that leaves out default values.

    Example::

        >>> spec_repr(ProgramSpec(seed=3, layers=(LayerSpec("mlp"),), stack_ckpt="reentrant"))
        "ProgramSpec(seed=3, layers=(LayerSpec('mlp'),), stack_ckpt='reentrant')"
    """
    def short(obj) -> str:
        if isinstance(obj, (ProgramSpec, LayerSpec, OptSpec)):
            args = []
            for f in fields(obj):
                value = getattr(obj, f.name)
                if f.name in ("seed", "layers", "kind"):
                    args.append(short(value) if f.name == "kind" else f"{f.name}={short(value)}")
                elif value != f.default:
                    args.append(f"{f.name}={short(value)}")
            return f"{type(obj).__name__}({', '.join(args)})"
        if isinstance(obj, tuple):
            inner = ", ".join(short(v) for v in obj)
            return f"({inner},)" if len(obj) == 1 else f"({inner})"
        return repr(obj)

    return short(spec)


def snippet(spec: ProgramSpec) -> str:
    """A short reproducer that uses the fuzzer package (run from the repository root)."""
    return (
        "from tests.fuzz import *\n"
        f"print(check({spec_repr(spec)}).problems)"
    )


def report(result: Result, shrunk: Optional[Result] = None, standalone: bool = False) -> str:
    """The text printed for a failure: seed, what differs, reproducers."""
    lines = [f"seed {result.spec.seed} [{result.signature}]: " + "; ".join(result.problems[:3])]
    small = shrunk if shrunk is not None and shrunk.spec != result.spec else None
    lines += ["  features: " + ", ".join(sorted(features(result.spec)))]
    if small is not None:
        lines += ["  smallest failing program found: " + "; ".join(small.problems[:2])]
    lines += ["  reproducer:"] + ["    " + l for l in snippet((small or result).spec).splitlines()]
    if standalone:
        lines += ["  standalone reproducer:", program_source((small or result).spec)]
    return "\n".join(lines)
