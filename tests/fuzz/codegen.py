"""A ``ProgramSpec`` as Python source: the program the fuzzer runs is exactly the reproducer it
prints. ``program(rec, offload)`` runs the training program with offloading (``offload=True``)
or without it (the same code with a null context, no ``apply_offloading``, the wrapped torch
optimizer) and records outputs, gradients, parameters and the hygiene checks into ``rec``;
``differences`` compares two runs."""
from __future__ import annotations

import inspect
import textwrap
from typing import List

from packaging.version import Version

from cpu_offload.compat import TORCH_VERSION
from cpu_offload.optim.stream_update import MIN_STREAM_BUDGET_BYTES

from . import layers as layer_module
from . import prelude
from .spec import (
    APPLY_ENTRIES, OPTIMIZERS, UPDATING_MODES, LayerSpec, OptSpec, ProgramSpec, features,
    layer_kwargs,
)

HEADER = '''\
"""A fuzz program, standalone: run it from the repository root with PYTHONPATH=. (exit status 1:
the run with offloading differs from the run without it).

{spec}

Features: {features}.
"""
import contextlib
import gc
import os
import threading
import traceback
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import cpu_offload
from cpu_offload.compat import top_saved_tensors_hooks
from cpu_offload import OffloadConfigError, OffloadUsageError
from cpu_offload.optim import HybridDeviceOptimizer
from cpu_offload import Plan

SEQ = {seq}
'''

MAIN = '''
if __name__ == "__main__":
    torch.set_num_threads(1)
    for offload in (False, True):  # once to warm up: a first import inside a step keeps its frame
        outcome(program, offload)
    runs = [outcome(program, offload) for offload in (False, True)]
    for offload, run in zip((False, True), runs):
        if run.error is not None:
            print(f"--- the run {'with' if offload else 'without'} offloading raised:")
            traceback.print_exception(type(run.error), run.error, run.error.__traceback__)
    problems = differences(*runs)
    print("\\n".join(problems) or "the runs agree")
    raise SystemExit(1 if problems else 0)
'''

PRELUDE = (
    prelude.TrackingDevice, prelude.Watch, prelude.Recorder, prelude.same, prelude.describe,
    prelude.first_line, prelude.differences, prelude.outcome, prelude.loss_of, prelude.scale_grad,
    prelude.zero_grad_of, prelude.boom_hook, prelude.identity, prelude.in_flight, prelude.set_stream_ahead,
    prelude.div_grad_data, prelude.mul_grad_data, prelude.read_states, prelude.clip_values, prelude.tensor_betas,
    prelude.early_updates_ran, prelude.hooks_on_stream,
    prelude.Masters, prelude.renewed, prelude.Stack,
    prelude.ensure_process_group, prelude.record_state, prelude.step_after_close,
    prelude.misuse,
)


def _source(obj) -> str:
    return inspect.getsource(obj).rstrip() + "\n"


def layer_ctor(layer: LayerSpec, width: int) -> str:
    cls = layer_module.LAYER_CLASSES[layer.kind]
    args = ", ".join(f"{k}={v!r}" for k, v in layer_kwargs(layer, width).items())
    return f"{cls.__name__}({args})"


class _Lines:
    def __init__(self) -> None:
        self.lines: List[str] = []

    def __call__(self, indent: int, *texts: str) -> None:
        for text in texts:
            self.lines.append(" " * (4 * indent) + text if text else "")


def _kwargs(**kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())


def _min_size(spec: ProgramSpec) -> dict:
    return {} if spec.min_size is None else {"min_tensor_size_to_offload": spec.min_size}


