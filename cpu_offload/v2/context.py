"""The V2 backend's public surface: the re-enterable offload context and its construction.

``get_cpu_offload_context`` validates arguments (every misuse named with its fix), builds an
``OffloadSynchronizer`` and returns the per-layer context plus the sync function (and the manual
synchronizer in manual mode). The context installs the saved-tensor hooks for exactly one layer's
forward; an exception inside it removes them and drops everything the step held.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Callable, ContextManager, Optional, Tuple, Union

import torch

from ..core import markers
from ..core.checks import check_context_types, check_int
from ..compat import (
    DIRECT_HOOKS,
    eager_between_graphs,
    pop_pushed_saved_tensors_hooks,
    push_saved_tensors_hooks,
    saved_tensors_hooks,
)
from ..core.device import OffloadDevice, default_device
from ..core.errors import OffloadConfigError, stacklevel_outside_package
from .schedule import Schedule, check_default_arguments, validate_synchronization_dict
from .selection import DEFAULT_MIN_TENSOR_SIZE, SelectionPolicy
from .stats import StepStats
from .layer_state import unpack
from .synchronizer import (
    ManualOffloadSynchronizer,
    OffloadSynchronizer,
)

class _ThreadState(threading.local):
    """Contexts active on this thread, innermost first, as a chain of pairs
    ``(synchronizer, outer chain)`` (None: none), so that entering and leaving a layer make no
    call. Per thread, so two threads that enter and exit contexts in any interleaving never see
    or keep each other's."""

    def __init__(self) -> None:
        self.active: Optional[tuple] = None


def _without(chain: Optional[tuple], sync: OffloadSynchronizer) -> Optional[tuple]:
    """``chain`` without the innermost link holding ``sync`` (contexts left out of order)."""
    inner = []
    while chain is not None and chain[0] is not sync:
        inner.append(chain[0])
        chain = chain[1]
    if chain is not None:
        chain = chain[1]
    for s in reversed(inner):
        chain = (s, chain)
    return chain


_state = _ThreadState()

VERIFY_ENV = "CPU_OFFLOAD_VERIFY"  # 1: verify mode for every context (checksums, host syncs)

_DIRECT = object()  # a frame whose layer's hooks were pushed with torch's own call


class OffloadContext:
    """``with ctx:`` around one layer's forward. Re-entered once per layer, never nested.

    Entered while a backward pass runs (activation checkpointing recomputes the layer), it does
    nothing: the recomputed tensors are used at once, and the layer was counted in forward."""

    def __init__(self, synchronizer: OffloadSynchronizer) -> None:
        self.synchronizer = synchronizer
        # The open entry's hooks (None: none installed), and entries made during backward
        # (activation-checkpoint recomputation; they install nothing) still open: those are
        # always the innermost, so a count says which kind an exit closes.
        self._frame: Any = None
        self._recomputing = 0
        # One hooks object for every entry (it holds only the two functions), not one per layer.
        self._hooks = saved_tensors_hooks(synchronizer.push, synchronizer.pop)
        self._selective_hooks = saved_tensors_hooks(synchronizer.push_selective, synchronizer.pop)

    def stats(self) -> StepStats:
        """What the current (or last) step did; see ``OffloadSynchronizer.stats``."""
        return self.synchronizer.stats()

    @property
    def offload_synchronizer(self) -> OffloadSynchronizer:
        """The reference implementation's name for ``synchronizer``."""
        return self.synchronizer

    @eager_between_graphs
    def __enter__(self) -> "OffloadContext":
        sync = self.synchronizer
        if not sync.fwd_step():
            self._recomputing += 1
            return self
        hooks: Any = None
        layer, selective = sync.current, sync.current_selective
        if selective is None and layer is not None and DIRECT_HOOKS:
            # The layer's own pack hook, installed with torch's call: no object per layer.
            try:
                push_saved_tensors_hooks(layer.pack, unpack)
            except BaseException:
                sync.abort()
                raise
            hooks = _DIRECT
        elif layer is not None or selective is not None:
            hooks = self._hooks if selective is None else self._selective_hooks
            try:
                hooks.__enter__()
            except BaseException:
                sync.abort()
                raise
            if selective is not None:
                try:
                    selective.begin()  # records recipes while the layer runs
                except BaseException:
                    hooks.__exit__(None, None, None)
                    sync.abort()
                    raise
        self._frame = hooks
        _state.active = (sync, _state.active)
        return self

    @eager_between_graphs
    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        sync = self.synchronizer
        if self._recomputing:
            self._recomputing -= 1
            return False
        hooks, self._frame = self._frame, None
        active = _state.active
        if active is not None and active[0] is sync:
            _state.active = active[1]
        else:
            _state.active = _without(active, sync)
        if hooks is _DIRECT:
            pop_pushed_saved_tensors_hooks()
        elif hooks is not None:
            hooks.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            sync.abort()
        else:
            try:
                sync.end_fwd_layer()  # queues the layer's copies (pinned allocation may fail)
            except BaseException:
                sync.abort()
                raise
        return False


def is_cpu_offload_enabled() -> bool:
    """True while a layer runs inside an enabled V2 offload context on this thread."""
    return _state.active is not None


