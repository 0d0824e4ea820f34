"""`spindle bench`: JSON rows, files written to --out, one-line errors. The matrix is cut
down to one tiny configuration (monkeypatched) so the command runs in seconds."""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import shutil
import signal
import stat
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner

from spindle_cli.cli import main
from spindle_cli.errors import SpindleError
from spindle_cli.planner import bench as lib

REPO = Path(__file__).resolve().parents[2]
TINY = lib.BenchConfig(model="tiny-clip", task_set="2", num_tasks=2, num_devices=8)
ROW_KEYS = ("model", "num_tasks", "num_devices", "planner", "iteration_ms",
            "speedup_vs_sequential", "lower_bound_ms", "transfer_fraction", "plan_seconds")


def run(args: list[str]):
    @click.command(context_settings={"ignore_unknown_options": True})
    @click.argument("argv", nargs=-1, type=click.UNPROCESSED)
    def entry(argv):
        main(list(argv))

    return CliRunner().invoke(entry, args, catch_exceptions=False)


@pytest.fixture
def tiny_matrix(monkeypatch):
    monkeypatch.setattr(lib, "matrix", lambda quick=False: [TINY])


def repo_dirs() -> list[str]:
    return ["--models-dir", str(REPO / "models"), "--clusters-dir", str(REPO / "clusters")]


