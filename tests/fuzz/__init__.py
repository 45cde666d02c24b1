"""A differential fuzzer for cpu_offload: random but valid training programs, each run on the
simulated device with offloading and without it, compared bit for bit (outputs, input and
parameter gradients, parameters after the optimizer step) and checked for leftovers (saved-tensor
hooks, live activations, device buffers, queued copies).

    python -m tests.fuzz --seed 0 --count 2000 --shrink   # development (docs/fuzzing.md)
    python -m pytest tests/fuzz -q                         # CI budget (test_fuzz.py)
"""
from .runner import EXCLUDE_ENV, Isolated, Result, check, exclusions, run_many, without_excluded
from .shrink import report, shrink, snippet, spec_repr
from .spec import LayerSpec, OptSpec, ProgramSpec, features, generate, normalize

__all__ = [
    "EXCLUDE_ENV", "Isolated", "LayerSpec", "OptSpec", "ProgramSpec", "Result", "check", "exclusions",
    "features", "generate", "normalize", "report", "run_many", "shrink", "snippet", "spec_repr",
    "without_excluded",
]
