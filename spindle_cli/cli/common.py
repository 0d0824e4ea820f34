"""Helpers shared by the subcommands: loading inputs, writing outputs, `--check`, the memory
strategies a plan uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TypeVar

from spindle_cli.artifacts import Plan, load, rendered_for, write_artifact
from spindle_cli.artifacts.base import Artifact
from spindle_cli.cli._console import err

A = TypeVar("A", bound=Artifact)


def load_input(path: str, cls: type[A]) -> A:
    """Load a validated input artifact (errors are one-line ArtifactErrors)."""
    return load(path, cls)


def emit(obj: Artifact, output: str, *, check: bool = False) -> int:
    """Write `obj` to `output` (or stdout for '-'); with `check`, compare instead and write
    nothing. Returns the exit code: 1 when `check` finds a difference."""
    if check:
        new = rendered_for(obj, output)
        try:
            old = Path(output).read_text(encoding="utf-8")
        except FileNotFoundError:
            err.print(f"{output}: missing (would be created)", soft_wrap=True)
            return 1
        if old != new:
            err.print(f"{output}: out of date (regenerate it)", soft_wrap=True)
            return 1
        err.print(f"{output}: up to date", soft_wrap=True)
        return 0
    write_artifact(obj, output)
    if output != "-":
        err.print(f"wrote {output}", soft_wrap=True)
    return 0


def exit_with(code: int) -> None:
    """Exit with `code` when it is non-zero."""
    if code:
        sys.exit(code)


def memory_text(plan: Plan) -> str:
    """The memory strategies the plan counts on, as ', ZeRO-2, recompute' ('' for none)."""
    zero = plan.options.get("zero", "0")
    return (("" if zero == "0" else f", ZeRO-{zero}")
            + (", recompute" if plan.options.get("recompute") == "true" else ""))
