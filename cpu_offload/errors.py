"""Exceptions raised for misuse, so callers can catch configuration mistakes specifically."""
from typing import Any

import torch


class OffloadConfigError(ValueError):
    """An argument combination of ``get_cpu_offload_context`` (or a config) that cannot work."""


class OffloadUsageError(RuntimeError):
    """The context or sync function was used out of order (e.g. sync function not called)."""


def check_sync_argument(tensor: Any) -> None:
    """The sync function (both backends) marks a layer boundary on one tensor: refuse others."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"the sync function takes the layer's output tensor, got {type(tensor).__name__}; "
            "for a layer returning a tuple or dict, pass its hidden-state tensor: "
            "`out = (sync(out[0]), *out[1:])`"
        )
