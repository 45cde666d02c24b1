"""Helpers every generated program uses: what it records, how two runs are compared, and the
checks that nothing stays installed or alive. A reproducer inlines their source
(``inspect.getsource``), so each keeps its code in its own body."""
from __future__ import annotations

import contextlib
import gc
import threading
import weakref

import torch
from torch import nn

import cpu_offload
from cpu_offload import OffloadConfigError, OffloadUsageError
from cpu_offload.optim import HybridDeviceOptimizer

from .layers import Boom


class TrackingDevice(cpu_offload.SimulatedDevice):
    """The simulated device, remembering (weakly) every buffer it handed out."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.host_refs, self.device_refs = [], []
        self.link_queries = 0

    def link_busy(self, event):
        """Busy every other time it is asked, so that a forward queues some large storages at
        once and leaves others for a later batch of their layer, differently every step."""
        self.link_queries += 1
        return self.link_queries % 2 == 0

    def alloc_host(self, nbytes):
        t = super().alloc_host(nbytes)
        self.host_refs.append(weakref.ref(t))
        return t

    def alloc_device(self, nbytes, device):
        t = super().alloc_device(nbytes, device)
        self.device_refs.append(weakref.ref(t))
        return t

    def live_host_buffers(self):
        return sum(r() is not None for r in self.host_refs)

    def live_device_buffers(self, held=()):
        """Device buffers alive, but those in ``held`` (work still in flight uses them)."""
        skip = {id(t) for t in held}
        return sum(r() is not None and id(r()) not in skip for r in self.device_refs)


def set_stream_ahead(opt, chunks):
    """The streamed parts of ``opt`` queue ``chunks`` chunks before the CPU and device parts in
    ``step()``, the rest after them (``StreamedPart.ahead_chunks``; the default is more than a
    fuzz model has, which would leave the second part untried)."""
    for part in getattr(opt, "_parts", ()):
        part.ahead_chunks = chunks


def in_flight(opt):
    """The device buffers an optimizer's streamed update still running after ``step()``
    (``overlap="next_forward"``) holds: freed once the next forward has waited for it."""
    return [t for part in getattr(opt, "_parts", ()) for t in part.in_flight()]


class Watch:
    """Weak references to every tensor a submodule of ``model`` outputs (the activations and
    the bases of what autograd saves): all must be dead once a step is over."""

    def __init__(self, model):
        self.refs = []
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules()]

    def hook(self, module, args, out):
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))

    def alive(self):
        return sum(r() is not None for r in self.refs)

    def remove(self):
        for h in self.handles:
            h.remove()


class Recorder:
    """What one run produced, in order: ``(name, value)`` with tensors cloned; ``error`` is the
    exception that ended the run, if any; ``refused`` marks a loud refusal the program allows."""

    def __init__(self):
        self.items = []
        self.error = None
        self.refused = False

    def put(self, name, value):
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        elif isinstance(value, (tuple, list)):
            value = tuple(v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value)
        self.items.append((name, value))

    def grads(self, name, params):
        self.put(name, [p.grad for p in params])

    @contextlib.contextmanager
    def refusal_allowed(self):
        """An ``OffloadUsageError`` raised here is a loud refusal, which is acceptable."""
        try:
            yield
        except OffloadUsageError:
            self.refused = True
            raise


def same(a, b):
    """Equal values, bit for bit (NaN where the other has NaN counts as equal)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if torch.equal(a, b):
            return True
        if not a.is_floating_point():
            return False
        nan = a.isnan()
        return (torch.equal(nan, b.isnan())
                and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0)))
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def describe(value):
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, tuple):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    return repr(value)


def first_line(exc):
    """``Type: first line of the message`` (``NoneType: `` for no exception)."""
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0][:300]}"


def differences(base, offl, limit=6):
    """What differs between the run without offloading (``base``) and the run with it: the
    exception that ended each run (same type, or none), then every recorded value."""
    out = []
    refusal = offl.refused and offl.error is not None and base.error is None
    if not refusal and type(base.error) is not type(offl.error):
        out.append(f"exception: without offloading {first_line(base.error)}; "
                   f"with offloading {first_line(offl.error)}")
    names, offl_names = [n for n, _ in base.items], [n for n, _ in offl.items]
    common = min(len(names), len(offl_names))
    if names[:common] != offl_names[:common]:
        return out + ["the runs recorded different things (they took different paths)"]
    for (name, a), (_, b) in zip(base.items, offl.items):
        if not same(a, b):
            if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
                bad = [i for i, (x, y) in enumerate(zip(a, b)) if not same(x, y)]
                out.append(f"{name}: entries {bad} differ")
            else:
                out.append(f"{name}: {describe(a)} != {describe(b)}")
            if len(out) >= limit:
                break
    if base.error is None and offl.error is None and len(names) != len(offl_names):
        out.append(f"recorded {len(names)} values without offloading, {len(offl_names)} with")
    return out


