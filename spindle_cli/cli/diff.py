"""`spindle diff A B [--json]`: a semantic diff of two plans (allocations per MetaOp, waves,
placement, estimated time and memory). Exit 1 when they differ, 0 when they are the same
plan. How each was made (producer, recorded inputs' paths and sha256) is listed, and does
not make two plans differ: the same schedule from a changed profile is the same plan."""

from __future__ import annotations

import json

import click

from spindle_cli.artifacts import Plan
from spindle_cli.cli._console import closed_pipe_exit, out
from spindle_cli.cli.common import exit_with, load_input, provenance_changes
from spindle_cli.cli.views.plan_diff import differences, figures


@click.command()
@click.argument("a_path", metavar="A")
@click.argument("b_path", metavar="B")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout: the lines, and the figures a CI job "
                   "compares (estimated compute, C*, peak memory, waves, changed allocations) "
                   "as [A, B] pairs.")
def diff(a_path: str, b_path: str, as_json: bool) -> None:
    """Compare two plans; exit 1 when they differ.

    How each was made (producer, recorded inputs) is listed too, but the same schedule made
    from other inputs is the same plan."""
    a, b = load_input(a_path, Plan), load_input(b_path, Plan)
    lines, made = differences(a, b), provenance_changes(a, b)
    with closed_pipe_exit(1 if lines else 0):
        if as_json:
            out.print(json.dumps({"a": a_path, "b": b_path, "same": not lines,
                                  "differences": lines, "made_differently": made,
                                  **figures(a, b)}, indent=2))
        elif not lines:
            out.print(f"{a_path} and {b_path}: same plan"
                      + ("; made differently:" if made else ""))
            for line in made:
                out.print(f"  {line}")
        else:
            out.print(f"--- {a_path}\n+++ {b_path}")
            for line in made + lines:
                out.print(line)
    exit_with(1 if lines else 0)