def _entry_setup(spec: ProgramSpec, out: _Lines) -> None:
    n, dev = spec.n, "dev"
    if spec.entry in ("ctx", "sync_dict", "manual"):
        kw = {"enabled": True}
        if spec.entry == "ctx":
            kw.update(num_layers=spec.num_layers, model_layers=n)
        elif spec.entry == "sync_dict":
            kw.update(model_layers=n, synchronization_dict=dict(spec.sync_dict))
        else:
            kw.update(model_layers=n + spec.extra_model_layers, manual_synchronization=True)
        kw.update(_min_size(spec), device=dev)
        names = "ctx, sync, manual" if spec.entry == "manual" else "ctx, sync"
        null = "contextlib.nullcontext(), identity" + (", None" if spec.entry == "manual" else "")
        out(2, "if offload:",
            f"    {names} = cpu_offload.get_cpu_offload_context(",
            f"        {_kwargs(**kw)})",
            "else:",
            f"    {names} = {null}")
        return
    out(2, "if offload:")
    kw: dict = {}
    if spec.entry == "plan":
        plan = dict(num_layers=spec.num_layers, recompute=spec.recompute, offloaded=spec.spread,
                    selective=spec.selective, selective_scope=repr(spec.selective_scope),
                    model_layers=n, min_tensor_size_to_offload=spec.min_size,
                    partial_bytes=spec.partial_bytes)
        out(3, f"plan = Plan({_kwargs(**plan)})")
        kw.update(plan="plan")
    elif spec.entry == "apply":
        kw.update(num_layers=spec.num_layers)
    else:
        kw.update(synchronization_dict=dict(spec.sync_dict))
    if spec.selective and spec.entry != "plan":
        every = spec.selective == tuple(range(n))
        kw.update(selective=True if every else spec.selective,
                  selective_scope=repr(spec.selective_scope))
    if spec.entry != "plan":
        kw.update(_min_size(spec))
    kw.update(device=dev)
    out(3, f"handle = cpu_offload.apply_offloading(layers, {_kwargs(**kw)})")


def _device_kwargs(spec: ProgramSpec) -> str:
    """``TrackingDevice``'s arguments: updates started in backward run in its hooks
    (``inline_launches``) or, by default, deferred until ``step()`` waits for them."""
    inline = spec.optimizer is not None and spec.optimizer.inline_launches
    return "defer_launches=False" if inline else ""


def _lr(value: float, opt: OptSpec) -> str:
    return f"torch.tensor({value!r})" if opt.lr_tensor else repr(value)


def _param_groups(spec: ProgramSpec, out: _Lines) -> str:
    """The expression of the optimizer's ``params`` argument (``param_groups()``, defined here,
    where there are several groups or tensor learning rates: each group gets a tensor of its
    own, and a rebuilt optimizer new ones)."""
    opt = spec.optimizer
    n = len(opt.groups) + 1
    if n == 1 and not opt.lr_tensor and not opt.betas_tensor:
        return "params"
    out(2, "def param_groups():", "    return [")
    for g in range(n):
        overrides = dict(opt.groups[g - 1]) if g else {}
        items = [f'"params": params[{g}::{n}]' if n > 1 else '"params": params']
        if opt.lr_tensor or "lr" in overrides:
            items.append(f'"lr": {_lr(overrides.pop("lr", 0.01), opt)}')
        items += [f'"{k}": {v!r}' for k, v in overrides.items()]
        if opt.betas_tensor:
            items.append('"betas": tensor_betas()')
        out(4, "{" + ", ".join(items) + "},")
    out(3, "]")
    return "param_groups()"


