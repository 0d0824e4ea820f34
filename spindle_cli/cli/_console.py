"""Consoles: stdout is for data, stderr is for people."""

from __future__ import annotations

import os
import sys

from rich.console import Console


class _Console(Console):
    """A console that treats a reader closing the pipe (`spindle show PLAN | head`) as the end
    of the output, not a failure: rich exits 1 there, which the exit codes reserve for a
    difference found."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (sys.stderr if self.stderr else sys.stdout).fileno())
        raise SystemExit(0)


err = _Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Progress, tables, warnings and errors."""

out = _Console(markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Reports a user asked for (tables of `show`, `bench`, `simulate`)."""


def wide_out(width: int) -> Console:
    """A console like `out`, `width` columns wide (Console.print never renders wider than its
    console)."""
    return _Console(width=width, markup=False, emoji=False, highlight=False)
