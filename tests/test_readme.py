"""README.md as a first-time user reads it (issue 40): short, terms defined before use, the most
common way in shown, the install path clean, and the numbers it states still true. Its code
blocks themselves run in ``tests/test_doc_blocks.py``."""
from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEVELOPMENT = ROOT / "docs" / "development.md"
pytestmark = pytest.mark.skipif(not README.exists(), reason="not run from a checkout")

# The row of docs/development.md's cost table that states what the suite measured, and the
# README's sentence that repeats its time.
SUITE_ROW = re.compile(r"`python3 -m pytest`: ([\d,]+) tests .*?\| about (\d+) s on torch ([\d.]+)")
README_TIME = re.compile(r"`python3 -m pytest` runs the suite and the docstring examples "
                         r"\(about (\d+) s on 2 cores\)")


def text(path: pathlib.Path) -> str:
    return path.read_text()


def first_bash_block(doc: str) -> list:
    block = re.search(r"```bash\n(.*?)```", doc, re.S).group(1)
    return [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.strip()]


def test_readme_stays_short():
    assert len(text(README).splitlines()) <= 250


def test_v2_is_defined_where_it_is_first_used():
    readme = " ".join(text(README).split())
    first = readme.index("V2")
    sentence = readme[readme.rfind(". ", 0, first) + 2: readme.find(". ", first)]
    assert "default" in sentence and "backend" in sentence, sentence


def test_the_trainer_recipe_is_a_section_with_code():
    readme = text(README)
    section = re.search(r"^## Hugging Face `Trainer`\n(.*?)^## ", readme, re.S | re.M)
    assert section, "README needs a '## Hugging Face `Trainer`' section"
    code = re.search(r"```python\n(.*?)```", section.group(1), re.S)
    assert code and "OffloadCallback(" in code.group(1) and ".train()" in code.group(1)


def test_quick_start_installs_numpy_before_the_demo():
    """torch's CPU wheels warn at import without NumPy ("Failed to initialize NumPy"): that
    was the demo's first line on the README's CPU install path."""
    lines = first_bash_block(text(README))
    demo = next(i for i, words in enumerate(lines) if "cpu_offload" in words and "-m" in words)
    installed = {w for words in lines[:demo + 1] if "install" in words for w in words}
    assert "numpy" in installed, lines


def test_gitignore_covers_the_quick_start_venv():
    venvs = [words[words.index("venv") + 1] for words in first_bash_block(text(README))
             if "venv" in words]
    ignored = text(ROOT / ".gitignore").split()
    assert venvs and all(f"{v.strip('/')}/" in ignored for v in venvs), (venvs, ignored)


def test_readme_and_development_state_the_same_suite_time():
    row = SUITE_ROW.search(text(DEVELOPMENT))
    said = README_TIME.search(" ".join(text(README).split()))
    assert row and said, "docs/development.md's cost table and README state the suite's time"
    assert said.group(1) == row.group(2)


def test_development_states_the_suite_size(request):
    """The number of tests docs/development.md gives for `python3 -m pytest` is within 10% of
    what this run collected, when this run is that command (tests and doctests, nothing
    deselected)."""
    config, items = request.config, request.session.items
    names = {type(item).__name__ for item in items}
    whole = (not config.option.keyword and not config.option.markexpr
             and "DoctestItem" in names and len(items) > 500
             and any("test_doc_blocks" in item.nodeid for item in items))
    if not whole:
        pytest.skip("only a run of the whole suite (python3 -m pytest) can count it")
    stated = int(SUITE_ROW.search(text(DEVELOPMENT)).group(1).replace(",", ""))
    assert abs(len(items) - stated) <= 0.1 * stated, (len(items), stated)
