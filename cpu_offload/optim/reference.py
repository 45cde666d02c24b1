"""The baselines the hybrid optimizer is compared with.

``MasterWeightOptimizer``: a plain optimizer over master copies of the parameters (fp32 for
bf16/fp16 parameters, the parameter's dtype for fp32/fp64 ones, as the hybrid optimizer's CPU
part keeps them), on the parameters' own device (what mixed-precision training does without
offloading). Used by the GPU tests and the benchmark's "plain" row.

``PlacedReference``: the exact reference of a ``HybridDeviceOptimizer`` whose placement is
known: the CPU class on CPU masters for its CPU part, the device class on the device for the
rest. On a GPU the two round differently, so this, not one class, is what the hybrid equals."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .cpu_update import master_dtype
from .guards import merge_edited
from .sharded import ShardedParams


class MasterWeightOptimizer:
    """``optimizer_cls`` (default: fused AdamW) over master copies of ``params``: fp32 for
    bf16/fp16 parameters, the parameter's own dtype otherwise (``cpu_update.master_dtype``).

    ``step()`` takes edits of the parameters since the last step into the masters
    (``guards.merge_edited``), converts each gradient to the master dtype (and device), steps,
    and copies the masters back (rounded to the parameter dtype). ``optimizer`` is the wrapped
    optimizer (for LR schedulers). ``master_device``: where the masters live (default: each
    parameter's device). ``in_place``: parameters stepped as they are, without a master.
    ``follow_edits=False`` skips taking edits (a full pass over every master each step): what a
    mixed-precision loop without offloading does, the benchmarks' baseline.
    ``fp32_masters=False``: masters in each parameter's own dtype (``master_dtype``).
    """

    def __init__(self, params: Iterable[torch.Tensor],
                 optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None, *,
                 master_device: Optional[torch.device] = None,
                 in_place: Iterable[torch.Tensor] = (), follow_edits: bool = True,
                 fp32_masters: bool = True, **kwargs: Any) -> None:
        self.params = list(params)
        self.follow_edits = follow_edits
        direct = {id(p) for p in in_place}
        self.masters = [p if id(p) in direct else p.detach().to(
            master_device or p.device, master_dtype(p.dtype, fp32_masters), copy=True) for p in self.params]
        if optimizer_cls is None:
            kwargs.setdefault("fused", True)
            optimizer_cls = torch.optim.AdamW
        self.optimizer = optimizer_cls(self.masters, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        masters = [(m, p) for m, p in zip(self.masters, self.params) if m is not p]
        for m, p in masters if self.follow_edits else ():
            merge_edited(m, p)  # a parameter edited since the last step: its master follows
        for m, p in masters:
            m.grad = None if p.grad is None else p.grad.to(m.device, m.dtype)
        self.optimizer.step()
        for m, p in masters:
            if m.grad is not None:
                p.copy_(m)
            m.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


def default_cls(kwargs: dict) -> Callable[..., torch.optim.Optimizer]:
    """The hybrid optimizer's default class: fused AdamW, unless ``kwargs`` set ``fused`` or
    ``foreach`` (then ``torch.optim.AdamW`` with them)."""
    if "fused" in kwargs or "foreach" in kwargs:
        return torch.optim.AdamW
    return lambda params, **kw: torch.optim.AdamW(params, fused=True, **kw)


class PlacedReference:
    """What a ``HybridDeviceOptimizer`` with a given placement computes, without offloading:
    ``cpu_optimizer_cls`` over CPU masters of the parameters it updates on the CPU (gradients
    copied to the CPU and converted), ``gpu_optimizer_cls`` over masters on the parameters'
    device for the others (its streamed part, and its device part with
    ``param_update_in_fp32``), and over the parameters themselves for ``in_place`` (its device
    part otherwise). Classes default as the hybrid's (fused AdamW). On ``SimulatedDevice`` this
    equals the wrapped class; on a GPU it is the exact reference. ``fp32_masters=False``
    (the hybrid's option of that name): CPU masters in each parameter's own dtype.

    ``params`` are the reference model's (a copy of the hybrid's model), ``on_cpu`` and
    ``in_place`` positions in them; ``like`` reads both from a hybrid optimizer. DTensor
    parameters (FSDP2) are stepped as the hybrid steps them: each rank over its local shards,
    from the local shards of their gradients.

    Example::

        >>> import torch, cpu_offload
        >>> from cpu_offload.optim import HybridDeviceOptimizer
        >>> from cpu_offload.optim.reference import PlacedReference
        >>> a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        >>> _ = b.load_state_dict(a.state_dict())
        >>> opt = HybridDeviceOptimizer(a.parameters(), 0.5, lr=0.1, stream_fraction=0,
        ...                             device=cpu_offload.SimulatedDevice())
        >>> ref = PlacedReference.like(opt, list(a.parameters()), b.parameters(), lr=0.1)
        >>> for m, o in ((a, opt), (b, ref)):
        ...     m(torch.ones(2, 4)).sum().backward()
        ...     o.step()
        >>> opt.close()
        >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
        True
    """

    def __init__(self, params: Iterable[torch.Tensor], on_cpu: Iterable[int],
                 cpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
                 gpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None, *,
                 in_place: Iterable[int] = (), fp32_masters: bool = True, **kwargs: Any) -> None:
        self.params = list(params)
        self._shards = ShardedParams()
        keys = [self._shards.add(p) for p in self.params]  # a DTensor's local shard, else p
        cpu, direct = set(on_cpu), set(in_place)
        here = [p for i, p in enumerate(keys) if i in cpu]
        there = [p for i, p in enumerate(keys) if i not in cpu]
        self.parts: list[MasterWeightOptimizer] = []
        if here:
            self.parts.append(MasterWeightOptimizer(
                here, cpu_optimizer_cls or default_cls(kwargs), master_device=torch.device("cpu"),
                fp32_masters=fp32_masters, **kwargs))
        if there:
            self.parts.append(MasterWeightOptimizer(
                there, gpu_optimizer_cls or default_cls(kwargs),
                in_place=[keys[i] for i in direct], **kwargs))

    @classmethod
    def like(cls, opt: Any, hybrid_params: Sequence[torch.Tensor], params: Iterable[torch.Tensor],
             cpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
             gpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
             **kwargs: Any) -> "PlacedReference":
        """The reference for ``opt`` over ``hybrid_params``, run on ``params`` (the same
        positions): ``opt.offloaded_params()`` on the CPU, ``opt.streamed_params()`` (unless
        ``fp32_masters=False``) and the device part's low-precision ones with
        ``param_update_in_fp32`` on device masters, the rest in place."""
        pos = {id(p): i for i, p in enumerate(hybrid_params)}
        on_cpu = {pos[id(p)] for p in opt.offloaded_params()}
        fp32 = opt.options.fp32_masters
        streamed = {pos[id(p)] for p in opt.streamed_params()}
        # streamed parameters are stepped on device masters, or in place where each is its own
        masters = set(streamed) if fp32 else set()
        if getattr(opt, "param_update_in_fp32", False):  # the device part's masters
            masters |= {i for i, p in enumerate(hybrid_params)
                        if master_dtype(p.dtype) != p.dtype and i not in streamed}
        in_place = [i for i in range(len(hybrid_params)) if i not in on_cpu | masters]
        return cls(params, on_cpu, cpu_optimizer_cls, gpu_optimizer_cls, in_place=in_place,
                   fp32_masters=fp32, **kwargs)

    def step(self) -> None:
        self._shards.sync_grads()
        try:
            for part in self.parts:
                part.step()
        finally:
            self._shards.drop_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
