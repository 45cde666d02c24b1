"""``HybridDeviceOptimizer``: part of the optimizer state and update on the CPU, overlapped with
backward (and optionally with the next forward)."""
from __future__ import annotations

import contextlib
import numbers
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import nn

from ..core.checks import check_bool, check_int
from ..core.device import Event, OffloadDevice, default_device
from ..core.errors import OffloadConfigError, OffloadUsageError
from ..core.launcher import Launcher
from . import balance, ddp
from . import state as state_format
from .cpu_update import (
    IMPLEMENTATION_KEYS, CpuBucket, tensor_version, same_hyperparameters, sync_hyperparameters,
)
from .overlap import overlap_mode
from .partition import (
    DEFAULT_BUCKET_BYTES, arrival_from_order, check_fraction, choose_offloaded, default_arrival,
    make_buckets, next_update,
)
from .stream_update import (
    DEFAULT_STREAM_BUDGET_BYTES, MIN_STREAM_BUDGET_BYTES, StreamedPart, state_elems_per_param,
)
from .transfer import TransferEngine
from .worker import CpuWorker, default_chunk_bytes, default_cpu_threads, wait_all, worker_cores

REQUIRED_API = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group")
LOW_PRECISION = (torch.bfloat16, torch.float16)
_PENDING = ("pending",)  # st.seen: DDP's reduced gradient copied; .grad recorded after backward


def default_optimizer_cls(kwargs: dict) -> Callable[..., torch.optim.Optimizer]:
    """``torch.optim.AdamW`` with ``fused=True`` (on CPU and GPU alike), unless ``kwargs`` choose
    the implementation themselves (``fused`` or ``foreach``)."""
    if "fused" in kwargs or "foreach" in kwargs:
        return torch.optim.AdamW

    def adamw_fused(params: Any, **kw: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, fused=True, **kw)

    return adamw_fused


def _probe(cls: Callable[..., Any], kwargs: dict, role: str) -> dict:
    """Instantiate ``cls`` on a dummy CPU parameter: check its API, return its defaults."""
    name = getattr(cls, "__name__", repr(cls))
    try:
        probe = cls([torch.zeros(1, requires_grad=True)], **kwargs)
    except Exception as exc:
        raise OffloadConfigError(
            f"{role}={name} could not be built with the optimizer arguments {sorted(kwargs)}: "
            f"{exc}; pass arguments that class accepts"
        ) from exc
    missing = [a for a in REQUIRED_API if not callable(getattr(probe, a, None))]
    missing += [a for a in ("param_groups", "state", "defaults") if not hasattr(probe, a)]
    if missing:
        raise OffloadConfigError(
            f"{role}={name} lacks {', '.join(missing)}: the hybrid optimizer needs a "
            "torch.optim.Optimizer-like class (param_groups, state, defaults, step, zero_grad, "
            "state_dict, load_state_dict, add_param_group); subclass torch.optim.Optimizer"
        )
    return dict(probe.defaults)


@dataclass
class _CpuParam:
    bucket: int
    master: torch.Tensor


