"""Optimizer-state CPU offloading: ``HybridDeviceOptimizer`` (README, "Optimizer-state
offloading").

Modules, one job each:

- ``partition``  which parameters the CPU updates and in which buckets (pure logic);
- ``transfer``   pinned staging buffers and the copies to/from the device (``OffloadDevice`` only);
- ``worker``     the CPU thread that runs the updates;
- ``cpu_update`` one bucket: fp32 master weights, its optimizer, the update;
- ``state``      state_dict format and conversion to the wrapped optimizer's format;
- ``hybrid``     the optimizer itself (hooks, overlap modes, clipping, DDP comm hook).
"""
from .hybrid import OVERLAP_MODES, HybridDeviceOptimizer
from .partition import grad_arrival_order
from .state import to_wrapped_format

__all__ = ["HybridDeviceOptimizer", "OVERLAP_MODES", "grad_arrival_order", "to_wrapped_format"]
