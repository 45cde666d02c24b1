"""``state_dict`` conversion between the hybrid optimizer and the optimizers it wraps.

The hybrid format is torch's own optimizer format, each master weight inside its parameter's
state, plus one key::

    {"state": {index: {..., "master_weight": tensor}},  # indexed like torch.optim.Optimizer;
                                                        # a master of another dtype (fp32)
     "param_groups": [{..., "params": [indices]}],
     "hybrid": {"format": FORMAT, "offloaded": [bool per index], "stream_fraction": float}}

Masters live in the per-parameter state so that checkpoint tools that keep only ``state`` and
``param_groups`` (``torch.distributed.checkpoint``'s ``get_optimizer_state_dict``) keep them too:
a resumed run continues from the same fp32 masters, not from the rounded parameters.

Indices follow the wrapper's param groups, so a checkpoint does not depend on which parameters
were offloaded: it loads into a hybrid optimizer with another ``offload_fraction``.
``to_wrapped_format`` drops the ``hybrid`` key, giving exactly what the wrapped optimizer class
run over the same parameter groups would have saved (state tensors stay where they were: CPU for
offloaded parameters; the wrapped class's ``load_state_dict`` casts them to its parameters'
device and dtype). The reverse direction needs no conversion: ``load_state_dict`` accepts the
wrapped optimizer's own state dict and starts master weights from the current parameters.
"""
from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..compat import optimizer_hooks
from ..core.errors import OffloadUsageError, stacklevel_outside_package
from .cpu_update import IMPLEMENTATION_KEYS, STATE_WRITE_FIX, StateEntry

FORMAT = "cpu_offload.optim.HybridDeviceOptimizer/2"
FORMATS = (FORMAT, "cpu_offload.optim.HybridDeviceOptimizer/1")  # /1: masters under "hybrid"
MASTER = "master_weight"


@dataclass
class Placement:
    """Where one wrapper parameter's optimizer state lives."""

    param: torch.Tensor  # the model parameter
    optimizer: Any  # the sub-optimizer updating it (a torch optimizer, or a CpuBucket: same API)
    key: torch.Tensor  # the tensor that optimizer updates (the param, or its master)
    offloaded: bool

    @property
    def master(self) -> Optional[torch.Tensor]:
        """The separate copy the sub-optimizer updates (host copy, fp32 master), if any."""
        return None if self.key is self.param else self.key

    @property
    def saved_master(self) -> Optional[torch.Tensor]:
        """The master ``state_dict()`` saves (``"master_weight"``): one of another dtype than
        the parameter (fp32 for bf16/fp16), whose extra precision the parameter lacks. A copy
        in the parameter's own dtype equals it and is not saved, so that which parameters a
        rank offloads (its own shards, under FSDP2) or a checkpoint's placement does not change
        the keys: DCP's planners need the same keys on every rank and in every checkpoint."""
        m = self.master
        return m if m is not None and m.dtype != self.param.dtype else None


