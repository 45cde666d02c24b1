"""``OptimizerOffloadOptions``: every knob of ``HybridDeviceOptimizer`` beyond Megatron's
signature, in one frozen, checked value (as FSDP2's ``MixedPrecisionPolicy``).

The constructor keeps Megatron-core's names (``offload_fraction``, ``cpu_optimizer_cls``, ...);
the rest lives here so that the signature stops growing. The fields may also be passed to the
constructor as keywords (``overlap="next_forward"``): they are taken out of the optimizer's
keyword arguments by name (``split_options``).

Numbers are checked with ``numbers.Integral`` / ``numbers.Real``, so numpy scalars and values read
from configs work; a ``bool`` is never a number here, and every error names the field and the fix.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from ..core.errors import OffloadConfigError
from .overlap import OVERLAP_MODES, OverlapMode
from .partition import DEFAULT_BUCKET_BYTES
from .stream_update import DEFAULT_STREAM_BUDGET_BYTES, MIN_STREAM_BUDGET_BYTES

STREAM_CHOICES = ("auto", "measure")

__all__ = ["OptimizerOffloadOptions", "split_options", "count"]


def count(name: str, value: Any, minimum: int, allow_none: bool = False, unit: str = "") -> Optional[int]:
    """``value`` as an ``int`` >= ``minimum`` (any ``numbers.Integral`` but ``bool``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        what = f"an integer >= {minimum}" + (f" ({unit})" if unit else "")
        raise OffloadConfigError(
            f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}"
            + (" (a bool)" if isinstance(value, bool) else ""))
    return int(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OffloadConfigError(f"{name} must be True or False, got {value!r}"
                                 + (" (a string: convert flags read from files to bool)"
                                    if isinstance(value, str) else ""))
    return value


@dataclass(frozen=True)
class OptimizerOffloadOptions:
    """How ``HybridDeviceOptimizer`` schedules its offloaded part (see its docstring for each
    field's effect). Checked on construction.

    Example::

        >>> from cpu_offload.optim import OptimizerOffloadOptions
        >>> OptimizerOffloadOptions(overlap="next_forward", stream_fraction=0.5).stream_fraction
        0.5
        >>> OptimizerOffloadOptions(bucket_bytes=True)
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: bucket_bytes must be an integer >= 1 (bytes), got True (a bool)
    """

    overlap: Optional[str] = None
    max_grad_norm: Optional[float] = None
    grad_order: Optional[Sequence[torch.Tensor]] = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    cpu_threads: Optional[int] = None
    cpu_chunk_bytes: Optional[int] = None
    stream_fraction: Union[str, float] = "auto"
    stream_budget_bytes: int = DEFAULT_STREAM_BUDGET_BYTES
    bind_cpu_cores: bool = False
    stream_during_backward: bool = False
    fp32_masters: bool = True

    def __post_init__(self) -> None:
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen
        if self.overlap is not None and self.overlap not in OVERLAP_MODES:
            raise OffloadConfigError(f"overlap={self.overlap!r} is not one of {OVERLAP_MODES} (or None: "
                                     "Megatron's overlap_cpu_optimizer_d2h_h2d switch decides)")
        if self.max_grad_norm is not None:
            if (isinstance(self.max_grad_norm, bool) or not isinstance(self.max_grad_norm, numbers.Real)
                    or not float(self.max_grad_norm) > 0):
                raise OffloadConfigError(
                    f"max_grad_norm must be a number > 0 (or None), got {self.max_grad_norm!r}")
            put("max_grad_norm", float(self.max_grad_norm))
        if self.grad_order is not None:
            order = self.grad_order
            if isinstance(order, (str, bytes, torch.Tensor)) or not hasattr(order, "__iter__"):
                raise OffloadConfigError(
                    f"grad_order must be a list of the parameters in gradient-arrival order "
                    f"(cpu_offload.optim.grad_arrival_order(model, step_fn)), got {order!r}")
            order = tuple(order)
            bad = [type(t).__name__ for t in order if not isinstance(t, torch.Tensor)]
            if bad:
                raise OffloadConfigError(
                    f"grad_order must hold the parameters themselves (tensors), got {bad[0]} "
                    "entries: pass cpu_offload.optim.grad_arrival_order(model, step_fn)")
            put("grad_order", order)
        put("bucket_bytes", count("bucket_bytes", self.bucket_bytes, 1, unit="bytes"))
        put("cpu_threads", count("cpu_threads", self.cpu_threads, 1, allow_none=True))
        put("cpu_chunk_bytes", count("cpu_chunk_bytes", self.cpu_chunk_bytes, 0, allow_none=True,
                                     unit="bytes"))
        if not (isinstance(self.stream_fraction, str) and self.stream_fraction in STREAM_CHOICES):
            if isinstance(self.stream_fraction, str):
                raise OffloadConfigError(
                    f"stream_fraction must be 'auto' or a number in [0, 1] (or 'measure': time "
                    f"this host), got {self.stream_fraction!r}")
            if (isinstance(self.stream_fraction, bool) or not isinstance(self.stream_fraction, numbers.Real)
                    or math.isnan(float(self.stream_fraction)) or not 0 <= float(self.stream_fraction) <= 1):
                raise OffloadConfigError(
                    f"stream_fraction must be 'auto' or a number in [0, 1] (the share of the "
                    f"offloaded parameters updated on the device from streamed state; 0 updates "
                    f"them all on the CPU; 'measure' times this host), got {self.stream_fraction!r}")
            put("stream_fraction", float(self.stream_fraction))
        put("stream_budget_bytes", count("stream_budget_bytes", self.stream_budget_bytes,
                                         MIN_STREAM_BUDGET_BYTES, unit="bytes"))
        put("bind_cpu_cores", _flag("bind_cpu_cores", self.bind_cpu_cores))
        put("stream_during_backward", _flag("stream_during_backward", self.stream_during_backward))
        put("fp32_masters", _flag("fp32_masters", self.fp32_masters))

    def check_mode(self, mode: OverlapMode) -> None:
        """``stream_during_backward`` against the overlap mode chosen and the other options:
        it needs a mode that updates in backward, no ``max_grad_norm`` and a streamed part."""
        if not self.stream_during_backward:
            return
        if not mode.updates_in_backward:
            raise OffloadConfigError(
                f"stream_during_backward=True updates during backward: it needs "
                f"overlap='backward_update' or 'next_forward', not {mode.name!r}")
        if self.max_grad_norm is not None:
            raise OffloadConfigError(
                "stream_during_backward=True cannot be combined with max_grad_norm (which "
                "scales every gradient inside step(), after backward): drop one of them")
        if self.stream_fraction == 0:
            raise OffloadConfigError("stream_during_backward=True needs a streamed part: "
                                     "stream_fraction > 0 (or 'auto')")

    def replace(self, **changes: Any) -> "OptimizerOffloadOptions":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)


OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(OptimizerOffloadOptions))


def split_options(options: Optional[OptimizerOffloadOptions], kwargs: dict) -> tuple[OptimizerOffloadOptions, dict]:
    """The options (``options`` updated by any of its fields passed as keywords) and the
    remaining keywords (the wrapped optimizer's hyperparameters)."""
    if options is not None and not isinstance(options, OptimizerOffloadOptions):
        raise OffloadConfigError(
            f"options must be a cpu_offload.optim.OptimizerOffloadOptions, got {type(options).__name__}")
    given = {k: v for k, v in kwargs.items() if k in OPTION_NAMES}
    rest = {k: v for k, v in kwargs.items() if k not in OPTION_NAMES}
    base = options if options is not None else OptimizerOffloadOptions()
    return (base.replace(**given) if given else base), rest
