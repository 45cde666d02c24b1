"""Optimizer-state CPU offloading: ``HybridDeviceOptimizer`` (README, "Optimizer-state
offloading").

Modules, one job each:

- ``partition``  which parameters the CPU updates and in which buckets (pure logic);
- ``transfer``   pinned staging buffers and the copies to/from the device (``OffloadDevice`` only);
- ``worker``     the CPU thread that runs the updates;
- ``cpu_update`` one bucket: fp32 master weights, its optimizer, the update;
- ``stream_update`` the streamed part: state in pinned CPU memory, updated on the device in chunks
  (with ``stream_plan`` its chunks, ``stream_store`` its host memory, ``stream_chunk`` one chunk's
  copies and update, ``stream_records`` its work in flight, ``stream_backward`` the updates
  started in backward);
- ``balance``    how the offloaded parameters split between the CPU and the streamed part;
- ``state``      state_dict format and conversion to the wrapped optimizer's format;
- ``overlap``    the overlap modes: what runs during backward and what ``step()`` waits for;
- ``ddp``        DistributedDataParallel's communication hook (reduced gradients to the host);
- ``hybrid``     the optimizer itself (hooks, buckets, clipping, state dicts).
"""
from .hybrid import HybridDeviceOptimizer
from .overlap import OVERLAP_MODES
from .partition import grad_arrival_order
from .state import to_wrapped_format

__all__ = ["HybridDeviceOptimizer", "OVERLAP_MODES", "grad_arrival_order", "to_wrapped_format"]
