"""What a fuzz program is (``ProgramSpec``), how one is drawn from a seed (``generate``), and the
rules that keep it valid (``normalize``: every program it returns is one plain torch runs
without error, and one the library documents as supported).

A spec is plain data: ``repr(spec)`` rebuilds it, ``features(spec)`` names what it combines (for
``CPU_OFFLOAD_FUZZ_EXCLUDE`` and the statistics), ``codegen.program_source(spec)`` turns it into
the Python program that runs.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Optional

from cpu_offload.compat import TORCH_VERSION
from cpu_offload.optim import OVERLAP_MODES
from cpu_offload.optim.classes import FUSED_CPU_SGD_LOW_PRECISION_FIXED
from cpu_offload.v2.schedule import validate_synchronization_dict

from .layers import LAYER_CLASSES

KINDS = tuple(k for k in LAYER_CLASSES if k != "odd_params")  # odd_params: drawn on its own
ENTRIES = ("ctx", "sync_dict", "manual", "apply", "apply_dict", "plan")
V1_ENTRIES = ("ctx", "apply", "plan")
APPLY_ENTRIES = ("apply", "apply_dict", "plan")
DTYPES = ("float32", "float64", "bfloat16")
BACKWARDS = ("backward", "retain_double", "autograd_grad")
EDITS = ("clip", "scale", "zero", "none", "zero_grad")
# drawn after EDITS: .grad.data writes (no version bump), clip_grad_value_, the learning rate
# changed in place between backward and step()
MORE_EDITS = ("data_div", "data_mul", "clip_value", "lr")
PARAM_EDITS = ("clamp_data", "clamp_nograd")  # parameters changed in place after step()
UPDATING_MODES = ("backward_update", "next_forward")  # the CPU update starts during backward
LOW_PRECISION = ("bfloat16", "float16")
# The optimizer classes: name -> (torch.optim class, its arguments besides lr and weight_decay).
# "adamw_fused" is the hybrid optimizer's default (no class passed).
OPTIMIZERS = {
    "adamw_fused": ("AdamW", {"fused": True}),
    "adamw_foreach": ("AdamW", {"foreach": True}),
    "adamw_loop": ("AdamW", {"foreach": False}),
    "adam_amsgrad": ("Adam", {"amsgrad": True}),
    "adam_maximize": ("Adam", {"maximize": True}),
    "adam_amsgrad_maximize": ("Adam", {"amsgrad": True, "maximize": True}),
    "adam_fused_amsgrad": ("Adam", {"fused": True, "amsgrad": True}),
    "sgd": ("SGD", {}),
    "sgd_momentum": ("SGD", {"momentum": 0.9}),
    "sgd_nesterov": ("SGD", {"momentum": 0.9, "nesterov": True}),
    "sgd_fused": ("SGD", {"momentum": 0.9, "fused": True}),
    "adagrad": ("Adagrad", {"lr_decay": 0.01}),
    "adagrad_fused": ("Adagrad", {"fused": True}),
    "rmsprop": ("RMSprop", {"momentum": 0.5}),
    "rmsprop_centered": ("RMSprop", {"centered": True, "alpha": 0.9}),
}
NO_TENSOR_LR = ("adamw_foreach",)  # torch: "lr as a Tensor is not supported ... foreach=True"
SCALER_MODES = ("step", "unscale", "unscale_clip")  # GradScaler: scaler.step(opt) alone, or
# after scaler.unscale_(opt) (and clip_grad_norm_)
SAVES = ("state_dict", "dcp")  # opt.state_dict(), DCP's get_optimizer_state_dict(model, opt)
MISUSES = ("device_str", "grad_order_int", "grad_order_str", "sparse_grad")


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its kind (``layers.LAYER_CLASSES``), its constructor variant, its output type
    (``tensor``, ``tuple``, ``dict``) and the checkpoint the user wraps it in."""

    kind: str
    variant: int = 0
    out: str = "tensor"
    ckpt: str = "none"  # none | reentrant | nonreentrant
    dtype: Optional[str] = None  # None: the program's; else this layer's (mixed dtypes)


