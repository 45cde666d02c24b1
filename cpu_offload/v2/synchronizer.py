"""The V2 per-step state machine: ``fwd_step``/``bwd_step`` drive the schedule,
``push``/``pop`` are the saved-tensor hooks.

A *step* is one forward over ``model_layers`` layers and the backward passes that follow. Each
step gets its own ``Step`` object, referenced by the backward triggers registered on its layers'
outputs, so a graph kept alive (``retain_graph=True``, gradient accumulation) keeps its own
schedule while the next forward starts a fresh one.
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Optional

import torch

from ..compat import (
    eager_between_graphs,
    current_graph_task_id,
    in_checkpoint_region,
    never_compiled,
    queue_backward_callback,
    top_default_hooks,
)
from ..core.checks import is_count
from ..core.device import OffloadDevice
from ..core.errors import OffloadUsageError, check_sync_argument
from .layer_state import LayerState, Runtime, unpack
from .recompute import SelectiveLayer, check_selective_scope
from ..core.storage import KeptRef
from ..core.pinned_pool import PinnedPool
from .schedule import Schedule
from .selection import SelectionPolicy
from .stats import StepStats, host_overhead

_top_hooks = top_default_hooks  # (in_checkpoint_region is False when no hooks are installed)


class Step:
    """Layers of one forward pass and the schedule positions reached so far."""

    __slots__ = (
        "rt", "schedule", "model_layers", "layers", "shared", "fwd_count", "grad_layers",
        "bwd_layers", "backward_task", "aborted", "invalid", "last_trigger", "stats",
        "selective_indices", "selective", "selective_scope", "applied", "backward_ran",
        "actions", "bwd_count",
    )

    def __init__(
        self, rt: Runtime, schedule: Optional[Schedule], model_layers: int,
        selective: frozenset = frozenset(), selective_scope: str = "modules",
        applied: bool = False,
    ) -> None:
        self.rt = rt
        self.stats = StepStats(rt.device, rt.pool)
        self.schedule = schedule  # None: manual synchronization
        self.model_layers = model_layers
        self.layers: list[Optional[LayerState]] = []
        self.shared: dict = {}  # storage address -> Entry while the forward runs
        self.fwd_count = 0
        self.grad_layers = 0  # layers entered with grad enabled (the others save nothing)
        self.bwd_layers: set[int] = set()
        self.bwd_count = 0  # len(bwd_layers)
        self.backward_task: Optional[int] = None  # the backward pass our callback is queued in
        self.aborted = False
        self.invalid = False  # misused (wrong layer count): the next forward starts a new step
        self.last_trigger: Optional[weakref.ref] = None  # of the newest layer output's trigger
        self.selective_indices = selective  # layers whose cheap saved tensors are recomputed
        self.selective: dict[int, SelectiveLayer] = {}  # of this step, made as they run
        self.selective_scope = selective_scope
        self.applied = applied  # installed by apply_offloading: model_layers = len(layers)
        # A backward that builds no graph (not create_graph=True) reached this step: its forward
        # pass is over, the next `with ctx:` begins a new one (manual synchronization, whose
        # forward may run fewer than model_layers layers, knows it only so).
        self.backward_ran = False
        # position -> (layers released, layers reloaded) there (``Schedule.at``), looked up once
        self.actions = schedule.actions() if schedule is not None else None

    @property
    def complete(self) -> bool:
        return self.fwd_count >= self.model_layers  # (spelled out where it runs per layer)

    def over(self) -> bool:
        """The next `with ctx:` block begins a new forward pass (a new step)."""
        return self.complete or self.invalid or self.backward_ran or self.abandoned()

    def awaits_backward(self) -> bool:
        """Layers of this step saved tensors for a backward that has not come yet: some ran with
        grad, the step was not given up, and the newest layer output's graph is alive."""
        return (self.grad_layers > 0 and not self.aborted and not self.invalid
                and not self.backward_ran
                and self.last_trigger is not None and self.last_trigger() is not None)

    def count_layers_without_grad(self, n: int) -> None:
        """Count ``n`` layers that ran with grad disabled (they saved nothing) as this step's next
        layers, as if they had entered it."""
        with torch.no_grad():
            for _ in range(n):
                self.begin_forward()
                self.end_forward_layer()

    def abandoned(self) -> bool:
        """A forward left half-way (an exception between layers): the newest layer output's
        graph is gone, or every layer so far ran without grad while this one needs it."""
        if self.complete or self.fwd_count == 0:
            return False
        if self.last_trigger is not None:
            return self.last_trigger() is None
        return self.grad_layers == 0 and torch.is_grad_enabled()

    def begin_forward(self, checkpointed: bool = False, grad: Optional[bool] = None
                      ) -> Optional[LayerState]:
        """Count a layer's forward. ``checkpointed``: it runs inside a non-reentrant checkpoint
        region, which stores none of its saved tensors (it recomputes them in backward): the
        layer is counted, but neither offloaded nor selective, and gets no hooks. ``grad``:
        ``torch.is_grad_enabled()``, where the caller knows it."""
        index = self.fwd_count
        self.fwd_count = pos = index + 1
        if grad is None:
            grad = torch.is_grad_enabled()
        self.grad_layers += grad
        actions = self.actions
        if actions is not None and actions[pos] is not None:
            self._apply(pos, index)  # (layers[:index] exist)
        if self.rt.traces:
            self.rt.device.trace("fwd", index)
        schedule = self.schedule
        manual = schedule is None
        offloaded = manual or index in schedule.sync
        if offloaded and not grad:
            self.stats.layers_without_grad += 1
        if offloaded and grad and checkpointed:
            self.stats.layers_in_checkpoint += 1
        layer = (
            LayerState(index, self.rt, not manual, self.shared, self.stats,
                       not manual and index in schedule.copies_wait)
            if offloaded and grad and not checkpointed else None
        )
        self.layers.append(layer)
        if grad and index in self.selective_indices and not checkpointed:
            self.selective[index] = SelectiveLayer(
                index, self.stats.layer(index), self.selective_scope
            )
        return layer

    def end_forward_layer(self) -> None:
        if self.fwd_count >= self.model_layers:  # complete
            self.shared = {}  # deduplication is per forward; entries must not stay reachable
            for layer in self.layers:
                if layer is not None:
                    layer.shared = self.shared
            if self.schedule is not None:  # layers released when the forward pass ends
                for i in self.schedule.releases_at_forward_end():
                    if self.layers[i] is not None:
                        # Inside the last layer's call: its caller still holds that layer's input.
                        self.layers[i].release(recheck=True)

    def begin_backward(self, index: int, grad_outputs: Any = None) -> None:
        """Layer ``index``'s backward is about to start (the pre-hook on its output's
        ``grad_fn``, registered by the sync function as ``partial(begin_backward, index)``)."""
        if self.aborted:
            return  # unpacking its tensors raises a clear error instead
        if not torch.is_grad_enabled():
            self.backward_ran = True
        task = current_graph_task_id()
        if task != self.backward_task:
            # A new backward pass. One before it may have ended in an exception: its callback
            # never ran, so reset its positions (reloads it queued stay valid and are reused).
            self._reset_backward_positions()
            self.backward_task = task
            queue_backward_callback(self.end_backward)
        if index in self.bwd_layers:
            return
        if self.schedule is not None and self.fwd_count < self.model_layers:  # not complete
            # Only a schedule counts layers: positions in it are layer counts. With manual
            # synchronization the caller drives every transfer, and ``model_layers`` only bounds
            # the layers of one step (a forward may run fewer, e.g. one pipeline chunk).
            if torch.is_grad_enabled():
                # ``torch.autograd.grad(..., create_graph=True)`` in mid-forward (physics-
                # informed losses, gradient penalties): nothing to schedule yet; released layers
                # reload on demand.
                return
            self.invalid = True
            if self.applied:
                raise OffloadUsageError(
                    f"backward started after {self.fwd_count} of the {self.model_layers} layers "
                    "given to apply_offloading ran in forward: every layer in `layers` must run "
                    "exactly once per forward pass (a layer called twice starts a new pass); "
                    "pass only the layers the forward calls, each once"
                )
            raise OffloadUsageError(
                f"backward started after {self.fwd_count} offload-context layers in forward, but "
                f"get_cpu_offload_context(model_layers={self.model_layers}); set model_layers to "
                "the number of `with ctx:` blocks in one forward pass (a backward through part "
                "of a forward pass is supported with create_graph=True)"
            )
        self.bwd_layers.add(index)
        self.bwd_count = count = self.bwd_count + 1  # len(self.bwd_layers)
        actions = self.actions
        if actions is not None and actions[self.model_layers + count] is not None:
            # (a schedule's forward is complete here: every layer exists)
            self._apply(self.model_layers + count, self.fwd_count)
        if self.rt.traces:
            self.rt.device.trace("bwd", index)

    def end_backward(self) -> None:
        """Runs when the autograd engine finishes a backward pass through this step."""
        dev = self.rt.device
        # Join the copy stream: no transfer of ours outlives the backward (CUDA-graph safe).
        dev.wait_stream(dev.current_stream(), self.rt.stream)
        # Only layers whose backward ran in this pass let go of their reloads. A layer reloaded
        # ahead for a later pass (each layer's output backpropagated separately, as pipeline
        # schedules do) keeps its reload instead of copying it back a second time.
        for layer in self.layers:
            if layer is not None and layer.index in self.bwd_layers:
                # Reloads nobody unpacked are dropped; another backward may reload again.
                layer.reload_started = False
                for entry in layer.entries:
                    if entry.reloaded is not None:
                        entry.free_reload()
        for selective in self.selective.values():
            selective.end_backward()
        self.bwd_layers.clear()
        self.bwd_count = 0
        self.backward_task = None
        dev.trace("end_bwd", -1)
        self._warn_if_nothing_freed()

    def _warn_if_nothing_freed(self) -> None:
        """Offloading that frees nothing is worse than none: say so once per context."""
        if self.stats.checked or self.schedule is None:
            return
        if not self.stats.layers_in_checkpoint and not any(
            layer is not None for layer in self.layers
        ):
            return  # only selective layers: nothing was to be offloaded
        self.stats.checked = True
        reason = self.stats.nothing_done_reason(self.rt.threshold)
        if reason is not None:
            self.rt.warn_once(
                f"an offload step freed no GPU memory: {reason}. See ctx.stats().summary()",
                key="nothing freed",
            )

    def _reset_backward_positions(self) -> None:
        self.bwd_layers.clear()
        self.bwd_count = 0
        for layer in self.layers:
            if layer is not None:
                layer.reload_started = False

    def abort(self, reason: Optional[str] = None) -> None:
        """Drop everything the step holds; ``reason``: what a saved tensor of it says when
        backward unpacks it (default: an exception inside a layer)."""
        self.aborted = True
        self.shared = {}
        for selective in self.selective.values():
            selective.end()
        for layer in self.layers:
            if layer is not None:
                layer.abort(reason)

    def given_up_reason(self, why: str) -> str:
        """What a saved tensor of this step says after a later forward gave the step up."""
        return (
            f"this saved tensor belongs to a forward pass that was given up after "
            f"{self.fwd_count} of {self.model_layers} layers: {why}; run the forward pass again"
        )

    def _apply(self, pos: int, n: int) -> None:
        """The schedule's releases and reloads at position ``pos``, among ``layers[:n]``."""
        if self.actions is None:
            return
        releases, reloads = self.actions[pos]
        layers = self.layers
        for i in releases:
            if i < n and layers[i] is not None:
                layers[i].release()
        for i in reloads:
            if i < n and layers[i] is not None:
                layers[i].start_reload()


