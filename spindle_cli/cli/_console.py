"""Consoles: stdout is for data, stderr is for people."""

from __future__ import annotations

from rich.console import Console

err = Console(stderr=True, markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Progress, tables, warnings and errors."""

out = Console(markup=False, emoji=False, highlight=False, soft_wrap=True)
"""Reports a user asked for (tables of `show`, `bench`, `simulate`)."""