def _optimizer_setup(spec: ProgramSpec, out: _Lines) -> None:
    """``make_opt()`` (the hybrid optimizer, or the reference: the torch class itself, over
    fp32 masters where parameters are bf16/fp16), the optimizer, its scheduler and scaler."""
    opt = spec.optimizer
    masters = spec.low_precision and opt.fp32_masters  # the reference keeps fp32 masters
    cls_name, cls_kw = OPTIMIZERS[opt.cls]
    hyper = dict(lr=_lr(0.01, opt), weight_decay=opt.weight_decay)

    def num(value, kind: str) -> str:  # numpy_args: sizes and fractions as numpy scalars
        return f"np.{kind}({value!r})" if opt.numpy_args and not isinstance(value, str) else repr(value)

    kw = dict(offload_fraction=num(opt.fraction, "float32"), overlap=repr(opt.overlap),
              bucket_bytes=num(opt.bucket_bytes, "int64"),
              cpu_chunk_bytes=num(opt.chunk_bytes, "int64"), cpu_threads=1,
              stream_fraction=num(opt.stream_fraction, "float32"),
              stream_budget_bytes=num(MIN_STREAM_BUDGET_BYTES, "int64"))  # 1024-element chunks
    if opt.max_grad_norm is not None:
        kw.update(max_grad_norm=opt.max_grad_norm)
    if opt.stream_during_backward:
        kw.update(stream_during_backward=True)
    if masters:
        kw.update(param_update_in_fp32=True)
    elif spec.low_precision:
        kw.update(fp32_masters=False)
    if not opt.pin_grads:
        kw.update(pin_cpu_grads=False)
    if not opt.pin_params:
        kw.update(pin_cpu_params=False)
    kw.update(device="dev" if opt.shared_device else "opt_dev")
    if opt.cls != "adamw_fused":  # else the hybrid optimizer's default class (fused AdamW)
        kw.update(cpu_optimizer_cls=f"torch.optim.{cls_name}",
                  gpu_optimizer_cls=f"torch.optim.{cls_name}", **hyper,
                  **{k: repr(v) for k, v in cls_kw.items()})
    else:
        kw.update(hyper)
    hyper.update((k, repr(v)) for k, v in cls_kw.items())
    if not opt.shared_device:
        out(2, f"opt_dev = TrackingDevice({_device_kwargs(spec)})")
    if opt.hook_stream:
        out(2, "hook_stream = opt_dev.new_stream()  # FSDP2's reduce-scatter stream")
    if opt.misuse:
        device = "dev" if opt.shared_device else "opt_dev"
        out(2, f'rec.put("misuse", misuse({opt.misuse!r}, offload, {device}))')
    out(2, "")
    groups = _param_groups(spec, out)
    out(2, "", "def make_opt():", "    if offload:",
        f"        o = HybridDeviceOptimizer({groups}, {_kwargs(**kw)})")
    if opt.overlap == "next_forward":
        out(4, "o.register_forward_waits(layers)")
    if opt.stream_ahead is not None:
        out(4, f"set_stream_ahead(o, {opt.stream_ahead})")
    out(4, "return o")
    if masters:  # the hybrid optimizer keeps fp32 master weights: compare with a master-weight run
        out(3, f"return Masters({groups}, torch.optim.{cls_name}, {_kwargs(**hyper)})")
    else:
        out(3, f"return torch.optim.{cls_name}({groups}, {_kwargs(**hyper)})")
    if opt.close_step is not None and opt.close_via == "torch":
        out(2, "", "def make_torch():  # torch's class on the parameters themselves: no masters",
            f"    return torch.optim.{cls_name}({groups}, {_kwargs(**hyper)})")
    out(2, "", "opt = make_opt()")
    if opt.ddp:
        out(2, "if offload:", "    model.register_comm_hook(*opt.ddp_comm_hook())")
    if opt.scheduler == "lambda":
        out(2, "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)")
    elif opt.scheduler == "step":
        out(2, "sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)")
    if opt.scaler:
        out(2, 'scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)')


def _ddp_setup(spec: ProgramSpec, out: _Lines) -> None:
    """The model under DistributedDataParallel (one gloo process), before the optimizer."""
    odd = any(layer.kind == "odd_params" for layer in spec.layers)  # maybe an unused parameter
    out(2, "ensure_process_group()",
        "model = torch.nn.parallel.DistributedDataParallel(",
        f"    Stack(layers, lambda x: forward(x)), find_unused_parameters={odd})")


