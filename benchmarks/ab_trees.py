"""Whether a change made the optimizer's step faster on this host: ``optim_benchmark.py`` run
from two or more source trees, or with two or more sets of options, interleaved, in one call.

    python3 benchmarks/ab_trees.py --trees HEAD~1 . --rounds 3 -- \\
        --no-microbench --no-probe --iters 6 --warmup 2 --rows "plain,split f=0.25"
    python3 benchmarks/ab_trees.py --variant "384=--stream-budget-mib 384" \\
        --variant "768=--stream-budget-mib 768" -- --rows "plain,split f=0.25" ...

A host's CPU rate moves up to 1.7x between machines, and between runs on one machine, so step
times of two trees compare only when measured on one machine with the trees interleaved (A B A
B ...), not one after the other. Each tree is ``.`` (the working tree), a git revision of this
repository (unpacked with ``git archive`` under ``--out``) or a directory holding a tree (where
``.git`` is absent: ``git archive REV | tar -x -C DIR`` beforehand). Each round runs
``optim_benchmark.py`` once from each tree's root, in a fresh process (each tree imports its
own ``cpu_offload``: checked before the first round), with the arguments after ``--``; a tree
too old to know one of them fails its runs, and the table says so. Each ``--variant NAME=ARGS``
adds ``ARGS`` to the runs of an arm of its own: every tree runs every variant, in each round.

The table, per benchmark row and arm (a tree, or a tree and a variant): the step ms of each
round, their median, the median's ratio to the first arm's, and the median of "x plain" (each
run's step ms over the ``plain`` row of the same run, when ``--rows`` has one).
``--out/ab_trees.json`` keeps every run. On a machine without CUDA the benchmark runs on the
simulated device (a smoke test: times there mean nothing).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional, Sequence

from plain_table import format_table

REPO = Path(__file__).resolve().parents[1]
PLAIN = "plain"


def unpack(rev: str, dest: Path) -> Path:
    """The tree of git revision ``rev`` of this repository, unpacked into ``dest``; ``.`` is the
    working tree itself, as it is, and a directory is taken as it is (a tree unpacked beforehand:
    where no ``.git`` travels, as to a lent GPU machine)."""
    if rev == ".":
        return REPO
    if Path(rev).is_dir():
        if not (Path(rev) / "benchmarks" / "optim_benchmark.py").is_file():
            raise SystemExit(f"--trees: {rev!r} is a directory but holds no benchmarks/optim_benchmark.py")
        return Path(rev).resolve()
    out = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True)
    if out.returncode:
        raise SystemExit(f"--trees: git archive {rev!r} failed: {out.stderr.decode().strip()}")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(out.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.12 warns without a filter
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    return dest


def _env(root: Path) -> dict:
    """The environment of a run from ``root``: its package first on the path (an editable
    install of another tree must not answer its imports)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def check_imports(root: Path) -> None:
    """Fail unless a process started as the runs are imports ``cpu_offload`` from ``root``."""
    out = subprocess.run([sys.executable, "-c", "import cpu_offload; print(cpu_offload.__file__)"],
                         cwd=root, env=_env(root), capture_output=True, text=True)
    if out.returncode:  # no copy at all: say why the import failed
        why = (out.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"a run from {root} would import cpu_offload from nowhere ({why}): "
                         "give a tree that holds the package")
    where = Path(out.stdout.strip()).resolve()
    if root.resolve() not in where.parents:
        raise SystemExit(f"a run from {root} would import cpu_offload from {where}: "
                         "uninstall the other copy or set PYTHONPATH")


