"""Quantities as people read them, shared by the CLI's views and the planner's messages."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """Bytes in binary units: 80.0 GiB, 1.5 MiB, 384 B."""
    for scale, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {suffix}"
    return f"{n:g} B"