def _stack(spec: ProgramSpec, out: _Lines) -> None:
    ctx_entry = spec.entry in ("ctx", "sync_dict", "manual")
    n = spec.n
    out(2, "def stack(h, train=True, faulty=False):", "    aux = torch.zeros(())")
    for i, layer in enumerate(spec.layers):
        if spec.mixed:
            out(3, f"h = h.to(torch.{spec.layer_dtype(i)})")
        call = f"layers[{i}](h)"
        if layer.ckpt != "none":
            call = f"checkpoint(layers[{i}], h, use_reentrant={layer.ckpt == 'reentrant'})"
        if ctx_entry:
            out(3, "with ctx:", f"    out = {call}")
        else:
            out(3, f"out = {call}")
        if layer.out == "tuple":
            out(3, "h, a = out")
        elif layer.out == "dict":
            out(3, 'h, a = out["hidden_states"], out["aux"]')
        else:
            out(3, "h = out")
        if ctx_entry:
            out(3, "h = sync(h)")
        if layer.out != "tensor":
            out(3, "aux = aux + a.float().sum() * 0.01")
        _manual_after(spec, i, out)
        if spec.fault and spec.fault[1] == i and spec.fault[0] in ("bwd", "between"):
            action = ("h.register_hook(boom_hook)" if spec.fault[0] == "bwd"
                      else 'raise Boom("raised between layers")')
            out(3, "if faulty:", f"    {action}")
    _manual_after(spec, n, out)
    out(3, "return h, aux")


def _manual_after(spec: ProgramSpec, i: int, out: _Lines) -> None:
    """Manual synchronization calls after layer ``i`` (``i == n``: after the stack)."""
    calls = [f"manual.start_offload_layer({i})" for layer, _ in spec.manual if layer == i]
    calls += [f"manual.release_activation_forward_gpu_memory({layer})"
              for layer, release in spec.manual if release == i]
    if calls:
        out(3, "if offload and train:", *("    " + c for c in calls))


def program_source(spec: ProgramSpec) -> str:
    """The standalone Python program of ``spec``."""
    from .shrink import spec_repr

    kinds = {l.kind for l in spec.layers}
    classes = [layer_module.Boom, layer_module.FuzzLayer]
    if "custom_function" in kinds:
        classes.append(layer_module._TanhMatmul)
    classes += [layer_module.LAYER_CLASSES[k] for k in layer_module.LAYER_CLASSES if k in kinds]
    parts = [HEADER.format(spec=textwrap.fill(spec_repr(spec), 99, break_long_words=False),
                           features=", ".join(sorted(features(spec))), seq=layer_module.SEQ)]
    parts += [_source(c) for c in classes + list(PRELUDE)]
    out = _Lines()
    _build(spec, out)
    out(0, "def program(rec, offload):")
    if spec.backend == "v1":
        out(1, 'os.environ["NVTE_CPU_OFFLOAD_V1"] = "1"  # the legacy backend')
    else:
        out(1, 'os.environ.pop("NVTE_CPU_OFFLOAD_V1", None)')
    if spec.batch_bytes is not None:
        out(1, "from cpu_offload.v2 import layer_state",
            f"layer_state.BATCH_BYTES = {spec.batch_bytes}  # copies from this size queued early")
    opt = spec.optimizer
    if opt is not None and opt.numpy_args:
        out(1, "import numpy as np")
    if opt is not None and any(kind == "dcp" for _, kind in opt.saves):
        out(1, "from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict")
    if opt is not None and opt.close_step is not None and opt.close_via == "dcp":
        out(1, "from torch.distributed.checkpoint.state_dict import (",
            "    StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict)")
    out(1, "layers = build()", "params = list(layers.parameters())", f"dev = TrackingDevice({_device_kwargs(spec)})",
        "watch = Watch(layers)", "handle = opt = None", "try:")
    _entry_setup(spec, out)
    if opt is not None and opt.ddp:
        _ddp_setup(spec, out)
    if opt is not None:
        _optimizer_setup(spec, out)
    out(2, "")
    _stack(spec, out)
    _micro_batch(spec, out)
    _steps(spec, out)
    _final(spec, out)
    parts.append("\n".join(out.lines) + "\n")
    parts.append(MAIN)
    return "\n\n".join(p.rstrip() + "\n" for p in parts)


