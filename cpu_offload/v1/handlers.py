"""Offload handlers: the interface, and the synchronous handler that also owns the step bookkeeping
shared with the asynchronous one (``async_handler.py``).

A *step* is one forward (groups counted up by the group commits) and its backward (counted back
down). Its state lives in the handler only while the step is open: it is dropped when backward
reaches group 0, at the end of any backward pass (an engine callback, for partial backwards), when
the context sees a new forward start over a finished one, and when an exception leaves the
context. The saved tensors themselves are owned by the autograd graph (``saved.py``), so dropping
handler state never loses data; it only stops scheduling it.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch

from ..core import markers
from ..compat import queue_backward_callback, untyped_storage
from ..core.device import OffloadDevice, default_device
from ..core.errors import OffloadUsageError, stacklevel_outside_package
from ..core.storage import storage_key
from .saved import PackedTensor, StorageRecord, pack_tensor

Checker = Callable[[torch.Tensor], bool]


class OffloadHandler:
    """How saved tensors are stored (``tensor_push``) and retrieved (``tensor_pop``).

    The hooks below are extensions over Transformer Engine's interface, with no-op defaults so
    that handlers written against the original interface keep working.
    """

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "`tensor_push` is not implemented in OffloadHandler class. Inherit this class and "
            "implement your custom tensor_push."
        )

    def tensor_pop(self, tensor_tag: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(
            "`tensor_pop` is not implemented in OffloadHandler class. Inherit this class and "
            "implement your custom tensor_pop."
        )

    def on_context_enter(self) -> None:
        """Called when the offload context is entered (before its hooks are installed); may
        refuse the entry by raising."""

    def on_context_exit(self) -> None:
        """Called when the offload context is left normally."""

    def on_group_commit_skipped(self) -> None:
        """Called instead of a commit when no backward can follow it (no grad mode)."""

    def on_context_error(self) -> None:
        """Called when an exception leaves the offload context (after its hooks are removed)."""

    def group_commit_token(self) -> Any:
        """Identifies the step a group commit belongs to (kept in the commit's autograd ctx)."""
        return None

    def accept_group_commit_backward(self, token: Any) -> bool:
        """Whether a commit's backward should move the schedule (False for stale steps)."""
        return True


class SynchronizedGroupOffloadHandler(OffloadHandler):
    """Offloads each selected tensor on the compute stream as it is saved, reloads it on demand.

    Tags are ``(group, index in group)``; groups below ``num_offload_group`` are offloaded.
    """

    def __init__(
        self,
        num_offload_group: int,
        tensor_need_offloading_checker: Checker = (lambda _: True),
        debug: bool = False,
        *,
        device: Optional[OffloadDevice] = None,
    ) -> None:
        super().__init__()
        self.num_offload_group = num_offload_group
        self.tensor_need_offloading_checker = tensor_need_offloading_checker
        self.debug = debug
        self.device = device if device is not None else default_device()
        self.step = 0
        self._phase = "idle"  # "idle" | "forward" | "backward"
        self._awaiting_commit = False  # a layer ran in the context; its output is not synced yet
        self._refused = False  # an entry was refused for a missing sync
        self._seen = self._selected = 0  # saved tensors in offloaded groups, and tagged ones
        self._warned_empty = False
        self._groups: Dict[int, Dict[int, StorageRecord]] = {}
        # Records reloaded this step, weakly (the handler forgets their groups at the reload,
        # and a dropped graph frees them at once): an abandoned step lets go of their device
        # copies (``_abort_step``).
        self._reloaded: List[weakref.ref] = []
        # The newest committed layer output's graph, weakly (see ``_step_abandoned``).
        self._last_output: Optional[weakref.ref] = None
        self.groupid_reset()

    # -- step bookkeeping ---------------------------------------------------------------------
    def groupid_reset(self) -> None:
        self.current_group, self.tensor_count_current_group = 0, 0
        self.torch_tensor_count = 0

    def _finish_step(self) -> None:
        """Forget the step: the graph owns its tensors from here on."""
        if self._seen and not self._selected and not self._warned_empty:
            self._warned_empty = True
            warnings.warn(
                f"cpu_offload (V1): a step saved {self._seen} tensors in offloaded layers but "
                "none is tagged, so nothing was offloaded. V1 offloads only tensors tagged with "
                "cpu_offload.mark_activation_offload; tag them, or unset NVTE_CPU_OFFLOAD_V1 to "
                "use V2's automatic detection (this warning is given once per context)",
                UserWarning,
                stacklevel=stacklevel_outside_package(),
            )
        self._seen = self._selected = 0
        for records in self._groups.values():
            for record in records.values():
                record.drop_force_clear(clear=False)  # never hold user tensors past the step
        self._groups.clear()
        self._reloaded = []
        self._last_output = None
        self.groupid_reset()
        self.step += 1
        self._phase = "idle"
        self._awaiting_commit = False
        self._refused = False

    def _fence(self) -> None:
        """Make compute wait for all side-stream copies (none here: copies run on compute)."""

    def _abort_step(self) -> None:
        self._fence()
        for ref in self._reloaded:  # their graph may outlive the step: no device copy held
            record = ref()
            if record is not None:
                record.drop_reload()
        self._finish_step()

    def on_context_enter(self) -> None:
        if self._awaiting_commit:
            if self._refused:
                # Refused once already, and the sync function was not called since: the caller
                # started the forward pass over, so the step starts clean.
                self._abort_step()
                return
            self._refused = True
            raise OffloadUsageError(
                "the offload context was entered again before the sync function was called on "
                "the previous layer's output; after each `with ctx:` block call `x = sync(x)` "
                "(the second value returned by get_cpu_offload_context)"
            )
        if torch.is_grad_enabled() and self._step_abandoned():
            self._abort_step()  # this entry starts a fresh step, counted from group 0

    def _step_abandoned(self) -> bool:
        """Whether the open step was left half-way by an exception: a backward that raised (its
        end-of-backward callback never ran), or a forward whose graph is gone (an exception
        between layers). Without this, the next forward would continue the old step's group
        count and offload the wrong layers."""
        if self._phase == "backward":
            return True
        last = self._last_output
        return self._phase == "forward" and last is not None and last() is None

    def note_group_output(self, tensor: torch.Tensor) -> None:
        """Called by the sync function with a layer's output: remember its graph weakly, through
        a no-op pre-hook its ``grad_fn`` keeps alive (as long as any of that graph is)."""
        node = tensor.grad_fn
        if node is not None:
            marker = _GraphMarker()
            node.register_prehook(marker)
            self._last_output = weakref.ref(marker)

    def on_context_exit(self) -> None:
        # Without grad nothing was saved and no backward will come: evaluation loops need not
        # call the sync function (as in V2).
        self._awaiting_commit = torch.is_grad_enabled()

    def on_group_commit_skipped(self) -> None:
        self._awaiting_commit = self._refused = False

    def on_context_error(self) -> None:
        self._abort_step()

    def group_commit_token(self) -> Any:
        return self.step

    def accept_group_commit_backward(self, token: Any) -> bool:
        if token != self.step or self.current_group <= 0:
            return False  # a retained graph's second backward, or a graph of an earlier step
        if self._phase != "backward":
            self._phase = "backward"
            queue_backward_callback(self._end_of_backward)
        return True

    def _end_of_backward(self) -> None:
        """A backward pass ended; if it did not reach group 0 (partial backward), close the step."""
        if self._phase == "backward":
            self._abort_step()

    def live_records(self) -> int:
        """Storage records the handler still references (0 between steps); for tests."""
        return sum(len(r) for r in self._groups.values())

    # -- push / pop ---------------------------------------------------------------------------
    def _offloadable(self, t: torch.Tensor) -> bool:
        return (
            type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.layout == torch.strided
            and self.device.is_device_tensor(t)
            and bool(self.tensor_need_offloading_checker(t))
            and not markers.is_marked_not_offload(t)
            and untyped_storage(t).nbytes() > 0
        )

    def _record_for(self, t: torch.Tensor) -> Optional[StorageRecord]:
        if not self._offloadable(t):
            return None
        records = self._groups.setdefault(self.current_group, {})
        key = storage_key(t)
        record = records.get(key)
        if record is None:
            self._selected += 1
            record = records[key] = StorageRecord(self.device, t)
            self._on_new_record(record)
        return record

    def _on_new_record(self, record: StorageRecord) -> None:
        """Synchronous offload: copy now, on the compute stream, in order with the producers."""
        record.start_offload(self.device.current_stream())

    def tensor_push(self, tensor: torch.Tensor, **kwargs: Any) -> PackedTensor:
        if self._phase == "idle":
            self._phase = "forward"
        packed = PackedTensor((self.current_group, self.tensor_count_current_group))
        self.tensor_count_current_group += 1
        offload = (
            self.current_group < self.num_offload_group and not markers.module_opt_out_active()
        )
        self._seen += offload
        packed.entry = pack_tensor(tensor, packed, self._record_for if offload else _keep)
        return packed

    def tensor_pop(self, tensor_tag: PackedTensor, **kwargs: Any) -> torch.Tensor:
        return tensor_tag.entry.unpack()  # type: ignore[union-attr]

    # -- group commits ------------------------------------------------------------------------
    def on_group_commit_forward(self) -> None:
        # The storages of this group are copied; stop holding their device memory (it was held
        # only so that a freed-and-reused address cannot be mistaken for a saved storage).
        for record in self._groups.pop(self.current_group, {}).values():
            record.release_device()
        self._phase = "forward"
        self._awaiting_commit = self._refused = False
        self.current_group += 1
        self.tensor_count_current_group = 0

    def on_group_commit_backward(self) -> None:
        self.current_group -= 1
        assert self.current_group >= 0
        if self.current_group == 0:
            self._finish_step()


def _keep(_: torch.Tensor) -> None:
    return None


class _GraphMarker:
    """A no-op backward pre-hook; alive exactly as long as the node it is registered on."""

    __slots__ = ("__weakref__",)

    def __call__(self, grad_outputs: Any) -> None:
        return None
