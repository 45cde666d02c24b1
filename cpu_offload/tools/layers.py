"""The layer seam: route every call of a model's layers through a *driver*, without wrapping them.

``apply_offloading`` (which enters the offload context around each layer), the real-step
profiler of ``plan_offloading`` and the real-step mode of the audit all need to see each layer's
call of a real training step; this module is what they share.

How: like FSDP2's ``fully_shard``, each layer's class is swapped for a subclass created once per
class (``Offloaded<Name>``) whose ``__call__`` runs the original call between the driver's
``before`` and ``after``. ``__call__`` runs outside ``nn.Module._call_impl``, so it also works
when the layer was compiled in place (``layer.compile()``: only ``_call_impl`` is compiled) and is
not affected by torch.compile skipping guards on module hooks. The per-layer logic lives in small
functions excluded from tracing, so a layer compiled *after* instrumenting
(``torch.compile(layer)``) compiles its body and runs the driver eagerly between graphs. Nothing
is wrapped in a new parent module, so ``state_dict()`` keys and ``named_parameters()`` names do
not change, and copies and pickles of an instrumented layer are plain layers of the original
class.

The driver protocol (see ``instrument``):

- ``before(index, layer, args, kwargs) -> token``: the layer's call begins (grad enabled, not
  a recomputation during backward); a ``None`` token leaves this call untouched;
- ``after(token, out) -> out``: it returned ``out``; what ``after`` returns is the call's result;
- ``abort(token, exc)``: it raised ``exc`` (re-raised after ``abort``);
- ``owner``: the handle that installed the driver and can remove it (``apply_offloading``'s), or
  ``None`` for a driver that removes itself when it is done (profiler, audit).
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..compat import (
    checkpoint_sac_hooks_kwargs, eager_between_graphs, in_backward, in_checkpoint_region,
)
from ..core.errors import OffloadConfigError, OffloadUsageError
from ..v2.policies import SAC_RESPECTS_OFFLOAD_HOOKS

__all__ = [
    "as_layer_list", "base_class", "check_not_instrumented", "driver_of", "find_block_list",
    "first_tensor", "hf_offloads_checkpoints", "hidden_state", "instrument",
]

_STATE_ATTR = "_cpu_offload_layer"
_classes: dict[type, type] = {}  # original class -> its Offloaded<Name> subclass
_bases: dict[type, type] = {}  # the reverse


class _LayerState:
    """What an instrumented layer needs at call time (kept in the layer's ``__dict__``)."""

    __slots__ = ("driver", "index", "base", "recompute", "context_fn")

    def __init__(
        self, driver: Any, index: int, base: type, recompute: bool,
        context_fn: Optional[Callable] = None,
    ) -> None:
        self.driver = driver
        self.index = index
        self.base = base
        self.recompute = recompute
        self.context_fn = context_fn


@eager_between_graphs
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
    # Decided before ``before`` enters the offload context, whose hooks then are the innermost.
    checkpointed = (
        state.recompute
        and not (getattr(self, "gradient_checkpointing", False) and self.training)  # HF: done
        and not in_checkpoint_region()
    )
    return state, state.driver.before(state.index, self, args, kwargs), checkpointed


@eager_between_graphs
def _end(state: _LayerState, token: Any, out: Any) -> Any:
    return state.driver.after(token, out)


@eager_between_graphs
def _fail(state: _LayerState, token: Any, exc: BaseException) -> None:
    state.driver.abort(token, exc)


# How the package's checkpoints run: non-reentrant, and (torch >= 2.15) with
# respect_saved_tensors_hooks chosen explicitly, not left to torch's default, which warns now and
# is to change (see Note [SAC-cached tensors and the offload hooks] in v2/policies.py).
_CHECKPOINT_KWARGS = {"use_reentrant": False,
                      **checkpoint_sac_hooks_kwargs(SAC_RESPECTS_OFFLOAD_HOOKS)}


def _base_call(
    self: nn.Module, state: Optional[_LayerState], checkpointed: bool, *args: Any, **kwargs: Any
) -> Any:
    base = state.base if state is not None else _bases.get(type(self), type(self))
    if checkpointed:
        if state.context_fn is not None:  # a selective-checkpoint policy
            return checkpoint(
                base.__call__, self, *args, context_fn=state.context_fn, **_CHECKPOINT_KWARGS,
                **kwargs,
            )
        return checkpoint(base.__call__, self, *args, **_CHECKPOINT_KWARGS, **kwargs)
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


def block_lists(model: nn.Module) -> list:
    """``[(attribute path, ModuleList)]``: the outermost lists of two or more modules of one
    class in ``model`` (its repeated blocks). A Hugging Face model's ``_no_split_modules`` (the
    decoder layer classes, which FSDP's auto-wrap policy wraps) narrows them when it names one."""
    found = []
    inside: set = set()  # modules inside an element of a list already found (e.g. MoE experts)
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                found.append((name, module))
                for block in module:
                    inside.update(id(m) for m in block.modules())
    preferred = set(getattr(model, "_no_split_modules", None) or ())
    named = [(n, m) for n, m in found if type(m[0]).__name__ in preferred]
    return named or found


def _path(name: str) -> str:
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in name.split(".") if p)


