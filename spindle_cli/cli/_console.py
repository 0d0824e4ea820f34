"""Consoles: stdout is for data, stderr is for people."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console

from spindle_cli.errors import one_line


class _Console(Console):
    """A console that treats a reader closing the pipe as the end of its output, not a
    failure (rich exits 1 there, which the exit codes reserve for a difference found). On
    stdout (`spindle show PLAN | head`) the command ends there, with 0 or the code a command
    that found a difference gives `closed_pipe_exit`. On stderr (`spindle plan ... 2>&1 |
    head -1`) it goes on without its messages, so its output file is still written."""

    closed_pipe_code = 0
    """The exit code when the reader of stdout has closed the pipe."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, (sys.stderr if self.stderr else sys.stdout).fileno())
        if not self.stderr:
            raise SystemExit(_Console.closed_pipe_code)


@contextmanager
def closed_pipe_exit(code: int) -> Iterator[None]:
    """Exit with `code` (the command's own: 1 for a difference found) if the reader closes
    the pipe while the block prints."""
    before, _Console.closed_pipe_code = _Console.closed_pipe_code, code
    try:
        yield
    finally:
        _Console.closed_pipe_code = before


err = _Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Progress, tables, warnings and errors."""

out = _Console(markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Reports a user asked for (tables of `show`, `bench`, `simulate`)."""


def wrote(path: object) -> None:
    """Tell on stderr that a file was written, its name escaped as errors escape it (a line
    break in it split the line)."""
    err.print(f"wrote {one_line(str(path))}")


def wide_out(width: int) -> Console:
    """A console like `out`, `width` columns wide (Console.print never renders wider than its
    console)."""
    return _Console(width=width, markup=False, emoji=False, highlight=False)
