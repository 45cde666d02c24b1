"""When the CPU part of ``HybridDeviceOptimizer`` runs: one policy object per ``overlap=`` mode.

Each mode answers the three questions the optimizer asks, so adding a mode is one entry in
``MODES`` (and its line in ``HybridDeviceOptimizer``'s docstring):

- ``copies_in_backward``: are offloaded gradients copied to the host as backward finalizes them
  (post-accumulate-grad hooks), or all at once inside ``step()``?
- ``updates_in_backward``: does a bucket's CPU update start as soon as its gradients have
  landed, during backward? (A gradient changed before ``step()``, by ``clip_grad_norm_`` or a
  second backward, makes ``step()`` undo and redo that bucket's update.)
- ``forward_waits``: does ``step()`` return before the CPU part is done, leaving each module's
  next forward to wait for its own parameters (``register_forward_waits``)?

The numbers are identical in every mode; only what overlaps what changes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import OffloadConfigError

__all__ = ["MODES", "OVERLAP_MODES", "OverlapMode", "overlap_mode"]


@dataclass(frozen=True)
class OverlapMode:
    """What one ``overlap=`` value decides (see the module docstring)."""

    name: str
    copies_in_backward: bool
    updates_in_backward: bool
    forward_waits: bool


MODES = {
    mode.name: mode
    for mode in (
        # Megatron's behaviour: copies, update and copies back all inside step().
        OverlapMode("none", copies_in_backward=False, updates_in_backward=False,
                    forward_waits=False),
        OverlapMode("backward_copies", copies_in_backward=True, updates_in_backward=False,
                    forward_waits=False),
        OverlapMode("backward_update", copies_in_backward=True, updates_in_backward=True,
                    forward_waits=False),
        OverlapMode("next_forward", copies_in_backward=True, updates_in_backward=True,
                    forward_waits=True),
    )
}
OVERLAP_MODES = tuple(MODES)


def overlap_mode(overlap: Any, overlap_cpu_optimizer_d2h_h2d: bool = True) -> OverlapMode:
    """The mode ``overlap`` names; ``None`` takes Megatron's switch instead (``True``:
    ``"backward_update"``, ``False``: ``"none"``).

    Raises:
        OffloadConfigError: an unknown mode.

    Example::

        >>> overlap_mode(None, overlap_cpu_optimizer_d2h_h2d=False).name
        'none'
        >>> overlap_mode("next_forward").forward_waits
        True
    """
    if overlap is None:
        overlap = "backward_update" if overlap_cpu_optimizer_d2h_h2d else "none"
    if overlap not in OVERLAP_MODES:
        raise OffloadConfigError(f"overlap={overlap!r} is not one of {OVERLAP_MODES}")
    return MODES[overlap]