@dataclass(frozen=True)
class OptSpec:
    """``HybridDeviceOptimizer`` against the wrapped torch optimizer (``cls``, a key of
    ``OPTIMIZERS``; over fp32 masters where parameters are bf16/fp16: ``prelude.Masters``), and
    what the user does around ``step()``.

    ``edits``, between backward and ``step()``: ``("clip", max_norm)``, ``("scale", param,
    factor)`` (``grad.mul_``), ``("zero", param)``, ``("none", param)``, ``("zero_grad",
    set_to_none)``, ``("data_div", param, k)`` (``p.grad.data /= k``), ``("data_mul", param,
    c)`` (``p.grad.data.mul_(c)``), ``("clip_value", v)`` (``clip_grad_value_``), ``("lr",
    group, value)`` (``group["lr"].fill_(value)`` for a tensor lr, ``group["lr"] = value``
    for a float one). ``param_edits``, after every ``step()``: ``("clamp_data", c)``
    (``p.data.clamp_``) or ``("clamp_nograd", c)`` (``p.clamp_`` under ``torch.no_grad()``).

    ``groups``: further param groups, each a tuple of ``(hyperparameter, value)`` overrides;
    parameter ``i`` goes to group ``i % (len(groups) + 1)``. ``lr_tensor``: every group's lr is
    a tensor of its own. ``scheduler`` (``lambda``: ``LambdaLR``, ``step``: ``StepLR``) steps
    right after ``opt.step()``. ``scaler``: a ``GradScaler("cpu")`` scales the losses
    (``SCALER_MODES``); ``inf_step``: the step whose loss is multiplied by inf (the scaler skips
    it). ``saves``: ``(step, kind)``, a save after that step (``SAVES``; its optimizer state is
    compared, and it must not change training). ``close_step``: before that step's ``step()``,
    the hybrid optimizer is closed, a ``step()`` must raise ``OffloadUsageError`` naming
    ``close()``, and a new one is built from its ``state_dict()``. ``ddp``: the model runs
    under ``DistributedDataParallel`` (gloo, one process), the hybrid optimizer's
    ``ddp_comm_hook`` registered. ``numpy_args``: sizes and fractions given as numpy scalars.
    ``misuse``: a wrong use tried first on parameters of its own (``MISUSES``)."""

    fraction: float = 0.5
    overlap: str = "backward_update"
    bucket_bytes: int = 512
    chunk_bytes: int = 0
    max_grad_norm: Optional[float] = None
    edits: tuple = ()
    no_sync: bool = True  # accumulate micro-batches inside opt.no_sync()
    weight_decay: float = 0.0
    shared_device: bool = True  # the optimizer uses the activation offloading's device
    stream_fraction: Any = 0.0  # share of the offloaded parameters streamed ("auto" or [0, 1])
    edit_steps: Optional[tuple] = None  # the steps whose gradients are edited (None: every step)
    stream_during_backward: bool = False
    inline_launches: bool = False  # the early updates run in backward's hooks, not deferred
    cls: str = "adamw_fused"
    lr_tensor: bool = False
    groups: tuple = ()
    scheduler: Optional[str] = None
    scaler: Optional[str] = None
    inf_step: Optional[int] = None
    param_edits: tuple = ()
    saves: tuple = ()
    close_step: Optional[int] = None
    ddp: bool = False
    pin_grads: bool = True
    pin_params: bool = True
    numpy_args: bool = False
    misuse: Optional[str] = None
    # next_forward: the chunks the streamed part queues before the CPU and device parts (None:
    # the library's STREAM_AHEAD_CHUNKS, more than a fuzz model has, so the rest come after)
    stream_ahead: Optional[int] = None
    # bf16/fp16 parameters: False keeps their state in their own dtype (no fp32 master), and the
    # reference is then torch's class itself on the parameters
    fp32_masters: bool = True
    # opt.state[p] read for every parameter between backward and step() (it must change nothing)
    state_read: bool = False
    # after every step(), each parameter given new memory of the same values (p.data = clone)
    data_assign: bool = False
    # Adam/AdamW: every group's betas a tuple of 0-dim tensors of its own, betas[0] filled in
    # place between backward and step() (a snapshot must copy tensors inside tuples too)
    betas_tensor: bool = False
    # backward's gradient hooks run with another stream of the optimizer's own device current,
    # and the compute stream waits only for what was queued there by the end of backward, as
    # FSDP2 runs them on its reduce-scatter stream (the optimizer's device only: the activation
    # offloading's takes the current stream for compute)
    hook_stream: bool = False
    # how ``close_step``'s new optimizer gets the old one's state: ``state_dict`` (its
    # ``load_state_dict``); ``torch``: that step is taken by the torch class on the parameters
    # themselves (no masters), loaded with the ``state_dict()`` as is (a hybrid's masters carried
    # along, cast to the parameters' dtype), and the new optimizer loads that class's
    # ``state_dict()``; ``dcp``: DCP's ``get_optimizer_state_dict``/``set_optimizer_state_dict``
    close_via: str = "state_dict"


