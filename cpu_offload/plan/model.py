"""Choose what to offload (and what to recompute) from measured layer costs.

Offloading hides only as many bytes as the link moves while compute runs; beyond that the
schedule stalls (the default schedule keeps at most ``n-k`` layers resident). Recomputation
(``torch.utils.checkpoint``) costs one extra forward per layer but no link time. Given per-layer
activation bytes, forward/backward times and the link's bandwidth, ``simulate`` predicts step
time and peak activation memory of "offload the first ``k`` layers with the default schedule,
recompute layers ``R``"; ``plan`` searches all ``(k, R)`` for the fastest plan within a memory
budget. ``profile_layers`` measures the inputs on the real device.

Between storing a layer's activations and recomputing the whole layer lies *selective*
recomputation (``apply_offloading(..., selective=...)``): the cheap saved tensors of a layer
(norm, activation and elementwise outputs, ``selective_bytes`` of it) are recomputed in its
backward (``selective_ms``) and never stored; the rest is kept or offloaded as usual, so an
offloaded selective layer moves fewer bytes over the link. Per layer a plan thus keeps,
offloads (the last offloaded layer possibly in part), recomputes selectively, does both,
checkpoints the whole layer, or checkpoints it and offloads its input: the checkpoint then holds
nothing on the device between the layer's forward and backward, for little link time, which is
what takes a plan below checkpointing every layer. When every layer is offloaded this way, the
last one's input is released when the forward pass ends and reloaded when its backward starts
(``plan_synchronization_dict``): away during the loss only, which is often the step's peak.

Whole layers are coarse: when the link can move 3.4 layers' bytes during the forward, offloading
3 wastes link time and offloading 4 stalls. So the last offloaded layer may be offloaded only in
part (the first quarter, half or three quarters of the bytes it saves, in the order it saves
them; the rest stays on the device), which lets a plan use the link up to its capacity.

Where the host issues a layer's forward in less time than the GPU runs it (a Hugging Face
decoder layer: about half), the host gets ahead, and offloading's extra host work (the hooks, the
copies' launches) is free until that lead is used up; then the GPU waits. At the start of a step
there is no lead, so offloading the first layers stalls the GPU, and the same layers spread out
(``1, 3, 5``: a plain layer in between lets the host get ahead again) do not. With host times in
the profiles and a measured ``HostCost``, ``simulate`` models that wait and ``plan`` also tries
each layout with its offloaded layers spread (``spread_layers``).

The model is deliberately simple (one copy queue per direction, a layer's reload must finish
before its backward starts, recompute runs inside the backward): it is a planning tool,
validated against the benchmark, not a promise.
"""
from __future__ import annotations

import functools
import statistics
import time
from itertools import product
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..core.errors import OffloadConfigError
from ..v2.selection import DEFAULT_MIN_TENSOR_SIZE


PARTIAL_FRACTIONS = (0.25, 0.5, 0.75)  # shares of the last offloaded layer's bytes a plan may move
PEAK_MARGIN = 0.01  # of the peak without offloading: a plan's predicted peak stays this far under


@dataclass(frozen=True)
class HostCost:
    """What offloading costs the host that issues the forward (measured by ``profile_step``).

    Where the host issues a layer in less time than the GPU runs it, the host gets ahead, and
    extra host work is free until that lead is used up; then the GPU waits (``host_stall_ms``).
    """

    ms_per_gb: float = 0.0  # added to an offloaded layer's forward call, per GB it moves
    # Added to every other layer's forward call once copies are under way (the copies and the
    # schedule's bookkeeping slow the host down; measured on the layers the probe kept).
    slowdown_ms: float = 0.0

    @property
    def is_free(self) -> bool:
        return self.ms_per_gb <= 0 and self.slowdown_ms <= 0


