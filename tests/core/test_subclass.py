"""``cpu_offload.core.subclass``: wrapper subclasses flattened into their inner tensors and
rebuilt, as both backends save them."""
from __future__ import annotations

import pytest
import torch

from cpu_offload.compat import functional_collectives, make_wrapper_subclass, tree_map
from cpu_offload.core.subclass import tensor_flatten, tensor_unflatten


class WithMesh(torch.Tensor):
    """A wrapper subclass that lists a non-tensor object among its inner attributes, as DTensor
    lists its device_mesh on recent torch."""

    @staticmethod
    def __new__(cls, data, mesh):
        return make_wrapper_subclass(cls, data, data.dtype)

    def __init__(self, data, mesh):
        self._data, self.mesh = data, mesh

    def __tensor_flatten__(self):
        return ["_data", "mesh"], {"tag": 7}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        assert meta == {"tag": 7}
        return WithMesh(inner["_data"], inner["mesh"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data if isinstance(t, WithMesh) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_tensor_flatten_keeps_non_tensor_inner_attributes_aside():
    mesh = object()
    t = WithMesh(torch.arange(6.0).view(2, 3), mesh)
    names, ctx = tensor_flatten(t)
    assert names == ["_data"]
    back = tensor_unflatten(WithMesh, {"_data": t._data.clone()}, ctx, t.size(), t.stride())
    assert type(back) is WithMesh and back.mesh is mesh and torch.equal(back._data, t._data)


def test_tensor_flatten_waits_for_a_pending_collective(tmp_path):
    import torch.distributed as dist

    funcol = functional_collectives()
    if funcol is None:
        pytest.skip("no functional collectives")
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        out = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
        if type(out).__name__ != "AsyncCollectiveTensor":
            pytest.skip(f"all_reduce returned {type(out).__name__}")
        if not hasattr(out, "__tensor_flatten__"):
            pytest.skip(f"AsyncCollectiveTensor is not flattenable in torch {torch.__version__}")
        waits = []
        real_wait = type(out).trigger_wait
        out.trigger_wait = lambda: waits.append(1) or real_wait(out)
        names, _ = tensor_flatten(out)
        assert waits == [1] and names == ["elem"]
        assert getattr(out, "completed", True)
    finally:
        dist.destroy_process_group()
