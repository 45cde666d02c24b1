"""The step model: predicted step time and peak memory of one offloading layout.

Offloading hides only as many bytes as the link moves while compute runs; beyond that the
schedule stalls (the default schedule keeps at most ``n-k`` layers resident). Recomputation
(``torch.utils.checkpoint``) costs one extra forward per layer but no link time. Given per-layer
activation bytes, forward/backward times and the link's bandwidth (``LayerProfile``), ``simulate``
predicts step time and peak activation memory of "offload these layers with the default
schedule's timing, recompute layers ``R``"; ``search.plan`` compares layouts with it.

Between storing a layer's activations and recomputing the whole layer lies *selective*
recomputation (``apply_offloading(..., selective=...)``): the cheap saved tensors of a layer
(norm, activation and elementwise outputs, ``selective_bytes`` of it) are recomputed in its
backward (``selective_ms``) and never stored; the rest is kept or offloaded as usual, so an
offloaded selective layer moves fewer bytes over the link. Per layer a layout thus keeps,
offloads (the last offloaded layer possibly in part), recomputes selectively, does both,
checkpoints the whole layer, or checkpoints it and offloads its input: the checkpoint then holds
nothing on the device between the layer's forward and backward, for little link time. When every
layer is offloaded this way, the last one's input is released when the forward pass ends and
reloaded when its backward starts (``plan_synchronization_dict``): away during the loss only,
which is often the step's peak.

Note [the host model]: where the host issues a layer's forward in less time than the GPU runs it
(a Hugging Face decoder layer: about half), the host gets ahead, and offloading's extra host work
(the hooks, the copies' launches) is free until that lead is used up; then the GPU waits. At the
start of a step there is no lead, so offloading the first layers stalls the GPU, and the same
layers spread out (``1, 3, 5``: a plain layer in between lets the host get ahead again) do not.
``HostCost`` holds the rule's two parameters and how they are calibrated from a measured probe
(``HostCost.from_probe``, fed by ``profile.profile_step``); ``host_stall_ms`` and
``spread_layers`` apply the rule, and ``simulate`` models the wait.

The model is deliberately simple (one copy queue per direction, a layer's reload must finish
before its backward starts, recompute runs inside the backward): it is a planning tool,
validated against the benchmark, not a promise.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

from ..core.errors import OffloadConfigError
from ..v2.schedule import (
    Schedule,
    plan_synchronization_dict,
    position,
    spread_synchronization_dict,
)

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
    # Added to an offloaded layer's forward call per saved tensor it offloads (the pack hook,
    # the copy's launch): the host's cost follows the tensors, not the bytes, so a checkpointed
    # layer that offloads only its input pays for one tensor.
    ms_per_tensor: float = 0.0

    @property
    def is_free(self) -> bool:
        return self.ms_per_gb <= 0 and self.slowdown_ms <= 0 and self.ms_per_tensor <= 0

    def layer_ms(self, nbytes: int, tensors: float) -> float:
        """The host time offloading ``tensors`` saved tensors of ``nbytes`` adds to a layer's
        forward call."""
        return self.ms_per_gb * nbytes / 1e9 + self.ms_per_tensor * tensors

    @classmethod
    def from_probe(cls, added_host_ms: Sequence[float], k: int, moved_bytes: int,
                   moved_tensors: int = 0) -> "HostCost":
        """Calibrate the rule from a probe step that offloaded the first ``k`` layers, moving
        ``moved_bytes`` in ``moved_tensors`` saved tensors: ``added_host_ms`` is, per layer,
        the host time the probe added to its forward call (against plain steps). The
        offloaded layers' sum, per tensor they moved, is ``ms_per_tensor`` (per GB,
        ``ms_per_gb``, when the tensors were not counted); the median over the other layers
        is ``slowdown_ms``.

        Example::

            >>> HostCost.from_probe([1.0, 2.0, 0.25, 0.5, 0.75], k=2, moved_bytes=2 * 10**9)
            HostCost(ms_per_gb=1.5, slowdown_ms=0.5, ms_per_tensor=0.0)
            >>> HostCost.from_probe([1.0, 2.0, 0.25, 0.5, 0.75], 2, 2 * 10**9, moved_tensors=12)
            HostCost(ms_per_gb=0.0, slowdown_ms=0.5, ms_per_tensor=0.25)
        """
        slowdown = statistics.median(added_host_ms[k:])
        if moved_tensors:
            return cls(0.0, slowdown, sum(added_host_ms[:k]) / moved_tensors)
        return cls(sum(added_host_ms[:k]) / (moved_bytes / 1e9), slowdown)


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
    # The saved tensors (storages) V2 offloads for the layer; 0: not counted.
    saved_tensors: int = 0

    def moved_tensors(self, nbytes: int, checkpointed: bool = False) -> float:
        """About how many saved tensors offloading ``nbytes`` of the layer moves: its input
        when checkpointed, else its share of ``saved_tensors`` (at least one)."""
        if not nbytes:
            return 0.0
        if checkpointed:
            return 1.0
        share = nbytes / self.activation_bytes if self.activation_bytes else 1.0
        return max(1.0, self.saved_tensors * min(1.0, share))

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
    host_ms = _host_ms(profiles, offl, moved, host_cost, rec)
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
    host_cost: HostCost, recompute: Sequence[int] = (),
) -> Optional[list]:
    """Per layer, the host's time to issue its forward with the plan's offloading, or None
    when the profiles do not say (the host model is then off: the GPU sets the pace)."""
    if any(p.host_fwd_ms is None for p in profiles):
        return None
    first = min(offloaded) if offloaded else len(profiles)
    offl = set(offloaded)
    return [
        p.host_fwd_ms + (host_cost.layer_ms(b, p.moved_tensors(b, j in recompute)) if j in offl
                         else host_cost.slowdown_ms if j > first else 0.0)
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
    Offloading a layer adds ``host_cost.ms_per_gb`` per GB it moves and ``ms_per_tensor`` per
    saved tensor to that layer's host time, and ``host_cost.slowdown_ms`` to each later
    layer's. Hugging Face decoder layers issue in
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
    earliest layers whose extra host time (``host_cost.layer_ms`` of ``nbytes[layer]``, what it
    would move) the host's lead covers, skipping layers in between to let the lead grow
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
        extra = host_cost.layer_ms(nbytes[m], p.moved_tensors(nbytes[m]))
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


def _schedule(offloaded: tuple, n: int) -> Schedule:
    """The V2 schedule ``apply_offloading`` installs for a plan offloading these of ``n``."""
    return Schedule(n, plan_sync_dict(offloaded, n))


def plan_sync_dict(offloaded: Sequence[int], n: int) -> dict:
    """The synchronization dict of a plan offloading the ``offloaded`` of ``n`` layers: the
    first ``k`` (``plan_synchronization_dict``, which also covers all ``n``) or a spread set
    (``spread_synchronization_dict``)."""
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
