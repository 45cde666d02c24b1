"""torch's checkpoint offload policies, honoured: ``create_selective_checkpoint_contexts``, a
drop-in for torch's, under which an op whose policy says ``CheckpointPolicy.MUST_CPU_OFFLOAD`` or
``PREFER_CPU_OFFLOAD`` is saved (not recomputed) and its output moved to pinned CPU memory by the
V2 engine of the offload context around the checkpoint, as any saved activation of that layer:
copied out on the side stream, released and reloaded on the layer's schedule, counted in its
statistics. torch itself, in eager mode, recomputes such ops.

How: the policy is passed to torch's own contexts with offload answers turned into
``MUST_SAVE``; when the checkpointed forward ends, the outputs torch cached for those ops are
handed to the engine (``OffloadSynchronizer.push``) and their cache entries replaced by ones that
unpack the engine's copy when the recomputation asks for them.

Note [SAC-cached tensors and the offload hooks]: torch 2.15 lets ``checkpoint`` route the
tensors SAC caches (``MUST_SAVE``/``PREFER_SAVE`` outputs) through the saved-tensor hooks around
it (``respect_saved_tensors_hooks=True``), ours included, or not (``False``, what every earlier
release does; ``None`` warns). The package chooses ``False`` (``SAC_RESPECTS_OFFLOAD_HOOKS``),
for its own checkpoints and inside these contexts, because:

- a policy keeps its per-op meaning: ``MUST_SAVE`` keeps the output on the device and
  ``MUST_CPU_OFFLOAD`` moves it, on every torch release tox tests; with ``True`` an offloaded
  layer would move ``MUST_SAVE`` outputs too, and a user could no longer keep one there;
- these contexts hand the ``MUST_CPU_OFFLOAD`` outputs to the engine themselves; with ``True``
  torch would pack them first, and the forward context would unpack them while the forward
  runs (the engine counts that as a backward use) to pack them again.

Both values give bit-identical gradients and free what they move
(``tests/v2/test_sac_saved_tensors_hooks.py`` runs both on torch >= 2.15).
"""
from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Callable, Union

import torch
from torch.utils.checkpoint import CheckpointPolicy
from torch.utils.checkpoint import create_selective_checkpoint_contexts as torch_contexts
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..compat import cpu_offload_policies, sac_cache, set_sac_respects_hooks
from .context import active_synchronizer
from .layer_state import unpack

__all__ = ["SAC_RESPECTS_OFFLOAD_HOOKS", "create_selective_checkpoint_contexts"]

# ``respect_saved_tensors_hooks`` of every checkpoint the package makes and of the contexts
# below: see Note [SAC-cached tensors and the offload hooks].
SAC_RESPECTS_OFFLOAD_HOOKS = False


class OffloadedEntry:
    """A cache entry whose value the offload engine holds; ``get_val`` (what the recomputation
    calls on each cached leaf) reloads it."""

    def __init__(self, packed: Any) -> None:
        self.packed = packed

    def get_val(self, allow_cache_entry_mutation: bool = False) -> torch.Tensor:
        return unpack(self.packed)


