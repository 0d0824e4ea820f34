"""`spindle show MODEL`: modules (kind, layers, dimensions, parameters) and tasks."""

from __future__ import annotations

from rich.table import Table

from spindle_cli.artifacts.model import ModelSpec, ModuleSpec
from spindle_cli.cli._console import out
from spindle_cli.cli.views import fmt_count, print_table
from spindle_cli.planner.costs import module_params


def _dims(m: ModuleSpec) -> str:
    parts = [f"hidden={m.hidden}"]
    for name in ("heads", "ffn", "in_dim", "vocab_size", "max_seq_len", "target_len"):
        value = getattr(m, name)
        if value:
            parts.append(f"{name}={value}")
    if m.kind == "projection":
        parts.append(f"pool={m.pool}")
    return " ".join(parts)


def show(obj: ModelSpec, path: str) -> None:
    """Print the model's modules, tasks and task sets."""
    users: dict[str, list[str]] = {name: [] for name in obj.modules}
    for task in obj.tasks:
        for step in task.steps:
            if task.name not in users[step.module]:
                users[step.module].append(task.name)
    params = {name: module_params(m) for name, m in obj.modules.items()}
    total = sum(params.values())

    out.print(f"model {obj.name} ({path})")
    if obj.description:
        out.print(obj.description)
    out.print(f"total parameters: {fmt_count(total)} ({total:,}); "
              f"{len(obj.modules)} modules, {len(obj.tasks)} task(s)")

    modules = Table(title="modules")
    for col in ("module", "kind", "layers", "dims", "params", "used by"):
        modules.add_column(col, justify="right" if col in ("layers", "params") else "left")
    for name, m in obj.modules.items():
        modules.add_row(name, m.kind, str(m.num_layers), _dims(m), fmt_count(params[name]),
                        f"{len(users[name])} tasks" if len(users[name]) > 1
                        else ", ".join(users[name]) or "-")
    print_table(modules)

    tasks = Table(title="tasks")
    for col in ("task", "batch", "inputs", "steps"):
        tasks.add_column(col, justify="right" if col == "batch" else "left")
    for t in obj.tasks:
        inputs = ", ".join(f"{n}[{i.seq_len}x{i.dim}]" if i.dim else f"{n}[{i.seq_len} tokens]"
                           for n, i in t.inputs.items())
        steps = ", ".join(f"{s.name}({s.module})" if s.name != s.module else s.name
                          for s in t.steps)
        tasks.add_row(t.name, str(t.batch_size), inputs, steps)
    print_table(tasks)

    for name, members in obj.task_sets.items():
        out.print(f"task set {name}: {', '.join(members)}")