@dataclass(frozen=True)
class ProgramSpec:
    """A training program: a stack of layers, how offloading is applied to it, and the steps.

    ``backwards`` has one tuple per optimizer step with one entry per micro-batch (``backward``,
    ``retain_double``: two backwards with ``retain_graph``, ``autograd_grad``). ``manual``:
    ``(layer, release_after)`` pairs (offload after the layer's forward, release after the
    forward of layer ``release_after``, ``n``: after the stack, ``-1``: never; reload what was
    released before backward). ``fault``: ``(kind, layer)``, an extra micro-batch before the
    first step that raises (``fwd``: in the layer's forward, ``bwd``: in backward, at the layer's
    output, ``between``: after the layer)."""

    seed: int
    layers: tuple
    width: int = 8
    dtype: str = "float32"
    backend: str = "v2"
    entry: str = "ctx"
    num_layers: int = 0
    min_size: Optional[int] = 0  # None: the library's default
    sync_dict: tuple = ()  # ((layer, (offload_fwd, offload_num, reload_fwd, reload_num)), ...)
    manual: tuple = ()
    extra_model_layers: int = 0  # manual: model_layers = len(layers) + this
    recompute: tuple = ()  # plan
    spread: tuple = ()  # plan.offloaded
    partial_bytes: Optional[int] = None  # plan
    selective: tuple = ()
    selective_scope: str = "modules"
    stack_ckpt: str = "none"
    backwards: tuple = (("backward",),)
    eval_forward: str = "none"  # none | before (each step) | inside (between forward and backward)
    fault: tuple = ()
    optimizer: Optional[OptSpec] = None
    # V2's BATCH_BYTES for the program (None: the library's 1 MiB, which the fuzzer's small
    # tensors never reach): storages from this size on are copied as soon as they are saved,
    # with those saved before them, instead of at the layer's end.
    batch_bytes: Optional[int] = None
    frozen: tuple = ()  # parameters (by index) with requires_grad=False

    @property
    def n(self) -> int:
        return len(self.layers)

    def layer_dtype(self, i: int) -> str:
        return self.layers[i].dtype or self.dtype

    @property
    def dtypes(self) -> set:
        """The parameter dtypes of the model."""
        return {self.layer_dtype(i) for i in range(self.n)}

    @property
    def mixed(self) -> bool:
        """Some layers have a dtype of their own (the hidden state is cast before each layer)."""
        return any(layer.dtype is not None for layer in self.layers)

    @property
    def low_precision(self) -> bool:
        """Some parameters are bf16/fp16: the reference keeps fp32 masters (``Masters``)."""
        return bool(self.dtypes & set(LOW_PRECISION))


def features(spec: ProgramSpec) -> set:
    """Names of what the program combines, e.g. ``entry=manual``, ``ckpt_stack=nonreentrant``."""
    return set(feature_counts(spec))


