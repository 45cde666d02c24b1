"""A plain fixed-width table for the benchmarks' output, in a module of its own so that the
hardware probes (``launch_queue_probe.py``, ``gil_probe.py``), which must
not import ``cpu_offload``, print the same tables as the rest (``bench_common`` re-exports it).
"""
from __future__ import annotations

from typing import Any, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table (no extra dependency): columns right-aligned, a rule under the
    headers; ``None`` prints as ``-``, a bool as ``yes``/``NO``, a float with 3 decimals below 10
    and 1 from there on, anything else (a string formatted by the caller) as it is.

    Args:
        headers: the column names.
        rows: one sequence of cells per row, as many as ``headers``.

    Example::

        >>> print(format_table(["case", "ms"], [["idle", 21.94], ["busy", None]]))
        case    ms
        ----  ----
        idle  21.9
        busy     -
    """
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
