"""The layer-window map of Transformer Engine's asynchronous V1 handler, as a pure function.

``layer_window_map[i] = g`` means: offloaded group ``i`` has its device memory released at the
forward commit of group ``g`` (and the next offloaded group starts copying then), and in backward
group ``i`` is reloaded at the backward commit that brings the current group down to ``g``. The
windows spread the ``num_offload_group`` transfers evenly over ``num_model_group`` layers.
"""
from __future__ import annotations

from typing import Dict


def layer_window_map(num_offload_group: int, num_model_group: int) -> Dict[int, int]:
    """Transformer Engine's formula: ``(n // k) * (i + 1) - 1``, plus ``i + 1`` for the first
    ``n % k`` groups and the last such constant for the rest. Empty for ``k == 0``."""
    k, n = num_offload_group, num_model_group
    windows: Dict[int, int] = {}
    constant = 0
    for i in range(k):
        windows[i] = (n // k) * (i + 1) - 1
        if i < n % k:
            windows[i] += i + 1
            constant = i + 1
        else:
            windows[i] += constant
    return windows