def feature_counts(spec: ProgramSpec) -> Counter:
    """``features`` with how often each occurs (per layer, per edit...)."""
    f = Counter({f"backend={spec.backend}", f"entry={spec.entry}", f"dtype={spec.dtype}"})
    for layer in spec.layers:
        f[f"layer={layer.kind}"] += 1
        if layer.out != "tensor":
            f[f"out={layer.out}"] += 1
        if layer.ckpt != "none":
            f[f"ckpt_layer={layer.ckpt}"] += 1
        if layer.dtype is not None and layer.dtype != spec.dtype:
            f[f"dtype={layer.dtype}"] += 1
        if layer.kind == "odd_params":
            f.update(["zero_size", "scalar_param", "frozen"])
    if spec.mixed:
        f["mixed_dtypes"] += 1
    if spec.frozen:
        f["frozen"] += len(spec.frozen)
    if spec.stack_ckpt != "none":
        f[f"ckpt_stack={spec.stack_ckpt}"] += 1
    if spec.min_size is None:
        f["min_size=default"] += 1
    elif spec.min_size:
        f["min_size>0"] += 1
    if spec.sync_dict:
        f["sync_dict"] += 1
    if spec.extra_model_layers:
        f["manual_extra_model_layers"] += 1
    if spec.recompute:
        f["plan_recompute"] += 1
    if spec.spread:
        f["plan_spread"] += 1
    if spec.partial_bytes is not None:
        f["plan_partial"] += 1
    if spec.batch_bytes is not None:
        f["early_copies"] += 1
    if spec.selective:
        f.update(["selective", f"selective_scope={spec.selective_scope}"])
    if len(spec.backwards) > 1:
        f["steps>1"] += 1
    for step in spec.backwards:
        if len(step) > 1:
            f["accumulation"] += 1
        f.update(f"backward={b}" for b in step if b != "backward")
    if spec.eval_forward != "none":
        f[f"eval={spec.eval_forward}"] += 1
    if spec.fault:
        f[f"fault={spec.fault[0]}"] += 1
    opt = spec.optimizer
    if opt is not None:
        f.update(["optimizer", f"overlap={opt.overlap}"])
        f.update(f"edit={_edit_name(e, opt)}" for e in opt.edits)
        if opt.edits and opt.edit_steps is not None:
            f["edit_some_steps"] += 1
        if opt.max_grad_norm is not None:
            f["max_grad_norm"] += 1
        if opt.stream_fraction != 0.0 and opt.fraction > 0:
            f["stream"] += 1
            if opt.overlap == "next_forward":  # the streamed update overlaps the next forward
                f["stream_overlapped"] += 1
                if opt.stream_ahead is not None:
                    f["stream_queued_in_two_parts"] += 1
                    if not opt.stream_during_backward:  # the rest queued after step() returns
                        f["stream_rest_deferred"] += 1
            if opt.stream_during_backward:
                f["stream_during_backward"] += 1
                f["inline_launches" if opt.inline_launches else "deferred_launches"] += 1
            sf = opt.stream_fraction
            f["stream_fraction=" + (sf if isinstance(sf, str) else "1" if sf == 1 else "part")] += 1
        f[f"optim={opt.cls}"] += 1
        if not opt.fp32_masters:
            f["state_in_param_dtype"] += 1
        if opt.lr_tensor:
            f["lr=tensor"] += 1
        if opt.groups:
            f["groups>1"] += 1
        if opt.scheduler:
            f[f"sched={opt.scheduler}"] += 1
        if opt.scaler:
            f[f"scaler={opt.scaler}"] += 1
        if opt.inf_step is not None:
            f["scaler_inf_step"] += 1
        f.update(f"param_edit={e[0]}" for e in opt.param_edits)
        f.update(f"save={kind}" for _, kind in opt.saves)
        if opt.close_step is not None:
            f["close_reuse"] += 1
            if opt.close_via != "state_dict":
                f[f"close_via_{opt.close_via}"] += 1
        if opt.ddp:
            f["ddp"] += 1
        if 0 < opt.chunk_bytes < 1024:
            f["chunk_bytes_small"] += 1
        if not opt.pin_grads:
            f["pageable_grads"] += 1
        if not opt.pin_params:
            f["pageable_params"] += 1
        if opt.numpy_args:
            f["numpy_args"] += 1
        if opt.misuse:
            f[f"misuse={opt.misuse}"] += 1
        if opt.state_read:
            f["state_read"] += 1
        if opt.data_assign:
            f["data_assign"] += 1
        if opt.hook_stream:
            f["hook_stream"] += 1
        if opt.betas_tensor:
            f["betas=tensor"] += 1
    return f


def _edit_name(edit: tuple, opt: OptSpec) -> str:
    if edit[0] == "lr":
        return "lr_fill" if opt.lr_tensor else "lr_set"
    return edit[0]


def layer_kwargs(layer: LayerSpec, width: int) -> dict:
    """The constructor arguments of a layer (its ``variant`` picks the options)."""
    kw: dict = {"width": width}
    if layer.kind == "attention":
        kw.update(causal=not layer.variant & 1, cuda_layout=not layer.variant & 2)
    elif layer.kind == "rnn":
        kw.update(gru=layer.variant % 2 == 0)
    elif layer.kind == "inplace_after_recipe":
        kw.update(module_act=layer.variant % 2 == 1)
    elif layer.kind == "odd_params":
        kw.update(use_empty=layer.variant % 2 == 0)
    if layer.out != "tensor":
        kw.update(out=layer.out)
    return kw


def param_count(kind: str, variant: int, width: int) -> int:
    """How many parameter tensors a layer has (edits name parameters by index)."""
    return len(trainable(kind, variant, width))


@lru_cache(maxsize=None)
def trainable(kind: str, variant: int, width: int) -> tuple:
    """``requires_grad`` of each of a layer's parameters, in ``parameters()`` order."""
    layer = LAYER_CLASSES[kind](**layer_kwargs(LayerSpec(kind, variant), width))
    return tuple(p.requires_grad for p in layer.parameters())


# --- validity ------------------------------------------------------------------------------------


def sync_entry_valid(layer: int, entry: tuple, n: int) -> bool:
    try:
        validate_synchronization_dict({layer: entry}, n)
    except Exception:  # noqa: BLE001 - any refusal: not a valid entry for this n
        return False
    return True


def spread_valid(spread: tuple, n: int) -> bool:
    """``spread_synchronization_dict``'s rule: the j-th of k layers is at most n-k+j-1."""
    k = len(spread)
    return (list(spread) == sorted(set(spread)) and k < n
            and all(0 <= s <= n - k + j - 1 for j, s in enumerate(spread)))


