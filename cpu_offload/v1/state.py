"""Process-wide V1 state that layers query while they run (``is_cpu_offload_enabled`` and friends).

Transformer Engine keeps this in module globals; here they are per-thread stacks, so nested or
interleaved contexts restore what was there before instead of switching offloading off for an
outer context when an inner one exits.
"""
from __future__ import annotations

import threading
from typing import Any, List


class _ThreadState(threading.local):
    """Per thread: contexts entered and exited by two threads in any interleaving never see or
    keep each other's state."""

    def __init__(self) -> None:
        self.enabled: List[bool] = []
        self.handlers: List[Any] = []


_state = _ThreadState()


def is_cpu_offload_enabled() -> bool:
    """True while inside an enabled V1 offload context."""
    return bool(_state.enabled)


def is_current_layer_offloaded() -> bool:
    """True while the innermost active handler's current group is one that gets offloaded."""
    if not _state.handlers:
        return False
    handler = _state.handlers[-1]
    return handler.current_group < handler.num_offload_group


def push_enabled() -> None:
    _state.enabled.append(True)


def pop_enabled() -> None:
    if _state.enabled:
        _state.enabled.pop()


def push_handler(handler: Any) -> None:
    _state.handlers.append(handler)


def pop_handler() -> None:
    if _state.handlers:
        _state.handlers.pop()
