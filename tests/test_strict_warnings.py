"""The newest-torch tox env turns torch's FutureWarnings and DeprecationWarnings about our calls
into failures (``tests/_support/strict_warnings.py``), and leaves third-party warnings alone."""
from __future__ import annotations

import configparser
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from _support import strict_warnings

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent

CASES = textwrap.dedent("""
    import warnings

    def warn(category, module):
        warnings.warn_explicit("deprecated", category, "somefile.py", 1, module=module)

    def test_torch_internal_future():          # e.g. the SAC warning, raised inside torch
        warn(FutureWarning, "torch.utils.checkpoint")

    def test_torch_at_our_call_deprecation():   # torch's stacklevel points at our module
        warn(DeprecationWarning, "cpu_offload.tools.layers")

    def test_torch_top_level_future():
        warn(FutureWarning, "torch")

    def test_third_party_future():              # transformers' own: we cannot change it
        warn(FutureWarning, "transformers.modeling_utils")

    def test_other_package_named_like_torch():
        warn(DeprecationWarning, "torchvision.io")

    def test_torch_user_warning():              # other categories are not deprecations
        warn(UserWarning, "torch.autograd.graph")
""")


def run_cases(tmp_path: pathlib.Path, strict: bool) -> str:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop(strict_warnings.ENV, None)
    if strict:
        env[strict_warnings.ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "_support.strict_warnings", "-p", "no:cacheprovider",
         "-rf", "-q", "test_cases.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return proc.stdout + proc.stderr


def test_strict_mode_fails_torch_and_package_deprecations_only(tmp_path):
    out = run_cases(tmp_path, strict=True)
    failed = set(re.findall(r"FAILED test_cases.py::(\w+)", out))
    assert failed == {"test_torch_internal_future", "test_torch_at_our_call_deprecation",
                      "test_torch_top_level_future"}, out
    assert "3 failed, 3 passed" in out, out


def test_without_the_variable_nothing_changes(tmp_path):
    out = run_cases(tmp_path, strict=False)
    assert "6 passed" in out and "failed" not in out, out


def test_only_the_newest_torch_env_is_strict():
    if not (ROOT / "tox.ini").exists():
        pytest.skip("not run from a checkout")
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    pins = dict(re.findall(r"^\s*(torch\d+):\s*torch==([\d.]+)\s*$", tox["testenv"]["deps"], re.M))
    newest = max(pins, key=lambda env: Version(pins[env]))
    strict = re.findall(rf"^\s*(\w+):\s*{strict_warnings.ENV}\s*=\s*1\s*$",
                        tox["testenv"]["set_env"], re.M)
    assert strict == [newest]
