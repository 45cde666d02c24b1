"""``get_cpu_offload_context``: one entry point, two backends.

The backend is chosen when the function is called, from ``NVTE_CPU_OFFLOAD_V1``: ``1`` selects
the legacy tag-based V1 (``cpu_offload.v1``), anything else the default V2
(``cpu_offload.v2``). The tensor-marking helpers dispatch the same way.
"""
from __future__ import annotations

import os
from typing import Any, Callable, ContextManager, Optional, Tuple, Union

import torch

from . import markers
from .device import OffloadDevice
from .errors import OffloadConfigError
from .v2.selection import DEFAULT_MIN_TENSOR_SIZE

V1_ENV = "NVTE_CPU_OFFLOAD_V1"


def use_v1() -> bool:
    """Whether the legacy backend is selected (read on every call, not cached)."""
    return os.environ.get(V1_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: Optional[int] = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Optional[torch.cuda.Stream] = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    synchronization_dict: Optional[dict] = None,
    *,
    device: Optional[OffloadDevice] = None,
    verify: Optional[bool] = None,
    max_host_bytes: Optional[int] = None,
) -> Union[Tuple[ContextManager, Callable], Tuple[ContextManager, Callable, Any]]:
    """Return ``(context, sync_function)``, or with ``manual_synchronization=True``
    ``(context, sync_function, ManualOffloadSynchronizer)``.

    Wrap each layer's forward in ``context`` and pass the layer's output through
    ``sync_function``; see README.md and seed 000 for the full semantics. ``device`` selects the
    offload device (default CUDA; ``SimulatedDevice()`` runs the schedule on the CPU).
    """
    device = resolve_device(device)
    if use_v1():
        v2_only = {
            "manual_synchronization": manual_synchronization,
            "retain_pinned_cpu_buffers": retain_pinned_cpu_buffers,
            "offload_stream": offload_stream is not None,
            "synchronization_dict": synchronization_dict is not None,
            "min_tensor_size_to_offload": min_tensor_size_to_offload != DEFAULT_MIN_TENSOR_SIZE,
            "verify": bool(verify),
            "max_host_bytes": max_host_bytes is not None,
        }
        used = [k for k, v in v2_only.items() if v]
        if used and enabled:
            raise OffloadConfigError(
                f"{', '.join(used)} exist only in the V2 backend, but {V1_ENV}=1 selects V1; "
                f"unset {V1_ENV} to use them"
            )
        from .v1 import get_cpu_offload_context as v1_context

        return v1_context(
            enabled=enabled,
            num_layers=num_layers,
            model_layers=model_layers,
            offload_activations=offload_activations,
            offload_weights=offload_weights,
            double_buffering=double_buffering,
            device=device,
        )
    from .v2 import get_cpu_offload_context as v2_context

    return v2_context(
        enabled=enabled,
        num_layers=num_layers,
        model_layers=model_layers,
        offload_activations=offload_activations,
        offload_weights=offload_weights,
        double_buffering=double_buffering,
        manual_synchronization=manual_synchronization,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        offload_stream=offload_stream,
        min_tensor_size_to_offload=min_tensor_size_to_offload,
        synchronization_dict=synchronization_dict,
        device=device,
        verify=verify,
        max_host_bytes=max_host_bytes,
    )


def resolve_device(device: Any) -> Optional[OffloadDevice]:
    """The ``device`` argument as an ``OffloadDevice``: ``None`` and CUDA devices mean the CUDA
    device; anything else is refused with the fix."""
    if device is None or isinstance(device, OffloadDevice):
        return device
    if isinstance(device, (str, torch.device)):
        try:
            kind = torch.device(device).type
        except (RuntimeError, TypeError):
            kind = None
        if kind == "cuda":
            return None  # the default: CUDA
    raise OffloadConfigError(
        f"device={device!r} is not an offload device. Activations are offloaded from a CUDA GPU: "
        "pass device=None (or 'cuda'); to run the schedule on a CPU-only machine, pass "
        "device=cpu_offload.SimulatedDevice()"
    )


def mark_activation_offload(*tensors: Optional[torch.Tensor], offload: bool = True) -> None:
    """Tag tensors for offloading. V1 offloads exactly the tagged tensors; V2 detects activations
    automatically and keeps the tag only for auditing (``cpu_offload.tools.audit``)."""
    if use_v1():
        from .v1 import mark_activation_offload as v1_mark

        v1_mark(*tensors, offload=offload)
    else:
        markers.tag_activation_offload(*tensors, offload=offload)


def is_cpu_offload_enabled() -> bool:
    """True while inside an enabled offload context of the selected backend."""
    if use_v1():
        from .v1 import is_cpu_offload_enabled as v1_enabled

        return v1_enabled()
    from .v2 import is_cpu_offload_enabled as v2_enabled

    return v2_enabled()


def start_offload(*tensors: Optional[torch.Tensor], offload_base_tensor: bool = False) -> None:
    """Mark the point on the compute stream after which these tensors are final, so their copy
    to the CPU may start before they are saved for backward (V2; a no-op outside a context)."""
    if use_v1():
        return
    from .v2 import start_offload as v2_start

    v2_start(*tensors, offload_base_tensor=offload_base_tensor)
