"""The worker process of ``runner.Isolated``: reads one ``ProgramSpec(...)`` per line on stdin,
runs ``check`` on it, writes the result as one JSON line. What programs print goes to stderr."""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the protocol has stdout to itself
    import tests.fuzz as fuzz

    names = vars(fuzz)
    for line in sys.stdin:
        spec = eval(line, names)  # noqa: S307 - a spec the parent process wrote
        r = fuzz.check(spec)
        results.write(json.dumps({"problems": r.problems, "seconds": r.seconds,
                                  "invalid": r.invalid, "trace": r.trace}) + "\n")
        results.flush()


if __name__ == "__main__":
    main()
