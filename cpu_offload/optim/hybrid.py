"""``HybridDeviceOptimizer``: the facade over the three update paths (``device_part``,
``cpu_part``, ``stream_update`` with ``stream_backward``). It partitions the parameters, installs
the hooks, and runs one step in order: queue the streamed update (first, unless it must wait
for clipping: nothing in it waits on the host), validate the early work, copy the rest, clip,
update.
The parts see plain tensors: for a DTensor parameter (FSDP2) its local shard (``sharded``)."""
from __future__ import annotations

import collections
import contextlib
import functools
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from ..core.checks import check_bool
from ..core.device import OffloadDevice, default_device
from ..core.errors import OffloadConfigError, OffloadUsageError
from ..core.launcher import Launcher
from . import balance, ddp, forward_waits
from . import state as state_format
from .amp import LossScale
from .classes import build, check_cpu_class_dtypes, default_optimizer_cls, keeps_state, probe_class, warm_torch_optim
from .cpu_part import CpuPart, weak_call
from .cpu_update import IMPLEMENTATION_KEYS, STATE_WRITE_FIX, StateEntry, master_dtype
from .clipping import clip_by_global_norm
from .device_part import DevicePart
from .guards import GradsLaidOutAsParams, check_group_keys, snapshot_hypers
from .options import OptimizerOffloadOptions, split_options
from .overlap import overlap_mode
from .partition import (
    arrival_from_order, check_fraction, check_listed_once, check_offloadable, choose_offloaded, default_arrival,
    make_buckets,
)
from .sharded import ShardedParams
from .stream_update import StreamedPart, state_elems_per_param
from .transfer import TransferEngine
from .worker import CpuWorker, default_chunk_bytes, default_cpu_threads, worker_cores

