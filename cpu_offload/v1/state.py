"""Process-wide V1 state that layers query while they run (``is_cpu_offload_enabled`` and friends).

Transformer Engine keeps this in module globals; here the globals are stacks, so nested or
interleaved contexts restore what was there before instead of switching offloading off for an
outer context when an inner one exits.
"""
from __future__ import annotations

from typing import Any, List

_enabled: List[bool] = []
_handlers: List[Any] = []


def is_cpu_offload_enabled() -> bool:
    """True while inside an enabled V1 offload context."""
    return bool(_enabled)


def is_current_layer_offloaded() -> bool:
    """True while the innermost active handler's current group is one that gets offloaded."""
    if not _handlers:
        return False
    handler = _handlers[-1]
    return handler.current_group < handler.num_offload_group


def push_enabled() -> None:
    _enabled.append(True)


def pop_enabled() -> None:
    if _enabled:
        _enabled.pop()


def push_handler(handler: Any) -> None:
    _handlers.append(handler)


def pop_handler() -> None:
    if _handlers:
        _handlers.pop()
