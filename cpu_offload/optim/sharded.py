"""DTensor parameters (FSDP2's ``fully_shard``): each rank offloads a share of its own shards.

``HybridDeviceOptimizer``'s parts (``device_part``, ``cpu_part``, ``stream_update``) update plain
tensors. For a DTensor parameter they update a *stand-in*: a plain leaf tensor over the storage
of the parameter's local shard (``compat.local_tensor``), so that what they write is what FSDP2
all-gathers next. ``ShardedParams`` keeps the stand-ins and is the one place that translates:

- **Gradients.** FSDP2 runs the sharded parameter's post-accumulate-grad hooks once its
  reduce-scattered gradient is final (``compat`` says where and on which stream); the hook gives
  the local shard of that gradient (``grad``), which also becomes the stand-in's ``.grad``.
  ``step()`` and ``zero_grad()`` first take every stand-in's ``.grad`` from the parameter's
  ``.grad`` as it is then (``sync_grads``: the user may have replaced or cleared it), and drop
  them when they return (``drop_grads``: a stand-in does not keep a gradient alive).
- **State.** The parts keep local tensors. ``state_dict()`` and ``opt.state`` show each state
  tensor shaped like the shard as a DTensor laid out as its parameter (``shard_state``), as
  ``torch.optim.AdamW`` over FSDP2 parameters keeps it, so that
  ``torch.distributed.checkpoint`` saves and reshards it; offloaded state stays in CPU memory
  (a DTensor over a CPU shard, as FSDP2's own ``CPUOffloadPolicy`` makes). ``load_state_dict``
  takes those DTensors back to local tensors (``local_state``).

Placement is chosen from the local shards' bytes on each rank, so ranks whose shards have the
same shapes (even sharding; HSDP replicas) make the same choice.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from ..compat import dtensor_layout, dtensor_like, fsdp_module_class, fsdp_offloads_to_cpu, is_dtensor, local_tensor
from ..core.errors import OffloadConfigError, OffloadUsageError

__all__ = ["ShardedParams", "fsdp_roots"]

CPU_OFFLOAD_POLICY_ERROR = (
    "FSDP2's CPUOffloadPolicy already keeps these parameters, their gradients and the optimizer "
    "step on the CPU; HybridDeviceOptimizer offloads the optimizer state of parameters on the "
    "accelerator. Drop offload_policy=CPUOffloadPolicy() from fully_shard to use it, or keep "
    "the policy and step with torch.optim.AdamW")


class ShardedParams:
    """The DTensor parameters of one optimizer and their stand-ins (see the module docstring).
    Plain parameters pass through: ``key(p)`` is ``p`` itself."""

    def __init__(self) -> None:
        self._stand_in: dict[int, torch.Tensor] = {}  # id(param) -> stand-in
        self._param: dict[int, torch.Tensor] = {}  # id(stand-in) -> param

    def __bool__(self) -> bool:
        return bool(self._stand_in)

    def key(self, p: torch.Tensor) -> torch.Tensor:
        """What the parts update for ``p``: its stand-in (``add``), or ``p``."""
        return self._stand_in.get(id(p), p)

    def add(self, p: torch.Tensor) -> torch.Tensor:
        """``key(p)``, making the stand-in of a DTensor parameter not seen before."""
        if id(p) in self._stand_in or not is_dtensor(p):
            return self.key(p)
        shard = local_tensor(p)
        if shard.device.type == "cpu" and p.device_mesh.device_type != "cpu":
            raise OffloadConfigError(f"parameter {tuple(p.shape)} has its shard in CPU memory: "
                                     + CPU_OFFLOAD_POLICY_ERROR)
        if not p.is_leaf:
            raise OffloadConfigError(f"parameter {tuple(p.shape)} must be a leaf tensor")
        with torch.no_grad():
            stand_in = shard.detach()  # the shard's storage and version counter
        stand_in.requires_grad_(p.requires_grad)
        self._stand_in[id(p)] = stand_in
        self._param[id(stand_in)] = p
        return stand_in

    def param(self, key: torch.Tensor) -> torch.Tensor:
        """The user's parameter for what ``key`` returned."""
        return self._param.get(id(key), key)

    def is_sharded(self, p: torch.Tensor) -> bool:
        return id(p) in self._stand_in

    # -- gradients ---------------------------------------------------------------------------

    def grad(self, p: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(key, gradient)`` for a hook on ``p``: the stand-in and the local shard of
        ``p.grad`` (set as the stand-in's ``.grad``), or ``(p, p.grad)``."""
        stand_in = self._stand_in.get(id(p))
        if stand_in is None:
            return p, p.grad
        self._check_shard(p, stand_in)
        stand_in.grad = None if p.grad is None else local_tensor(p.grad)
        return stand_in, stand_in.grad

    def sync_grads(self) -> None:
        """Every stand-in's ``.grad`` from its parameter's ``.grad`` as it is now."""
        for stand_in in self._stand_in.values():
            p = self._param[id(stand_in)]
            self._check_shard(p, stand_in)
            stand_in.grad = None if p.grad is None else local_tensor(p.grad)

    @staticmethod
    def _check_shard(p: torch.Tensor, stand_in: torch.Tensor) -> None:
        """Refuse to go on when ``p``'s local shard is no longer the memory the parts update:
        their updates would be lost. Same values in new memory is FSDP2's doing (before torch
        2.11 its lazy initialization, at the model's first forward, moves an uneven shard to
        new padded memory); other values, the user's (``load_state_dict(assign=True)``)."""
        shard = local_tensor(p)
        if not stand_in.numel() or shard.data_ptr() == stand_in.data_ptr():
            return
        if shard.shape == stand_in.shape and bool(torch.equal(shard, stand_in)):
            raise OffloadUsageError(
                f"parameter {tuple(p.shape)}: FSDP2 moved its local shard to new memory at the "
                f"model's first forward (torch {torch.__version__} re-pads uneven shards when "
                "fully_shard's lazy initialization runs), after HybridDeviceOptimizer was built "
                "over the old memory, so updates would be lost: build the optimizer after one "
                "forward of the model (e.g. `with torch.no_grad(): model(batch)`), or use torch "
                ">= 2.11, whose FSDP2 keeps the memory")
        raise OffloadUsageError(
            f"parameter {tuple(p.shape)}: its local shard was replaced after the optimizer "
            "was built (e.g. load_state_dict(assign=True) or .data = ...), so updates would "
            "go to the old one: build the optimizer over the model's final parameters, or "
            "load weights in place (model.load_state_dict(sd))")

    def drop_grads(self) -> None:
        for stand_in in self._stand_in.values():
            stand_in.grad = None

    # -- state -----------------------------------------------------------------------------

    def state_view(self, p: torch.Tensor, state: Optional[dict]) -> Optional[dict]:
        """``p``'s state (local tensors) as torch keeps a DTensor parameter's: tensors shaped
        like the shard (not 0-d ones, such as ``step``) as DTensors over the same memory."""
        stand_in = self._stand_in.get(id(p))
        if stand_in is None or not state:
            return state
        return {k: self._as_dtensor(v, p, stand_in) for k, v in state.items()}

    @staticmethod
    def _as_dtensor(v: Any, p: torch.Tensor, stand_in: torch.Tensor) -> Any:
        if torch.is_tensor(v) and v.dim() > 0 and v.shape == stand_in.shape and not is_dtensor(v):
            return dtensor_like(v, p)
        return v

    def shard_state(self, state_dict: dict, params: Sequence[torch.Tensor]) -> dict:
        """``state_dict()`` with the state of DTensor parameters (``params``: the optimizer's, in
        index order) as DTensors (``state_view``)."""
        if not self:
            return state_dict
        state = {i: (self.state_view(params[i], entry) if isinstance(i, int) and i < len(params) else entry)
                 for i, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def local_state(self, state_dict: dict, params: Sequence[torch.Tensor]) -> dict:
        """A state dict to load, with each DTensor in the state of a DTensor parameter as its
        local shard; its layout must be the parameter's (DCP's ``set_optimizer_state_dict``
        reshards a checkpoint to it)."""
        if not self or "state" not in state_dict or "param_groups" not in state_dict:
            return state_dict
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        by_id = dict(zip(saved_ids, params))
        state = {}
        for i, entry in state_dict["state"].items():
            p = by_id.get(i)
            if p is not None and self.is_sharded(p) and isinstance(entry, dict):
                entry = {k: self._local(v, p, k) for k, v in entry.items()}
            state[i] = entry
        return {**state_dict, "state": state}

    def _local(self, v: Any, p: torch.Tensor, name: str) -> Any:
        if not is_dtensor(v):
            shard = self._stand_in[id(p)]
            if torch.is_tensor(v) and v.dim() > 0 and v.shape != shard.shape:
                raise ValueError(
                    f"state {name!r} of parameter {tuple(p.shape)} has shape {tuple(v.shape)}, not "
                    f"this rank's shard's {tuple(shard.shape)}: load a sharded state dict (DTensor "
                    "state, as state_dict() or get_optimizer_state_dict give it)")
            return v
        if dtensor_layout(v) != dtensor_layout(p):
            raise ValueError(
                f"state {name!r} of parameter {tuple(p.shape)} is a DTensor laid out as "
                f"{tuple(v.placements)} over {v.device_mesh} with shape {tuple(v.shape)}, the "
                f"parameter as {tuple(p.placements)} over {p.device_mesh} with shape "
                f"{tuple(p.shape)}: load it with torch.distributed.checkpoint's "
                "set_optimizer_state_dict, which reshards it to the parameter's layout")
        return local_tensor(v)


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules in ``model`` (``model`` itself if it is one). The forward of
    each starts with its root pre-forward hook, where FSDP2 orders its all-gather streams after
    the compute stream once per forward. Raises if one keeps its parameters on the CPU
    (``CPUOffloadPolicy``)."""
    cls = fsdp_module_class()
    if cls is None:
        return []
    roots: list[nn.Module] = []
    inner: set[int] = set()
    for m in model.modules():
        if not isinstance(m, cls):
            continue
        if fsdp_offloads_to_cpu(m):
            raise OffloadConfigError(f"{type(m).__name__} was sharded with "
                                     + CPU_OFFLOAD_POLICY_ERROR)
        if id(m) not in inner:
            roots.append(m)
        inner.update(id(sub) for sub in m.modules())
    return roots