def _build(spec: ProgramSpec, out: _Lines) -> None:
    dtype = f"torch.{spec.dtype}"
    out(0, "def build():", f"    torch.manual_seed({spec.seed})", "    layers = nn.ModuleList([")
    for layer in spec.layers:
        out(2, layer_ctor(layer, spec.width) + ",")
    out(1, f"]).to({dtype})")
    for i, layer in enumerate(spec.layers):
        if layer.dtype is not None:
            out(1, f"layers[{i}].to(torch.{layer.dtype})")
    if spec.frozen:
        out(1, "params = list(layers.parameters())",
            f"for i in {spec.frozen!r}:", "    params[i].requires_grad_(False)")
    out(1, "return layers")
    out(0, "", "",
        "def make_input(step, mb):",
        "    g = torch.Generator().manual_seed(1000 * step + mb)",
        f"    return torch.randn(2 * SEQ, {spec.width}, generator=g).to({dtype}).requires_grad_()",
        "", "")


def _released(spec: ProgramSpec) -> list:
    return [layer for layer, release in spec.manual if release >= 0]


def _nosync(spec: ProgramSpec) -> bool:
    return spec.optimizer is not None and spec.optimizer.no_sync


def _micro_batch(spec: ProgramSpec, out: _Lines) -> None:
    """``forward``, ``reload``, ``accumulate``, ``micro_batch``, ``evaluate`` and
    ``faulty_micro_batch``, as the program needs them."""
    out(2, "", "def forward(x, train=True):")
    if spec.stack_ckpt != "none":
        out(3, f"return checkpoint(stack, x, use_reentrant={spec.stack_ckpt == 'reentrant'})")
    else:
        out(3, "return stack(x, train)")
    released, nosync = _released(spec), _nosync(spec)
    if released:
        out(2, "", "def reload():", "    if offload:",
            *(f"        manual.start_reload_layer({layer})" for layer in released))
    ddp = spec.optimizer is not None and spec.optimizer.ddp
    if nosync and ddp:
        out(2, "", "def accumulate(last):", "    if last:", "        return contextlib.nullcontext()",
            "    both = contextlib.ExitStack()", "    if offload:",
            "        both.enter_context(opt.no_sync())", "    both.enter_context(model.no_sync())",
            "    return both")
    elif nosync:
        out(2, "", "def accumulate(last):",
            "    return opt.no_sync() if offload and not last else contextlib.nullcontext()")
    hows = {h for step in spec.backwards for h in step}
    out(2, "", "def micro_batch(step, mb, how, last):",
        "    x = make_input(step, mb)",
        f"    h, aux = {'model' if ddp else 'forward'}(x)",
        "    loss = loss_of(h, aux)",
        '    rec.put(f"step{step}.mb{mb}.out", h)',
        '    rec.put(f"step{step}.mb{mb}.loss", loss)')
    target = "loss"
    scaler = spec.optimizer.scaler if spec.optimizer is not None else None
    if scaler:
        inf = spec.optimizer.inf_step
        if inf is not None:  # the scaler finds inf in the gradients and skips this step
            out(3, f"if step == {inf} and last:", '    loss = loss * float("inf")')
        out(3, "scaled = scaler.scale(loss)")
        target = "scaled"
    if spec.eval_forward == "inside":
        out(3, "evaluate(step, mb)")
    if released:
        out(3, "reload()")
    if "autograd_grad" in hows:
        out(3, 'if how == "autograd_grad":',
            "    trained = [p for p in params if p.requires_grad]",
            "    grads = torch.autograd.grad(loss, [x, *trained], allow_unused=True)",
            '    rec.put(f"step{step}.mb{mb}.autograd_grad", grads)',
            "    return")
    hooks = ", hooks_on_stream(opt_dev, hook_stream)" if spec.optimizer and spec.optimizer.hook_stream else ""
    if "retain_double" in hows:
        out(3, 'if how == "retain_double":')
        if nosync or hooks:
            out(4, f"with {'accumulate(False)' if nosync else 'contextlib.nullcontext()'}{hooks}:",
                f"    {target}.backward(retain_graph=True)")
        else:
            out(4, f"{target}.backward(retain_graph=True)")
    if nosync or hooks:
        out(3, f"with {'accumulate(last)' if nosync else 'contextlib.nullcontext()'}{hooks}:",
            f"    {target}.backward()")
    else:
        out(3, f"{target}.backward()")
    out(3, 'rec.put(f"step{step}.mb{mb}.x_grad", x.grad)')
    if spec.eval_forward != "none":
        out(2, "", "def evaluate(step, mb):", "    with torch.no_grad():",
            "        h, aux = forward(make_input(50 + step, mb), train=False)",
            '    rec.put(f"step{step}.mb{mb}.eval", h)')
    if spec.fault:
        updating = spec.optimizer is not None and spec.optimizer.overlap in UPDATING_MODES
        _faulty_micro_batch(spec, out, updating and nosync, bool(released))


