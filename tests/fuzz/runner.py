"""Run fuzz programs: each one with and without offloading, compared (``check``), many of them
from a seed (``run_many``), with known-defect features left out on request (``EXCLUDE_ENV``).

``run_many`` and the shrinker run programs in a worker process (``Isolated``): a program that
crashes the interpreter (a segfault in a kernel) or hangs (a thread waiting forever) is reported
as ``crash`` or ``timeout`` and the worker restarted, so one bad program cannot stop a run."""
from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence

import torch

from cpu_offload.compat import pop_saved_tensors_hooks, top_saved_tensors_hooks

from .codegen import program_source
from .spec import ProgramSpec, features, generate

EXCLUDE_ENV = "CPU_OFFLOAD_FUZZ_EXCLUDE"
V1_ENV = "NVTE_CPU_OFFLOAD_V1"
PROGRAM_TIMEOUT_S = 120  # one program takes well under a second (a check runs it 2-4 times)
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    """One program's verdict: ``problems`` (empty: the runs agree), ``invalid``: the program
    failed without offloading too (same exception type with offloading: not a failure, but a
    program the generator should not make)."""

    spec: ProgramSpec
    problems: List[str]
    seconds: float
    invalid: Optional[str] = None
    trace: Optional[str] = None  # the offloaded run's exception, formatted

    @property
    def failed(self) -> bool:
        return bool(self.problems)

    @property
    def signature(self) -> str:
        """A coarse class of the failure, kept while shrinking: the offloaded run's exception
        type, or which kind of recorded value differs."""
        if not self.problems:
            return ""
        first = self.problems[0]
        if first.startswith(("crash:", "timeout:")):
            return first.split(":", 1)[0]
        if first.startswith("exception:"):
            return "exception:" + first.split("with offloading ", 1)[1].split(":", 1)[0]
        name = first.split(":", 1)[0].rsplit(".", 1)[-1]
        hygiene = ("hooks_left", "context_active", "live_activations", "live_device_buffers",
                   "host_buffer_growth", "pending_copies", "layer_classes")
        return "hygiene" if name in hygiene else f"mismatch:{name}"


@contextlib.contextmanager
def _isolated() -> Iterator[None]:
    """Restore the backend switch, V2's batch size, warnings and the thread count; silence
    expected warnings."""
    from cpu_offload.v2 import layer_state

    before = os.environ.get(V1_ENV)
    threads = torch.get_num_threads()
    batch_bytes = layer_state.BATCH_BYTES  # a program may lower it
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        layer_state.BATCH_BYTES = batch_bytes
        torch.set_num_threads(threads)
        if before is None:
            os.environ.pop(V1_ENV, None)
        else:
            os.environ[V1_ENV] = before


def _leftovers() -> List[str]:
    """Saved-tensor hooks or active offload contexts a program left behind (removed here, so
    that the next program starts clean)."""
    found = []
    while top_saved_tensors_hooks() is not None:
        pop_saved_tensors_hooks()
        found.append("a saved-tensor hook was still installed after the program")
    from cpu_offload.v2 import context as v2_context

    if v2_context._state.active is not None:
        v2_context._state.active = None
        found.append("an offload context was still active after the program")
    return found


def check(spec: ProgramSpec) -> Result:
    """Run ``spec``'s program without and with offloading; compare everything it records.

    A hygiene difference (live tensors...) is confirmed by a second run: the first import of a
    module inside a step can leave a frame, and the tensors it refers to, alive once.
    """
    result = _check_once(spec)
    if result.signature == "hygiene":
        result = _check_once(spec)
    return result


def _check_once(spec: ProgramSpec) -> Result:
    source = program_source(spec)
    namespace: dict = {"__name__": f"fuzz_program_{spec.seed}"}
    start = time.perf_counter()
    exec(compile(source, f"<fuzz program {spec.seed}>", "exec"), namespace)  # noqa: S102
    with _isolated():
        base = namespace["outcome"](namespace["program"], False)
        offl = namespace["outcome"](namespace["program"], True)
    problems = namespace["differences"](base, offl) + _leftovers()
    invalid = None
    if base.error is not None:
        invalid = f"{type(base.error).__name__}: {base.error}"
    trace = None
    if offl.error is not None:
        trace = "".join(traceback.format_exception(type(offl.error), offl.error,
                                                   offl.error.__traceback__))
    return Result(spec, problems, time.perf_counter() - start, invalid, trace)


# --- excluding known-defect features --------------------------------------------------------------


