"""Migration audit: what V1's ``activation_offloading`` tags select vs. what V2 detects.

Callers moving from tags to automatic detection run ``audit_offload_selection(layers, x)`` once
and read, per layer, which saved tensors each backend would offload, how many bytes that is, and
why every other tensor stays on the device (parameter, weight mark, ``mark_not_offload``, too
small, not on the device, module opted out, ...). They can then opt tensors or modules out
(``mark_not_offload``, ``set_activation_offloading``) until V2 moves what V1 moved.

The audit does not use the offload context: it installs its own ``saved_tensors_hooks`` around
each layer's forward, classifies every saved tensor with the predicates the backends' pack hooks
use (``SelectionPolicy.skip_reason`` for V2, the tag checks for V1) and moves nothing. Both
backends move the *whole storage* a saved tensor views, once per layer however many saved tensors
share it (views of one base, duplicates), so bytes are unique-storage bytes
(``untyped_storage().nbytes()``), counted once per layer and backend. The per-tensor ``nbytes``
(``numel * element_size``) is shown for reference.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..core import markers
from ..compat import is_traceable_wrapper_subclass, register_forward_hook_always, saved_tensors_hooks
from ..core.units import format_bytes
from ..v2.selection import SelectionPolicy
from .layers import instrument

BYTES_NOTE = (
    "bytes = whole-storage bytes, each storage counted once per layer and backend (views and "
    "duplicates share one copy), as both backends move them"
)


@dataclass
class SavedTensorInfo:
    """One tensor saved for backward during a layer's forward, and both backends' verdicts."""

    index: int  # order of saving within the layer
    module: str  # innermost running sub-module, relative to the layer ("" = the layer itself)
    shape: tuple
    dtype: str
    nbytes: int  # numel * element_size (inner tensors summed for wrapper subclasses)
    storage_nbytes: int  # bytes of the storage(s) behind it
    storages: tuple  # layer-local ids of those storages (shared ids = shared memory)
    v1_selected: bool
    v1_reason: Optional[str]  # why V1 keeps it on the device (None if selected)
    v2_selected: bool
    v2_reason: Optional[str]  # why V2 keeps it on the device (None if selected)
    v1_storages: tuple = ()  # ids of the storages V1 moves for it
    v2_storages: tuple = ()  # ids of the storages V2 moves for it
    v1_new_bytes: int = 0  # bytes it adds to V1's layer total (0: its storage is already moved)
    v2_new_bytes: int = 0  # the same for V2


@dataclass
class LayerAudit:
    """Every saved tensor of one layer, with per-backend totals."""

    index: int
    name: str
    tensors: list = field(default_factory=list)  # list[SavedTensorInfo]

    @property
    def saved_count(self) -> int:
        return len(self.tensors)

    @property
    def v1_count(self) -> int:
        return sum(t.v1_selected for t in self.tensors)

    @property
    def v1_storages(self) -> int:
        return len({s for t in self.tensors for s in t.v1_storages})

    @property
    def v1_bytes(self) -> int:
        """Unique-storage bytes V1 moves for this layer."""
        return sum(t.v1_new_bytes for t in self.tensors)

    @property
    def v2_count(self) -> int:
        return sum(t.v2_selected for t in self.tensors)

    @property
    def v2_storages(self) -> int:
        return len({s for t in self.tensors for s in t.v2_storages})

    @property
    def v2_bytes(self) -> int:
        """Unique-storage bytes V2 moves for this layer."""
        return sum(t.v2_new_bytes for t in self.tensors)

    @property
    def v1_only(self) -> int:
        """Tagged for V1 but kept by V2: where migrating loses offloading."""
        return sum(t.v1_selected and not t.v2_selected for t in self.tensors)

    @property
    def v2_only(self) -> int:
        """Offloaded by V2 but never tagged: new traffic after migrating."""
        return sum(t.v2_selected and not t.v1_selected for t in self.tensors)

    def v2_skipped(self) -> dict:
        return dict(Counter(t.v2_reason for t in self.tensors if not t.v2_selected))

    def v1_skipped(self) -> dict:
        return dict(Counter(t.v1_reason for t in self.tensors if not t.v1_selected))

    def summary(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "saved_count": self.saved_count,
            "v1_count": self.v1_count,
            "v1_storages": self.v1_storages,
            "v1_bytes": self.v1_bytes,
            "v2_count": self.v2_count,
            "v2_storages": self.v2_storages,
            "v2_bytes": self.v2_bytes,
            "v1_only": self.v1_only,
            "v2_only": self.v2_only,
            "v1_skipped": self.v1_skipped(),
            "v2_skipped": self.v2_skipped(),
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "tensors": [dataclasses.asdict(t) for t in self.tensors]}


@dataclass
class AuditReport:
    """Result of ``audit_offload_selection``: per layer, what each backend would offload.

    ``print(report)`` shows one summary row per layer and one row per saved tensor (shape,
    dtype, bytes, storage, and each backend's verdict with its reason); ``table(details=False)``
    only the summary rows; ``totals()`` sums the per-layer counts; ``to_dict()`` gives all of
    it as plain data (for logging or JSON).

    Attributes:
        layers: one ``LayerAudit`` per layer: ``tensors`` (the saved tensors and verdicts),
            ``v1_count``/``v1_bytes``, ``v2_count``/``v2_bytes``, ``v1_only``/``v2_only``,
            ``v2_skipped()`` (reason -> count).
        policy: the V2 selection settings the audit used.
        notes: how bytes are counted.

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> report = cpu_offload.audit_offload_selection(
        ...     layers, torch.randn(4, 8), is_device_tensor=lambda t: True)
        >>> report.layers[0].v2_skipped()   # 32 elements: below min_tensor_size_to_offload
        {'too small': 1}
        >>> sorted(report.to_dict())
        ['layers', 'notes', 'policy', 'totals']
    """

    layers: list  # list[LayerAudit]
    policy: dict
    notes: tuple = (BYTES_NOTE,)

    def totals(self) -> dict:
        keys = ("saved_count", "v1_count", "v1_storages", "v1_bytes", "v2_count", "v2_storages",
                "v2_bytes", "v1_only", "v2_only")
        return {k: sum(getattr(layer, k) for layer in self.layers) for k in keys}

    def to_dict(self) -> dict:
        return {
            "policy": dict(self.policy),
            "notes": list(self.notes),
            "totals": self.totals(),
            "layers": [layer.to_dict() for layer in self.layers],
        }

    def table(self, details: bool = True) -> str:
        """Fixed-width text: one summary row per layer, then (``details``) one row per tensor."""
        return _format_report(self, details)

    def __str__(self) -> str:
        return self.table()


# --- classification ------------------------------------------------------------------------------


def _storage(t: torch.Tensor) -> tuple:
    """``(key, nbytes)`` of the storage behind ``t``; tensors without one (sparse) have 0 bytes."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return ("no storage", id(t)), 0
    return (str(t.device), storage.data_ptr()), storage.nbytes()


def _v1_verdict(t: torch.Tensor, is_device_tensor: Callable[[torch.Tensor], bool]) -> tuple:
    """``(reason, [(storage_key, nbytes), ...])`` as V1's pack hook decides: tagged, not marked,
    not opted out, on the device; wrapper subclasses by their inner tensors (which the tag and
    the mark reach too)."""
    if markers.module_opt_out_active():  # checked before anything else, as V1's pack hook does
        tagged = any(getattr(c, markers.V1_TAG_ATTR, False) for c in markers.component_tensors(t))
        return ("module opted out" if tagged else "not tagged"), []
    if is_traceable_wrapper_subclass(t):
        return _inner_verdicts(t, lambda inner: _v1_verdict(inner, is_device_tensor))
    if not getattr(t, markers.V1_TAG_ATTR, False):
        return "not tagged", []
    if markers.is_marked_not_offload(t):
        return "mark_not_offload", []
    if not is_device_tensor(t):
        return "not on the offload device", []
    if t.layout != torch.strided:
        return "not strided", []
    return _whole_storage(t)


def v2_verdict(t: torch.Tensor, policy: SelectionPolicy) -> tuple:
    """``(reason, [(storage_key, nbytes), ...])`` exactly as V2's pack hook decides.

    Mirrors ``OffloadSynchronizer.push``: wrapper subclasses are judged as a whole for the
    opt-outs, then each inner tensor on its own; empty storages are never moved.
    """
    if is_traceable_wrapper_subclass(t):
        reason = policy.wrapper_skip_reason(t)
        if reason is not None:
            return reason, []
        return _inner_verdicts(t, lambda inner: v2_verdict(inner, policy))
    reason = policy.skip_reason(t)
    if reason == "weight mark" and isinstance(t._base, nn.Parameter):
        reason = "parameter view"  # e.g. the ``weight.t()`` that ``F.linear`` saves
    if reason is not None:
        return reason, []
    return _whole_storage(t)


def _whole_storage(t: torch.Tensor) -> tuple:
    key, nbytes = _storage(t)
    if nbytes == 0:
        return "empty storage", []
    return None, [(key, nbytes)]


def _inner_verdicts(t: torch.Tensor, judge: Callable[[torch.Tensor], tuple]) -> tuple:
    """A wrapper subclass is moved if any inner tensor is; else the first inner reason."""
    reasons, storages = [], []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            reason, found = judge(inner)
            reasons.append(reason)
            storages.extend(found)
    if storages:
        return None, storages
    return next((r for r in reasons if r), "no inner tensor"), []


def _leaves(t: torch.Tensor) -> list:
    return [c for c in markers.component_tensors(t) if not is_traceable_wrapper_subclass(c)]


class _LayerRecorder:
    """Pack hook and module-path tracking for one layer's forward."""

    def __init__(
        self, audit: LayerAudit, policy: SelectionPolicy, is_device_tensor: Callable
    ) -> None:
        self.audit = audit
        self.policy = policy
        self.is_device_tensor = is_device_tensor
        self.path: list[str] = []
        self.storage_ids: dict = {}
        self.moved: dict = {"v1": set(), "v2": set()}
        self.keep: list[torch.Tensor] = []  # alive until the audit ends: storage keys stay unique

    def _id(self, key: Any) -> int:
        return self.storage_ids.setdefault(key, len(self.storage_ids))

    def _account(self, backend: str, storages: list) -> tuple:
        """(storage ids, bytes not yet moved by ``backend`` in this layer)."""
        ids, new_bytes = [], 0
        for key, nbytes in storages:
            sid = self._id(key)
            if sid not in self.moved[backend]:
                self.moved[backend].add(sid)
                new_bytes += nbytes
            ids.append(sid)
        return tuple(ids), new_bytes

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.keep.append(t)
        leaves = _leaves(t)
        storages = [_storage(c) for c in leaves]
        all_ids = tuple(self._id(key) for key, _ in storages)
        v1, v1_found = _v1_verdict(t, self.is_device_tensor)
        v2, v2_found = v2_verdict(t, self.policy)
        v1_ids, v1_new = self._account("v1", v1_found)
        v2_ids, v2_new = self._account("v2", v2_found)
        self.audit.tensors.append(
            SavedTensorInfo(
                index=len(self.audit.tensors),
                module=self.path[-1] if self.path else "",
                shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""),
                nbytes=sum(c.numel() * c.element_size() for c in leaves),
                storage_nbytes=sum(nbytes for _, nbytes in storages),
                storages=all_ids,
                v1_selected=v1 is None,
                v1_reason=v1,
                v2_selected=v2 is None,
                v2_reason=v2,
                v1_storages=v1_ids,
                v2_storages=v2_ids,
                v1_new_bytes=v1_new,
                v2_new_bytes=v2_new,
            )
        )
        return t

    def track_modules(self, layer: nn.Module) -> list:
        """Hooks that keep ``self.path`` = the innermost running sub-module's name."""
        handles = []
        for name, module in layer.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(name)))
            handles.append(register_forward_hook_always(module, self._leave))
        return handles

    def _enter(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self.path.append(name)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.path:
            self.path.pop()


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _default_call(layer: nn.Module, x: Any) -> Any:
    return layer(*x) if isinstance(x, tuple) else layer(x)


def _as_layers(model_layers: Union[nn.Module, Sequence[nn.Module]]) -> list:
    if isinstance(model_layers, (nn.Sequential, nn.ModuleList)):
        return list(model_layers)
    if isinstance(model_layers, nn.Module):
        return [model_layers]
    layers = list(model_layers)
    bad = [type(m).__name__ for m in layers if not isinstance(m, nn.Module)]
    if bad:
        raise TypeError(f"model_layers must contain nn.Modules, got {', '.join(bad)}")
    return layers


def audit_offload_selection(
    model_layers: Union[nn.Module, Sequence[nn.Module]],
    example_input: Any = None,
    *,
    step_fn: Optional[Callable[[], Any]] = None,
    policy: Optional[SelectionPolicy] = None,
    is_device_tensor: Optional[Callable[[torch.Tensor], bool]] = None,
    call_layer: Callable[[nn.Module, Any], Any] = _default_call,
) -> AuditReport:
    """Report, per layer, what each backend offloads: from a chain forward or a real step.

    Two modes:

    - ``audit_offload_selection(layers, x)``: one forward (grad enabled) through the layers as a
      chain, each layer's output feeding the next; ``call_layer(layer, x)`` calls a layer
      (default: ``layer(*x)`` for a tuple, else ``layer(x)``). No backward runs and nothing is
      moved; the forward's graph is dropped.
    - ``audit_offload_selection(layers, step_fn=step)``: runs ``step()``, one ordinary training
      step of the real model (any layer signature: keyword arguments, tuple or ``ModelOutput``
      returns), and records what each layer saves during the first forward pass. The gradients
      the step accumulates are left as they are.

    Use it when moving from V1's tags to V2's automatic detection, or to see why V2 keeps a
    tensor on the device: then opt tensors or modules out (``mark_not_offload``,
    ``set_activation_offloading``) until V2 moves what you want moved (README, "Control and
    migration").

    Args:
        model_layers: a list of layers, an ``nn.ModuleList``/``nn.Sequential`` (each child is a
            layer), or one module (one layer).
        example_input: input of the first layer, for the chain mode.
        step_fn: one training step, for the real-step mode (instead of ``example_input``).
        policy: V2's selection, a ``cpu_offload.SelectionPolicy`` (pass the
            ``offload_weights``/``min_tensor_size_to_offload`` you will use); default: the
            defaults of ``get_cpu_offload_context``.
        is_device_tensor: replaces the device test of both backends (e.g. ``lambda t:
            t.device.type == "cpu"`` to audit on a CPU); default: CUDA tensors.
        call_layer: how the chain mode calls a layer.

    Returns:
        An ``AuditReport``: ``print(report)`` for the table, ``report.to_dict()`` for the data.

    Raises:
        TypeError: neither or both of ``example_input`` and ``step_fn``, or ``model_layers``
            containing something other than modules.

    Example::

        >>> import torch, cpu_offload
        >>> layers = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> report = cpu_offload.audit_offload_selection(
        ...     layers, torch.randn(4, 8),
        ...     policy=cpu_offload.SelectionPolicy(min_tensor_size_to_offload=1),
        ...     is_device_tensor=lambda t: True)    # audit CPU tensors as if on the GPU
        >>> t = report.totals()
        >>> t["saved_count"], t["v2_count"], t["v1_count"]   # nothing carries a V1 tag
        (2, 2, 0)
    """
    if (example_input is None) == (step_fn is None):
        raise TypeError(
            "audit_offload_selection needs exactly one of example_input (a chain forward through "
            "the layers) and step_fn= (a real training step that runs them)"
        )
    policy = policy or SelectionPolicy()
    if is_device_tensor is not None:
        policy = dataclasses.replace(policy, is_device_tensor=is_device_tensor)
    layers = _as_layers(model_layers)
    audits = [LayerAudit(index=i, name=type(layer).__name__) for i, layer in enumerate(layers)]
    if step_fn is not None:
        _audit_step(step_fn, layers, audits, policy)
    else:
        _audit_chain(example_input, layers, audits, policy, call_layer)
    return AuditReport(
        layers=audits,
        policy={
            "offload_activations": policy.offload_activations,
            "offload_weights": policy.offload_weights,
            "min_tensor_size_to_offload": policy.min_tensor_size_to_offload,
        },
    )


def _audit_chain(
    x: Any, layers: list, audits: list, policy: SelectionPolicy, call_layer: Callable
) -> None:
    keep: list[torch.Tensor] = []
    with torch.enable_grad():
        for layer, audit in zip(layers, audits):
            recorder = _LayerRecorder(audit, policy, policy.is_device_tensor)
            handles = recorder.track_modules(layer)
            try:
                with saved_tensors_hooks(recorder.pack, _unpack):
                    x = call_layer(layer, x)
            finally:
                for handle in handles:
                    handle.remove()
            keep.extend(recorder.keep)
    del x, keep


class _StepAuditDriver:
    """``layers.instrument`` driver: a ``_LayerRecorder`` around each layer of the first pass."""

    owner = None

    def __init__(self, audits: list, policy: SelectionPolicy) -> None:
        self.audits = audits
        self.policy = policy
        self.passes = 0
        self.active: Optional[tuple] = None

    def before(self, index: int, layer: nn.Module, args: tuple, kwargs: dict) -> Optional[int]:
        if index == 0:
            self.passes += 1
        if self.passes != 1:
            return None
        recorder = _LayerRecorder(self.audits[index], self.policy, self.policy.is_device_tensor)
        handles = recorder.track_modules(layer)
        hooks = saved_tensors_hooks(recorder.pack, _unpack)
        hooks.__enter__()
        self.active = (recorder, handles, hooks)
        return index

    def after(self, index: int, out: Any) -> Any:
        self.close()
        return out

    def abort(self, index: int, exc: BaseException) -> None:
        self.close()

    def close(self) -> None:
        active, self.active = self.active, None
        if active is not None:
            recorder, handles, hooks = active
            hooks.__exit__(None, None, None)
            for handle in handles:
                handle.remove()
            # The graph keeps what was saved alive until backward: no need to hold it here.
            recorder.keep.clear()


def _audit_step(step_fn: Callable[[], Any], layers: list, audits: list, policy: SelectionPolicy) -> None:
    driver = _StepAuditDriver(audits, policy)
    undo = instrument(layers, driver)
    try:
        step_fn()
    finally:
        driver.close()
        undo()
    if driver.passes == 0:
        raise ValueError(
            "step_fn() ran none of the layers with grad enabled: pass the layers its forward "
            "calls (e.g. model.model.layers) and a step_fn that runs forward and backward"
        )


# --- text ----------------------------------------------------------------------------------------


def _verdict_text(reason: Optional[str], new_bytes: int) -> str:
    if reason is not None:
        return f"keep: {reason}"
    return "offload" if new_bytes else "offload (storage already moved)"


def _reasons(counts: dict) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items())) or "-"


