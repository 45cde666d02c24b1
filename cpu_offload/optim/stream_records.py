"""What a streamed part has in flight: one record type per kind of work started and not done
yet, and the named phases they go through.

The device work of a streamed part outlives the call that queued it: an update started in
backward waits for ``step()`` to keep or redo it; an overlapped update (``next_forward``) runs
on while the next forward waits for it module by module. Each kind has a record here that says
what the work read and holds, and a phase checked at every transition (as FSDP2's
``_fsdp_param_group.py`` and TransformerEngine's ``cpu_offload.py`` name theirs), so that the
state of a chunk is one value, not a combination of containers.

- ``Landed``: a gradient backward produced, as the post-accumulate-grad hook saw it; the one
  predicate ``still_valid`` says whether work that read it may be kept.
- ``EarlyUpdate``: one chunk's update started in backward (``stream_backward``).
- ``BackwardRound``: the early updates of one backward, from its first gradient to the
  ``step()`` that keeps or drops them; ``EarlyPhase`` per chunk, and ``EarlyMiss`` for those
  not kept.
- ``ChunkMark`` and ``QueuedUpdate``: the update ``step()`` left running (``next_forward``),
  which forwards wait for chunk by chunk; ``UpdatePhase``.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..core.device import Event
from .guards import Fingerprint


class EarlyPhase(enum.Enum):
    """Where one chunk stands in a backward (``BackwardRound.phases``)."""

    WAITING = "waiting"  # gradients of its parameters still to land
    SKIPPED = "skipped"  # all landed, nothing started: step() updates it (not eligible, or off)
    QUEUED = "queued"  # its update handed to the launcher (or run in the hook)
    DROPPED = "dropped"  # launched, its result unusable (state layout changed): step() redoes it
    UPDATED = "updated"  # updated on the device, copies out queued: an ``EarlyUpdate``
    KEPT = "kept"  # step() keeps it (nothing it read changed)
    REDONE = "redone"  # step() updates it again (something it read changed)

    def to(self, new: "EarlyPhase") -> "EarlyPhase":
        """``new``, if a chunk may go there from here (else ``AssertionError``)."""
        if new not in _EARLY_NEXT[self]:
            raise AssertionError(f"an early chunk update cannot go from {self.name} to {new.name}")
        return new


_EARLY_NEXT = {
    EarlyPhase.WAITING: {EarlyPhase.SKIPPED, EarlyPhase.QUEUED},
    EarlyPhase.QUEUED: {EarlyPhase.UPDATED, EarlyPhase.DROPPED},
    EarlyPhase.UPDATED: {EarlyPhase.KEPT, EarlyPhase.REDONE},
    EarlyPhase.SKIPPED: set(), EarlyPhase.DROPPED: set(), EarlyPhase.KEPT: set(),
    EarlyPhase.REDONE: set(),
}


class EarlyMiss(enum.Enum):
    """Why a chunk's update was not started in backward, or not kept by ``step()`` (then
    ``step()`` updates it itself: only the overlap is lost). ``last_step_stats`` counts them
    (``stream_early_missed``), so a user can see what costs the overlap."""

    NO_GRADIENT = "a gradient of the chunk did not arrive in backward"
    OFF = "off: the step before changed gradients after backward, or scaled the loss"
    NOT_ELIGIBLE = "not eligible (optimizer class, state not yet made, or a second gradient)"
    LAYOUT = "the optimizer changed its state's layout"
    LOSS_SCALE = "a loss scale came at step()"
    HYPERPARAMETERS = "hyperparameters changed before step()"
    SECOND_GRADIENT = "a second gradient came before step()"
    GRADIENT = "a gradient changed before step()"
    PARAMETER = "a parameter changed before step()"


class UpdatePhase(enum.Enum):
    """Where the update ``step()`` left running stands (``QueuedUpdate.phase``)."""

    RUNNING = "running"  # queued on the update stream; forwards wait for their chunks
    ORDERED = "ordered"  # the compute stream waited for all of it: the gradients it read are free
    FINISHED = "finished"  # and for its copies out: its staging and device state are free

    def to(self, new: "UpdatePhase") -> "UpdatePhase":
        """``new``, if the update may go there from here (else ``AssertionError``)."""
        if new not in _UPDATE_NEXT[self]:
            raise AssertionError(f"a queued update cannot go from {self.name} to {new.name}")
        return new


_UPDATE_NEXT = {
    UpdatePhase.RUNNING: {UpdatePhase.ORDERED},
    UpdatePhase.ORDERED: {UpdatePhase.ORDERED, UpdatePhase.FINISHED},  # ordering twice is a no-op
    UpdatePhase.FINISHED: set(),
}


@dataclass(frozen=True, eq=False)
class Landed:
    """A parameter's gradient and the parameter as its hook saw them (``guards.Fingerprint``):
    the early update reads both (the parameter as its master, or to take a user's edit into
    its master).

    The hook records only the tensors and their versions (``of``); their bit sums are taken
    when the first chunk that reads them is queued, for all of that chunk's parameters at once
    (``fingerprints``, ``Fingerprint.take_bits``). Taken in the hook, two sums per parameter
    cost backward about 0.35 ms of host time each (a 1.5B GPT with every offloaded parameter
    streamed in backward: 142 ms of host time in backward instead of 31, the GPU waiting for
    its kernels; ``benchmarks/optim_trace.py``)."""

    grad: Fingerprint
    param: Fingerprint
    stale: bool = False  # a second gradient came before step(): work on the first is stale

    @classmethod
    def of(cls, grad: torch.Tensor, param: torch.Tensor) -> "Landed":
        return cls(Fingerprint.pending(grad), Fingerprint.pending(param))

    def fingerprints(self) -> tuple[Fingerprint, Fingerprint]:
        return self.grad, self.param

    def made_stale(self) -> "Landed":
        """This gradient, after a second one came for its parameter."""
        return dataclasses.replace(self, stale=True)

    def checks(self, param: torch.Tensor) -> list[tuple[Fingerprint, Optional[torch.Tensor]]]:
        """What ``guards.changed`` compares for work that read this gradient to give what
        ``step()`` would give now: the gradient (still ``param.grad``, bit for bit) and the
        parameter (unchanged)."""
        return [(self.grad, param.grad), (self.param, param)]


@dataclass(eq=False)
class EarlyUpdate:
    """One chunk's update started in backward: done on the device once ``updated`` has passed;
    its new masters and state in the spare host copy, its parameters' new values in ``new``."""

    chunk: int
    seen: list  # per parameter of the chunk: (index, its ``Landed``) the update read
    hypers: Sequence[dict]  # the hyperparameters it ran with
    updated: Event
    new: list  # per piece: its parameter's new bytes, on the device until step() keeps them


