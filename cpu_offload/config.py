"""Megatron-style offloading configs: activations (``ActivationOffloadConfig`` ->
``build_offload_context``) and optimizer state (``OptimizerOffloadConfig`` ->
``build_hybrid_optimizer``).

Training frameworks configure offloading with flat flags (``cpu_offloading``,
``cpu_offloading_num_layers``, ...) next to model-parallel settings that decide whether offloading
can work at all. ``ActivationOffloadConfig`` carries both, ``validate()`` rejects the combinations
Megatron's CPU-offloading documentation lists (each message names the fix), and
``build_offload_context`` turns a valid config into ``get_cpu_offload_context(...)``.

Where this library differs from Megatron's documented constraints, on purpose:

- Pipeline parallelism works with ``manual_synchronization=True`` (the pipeline schedule drives
  ``ManualOffloadSynchronizer``); only PP > 1 with the default schedule is rejected.
- CUDA graphs work when pinned buffers are retained (``cpu_offloading_retain_pinned_cpu_buffers``),
  because a captured graph replays its copies into fixed host addresses; without it they are
  rejected, naming that flag.
- ``cpu_offloading_num_layers`` must lie in ``[0, num_layers - 1)``, Megatron's documented range:
  ``num_layers - 1`` would leave a single activation set on the GPU, so no transfer could overlap
  compute. Call ``get_cpu_offload_context`` directly to accept that (it only warns). ``0`` (offload
  nothing) is always accepted. With ``manual_synchronization`` the count is unused, not checked.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch

from .core.checks import bool_problem, int_problem, is_count
from .api import get_cpu_offload_context
from .core.errors import OffloadConfigError
from .optim import HybridDeviceOptimizer

_CONFIG_DERIVED = (
    "enabled", "num_layers", "model_layers", "offload_activations", "offload_weights",
    "double_buffering", "retain_pinned_cpu_buffers", "manual_synchronization",
)


@dataclass
class ActivationOffloadConfig:
    """Megatron-style activation-offloading settings, checked against the model settings that
    decide whether offloading can work.

    Training frameworks configure offloading with flat flags next to model-parallel and
    recomputation settings. Fill this from such a config (``from_object``), check it
    (``validate``: every violated constraint at once, each with its fix), and turn it into an
    offload context with ``build_offload_context``. Field names follow Megatron's
    ``TransformerConfig``.

    Args:
        num_layers: transformer layers of the model (on this pipeline stage); the context's
            ``model_layers``.
        cpu_offloading: switch offloading on (``get_cpu_offload_context(enabled=...)``).
        cpu_offloading_num_layers: offload the first ``k`` layers; in ``[0, num_layers - 1)``
            so that at least two layers' activations stay on the GPU and copies overlap compute.
        cpu_offloading_activations: offload activations (``offload_activations``).
        cpu_offloading_weights: ``offload_weights`` (deprecated, no effect: weights stay on
            the GPU).
        cpu_offloading_double_buffering: ``double_buffering`` (legacy V1 backend only).
        cpu_offloading_retain_pinned_cpu_buffers: ``retain_pinned_cpu_buffers``; required with
            CUDA graphs.
        pipeline_model_parallel_size: must be 1 unless ``manual_synchronization`` (the pipeline
            schedule then drives the offloading).
        recompute_granularity: must be ``None`` with offloading (recomputation decides what is
            kept for backward itself).
        cuda_graph_impl: ``"none"``, or a CUDA-graph mode (needs retained pinned buffers).
        fine_grained_activation_offloading: Megatron's other offloading mechanism; exclusive
            with ``cpu_offloading``.
        manual_synchronization: return the ``ManualOffloadSynchronizer`` too (pipelines).

    Example::

        >>> import cpu_offload
        >>> cfg = cpu_offload.ActivationOffloadConfig(
        ...     num_layers=4, cpu_offloading=True, cpu_offloading_num_layers=2)
        >>> ctx, sync = cpu_offload.build_offload_context(
        ...     cfg, device=cpu_offload.SimulatedDevice())
        >>> cfg.cpu_offloading_num_layers = 3
        >>> print(cfg.problems()[0])   # doctest: +ELLIPSIS
        cpu_offloading_num_layers=3 must be in [0, num_layers-1) for num_layers=4: ...
    """

    num_layers: int  # transformer layers of the model (on this pipeline stage)
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0
    cpu_offloading_activations: bool = True
    cpu_offloading_weights: bool = False
    cpu_offloading_double_buffering: bool = False
    cpu_offloading_retain_pinned_cpu_buffers: bool = False
    pipeline_model_parallel_size: int = 1
    recompute_granularity: Optional[str] = None
    cuda_graph_impl: str = "none"
    fine_grained_activation_offloading: bool = False
    manual_synchronization: bool = False

    @classmethod
    def from_object(cls, source: Any, **overrides: Any) -> "ActivationOffloadConfig":
        """Pick this config's fields by name from a framework config (attributes or a mapping),
        e.g. a Megatron ``TransformerConfig``; fields it lacks keep their defaults."""
        values = _fields_of(cls, source, overrides)
        if "num_layers" not in values:
            raise OffloadConfigError(
                "num_layers (the model's layer count) is missing from the source config; pass "
                "num_layers=... as an override"
            )
        return cls(**values)

    def problems(self) -> list[str]:
        """Every violated constraint, each with its fix (empty: valid)."""
        out: list[str] = []
        n = self.num_layers
        _add(out, int_problem("num_layers", n, minimum=1, meaning="the model's layer count"))
        # "false" is a non-empty string, so it would switch a feature *on*.
        out.extend(_bool_field_problems(self))
        if out or not self.cpu_offloading:
            return out
        k = self.cpu_offloading_num_layers
        if self.fine_grained_activation_offloading:
            out.append(
                "fine_grained_activation_offloading cannot be combined with cpu_offloading: set "
                "one of them to False"
            )
        if not self.cpu_offloading_activations and not self.cpu_offloading_weights:
            out.append(
                "cpu_offloading is on but neither cpu_offloading_activations nor "
                "cpu_offloading_weights is set: set cpu_offloading_activations=True (or "
                "cpu_offloading_weights=True), or cpu_offloading=False"
            )
        pp = self.pipeline_model_parallel_size
        problem = int_problem("pipeline_model_parallel_size", pp, minimum=1)
        if problem is not None:
            out.append(problem)
        elif pp > 1 and not self.manual_synchronization:
            out.append(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} needs "
                "manual_synchronization=True (the default schedule assumes all forwards, then all "
                "backwards); drive ManualOffloadSynchronizer from the pipeline schedule, or set "
                "pipeline_model_parallel_size=1"
            )
        if self.recompute_granularity is not None:
            out.append(
                f"recompute_granularity={self.recompute_granularity!r} cannot be combined with "
                "cpu_offloading (both decide what is kept for backward, and recomputation's "
                "saved-tensor hooks would bypass the offload hooks): set "
                "recompute_granularity=None, or cpu_offloading=False"
            )
        graphs = self.cuda_graph_impl not in ("none", None)
        if graphs and not self.cpu_offloading_retain_pinned_cpu_buffers:
            out.append(
                f"cuda_graph_impl={self.cuda_graph_impl!r} with cpu_offloading needs "
                "cpu_offloading_retain_pinned_cpu_buffers=True (a captured graph replays copies "
                "into fixed pinned buffers), or set cuda_graph_impl='none'"
            )
        problem = int_problem("cpu_offloading_num_layers", k)
        if problem is not None:
            out.append(problem)
        elif not self.manual_synchronization and is_count(n) and n >= 1:
            # Offloading no layer (k = 0) is always allowed, even for a one-layer model.
            if k != 0 and not 0 <= k < n - 1:
                out.append(
                    f"cpu_offloading_num_layers={k} must be in [0, num_layers-1) for "
                    f"num_layers={n}: at least two layers' activations must stay on the GPU for "
                    "transfers to overlap compute; set cpu_offloading_num_layers <= "
                    f"{max(n - 2, 0)}"
                )
        return out

    def validate(self) -> "ActivationOffloadConfig":
        """Raise ``OffloadConfigError`` listing every violated constraint; return ``self``."""
        return _raise_problems(self, "activation")


def _add(out: list, problem: Optional[str]) -> None:
    if problem is not None:
        out.append(problem)


def _bool_field_problems(cfg: Any) -> list:
    """Every ``bool`` field of the config dataclass ``cfg`` that holds something else."""
    out: list = []
    for f in dataclasses.fields(cfg):
        if f.type in ("bool", bool):
            _add(out, bool_problem(f.name, getattr(cfg, f.name)))
    return out


def _fields_of(cls: type, source: Any, overrides: dict) -> dict:
    values = {}
    for f in dataclasses.fields(cls):
        if isinstance(source, Mapping):
            if f.name in source:
                values[f.name] = source[f.name]
        elif hasattr(source, f.name):
            values[f.name] = getattr(source, f.name)
    values.update(overrides)
    return values


def _raise_problems(cfg: Any, what: str) -> Any:
    problems = cfg.problems()
    if len(problems) == 1:
        raise OffloadConfigError(f"invalid {what} offload config: {problems[0]}")
    if problems:
        raise OffloadConfigError(
            f"invalid {what} offload config:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return cfg


def build_offload_context(cfg: ActivationOffloadConfig, **kwargs: Any) -> Any:
    """The offload context an ``ActivationOffloadConfig`` describes.

    Validates ``cfg``, then calls ``get_cpu_offload_context`` with the arguments the config
    decides (``enabled``, ``num_layers``, ``model_layers``, ...). Use it to configure offloading
    from a training framework's flags; call ``get_cpu_offload_context`` directly otherwise.

    Args:
        cfg: the config.
        **kwargs: passed through to ``get_cpu_offload_context`` (``device``,
            ``offload_stream``, ``min_tensor_size_to_offload``, ``synchronization_dict``, ...).

    Returns:
        What ``get_cpu_offload_context`` returns: ``(context, sync)``, or with
        ``manual_synchronization`` also the ``ManualOffloadSynchronizer``.

    Raises:
        OffloadConfigError: ``cfg`` violates a constraint (all are listed), or ``kwargs`` set an
            argument the config decides.

    Example::

        >>> import torch, cpu_offload
        >>> cfg = cpu_offload.ActivationOffloadConfig(
        ...     num_layers=4, cpu_offloading=True, cpu_offloading_num_layers=2)
        >>> ctx, sync = cpu_offload.build_offload_context(
        ...     cfg, device=cpu_offload.SimulatedDevice(), min_tensor_size_to_offload=1)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> for layer in [torch.nn.Linear(8, 8) for _ in range(4)]:
        ...     with ctx:
        ...         x = layer(x)
        ...     x = sync(x)
        >>> x.sum().backward()
    """
    cfg.validate()
    clash = sorted(set(kwargs) & set(_CONFIG_DERIVED))
    if clash:
        raise OffloadConfigError(
            f"{', '.join(clash)} come from the config; set the corresponding "
            "ActivationOffloadConfig field instead of passing them to build_offload_context"
        )
    return get_cpu_offload_context(
        enabled=cfg.cpu_offloading,
        num_layers=cfg.cpu_offloading_num_layers,
        model_layers=cfg.num_layers,
        offload_activations=cfg.cpu_offloading_activations,
        offload_weights=cfg.cpu_offloading_weights,
        double_buffering=cfg.cpu_offloading_double_buffering,
        retain_pinned_cpu_buffers=cfg.cpu_offloading_retain_pinned_cpu_buffers,
        manual_synchronization=cfg.manual_synchronization,
        **kwargs,
    )


@dataclass
class OptimizerOffloadConfig:
    """Megatron-style optimizer-offloading settings (Megatron ``OptimizerConfig`` names and
    defaults) plus the optimizer and precision settings they are checked against.

    Fill it from a framework config (``from_object``), check it (``validate``), and build the
    optimizer with ``build_hybrid_optimizer``.

    Constraints when ``optimizer_cpu_offload`` is on (each error names the fix):

    - ``optimizer_offload_fraction`` in [0, 1];
    - ``use_distributed_optimizer=True`` (Megatron requires it: it builds the hybrid optimizer
      inside its distributed optimizer. This library does not need it, but a config that
      validates here also runs there);
    - ``optimizer='adam'`` with ``decoupled_weight_decay=True``: the CPU part is AdamW;
    - ``main_params_dtype=torch.float32``: the CPU part keeps fp32 master weights;
    - ``fp16=False``: gradients leave for the CPU during backward, before a loss scaler could
      unscale them (use bf16).

    ``use_torch_optimizer_for_cpu_offload=True`` runs plain ``torch.optim.AdamW`` with the given
    arguments on both parts (torch's per-device default implementation: for-loop on the CPU);
    ``False`` the library default, fused AdamW on both. ``overlap_cpu_optimizer_d2h_h2d`` picks
    ``overlap="backward_update"`` (else ``"none"``); ``clip_grad > 0`` becomes ``max_grad_norm``.

    Example::

        >>> import torch, cpu_offload
        >>> cfg = cpu_offload.OptimizerOffloadConfig(
        ...     optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
        >>> cfg.validate() is cfg
        True
        >>> cpu_offload.OptimizerOffloadConfig(
        ...     optimizer_cpu_offload=True, optimizer_offload_fraction=1.5).validate()
        Traceback (most recent call last):
        ...
        cpu_offload.OffloadConfigError: invalid optimizer offload config: optimizer_offload_fraction=1.5 must be in [0.0, 1.0] (the share of parameter bytes whose optimizer state lives on the CPU)
    """

    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 0.0
    overlap_cpu_optimizer_d2h_h2d: bool = False
    use_torch_optimizer_for_cpu_offload: bool = False
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    optimizer: str = "adam"
    decoupled_weight_decay: bool = True
    use_distributed_optimizer: bool = True
    main_params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    clip_grad: float = 0.0

    @classmethod
    def from_object(cls, source: Any, **overrides: Any) -> "OptimizerOffloadConfig":
        """Pick this config's fields by name from a framework config (e.g. Megatron's
        ``OptimizerConfig``) or a mapping; fields it lacks keep their defaults."""
        return cls(**_fields_of(cls, source, overrides))

    def problems(self) -> list[str]:
        """Every violated constraint, each with its fix (empty: valid)."""
        out: list[str] = _bool_field_problems(self)
        if out or not self.optimizer_cpu_offload:
            return out
        f = self.optimizer_offload_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            out.append(
                f"optimizer_offload_fraction={f!r} must be in [0.0, 1.0] (the share of parameter "
                "bytes whose optimizer state lives on the CPU)"
            )
        if not self.use_distributed_optimizer:
            out.append(
                "optimizer_cpu_offload requires use_distributed_optimizer=True (as in Megatron): "
                "set it, or optimizer_cpu_offload=False"
            )
        if self.optimizer != "adam":
            out.append(
                f"optimizer={self.optimizer!r}: CPU offloading supports optimizer='adam' (AdamW) "
                "only; set optimizer='adam', or optimizer_cpu_offload=False"
            )
        if not self.decoupled_weight_decay:
            out.append(
                "CPU offloading runs AdamW: set decoupled_weight_decay=True, or "
                "optimizer_cpu_offload=False"
            )
        if self.main_params_dtype != torch.float32:
            out.append(
                f"main_params_dtype={self.main_params_dtype} with optimizer_cpu_offload: the CPU "
                "part keeps fp32 master weights; set main_params_dtype=torch.float32"
            )
        if self.fp16:
            out.append(
                "fp16=True with optimizer_cpu_offload: gradients are copied to the CPU during "
                "backward, before a loss scaler could unscale them; train in bf16 (fp16=False)"
            )
        if not isinstance(self.clip_grad, (int, float)) or self.clip_grad < 0:
            out.append(f"clip_grad must be >= 0 (0 disables clipping), got {self.clip_grad!r}")
        return out

    def validate(self) -> "OptimizerOffloadConfig":
        """Raise ``OffloadConfigError`` listing every violated constraint; return ``self``."""
        return _raise_problems(self, "optimizer")


def build_hybrid_optimizer(
    cfg: OptimizerOffloadConfig, params: Iterable[Any], **kwargs: Any
) -> torch.optim.Optimizer:
    """The optimizer an ``OptimizerOffloadConfig`` describes, for ``params``.

    Validates ``cfg``, then builds a ``cpu_offload.optim.HybridDeviceOptimizer`` (with
    ``optimizer_cpu_offload``) or a plain ``torch.optim.AdamW`` (without).

    Args:
        cfg: the config.
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
        **kwargs: the optimizer's arguments (``lr``, ``betas``, ``weight_decay``, ...) and, for
            the hybrid optimizer, its keyword-only options (``device``, ``overlap``,
            ``bucket_bytes``, ...).

    Returns:
        A ``torch.optim.Optimizer``.

    Raises:
        OffloadConfigError: ``cfg`` violates a constraint (all are listed), ``kwargs`` set an
            argument the config decides (``offload_fraction``, ``max_grad_norm``, ...), or what
            ``HybridDeviceOptimizer`` rejects.

    Example::

        >>> import torch, cpu_offload
        >>> model = torch.nn.Linear(8, 8)
        >>> cfg = cpu_offload.OptimizerOffloadConfig(
        ...     optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
        >>> opt = cpu_offload.build_hybrid_optimizer(
        ...     cfg, model.parameters(), lr=1e-3, device=cpu_offload.SimulatedDevice())
        >>> model(torch.randn(4, 8)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.close()
    """
    cfg.validate()
    if not cfg.optimizer_cpu_offload:
        return torch.optim.AdamW(params, **kwargs)
    decided = {"offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls", "pin_cpu_grads",
               "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d", "max_grad_norm"}
    clash = sorted(set(kwargs) & decided)
    if clash:
        raise OffloadConfigError(
            f"{', '.join(clash)} come from the config; set the corresponding "
            "OptimizerOffloadConfig field instead of passing them to build_hybrid_optimizer"
        )
    cls = torch.optim.AdamW if cfg.use_torch_optimizer_for_cpu_offload else None
    return HybridDeviceOptimizer(
        params,
        offload_fraction=cfg.optimizer_offload_fraction,
        cpu_optimizer_cls=cls,
        gpu_optimizer_cls=cls,
        pin_cpu_grads=cfg.pin_cpu_grads,
        pin_cpu_params=cfg.pin_cpu_params,
        overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
        max_grad_norm=cfg.clip_grad or None,
        **kwargs,
    )
