"""`spindle graph MODEL -o GRAPH`: contract a model's tasks into a MetaOp graph."""

from __future__ import annotations

import difflib

import click

from spindle_cli.artifacts import ModelSpec, input_ref
from spindle_cli.cli._console import err
from spindle_cli.cli.common import check_output, emit, exit_with, load_input, recorded
from spindle_cli.errors import SpindleError


def _selected_tasks(model: ModelSpec, path: str, tasks: str | None,
                    task_set: str | None) -> list[str] | None:
    if tasks is not None and task_set is not None:
        raise SpindleError("--tasks and --task-set are mutually exclusive")
    if task_set is not None:
        if task_set not in model.task_sets:
            known = ", ".join(model.task_sets) or "none"
            raise SpindleError(f"{path}: task_sets: unknown task set {task_set!r} (known: {known})")
        return list(model.task_sets[task_set])
    if tasks is None:
        return None
    names = [t.strip() for t in tasks.split(",")]
    if not all(names):
        raise SpindleError(f"--tasks: empty task name in {tasks!r}")
    known = [t.name for t in model.tasks]
    unknown = [t for t in names if t not in known]
    if unknown:
        near = difflib.get_close_matches(unknown[0], known, n=1)
        raise SpindleError(
            f"{path}: tasks: unknown task {', '.join(repr(t) for t in unknown)} in --tasks "
            + (f"(did you mean {near[0]!r}?)" if len(unknown) == 1 and near else
               f"(known: {', '.join(known)})")
        )
    twice = next((t for i, t in enumerate(names) if t in names[:i]), None)
    if twice is not None:
        raise SpindleError(f"--tasks: task {twice!r} is given twice in {tasks!r}")
    return names


@click.command()
@click.argument("model_path", metavar="MODEL")
@click.option("--tasks", default=None, metavar="A,B,C",
              help="Comma-separated tasks (default: all).")
@click.option("--task-set", default=None, metavar="NAME", help="A task set named in the model.")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default="bf16",
              show_default=True, help="Activation and parameter dtype.")
@click.option("-o", "--output", default="-", show_default=True, metavar="GRAPH",
              help="Output file (.yaml, .yml or .json); '-' for stdout.")
@click.option("--check", is_flag=True,
              help="Compare with the existing output file instead of writing (exit 1 on drift).")
def graph(model_path: str, tasks: str | None, task_set: str | None, dtype: str, output: str,
          check: bool) -> None:
    """Contract the operator DAG of MODEL's tasks into a MetaOp graph."""
    from spindle_cli.planner.graph import build_graph

    check_output(output, check=check, inputs=(model_path,))
    model = load_input(model_path, ModelSpec)
    selected = _selected_tasks(model, model_path, tasks, task_set)
    result = build_graph(model, tasks=selected, dtype=dtype,
                         inputs=[input_ref(model, recorded(model_path, output))])
    code = emit(result, output, check=check)
    # after emit, so that a bad output path leaves a single error line
    tasks = f"{len(result.tasks)} task{'s' * (len(result.tasks) > 1)}"
    err.print(f"{model.name}: {tasks} -> {len(result.metaops)} MetaOps on "
              f"{result.num_levels} MetaLevels")
    unused = sorted(set(model.modules) - {s.module for t in model.tasks for s in t.steps})
    if unused:
        err.print(f"note: {model_path}: no task runs module(s) {', '.join(unused)}",
                  soft_wrap=True)
    exit_with(code)
