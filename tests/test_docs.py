"""User-facing text: every public name documents itself with a runnable example (the examples
themselves run as doctests: ``--doctest-modules`` in setup.cfg), and no text points users to
documents they do not have."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import cpu_offload
from cpu_offload import optim

ROOT = Path(__file__).resolve().parents[1]

# Constants (OVERLAP_MODES) carry no docstring of their own; HybridDeviceOptimizer lists them.
PUBLIC = [(f"cpu_offload.{n}", getattr(cpu_offload, n)) for n in cpu_offload.__all__] + [
    (f"cpu_offload.optim.{n}", getattr(optim, n)) for n in optim.__all__ if n != "OVERLAP_MODES"
]


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_public_name_has_a_docstring_with_an_example(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert ">>>" in doc, f"{name}: its docstring needs a short runnable example (doctest format)"


# Internal planning documents: numbered seed documents, the spec, issue numbers.
INTERNAL = re.compile(r"(?i:\bseeds?[ _-]?\d{3}\b|\bseeds/|\bissue #?\d+\b)|\bSPEC\b")


def user_facing_files() -> list:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "cpu_offload").rglob("*.py")),
        *sorted((ROOT / "benchmarks").glob("*.py")),
    ]


def test_no_user_facing_text_names_internal_documents():
    hits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in user_facing_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if INTERNAL.search(line)
    ]
    assert not hits, "say the thing itself, or point to a README section:\n" + "\n".join(hits)