def normalize(spec: ProgramSpec) -> ProgramSpec:
    """The valid program closest to ``spec``: drops or clamps whatever breaks a rule. Idempotent;
    ``generate`` and every shrinking step pass through it."""
    n = spec.n
    s = spec
    v1 = s.backend == "v1"
    entry = s.entry
    if v1 and entry not in V1_ENTRIES:
        entry = {"sync_dict": "ctx", "manual": "ctx", "apply_dict": "apply"}[entry]
    s = replace(s, entry=entry)
    k = s.num_layers
    recompute = tuple(sorted({r for r in s.recompute if r < n})) if entry == "plan" else ()
    spread = s.spread if entry == "plan" else ()
    partial = s.partial_bytes if entry == "plan" else None
    if entry in ("ctx", "apply"):
        k = max(0, min(k, n - 1))
    elif entry == "plan":
        k = max(0, min(k, n))
        if k == n and (n - 1 not in recompute or v1):
            k = n - 1
        if spread and (len(spread) != k or not spread_valid(spread, n) or v1):
            spread = ()
        if v1:
            offloaded = set(range(k))
            recompute = tuple(r for r in recompute if r not in offloaded)
            partial = None
        if k == 0:
            partial = None
    else:
        k = 0
    sync = ()
    if entry in ("sync_dict", "apply_dict"):
        sync = tuple((i, e) for i, e in s.sync_dict if i < n and sync_entry_valid(i, e, n))
    manual, extra = (), 0
    if entry == "manual":
        seen = set()
        for i, r in s.manual:
            if i < n and i not in seen:
                seen.add(i)
                manual += ((i, r if r < 0 else max(i, min(r, n))),)
        extra = s.extra_model_layers
    selective = ()
    if entry in APPLY_ENTRIES and not v1:
        selective = tuple(sorted({i for i in s.selective if i < n and i not in recompute}))
    reentrant_ok = entry in ("ctx", "sync_dict", "manual")
    layers = tuple(
        replace(l, ckpt="nonreentrant") if l.ckpt == "reentrant" and (not reentrant_ok or l.out == "dict")
        else l
        for l in s.layers
    )
    stack_ckpt = s.stack_ckpt if entry != "manual" else "none"
    fault = s.fault if s.fault and s.fault[1] < n and stack_ckpt == "none" else ()
    reentrant = stack_ckpt == "reentrant" or any(l.ckpt == "reentrant" for l in layers)
    backwards = tuple(
        tuple("backward" if b == "autograd_grad" and reentrant else b for b in step) or ("backward",)
        for step in s.backwards
    ) or (("backward",),)
    layers = tuple(replace(l, dtype=None) if l.dtype == s.dtype else l for l in layers)
    count = sum(param_count(l.kind, l.variant, s.width) for l in layers)
    frozen = sorted({i % count for i in s.frozen})
    # one parameter at least keeps training (DDP refuses a model without any)
    grads = [i for i, t in enumerate(t for l in layers for t in trainable(l.kind, l.variant, s.width))
             if t]
    while frozen and set(grads) <= set(frozen):
        frozen.pop()
    frozen = tuple(frozen)
    opt = s.optimizer
    if opt is not None and opt.ddp:
        # DistributedDataParallel: one backward per parameter per iteration, into .grad, and
        # no reentrant checkpoint (its parameters would be marked ready twice)
        layers = tuple(replace(l, ckpt="nonreentrant") if l.ckpt == "reentrant" else l
                       for l in layers)
        stack_ckpt = "nonreentrant" if stack_ckpt == "reentrant" else stack_ckpt
        backwards = tuple(("backward",) * len(step) for step in backwards)
        fault = ()
    if opt is not None:
        opt = _normalize_optimizer(replace(s, layers=layers, backwards=backwards), opt, count)
    return replace(
        s, layers=layers, num_layers=k, min_size=None if v1 else s.min_size, sync_dict=sync,
        manual=manual, extra_model_layers=extra, recompute=recompute, spread=spread,
        partial_bytes=partial, selective=selective,
        selective_scope=s.selective_scope if selective else "modules", stack_ckpt=stack_ckpt,
        backwards=backwards, fault=fault, optimizer=opt, frozen=frozen,
    )