FREE_HOST = HostCost()


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer."""

    activation_bytes: int  # what V2 offloads for the layer (unique storages)
    input_bytes: int  # what a recomputed (checkpointed) layer keeps: its input
    fwd_ms: float
    bwd_ms: float
    transient_bytes: int = 0  # workspace above inputs + saved activations while the layer runs
    selective_bytes: int = 0  # of activation_bytes, what selective recomputation does not store
    selective_ms: float = 0.0  # the backward time selective recomputation adds
    # The forward time it adds: its ops are recorded by a Python dispatch mode, which costs the
    # host tens of microseconds per op; a layer with many small ops becomes host-bound.
    selective_fwd_ms: float = 0.0
    # The backward time checkpointing the layer adds (measured); None: its forward time. Less
    # than the forward where that is host-bound: recomputed kernels queue behind backward ones.
    recompute_ms: Optional[float] = None
    # The host's time to run the layer's forward call (launches and Python), without
    # offloading; None: not measured. Where it is close to ``fwd_ms`` the GPU waits for the host
    # as soon as offloading adds host work (see ``host_stall_ms``).
    host_fwd_ms: Optional[float] = None

    @property
    def checkpoint_ms(self) -> float:
        """What recomputing the whole layer in backward costs."""
        return self.fwd_ms if self.recompute_ms is None else self.recompute_ms

    def stored_bytes(self, checkpointed: bool, selective: bool) -> int:
        """What the layer keeps for backward (on the device or offloaded): a checkpointed layer
        its input, a selective one its activations but the recomputed ones."""
        if checkpointed:
            return self.input_bytes
        return self.activation_bytes - (self.selective_bytes if selective else 0)


@dataclass(frozen=True)
class Plan:
    """Offload ``num_layers`` layers (the first ones, or the ``offloaded`` ones); checkpoint the
    layers in ``recompute``; recompute the cheap saved tensors of the layers in ``selective``."""

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

    @property
    def offloaded_layers(self) -> tuple:
        """The layers this plan offloads (the first ``num_layers`` unless spread)."""
        return tuple(self.offloaded) or tuple(range(self.num_layers))

    @property
    def time_ratio(self) -> float:
        return _ratio(self.step_ms, self.baseline_ms)

    @property
    def peak_ratio(self) -> float:
        return _ratio(self.peak_bytes, self.baseline_peak_bytes)

    def describe(self) -> str:
        rec = ", ".join(map(str, self.recompute)) or "none"
        part = ""
        offl = self.offloaded_layers
        if self.partial_bytes is not None:
            part = (
                f", of layer {offl[-1]} only its first "
                f"{self.partial_fraction:.0%} of saved bytes ({self.partial_bytes / 2**20:.0f} MiB)"
            )
        sel = ", ".join(map(str, self.selective)) or "none"
        moved = [r for r in self.recompute if r in offl]
        if moved:
            rec += f" (of which {', '.join(map(str, moved))} offload their checkpointed inputs)"
        if offl != tuple(range(self.num_layers)):
            what = (f"offload layers {', '.join(map(str, offl))} (spread, so that the host "
                    "issues each offloaded layer while the GPU still runs earlier ones: "
                    "cpu_offload.v2.schedule.spread_synchronization_dict)")
        elif self.num_layers and self.num_layers == self.model_layers:
            what = (f"offload all {self.num_layers} layers (the last one's input when the forward "
                    "pass ends: cpu_offload.v2.schedule.plan_synchronization_dict)")
        else:
            what = (f"offload the first {self.num_layers} layers (get_cpu_offload_context("
                    f"num_layers={self.num_layers}))")
        return (
            f"{what}{part}, recompute layers: {rec}, selective layers: {sel}; "
            f"predicted step {self.step_ms:.1f} ms "
            f"({self.time_ratio:.3f}x), peak activations {self.peak_bytes / 2**30:.2f} GiB "
            f"({self.peak_ratio:.3f}x); apply with cpu_offload.apply_offloading(layers, plan=plan)"
        )


def _ratio(value: float, baseline: float) -> float:
    """``value / baseline``; with a zero baseline (a step that saves nothing offloadable), 1.0
    for a zero value (the plan changes nothing), else infinity: never NaN."""
    if baseline:
        return value / baseline
    return 1.0 if not value else float("inf")


def simulate(
    profiles: Sequence[LayerProfile],
    num_layers: int,
    recompute: Sequence[int] = (),
    d2h_gbps: float = 50.0,
    h2d_gbps: float = 50.0,
    partial_fraction: float = 1.0,
    memory_timeline: Optional[Sequence[int]] = None,
    selective: Sequence[int] = (),
    offload_ms_per_gb: float = 0.0,
    offloaded: Optional[Sequence[int]] = None,
    host_cost: HostCost = FREE_HOST,
) -> tuple[float, int]:
    """Predicted ``(step_ms, peak_bytes)`` of one forward+backward, where the ``offloaded``
    layers (default: the first ``num_layers``) are offloaded, the last of them only
    ``partial_fraction`` of its bytes, and the ``selective`` layers store ``selective_bytes``
    less (offloaded ones move that much less) and take ``selective_fwd_ms`` longer in forward
    and ``selective_ms`` longer in backward.
    A ``recompute`` layer among the offloaded ones stores only its input, which it offloads.
    ``num_layers == len(profiles)`` (every layer; the last one must be checkpointed) releases the
    last layer's input when the forward pass ends (``plan_synchronization_dict``).
    ``offload_ms_per_gb`` (measured by ``profile_step``) is added per GB the plan moves out.
    ``host_cost`` (measured too) is the host time offloading adds to the forward: with the
    layers' ``host_fwd_ms`` it tells where the GPU waits for the host (``host_stall_ms``).

    Without ``memory_timeline`` the peak counts layer activations only (plus the largest
    transient). With it (the measured peak of each segment of a step without offloading, as
    ``memory_segments`` describes), the peak is that step's, minus what the plan holds off the
    device in each segment: so a plan is charged where the real step peaks (often the loss, after
    the last layer), not where the layers alone would."""
    n, k = len(profiles), num_layers
    rec = set(recompute)
    if not 0 <= k <= n or (k == n and n - 1 not in rec) or any(not 0 <= r < n for r in rec):
        raise OffloadConfigError(
            f"num_layers must be in [0, {n}) (or {n} with layer {n - 1} recomputed) and "
            f"recomputed layers in [0, {n}), got num_layers={k}, recompute={sorted(rec)}"
        )
    offl = _offloaded(k, n, offloaded)
    if not 0.0 < partial_fraction <= 1.0:
        raise OffloadConfigError(f"partial_fraction must be in (0, 1], got {partial_fraction}")
    sel = set(selective)
    if any(not 0 <= j < n for j in sel) or sel & rec:
        raise OffloadConfigError(
            f"selective layers must be in [0, {n}) and not checkpointed, got "
            f"selective={sorted(sel)}, recompute={sorted(rec)}"
        )
    stored = [p.stored_bytes(j in rec, j in sel) for j, p in enumerate(profiles)]
    moved = [stored[j] if j in offl else 0 for j in range(n)]  # bytes each layer sends out
    if k:
        moved[offl[-1]] = int(moved[offl[-1]] * partial_fraction)
    d2h = [b / (d2h_gbps * 1e6) for b in moved]  # ms
    h2d = [b / (h2d_gbps * 1e6) for b in moved]
    # Forward: copies queue in layer order; layer m waits for the copy of the offloaded layer
    # it releases (the j-th is released as layer n-kd+j starts). With every layer offloaded the
    # last one is released at the forward's end. The GPU cannot run ahead of the host.
    kd = min(k, n - 1)  # layers on the default schedule's timing
    host_ms = _host_ms(profiles, offl, moved, host_cost)
    offl_set = set(offl)
    fwd_start, fwd_end, copy_end = [0.0] * n, [0.0] * n, [0.0] * n
    t = queue = issued = 0.0
    for m in range(n):
        i = m - (n - kd)
        start = max(t, copy_end[offl[i]]) if 0 <= i < kd else t
        fwd_ms = profiles[m].fwd_ms + (profiles[m].selective_fwd_ms if m in sel else 0.0)
        if host_ms is not None:
            issued += host_ms[m]
            fwd_ms = max(fwd_ms, issued - start)  # launched no sooner than the host issues it
        fwd_start[m], fwd_end[m] = start, start + fwd_ms
        t = fwd_end[m]
        if m in offl_set:
            queue = max(queue, start) + d2h[m]
            copy_end[m] = queue
    # Backward: the j-th offloaded layer's reload starts when layer n-kd+j's backward ends,
    # after earlier reloads.
    bwd_end, reload_end = [0.0] * n, [0.0] * n
    t = fwd_end[-1]
    queue = t
    if k == n:  # the last layer: released once its copy is done, reloaded as its backward starts
        t = queue = max(t, copy_end[n - 1])
        queue = reload_end[n - 1] = queue + h2d[n - 1]
    for m in range(n - 1, -1, -1):
        start = max(t, reload_end[m]) if m in offl_set else t
        cost = profiles[m].bwd_ms + (profiles[m].checkpoint_ms if m in rec else 0.0)
        if m in sel:
            cost += profiles[m].selective_ms
        bwd_end[m] = t = start + cost
        i = m - (n - kd)  # the offloaded layer whose reload this backward unlocks
        if 0 <= i < kd:
            queue = max(queue, t) + h2d[offl[i]]
            reload_end[offl[i]] = queue
    step_ms = bwd_end[0] + offload_ms_per_gb * sum(moved) / 1e9
    if memory_timeline is not None:
        return step_ms, _peak_from_timeline(
            memory_timeline, profiles, offl, rec, moved, sel)
    return step_ms, _peak_bytes(profiles, offl, moved, stored)


def _offloaded(k: int, n: int, offloaded: Optional[Sequence[int]]) -> tuple:
    """The offloaded layers of a plan offloading ``k`` of ``n``: ``offloaded`` (checked), or
    (``None`` or empty, as in ``Plan.offloaded``) the first ``k``."""
    if not offloaded:
        return tuple(range(k))
    offl = tuple(offloaded)
    late = k < n and any(not 0 <= layer <= n - k + j - 1 for j, layer in enumerate(offl))
    if len(offl) != k or list(offl) != sorted(set(offl)) or late:
        raise OffloadConfigError(
            f"offloaded must be {k} distinct layers in increasing order, the j-th at most "
            f"n-k+j-1 (released after its own forward), got {list(offl)} for n={n}"
        )
    if k == n and offl != tuple(range(n)):
        raise OffloadConfigError(f"offloading all {n} layers means layers 0..{n - 1}, got {offl}")
    return offl


def _host_ms(
    profiles: Sequence[LayerProfile], offloaded: Sequence[int], moved: Sequence[int],
    host_cost: HostCost,
) -> Optional[list]:
    """Per layer, the host's time to issue its forward with the plan's offloading, or None
    when the profiles do not say (the host model is then off: the GPU sets the pace)."""
    if any(p.host_fwd_ms is None for p in profiles):
        return None
    first = min(offloaded) if offloaded else len(profiles)
    offl = set(offloaded)
    return [
        p.host_fwd_ms + (host_cost.ms_per_gb * b / 1e9 if j in offl else
                         host_cost.slowdown_ms if j > first else 0.0)
        for j, (p, b) in enumerate(zip(profiles, moved))
    ]


def host_stall_ms(
    profiles: Sequence[LayerProfile], offloaded: Sequence[int], moved: Sequence[int],
    host_cost: HostCost,
) -> float:
    """How long the GPU waits for the host during the forward when the ``offloaded`` layers
    move ``moved`` bytes each (a sequence indexed like ``profiles``), beyond the wait without
    offloading.

    The host issues layer after layer while the GPU runs them; the host's lead over the GPU
    grows by ``fwd_ms - host_fwd_ms`` per layer and cannot go below zero (then the GPU waits).
    Offloading a layer adds ``host_cost.ms_per_gb`` per GB it moves to that layer's host time,
    and ``host_cost.slowdown_ms`` to each later layer's. Hugging Face decoder layers issue in
    about half their GPU time, but offloading one adds about as much again: offloading the
    first layers, before the host got ahead, stalls the GPU; offloading every other layer
    does not.

    Args:
        profiles: per layer, ``fwd_ms`` and ``host_fwd_ms`` (without it: 0.0, no host model).
        offloaded: the offloaded layers.
        moved: per layer, the bytes it sends to the host (0 for the others).
        host_cost: what offloading costs the host, as ``profile_step`` measures it.

    Example::

        >>> p = [LayerProfile(10**9, 0, fwd_ms=2.0, bwd_ms=4.0, host_fwd_ms=1.0)] * 4
        >>> cost = HostCost(ms_per_gb=1.5)
        >>> host_stall_ms(p, [0, 1], [10**9, 10**9, 0, 0], cost)
        1.0
        >>> host_stall_ms(p, [1, 3], [0, 10**9, 0, 10**9], cost)
        0.0
    """
    with_offload = _stall(profiles, _host_ms(profiles, offloaded, moved, host_cost))
    return with_offload - _stall(profiles, _host_ms(profiles, (), [0] * len(profiles), FREE_HOST))


def _stall(profiles: Sequence[LayerProfile], host: Optional[list]) -> float:
    if host is None:
        return 0.0
    lead = stall = 0.0
    for p, h in zip(profiles, host):
        lead += p.fwd_ms - h
        if lead < 0:
            stall -= lead
            lead = 0.0
    return stall


def spread_layers(
    profiles: Sequence[LayerProfile], k: int, nbytes: Sequence[int], host_cost: HostCost,
) -> tuple:
    """Where to put ``k`` offloaded layers so that the GPU does not wait for the host: the
    earliest layers whose extra host time (``host_cost.ms_per_gb`` per GB of ``nbytes[layer]``,
    what it would move) the host's lead covers, skipping layers in between to let the lead grow
    back (by their ``fwd_ms - host_fwd_ms``, less ``host_cost.slowdown_ms`` once copies run).
    A layer is taken anyway when later ones would no longer fit the schedule (the ``j``-th at
    most ``n-k+j-1``), or when skipping it would not let the host gain. Without host times in
    the profiles, the first ``k`` layers.

    Args:
        profiles: per layer, ``fwd_ms`` and ``host_fwd_ms``.
        k: how many layers to offload.
        nbytes: per layer, the bytes it would move if offloaded.
        host_cost: what offloading costs the host, as ``profile_step`` measures it.

    Example::

        >>> p = [LayerProfile(10**9, 0, fwd_ms=2.0, bwd_ms=4.0, host_fwd_ms=1.0)] * 8
        >>> spread_layers(p, 3, [10**9] * 8, HostCost(ms_per_gb=1.8))
        (1, 3, 5)
    """
    n = len(profiles)
    if k >= n or any(p.host_fwd_ms is None for p in profiles) or host_cost.is_free:
        return tuple(range(k))
    placed: list[int] = []
    lead = 0.0
    for m, p in enumerate(profiles):
        if len(placed) == k:
            break
        slack = p.fwd_ms - p.host_fwd_ms - (host_cost.slowdown_ms if placed else 0.0)
        extra = host_cost.ms_per_gb * nbytes[m] / 1e9
        last_chance = m == n - k + len(placed) - 1
        # Skipping a layer pays only where the host gains on the GPU during it.
        if last_chance or slack <= 0 or lead + slack - extra >= 0:
            placed.append(m)
            slack -= extra
        lead = max(0.0, lead + slack)
    return tuple(placed)


def memory_segments(model_layers: int) -> list[str]:
    """Names of the segments of a step whose peaks form a memory timeline, in order: before the
    first layer, each layer's forward, the loss (after the last layer's forward, before the
    first backward), each layer's backward."""
    n = model_layers
    return (["before the layers"] + [f"forward {j}" for j in range(n)] + ["loss"]
            + [f"backward {j}" for j in range(n - 1, -1, -1)])


