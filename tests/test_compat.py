"""``cpu_offload.compat``: the one place that knows torch-version differences, and the suite's
rule that tests reach torch internals only through it."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch
from packaging.version import Version

from cpu_offload import SimulatedDevice, get_cpu_offload_context
from cpu_offload.compat import (
    MIN_TORCH,
    TORCH_VERSION,
    make_wrapper_subclass,
    saved_tensors_hooks,
    tensor_flatten,
    tensor_unflatten,
    top_saved_tensors_hooks,
    tree_map,
)


def test_top_saved_tensors_hooks_sees_nesting_and_removal():
    def pack(t):
        return t

    def unpack(t):
        return t

    assert top_saved_tensors_hooks() is None
    with saved_tensors_hooks(pack, unpack):
        assert top_saved_tensors_hooks() == (pack, unpack)
        with saved_tensors_hooks(unpack, pack):
            assert top_saved_tensors_hooks() == (unpack, pack)
        assert top_saved_tensors_hooks() == (pack, unpack)
    assert top_saved_tensors_hooks() is None


def test_top_saved_tensors_hooks_inside_the_offload_context():
    ctx, sync = get_cpu_offload_context(
        enabled=True, num_layers=1, model_layers=3, device=SimulatedDevice()
    )
    with ctx:
        assert top_saved_tensors_hooks() is not None
    assert top_saved_tensors_hooks() is None


def test_version_is_parsed_without_local_suffix():
    assert TORCH_VERSION.local is None
    assert str(TORCH_VERSION) in torch.__version__


# Anything named torch._<private> (torch._C, torch._dynamo, torch.utils._pytree, ...) differs
# between the releases tox tests; the tests go through cpu_offload.compat instead.
_PRIVATE = re.compile(r"\btorch(\.[A-Za-z0-9_]+)*\._[A-Za-z]")


def test_tests_use_torch_internals_only_through_compat():
    here = pathlib.Path(__file__).parent
    offenders = []
    for path in sorted(here.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code) and path.name != "test_compat.py":
                offenders.append(f"{path.name}:{lineno}: {line.strip()}")
    assert not offenders, "use cpu_offload.compat for torch internals:\n" + "\n".join(offenders)


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

    try:
        import torch.distributed._functional_collectives as funcol  # noqa: private, test only
    except ImportError:
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


def test_readme_setup_cfg_and_tox_name_the_same_torch_releases():
    """Supported torch releases are exactly the ones tox tests; install_requires names the
    oldest; README.md lists them all."""
    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "tox.ini").exists():
        pytest.skip("not run from a checkout")
    tested = sorted(
        {Version(v) for v in re.findall(r"^\s*torch\w*:\s*torch==([\d.]+)\s*$",
                                        (root / "tox.ini").read_text(), re.M)}
    )
    assert len(tested) >= 5, tested
    lower = re.search(r"^\s*torch>=([\d.]+)\s*$", (root / "setup.cfg").read_text(), re.M)
    assert lower and Version(lower.group(1)) == tested[0]
    assert MIN_TORCH <= tested[0]
    readme = (root / "README.md").read_text()
    assert f"torch {tested[0]} to {tested[-1]}" in readme
    for v in tested:
        assert str(v) in readme, v