def _steps(spec: ProgramSpec, out: _Lines) -> None:
    """The training loop, and the checks after each step."""
    opt = spec.optimizer
    out(2, "", "host0 = 0", f"for step, hows in enumerate({spec.backwards!r}):")
    if spec.fault:
        out(3, "if step == 0:", "    faulty_micro_batch()",
            "    opt.zero_grad()" if opt is not None else "    layers.zero_grad()")
    if spec.eval_forward == "before":
        out(3, "evaluate(step, -1)")
    out(3, "for mb, how in enumerate(hows):",
        "    micro_batch(step, mb, how, last=mb == len(hows) - 1)",
        'rec.grads(f"step{step}.grads", params)')
    if opt is not None:
        _optimizer_step(spec, out)
    else:
        out(3, "layers.zero_grad()")
    # next_forward: the streamed update is still running after step(), in its staging
    held = "in_flight(opt)" if opt is not None and opt.overlap == "next_forward" else ""
    alive = "watch.alive()"
    if _old_checkpoint_cycles(spec):
        alive = "None"  # torch < 2.11: its non-reentrant checkpoint leaves cycles (see below)
    out(3, 'rec.put(f"step{step}.hooks_left", top_saved_tensors_hooks() is not None)',
        'rec.put(f"step{step}.context_active", cpu_offload.is_cpu_offload_enabled())',
        f'rec.put(f"step{{step}}.live_activations", {alive})',
        f'rec.put(f"step{{step}}.live_device_buffers", dev.live_device_buffers({held}))',
        "host0 = host0 or dev.live_host_buffers()",
        'rec.put(f"step{step}.host_buffer_growth", max(0, dev.live_host_buffers() - host0))')


def _old_checkpoint_cycles(spec: ProgramSpec) -> bool:
    """Whether live activations cannot be compared: on torch 2.6 (and, untested, up to 2.10) a
    non-reentrant ``torch.utils.checkpoint`` leaves activations in reference cycles with the
    collector off in the run *without* offloading too (seen on the fuzz seeds 1058019 and
    1058191), so the count differs between runs for reasons of torch's own. From 2.11 on the
    counts are compared for every program."""
    nonreentrant = spec.stack_ckpt == "nonreentrant" or any(
        layer.ckpt == "nonreentrant" for layer in spec.layers)
    return nonreentrant and TORCH_VERSION < Version("2.11")


def _plan_checkpoints_run(spec: ProgramSpec) -> bool:
    """Whether a plan's own checkpoint of a ``recompute`` layer runs, which updates BatchNorm
    running stats twice, as torch's checkpoint does (the run without offloading has none). It
    steps aside inside the program's own checkpoint regions: non-reentrant ones recompute the
    layer themselves, and a reentrant one runs it without grad, then in backward."""
    return spec.stack_ckpt == "none" and any(spec.layers[r].ckpt == "none" for r in spec.recompute)


