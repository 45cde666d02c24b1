"""Optimizer-state CPU offloading: ``HybridDeviceOptimizer`` (README, "Optimizer-state
offloading"; docs/architecture.md, "The optimizer").

Modules, one job each:

- ``hybrid``       the optimizer itself: a facade that partitions and runs the parts in order;
- ``classes``      the wrapped optimizer classes: the default, the API check, the factory;
- ``device_part``  parameters updated on the device by the wrapped class, as without offloading;
- ``cpu_part``     parameters updated on the CPU (``cpu_step``: one step's typed records and phases;
  ``cpu_update``: one bucket's masters, optimizers and update);
- ``stream_update``  the streamed part: state in pinned CPU memory, updated on the device in
  chunks (with ``stream_plan`` its chunks, ``stream_store`` its host memory, ``stream_chunk``
  one chunk's copies and update, ``stream_records`` its work in flight, ``stream_backward`` the
  updates started in backward);
- ``guards``       what changed since early work read it (gradients, parameters, hyperparameters);
- ``amp``          ``GradScaler``'s scale and inf check, applied to every sub-optimizer;
- ``clipping``     ``max_grad_norm``: the global-norm clip inside ``step()``, as torch's;
- ``options``      ``OptimizerOffloadOptions``, the knobs beyond Megatron's signature;
- ``partition``    which parameters are offloaded and in which buckets (pure logic);
- ``balance``      how the offloaded parameters split between the CPU and the streamed part;
- ``transfer``     pinned staging buffers and the copies to/from the device;
- ``worker``       the CPU thread that runs the updates;
- ``state``        state_dict format and conversion to the wrapped optimizer's format, ``opt.state``;
- ``overlap``      the overlap modes: what runs during backward and what ``step()`` waits for;
- ``ddp``          DistributedDataParallel's communication hook;
- ``sharded``      DTensor (FSDP2) parameters: the local shards the parts update, DTensor state;
- ``reference``    the plain optimizers the hybrid is compared with (tests, benchmarks).
"""
from .hybrid import HybridDeviceOptimizer
from .options import OptimizerOffloadOptions
from .overlap import OVERLAP_MODES
from .partition import grad_arrival_order
from .state import to_wrapped_format

__all__ = ["HybridDeviceOptimizer", "OVERLAP_MODES", "OptimizerOffloadOptions", "grad_arrival_order",
           "to_wrapped_format"]
