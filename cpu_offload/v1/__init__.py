"""Legacy V1 backend (``NVTE_CPU_OFFLOAD_V1=1``): tag-based selection, offload handlers with the
layer-window schedule, and a group commit on each layer's output -- Transformer Engine's
``cpu_offload_v1`` behaviour on top of ``OffloadDevice``, with the correctness guarantees of V2
(README, "Guarantees").

Modules: ``api`` (``get_cpu_offload_context``), ``hooks`` (context managers), ``handlers`` and
``async_handler`` (schedules), ``commit`` (``GroupCommitFunction``), ``saved`` (packed tensors and
storage records), ``window`` (layer-window map), ``marking`` (tags), ``state`` (global queries).
"""
from .api import get_cpu_offload_context
from .async_handler import AsyncDoubleBufferGroupOffloadHandler
from .commit import GroupCommitFunction, group_prefetch_offload_commit
from .handlers import OffloadHandler, SynchronizedGroupOffloadHandler
from .hooks import CpuOffloadHookWithOffloadHandler, CpuOffloadSavedTensorHook
from .marking import mark_activation_offload, tensor_need_offloading_checker_activations
from .saved import PackedTensor
from .state import is_cpu_offload_enabled, is_current_layer_offloaded
from .window import layer_window_map

__all__ = [
    "AsyncDoubleBufferGroupOffloadHandler",
    "CpuOffloadHookWithOffloadHandler",
    "CpuOffloadSavedTensorHook",
    "GroupCommitFunction",
    "OffloadHandler",
    "PackedTensor",
    "SynchronizedGroupOffloadHandler",
    "get_cpu_offload_context",
    "group_prefetch_offload_commit",
    "is_cpu_offload_enabled",
    "is_current_layer_offloaded",
    "layer_window_map",
    "mark_activation_offload",
    "tensor_need_offloading_checker_activations",
]
