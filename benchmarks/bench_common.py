"""Pieces shared by the benchmark scripts: device abstraction (real CUDA or the simulated device),
clocks, memory statistics, backend selection and JSON output.

Every script runs the same code path on a CUDA GPU (real numbers) and on the CPU with
``cpu_offload.SimulatedDevice`` (a smoke test of the script: timings there mean nothing).
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

# Let ``python benchmarks/<script>.py`` work from a checkout without installing the package.
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402

import cpu_offload  # noqa: E402
from plain_table import format_table  # noqa: E402,F401 (re-exported: the scripts import it from here)

V1_ENV = "NVTE_CPU_OFFLOAD_V1"


@dataclass
class BenchDevice:
    """Where the benchmark runs: ``cuda`` (real GPU) or ``sim`` (CPU + ``SimulatedDevice``)."""

    kind: str
    last_offload_device: Optional[Any] = None  # the latest SimulatedDevice handed out (sim only)

    @staticmethod
    def from_flag(flag: str) -> "BenchDevice":
        if flag == "auto":
            flag = "cuda" if torch.cuda.is_available() else "sim"
        if flag == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available here; use --device sim")
        return BenchDevice(flag)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.is_cuda else torch.device("cpu")

    def offload_device(self) -> Optional[Any]:
        """``device=`` for ``get_cpu_offload_context``: the library default on CUDA, a fresh
        simulated device (one per context, so its log stays small) on the CPU."""
        if self.is_cuda:
            return None
        self.last_offload_device = cpu_offload.SimulatedDevice()
        return self.last_offload_device

    def take_copy_count(self) -> Optional[int]:
        """Copies the latest simulated device performed (proof that something was offloaded)."""
        dev, self.last_offload_device = self.last_offload_device, None
        return None if dev is None else sum(1 for e in dev.log if e[0] == "copy")

    def describe(self) -> str:
        if self.is_cuda:
            return torch.cuda.get_device_name()
        return f"CPU ({platform.processor() or platform.machine()}) with SimulatedDevice"

    # -- time ----------------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize()

    def mark(self) -> Any:
        """A point in time on the compute stream (CUDA event) or on the host (perf_counter)."""
        if self.is_cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        """Milliseconds between two marks; call after ``synchronize``."""
        if self.is_cuda:
            return start.elapsed_time(end)
        return (end - start) * 1e3

    # -- memory --------------------------------------------------------------------------------
    def memory_allocated(self) -> Optional[int]:
        return torch.cuda.memory_allocated() if self.is_cuda else None

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats()

    def max_memory_allocated(self) -> Optional[int]:
        return torch.cuda.max_memory_allocated() if self.is_cuda else None

    def free_memory(self) -> None:
        """Drop garbage and cached blocks so the next method starts from a clean allocator."""
        gc.collect()
        if self.is_cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def prepare_determinism(device: BenchDevice) -> None:
    """Allow ``deterministic_algorithms`` later in the run: cuBLAS reads its workspace config
    once, when its first handle is created, so it is set at start-up. ``:4096:8`` (32 MiB) is
    also the default on Hopper, so timings are unaffected."""
    if device.is_cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Deterministic kernels for a bit-exactness step, restored afterwards.

    Timed steps run without it (realistic training kernels): flash-attention backward then
    accumulates dQ with atomics and is not bit-reproducible, so exactness is checked in a separate
    step. Not ``warn_only``: with it, flash attention silently stays non-deterministic.
    ``fill_uninitialized_memory`` is kept off: it would fill every ``torch.empty`` (pinned host
    buffers included) and make the step differ from the timed ones.
    """
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    det = getattr(torch.utils, "deterministic", None)
    prev_fill = getattr(det, "fill_uninitialized_memory", None)
    torch.use_deterministic_algorithms(True)
    if det is not None:
        det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        if det is not None:
            det.fill_uninitialized_memory = prev_fill


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Select the library backend for the duration of a method: ``v1`` sets
    ``NVTE_CPU_OFFLOAD_V1=1`` (read by ``get_cpu_offload_context`` *and* by
    ``mark_activation_offload`` on every call, so it must stay set while the method runs)."""
    old = os.environ.get(V1_ENV)
    if name == "v1":
        os.environ[V1_ENV] = "1"
    else:
        os.environ.pop(V1_ENV, None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(V1_ENV, None)
        else:
            os.environ[V1_ENV] = old


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Collect once, then keep the cyclic GC out of timed loops (it adds random pauses)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def plottable(points: Sequence[Any]) -> tuple[Any, list]:
    """``(pyplot, points)`` for a time-vs-peak plot: matplotlib on the Agg backend and the
    points that have both ratios; ``(None, [])``, with a note why, when there is nothing to plot
    (matplotlib is optional; the simulated device measures no peak)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: plot skipped (pip install matplotlib)")
        return None, []
    have = [p for p in points if p.time_ratio is not None and p.peak_ratio is not None]
    if not have:
        print("no peak-memory data (simulated device?): plot skipped")
        return None, []
    return plt, have