def _segment_at(pos: int, n: int) -> int:
    """Index (``memory_segments`` order) of the first segment that runs at schedule position
    ``pos`` or later: position ``p <= n`` is layer ``p-1``'s forward; later positions are
    backward starts, which come after the loss segment."""
    return pos if pos <= n else pos + 1


@functools.lru_cache(maxsize=4096)
def _offload_windows(offloaded: tuple, n: int) -> tuple:
    """``(first, last, layer)``: the segments in which a plan's schedule keeps each of the
    ``offloaded`` of ``n`` layers off the device (the search asks for the same layers many
    times). A layer released when the forward ends is away from the loss segment (``n + 1``)
    on."""
    schedule = _schedule(offloaded, n)
    windows = []
    for j in schedule.sync:
        release, reload = schedule.window(j)
        first = n + 1 if schedule.released_at_forward_end(j) else _segment_at(release, n)
        windows.append((first, _segment_at(reload, n), j))
    return tuple(windows)


def _schedule(offloaded: tuple, n: int) -> Any:
    """The V2 schedule ``apply_offloading`` installs for a plan offloading these of ``n``."""
    from ..v2.schedule import Schedule

    return Schedule(n, plan_sync_dict(offloaded, n))


def plan_sync_dict(offloaded: Sequence[int], n: int) -> dict:
    """The synchronization dict of a plan offloading the ``offloaded`` of ``n`` layers: the
    first ``k`` (``plan_synchronization_dict``, which also covers all ``n``) or a spread set
    (``spread_synchronization_dict``)."""
    from ..v2.schedule import plan_synchronization_dict, spread_synchronization_dict

    k = len(offloaded)
    if tuple(offloaded) == tuple(range(k)):
        return plan_synchronization_dict(k, n)
    return spread_synchronization_dict(offloaded, n)


