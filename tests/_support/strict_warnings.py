"""The newest-torch tox env fails on torch's deprecations of our calls (a pytest plugin).

``tox.ini`` sets ``CPU_OFFLOAD_STRICT_WARNINGS=1`` for the env of the newest torch release only,
so that a ``FutureWarning`` or ``DeprecationWarning`` torch adds about how the package calls it
(as torch 2.15 did for ``respect_saved_tensors_hooks``) fails CI the day that release is added,
not when the next one turns it into an error. ``tests/conftest.py`` loads this plugin; the
doc-block runner calls ``install`` for the blocks it runs.

Scope, by the module a warning is attributed to (the frame its raiser's ``stacklevel`` points
at): torch's own modules (torch warns from inside itself, e.g. from the dispatch of an op under
selective checkpointing) and this package's (torch warns at the call into it). Warnings attributed
to third-party packages (transformers, accelerate: code we cannot change) are left as they are,
also when torch raises them about those packages' calls.
"""
from __future__ import annotations

import os
import warnings

ENV = "CPU_OFFLOAD_STRICT_WARNINGS"
MODULES = r"(torch|cpu_offload)(\..*)?\Z"  # torch and its submodules, not torchvision
CATEGORIES = (FutureWarning, DeprecationWarning)


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def install() -> None:
    """Turn those warnings into errors in this process (without pytest)."""
    for category in CATEGORIES:
        warnings.filterwarnings("error", category=category, module=MODULES)


def pytest_configure(config) -> None:
    """pytest's filters for every test and doctest, after setup.cfg's (later ones win)."""
    if enabled():
        for category in CATEGORIES:
            config.addinivalue_line("filterwarnings", f"error::{category.__name__}:{MODULES}")
