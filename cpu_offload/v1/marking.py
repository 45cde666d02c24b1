"""Tag-based selection: V1 offloads exactly the saved tensors that carry the
``activation_offloading`` tag."""
from __future__ import annotations

from typing import Optional

import torch

from ..core import markers
from ..core.checks import check_bool

FORCE_CLEAR_ATTR = "needs_force_clear"


def mark_activation_offload(*tensors: Optional[torch.Tensor], offload: bool = True) -> None:
    """Tag tensors (and the inner data tensors of wrapper subclasses) for offloading.

    Inner tensors of a wrapper also get ``needs_force_clear``: layers often keep the wrapper object
    itself in ``ctx``, which would keep its data alive after the offload; the handler therefore
    empties those inner tensors in place once their copy is on the host.
    """
    check_bool("offload", offload)
    markers.tag_activation_offload(*tensors, offload=offload)
    for t in tensors:
        if t is None:
            continue
        for inner in markers.component_tensors(t)[1:]:
            setattr(inner, FORCE_CLEAR_ATTR, offload)


def tensor_need_offloading_checker_activations(tensor: torch.Tensor) -> bool:
    """The checker ``get_cpu_offload_context`` installs: offload exactly the tagged tensors."""
    return bool(getattr(tensor, markers.V1_TAG_ATTR, False))


def needs_force_clear(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, FORCE_CLEAR_ATTR, False))