def run_once(root: Path, bench_args: Sequence[str], out: Path) -> dict[str, Optional[float]]:
    """``optim_benchmark.py`` from ``root`` once: per row label, its step ms (None: the row or
    the run failed)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("optim_benchmark_*.json"):
        old.unlink()
    cmd = [sys.executable, "benchmarks/optim_benchmark.py", *bench_args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, env=_env(root), capture_output=True, text=True)
    found = sorted(out.glob("optim_benchmark_*.json"))
    if proc.returncode or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"  run from {root} failed ({proc.returncode}): {tail[0]}", file=sys.stderr)
        return {}
    rows = json.loads(found[0].read_text())["rows"]
    return {r["label"]: (r["step_ms"] if not r.get("error") else None) for r in rows}


def summarize(arms: Sequence[str], runs: dict[str, list[dict]]) -> list[dict]:
    """Per row label (in first-seen order) and arm: the step ms of each round, their median,
    its ratio to the first arm's median, and the median of each run's step over its ``plain``.

    Example::

        >>> runs = {"A": [{"plain": 100.0, "split": 160.0}, {"plain": 100.0, "split": 170.0}],
        ...         "B": [{"plain": 100.0, "split": 150.0}, {"plain": 101.0, "split": 151.5}]}
        >>> [(r["row"], r["arm"], r["median_ms"], r["vs_first"], r["x_plain"])
        ...  for r in summarize(["A", "B"], runs) if r["row"] == "split"]
        [('split', 'A', 165.0, 1.0, 1.65), ('split', 'B', 150.75, 0.9136, 1.5)]
    """
    labels: list[str] = []
    for arm in arms:
        for run in runs[arm]:
            labels += [k for k in run if k not in labels]
    out = []
    for label in labels:
        first = None
        for arm in arms:
            times = [run.get(label) for run in runs[arm]]
            ok = [t for t in times if t is not None]
            median = statistics.median(ok) if ok else None
            if arm == arms[0]:
                first = median
            ratios = [run[label] / run[PLAIN] for run in runs[arm]
                      if run.get(label) is not None and run.get(PLAIN)]
            out.append({
                "row": label, "arm": arm, "rounds_ms": times, "median_ms": median,
                "vs_first": None if median is None or not first else round(median / first, 4),
                "x_plain": round(statistics.median(ratios), 4) if ratios else None,
            })
    return out


def arms_of(trees: Sequence[str], variants: Sequence[str]) -> list[tuple[str, str, list[str]]]:
    """``(label, tree, extra arguments)`` per arm: each tree, times each ``NAME=ARGS`` variant.

    Example::

        >>> arms_of(["HEAD", "."], ["a=--x 1", "b=--x 2"])[1]
        ('HEAD b', 'HEAD', ['--x', '2'])
        >>> arms_of(["."], ["a=--x 1", "b="])
        [('a', '.', ['--x', '1']), ('b', '.', [])]
    """
    if not variants:
        return [(t, t, []) for t in trees]
    named = [(name, shlex.split(extra)) for name, _, extra in (v.partition("=") for v in variants)]
    return [((f"{t} {name}" if len(trees) > 1 else name), t, extra) for t in trees for name, extra in named]


def table(summary: Sequence[dict]) -> str:
    def num(v: Optional[float], fmt: str) -> str:
        return "failed" if v is None else format(v, fmt)
    return format_table(
        ["row", "arm", "rounds (step ms)", "median ms", "vs first arm", "x plain"],
        [[s["row"], s["arm"], " / ".join(num(t, ".1f") for t in s["rounds_ms"]),
          num(s["median_ms"], ".1f"), num(s["vs_first"], ".3f"), num(s["x_plain"], ".3f")]
         for s in summary])


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, bench_args = argv[:cut], argv[cut + 1:]
    usage = "%(prog)s [--trees REV ...] [--variant NAME=ARGS ...] [--rounds N] -- OPTIM_BENCHMARK_ARGS"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=usage)
    p.add_argument("--trees", nargs="+", default=["."],
                   help="'.' (the working tree, the default), git revisions or directories holding a "
                        "tree; the first is the baseline")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                   help="more optim_benchmark.py arguments for an arm of their own, e.g. "
                        "'b768=--stream-budget-mib 768'; every tree runs every variant")
    p.add_argument("--rounds", type=int, default=3, help="runs per arm, interleaved")
    p.add_argument("--out", default="bench_out/ab_trees")
    args = p.parse_args(own)
    bad = [v for v in args.variant if not v.partition("=")[0] or "=" not in v]
    if bad:
        p.error(f"--variant takes NAME=ARGS, got {bad[0]!r}")
    if len(args.trees) * max(1, len(args.variant)) < 2 or args.rounds < 1:
        p.error("compare at least two arms (two --trees, or two --variant) and --rounds at least 1")
    if any(a == "--out" or a.startswith("--out=") for a in bench_args):
        p.error("give --out before '--': each run writes under it")
    return args, bench_args


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    args, bench_args = parse_args(argv)
    out = Path(args.out).resolve()
    roots = {t: unpack(t, out / f"tree{i}") for i, t in enumerate(args.trees)}
    for root in roots.values():
        check_imports(root)
    arms = arms_of(args.trees, args.variant)
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in arms}
    for r in range(args.rounds):
        for i, (label, tree, extra) in enumerate(arms):
            result = run_once(roots[tree], [*bench_args, *extra], out / f"run{i}")
            runs[label].append(result)
            shown = ", ".join(f"{k} {v:.1f}" if v is not None else f"{k} failed" for k, v in result.items())
            print(f"round {r + 1}, {label}: {shown or 'failed'}", flush=True)
    summary = summarize([label for label, _, _ in arms], runs)
    print(table(summary))
    (out / "ab_trees.json").write_text(json.dumps({"trees": args.trees, "variants": args.variant,
                                                   "bench_args": bench_args, "runs": runs,
                                                   "summary": summary}, indent=2) + "\n")
    print(f"wrote {out / 'ab_trees.json'}")
    return summary


if __name__ == "__main__":
    main()
