"""Measure the user's own training step per layer, and plan offloading from it.

``profile_step(step_fn, layers)`` runs ``step_fn()`` (forward + backward of the real model, any
layer signature) with the layers instrumented by ``tools.layers.instrument``:

- saved bytes: a counting saved-tensor hook around each layer's forward applies V2's selection
  (``SelectionPolicy``, the predicate V2's pack hook uses) and counts each storage once, for the
  first layer that saves it, as V2 moves whole storages at most once;
- input bytes: the hidden-state input, what a checkpointed layer keeps instead;
- forward time: from a layer's call to its return; backward time: from the backward pre-hook on
  the layer's hidden-state output to the next layer's (the end of backward for layer 0). CUDA
  events on the GPU, host clocks on the simulated device (where compute is the CPU's);
- peak memory of the step above what it starts with, each layer's transient workspace, and the
  peak of every segment of the step (before the layers, each layer's forward, the loss, each
  layer's backward): where the step peaks, which the planner's memory model charges each plan
  with (CUDA only);
- the link: pinned copies each way (CUDA), or the ``link_gbps`` parameter;
- recomputation: timed steps with every layer checkpointed, taking turns with the plain timed
  steps: per layer the backward time a checkpoint adds (less than the layer's forward time
  where the forward is host-bound: in backward the recomputed kernels queue behind others);
- selective recomputation: timed steps with every layer selective (a V2 context that offloads
  nothing), taking turns with the same plain steps: per layer the bytes it stores as recipes
  instead, and the forward and backward time it adds;
- what offloading costs beyond the link: timed steps offloading the most layers whose cost
  the planner's model predicts within 1% of the step, taking turns with plain steps. What they
  add above the model's prediction, per GB moved, is charged to every plan in proportion to the
  bytes it moves
  (``offload_ms_per_gb``): copies slowing the kernels they overlap, the hooks' host time in the
  offloaded layers' forward, copies starting later than the model assumes. The two kinds are
  compared at the lower quartile of their step times (a few ms, where noise only adds), and
  nothing is charged when the difference is within the plain steps' own spread (quartiles).

Added times are medians of step-by-step differences to the plain step next to them, so that a
machine whose speed drifts while it is profiled does not charge the drift to one of them.

``plan_offloading`` feeds that to the planner's search (``search.plan``) and returns a ``Plan``
that ``apply_offloading(layers, plan=plan)`` applies. ``profile_layers`` is the older chain form:
each layer run on its own, from one example input.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..core.checks import check_bool, check_int
from ..compat import queue_backward_callback, saved_tensors_hooks
from ..core.device import OffloadDevice, default_device
from ..core.errors import OffloadConfigError
from ..core.units import format_bytes
from ..tools.apply import OffloadDriver
from ..tools.audit import audit_offload_selection, v2_verdict
from ..tools.layers import as_layer_list, first_tensor, hidden_state, instrument
from ..v2.context import get_cpu_offload_context
from ..v2.recompute import SELECTIVE_SCOPES, check_selective_scope
from ..v2.selection import DEFAULT_MIN_TENSOR_SIZE, SelectionPolicy
from .guard import untouched
from .model import FREE_HOST, HostCost, LayerProfile, simulate

__all__ = ["StepProfile", "measure_link", "profile_layers", "profile_step"]

DEFAULT_SIM_LINK_GBPS = 50.0  # assumed on the simulated device: a PCIe Gen5 x16 link, each way


@dataclass
class StepProfile:
    """One real step, per layer: what ``plan_offloading`` plans from.

    ``profile_step`` measures it; ``cpu_offload.plan.plan(profile, memory_budget)`` searches it
    (as often as needed: one profile, many budgets). Built by hand from ``LayerProfile``s, it
    needs only ``layers`` and the link speed; what is left out is not calibrated.

    Attributes:
        layers: one ``LayerProfile`` per layer: bytes V2 offloads, input bytes, forward and
            backward time, transient memory, what selective recomputation and checkpointing
            cost, the host's time per forward call (CUDA).
        step_ms: the whole step's time (median), layers and everything around them; None: not
            measured.
        peak_bytes: peak above the memory held before the step (CUDA), else None.
        d2h_gbps, h2d_gbps: the host link, each way (GB/s).
        min_tensor_size_to_offload: the selection the bytes were counted with.
        notes: what the measurement could not do, and what it found (human-readable).
        memory_timeline: the peak of each segment of the step (``model.memory_segments``) above
            what it starts with (CUDA), else None.
        selective_scope: where selective layers were recorded.
        offload_ms_per_gb: measured time per GB offloaded above the step model's prediction.
        offload_host_cost: host time offloading adds to the forward calls (CUDA): the
            ``HostCost`` of the host model.
        device: the offload device it was measured on (None: CUDA); plans made from it
            remember it.

    Example::

        >>> from cpu_offload.plan import LayerProfile, StepProfile, plan
        >>> prof = StepProfile([LayerProfile(2**30, 2**24, fwd_ms=50.0, bwd_ms=100.0)] * 4,
        ...                    d2h_gbps=25.0, h2d_gbps=25.0)
        >>> plan(prof).num_layers   # no budget: offload what the link hides at no cost
        2
    """

    layers: list  # list[LayerProfile]
    step_ms: Optional[float] = None  # the whole step (median), layers and everything around them
    peak_bytes: Optional[int] = None  # peak above the memory held before the step (CUDA), else None
    d2h_gbps: float = 50.0
    h2d_gbps: float = 50.0
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE
    notes: list = field(default_factory=list)
    # Peak of each segment of the step (``model.memory_segments``) above what it starts with
    # (CUDA), else None: where the real step peaks, for the planner's memory model.
    memory_timeline: Optional[list] = None
    selective_scope: str = "modules"  # where selective layers were recorded (``set_selective``)
    # Measured time per GB offloaded above the planner's model (see the module docstring).
    offload_ms_per_gb: float = 0.0
    # Host time offloading adds to the forward calls (CUDA; the planner's host model:
    # ``model.host_stall_ms``).
    offload_host_cost: HostCost = FREE_HOST
    device: Optional[OffloadDevice] = field(default=None, compare=False, repr=False)


class StepClock:
    """CUDA events on the compute stream, or the host clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if start is None or end is None:
            return 0.0
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _allocated() -> int:
    return torch._C._cuda_memoryStats(torch.cuda.current_device())["allocated_bytes"]["all"]["current"]


