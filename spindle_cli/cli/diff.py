"""`spindle diff A B`: a semantic diff of two plans (allocations per MetaOp, waves, placement,
estimated time and memory). Exit 1 when they differ, 0 when they are the same plan (headers
such as the producer version and input paths are not compared)."""

from __future__ import annotations

import click

from spindle_cli.artifacts import Plan
from spindle_cli.cli._console import closed_pipe_exit, out
from spindle_cli.cli.common import exit_with, load_input
from spindle_cli.cli.views.plan_diff import differences


@click.command()
@click.argument("a_path", metavar="A")
@click.argument("b_path", metavar="B")
def diff(a_path: str, b_path: str) -> None:
    """Compare two plans; exit 1 when they differ."""
    a, b = load_input(a_path, Plan), load_input(b_path, Plan)
    lines = differences(a, b)
    if not lines:
        out.print(f"{a_path} and {b_path}: same plan")
        return
    with closed_pipe_exit(1):
        out.print(f"--- {a_path}\n+++ {b_path}")
        for line in lines:
            out.print(line)
    exit_with(1)