def _final(spec: ProgramSpec, out: _Lines) -> None:
    """After the last step: queued copies, the layers restored, parameters and buffers."""
    opt = spec.optimizer
    if opt is not None and opt.overlap == "next_forward":
        out(2, "if offload:", "    opt.wait_params()")
    devices = "(dev, opt_dev)" if opt is not None and not opt.shared_device else "(dev,)"
    out(2, f"for d in {devices}:", "    d.synchronize()",
        '    rec.put("final.pending_copies", d.pending_ops())')
    if spec.entry in APPLY_ENTRIES:
        out(2, "if handle is not None:", "    handle.remove()")
    out(2, 'rec.put("final.layer_classes", tuple(type(l).__name__ for l in layers))',
        'rec.put("final.params", params)')
    if not _plan_checkpoints_run(spec):
        out(2, 'rec.put("final.buffers", tuple(layers.buffers()))')
    out(1, "finally:", "    watch.remove()")
    if spec.entry in APPLY_ENTRIES:
        out(2, "if handle is not None:", "    handle.remove()")
    if opt is not None:
        out(2, "if offload and opt is not None:", "    opt.close()")


def _faulty_micro_batch(spec: ProgramSpec, out: _Lines, nosync: bool, reload: bool) -> None:
    kind, layer = spec.fault
    out(2, "", "def faulty_micro_batch():", "    x = make_input(99, 0)")
    if kind == "fwd":
        out(3, f"layers[{layer}].armed = True")
    out(3, "try:")
    body = ["h, aux = stack(x, faulty=True)", "loss = loss_of(h, aux)"]
    body += ["reload()"] if reload else []
    body += ["loss.backward()"]
    if nosync:  # a step that fails must not have started CPU updates: keep its gradients here
        out(4, "with accumulate(False):", *("    " + b for b in body))
    else:
        out(4, *body)
    out(3, "except Boom as exc:", '    rec.put("fault", str(exc))')
    if kind == "fwd":
        out(3, "finally:", f"    layers[{layer}].armed = False")


EDIT_CODE = {  # a gradient edit's line; {1}, {2}: the edit's fields (OptSpec.edits)
    "clip": "torch.nn.utils.clip_grad_norm_(params, {1})",
    "scale": "scale_grad(params[{1}], {2})",
    "zero": "zero_grad_of(params[{1}])",
    "none": "params[{1}].grad = None",
    "zero_grad": "opt.zero_grad(set_to_none={1})",
    "data_div": "div_grad_data(params[{1}], {2})",
    "data_mul": "mul_grad_data(params[{1}], {2})",
    "clip_value": "clip_values(params, {1})",
}


def _close_lines(opt) -> list:
    """``close_step``: the old optimizer's state is saved, the hybrid is closed (a ``step()``
    must then raise naming ``close()``) and a new optimizer takes that state, as ``close_via``
    says (``OptSpec``). Each way only adds what it does differently."""
    save, new_hybrid, new_reference, both = {
        "state_dict": ("opt.state_dict()", ["opt = make_opt()", "opt.load_state_dict(saved)"], [], []),
        # torch's class on the parameters takes this step (instead of the lines after), loaded
        # with the dict as is: a hybrid's masters carried along, cast
        "torch": ("opt.state_dict()", [], [],
                  ["detour = make_torch()", "detour.load_state_dict(saved)", "detour.step()",
                   "opt = make_opt()", "opt.load_state_dict(detour.state_dict())"]),
        # a new reference too, with the masters the hybrid's dict holds; not strict: a parameter
        # without state yet (no gradient so far) is allowed
        "dcp": ("get_optimizer_state_dict(layers, opt)", ["opt = make_opt()"],
                ["opt = renewed(opt, make_opt)"],
                ["set_optimizer_state_dict(layers, opt, saved,",
                 "                         options=StateDictOptions(strict=False))"]),
    }[opt.close_via]
    return [f"if step == {opt.close_step}:", f"    saved = {save}",
            "    if offload:  # closed, a step must raise; then a new one",
            "        opt.close()",
            '        rec.put("closed.step", step_after_close(opt))',
            *("        " + line for line in new_hybrid),
            "    else:",
            '        rec.put("closed.step", "OffloadUsageError naming close()")',
            *("        " + line for line in new_reference),
            *("    " + line for line in both)]


