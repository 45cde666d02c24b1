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
    saved_tensors_hooks,
    top_saved_tensors_hooks,
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


def test_readme_setup_cfg_and_tox_name_the_same_torch_releases():
    """Supported torch releases are exactly the ones tox tests; install_requires names the
    oldest; README.md says "tested on" with all of them, and where the list lives."""
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
    listed = ", ".join(str(v) for v in tested[:-1]) + f" and {tested[-1]}"
    assert f"Tested on torch {listed}: the list lives in `tox.ini`" in " ".join(readme.split())
