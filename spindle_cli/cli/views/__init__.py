"""Rich summaries of artifacts for `spindle show`, one module per kind.

`spindle show FILE` imports `spindle_cli.cli.views.<module>` for the file's kind (model ->
model, cluster -> cluster, metaop_graph -> graph, profile -> profile, plan -> plan) and calls
`show(obj, path, **options)`, passing only the options the user gave. A view declares the
options it accepts as keyword parameters; `show` rejects any other option for that kind.
Tables go to stdout (`_console.out`). This package holds the number formats views share.
"""

from __future__ import annotations

from rich.table import Table

from spindle_cli.cli._console import out, wide_out

VIEW_MODULES = {
    "model": "model",
    "cluster": "cluster",
    "metaop_graph": "graph",
    "profile": "profile",
    "plan": "plan",
}
"""Artifact kind -> module under spindle_cli.cli.views."""


def fmt_count(n: float) -> str:
    """A count with a magnitude suffix: 1.20B, 0.66B, 86.0M, 4.6K, 512."""
    # From 0.1B up, counts read as billions, the way papers quote model sizes (0.66B).
    if abs(n) >= 1e8:
        return f"{n / 1e9:.2f}B"
    for scale, suffix in ((1e6, "M"), (1e3, "K")):
        # 999_950 is 1.0M, not 1000.0K
        if abs(n) >= scale or (scale > 1e3 and round(abs(n) / 1e3, 1) >= 1000):
            return f"{n / scale:.1f}{suffix}"
    return f"{n:g}"


def rank_text(ranks: tuple[int, ...]) -> str:
    """Compact rank list: 0-7,12."""
    parts, start = [], ranks[0]
    for a, b in zip(ranks, [*ranks[1:], None], strict=True):
        if b is None or b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            if b is not None:
                start = b
    return ",".join(parts)


def fmt_rate(bytes_per_s: float) -> str:
    """A bandwidth in GB/s and Gb/s (links are quoted in both)."""
    return f"{bytes_per_s / 1e9:.1f} GB/s ({bytes_per_s * 8 / 1e9:.0f} Gb/s)"


def print_table(table: Table) -> None:
    """Print a table to stdout at its natural width: a narrow terminal or a pipe (80 columns)
    would otherwise squeeze ids and numbers into ellipses or wrapped cells."""
    natural = out.measure(table, options=out.options.update_width(10_000)).maximum
    wide_out(max(natural, out.width)).print(table)
