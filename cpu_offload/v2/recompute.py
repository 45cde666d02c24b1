"""Selective recomputation: per saved tensor, store its bytes or the recipe that recomputes it.

A layer marked *selective* runs its forward under ``RecipeRecorder``, a dispatch mode that notes,
for the output of every cheap, deterministic aten op (norms, activations, elementwise arithmetic,
dtype casts, copies; ``CHEAP_OPS``), how it was made: the op, its non-tensor arguments and, per
tensor argument, its storage (weakly), geometry and version. Nothing is held: outputs and
inputs stay weak references, parameters are the module's own.

A Python dispatch mode costs the host tens of microseconds per op, which a layer of many small
ops (a Hugging Face decoder layer runs about 90) turns into a host-bound forward. So by default
(``scope="modules"``) the mode is active only while a norm or activation module runs
(``is_recomputable_module``: ``LayerNorm``, ``GroupNorm``, ``RMSNorm`` and classes named
``*RMSNorm``/``*LayerNorm``, ``GELU``, ``SiLU``, ``ReLU``, ``Tanh``, ``Sigmoid``), entered and
left by global module hooks: a few ops recorded per layer, the outputs that matter most (a
GPT block's two LayerNorm outputs and its GELU output). ``scope="layer"`` records every op of the
layer (also elementwise products outside modules, such as a gated MLP's), at that host cost.

When the layer's pack hook sees a saved tensor whose whole storage is such an output, unchanged
since, and every tensor input of its op is held anyway by this layer's forward (saved by it,
offloaded or kept, a parameter, a tiny tensor, or itself recomputable the same way from such
inputs), the hook stores a ``RecomputedRef`` instead of the bytes: references to the inputs'
saved states, no data. Its unpack runs the op again under ``no_grad`` on the current stream from
the unpacked inputs (reloaded from the host, kept, or recomputed in turn) and restores the saved
view of the result. The recomputed storage serves every saved view of it in that backward and
is dropped after the last one, as a reload is. Any other saved tensor takes the ordinary path,
so this composes with offloading: a matmul output is offloaded, the GELU output made from it is
recomputed from the reloaded matmul output and never stored at all.

Exact: a deterministic op run on the same device with the same inputs (same bytes, geometry and
alignment) gives the same bits. Random ops are never recipes (none is in ``CHEAP_OPS``); a saved
tensor changed in place after its op (or whose inputs were) is stored as bytes; one changed
after it was saved raises autograd's "modified by an inplace operation" error at backward.

An input held as it is (a tiny tensor or a parameter) that nothing saved may legally be changed
in place after the op read it, even after the op's output was saved (``t = tanh(a); a.mul_(2)``).
Outputs whose recipes rerun from such a tiny tensor are held until the layer's forward ends;
if the tensor changed by then, the output is stored the ordinary way (offloaded or kept)
instead. A change after the layer's forward (or to a parameter, whose outputs are not held,
during it) raises at backward, naming the fix.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

from torch import nn

from ..compat import (
    TorchDispatchMode,
    autocast_off,
    bytes_on_storage,
    functional_overloads,
    global_module_hooks,
    is_parameter,
)
from ..core.errors import OffloadConfigError
from ..core.storage import KeptRef, VersionWatch, ViewMeta, restore_view, storage_bytes
from .layer_state import SavedRef
from .stats import LayerStats

# Cheap, deterministic ops whose outputs are worth recomputing instead of storing: their outputs
# are as large as their inputs and they cost a fraction of a matmul. No random op is listed.
CHEAP_OP_NAMES = (
    "native_layer_norm", "_fused_rms_norm",  # norms (F.rms_norm decomposes into the ops below)
    "gelu", "silu", "relu", "tanh", "sigmoid",  # activations
    "mul", "add", "sub", "div", "neg", "pow", "rsqrt", "sqrt", "exp",  # elementwise
    "mean", "_to_copy", "clone",  # reductions along a dim (RMSNorm), dtype casts, copies
)
_cheap: Optional[frozenset] = None

TINY_BYTES = 4096  # inputs whose whole storage is this small are held (scalars, eps tensors)
MAX_DEPTH = 4  # how far a recipe may reach back through inputs that are not saved themselves


def cheap_ops() -> frozenset:
    """The ``OpOverload``s recorded as recipes (``CHEAP_OP_NAMES``, functional overloads)."""
    global _cheap
    if _cheap is None:
        _cheap = functional_overloads(CHEAP_OP_NAMES)
    return _cheap


class InputSpec:
    """One tensor argument of a recorded op: where its bytes were, and how to find them again."""

    __slots__ = ("key", "storage", "version", "meta", "held", "param", "producer")

    def __init__(self, t: torch.Tensor, storage: Any, producer: Optional["Recipe"]) -> None:
        self.key = storage.data_ptr()
        self.storage = weakref.ref(storage)
        self.version = t._version
        self.meta = ViewMeta.of(t)
        base = t._base
        # Parameters (and views of them) and tiny tensors are held as they are: no memory.
        # (Detached only when packed: below autograd, detach() would not share the version.)
        param = is_parameter(t) or (base is not None and is_parameter(base))
        self.held = t if param or storage.nbytes() <= TINY_BYTES else None
        self.param = param
        self.producer = producer  # the recipe that made this storage, if recorded


class Recipe:
    """How one output of a recorded op call was made (the call is shared by its outputs)."""

    __slots__ = ("func", "args", "kwargs", "inputs", "index", "storage", "version", "nbytes",
                 "meta", "device", "call")

    def __init__(self, func: Any, args: tuple, kwargs: dict, inputs: list, index: Optional[int],
                 out: torch.Tensor, storage: Any, call: Optional[list] = None) -> None:
        # The entries of every output of the same call (``SelectiveLayer._entry`` fills it):
        # one rerun of a multi-output op (native_layer_norm: out, mean, rstd) serves them all.
        self.call: list = call if call is not None else []
        self.func = func
        self.args = args  # tensor arguments replaced by their position in ``inputs``
        self.kwargs = kwargs
        self.inputs = inputs
        self.index = index  # which output of a multi-output op (native_layer_norm: 0)
        self.storage = weakref.ref(storage)
        self.version = out._version
        self.nbytes = storage.nbytes()
        self.meta = ViewMeta.of(out)
        self.device = out.device


class _Slot:
    """Placeholder for the ``i``-th tensor argument in a recipe's argument template."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