class OffloadSynchronizer:
    """Drives steps for one offload context: forward entry/exit, the sync function, the hooks."""

    def __init__(
        self,
        model_layers: int,
        schedule: Optional[Schedule],
        device: OffloadDevice,
        stream: Any,
        policy: SelectionPolicy,
        retain_pinned_cpu_buffers: bool = False,
        verify: bool = False,
        max_host_bytes: Optional[int] = None,
    ) -> None:
        self.model_layers = model_layers
        self.schedule = schedule
        self.policy = policy
        self.rt = Runtime(
            device, stream,
            PinnedPool(device, partial(_wait_for_copies, device, stream), max_host_bytes),
            retain_pinned_cpu_buffers, verify, max_host_bytes, policy.min_tensor_size_to_offload,
            policy,
        )
        self.step: Optional[Step] = None
        self.current: Optional[LayerState] = None
        self.selective: frozenset = frozenset()  # layers whose cheap saved tensors are recomputed
        self.selective_scope = "modules"  # where their ops are recorded (``set_selective``)
        self.current_selective: Optional[SelectiveLayer] = None
        self.current_index = -1
        self.inside = False
        self.awaiting_sync = False
        self.refused = False  # an entry was refused for a missing sync
        # Layers entered with grad disabled while the step's backward is pending, not counted in
        # it (see ``fwd_step``); with manual synchronization, counted once a layer with grad
        # follows in the same forward pass.
        self.side_layers = 0
        self.side = False  # the layer now running is one of them
        self.last_side = False  # the layer that ran last is one of them
        # Installed by apply_offloading (or the planner): model_layers is len(layers), which
        # errors name instead of the get_cpu_offload_context argument.
        self.applied = False

    @property
    def device(self) -> OffloadDevice:
        return self.rt.device

    @property
    def offload_stream(self) -> Any:
        return self.rt.stream

    # -- forward ---------------------------------------------------------------------------------
    def fwd_step(self) -> bool:
        """A layer's forward begins: apply the schedule. False when this forward is a
        recomputation inside backward (activation checkpointing): then nothing is scheduled,
        counted or hooked, and the recomputed tensors stay on the device (they are used at once)."""
        if current_graph_task_id() != -1:  # in backward
            return False
        if self.inside:
            raise OffloadUsageError(
                "the offload context was entered while already inside it; use one `with ctx:` "
                "block per layer, not nested ones"
            )
        grad = torch.is_grad_enabled()
        if self.awaiting_sync and grad:
            if self.refused:
                # Refused once already and the sync function was not called since: the caller
                # started the forward pass over. It starts clean.
                self.abort()
            else:
                self.refused = True
                raise OffloadUsageError(
                    f"the offload context was entered twice without calling the sync function: "
                    f"pass layer {self.current_index}'s output through it "
                    "(`x = sync_function(x)`) after each `with ctx:` block"
                )
        step = self.step
        if step is not None and not grad and step.awaits_backward() and (
                step.complete or step.schedule is None):
            # A layer run with grad disabled (an evaluation forward, `torch.no_grad()`) while the
            # training forward's backward is pending: it saves nothing and must not end, extend
            # or replace that step (manual layer ids and ctx.stats() keep naming it). Such layers
            # may also belong to a training forward: a reentrant checkpoint runs its layer
            # without grad. With a schedule, inside an unfinished forward they are its positions
            # (counted as usual, below); otherwise that is known only when the layer's output
            # joins an autograd graph (``sync``) or a layer with grad follows in the same
            # forward: then they are counted in after all.
            self.side_layers += 1
            self.side = self.last_side = True
            self.current = None
            self.current_selective = None
            self.current_index = step.fwd_count + self.side_layers - 1
            self.inside = True
            return True
        self.last_side = False
        if self.side_layers:
            if step is not None and grad and not step.over():
                # The forward went on after layers run without grad: they were part of it.
                step.count_layers_without_grad(self.side_layers)
            self.side_layers = 0
        if step is None or step.fwd_count >= step.model_layers or step.invalid or (
                step.backward_ran or step.fwd_count and (
                    step.last_trigger() is None if step.last_trigger is not None
                    else step.abandoned())):  # ``step.over()``, spelled out
            step = self._new_step(step)
        # Inside a non-reentrant checkpoint region (checkpoint around the stack of layers) the
        # layer gets no hooks: ours would shadow checkpoint's in forward but not in its
        # recomputation (entered in backward, where the context does nothing), so checkpoint
        # would pair recomputed tensors with the wrong saved slots.
        self.current = step.begin_forward(
            (_top_hooks is None or _top_hooks(False) is not None) and in_checkpoint_region(),
            grad)
        self.current_index = index = step.fwd_count - 1
        self.current_selective = step.selective[index] if index in step.selective else None
        self.inside = True
        return True

    def _new_step(self, step: Optional[Step]) -> Step:
        """Begin a new forward pass (after ``step``, which it gives up if unfinished)."""
        if step is not None and not step.complete:
            # A forward left half-way: its graph is gone or unusable.
            step.abort(None if step.invalid else step.given_up_reason(
                f"when the next `with ctx:` block began, the output of layer "
                f"{step.fwd_count - 1} that went through the sync function was no longer "
                "part of any autograd graph (after an exception between layers, or because "
                "the tensor passed to the sync function is not the one the next layer "
                "takes). Pass the tensor that reaches the loss through the sync function "
                "(with apply_offloading: return it as the first tensor of a tuple output)"
            ))
        if step is not None:
            step.stats.log()
        self.step = step = Step(
            self.rt, self.schedule, self.model_layers, self.selective, self.selective_scope,
            self.applied,
        )
        self.rt.pool.trim()
        reason = host_overhead(self.rt.pool, self.rt.device)
        if reason is not None:
            self.rt.warn_once(reason, key="host overhead")
        return step

    def end_fwd_layer(self) -> None:
        self.inside = False
        self.awaiting_sync = torch.is_grad_enabled()
        if self.side:
            self.side = False
            return
        # First: outputs a selective layer stores after all are pushed as the layer's own.
        if self.current_selective is not None:
            self._end_selective(store=True)
        current = self.current
        if current is not None:
            self.current = None
            if current.eager and current.entries:
                current.flush_copies(True)  # the rest of its copies, and its offload event
        step = self.step
        if step is not None and step.fwd_count >= step.model_layers:
            step.end_forward_layer()

    @eager_between_graphs
    def sync(self, tensor: Any) -> Any:
        """The sync function: marks the end of a layer; its backward start triggers the schedule."""
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor):
            check_sync_argument(tensor)
        if current_graph_task_id() != -1:
            return tensor  # recomputation (activation checkpointing): nothing to schedule
        if self.inside:
            raise OffloadUsageError(
                "the sync function was called inside the offload context; call it on the layer's "
                "output after the `with ctx:` block"
            )
        self.awaiting_sync = self.refused = False
        step = self.step
        if self.last_side and tensor.grad_fn is not None and torch.is_grad_enabled():
            # A layer run without grad beside the step, whose output joins an autograd graph (a
            # reentrant checkpoint ran it): the layers run so since are a training forward's.
            n, self.side_layers = self.side_layers, 0
            if step is None or step.over():
                step = self._new_step(step)
            step.count_layers_without_grad(n)
            self.current_index = step.fwd_count - 1
        self.last_side = False
        if tensor.grad_fn is not None and step is not None:
            # The backward trigger: a pre-hook on the layer's output ``grad_fn`` (it holds the
            # step; ``last_trigger`` tells whether the newest layer output's graph is alive).
            trigger = partial(step.begin_backward, self.current_index)
            tensor.grad_fn.register_prehook(trigger)
            step.last_trigger = weakref.ref(trigger)
        return tensor

    def reset(self, why: Optional[str] = None) -> None:
        """Drop an unfinished forward pass: the next `with ctx:` starts a new step (callers
        that know where a forward begins, such as ``apply_offloading``, say so; ``why``: what
        its saved tensors say if a backward reaches them)."""
        step = self.step
        if step is not None and not step.complete:
            self.abort(None if why is None else step.given_up_reason(why))
        self.awaiting_sync = self.refused = False

    def abort(self, reason: Optional[str] = None) -> None:
        """An exception escaped a layer: drop the step and everything it held (``reason``: see
        ``Step.abort``). A layer run without grad beside the step (see ``fwd_step``) held
        nothing: the step it left alone stays."""
        if self.side:
            self.side = self.inside = False
            return
        if self.step is not None:
            self.step.abort(reason)
        self._end_selective()
        self.step = None
        self.current = None
        self.side_layers = 0
        self.side = self.last_side = False
        self.inside = False
        self.awaiting_sync = self.refused = False

    def limit_layer_bytes(self, layer: int, nbytes: Optional[int]) -> None:
        """Offload at most ``nbytes`` of what layer ``layer`` saves, per step, storages in the
        order they are saved (a larger one that does not fit stays on the device, smaller ones
        after it may still fit); ``None`` removes the limit. Plans use it to offload the last
        offloaded layer in part."""
        if nbytes is None:
            self.rt.byte_limits.pop(layer, None)
        elif not is_count(nbytes) or nbytes < 0:
            raise OffloadUsageError(f"a layer's byte limit must be an int >= 0, got {nbytes!r}")
        else:
            self.rt.byte_limits[layer] = int(nbytes)

    def set_selective(self, layers: Any, scope: str = "modules") -> None:
        """Recompute the cheap saved tensors of these layers (indices) in backward instead of
        storing them (``cpu_offload.v2.recompute``); from the next forward pass on. ``scope``:
        where ops are recorded, ``"modules"`` (inside norm and activation modules: cheap) or
        ``"layer"`` (every op of the layer: more recipes, tens of microseconds of host time per
        op)."""
        check_selective_scope(scope)
        layers = frozenset(layers)
        bad = [i for i in layers if not is_count(i) or not 0 <= i < self.model_layers]
        if bad:
            raise OffloadUsageError(
                f"selective layers must be ints in [0, model_layers={self.model_layers}), got "
                f"{sorted(bad, key=repr)!r}"
            )
        layers = frozenset(int(i) for i in layers)
        self.selective = layers
        self.selective_scope = scope

    def _end_selective(self, store: bool = False) -> None:
        selective, self.current_selective = self.current_selective, None
        if selective is not None:
            selective.end(self.push if store else None)

    # -- saved-tensor hooks ------------------------------------------------------------------------
    def push_selective(self, t: torch.Tensor) -> Any:
        """The pack hook of a selective layer: a recipe instead of the bytes where one applies
        (and the tensor would be offloaded), else ``push``."""
        selective = self.current_selective
        if selective is None:
            return self.push(t)
        ref = selective.pack(t, self.policy)
        if ref is None:
            ref = self.push(t)
            selective.note(t, ref)
        return ref

    def push(self, t: torch.Tensor) -> Any:
        """Store a saved tensor of the layer running now (the pack hook of selective layers,
        and of checkpoint offload policies; an offloaded layer's hook is ``LayerState.pack``)."""
        layer = self.current
        if layer is None:
            return KeptRef(t)
        return layer.pack(t)

    pop = staticmethod(unpack)

    # -- introspection (tests, audit, demo) --------------------------------------------------------
    def layer_summary(self) -> list[dict]:
        """Per layer of the current step: whether it is offloaded, storages and bytes saved."""
        out = []
        for i, layer in enumerate(self.step.layers if self.step else []):
            entries = layer.entries if layer is not None else []
            out.append({
                "layer": i,
                "offloaded": layer is not None,
                "storages": len(entries),
                "bytes": sum(e.nbytes for e in entries),
            })
        return out

    def held_device_bytes(self) -> int:
        layers = self.step.layers if self.step else []
        return sum(l.held_device_bytes() for l in layers if l is not None)

    def stats(self) -> StepStats:
        """What the current (or last) step did: ``.summary()`` for humans, ``.to_dict()`` for
        loggers. Reading it never blocks the host."""
        if self.step is None:
            return StepStats(self.rt.device, self.rt.pool)
        return self.step.stats

    def offloaded_bytes(self) -> int:
        """Bytes copied to the host in the current (or last) forward pass, each storage once."""
        layers = self.step.layers if self.step else []
        entries = {id(e): e for l in layers if l is not None for e in l.entries if e.cpu is not None}
        return sum(e.nbytes for e in entries.values())

    def get_offloaded_total_size_mb(self) -> float:
        """The reference implementation's spelling: ``offloaded_bytes()`` in MiB."""
        return self.offloaded_bytes() / (1024 * 1024)

    def held_host_bytes(self) -> int:
        layers = self.step.layers if self.step else []
        return sum(l.held_host_bytes() for l in layers if l is not None)


