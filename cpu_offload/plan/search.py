"""The search: the fastest offloading layout whose predicted peak fits a memory budget.

``plan(profile, memory_budget)`` compares, with the step model (``model.simulate``), every layout
of two families (``_layout``): offload the first ``k`` layers (the last one possibly in part) and
checkpoint the next ones, or offload the first layers and checkpoint *and* offload the next ones
(a checkpointed layer then holds nothing on the device between its forward and backward, for
little link time: what takes a plan below checkpointing every layer); each with selective
recomputation on the following layers, and on the offloaded ones or not. With a host model in
the profile, each layout is also tried with its offloaded layers spread (``spread_layers``).
The simple families ``benchmarks/frontier.py`` measures (``ckpt k``, ``off k``, ``sel k``:
``family_params``) are always candidates, whatever the search's stride, so that in the model a
plan is never worse than any of them.
``plan_offloading`` profiles the user's real step (``profile.profile_step``) and searches.

Note [partial layers]: whole layers are coarse. When the link can move 3.4 layers' bytes during
the forward, offloading 3 wastes link time and offloading 4 stalls. So the last offloaded layer
may be offloaded only in part (the first quarter, half or three quarters of the bytes it saves,
in the order it saves them; the rest stays on the device), which lets a plan use the link up to
its capacity.
"""
from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass, field, replace
from itertools import product
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from torch import nn

from ..core.checks import check_bool, is_count
from ..core.device import OffloadDevice
from ..core.errors import OffloadConfigError, stacklevel_outside_package
from ..core.units import format_bytes
from ..v2.selection import DEFAULT_MIN_TENSOR_SIZE
from ..tools.layers import as_layer_list
from .guard import untouched
from .model import HostCost, LayerProfile, simulate, spread_layers
from .profile import StepProfile, profile_step
from .verify import MeasureHook, check_verify_candidates, verify_plans

__all__ = ["Plan", "plan", "plan_offloading"]

PARTIAL_FRACTIONS = (0.25, 0.5, 0.75)  # shares of the last offloaded layer's bytes a plan may move
# Of the peak without offloading: how far over the budget a simple family's predicted peak may
# be and still be measured by verification (the model overestimated selective layouts' peaks by
# up to 4.3% of it on the H100's GPT workload: sel 4 predicted 0.422, measured 0.386).
NEAR_BUDGET = 0.05
# How much slower than the plan such a family may be predicted (the model overestimated
# offloaded selective layouts' times by up to 10% there: sel 6 predicted 1.284x, measured 1.167x).
NEAR_TIME = 0.10
PEAK_MARGIN = 0.01  # of the peak without offloading: a plan's predicted peak stays this far under



def ratio(value: float, baseline: float) -> float:
    """``value / baseline``; with a zero baseline (a step that saves nothing offloadable), 1.0
    for a zero value (the plan changes nothing), else infinity: never NaN."""
    if baseline:
        return value / baseline
    return 1.0 if not value else float("inf")