class RecipeRecorder(TorchDispatchMode):
    """Dispatch mode active during a selective layer's forward: records ``Recipe``s, keyed by
    the data pointer of each output's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.recipes: dict[int, Recipe] = {}
        self.cheap = cheap_ops()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.cheap:
            self._record(func, args, kwargs, out)
        return out

    def _record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs: list[InputSpec] = []
        device = None

        def template(a: Any) -> Any:
            nonlocal device
            if isinstance(a, torch.Tensor):
                if type(a) is not torch.Tensor and not is_parameter(a):
                    raise _Skip  # tensor subclasses: their ops are theirs
                storage = a.untyped_storage()
                producer = self.recipes.get(storage.data_ptr())
                if producer is not None and not (
                    producer.storage() is storage and producer.version == a._version
                ):
                    producer = None
                inputs.append(InputSpec(a, storage, producer))
                if a.dim():
                    device = device or a.device
                return _Slot(len(inputs) - 1)
            if isinstance(a, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in a):
                raise _Skip  # tensor lists (cat, ...) are not recorded
            return a

        try:
            targs = tuple(template(a) for a in args)
            tkwargs = {k: template(v) for k, v in kwargs.items()}
        except _Skip:
            return
        call: list = []  # shared by this call's recipes
        for index, o in enumerate(outs):
            if type(o) is not torch.Tensor or o.layout is not torch.strided:
                continue
            if device is not None and o.device != device:
                continue  # a copy to another device (``.to("cpu")``) is not recomputed
            storage = o.untyped_storage()
            if storage.nbytes() == 0 or storage.nbytes() != o.numel() * o.element_size():
                continue  # only outputs that own their whole storage
            self.recipes[storage.data_ptr()] = Recipe(
                func, targs, tkwargs, inputs, index if len(outs) > 1 or out is not o else None,
                o, storage, call,
            )


SELECTIVE_SCOPES = ("modules", "layer")
RECOMPUTABLE_MODULES = tuple(
    getattr(nn, name) for name in
    ("LayerNorm", "GroupNorm", "RMSNorm", "GELU", "SiLU", "ReLU", "Tanh", "Sigmoid")
    if hasattr(nn, name)  # nn.RMSNorm: torch 2.4 and later
)
NORM_NAME_SUFFIXES = ("RMSNorm", "LayerNorm")  # e.g. transformers' LlamaRMSNorm
_recomputable: dict = {}  # module class -> verdict


def check_selective_scope(scope: str) -> None:
    if scope not in SELECTIVE_SCOPES:
        raise OffloadConfigError(
            f"selective scope must be one of {SELECTIVE_SCOPES}, got {scope!r}: 'modules' records "
            "ops inside norm and activation modules (cheap), 'layer' every op of the layer"
        )


def is_recomputable_module(module: nn.Module) -> bool:
    """Whether ``scope="modules"`` records the ops of ``module``'s forward: a norm or an
    activation (by type, or a class named ``*RMSNorm``/``*LayerNorm``)."""
    cls = type(module)
    verdict = _recomputable.get(cls)
    if verdict is None:
        verdict = _recomputable[cls] = (
            issubclass(cls, RECOMPUTABLE_MODULES) or cls.__name__.endswith(NORM_NAME_SUFFIXES)
        )
    return verdict


class ModuleScopedRecorder:
    """``RecipeRecorder`` entered only while a recomputable module runs (and the modules it
    calls), by global module hooks: the host pays the dispatch mode for a few ops per layer,
    not all of them. Same interface as the recorder (``recipes``, context manager)."""

    def __init__(self) -> None:
        self.mode = RecipeRecorder()
        self.recipes = self.mode.recipes
        self.depth = 0  # module calls open since a recomputable one started
        self.handles: list = []

    def __enter__(self) -> "ModuleScopedRecorder":
        self.handles = global_module_hooks(self._pre, self._post)
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.depth:  # left from inside a module (cannot happen with paired hooks; be safe)
            self.depth = 0
            self.mode.__exit__(None, None, None)

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self.depth:
            self.depth += 1
        elif is_recomputable_module(module):
            self.mode.__enter__()
            self.depth = 1

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self.depth:
            self.depth -= 1
            if not self.depth:
                self.mode.__exit__(None, None, None)


class _Skip(Exception):
    """An op call that is not recorded."""


class RecomputeEntry:
    """One recomputable storage: its recipe, references to its inputs' saved states, and the
    recomputed storage while a backward uses it. Like ``layer_state.Entry``: shared by every
    saved view of the storage, freed after the last unpack of a backward."""

    __slots__ = ("recipe", "inputs", "lstats", "live", "pops", "generation", "cached", "watch",
                 "fragile", "stored", "__weakref__")

    def __init__(self, recipe: Recipe, inputs: list, lstats: LayerStats) -> None:
        self.recipe = recipe
        self.inputs = inputs  # per InputSpec: a ref with .unpack() giving that input
        self.lstats = lstats
        self.live = 0
        self.pops = 0
        self.generation = 0
        self.cached: Optional[torch.Tensor] = None
        self.watch: Optional[VersionWatch] = None  # the original's version counter, no memory
        # Whether an input it reruns from (itself, or through the recipes of its inputs) is a
        # tensor held as it is that is no parameter: the model may legally change such a tensor
        # in place after the op read it (nothing saved it), which ``intact`` tells at the end of
        # the layer's forward.
        self.fragile = any(
            (type(ref) is HeldInput and not ref.param)
            or (type(ref) is RecomputedRef and ref.entry.fragile)
            for ref in inputs
        )
        # The output's bytes stored the ordinary way (a SavedRef or KeptRef), when an input
        # changed in place before the layer's forward ended: then nothing is rerun.
        self.stored: Any = None

    def intact(self) -> bool:
        """Whether rerunning the recipe still gives the original bytes: no held input changed
        in place since the op read it (a stored input entry counts as intact)."""
        if self.stored is not None:
            return True
        for ref in self.inputs:
            if type(ref) is HeldInput:
                if ref.alias._version != ref.version:
                    return False
            elif type(ref) is RecomputedRef and not ref.entry.intact():
                return False
        return True

    def original(self) -> Optional[torch.Tensor]:
        """The original storage, if something else kept it alive unchanged (then it is used
        as it is, as a reload uses a storage held elsewhere)."""
        storage = self.recipe.storage()
        watch = self.watch
        if storage is None or watch is None or watch.alias._version != self.recipe.version:
            return None
        return bytes_on_storage(storage, watch.alias)

    def materialize(self) -> torch.Tensor:
        """The storage's bytes (flat ``uint8``): cached, the original, or recomputed now."""
        if self.cached is not None:
            return self.cached
        if self.stored is not None:
            flat = storage_bytes(self.stored.unpack())
        else:
            flat = self.original()
            if flat is None:
                flat = self._recompute()
        self.cached = flat
        return flat

    def _recompute(self) -> torch.Tensor:
        """Rerun the recorded call; its other outputs that are recipes waiting for a backward
        (LayerNorm's mean and rstd beside its output) are cached from the same run."""
        r = self.recipe
        tensors = [ref.unpack() for ref in self.inputs]

        def fill(a: Any) -> Any:
            return tensors[a.i] if type(a) is _Slot else a

        with torch.no_grad(), autocast_off(r.device.type):
            out = r.func(*[fill(a) for a in r.args], **{k: fill(v) for k, v in r.kwargs.items()})
        if r.index is None:
            return self._checked(out)
        for ref in r.call:
            sibling = ref()
            if (sibling is not None and sibling is not self and sibling.cached is None
                    and sibling.live and sibling.inputs):
                sibling.cached = sibling._checked(out[sibling.recipe.index])
        return self._checked(out[r.index])

    def _checked(self, out: torch.Tensor) -> torch.Tensor:
        """``out``'s storage bytes, after checking it has the layout recorded in forward."""
        r = self.recipe
        storage = out.untyped_storage()
        if ViewMeta.of(out)[:4] != r.meta[:4] or storage.nbytes() != r.nbytes:
            raise RuntimeError(
                f"cpu_offload: recomputing {r.func} gave a tensor of another layout "
                f"({tuple(out.shape)}, strides {out.stride()}) than in forward "
                f"({tuple(r.meta.size)}, strides {r.meta.stride}); please report this with the "
                "layer and the torch version, and leave this layer out of selective"
            )
        self.lstats.recomputed_bytes += r.nbytes
        return storage_bytes(out, storage)

    def free_cache(self) -> None:
        self.cached = None
        self.pops = 0
        self.generation += 1

    def drop(self) -> None:
        self.cached = None
        self.inputs = []
        self.stored = None


