"""Differences between torch releases, in one place.

Everything version-dependent that the rest of the package needs goes through here, so the
backends read as plain code and a new torch release means editing one module.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

import torch
import torch.utils.checkpoint
from packaging.version import Version

TORCH_VERSION = Version(torch.__version__.split("+")[0])
MIN_TORCH = Version("2.6")

if TORCH_VERSION < MIN_TORCH:  # pragma: no cover - guarded by setup.cfg too
    raise ImportError(f"cpu_offload needs torch>={MIN_TORCH}, found {torch.__version__}")

try:  # torch >= 2.1
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
except ImportError:  # pragma: no cover

    def is_traceable_wrapper_subclass(t: Any) -> bool:  # type: ignore[misc]
        return hasattr(t, "__tensor_flatten__") and hasattr(type(t), "__tensor_unflatten__")


# What an allocation failure raises: ``torch.OutOfMemoryError`` from torch 2.4, only under
# ``torch.cuda`` before (the same class where both exist).
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

# ``tree_map`` over nested containers, as ``__torch_dispatch__`` implementations use it (a private
# module in every release, same signature from 1.x to 2.14).
from torch.utils._pytree import tree_map  # noqa: E402,F401

# Newer torch releases (2.11 does, 2.6 does not) can report the innermost saved-tensor hooks of
# the current thread; older ones cannot (and calling a hook to find out would run it).
_top_default_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)

_tracing_types: Optional[tuple] = None


def is_tracing_tensor(t: Any) -> bool:
    """True for the stand-ins ``torch.compile`` traces with (FakeTensor, FunctionalTensor, and
    before torch 2.2 plain-typed C++ functional wrappers): they have no data, so saved-tensor
    hooks must leave them alone."""
    global _tracing_types
    if _tracing_types is None:
        found = []
        try:
            from torch._subclasses.fake_tensor import FakeTensor

            found.append(FakeTensor)
        except ImportError:  # pragma: no cover
            pass
        try:
            from torch._subclasses.functional_tensor import FunctionalTensor

            found.append(FunctionalTensor)
        except ImportError:  # pragma: no cover
            pass
        _tracing_types = tuple(found)
    return isinstance(t, _tracing_types) or _is_functional_wrapper(t)


def _is_functional_wrapper(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and torch._is_functional_tensor(t)


# Whether a hook pair may be installed and removed with torch's own two calls (what
# ``saved_tensors_hooks.__enter__``/``__exit__`` make), with no object per entry: where torch
# reports the installed hooks itself, so nothing has to record them.
DIRECT_HOOKS = _top_default_hooks is not None
push_saved_tensors_hooks = torch._C._autograd._push_saved_tensors_default_hooks
pop_pushed_saved_tensors_hooks = torch._C._autograd._pop_saved_tensors_default_hooks

if _top_default_hooks is not None:
    # Public since torch 1.10; kept behind a name so V1 and V2 share one entry point. From torch
    # 2.5 on, torch.compile's tracing does not run the installed hooks either.
    saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks
else:  # pragma: no cover - torch releases without _top_saved_tensors_default_hooks
    import threading

    _installed = threading.local()

    # Note [recording every hook pair]: the offload contexts must see whose hooks are innermost
    # (``in_checkpoint_region``: a non-reentrant checkpoint's), and the tests that none of
    # theirs is left. These releases cannot report it, so every ``saved_tensors_hooks`` entered
    # on this thread (torch's checkpoint hooks subclass it) is recorded here. Only these
    # releases are patched; the behaviour of the hooks is unchanged.
    _base_hooks = torch.autograd.graph.saved_tensors_hooks
    _base_enter, _base_exit = _base_hooks.__enter__, _base_hooks.__exit__

    def _recording_enter(self: Any) -> None:
        _base_enter(self)
        stack = getattr(_installed, "stack", None)
        if stack is None:
            stack = _installed.stack = []
        stack.append(getattr(self, "user_hooks", (self.pack_hook, self.unpack_hook)))

    def _recording_exit(self: Any, *args: Any) -> None:
        stack = getattr(_installed, "stack", None)
        if stack:
            stack.pop()
        _base_exit(self, *args)

    _base_hooks.__enter__ = _recording_enter  # type: ignore[method-assign]
    _base_hooks.__exit__ = _recording_exit  # type: ignore[method-assign]

    class _Traced:
        __slots__ = ("t",)

        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    class saved_tensors_hooks(torch.autograd.graph.saved_tensors_hooks):  # type: ignore[no-redef]
        """``torch.autograd.graph.saved_tensors_hooks`` for torch releases that cannot report the
        installed hooks, where torch.compile's tracing (the first call of a compiled function)
        also runs the installed hooks on FakeTensors, which have no data to copy: those pass
        through untouched. ``user_hooks`` is what ``top_saved_tensors_hooks`` reports (see
        Note [recording every hook pair]).
        """

        def __init__(self, pack_hook: Callable, unpack_hook: Callable) -> None:
            def pack(t: torch.Tensor) -> Any:
                return _Traced(t) if is_tracing_tensor(t) else pack_hook(t)

            def unpack(packed: Any) -> torch.Tensor:
                return packed.t if type(packed) is _Traced else unpack_hook(packed)

            super().__init__(pack, unpack)
            self.user_hooks = (pack_hook, unpack_hook)


def top_saved_tensors_hooks() -> Optional[Tuple[Callable, Callable]]:
    """The innermost ``(pack_hook, unpack_hook)`` installed on this thread, or None.

    Newer torch releases answer this themselves; on older ones every
    ``torch.autograd.graph.saved_tensors_hooks`` entered is recorded (Note [recording every hook
    pair]), so it also sees every pair installed through that class (checkpoint's included).
    """
    if _top_default_hooks is not None:
        return _top_default_hooks(False)
    stack = getattr(_installed, "stack", None)
    return stack[-1] if stack else None


def pop_saved_tensors_hooks() -> None:
    """Remove the innermost saved-tensor hook pair of this thread, whoever installed it: for
    test harnesses that clean up after a program that left one behind (the package's own
    contexts always remove theirs).

    Example:

    >>> import torch
    >>> hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    >>> hooks.__enter__()
    >>> pop_saved_tensors_hooks()
    >>> top_saved_tensors_hooks() is None
    True
    """
    torch._C._autograd._pop_saved_tensors_default_hooks()
    if _top_default_hooks is None:  # pragma: no cover - releases where this module records them
        stack = getattr(_installed, "stack", None)
        if stack:
            stack.pop()


_CHECKPOINT_MODULE = "torch.utils.checkpoint"
# torch's own query of the innermost saved-tensor hook pair (``top_saved_tensors_hooks``, one C
# call: hot paths ask it first, since ``in_checkpoint_region`` is False with no hooks at all),
# or None on releases that lack it.
top_default_hooks = _top_default_hooks


def in_checkpoint_region() -> bool:
    """True while the innermost saved-tensor hooks of this thread are those of a non-reentrant
    ``torch.utils.checkpoint`` region (its forward or its recomputation).

    Such a region stores nothing it saves: its pack hook numbers the saved tensors, and its
    recomputation pairs the recomputed tensors with those numbers in order. Hooks installed on
    top of it in forward but not in the recomputation would shift that numbering (wrong
    gradients, or a ``CheckpointError`` when the shapes differ), so the offload contexts install
    none there. Recognized by where the pack hook is defined (the module the hooks of
    ``checkpoint(use_reentrant=False)`` have lived in since torch 2.0); on releases that cannot
    report the installed hooks, the pairs recorded here (Note [recording every hook pair]).

    Example:

    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> seen = []
    >>> def f(t):
    ...     seen.append(in_checkpoint_region())
    ...     return t * t
    >>> _ = checkpoint(f, torch.ones(2, requires_grad=True), use_reentrant=False)
    >>> seen, in_checkpoint_region()
    ([True], False)
    """
    top = _top_default_hooks(False) if _top_default_hooks is not None else (
        top_saved_tensors_hooks())
    return top is not None and getattr(top[0], "__module__", None) == _CHECKPOINT_MODULE


_Parameter = torch.nn.Parameter
_Tensor = torch.Tensor


def is_parameter(t: Any) -> bool:
    """``isinstance(t, nn.Parameter)``, without its Python metaclass check for the common types.

    ``Parameter``'s metaclass answers True for an ``nn.Parameter`` (or subclass) and for any
    tensor with a true ``_is_param`` attribute; the saved-tensor hook asks this for every
    saved tensor and its base, so the two common types are answered directly."""
    cls = type(t)
    if cls is _Tensor:
        return bool(getattr(t, "_is_param", False))
    if cls is _Parameter:
        return True
    return isinstance(t, _Parameter)


def untyped_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage behind ``t`` (``Tensor.untyped_storage`` exists from torch 2.0)."""
    return t.untyped_storage()


def _empty(dtype: torch.dtype, device: torch.device, like: Optional[torch.Tensor]) -> torch.Tensor:
    """A 0-element tensor to ``set_`` onto a storage. ``like.new_empty`` (a plain tensor on
    ``device``) costs half of ``torch.empty(device=...)``; a subclass would return its own type
    through ``__torch_function__``, so anything else goes the long way."""
    if type(like) is _Tensor:
        return like.new_empty(0, dtype=dtype)
    return torch.empty(0, dtype=dtype, device=device)


def tensor_on_storage(
    storage: torch.UntypedStorage,
    dtype: torch.dtype,
    device: torch.device,
    size: torch.Size,
    stride: tuple,
    storage_offset: int,
    like: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """A tensor viewing ``storage`` with exactly the given geometry (any strides, any offset).
    ``like``: a tensor on ``device`` the caller has at hand (faster, see ``_empty``)."""
    return _empty(dtype, device, like).set_(storage, storage_offset, size, stride)


def bytes_on_storage(storage: torch.UntypedStorage,
                     like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A flat ``uint8`` tensor over all of ``storage``, which lives on ``like``'s device
    (``set_`` with a storage alone views all of it, contiguously, from offset 0). Without
    ``like``, the storage's own device."""
    if like is None:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    return _empty(torch.uint8, None if type(like) is _Tensor else like.device, like).set_(storage)


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` once the backward pass that is executing now has finished.

    Only valid while the autograd engine runs (e.g. from a grad_fn pre-hook).
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def optimizer_hooks(opt: torch.optim.Optimizer, kind: str) -> list:
    """The hooks ``opt.register_<kind>_hook`` registered (``kind``: ``state_dict_pre``,
    ``state_dict_post``, ``load_state_dict_pre``, ``load_state_dict_post``), in order: an
    optimizer overriding ``state_dict``/``load_state_dict`` runs them itself."""
    return list(getattr(opt, f"_optimizer_{kind}_hooks").values())


def register_forward_hook_always(module: torch.nn.Module, hook: Callable) -> Any:
    """Forward hook that also runs when forward raises (``always_call`` exists from torch 2.1)."""
    return module.register_forward_hook(hook, always_call=True)


def in_backward() -> bool:
    """True while the calling thread executes a backward pass (an autograd graph task): a
    forward running now is a recomputation (activation checkpointing), not a new step."""
    return graph_task_id() != -1


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_counter() -> Optional[Callable[[int], int]]:
    """torch's use count of a storage by its ``_cdata`` (references to it: tensors and its Python
    object), or None where torch lacks it."""
    return _storage_use_count


def storage_use_count(t: torch.Tensor) -> int:
    """How many references hold the storage behind ``t`` (tensors, storage objects), or 0 where
    torch cannot say. Used to tell whether dropping our reference would free any memory."""
    count = _storage_use_count
    if count is None:  # pragma: no cover
        return 0
    storage = t.untyped_storage()
    return count(storage._cdata) - 1  # not counting the storage object made for the question


_unsafe_set_version_counter = torch._C._autograd._unsafe_set_version_counter  # looked up once


def set_versions(tensors: list, versions: list) -> None:
    """Put each tensor's version counter (shared with every alias) back to its version: one
    call where torch takes lists (>= 2.5)."""
    try:
        _unsafe_set_version_counter(tuple(tensors), tuple(versions))
    except TypeError:  # torch < 2.5 takes one tensor and one int
        for t, version in zip(tensors, versions):
            _unsafe_set_version_counter(t, version)


def copy_view_bits(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Give ``dst`` the lazy conjugate / negative bits of ``src`` (complex views keep them as
    flags, not in the data, so a byte copy alone loses them)."""
    if src.is_conj():
        torch._C._set_conj(dst, True)
    if src.is_neg():
        torch._C._set_neg(dst, True)
    return dst


_current_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)

# ``graph_task_id`` without the Python call, for code that runs once per layer.
current_graph_task_id: Callable[[], int] = _current_graph_task_id or (lambda: -1)


def graph_task_id() -> int:
    """An id of the backward pass running on this thread (-1 outside backward), so that a pass
    that ended in an exception, whose end-of-backward callback never ran, is told from the next.
    (Looked up once: it runs on every layer entry and sync.)"""
    get = _current_graph_task_id
    return get() if get is not None else -1


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles
    (``torch.cuda._sleep``, in every supported release): tests stand it in for device work
    that is still running, such as FSDP2's later reduce-scatters."""
    torch.cuda._sleep(cycles)


def cuda_allocated_bytes(device: Any = None) -> int:
    """``torch.cuda.memory_allocated(device)`` without its garbage: that function builds a
    recursive closure (a reference cycle) on every call, which would mask cycles made elsewhere."""
    index = None
    if device is not None:
        index = device if isinstance(device, int) else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return torch._C._cuda_memoryStats(index)["allocated_bytes"]["all"]["current"]


def make_wrapper_subclass(cls: type, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The outer tensor of a wrapper subclass (``__torch_dispatch__`` style) with ``like``'s shape,
    strides and device and the given dtype, as ``Tensor._make_wrapper_subclass`` builds it."""
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), dtype=dtype, device=like.device
    )


def fully_shard() -> Optional[Callable]:
    """FSDP2's ``fully_shard``: ``torch.distributed.fsdp`` from torch 2.6, under
    ``torch.distributed._composable.fsdp`` in 2.4-2.5, absent before (None)."""
    try:
        from torch.distributed.fsdp import fully_shard as fn  # type: ignore[attr-defined]

        return fn
    except ImportError:
        pass
    try:
        from torch.distributed._composable.fsdp import fully_shard as fn

        return fn
    except ImportError:
        return None


def pipelining() -> Any:
    """``torch.distributed.pipelining`` (PipelineStage, ScheduleGPipe, Schedule1F1B), torch >= 2.4;
    None before."""
    try:
        import torch.distributed.pipelining as pp

        return pp
    except ImportError:
        return None


def functional_collectives() -> Any:
    """``torch.distributed._functional_collectives`` (the collectives that return an
    ``AsyncCollectiveTensor``; a private module in every release), or None."""
    try:
        import torch.distributed._functional_collectives as funcol

        return funcol
    except ImportError:
        return None


def compile_supported() -> bool:
    """Whether ``torch.compile`` works here (TorchDynamo supports this Python and platform)."""
    try:
        from torch._dynamo.eval_frame import is_dynamo_supported
    except ImportError:  # pragma: no cover
        return False
    try:
        return bool(is_dynamo_supported())
    except Exception:  # pragma: no cover - raises instead of answering in some releases
        return False


def reset_compiled() -> None:
    """Forget every ``torch.compile`` result (``torch._dynamo.reset``), e.g. between tests."""
    import torch._dynamo

    torch._dynamo.reset()


def compiler_disable(fn: Callable) -> Callable:
    """Keep ``fn`` out of torch.compile's traced graphs: it runs eagerly, between graphs (the
    offload context and sync function change Python state that a graph cannot replay).

    ``torch._disable_dynamo`` is what torch itself uses for this: it imports ``torch._dynamo``
    (about 2 s) only when ``fn`` is first called, not when ``cpu_offload`` is imported, and its
    wrapper lives in torch's own files, which dynamo never traces.
    """
    lazy = getattr(torch, "_disable_dynamo", None)
    if lazy is not None:
        return lazy(fn)
    return torch.compiler.disable(fn)  # pragma: no cover - torch without _disable_dynamo


def never_compiled(*fns: Callable) -> bool:
    """Mark the code of ``fns`` (saved-tensor hooks: autograd calls them, also from eager code
    that torch.compile runs between its graphs) so that TorchDynamo never compiles their frames
    or the frames they call: its frame strategy "skip this frame and the frames it calls"
    (``set_code_exec_strategy``, torch >= 2.7). Marking costs nothing when they run. False where
    torch cannot mark code: then Dynamo may trace them, and they must stay traceable."""
    try:
        from torch._C._dynamo import eval_frame
    except ImportError:  # pragma: no cover - torch built without dynamo
        return False
    cls = getattr(eval_frame, "_FrameExecStrategy", None)
    action = getattr(eval_frame, "_FrameAction", None)
    if cls is None or action is None or not hasattr(eval_frame, "set_code_exec_strategy"):
        return False  # pragma: no cover - torch < 2.7
    strategy = cls(action.SKIP, action.SKIP)
    for fn in fns:
        eval_frame.set_code_exec_strategy(fn.__code__, strategy)
    return True


def eager_between_graphs(fn: Callable) -> Callable:
    """``compiler_disable`` without its wrapper where torch can mark code (torch >= 2.7): a
    function called once per layer pays the wrapper's ten calls on every call, eager or not.

    The same two effects, from two marks on ``fn`` itself: ``_torchdynamo_disable`` (what the
    wrapper carries) makes Dynamo end its graph at a call to ``fn`` instead of tracing into it,
    and ``never_compiled`` makes it run ``fn``'s frame, and the frames it calls, as they are.
    Below torch 2.7 it is ``compiler_disable(fn)``.
    """
    if not never_compiled(fn):
        return compiler_disable(fn)  # pragma: no cover - torch < 2.7
    fn._torchdynamo_disable = True  # type: ignore[attr-defined]
    fn._torchdynamo_disable_msg = (  # type: ignore[attr-defined]
        "cpu_offload's context and sync function run eagerly, between graphs")
    return fn


def compiled_by_dynamo(fn: Callable) -> bool:
    """Whether torch.compile holds compiled code for ``fn``'s frames (tests: nothing of the
    package is compiled when a model that uses it is)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return bool(_debug_get_cache_entry_list(fn.__code__))


def neg_view(t: torch.Tensor) -> torch.Tensor:
    """A view of ``t`` with the lazy negation bit set (``torch._neg_view``), for tests."""
    return torch._neg_view(t)


# ``TorchDispatchMode``: the hook below autograd that sees every aten op (selective
# recomputation records with it). A private module in every release, same interface 2.0-2.14.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402,F401


def functional_overloads(names: Any) -> frozenset:
    """The aten ``OpOverload``s of the packets named ``names`` that neither mutate their inputs
    nor write into an ``out=`` tensor (names this torch release lacks are skipped)."""
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            if not schema.is_mutable and not any(a.is_out for a in schema.arguments):
                found.append(op)
    return frozenset(found)


def global_module_hooks(pre: Callable, post: Callable) -> list:
    """Forward pre-hook and forward hook on every ``nn.Module`` call (removable handles); the
    forward hook also runs when the forward raises, so the two always pair up."""
    from torch.nn.modules import module

    return [
        module.register_module_forward_pre_hook(pre),
        module.register_module_forward_hook(post, always_call=True),
    ]


def autocast_off(device_type: str) -> Any:
    """A context that runs aten ops exactly as called (no autocast casts) on ``device_type``;
    a null context when autocast is not enabled there."""
    import contextlib

    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # pragma: no cover - releases without the device argument
        enabled = torch.is_autocast_enabled()
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile(module)``'s wrapper or was compiled in place
    (``module.compile()``)."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    return type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod")


def current_dispatch_mode() -> Any:
    """The innermost ``TorchDispatchMode`` active on this thread, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode()


# Selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``):
# the forward context's cache, ``{op key: outputs per call index}`` (a list of trees of version
# wrappers, or a dict by index, depending on the release);
# in eager mode an op's key is the op itself. ``CheckpointPolicy.MUST_CPU_OFFLOAD`` and
# ``PREFER_CPU_OFFLOAD`` exist in recent releases (2.11 has them); None where absent.
def sac_cache(forward_context: Any) -> dict:
    """The cache of the forward context that ``create_selective_checkpoint_contexts`` made."""
    return forward_context.storage


# torch 2.15 added ``checkpoint(..., respect_saved_tensors_hooks=None|False|True)``: whether the
# tensors selective activation checkpointing (SAC) caches outside the autograd graph go through
# the saved-tensor hooks around the checkpoint (an offloader's). ``None`` keeps the old behaviour
# (they bypass the hooks) and warns (``FutureWarning``) where such hooks are in scope; torch plans
# an error for ``None`` next, then ``True`` as the default. Releases before 2.15 lack the
# argument and behave as ``False``. torch sets the choice only on its own SAC forward mode
# (``_CachingTorchDispatchMode``), as an attribute, after ``context_fn`` made it.
SAC_HOOKS_ARG = "respect_saved_tensors_hooks"
CHECKPOINT_HAS_SAC_HOOKS_ARG = (
    SAC_HOOKS_ARG in inspect.signature(torch.utils.checkpoint.checkpoint).parameters)


def checkpoint_sac_hooks_kwargs(respect: bool) -> dict:
    """The keyword that chooses ``respect`` explicitly for ``torch.utils.checkpoint.checkpoint``
    where torch has it (``{}`` before torch 2.15, whose behaviour is ``False``)."""
    return {SAC_HOOKS_ARG: respect} if CHECKPOINT_HAS_SAC_HOOKS_ARG else {}


def set_sac_respects_hooks(forward_context: Any, respect: bool) -> None:
    """Choose ``respect`` on torch's SAC forward context itself: what ``checkpoint`` does with
    its argument, for a context that wraps torch's (``checkpoint`` sets it only on torch's own
    class). Nothing before torch 2.15."""
    if CHECKPOINT_HAS_SAC_HOOKS_ARG:
        setattr(forward_context, SAC_HOOKS_ARG, respect)


def cpu_offload_policies() -> frozenset:
    """The ``CheckpointPolicy`` members that mean "save, offloaded to the CPU" (empty before
    torch added them)."""
    policy = getattr(torch.utils.checkpoint, "CheckpointPolicy", None)
    names = ("MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD")
    return frozenset(getattr(policy, n) for n in names if policy is not None and hasattr(policy, n))


def amp_unscale_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """``GradScaler.unscale_``'s kernel (``torch._amp_foreach_non_finite_check_and_unscale_``):
    ``grads`` (one device and dtype) multiplied by ``inv_scale`` in place, ``found_inf`` set if
    any is not finite. The optimizer offload applies it to optimizers that do not take the
    scale themselves, exactly as ``GradScaler`` would."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# --- DTensor parameters and FSDP2 (``HybridDeviceOptimizer`` over sharded parameters) ---------
#
# How FSDP2 hands over sharded gradients (torch 2.13 ``distributed/fsdp/_fully_shard``): after a
# group's backward, ``FSDPParamGroup.post_backward`` (``_fsdp_param_group.py``) calls
# ``foreach_reduce`` (``_fsdp_collectives.py``), which reduce-scatters the group's gradients on the
# reduce-scatter stream (HSDP: then all-reduces them on the all-reduce stream) and, under
# ``with device_handle.stream(post_reduce_stream)``, sets each sharded parameter's ``.grad`` (a
# DTensor over a view of the reduce-scatter output, or adds into the one there) and then runs
# the ``register_post_accumulate_grad_hook`` hooks of that sharded parameter itself (autograd
# never reaches the sharded parameters). So the hook sees the final, reduced shard, and the
# current stream inside it is the stream that wrote it. Every release this package supports
# (2.6 and later) does this (pytorch#129450, since torch 2.5); some releases skip the loop under
# compiled autograd. No hook runs for a backward without gradient sync
# (``set_requires_gradient_sync(False)``, or HSDP without ``set_requires_all_reduce``).


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (where that module was never
    imported, nothing is one: no import here)."""
    import sys

    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank: the very tensor object it holds (``_local_tensor``, in
    every release). Not ``to_local()``: with autograd enabled that returns a new view each call,
    and from torch 2.13 also without it for an ``nn.Parameter`` (pytorch#166156); the
    optimizer recognises a gradient by its identity."""
    return t._local_tensor


def dtensor_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor over ``local`` (this rank's shard, ``like``'s local shape, any dtype and
    device) laid out as the DTensor ``like``: same mesh, placements and global shape, the dtype
    of ``local``. ``local`` is used as it is, not moved: ``DTensor.from_local`` copies it to the
    mesh's device type (an offloaded optimizer state would land on the GPU); FSDP2 builds its
    DTensors this way (``_fsdp_common._from_local_no_grad``), which also keeps CPU shards of a
    CUDA mesh where they are (its ``CPUOffloadPolicy``)."""
    import dataclasses

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    meta = TensorMeta(like.shape, like.stride(), local.dtype)
    spec = dataclasses.replace(like._spec, tensor_meta=meta)
    return DTensor(at_offset_zero(local), spec, requires_grad=False)


def at_offset_zero(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or, where it starts inside its storage, a tensor over the same memory (a
    storage sliced from ``t``'s, which keeps it alive) that starts at offset 0. A DTensor takes
    its local tensor's storage offset (2.13 to 2.15 at least), and one with a nonzero offset can
    be neither deep-copied nor ``torch.save``'d ("invalid python storage"; FSDP2's own gradients
    too): the optimizer's state tensors are views into larger pinned buffers."""
    if t.storage_offset() == 0 or t.numel() == 0:
        return t
    size = t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    start = t.storage_offset() * size
    storage = t.untyped_storage()[start: start + span * size]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def dtensor_layout(t: torch.Tensor) -> tuple:
    """``(mesh, placements, global shape)`` of a DTensor: what must match for its local shard
    to be another DTensor's."""
    return (t.device_mesh, tuple(t.placements), tuple(t.shape))


def fsdp_module_class() -> Optional[type]:
    """``FSDPModule`` (the class ``fully_shard`` gives a module; under
    ``torch.distributed._composable.fsdp`` in 2.4-2.5), or None without FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule
    except ImportError:  # pragma: no cover - FSDP2 is in every supported release
        return None


def fsdp_offloads_to_cpu(module: torch.nn.Module) -> bool:
    """Whether ``fully_shard(module, offload_policy=CPUOffloadPolicy())`` keeps ``module``'s
    own sharded parameters on the CPU (``FSDPParam.offload_to_cpu`` of the state's param groups:
    ``_fsdp_param_groups`` in newer releases, ``_fsdp_param_group`` in older ones). False where
    this torch keeps it elsewhere."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return False
    state = get_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return any(getattr(fp, "offload_to_cpu", False) for g in groups for fp in getattr(g, "fsdp_params", ()))