def find_block_list(model: nn.Module) -> nn.ModuleList:
    """The list of repeated blocks of ``model`` (a transformer's decoder layers), found the way
    FSDP's auto-wrap policies find what to wrap: the outermost ``nn.ModuleList`` (or
    ``nn.Sequential``) of two or more modules of one class, narrowed by a Hugging Face model's
    ``_no_split_modules`` (its decoder layer classes).

    Raises:
        OffloadConfigError: ``model`` has no such list, or several (an encoder-decoder, a vision
            tower next to the text layers); the message names the candidates to pass as the
            layers (``apply_offloading(model.model.layers, ...)``, ``layers=`` of the Trainer
            callback).

    Example::

        >>> import torch, cpu_offload
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = torch.nn.Linear(8, 8)
        ...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        >>> net = Net()
        >>> cpu_offload.find_block_list(net) is net.blocks
        True
    """
    found = block_lists(model)
    if len(found) == 1:
        return found[0][1]
    if not found:
        raise OffloadConfigError(
            f"found no list of repeated blocks in this {type(model).__name__} (an nn.ModuleList "
            "of two or more layers of one class); pass its layers yourself: "
            "apply_offloading(model.<layers>, ...), or layers=model.<layers> in the Trainer callback"
        )
    names = ", ".join(f"{_path(n)} ({len(m)} x {type(m[0]).__name__})" for n, m in found)
    first = _path(found[0][0])
    children = (
        f", or apply_offloading(list(model), ...) to offload its {len(model)} children as the "
        "layers" if isinstance(model, (nn.Sequential, nn.ModuleList)) else "")
    raise OffloadConfigError(
        f"this {type(model).__name__} has several lists of repeated blocks: {names}; pass the one "
        f"to offload: apply_offloading({first}, ...), or layers={first} in the Trainer "
        f"callback{children}"
    )


def as_layer_list(
    layers: Union[nn.Module, Sequence[nn.Module]], what: str = "layers", find: bool = False
) -> list:
    """``ModuleList``/``Sequential`` -> its children; a list/tuple of modules as is; with
    ``find``, a whole model -> its repeated blocks (``find_block_list``).

    With ``find``, a ``Sequential``/``ModuleList`` of modules of several classes that holds a
    list of repeated blocks deeper down is a model, not a layer list: ``nn.Sequential(Embedding,
    TransformerEncoder, Linear)`` offloads ``[1].layers``, not the whole encoder as one layer
    (several such lists: ``find_block_list``'s error names them, and ``list(model)``)."""
    if isinstance(layers, (nn.ModuleList, nn.Sequential)):
        if find and len({type(m) for m in layers}) > 1 and block_lists(layers):
            return as_layer_list(find_block_list(layers), what)
        out = list(layers)
    elif isinstance(layers, nn.Module):
        if find and block_lists(layers):
            return as_layer_list(find_block_list(layers), what)
        raise TypeError(
            f"{what} must be the model's layers (an nn.ModuleList, nn.Sequential or a list of "
            f"modules, e.g. model.model.layers) or a model holding one list of repeated layers, "
            f"got one {type(layers).__name__}; pass [module] for a single layer"
        )
    else:
        try:
            out = list(layers)
        except TypeError:
            raise TypeError(
                f"{what} must be the model's layers (an nn.ModuleList, nn.Sequential or a list "
                f"of modules, e.g. model.model.layers), got {layers!r}"
            ) from None
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
                if owner is not None
                else "let the running planner/audit finish first"
            )
            raise OffloadUsageError(
                f"layer {i} ({type(layer).__name__}) already has offloading or profiling "
                f"installed; {fix} before applying again"
            )


def instrument(
    layers: list, driver: Any, recompute: Sequence[int] = (), context_fn: Optional[Callable] = None
) -> Callable[[], None]:
    """Route every call of ``layers[i]`` through ``driver`` (``before(i, layer, args, kwargs) ->
    token``, ``after(token, out) -> out``, ``abort(token, exc)``); return the function that undoes
    it.

    ``before`` is not called (the layer runs untouched) with grad disabled or during a backward
    pass (recomputation); a ``None`` token from ``before`` also leaves the call untouched.
    Layers in ``recompute`` run under non-reentrant ``torch.utils.checkpoint`` (with
    ``context_fn``, e.g. selective-checkpoint contexts, if given).
    """
    check_not_instrumented(layers)
    rec = set(recompute)
    originals = []
    for i, layer in enumerate(layers):
        base = type(layer)
        layer.__dict__[_STATE_ATTR] = _LayerState(driver, i, base, i in rec, context_fn)
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


def driver_of(module: nn.Module) -> Any:
    """The driver ``instrument`` routes ``module``'s calls through, or ``None``."""
    state = module.__dict__.get(_STATE_ATTR)
    return None if state is None else state.driver


def hf_offloads_checkpoints(layer: nn.Module) -> bool:
    """Whether Hugging Face activation checkpointing with ``offload=True`` is on for ``layer``
    (``activation_checkpointing_enable(offload=True)``, or the deprecated
    ``gradient_checkpointing_enable(offload=True)``): its checkpoint function runs inside
    ``torch.autograd.graph.save_on_cpu``, which takes the checkpoint's saved inputs before any
    outer saved-tensor hooks (ours) see them."""
    if not getattr(layer, "gradient_checkpointing", False):
        return False
    func = getattr(layer, "_gradient_checkpointing_func", None)
    inner = getattr(func, "func", func)  # functools.partial(checkpoint_func, **kwargs)
    code = getattr(inner, "__code__", None)
    return code is not None and "save_on_cpu" in code.co_names


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


def first_tensor(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The hidden-state input of a layer call: its first tensor argument (positional first)."""
    for v in (*args, kwargs.get("hidden_states"), *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


def base_class(layer: nn.Module) -> type:
    """The layer's own class, also while it is instrumented (its class swapped)."""
    return _bases.get(type(layer), type(layer))