def _normalize_optimizer(s: ProgramSpec, opt: OptSpec, count: int) -> OptSpec:
    # torch's fused CPU SGD skips vector blocks of bf16/fp16 tensors and reads momentum it never
    # wrote before 2.14 (pytorch/pytorch#191763): on the simulated device the device part and the
    # reference run it on the CPU, so those programs would differ by torch's bug, run to run
    if (opt.cls == "sgd_fused" and s.low_precision
            and TORCH_VERSION < FUSED_CPU_SGD_LOW_PRECISION_FIXED):
        opt = replace(opt, cls="sgd_momentum")
    steps = len(s.backwards)
    ngroups = len(opt.groups) + 1
    edits = tuple(
        (e[0], e[1] % count, *e[2:]) if e[0] in ("scale", "zero", "none", "data_div", "data_mul")
        else (e[0], e[1] % ngroups, *e[2:]) if e[0] == "lr" else e
        for e in opt.edits
        # torch's fused SGD fails on a parameter whose first gradient comes after the others'
        # momentum buffers exist ("expected Tensor as element 1 in argument 2")
        if not (opt.cls == "sgd_fused" and e in (("none", e[1]), ("zero_grad", True)))
    )
    low = s.low_precision
    # GradScaler refuses to unscale fp16 gradients ("Attempting to unscale FP16 gradients")
    scaler = None if "float16" in s.dtypes else opt.scaler
    mgn = opt.max_grad_norm
    # bf16: the hybrid optimizer clips its CPU part in fp32 (documented), torch in bf16; a
    # scaler without unscale_: torch would clip the scaled gradients, the hybrid unscaled ones
    if low or scaler == "step":
        mgn = None
    inf_step = opt.inf_step if scaler and opt.inf_step is not None and opt.inf_step < steps else None
    # fused SGD with momentum makes its momentum buffers with empty_like on a parameter's first
    # step, and a step skipped for an inf leaves them uninitialized: torch itself differs run to
    # run. The first step is that of the first iteration whose backwards fill ``.grad``
    # (``autograd.grad`` alone does not, and the program then calls no step)
    first = next((k for k, hows in enumerate(s.backwards) if set(hows) - {"autograd_grad"}), None)
    if inf_step is not None and inf_step == first and opt.cls == "sgd_fused":
        inf_step = None
    saves = tuple(sorted({(st, kind) for st, kind in opt.saves if st < steps}))
    close = opt.close_step
    # a scheduler and DDP's comm hook hold the closed optimizer: no rebuild with them
    if close is not None and (close >= steps or opt.scheduler or opt.ddp):
        close = None
    via = opt.close_via if close is not None else "state_dict"
    if via == "torch" and (scaler or mgn is not None):  # torch's class takes a plain step()
        via = "state_dict"
    if via == "torch" and steps > 1:  # after a step: the masters it carries are then stale
        close = max(close, 1)
    return replace(
        opt, edits=edits, no_sync=opt.no_sync or opt.overlap in UPDATING_MODES,
        max_grad_norm=mgn, inline_launches=opt.inline_launches and opt.stream_during_backward,
        lr_tensor=opt.lr_tensor and opt.cls not in NO_TENSOR_LR, scaler=scaler,
        betas_tensor=(opt.betas_tensor and OPTIMIZERS[opt.cls][0] in ("Adam", "AdamW")
                      and opt.cls not in NO_TENSOR_LR),
        inf_step=inf_step, saves=saves, close_step=close, close_via=via,
        hook_stream=opt.hook_stream and not opt.shared_device,
        # the reference of bf16/fp16 parameters keeps fp32 masters that it does not reload from
        # edited parameters: parameter edits only where the reference is torch's class itself
        param_edits=() if low and opt.fp32_masters else opt.param_edits,
        stream_ahead=(opt.stream_ahead if opt.overlap == "next_forward" and opt.fraction > 0
                      and opt.stream_fraction != 0.0 else None),
        fp32_masters=opt.fp32_masters or not low,
    )


# --- generation ----------------------------------------------------------------------------------


def _sync_dict(rng: random.Random, n: int) -> tuple:
    """Random valid ``synchronization_dict`` entries for some of the layers."""
    out = []
    for layer in range(n):
        if rng.random() < 0.5:
            continue
        for _ in range(20):
            off_fwd = rng.random() < 0.6
            off_num = rng.randint(1, n + 1 if off_fwd else n)
            rel_fwd = rng.random() < 0.2
            rel_num = rng.randint(1, n)
            entry = (off_fwd, off_num, rel_fwd, rel_num)
            if sync_entry_valid(layer, entry, n):
                out.append((layer, entry))
                break
    return tuple(out)


def _spread(rng: random.Random, k: int, n: int) -> tuple:
    out, prev = [], -1
    for j in range(k):
        prev = rng.randint(prev + 1, n - k + j - 1)
        out.append(prev)
    return tuple(out)