def _optimizer_step(spec: ProgramSpec, out: _Lines) -> None:
    opt = spec.optimizer
    lines = []
    if opt.state_read:  # a read of the state between backward and step() changes nothing
        lines.append("read_states(opt, params)")
    if opt.betas_tensor:  # each step a beta of its own, changed in place
        lines.append('early_updates_ran(opt)\nfor g in opt.param_groups:\n'
                     '    g["betas"][0].fill_(0.9 - 0.1 * (step % 3))')
    for edit in opt.edits:
        if edit[0] == "lr":
            lr = f'opt.param_groups[{edit[1]}]["lr"]'
            lines.append(f"{lr}.fill_({edit[2]})" if opt.lr_tensor else f"{lr} = {edit[2]}")
        else:
            lines.append(EDIT_CODE[edit[0]].format(*edit))
    if lines and opt.edit_steps is not None:
        lines = [f"if step in {set(opt.edit_steps) or '()'}:"] + ["    " + l for line in lines
                                                                   for l in line.split("\n")]
    if opt.close_step is not None:
        close = _close_lines(opt)
        if opt.close_via != "torch":  # torch's class takes that step itself: see below
            lines += close
    step = []
    if opt.scaler in ("unscale", "unscale_clip"):
        step.append("scaler.unscale_(opt)")
    if opt.scaler == "unscale_clip":
        step.append("torch.nn.utils.clip_grad_norm_(params, 0.5)")
    if opt.max_grad_norm is not None:  # the hybrid optimizer clips inside step()
        step.append("if not offload:  # over the parameters in param-group order, as the hybrid\n"
                    "    in_groups = [p for g in opt.param_groups for p in g[\"params\"]]\n"
                    f"    torch.nn.utils.clip_grad_norm_(in_groups, {opt.max_grad_norm})")
    if opt.scaler:  # GradScaler asserts on a step without gradients: no step then
        step += ["scaler.step(opt)", "scaler.update()"]
        step = ["if any(p.grad is not None for p in params):"] + [
            "    " + l for line in step for l in line.split("\n")]
    else:
        step.append("opt.step()")
    if opt.close_step is not None and opt.close_via == "torch":
        step = close + ["else:"] + ["    " + l for line in step for l in line.split("\n")]
    lines += step
    if opt.scheduler:
        lines.append("sched.step()")
    lines = [l for line in lines for l in line.split("\n")]
    if opt.edits and opt.overlap != "none":
        # Loud refusal (OffloadUsageError naming the supported way) is an acceptable answer to
        # gradients changed between backward and step(); a silent difference is not.
        out(3, "with rec.refusal_allowed():", *("    " + l for l in lines))
    else:
        out(3, *lines)
    out(3, "opt.zero_grad()")
    if opt.param_edits:
        if opt.overlap == "next_forward":
            out(3, "if offload:", "    opt.wait_params()  # before reading parameters outside a forward")
        for kind, c in opt.param_edits:
            if kind == "clamp_data":
                out(3, "for p in params:", f"    p.data.clamp_(-{c}, {c})")
            else:
                out(3, "with torch.no_grad():", "    for p in params:", f"        p.clamp_(-{c}, {c})")
    if opt.data_assign:  # new memory, same values: the optimizer must follow it
        if opt.overlap == "next_forward" and not opt.param_edits:
            out(3, "if offload:", "    opt.wait_params()  # before reading parameters outside a forward")
        out(3, "for p in params:", "    p.data = p.data.clone()")
    if opt.overlap != "next_forward":  # next_forward: read after opt.wait_params(), at the end
        out(3, 'rec.put(f"step{step}.params", params)')
    out(3, 'rec.put(f"step{step}.lrs", tuple(g["lr"] for g in opt.param_groups))')
    if opt.scaler:
        out(3, 'rec.put(f"step{step}.scale", scaler.get_scale())')
    for kind in ("state_dict", "dcp"):
        steps = sorted({st for st, k in opt.saves if k == kind})
        if not steps:
            continue
        out(3, f"if step in {set(steps)}:  # must not change training")
        if kind == "state_dict":
            out(4, 'record_state(rec, f"step{step}.state_dict", opt.state_dict())')
        else:
            model = "model" if opt.ddp else "layers"
            out(4, f'record_state(rec, f"step{{step}}.dcp", get_optimizer_state_dict({model}, opt))')
