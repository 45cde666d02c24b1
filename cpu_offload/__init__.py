"""cpu_offload: move activations saved for backward to pinned CPU memory and back, overlapped
with compute, for any ``nn.Module`` stack.

Public API (see README.md)::

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n)
    for layer in layers:
        with ctx:
            x = layer(x)
        x = sync(x)

Backends: V2 (default, ``cpu_offload.v2``) and legacy V1 (``NVTE_CPU_OFFLOAD_V1=1``,
``cpu_offload.v1``).
"""
from .tools.apply import OffloadingHandle, apply_offloading, offloading_handle
from .tools.audit import AuditReport, audit_offload_selection
from .plan.search import plan_offloading
from .config import (
    ActivationOffloadConfig,
    OptimizerOffloadConfig,
    build_hybrid_optimizer,
    build_offload_context,
)
from .core.device import CudaDevice, OffloadDevice
from .core.errors import OffloadConfigError, OffloadUsageError, OffloadVerifyError
from .api import get_cpu_offload_context, is_cpu_offload_enabled
from .control import (
    get_activation_offloading,
    mark_activation_offload,
    mark_not_offload,
    mark_weight,
    maybe_mark_activation_offload,
    offload_opt_out,
    offload_policy,
    set_activation_offloading,
    start_offload,
)
from .core.simulated import SimulatedDevice

__all__ = [
    "ActivationOffloadConfig",
    "apply_offloading",
    "OffloadingHandle",
    "offloading_handle",
    "plan_offloading",
    "AuditReport",
    "audit_offload_selection",
    "build_hybrid_optimizer",
    "build_offload_context",
    "CudaDevice",
    "OffloadConfigError",
    "OffloadDevice",
    "OffloadUsageError",
    "OffloadVerifyError",
    "OptimizerOffloadConfig",
    "SimulatedDevice",
    "get_activation_offloading",
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "mark_activation_offload",
    "mark_not_offload",
    "mark_weight",
    "maybe_mark_activation_offload",
    "offload_opt_out",
    "offload_policy",
    "set_activation_offloading",
    "start_offload",
]

__version__ = "0.1.0"