def _optimizer(rng: random.Random) -> OptSpec:
    edits = []
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        kind = rng.choice(EDITS)
        if kind == "clip":
            edits.append(("clip", rng.choice((0.01, 0.1, 1.0))))
        elif kind == "scale":
            edits.append(("scale", rng.randrange(1000), rng.choice((0.0, 0.5, 2.0, -1.0))))
        elif kind in ("zero", "none"):
            edits.append((kind, rng.randrange(1000)))
        else:
            edits.append(("zero_grad", rng.random() < 0.5))
    return OptSpec(
        fraction=rng.choice((0.0, 0.25, 0.5, 0.75, 1.0, round(rng.random(), 2))),
        overlap=rng.choice(OVERLAP_MODES),
        bucket_bytes=rng.choice((64, 512, 4096, 1 << 26)),
        chunk_bytes=rng.choice((0, 4096, 1 << 22)),
        max_grad_norm=rng.choice((None, None, None, 0.05, 1.0)),
        edits=tuple(edits),
        no_sync=rng.random() < 0.5,
        weight_decay=rng.choice((0.0, 0.1)),
        shared_device=rng.random() < 0.5,
        stream_fraction=rng.choice((0.0, "auto", 0.5, 1.0)),  # last draw: earlier seeds unchanged
    )


def generate(seed: int) -> ProgramSpec:
    """The program of ``seed`` (the same seed always gives the same program).

    Example::

        >>> generate(7) == generate(7)
        True
        >>> normalize(generate(7)) == generate(7)
        True
    """
    rng = random.Random(seed)
    n = rng.choice((1, 2, 2, 3, 3, 3, 4, 4, 5))
    layers = tuple(
        LayerSpec(
            kind=rng.choice(KINDS),
            variant=rng.randrange(4),
            out=rng.choice(("tensor", "tensor", "tuple", "dict")),
            ckpt=rng.choice(("none",) * 6 + ("reentrant", "nonreentrant")),
        )
        for _ in range(n)
    )
    backend = "v1" if rng.random() < 0.3 else "v2"
    entry = rng.choice(ENTRIES)
    k = rng.randint(0, n)
    steps = rng.choice((1, 1, 2, 2, 3))
    backwards = tuple(
        tuple(rng.choice(BACKWARDS[:1] * 4 + BACKWARDS) for _ in range(rng.choice((1, 1, 2, 3))))
        for _ in range(steps)
    )
    spec = ProgramSpec(
        seed=seed,
        layers=layers,
        width=rng.choice((8, 16)),
        dtype=rng.choice(DTYPES),
        backend=backend,
        entry=entry,
        num_layers=k,
        min_size=rng.choice((0, 0, 0, 16, 64, None)),
        sync_dict=_sync_dict(rng, n),
        manual=tuple(
            (i, rng.choice((i, rng.randint(i, n), n, -1))) for i in range(n) if rng.random() < 0.6
        ),
        extra_model_layers=rng.choice((0, 0, 1, 2)),
        recompute=tuple(i for i in range(n) if rng.random() < 0.3),
        spread=_spread(rng, k, n) if 0 < k < n and rng.random() < 0.4 else (),
        partial_bytes=rng.choice((None, None, 64, 1024)),
        selective=tuple(i for i in range(n) if rng.random() < 0.6) if rng.random() < 0.5 else (),
        selective_scope=rng.choice(("modules", "layer")),
        stack_ckpt=rng.choice(("none",) * 5 + ("reentrant", "nonreentrant")),
        backwards=backwards,
        eval_forward=rng.choice(("none",) * 4 + ("before", "inside")),
        fault=(rng.choice(("fwd", "bwd", "between")), rng.randrange(n)) if rng.random() < 0.25 else (),
        optimizer=_optimizer(rng) if rng.random() < 0.4 else None,
        batch_bytes=rng.choice((None, None, 0, 512)),  # drawn last: earlier seeds' fields stay
    )
    # drawn after every field above: optimizer programs with more steps, and gradient edits on
    # some steps only, so that updates started in backward are kept on some steps and redone on
    # others (the streamed part starts them from its second step on, while no step edits)
    more = rng.choice((0, 0, 1, 3))
    some = rng.random() < 0.5
    chosen = tuple(i for i in range(len(spec.backwards) + more) if rng.random() < 0.5)
    during = rng.random() < 0.6
    if spec.optimizer is not None:
        opt = spec.optimizer
        if some and opt.edits:
            opt = replace(opt, edit_steps=chosen)
        if (during and opt.stream_fraction != 0.0 and opt.max_grad_norm is None
                and opt.overlap in ("backward_update", "next_forward")):
            opt = replace(opt, stream_during_backward=True)
        spec = replace(spec, backwards=spec.backwards + (("backward",),) * more, optimizer=opt)
    if spec.optimizer is not None and spec.optimizer.stream_during_backward and rng.random() < 0.3:
        spec = replace(spec, optimizer=replace(spec.optimizer, inline_launches=True))
    spec = _more(rng, spec)
    if spec.optimizer is not None and rng.random() < 0.5:  # drawn last: earlier fields stay
        spec = replace(spec, optimizer=replace(spec.optimizer, stream_ahead=rng.choice((0, 1, 2))))
    if spec.optimizer is not None and spec.low_precision and rng.random() < 0.5:  # drawn last
        spec = replace(spec, optimizer=replace(spec.optimizer, fp32_masters=False))
    return normalize(spec)