@dataclass
class _Step:
    """What one optimizer step has queued so far (gradient copies, CPU jobs).

    Work started before ``step()`` (gradient copies, norms, updates) is *early*: it read the
    gradients as they were then. ``seen`` records, per copied parameter, which gradient tensor
    was copied and its ``_version`` (``None``: unknown or stale); ``step()`` checks them
    (``_validate``) and redoes the buckets whose gradients changed. Until then an early update
    is *uncommitted*: the bucket can restore its previous state, and its parameters are not
    copied back to the device (``spec``).
    """

    hypers: list[dict]
    remaining: list[int]  # per bucket: gradients still to copy
    copied: set = field(default_factory=set)  # ids of CPU params whose gradient was copied
    seen: dict = field(default_factory=dict)  # id(param) -> (grad, grad._version) | None
    watch: dict = field(default_factory=dict)  # early work off: id -> (param, grad, version) | None
    landed: dict = field(default_factory=dict)  # bucket -> event after its gradient copies
    keep: list = field(default_factory=list)  # temporaries read by queued copies
    norms: dict = field(default_factory=dict)  # bucket -> Future[dict[id, norm]]
    updates: dict = field(default_factory=dict)  # bucket -> Future[h2d event | None]
    ready: list = field(default_factory=list)  # (bucket, clip coef, future): queued, not started
    ready_lock: Any = field(default_factory=threading.Lock)
    validated: bool = False  # step() has checked the gradients: updates started now are final
    invalid: set = field(default_factory=set)  # buckets step() found changed (or abandoned)
    spec: set = field(default_factory=set)  # buckets updated early, restorable, not committed
    coefs: dict = field(default_factory=dict)  # bucket -> clip coefficient for its copies
    waited: set = field(default_factory=set)  # buckets the compute stream already waits for
    record_queued: bool = False  # DDP: the end-of-backward record of gradients is queued
    stats: dict = field(default_factory=lambda: {"cpu_update_s": 0.0, "jobs": [], "redone": 0})


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class HybridDeviceOptimizer(torch.optim.Optimizer):
    r"""Keep ``offload_fraction`` of the optimizer state (and its update) in CPU memory.

    A drop-in ``torch.optim.Optimizer`` for parameters on one accelerator. The parameters whose
    gradients are final earliest in backward (the last layers), ``offload_fraction`` of all
    parameter bytes, get master weights (fp32 for bf16/fp16 parameters, the parameter's own dtype
    for fp32/fp64 ones) and optimizer state in CPU memory and are updated by
    ``cpu_optimizer_cls`` on a CPU worker thread; the rest are updated on the device by
    ``gpu_optimizer_cls`` as usual. Part of the offloaded parameters (``stream_fraction``,
    balanced against the CPU by default) keep their state in CPU memory but are updated on the
    device, their state streamed in and out in chunks from ``step()`` on (overlapping the next
    forward in ``next_forward`` mode). For the CPU parameters:

    1. during backward, each gradient is copied (model dtype, on a side stream) into pinned
       buffers allocated at construction, as soon as it is final (post-accumulate-grad hooks);
    2. the CPU update of a bucket of parameters starts as soon as its gradients have landed,
       overlapping the rest of backward (``overlap``);
    3. updated parameters (cast to the model dtype on the CPU) stream back on another side stream
       (for an update started during backward: once ``step()`` has checked its gradients).

    **Gradients changed before** ``step()``. The copies and updates started during backward read
    the gradients as they were then. ``step()`` checks, per parameter, that ``.grad`` is still
    the tensor that was copied and unchanged since (its ``_version``; ``None`` where none was
    copied); a bucket where one is not -- ``clip_grad_norm_``, loss-scale unscaling,
    ``grad.mul_``, ``.grad = None`` or replaced, another backward accumulating, or the
    hyperparameters changed since its update started -- is restored (an update started before
    ``step()`` first keeps a copy of what it changes), copied and updated again from the
    gradients as they are now. So the result is that of the wrapped optimizer whatever is done
    to ``.grad`` before ``step()`` (a parameter whose ``.grad`` is ``None`` at ``step()`` is
    skipped, as torch's optimizers skip it). The cost: redone buckets lose their overlap (they
    run inside ``step()`` as in mode ``"none"``), and a kept copy of the state of the buckets
    updated before ``step()`` (at most one more copy of the CPU optimizer state, allocated on
    first use). Clipping changes every gradient: with ``torch.nn.utils.clip_grad_norm_`` (what
    Hugging Face's ``Trainer`` does by default) every bucket is redone each step
    (``last_step_stats["redone_buckets"]``). After a step whose gradients changed, the next
    backward does no early work (it only notes which gradients it produced), and after one
    whose gradients stayed untouched early work resumes: so with clipping every step, every
    mode works as ``"none"`` from the second step on, and only the first step pays for work
    that is undone. To keep the overlap pass ``max_grad_norm=`` instead, which clips inside
    ``step()`` without redoing anything (no other code must touch ``.grad`` then: Hugging
    Face's ``Trainer`` calls ``clip_grad_norm_`` even with ``max_grad_norm=0``, to log the
    norm); accumulate micro-batches inside ``no_sync()``.
    A backward abandoned by ``zero_grad()`` (or ``state_dict()``...) before ``step()`` is undone.

    Use it when optimizer state does not fit next to the model and activations (AdamW in mixed
    precision keeps 12 bytes per parameter), typically with ``offload_fraction`` 0.25 to 1.

    The CPU part runs exactly ``cpu_optimizer_cls(**optimizer_kwargs)``: it never switches
    between for-loop, foreach and fused implementations. Results equal that class run on the CPU
    over those master weights, bit for bit; with ``device=SimulatedDevice()`` (everything on the
    CPU) the whole optimizer equals the wrapped classes run directly, for every overlap mode.

    Args:
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``; all on
            one device (the accelerator, or the CPU with ``SimulatedDevice``).
        offload_fraction: share of parameter bytes updated on the CPU, in [0, 1].
        cpu_optimizer_cls: optimizer class for the CPU part. ``None``: ``torch.optim.AdamW``
            with ``fused=True`` (fused CPU AdamW, torch >= 2.4), unless ``optimizer_kwargs``
            set ``fused`` or ``foreach`` (then plain ``torch.optim.AdamW`` with them).
        gpu_optimizer_cls: optimizer class for the device part; ``None`` as above (fused).
        param_update_in_fp32: keep fp32 master weights for bf16/fp16 parameters of the *device*
            part too (the CPU part always has them).
        pin_cpu_grads: gradients land in pinned memory (else pageable: the copy then blocks).
        pin_cpu_params: updated parameters leave from pinned memory. When both pin flags
            agree, gradients and parameters share one buffer.
        overlap_cpu_optimizer_d2h_h2d: Megatron's switch, used when ``overlap`` is ``None``:
            ``True`` means ``"backward_update"``, ``False`` means ``"none"``.
        device: the ``OffloadDevice`` (default: CUDA; ``SimulatedDevice()`` on a CPU).
        overlap: ``"none"`` (copies, update and copies back all inside ``step()``, Megatron's
            behaviour), ``"backward_copies"`` (gradient copies during backward),
            ``"backward_update"`` (also the CPU update during backward), ``"next_forward"``
            (also: ``step()`` returns before the CPU finishes; each module's forward waits only
            for its own parameters, see ``register_forward_waits``). The numbers are identical
            in every mode.
        max_grad_norm: clip gradients to this global norm (over device and CPU parts) inside
            ``step()``; the way to clip in the ``backward_update``/``next_forward`` modes and
            keep their overlap (clipping between backward and ``step()`` is exact too, but the
            updates started during backward are then redone).
        grad_order: parameters in gradient-arrival order (``grad_arrival_order``); default:
            reverse registration order.
        bucket_bytes: model-dtype bytes per CPU update unit (default 64 MiB).
        cpu_threads: intra-op threads of the CPU worker (default: all but one).
        cpu_chunk_bytes: fp32 bytes per CPU update chunk (elements: this over 4) (default: 1 MiB per worker thread, at
            least 4 MiB; 0: one optimizer step per bucket). Each bucket is converted, stepped
            and written back one chunk at a time so its data stays in cache, each chunk by its
            own instance of ``cpu_optimizer_cls``; parameters larger than a chunk are split for
            ``torch.optim.Adam``/``AdamW``/``SGD`` only (bit-identical to whole-tensor steps,
            see ``cpu_offload.optim.cpu_update``).
        stream_fraction: share of the offloaded parameters (by elements) updated *on the
            device* from state kept in pinned CPU memory, streamed in chunks through
            ``stream_budget_bytes`` of device staging (``cpu_offload.optim.stream_update``): their
            masters and state (12 B/param each way for bf16 AdamW) cross the link, the CPU does
            no work for them. The rest of the offloaded parameters (the earliest gradients) keep
            the CPU path above. ``"auto"`` (default): balance the two so that they finish
            together, from the CPU update rate and the link rate both ways measured at
            construction (``device.nominal_rates()`` on a simulated device: reproducible);
            the choice is logged once (logger ``"cpu_offload"``) and kept in
            ``stream_fraction`` / ``split_estimate()``. ``0``: everything offloaded is updated
            on the CPU (the behaviour before streaming existed). The streamed part starts in
            ``step()``, from ``.grad`` as it is then (after any clipping), with
            ``gpu_optimizer_cls``: its result is that class run on the device, bit for bit. It
            runs on the compute stream inside ``step()``, except in ``next_forward`` mode: there
            it runs on a stream of its own, chunks in forward order, while the next forward
            runs (each module waits for the chunks writing its own parameters; zero gradients
            in place only with ``zero_grad(set_to_none=False)`` until then, which waits).
        stream_budget_bytes: device bytes for the streamed part's staging (two chunks, so that
            the copy of one overlaps the update of the other; default 256 MiB, at least 64 KiB),
            allocated by ``step()`` (``last_step_stats["stream_staging_bytes"]``) and freed at its
            end (``next_forward``: once the next forward has waited for the last chunk). The
            first step of a parameter also lets the class create its state on the device, one
            chunk at a time (at most half the budget more, that step).
        stream_during_backward: start the streamed part's chunks during backward, each as
            soon as its gradients are final, into a second pinned host copy of their state
            (``cpu_offload.optim.stream_backward``); ``step()`` keeps those whose gradients,
            hyperparameters and (fp32) parameters did not change since, and redoes the others.
            The updates are queued off backward's thread (on CUDA a thread of the optimizer's
            own, ``OffloadDevice.host_launcher``); ``step()`` waits for it, and raises an error
            one of them raised. Costs 12 B/param more pinned host memory (bf16 AdamW), the
            staging during backward, and on the device the new parameter values of the chunks
            updated early, held from their update to ``step()`` (2 B/param of the streamed part
            for bf16: the step's peak grows by about that). Needs ``overlap`` of
            ``"backward_update"`` or ``"next_forward"`` and no ``max_grad_norm``. Off by default:
            it helps when the streamed part's link time, not the CPU, bounds the step (see
            docs/optimizer.md).
        bind_cpu_cores: run the CPU worker and its intra-op threads on physical cores only (one
            hyperthread per core, of the GPU's NUMA node where the host exposes it, leaving one
            core to the launching thread): ``os.sched_setaffinity``. Off by default until
            measured (``optim_benchmark.py --bind-cores``). The cores: ``cpu_cores``.
        **optimizer_kwargs: hyperparameters for both classes (``lr``, ``weight_decay``, ...).

    Raises:
        OffloadConfigError: ``offload_fraction`` outside [0, 1]; ``stream_fraction`` neither
            ``"auto"`` nor in [0, 1]; ``stream_budget_bytes`` under 64 KiB; a flag that is not a bool or a
            size that is not an int (e.g. ``pin_cpu_grads="no"``); parameters on several
            devices, non-contiguous or non-leaf; an unknown ``overlap``; an optimizer class
            without the ``torch.optim.Optimizer`` API or rejecting ``optimizer_kwargs``.
        RuntimeError: no ``device=`` on a machine without CUDA (pass
            ``device=cpu_offload.SimulatedDevice()``).
        OffloadUsageError: at run time, sparse gradients on an offloaded parameter.

    Example::

        >>> import torch, cpu_offload
        >>> from cpu_offload.optim import HybridDeviceOptimizer
        >>> dev = None if torch.cuda.is_available() else cpu_offload.SimulatedDevice()
        >>> where = "cuda" if dev is None else "cpu"
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(where)
        >>> opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-2,
        ...                             device=dev)
        >>> loss = model(torch.randn(4, 8, device=where)).square().mean()
        >>> loss.backward()          # gradient copies (and CPU updates) start here
        >>> opt.step(); opt.zero_grad()
        >>> opt.close()
    """

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
        overlap: Optional[str] = None,
        max_grad_norm: Optional[float] = None,
        grad_order: Optional[Sequence[torch.Tensor]] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        cpu_threads: Optional[int] = None,
        cpu_chunk_bytes: Optional[int] = None,
        stream_fraction: Any = "auto",
        stream_budget_bytes: int = DEFAULT_STREAM_BUDGET_BYTES,
        bind_cpu_cores: bool = False,
        stream_during_backward: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        self.offload_fraction = check_fraction(offload_fraction)
        for name, flag in (("param_update_in_fp32", param_update_in_fp32), ("pin_cpu_grads", pin_cpu_grads),
                           ("pin_cpu_params", pin_cpu_params),
                           ("overlap_cpu_optimizer_d2h_h2d", overlap_cpu_optimizer_d2h_h2d),
                           ("bind_cpu_cores", bind_cpu_cores),
                           ("stream_during_backward", stream_during_backward)):
            check_bool(name, flag)
        check_int("bucket_bytes", bucket_bytes, minimum=1, unit="bytes")
        check_int("cpu_threads", cpu_threads, minimum=1, allow_none=True)
        check_int("cpu_chunk_bytes", cpu_chunk_bytes, minimum=0, allow_none=True, unit="bytes")
        self._stream_request = balance.check_stream_fraction(stream_fraction)
        check_int("stream_budget_bytes", stream_budget_bytes, minimum=MIN_STREAM_BUDGET_BYTES, unit="bytes")
        self.stream_budget_bytes = stream_budget_bytes
        self.stream_fraction: Optional[float] = None  # the streamed share chosen (see _split)
        self._parts: list[StreamedPart] = []
        self._launcher: Optional[Launcher] = None
        self._streamed: dict[int, tuple[StreamedPart, int]] = {}  # id(param) -> (part, index)
        self._rates: Optional[dict] = None
        self._state_probe: Optional[tuple[int, bool]] = None
        self._balance: Optional[dict] = None
        self._cpu_threads = cpu_threads or default_cpu_threads()
        self._mode = overlap_mode(overlap, overlap_cpu_optimizer_d2h_h2d)
        if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(
                max_grad_norm, numbers.Real) or not max_grad_norm > 0):
            raise OffloadConfigError(f"max_grad_norm must be a number > 0 (or None), got {max_grad_norm!r}")
        if device is None and not torch.cuda.is_available():
            raise RuntimeError(
                "HybridDeviceOptimizer: CUDA is not available, and without device= the optimizer "
                "expects its parameters on a CUDA GPU. On a CPU-only machine pass "
                "HybridDeviceOptimizer(device=cpu_offload.SimulatedDevice()) (parameters on the "
                "CPU; the schedule runs in simulation)"
            )
        self.overlap = self._mode.name
        self.max_grad_norm = max_grad_norm
        if stream_during_backward:
            if not self._mode.updates_in_backward:
                raise OffloadConfigError(
                    f"stream_during_backward=True updates during backward: it needs "
                    f"overlap='backward_update' or 'next_forward', not {self._mode.name!r}")
            if max_grad_norm is not None:
                raise OffloadConfigError(
                    "stream_during_backward=True cannot be combined with max_grad_norm (which "
                    "scales every gradient inside step(), after backward): drop one of them")
            if self._stream_request == 0:
                raise OffloadConfigError(
                    "stream_during_backward=True needs a streamed part: stream_fraction > 0 "
                    "(or 'auto')")
        self.stream_during_backward = stream_during_backward
        self.param_update_in_fp32 = param_update_in_fp32
        self._device = device if device is not None else default_device()
        self._cpu_cls = cpu_optimizer_cls or default_optimizer_cls(optimizer_kwargs)
        self._gpu_cls = gpu_optimizer_cls or default_optimizer_cls(optimizer_kwargs)
        self._kwargs = dict(optimizer_kwargs)
        defaults = _probe(self._gpu_cls, self._kwargs, "gpu_optimizer_cls")
        defaults.update(_probe(self._cpu_cls, self._kwargs, "cpu_optimizer_cls"))
        # implementation choices (fused, foreach, ...) stay out of the wrapper's groups, so each
        # part keeps its own; state_dict() reports them as the wrapped class would
        self._implementation = {k: v for k, v in defaults.items() if k in IMPLEMENTATION_KEYS}
        defaults = {k: v for k, v in defaults.items() if k not in IMPLEMENTATION_KEYS}
        self._bucket_bytes = bucket_bytes
        cpu_threads = self._cpu_threads
        if cpu_chunk_bytes is None:
            cpu_chunk_bytes = default_chunk_bytes(cpu_threads)
        self._chunk_elems = cpu_chunk_bytes // 4
        self._grad_order = list(grad_order) if grad_order is not None else None
        self._engine = TransferEngine(self._device, pin_cpu_grads, pin_cpu_params)
        self._cpu: dict[int, _CpuParam] = {}
        self._buckets: list[CpuBucket] = []
        self._gpu_opt: Optional[torch.optim.Optimizer] = None
        self._gpu_groups: list[int] = []  # wrapper group of each gpu_opt group
        self._gpu_master: dict[int, torch.Tensor] = {}
        self._torch_device: Optional[torch.device] = None
        self._scratch = torch.empty(0, dtype=torch.float32)
        self._lock = threading.RLock()
        self._step_state: Optional[_Step] = None
        self._inflight: Optional[_Step] = None
        self._hooks: list[Any] = []
        self._module_hooks: list[Any] = []
        self._covered: set[int] = set()
        self._no_sync = 0
        self._ddp = False
        self._attached = 0  # param groups already partitioned
        self._early = True  # work during backward (off after a step whose gradients changed)
        self.last_step_stats: dict[str, Any] = {}
        self.last_grad_norm: Optional[torch.Tensor] = None
        super().__init__(params, defaults)
        self._attach(range(len(self.param_groups)))
        index = self._torch_device.index if self._torch_device is not None else None
        cuda_index = index if self._torch_device is not None and self._torch_device.type == "cuda" else None
        self._worker = CpuWorker(cpu_threads, cuda_index,
                                 worker_cores(cpu_threads, cuda_index) if bind_cpu_cores else None)

    # ------------------------------------------------------------------------------------------
    # construction

    def add_param_group(self, param_group: dict) -> None:
        """Add a group, as ``torch.optim.Optimizer.add_param_group``; ``offload_fraction`` of its
        bytes go to the CPU (pinned buffers for them are allocated here)."""
        super().add_param_group(param_group)
        if hasattr(self, "_worker"):  # after construction; the constructor partitions globally
            self._drain_all()
            self._attach([len(self.param_groups) - 1])

    def _check_param(self, p: torch.Tensor, pos: int) -> None:
        if not self._device.is_device_tensor(p):
            raise OffloadConfigError(
                f"parameter {pos} is on {p.device}, not on the {self._device.name} device: "
                "move the model to the accelerator before building the optimizer (on a CPU-only "
                "machine pass device=cpu_offload.SimulatedDevice())"
            )
        if self._torch_device is None:
            self._torch_device = p.device
        elif p.device != self._torch_device:
            raise OffloadConfigError(
                f"parameters are on several devices ({self._torch_device} and {p.device}): build "
                "one HybridDeviceOptimizer per device"
            )
        if p.layout != torch.strided or not p.is_contiguous() or not p.is_leaf:
            raise OffloadConfigError(
                f"parameter {pos} ({tuple(p.shape)}) must be a contiguous dense leaf tensor"
            )

    def _attach(self, group_ids: Iterable[int]) -> None:
        entries = [(gi, p) for gi in group_ids for p in self.param_groups[gi]["params"]]
        for pos, (_, p) in enumerate(entries):
            self._check_param(p, pos)
        params = [p for _, p in entries]
        sizes = [p.numel() * p.element_size() for p in params]
        arrival = (arrival_from_order(params, self._grad_order) if self._grad_order is not None
                   else default_arrival(len(params)))
        chosen = choose_offloaded(sizes, arrival, self.offload_fraction)
        offloaded = set(chosen)
        hypers = self._hyperparameters()
        chosen, streamed = self._split([params[i] for i in chosen], chosen, hypers)
        if streamed:
            part = StreamedPart(
                self._device, [params[i] for i in streamed], [entries[i][0] for i in streamed], hypers,
                lambda groups: self._gpu_cls(groups, **self._kwargs), self.stream_budget_bytes,
                *self._state_probe, overlapped=self._mode.forward_waits,
                early=self.stream_during_backward, launcher=self._early_launcher(params[0].device))
            self._parts.append(part)
            self._streamed.update((id(p), (part, k)) for k, p in enumerate(part.params))
            if part.backward is not None:  # chunks start updating as their gradients land
                ref = weakref.ref(self)
                for p in part.params:
                    if p.requires_grad:
                        self._hooks.append(p.register_post_accumulate_grad_hook(
                            lambda p, ref=ref: _call(ref, "_on_streamed_grad", p, p.grad)))
        for order in make_buckets(chosen, sizes, self._bucket_bytes):
            bparams = [params[i] for i in order]
            self._engine.add_bucket(bparams)
            self._engine.read_params(bparams)
            bucket = CpuBucket(bparams, [entries[i][0] for i in order],
                               [self._engine.params.typed(p) for p in bparams], hypers,
                               lambda groups: self._cpu_cls(groups, **self._kwargs), self._chunk_elems)
            for p, m in zip(bparams, bucket.masters):
                self._cpu[id(p)] = _CpuParam(len(self._buckets), m)
            self._buckets.append(bucket)
            need = bucket.scratch_elems
            if need > self._scratch.numel():
                self._scratch = torch.empty(need, dtype=torch.float32)
        for gi in dict.fromkeys(gi for gi, _ in entries):
            gparams = [p for (g, p), i in zip(entries, range(len(entries))) if g == gi and i not in offloaded]
            if gparams:
                self._add_gpu_group(gi, gparams, hypers)
        if self._mode.copies_in_backward:
            ref = weakref.ref(self)
            for i in chosen:
                if params[i].requires_grad:
                    self._hooks.append(params[i].register_post_accumulate_grad_hook(
                        lambda p, ref=ref: _call(ref, "_on_grad", p, p.grad)))

    def _early_launcher(self, where: torch.device) -> Optional[Launcher]:
        """The one launcher of every streamed part's updates started in backward (off
        backward's thread on CUDA, see ``stream_backward``), made with the first part."""
        if self.stream_during_backward and self._launcher is None:
            self._launcher = self._device.host_launcher(where)
        return self._launcher

    def _split(self, params: list[torch.Tensor], chosen: list[int],
               hypers: list[dict]) -> tuple[list[int], list[int]]:
        """``chosen`` (offloaded, in arrival order) as (CPU part, streamed part): the CPU takes
        the earliest gradients (its updates overlap backward), see ``balance.split``."""
        if self._stream_request == 0 or not params:
            self.stream_fraction = self.stream_fraction or 0.0
            return chosen, []
        if self._state_probe is None:
            self._state_probe = state_elems_per_param(lambda groups: self._gpu_cls(groups, **self._kwargs))

        def rates() -> dict:
            if self._rates is None:
                self._rates = balance.rates(
                    self._device, params[0].device, lambda: balance.cpu_update_probe(
                        params[0].dtype, lambda groups: self._cpu_cls(groups, **self._kwargs),
                        hypers[0], self._chunk_elems),
                    self._cpu_threads)
            return self._rates

        on_cpu, self._balance = balance.split(params, self._stream_request, self._state_probe[0],
                                              rates, log=self.stream_fraction is None)
        self.stream_fraction = self._balance["stream_fraction"]
        return ([i for k, i in enumerate(chosen) if k in on_cpu],
                [i for k, i in enumerate(chosen) if k not in on_cpu])

    def _add_gpu_group(self, gi: int, params: list[torch.Tensor], hypers: list[dict]) -> None:
        keys = []
        for p in params:
            if self.param_update_in_fp32 and p.dtype in LOW_PRECISION:
                self._gpu_master[id(p)] = p.detach().float()
                keys.append(self._gpu_master[id(p)])
            else:
                keys.append(p)
        group = {**{k: v for k, v in hypers[gi].items() if k != "params"}, "params": keys}
        if self._gpu_opt is None:
            self._gpu_opt = self._gpu_cls([group], **self._kwargs)
        else:
            self._gpu_opt.add_param_group(group)
        self._gpu_groups.append(gi)

    def _hyperparameters(self) -> list[dict]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    # ------------------------------------------------------------------------------------------
    # public helpers

    def offloaded_params(self) -> list[torch.Tensor]:
        """The parameters updated on the CPU, in gradient-arrival order."""
        return [p for b in self._buckets for p in b.params]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients on the device only, like DDP's
        ``no_sync``: use it for every micro-batch but the last when accumulating gradients
        (without it the result is the same, but each further backward makes ``step()`` redo the
        copies and updates the previous one started)."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    def register_forward_waits(self, model: nn.Module) -> Any:
        """Make each submodule of ``model`` wait, before its forward, for its own offloaded
        parameters from the last ``step()`` (needed by ``overlap="next_forward"``; harmless
        otherwise). Returns a handle whose ``remove()`` unregisters the hooks."""
        ref = weakref.ref(self)
        handles = []
        parts = {id(part): k for k, part in enumerate(self._parts)}
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            mine = [p for p in own if id(p) in self._cpu]
            if mine:
                buckets = sorted({self._cpu[id(p)].bucket for p in mine})
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, b=buckets: _call(ref, "_wait_buckets", b)))
            streamed: dict[int, list[int]] = {}  # part position -> parameter indices in it
            for p in own:
                if id(p) in self._streamed:
                    part, k = self._streamed[id(p)]
                    streamed.setdefault(parts[id(part)], []).append(k)
            if streamed:
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, s=sorted(streamed.items()): _call(ref, "_wait_streamed", s)))
            self._covered.update(id(p) for p in own if id(p) in self._cpu or id(p) in self._streamed)
        self._module_hooks += handles
        return _Handles(handles)

    def wait_params(self) -> None:
        """In ``next_forward`` mode: wait for every parameter of the last step (before reading
        parameters outside a forward, e.g. to evaluate or save the model). The streamed part's
        update is ordered before what the compute stream does next (device side), and its
        staging freed."""
        self._finish_inflight()
        for part in self._parts:
            part.finish()
        for p in self.streamed_params():
            self._device.will_read(p)

    def close(self) -> None:
        """Finish pending work, remove every hook and stop the worker thread."""
        try:
            self._drain_all()
        finally:
            for h in self._hooks + self._module_hooks:
                h.remove()
            self._hooks, self._module_hooks = [], []
            self._worker.shutdown()
            if self._launcher is not None:
                self._launcher.close()

    # ------------------------------------------------------------------------------------------
    # backward: gradient copies, CPU jobs

    @property
    def _updates_in_backward(self) -> bool:
        return self._mode.updates_in_backward

    def _begin(self) -> _Step:
        st = self._step_state
        if st is None:
            self._finish_inflight()
            st = _Step(self._hyperparameters(), [
                sum(1 for p in b.params if p.requires_grad) for b in self._buckets])
            self._step_state = st
        return st

    def _on_grad(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        if self._no_sync or grad is None:
            return
        with self._lock:
            st = self._begin()
            if self._early:
                self._copy_grad(st, p, grad, from_hook=True)
            else:
                self._watch(st, p, grad, True)

    def _on_streamed_grad(self, p: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        if self._no_sync or grad is None or self._ddp:
            return
        with self._lock:
            st = self._begin()
            part, k = self._streamed[id(p)]
            part.backward.on_grad(k, grad, st.hypers)

    def _watch(self, st: _Step, p: torch.Tensor, grad: torch.Tensor, is_param_grad: bool) -> None:
        """Early work is off: only note which gradient backward produced, for ``step()`` to
        tell whether early work would have stayed valid (then it is turned on again)."""
        again = id(p) in st.watch
        st.watch[id(p)] = None if again else (p, grad, tensor_version(grad)) if is_param_grad else (p, _PENDING)

    def _copy_grad(self, st: _Step, p: torch.Tensor, grad: torch.Tensor, from_hook: bool,
                   is_param_grad: bool = True) -> None:
        """Queue the copy of ``grad`` (``p.grad``, or with ``is_param_grad=False`` DDP's reduced
        gradient, which DDP writes into ``p.grad`` at the end of backward) and remember what
        was copied, for ``step()`` to check."""
        if grad.layout != torch.strided:
            raise OffloadUsageError(
                f"parameter {tuple(p.shape)} has a sparse gradient: offloaded parameters need "
                "dense gradients (e.g. nn.Embedding(sparse=False))"
            )
        b = self._cpu[id(p)].bucket
        if id(p) in st.copied:
            # another backward reached p before step() (gradient accumulation without
            # no_sync(), or p used inside and outside a reentrant checkpoint): what was copied
            # (and maybe updated) is stale; step() redoes this bucket from the final gradient
            st.seen[id(p)] = None
            return
        source = grad
        if not grad.is_contiguous() or grad.dtype != p.dtype:
            grad = grad.contiguous().to(p.dtype)
            st.keep.append(grad)
        self._engine.grad_out(p, grad)
        st.copied.add(id(p))
        st.seen[id(p)] = (source, tensor_version(source)) if is_param_grad else _PENDING
        st.remaining[b] -= 1
        if st.remaining[b] == 0 and from_hook:
            self._close_bucket(st, b, during_backward=True)

    def _close_bucket(self, st: _Step, b: int, during_backward: bool) -> None:
        st.landed[b] = self._engine.mark_landed()
        if during_backward and self._updates_in_backward:
            if self.max_grad_norm is not None:
                st.norms[b] = self._worker.submit(self._bucket_norms, b, st.landed[b], 2.0, st)
            else:
                self._queue_updates(st, [b])

    def _flush(self, st: _Step) -> None:
        """Copy the gradients no hook copied (mode "none", unused params, grads set by hand) and
        close every bucket."""
        for b, bucket in enumerate(self._buckets):
            if b in st.landed:
                continue
            for p in bucket.params:
                if id(p) not in st.copied and p.grad is not None:
                    self._copy_grad(st, p, p.grad, from_hook=False)
            self._close_bucket(st, b, during_backward=False)

    # ------------------------------------------------------------------------------------------
    # worker jobs

    def _bucket_grads(self, b: int, st: _Step) -> list[Optional[torch.Tensor]]:
        return [self._engine.grads.typed(p) if id(p) in st.copied else None
                for p in self._buckets[b].params]

    def _bucket_norms(self, b: int, landed: Event, norm_type: float, st: _Step) -> dict[int, torch.Tensor]:
        self._engine.wait_landed(landed)
        params = [p for p, g in zip(self._buckets[b].params, self._bucket_grads(b, st)) if g is not None]
        grads = [self._engine.grads.typed(p) for p in params]
        return dict(zip(map(id, params), torch._foreach_norm(grads, norm_type) if grads else []))

    def _queue_updates(self, st: _Step, buckets: Sequence[int]) -> None:
        """Queue the updates of ``buckets`` (their gradient copies are queued), all before any
        job may pick one; ``st.updates[b]`` is done when bucket ``b`` is, whichever worker job
        runs it (see ``_run_next_update``). Each uses its bucket's clip coefficient, if any."""
        with st.ready_lock:
            for b in buckets:
                st.updates[b] = future = Future()
                st.ready.append((b, st.coefs.get(b), future))
        for _ in buckets:
            self._worker.submit(self._run_next_update, st)

    def _run_next_update(self, st: _Step) -> None:
        """One worker job per queued bucket; each runs the queued bucket that matters most now
        (``partition.next_update``: of the landed ones, the one the next forward needs first).
        A job finding nothing queued returns: ``step()`` took its bucket back, or the step was
        abandoned."""
        with st.ready_lock:
            if not st.ready:
                return
            i = next_update([e[0] for e in st.ready], lambda b: self._device.event_done(st.landed[b]))
            b, coef, future = st.ready.pop(i)
            early = not st.validated
            restore = b in st.spec  # a redo: undo the early update first
            st.spec.discard(b)
        future.set_running_or_notify_cancel()
        try:
            future.set_result(self._update_bucket(b, st, coef, early, restore))
        except BaseException as exc:  # noqa: BLE001 - raised to whoever waits for the bucket
            future.set_exception(exc)

    def _update_bucket(self, b: int, st: _Step, coef: Optional[torch.Tensor], early: bool,
                       restore: bool) -> Optional[Event]:
        """Update bucket ``b``; returns the event of its parameters' copy to the device.

        An ``early`` update (started before ``step()`` checked the gradients) keeps what it
        changes, and its parameters stay on the host, until it is committed: by this job if
        ``step()`` has found the bucket's gradients unchanged by now, else by ``step()``
        (``_validate``), which may instead redo it (the job then returns ``None``)."""
        t0 = time.perf_counter()
        landed = st.landed[b]
        self._engine.wait_landed(landed)
        t1 = time.perf_counter()
        bucket = self._buckets[b]
        if restore:
            bucket.restore()
        grads = self._bucket_grads(b, st)
        out = [self._engine.params.typed(p) for p in bucket.params]
        try:
            bucket.update(grads, out, self._scratch, st.hypers, coef, keep_previous=early)
        except BaseException:
            if bucket.restorable:  # an early update that failed leaves no trace
                bucket.restore()
            raise
        with st.ready_lock:
            commit = not early or (st.validated and b not in st.invalid)
            if not commit:
                st.spec.add(b)
        ev = None
        if commit:
            bucket.commit()
            ev = self._engine.params_in([p for p, g in zip(bucket.params, grads) if g is not None], landed)
        t2 = time.perf_counter()
        st.stats["cpu_update_s"] += t2 - t1
        st.stats["jobs"].append((t0, t1, t2))
        return ev

    # ------------------------------------------------------------------------------------------
    # step(): check the early work against the gradients as they are now

    def _still_valid(self, st: _Step, b: int) -> bool:
        """Bucket ``b``'s copies (and anything computed from them) match the gradients now: the
        same tensor at the same version for every copied parameter, and no gradient where
        none was copied (once the bucket's copies are complete)."""
        for p in self._buckets[b].params:
            if id(p) in st.copied:
                rec = st.seen.get(id(p))
                if (rec is None or rec is _PENDING or p.grad is not rec[0]
                        or not 0 <= rec[1] == tensor_version(p.grad)):
                    return False
            elif p.grad is not None and b in st.landed:
                return False
        return True

    def _validate(self, st: _Step) -> None:
        """Called by ``step()`` (and ``clip_grad_norm_``) before anything else: every bucket
        whose gradients changed since they were copied -- ``p.grad`` scaled or zeroed in place
        (``clip_grad_norm_``, unscaling), replaced, set to ``None``, accumulated by another
        backward -- or whose update started with hyperparameters changed since, loses its
        early work (``_reset``) and is copied and updated again from the gradients as they are
        now. Early updates that stay valid are committed."""
        hypers = self._hyperparameters()
        with st.ready_lock:
            queued = {e[0] for e in st.ready}
            invalid = {b for b in range(len(self._buckets)) if not self._still_valid(st, b)}
            if not same_hyperparameters(st.hypers, hypers):
                invalid |= {b for b in st.updates if b not in queued}
                st.hypers = hypers  # for the updates not started yet
            st.invalid |= invalid
            st.validated = True
            taken = {e[0] for e in st.ready if e[0] in invalid}
            st.ready = [e for e in st.ready if e[0] not in invalid]
            commit = [b for b in st.spec if b not in invalid]
            st.spec.difference_update(commit)
        for b in commit:
            bucket = self._buckets[b]
            bucket.commit()
            params = [p for p in bucket.params if id(p) in st.copied]
            st.updates[b] = _done(self._engine.params_in(params, st.landed[b]))
        for b in sorted(invalid):
            self._reset(st, b, started=b not in taken)

    def _reset(self, st: _Step, b: int, started: bool = True) -> None:
        """Forget bucket ``b``'s early work: wait for its jobs (``started``: its update job may
        run), drop its copies; ``_flush`` copies its gradients again and its update runs again
        (restoring the bucket first if an early update changed it, see ``st.spec``)."""
        norms, update = st.norms.pop(b, None), st.updates.pop(b, None)
        jobs = [j for j in (norms, update if started else None) if j is not None]
        for job in jobs:
            if job is not None:
                try:
                    job.result()  # it reads the staging buffers the new copies write into
                except BaseException:  # noqa: BLE001 - stale work: its error no longer matters
                    pass
        if b in st.landed or jobs:
            st.stats["redone"] += 1
        st.landed.pop(b, None)
        st.coefs.pop(b, None)
        st.waited.discard(b)
        bucket = self._buckets[b]
        for p in bucket.params:
            if id(p) in st.copied:
                st.copied.discard(id(p))
                rec = st.seen.pop(id(p), None)
                if isinstance(rec, tuple):
                    st.keep.append(rec[0])  # a queued copy may still read it
        st.remaining[b] = sum(1 for p in bucket.params if p.requires_grad)

    # ------------------------------------------------------------------------------------------
    # step

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Update every parameter (see the class docstring for what runs where and when).

        In ``next_forward`` mode this returns once the device part is queued and the CPU part
        is running; the next forward's modules wait for their own parameters.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        uncovered = len(self._cpu) + len(self._streamed) - len(self._covered)
        if self._mode.forward_waits and uncovered > 0:
            raise OffloadUsageError(
                "overlap='next_forward' needs opt.register_forward_waits(model) for the modules "
                f"owning the offloaded parameters ({uncovered} are not covered), or another "
                "overlap mode"
            )
        with self._lock:
            st = self._begin()
            self._step_state = None
        st.stats["step_called"] = time.perf_counter()
        try:
            self._validate(st)
            # gradients changed this step: expect them to change again (clipping every step),
            # so the next backward does no early work; untouched ones: early work resumes
            self._early = not st.invalid and all(
                w is not None and w[1] is not _PENDING and w[0].grad is w[1]
                and 0 <= w[2] == tensor_version(w[1]) for w in st.watch.values())
            self._flush(st)
            todo = [b for b in range(len(self._buckets)) if b not in st.updates]
            if self.max_grad_norm is not None:
                self.last_grad_norm, coef = self._clip(st, self.max_grad_norm, 2.0)
                st.coefs.update((b, coef) for b in todo)
            self._queue_updates(st, todo)
            self._gpu_step(st.hypers)
            for part in self._parts:  # on the device, from .grad as it is now (after clipping)
                part.step(st.hypers)
            for ev in st.landed.values():  # gradients may be zeroed or freed after step()
                self._engine.fence_compute(ev)
            st.keep.clear()
            st.seen.clear()
            st.watch.clear()
        except BaseException:
            self._drain(st)
            raise
        if self._mode.forward_waits:
            self._inflight = st
        else:
            self._wait_updates(st, list(st.updates))
        return loss

    def _gpu_step(self, hypers: list[dict]) -> None:
        opt = self._gpu_opt
        if opt is None:
            return
        sync_hyperparameters(opt, self._gpu_groups, hypers)
        masters = [(p, self._gpu_master[id(p)]) for g in self.param_groups for p in g["params"]
                   if id(p) in self._gpu_master]
        for p, m in masters:
            m.grad = None if p.grad is None else p.grad.float()
        try:
            opt.step()
            for p, m in masters:
                if p.grad is not None:
                    p.copy_(m)
        finally:
            for _, m in masters:
                m.grad = None

    def _wait_updates(self, st: _Step, buckets: Sequence[int]) -> None:
        error = None
        for b in buckets:
            if b in st.waited:
                continue
            st.waited.add(b)
            try:
                ev = st.updates[b].result()
            except BaseException as exc:  # noqa: BLE001 - raised after the others are fenced
                error = error or exc
                continue
            self._engine.fence_compute(ev)  # buckets that did update must reach the device
        self._record_stats(st)
        if error is not None:
            raise error

    def _record_stats(self, st: _Step) -> None:
        if len(st.waited) < len(st.updates) or "step_called" not in st.stats:
            return
        called = st.stats["step_called"]
        before = sum(max(0.0, min(t2, called) - t1) for _, t1, t2 in st.stats["jobs"])
        total = st.stats["cpu_update_s"]
        self.last_step_stats = {
            "cpu_update_s": total,
            "cpu_update_before_step_s": before,
            "overlapped_with_backward": before / total if total else 0.0,
            "redone_buckets": st.stats["redone"],
            "bytes_to_host": self._engine.bytes_out,
            "bytes_to_device": self._engine.bytes_in,
            **self._stream_stats(),
        }

    def _stream_stats(self) -> dict[str, Any]:
        return {
            "stream_fraction": self.stream_fraction,
            "stream_budget_bytes": self.stream_budget_bytes,
            "stream_staging_bytes": max([p.staging_bytes for p in self._parts] or [0]),
            "stream_bytes_to_device": sum(p.bytes_in for p in self._parts),
            "stream_bytes_to_host": sum(p.bytes_out for p in self._parts),
            # chunks of the streamed part updated during backward, and those step() kept
            "stream_early_chunks": sum(p.backward.started for p in self._parts if p.backward),
            "stream_early_kept": sum(p.backward.kept for p in self._parts if p.backward),
        }

    def split_estimate(self) -> Optional[dict[str, Any]]:
        """What ``stream_fraction="auto"`` planned with: the rates (measured at construction, or
        the device's ``nominal_rates``), bytes per parameter each way on each path, and the
        expected seconds per step of the CPU update, each link direction and their maximum
        (``bound_s``, the balanced time) for the split chosen. ``None`` unless "auto" chose it."""
        if not self._balance or self._balance["rates"] is None:
            return None
        b = self._balance
        n = sum(p.numel() for p in self.offloaded_params() + self.streamed_params())
        share = self.stream_fraction or 0.0
        return {"stream_fraction": share, "rates": dict(b["rates"]), "cpu_bytes": b["cpu_bytes"],
                "stream_bytes": b["stream_bytes"],
                **balance.balanced_seconds(n, 1.0 - share, b["rates"], b["cpu_bytes"], b["stream_bytes"])}

    @property
    def cpu_cores(self) -> Optional[list[int]]:
        """The CPUs the worker is bound to (``bind_cpu_cores=True``), else None."""
        return self._worker.cores

    def streamed_params(self) -> list[torch.Tensor]:
        """The offloaded parameters updated on the device from streamed state (see
        ``stream_fraction``), in gradient-arrival order."""
        return [p for part in self._parts for p in part.params]

    def _wait_buckets(self, buckets: Sequence[int]) -> None:
        st = self._inflight
        if st is None:
            return
        try:
            self._wait_updates(st, buckets)
        except BaseException:
            self._inflight = None
            self._drain(st)
            raise
        if len(st.waited) == len(st.updates):
            self._inflight = None

    def _wait_streamed(self, marks: Sequence[tuple[int, list[int]]]) -> None:
        for k, indices in marks:
            self._parts[k].wait_params(indices)

    def _finish_inflight(self) -> None:
        self._order_streamed()
        st, self._inflight = self._inflight, None
        if st is not None:
            try:
                self._wait_updates(st, list(st.updates))
            except BaseException:
                self._drain(st)
                raise

    def _drain(self, st: _Step) -> None:
        """After an error or an abandoned step: cancel the queued updates, wait for every job,
        undo every early update not committed yet (``CpuBucket.restore``), keep the device
        consistent with the CPU (parameters a committed update changed are copied back),
        swallow job errors."""
        with st.ready_lock:
            taken = []
            if not st.validated:  # an abandoned backward: its queued updates never run
                taken, st.ready = st.ready, []
            st.invalid.update(range(len(self._buckets)))  # early updates still running: no commit
        for _, _, future in taken:
            future.set_result(None)
        for b, f in list(st.updates.items()) + list(st.norms.items()):
            try:
                ev = f.result()
            except BaseException:  # noqa: BLE001 - the caller is already raising (or abandoning)
                continue
            if b in st.updates and st.updates[b] is f and b not in st.waited:
                self._engine.fence_compute(ev)
        st.waited.update(st.updates)
        for part in self._parts:  # its updates started in backward: dropped, never kept
            if part.backward is not None:
                part.backward.abandon()
        with st.ready_lock:
            spec, st.spec = st.spec, set()
        for b in spec:
            self._buckets[b].restore()
        for ev in st.landed.values():
            self._engine.fence_compute(ev)
        if any(self._cpu[k].bucket not in st.landed for k in st.copied):
            # Copies queued into a bucket that never closed (a backward that raised, or was
            # abandoned, before its last gradient): the gradients and temporaries they read
            # may be freed next (zero_grad, `keep` below) only after they ran.
            self._engine.fence_compute(self._engine.mark_landed())
        st.keep.clear()
        st.seen.clear()
        st.watch.clear()

    def _drain_all(self) -> None:
        with self._lock:
            st, self._step_state = self._step_state, None
        if st is not None:
            self._drain(st)
        self._finish_inflight()
        for part in self._parts:
            part.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. A backward that never reached ``step()`` is
        abandoned first: CPU updates it started are undone, so parameters and optimizer state
        are those of the last ``step()``, as with the wrapped optimizer."""
        with self._lock:
            st, self._step_state = self._step_state, None
        if st is not None:
            self._drain(st)
        if set_to_none:
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None:
                        self._device.will_free(p.grad)
        else:  # zeroed in place: after the streamed update read them (set to None: it holds them)
            self._order_streamed()
            for part in self._parts:
                for p in part.params:
                    if p.grad is not None:
                        self._device.will_write(p.grad)
        super().zero_grad(set_to_none)

    def _order_streamed(self) -> None:
        """Device side: the streamed update before what the compute stream does next (tests
        remove it: a hazard)."""
        for part in self._parts:
            part.order_params()

    # ------------------------------------------------------------------------------------------
    # clipping

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients (device and CPU parts) by their global norm, like
        ``torch.nn.utils.clip_grad_norm_(all_params, max_norm, norm_type)``; call it between
        backward and ``step()``. Returns the total norm.

        Same numbers as ``clip_grad_norm_`` on the same gradients: per-parameter norms are
        combined in torch's order; in modes ``none`` and ``backward_copies`` the offloaded
        gradients' norms come from their host copies and the copies are scaled on the CPU in
        the master dtype before the update (for fp32 and fp64 parameters that is torch's own
        operation). In the ``backward_update``/``next_forward`` modes updates start during
        backward, so this is ``torch.nn.utils.clip_grad_norm_`` itself, and ``step()`` redoes
        those updates from the clipped gradients (exact, but their overlap is lost): pass
        ``max_grad_norm=`` to the constructor instead to clip inside ``step()`` and keep it.

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
        if self._updates_in_backward:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
        with self._lock:
            st = self._begin()
        self._validate(st)
        if st.coefs:  # clipped before: the copies predate that scaling, copy them again
            for b in list(st.coefs):
                self._reset(st, b)
        self._flush(st)
        watched = [k for k, w in st.watch.items()
                   if w is not None and w[1] is not _PENDING and w[0].grad is w[1] and w[2] == tensor_version(w[1])]
        total, coef = self._clip(st, max_norm, norm_type)
        st.coefs.update((b, coef) for b in st.landed)
        for p in params:  # the copies scaled by coef on the CPU stand for the scaled .grad
            if isinstance(st.seen.get(id(p)), tuple) and p.grad is not None:
                st.seen[id(p)] = (p.grad, tensor_version(p.grad))
        for k in watched:  # this scaling does not count as a change (see step)
            p, g, _ = st.watch[k]
            st.watch[k] = (p, g, tensor_version(g))
        return total

    def _clip(self, st: _Step, max_norm: float, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Global norm and clip coefficient; scales the device gradients in place, returns the
        coefficient for the CPU part."""
        for b in range(len(self._buckets)):
            if b not in st.norms:
                st.norms[b] = self._worker.submit(self._bucket_norms, b, st.landed[b], norm_type, st)
        cpu_norms: dict[int, torch.Tensor] = {}
        for part in wait_all(list(st.norms.values())):
            cpu_norms.update(part)
        for ev in st.landed.values():  # the device gradients are scaled below
            self._engine.fence_compute(ev)
        groups: dict[tuple, list[torch.Tensor]] = {}  # torch's grouping: (device, dtype)
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None or id(p) in cpu_norms:
                    groups.setdefault((p.device, p.dtype), []).append(p)
        if not groups:
            return torch.tensor(0.0), torch.tensor(1.0)
        first = next(iter(groups))[0]
        norms: list[torch.Tensor] = []
        for params in groups.values():
            on_device = [p.grad for p in params if id(p) not in cpu_norms]
            device_norms = iter(torch._foreach_norm(on_device, norm_type) if on_device else [])
            norms += [cpu_norms[id(p)] if id(p) in cpu_norms else next(device_norms) for p in params]
        total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for (dev, _), params in groups.items():
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(dev))
        return total, coef.to("cpu")

    # ------------------------------------------------------------------------------------------
    # state dict

    def _placements(self) -> list[state_format.Placement]:
        out = []
        gpu_keys = {}
        if self._gpu_opt is not None:
            for group in self._gpu_opt.param_groups:
                for key in group["params"]:
                    gpu_keys[id(key)] = key
        for g in self.param_groups:
            for p in g["params"]:
                cp = self._cpu.get(id(p))
                sp = self._streamed.get(id(p))
                if sp is not None:
                    out.append(state_format.Placement(p, sp[0], sp[0].keys[sp[1]], True))
                elif cp is not None:
                    out.append(state_format.Placement(p, self._buckets[cp.bucket], cp.master, True))
                else:
                    key = self._gpu_master.get(id(p), p)
                    out.append(state_format.Placement(p, self._gpu_opt, key, False))
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format plus a ``"hybrid"`` entry (master weights, placement); see
        ``cpu_offload.optim.state``. ``to_wrapped_format(sd)`` converts it to the wrapped
        optimizer's own format."""
        self._drain_all()
        return state_format.gather(self.param_groups, self._placements(), self._implementation)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a hybrid optimizer (any ``offload_fraction``) or of the
        wrapped optimizer class over the same parameter groups. Updated parameters are copied to
        the device (their master weights, when the state dict has them)."""
        self._drain_all()
        sub_groups = {id(b): b.group_ids for b in self._buckets}
        if self._gpu_opt is not None:
            sub_groups[id(self._gpu_opt)] = self._gpu_groups
        sub_groups.update((id(part), part.group_ids) for part in self._parts)
        placements = self._placements()
        state_format.scatter(state_dict, self.param_groups, placements, sub_groups)
        with torch.no_grad():
            for pl in placements:
                if pl.master is not None and not pl.offloaded:
                    pl.param.copy_(pl.master)
            for bucket in self._buckets:
                for p, m in zip(bucket.params, bucket.masters):
                    self._engine.params.typed(p).copy_(m)
                self._engine.fence_compute(
                    self._engine.params_in(bucket.params, self._engine.compute_event()))
            for part in self._parts:
                part.write_params()

    def reload_master_weights(self) -> None:
        """Start the master weights again from the model's current parameters: call this after
        changing parameters outside the optimizer (e.g. ``model.load_state_dict`` without the
        optimizer's state dict); optimizer state (moments) is kept."""
        self._drain_all()
        with torch.no_grad():
            for bucket in self._buckets:
                self._engine.read_params(bucket.params)
                for p, m in zip(bucket.params, bucket.masters):
                    m.copy_(self._engine.params.typed(p))
            for part in self._parts:
                part.read_params()
            for g in self.param_groups:
                for p in g["params"]:
                    if id(p) in self._gpu_master:
                        self._gpu_master[id(p)].copy_(p)

    # ------------------------------------------------------------------------------------------
    # DDP

    def ddp_comm_hook(self, inner: Optional[Callable] = None) -> tuple[Any, Callable]:
        """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.

        Under DDP a post-accumulate-grad hook sees the local, unreduced gradient, so calling
        this switches the optimizer to take offloaded gradients from DDP's reduced buckets
        instead: ``inner`` (default: DDP's ``allreduce_hook`` on the default group) reduces
        the bucket, then each offloaded gradient in it is copied to the host as above. At the
        end of backward, after DDP has written the reduced gradients into ``.grad``, the
        optimizer records them, so that ``step()`` sees later changes (clipping, ...) as
        without DDP.
        """
        ref = weakref.ref(self)
        state_and_hook = ddp.comm_hook(
            lambda params, flat: _call(ref, "_on_reduced_bucket", params, flat), inner,
            on_start=lambda: _call(ref, "_queue_ddp_record"))
        self._ddp = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        return state_and_hook

    def _on_reduced_bucket(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        if not self._mode.copies_in_backward:  # step() copies the reduced p.grad
            return
        offset = 0
        for p in params:
            n = p.numel()
            if id(p) in self._cpu and not self._no_sync:
                with self._lock:
                    if self._early:
                        self._copy_grad(self._begin(), p, flat[offset: offset + n].view(p.shape), True,
                                        is_param_grad=False)
                    else:
                        self._watch(self._begin(), p, flat, False)
            offset += n

    def _queue_ddp_record(self) -> None:
        """(Engine thread, during backward.) Queue ``_record_ddp_grads`` to run once DDP's own
        end-of-backward callback has written the reduced gradients into ``.grad``: DDP queues
        it after the last bucket's hook, so a callback queued now runs before it, and one that
        callback queues runs after it (the engine runs callbacks queued by callbacks)."""
        if not self._mode.copies_in_backward or self._no_sync:
            return
        with self._lock:
            st = self._begin()
            if st.record_queued:
                return
            st.record_queued = True
        ref = weakref.ref(self)
        engine = torch.autograd.Variable._execution_engine

        def after_ddp() -> None:
            _call(ref, "_record_ddp_grads", st)

        try:
            engine.queue_callback(lambda: engine.queue_callback(after_ddp))
        except RuntimeError:  # not inside a backward: step() finds nothing recorded, copies again
            pass

    def _record_ddp_grads(self, st: _Step) -> None:
        with self._lock:
            for bucket in self._buckets:
                for p in bucket.params:
                    g = p.grad
                    if st.seen.get(id(p)) is _PENDING:
                        st.seen[id(p)] = None if g is None else (g, tensor_version(g))
                    w = st.watch.get(id(p))
                    if w is not None and w[1] is _PENDING:
                        st.watch[id(p)] = None if g is None else (p, g, tensor_version(g))


def _call(ref: "weakref.ref[HybridDeviceOptimizer]", name: str, *args: Any) -> None:
    """Hooks hold the optimizer weakly: a dropped optimizer stops copying."""
    opt = ref()
    if opt is not None:
        getattr(opt, name)(*args)


class _Handles:
    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
