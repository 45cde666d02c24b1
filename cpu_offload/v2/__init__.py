"""The V2 backend: automatic activation detection and the per-layer ``OffloadSynchronizer``
schedule.

- ``context``: the per-layer context manager and ``get_cpu_offload_context`` (argument checks);
- ``synchronizer``: the per-step state machine (forward/backward positions, hooks, manual mode);
- ``layer_state``: one layer's storage entries (copy out, release, reload, unpack);
- ``schedule``: pure scheduling rules (which layer is released/reloaded when), CPU-testable;
- ``selection``: which saved tensors are offloaded, and why not (shared with the audit).
"""
from .context import get_cpu_offload_context, is_cpu_offload_enabled, start_offload

__all__ = ["get_cpu_offload_context", "is_cpu_offload_enabled", "start_offload"]