@dataclass(frozen=True)
class Plan:
    """What to do with each layer: offload ``num_layers`` layers (the first ones, or the
    ``offloaded`` ones), checkpoint the layers in ``recompute``, recompute the cheap saved tensors
    of the layers in ``selective``.

    ``plan_offloading`` returns one, with the predicted ``step_ms`` and ``peak_bytes`` (and their
    ratios to the step without offloading, ``time_ratio`` and ``peak_ratio``), the runners-up in
    ``alternatives`` (the five fastest predicted plans that fit, and the fastest of the simple
    families, ``family_params``, if not among them), the candidates measured in the real step
    in ``verified`` (``verify.Trial``s), and what it was measured with; ``describe()`` says it in words;
    ``apply_offloading(layers, plan=plan)`` applies it. A plan built by hand applies the same way
    (e.g. ``Plan(0, recompute=(0, 1))``: checkpoint two layers, offload nothing).

    Example::

        >>> import cpu_offload
        >>> plan = cpu_offload.Plan(num_layers=2, recompute=(2,), model_layers=6)
        >>> plan.offloaded_layers
        (0, 1)
        >>> print(plan.describe()[:80])
        offload the first 2 layers (get_cpu_offload_context(num_layers=2)), recompute la
    """

    num_layers: int
    recompute: tuple = ()
    step_ms: float = 0.0
    peak_bytes: int = 0
    baseline_ms: float = 0.0
    baseline_peak_bytes: int = 0
    alternatives: list = field(default_factory=list, compare=False, repr=False)
    # Filled by ``plan_offloading`` (a plan from a real step), read by ``apply_offloading``:
    memory_budget_bytes: Optional[int] = None
    min_tensor_size_to_offload: Optional[int] = None  # the selection the bytes were counted with
    d2h_gbps: Optional[float] = None
    h2d_gbps: Optional[float] = None
    profiles: tuple = field(default=(), compare=False, repr=False)  # LayerProfile per layer
    # The last offloaded layer (``num_layers - 1``) may offload only part of what it saves:
    partial_fraction: float = 1.0  # the share of its bytes the plan assumed
    partial_bytes: Optional[int] = None  # its byte limit, applied by ``apply_offloading``
    selective: tuple = ()  # layers whose cheap saved tensors are recomputed (never stored)
    selective_scope: str = "modules"  # where their ops were recorded when profiled
    model_layers: int = 0  # the number of layers planned for
    # Which layers are offloaded when not the first ``num_layers`` (``spread_layers``); the last
    # of them is the one offloaded in part. Empty: the first ``num_layers``.
    offloaded: tuple = ()
    # The offload device the plan was measured on (``plan_offloading(device=...)``; None: CUDA):
    # ``apply_offloading(layers, plan=plan)`` offloads from it unless given ``device=``.
    device: Any = field(default=None, compare=False, repr=False)
    # The candidates ``plan_offloading(..., verify_candidates=N)`` measured in the real step
    # (``verify.Trial``s, in the model's order), this plan the fastest that fit; empty: none.
    verified: tuple = field(default=(), compare=False, repr=False)
    # Simple families predicted over the budget by less than the model's error on peaks
    # (``NEAR_BUDGET``), and slower than this plan by less than its error on times
    # (``NEAR_TIME``): the fastest of each family, at most two. Verification measures them
    # too, and keeps one only if its measured peak fits (CUDA). Not plans to apply unmeasured.
    near_budget: tuple = field(default=(), compare=False, repr=False)

    @property
    def offloaded_layers(self) -> tuple:
        """The layers this plan offloads (the first ``num_layers`` unless spread)."""
        return tuple(self.offloaded) or tuple(range(self.num_layers))

    @property
    def time_ratio(self) -> float:
        return ratio(self.step_ms, self.baseline_ms)

    @property
    def peak_ratio(self) -> float:
        return ratio(self.peak_bytes, self.baseline_peak_bytes)

    @property
    def layout(self) -> str:
        """The layout in a few words, e.g. ``"offload 0-2 (2: 50%), recompute 3, selective
        0-7"`` (``Plan.verified`` names candidates this way).

        Example::

            >>> Plan(2, recompute=(2, 3), selective=(0, 1, 2, 3, 5), model_layers=6).layout
            'offload 0-1, recompute 2-3, selective 0-3, 5'
        """
        offl = self.offloaded_layers
        parts = [f"offload {_ranges(offl)}" if offl else "offload none"]
        if self.partial_bytes is not None:
            parts[0] += f" ({offl[-1]}: {self.partial_fraction:.0%})"
        if self.recompute:
            parts.append(f"recompute {_ranges(self.recompute)}")
        if self.selective:
            parts.append(f"selective {_ranges(self.selective)}")
        return ", ".join(parts)

    @property
    def measured_ms(self) -> Optional[float]:
        """This plan's step time measured by ``plan_offloading``'s verification, else None."""
        return next((t.measured_ms for t in self.verified if t.layout == self.layout), None)

    def describe(self) -> str:
        rec = ", ".join(map(str, self.recompute)) or "none"
        part = ""
        offl = self.offloaded_layers
        if self.partial_bytes is not None:
            part = (
                f", of layer {offl[-1]} only its first "
                f"{self.partial_fraction:.0%} of saved bytes ({format_bytes(self.partial_bytes)})"
            )
        sel = ", ".join(map(str, self.selective)) or "none"
        moved = [r for r in self.recompute if r in offl]
        if moved:
            rec += f" (of which {', '.join(map(str, moved))} offload their checkpointed inputs)"
        if offl != tuple(range(self.num_layers)):
            what = (f"offload layers {', '.join(map(str, offl))} (spread, so that the host "
                    "issues each offloaded layer while the GPU still runs earlier ones: "
                    "cpu_offload.spread_synchronization_dict)")
        elif self.num_layers and self.num_layers == self.model_layers:
            what = (f"offload all {self.num_layers} layers (the last one's input when the forward "
                    "pass ends: cpu_offload.plan_synchronization_dict)")
        else:
            what = (f"offload the first {self.num_layers} layers (get_cpu_offload_context("
                    f"num_layers={self.num_layers}))")
        return (
            f"{what}{part}, recompute layers: {rec}, selective layers: {sel}; "
            f"predicted step {self.step_ms:.1f} ms "
            f"({self.time_ratio:.3f}x), peak activations {format_bytes(self.peak_bytes)} "
            f"({self.peak_ratio:.3f}x){self._verification()}; apply with "
            "cpu_offload.apply_offloading(layers, plan=plan)"
        )

    def _verification(self) -> str:
        """What the verification measured, in words ("" without one)."""
        if not self.verified:
            return ""
        others = []
        for t in self.verified:
            if t.layout == self.layout:
                continue
            what = f"{t.measured_ms:.1f} ms" if t.measured_ms is not None else "-"
            others.append(f"{t.layout}: {what}" + (f" ({t.rejected})" if t.rejected else ""))
        mine = self.measured_ms
        return (f"; measured {mine:.1f} ms in the real step, the fastest of "
                f"{len(self.verified)} verified candidates"
                + (f" (the others: {'; '.join(others)})" if others else ""))


def _ranges(layers: Sequence[int]) -> str:
    """``"0-3, 5"`` for ``(0, 1, 2, 3, 5)``."""
    out, run = [], []
    for j in layers:
        if run and j != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
            run = []
        run.append(j)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}")
    return ", ".join(out)