def _max_allocated() -> int:
    return torch._C._cuda_memoryStats(torch.cuda.current_device())["allocated_bytes"]["all"]["peak"]


class _StepRecorder:
    """``instrument`` driver: records the first forward pass of one ``step_fn()`` call."""

    owner = None

    def __init__(
        self, n: int, clock: StepClock, policy: Optional[SelectionPolicy], memory: bool
    ) -> None:
        self.n = n
        self.clock = clock
        self.policy = policy  # count saved bytes with it (None: time only)
        self.memory = memory
        self.passes = 0
        self.fwd = [[None, None] for _ in range(n)]
        self.host = [[0.0, 0.0] for _ in range(n)]  # host clock around each forward call
        self.bwd_start: list = [None] * n
        self.bwd_end: Any = None
        self.bwd_queued = False
        self.saved = [0] * n
        self.tensors = [0] * n  # storages counted in ``saved``
        self.inputs = [0] * n
        self.transient = [0] * n
        self.seen: set = set()
        self.peak_so_far = 0
        self.segments: list[int] = []  # peak of each segment so far (memory=True)
        self.hooks: Any = None
        self.current = -1
        self.unpacked = 0  # saved tensors of the layers used by a backward (counting hook)

    # -- instrument's driver interface -----------------------------------------------------------
    def before(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> Optional[int]:
        if index == 0:
            self.passes += 1
        if self.passes != 1:
            return None  # only the first forward pass of the step is recorded
        h = first_tensor(args, kwargs)
        self.inputs[index] = 0 if h is None else h.untyped_storage().nbytes()
        if self.memory:
            self._close_segment()
        self.current = index
        if self.policy is not None:
            self.hooks = saved_tensors_hooks(self._pack, self._unpack)
            self.hooks.__enter__()
        self.fwd[index][0] = self.clock.mark()
        self.host[index][0] = time.perf_counter()
        return index

    def after(self, index: int, out: Any) -> Any:
        self.host[index][1] = time.perf_counter()
        self.fwd[index][1] = self.clock.mark()
        self._close_hooks()
        if self.memory:
            layer_peak = _max_allocated()
            self.transient[index] = max(0, layer_peak - _allocated())
            self.peak_so_far = max(self.peak_so_far, layer_peak)
            if index == self.n - 1:
                self._close_segment()  # the last layer's forward; the loss segment starts
        try:
            hidden, _ = hidden_state(out)
        except TypeError:
            hidden = None
        if hidden is not None and hidden.grad_fn is not None:
            hidden.grad_fn.register_prehook(_BackwardMark(self, index))
        return out

    def abort(self, index: int, exc: BaseException) -> None:
        self._close_hooks()

    # -- internals ---------------------------------------------------------------------------------
    def _close_hooks(self) -> None:
        hooks, self.hooks = self.hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        reason, storages = v2_verdict(t, self.policy)
        if reason is None:
            for key, nbytes in storages:
                if key not in self.seen:
                    self.seen.add(key)
                    self.saved[self.current] += nbytes
                    self.tensors[self.current] += 1
        return t

    def _unpack(self, t: torch.Tensor) -> torch.Tensor:
        self.unpacked += 1
        return t

    def _close_segment(self) -> None:
        """The memory segment that ends now: record its peak, start the next one."""
        peak = _max_allocated()
        self.segments.append(peak)
        self.peak_so_far = max(self.peak_so_far, peak)
        torch.cuda.reset_peak_memory_stats()

    def backward_started(self, index: int) -> None:
        if self.bwd_start[index] is None:
            self.bwd_start[index] = self.clock.mark()
            if self.memory:
                self._close_segment()
        if not self.bwd_queued:
            self.bwd_queued = True
            queue_backward_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.bwd_end = self.clock.mark()
        if self.memory:
            self._close_segment()

    def memory_timeline(self, before: int) -> Optional[list]:
        """Segment peaks above ``before`` in ``model.memory_segments`` order, or None when
        a layer's backward went unseen (its output was not on the loss's path)."""
        if not self.memory or len(self.segments) != 2 * self.n + 2:
            return None
        return [max(0, peak - before) for peak in self.segments]

    def times(self) -> tuple:
        """Per-layer ``(fwd_ms, bwd_ms, host_fwd_ms)`` lists (call after the clock
        synchronized); the last is the host's time in each forward call."""
        fwd = [self.clock.ms(s, e) for s, e in self.fwd]
        ends = [self.bwd_end] + self.bwd_start[:-1]  # layer i's backward ends as i-1's begins
        bwd = [self.clock.ms(s, e) for s, e in zip(self.bwd_start, ends)]
        return fwd, bwd, [(e - s) * 1e3 for s, e in self.host]


class _BackwardMark:
    """Backward pre-hook on a layer's output: that layer's backward starts now."""

    __slots__ = ("recorder", "index")

    def __init__(self, recorder: _StepRecorder, index: int) -> None:
        self.recorder = recorder
        self.index = index

    def __call__(self, grad_outputs: Any) -> None:
        self.recorder.backward_started(self.index)


class _Wrapped:
    """``instrument`` driver: a recorder's measurements around a V2 context that offloads the
    first ``num_layers`` layers and (with ``scope``) recomputes every layer's cheap saved
    tensors. One context serves every profiled step; each step gets a fresh ``recorder``."""

    owner = None

    def __init__(
        self, layers: list, device: Any, min_size: int, scope: Optional[str], num_layers: int = 0
    ) -> None:
        context, sync = get_cpu_offload_context(
            enabled=True, num_layers=num_layers, model_layers=len(layers), device=device,
            min_tensor_size_to_offload=min_size,
        )
        if scope is not None:
            context.synchronizer.set_selective(range(len(layers)), scope)
        self.recorder: Optional[_StepRecorder] = None
        self.context = context
        self.inner = OffloadDriver(SimpleNamespace(layers=layers), context, sync)

    def before(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> Any:
        token = self.recorder.before(index, layer, args, kwargs)
        return None if token is None else (token, self.inner.before(index, layer, args, kwargs))

    def after(self, token: tuple, out: Any) -> Any:
        return self.recorder.after(token[0], self.inner.after(token[1], out))

    def abort(self, token: tuple, exc: BaseException) -> None:
        self.inner.abort(token[1], exc)
        self.recorder.abort(token[0], exc)

    def recipe_bytes(self) -> list:
        layers = self.context.stats().layers
        return [layers[i].recipe_bytes if i in layers else 0 for i in range(self.inner.n)]


def _run(
    step_fn: Callable[[], Any], layers: list, recorder: _StepRecorder, driver: Any = None,
    recompute: Sequence[int] = (),
) -> float:
    """One instrumented ``step_fn()`` (``driver``: one that wraps ``recorder``; ``recompute``:
    layers run checkpointed); returns the whole step's time in ms."""
    clock = recorder.clock
    undo = instrument(layers, driver or recorder, recompute)
    try:
        clock.synchronize()
        start = clock.mark()
        step_fn()
        end = clock.mark()
        clock.synchronize()
    finally:
        recorder._close_hooks()
        undo()
    if recorder.passes == 0:
        raise OffloadConfigError(
            "step_fn() ran none of the layers with grad enabled: pass the layers its forward "
            "calls (e.g. model.model.layers) and a step_fn that runs forward and backward"
        )
    ran = [i for i, (start_mark, _) in enumerate(recorder.fwd) if start_mark is not None]
    if len(ran) < recorder.n:
        raise OffloadConfigError(
            f"step_fn() ran {len(ran)} of the {recorder.n} layers given (layers "
            f"{', '.join(map(str, ran))}): every layer must run once per step, with grad "
            "enabled; pass only the layers the step's forward calls"
        )
    if recorder.policy is not None and not recorder.bwd_queued and not recorder.unpacked:
        raise OffloadConfigError(
            "step_fn() ran the forward pass but no backward reached the layers: it must run "
            "one whole training step, forward and backward (e.g. `loss.backward()`), since the "
            "plan weighs what each layer costs in backward; add the backward to step_fn"
        )
    return clock.ms(start, end)


def measure_link(nbytes: int = 256 << 20, reps: int = 3) -> tuple:
    """``(d2h_gbps, h2d_gbps)`` of pinned copies on the current CUDA device (GB/s = 1e9 B/s)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for dst, src in ((host, dev), (dev, host)):
        times = []
        for _ in range(reps + 1):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        out.append(nbytes / 1e6 / statistics.median(times[1:]))
    del host, dev
    return tuple(out)


def profile_step(
    step_fn: Callable[[], Any],
    layers: Union[nn.ModuleList, nn.Sequential, Sequence[nn.Module]],
    *,
    device: Optional[OffloadDevice] = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    offload_weights: bool = False,
    link_gbps: Union[None, float, tuple] = None,
    warmup: int = 1,
    repeats: int = 3,
    selective: Union[bool, str] = True,
) -> StepProfile:
    """Measure ``step_fn()`` per layer (see the module docstring); ``plan_offloading``'s input.

    ``step_fn`` runs ``warmup + 1 + 2 * repeats`` times (plain and checkpointed timed steps),
    ``max(1, warmup) + repeats`` more with ``selective`` (what selective recomputation
    removes and costs; ``True`` or a scope, as in ``plan_offloading``), and ``1 + 4 * repeats``
    more to measure what offloading costs beyond the link (half of them plain). It leaves the
    model as it was, as ``plan_offloading`` does (an optimizer step in ``step_fn`` is refused;
    gradients, buffers and random state are restored). Only the first forward pass of each
    call is recorded.
    Arguments as in ``plan_offloading``; ``offload_weights`` as in ``get_cpu_offload_context``.

    Profile once to plan for several budgets: ``cpu_offload.plan.plan(profile, budget)`` searches
    a ``StepProfile`` without running the step again.

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.ModuleList(
        ...     torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4))
        >>> x0 = torch.randn(8, 64)
        >>> def step():
        ...     x = x0.requires_grad_()
        ...     for layer in layers:
        ...         x = layer(x)
        ...     x.sum().backward()
        >>> prof = cpu_offload.profile_step(   # on a GPU: leave out device= and link_gbps=
        ...     step, layers, device=cpu_offload.SimulatedDevice(), min_tensor_size_to_offload=1,
        ...     link_gbps=1.0, repeats=1)
        >>> [p.activation_bytes for p in prof.layers]   # layer 0 also saves the step's input
        [4096, 2048, 2048, 2048]
        >>> plans = [cpu_offload.plan.plan(prof, budget) for budget in (0.6, 0.9)]
    """
    scope = _selective_scope(selective)
    check_int("min_tensor_size_to_offload", min_tensor_size_to_offload, minimum=0, unit="elements")
    check_bool("offload_weights", offload_weights)
    check_int("warmup", warmup, minimum=0, meaning="the number of untimed steps first")
    check_int("repeats", repeats, minimum=1, meaning="the number of timed steps")
    layers = as_layer_list(layers, find=True)
    with untouched(layers, step_fn) as step:
        return _profile(step, layers, device, min_tensor_size_to_offload, offload_weights,
                        link_gbps, warmup, repeats, scope)


def _profile(
    step_fn: Callable[[], Any], layers: list, device: Optional[OffloadDevice],
    min_tensor_size_to_offload: int, offload_weights: bool, link_gbps: Union[None, float, tuple],
    warmup: int, repeats: int, scope: Optional[str],
) -> StepProfile:
    """``profile_step`` once its arguments are checked, inside ``untouched``."""
    given_device = device
    device = device or default_device()
    cuda = device.name == "cuda"
    n = len(layers)
    notes: list[str] = []
    if link_gbps is None:
        if cuda:
            d2h, h2d = measure_link()
        else:
            d2h = h2d = DEFAULT_SIM_LINK_GBPS
            notes.append(f"link: not measured on the {device.name} device, assumed {d2h} GB/s")
    elif isinstance(link_gbps, (tuple, list)):
        d2h, h2d = (float(v) for v in link_gbps)
    else:
        d2h = h2d = float(link_gbps)
    policy = SelectionPolicy(
        offload_weights=offload_weights,
        min_tensor_size_to_offload=min_tensor_size_to_offload,
        is_device_tensor=device.is_device_tensor,
    )
    clock = StepClock(cuda)
    for _ in range(warmup):
        step_fn()
    # Bytes and memory (the counting hook returns each tensor itself: memory is unchanged).
    counted = _StepRecorder(n, clock, policy, memory=cuda)
    before = 0
    if cuda:
        torch.cuda.synchronize()
        before = _allocated()
        torch.cuda.reset_peak_memory_stats()
    _run(step_fn, layers, counted)
    peak = max(counted.peak_so_far, _max_allocated()) - before if cuda else None
    # Times, without the counting hook's host work; plain steps take turns with checkpointed
    # and (with ``selective``) selective ones.
    timing = _Timing(step_fn, layers, clock, n)
    selective_driver = None
    if scope is not None:
        selective_driver = _Wrapped(layers, device, min_tensor_size_to_offload, scope)
        for _ in range(max(1, warmup)):  # the recording mode's first calls
            timing.run("selective", selective_driver)
    checkpointed = True
    for _ in range(max(1, repeats)):
        timing.run("plain")
        if checkpointed:
            checkpointed = timing.try_run("checkpoint", notes, recompute=range(n))
        if selective_driver is not None:
            timing.run("selective", selective_driver)
    fwd_ms, bwd_ms, host_ms = timing.medians("plain")
    recompute_ms = timing.added("checkpoint", "bwd") if checkpointed else [None] * n
    sel_bytes, sel_fwd_ms, sel_ms = [0] * n, [0.0] * n, [0.0] * n
    if selective_driver is not None:
        sel_bytes = timing.recipe_bytes
        sel_fwd_ms, sel_ms = timing.added("selective", "fwd"), timing.added("selective", "bwd")
    profiles = [
        LayerProfile(
            activation_bytes=counted.saved[i],
            input_bytes=counted.inputs[i],
            fwd_ms=fwd_ms[i],
            bwd_ms=bwd_ms[i],
            transient_bytes=counted.transient[i],
            selective_bytes=min(sel_bytes[i], counted.saved[i]),
            selective_ms=sel_ms[i],
            selective_fwd_ms=sel_fwd_ms[i],
            recompute_ms=recompute_ms[i],
            # Only where the host and the device are two machines: on the simulated device the
            # host runs the "device" work itself, so there is no lead to keep.
            host_fwd_ms=host_ms[i] if cuda else None,
            saved_tensors=counted.tensors[i],
        )
        for i in range(n)
    ]
    if not any(p.activation_bytes for p in profiles):
        notes.append(
            f"no saved tensor has >= {min_tensor_size_to_offload} elements: lower "
            "min_tensor_size_to_offload, or nothing can be offloaded"
        )
    offload_ms_per_gb, host_cost = _offload_overhead(
        step_fn, layers, device, clock, profiles, d2h, h2d, min_tensor_size_to_offload, repeats,
        notes,
    )
    timeline = counted.memory_timeline(before)
    if cuda and timeline is None:
        notes.append("memory timeline: not every layer's backward was seen; the planner "
                     "calibrates its memory model with the step's peak instead")
    return StepProfile(
        profiles, timing.step_ms(), peak, d2h, h2d, min_tensor_size_to_offload, notes,
        timeline, scope or "modules", offload_ms_per_gb, host_cost, device=given_device,
    )


PROBE_COST = 0.01  # the probe offloads the most layers whose predicted cost is below this


def _offload_overhead(
    step_fn: Callable[[], Any], layers: list, device: Any, clock: "StepClock", profiles: list,
    d2h: float, h2d: float, min_size: int, repeats: int, notes: list,
) -> tuple:
    """``(offload_ms_per_gb, host_cost)``: steps offloading the most layers the model
    predicts within 1% of the step take turns with plain steps (see the module docstring). The
    host time those layers' forward calls gain, per GB they move, and the median host time the
    other layers' calls gain, are the host model's ``HostCost`` (CUDA only); what the step
    gains beyond the model's prediction with it, per GB, is charged to every plan. Nothing is
    charged when nothing is offloadable or the offloaded steps fail (a note)."""
    n = len(profiles)
    if n < 2 or not any(p.activation_bytes for p in profiles):
        return 0.0, FREE_HOST
    base = simulate(profiles, 0, (), d2h, h2d)[0]
    # At most n - 2 layers: one resident layer more keeps copies overlapped with compute.
    predicted = {k: simulate(profiles, k, (), d2h, h2d)[0] - base for k in range(1, max(2, n - 1))}
    # The more it moves, the less the step's noise weighs per GB; a predicted stall is fine,
    # since only what the model does not predict is charged.
    hidden = [k for k, ms in predicted.items() if ms <= PROBE_COST * base]
    k = max(hidden) if hidden else 1
    moved = sum(p.activation_bytes for p in profiles[:k])
    moved_gb = moved / 1e9
    if not moved_gb:
        notes.append(f"the first {k} layers save nothing to offload: no offload probe")
        return 0.0, FREE_HOST
    timing = _Timing(step_fn, layers, clock, n)
    try:
        with warnings.catch_warnings():  # the probe's own findings are not the user's concern
            warnings.filterwarnings("ignore", message="cpu_offload: an offload step freed no")
            driver = _Wrapped(layers, device, min_size, None, num_layers=k)
            timing.run("offload", driver)  # warm-up: pinned host buffers are allocated once
            for _ in range(2 * max(1, repeats)):  # a few ms on a noisy step: more pairs
                timing.run("plain")
                timing.run("offload", driver)
    except Exception as exc:  # noqa: BLE001 - profiling goes on without this measurement
        notes.append(f"offloaded steps failed ({type(exc).__name__}: {exc}); the planner "
                     "charges offloading the link time of its model only")
        return 0.0, FREE_HOST
    host_cost = FREE_HOST
    if profiles[0].host_fwd_ms is not None:
        added = timing.added("offload", "host")
        tensors = sum(p.saved_tensors for p in profiles[:k])
        host_cost = HostCost.from_probe(added, k, moved, tensors)
        predicted[k] = simulate(profiles, k, (), d2h, h2d, host_cost=host_cost)[0] - base
        notes.append(
            f"offloading {k} layers added {sum(added[:k]):.2f} ms of host time to their "
            f"forward calls ({_per_moved(host_cost)}) and "
            f"{host_cost.slowdown_ms:.2f} ms to each other layer's: the GPU waits for the host "
            f"where that exceeds the host's lead (the model predicts {predicted[k]:.2f} ms for "
            f"these {k} layers)"
        )
    extra = timing.added_step("offload") - predicted[k]
    low, high = timing.quartiles("plain")
    noise = high - low
    if extra <= noise:
        notes.append(
            f"offloading {k} layers ({format_bytes(moved)}) measured {extra:+.2f} ms against "
            f"the model's {predicted[k]:.2f} ms, within the step's own noise ({noise:.2f} ms "
            "between the quartiles of plain steps): nothing is charged beyond the model"
        )
        return 0.0, host_cost
    notes.append(
        f"offloading {k} layers ({format_bytes(moved)}) measured {extra:+.2f} ms against the "
        f"model's {predicted[k]:.2f} ms: {extra / moved_gb:.2f} ms per GB moved is charged to "
        "every plan"
    )
    return extra / moved_gb, host_cost


def _per_moved(host_cost: HostCost) -> str:
    """What offloading costs the host per tensor (or per GB) it moves, in words."""
    if host_cost.ms_per_tensor:
        return f"{1e3 * host_cost.ms_per_tensor:.0f} us per saved tensor offloaded"
    return f"{host_cost.ms_per_gb:.2f} ms per GB moved"


def _selective_scope(selective: Union[bool, str]) -> Optional[str]:
    """``selective=`` of ``profile_step``/``plan_offloading`` as a scope, or None (off)."""
    if not isinstance(selective, bool) and selective not in SELECTIVE_SCOPES:
        raise OffloadConfigError(
            f"selective must be True, False or a scope ({', '.join(map(repr, SELECTIVE_SCOPES))}), "
            f"got {selective!r}"
        )
    if selective is True:
        return "modules"
    if selective is False:
        return None
    check_selective_scope(selective)
    return selective


class _Timing:
    """Timed steps of several kinds, in the order they ran: per kind, the per-layer forward and
    backward times of each step, and the step's own time."""

    def __init__(self, step_fn: Callable[[], Any], layers: list, clock: StepClock, n: int) -> None:
        self.step_fn, self.layers, self.clock, self.n = step_fn, layers, clock, n
        self.runs: dict[str, list] = {}  # kind -> [(fwd list, bwd list, step ms)]
        self.recipe_bytes = [0] * n

    def run(self, kind: str, driver: Optional[_Wrapped] = None, recompute: Sequence[int] = ()) -> None:
        recorder = _StepRecorder(self.n, self.clock, None, memory=False)
        if driver is not None:
            driver.recorder = recorder
        ms = _run(self.step_fn, self.layers, recorder, driver, recompute)
        if kind == "selective":
            self.recipe_bytes = [max(a, b) for a, b in zip(self.recipe_bytes, driver.recipe_bytes())]
        fwd, bwd, host = recorder.times()
        self.runs.setdefault(kind, []).append((fwd, bwd, ms, host))

    def try_run(self, kind: str, notes: list, recompute: Sequence[int]) -> bool:
        """``run``, or, if ``step_fn`` fails with the layers checkpointed, a note and False:
        the planner then charges a checkpointed layer its forward time."""
        try:
            self.run(kind, recompute=recompute)
        except Exception as exc:  # noqa: BLE001 - profiling goes on without this measurement
            notes.append(
                f"checkpointed steps failed ({type(exc).__name__}: {exc}); the planner charges "
                "each checkpointed layer its forward time instead of a measured cost"
            )
            return False
        return True

    def medians(self, kind: str) -> tuple:
        """Per layer, the median ``(fwd_ms, bwd_ms, host_fwd_ms)`` of ``kind``'s steps."""
        runs = self.runs[kind]
        return tuple([statistics.median(r[part][i] for r in runs) for i in range(self.n)]
                     for part in (0, 1, 3))

    def step_ms(self) -> float:
        return statistics.median(r[2] for r in self.runs["plain"])

    def quartiles(self, kind: str, last: Optional[int] = None) -> tuple:
        """``(lower, upper)`` quartile of ``kind``'s step times (its ``last`` steps)."""
        times = sorted(r[2] for r in self.runs[kind][-(last or len(self.runs[kind])):])
        return times[(len(times) - 1) // 4], times[3 * (len(times) - 1) // 4]

    def added_step(self, kind: str) -> float:
        """What ``kind`` adds to the whole step: the difference of the lower quartiles of its
        step times and the plain ones (its last ``len(plain)`` steps). Interference only ever
        adds time, and a few slow steps would decide a median of differences of a few ms."""
        plain = self.quartiles("plain")[0]
        return self.quartiles(kind, last=len(self.runs["plain"]))[0] - plain

    def added(self, kind: str, part: str) -> list:
        """Per layer, what ``kind`` adds to its forward (``"fwd"``), backward (``"bwd"``) or
        host forward (``"host"``) time: the median of the differences to the plain step before
        it (its last ``len(plain)`` steps are paired with the plain ones; earlier ones were
        warm-up), never below zero."""
        j = {"fwd": 0, "bwd": 1, "host": 3}[part]
        plain, other = self.runs["plain"], self.runs[kind][-len(self.runs["plain"]):]
        return [max(0.0, statistics.median(o[j][i] - p[j][i] for p, o in zip(plain, other)))
                for i in range(self.n)]


def profile_layers(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    repeats: int = 3,
) -> list[LayerProfile]:
    """Measure each layer's offloadable bytes (via the audit) and forward/backward times, each
    layer run on its own from the previous one's output (the chain form; ``profile_step``
    measures the real step instead)."""
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