class RecomputedRef:
    """What autograd stores for a saved tensor that is recomputed: its storage's
    ``RecomputeEntry`` and its geometry in that storage."""

    __slots__ = ("entry", "meta", "watch", "popped")

    def __init__(self, entry: RecomputeEntry, meta: ViewMeta, watch: Optional[VersionWatch]) -> None:
        self.entry = entry
        self.meta = meta
        self.watch = watch  # None for a recipe's input reference: its dependant checks
        self.popped = -1
        entry.live += 1

    def __del__(self) -> None:
        entry = getattr(self, "entry", None)
        if entry is None:
            return
        entry.live -= 1
        if self.popped == entry.generation:
            entry.pops -= 1
        if entry.live == 0:
            entry.drop()

    def unpack(self) -> torch.Tensor:
        if self.watch is not None:
            self.watch.check()
        entry = self.entry
        t = restore_view(entry.materialize(), self.meta)
        if self.popped != entry.generation:
            self.popped = entry.generation
            entry.pops += 1
        if entry.pops >= entry.live:
            entry.free_cache()  # last unpack of this backward: autograd holds the only reference
        return t


class HeldInput(KeptRef):
    """A recipe input held as it is (a parameter or a tiny tensor): a ``KeptRef`` whose
    expected version is the one the recorded op saw. A change before the layer's forward ends
    makes the layer store the recipe's output instead (``SelectiveLayer.end``); one after it
    raises at backward, naming the fix."""

    __slots__ = ("param",)

    def __init__(self, t: torch.Tensor, version: int, param: bool = False) -> None:
        super().__init__(t)
        self.version = version
        self.param = param

    def check(self) -> None:
        if self.alias._version != self.version:
            what = "parameter" if self.param else "tensor"
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {what} of shape {list(self.size)} that an op of a "
                "selective layer read in forward (to recompute its output in backward) was "
                f"changed in place after that layer's forward (version {self.alias._version}, "
                f"expected {self.version}). Change it before or inside that forward, clone it "
                "before changing it, or leave the layer out of apply_offloading(selective=...)"
            )