def plan(
    profile: StepProfile,
    memory_budget: Union[None, int, float] = None,
    *,
    partial: bool = True,
    peak_margin: float = PEAK_MARGIN,
    spread: bool = True,
) -> Plan:
    """Fastest ``(num_layers, recompute, selective)`` for a measured step whose predicted peak
    fits ``memory_budget``.

    ``profile`` is a ``StepProfile``: what ``profile_step`` measured, or one built from
    ``LayerProfile``s and a link speed. ``memory_budget``: peak bytes above what the step starts
    with (``int``), a fraction of the predicted peak without offloading (``float`` in (0, 1]), or
    ``None``: the fastest plan that offloads as much as possible at no predicted time cost.

    Recomputation is tried on the earliest non-offloaded layers (resident the longest), and
    on offloaded layers after the ones offloaded whole (a checkpointed offloaded layer offloads
    only its input); then selective recomputation on the next ones, and on all offloaded
    layers or none of them (when the profiles say what it removes, ``selective_bytes``). With
    ``partial``, the last offloaded layer may also be offloaded in part (``PARTIAL_FRACTIONS``
    of its bytes; ``Plan.partial_bytes`` is the resulting byte limit).
    The profile's ``peak_bytes`` (peak of one real step without offloading) calibrates the memory
    model: what it misses (gradients between layers, loss temporaries) is added to every plan.
    Its ``step_ms`` (time of one real step without offloading) does the same for time: what runs
    outside the layers (embedding, loss, optimizer hooks) is added to every plan, so ratios are to
    the whole step. Its ``memory_timeline`` (see ``simulate``) replaces that memory calibration
    with the measured step's own peaks, segment by segment. ``peak_margin`` (a fraction of the
    peak without offloading, default ``PEAK_MARGIN``) is kept between a plan's predicted peak and
    the budget, for the model's error; 0 trusts the prediction. ``offload_ms_per_gb`` and
    ``offload_host_cost``: see ``simulate``. With ``spread`` and a host model (``host_fwd_ms`` in
    the profiles, an ``offload_host_cost`` that is not free), each layout that offloads whole
    layers is also tried with its offloaded layers spread (``spread_layers``), its checkpointed
    and selective layers after them or in between (``_spread_layouts``).

    The simple families (``family_params``: checkpoint the first k layers, offload the first
    k, offload the first k with every layer selective) are always compared.
    Up to ``COARSE_LAYERS`` (24) layers every layout is compared. Above that the search first
    steps through layer counts in strides of ``ceil(n / 24)``, then compares every layout
    within one stride of the best: about a tenth of the candidates (seconds for 80 layers
    instead of many minutes), for a plan whose predicted time was within 1% of the exhaustive
    search's in tests with 26-32 layers.

    Example::

        >>> layers = [LayerProfile(activation_bytes=2**30, input_bytes=2**24, fwd_ms=50.0,
        ...                        bwd_ms=100.0)] * 8
        >>> chosen = plan(StepProfile(layers, d2h_gbps=25.0, h2d_gbps=25.0), 0.5)
        >>> chosen.num_layers, chosen.time_ratio   # the link hides every copy: no time cost
        (6, 1.0)
    """
    profiles = profile.layers
    if len(profiles) < 2:
        raise OffloadConfigError("planning needs at least 2 layers (one stays on the device)")
    n = len(profiles)
    if isinstance(peak_margin, bool) or not isinstance(peak_margin, (int, float)) or not (
            0.0 <= peak_margin < 1.0):
        raise OffloadConfigError(
            f"peak_margin is a fraction of the peak without offloading in [0, 1), got "
            f"{peak_margin!r}"
        )
    d2h_gbps, h2d_gbps = profile.d2h_gbps, profile.h2d_gbps
    memory_timeline = profile.memory_timeline
    offload_ms_per_gb, host_cost = profile.offload_ms_per_gb, profile.offload_host_cost
    base_ms, base_peak, extra_ms, extra = _baseline(
        profiles, d2h_gbps, h2d_gbps, profile.peak_bytes, profile.step_ms, memory_timeline,
    )
    if memory_budget is not None:
        memory_budget = check_memory_budget(memory_budget)
    if isinstance(memory_budget, float):
        memory_budget_bytes: Optional[int] = int(memory_budget * base_peak)
    else:
        memory_budget_bytes = None if memory_budget is None else int(memory_budget)
    if not any(p.activation_bytes for p in profiles):
        return _nothing_to_offload(profile, base_ms, base_peak, memory_budget_bytes)
    selective = any(p.selective_bytes for p in profiles)
    limit = None if memory_budget_bytes is None else (
        # Measured peaks have landed within 0.7% of the baseline's peak of the prediction (H100,
        # both workloads): keep a margin, so that a plan meets its budget.
        memory_budget_bytes - int(peak_margin * base_peak))
    candidates: dict = {}

    def evaluate(params: tuple) -> None:
        if params in candidates:
            return
        layout = _layout(params)
        add(params, *layout, offloaded=None)
        if spread and not host_cost.is_free:
            for i, (offl, rec, sel) in enumerate(_spread_layouts(profiles, *layout, host_cost)):
                add(params + ("spread", i), layout[0], layout[1], rec, sel, offloaded=offl)

    def add(params: tuple, k: int, frac: float, rec: tuple, sel: tuple,
            offloaded: Optional[tuple]) -> None:
        ms, peak = simulate(
            profiles, k, rec, d2h_gbps, h2d_gbps, frac, memory_timeline, sel, offload_ms_per_gb,
            offloaded, host_cost,
        )
        cap = None
        if frac < 1.0:
            last = offloaded[-1] if offloaded else k - 1
            cap = int(profiles[last].stored_bytes(last in rec, last in sel) * frac)
        candidates[params] = Plan(
            k, rec, ms + extra_ms, peak + extra, base_ms, base_peak,
            partial_fraction=frac, partial_bytes=cap, selective=sel, model_layers=n,
            offloaded=tuple(offloaded or ()),
        )

    stride = -(-n // COARSE_LAYERS)  # 1 up to COARSE_LAYERS layers: every layout
    for params in _layout_params(n, partial, selective, stride):
        evaluate(params)
    for params in family_params(n, selective):  # never worse than a simple family, in the model
        evaluate(params)
    if stride > 1:  # then every layout within one stride of the best coarse one
        centre = _pick(candidates, limit, lowest_if_none=True)[:6]
        for params in _neighbours(centre, n, partial, selective, stride):
            evaluate(params)
    best_params = _pick(candidates, limit)
    if best_params is None:
        lowest = min(c.peak_bytes for c in candidates.values())
        err = OffloadConfigError(
            f"no plan fits memory_budget_bytes={memory_budget_bytes}: the lowest predicted "
            f"peak is {lowest} bytes (plans keep peak_margin={peak_margin:.1%} of the peak "
            "without offloading as a margin for the model's error); raise the budget, lower "
            "peak_margin, or reduce the batch"
        )
        err.lowest_peak_bytes = lowest  # what a budget needs (with peak_margin=0) to fit a plan
        raise err
    by_time = lambda c: (c.step_ms, c.peak_bytes)  # noqa: E731
    fits = sorted((c for _, c in _fitting(candidates, limit)), key=by_time)
    others = fits[:5]  # and the fastest fitting plan of each family (see ``shortlist``)
    others += [c for c in fastest_of_each_family(fits).values() if c not in others]
    near: list = []  # the fastest layout of each family just over the budget (Plan.near_budget)
    if limit is not None:
        slowest = candidates[best_params].step_ms * (1 + NEAR_TIME)
        slack = memory_budget_bytes + int(NEAR_BUDGET * base_peak)
        near = list(fastest_of_each_family(
            c for c in sorted(candidates.values(), key=by_time)
            if limit < c.peak_bytes <= slack and c.step_ms < slowest).values())[:2]
    complete = dict(  # what apply_offloading and describe() read
        memory_budget_bytes=memory_budget_bytes,
        min_tensor_size_to_offload=profile.min_tensor_size_to_offload,
        selective_scope=profile.selective_scope,
        d2h_gbps=d2h_gbps,
        h2d_gbps=h2d_gbps,
        profiles=tuple(profiles),
        device=profile.device,
    )
    return replace(candidates[best_params], **complete,
                   alternatives=[replace(c, **complete) for c in others],
                   near_budget=tuple(replace(c, **complete) for c in near))


def _nothing_to_offload(profile: StepProfile, base_ms: float, base_peak: int,
                        memory_budget_bytes: Optional[int]) -> Plan:
    """The plan of a step whose layers save nothing V2 would offload: offload and recompute
    nothing, with a warning that says why."""
    warnings.warn(
        f"cpu_offload: nothing to offload: every saved tensor is below "
        f"min_tensor_size_to_offload={profile.min_tensor_size_to_offload} elements (or is a "
        "weight, or opted out), so the plan offloads and recomputes nothing; lower "
        "min_tensor_size_to_offload to move smaller tensors",
        UserWarning,
        stacklevel=stacklevel_outside_package(),
    )
    return Plan(
        0, (), base_ms, base_peak, base_ms, base_peak,
        memory_budget_bytes=memory_budget_bytes,
        min_tensor_size_to_offload=profile.min_tensor_size_to_offload,
        selective_scope=profile.selective_scope,
        d2h_gbps=profile.d2h_gbps,
        h2d_gbps=profile.h2d_gbps,
        profiles=tuple(profile.layers),
        model_layers=len(profile.layers),
        device=profile.device,
    )


COARSE_LAYERS = 24  # above this many layers the search first steps through layer counts


def _baseline(
    profiles: Sequence[LayerProfile],
    d2h_gbps: float,
    h2d_gbps: float,
    measured_baseline_peak: Optional[int] = None,
    measured_baseline_ms: Optional[float] = None,
    memory_timeline: Optional[Sequence[int]] = None,
) -> tuple:
    """``(step_ms, peak_bytes, extra_ms, extra_bytes)`` of the step without offloading, as
    ``plan`` calibrates it: the model's prediction plus what the measured step adds outside the
    layers (``extra_*``, added to every plan too; no extra bytes with a ``memory_timeline``,
    which is the measured step itself)."""
    ms, peak = simulate(profiles, 0, (), d2h_gbps, h2d_gbps, 1.0, memory_timeline)
    extra = max(0, measured_baseline_peak - peak) if measured_baseline_peak else 0
    if memory_timeline is not None:
        extra = 0
    extra_ms = max(0.0, measured_baseline_ms - ms) if measured_baseline_ms else 0.0
    return ms + extra_ms, peak + extra, extra_ms, extra


def _fitting(candidates: dict, limit: Optional[int]) -> list:
    """The ``(params, plan)`` items a pick chooses from: within the peak ``limit``, or (no
    budget) within 0.1% of the fastest."""
    if limit is None:
        fastest = min(c.step_ms for c in candidates.values())
        return [i for i in candidates.items() if i[1].step_ms <= fastest * 1.001]
    return [i for i in candidates.items() if i[1].peak_bytes <= limit]


def _pick(candidates: dict, limit: Optional[int], lowest_if_none: bool = False) -> Optional[tuple]:
    """Parameters of the best candidate: fastest, then lowest peak, fewest recomputed and
    selective layers; ``None`` if none fits (or, with ``lowest_if_none``, the lowest peak)."""
    def key(item: tuple) -> tuple:
        c = item[1]
        return (round(c.step_ms, 3), c.peak_bytes, len(c.recompute), len(c.selective))

    items = _fitting(candidates, limit)
    if not items:
        if not lowest_if_none:
            return None
        return min(candidates.items(), key=lambda i: i[1].peak_bytes)[0]
    return min(items, key=key)[0]


def _layout_params(n: int, partial: bool, selective: bool, stride: int = 1):
    """The planner's layouts as parameter tuples (see ``_layout``); with ``stride`` > 1 only
    every ``stride``-th layer count (and the largest) of each dimension."""
    def counts(lo: int, hi: int) -> list:  # lo..hi inclusive, every stride-th, and hi
        return sorted(set(range(lo, hi + 1, stride)) | ({hi} if hi >= lo else set()))

    sel_counts = (lambda used: counts(0, n - used)) if selective else (lambda used: [0])
    for k in counts(0, n - 1):
        fractions = (1.0,) + (PARTIAL_FRACTIONS if partial and k else ())
        for frac, sel_off in product(fractions, (False, True) if selective and k else (False,)):
            for r in counts(0, n - k):
                for s in sel_counts(k + r):
                    yield ("offload", k, frac, sel_off, r, s)
    for a in counts(0, n - 2):
        for sel_off in (False, True) if selective and a else (False,):
            for c in counts(1, n - a):  # a + c == n: the last input released at forward end
                for r in counts(0, n - a - c):
                    for s in sel_counts(a + c + r):
                        yield ("checkpoint-offload", a, c, sel_off, r, s)


FAMILIES = ("ckpt", "off", "sel")


def family_params(n: int, selective: bool) -> list:
    """The simple families every plan is compared with, as ``_layout`` parameters, whatever
    the search's stride: ``ckpt k`` (checkpoint the first ``k`` layers, offload nothing,
    k = 1..n), ``off k`` (offload the first ``k``, k = 1..n-1) and, when the profiles say
    what selective recomputation removes, ``sel k`` (every layer selective, the first ``k``
    offloaded, k = 0..n-1): the configurations ``benchmarks/frontier.py`` measures.

    Example::

        >>> [_layout(p) for p in family_params(2, selective=True)]   # doctest: +NORMALIZE_WHITESPACE
        [(0, 1.0, (0,), ()), (0, 1.0, (0, 1), ()), (1, 1.0, (), ()), (0, 1.0, (), (0, 1)),
         (1, 1.0, (), (0, 1))]
    """
    params = [("offload", 0, 1.0, False, k, 0) for k in range(1, n + 1)]  # ckpt k
    params += [("offload", k, 1.0, False, 0, 0) for k in range(1, n)]  # off k
    if selective:  # sel k: sel 0 is s = n; sel k offloads k selective layers, n - k follow
        params += [("offload", 0, 1.0, False, 0, n)]
        params += [("offload", k, 1.0, True, 0, n - k) for k in range(1, n)]
    return params


def family_of(plan: "Plan") -> Optional[str]:
    """``"ckpt k"``, ``"off k"`` or ``"sel k"`` when ``plan`` is one of the simple families
    (``family_params``), else None.

    Example::

        >>> family_of(Plan(2, selective=(0, 1, 2, 3), model_layers=4))
        'sel 2'
    """
    n, k = plan.model_layers, plan.num_layers
    if plan.partial_bytes is not None or plan.offloaded_layers != tuple(range(k)):
        return None
    if plan.selective:
        ok = not plan.recompute and tuple(plan.selective) == tuple(range(n))
        return f"sel {k}" if ok and k < n else None
    if k == 0 and plan.recompute and tuple(plan.recompute) == tuple(range(len(plan.recompute))):
        return f"ckpt {len(plan.recompute)}"
    if not plan.recompute and 0 < k < n:
        return f"off {k}"
    return None


def fastest_of_each_family(plans: Iterable["Plan"]) -> dict:
    """Family kind (``"ckpt"``, ``"off"``, ``"sel"``: ``family_of``) -> the first plan of that
    kind in ``plans``, in the order met (give them fastest first).

    Example::

        >>> plans = [Plan(2, model_layers=4), Plan(0, recompute=(0,), model_layers=4),
        ...          Plan(1, model_layers=4)]
        >>> {kind: p.layout for kind, p in fastest_of_each_family(plans).items()}
        {'off': 'offload 0-1', 'ckpt': 'offload none, recompute 0'}
    """
    out: dict = {}
    for p in plans:
        family = family_of(p)
        if family is not None:
            out.setdefault(family.split()[0], p)
    return out


def _neighbours(params: tuple, n: int, partial: bool, selective: bool, stride: int):
    """Every valid layout of the same family whose layer counts are each within ``stride`` of
    ``params``' (any partial fraction and selective choice for the offloaded layers)."""
    family, x, y, _, r, s = params
    near = lambda v: range(v - stride, v + stride + 1)  # noqa: E731
    sel_near = near(s) if selective else (0,)
    if family == "offload":
        for k, r2, s2 in product(near(x), near(r), sel_near):
            if not (0 <= k < n and 0 <= r2 <= n - k and 0 <= s2 <= n - k - r2):
                continue
            fractions = (1.0,) + (PARTIAL_FRACTIONS if partial and k else ())
            for frac, sel_off in product(fractions, (False, True) if selective and k else (False,)):
                yield ("offload", k, frac, sel_off, r2, s2)
    else:
        for a, c, r2, s2 in product(near(x), near(y), near(r), sel_near):
            if not (0 <= a <= n - 2 and 1 <= c <= n - a and 0 <= r2 <= n - a - c
                    and 0 <= s2 <= n - a - c - r2):
                continue
            for sel_off in (False, True) if selective and a else (False,):
                yield ("checkpoint-offload", a, c, sel_off, r2, s2)


def _layout(params: tuple) -> tuple:
    """``(num_layers, partial_fraction, recompute, selective)`` of one parameter tuple.

    Two families, each with selective recomputation on the ``s`` layers after the
    checkpointed ones (and on the fully offloaded ones, ``sel_off``, or not):

    - ``("offload", k, frac, sel_off, r, s)``: offload the first ``k`` layers (the last one
      ``frac`` of its bytes), checkpoint the next ``r``;
    - ``("checkpoint-offload", a, c, sel_off, r, s)``: offload the first ``a`` layers whole,
      checkpoint the next ``c`` *and offload their inputs* (so ``num_layers = a + c``: a
      checkpointed layer then holds nothing on the device between its forward and backward,
      for a few MB over the link), checkpoint the next ``r``.
    """
    if params[0] == "offload":
        _, k, frac, sel_off, r, s = params
        full, first_rec = k, k
    else:
        _, a, c, sel_off, r, s = params
        k, frac, full, first_rec = a + c, 1.0, a, a
    rec = tuple(range(first_rec, k + r))
    sel = tuple(range(full) if sel_off else ()) + tuple(range(k + r, k + r + s))
    return k, frac, rec, sel


def _spread_layouts(
    profiles: Sequence[LayerProfile], k: int, frac: float, rec: tuple, sel: tuple,
    host_cost: HostCost,
) -> list:
    """``(offloaded, recompute, selective)`` layouts of the "offload" family with its ``k``
    offloaded layers spread by ``spread_layers``, the other layers keeping their roles
    (checkpointed, selective, plain) in the same order, in two ways: the layers skipped in
    between stay plain (the roles follow the last offloaded layer), or the roles fill them
    first (checkpointing every layer but one spread, offloaded one). None of them when the
    spread layers are the first ``k`` anyway, or when the layout checkpoints offloaded layers
    (those offload only their inputs: nothing to spread); the first way only where the roles
    fit after the last offloaded layer."""
    n = len(profiles)
    if not 0 < k < n or any(r < k for r in rec):
        return []
    sel_off = all(j in sel for j in range(k))
    nbytes = [p.stored_bytes(False, sel_off) for p in profiles]
    offl = spread_layers(profiles, k, nbytes, host_cost)
    if offl == tuple(range(k)):
        return []
    roles = ["rec" if j in rec else "sel" if j in sel else "" for j in range(k, n)]
    layouts = []
    for others in ([j for j in range(offl[-1] + 1, n)],  # after the last offloaded layer
                   [j for j in range(n) if j not in offl]):  # every layer not offloaded
        if any(roles[len(others):]):
            continue  # the checkpointed and selective layers do not fit there
        new_rec = tuple(j for j, role in zip(others, roles) if role == "rec")
        new_sel = tuple(j for j, role in zip(others, roles) if role == "sel")
        layout = (offl, new_rec, tuple(sorted((offl if sel_off else ()) + new_sel)))
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def _layouts(profiles: Sequence[LayerProfile], partial: bool, selective: bool):
    """Every ``(num_layers, partial_fraction, recompute, selective)`` the exhaustive search
    compares (``_layout`` describes the two families)."""
    for params in _layout_params(len(profiles), partial, selective):
        yield _layout(params)




def plan_offloading(
    step_fn: Callable[[], Any],
    layers: Union[nn.ModuleList, nn.Sequential, Sequence[nn.Module]],
    memory_budget: Union[int, float],
    *,
    device: Optional[OffloadDevice] = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    link_gbps: Union[None, float, tuple] = None,
    warmup: int = 1,
    repeats: int = 3,
    partial: bool = True,
    selective: Union[bool, str] = True,
    peak_margin: float = PEAK_MARGIN,
    spread: bool = True,
    verify_candidates: Optional[int] = None,
    _measure: Optional[MeasureHook] = None,
) -> Plan:
    """Choose what to offload and what to recompute from one real training step.

    Runs ``step_fn()`` (one ordinary forward + backward of your model) with the layers
    instrumented, measures per layer the bytes V2 would offload, forward and backward time and
    transient memory, plus the step's peak memory, the host link and (on CUDA) the host's
    time per layer, and searches the fastest "offload these layers (the first k, or spread
    where the host has time for them) + recompute these layers" whose predicted peak fits
    ``memory_budget`` (``cpu_offload.plan``). Then it measures the model's best candidates in
    the real step and returns the fastest measured one (``verify_candidates``). Plan before
    ``apply_offloading`` and before enabling gradient checkpointing (a checkpointed layer hides
    what it saves).

    Planning does not train the model: it refuses an optimizer step in ``step_fn`` (raised
    before the step changes anything), and when it returns or raises, the parameters'
    gradients, the buffers (e.g. BatchNorm statistics) and the random number generators
    (torch's CPU and CUDA ones, Python's ``random``) are as they were: each gradient and buffer
    is copied to host memory before the step first reaches it and written back at the end, and
    the generators are restored (``cpu_offload.plan.guard``). The gradients stay in place while
    it runs, so a step that zeroes persistent gradient buffers in place is measured as it runs
    (the gradients of modules outside ``layers`` that ``step_fn`` zeroes before its forward
    reaches them stay as ``step_fn`` leaves them).

    Args:
        step_fn: runs one training step: forward and backward, no optimizer step (refused, see
            above; a gradient scaler's ``scaler.scale(loss).backward()`` is fine). It is
            called ``warmup + 2 + 6 * repeats`` times, plus ``max(1, warmup) + repeats``
            with ``selective`` (see ``profile_step``), plus ``3 * repeats`` per verified
            candidate.
        layers: the model's layers, as for ``apply_offloading``.
        memory_budget: peak memory of the step, above what it starts with: bytes (``int``), or
            a ``float`` in (0, 1], the fraction of the peak of the step without offloading
            (measured on CUDA, predicted by the planner's model elsewhere).
        device: the offload device (default CUDA); ``SimulatedDevice()`` plans on a CPU, with
            host times and ``link_gbps``.
        min_tensor_size_to_offload: as in ``get_cpu_offload_context``; stored in the plan and
            used by ``apply_offloading(layers, plan=plan)``.
        link_gbps: host link speed in GB/s, one number or ``(d2h, h2d)``; default: measured with
            pinned copies on CUDA, 50 GB/s on the simulated device.
        warmup, repeats: untimed steps first, then timed steps (medians).
        partial: let the last offloaded layer offload only part of what it saves (its first
            quarter, half or three quarters of bytes), to use the link up to its capacity.
            Only the V2 backend applies such a plan; pass ``False`` for V1.
        selective: measure and consider selective recomputation (``Plan.selective``: layers
            whose cheap saved tensors are recomputed instead of stored). ``True`` (or
            ``"modules"``): ops are recorded inside norm and activation modules only;
            ``"layer"``: every op of the layer (more recipes, more host time per op). Only the
            V2 backend applies it; pass ``False`` for V1 (or to save the extra profiled steps).
        peak_margin: kept between a plan's predicted peak and the budget, as a fraction of the
            peak without offloading (default 1%: measured peaks landed within 0.7% of the
            predictions); 0 trusts the prediction, for comparisons at an exact peak.
        spread: on CUDA, let a plan offload spread layers (``1, 3, 5`` instead of ``0, 1,
            2``) where the measured host times say that offloading the first layers would make
            the GPU wait for the host (``cpu_offload.plan.model.spread_layers``). Only the V2 backend applies
            such a plan; pass ``False`` for V1.
        verify_candidates: how many of the model's best plans to measure in the real step
            (the prediction ranks, the measurement decides): the fastest predicted plans that
            fit the budget, plus the fastest fitting plan of each simple family (``ckpt k``,
            ``off k``, ``sel k``) not among them that the model predicts less than 10% slower
            than its best (``search.shortlist``): up to 3 more. Each is applied with
            ``apply_offloading``, run ``repeats`` times (one untimed step, two timed, taking
            turns with the others) and removed; the fastest (median step) whose measured
            peak fits the budget (CUDA) is returned, and ``Plan.verified`` holds every
            candidate's times. ``None`` (default): 3 on CUDA (with ``repeats=3``, 27 to 54
            more steps), 0 on other devices, whose times are the host's own and vary by more
            than the candidates differ. 0: return the model's best without measuring it.

    Returns:
        A ``Plan``: ``num_layers`` (and ``offloaded``, if spread), ``recompute``,
        ``selective``, predicted ``step_ms``/``peak_bytes`` and ratios, ``describe()``; apply
        it with ``apply_offloading(layers, plan=plan)`` (on ``device``, which the plan
        remembers).

    Raises:
        OffloadConfigError: a budget outside (0, 1] or below the lowest reachable peak (the
            message names it, and the exception's ``lowest_peak_bytes`` holds it), a flag that
            is not a ``bool`` or a count that is not an ``int``, or a ``step_fn`` that runs
            only some of ``layers``, no backward through them, or an optimizer step.
        Exception: what ``step_fn`` raised in every verified candidate (one that raises only
            with some candidates rejects those; no plan stays applied either way).

    Warns:
        UserWarning: nothing to offload (every saved tensor is below
        ``min_tensor_size_to_offload``): the plan then offloads and recomputes nothing.
        Every verified candidate measured a peak over the budget: the lowest is returned.

    Example (the same plan every run: on the simulated device the layers' times are the
    host's own and vary from run to run, even by tens of milliseconds on a busy machine, so
    this example plans where bytes decide: its link, 10 kB/s, makes every byte moved cost more
    than any such noise; ``selective`` and ``partial`` are off, since their options differ
    from the others by microseconds of host time)::

        >>> import torch, cpu_offload
        >>> _ = torch.manual_seed(0)
        >>> layers = torch.nn.ModuleList(
        ...     torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4))
        >>> x0 = torch.randn(8, 64)
        >>> def step():
        ...     x = x0.requires_grad_()
        ...     for layer in layers:
        ...         x = layer(x)
        ...     x.sum().backward()
        >>> sim = cpu_offload.SimulatedDevice()   # on a GPU: leave out device= and link_gbps=
        >>> plan = cpu_offload.plan_offloading(
        ...     step, layers, 0.5, device=sim, min_tensor_size_to_offload=1, link_gbps=1e-5,
        ...     selective=False, partial=False)
        >>> plan.num_layers, plan.recompute, plan.peak_ratio  # 0, 1 checkpointed, inputs moved
        (2, (0, 1), 0.4)
        >>> print(plan.describe())   # doctest: +ELLIPSIS
        offload the first 2 layers (...), recompute layers: 0, 1 (of which 0, 1 offload ...
        >>> handle = cpu_offload.apply_offloading(layers, plan=plan)   # on the plan's device
        >>> step()
        >>> handle.remove()
    """
    memory_budget = check_memory_budget(memory_budget)
    check_bool("partial", partial)
    check_bool("spread", spread)
    check_verify_candidates(verify_candidates)
    with untouched(as_layer_list(layers, find=True), step_fn) as step:
        prof = profile_step(
            step, layers, device=device, min_tensor_size_to_offload=min_tensor_size_to_offload,
            link_gbps=link_gbps, warmup=warmup, repeats=repeats, selective=selective,
        )
        best = plan(prof, memory_budget, partial=partial, peak_margin=peak_margin, spread=spread)
        cuda = device is None or device.name == "cuda"
        count = (3 if cuda else 0) if verify_candidates is None else int(verify_candidates)
        candidates = shortlist(best, count, peaks_measured=cuda)
        if not candidates:
            return best
        chosen, trials = verify_plans(step, layers, candidates, repeats, cuda, _measure)
    return replace(chosen, alternatives=best.alternatives, verified=trials)


def check_memory_budget(value: Any) -> Union[int, float]:
    """``memory_budget`` as a plain ``int`` (bytes of peak above the step's start) or ``float``
    (a fraction in (0, 1] of the peak without offloading); NumPy numbers count as theirs.

    Example::

        >>> check_memory_budget(0.5), check_memory_budget(2 << 30)
        (0.5, 2147483648)
        >>> check_memory_budget(2.0)
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: memory_budget=2.0 as a float is a fraction of the peak without offloading and must be in (0, 1]; pass an int for bytes
    """
    if is_count(value):
        if value <= 0:
            raise OffloadConfigError(f"memory_budget must be > 0 bytes, got {value}")
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not 0.0 < float(value) <= 1.0:
            raise OffloadConfigError(
                f"memory_budget={value} as a float is a fraction of the peak without "
                "offloading and must be in (0, 1]; pass an int for bytes"
            )
        return float(value)
    raise OffloadConfigError(
        f"memory_budget must be bytes (int) or a fraction in (0, 1] (float), got {value!r}"
    )


def shortlist(best: Plan, count: int, peaks_measured: bool = True) -> list:
    """The plans verification measures: ``best`` and its ``alternatives`` in the model's order
    (each layout once), ``count`` of them, then the fastest fitting plan of each simple family
    (``family_of``: ``ckpt k``, ``off k``, ``sel k``) not among them that the model predicts
    slower than ``best`` by less than its error on times (``NEAR_TIME``), so that a simple
    configuration the model ranks a few percent too slow is still measured against the mixed
    plans. Where verification measures peaks (``peaks_measured``: CUDA), ``best.near_budget``
    take the last of the ``count`` places but two (the best plan and another that fits in the
    model stay, so that a measured peak over the budget leaves a choice). None for a plan with
    no alternatives (nothing to offload) or ``count == 0``.

    Example::

        >>> a = Plan(3, recompute=(3,), model_layers=8, step_ms=10.0)
        >>> b = Plan(4, recompute=(4,), model_layers=8, step_ms=10.5)
        >>> c = Plan(0, recompute=(0, 1), model_layers=8, step_ms=10.8)   # "ckpt 2"
        >>> d = Plan(2, model_layers=8, step_ms=12.0)                     # "off 2": 20% slower
        >>> [p.layout for p in shortlist(replace(a, alternatives=[a, b, c, d]), 2)]
        ['offload 0-2, recompute 3', 'offload 0-3, recompute 4', 'offload none, recompute 0-1']
    """
    if count == 0 or not best.alternatives:
        return []
    ranked: list = []
    for p in [best] + sorted(best.alternatives, key=lambda c: (c.step_ms, c.peak_bytes)):
        if all(p.layout != q.layout for q in ranked):
            ranked.append(p)
    top = ranked[:count]
    near = [p for p in best.near_budget if all(p.layout != q.layout for q in top)]
    places = min(len(near), count - 2)  # two plans that fit stay: the model's best and another
    if peaks_measured and places > 0:
        top = top[:count - places] + near[:places]
    for p in fastest_of_each_family(ranked).values():  # fitting plans, fastest predicted first
        if p.step_ms <= best.step_ms * (1 + NEAR_TIME) and all(p.layout != q.layout for q in top):
            top.append(p)
    return top
