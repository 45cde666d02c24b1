"""``get_cpu_offload_context``: one entry point, two backends.

The backend is chosen when the function is called, from ``NVTE_CPU_OFFLOAD_V1``: ``1`` selects
the legacy tag-based V1 (``cpu_offload.v1``), anything else the default V2
(``cpu_offload.v2``). ``is_cpu_offload_enabled`` and the marking helpers of ``control``
(``use_v1``) dispatch the same way. V1 is imported only when it is selected.
"""
from __future__ import annotations

import functools
import inspect
import os
import warnings
from typing import Any, Callable, ContextManager, Optional, Tuple, Union

import torch

from .core.checks import check_context_types
from .core.device import OffloadDevice
from .core.errors import OffloadConfigError, stacklevel_outside_package
from .v2.context import get_cpu_offload_context as v2_context
from .v2.context import is_cpu_offload_enabled as v2_enabled
from .v2.selection import DEFAULT_MIN_TENSOR_SIZE

V1_ENV = "NVTE_CPU_OFFLOAD_V1"


def use_v1() -> bool:
    """Whether the legacy backend is selected (read on every call, not cached)."""
    return os.environ.get(V1_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


_warned_not_enabled = False  # the "offload arguments without enabled=True" warning, once


def _warn_unless_enabled_given(fn: Callable) -> Callable:
    """``get_cpu_offload_context`` called with offload arguments but without ``enabled``
    returns a no-op context, as the reference does; say so once, naming ``enabled=True``."""
    names = list(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _warned_not_enabled
        given = set(names[: len(args)]) | set(kwargs)
        if given and "enabled" not in given and not _warned_not_enabled:
            _warned_not_enabled = True
            call = ", ".join(f"{name}=..." for name in sorted(given))
            warnings.warn(
                f"cpu_offload: get_cpu_offload_context({call}) was "
                "called without enabled=True, so offloading is off and the context does nothing "
                "(enabled defaults to False, as in the reference implementation); pass "
                "enabled=True to offload, or enabled=False to say that off is intended (this "
                "warning is given once)",
                UserWarning,
                stacklevel=stacklevel_outside_package(),
            )
        return fn(*args, **kwargs)

    return wrapper


@_warn_unless_enabled_given
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
    """Offload the activations of a stack of layers to CPU memory during forward, and reload
    them just in time for backward.

    Returns a context manager to wrap around each layer's forward and a *sync function* to pass
    each layer's output through. Tensors the layer saves for backward are copied to pinned CPU
    memory on a side stream as they are saved, their device memory is released a few layers
    later, and they are copied back during backward before they are needed; all of it overlaps
    compute and never blocks the host. Use it when activations, not weights, limit the batch
    size or sequence length and the model is a chain of layers (a transformer); compared with
    ``torch.autograd.graph.save_on_cpu``, which copies everything on the compute stream, only
    the first ``num_layers`` layers are offloaded and the copies overlap compute. Gradients are
    bit-identical to a run without offloading. ``apply_offloading`` does the same without
    changing the forward code.

    The backend is chosen on every call from the environment variable ``NVTE_CPU_OFFLOAD_V1``:
    the default V2 detects activations automatically; ``NVTE_CPU_OFFLOAD_V1=1`` selects the
    legacy V1, which offloads only tensors tagged with ``mark_activation_offload`` (README,
    "Backends").

    Args:
        enabled: ``False`` returns a no-op context and an identity sync function, whatever
            else is passed, so the same loop runs with and without offloading. Left out while
            other arguments are given, it warns once (``enabled=True`` switches offloading on).
        num_layers: default schedule: offload the first ``num_layers`` of ``model_layers``
            layers. Layer ``i`` is released before the forward of layer
            ``model_layers - num_layers + i`` and reloaded after that layer's backward, so at
            most ``model_layers - num_layers`` layers' activations are on the device at once.
            Must be smaller than ``model_layers``; ``model_layers - 1`` warns (no overlap).
        model_layers: how many ``with context:`` blocks one forward pass enters.
        offload_activations: offload activations (tensors that are not weights).
        offload_weights: deprecated, no effect: weights stay on the device (the module holds
            them, so copying them would free nothing); warns ``DeprecationWarning``.
        double_buffering: V1 only: two alternating reload buffers. V2 ignores it
            (``DeprecationWarning``).
        manual_synchronization: V2: you decide when each layer is offloaded, released and
            reloaded; a third return value, the ``ManualOffloadSynchronizer``, has
            ``start_offload_layer(i)``, ``release_activation_forward_gpu_memory(i)`` and
            ``start_reload_layer(i)``. For pipeline schedules (README, "Use (per layer, by hand)").
        retain_pinned_cpu_buffers: V2: keep the pinned host buffers at fixed addresses across
            steps (needed to capture forward and backward in a CUDA graph).
        offload_stream: V2 with ``manual_synchronization``: the CUDA stream the copies run on
            (contexts of several micro-batches may share one).
        min_tensor_size_to_offload: V2: saved tensors with fewer elements stay on the device
            (default ``256 * 1024``); small tensors cost more in per-copy overhead than they
            free.
        synchronization_dict: V2: ``{layer: (offload_fwd, offload_num, reload_fwd,
            reload_num)}`` instead of the default schedule: ``layer`` is released when
            ``offload_num`` layers have begun their forward (``offload_fwd=True``) or backward
            pass, and its reload starts when ``reload_num`` layers have begun theirs.
        device: where activations are offloaded from. ``None`` or ``"cuda"``: the current CUDA
            device. ``cpu_offload.SimulatedDevice()`` runs the same schedule on a CPU-only
            machine.
        verify: V2: check every reloaded storage against a checksum taken when its copy out was
            queued, and raise ``OffloadVerifyError`` (naming the layer and the awaited event) on
            a mismatch. For debugging: it adds device work and host synchronizations. ``None``:
            on if the environment variable ``CPU_OFFLOAD_VERIFY=1``.
        max_host_bytes: V2: pinned host memory this context may reserve, in bytes, page
            rounding included (default: no limit). Saved tensors beyond it stay on the device,
            with one warning naming the bytes a step needs.

    Returns:
        V2: ``(context, sync_function)``, or ``(context, sync_function, manual)`` with
        ``manual_synchronization=True`` (``manual`` is ``None`` when ``enabled=False``). V1:
        ``(context, group_prefetch_offload_commit)``, used
        the same way. ``sync_function(x)`` returns ``x`` (as a tensor autograd tracks: use the
        returned value). V2's ``context.stats()`` tells what the current or last step did
        (docs/apply.md, "What did it do?").

    Raises:
        OffloadConfigError: an argument or combination that cannot work, e.g. a flag that is
            not a ``bool`` (``enabled="False"``), a count that is not an ``int``, ``num_layers >=
            model_layers``, neither activations nor weights selected, an infeasible
            ``synchronization_dict`` entry, ``offload_stream`` without
            ``manual_synchronization``, or V2-only arguments while ``NVTE_CPU_OFFLOAD_V1=1``.
            The message names the fix.
        RuntimeError: ``enabled=True`` with ``device=None`` on a machine without CUDA (pass
            ``device=cpu_offload.SimulatedDevice()``).

    Example::

        >>> import torch, cpu_offload
        >>> layers = [torch.nn.Linear(64, 64) for _ in range(4)]
        >>> sim = cpu_offload.SimulatedDevice()   # leave device=None on a GPU
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=2, model_layers=len(layers),
        ...     min_tensor_size_to_offload=1, device=sim)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        >>> x.sum().backward()
        >>> len(sim.copies("d2h"))  # layers 0 and 1 copied their saved input to the CPU
        2
    """
    check_context_types(
        enabled=enabled, num_layers=num_layers, model_layers=model_layers,
        offload_activations=offload_activations, offload_weights=offload_weights,
        double_buffering=double_buffering, manual_synchronization=manual_synchronization,
        retain_pinned_cpu_buffers=retain_pinned_cpu_buffers,
        min_tensor_size_to_offload=min_tensor_size_to_offload, verify=verify,
        max_host_bytes=max_host_bytes,
    )
    # NumPy integers pass the checks (numbers.Integral): the backends get plain ints
    num_layers, model_layers, min_tensor_size_to_offload, max_host_bytes = (
        None if v is None else int(v)
        for v in (num_layers, model_layers, min_tensor_size_to_offload, max_host_bytes))
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
        # V1 is imported only when selected: a V2 program never loads the legacy backend.
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


def is_cpu_offload_enabled() -> bool:
    """Whether code runs inside an enabled offload context (of the backend
    ``NVTE_CPU_OFFLOAD_V1`` selects; V2 answers per thread).

    Use it in layer code that should behave differently while its activations may be offloaded,
    e.g. to call ``start_offload`` or ``mark_not_offload`` only then.

    Returns:
        ``True`` between ``with context:`` entry and exit of a context made with
        ``enabled=True``; ``False`` elsewhere, including inside a disabled context.

    Example::

        >>> import torch, cpu_offload
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, device=cpu_offload.SimulatedDevice())
        >>> with ctx:
        ...     print(cpu_offload.is_cpu_offload_enabled())
        True
        >>> cpu_offload.is_cpu_offload_enabled()
        False
    """
    if use_v1():
        from .v1 import is_cpu_offload_enabled as v1_enabled  # only when selected, as above

        return v1_enabled()
    return v2_enabled()