def _peak_from_timeline(
    timeline: Sequence[int], profiles: Sequence[LayerProfile], offloaded: tuple, rec: set,
    moved: list, sel: set = frozenset(),
) -> int:
    """The measured step's peak, segment by segment, minus the bytes the plan keeps away."""
    n = len(profiles)
    if len(timeline) != 2 * n + 2:
        raise OffloadConfigError(
            f"memory_timeline has {len(timeline)} segments; {n} layers need {2 * n + 2}"
        )
    windows = [  # [first, last) segment indices in which the plan keeps ``bytes`` off the device
        (first, last, moved[j]) for first, last, j in _offload_windows(offloaded, n)
    ]
    windows += [  # a checkpointed layer holds only its input between its forward and backward
        (j + 2, 2 * n + 1 - j,
         max(0, profiles[j].activation_bytes - profiles[j].input_bytes))
        for j in rec
    ]
    windows += [  # a selective layer never stores its recomputed tensors (the same window)
        (j + 2, 2 * n + 1 - j, profiles[j].selective_bytes) for j in sel
    ]
    away = [0] * (len(timeline) + 1)  # a difference array: the search calls this ~n^3 times
    for first, last, b in windows:
        away[first] += b
        away[last] -= b
    peak, held_away = None, 0
    for seg, delta in zip(timeline, away):
        held_away += delta
        peak = seg - held_away if peak is None else max(peak, seg - held_away)
    return peak


