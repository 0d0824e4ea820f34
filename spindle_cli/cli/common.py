"""Helpers shared by the subcommands: loading inputs, writing outputs, `--check`, the memory
strategies a plan uses."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TypeVar

from spindle_cli.artifacts import Plan, load, rendered_for, write_artifact
from spindle_cli.artifacts.base import Artifact
from spindle_cli.cli._console import err
from spindle_cli.errors import SpindleError

A = TypeVar("A", bound=Artifact)


def load_input(path: str, cls: type[A]) -> A:
    """Load a validated input artifact (errors are one-line ArtifactErrors)."""
    return load(path, cls)


def check_output(path: str, suffixes: tuple[str, ...] = (".yaml", ".yml", ".json"),
                 what: str = "file extension") -> None:
    """SpindleError unless `path` ('-': stdout) can be written or compared with: one of
    `suffixes` (else 'unknown <what>'), not a directory, in a directory that exists. Commands
    call it before their work, so a bad name prints nothing else and wastes nothing."""
    if path == "-":
        return
    target = Path(path)
    if target.suffix.lower() not in suffixes:
        raise SpindleError(f"{path}: unknown {what} (expected {_one_of(suffixes)})")
    if target.is_dir():
        raise SpindleError(f"{path}: is a directory")
    parent = target.parent
    if not parent.exists():
        raise SpindleError(f"{path}: output directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise SpindleError(f"{path}: {str(parent)!r} is not a directory")


def _one_of(suffixes: tuple[str, ...]) -> str:
    return ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]


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
