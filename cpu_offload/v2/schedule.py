"""Pure scheduling logic of V2: which layers are offloaded, when each is released, when reloaded.

No tensors, no streams: positions are counted in "layer starts" of one training step. Forward
start of layer ``j`` is position ``j + 1``; the ``c``-th backward start (layer ``n - c``) is
position ``n + c``. A ``synchronization_dict`` entry ``i -> (offload_fwd, offload_num, reload_fwd,
reload_num)`` says: layer ``i`` finishes offloading (and its GPU memory is released) when
``offload_num`` layers have begun their forward (``offload_fwd``) or backward pass, and its reload
starts when ``reload_num`` layers have begun their forward (``reload_fwd``) or backward pass.

One extension of that format: ``offload_fwd=True, offload_num=model_layers + 1`` ("one layer more
than the forward pass runs") releases the layer when the forward pass is over, after the last
layer's forward and before whatever follows it (the loss, often the step's peak). Only this lets
the last layer be away from the device at all; ``plan_synchronization_dict`` uses it for a
checkpointed last layer, whose input then spends the loss on the host.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from ..core.checks import check_int, is_count
from ..core.errors import OffloadConfigError

SyncEntry = tuple  # (offload_fwd: bool, offload_num: int, reload_fwd: bool, reload_num: int)


def position(fwd: bool, num: int, model_layers: int) -> int:
    """Position of "``num`` layers have begun their forward/backward"."""
    return num if fwd else model_layers + num


def default_synchronization_dict(num_layers: int, model_layers: int) -> dict[int, SyncEntry]:
    """The default schedule: offload the first ``k`` of ``n`` layers; layer ``i`` is released
    before the forward of layer ``n-k+i`` and reloaded after the backward of layer ``n-k+i``."""
    n, k = model_layers, num_layers
    return {i: (True, n - k + i + 1, False, k - i + 1) for i in range(k)}


def spread_synchronization_dict(layers: Sequence[int], model_layers: int) -> dict[int, SyncEntry]:
    """The default schedule's timing for any set of offloaded layers, not only the first ``k``:
    the ``j``-th of the ``k`` offloaded layers is released before the forward of layer
    ``n-k+j`` and reloaded after that layer's backward. A plan spreads its offloaded layers
    (``1, 3, 5`` instead of ``0, 1, 2``) where offloading one costs the host more than the GPU
    spends on the layer: plain layers in between let the host get ahead again.

    Args:
        layers: the offloaded layers, in increasing order; the ``j``-th must be at most
            ``n-k+j-1`` (its release comes after its own forward).
        model_layers: the layers of one forward pass.

    Example::

        >>> spread_synchronization_dict([0, 1], 4) == default_synchronization_dict(2, 4)
        True
        >>> spread_synchronization_dict([1, 3], 6)
        {1: (True, 5, False, 3), 3: (True, 6, False, 2)}
    """
    n, k = model_layers, len(layers)
    if list(layers) != sorted(set(layers)):
        raise OffloadConfigError(
            f"offloaded layers must be distinct and in increasing order, got {list(layers)}"
        )
    return validate_synchronization_dict(
        {layer: (True, n - k + j + 1, False, k - j + 1) for j, layer in enumerate(layers)}, n
    )


def plan_synchronization_dict(num_layers: int, model_layers: int) -> dict[int, SyncEntry]:
    """The schedule of a plan: the default one, except that ``num_layers == model_layers``
    (every layer, the last one checkpointed, so that only its input moves) offloads the last
    layer too, released when the forward pass ends and reloaded when its backward starts.

    Args:
        num_layers: how many of the first layers are offloaded (``model_layers`` at most).
        model_layers: the layers of one forward pass.

    Example::

        >>> plan_synchronization_dict(1, 3) == default_synchronization_dict(1, 3)
        True
        >>> plan_synchronization_dict(3, 3)[2]   # released at the forward's end (3 + 1)
        (True, 4, False, 1)
    """
    n, k = model_layers, num_layers
    if k < n:
        return default_synchronization_dict(k, n)
    sync = default_synchronization_dict(n - 1, n)
    sync[n - 1] = (True, forward_end(n), False, 1)
    return sync


def forward_end(model_layers: int) -> int:
    """``offload_num`` (with ``offload_fwd=True``) of "released when the forward pass ends".

    Args:
        model_layers: the layers of one forward pass.

    Example::

        >>> forward_end(16)
        17
    """
    return model_layers + 1


def validate_synchronization_dict(
    sync: Mapping[int, SyncEntry], model_layers: int
) -> dict[int, SyncEntry]:
    """Check every entry can be executed in a forward-then-backward step; return a clean copy."""
    if not isinstance(sync, Mapping):
        raise OffloadConfigError(
            f"synchronization_dict must be a dict {{layer_id: (offload_fwd, offload_num, "
            f"reload_fwd, reload_num)}}, got {type(sync).__name__}"
        )
    n = model_layers
    clean: dict[int, SyncEntry] = {}
    for layer, entry in sync.items():
        where = f"synchronization_dict[{layer!r}]"
        if not is_count(layer) or not 0 <= layer < n:
            raise OffloadConfigError(
                f"{where}: layer ids must be ints in [0, model_layers={n}); fix the key"
            )
        layer = int(layer)
        if not isinstance(entry, (tuple, list)) or len(entry) != 4:
            raise OffloadConfigError(
                f"{where} = {entry!r}: expected a 4-tuple "
                "(offload_fwd: bool, offload_num: int, reload_fwd: bool, reload_num: int)"
            )
        off_fwd, off_num, rel_fwd, rel_num = entry
        for name, v in (("offload_fwd", off_fwd), ("reload_fwd", rel_fwd)):
            if not isinstance(v, bool):
                raise OffloadConfigError(f"{where}: {name} must be a bool, got {v!r}")
        for name, v in (("offload_num", off_num), ("reload_num", rel_num)):
            top = n + 1 if name == "offload_num" and off_fwd else n  # n + 1: the forward's end
            if not is_count(v) or not 1 <= v <= top:
                if name == "offload_num":
                    hint = f"offload_fwd=True, offload_num={n + 1}: released when the forward ends"
                else:
                    hint = (
                        "the reload starts when reload_num layers have begun their forward "
                        f"(reload_fwd=True) or backward (reload_fwd=False); layer {layer}'s "
                        f"reload must start by its own backward: reload_fwd=False, reload_num "
                        f"<= {n - layer}"
                    )
                raise OffloadConfigError(
                    f"{where}: {name} must be an int in [1, model_layers={n}], got {v!r} "
                    f"({hint})"
                )
        off_pos, rel_pos = position(off_fwd, off_num, n), position(rel_fwd, rel_num, n)
        own_fwd_end, own_bwd_start = layer + 2, position(False, n - layer, n)
        if off_pos < own_fwd_end:
            raise OffloadConfigError(
                f"{where}: offload of layer {layer} would have to finish before its own forward "
                f"ends; use offload_num >= {layer + 2} with offload_fwd=True, or offload_fwd=False"
            )
        if rel_pos < off_pos:
            raise OffloadConfigError(
                f"{where}: reload would start before the offload finishes; move reload_num later"
            )
        if rel_pos > own_bwd_start:
            raise OffloadConfigError(
                f"{where}: reload would start after layer {layer}'s backward began; use "
                f"reload_fwd=False and reload_num <= {n - layer}"
            )
        clean[layer] = (off_fwd, int(off_num), rel_fwd, int(rel_num))
    return clean


@dataclass(frozen=True)
class Schedule:
    """Actions per position, derived once from a validated synchronization dict; and
    ``copies_wait``, the layers for which ``copies_can_wait`` holds."""

    model_layers: int
    sync: Mapping[int, SyncEntry]

    def __post_init__(self) -> None:
        releases: dict[int, list[int]] = defaultdict(list)
        reloads: dict[int, list[int]] = defaultdict(list)
        at_end = []
        for layer in sorted(self.sync):
            release, reload = self.window(layer)
            if self.released_at_forward_end(layer):
                at_end.append(layer)
            else:
                releases[release].append(layer)
            reloads[reload].append(layer)
        object.__setattr__(self, "_releases", dict(releases))
        object.__setattr__(self, "_reloads", dict(reloads))
        object.__setattr__(self, "_at_forward_end", at_end)
        actions: list = [None] * (2 * self.model_layers + 2)
        for pos in set(releases) | set(reloads):
            actions[pos] = (releases.get(pos, []), reloads.get(pos, []))
        object.__setattr__(self, "_actions", actions)
        # ``copies_can_wait``, for every layer at once (looked up per layer without a call)
        object.__setattr__(self, "copies_wait", frozenset(
            layer for layer in self.sync if self.copies_can_wait(layer)))

    @classmethod
    def default(cls, num_layers: int, model_layers: int) -> "Schedule":
        return cls(model_layers, default_synchronization_dict(num_layers, model_layers))

    def is_offloaded(self, layer: int) -> bool:
        return layer in self.sync

    def at(self, pos: int) -> tuple:
        """``(releases_at(pos), reloads_at(pos))``: what the synchronizer does at a position."""
        return self._releases.get(pos, ()), self._reloads.get(pos, ())  # type: ignore[attr-defined]

    def actions(self) -> list:
        """``at(pos)`` for every position ``0 .. 2 * model_layers + 1``, as a list (``None`` where
        nothing happens): looked up per layer without a call."""
        return self._actions  # type: ignore[attr-defined]

    def releases_at(self, pos: int) -> list[int]:
        return self._releases.get(pos, [])  # type: ignore[attr-defined]

    def released_at_forward_end(self, layer: int) -> bool:
        """Whether ``layer`` is released when the forward pass ends (between the position of the
        last forward start and the first backward start, so between two positions)."""
        off_fwd, off_num, _, _ = self.sync[layer]
        return off_fwd and off_num == forward_end(self.model_layers)

    def releases_at_forward_end(self) -> list[int]:
        return self._at_forward_end  # type: ignore[attr-defined]

    def reloads_at(self, pos: int) -> list[int]:
        return self._reloads.get(pos, [])  # type: ignore[attr-defined]

    def window(self, layer: int) -> tuple[int, int]:
        """``(release, reload)`` positions of an offloaded layer: its memory is off the device
        from the first (inclusive) to the second (exclusive). A layer released when the forward
        ends (``released_at_forward_end``) is also away before the first: between the last
        forward start and the first backward start (``forward_end`` is the first backward
        start's position)."""
        off_fwd, off_num, rel_fwd, rel_num = self.sync[layer]
        n = self.model_layers
        return position(off_fwd, off_num, n), position(rel_fwd, rel_num, n)

    def copies_can_wait(self, layer: int) -> bool:
        """Whether a whole other layer's forward runs between the end of ``layer``'s forward and
        its release. Only then may the copies of its large storages wait for a busy link (until
        its next batch or its end, at the latest): the copies still have that layer's time to
        finish before the release waits for them. A layer released at the next layer's start
        has none, and its copies are queued as they are saved.

        Args:
            layer: an offloaded layer of this schedule.

        Example::

            >>> Schedule.default(2, 8).copies_can_wait(0)   # released before layer 6's forward
            True
            >>> Schedule.default(7, 8).copies_can_wait(0)   # released before layer 1's forward
            False
        """
        return self.window(layer)[0] >= layer + 3  # forward of layer j starts at position j + 1

    def away(self, layer: int, pos: int) -> bool:
        """Whether ``layer``'s offloaded memory is off the device at position ``pos``."""
        if layer not in self.sync:
            return False
        release, reload = self.window(layer)
        return release <= pos < reload

    def resident_profile(self) -> list[int]:
        """Layers whose activations are on the device while each position's layer runs.

        Layer ``j`` holds memory from its forward start to the start of the backward after its
        own; an offloaded layer is absent between its release and its reload.
        """
        n = self.model_layers
        out = []
        for pos in range(1, 2 * n + 1):
            count = 0
            for j in range(n):
                start, end = j + 1, position(False, n - j, n) + 1
                if start <= pos < end and not self.away(j, pos):
                    count += 1
            out.append(count)
        return out


def check_default_arguments(num_layers: Optional[int], model_layers: int) -> list[str]:
    """Validate ``num_layers``/``model_layers`` for the default schedule; return warnings."""
    check_int("model_layers", model_layers, minimum=1, meaning="the total number of layers")
    check_int("num_layers", num_layers, minimum=0, meaning="the number of layers to offload")
    if num_layers >= model_layers == 1:  # type: ignore[operator]
        # model_layers left at its default: the count of the layers is what is missing.
        raise OffloadConfigError(
            f"num_layers={num_layers} must be smaller than model_layers=1: model_layers is the "
            "number of layers (`with ctx:` blocks) in one forward pass and defaults to 1; pass "
            "model_layers=len(layers)"
        )
    if num_layers >= model_layers:  # type: ignore[operator]
        raise OffloadConfigError(
            f"num_layers={num_layers} must be smaller than model_layers={model_layers}: at least "
            f"one layer's activations stay on the GPU; use num_layers <= {model_layers - 2} "
            "for full overlap"
        )
    if model_layers > 1 and num_layers == model_layers - 1:
        return [
            f"num_layers=model_layers-1={num_layers} leaves one activation set on the GPU, so "
            "compute and transfers cannot overlap; use num_layers <= model_layers-2 for overlap"
        ]
    return []
