"""The CPU part's record of one optimizer step: a named phase per bucket, checked at every
transition, and one record type per kind of work in flight.

A bucket's life in one step (``CpuPart`` drives it; ``step()`` validates it)::

    IDLE -> COPYING -> LANDED -> QUEUED -> RUNNING -> SENT -> FENCED
                                              |          ^
                                              +-> UPDATED (early: restorable, not sent)
                                              +-> FAILED (its error is raised by the wait)

- ``COPYING``: some of its gradients are queued for the host (``GradCopy`` each);
- ``LANDED``: all of them are queued; ``landed`` is the event after the last copy;
- ``QUEUED`` / ``RUNNING``: its ``UpdateJob`` waits for, or runs on, the CPU worker;
- ``UPDATED``: an *early* update (started before ``step()`` validated the bucket) finished; it
  keeps what it changed so that ``step()`` can still undo it, and its parameters stay on the host;
- ``SENT``: committed; the new parameters are queued to the device (``sent`` event);
- ``FENCED``: the compute stream waits for them.

``step()`` finds a bucket stale when a gradient it copied changed since (``guards``), a parameter
was edited since the optimizer wrote it, or an early update used other hyperparameters or no
loss scale. A stale bucket goes back to ``IDLE`` (a running update is awaited and undone first)
and is copied and updated again from the values as they are now.
"""
from __future__ import annotations

import enum
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..core.device import Event
from .amp import LossScale
from .guards import Fingerprint

__all__ = ["BucketStep", "CpuStep", "GradCopy", "Phase", "UpdateJob"]


class Phase(enum.Enum):
    IDLE = "idle"
    COPYING = "copying"
    LANDED = "landed"
    QUEUED = "queued"
    RUNNING = "running"
    UPDATED = "updated"
    SENT = "sent"
    FENCED = "fenced"
    FAILED = "failed"


_NEXT = {
    Phase.IDLE: {Phase.COPYING, Phase.LANDED},
    Phase.COPYING: {Phase.LANDED, Phase.IDLE},
    Phase.LANDED: {Phase.QUEUED, Phase.IDLE},
    Phase.QUEUED: {Phase.RUNNING, Phase.IDLE},
    Phase.RUNNING: {Phase.UPDATED, Phase.SENT, Phase.FAILED},
    Phase.UPDATED: {Phase.SENT, Phase.IDLE},
    Phase.SENT: {Phase.FENCED},
    Phase.FAILED: {Phase.FENCED, Phase.IDLE},
    Phase.FENCED: set(),
}


@dataclass
class GradCopy:
    """One gradient queued for the host. ``fingerprint`` is what was copied (``None`` while a
    DDP-reduced copy waits for DDP to write ``.grad``, see ``CpuPart.record_reduced``);
    ``stale``: another backward reached the parameter since; ``keep``: a temporary (contiguous or
    cast) the queued copy reads."""

    fingerprint: Optional[Fingerprint]
    stale: bool = False
    keep: Optional[torch.Tensor] = None


@dataclass
class UpdateJob:
    """A bucket's CPU update: its result future (the ``sent`` event or ``None``), and the
    hyperparameter snapshot, clip coefficient and loss scale it runs with. ``early``: queued
    before ``step()`` validated the bucket."""

    future: Future
    hypers: list[dict]
    coef: Optional[torch.Tensor]
    scale: Optional[LossScale]
    early: bool


@dataclass
class BucketStep:
    """One bucket in one step (see the module docstring)."""

    remaining: int
    phase: Phase = Phase.IDLE
    copies: dict[int, GradCopy] = field(default_factory=dict)  # position in bucket -> copy
    landed: Optional[Event] = None
    job: Optional[UpdateJob] = None
    norms: Optional[Future] = None  # the worker's gradient norms (clipping)
    sent: Optional[Event] = None
    verdict: Optional[bool] = None  # step() found the bucket valid (True) or stale (False)

    def move(self, to: Phase) -> None:
        if to not in _NEXT[self.phase]:
            raise AssertionError(f"CPU bucket phase {self.phase.name} -> {to.name} is not a transition")
        self.phase = to


@dataclass
class CpuStep:
    """What one optimizer step of the CPU part has queued so far. ``lock`` guards phases and
    ``ready`` against the worker thread. ``watch``: with early work off, the gradients backward
    produced (a fingerprint, or ``None`` when backward reached the parameter twice), for
    ``step()`` to tell whether early work would have stayed valid."""

    buckets: list[BucketStep]
    lock: Any = field(default_factory=threading.Lock)
    ready: list[int] = field(default_factory=list)  # queued buckets, not started
    validated: bool = False
    early_hypers: Optional[list[dict]] = None  # the snapshot early updates use
    watch: dict[int, Optional[Fingerprint]] = field(default_factory=dict)
    pending: dict[int, bool] = field(default_factory=dict)  # DDP: reduced gradient seen, .grad not yet
    ddp_record_queued: bool = False
    cpu_update_s: float = 0.0
    jobs: list[tuple[float, float, float]] = field(default_factory=list)
    redone: int = 0
    step_called: Optional[float] = None
