"""`spindle bench [--json] [--out DIR] [--quick | --dynamic [--schedule SETS]]`: the paper's
evaluation on simulated clusters, with the paper's numbers beside ours.

Tables go to stdout, progress to stderr. `--out DIR` writes bench.csv, bench.json, bench.md
(the tables as markdown) and PNG charts (Figs. 8, 10, 11, 12, plus a Gantt chart and the
utilization of one Spindle plan); with `--dynamic`, dynamic.csv/json/md instead. A run's
files are written into a hidden directory inside DIR and moved into place together at the
end, so an interrupted run leaves the previous run's set whole.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import errno
import io
import json
import math
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from spindle_cli.artifacts import ClusterSpec, ModelSpec
from spindle_cli.artifacts.files import check_can_create, output_file, write_text_atomic
from spindle_cli.cli._console import err
from spindle_cli.cli.common import check_parent, exit_with, load_input
from spindle_cli.cli.views import print_table
from spindle_cli.errors import ArtifactError, SpindleError, one_line
from spindle_cli.planner import bench as lib
from spindle_cli.planner import paper_numbers

PLANNER_ORDER = ("spindle", "optimus", "distmm", "sequential")
GANTT_CASE = ("multitask-clip", 4, 16)
"""The configuration whose Spindle plan is drawn into --out (the paper's Fig. 9 case)."""


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _cell(row: lib.BenchRow | None) -> str:
    if row is None or row.iteration_ms is None:
        return "failed"
    text = f"{row.iteration_ms:.1f} x{_num(row.speedup_vs_sequential, '.2f')}"
    if row.paper_speedup is not None:
        text += f" ({row.paper_speedup:.2f})"
    if row.memory != "none":
        text += f" [{row.memory}]"
    return text


def _configs(rows: list[lib.BenchRow]) -> list[tuple[str, int, int]]:
    return list(dict.fromkeys((r.model, r.num_tasks, r.num_devices) for r in rows))


def _find(rows: list[lib.BenchRow], key: tuple[str, int, int], planner: str,
          placement: str = "island") -> lib.BenchRow | None:
    return next((r for r in rows if (r.model, r.num_tasks, r.num_devices) == key
                 and r.planner == planner and r.placement in (placement, "-")), None)


def speedup_table(rows: list[lib.BenchRow]) -> tuple[list[str], list[list[str]]]:
    """Fig. 8: iteration ms and speedup over sequential (paper's speedup over DeepSpeed)
    [memory setting, when the kept plan uses one]."""
    header = ["model", "tasks", "GPUs", "optimum ms", *PLANNER_ORDER]
    body = []
    for key in _configs(rows):
        opt = _find(rows, key, lib.OPTIMUM)
        body.append([key[0], str(key[1]), str(key[2]),
                     _num(opt.iteration_ms if opt else None, ".1f"),
                     *(_cell(_find(rows, key, p)) for p in PLANNER_ORDER)])
    return header, body


def executed_table(rows: list[lib.BenchRow]) -> tuple[list[str], list[list[str]]]:
    """Each planner's kept plan with every rank on its own, as `spindle run` executes it
    (iteration ms, and its change from the wave-by-wave figure); the fastest is marked."""
    header = ["model", "tasks", "GPUs", *PLANNER_ORDER]
    body = []
    for key in _configs(rows):
        found = [_find(rows, key, p) for p in PLANNER_ORDER]
        times = [r.executed_ms for r in found if r is not None and r.executed_ms is not None]
        cells = []
        for r in found:
            if r is None or r.executed_ms is None or r.iteration_ms is None:
                cells.append("failed")
                continue
            mark = " *" if r.executed_ms == min(times) else ""
            cells.append(f"{r.executed_ms:.1f} ({r.executed_ms / r.iteration_ms - 1:+.1%})"
                         f"{mark}")
        body.append([key[0], str(key[1]), str(key[2]), *cells])
    return header, body


def detail_table(rows: list[lib.BenchRow]) -> tuple[list[str], list[list[str]]]:
    """Figs. 10-12: Spindle's gap to the optimum, transfer shares, sync, planning time. The
    transfer share with sequential placement twice: the kept waves placed on consecutive ranks
    (the paper's ablation, its number beside it), and a plan made for sequential placement
    (which may choose other waves). The planning time is the configuration's slowest
    `plan_seconds` over every planner and placement (each `spindle plan`'s whole search over
    memory settings)."""
    header = ["model", "tasks", "GPUs", "gap (iter/C*)", "compute/C*", "transfer island",
              "seq-place, same waves", "seq-place, replanned", "sync ms (all-gather waits)",
              "plan s (slowest planner)", "kept candidate"]
    body = []
    for key in _configs(rows):
        sp, seq = _find(rows, key, "spindle"), _find(rows, key, "spindle", "sequential")

        def share(fraction: float | None, paper: float | None = None) -> str:
            if fraction is None:
                return "failed"
            return f"{100 * fraction:.1f}%" + (f" ({100 * paper:.1f}%)" if paper else "")

        if sp is None or sp.transfer_fraction is None:
            naive = "failed"
        elif sp.naive_error:
            naive = "does not fit"
        else:
            naive = share(sp.naive_transfer_fraction, sp.paper_naive_transfer_share)
        seconds = [r.plan_seconds for r in rows
                   if (r.model, r.num_tasks, r.num_devices) == key and r.plan_seconds is not None]
        body.append([key[0], str(key[1]), str(key[2]),
                     _num(sp.gap_to_optimum if sp else None, ".3f"),
                     _num(sp.compute_gap if sp else None, ".3f"),
                     share(sp.transfer_fraction, sp.paper_transfer_share) if sp else "failed",
                     naive, share(seq.transfer_fraction) if seq else "failed",
                     _num(sp.sync_ms if sp else None, ".1f") + (
                         f" ({sp.gather_wait_ms:.1f})" if sp and sp.gather_wait_ms else ""),
                     _num(max(seconds) if seconds else None, ".3f"),
                     sp.candidate if sp else "-"])
    return header, body


def _rich(title: str, header: list[str], body: list[list[str]]) -> Table:
    table = Table(title=title)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for line in body:
        table.add_row(*line)
    return table


def _markdown(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(line) + " |" for line in body]
    return "\n".join(lines) + "\n"


def _failures(rows: list[lib.BenchRow]) -> list[str]:
    return [f"{r.model} {r.num_tasks} tasks @{r.num_devices} {r.planner}/{r.placement}: {r.error}"
            for r in rows if r.error]


def _csv(records: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(records[0]) if records else [],
                            lineterminator="\n")
    writer.writeheader()
    writer.writerows(records)
    return buf.getvalue()


def _load_world(models_dir: str, clusters_dir: str, configs: list[lib.BenchConfig],
                ) -> tuple[dict[str, ModelSpec], dict[str, ClusterSpec]]:
    models = {m: load_input(str(Path(models_dir) / f"{m}.yaml"), ModelSpec)
              for m in dict.fromkeys(c.model for c in configs)}
    clusters: dict[str, ClusterSpec] = {}
    for c in configs:
        path = str(Path(models_dir) / f"{c.model}.yaml")
        if c.task_set is not None:
            _check_task_sets(models[c.model], path, [c.task_set])
        _check_num_tasks(models[c.model], path, c.task_set, c.num_tasks)
        if c.cluster not in clusters:
            clusters[c.cluster] = _cluster(clusters_dir, c.cluster, c.num_devices)
    return models, clusters


def _check_num_tasks(model: ModelSpec, path: str, task_set: str | None, num_tasks: int) -> None:
    """ArtifactError where the task set a cell runs (None: all tasks) has another number of
    tasks than the cell is named for: its row, and the paper's numbers beside it, would say
    so."""
    tasks = model.tasks if task_set is None else model.task_sets[task_set]
    if len(tasks) != num_tasks:
        field = "tasks" if task_set is None else f"task_sets.{task_set}"
        raise ArtifactError(path, field, f"{len(tasks)} tasks, where spindle bench runs the "
                                         f"paper's {num_tasks}")


def _cluster(clusters_dir: str, name: str, num_devices: int) -> ClusterSpec:
    """The cluster spec `name`, which must have the `num_devices` the bench's cells run on."""
    path = str(Path(clusters_dir) / f"{name}.yaml")
    cluster = load_input(path, ClusterSpec)
    if cluster.num_devices != num_devices:
        raise ArtifactError(path, "num_nodes", f"{cluster.num_nodes} x "
                            f"{cluster.devices_per_node} = {cluster.num_devices} devices, where "
                            f"spindle bench runs {num_devices} on {name}")
    return cluster


def _check_task_sets(model: ModelSpec, path: str, names: list[str]) -> None:
    """ArtifactError naming the first of `names` the model has no task set of."""
    missing = next((n for n in names if n not in model.task_sets), None)
    if missing is not None:
        have = ", ".join(map(repr, model.task_sets)) or "none"
        raise ArtifactError(path, "task_sets", f"no task set {missing!r}, which spindle bench "
                                               f"runs (the model has {have})")


def _bar_chart(path: Path, title: str, ylabel: str, groups: list[str],
               series: dict[str, list[float | None]], *, reference: float | None = None,
               percent: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spindle_cli.cli.views.gantt import save_figure

    fig, ax = plt.subplots(figsize=(max(8.0, 0.9 * len(groups) + 3), 4.2))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [float("nan") if v is None else (100 * v if percent else v) for v in values]
        ax.bar(xs, ys, width=width, label=name)
    if reference is not None:
        ax.axhline(reference, color="black", linewidth=0.8, linestyle="--")
    ours = [values for name, values in series.items() if not name.startswith("paper")]
    for g in range(len(groups)):
        if all(values[g] is None for values in ours):
            ax.text(g, 0.0, "no plan", rotation=90, ha="center", va="bottom", fontsize=7,
                    color="grey")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    save_figure(fig, str(path))
    plt.close(fig)


def _charts(rows: list[lib.BenchRow], out_dir: Path) -> None:
    keys = _configs(rows)
    groups = [f"{m} {k}t @{n}" for m, k, n in keys]

    def col(planner: str, field: str, placement: str = "island") -> list[float | None]:
        found = [_find(rows, k, planner, placement) for k in keys]
        return [getattr(r, field) if r is not None else None for r in found]

    _bar_chart(out_dir / "fig8_speedup.png",
               "Speedup over sequential (Megatron/DeepSpeed-style), simulated (cf. paper Fig. 8)",
               "speedup", groups,
               {p: col(p, "speedup_vs_sequential") for p in PLANNER_ORDER}
               | {"paper: spindle vs DeepSpeed": col("spindle", "paper_speedup")},
               reference=1.0)
    _bar_chart(out_dir / "fig10_transfer.png",
               "Inter-wave transfer share of the iteration (cf. paper Fig. 10)", "% of iteration",
               groups, {"island placement": col("spindle", "transfer_fraction"),
                        "sequential placement, same waves": col("spindle",
                                                                "naive_transfer_fraction"),
                        "sequential placement, replanned": col("spindle", "transfer_fraction",
                                                               "sequential"),
                        "paper: island": col("spindle", "paper_transfer_share"),
                        "paper: sequential, same waves": col("spindle",
                                                             "paper_naive_transfer_share")},
               percent=True)
    _bar_chart(out_dir / "fig11_gap.png",
               "Spindle over the relaxed optimum C* (cf. paper Fig. 11: <= 1.07)", "x C*", groups,
               {"iteration / C*": col("spindle", "gap_to_optimum"),
                "compute / C*": col("spindle", "compute_gap")},
               reference=paper_numbers.FIG11_MAX_GAP)
    _bar_chart(out_dir / "fig12_plan_time.png",
               "Planning time of spindle plan, its search over memory settings included "
               "(cf. paper Fig. 12: < 3 s)",
               "seconds", groups, {p: col(p, "plan_seconds") for p in PLANNER_ORDER},
               reference=paper_numbers.FIG12_MAX_PLAN_SECONDS)


def _gantt(models: dict[str, ModelSpec], clusters: dict[str, ClusterSpec],
           configs: list[lib.BenchConfig], out_dir: Path) -> None:
    from spindle_cli.cli.views.gantt import write_gantt, write_utilization

    cfg = next((c for c in configs
                if (c.model, c.num_tasks, c.num_devices) == GANTT_CASE), configs[0])
    cluster = clusters[cfg.cluster]
    # the graph the bench row's plan was made from, so the chart draws that plan
    graph = lib.config_graph(models[cfg.model], cfg)
    try:
        plan, sim, _ = lib.plan_and_simulate(graph, lib.profile_for(graph, cluster), cluster,
                                             "spindle", "island")
    except SpindleError as e:
        err.print(f"no Gantt chart: {e}")
        return
    write_gantt(plan, str(out_dir / "gantt.png"), sim=sim)
    write_utilization(plan, str(out_dir / "utilization.png"), sim=sim)


MATRIX_FILES = ("bench.json", "bench.csv", "bench.md", "fig8_speedup.png", "fig10_transfer.png",
                "fig11_gap.png", "fig12_plan_time.png", "gantt.png", "utilization.png")
"""What a matrix run writes into --out (the Gantt and utilization charts when the plan they
draw could be made)."""
DYNAMIC_FILES = ("dynamic.json", "dynamic.csv", "dynamic.md")
"""What a --dynamic run writes into --out."""


@contextlib.contextmanager
def _staged(out_dir: Path, owned: tuple[str, ...]) -> Iterator[Path]:
    """A hidden directory inside `out_dir` to write a run's files into; once the block ends
    without an error they replace their namesakes in `out_dir` and the files in `owned` that
    this run did not write are removed (a chart of an earlier run beside this run's tables),
    as one swap (`_swap_in`); after an error they are removed and `out_dir` keeps the previous
    run's files. The file system refusing (`out_dir` gone or full meanwhile, a directory where
    a file goes) is a one-line SpindleError, and leaves the previous run's set whole."""
    try:
        out_dir.mkdir(exist_ok=True)
        staging = tempfile.TemporaryDirectory(dir=out_dir, prefix=".staging-")
    except OSError as e:
        raise SpindleError(f"--out {out_dir}: cannot write: {e.strerror or e}") from None
    with staging as tmp:
        yield Path(tmp)
        written = sorted(f.name for f in Path(tmp).iterdir())
        _swap_in(Path(tmp), out_dir, written, sorted(set(owned) - set(written)))


def _swap_in(staging: Path, out_dir: Path, written: list[str], dropped: list[str]) -> None:
    """Move the files `written` from `staging` into `out_dir` and remove `dropped` from it, all
    or nothing: the files they replace are first moved aside into a hidden directory of
    `out_dir` (renames in one directory), and put back when any rename fails; a directory, or
    a file `files.output_file` refuses (a read-only one), in the way stops the swap before
    anything moves. Should putting them back fail too, they stay in that directory, which the
    error names. A file keeps the permission bits of the one it replaces; a symlink under one
    of these names is replaced like a file, not written through: the names are bench's own,
    and one swap cannot rename across directories."""

    def refused(name: str, why: str, kept: Path | None = None) -> SpindleError:
        where = f"; the previous files are in {kept}" if kept is not None else ""
        return SpindleError(f"--out {out_dir}: cannot write {name}: {why}{where}")

    modes: dict[str, int] = {}
    for name in written + dropped:
        replaced = _replaced(out_dir, name)
        if replaced is not None:
            modes[name] = stat.S_IMODE(replaced.stat().st_mode)
    try:
        aside = Path(tempfile.mkdtemp(dir=out_dir, prefix=".previous-"))
    except OSError as e:
        raise SpindleError(f"--out {out_dir}: cannot write: {e.strerror or e}") from None
    # one swap: Ctrl-C or SIGTERM waits until it is whole or put back
    with _signals_held():
        moved_aside: list[str] = []
        moved_in: list[str] = []
        try:
            for name in written + dropped:
                if os.path.lexists(out_dir / name):
                    os.rename(out_dir / name, aside / name)
                    moved_aside.append(name)
            for name in written:
                if name in modes:
                    os.chmod(staging / name, modes[name])
                os.rename(staging / name, out_dir / name)
                moved_in.append(name)
        except OSError as e:  # the target's name: rename's second file, or its first
            name = Path(e.filename2 or e.filename).name
            try:
                for moved in moved_in:
                    os.rename(out_dir / moved, staging / moved)
                for moved in moved_aside:
                    os.rename(aside / moved, out_dir / moved)
            except OSError:
                raise refused(name, e.strerror or str(e), aside) from None
            shutil.rmtree(aside, ignore_errors=True)
            raise refused(name, e.strerror or str(e)) from None
        shutil.rmtree(aside, ignore_errors=True)


def _replaced(out_dir: Path, name: str) -> Path | None:
    """The file that the swap's `name` replaces in `out_dir` (`files.output_file`; None where
    there is none, or a symlink, which the swap replaces like a file); SpindleError where the
    swap would refuse it: a directory, or a file `output_file` refuses (a read-only one)."""
    entry = out_dir / name
    if entry.is_symlink() or not entry.exists():
        return None
    if entry.is_dir():
        raise SpindleError(f"--out {out_dir}: cannot write {name}: {os.strerror(errno.EISDIR)}")
    return output_file(entry)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then handled as they would have
    been: a swap of renames stopped half way left the previous files aside and the new ones
    gone with the staging directory. (Their Python handlers swapped, not the signal mask:
    a signal the kernel gives another thread still raises in the main thread.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers, and only it receives them
        return
    arrived: list[tuple[int, Any]] = []
    before = {s: signal.signal(s, lambda signum, frame: arrived.append((signum, frame)))
              for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for signum, frame in arrived[:1]:
            handler = before[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)


def _run_matrix(models_dir: str, clusters_dir: str, quick: bool, as_json: bool,
                out_dir: Path | None) -> None:
    configs = lib.matrix(quick=quick)
    models, clusters = _load_world(models_dir, clusters_dir, configs)
    rows: list[lib.BenchRow] = []
    for cfg in configs:
        err.print(f"bench: {cfg.model} {cfg.num_tasks} tasks on {cfg.num_devices} devices")
        rows += lib.run_config(models[cfg.model], clusters[cfg.cluster], cfg)
    records = [dataclasses.asdict(r) for r in rows]
    fig8, detail, executed = speedup_table(rows), detail_table(rows), executed_table(rows)
    if as_json:
        click.echo(json.dumps(records, indent=2))
    else:
        print_table(_rich("iteration ms x speedup over sequential (paper's speedup over "
                          "DeepSpeed) [ZeRO stage / recomputation used]", *fig8))
        print_table(_rich("spindle: gap to optimum, inter-wave transfer share with island vs "
                          "sequential placement (paper), planning time", *detail))
        print_table(_rich("the same plans with each rank on its own, as spindle run executes "
                          "them: iteration ms (change from wave by wave); * fastest",
                          *executed))
    if out_dir is not None:
        with _staged(out_dir, MATRIX_FILES) as staging:
            _write_matrix(rows, records, fig8, detail, executed, staging)
            _gantt(models, clusters, configs, staging)
        err.print(f"wrote {one_line(str(out_dir))}/bench.{{csv,json,md}} and charts")
    _fail_with(_failures(rows))


def _fail_with(failures: list[str]) -> None:
    """Each configuration that could not be planned, on stderr, and exit 1 (the tables and
    files hold the others): a bench run by CI as a gate fails where one did."""
    if not failures:
        return
    for line in failures:
        err.print(f"failed: {line}")
    err.print(f"error: {len(failures)} of the bench's rows failed (above)")
    exit_with(1)


def _write_matrix(rows: list[lib.BenchRow], records: list[dict[str, Any]],
                  fig8: tuple[list[str], list[list[str]]],
                  detail: tuple[list[str], list[list[str]]],
                  executed: tuple[list[str], list[list[str]]], out_dir: Path) -> None:
    """bench.json, bench.csv, bench.md and the bar charts into `out_dir`."""
    write_text_atomic(out_dir / "bench.json", json.dumps(records, indent=2) + "\n")
    write_text_atomic(out_dir / "bench.csv", _csv(records))
    failures = "".join(f"- {line}\n" for line in _failures(rows))
    write_text_atomic(out_dir / "bench.md",
                      "## Iteration time (ms) and speedup over `sequential` "
                      "(paper's speedup over DeepSpeed in parentheses; [memory setting] when "
                      "the kept plan uses ZeRO or recomputation)\n\n" + _markdown(*fig8)
                      + "\n## Spindle: gap to the relaxed optimum, inter-wave transfer share "
                      "(paper in parentheses), planning time\n\n" + _markdown(*detail)
                      + "\n## The same plans with each rank on its own, as `spindle run` "
                      "executes them (iteration ms, change from wave by wave; * fastest)\n\n"
                      + _markdown(*executed)
                      + ("\n## Configurations that could not be planned\n\n" + failures
                         if failures else ""))
    _charts(rows, out_dir)


def _iterations(k: int) -> str:
    """'k iterations per phase' (one iteration: a one-set schedule is ahead from its first)."""
    return f"{k} iteration{'s' * (k != 1)} per phase"


def _run_dynamic(models_dir: str, clusters_dir: str, schedule: tuple[str, ...], as_json: bool,
                 out_dir: Path | None) -> None:
    cluster_name = lib.CLUSTERS[lib.DYNAMIC_DEVICES]
    model_path = str(Path(models_dir) / f"{lib.DYNAMIC_MODEL}.yaml")
    model = load_input(model_path, ModelSpec)
    _check_task_sets(model, model_path, list(schedule))
    cluster = _cluster(clusters_dir, cluster_name, lib.DYNAMIC_DEVICES)
    err.print(f"bench --dynamic: {lib.DYNAMIC_MODEL} task sets "
              f"{' -> '.join(schedule)} on {cluster_name}")
    rows = lib.run_dynamic(model, cluster, schedule=schedule)
    totals = lib.dynamic_totals(rows)
    records = [dataclasses.asdict(r) for r in rows]
    # the phases as rows, and each planner's sums so a script need not add them up
    report = {"phases": records, "totals": [dataclasses.asdict(t) for t in totals]}
    header = ["planner", *(f"phase {i}: task set {s}" for i, s in enumerate(schedule)),
              "training s", "replanning s", "total s", "Spindle ahead from"]
    body = []
    for t in totals:
        phases = [r for r in rows if r.planner == t.planner]
        body.append([t.planner, *(_num(r.iteration_ms, ".1f") + " ms" if r.iteration_ms
                                  else "failed" for r in phases),
                     _num(t.train_s, ".2f"), _num(t.replan_s, ".3f"), _num(t.total_s, ".2f"),
                     "" if t.spindle_ahead_beyond is None else _iterations(
                         math.floor(t.spindle_ahead_beyond) + 1)])
    title = (f"dynamic task sets: {lib.DYNAMIC_MODEL} on {cluster_name}, "
             f"{_iterations(rows[0].iterations)}")
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        print_table(_rich(title, header, body))
    if out_dir is not None:
        with _staged(out_dir, ()) as staging:
            write_text_atomic(staging / "dynamic.json", json.dumps(report, indent=2) + "\n")
            write_text_atomic(staging / "dynamic.csv", _csv(records))
            write_text_atomic(staging / "dynamic.md",
                              f"## {title[0].upper()}{title[1:]}\n\n" + _markdown(header, body))
        err.print(f"wrote {one_line(str(out_dir))}/dynamic.{{csv,json,md}}")
    _fail_with([f"{r.planner} phase {r.phase}: {r.error}" for r in rows if r.error])


def _checked_out_dir(out_dir: str, names: tuple[str, ...]) -> Path:
    """The --out directory, checked before the run so that one the files cannot go to fails at
    once rather than after it: a directory, or a name one can be created under, that takes
    new files (a dangling symlink, which mkdir cannot follow, is refused), where none of the
    files `names` the run writes is one the swap would refuse (a directory, a read-only file:
    `_swap_in`). Not '-', which is stdout to every other command: a directory of files cannot
    be; not '', which would be the working directory."""
    if out_dir == "-":
        raise SpindleError("--out -: bench writes a directory of files, which cannot go to "
                           "stdout (give a directory)")
    if not out_dir:
        raise SpindleError("--out '': an empty directory name (give a directory)")
    target = Path(out_dir)
    if target.is_symlink() and not target.exists():
        raise SpindleError(f"--out {out_dir}: a symlink to {os.readlink(target)!r}, which "
                           "does not exist")
    if target.exists() and not target.is_dir():
        raise SpindleError(f"--out {out_dir}: exists and is not a directory")
    check_parent(f"--out {out_dir}", target.parent)
    check_can_create(f"--out {out_dir}", target if target.exists() else target.parent)
    for name in names:
        _replaced(target, name)
    return target


@click.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print the rows as one JSON list (with --dynamic, an object: the phases' "
                   "rows and each planner's totals).")
@click.option("--out", "out_dir", default=None, metavar="DIR",
              help="Write CSV, JSON, markdown and PNG charts into DIR (created if missing, in "
                   "a directory that exists).")
@click.option("--quick", is_flag=True, help="Three configurations instead of the whole matrix.")
@click.option("--dynamic", is_flag=True,
              help="Run the dynamic task-set schedule instead of the matrix.")
@click.option("--schedule", default=None, metavar="SETS",
              help=f"With --dynamic: {lib.DYNAMIC_MODEL}'s task sets in the order they follow "
              f"each other, comma-separated (default: {','.join(lib.DYNAMIC_SCHEDULE)}).")
@click.option("--models-dir", default="models", show_default=True, metavar="DIR",
              help="Model specs.")
@click.option("--clusters-dir", default="clusters", show_default=True, metavar="DIR",
              help="Cluster specs.")
def bench(as_json: bool, out_dir: str | None, quick: bool, dynamic: bool, schedule: str | None,
          models_dir: str, clusters_dir: str) -> None:
    """Reproduce the paper's evaluation on simulated a800 clusters.

    Exit 1 when some configuration could not be planned: its rows say why, a 'failed:' line
    on stderr names each, and the other rows, tables and files are complete."""
    target = (None if out_dir is None else
              _checked_out_dir(out_dir, DYNAMIC_FILES if dynamic else MATRIX_FILES))
    for flag, given in (("--models-dir", models_dir), ("--clusters-dir", clusters_dir)):
        if not Path(given).is_dir():
            raise SpindleError(f"{flag} {given}: " + (
                "is not a directory" if Path(given).exists() else "no such directory"))
    if dynamic:
        if quick:
            raise SpindleError("--quick applies to the matrix, not to --dynamic")
        sets = (lib.DYNAMIC_SCHEDULE if schedule is None
                else tuple(x.strip() for x in schedule.split(",")))
        if "" in sets:
            raise SpindleError(f"--schedule {schedule!r}: an empty task set name (give names "
                               "separated by commas, such as 4,7,10,7)")
        _run_dynamic(models_dir, clusters_dir, sets, as_json, target)
    else:
        if schedule is not None:
            raise SpindleError("--schedule applies to --dynamic, not to the matrix")
        _run_matrix(models_dir, clusters_dir, quick, as_json, target)