def _more(rng: random.Random, spec: ProgramSpec) -> ProgramSpec:
    """The draws added for issue #39, after every earlier one (so the earlier fields of a seed
    stay): odd and frozen parameters, fp16 and mixed dtypes, more optimizer programs, and the
    optimizer's classes, param groups, lr, scheduler, scaler, edits, saves, close, DDP."""
    layers = list(spec.layers)
    if rng.random() < 0.15:
        i = rng.randrange(len(layers))
        layers[i] = replace(layers[i], kind="odd_params", variant=rng.randrange(2))
    frozen = tuple(rng.randrange(1000) for _ in range(rng.choice((0, 0, 0, 0, 1, 2))))
    dtype = "float16" if rng.random() < 0.1 else spec.dtype
    if rng.random() < 0.15:
        layers = [replace(l, dtype=rng.choice((None, None, "bfloat16", "float16", "float32")))
                  for l in layers]
    opt = spec.optimizer
    backwards = spec.backwards
    if opt is None and rng.random() < 0.35:
        opt = _optimizer(rng)
        backwards += (("backward",),) * rng.choice((0, 1, 2))
        if (rng.random() < 0.5 and opt.stream_fraction != 0.0 and opt.max_grad_norm is None
                and opt.overlap in UPDATING_MODES):
            opt = replace(opt, stream_during_backward=True)
    if opt is not None:
        opt = _more_optimizer(rng, opt, len(backwards))
    return replace(spec, layers=tuple(layers), frozen=frozen, dtype=dtype, optimizer=opt,
                   backwards=backwards)


def _more_optimizer(rng: random.Random, opt: OptSpec, steps: int) -> OptSpec:
    edits = list(opt.edits)
    for _ in range(rng.choice((0, 0, 1, 2))):
        kind = rng.choice(MORE_EDITS)
        if kind == "data_div":
            edit = ("data_div", rng.randrange(1000), rng.choice((2.0, 3.0, 8.0)))
        elif kind == "data_mul":
            edit = ("data_mul", rng.randrange(1000), rng.choice((0.5, 3.0, -1.0)))
        elif kind == "clip_value":
            edit = ("clip_value", rng.choice((0.001, 0.01, 0.1)))
        else:
            edit = ("lr", rng.randrange(4), rng.choice((0.0, 0.003, 0.02)))
        edits.insert(rng.randint(0, len(edits)), edit)
    groups = tuple(
        tuple(pair for pair in (("lr", rng.choice((0.05, 0.002))),
                                ("weight_decay", rng.choice((0.0, 0.2))))
              if rng.random() < 0.6)
        for _ in range(rng.choice((0, 0, 1, 2))))
    clamp = rng.choice((0.05, 0.2))
    return replace(
        opt,
        cls=rng.choice(tuple(OPTIMIZERS)) if rng.random() < 0.7 else "adamw_fused",
        lr_tensor=rng.random() < 0.35,
        groups=groups,
        scheduler=rng.choice((None, None, None, "lambda", "step")),
        scaler=rng.choice((None,) * 6 + SCALER_MODES),
        inf_step=rng.randrange(steps) if rng.random() < 0.4 else None,
        edits=tuple(edits),
        param_edits=rng.choice(((),) * 4 + ((("clamp_data", clamp),), (("clamp_nograd", clamp),))),
        saves=tuple((rng.randrange(steps), rng.choice(SAVES))
                    for _ in range(rng.choice((0, 0, 0, 1, 2)))),
        close_step=rng.randrange(steps) if rng.random() < 0.08 else None,
        ddp=rng.random() < 0.12,
        pin_grads=rng.random() < 0.8,
        pin_params=rng.random() < 0.8,
        numpy_args=rng.random() < 0.1,
        misuse=rng.choice(MISUSES) if rng.random() < 0.08 else None,
        chunk_bytes=rng.choice((64, 256)) if rng.random() < 0.25 else opt.chunk_bytes,
        stream_fraction=(round(rng.uniform(0.05, 0.95), 2) if rng.random() < 0.2
                         else opt.stream_fraction),
        # drawn last: the programs of earlier seeds stay as they were
        state_read=rng.random() < 0.15,
        data_assign=rng.random() < 0.15,
        betas_tensor=rng.random() < 0.25,
        hook_stream=rng.random() < 0.5,
        close_via=rng.choice(("state_dict", "torch", "dcp")),
    )