def _peak_bytes(
    profiles: Sequence[LayerProfile], offloaded: tuple, moved: list, stored: list
) -> int:
    """Largest sum of resident activation bytes over the layer starts of one step."""
    from ..v2.schedule import position

    n = len(profiles)
    schedule = _schedule(offloaded, n)
    peak = 0
    for pos in range(1, 2 * n + 1):
        total = 0
        for j, p in enumerate(profiles):
            start, bwd_start = j + 1, position(False, n - j, n)
            if not start <= pos <= bwd_start:
                continue
            if schedule.away(j, pos):
                total += stored[j] - moved[j]  # what a partial layer keeps
                continue
            total += p.activation_bytes if pos in (start, bwd_start) else stored[j]
        peak = max(peak, total)
    return peak + max(p.transient_bytes for p in profiles)


def plan(
    profiles: Sequence[LayerProfile],
    d2h_gbps: float,
    h2d_gbps: float,
    memory_budget_bytes: Optional[int] = None,
    measured_baseline_peak: Optional[int] = None,
    measured_baseline_ms: Optional[float] = None,
    partial: bool = True,
    memory_timeline: Optional[Sequence[int]] = None,
    peak_margin: float = PEAK_MARGIN,
    offload_ms_per_gb: float = 0.0,
    host_cost: HostCost = FREE_HOST,
    spread: bool = True,
) -> Plan:
    """Fastest ``(num_layers, recompute, selective)`` whose predicted peak fits the budget.

    Recomputation is tried on the earliest non-offloaded layers (resident the longest), and
    on offloaded layers after the ones offloaded whole (a checkpointed offloaded layer offloads
    only its input); then selective recomputation on the next ones, and on all offloaded
    layers or none of them (when the profiles say what it removes, ``selective_bytes``). With
    ``partial``, the last offloaded layer may also be offloaded in part (``PARTIAL_FRACTIONS``
    of its bytes; ``Plan.partial_bytes`` is the resulting byte limit). Without
    a budget, the fastest plan that offloads as much as possible at no predicted time cost.
    ``measured_baseline_peak`` (peak of one real step without offloading) calibrates the memory
    model: what it misses (gradients between layers, loss temporaries) is added to every plan.
    ``measured_baseline_ms`` (time of one real step without offloading) does the same for time:
    what runs outside the layers (embedding, loss, optimizer hooks) is added to every plan, so
    ratios are to the whole step. ``memory_timeline`` (see ``simulate``) replaces that memory
    calibration with the measured step's own peaks, segment by segment. ``peak_margin`` (a
    fraction of the peak without offloading, default ``PEAK_MARGIN``) is kept between a plan's
    predicted peak and the budget, for the model's error; 0 trusts the prediction.
    ``offload_ms_per_gb``, ``host_cost``: see ``simulate``. With ``spread`` and a host model
    (``host_fwd_ms`` in the profiles, a ``host_cost`` that is not free), each layout that
    offloads whole layers is also tried with its offloaded layers spread (``spread_layers``),
    its checkpointed and selective layers after them or in between (``_spread_layouts``).

    Up to ``COARSE_LAYERS`` (24) layers every layout is compared. Above that the search first
    steps through layer counts in strides of ``ceil(n / 24)``, then compares every layout
    within one stride of the best: about a tenth of the candidates (seconds for 80 layers
    instead of many minutes), for a plan whose predicted time was within 1% of the exhaustive
    search's in tests with 26-32 layers.
    """
    n = len(profiles)
    if isinstance(peak_margin, bool) or not isinstance(peak_margin, (int, float)) or not (
            0.0 <= peak_margin < 1.0):
        raise OffloadConfigError(
            f"peak_margin is a fraction of the peak without offloading in [0, 1), got "
            f"{peak_margin!r}"
        )
    base_ms, base_peak, extra_ms, extra = _baseline(
        profiles, d2h_gbps, h2d_gbps, measured_baseline_peak, measured_baseline_ms,
        memory_timeline,
    )
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
    fits = [c for _, c in _fitting(candidates, limit)]
    others = sorted(fits, key=lambda c: (c.step_ms, c.peak_bytes))[:5]
    return replace(candidates[best_params], alternatives=others)


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