def hyperparameters(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def gather(param_groups: Sequence[dict], placements: Sequence[Placement],
           implementation: Optional[dict] = None, keeps_state: bool = False) -> dict[str, Any]:
    """The hybrid state dict of a wrapper whose parameters (in group order) sit at ``placements``.

    ``implementation``: the wrapped class's implementation entries (``fused``, ``foreach``,
    ``capturable``, ``differentiable``), added to every group as that class saves them (the
    wrapper's own groups leave them out: each part keeps the implementation it was built with).
    ``keeps_state``: the class keeps state for every parameter it steps (``classes.keeps_state``),
    so a parameter without state gets no entry at all, as in torch's state dict: its master
    equals it (not stepped yet), and torch's Adam-like classes refuse an entry without ``"step"``.
    """
    state: dict[int, dict] = {}
    for i, pl in enumerate(placements):
        s = pl.optimizer.state.get(pl.key) if pl.optimizer is not None else None
        if s:
            state[i] = dict(s)
        if pl.saved_master is not None and (s or not keeps_state):
            state.setdefault(i, {})[MASTER] = pl.saved_master
    groups, start = [], 0
    for g in param_groups:
        groups.append({**(implementation or {}), **hyperparameters(g),
                       "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {
        "state": state,
        "param_groups": groups,
        "hybrid": {"format": FORMAT, "offloaded": [pl.offloaded for pl in placements]},
    }


def to_wrapped_format(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Convert a ``HybridDeviceOptimizer.state_dict()`` to the wrapped optimizer's own format.

    Use it to load a checkpoint into the optimizer class the hybrid optimizer wraps (e.g. plain
    ``torch.optim.AdamW`` when training without offloading). Indices follow the hybrid
    optimizer's param groups, so the result loads into that class built over the same groups.
    The reverse needs no conversion: ``HybridDeviceOptimizer.load_state_dict`` accepts the
    wrapped class's state dict.

    Args:
        state_dict: what ``HybridDeviceOptimizer.state_dict()`` returned.

    Returns:
        ``{"state": ..., "param_groups": ...}`` without the ``"hybrid"`` entry and the master
        weights; state tensors stay where they were (CPU for offloaded parameters). Groups keep
        every entry, the implementation choices (``fused``, ``foreach``, ``capturable``,
        ``differentiable``) included, so ``AdamW(fused=True)`` resumes fused, as from its own
        state dict.

    Example::

        >>> import torch, cpu_offload
        >>> from cpu_offload.optim import HybridDeviceOptimizer, to_wrapped_format
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3,
        ...                             device=cpu_offload.SimulatedDevice())
        >>> model(torch.randn(2, 4)).sum().backward()
        >>> opt.step(); opt.close()
        >>> plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> plain.load_state_dict(to_wrapped_format(opt.state_dict()))
        >>> sorted(plain.state[model.weight])
        ['exp_avg', 'exp_avg_sq', 'step']
        >>> plain.param_groups[0]["fused"]  # the hybrid optimizer's default class: fused AdamW
        True
    """
    state = {}
    for i, entry in state_dict["state"].items():
        entry = {k: v for k, v in entry.items() if k != MASTER}
        if entry:
            state[i] = entry
    return {"state": state, "param_groups": state_dict["param_groups"]}


def check_compatible(param_groups: Sequence[dict], state_dict: dict[str, Any]) -> None:
    saved = state_dict.get("param_groups")
    if saved is None or "state" not in state_dict:
        raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
    if len(saved) != len(param_groups):
        raise ValueError(
            f"state dict has {len(saved)} param groups, this optimizer {len(param_groups)}"
        )
    for i, (s, g) in enumerate(zip(saved, param_groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"param group {i}: state dict has {len(s['params'])} parameters, this optimizer "
                f"{len(g['params'])}"
            )
    hybrid = state_dict.get("hybrid")
    if hybrid is not None and hybrid.get("format") not in FORMATS:
        raise ValueError(f"unknown hybrid state format {hybrid.get('format')!r}, expected {FORMAT!r}")


# Per-parameter state that torch's own optimizers keep in their parameter's shape (Adam, AdamW,
# SGD, Adagrad, RMSprop, Adadelta, ASGD, Rprop, Adamax), and the masters. Other classes' state
# may have other shapes (factored statistics, say): not checked.
PARAM_SHAPED = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum",
                          "square_avg", "grad_avg", "acc_delta", "ax", "prev", "step_size",
                          "exp_inf", MASTER})


def check_state_shapes(saved_ids: Sequence[Any], saved_state: dict, masters: dict,
                       placements: Sequence[Placement]) -> None:
    """Refuse, before anything is loaded, a state tensor or master shaped unlike its parameter
    (a state dict from another model, or one edited by hand). torch's optimizers load it
    unchecked and fail or write out of bounds at the next step; here the parts copy state into
    buffers of their own, so a wrong shape would be half taken. ``saved_ids``, ``saved_state``
    (without masters) and ``masters`` are ``scatter``'s reading of the state dict."""
    for pos, (sid, pl) in enumerate(zip(saved_ids, placements)):
        entry = dict(saved_state.get(sid) or {})
        if sid in masters:
            entry[MASTER] = masters[sid]
        for name, value in entry.items():
            if name in PARAM_SHAPED and torch.is_tensor(value) and value.shape != pl.key.shape:
                raise ValueError(
                    f"state dict entry {sid!r} (parameter {pos}): {name!r} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(pl.key.shape)}: load a state dict "
                    "saved with this model's parameters, in the same order")


def carried_masters(saved_ids: Sequence[Any], masters: dict,
                    placements: Sequence[Placement]) -> list[int]:
    """Positions whose saved master has its parameter's own dtype (bf16/fp16) where this
    optimizer keeps a wider master. ``state_dict()`` never saves such a master (a copy in the
    parameter's dtype equals the parameter): it is what an optimizer that keeps no masters makes
    of ours when it loads our state dict (torch's ``load_state_dict`` casts state to the
    parameter's dtype) and then carries along without updating it. After that optimizer has
    trained, the master is older than the parameter, and loading it would take the parameter
    back to it."""
    return [pos for pos, (sid, pl) in enumerate(zip(saved_ids, placements))
            if pl.master is not None and torch.is_tensor(masters.get(sid))
            and masters[sid].dtype == pl.param.dtype != pl.master.dtype]


def scatter(
    state_dict: dict[str, Any],
    param_groups: list[dict],
    placements: Sequence[Placement],
    sub_groups: dict[int, list[int]],
) -> None:
    """Load ``state_dict`` (hybrid or wrapped format) into the sub-optimizers and masters.

    ``sub_groups[id(optimizer)]`` lists, per group of that sub-optimizer, the wrapper group it
    belongs to. Each sub-optimizer loads through its own ``load_state_dict``, so state is cast
    to its parameters' device and dtype exactly as the wrapped class does.
    """
    check_compatible(param_groups, state_dict)
    saved_groups = state_dict["param_groups"]
    saved_ids = [i for g in saved_groups for i in g["params"]]
    saved_state = {i: {k: v for k, v in e.items() if k != MASTER} for i, e in state_dict["state"].items()}
    masters = dict((state_dict.get("hybrid") or {}).get("master_weights", {}))
    masters.update((i, e[MASTER]) for i, e in state_dict["state"].items() if MASTER in e)
    check_state_shapes(saved_ids, saved_state, masters, placements)  # before anything is loaded
    carried = carried_masters(saved_ids, masters, placements)
    if carried:
        pl = placements[carried[0]]
        warnings.warn(
            f"HybridDeviceOptimizer.load_state_dict: {len(carried)} master weight(s) have their "
            f"parameters' dtype ({pl.param.dtype}), not {pl.master.dtype}: this state dict went "
            "through an optimizer that keeps no masters (torch's load_state_dict casts them to "
            "the parameter's dtype, and that optimizer never updates them), so they may be older "
            "than the parameters. The masters start from the parameters instead, as "
            "reload_master_weights() does. To leave them out, load to_wrapped_format(state_dict) "
            "into other optimizers.", UserWarning, stacklevel=stacklevel_outside_package())
        for pos in carried:
            del masters[saved_ids[pos]]
    for g, s in zip(param_groups, saved_groups):
        g.update({k: v for k, v in s.items() if k != "params" and k not in IMPLEMENTATION_KEYS})
    by_optimizer: dict[int, tuple[torch.optim.Optimizer, dict[int, int]]] = {}
    for pos, pl in enumerate(placements):
        if pl.master is not None:
            m = masters.get(saved_ids[pos])
            with torch.no_grad():
                pl.master.copy_(m if m is not None else pl.param.detach())
        if pl.optimizer is not None:
            by_optimizer.setdefault(id(pl.optimizer), (pl.optimizer, {}))[1][id(pl.key)] = pos
    for opt, positions in by_optimizer.values():
        state, groups, local = {}, [], 0
        for group, gi in zip(opt.param_groups, sub_groups[id(opt)]):
            ids = []
            for key in group["params"]:
                entry = saved_state.get(saved_ids[positions[id(key)]])
                if entry:
                    state[local] = entry
                ids.append(local)
                local += 1
            hp = {k: v for k, v in hyperparameters(saved_groups[gi]).items() if k not in IMPLEMENTATION_KEYS}
            groups.append({**hyperparameters(group), **hp, "params": ids})
        opt.load_state_dict({"state": state, "param_groups": groups})


def saved_with_hooks(opt: torch.optim.Optimizer, gather: Callable[[], dict]) -> dict:
    """``gather()`` between the optimizer's ``register_state_dict_pre_hook`` hooks and its
    ``register_state_dict_post_hook`` hooks (a post hook may return a new dict), as
    ``torch.optim.Optimizer.state_dict`` runs them."""
    for pre_hook in optimizer_hooks(opt, "state_dict_pre"):
        pre_hook(opt)
    state_dict = gather()
    for post_hook in optimizer_hooks(opt, "state_dict_post"):
        result = post_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    return state_dict


def loaded_with_hooks(opt: torch.optim.Optimizer, state_dict: dict,
                      load: Callable[[dict], None]) -> None:
    """``load`` of a shallow copy of ``state_dict`` that the optimizer's
    ``register_load_state_dict_pre_hook`` hooks may edit or replace, then its post hooks, as
    ``torch.optim.Optimizer.load_state_dict`` runs them."""
    state_dict = state_dict.copy()
    for pre_hook in optimizer_hooks(opt, "load_state_dict_pre"):
        result = pre_hook(opt, state_dict)
        state_dict = state_dict if result is None else result
    load(state_dict)
    for post_hook in optimizer_hooks(opt, "load_state_dict_post"):
        post_hook(opt)


class _NoStateYet(StateEntry):
    """``opt.state[p]`` before ``p``'s first step: empty, as torch's, and read-only."""

    why = ("this parameter has no optimizer state before its first step() (a key set here would "
           "not reach the parts)")


class StateView(Mapping):
    """``opt.state``: each stepped parameter -> its state, live (the parts' own tensors), as a
    torch optimizer's ``state`` maps them. Read-only as a mapping: the parts keep the state (in
    host memory, in chunks), so entries added or removed here would be silently ignored;
    ``del``, ``clear`` and the like raise instead, naming what works."""

    def __init__(self, owner: "weakref.ref[Any]") -> None:
        self._owner = owner  # the optimizer, weakly: no cycle through its own attribute

    def _of(self, p: Any) -> Optional[dict]:
        opt = self._owner()
        return opt.state_of(p) if opt is not None and isinstance(p, torch.Tensor) else None

    def __getitem__(self, p: torch.Tensor) -> dict:
        """``p``'s state; a tensor without any (not stepped yet) gets an empty entry, as from
        torch's ``defaultdict`` (read-only here: it would not reach the parts)."""
        if not isinstance(p, torch.Tensor) or self._owner() is None:
            raise KeyError(p)
        return self._of(p) or _NoStateYet()

    def __contains__(self, p: Any) -> bool:
        return bool(self._of(p))

    def get(self, p: Any, default: Any = None) -> Any:
        return self._of(p) or default

    def __iter__(self) -> Iterator[torch.Tensor]:
        opt = self._owner()
        params = [] if opt is None else [p for g in opt.param_groups for p in g["params"]]
        return (p for p in params if opt.state_of(p))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def _refuse(self, *_: Any, **__: Any) -> None:
        raise OffloadUsageError(f"opt.state of a HybridDeviceOptimizer is a view of the state its "
                                f"parts keep; entries cannot be set or removed: {STATE_WRITE_FIX}")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _refuse

    def __deepcopy__(self, memo: dict) -> dict:
        """A snapshot (torch's ``deepcopy(opt.state)`` is one), not another live view."""
        return copy.deepcopy(dict(self.items()), memo)

