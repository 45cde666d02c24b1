"""Exceptions raised for misuse, so callers can catch configuration mistakes specifically."""
import sys
from typing import Any

import torch


class OffloadConfigError(ValueError):
    """An argument combination of ``get_cpu_offload_context`` (or a config) that cannot work."""


class OffloadUsageError(RuntimeError):
    """The context or sync function was used out of order (e.g. sync function not called)."""


class OffloadVerifyError(RuntimeError):
    """Verify mode: a reloaded storage differs from the bytes that were saved."""


def check_sync_argument(tensor: Any) -> None:
    """The sync function (both backends) marks a layer boundary on one tensor: refuse others."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"the sync function takes the layer's output tensor, got {type(tensor).__name__}; "
            "for a layer returning a tuple or dict, pass its hidden-state tensor: "
            "`out = (sync(out[0]), *out[1:])`"
        )


def stacklevel_outside_package() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the first caller outside
    ``cpu_offload`` (the user's line), however deep inside the package the warning is raised."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("cpu_offload"):
        frame, level = frame.f_back, level + 1
    return level