def profile_layers(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    repeats: int = 3,
) -> list[LayerProfile]:
    """Measure each layer's offloadable bytes (via the audit) and forward/backward times."""
    from ..tools.audit import audit_offload_selection
    from ..v2.selection import SelectionPolicy

    policy = SelectionPolicy(
        min_tensor_size_to_offload=min_tensor_size_to_offload,
        is_device_tensor=(lambda t: t.is_cuda) if x.is_cuda else (lambda t: t.device == x.device),
    )
    report = audit_offload_selection(list(layers), x.detach(), policy=policy)
    timer = _cuda_timer if x.is_cuda else _host_timer
    out, h = [], x.detach()
    for layer, audit in zip(layers, report.layers):
        fwd, bwd = [], []
        transient = _transient_bytes(layer, h, audit.v2_bytes) if x.is_cuda else 0
        params = [p for p in layer.parameters() if p.requires_grad]
        for _ in range(repeats):
            inp = h.detach().requires_grad_()
            y, f_ms = timer(lambda: layer(inp))
            ones = torch.ones_like(y)
            # autograd.grad computes every gradient a training backward does, without touching .grad
            _, b_ms = timer(lambda: torch.autograd.grad(y, [inp, *params], ones))
            fwd.append(f_ms)
            bwd.append(b_ms)
        out.append(LayerProfile(
            audit.v2_bytes, h.nbytes, statistics.median(fwd), statistics.median(bwd), transient
        ))
        h = y.detach()
    return out


def _transient_bytes(layer: nn.Module, h: torch.Tensor, saved_bytes: int) -> int:
    """Peak device memory of one forward+backward of ``layer`` beyond its saved activations."""
    inp = h.detach().requires_grad_()
    params = [p for p in layer.parameters() if p.requires_grad]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = layer(inp)
    grads = torch.autograd.grad(y, [inp, *params], torch.ones_like(y))
    torch.cuda.synchronize()
    # Weight gradients land in buffers that persist across steps in training: not transient.
    persistent = sum(g.nbytes for g in grads[1:])
    return max(0, torch.cuda.max_memory_allocated() - before - saved_bytes - persistent)


def _cuda_timer(fn: Callable):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end)


def _host_timer(fn: Callable):
    t = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - t) * 1e3
