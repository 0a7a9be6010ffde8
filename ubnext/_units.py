"""Byte counts as people read them, for reports, tables and plots."""

from __future__ import annotations


def human_bytes(nbytes: int) -> str:
    """``2048`` -> ``"2 KiB"``, ``268435456`` -> ``"256 MiB"`` (labels of tables and plots)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