def outcome(program, offload):
    """Run ``program`` once (with the cycle collector off, so that what is alive is exact)."""
    rec = Recorder()
    gc.disable()
    try:
        program(rec, offload)
    except Exception as exc:  # noqa: BLE001 - compared with the other run's
        rec.error = exc
    finally:
        gc.enable()
    return rec


def loss_of(h, aux):
    """A loss that weighs every column differently (so that a permuted gradient shows)."""
    w = torch.linspace(-1, 1, h.shape[-1], dtype=torch.float32)
    return (h.float() * w).pow(2).mean() + aux


def scale_grad(p, factor):
    if p.grad is not None:
        p.grad.mul_(factor)


def zero_grad_of(p):
    if p.grad is not None:
        p.grad.zero_()


def boom_hook(grad):
    raise Boom("a gradient hook raised in backward")


def identity(t):
    return t


def div_grad_data(p, k):
    """``p.grad.data /= k`` (as the PyTorch distributed tutorial averages): no version bump."""
    if p.grad is not None:
        p.grad.data /= k


def clip_values(params, value):
    """``clip_grad_value_`` of the gradients there are (torch 2.13 raises where there are none)."""
    grads = [p for p in params if p.grad is not None]
    if grads:
        torch.nn.utils.clip_grad_value_(grads, value)


def read_states(opt, params):
    """Read every parameter's optimizer state (as a logger or a checkpoint hook does): for a
    torch optimizer a dict lookup; it must not change what the next step() computes."""
    for p in params:
        if p in opt.state:
            for v in opt.state[p].values():
                if torch.is_tensor(v):
                    v.sum()


def early_updates_ran(opt):
    """Wait until the CPU worker has run the updates backward queued (a hybrid optimizer's;
    nothing for a torch one), so that an edit made next comes after them, and must be seen."""
    worker = getattr(opt, "_worker", None)
    if worker is not None:
        worker.submit(lambda: None).result()


@contextlib.contextmanager
def hooks_on_stream(dev, stream):
    """The backward inside runs its gradient hooks with ``stream`` current, and the compute
    stream then waits only for what was queued there by the end of backward: how FSDP2 hands
    its reduce-scattered gradients over (work the hooks leave for later lands behind that)."""
    dev.wait_event(stream, dev.record_event(dev.current_stream()))
    with dev.use_stream(stream):
        yield
    dev.wait_event(dev.current_stream(), dev.record_event(stream))


def tensor_betas():
    """Adam's ``betas`` as 0-dim tensors (a tuple of its own per group and optimizer)."""
    return (torch.tensor(0.9), torch.tensor(0.999))


def mul_grad_data(p, c):
    if p.grad is not None:
        p.grad.data.mul_(c)


