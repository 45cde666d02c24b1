"""Sizes for humans: the byte format of the audit's report, a plan's description and the
profiler's notes."""
from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(n: int) -> str:
    """Binary units with one decimal (``"1.5 MiB"``), plain bytes below 1 KiB: the unit scales
    with the size, so a small model reads "12.0 KiB", not "0.00 GiB".

    Example::

        >>> format_bytes(1536), format_bytes(3 * 2**30), format_bytes(100)
        ('1.5 KiB', '3.0 GiB', '100 B')
    """
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