def _rows(header: Sequence[str], rows: Sequence[Sequence[str]], right: set) -> Iterator[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def fmt(cells: Sequence[str]) -> str:
        parts = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    yield fmt(header)
    yield fmt(["-" * w for w in widths])
    for row in rows:
        yield fmt(row)


def _format_report(report: AuditReport, details: bool) -> str:
    p = report.policy
    lines = [
        "Offload selection audit: V1 = activation_offloading tags, V2 = automatic detection",
        f"V2 policy: offload_activations={p['offload_activations']}, "
        f"offload_weights={p['offload_weights']}, "
        f"min_tensor_size_to_offload={p['min_tensor_size_to_offload']} elements",
        *(f"Note: {note}" for note in report.notes),
        "",
    ]
    header = ["layer", "saved", "V1 n", "V1 storages", "V1 bytes", "V2 n", "V2 storages",
              "V2 bytes", "V1 only", "V2 only", "V2 keeps (reason n)"]
    rows = [
        [f"{a.index} {a.name}", a.saved_count, a.v1_count, a.v1_storages,
         format_bytes(a.v1_bytes), a.v2_count, a.v2_storages, format_bytes(a.v2_bytes), a.v1_only,
         a.v2_only, _reasons(a.v2_skipped())]
        for a in report.layers
    ]
    t = report.totals()
    rows.append(["total", t["saved_count"], t["v1_count"], t["v1_storages"],
                 format_bytes(t["v1_bytes"]), t["v2_count"], t["v2_storages"],
                 format_bytes(t["v2_bytes"]), t["v1_only"], t["v2_only"], ""])
    lines.extend(_rows(header, rows, right=set(range(1, 10))))
    if not details:
        return "\n".join(lines)
    for a in report.layers:
        lines += ["", f"layer {a.index} {a.name}"]
        header = ["#", "module", "shape", "dtype", "bytes", "storage", "V1", "V2"]
        rows = [
            [s.index, s.module or "(layer)", "x".join(map(str, s.shape)) or "scalar", s.dtype,
             format_bytes(s.nbytes), ",".join(f"s{i}" for i in s.storages),
             _verdict_text(s.v1_reason, s.v1_new_bytes),
             _verdict_text(s.v2_reason, s.v2_new_bytes)]
            for s in a.tensors
        ]
        if rows:
            lines.extend("  " + line for line in _rows(header, rows, right={0, 4}))
        else:
            lines.append("  (no tensors saved for backward)")
    return "\n".join(lines)
