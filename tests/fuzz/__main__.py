"""``python -m tests.fuzz --seed S --count N [--shrink] [--show] [--exclude PATTERNS]``

Runs programs S .. S+N-1, prints each failure with its seed and a reproducer (with ``--shrink``,
of the smallest failing program found), then a summary; exit status 1 if any failed. ``--show``
prints the standalone program of each failure (or, with ``--count 1``, of the program).
"""
from __future__ import annotations

import argparse
import collections
import sys

from .runner import EXCLUDE_ENV, Isolated, check, exclusions, run_many
from .shrink import report, shrink
from .spec import generate
from .codegen import program_source


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[1])
    parser.add_argument("--seed", type=int, default=0, help="first program's seed")
    parser.add_argument("--count", type=int, default=100, help="how many programs")
    parser.add_argument("--shrink", action="store_true", help="shrink each failure")
    parser.add_argument("--shrink-seconds", type=float, default=60.0, help="per failure")
    parser.add_argument("--show", action="store_true", help="print standalone programs")
    parser.add_argument("--exclude", default=None,
                        help=f"features to leave out (default: ${EXCLUDE_ENV}), e.g. "
                             "'ckpt_stack=nonreentrant,overlap=backward_update+edit=*'")
    parser.add_argument("--quiet", action="store_true", help="only failures and the summary")
    parser.add_argument("--spec", default=None,
                        help="check this ProgramSpec(...) (as a reproducer prints it) instead")
    args = parser.parse_args(argv)
    patterns = exclusions(args.exclude)
    if args.spec is not None:
        import tests.fuzz as fuzz

        spec = eval(args.spec, vars(fuzz))  # noqa: S307 - a spec the fuzzer printed
        if args.show:
            print(program_source(spec))
        result = check(spec)
        print(report(result) if result.failed else "the runs agree",
              file=sys.stderr if args.show else sys.stdout)
        return 1 if result.failed else 0
    if args.count == 1 and args.show:
        print(program_source(generate(args.seed)))

    isolated = Isolated()  # programs run in a worker process: crashes and hangs are reported

    def progress(result) -> None:
        if result.failed:
            shrunk = shrink(result, args.shrink_seconds, checker=isolated.check) if args.shrink else None
            print(report(result, shrunk, standalone=args.show), flush=True)
            if result.trace and not args.quiet:
                print("  " + result.trace.rstrip().replace("\n", "\n  "))
        elif result.invalid:  # a generator bug: shown even with --quiet
            print(f"seed {result.spec.seed} invalid (fails without offloading too): "
                  f"{result.invalid}", flush=True)
        elif not args.quiet:
            print(f"seed {result.spec.seed} ok {result.seconds:.2f}s", flush=True)

    with isolated:
        summary = run_many(args.seed, args.count, patterns, progress, isolated)
    by_kind = collections.Counter(r.signature for r in summary.failures)
    print(f"\n{len(summary.results)} programs in {summary.seconds:.1f}s: "
          f"{len(summary.failures)} failed {dict(by_kind)}, {len(summary.invalid)} invalid"
          + (f"; excluded {patterns}" if patterns else ""))
    if summary.failures:
        print("failing seeds: " + " ".join(str(r.spec.seed) for r in summary.failures))
    if summary.invalid:
        print("invalid seeds: " + " ".join(str(r.spec.seed) for r in summary.invalid))
    return 1 if summary.failures or summary.invalid else 0


if __name__ == "__main__":
    sys.exit(main())
