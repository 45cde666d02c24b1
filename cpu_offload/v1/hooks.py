"""The context managers that install V1's saved-tensor hooks around a layer's forward.

They use the public ``torch.autograd.graph.saved_tensors_hooks`` (through ``compat``) rather than
Transformer Engine's private push/pop, and always remove exactly the hooks they installed, also
when the layer raises.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..compat import in_backward, in_checkpoint_region, saved_tensors_hooks
from . import state
from .handlers import OffloadHandler


class CpuOffloadSavedTensorHook:
    """Installs ``on_save_for_backward`` / ``on_get_saved_tensor`` as saved-tensor hooks while
    entered, and makes ``is_cpu_offload_enabled()`` true."""

    def __init__(self) -> None:
        self.inside_context = False
        self._installed: List[Any] = []

    def __enter__(self) -> "CpuOffloadSavedTensorHook":
        hooks = saved_tensors_hooks(self.on_save_for_backward, self.on_get_saved_tensor)
        hooks.__enter__()
        self._installed.append(hooks)
        state.push_enabled()
        self.inside_context = True
        return self

    def __exit__(self, *args: Any) -> None:
        hooks = self._installed.pop()
        try:
            hooks.__exit__(*args)
        finally:
            state.pop_enabled()
            self.inside_context = bool(self._installed)

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        raise NotImplementedError(
            "`on_save_for_backward: Callable[[torch.Tensor], Any]`is not implemented in "
            "CpuOffloadHook class. Inherit this class and implement your custom hooks"
        )

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        raise NotImplementedError(
            "`on_get_saved_tensors: Callable[[Any], torch.Tensor]`is not implemented in "
            "CpuOffloadHook class. Inherit this class and implement your custom hooks"
        )


class CpuOffloadHookWithOffloadHandler(CpuOffloadSavedTensorHook):
    """Delegates packing and unpacking to an ``OffloadHandler``."""

    def __init__(
        self,
        offload_handler: OffloadHandler,
        handler_extra_kwargs: Optional[Dict[str, Any]] = None,
        debug: bool = False,
    ) -> None:
        self.debug = debug
        self.offload_handler = offload_handler
        self.handler_extra_kwargs = handler_extra_kwargs if handler_extra_kwargs is not None else {}
        # Per entry: True a recomputation in backward, None inside a checkpoint region (no
        # hooks), False hooked.
        self._recomputing: List[Optional[bool]] = []
        super().__init__()

    def __enter__(self) -> "CpuOffloadHookWithOffloadHandler":
        if in_backward():
            # Activation checkpointing recomputes the layer inside backward: its tensors are used
            # at once, and the layer was counted in forward. Nothing to hook or schedule.
            self._recomputing.append(True)
            return self
        on_enter = getattr(self.offload_handler, "on_context_enter", None)
        if on_enter is not None:
            on_enter()
        if in_checkpoint_region():
            # Inside a non-reentrant checkpoint region (checkpoint around the stack of layers):
            # it stores nothing, and our hooks would shadow its own in forward but not in its
            # recomputation (in backward, above), so it would pair recomputed tensors with the
            # wrong saved slots. The layer is counted (entry, exit, commit); nothing is hooked.
            self._recomputing.append(None)
            state.push_enabled()
            self.inside_context = True
        else:
            self._recomputing.append(False)
            super().__enter__()
        state.push_handler(self.offload_handler)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        mode = self._recomputing.pop()
        if mode:
            return
        try:
            if mode is None:  # entered inside a checkpoint region: no hooks to remove
                state.pop_enabled()
                self.inside_context = bool(self._installed)
            else:
                super().__exit__(exc_type, exc, tb)
        finally:
            state.pop_handler()
            name = "on_context_error" if exc_type is not None else "on_context_exit"
            callback = getattr(self.offload_handler, name, None)
            if callback is not None:
                callback()

    def on_save_for_backward(self, tensor: torch.Tensor) -> Any:
        return self.offload_handler.tensor_push(tensor, **self.handler_extra_kwargs)

    def on_get_saved_tensor(self, saved_state: Any) -> torch.Tensor:
        return self.offload_handler.tensor_pop(saved_state, **self.handler_extra_kwargs)