def exclusions(text: Optional[str] = None) -> List[List[str]]:
    """``CPU_OFFLOAD_FUZZ_EXCLUDE`` parsed: comma-separated patterns, each a ``+``-joined
    conjunction of ``fnmatch`` patterns over ``features`` (``ckpt_stack=nonreentrant``,
    ``overlap=backward_update+edit=*``).

    Example::

        >>> exclusions("ckpt_stack=nonreentrant, overlap=next_forward+edit=*")
        [['ckpt_stack=nonreentrant'], ['overlap=next_forward', 'edit=*']]
    """
    text = os.environ.get(EXCLUDE_ENV, "") if text is None else text
    return [[p.strip() for p in item.split("+")] for item in text.split(",") if item.strip()]


def excluded_by(spec: ProgramSpec, patterns: Sequence[Sequence[str]]) -> Optional[str]:
    """The excluded feature ``spec`` has (the last term of a matching conjunction), or None."""
    have = features(spec)
    for conj in patterns:
        matches = [[f for f in have if fnmatch.fnmatchcase(f, p)] for p in conj]
        if all(matches):
            return sorted(matches[-1])[0]
    return None


def without_excluded(spec: ProgramSpec, patterns: Sequence[Sequence[str]]) -> ProgramSpec:
    """``spec`` with every excluded feature removed (by the shrinker's reductions)."""
    from .shrink import remove_feature

    for _ in range(50):
        feature = excluded_by(spec, patterns)
        if feature is None:
            return spec
        spec = remove_feature(spec, feature)
    raise RuntimeError(f"could not remove the excluded features from {spec!r}")


# --- many programs -----------------------------------------------------------------------------


class Isolated:
    """``check`` in a worker process (``python -m tests.fuzz.worker``), started on first use
    and again after a program crashed it or ran past ``timeout_s`` (then it is killed). A
    crash is reported with the innermost frames ``faulthandler`` printed; a hang with the
    stacks of the worker's threads (dumped before the kill)."""

    def __init__(self, timeout_s: float = PROGRAM_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.proc: Optional[subprocess.Popen] = None
        self.log = None

    def __enter__(self) -> "Isolated":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "tests.fuzz.worker"], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)

    def check(self, spec: ProgramSpec) -> Result:
        from .shrink import spec_repr

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        self.log.seek(0)
        self.log.truncate()
        start = time.perf_counter()
        try:
            self.proc.stdin.write((spec_repr(spec) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        ready = select.select([self.proc.stdout], [], [], self.timeout_s)[0]
        line = self.proc.stdout.readline() if ready else b""
        if line:
            r = json.loads(line)
            return Result(spec, r["problems"], r["seconds"], r["invalid"], r["trace"])
        hung = not ready
        if hung:  # every thread's stack to the log, then kill
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGABRT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self.log.seek(0)
        log = self.log.read().decode(errors="replace")
        self.proc = None
        if hung:
            what = f"timeout: no result after {self.timeout_s:.0f} s (a hang); the worker was killed"
        else:
            sig = -code if code < 0 else None
            name = signal.Signals(sig).name if sig else f"exit status {code}"
            what = f"crash: the worker process died ({name})"
        frames = _innermost_frames(log)
        return Result(spec, [what + (f" in {frames}" if frames else "")],
                      time.perf_counter() - start, None, log[-6000:])

    def close(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def _innermost_frames(log: str, count: int = 3) -> str:
    """``file:line in function`` of the innermost frames of the thread where ``faulthandler``
    caught the signal ("Current thread"), innermost first."""
    current = log.find("Current thread ")
    dump = log[current if current >= 0 else 0:].split("most recent call first):", 1)
    if len(dump) < 2:
        return ""
    frames = []
    for line in dump[1].splitlines()[1:]:
        m = re.match(r'\s+File "(.+)", line (\d+) in (\S+)', line)
        if not m:
            break
        path = m.group(1)
        short = "/".join(Path(path).parts[-2:]) if path.startswith("/") else path
        frames.append(f"{short}:{m.group(2)} {m.group(3)}")
    return " < ".join(frames[:count])


@dataclass
class Summary:
    results: List[Result] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failures(self) -> List[Result]:
        return [r for r in self.results if r.failed]

    @property
    def invalid(self) -> List[Result]:
        return [r for r in self.results if r.invalid and not r.failed]


def run_many(seed: int, count: int, exclude: Optional[Sequence[Sequence[str]]] = None,
             progress: Optional[Callable[[Result], None]] = None,
             isolated: Optional[Isolated] = None) -> Summary:
    """Programs ``seed``, ``seed + 1``, ..., ``seed + count - 1``, in ``isolated`` (default: a
    worker process of their own, closed at the end)."""
    patterns = exclusions() if exclude is None else exclude
    summary = Summary()
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if isolated is None:
            isolated = stack.enter_context(Isolated())
        for s in range(seed, seed + count):
            result = isolated.check(without_excluded(generate(s), patterns))
            summary.results.append(result)
            if progress is not None:
                progress(result)
    summary.seconds = time.perf_counter() - start
    return summary
