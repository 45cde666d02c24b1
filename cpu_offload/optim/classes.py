"""The optimizer classes ``HybridDeviceOptimizer`` wraps: the default (fused AdamW), the check
that a class has a torch optimizer's API, and how its instances are built."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from ..core.errors import OffloadConfigError

__all__ = ["REQUIRED_API", "build", "default_optimizer_cls", "probe_class", "warm_torch_optim"]


def build(cls: Callable[..., torch.optim.Optimizer], kwargs: dict, groups: list[dict]) -> torch.optim.Optimizer:
    """``cls(groups, **kwargs)``: with ``functools.partial``, a factory that holds no reference
    to the hybrid optimizer."""
    return cls(groups, **kwargs)


REQUIRED_API = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")


def default_optimizer_cls(kwargs: dict) -> Callable[..., torch.optim.Optimizer]:
    """``torch.optim.AdamW`` with ``fused=True`` (on CPU and GPU alike), unless ``kwargs`` choose
    the implementation themselves (``fused`` or ``foreach``)."""
    if "fused" in kwargs or "foreach" in kwargs:
        return torch.optim.AdamW

    def adamw_fused(params: Any, **kw: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, fused=True, **kw)

    return adamw_fused


WARMED = threading.Event()


def warm_torch_optim() -> None:
    """Build a first torch optimizer on a thread of its own. torch's first optimizer in a
    process imports its compiler lazily and leaves the frames of that call in a reference cycle;
    called from ``__init__`` those frames would hold the hybrid optimizer (and its pinned
    memory) until the cycle collector runs. Here they hold nothing of the user's."""
    if WARMED.is_set():
        return
    t = threading.Thread(target=lambda: torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1),
                         name="cpu_offload-optim-warmup")
    t.start()
    t.join()
    WARMED.set()


def probe_class(cls: Callable[..., Any], kwargs: dict, role: str) -> dict:
    """Instantiate ``cls`` on a dummy CPU parameter: check its API, return its defaults."""
    name = getattr(cls, "__name__", repr(cls))
    try:
        probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except Exception as exc:
        raise OffloadConfigError(
            f"{role}={name} could not be built with the optimizer arguments {sorted(kwargs)}: "
            f"{exc}; pass arguments that class accepts") from exc
    missing = [a for a in REQUIRED_API if not callable(getattr(probe, a, None))]
    missing += [a for a in ("param_groups", "state", "defaults") if not hasattr(probe, a)]
    if missing:
        raise OffloadConfigError(
            f"{role}={name} lacks {', '.join(missing)}: the hybrid optimizer needs a "
            "torch.optim.Optimizer-like class (param_groups, state, defaults, step, zero_grad, "
            "state_dict, load_state_dict, add_param_group); subclass torch.optim.Optimizer")
    return dict(probe.defaults)
