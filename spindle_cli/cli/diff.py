"""`spindle diff A B`: a semantic diff of two plans (allocations per MetaOp, waves, placement,
estimated time and memory). Exit 1 when they differ, 0 when they are the same plan. How each
was made (producer, recorded inputs' paths and sha256) is listed, and does not make two
plans differ: the same schedule from a changed profile is the same plan."""

from __future__ import annotations

import click

from spindle_cli.artifacts import Plan
from spindle_cli.cli._console import closed_pipe_exit, out
from spindle_cli.cli.common import exit_with, load_input, provenance_changes
from spindle_cli.cli.views.plan_diff import differences


@click.command()
@click.argument("a_path", metavar="A")
@click.argument("b_path", metavar="B")
def diff(a_path: str, b_path: str) -> None:
    """Compare two plans; exit 1 when they differ.

    How each was made (producer, recorded inputs) is listed too, but the same schedule made
    from other inputs is the same plan."""
    a, b = load_input(a_path, Plan), load_input(b_path, Plan)
    lines, made = differences(a, b), provenance_changes(a, b)
    if not lines:
        out.print(f"{a_path} and {b_path}: same plan"
                  + ("; made differently:" if made else ""))
        for line in made:
            out.print(f"  {line}")
        return
    with closed_pipe_exit(1):
        out.print(f"--- {a_path}\n+++ {b_path}")
        for line in made + lines:
            out.print(line)
    exit_with(1)
