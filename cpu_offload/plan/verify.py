"""Measure the planner's shortlist in the user's real step: the model ranks, the measurement
decides (``plan_offloading(..., verify_candidates=N)``).

Each candidate plan is applied with ``apply_offloading(layers, plan=candidate)``, ``step_fn()``
runs once untimed (pinned host buffers are allocated and selective layers recorded at a
context's first step) and ``TIMED_STEPS`` times timed, and the plan is removed again; the
candidates take turns for ``repeats`` rounds (every other round in reverse order), so that a
machine whose speed drifts meanwhile slows them alike. A candidate's time is the median of its
timed steps: the step a user gets. (A lower quartile of a few steps favoured the configurations
whose host work makes some steps slow: on the H100 it chose one whose rounds then spread by 15%,
1.9% behind the fastest.) On CUDA its peak (``torch.cuda.max_memory_allocated`` above what the
timed steps start with) must fit the budget too.
"""
from __future__ import annotations

import statistics
import warnings
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from ..core.checks import is_count
from ..core.errors import OffloadConfigError, stacklevel_outside_package
from ..core.units import format_bytes
from ..tools.apply import apply_offloading
from .profile import StepClock

__all__ = ["TIMED_STEPS", "Trial", "verify_plans"]

TIMED_STEPS = 2  # per candidate and round, after its untimed step


class Trial(NamedTuple):
    """One candidate plan measured in the real step (``Plan.verified``)."""

    layout: str  # the candidate's ``Plan.layout``
    predicted_ms: float  # the model's step time
    measured_ms: Optional[float]  # median of its timed steps; None: it failed
    peak_bytes: Optional[int]  # measured peak above what the step starts with (CUDA), else None
    rejected: Optional[str] = None  # why it may not be chosen (over the budget, an error)


# A test's stand-in for the measurement: (candidate, measured ms, measured peak or None) ->
# (ms, peak) to use instead.
MeasureHook = Callable[[Any, float, Optional[int]], tuple]


def verify_plans(
    step_fn: Callable[[], Any],
    layers: Any,
    candidates: Sequence[Any],
    repeats: int,
    cuda: bool,
    measure_hook: Optional[MeasureHook] = None,
) -> tuple:
    """``(chosen, trials)``: the candidate whose measured step is the fastest among those whose
    measured peak fits its ``memory_budget_bytes`` (ties: the model's order), and one ``Trial``
    per candidate, in the model's order. ``step_fn`` runs ``(1 + TIMED_STEPS) * repeats`` times
    per candidate.

    A candidate whose step raises is rejected (the plan is removed first, as after every
    step); if every candidate raises, the first exception propagates. If every candidate's
    measured peak is over the budget, the one with the lowest measured peak is chosen, with a
    warning.
    """
    clock = StepClock(cuda)
    times: list = [[] for _ in candidates]
    peaks: list = [None for _ in candidates]
    errors: list = [None for _ in candidates]
    first_exc: Optional[BaseException] = None
    for r in range(repeats):
        order = list(range(len(candidates)))
        for i in (order if r % 2 == 0 else order[::-1]):
            if errors[i] is not None:
                continue
            try:
                steps, peak = _trial(step_fn, layers, candidates[i], clock, cuda)
                if measure_hook is not None:
                    hooked = [measure_hook(candidates[i], ms, peak) for ms in steps]
                    steps, peak = [ms for ms, _ in hooked], hooked[-1][1]
            except Exception as exc:  # noqa: BLE001 - one candidate failing rejects only it
                errors[i] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                first_exc = first_exc or exc
                continue
            times[i].extend(steps)
            if peak is not None:
                peaks[i] = max(peaks[i] or 0, peak)
    if all(e is not None for e in errors):
        raise first_exc
    trials = []
    for c, ts, peak, err in zip(candidates, times, peaks, errors):
        budget = c.memory_budget_bytes
        rejected = f"failed: {err}" if err else None
        if not err and peak is not None and budget is not None and peak > budget:
            rejected = f"measured peak {format_bytes(peak)} over the budget {format_bytes(budget)}"
        ms = statistics.median(ts) if ts and not err else None
        trials.append(Trial(c.layout, c.step_ms, ms, peak, rejected))
    fits = [i for i, t in enumerate(trials) if t.rejected is None]
    if fits:
        return candidates[min(fits, key=lambda i: (trials[i].measured_ms, i))], tuple(trials)
    measured = [i for i, t in enumerate(trials) if t.measured_ms is not None]
    lowest = min(measured, key=lambda i: (trials[i].peak_bytes, i))
    warnings.warn(
        f"cpu_offload: every verified plan measured a peak over the memory budget; returning "
        f"the lowest ({trials[lowest].layout}: {trials[lowest].rejected}). Lower the budget "
        "or raise peak_margin so that the model keeps more distance from it",
        UserWarning, stacklevel=stacklevel_outside_package(),
    )
    return candidates[lowest], tuple(trials)


def _trial(step_fn: Callable[[], Any], layers: Any, candidate: Any, clock: StepClock,
           cuda: bool) -> tuple:
    """``(times, peak)`` of ``TIMED_STEPS`` timed steps with ``candidate`` applied (after one
    untimed step); the plan is removed whatever happens."""
    with warnings.catch_warnings():  # the trial's own findings are not the user's concern
        warnings.filterwarnings("ignore", message="cpu_offload: an offload step freed no")
        return _timed(step_fn, apply_offloading(layers, plan=candidate), clock, cuda)


def _timed(step_fn: Callable[[], Any], handle: Any, clock: StepClock, cuda: bool) -> tuple:
    try:
        step_fn()
        clock.synchronize()
        before = 0
        if cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(TIMED_STEPS):
            start = clock.mark()
            step_fn()
            end = clock.mark()
            clock.synchronize()
            times.append(clock.ms(start, end))
        peak = torch.cuda.max_memory_allocated() - before if cuda else None
    finally:
        handle.remove()
    return times, peak


def check_verify_candidates(value: Any) -> None:
    """``OffloadConfigError`` unless ``value`` is None or an int >= 0."""
    if value is None or (is_count(value) and value >= 0):
        return
    raise OffloadConfigError(
        f"verify_candidates must be None (measure 3 candidates on CUDA, none elsewhere) or an "
        f"int >= 0 (how many of the model's best plans to measure in the real step; 0: none), "
        f"got {value!r}"
    )