def active_synchronizer() -> Optional[OffloadSynchronizer]:
    """The synchronizer of the V2 offload context a layer runs inside now (this thread), or
    None (checkpoint offload policies hand their tensors to it)."""
    active = _state.active
    return active[0] if active is not None else None


def start_offload(*tensors: Optional[torch.Tensor], offload_base_tensor: bool = False) -> None:
    """Record that these tensors are final now, so their copy may start before they are saved
    for backward. Outside an offload context there is nothing to offload: no-op."""
    active = _state.active
    if active is None:
        return
    dev = active[0].device
    event = dev.record_event(dev.current_stream())
    for t in tensors:
        if t is None:
            continue
        if offload_base_tensor and t._base is not None:
            t = t._base  # every view of it, saved later, finds the event on its base
        for c in markers.component_tensors(t):
            setattr(c, markers.READY_EVENT_ATTR, event)


def _identity(x: Any) -> Any:
    return x


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: Optional[int] = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    manual_synchronization: bool = False,
    retain_pinned_cpu_buffers: bool = False,
    offload_stream: Optional[Any] = None,
    min_tensor_size_to_offload: int = DEFAULT_MIN_TENSOR_SIZE,
    synchronization_dict: Optional[dict] = None,
    device: Optional[OffloadDevice] = None,
    verify: Optional[bool] = None,
    max_host_bytes: Optional[int] = None,
) -> Union[Tuple[ContextManager, Callable], Tuple[ContextManager, Callable, Any]]:
    """V2 implementation of ``cpu_offload.get_cpu_offload_context`` (see ``cpu_offload.api``)."""
    check_context_types(
        enabled=enabled, num_layers=num_layers, model_layers=model_layers,
        offload_activations=offload_activations, offload_weights=offload_weights,
        double_buffering=double_buffering, manual_synchronization=manual_synchronization,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        min_tensor_size_to_offload=min_tensor_size_to_offload, verify=verify,
        max_host_bytes=max_host_bytes,
    )
    if not enabled:
        # As in the reference: a disabled context is a null context, whatever else is passed
        # (configs often set enabled=False and leave the other fields as they are).
        return (contextlib.nullcontext(), _identity, None) if manual_synchronization else (
            contextlib.nullcontext(), _identity
        )
    if not offload_activations and not offload_weights:
        raise OffloadConfigError(
            "neither activations nor weights are selected for offloading: set "
            "offload_activations=True (the usual choice) or offload_weights=True"
        )
    if offload_weights:
        warnings.warn(
            "offload_weights=True is deprecated and has no effect: weights stay on the GPU (the "
            "module holds them, so copying them would free nothing); drop the argument",
            DeprecationWarning,
            stacklevel=stacklevel_outside_package(),
        )
        if not offload_activations:
            return (contextlib.nullcontext(), _identity, None) if manual_synchronization else (
                contextlib.nullcontext(), _identity
            )
    if offload_stream is not None and not manual_synchronization:
        raise OffloadConfigError(
            "offload_stream is only used with manual synchronization: pass "
            "manual_synchronization=True, or drop offload_stream to let the default schedule "
            "create its own stream"
        )
    if manual_synchronization and synchronization_dict is not None:
        raise OffloadConfigError(
            "synchronization_dict configures the automatic schedule and cannot be combined with "
            "manual_synchronization=True; choose one"
        )
    check_int("min_tensor_size_to_offload", min_tensor_size_to_offload, minimum=0, unit="elements")
    check_int("max_host_bytes", max_host_bytes, minimum=0, allow_none=True,
              unit="bytes of pinned host memory; None: no limit")
    if verify is None:
        verify = os.environ.get(VERIFY_ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    check_int("model_layers", model_layers, minimum=1, meaning="the total number of layers")
    if manual_synchronization:
        schedule = None
    elif synchronization_dict is not None:
        schedule = Schedule(model_layers, validate_synchronization_dict(synchronization_dict, model_layers))
    else:
        for message in check_default_arguments(num_layers, model_layers):
            warnings.warn(message, UserWarning, stacklevel=stacklevel_outside_package())
        schedule = Schedule.default(num_layers, model_layers)
    if double_buffering:
        warnings.warn(
            "double_buffering has no effect in the V2 backend: reload buffers are allocated on "
            "the compute stream, which avoids the fragmentation double buffering worked around",
            DeprecationWarning,
            stacklevel=stacklevel_outside_package(),
        )
    device = device or default_device()
    policy = SelectionPolicy(
        offload_activations=True,
        offload_weights=False,  # deprecated, no effect (warned above)
        min_tensor_size_to_offload=min_tensor_size_to_offload,
        is_device_tensor=device.is_device_tensor,
    )
    synchronizer = OffloadSynchronizer(
        model_layers=model_layers,
        schedule=schedule,
        device=device,
        stream=offload_stream if offload_stream is not None else device.new_stream(),
        policy=policy,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        verify=bool(verify),
        max_host_bytes=max_host_bytes,
    )
    context = OffloadContext(synchronizer)
    if manual_synchronization:
        return context, synchronizer.sync, ManualOffloadSynchronizer(synchronizer)
    return context, synchronizer.sync