class _ForwardContext:
    """torch's forward context, then: cache entries of offloaded ops swapped for the engine's."""

    def __init__(self, inner: Any, offloaded: set, sync: Any, allow_cache_entry_mutation: bool) -> None:
        self.inner = inner
        # torch's checkpoint passes its respect_saved_tensors_hooks only to its own class, not
        # through this wrapper: the choice is made here (see the Note in the module docstring)
        set_sac_respects_hooks(inner, SAC_RESPECTS_OFFLOAD_HOOKS)
        # {(op key, call index, index among the op's saved calls)} whose policy said CPU offload
        self.offloaded = offloaded
        self.sync = sync
        self.allow_cache_entry_mutation = allow_cache_entry_mutation

    def __enter__(self) -> Any:
        return self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        out = self.inner.__exit__(*exc)
        cache = sac_cache(self.inner)
        if exc[0] is None:
            for key, call, saved in sorted(self.offloaded, key=lambda k: k[1]):
                # Per op, a dict by call index on some releases; on others a list of the saved
                # calls only, in order.
                calls = cache.get(key)
                index = call if isinstance(calls, dict) else saved
                if calls is not None and (index in calls if isinstance(calls, dict)
                                          else index < len(calls)):
                    calls[index] = self._offload(calls[index])
        self.offloaded.clear()
        return out

    def _offload(self, entry: Any) -> Any:
        """The cached outputs of one op, handed to the engine: each tensor leaf (a version
        wrapper whose ``get_val`` runs torch's check that it was not mutated inside the region)
        becomes an entry that reloads the engine's copy. Done as the checkpointed forward ends,
        still inside the layer's offload context: the op's output is only there (the policy is
        asked before the op runs on some torch releases)."""
        leaves, spec = tree_flatten(entry)
        out = []
        for leaf in leaves:
            get_val = getattr(leaf, "get_val", None)
            val = get_val(self.allow_cache_entry_mutation) if get_val is not None else None
            out.append(OffloadedEntry(self.sync.push(val.detach()))
                       if isinstance(val, torch.Tensor) else leaf)
        return tree_unflatten(out, spec)


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Union[Callable, list], allow_cache_entry_mutation: bool = False
) -> tuple:
    """``torch.utils.checkpoint.create_selective_checkpoint_contexts`` whose
    ``CheckpointPolicy.MUST_CPU_OFFLOAD`` / ``PREFER_CPU_OFFLOAD`` mean what torch documents:
    the op's output is saved, offloaded to CPU and reloaded for backward, instead of recomputed.

    Pass it as ``context_fn`` of a non-reentrant ``torch.utils.checkpoint.checkpoint`` that runs
    inside cpu_offload's V2 offload context (a layer of ``apply_offloading``, or ``with ctx:`` of
    ``get_cpu_offload_context``). The outputs go through that engine like the layer's other
    saved activations: offloaded when the layer is one of the offloaded layers and the tensor
    passes the selection (``min_tensor_size_to_offload``, marks), kept on the device otherwise;
    counted in ``stats()``. Outside such a context it warns once and does what torch does
    (recomputes; Python shows the warning once), and returns torch's own contexts, which take
    ``checkpoint``'s ``respect_saved_tensors_hooks``. Other policies, and a list of ops to save,
    behave exactly as with torch's: inside an offload context, ``MUST_SAVE`` outputs stay on the
    device whatever ``checkpoint`` is passed (``respect_saved_tensors_hooks=False``, chosen by
    these contexts, see the module's Note); answer ``MUST_CPU_OFFLOAD`` to move one.
    Gradients are bit-identical to torch's recomputation. Eager mode only (under
    ``torch.compile`` the partitioner decides).

    Args:
        policy_fn_or_list: as torch's: ``policy_fn(ctx, op, *args, **kwargs) ->
            CheckpointPolicy`` (or a bool), or a list of ops to save.
        allow_cache_entry_mutation: as torch's (for the ops saved on the device).

    Returns:
        ``(forward_context, recompute_context)``, as torch's.

    Example::

        >>> import functools, torch, cpu_offload
        >>> from torch.utils.checkpoint import CheckpointPolicy, checkpoint
        >>> def policy(ctx, op, *args, **kwargs):   # keep matmul outputs, on the CPU
        ...     if op is torch.ops.aten.mm.default:
        ...         return CheckpointPolicy.MUST_CPU_OFFLOAD
        ...     return CheckpointPolicy.PREFER_RECOMPUTE
        >>> context_fn = functools.partial(cpu_offload.create_selective_checkpoint_contexts, policy)
        >>> layers = torch.nn.ModuleList(torch.nn.Linear(64, 64, bias=False) for _ in range(3))
        >>> sim = cpu_offload.SimulatedDevice()    # on a GPU: leave out device=
        >>> ctx, sync = cpu_offload.get_cpu_offload_context(
        ...     enabled=True, num_layers=1, model_layers=3, min_tensor_size_to_offload=1, device=sim)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> for layer in layers:
        ...     with ctx:
        ...         x = checkpoint(lambda h: torch.tanh(layer(h)), x, use_reentrant=False,
        ...                        context_fn=context_fn)
        ...     x = sync(x)
        >>> x.sum().backward()
        >>> ctx.stats().to_dict()["layers"][0]["copied_out_bytes"]   # input + mm output
        4096
    """
    offload = cpu_offload_policies()
    sync = active_synchronizer()
    if callable(policy_fn_or_list) and offload:
        policy_fn = policy_fn_or_list
        counts: dict = defaultdict(int)
        saved: dict = defaultdict(int)  # per op, the calls torch caches (see _ForwardContext)
        offloaded: set = set()
        keep = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE, True)

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            index = counts[op]
            counts[op] += 1
            answer = policy_fn(ctx, op, *args, **kwargs)
            if answer in offload:
                if sync is None:
                    warn_outside()
                    answer = CheckpointPolicy.PREFER_RECOMPUTE  # what torch does in eager mode
                else:
                    offloaded.add((op, index, saved[op]))
                    answer = CheckpointPolicy.MUST_SAVE
            if answer in keep:
                saved[op] += 1
            return answer

        forward, recompute = torch_contexts(policy, allow_cache_entry_mutation)
        if sync is None:  # nothing to hand over: torch's contexts, which checkpoint configures
            return forward, recompute
        return _ForwardContext(forward, offloaded, sync, allow_cache_entry_mutation), recompute
    return torch_contexts(policy_fn_or_list, allow_cache_entry_mutation)


def warn_outside() -> None:
    """Python's default warning filter shows it once per place in a program."""
    warnings.warn(
        "cpu_offload.create_selective_checkpoint_contexts: a policy asked for CPU offload "
        "outside cpu_offload's offload context, so the op is recomputed (as torch does); "
        "run the checkpoint inside apply_offloading's layers or `with ctx:` of "
        "get_cpu_offload_context",
        stacklevel=3,
    )
