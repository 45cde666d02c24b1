"""cpu_offload: move the activations a model saves for backward to pinned CPU memory and back,
overlapped with compute, for any stack of ``nn.Module`` layers. Gradients stay bit-identical.

Three ways in, from the least code to the most control:

- ``apply_offloading(layers, num_layers=k)`` installs offloading on a model's layers in place
  (e.g. ``model.model.layers`` of a Hugging Face decoder); ``handle.remove()`` undoes it.
- ``plan_offloading(step_fn, layers, memory_budget)`` measures one real training step and
  chooses what to offload and what to recompute within a memory budget; apply the ``Plan`` with
  ``apply_offloading(layers, plan=plan)``.
- ``get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n)`` returns the context
  and sync function of the per-layer loop, written by hand::

      ctx, sync = get_cpu_offload_context(enabled=True, num_layers=k, model_layers=n)
      for layer in layers:
          with ctx:
              x = layer(x)
          x = sync(x)

What gets offloaded can be narrowed per tensor, module or block (``mark_not_offload``,
``set_activation_offloading``, ``offload_policy``; see ``cpu_offload.control``). Optimizer state
is offloaded by ``cpu_offload.optim.HybridDeviceOptimizer``, a drop-in optimizer that keeps part
of the state, and its update, on the CPU. Without a GPU, ``device=SimulatedDevice()`` runs the
same schedule on the CPU, checked for missing synchronization. Backends: V2 (default,
``cpu_offload.v2``) and the legacy, tag-based V1 (``NVTE_CPU_OFFLOAD_V1=1``, ``cpu_offload.v1``).

Example (on a GPU, leave out ``device=``)::

    >>> import torch, cpu_offload
    >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
    >>> handle = cpu_offload.apply_offloading(
    ...     layers, num_layers=2, min_tensor_size_to_offload=1,
    ...     device=cpu_offload.SimulatedDevice())
    >>> x = torch.randn(8, 64, requires_grad=True)
    >>> for layer in layers:
    ...     x = layer(x)
    >>> x.sum().backward()
    >>> handle.stats().to_dict()["offloaded_tensors"]   # layers 0 and 1 saved their input
    2
    >>> handle.remove()
"""
from .api import get_cpu_offload_context, is_cpu_offload_enabled
from .config import (
    ActivationOffloadConfig,
    OptimizerOffloadConfig,
    build_hybrid_optimizer,
    build_offload_context,
)
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
from .core.device import CudaDevice, OffloadDevice
from .core.errors import OffloadConfigError, OffloadUsageError, OffloadVerifyError
from .core.simulated import SimulatedDevice
from .plan.profile import StepProfile, profile_step
from .plan.search import Plan, plan_offloading
from .tools.apply import OffloadingHandle, apply_offloading, offloading_handle
from .tools.layers import find_block_list
from .tools.audit import AuditReport, audit_offload_selection
from .v2.policies import create_selective_checkpoint_contexts
from .v2.schedule import plan_synchronization_dict, spread_synchronization_dict
from .v2.selection import SelectionPolicy

__all__ = [
    # context: the per-layer loop by hand, and its Megatron-style config
    "get_cpu_offload_context",
    "is_cpu_offload_enabled",
    "spread_synchronization_dict",
    "plan_synchronization_dict",
    "ActivationOffloadConfig",
    "build_offload_context",
    # control: what gets offloaded (tensors, modules, blocks)
    "mark_not_offload",
    "mark_weight",
    "mark_activation_offload",
    "maybe_mark_activation_offload",
    "start_offload",
    "set_activation_offloading",
    "get_activation_offloading",
    "offload_policy",
    "offload_opt_out",
    "create_selective_checkpoint_contexts",
    # apply and plan: one call on a model's layers, a plan for a memory budget, the audit
    "apply_offloading",
    "OffloadingHandle",
    "offloading_handle",
    "find_block_list",
    "plan_offloading",
    "Plan",
    "profile_step",
    "StepProfile",
    "audit_offload_selection",
    "AuditReport",
    "SelectionPolicy",
    # optim: optimizer-state offloading (the optimizer itself: cpu_offload.optim)
    "OptimizerOffloadConfig",
    "build_hybrid_optimizer",
    # devices and errors
    "OffloadDevice",
    "CudaDevice",
    "SimulatedDevice",
    "OffloadConfigError",
    "OffloadUsageError",
    "OffloadVerifyError",
]

__version__ = "0.1.0"