def save_plot(plt: Any, fig: Any, ax: Any, title: str, path: Path) -> None:
    """Grid, legend and title on ``ax``, then ``fig`` written to ``path`` and closed."""
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def median(values: Sequence[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def quantile(values: Sequence[float], q: float) -> Optional[float]:
    """The ``q`` quantile (nearest rank below) of ``values``; None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def ratio_stats(ratios: Sequence[float]) -> tuple:
    """``(median, spread, range)`` of a configuration's per-round time ratios (to ``none``
    measured in the same round): ``range`` is max - min, ``spread`` that relative to the
    median (None with fewer than two rounds)."""
    if not ratios:
        return None, None, None
    mid = statistics.median(ratios)
    if len(ratios) < 2:
        return mid, None, None
    width = max(ratios) - min(ratios)
    return mid, width / mid if mid else None, width


def interleaved_rounds(names: Sequence[str], time_one: Callable[[str], float],
                       rounds: int) -> dict[str, list[float]]:
    """Time every configuration ``rounds`` more times, in turn: ``time_one(name)`` returns one
    measurement (ms). ``names[0]`` is the baseline. Every other round runs in reverse order, the
    baseline first and last (its time in that round: the median of the two), so clock and
    neighbour drift hit every configuration alike. Returns each name's per-round times."""
    times: dict[str, list[float]] = {name: [] for name in names}
    base = names[0]
    for r in range(rounds):
        order = list(names) if r % 2 == 0 else [base, *names[:0:-1], base]
        base_times = []
        for name in order:
            ms = time_one(name)
            (base_times if name == base else times[name]).append(ms)
        times[base].append(median(base_times))
    return times


def within_noise(diff: float, *ranges: Optional[float]) -> bool:
    """Whether a difference of time ratios is at most the widest of the ``ranges`` (per-round
    max - min) of the configurations it compares: then it claims nothing."""
    widths = [r for r in ranges if r is not None]
    return bool(widths) and abs(diff) <= max(widths)


def ratio_interval(a: Sequence[float], b: Sequence[float], level: float = 0.9,
                   resamples: int = 2000, seed: int = 0) -> tuple:
    """``(ratio, low, high)``: the median of ``a`` over the median of ``b`` (per-step times of
    two configurations measured in turns), and a bootstrap interval for it at ``level``
    (resampling each side's steps, seeded: the same samples give the same interval).

    >>> ratio_interval([10.0] * 5, [10.0] * 5)
    (1.0, 1.0, 1.0)
    """
    rng = random.Random(seed)
    ratio = statistics.median(a) / statistics.median(b)
    boot = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(resamples))
    tail = (1.0 - level) / 2
    return ratio, boot[int(tail * (resamples - 1))], boot[int((1 - tail) * (resamples - 1))]


def environment_info(device: BenchDevice) -> dict:
    return {
        "device": device.describe(),
        "device_kind": device.kind,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_offload": getattr(cpu_offload, "__version__", "?"),
    }


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
