"""torch's optimizer-state format for a part updated by one optimizer per chunk (a CPU bucket,
the streamed part): its ``param_groups``, ``state`` and ``load_state_dict`` as one optimizer
over the part's keys would have them, built from (and loaded into) the chunks' optimizers."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..core.errors import OffloadUsageError


def chunk_param_groups(pieces: Sequence[Any], group_of: Sequence[int],
                       hypers: Sequence[dict]) -> tuple[list[int], list[dict]]:
    """The groups a chunk's optimizer is built with: the ids of the part's groups its
    ``pieces`` belong to (in order of first appearance), and per group its hyperparameters
    (``hypers[id]``) with the pieces' keys as ``params``."""
    gids = list(dict.fromkeys(group_of[pc.index] for pc in pieces))
    groups = []
    for gi in gids:
        group = {k: v for k, v in hypers[gi].items() if k != "params"}
        group["params"] = [pc.key for pc in pieces if group_of[pc.index] == gi]
        groups.append(group)
    return gids, groups


def part_param_groups(chunks: Sequence[Any], group_ids: Sequence[int], group_of: Sequence[int],
                      keys: Sequence[torch.Tensor]) -> list[dict]:
    """torch's ``param_groups`` of a part whose parameters ``keys`` (``keys[i]`` in group
    ``group_of[i]``) are updated by one optimizer per chunk (a ``CpuBucket``, a streamed part):
    each group's hyperparameters from a chunk optimizer that has it (they all hold the same
    ones), its ``params`` the part's keys in that group."""
    out = []
    for gi in group_ids:
        g = next(g for c in chunks for g, cg in zip(c.optimizer.param_groups, c.group_ids)
                 if cg == gi)
        out.append({**{k: v for k, v in g.items() if k != "params"},
                    "params": [k for k, og in zip(keys, group_of) if og == gi]})
    return out


def chunk_state_dicts(
    chunks: Sequence[Any], group_ids: Sequence[int], group_of: Sequence[int],
    state_dict: dict[str, Any], shapes: Sequence[torch.Size],
) -> Iterator[tuple[Any, dict]]:
    """``(chunk, its state dict)`` for loading torch's format (as ``part_param_groups`` groups
    the part) into each chunk's optimizer: the saved hyperparameters of the chunk's groups, and
    the entries of its pieces; a piece of a split parameter (``shapes[i]``: the whole
    parameter's shape) gets the elements it updates of every per-element state tensor, and a
    copy of the other tensors."""
    local = {i: pos for pos, i in enumerate(
        i for gi in group_ids for i, og in enumerate(group_of) if og == gi)}
    saved_groups = dict(zip(group_ids, state_dict["param_groups"]))
    for c in chunks:
        state, groups, n = {}, [], 0
        for group, gi in zip(c.optimizer.param_groups, c.group_ids):
            ids = []
            for key in group["params"]:
                pc = next(pc for pc in c.pieces if pc.key is key)
                entry = state_dict["state"].get(local[pc.index])
                if entry is not None:
                    state[n] = _slice(entry, pc, shapes[pc.index]) if pc.split else entry
                ids.append(n)
                n += 1
            groups.append({**{k: v for k, v in saved_groups[gi].items() if k != "params"},
                           "params": ids})
        yield c, {"state": state, "param_groups": groups}


def _slice(entry: dict, pc: Any, shape: torch.Size) -> dict:
    return {k: (v.reshape(-1)[pc.start:pc.stop] if v.shape == shape else v.clone())
            if torch.is_tensor(v) else v for k, v in entry.items()}


STATE_WRITE_FIX = ("change its tensors in place (opt.state[p]['exp_avg'].zero_()), or load a "
                   "state dict (opt.load_state_dict(sd)); to start afresh, build a new "
                   "HybridDeviceOptimizer")


class StateEntry(dict):
    """One parameter's state assembled for ``opt.state[p]`` (a streamed parameter, or one split
    over CPU chunks): a copy of the mapping over the live tensors, so that setting or removing
    a key would change nothing; those raise instead."""

    why = "this parameter's state is kept in pieces (streamed, or split over CPU chunks)"

    def _refuse(self, *_: Any, **__: Any) -> None:
        raise OffloadUsageError(f"{self.why}: a key cannot be set or removed here; {STATE_WRITE_FIX}")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self) -> tuple:  # pickled, deep-copied: a plain dict of the same items
        return dict, (dict(self),)


class KeyedState(Mapping):
    """``optimizer.state`` of a part that keeps its state itself (a ``CpuBucket``, a streamed
    part): ``state[key]`` is the per-parameter state of ``keys()[i]``, built on demand by
    ``state_of(i)``; only keys with state are listed. Bound methods are held weakly, so the
    part's own ``state`` attribute makes no reference cycle (a dropped part frees its memory
    at once, without the cycle collector)."""

    def __init__(self, keys: Callable[[], Sequence[torch.Tensor]],
                 state_of: Callable[[int], Optional[dict]]) -> None:
        self._keys, self._state_of = _weak(keys), _weak(state_of)

    def __getitem__(self, key: torch.Tensor) -> dict[str, Any]:
        i = next((i for i, k in enumerate(self._keys()()) if k is key), None)
        st = self._state_of()(i) if i is not None else None
        if not st:
            raise KeyError(key)
        return st

    def __iter__(self) -> Iterator[torch.Tensor]:
        state_of = self._state_of()
        return (k for i, k in enumerate(self._keys()()) if state_of(i))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _weak(fn: Callable) -> Callable[[], Callable]:
    """A getter of ``fn``: weak for bound methods (``weakref.WeakMethod``), strong otherwise."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        return weakref.WeakMethod(fn)
    return lambda: fn
