"""``apply_offloading``: install activation offloading on a model's layers in place, in one call.

In the spirit of ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.
apply_activation_checkpointing`` and FSDP2's ``fully_shard``: the layers stay where they are,
nothing is wrapped in a new parent module, so ``state_dict()`` keys and ``named_parameters()``
names do not change, and a handle undoes it.

How: the layer seam (``tools.layers.instrument``) routes each layer's call through an
``OffloadDriver``, which runs it inside the offload context and passes the layer's hidden-state
output through the sync function.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from typing import Any, Callable, Optional, Sequence, Union

from torch import nn

from ..api import get_cpu_offload_context, use_v1
from ..compat import is_compiled_module
from ..core.checks import check_int, check_keywords, is_count
from ..core.errors import OffloadConfigError, OffloadUsageError
from ..v2.policies import create_selective_checkpoint_contexts
from ..v2.recompute import check_selective_scope
from ..v2.schedule import plan_synchronization_dict, spread_synchronization_dict
from .layers import (
    as_layer_list, base_class, check_not_instrumented, driver_of, first_tensor,
    hf_offloads_checkpoints, hidden_state,
    instrument,
)

__all__ = [
    "OffloadDriver", "OffloadingHandle", "apply_offloading", "check_hf_offload", "offloading_handle",
]

HF_OFFLOAD_CONFLICT = (
    "layer {index} uses Hugging Face activation checkpointing with offload=True, which moves each "
    "checkpoint's saved inputs to the CPU itself, synchronously on the compute stream "
    "(save_on_cpu), before cpu_offload can see them; enable it with offload=False "
    "(model.activation_checkpointing_enable(every_n_layers=...), or drop \"offload\" from "
    "TrainingArguments' activation_checkpointing_kwargs) and let cpu_offload move them with "
    "overlap, or do not apply cpu_offload"
)


def check_hf_offload(layers: Sequence[nn.Module], offloaded: Sequence[int]) -> None:
    """Refuse offloaded layers under HF activation checkpointing with ``offload=True`` (indices
    past the end are left to the range check that names them)."""
    for i in offloaded:
        if i < len(layers) and hf_offloads_checkpoints(layers[i]):
            raise OffloadConfigError(HF_OFFLOAD_CONFLICT.format(index=i))


class OffloadDriver:
    """The ``instrument`` driver of ``apply_offloading`` (and of the profiler's offloaded steps):
    enters the offload context around each layer and syncs its hidden-state output.

    ``owner`` is the ``OffloadingHandle`` (or any object with the ``layers`` it drives)."""

    def __init__(self, owner: "OffloadingHandle", context: Any, sync: Callable) -> None:
        self.owner = owner
        self.context = context
        self.sync = sync
        self.n = len(owner.layers)
        self.next_index = 0
        self.last_hidden: Optional[weakref.ref] = None  # the last synced hidden state
        synchronizer = getattr(context, "synchronizer", None)
        if synchronizer is not None:
            synchronizer.applied = True  # its errors name `layers`, not model_layers

    def before(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> int:
        synchronizer = getattr(self.context, "synchronizer", None)
        if index != self.next_index:
            if index != 0:
                raise OffloadUsageError(
                    f"layer {index} ran while layer {self.next_index} was expected: "
                    "apply_offloading needs every layer in `layers` to run once per forward pass, "
                    "in the order given, with grad enabled (skipped layers such as LayerDrop, or "
                    "single layers under torch.no_grad or checkpoint(use_reentrant=True), are not "
                    "supported; use use_reentrant=False)"
                )
            last = self.last_hidden() if self.last_hidden is not None else None
            if last is not None and first_tensor(args, kwargs) is last:
                raise OffloadUsageError(
                    f"layer 0 ({base_class(layer).__name__}) ran again on the "
                    f"output of layer "
                    f"{self.next_index - 1}, before layer {self.n - 1} ran: a layer in `layers` "
                    "called twice in one forward pass. apply_offloading needs every layer to run "
                    "exactly once per forward pass; pass only layers called once (a layer "
                    "applied repeatedly, with shared weights, cannot be one of them)"
                )
            # A new forward pass began before the last one reached its last layer (an exception
            # between layers, an early exit): drop what the unfinished pass holds.
            if synchronizer is not None:
                synchronizer.reset(
                    f"layer 0 ran again before layer {self.n - 1} had run (an exception between "
                    "layers, an early exit, or a layer in `layers` called twice in one forward "
                    "pass); every layer in `layers` must run exactly once per forward pass"
                )
        elif index and synchronizer is not None and _hidden_dropped(synchronizer):
            raise OffloadUsageError(
                f"layer {index - 1}'s hidden state, the output apply_offloading passed through "
                "the sync function, was dropped before layer "
                f"{index} ran: it is not part of any autograd graph, so it cannot reach the loss "
                "and the offload schedule would never see this layer's backward. apply_offloading "
                "takes the output itself, the first tensor of a tuple/list or dataclass, or "
                "'last_hidden_state'/'hidden_states' of a dict as the hidden state: return the "
                "tensor the next layer takes in that place (first in a tuple)"
            )
        if index in getattr(self.owner, "offloaded", (index,)) and hf_offloads_checkpoints(layer):
            # HF checkpointing with offload=True enabled after apply_offloading: refuse here
            self.next_index = 0
            raise OffloadConfigError(HF_OFFLOAD_CONFLICT.format(index=index))
        self.context.__enter__()
        return index

    def after(self, index: int, out: Any) -> Any:
        self.context.__exit__(None, None, None)
        self.next_index = (index + 1) % self.n
        hidden, put = hidden_state(out)
        synced = self.sync(hidden)
        self.last_hidden = weakref.ref(synced)
        return out if synced is hidden else put(synced)

    def abort(self, index: int, exc: BaseException) -> None:
        self.next_index = 0
        self.last_hidden = None
        self.context.__exit__(type(exc), exc, exc.__traceback__)


def _hidden_dropped(synchronizer: Any) -> bool:
    """Whether the previous layer's synced output left every autograd graph (V2: the backward
    trigger on it was freed) while the graph of its forward pass lives on (tensors saved by
    an offloaded layer are still held): then the hidden state is not what reaches the loss.
    (A forward given up, whose graph is gone, just starts over.)"""
    step = synchronizer.step
    if step is None or step.complete or step.aborted or step.last_trigger is None:
        return False
    if step.last_trigger() is not None:
        return False
    return any(
        entry.live for layer in step.layers if layer is not None for entry in layer.entries
    )


class OffloadingHandle:
    """What ``apply_offloading`` returns: the installed state, and ``remove()`` to undo it.

    Not created directly. Keep it to remove offloading again (``handle.remove()``, or use it as
    a context manager); ``cpu_offload.offloading_handle(layer)`` finds it from any of its
    layers.

    Attributes:
        layers: the layers offloading is installed on, in order.
        num_layers: how many layers offload their activations.
        offloaded: which ones (the first ``num_layers``, unless the plan spread them).
        recompute: indices of the layers recomputed in backward (``torch.utils.checkpoint``).
        selective: indices of the layers whose cheap saved tensors (norm, activation and
            elementwise outputs) are recomputed in backward instead of stored.
        plan: the plan applied, if any.
        context, sync: the pair ``get_cpu_offload_context`` returned (``None`` if nothing is
            offloaded, only recomputed).
        synchronizer: the V2 per-step state (``layer_summary()``: per layer, whether it is
            offloaded, its storages and bytes), else ``None``.
        removed: whether ``remove()`` was called.

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> with cpu_offload.apply_offloading(
        ...         layers, num_layers=2, device=cpu_offload.SimulatedDevice()) as handle:
        ...     print(handle)
        OffloadingHandle(installed: offload the first 2 of 4 layers, recompute [])
        >>> handle.removed, type(layers[0]).__name__
        (True, 'Linear')
    """

    def __init__(
        self, layers: list, num_layers: int, recompute: tuple, plan: Any, selective: tuple = (),
        offloaded: tuple = (),
    ) -> None:
        self.layers = tuple(layers)
        self.num_layers = num_layers
        self.offloaded = tuple(offloaded) or tuple(range(num_layers))
        self.recompute = recompute
        self.selective = selective
        self.plan = plan
        self.context: Any = None
        self.sync: Optional[Callable] = None
        self._undo: Optional[Callable[[], None]] = None

    @property
    def synchronizer(self) -> Any:
        """The V2 ``OffloadSynchronizer`` (introspection: ``layer_summary()``), else ``None``."""
        return getattr(self.context, "synchronizer", None)

    @property
    def removed(self) -> bool:
        return self._undo is None

    def stats(self) -> Any:
        """What the last step did (V2): ``.summary()`` for humans, ``.to_dict()`` for loggers.
        Empty statistics when no layer is offloaded or selective (e.g. a plan with nothing to
        offload); ``None`` under the legacy V1 backend, which keeps none."""
        sync = self.synchronizer
        if sync is not None and hasattr(sync, "stats"):
            return sync.stats()
        if self.context is not None:
            return None  # V1
        from ..v2.stats import StepStats

        return StepStats.empty()

    def remove(self) -> None:
        """Restore every layer exactly as it was (class, attributes, call path). Calling it
        again does nothing.

        Raises:
            OffloadUsageError: called inside a layer's forward, or a layer's class was changed
                since (e.g. ``fully_shard`` applied afterwards).
        """
        if self._undo is None:
            return
        if self.context is not None and getattr(self.synchronizer, "inside", False):
            raise OffloadUsageError(
                "handle.remove() called inside a layer's forward; call it between steps"
            )
        self._undo()
        self._undo = None

    def __enter__(self) -> "OffloadingHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "installed"
        rec = list(self.recompute)
        sel = f", selective {list(self.selective)}" if self.selective else ""
        what = f"the first {self.num_layers}"
        if self.offloaded != tuple(range(self.num_layers)):
            what = f"layers {list(self.offloaded)}"
        return (
            f"OffloadingHandle({state}: offload {what} of "
            f"{len(self.layers)} layers, recompute {rec}{sel})"
        )


_RESERVED = {"enabled", "model_layers", "num_layers", "manual_synchronization"}
# What ``**context_kwargs`` may name: ``get_cpu_offload_context``'s arguments it does not set;
# and what a caller forwarding to apply_offloading may name besides ``layers``/``num_layers``/``plan``.
CONTEXT_KEYWORDS = frozenset(inspect.signature(get_cpu_offload_context).parameters) - _RESERVED
APPLY_KEYWORDS = CONTEXT_KEYWORDS | {"selective", "selective_scope"}


def apply_offloading(
    layers: Union[nn.ModuleList, nn.Sequential, Sequence[nn.Module]],
    *,
    num_layers: Optional[int] = None,
    plan: Any = None,
    selective: Union[None, bool, Sequence[int], Callable] = None,
    selective_scope: Optional[str] = None,
    **context_kwargs: Any,
) -> OffloadingHandle:
    """Offload the activations of a model's layers to pinned CPU memory, in place.

    Each layer's forward runs inside the offload context of ``get_cpu_offload_context`` (backend
    chosen by ``NVTE_CPU_OFFLOAD_V1`` as there) and its hidden-state output passes through the
    sync function: exactly the per-layer loop of the README, without writing it. Layers may take
    any positional and keyword arguments and return a tensor, a tuple/list (the hidden state is
    its first tensor), a dataclass (its first tensor field), a dict or a Hugging Face
    ``ModelOutput`` (``last_hidden_state`` / ``hidden_states``, else the first tensor). The
    hidden state is what the next layer takes: it must reach the loss. ``state_dict()`` keys
    and parameter names do not change. Forward passes with grad disabled (evaluation, ``torch.no_grad``) and recomputations
    during backward (``torch.utils.checkpoint``, HF ``gradient_checkpointing_enable()``) run
    untouched. Layers compiled with ``torch.compile`` before or after applying keep working.
    Hugging Face activation checkpointing (``activation_checkpointing_enable``, or the
    deprecated ``gradient_checkpointing_enable``; any ``every_n_layers``) combines with it, before
    or after: a checkpointed layer's input is what it offloads. HF's ``offload=True``
    (a synchronous ``save_on_cpu`` that takes the checkpoint inputs first) is refused.

    Args:
        layers: the modules that run once each, in this order, in every forward pass, e.g.
            ``model.model.layers`` of a Hugging Face decoder; ``model_layers`` is ``len(layers)``.
            A whole model works too, also an ``nn.Sequential`` of an embedding, an encoder
            and a head: its one list of repeated blocks is used, however deep
            (``cpu_offload.find_block_list``; ``OffloadConfigError`` naming the
            candidates when there are several).
        num_layers: offload the activations of the first ``num_layers`` layers (the default
            schedule: at most ``len(layers) - num_layers`` layers' activations on the GPU).
        plan: a ``Plan`` from ``plan_offloading``: its offloaded layers (the first
            ``num_layers``, or the spread ``offloaded`` ones, with their own schedule) are
            offloaded and its ``recompute`` layers are checkpointed (non-reentrant
            ``torch.utils.checkpoint``; not where they already run inside a non-reentrant
            checkpoint of the caller's, around the layer or the stack, which recomputes them).
            Its ``min_tensor_size_to_offload`` and device are used unless given here, and its
            ``selective`` layers are selective.
        selective: layers (indices, or ``True`` for all) whose cheap saved tensors are
            recomputed in backward instead of stored: outputs of norms, activations,
            elementwise ops and dtype casts whose inputs the layer saves anyway (V2 only, not
            with ``torch.compile``'d layers nor with layers the plan checkpoints). Exact, like
            everything else; combines with offloading (only the other saved tensors move).
            Or a ``torch.utils.checkpoint`` selective-checkpoint policy function (``policy(ctx,
            op, *args, **kwargs) -> CheckpointPolicy``): every layer runs checkpointed with it,
            and ops it answers ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` are saved and moved
            by the offload engine instead of recomputed
            (``cpu_offload.create_selective_checkpoint_contexts``; not with ``plan=``).
        selective_scope: where a selective layer's ops are recorded: ``"modules"`` (default,
            or the plan's): inside its norm and activation modules, a few ops for little host
            time; ``"layer"``: every op, which also catches products outside modules (a gated
            MLP's) but costs the host tens of microseconds per op.
        **context_kwargs: passed to ``get_cpu_offload_context`` (``min_tensor_size_to_offload``,
            ``device``, ``retain_pinned_cpu_buffers``, ``synchronization_dict``, ...).

    Returns:
        An ``OffloadingHandle``; ``handle.remove()`` restores the layers exactly.

    Raises:
        OffloadConfigError: neither or conflicting ``num_layers``/``plan``, a model with
            several lists of repeated blocks, an offloaded layer under HF activation
            checkpointing with ``offload=True`` (also at its first forward, if enabled later), arguments that
            ``apply_offloading`` sets itself, a plan for a different number of layers, bad
            ``selective`` layers (out of range, checkpointed, compiled, or under V1), or what
            ``get_cpu_offload_context`` rejects.
        OffloadUsageError: offloading is already applied to one of the layers.
        TypeError: a keyword neither ``apply_offloading`` nor ``get_cpu_offload_context`` takes
            (named against ``apply_offloading``, with the closest name).

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        >>> handle = cpu_offload.apply_offloading(   # on a GPU: leave out device=
        ...     layers, num_layers=2, min_tensor_size_to_offload=1,
        ...     device=cpu_offload.SimulatedDevice())
        >>> handle
        OffloadingHandle(installed: offload the first 2 of 4 layers, recompute [])
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for layer in layers:
        ...     x = layer(x)
        >>> x.sum().backward()
        >>> handle.remove()

    Selective recomputation, alone or with offloading::

        >>> mlp = lambda: torch.nn.Sequential(
        ...     torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
        >>> blocks = torch.nn.ModuleList(mlp() for _ in range(4))
        >>> handle = cpu_offload.apply_offloading(
        ...     blocks, num_layers=1, selective=True, min_tensor_size_to_offload=1,
        ...     device=cpu_offload.SimulatedDevice())
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for block in blocks:
        ...     x = block(x)
        >>> x.sum().backward()
        >>> handle.stats().to_dict()["recipe_tensors"]   # each GELU output, saved by a Linear
        4
        >>> handle.remove()
    """
    layers = as_layer_list(layers, find=True)
    n = len(layers)
    check_int("num_layers", num_layers, minimum=0, allow_none=True,
              meaning="the number of layers to offload")
    num_layers = None if num_layers is None else int(num_layers)  # also NumPy integers
    used = sorted(_RESERVED & set(context_kwargs))
    if used:
        raise OffloadConfigError(
            f"apply_offloading sets {', '.join(used)} itself (model_layers = len(layers)); drop "
            "it, and use get_cpu_offload_context directly for manual synchronization"
        )
    check_keywords("apply_offloading", context_kwargs, CONTEXT_KEYWORDS, "get_cpu_offload_context")
    check_plan(plan)
    recompute: tuple = ()
    offloaded: tuple = ()
    context_fn = None
    if callable(selective) and not isinstance(selective, (bool, list, tuple, range)):
        if plan is not None:
            raise OffloadConfigError(
                "selective=<checkpoint policy> checkpoints every layer, and plan= decides which "
                "layers are checkpointed; pass one of them"
            )
        hf = [i for i, layer in enumerate(layers) if getattr(layer, "gradient_checkpointing", False)]
        if hf:
            raise OffloadConfigError(
                f"layers {hf} are checkpointed by Hugging Face activation checkpointing, which "
                "would run instead of the policy's checkpoint; give HF the policy instead: "
                "activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': "
                "False, 'context_fn': functools.partial(cpu_offload."
                "create_selective_checkpoint_contexts, policy)}), and drop selective="
            )
        policy, selective = selective, None
        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        recompute = tuple(range(n))
    if plan is not None:
        if num_layers is not None and num_layers != plan.num_layers:
            raise OffloadConfigError(
                f"num_layers={num_layers} conflicts with plan.num_layers={plan.num_layers}; pass "
                "one of them"
            )
        num_layers = plan.num_layers
        recompute = tuple(sorted(plan.recompute))
        profiled = len(getattr(plan, "profiles", ()) or ())
        if (profiled and profiled != n) or any(not 0 <= r < n for r in recompute):
            raise OffloadConfigError(
                f"the plan was made for {profiled or 'other'} layers, but {n} layers were passed; "
                "plan with the same layers you apply it to"
            )
        min_size = getattr(plan, "min_tensor_size_to_offload", None)
        if min_size is not None:
            context_kwargs.setdefault("min_tensor_size_to_offload", min_size)
        if getattr(plan, "device", None) is not None:
            context_kwargs.setdefault("device", plan.device)
        offloaded = tuple(getattr(plan, "offloaded", ()) or ())
        if offloaded and offloaded != tuple(range(num_layers)):
            if "synchronization_dict" in context_kwargs or use_v1():
                raise OffloadConfigError(
                    f"the plan offloads layers {list(offloaded)} (spread: not the first "
                    f"{num_layers}), which needs the V2 backend and the plan's own schedule; "
                    "unset NVTE_CPU_OFFLOAD_V1 and pass no synchronization_dict, or plan with "
                    "spread=False"
                )
            context_kwargs["synchronization_dict"] = spread_synchronization_dict(offloaded, n)
        elif num_layers == n:  # every layer: the last one's input leaves when the forward ends
            if "synchronization_dict" in context_kwargs or n - 1 not in recompute:
                raise OffloadConfigError(
                    f"the plan offloads all {n} layers, which needs layer {n - 1} recomputed "
                    "and the plan's own schedule; plan again, and pass no synchronization_dict"
                )
            context_kwargs["synchronization_dict"] = plan_synchronization_dict(n, n)
    elif num_layers is None and "synchronization_dict" not in context_kwargs:
        raise OffloadConfigError(
            "apply_offloading needs num_layers=k (offload the first k layers) or "
            "plan=cpu_offload.plan_offloading(step_fn, layers, memory_budget)"
        )
    if plan is not None and selective is None:
        selective = tuple(getattr(plan, "selective", ()))
    if selective_scope is None:
        selective_scope = getattr(plan, "selective_scope", "modules")
    check_selective_scope(selective_scope)
    sel = _selective_layers(selective, layers, recompute)
    moved_checkpoints = sorted(set(recompute) & set(offloaded or range(num_layers or 0)))
    if moved_checkpoints and use_v1():
        raise OffloadConfigError(
            f"the plan checkpoints layers {moved_checkpoints} and offloads their inputs, which "
            "needs the V2 backend (V1 offloads only tagged tensors, and a checkpoint saves its "
            "inputs untagged), but NVTE_CPU_OFFLOAD_V1=1 selects V1; unset NVTE_CPU_OFFLOAD_V1"
        )
    if sel and use_v1():
        raise OffloadConfigError(
            "selective recomputation needs the V2 backend, but NVTE_CPU_OFFLOAD_V1=1 selects V1; "
            "unset NVTE_CPU_OFFLOAD_V1, or drop selective="
        )
    check_not_instrumented(layers)
    if num_layers or offloaded:
        check_hf_offload(layers, offloaded or range(num_layers))
    handle = OffloadingHandle(layers, num_layers or 0, recompute, plan, sel, offloaded)
    offloads = bool(num_layers) or "synchronization_dict" in context_kwargs
    if offloads or sel:
        with warnings.catch_warnings():
            if plan is not None:
                # The plan weighed overlap against memory with measured costs: offloading all
                # but one layer is its informed choice, not the misconfiguration warned about.
                warnings.filterwarnings("ignore", message="num_layers=model_layers-1")
            handle.context, handle.sync = get_cpu_offload_context(
                enabled=True, num_layers=num_layers or 0, model_layers=n, **context_kwargs
            )
        if plan is not None and getattr(plan, "partial_bytes", None) is not None:
            _limit_last_layer(handle, plan)
        if sel:
            handle.synchronizer.set_selective(sel, selective_scope)
        driver: Any = OffloadDriver(handle, handle.context, handle.sync)
    else:
        driver = _PassDriver(handle)
    handle._undo = instrument(layers, driver, recompute, context_fn)
    return handle


def check_plan(plan: Any) -> None:
    """``OffloadConfigError`` unless ``plan`` is ``None`` or a plan (what ``plan_offloading``
    returns: it has ``num_layers`` and ``recompute``; tools/ does not import plan/)."""
    if plan is not None and not (hasattr(plan, "num_layers") and hasattr(plan, "recompute")):
        raise OffloadConfigError(
            f"plan must be a Plan from cpu_offload.plan_offloading(step_fn, layers, "
            f"memory_budget), got {plan!r} ({type(plan).__name__}); for a number of layers to "
            "offload pass num_layers="
        )


def _selective_layers(selective: Any, layers: list, recompute: tuple) -> tuple:
    """``selective=`` as sorted layer indices, checked."""
    n = len(layers)
    if selective is None or selective is False:
        return ()
    if selective is True:
        sel = tuple(range(n))
    else:
        try:
            if isinstance(selective, (str, bytes)):
                raise TypeError  # a string is iterable, but its characters are no indices
            sel = tuple(sorted(set(selective)))
        except TypeError:
            raise OffloadConfigError(
                f"selective must be True (every layer) or layer indices (False or None: no "
                f"layer), got {selective!r}"
            ) from None
        bad = [i for i in sel if not is_count(i) or not 0 <= i < n]
        if bad:
            raise OffloadConfigError(
                f"selective layers must be indices in [0, {n}), got {bad!r}"
            )
        sel = tuple(sorted({int(i) for i in sel}))  # also NumPy integers
    both = sorted(set(sel) & set(recompute))
    if both:
        raise OffloadConfigError(
            f"layers {both} are both checkpointed (recompute) and selective: a checkpointed "
            "layer saves only its input, so leave it out of selective"
        )
    compiled = [i for i in sel if is_compiled_module(layers[i])]
    if compiled:
        raise OffloadConfigError(
            f"layers {compiled} are compiled with torch.compile: selective recomputation records "
            "the eager ops of a layer's forward, which a compiled graph hides; leave them out of "
            "selective, or compile the layers without it"
        )
    return sel


def _limit_last_layer(handle: OffloadingHandle, plan: Any) -> None:
    """A plan that offloads its last offloaded layer in part: set that layer's byte limit."""
    sync = handle.synchronizer
    last = handle.offloaded[-1]
    if not hasattr(sync, "limit_layer_bytes"):
        raise OffloadConfigError(
            f"the plan offloads layer {last} in part, which only the V2 backend "
            "can do; unset NVTE_CPU_OFFLOAD_V1, or plan with "
            "cpu_offload.plan_offloading(..., partial=False)"
        )
    sync.limit_layer_bytes(last, plan.partial_bytes)


class _PassDriver:
    """Recompute-only plans: nothing to offload, the layers only run checkpointed."""

    def __init__(self, owner: OffloadingHandle) -> None:
        self.owner = owner

    def before(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> int:
        return index

    def after(self, index: int, out: Any) -> Any:
        return out

    def abort(self, index: int, exc: BaseException) -> None:
        pass


def offloading_handle(module: nn.Module) -> Optional[OffloadingHandle]:
    """The handle of the ``apply_offloading`` call that installed offloading on ``module``.

    Use it to inspect or ``remove()`` offloading when the handle ``apply_offloading`` returned
    is out of reach (e.g. it was applied inside a library or a ``Trainer`` callback).

    Args:
        module: any ``nn.Module``.

    Returns:
        The ``OffloadingHandle``, or ``None`` if ``module`` is not one of the layers offloading
        was applied to (or it was removed).

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        >>> _ = cpu_offload.apply_offloading(
        ...     layers, num_layers=2, device=cpu_offload.SimulatedDevice())
        >>> cpu_offload.offloading_handle(layers[3]).remove()
        >>> print(cpu_offload.offloading_handle(layers[3]))
        None
    """
    owner = getattr(driver_of(module), "owner", None)
    return owner if isinstance(owner, OffloadingHandle) else None
