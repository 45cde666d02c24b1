"""``apply_offloading``: install activation offloading on a model's layers in place, in one call.

In the spirit of ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.
apply_activation_checkpointing`` and FSDP2's ``fully_shard``: the layers stay where they are,
nothing is wrapped in a new parent module, so ``state_dict()`` keys and ``named_parameters()``
names do not change, and a handle undoes it.

How: like ``fully_shard``, each layer's class is swapped for a subclass created once per class
(``Offloaded<Name>``) whose ``__call__`` runs the original call inside the offload context and
passes the layer's hidden-state output through the sync function. ``__call__`` runs outside
``nn.Module._call_impl``, so it also works when the layer was compiled in place
(``layer.compile()``: only ``_call_impl`` is compiled) and is not affected by torch.compile
skipping guards on module hooks. The per-layer logic lives in small functions excluded from
tracing, so a layer compiled *after* applying (``torch.compile(layer)``) compiles its body and runs
the offload bookkeeping eagerly between graphs.

The same machinery (``instrument``) runs the real-step profiler of ``plan_offloading`` and the
real-step mode of the audit: anything that needs to see each layer's call of a real training step.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
import weakref
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..checks import check_int
from ..compat import compiler_disable, in_backward, in_checkpoint_region, is_compiled_module
from ..errors import OffloadConfigError, OffloadUsageError
from ..facade import use_v1
from ..v2.recompute import check_selective_scope
from ..v2.schedule import plan_synchronization_dict, spread_synchronization_dict

__all__ = ["OffloadingHandle", "apply_offloading", "offloading_handle"]

_STATE_ATTR = "_cpu_offload_layer"
_classes: dict[type, type] = {}  # original class -> its Offloaded<Name> subclass
_bases: dict[type, type] = {}  # the reverse


class _LayerState:
    """What an instrumented layer needs at call time (kept in the layer's ``__dict__``)."""

    __slots__ = ("driver", "index", "base", "recompute")

    def __init__(self, driver: Any, index: int, base: type, recompute: bool) -> None:
        self.driver = driver
        self.index = index
        self.base = base
        self.recompute = recompute


@compiler_disable
def _begin(self: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """``(state, token, checkpointed)``; ``token is None``: run the layer untouched;
    ``checkpointed``: run it under the plan's checkpoint."""
    state = self.__dict__.get(_STATE_ATTR)
    if state is None or not torch.is_grad_enabled() or in_backward():
        return state, None, False
    # The plan's checkpoint of a recompute layer, unless the layer already runs inside a user's
    # non-reentrant checkpoint region (around the layer or the stack; HF's
    # gradient_checkpointing): that region recomputes the layer in backward, where this call
    # runs untouched, so the recomputation must see the same ops and saved tensors as the
    # forward. A checkpoint nested in forward only would save other tensors than the
    # recomputation (CheckpointError), and would recompute nothing the outer one does not.
    checkpointed = (
        state.recompute
        and not (getattr(self, "gradient_checkpointing", False) and self.training)  # HF: done
        and not in_checkpoint_region()
    )
    return state, state.driver.before(state.index, self, args, kwargs), checkpointed


@compiler_disable
def _end(state: _LayerState, token: Any, out: Any) -> Any:
    return state.driver.after(token, out)


@compiler_disable
def _fail(state: _LayerState, token: Any, exc: BaseException) -> None:
    state.driver.abort(token, exc)


def _base_call(
    self: nn.Module, state: Optional[_LayerState], checkpointed: bool, *args: Any, **kwargs: Any
) -> Any:
    base = state.base if state is not None else _bases.get(type(self), type(self))
    if checkpointed:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(base.__call__, self, *args, use_reentrant=False, **kwargs)
    return base.__call__(self, *args, **kwargs)


def _layer_call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``__call__`` of an instrumented layer: the original call between ``before``/``after``."""
    state, token, checkpointed = _begin(self, args, kwargs)
    if token is None:  # grad disabled, or a recomputation in backward: run it as it is
        return _base_call(self, None, False, *args, **kwargs)
    try:
        out = _base_call(self, state, checkpointed, *args, **kwargs)
    except BaseException as exc:
        _fail(state, token, exc)
        raise
    return _end(state, token, out)


def _layer_reduce_ex(self: nn.Module, protocol: int) -> Any:
    """Copies and pickles of an instrumented layer are plain layers of the original class."""
    state = dict(self.__getstate__() if hasattr(self, "__getstate__") else self.__dict__)
    state.pop(_STATE_ATTR, None)
    return _plain_layer, (_bases[type(self)], state)


def _plain_layer(base: type, state: dict) -> nn.Module:
    layer = base.__new__(base)
    if hasattr(layer, "__setstate__"):
        layer.__setstate__(state)
    else:
        layer.__dict__.update(state)
    return layer


def _instrumented_class(cls: type) -> type:
    sub = _classes.get(cls)
    if sub is None:
        sub = type(
            f"Offloaded{cls.__name__}",
            (cls,),
            {
                "__call__": _layer_call,
                "__reduce_ex__": _layer_reduce_ex,
                "__module__": cls.__module__,
                "__doc__": cls.__doc__,
            },
        )
        _classes[cls] = sub
        _bases[sub] = cls
    return sub


def as_layer_list(layers: Union[nn.Module, Sequence[nn.Module]], what: str = "layers") -> list:
    """``ModuleList``/``Sequential`` -> its children; a list/tuple of modules as is."""
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        out = list(layers)
    elif isinstance(layers, nn.Module):
        raise TypeError(
            f"{what} must be the model's layers (an nn.ModuleList, nn.Sequential or a list of "
            f"modules, e.g. model.model.layers), got one {type(layers).__name__}; pass [module] "
            "for a single layer"
        )
    else:
        out = list(layers)
    bad = [type(m).__name__ for m in out if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"{what} must contain nn.Modules, got {', '.join(bad)}")
    if not out:
        raise OffloadConfigError(f"{what} is empty: pass the model's layers (e.g. model.model.layers)")
    seen: dict[int, int] = {}
    for i, m in enumerate(out):
        if id(m) in seen:
            raise OffloadConfigError(
                f"{what}[{i}] is the same module as {what}[{seen[id(m)]}]: each layer must run "
                "once per forward pass; shared (weight-tied) layers are not supported"
            )
        seen[id(m)] = i
    for i, m in enumerate(out):
        for name, sub in m.named_modules(remove_duplicate=False):
            j = seen.get(id(sub))
            if j is not None and j != i:
                raise OffloadConfigError(
                    f"{what}[{i}] ({type(m).__name__}) contains {what}[{j}] "
                    f"({type(sub).__name__}) as its submodule {name!r}: a layer runs inside its "
                    "parent's forward, so the two cannot each be one layer of the forward pass; "
                    f"pass either the parent or its children, not both"
                )
    return out


def check_not_instrumented(layers: list) -> None:
    """Raise if offloading (or a running profiler) is already installed on one of ``layers``."""
    for i, layer in enumerate(layers):
        existing = layer.__dict__.get(_STATE_ATTR)
        if existing is not None:
            owner = getattr(existing.driver, "owner", None)
            fix = (
                "call .remove() on the handle apply_offloading returned (also available as "
                "cpu_offload.offloading_handle(layer))"
                if isinstance(owner, OffloadingHandle)
                else "let the running planner/audit finish first"
            )
            raise OffloadUsageError(
                f"layer {i} ({type(layer).__name__}) already has offloading or profiling "
                f"installed; {fix} before applying again"
            )


def instrument(layers: list, driver: Any, recompute: Sequence[int] = ()) -> Callable[[], None]:
    """Route every call of ``layers[i]`` through ``driver`` (``before(i, layer, args, kwargs) ->
    token``, ``after(token, out) -> out``, ``abort(token, exc)``); return the function that undoes
    it.

    ``before`` is not called (the layer runs untouched) with grad disabled or during a backward
    pass (recomputation); a ``None`` token from ``before`` also leaves the call untouched.
    Layers in ``recompute`` run under non-reentrant ``torch.utils.checkpoint``, except inside
    the caller's own non-reentrant checkpoint region (which recomputes them already).
    """
    check_not_instrumented(layers)
    rec = set(recompute)
    originals = []
    for i, layer in enumerate(layers):
        base = type(layer)
        layer.__dict__[_STATE_ATTR] = _LayerState(driver, i, base, i in rec)
        layer.__class__ = _instrumented_class(base)
        originals.append((layer, base))

    def undo() -> None:
        changed = [
            (i, type(layer).__name__) for i, (layer, base) in enumerate(originals)
            if type(layer) is not _classes[base]
        ]
        if changed:
            i, name = changed[0]
            raise OffloadUsageError(
                f"layer {i}'s class was changed after offloading was applied (now {name}, e.g. by "
                "fully_shard); remove offloading before such wrapping, or apply it after"
            )
        for layer, base in originals:
            layer.__class__ = base
            layer.__dict__.pop(_STATE_ATTR, None)

    return undo


# --- the layer boundary: the hidden-state output -------------------------------------------------

_HIDDEN_KEYS = ("last_hidden_state", "hidden_states")


def hidden_state(out: Any) -> tuple:
    """``(tensor, put)``: the hidden-state tensor of a layer's output, and ``put(t)`` that returns
    the output with it replaced. The hidden state is the output itself (a tensor), the first tensor
    of a tuple/list/namedtuple, the first tensor field of a dataclass, or
    ``last_hidden_state``/``hidden_states`` (else the first tensor) of a dict or a Hugging Face
    ``ModelOutput``."""
    if isinstance(out, torch.Tensor):
        return out, lambda t: t
    if isinstance(out, Mapping):
        keys = [k for k in _HIDDEN_KEYS if isinstance(out.get(k), torch.Tensor)]
        keys = keys or [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        if keys:
            key = keys[0]

            def put_item(t: torch.Tensor) -> Any:
                if isinstance(out, MutableMapping):
                    out[key] = t  # ModelOutput keeps its attribute in step
                    return out
                return {**out, key: t}

            return out[key], put_item
    elif isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if isinstance(v, torch.Tensor):

                def put_index(t: torch.Tensor, i: int = i) -> Any:
                    if isinstance(out, list):
                        return out[:i] + [t] + out[i + 1:]
                    if hasattr(out, "_replace"):  # namedtuple
                        return out._replace(**{out._fields[i]: t})
                    items = out[:i] + (t,) + out[i + 1:]
                    return items if type(out) is tuple else type(out)(items)

                return v, put_index
    elif dataclasses.is_dataclass(out) and not isinstance(out, type):
        for f in dataclasses.fields(out):
            v = getattr(out, f.name, None)
            if isinstance(v, torch.Tensor):

                def put_field(t: torch.Tensor, name: str = f.name) -> Any:
                    # A shallow copy with the field replaced (also for frozen dataclasses, and
                    # fields with init=False, which dataclasses.replace cannot set).
                    new = copy.copy(out)
                    object.__setattr__(new, name, t)
                    return new

                return v, put_field
        raise TypeError(
            f"the layer returned the dataclass {type(out).__name__}, which has no tensor field: "
            "apply_offloading takes the first tensor field of a dataclass output as the hidden "
            "state; return the hidden state in a field"
        )
    raise TypeError(
        f"the layer returned {type(out).__name__}, which holds no tensor: apply_offloading needs "
        "the hidden state as the output itself, the first tensor of a tuple/list or dataclass, "
        "or 'last_hidden_state'/'hidden_states' of a dict or ModelOutput"
    )


# --- apply_offloading -----------------------------------------------------------------------------


class _OffloadDriver:
    """Enters the offload context around each layer and syncs its hidden-state output."""

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
                    f"layer 0 ({_bases.get(type(layer), type(layer)).__name__}) ran again on the "
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


def first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The hidden-state input of a layer call: its first tensor argument (positional first)."""
    for v in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


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


def apply_offloading(
    layers: Union[nn.ModuleList, nn.Sequential, Sequence[nn.Module]],
    *,
    num_layers: Optional[int] = None,
    plan: Any = None,
    selective: Union[None, bool, Sequence[int]] = None,
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

    Args:
        layers: the modules that run once each, in this order, in every forward pass, e.g.
            ``model.model.layers`` of a Hugging Face decoder; ``model_layers`` is ``len(layers)``.
        num_layers: offload the activations of the first ``num_layers`` layers (the default
            schedule: at most ``len(layers) - num_layers`` layers' activations on the GPU).
        plan: a ``Plan`` from ``plan_offloading``: its offloaded layers (the first
            ``num_layers``, or the spread ``offloaded`` ones, with their own schedule) are
            offloaded and its ``recompute`` layers are checkpointed (non-reentrant
            ``torch.utils.checkpoint``; not where they already run inside a non-reentrant
            checkpoint of the caller's, around the layer or the stack, which recomputes them).
            Its ``min_tensor_size_to_offload`` is used unless given here, and its ``selective``
            layers are selective.
        selective: layers (indices, or ``True`` for all) whose cheap saved tensors are
            recomputed in backward instead of stored: outputs of norms, activations,
            elementwise ops and dtype casts whose inputs the layer saves anyway (V2 only, not
            with ``torch.compile``'d layers nor with layers the plan checkpoints). Exact, like
            everything else; combines with offloading (only the other saved tensors move).
        selective_scope: where a selective layer's ops are recorded: ``"modules"`` (default,
            or the plan's): inside its norm and activation modules, a few ops for little host
            time; ``"layer"``: every op, which also catches products outside modules (a gated
            MLP's) but costs the host tens of microseconds per op.
        **context_kwargs: passed to ``get_cpu_offload_context`` (``min_tensor_size_to_offload``,
            ``device``, ``retain_pinned_cpu_buffers``, ``synchronization_dict``, ...).

    Returns:
        An ``OffloadingHandle``; ``handle.remove()`` restores the layers exactly.

    Raises:
        OffloadConfigError: neither or conflicting ``num_layers``/``plan``, arguments that
            ``apply_offloading`` sets itself, a plan for a different number of layers, bad
            ``selective`` layers (out of range, checkpointed, compiled, or under V1), or what
            ``get_cpu_offload_context`` rejects.
        OffloadUsageError: offloading is already applied to one of the layers.

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
    layers = as_layer_list(layers)
    n = len(layers)
    check_int("num_layers", num_layers, minimum=0, allow_none=True,
              meaning="the number of layers to offload")
    used = sorted(_RESERVED & set(context_kwargs))
    if used:
        raise OffloadConfigError(
            f"apply_offloading sets {', '.join(used)} itself (model_layers = len(layers)); drop "
            "it, and use get_cpu_offload_context directly for manual synchronization"
        )
    recompute: tuple = ()
    offloaded: tuple = ()
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
    handle = OffloadingHandle(layers, num_layers or 0, recompute, plan, sel, offloaded)
    offloads = bool(num_layers) or "synchronization_dict" in context_kwargs
    if offloads or sel:
        from ..facade import get_cpu_offload_context

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
        driver: Any = _OffloadDriver(handle, handle.context, handle.sync)
    else:
        driver = _PassDriver(handle)
    handle._undo = instrument(layers, driver, recompute)
    return handle


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
        bad = [i for i in sel if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise OffloadConfigError(
                f"selective layers must be indices in [0, {n}), got {bad!r}"
            )
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
            "cpu_offload.tools.planner.plan(..., partial=False)"
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
    state = module.__dict__.get(_STATE_ATTR)
    owner = getattr(getattr(state, "driver", None), "owner", None)
    return owner if isinstance(owner, OffloadingHandle) else None