def _wait_for_copies(device: OffloadDevice, stream: Any) -> None:
    """Block the host until the copies queued on ``stream`` so far are done (the pinned pool
    calls it before it lets buffers go)."""
    device.wait_host(device.record_event(stream))


class ManualOffloadSynchronizer:
    """Explicit control of offload, release and reload per layer (README, "Use (per layer,
    by hand)"). Layer ids are the positions of the `with ctx:` blocks in the current
    forward pass; a layer for which none of these is called is simply not offloaded. A forward
    pass ends after ``model_layers`` blocks or when a backward that builds no graph reaches it;
    forwards run under ``torch.no_grad()`` before that backward (evaluation) do not count.
    For several micro-batches in flight (pipeline schedules), create one context per micro-batch;
    they may share one ``offload_stream``."""

    def __init__(self, synchronizer: OffloadSynchronizer) -> None:
        self._sync = synchronizer

    @property
    def offload_stream(self) -> Any:
        return self._sync.offload_stream

    def start_offload_layer(self, layer_id: int) -> None:
        """Queue the copies of layer ``layer_id``'s saved tensors on the offload stream; if called
        inside the layer, tensors it saves afterwards are copied as they are saved."""
        layer = self._layer(layer_id)
        if layer is not None:
            layer.start_offload()

    def release_activation_forward_gpu_memory(self, layer_id: int) -> None:
        """Make compute wait for the layer's offload, then free its device memory."""
        layer = self._layer(layer_id)
        if layer is not None:
            layer.release()

    def start_reload_layer(self, layer_id: int) -> None:
        """Queue the copies back; each tensor's unpack waits for its own copy."""
        layer = self._layer(layer_id)
        if layer is not None:
            layer.start_reload()

    def _layer(self, layer_id: int) -> Optional[LayerState]:
        """The layer's state; None for a layer that ran without grad (it saved nothing). Layers
        run with grad disabled while a forward's backward is pending (an evaluation forward in
        between) do not change which forward pass the ids name."""
        step = self._sync.step
        layers = step.layers if step else []
        count = len(layers)
        if step is not None and not step.complete:
            count += self._sync.side_layers  # maybe this forward's own layers without grad
        if not is_count(layer_id) or not 0 <= layer_id < count:
            raise OffloadUsageError(
                f"layer_id={layer_id!r} does not name a layer of the current forward pass "
                f"({count} layers entered so far; ids are 0..{count - 1})"
            )
        return layers[layer_id] if layer_id < len(layers) else None


# The other pack hooks (selective layers, checkpoint offload policies) lead to LayerState.pack.
never_compiled(OffloadSynchronizer.push, OffloadSynchronizer.push_selective)