class HybridDeviceOptimizer(torch.optim.Optimizer):
    r"""Keep ``offload_fraction`` of the optimizer state, and its update, in CPU memory.

    A drop-in ``torch.optim.Optimizer`` for parameters on one accelerator. The parameters whose
    gradients are final earliest in backward (the last layers), ``offload_fraction`` of the
    parameter bytes, keep master weights (fp32 for bf16/fp16 parameters; with
    ``fp32_masters=False`` their state stays in their own dtype, as the wrapped class keeps it on
    them) and state in CPU memory. Of those, ``stream_fraction`` are updated on the device by
    ``gpu_optimizer_cls`` from state streamed through it; the rest by ``cpu_optimizer_cls`` on
    a CPU worker thread, overlapped with backward (and with the next forward in
    ``overlap="next_forward"``). The other parameters are updated on the device as usual.
    FSDP2 (``fully_shard``) parameters: each rank does this over its own local shards, with the
    gradients FSDP2 reduce-scattered, and keeps DTensor state (docs/optimizer.md).

    **Exact.** With ``device=SimulatedDevice()`` the result equals the wrapped classes run
    directly. On a GPU the CPU part equals ``cpu_optimizer_cls`` run on the CPU over the same
    masters and the device parts equal ``gpu_optimizer_cls``; CPU and GPU kernels round
    differently, so which parameter goes where is part of the result. Whatever user code does
    between ``backward()`` and ``step()`` (clipping, ``torch.amp.GradScaler``, ``.grad.data``
    writes, collectives, hyperparameters changed in place) and to parameters after ``step()``,
    the result is the wrapped optimizer's: work started during backward is checked in
    ``step()`` against what it read (tensor, version, a sum of its bits) and redone where stale.

    **Reproducible.** No timing decides placement: ``stream_fraction="auto"`` plans from a fixed
    model of the host (``balance.MODEL_RATES``), ``"measure"`` times this host (rank 0's
    measurement under ``torch.distributed``); the choice is in ``opt.stream_fraction`` and in
    ``state_dict()``. Pass a number to pin it.

    Args:
        params: parameters or param-group dicts, all on one device.
        offload_fraction: share of parameter bytes offloaded, in [0, 1].
        cpu_optimizer_cls / gpu_optimizer_cls: the classes of the two sides (default:
            ``torch.optim.AdamW(fused=True)``, unless ``fused``/``foreach`` are given).
        param_update_in_fp32: fp32 masters for bf16/fp16 parameters of the device part too.
        pin_cpu_grads / pin_cpu_params: pinned (else pageable) host staging.
        overlap_cpu_optimizer_d2h_h2d: Megatron's switch, used when ``overlap`` is not given.
        device: the ``OffloadDevice`` (default: CUDA; ``SimulatedDevice()`` on a CPU).
        options: an ``OptimizerOffloadOptions``; its fields may also be given as keywords
            (``overlap``, ``max_grad_norm``, ``grad_order``, ``bucket_bytes``, ``cpu_threads``,
            ``cpu_chunk_bytes``, ``stream_fraction``, ``stream_budget_bytes``,
            ``bind_cpu_cores``, ``stream_during_backward``, ``fp32_masters``; see
            docs/optimizer.md).
        **optimizer_kwargs: hyperparameters for both classes (``lr``, ``weight_decay``, ...).

    Raises:
        OffloadConfigError: an argument out of range or of the wrong type (the message names the
            fix); parameters on several devices, non-leaf, or non-contiguous in the offloaded share.
        OffloadUsageError: ``step()`` after ``close()``; sparse gradients on offloaded
            parameters; ``next_forward`` without ``register_forward_waits``; a group key deleted,
            or an implementation key (``fused``...) set; ``copy.deepcopy`` or pickling.

    Example::

        >>> import torch, cpu_offload
        >>> from cpu_offload.optim import HybridDeviceOptimizer
        >>> dev = None if torch.cuda.is_available() else cpu_offload.SimulatedDevice()
        >>> where = "cuda" if dev is None else "cpu"
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(where, torch.bfloat16)
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-2,
        ...                             device=dev)
        >>> model(torch.randn(4, 8, device=where, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> opt.step(); opt.zero_grad()
        >>> sorted(opt.state[model[1].weight])      # state per parameter, with its fp32 master
        ['exp_avg', 'exp_avg_sq', 'master_weight', 'step']
        >>> opt.close()
    """

    _step_supports_amp_scaling = True  # GradScaler hands grad_scale / found_inf to step()

    def __init__(
        self,
        params: Iterable[Any],
        offload_fraction: float = 0.5,
        cpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
        gpu_optimizer_cls: Optional[Callable[..., torch.optim.Optimizer]] = None,
        param_update_in_fp32: bool = False,
        pin_cpu_grads: bool = True,
        pin_cpu_params: bool = True,
        overlap_cpu_optimizer_d2h_h2d: bool = True,
        *,
        device: Optional[OffloadDevice] = None,
        options: Optional[OptimizerOffloadOptions] = None,
        **optimizer_kwargs: Any,
    ) -> None:
        warm_torch_optim()
        self._closed = False
        opts, optimizer_kwargs = split_options(options, optimizer_kwargs)
        self.options = opts
        self.offload_fraction = check_fraction(offload_fraction)
        for name, flag in (("param_update_in_fp32", param_update_in_fp32), ("pin_cpu_grads", pin_cpu_grads),
                           ("pin_cpu_params", pin_cpu_params),
                           ("overlap_cpu_optimizer_d2h_h2d", overlap_cpu_optimizer_d2h_h2d)):
            check_bool(name, flag)
        self._mode = overlap_mode(opts.overlap, overlap_cpu_optimizer_d2h_h2d)
        self.overlap = self._mode.name
        self.max_grad_norm = opts.max_grad_norm
        self.stream_during_backward = opts.stream_during_backward
        self.stream_budget_bytes = opts.stream_budget_bytes
        opts.check_mode(self._mode)
        if device is not None and not isinstance(device, OffloadDevice):
            raise OffloadConfigError(
                f"device must be an OffloadDevice or None (CUDA), got {device!r}: on a machine "
                "without a GPU pass device=cpu_offload.SimulatedDevice()")
        if device is None and not torch.cuda.is_available():
            raise RuntimeError(
                "HybridDeviceOptimizer: CUDA is not available, and without device= the optimizer "
                "expects its parameters on a CUDA GPU. On a CPU-only machine pass "
                "HybridDeviceOptimizer(device=cpu_offload.SimulatedDevice()) (parameters on the "
                "CPU; the schedule runs in simulation)")
        self.param_update_in_fp32 = param_update_in_fp32
        self._device = device if device is not None else default_device()
        self._cpu_cls = cpu_optimizer_cls or default_optimizer_cls(optimizer_kwargs)
        self._gpu_cls = gpu_optimizer_cls or default_optimizer_cls(optimizer_kwargs)
        self._kwargs = dict(optimizer_kwargs)
        defaults = probe_class(self._gpu_cls, self._kwargs, "gpu_optimizer_cls")
        defaults.update(probe_class(self._cpu_cls, self._kwargs, "cpu_optimizer_cls"))
        # implementation choices (fused, foreach, ...) stay out of the wrapper's groups, so each
        # part keeps its own; state_dict() reports them as the wrapped class would
        self._implementation = {k: v for k, v in defaults.items() if k in IMPLEMENTATION_KEYS}
        self._keeps_state = keeps_state(self._make(self._cpu_cls))  # see state_format.gather
        defaults = {k: v for k, v in defaults.items() if k not in IMPLEMENTATION_KEYS}
        self._cpu_threads = opts.cpu_threads or default_cpu_threads()
        chunk_bytes = opts.cpu_chunk_bytes
        self._chunk_elems = (default_chunk_bytes(self._cpu_threads) if chunk_bytes is None else chunk_bytes) // 4
        self.stream_fraction: Optional[float] = None  # the streamed share chosen (see _split)
        self._balance: Optional[dict] = None
        self._parts: list[StreamedPart] = []
        self._streamed: dict[int, tuple[StreamedPart, int]] = {}  # id(param) -> (part, index)
        self._launcher: Optional[Launcher] = None
        self._state_probe: Optional[tuple[int, bool]] = None
        self._torch_device: Optional[torch.device] = None
        self._engine = TransferEngine(self._device, pin_cpu_grads, pin_cpu_params)
        self._hooks: list[Any] = []
        self._module_hooks: list[Any] = []
        self._waits: list[forward_waits.ForwardWaits] = []  # register_forward_waits' hooks
        self._partitioned: list[tuple[int, ...]] = []  # per group: ids of the parameters placed
        self._no_sync = 0
        self._ddp = False
        self.last_grad_norm: Optional[torch.Tensor] = None
        self._worker: Optional[CpuWorker] = None
        self._dev_part = DevicePart(self._make(self._gpu_cls), param_update_in_fp32)
        self._cpu: Optional[CpuPart] = None
        self._shards = ShardedParams()  # DTensor parameters and the local tensors the parts update
        super().__init__(params, defaults)
        self.state = state_format.StateView(weakref.ref(self))
        index = self._torch_device.index if self._torch_device is not None else None
        cuda_index = index if self._torch_device is not None and self._torch_device.type == "cuda" else None
        self._worker = CpuWorker(self._cpu_threads, cuda_index,
                                 worker_cores(self._cpu_threads, cuda_index) if opts.bind_cpu_cores else None)
        self._cpu = CpuPart(self._device, self._engine, self._worker, self._mode, self.max_grad_norm,
                            opts.fp32_masters)
        self._attach(range(len(self.param_groups)))
        self._finalizer = weakref.finalize(self, _finish_dropped, self._cpu, self._parts)
        self._finalizer.atexit = False

    # -- construction -------------------------------------------------------------------------

    @property
    def state(self) -> state_format.StateView:  # type: ignore[override]
        """``opt.state[p]``: a view of the parts' state; replacing it (torch's reset) raises."""
        return self.__dict__.get("_state_view", {})

    @state.setter
    def state(self, value: Any) -> None:
        if isinstance(value, state_format.StateView):
            self.__dict__["_state_view"] = value
        elif "_state_view" in self.__dict__:
            raise OffloadUsageError("opt.state cannot be replaced: the optimizer's parts keep the "
                                    f"state; {STATE_WRITE_FIX}")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, as ``torch.optim.Optimizer.add_param_group``; ``offload_fraction`` of its
        bytes are offloaded (pinned buffers for them are allocated here). A group that is refused
        (an ``OffloadConfigError`` from the checks of its parameters) is not added: ``step()``
        would otherwise leave its parameters as they are."""
        built = self._cpu is not None  # after construction; the constructor partitions globally
        if built:
            self._check_open("add_param_group")
        super().add_param_group(param_group)
        if built:
            try:
                self._drain_all()
                self._attach([len(self.param_groups) - 1])
            except BaseException:
                self.param_groups.pop()
                raise

    def _check_param(self, p: torch.Tensor, pos: int) -> None:
        """``p``: what the parts update (a DTensor parameter's local shard)."""
        if not self._device.is_device_tensor(p):
            raise OffloadConfigError(
                f"parameter {pos} is on {p.device}, not on the {self._device.name} device: move "
                "the model to the accelerator before building the optimizer (on a CPU-only "
                "machine pass device=cpu_offload.SimulatedDevice())")
        if self._torch_device is None:
            self._torch_device = p.device
        elif p.device != self._torch_device:
            raise OffloadConfigError(
                f"parameters are on several devices ({self._torch_device} and {p.device}): build "
                "one HybridDeviceOptimizer per device")
        if p.layout != torch.strided or not p.is_leaf:
            raise OffloadConfigError(
                f"parameter {pos} ({tuple(p.shape)}) must be a dense leaf tensor: build the "
                "optimizer over the model's own parameters")

    def _make(self, cls: Callable[..., torch.optim.Optimizer]) -> Callable[[list[dict]], torch.optim.Optimizer]:
        """A factory of ``cls`` over given groups; it holds no reference to the optimizer (no
        cycle: the optimizer is freed as soon as it is dropped)."""
        return functools.partial(build, cls, dict(self._kwargs))

    def _attach(self, group_ids: Iterable[int]) -> None:
        """Partition the parameters of ``group_ids``: of those with at least one dimension and
        one element, ``offload_fraction`` of the bytes by gradient arrival."""
        group_ids = list(group_ids)
        check_group_keys(self.param_groups, self.defaults, group_ids)
        entries = [(gi, p) for gi in group_ids for p in self.param_groups[gi]["params"]]
        check_listed_once(entries)
        keys = [self._shards.add(p) for _, p in entries]  # a DTensor's local shard, else p
        for pos, key in enumerate(keys):
            self._check_param(key, pos)
        if self._shards and self.max_grad_norm is not None:
            raise OffloadConfigError(
                "max_grad_norm clips this rank's gradients, and FSDP2's norm spans every rank: "
                "call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) between "
                "backward() and step() instead (exact; step() redoes the copies it makes stale)")
        params = [p for _, p in entries]
        sizes = [k.numel() * k.element_size() for k in keys]
        order = self.options.grad_order
        arrival = arrival_from_order(params, order) if order is not None else default_arrival(len(params))
        # zero-size and 0-dim parameters stay on the device: nothing (or one number) to offload,
        # and a 0-dim parameter's state is all shaped like it (AdamW's step count too)
        chosen = [i for i in choose_offloaded(sizes, arrival, self.offload_fraction)
                  if sizes[i] > 0 and params[i].dim() > 0]
        check_offloadable(keys, chosen)
        offloaded = set(chosen)
        hypers = snapshot_hypers(self.param_groups)
        on_cpu, streamed = self._split([keys[i] for i in chosen], chosen, hypers)
        check_cpu_class_dtypes(self._cpu_cls, self._kwargs, {master_dtype(keys[i].dtype, self.options.fp32_masters)
                                                             for i in on_cpu})
        if streamed:
            self._add_streamed([keys[i] for i in streamed], [entries[i][0] for i in streamed], hypers,
                               [params[i] for i in streamed])
        for order_ in make_buckets(on_cpu, sizes, self.options.bucket_bytes):
            self._cpu.add_bucket([keys[i] for i in order_], [entries[i][0] for i in order_], hypers,
                                 self._make(self._cpu_cls), self._chunk_elems)
        if self._mode.copies_in_backward:  # on the user's parameter: FSDP2 runs a shard's hooks
            hook = weak_call(self, "_on_grad")
            for i in on_cpu:
                if params[i].requires_grad:
                    self._hooks.append(params[i].register_post_accumulate_grad_hook(hook))
        device_groups = []
        for gi in dict.fromkeys(gi for gi, _ in entries):
            rest = [k for (g, _), k, i in zip(entries, keys, range(len(entries))) if g == gi and i not in offloaded]
            if rest:
                device_groups.append((gi, rest, hypers[gi]))
        self._dev_part.add_groups(device_groups)
        self._partitioned += [tuple(map(id, self.param_groups[gi]["params"])) for gi in group_ids]

    def _add_streamed(self, params: list[torch.Tensor], group_ids: list[int], hypers: list[dict],
                      hooked: list[torch.Tensor]) -> None:
        if (self.stream_during_backward or self._mode.forward_waits) and self._launcher is None:
            self._launcher = self._device.host_launcher(params[0].device)
        part = StreamedPart(self._device, params, group_ids, hypers, self._make(self._gpu_cls),
                            self.stream_budget_bytes, *self._state_probe, overlapped=self._mode.forward_waits,
                            fp32_masters=self.options.fp32_masters,
                            early=self.stream_during_backward, launcher=self._launcher)
        self._parts.append(part)
        self._streamed.update((id(p), (part, k)) for k, p in enumerate(part.params))
        if part.backward is not None:  # chunks start updating as their gradients land
            hook = weak_call(self, "_on_streamed_grad")
            self._hooks += [p.register_post_accumulate_grad_hook(hook) for p in hooked if p.requires_grad]

    def _split(self, params: list[torch.Tensor], chosen: list[int],
               hypers: list[dict]) -> tuple[list[int], list[int]]:
        """``chosen`` (offloaded, in arrival order) as (CPU part, streamed part): the CPU takes the
        earliest gradients (its updates overlap backward), see ``balance.split``."""
        request = self.options.stream_fraction
        if request == 0 or not params:
            self.stream_fraction = self.stream_fraction or 0.0
            return chosen, []
        if self._state_probe is None:
            self._state_probe = state_elems_per_param(self._make(self._gpu_cls))

        def rates() -> dict:
            if request == "auto":
                return balance.planning_rates(self._device)
            return balance.rates(self._device, params[0].device, lambda: balance.cpu_update_probe(
                params[0].dtype, self._make(self._cpu_cls), hypers[0], self._chunk_elems,
                fp32_masters=self.options.fp32_masters), self._cpu_threads)

        on_cpu, self._balance = balance.split(params, request, self._state_probe[0], rates,
                                              log=self.stream_fraction is None,
                                              fp32_masters=self.options.fp32_masters)
        self.stream_fraction = self._balance["stream_fraction"]
        return ([i for k, i in enumerate(chosen) if k in on_cpu],
                [i for k, i in enumerate(chosen) if k not in on_cpu])

    # -- what users read -----------------------------------------------------------------------

    def offloaded_params(self) -> list[torch.Tensor]:
        """The parameters updated on the CPU, in gradient-arrival order."""
        return [self._shards.param(k) for k in self._cpu.params]

    def streamed_params(self) -> list[torch.Tensor]:
        """The offloaded parameters updated on the device from streamed state (see
        ``stream_fraction``), in gradient-arrival order."""
        return [self._shards.param(k) for k in self._streamed_keys()]

    def _streamed_keys(self) -> list[torch.Tensor]:
        return [p for part in self._parts for p in part.params]

    @property
    def cpu_cores(self) -> Optional[list[int]]:
        """The CPUs the worker is bound to (``bind_cpu_cores=True``), else None."""
        return self._worker.cores

    def split_estimate(self) -> Optional[dict[str, Any]]:
        """What ``stream_fraction="auto"``/``"measure"`` planned with: the rates, bytes per
        parameter each way on each path, the expected seconds per step of the CPU update and
        each link direction, and their maximum (``bound_s``). ``None`` for a fixed fraction."""
        if not self._balance or self._balance["rates"] is None:
            return None
        b = self._balance
        n = sum(p.numel() for p in self._cpu.params + self._streamed_keys())  # this rank's
        share = self.stream_fraction or 0.0
        return {"stream_fraction": share, "rates": dict(b["rates"]), "cpu_bytes": b["cpu_bytes"],
                "stream_bytes": b["stream_bytes"],
                **balance.balanced_seconds(n, 1.0 - share, b["rates"], b["cpu_bytes"], b["stream_bytes"])}

    def state_of(self, p: torch.Tensor) -> Optional[dict]:
        """``p``'s optimizer state as the wrapped class keeps it (live tensors; DTensors for a
        DTensor parameter) and its ``"master_weight"`` where it has one, as ``state_dict()``
        saves it (DCP's flattened load takes only the keys listed here); ``None`` before its
        first step. ``opt.state[p]`` reads it."""
        key = self._shards.key(p)
        st = self._state_of(key)
        master = self._placement(key).saved_master if st else None
        if master is not None:
            st = StateEntry({**st, state_format.MASTER: master})
        return self._shards.state_view(p, st)

    def _state_of(self, p: torch.Tensor) -> Optional[dict]:
        if self._cpu is not None and self._cpu.owns(p):
            self._cpu.finish()
            self._cpu.pre_state_read(p)
            b, k = self._cpu.where[id(p)]
            return self._cpu.buckets[b].param_state(k)
        if id(p) in self._streamed:
            part, k = self._streamed[id(p)]
            part.sync()
            return part.param_state(k)
        return self._dev_part.state_of(p)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients on the device only (like DDP's
        ``no_sync``): use it for every micro-batch but the last."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def register_forward_waits(self, model: nn.Module) -> forward_waits.ForwardWaits:
        """Make each submodule of ``model`` wait, before its forward, for its own offloaded
        parameters from the last ``step()`` (needed by ``overlap="next_forward"``; harmless
        otherwise). An FSDP2 module waits for every parameter before its root pre-forward
        (FSDP2 orders its all-gathers after the compute stream there only). After
        ``add_param_group``, call it again. Returns a handle whose ``remove()`` unregisters the hooks."""
        parts = {id(part): k for k, part in enumerate(self._parts)}

        def streamed_at(p: torch.Tensor) -> Optional[tuple[int, int]]:
            part, k = self._streamed.get(id(p), (None, 0))
            return None if part is None else (parts[id(part)], k)

        waits = forward_waits.register(
            model, self._shards.key, lambda p: self._cpu.where[id(p)][0] if self._cpu.owns(p) else None,
            streamed_at, weak_call(self, "_wait_cpu"), weak_call(self, "_wait_streamed"),
            weak_call(self, "wait_params"))
        self._waits.append(waits)
        self._module_hooks += waits.handles
        return waits

    def _wait_cpu(self, buckets: Sequence[int]) -> None:
        self._cpu.wait_for(buckets)

    def _wait_streamed(self, marks: Sequence[tuple[int, list[int]]]) -> None:
        for k, indices in marks:
            self._parts[k].wait_params(indices)

    def wait_params(self) -> None:
        """In ``next_forward`` mode: wait for every parameter of the last step (before reading
        parameters outside a forward, e.g. to evaluate, edit or save the model)."""
        self._cpu.finish()
        for part in self._parts:
            part.finish()
            for p in part.params:
                self._device.will_read(p)

    def __getstate__(self) -> Any:
        """Refused (torch's optimizers pickle their groups and state; this one also holds a
        thread, pinned buffers and streams, and a copy would share them): save ``state_dict()``
        and load it into a new optimizer."""
        raise OffloadUsageError(
            "HybridDeviceOptimizer cannot be copied or pickled (it holds a worker thread, pinned "
            "host memory and device streams): save opt.state_dict() and load it into a new "
            "HybridDeviceOptimizer over the copied model's parameters")

    def close(self) -> None:
        """Finish pending work, remove every hook and stop the worker thread. The optimizer
        cannot step afterwards (``state_dict()`` still works)."""
        if self._closed:
            return
        try:
            self._drain_all()
        finally:
            self._closed = True
            self._finalizer.detach()
            for h in self._hooks + self._module_hooks:
                h.remove()
            self._hooks, self._module_hooks = [], []
            self._worker.shutdown()
            if self._launcher is not None:
                self._launcher.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise OffloadUsageError(
                f"{what}() after close(): the optimizer's worker thread and hooks are gone; build "
                "a new HybridDeviceOptimizer (load this one's state_dict() into it to continue)")

    def _check_groups(self) -> None:
        """The parameters of each group are those placed when it was added: torch's optimizers
        step whatever ``param_groups[i]["params"]`` holds, but here a parameter appended there
        has no master, state or part, and would silently not be updated."""
        now = [tuple(map(id, g["params"])) for g in self.param_groups]
        if now != self._partitioned:
            gi = next((i for i, (a, b) in enumerate(zip(now, self._partitioned)) if a != b),
                      min(len(now), len(self._partitioned)))
            raise OffloadUsageError(
                f"the parameters of param group {gi} changed after the optimizer placed them "
                "(param_groups were edited in place): add parameters with opt.add_param_group("
                "{'params': [...]}) instead, or build a new HybridDeviceOptimizer")
        check_group_keys(self.param_groups, self.defaults)

    # -- backward hooks -------------------------------------------------------------------------

    def _hypers_now(self) -> list[dict]:
        return snapshot_hypers(self.param_groups)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._no_sync or p.grad is None or self._closed:
            return
        key, grad = self._shards.grad(p)  # under FSDP2: the local shard of the reduced gradient
        self._cpu.on_grad(key, grad, self._hypers_now)

    def _on_streamed_grad(self, p: torch.Tensor) -> None:
        if self._no_sync or p.grad is None or self._ddp or self._closed:
            return
        self._cpu.finish()
        key, grad = self._shards.grad(p)
        part, k = self._streamed[id(key)]
        part.follow_params([k])  # the early update reads it
        part.backward.on_grad(k, grad, self._hypers_now())

    # -- step -------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update every parameter (see the class docstring for what runs where and when).

        In ``next_forward`` mode this returns once the device part is queued and the CPU part
        is running (a launcher thread queues the streamed part's later chunks); the next
        forward's modules wait for their own parameters.
        """
        self._check_open("step")
        self._check_groups()
        self._cpu.check_layouts()
        scale = LossScale.take(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        covered = set().union(*(w.covered for w in self._waits)) if self._mode.forward_waits else ()
        uncovered = len(self._cpu.where) + len(self._streamed) - len(covered)
        if self._mode.forward_waits and uncovered > 0:
            raise OffloadUsageError(
                "overlap='next_forward' needs opt.register_forward_waits(model) for the modules "
                f"owning the offloaded parameters ({uncovered} are not covered; after add_param_group "
                "call it again), or another overlap mode")
        if scale is not None and scale.grad_scale is not None and self.max_grad_norm is not None:
            raise OffloadUsageError(
                "max_grad_norm clips inside step(), but GradScaler still has the gradients scaled: "
                "call scaler.unscale_(opt) before scaler.step(opt)")
        hypers = snapshot_hypers(self.param_groups)
        st = self._cpu.take_step()
        st.step_called = time.perf_counter()
        clipping = self.max_grad_norm is not None
        laid = GradsLaidOutAsParams(p for g in self.param_groups for p in g["params"])
        try:
            self._shards.sync_grads()
            if not clipping:  # its first chunks queued first: the checks below wait for
                self._step_streamed(hypers, scale, ahead=True)  # backward's end on the host
            self._cpu.validate(st, hypers, scale)
            self._cpu.flush(st)
            coef = None
            if clipping:
                self.last_grad_norm, coef = clip_by_global_norm(
                    [p for g in self.param_groups for p in g["params"]],
                    self._cpu.norms(st, 2.0), self.max_grad_norm, 2.0)
            self._cpu.queue_rest(st, hypers, coef, scale)
            self._dev_part.step(hypers, scale)
            if clipping:  # from the clipped gradients: after the device part
                self._step_streamed(hypers, scale, ahead=True)
            self._queue_streamed_rest(defer=True)  # the rest, by a launcher (``queue_rest``)
            for bs in st.buckets:  # gradients may be zeroed or freed after step()
                self._engine.fence_compute(bs.landed)
            self._cpu.release_grads(st)
        except BaseException:
            try:  # a streamed update started is queued whole, as if it had been queued first
                self._queue_streamed_rest()
            finally:
                _abandon_parts(self._cpu, self._parts, st)
            raise
        finally:
            self._shards.drop_grads()
            laid.restore()
        if self._mode.forward_waits:
            self._cpu.leave_inflight(st)
        else:
            self._cpu.wait_all(st)
        return loss

    def _step_streamed(self, hypers: list[dict], scale: Optional[LossScale],
                       ahead: bool = False) -> None:
        """The streamed parts' updates, on the device from ``.grad`` as it is now (clipped), with
        no host synchronization: queued while the device may still run backward, so that their
        copies start as soon as it ends. ``ahead``: an overlapped part queues only its first
        ``ahead_chunks`` chunks here (``STREAM_AHEAD_CHUNKS``), the rest after the device part
        (``queue_rest``)."""
        for part in self._parts:
            part.step(hypers, scale, ahead=part.ahead_chunks if ahead and part.overlapped else None)

    def _queue_streamed_rest(self, defer: bool = False) -> None:
        """Every streamed part queues the chunks ``step(ahead=...)`` left (``defer``: hands them
        to its launcher). A part that fails does not stop the others (none may stay half
        queued); the first error is raised once all have run."""
        error = None
        for part in self._parts:
            try:
                part.queue_rest(defer)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the other parts
                error = error or exc
        if error is not None:
            raise error

    @property
    def last_step_stats(self) -> dict[str, Any]:
        """Of the last step whose CPU updates all finished (``{}`` before one has): CPU update
        seconds (``cpu_update_s``, and how much of it ran before ``step()``), the buckets redone
        because early work was stale (``redone_buckets``), bytes moved each way, and the
        streamed part's figures (``stream_*``; ``stream_early_missed``: per reason, the chunks
        whose update did not start in backward or was not kept, ``stream_records.EarlyMiss``)."""
        return {**self._cpu.stats, **self._stream_stats()} if self._cpu.stats else {}

    def _take_edits(self) -> None:
        """Outside a step: parameters edited since the optimizer wrote them, into their masters
        (``state_dict`` saves what training continues from, as the wrapped class's would)."""
        self._cpu.take_edits()
        self._dev_part.take_edits()
        for part in self._parts:
            part.take_edits()

    def _stream_stats(self) -> dict[str, Any]:
        return {
            "stream_fraction": self.stream_fraction,
            "stream_budget_bytes": self.stream_budget_bytes,
            "stream_staging_bytes": max([p.staging_bytes for p in self._parts] or [0]),
            "stream_bytes_to_device": sum(p.bytes_in for p in self._parts),
            "stream_bytes_to_host": sum(p.bytes_out for p in self._parts),
            "stream_early_chunks": sum(p.backward.started for p in self._parts if p.backward),
            "stream_early_kept": sum(p.backward.kept for p in self._parts if p.backward),
            "stream_early_missed": dict(sum((p.backward.missed for p in self._parts if p.backward),
                                            collections.Counter())),
        }

    def _drain_all(self) -> None:
        _abandon_parts(self._cpu, self._parts)
        self._cpu.finish()
        for part in self._parts:
            part.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. A backward that never reached ``step()`` is
        abandoned first: its early updates are undone, so parameters and optimizer state are
        those of the last ``step()``."""
        if self._cpu is not None:
            self._shards.sync_grads()
            _abandon_parts(self._cpu, self._parts)
            if set_to_none:
                self._cpu.free_grads()
            else:  # zeroed in place: after the streamed update read them (set to None: it holds them)
                for part in self._parts:
                    part.order_params()
                    for p in part.params:
                        if p.grad is not None:
                            self._device.will_write(p.grad)
            self._shards.drop_grads()
        super().zero_grad(set_to_none)

    # -- clipping ----------------------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients (device and offloaded) by their global norm, like
        ``torch.nn.utils.clip_grad_norm_(all_params, max_norm, norm_type)``, between backward
        and ``step()``; returns the total norm. It is that function: the gradient copies made
        during backward are then redone in ``step()`` (pass ``max_grad_norm=`` to clip inside
        ``step()`` and keep the overlap).

        Example::

            >>> import torch, cpu_offload
            >>> from cpu_offload.optim import HybridDeviceOptimizer
            >>> model = torch.nn.Linear(4, 4)
            >>> opt = HybridDeviceOptimizer(model.parameters(), 0.5, overlap="backward_copies",
            ...                             lr=1e-2, device=cpu_offload.SimulatedDevice())
            >>> model(torch.randn(2, 4)).sum().backward()
            >>> total = opt.clip_grad_norm_(0.1)
            >>> opt.step(); opt.close()
        """
        params = [p for g in self.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    # -- state dict ------------------------------------------------------------------------------------

    def _placement(self, p: torch.Tensor) -> state_format.Placement:  # p: a part's key
        if id(p) in self._streamed:
            part, k = self._streamed[id(p)]
            return state_format.Placement(p, part, part.keys[k], True)
        if self._cpu.owns(p):
            b, _ = self._cpu.where[id(p)]
            return state_format.Placement(p, self._cpu.buckets[b], self._cpu.master(p), True)
        return state_format.Placement(p, self._dev_part.optimizer, self._dev_part.key(p), False)

    def _placements(self) -> list[state_format.Placement]:
        return [self._placement(self._shards.key(p)) for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format, each offloaded parameter's master weight in its state
        (``"master_weight"``), plus a ``"hybrid"`` entry (format, placement, the split chosen);
        ``to_wrapped_format(sd)`` gives the wrapped class's own format. Runs the optimizer's
        state-dict hooks, as torch's optimizers do."""
        return state_format.saved_with_hooks(self, self._gather_state)

    def _gather_state(self) -> dict[str, Any]:
        self._drain_all()
        self._take_edits()
        sd = state_format.gather(self.param_groups, self._placements(), self._implementation, self._keeps_state)
        sd["hybrid"]["stream_fraction"] = self.stream_fraction
        return self._shards.shard_state(sd, [p for g in self.param_groups for p in g["params"]])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a hybrid optimizer (any ``offload_fraction``) or of the
        wrapped class over the same parameter groups; parameters are set from the masters (not
        from stale ones: ``state.carried_masters``). Runs the load hooks, as torch's do."""
        self._check_open("load_state_dict")
        state_format.loaded_with_hooks(self, state_dict, self._load_state)

    def _load_state(self, state_dict: dict[str, Any]) -> None:
        self._drain_all()
        sub_groups = {id(b): b.group_ids for b in self._cpu.buckets}
        if self._dev_part.optimizer is not None:
            sub_groups[id(self._dev_part.optimizer)] = self._dev_part.group_ids
        sub_groups.update((id(part), part.group_ids) for part in self._parts)
        placements = self._placements()
        state_dict = self._shards.local_state(state_dict, [p for g in self.param_groups for p in g["params"]])
        state_format.scatter(state_dict, self.param_groups, placements, sub_groups)
        self._dev_part.write_params()
        self._cpu.write_params()
        for part in self._parts:
            part.write_params()

    def reload_master_weights(self) -> None:
        """Start the master weights again from the model's current parameters (after changing
        them outside the optimizer, e.g. ``model.load_state_dict`` alone); state is kept."""
        self._drain_all()
        with torch.no_grad():
            self._cpu.reload()
            for part in self._parts:
                part.read_params()
            self._dev_part.reload()

    # -- DDP -------------------------------------------------------------------------------------

    def ddp_comm_hook(self, inner: Optional[Callable] = None) -> tuple[Any, Callable]:
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``:
        offloaded gradients are taken from DDP's reduced buckets (a post-accumulate-grad hook
        would see local, unreduced ones); ``inner`` (default: DDP's ``allreduce_hook``) reduces
        each bucket. At the end of backward the optimizer records the ``.grad`` DDP wrote, so
        that ``step()`` sees later changes as without DDP."""
        if self._shards:
            raise OffloadUsageError("ddp_comm_hook() is for DistributedDataParallel; under FSDP2 "
                                    "the optimizer takes the reduced gradient shards by itself")
        state_and_hook = ddp.comm_hook(weak_call(self, "_on_reduced_bucket"), inner,
                                       on_start=weak_call(self, "_queue_ddp_record"))
        self._ddp = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return state_and_hook

    def _on_reduced_bucket(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        if not self._mode.copies_in_backward or self._no_sync or self._closed:
            return
        offset = 0
        for p in params:
            n = p.numel()
            if self._cpu.owns(p):
                self._cpu.on_grad(p, flat[offset: offset + n].view(p.shape), self._hypers_now, reduced=True)
            offset += n

    def _queue_ddp_record(self) -> None:
        """(Backward's thread.) Have ``CpuPart.record_reduced`` run once DDP has written the
        reduced gradients into ``.grad``."""
        if self._mode.copies_in_backward and not self._no_sync and self._cpu.ddp_record_needed():
            ddp.after_ddp_writes_grads(weak_call(self, "_record_reduced"))

    def _record_reduced(self) -> None:
        self._cpu.record_reduced()


def _abandon_parts(cpu: CpuPart, parts: list[StreamedPart], st: Any = None) -> None:
    """A backward that never reached a finished ``step()`` (``zero_grad``, ``state_dict``, an
    error, a dropped optimizer): every part drops the work it started from it and fences what
    it queued."""
    cpu.abandon(st)
    for part in parts:
        if part.backward is not None:
            part.backward.abandon()


def _finish_dropped(cpu: CpuPart, parts: list[StreamedPart]) -> None:
    """Dropped without ``close()``: the step left running (``next_forward``; the forward
    pre-hooks that would finish it hold the optimizer weakly) still lands, as at ``close()``."""
    _abandon_parts(cpu, parts)
    cpu.finish()
    for part in parts:
        part.finish()
