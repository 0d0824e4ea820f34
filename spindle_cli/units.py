"""Quantities as people read them, shared by the CLI's views and the planner's messages."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: 80.0 GiB, 1.5 MiB, 384 B; a count that the unit below would
    round to 1024.0 in the larger unit (2**30 - 1 bytes: 1.0 GiB, not 1024.0 MiB)."""
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        below = abs(n) / scale * 1024
        if abs(n) >= scale or (scale > 2**10 and round(below, 1) >= 1024):
            return f"{n / scale:.1f} {suffix}"
    return f"{n:g} B"
