"""Helpers every generated program uses: what it records, how two runs are compared, and the
checks that nothing stays installed or alive. A reproducer inlines their source
(``inspect.getsource``), so each keeps its code in its own body."""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch

import cpu_offload
from cpu_offload import OffloadUsageError

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
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
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