def test_json_is_a_list_of_rows(tiny_matrix):
    res = run(["bench", "--json", *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["planner"] for r in rows] == [p for p, _ in lib.VARIANTS] + [lib.OPTIMUM]
    for r in rows:
        for key in ROW_KEYS:
            assert key in r, key
        assert (r["model"], r["num_tasks"], r["num_devices"]) == ("tiny-clip", 2, 8)
        # the forward's waits for all-gathers are a part of the sync
        if r["sync_ms"] is not None:
            assert 0 <= r["gather_wait_ms"] <= r["sync_ms"] + 1e-9
    assert "bench: tiny-clip" in res.stderr  # progress goes to stderr



def test_a_configuration_that_cannot_be_planned_fails_the_bench(monkeypatch, tmp_path):
    """Its rows say why, the other configurations go on, and the bench exits 1 naming each
    failed row on stderr (CI gates on it): a cluster too small for every MetaOp aborted the
    whole bench with a hint about options bench does not have, and a planner that failed a
    configuration exited 0 with a 'failed:' line among the tables."""
    on16 = lib.BenchConfig(model="tiny-clip", task_set="2", num_tasks=2, num_devices=16)
    monkeypatch.setattr(lib, "matrix", lambda quick=False: [TINY, on16])
    clusters = tmp_path / "clusters"
    shutil.copytree(REPO / "clusters", clusters)
    small = clusters / "a800-1x8.yaml"
    data = yaml.safe_load(small.read_text())
    # below what one layer of the tiny model needs under every memory setting
    data["device"]["memory_bytes"] = 2**14
    small.write_text(yaml.safe_dump(data))
    res = run(["bench", "--json", "--models-dir", str(REPO / "models"),
               "--clusters-dir", str(clusters)])
    assert res.exit_code == 1, res.stderr
    rows = json.loads(res.stdout)
    failed = [r for r in rows if r["error"]]
    assert {r["num_devices"] for r in failed} == {8}
    assert len(failed) == len(lib.VARIANTS) + 1  # and the optimum
    assert all(r["iteration_ms"] for r in rows if r["num_devices"] == 16)
    said = [ln for ln in res.stderr.splitlines() if ln.startswith("failed: tiny-clip 2 tasks @8 ")]
    assert len(said) == len(failed)
    assert res.stderr.splitlines()[-1] == f"error: {len(failed)} of the bench's rows failed (above)"

def test_tables_on_stdout(tiny_matrix):
    res = run(["bench", *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    assert "speedup over sequential" in res.stdout and "tiny-clip" in res.stdout


def test_out_dir_gets_csv_json_markdown_and_charts(tiny_matrix, tmp_path):
    out = tmp_path / "bench"
    res = run(["bench", "--out", str(out), "--json", *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    rows = json.loads((out / "bench.json").read_text())
    assert rows == json.loads(res.stdout)
    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [r["planner"] for r in table] == [r["planner"] for r in rows]
    md = (out / "bench.md").read_text()
    assert "| tiny-clip | 2 | 8 |" in md
    # the detail table's transfer shares: island, the same waves placed naively, replanned
    detail = md.split("inter-wave transfer share")[1].split("\n## ")[0]
    header = next(line for line in detail.splitlines() if line.startswith("| model"))
    cells = next(line for line in detail.splitlines() if line.startswith("| tiny-clip"))
    shares = dict(zip(header.split(" | "), cells.split(" | "), strict=True))
    island = next(r for r in rows if (r["planner"], r["placement"]) == ("spindle", "island"))
    assert shares["seq-place, same waves"] == f"{100 * island['naive_transfer_fraction']:.1f}%"
    executed = md.split("as `spindle run` executes them")[1]
    assert executed.count("| tiny-clip | 2 | 8 |") == 1 and " *" in executed
    for name in ("fig8_speedup.png", "fig10_transfer.png", "fig11_gap.png",
                 "fig12_plan_time.png", "gantt.png", "utilization.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG"), name


def test_papers_naive_share_is_beside_the_same_waves_in_json_csv_and_markdown(
        tiny_matrix, tmp_path, monkeypatch):
    from spindle_cli.planner import paper_numbers

    monkeypatch.setitem(paper_numbers.FIG10_TRANSFER_SHARE, ("tiny-clip", 2, 8), (0.01, 0.05))
    out = tmp_path / "bench"
    res = run(["bench", "--out", str(out), "--json", *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    rows = json.loads(res.stdout)
    island = next(r for r in rows if (r["planner"], r["placement"]) == ("spindle", "island"))
    paper = island["paper_naive_transfer_share"]
    assert paper == paper_numbers.transfer_share("tiny-clip", 2, 8, "sequential")
    assert all(r["paper_transfer_share"] is None for r in rows if r is not island)
    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    (csv_island,) = [r for r in table if (r["planner"], r["placement"]) == ("spindle", "island")]
    assert float(csv_island["paper_naive_transfer_share"]) == paper
    detail = (out / "bench.md").read_text().split("inter-wave transfer share")[1]
    header = next(line for line in detail.splitlines() if line.startswith("| model"))
    cells = next(line for line in detail.splitlines() if line.startswith("| tiny-clip"))
    shares = dict(zip(header.split(" | "), cells.split(" | "), strict=True))
    assert shares["seq-place, same waves"] == (
        f"{100 * island['naive_transfer_fraction']:.1f}% ({100 * paper:.1f}%)")


def test_an_interrupted_run_leaves_the_previous_set_whole(tiny_matrix, tmp_path, monkeypatch):
    from spindle_cli.cli import bench as command

    out = tmp_path / "bench"
    assert run(["bench", "--out", str(out), *repo_dirs()]).exit_code == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert {"bench.json", "bench.md", "gantt.png"} <= set(before)

    def interrupted(*args):
        raise KeyboardInterrupt  # after the tables and bar charts, before the Gantt chart

    gantt = command._gantt
    monkeypatch.setattr(command, "_gantt", interrupted)
    res = run(["bench", "--out", str(out), *repo_dirs()])
    assert res.exit_code != 0
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    monkeypatch.setattr(command, "_gantt", gantt)
    assert run(["bench", "--out", str(out), *repo_dirs()]).exit_code == 0
    after = {f.name: f.read_bytes() for f in out.iterdir()}
    assert set(after) == set(before) == set(command.MATRIX_FILES)
    # the planning times differ from run to run: the new set is in place
    assert after["bench.json"] != before["bench.json"]
    # a run that cannot draw the Gantt chart leaves no earlier run's chart beside its tables
    monkeypatch.setattr(command, "_gantt", lambda *args: None)
    assert run(["bench", "--out", str(out), *repo_dirs()]).exit_code == 0
    assert set(command.MATRIX_FILES) - {f.name for f in out.iterdir()} == {
        "gantt.png", "utilization.png"}


def test_dynamic_reports_each_planner(monkeypatch, tmp_path):
    monkeypatch.setattr(lib, "DYNAMIC_MODEL", "tiny-clip")
    monkeypatch.setattr(lib, "DYNAMIC_SCHEDULE", ("2", "2"))
    monkeypatch.setattr(lib, "DYNAMIC_DEVICES", 8)
    res = run(["bench", "--dynamic", "--json", "--out", str(tmp_path / "d"), *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    report = json.loads(res.stdout)
    assert json.loads((tmp_path / "d" / "dynamic.json").read_text()) == report
    rows = report["phases"]
    assert {r["planner"] for r in rows} == {"spindle", "sequential", "optimus", "distmm"}
    assert all(r["phase_ms"] == pytest.approx(r["iterations"] * r["iteration_ms"])
               for r in rows if not r["error"])
    # each planner's totals, as the table shows them, without adding up the phases
    totals = {t["planner"]: t for t in report["totals"]}
    assert set(totals) == {r["planner"] for r in rows}
    assert totals["spindle"]["total_s"] is not None
    for planner, t in totals.items():
        mine = [r for r in rows if r["planner"] == planner]
        assert t["replan_s"] == pytest.approx(sum(r["replan_seconds"] or 0.0 for r in mine))
        if all(r["phase_ms"] is not None for r in mine):
            assert t["train_s"] == pytest.approx(sum(r["phase_ms"] for r in mine) / 1e3)
            assert t["total_s"] == pytest.approx(t["train_s"] + t["replan_s"])
    table = (tmp_path / "d" / "dynamic.md").read_text()
    # titled like the terminal's table: what ran where, for how long
    iterations = rows[0]["iterations"]
    assert table.startswith(f"## Dynamic task sets: tiny-clip on a800-1x8, {iterations} "
                            f"iteration{'s' * (iterations != 1)} per phase\n\n| planner |")
    assert "replanning s" in table and "Spindle ahead from" in table
    assert totals["spindle"]["spindle_ahead_beyond"] is None
    for t in totals.values():
        if t["spindle_ahead_beyond"] is not None:
            k = math.floor(t["spindle_ahead_beyond"]) + 1
            assert f"| {k} iteration{'s' * (k != 1)} per phase |" in table


def test_missing_models_dir_is_a_one_line_error(tiny_matrix, tmp_path):
    out = tmp_path / "bench"
    res = run(["bench", "--out", str(out), "--models-dir", str(tmp_path / "nowhere"),
               "--clusters-dir", str(REPO / "clusters")])
    assert res.exit_code == 2
    assert res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1
    assert res.stderr == f"error: --models-dir {tmp_path / 'nowhere'}: no such directory\n"
    assert not out.exists()


def test_out_that_is_a_file_is_a_user_error(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    res = run(["bench", "--out", str(target)])
    assert res.exit_code == 2 and "not a directory" in res.stderr
    res = run(["bench", "--out", str(target / "sub")])
    assert res.exit_code == 2
    assert res.stderr == f"error: --out {target / 'sub'}: {str(target)!r} is not a directory\n"
    assert target.read_text() == "x"


@pytest.fixture
def no_run(monkeypatch):
    """A bench run fails the test: what is refused must be refused before the run."""

    def ran(*args, **kwargs):
        raise AssertionError("bench ran before refusing its --out")

    monkeypatch.setattr(lib, "run_config", ran)
    monkeypatch.setattr(lib, "run_dynamic", ran)


@pytest.mark.parametrize("mode", ["--quick", "--dynamic"])
def test_out_that_is_a_dangling_symlink_is_refused_before_the_run(no_run, tmp_path, mode):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "dir")
    res = run(["bench", mode, "--out", str(link)])
    assert res.exit_code == 2, res.stderr
    assert res.stderr == (f"error: --out {link}: a symlink to {str(tmp_path / 'nowhere' / 'dir')!r}"
                          ", which does not exist\n")
    assert link.is_symlink() and not link.exists()


def test_out_to_stdout_is_refused_before_the_run(no_run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(["bench", "--quick", "--out", "-"])
    assert res.exit_code == 2, res.stderr
    assert res.stderr == ("error: --out -: bench writes a directory of files, which cannot go "
                          "to stdout (give a directory)\n")
    assert list(tmp_path.iterdir()) == []


def test_out_where_no_file_can_be_created_is_refused_before_the_run(no_run):
    # os.access says yes to root in /proc; creating a file there fails
    res = run(["bench", "--quick", "--out", "/proc/nope"])
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith("error: --out /proc/nope: cannot write in '/proc'")
    assert len(res.stderr.splitlines()) == 1


def test_out_refusing_the_files_meanwhile_is_a_one_line_error(tmp_path):
    from spindle_cli.cli import bench as command

    # the parent of --out removed during the run
    with pytest.raises(SpindleError, match="gone/out: cannot write: No such file or directory"):
        with command._staged(tmp_path / "gone" / "out", ()):
            pass
    # a directory where the run's file goes: the staged files are removed, nothing is lost
    out = tmp_path / "out"
    (out / "bench.json").mkdir(parents=True)
    (out / "bench.csv").write_text("old")
    with pytest.raises(SpindleError, match=r"out: cannot write bench.json: Is a directory"):
        with command._staged(out, command.MATRIX_FILES) as staging:
            (staging / "bench.json").write_text("new")
    assert sorted(f.name for f in out.iterdir()) == ["bench.csv", "bench.json"]
    assert (out / "bench.csv").read_text() == "old"


def test_a_directory_in_the_way_stops_the_swap_before_any_file_moves(tmp_path):
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    (out / "bench.md").mkdir(parents=True)
    (out / "bench.csv").write_text("old csv")
    (out / "gantt.png").write_text("old chart")
    with pytest.raises(SpindleError, match=r"out: cannot write bench.md: Is a directory$"):
        with command._staged(out, command.MATRIX_FILES) as staging:
            for name in ("bench.csv", "bench.json", "bench.md"):
                (staging / name).write_text("new")
    assert sorted(f.name for f in out.iterdir()) == ["bench.csv", "bench.md", "gantt.png"]
    assert (out / "bench.csv").read_text() == "old csv"
    assert (out / "gantt.png").read_text() == "old chart"


def test_the_swapped_files_keep_their_modes_and_a_read_only_one_stops_the_swap(tmp_path):
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    out.mkdir()
    for name, mode in (("bench.csv", 0o600), ("bench.json", 0o640)):
        (out / name).write_text(f"old {name}")
        (out / name).chmod(mode)
    with command._staged(out, command.MATRIX_FILES) as staging:
        for name in ("bench.csv", "bench.json", "bench.md"):
            (staging / name).write_text(f"new {name}")
    assert stat.S_IMODE((out / "bench.csv").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "bench.json").stat().st_mode) == 0o640
    assert (out / "bench.csv").read_text() == "new bench.csv"
    (out / "bench.md").chmod(0o444)
    with pytest.raises(SpindleError, match=r"out/bench.md: cannot write: read-only file$"):
        with command._staged(out, command.MATRIX_FILES) as staging:
            for name in ("bench.csv", "bench.json", "bench.md"):
                (staging / name).write_text("newer")
    assert sorted(p.name for p in out.iterdir()) == ["bench.csv", "bench.json", "bench.md"]
    assert all(p.read_text().startswith("new ") for p in out.iterdir())


def test_a_rename_failing_midway_puts_the_previous_files_back(tmp_path, monkeypatch):
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    out.mkdir()
    for name in ("bench.csv", "bench.json", "bench.md", "gantt.png"):
        (out / name).write_text(f"old {name}")
    rename = os.rename

    def failing(src, dst):
        # the third new file refuses to move in, after two have replaced their namesakes
        if Path(src).name == "bench.md" and Path(src).parent.name.startswith(".staging-"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src), None, str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(SpindleError, match=r"out: cannot write bench.md: No space left on device$"):
        with command._staged(out, command.MATRIX_FILES) as staging:
            for name in ("bench.csv", "bench.json", "bench.md"):
                (staging / name).write_text(f"new {name}")
    # every previous file is back, gantt.png (not written this run) included; nothing new
    # and no hidden directory is left
    assert sorted(f.name for f in out.iterdir()) == [
        "bench.csv", "bench.json", "bench.md", "gantt.png"]
    for name in ("bench.csv", "bench.json", "bench.md", "gantt.png"):
        assert (out / name).read_text() == f"old {name}"


def test_previous_files_that_cannot_be_put_back_stay_where_the_error_says(tmp_path,
                                                                          monkeypatch):
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.csv").write_text("old csv")
    rename = os.rename

    def failing(src, dst):
        src, dst = Path(src), Path(dst)
        if (src.name == "bench.json" and src.parent.name.startswith(".staging-")) or (
                dst.parent == out and src.parent.name.startswith(".previous-")):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src), None, str(dst))
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(SpindleError) as e:
        with command._staged(out, command.MATRIX_FILES) as staging:
            (staging / "bench.csv").write_text("new")
            (staging / "bench.json").write_text("new")
    message = str(e.value)
    assert message.startswith(f"--out {out}: cannot write bench.json: Input/output error; "
                              "the previous files are in ")
    kept = Path(message.rsplit(" ", 1)[1])
    assert kept.parent == out and (kept / "bench.csv").read_text() == "old csv"


def test_ctrl_c_during_the_swap_arrives_once_the_set_is_whole(tmp_path, monkeypatch):
    # SIGINT sent to this process as the second new file moves in: it raised at once, with
    # the previous files aside and the new ones about to go with the staging directory
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    out.mkdir()
    for name in ("bench.csv", "bench.json", "bench.md"):
        (out / name).write_text(f"old {name}")
    rename = os.rename

    def interrupted(src, dst):
        rename(src, dst)
        if Path(dst).name == "bench.json" and Path(dst).parent == out:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with command._staged(out, command.MATRIX_FILES) as staging:
            for name in ("bench.csv", "bench.json", "bench.md"):
                (staging / name).write_text(f"new {name}")
    assert sorted(f.name for f in out.iterdir()) == ["bench.csv", "bench.json", "bench.md"]
    for name in ("bench.csv", "bench.json", "bench.md"):
        assert (out / name).read_text() == f"new {name}"


def test_a_swap_replaces_the_set_and_drops_an_earlier_runs_chart(tmp_path):
    from spindle_cli.cli import bench as command

    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.csv").write_text("old")
    (out / "gantt.png").write_text("old chart")
    (out / "notes.txt").write_text("mine")
    with command._staged(out, command.MATRIX_FILES) as staging:
        (staging / "bench.csv").write_text("new")
        (staging / "bench.json").write_text("new")
    assert sorted(f.name for f in out.iterdir()) == ["bench.csv", "bench.json", "notes.txt"]
    assert (out / "bench.csv").read_text() == "new"
    assert (out / "notes.txt").read_text() == "mine"


def test_quick_with_dynamic_is_refused():
    res = run(["bench", "--dynamic", "--quick"])
    assert res.exit_code == 2 and "--quick" in res.stderr


def test_a_model_without_the_task_set_bench_runs_is_a_one_line_error(tiny_matrix, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(REPO / "models", models)
    data = yaml.safe_load((models / "tiny-clip.yaml").read_text())
    data["task_sets"].pop(TINY.task_set)
    (models / "tiny-clip.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    res = run(["bench", "--models-dir", str(models), "--clusters-dir", str(REPO / "clusters")])
    assert res.exit_code == 2
    assert res.stderr.startswith(f"error: {models / 'tiny-clip.yaml'}: task_sets: no task set "
                                 f"{TINY.task_set!r}, which spindle bench runs")


def test_an_empty_out_is_refused_before_the_run(no_run, tmp_path, monkeypatch):
    # Path('') is the working directory: the files went into it
    monkeypatch.chdir(tmp_path)
    res = run(["bench", "--quick", "--out", ""])
    assert res.exit_code == 2, res.stderr
    assert res.stderr == "error: --out '': an empty directory name (give a directory)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("mode", "name"), [("--quick", "bench.csv"),
                                            ("--dynamic", "dynamic.md")])
def test_a_read_only_file_in_out_is_refused_before_the_run(no_run, tmp_path, mode, name):
    kept = tmp_path / name
    kept.write_text("kept\n")
    kept.chmod(0o444)
    res = run(["bench", mode, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.stderr
    assert res.stderr.startswith(f"error: {kept}: cannot write: read-only file\n")
    assert kept.read_text() == "kept\n"


def test_a_task_set_of_another_size_than_the_cell_is_refused(no_run, tiny_matrix, tmp_path):
    # its row would be labelled with the cell's count, beside the paper's numbers for it
    models = tmp_path / "models"
    shutil.copytree(REPO / "models", models)
    data = yaml.safe_load((models / "tiny-clip.yaml").read_text())
    data["task_sets"][TINY.task_set] = data["task_sets"][TINY.task_set][:1]
    (models / "tiny-clip.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    res = run(["bench", "--models-dir", str(models), "--clusters-dir", str(REPO / "clusters")])
    assert res.exit_code == 2, res.stderr
    assert res.stderr == (f"error: {models / 'tiny-clip.yaml'}: task_sets.{TINY.task_set}: "
                          f"1 tasks, where spindle bench runs the paper's 2\n")


@pytest.mark.parametrize("mode", ["--quick", "--dynamic"])
def test_a_cluster_of_another_size_than_the_cell_is_refused(no_run, tmp_path, mode):
    clusters = tmp_path / "clusters"
    shutil.copytree(REPO / "clusters", clusters)
    for spec in clusters.glob("a800-*.yaml"):
        data = yaml.safe_load(spec.read_text())
        data["num_nodes"] = 1
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
    res = run(["bench", mode, "--models-dir", str(REPO / "models"),
               "--clusters-dir", str(clusters)])
    assert res.exit_code == 2, res.stderr
    assert len(res.stderr.splitlines()) == 1
    assert res.stderr.startswith(f"error: {clusters}/a800-")
    assert ": num_nodes: 1 x 8 = 8 devices, where spindle bench runs " in res.stderr


def test_dynamic_runs_the_schedule_given(monkeypatch):
    monkeypatch.setattr(lib, "DYNAMIC_MODEL", "tiny-clip")
    monkeypatch.setattr(lib, "DYNAMIC_DEVICES", 8)
    res = run(["bench", "--dynamic", "--json", "--schedule", "2", *repo_dirs()])
    assert res.exit_code == 0, res.stderr
    phases = json.loads(res.stdout)["phases"]
    assert {(r["phase"], r["task_set"]) for r in phases} == {(0, "2")}
    assert "task sets 2 on a800-1x8" in res.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["--schedule", "4,7"], "--schedule applies to --dynamic, not to the matrix"),
    (["--dynamic", "--schedule", "4,,7"], "--schedule '4,,7': an empty task set name"),
    (["--dynamic", "--schedule", "4,99"], "task_sets: no task set '99', which spindle bench runs"),
])
def test_a_bad_schedule_is_refused_before_the_run(no_run, args, said):
    res = run(["bench", *args, *repo_dirs()])
    assert res.exit_code == 2, res.stderr
    assert said in res.stderr and len(res.stderr.splitlines()) == 1
