"""The optimizer classes ``HybridDeviceOptimizer`` wraps: the default (fused AdamW), the check
that a class has a torch optimizer's API, and how its instances are built."""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional

import torch
from packaging.version import Version

from ..compat import TORCH_VERSION
from ..core.errors import OffloadConfigError

__all__ = ["REQUIRED_API", "build", "check_cpu_class_dtypes", "default_optimizer_cls", "probe_class",
           "warm_torch_optim"]

# torch's fused CPU SGD on bf16/fp16 tensors leaves every full vector block of a parameter
# un-updated and loads its momentum through the wrong type (pytorch/pytorch#191763, fixed by
# #192545 in torch 2.14). On the GPU the same class is right, so offloading would change training.
FUSED_CPU_SGD_LOW_PRECISION_FIXED = Version("2.14")


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


ONE_STEP_SHAPE = (8,)  # the dummy parameter of ``one_step``: state shaped so is per element


def one_step(make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> Optional[tuple[Any, dict]]:
    """What one step of a class does to a dummy CPU parameter (``ONE_STEP_SHAPE`` zeros, a zero
    gradient): the optimizer ``make_optimizer`` built over it, and the state the step left for
    it (``{}``: none). ``None`` if building or stepping fails (a class that needs a closure, an
    option only a GPU takes): callers fall back to a conservative answer. How the hybrid learns
    what a class keeps (``keeps_state``, ``stream_update.state_elems_per_param``)."""
    x = torch.zeros(ONE_STEP_SHAPE, requires_grad=True)
    try:
        opt = make_optimizer([{"params": [x]}])
        x.grad = torch.zeros_like(x)
        opt.step()
        return opt, dict(opt.state.get(x, {}))
    except Exception:  # noqa: BLE001 - the callers' fallback
        return None


def keeps_state(make_optimizer: Callable[[list[dict]], torch.optim.Optimizer]) -> bool:
    """Whether one step of the class leaves state for its parameter (torch's classes do, but
    SGD without momentum). Such a class has state for every parameter it has stepped, so a
    parameter without state was never stepped and its master equals it: ``state_dict()`` then
    saves no master for it, as torch saves no entry (torch's Adam-like classes refuse to load an
    entry without their ``"step"``). A step that fails: False (every master is saved)."""
    stepped = one_step(make_optimizer)
    return stepped is not None and bool(stepped[1])


def check_cpu_class_dtypes(cls: Callable[..., Any], kwargs: dict, dtypes: Iterable[torch.dtype]) -> None:
    """Refuse a CPU class that torch is known to get wrong on the dtypes it would update there:
    fused SGD on bf16/fp16 state before torch 2.14 (``FUSED_CPU_SGD_LOW_PRECISION_FIXED``).
    Only ``fp32_masters=False`` puts low-precision state on the CPU; the error names the ways out.
    """
    low = sorted({str(d).replace("torch.", "") for d in dtypes if d.is_floating_point and d.itemsize < 4})
    if not low or TORCH_VERSION >= FUSED_CPU_SGD_LOW_PRECISION_FIXED:
        return
    probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    if isinstance(probe, torch.optim.SGD) and probe.defaults.get("fused"):
        raise OffloadConfigError(
            f"torch {TORCH_VERSION}'s fused CPU SGD updates {'/'.join(low)} tensors wrongly (it skips "
            "whole vector blocks and corrupts momentum: pytorch/pytorch#191763, fixed in torch "
            f"{FUSED_CPU_SGD_LOW_PRECISION_FIXED}), and with fp32_masters=False the CPU part would "
            "run it on them: keep fp32_masters=True, pass fused=False (or leave it unset), or use "
            f"torch>={FUSED_CPU_SGD_LOW_PRECISION_FIXED}")