@dataclass(eq=False)
class BackwardRound:
    """The early updates of one backward (``stream_backward.BackwardUpdates``)."""

    waiting: list  # per chunk: how many of its parameters' gradients are still to land
    phases: list  # per chunk: its ``EarlyPhase``
    landed: dict = field(default_factory=dict)  # param index -> ``Landed``
    done: dict = field(default_factory=dict)  # chunk -> ``EarlyUpdate`` (phase UPDATED on)
    slots: list = field(default_factory=list)  # the staging slots, from the first update
    layouts: list = field(default_factory=list)  # per chunk: its ``SlotLayout`` (with the slots)
    free: list = field(default_factory=list)  # per slot: its last copy out
    launched: int = 0
    held: list = field(default_factory=list)  # device buffers queued work uses
    grads: list = field(default_factory=list)  # the gradients it reads
    why: dict = field(default_factory=dict)  # chunk -> why it was not kept (``EarlyMiss``)
    fingerprinted: dict = field(default_factory=dict)  # id(stream) -> (stream, event after
    # the bit sums of the last launch queued on it)

    @classmethod
    def start(cls, needed: Sequence[int]) -> "BackwardRound":
        """A round over chunks that need ``needed[c]`` gradients each."""
        return cls(list(needed), [EarlyPhase.WAITING] * len(needed))

    def move(self, chunk: int, phase: EarlyPhase) -> None:
        self.phases[chunk] = self.phases[chunk].to(phase)

    def count(self, *phases: EarlyPhase) -> int:
        return sum(1 for p in self.phases if p in phases)

    @property
    def idle(self) -> bool:
        """Nothing was launched: no device memory or gradient to let go of."""
        return not self.slots and not self.grads


@dataclass(frozen=True, eq=False)
class ChunkMark:
    """(``next_forward``) What a forward that reads a parameter waits for: the chunk that
    writes it (``position``: its place in the update's order), and the gradient it reads."""

    position: int
    done: Event
    grad: torch.Tensor


@dataclass(eq=False)
class QueuedUpdate:
    """(``next_forward``) The update ``step()`` returned with, still running on the update
    stream, and what it holds until the compute stream has waited for it."""

    updated: Event  # the end of the update on its stream
    marks: dict  # param index -> ``ChunkMark``, until a forward waits for it
    held: list  # staging slots, device state, early updates' buffers: freed once FINISHED
    early_grads: list  # gradients the kept early updates read: freed once ORDERED
    phase: UpdatePhase = UpdatePhase.RUNNING