class KeptInput:
    """A recipe input whose storage this layer keeps on the device (a ``KeptRef``), in the
    geometry the op saw."""

    __slots__ = ("kept", "meta")

    def __init__(self, kept: KeptRef, meta: ViewMeta) -> None:
        self.kept = kept
        self.meta = meta

    def unpack(self) -> torch.Tensor:
        self.kept.check()
        return restore_view(storage_bytes(self.kept.alias), self.meta)


class SelectiveLayer:
    """Per step, one selective layer's forward: the recorder while it runs, the saved states
    its pack hook produced (by storage), and the recompute entries it made."""

    __slots__ = ("index", "lstats", "scope", "recorder", "sources", "by_recipe", "entries",
                 "pending")

    def __init__(self, index: int, lstats: LayerStats, scope: str = "modules") -> None:
        self.index = index
        self.lstats = lstats
        self.scope = scope
        self.recorder: Any = None  # RecipeRecorder or ModuleScopedRecorder while recording
        self.sources: dict[int, Any] = {}  # storage data_ptr -> SavedRef / KeptRef packed last
        self.by_recipe: dict[int, RecomputeEntry] = {}  # id(Recipe) -> its entry, this forward
        self.entries: list = []  # weak references to every RecomputeEntry made
        # id(entry) -> [entry, a saved tensor of it, how many were saved] for fragile entries
        # (``RecomputeEntry.fragile``): their output is held until the forward ends, when it
        # is known whether the recipe still holds.
        self.pending: dict[int, list] = {}

    def begin(self) -> None:
        recorder = RecipeRecorder() if self.scope == "layer" else ModuleScopedRecorder()
        recorder.__enter__()
        self.recorder = recorder

    def end(self, store: Optional[Any] = None) -> None:
        """The layer's forward is over (or failed): stop recording, forget what was recorded.
        ``store`` (the synchronizer's pack hook; ``None`` when the forward failed): stores the
        output of every recipe whose held input was changed in place during the forward (legal
        when nothing saved that input), which a rerun could no longer reproduce."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            recorder.__exit__(None, None, None)
        pending, self.pending = self.pending, {}
        if store is not None:
            for entry, t, count in pending.values():
                if not entry.intact():
                    entry.stored = store(t)
                    self.lstats.recipe_bytes -= entry.recipe.nbytes
                    self.lstats.recipe_tensors -= count
        if recorder is not None:
            # What the recipes recorded about their inputs served the pack hook, which made
            # each entry's own references (detached, no memory). Their held inputs are the
            # tensors themselves, autograd history included: kept by a recipe that an entry
            # in this layer's graph keeps, they would close a cycle through that graph (graph
            # -> RecomputedRef -> entry -> recipe -> tensor -> grad_fn -> graph), which no
            # refcount frees when the graph is dropped without a backward through it, or
            # after a backward that raised.
            for recipe in recorder.recipes.values():
                recipe.inputs = ()
        self.sources = {}
        self.by_recipe = {}

    # -- forward: the pack hook --------------------------------------------------------------------
    def pack(self, t: torch.Tensor, policy: Any) -> Optional[RecomputedRef]:
        """A ``RecomputedRef`` for ``t`` if its storage is a recipe output whose inputs are held
        anyway and V2 would offload it (``policy``), else ``None`` (store it the ordinary way,
        then ``note`` it)."""
        recorder = self.recorder
        if recorder is None or type(t) is not torch.Tensor:
            return None
        storage = t.untyped_storage()
        recipe = recorder.recipes.get(storage.data_ptr())
        if recipe is None or recipe.storage() is not storage or recipe.version != t._version:
            return None
        if policy.skip_reason(t) is not None:
            return None  # too small, opted out, marked: kept as the user asked
        entry = self._entry(recipe, 0)
        if entry is None:
            return None
        watch = VersionWatch(t)
        watch.forget_storage()  # keeps the version counter, holds no memory
        if entry.watch is None:
            entry.watch = watch
            self.lstats.recipe_bytes += recipe.nbytes
        self.lstats.recipe_tensors += 1
        if entry.fragile:
            held = self.pending.get(id(entry))
            if held is None:
                self.pending[id(entry)] = [entry, t, 1]
            else:
                held[2] += 1
        return RecomputedRef(entry, ViewMeta.of(t), watch)

    def note(self, t: torch.Tensor, ref: Any) -> None:
        """``t`` was saved as ``ref`` the ordinary way: later recipes may take it as an input."""
        if self.recorder is not None and type(ref) in (SavedRef, KeptRef):
            self.sources[t.untyped_storage().data_ptr()] = ref

    def _entry(self, recipe: Recipe, depth: int) -> Optional[RecomputeEntry]:
        """The entry recomputing ``recipe``'s output, if all its inputs can be had."""
        entry = self.by_recipe.get(id(recipe))
        if entry is not None:
            return entry
        inputs = []
        for spec in recipe.inputs:
            ref = self._input(spec, depth)
            if ref is None:
                return None
            inputs.append(ref)
        entry = RecomputeEntry(recipe, inputs, self.lstats)
        self.by_recipe[id(recipe)] = entry
        self.entries.append(weakref.ref(entry))
        recipe.call.append(weakref.ref(entry))
        return entry

    def _input(self, spec: InputSpec, depth: int) -> Any:
        """A reference that gives ``spec``'s tensor back in backward, holding no new memory;
        ``None`` if there is none."""
        if spec.held is not None:
            if spec.held._version != spec.version:
                return None  # changed in place since the op read it: a rerun would differ
            return HeldInput(spec.held, spec.version, spec.param)
        src = self.sources.get(spec.key)
        if type(src) is SavedRef:
            entry = src.entry
            if (entry.storage is not None and entry.version == spec.version
                    and entry.storage is spec.storage()):
                # The same storage, watched through the alias of the tensor saved there.
                return SavedRef.new(entry, src.index, spec.meta, torch.Tensor)
        elif type(src) is KeptRef:
            if src.version == spec.version and src.alias.untyped_storage() is spec.storage():
                return KeptInput(src, spec.meta)
        producer = spec.producer
        if producer is not None and depth < MAX_DEPTH:
            entry = self._entry(producer, depth + 1)
            if entry is not None:
                return RecomputedRef(entry, spec.meta, None)
        return None

    # -- backward ----------------------------------------------------------------------------------
    def end_backward(self) -> None:
        """After a backward pass: drop recomputed storages nobody unpacked to the end."""
        alive = []
        for ref in self.entries:
            entry = ref()
            if entry is not None:
                entry.free_cache()
                alive.append(ref)
        self.entries = alive
