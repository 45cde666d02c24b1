"""``get_cpu_offload_context`` of the V1 backend: argument checks and wiring."""
from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Callable, ContextManager, Optional, Tuple

import torch

from ..core.checks import check_context_types, check_int
from ..core.device import OffloadDevice
from ..core.errors import OffloadConfigError, stacklevel_outside_package
from .async_handler import AsyncDoubleBufferGroupOffloadHandler
from .commit import group_prefetch_offload_commit
from .hooks import CpuOffloadHookWithOffloadHandler
from .marking import tensor_need_offloading_checker_activations


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _check_layers(num_layers: object, model_layers: object) -> None:
    check_int("model_layers", model_layers, minimum=1,
              meaning="the number of layers wrapped in the offload context")
    check_int("num_layers", num_layers, minimum=0, meaning="the number of layers to offload")
    if num_layers >= model_layers:  # type: ignore[operator]
        if model_layers == 1:
            raise OffloadConfigError(
                f"num_layers={num_layers} must be smaller than model_layers=1: model_layers is "
                "the number of layers (`with ctx:` blocks) in one forward pass and defaults to "
                "1; pass model_layers=len(layers)"
            )
        raise OffloadConfigError(
            f"num_layers={num_layers} must be smaller than model_layers={model_layers}: the V1 "
            "layer-window schedule keeps at least one layer's activations on the device; pass "
            f"num_layers <= {model_layers - 1}, and model_layers=len(layers) (the number of "
            "layers in one forward pass)"
        )


def get_cpu_offload_context(
    enabled: bool = False,
    num_layers: int = 1,
    model_layers: int = 1,
    offload_activations: bool = True,
    offload_weights: bool = False,
    double_buffering: bool = False,
    *,
    device: Optional[OffloadDevice] = None,
) -> Tuple[ContextManager, Callable[[torch.Tensor], torch.Tensor]]:
    """Return ``(context, group_prefetch_offload_commit_async)``.

    Wrap each layer's forward in ``context`` and pass its output through the second element. Of
    the first ``num_layers`` of ``model_layers`` layers, the saved tensors tagged with
    ``mark_activation_offload`` are offloaded. ``device`` defaults to CUDA.
    """
    check_context_types(
        enabled=enabled, num_layers=num_layers, model_layers=model_layers,
        offload_activations=offload_activations, offload_weights=offload_weights,
        double_buffering=double_buffering,
    )
    if not enabled:
        return nullcontext(), _identity  # as in the reference: disabled never raises
    if not offload_weights and not offload_activations:
        raise OffloadConfigError(
            "CPU offloading is enabled while it is not mentioned what to offload: "
            "offload_activations=False and offload_weights=False; pass offload_activations=True"
        )
    if offload_weights:
        warnings.warn(
            "Offloading weights is deprecated: offload_weights=True has no effect (only "
            "activations are offloaded); drop the argument",
            DeprecationWarning,
            stacklevel=stacklevel_outside_package(),
        )
        if not offload_activations:
            return nullcontext(), _identity
    _check_layers(num_layers, model_layers)
    handler = AsyncDoubleBufferGroupOffloadHandler(
        num_offload_group=num_layers,
        num_model_group=model_layers,
        tensor_need_offloading_checker=tensor_need_offloading_checker_activations,
        double_buffering=double_buffering,
        device=device,
    )

    def group_prefetch_offload_commit_async(tensor: torch.Tensor) -> torch.Tensor:
        return group_prefetch_offload_commit(tensor, handler)

    context = CpuOffloadHookWithOffloadHandler(offload_handler=handler)
    return context, group_prefetch_offload_commit_async