class Masters(torch.optim.Optimizer):
    """The reference for models with bf16/fp16 parameters: ``cls(**kwargs)`` over master copies
    (fp32 for bf16/fp16 parameters, their own dtype otherwise), as the hybrid optimizer keeps
    them and as ``cpu_offload.optim.reference.MasterWeightOptimizer`` does, but itself a
    ``torch.optim.Optimizer`` over the model's parameters: its ``param_groups`` hold the
    hyperparameters (LR schedulers and in-place edits reach the update), ``state`` maps each
    parameter to its master's state, ``state_dict()`` is the wrapped optimizer's, and it takes
    a GradScaler's scale in ``step()`` (``_step_supports_amp_scaling``): handed on to a class
    that takes it (the fused ones), else applied as ``GradScaler.unscale_`` applies it (the
    scales are powers of two: unscaling in fp32 or in bf16 gives the same bits)."""

    _step_supports_amp_scaling = True

    def __init__(self, param_groups, cls, **kwargs):
        param_groups = list(param_groups)
        if isinstance(param_groups[0], torch.Tensor):
            param_groups = [{"params": param_groups}]
        groups, inner = [], []
        self.masters = {}
        for g in param_groups:
            ms = []
            for p in g["params"]:
                dtype = torch.float32 if p.dtype in (torch.bfloat16, torch.float16) else p.dtype
                self.masters[p] = p.detach().to(dtype, copy=True)
                ms.append(self.masters[p])
            groups.append(dict(g))
            inner.append({**g, "params": ms})
        self.inner = cls(inner, **kwargs)
        super().__init__(groups, dict(self.inner.defaults))

    @property
    def state(self):
        inner = self.inner.state
        return {p: inner[m] for p, m in self.masters.items() if m in inner}

    @state.setter
    def state(self, value):
        pass  # torch.optim.Optimizer.__init__ sets it; the state is the inner optimizer's

    def sync(self):
        for g, ig in zip(self.param_groups, self.inner.param_groups):
            ig.update({k: v for k, v in g.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        self.sync()
        pairs = [(p, self.masters[p]) for g in self.param_groups for p in g["params"]]
        for p, m in pairs:
            m.grad = None if p.grad is None else p.grad.to(m.dtype)
        try:
            if getattr(self.inner, "_step_supports_amp_scaling", False):
                self.inner.grad_scale, self.inner.found_inf = scale, found_inf
                self.inner.step()
            elif found_inf is None or not float(found_inf):
                if scale is not None:
                    by_dtype = {}
                    for _, m in pairs:
                        if m.grad is not None:
                            by_dtype.setdefault(m.grad.dtype, []).append(m.grad)
                    inv = scale.double().reciprocal().float()
                    for grads in by_dtype.values():
                        cpu_offload.compat.amp_unscale_(grads, torch.zeros(()), inv)
                self.inner.step()
            for p, m in pairs:
                if m.grad is not None:
                    p.copy_(m)
        finally:
            for _, m in pairs:
                m.grad = None
            self.inner.__dict__.pop("grad_scale", None)
            self.inner.__dict__.pop("found_inf", None)

    def state_dict(self):
        self.sync()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        """The inner optimizer's state and hyperparameters; the masters stay as they are (from
        the parameters, for a new one: a state dict of torch's class has none)."""
        self.inner.load_state_dict(state_dict)
        for g, ig in zip(self.param_groups, self.inner.param_groups):
            g.update({k: v for k, v in ig.items() if k != "params"})


def renewed(opt, make_opt):
    """A new optimizer from ``make_opt()`` with ``opt``'s masters (a reference's ``Masters``):
    a DCP state dict holds none of a reference's masters, while the hybrid's holds its own."""
    new = make_opt()
    for p, m in getattr(opt, "masters", {}).items():
        new.masters[p].copy_(m)
    return new


class Stack(nn.Module):
    """The layers as one module whose forward is the program's ``forward`` (for DDP)."""

    def __init__(self, layers, forward):
        super().__init__()
        self.layers = layers
        self.run = forward

    def forward(self, x):
        return self.run(x)


def ensure_process_group():
    """A one-process gloo group for DistributedDataParallel, made once per process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != 1:
        raise RuntimeError("a process group of several ranks is initialized: DDP programs need one rank")


def record_state(rec, name, sd):
    """The per-parameter state of an optimizer state dict (torch's format, or DCP's keyed by
    parameter names): the entry names, then their values."""
    names, values = [], []
    for key in sorted(sd["state"], key=str):
        # the hybrid keeps each master weight in its parameter's state (so DCP keeps it); the
        # wrapped class has none: masters show in the parameters of later steps instead
        for k in sorted(k for k in sd["state"][key] if k != "master_weight"):
            names.append(f"{key}.{k}")
            values.append(sd["state"][key][k])
    rec.put(f"{name}.state_names", tuple(names))
    rec.put(f"{name}.state", tuple(values))


def step_after_close(opt, timeout=3.0):
    """What ``opt.step()`` does after ``opt.close()`` (expected: an ``OffloadUsageError`` that
    names ``close()``), in a thread of its own so that a hang is reported, not waited for."""
    out = []

    def call():
        try:
            opt.step()
            out.append("no error")
        except OffloadUsageError as exc:
            out.append("OffloadUsageError naming close()" if "close()" in str(exc)
                       else first_line(exc))
        except Exception as exc:  # noqa: BLE001 - reported
            out.append(first_line(exc))

    thread = threading.Thread(target=call, daemon=True, name="step after close")
    thread.start()
    thread.join(timeout)
    return out[0] if out else f"hung (no answer after {timeout} s)"


def misuse(kind, offload, dev):
    """A wrong use of the optimizer, on parameters of its own: a bad argument must give an
    ``OffloadConfigError``; after the sparse-gradient error of ``step()``, ``zero_grad()``
    must work as torch's does."""
    if kind == "sparse_grad":
        emb = nn.Embedding(4, 2, sparse=True)
        if offload:
            opt = HybridDeviceOptimizer(emb.parameters(), 1.0, device=dev, stream_fraction=0.0,
                                        cpu_threads=1, lr=0.01)
        else:
            opt = torch.optim.AdamW(emb.parameters(), lr=0.01, fused=True)
        try:
            try:
                emb(torch.tensor([0, 2])).sum().backward()
                opt.step()
                out = "a sparse gradient accepted"
            except RuntimeError:
                out = "a sparse gradient refused"
            try:
                opt.zero_grad()
                return out + ", then zero_grad() works"
            except Exception as exc:  # noqa: BLE001 - reported
                return out + f", then zero_grad() raised {first_line(exc)}"
        finally:
            if offload:
                opt.close()
    if not offload:
        return "OffloadConfigError"
    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(2)]
    kw = {"device_str": {"device": "cpu"}, "grad_order_int": {"grad_order": 5},
          "grad_order_str": {"grad_order": "abc"}}[kind]
    try:
        opt = HybridDeviceOptimizer(params, 0.5, **{"device": dev, **kw}, stream_fraction=0.0,
                                    cpu_threads=1, lr=0.01)
    except OffloadConfigError:
        return "OffloadConfigError"
    except Exception as exc:  # noqa: BLE001 - reported
        return first_line(exc)
    opt.close()
    return "accepted"
