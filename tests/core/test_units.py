"""``cpu_offload.core.units``: byte sizes for humans."""
from cpu_offload.core.units import format_bytes


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"
