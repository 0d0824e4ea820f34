"""`spindle validate` and `spindle show` on every kind they can see."""

from __future__ import annotations

import copy
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.table import Table

from spindle_cli.artifacts import ModelSpec, input_ref, load, load_artifact, write_artifact
from spindle_cli.cli import cli
from spindle_cli.cli._console import out
from spindle_cli.cli.views import fmt_count, print_table
from spindle_cli.planner.costs import module_params
from spindle_cli.planner.graph import build_graph

REPO = Path(__file__).resolve().parents[2]
# the shipped artifacts and the golden plans' cases (tests/planner/test_api.py regenerates
# those from the current code, so they stay valid too)
COMMITTED = sorted(
    p for folder in ("models", "clusters", "graphs", "profiles", "plans", "tests/data")
    for p in (REPO / folder).rglob("*") if p.suffix in (".yaml", ".yml", ".json")
)


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def files(small_model_data, cluster_data, tmp_path, monkeypatch) -> dict[str, str]:
    """A model, a cluster (as JSON) and a graph, under short relative names."""
    monkeypatch.chdir(tmp_path)
    Path("m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    Path("c.json").write_text(json.dumps(cluster_data))
    model = load("m.yaml", ModelSpec)
    write_artifact(build_graph(model, inputs=[input_ref(model, "m.yaml")]), "g.yaml")
    return {"model": "m.yaml", "cluster": "c.json", "metaop_graph": "g.yaml"}


def test_validate_reports_each_file_and_kind(files):
    result = _invoke("validate", *files.values())
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.splitlines() == [f"ok {path} ({kind})" for kind, path in files.items()]


def test_show_model_lists_modules_params_and_tasks(files, small_model_data):
    result = _invoke("show", files["model"])
    assert result.exit_code == 0, result.stderr
    model = load(files["model"], ModelSpec)
    total = sum(module_params(m) for m in model.modules.values())
    assert f"total parameters: {fmt_count(total)} ({total:,})" in result.stdout
    for name, module in model.modules.items():
        row = next(line for line in result.stdout.splitlines() if f" {name} " in line)
        assert module.kind in row and fmt_count(module_params(module)) in row
    task_rows = [line for line in result.stdout.splitlines() if " pairs_big " in line]
    assert task_rows and " 8 " in task_rows[0]  # batch size of pairs_big
    assert "task set one: pairs" in result.stdout


def test_show_cluster_prints_sizes_and_bandwidths(files):
    result = _invoke("show", files["cluster"])
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "8 = 2 nodes x 4" in text
    assert "4 of 2 devices" in text
    assert "16.0 GiB" in text
    assert "100.0 GB/s (800 Gb/s)" in text  # intra-island
    # inter-node: the file's per-device figure, and the node's link it is a share of
    assert "12.5 GB/s (100 Gb/s) per device, 50.0 GB/s (400 Gb/s) per node" in text
    one_node = _invoke("show", str(Path(__file__).resolve().parents[2] / "clusters" /
                                   "local-cpu.yaml"))
    assert "4 = 1 node x 4" in one_node.stdout


def test_spindle_alone_prints_its_help_not_an_error():
    proc = subprocess.run([sys.executable, "-m", "spindle_cli"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("Usage: spindle [OPTIONS] COMMAND [ARGS]...")
    assert "Commands:" in proc.stderr
    assert not any(line.startswith("error") for line in proc.stderr.splitlines())


def test_help_lists_the_exit_codes_the_readme_gives():
    """A CI user reading `spindle --help` learns the exit codes (only diff, validate and
    --check named theirs)."""
    shown = _invoke("--help").stdout
    listed = re.findall(r"^ +(\d+) ", shown.split("Exit codes")[1], re.MULTILINE)
    table = (REPO / "README.md").read_text().split("### Exit codes")[1].split("\n\n")[1]
    documented = re.findall(r"^\| (\d+) \|", table, re.MULTILINE)
    assert listed == sorted(set(documented), key=int) == ["0", "1", "2", "123", "130"]


def test_show_graph_lists_metaops_by_level(files):
    result = _invoke("show", files["metaop_graph"])
    assert result.exit_code == 0, result.stderr
    graph = load_artifact(files["metaop_graph"])
    lines = result.stdout.splitlines()
    row_of = {m.id: next(i for i, line in enumerate(lines) if f" {m.id} " in line)
              for m in graph.metaops}
    for m in graph.metaops:
        for p in m.predecessors:
            assert row_of[p] < row_of[m.id], (p, m.id)
    enc = graph.metaop("pairs/text_enc")
    row = lines[row_of[enc.id]]
    assert f" {enc.num_layers} " in row and f"{enc.flops_per_layer / 1e9:.3g}" in row
    assert f"{len(graph.metaops)} MetaOps on {graph.num_levels} MetaLevels" in result.stdout


@pytest.mark.parametrize("path", COMMITTED, ids=[str(p.relative_to(REPO)) for p in COMMITTED])
def test_validate_and_show_every_committed_artifact(path):
    checked = _invoke("validate", str(path))
    assert checked.exit_code == 0, checked.stderr
    assert "not checked" not in checked.stderr  # its recorded inputs were found
    shown = _invoke("show", str(path))
    assert shown.exit_code == 0, shown.stderr
    assert shown.stdout.strip()


@pytest.fixture
def tiny_plan(tmp_path, monkeypatch) -> Path:
    """The committed tiny-clip plan and its inputs, at the paths the plan records."""
    monkeypatch.chdir(tmp_path)
    return _copied("plans/tiny-clip-local-cpu.yaml", "graphs/tiny-clip.yaml",
                   "profiles/tiny-clip-local-cpu.yaml", "clusters/local-cpu.yaml",
                   "models/tiny-clip.yaml")


def _copied(plan: str, *inputs: str) -> Path:
    """A committed plan and its inputs, at the paths the plan records, in the working
    directory."""
    for name in (plan, *inputs):
        Path(name).parent.mkdir(exist_ok=True)
        Path(name).write_text((REPO / name).read_text())
    return Path(plan)


@pytest.mark.parametrize("continuation", [False, True])
def test_a_transfer_from_a_slice_that_does_not_end_where_its_consumer_needs_is_refused(
        tmp_path, monkeypatch, spindle, continuation):
    """Each transfer came from some slice of the right MetaOp in an earlier wave: one edited to
    take a producer's output after a part of its operators, or a slice's input from an
    earlier part of its own MetaOp, validated, and the executor sends the slice it names."""
    monkeypatch.chdir(tmp_path)
    plan = _copied("plans/multitask-clip-4-a800-2x8.yaml", "graphs/multitask-clip-4.yaml",
                   "profiles/multitask-clip-a800-8x8.yaml", "clusters/a800-2x8.yaml",
                   "models/multitask-clip.yaml")
    assert spindle("validate", str(plan)).exit_code == 0
    data = yaml.safe_load(plan.read_text())
    slices = {s["id"]: s for w in data["waves"] for s in w["slices"]}
    for i, t in enumerate(data["transfers"]):
        src, dst = slices[t["src"]], slices[t["dst"]]
        if (src["metaop"] == dst["metaop"]) != continuation:
            continue
        earlier = [x for x in slices.values()
                   if x["metaop"] == src["metaop"] and x["last"] < src["last"]]
        if earlier:
            t["src"], t["src_ranks"] = earlier[0]["id"], earlier[0]["ranks"]
            edited = i
            break
    else:
        raise AssertionError("no transfer to retarget")
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(plan))
    assert result.exit_code == 2
    needs = dst["first"] - 1 if continuation else None
    assert result.stderr.startswith(f"error: {plan}: transfers[{edited}]: {t['dst']} needs the "
                                    f"output of {src['metaop']}'s operator "
                                    + (f"{needs}, " if needs is not None else "")), \
        result.stderr
    assert result.stderr.endswith(f", and {t['src']} runs its operators [{earlier[0]['first']}, "
                                  f"{earlier[0]['last']})\n")


def test_validate_checks_a_plan_against_its_inputs(tiny_plan, spindle):
    assert spindle("validate", str(tiny_plan)).stdout == f"ok {tiny_plan} (plan)\n"
    # a slice ending one operator early: the file is well-formed, the plan is not
    text = tiny_plan.read_text()
    data = yaml.safe_load(text)
    first = next(s for w in data["waves"] for s in w["slices"] if s["last"] - s["first"] > 1)
    first["last"] -= 1
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    assert result.stderr.startswith(
        f"error: {tiny_plan}: waves: MetaOp {first['metaop']}: operators")
    assert "not covered exactly once" in result.stderr
    # an input edited since: its sha256 no longer matches
    tiny_plan.write_text(text)
    graph = Path("graphs/tiny-clip.yaml")
    graph.write_text(graph.read_text().replace("model: tiny-clip", "model: tiny-clip-2", 1))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    assert "inputs[0].sha256: metaop_graph 'graphs/tiny-clip.yaml' changed" in result.stderr


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("zero", "7", "options.zero: '7' is not one of '0', '1', '2', '3'"),
    ("recompute", "yes", "options.recompute: 'yes' is not one of 'true', 'false'"),
    ("colour", "red", "options.colour: unknown option (expected one of planner, placement,"),
    ("planner", "optimus", "options.planner: 'optimus' differs from the plan's planner "
                           "'spindle'"),
])
def test_every_command_refuses_options_the_planner_does_not_write(tiny_plan, spindle, key,
                                                                  value, expected):
    data = yaml.safe_load(tiny_plan.read_text())
    data["options"][key] = value
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    for args in (["validate"], ["simulate"], ["show"], ["diff", str(tiny_plan)]):
        result = spindle(*args, str(tiny_plan))
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith(f"error: {tiny_plan}: {expected}")
        assert len(result.stderr.splitlines()) == 1


def test_every_command_refuses_a_planner_none_writes(tiny_plan, spindle):
    data = yaml.safe_load(tiny_plan.read_text())
    data["planner"] = "x"
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    for args in (["validate"], ["show"]):
        result = spindle(*args, str(tiny_plan))
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: {tiny_plan}: planner: 'x' is not one of "
                                        "'spindle', 'sequential', 'optimus', 'distmm'")


def _bump(path: str) -> Callable[[dict], str]:
    """An edit of the number at `path` (dots; list indices as numbers); returns the field."""
    def edit(data: dict) -> str:
        *head, last = path.split(".")
        node = data
        for key in head:
            node = node[int(key)] if key.isdigit() else node[key]
        node[last] = node[last] * 2 + 1
        return path
    return edit


_SLICE_NUMBER_EDITS = pytest.mark.parametrize(("edit", "expected"), [
    (_bump("memory.0.param_bytes"), "memory[0].param_bytes: recorded "),
    (_bump("waves.0.duration_ms"), "waves[0].duration_ms: recorded "),
    (_bump("waves.1.start_ms"), "waves[1].start_ms: recorded "),
    (_bump("estimated_iteration_ms"), "estimated_iteration_ms: recorded "),
    (_bump("levels.0.estimated_ms"), "levels[0].estimated_ms: recorded "),
    (_bump("transfers.0.bytes"), "transfers[0].bytes: recorded "),
    (_bump("param_groups.0.bytes"), "param_groups[0].bytes: recorded "),
    (_bump("lower_bound_ms"), "lower_bound_ms: recorded "),
    # it was reported as its level's estimate (a review's fuzzing)
    (_bump("waves.0.level"), "waves[0].level: recorded 1, but its slices' lowest MetaLevel "
                             "is 0"),
], ids=["memory", "duration", "start", "iteration", "level", "transfer", "group",
        "lower-bound", "wave-level"])
"""Edits of a number the slices imply, with the start of the error each gives."""


@_SLICE_NUMBER_EDITS
def test_validate_refuses_numbers_the_slices_do_not_imply(tiny_plan, spindle, edit, expected):
    # the executor refuses a rank by its recorded memory; show prints the rest
    data = yaml.safe_load(tiny_plan.read_text())
    edit(data)
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2, result.stderr
    assert result.stderr.startswith(f"error: {tiny_plan}: {expected}"), result.stderr
    assert "(edited since spindle plan wrote it?)" in result.stderr


@pytest.mark.torch
@_SLICE_NUMBER_EDITS
def test_run_refuses_numbers_the_slices_do_not_imply_before_it_launches(tiny_plan, spindle, edit,
                                                                        expected):
    data = yaml.safe_load(tiny_plan.read_text())
    edit(data)
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    dry = spindle("run", str(tiny_plan), "--dry-run")
    assert dry.exit_code == 2 and dry.stderr.startswith(f"error: {tiny_plan}: {expected}")


def _reversed(field: str) -> Callable[[dict], None]:
    def edit(data: dict) -> None:
        data[field].reverse()
    return edit


def _slices_swapped(data: dict) -> None:
    wave = next(w for w in data["waves"] if len(w["slices"]) > 1)
    wave["slices"][:2] = wave["slices"][1::-1]


@pytest.mark.parametrize(("edit", "expected"), [
    (_reversed("transfers"), r"transfers\[1\]: w\d+\.\d+ -> w\d+\.\d+ is out of canonical "
                             r"order \(by destination wave and slice"),
    (_reversed("param_groups"), r"param_groups\[1\]: \w+\[\d+:\] is out of order \(by "
                                r"module, then first layer\)"),
    (_slices_swapped, r"waves\[\d+\]\.slices\[0\]: id 'w\d+\.1' is not 'w\d+\.0' \(slices "
                      r"are numbered by wave and position\)"),
], ids=["transfers", "param_groups", "slices"])
def test_validate_refuses_a_plan_listed_out_of_order(tiny_plan, spindle, edit, expected):
    # the same plan, listed in another order: spindle diff called it different ('other
    # fields differ'), and validate passed it
    data = yaml.safe_load(tiny_plan.read_text())
    edit(data)
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    assert re.match(rf"error: {tiny_plan}: {expected}", result.stderr), result.stderr


def test_islands_that_are_not_the_clusters_are_refused(tiny_plan, spindle):
    """A plan keeps each tensor-parallel group inside one of its islands: islands that are not
    the cluster's would let one span two real ones."""
    data = yaml.safe_load(tiny_plan.read_text())
    assert data["islands"] == [[0, 1, 2, 3]]
    data["islands"] = [[0, 1], [2, 3]]
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    for command in ("validate", "simulate"):
        result = spindle(command, str(tiny_plan))
        assert result.exit_code == 2, result.stderr
        assert result.stderr.startswith(f"error: {tiny_plan}: islands: the plan's NVLink "
                                        "islands are not its cluster's")


def test_a_wave_without_slices_and_an_unknown_input_kind_are_clean_errors(tiny_plan, spindle):
    data = yaml.safe_load(tiny_plan.read_text())
    last = data["waves"][-1]
    data["waves"].append({**last, "index": last["index"] + 1, "slices": [],
                          "start_ms": last["start_ms"] + last["duration_ms"]})
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {tiny_plan}: waves[{last['index'] + 1}]."
                                    "duration_ms: recorded ")
    data["waves"].pop()
    data["inputs"][0]["kind"] = "foo"
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    assert result.stderr == (f"error: {tiny_plan}: inputs[0].kind: expected one of "
                             "metaop_graph, profile, cluster (what a plan is made from), got "
                             "'foo'\n")



@pytest.mark.parametrize("command", ["validate", "simulate", "show", "explain"])
def test_inputs_whose_kinds_were_swapped_are_bad_input(tiny_plan, spindle, command):
    # the graph's and the profile's kinds swapped in a plan: each file was found by its
    # sha256 and then asserted to be of the recorded kind, an internal error (exit 123)
    data = yaml.safe_load(tiny_plan.read_text())
    graph, profile = data["inputs"][0], data["inputs"][1]
    graph["kind"], profile["kind"] = profile["kind"], graph["kind"]
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    args = [command, str(tiny_plan)] + (["text_audio/audio_embed"] if command == "explain"
                                        else [])
    result = spindle(*args)
    if command == "show":  # a summary notes what it cannot read and goes on
        assert result.exit_code == 0, result.stderr
        assert f"note: {tiny_plan}: inputs[0].kind: a profile input recorded, but " \
               "'graphs/tiny-clip.yaml' is a metaop_graph" in result.stderr
        return
    assert result.exit_code == 2, result.stderr
    # whichever input the command reads first; the hint names the file to fix first
    assert result.stderr.splitlines() in (
        [f"error: {tiny_plan}: inputs[0].kind: a profile input recorded, but "
         "'graphs/tiny-clip.yaml' is a metaop_graph",
         f"hint: put the profile {tiny_plan} was made from back at 'graphs/tiny-clip.yaml', "
         f"or regenerate {tiny_plan}"],
        [f"error: {tiny_plan}: inputs[1].kind: a metaop_graph input recorded, but "
         "'profiles/tiny-clip-local-cpu.yaml' is a profile",
         f"hint: put the metaop_graph {tiny_plan} was made from back at "
         f"'profiles/tiny-clip-local-cpu.yaml', or regenerate {tiny_plan}"])


def test_an_input_of_a_kind_an_artifact_is_not_made_from_is_refused(tiny_plan, tmp_path,
                                                                     spindle):
    # a graph recording a plan as its input: profile, plan and show took it and wrote on
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "graphs" / "tiny-clip.yaml").read_text())
    data["inputs"][0]["kind"] = "plan"
    graph = tmp_path / "g.yaml"
    graph.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("show", str(graph))
    assert result.exit_code == 2
    assert result.stderr == (f"error: {graph}: inputs[0].kind: expected one of model (what a "
                             "metaop graph is made from), got 'plan'\n")


@pytest.mark.parametrize(("islands", "problem"), [
    ([[]], "islands[0]: an empty island"),
    ([[-1, 0, 1, 2, 3]], "islands[0]: rank -1 is not one of the plan's ranks 0-3"),
    ([[0, 1], [1, 2, 3]], "islands[1]: rank 1 is in another island too"),
    ([[0, 1, 3]], "islands: rank 2 is in no island"),
])
@pytest.mark.parametrize("command", ["validate", "diff"])
def test_islands_that_do_not_hold_every_rank_once_are_refused(tiny_plan, spindle, islands,
                                                               problem, command):
    # `islands: [[]]` loaded, and diff and --check ended in an IndexError (exit 123)
    data = yaml.safe_load(tiny_plan.read_text())
    data["islands"] = islands
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    args = [str(tiny_plan)] * (2 if command == "diff" else 1)
    result = spindle(command, *args)
    assert result.exit_code == 2
    assert result.stderr == f"error: {tiny_plan}: {problem}\n"


@pytest.mark.parametrize("repeat", [False, True])
def test_a_plans_levels_are_listed_once_each_in_order(tiny_plan, spindle, repeat):
    """As the planner writes them: a level listed twice loaded, and explain read the first
    entry's figures; swapped levels loaded too."""
    data = yaml.safe_load(tiny_plan.read_text())
    levels = data["levels"]
    assert len(levels) > 1
    data["levels"] = ([levels[0], *levels] if repeat else [levels[1], levels[0], *levels[2:]])
    tiny_plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(tiny_plan))
    assert result.exit_code == 2
    first, second = (0, 0) if repeat else (1, 0)
    assert result.stderr == (f"error: {tiny_plan}: levels[1].level: {second} after {first}: "
                             "each level once, in ascending order\n")


def test_a_plan_records_each_of_its_inputs_once(tiny_plan, spindle):
    """simulate and run read a plan's graph, profile and cluster: validate refuses a plan
    that records none of one (it said ok), and every reader a second input of a kind, which
    they passed over unread."""
    data = yaml.safe_load(tiny_plan.read_text())
    inputs = data["inputs"]
    for kept, expected in (([], "inputs: no metaop_graph input recorded"),
                           ([inputs[0], inputs[2]], "inputs: no profile input recorded")):
        tiny_plan.write_text(yaml.safe_dump({**data, "inputs": kept}, sort_keys=False))
        result = spindle("validate", str(tiny_plan))
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: {tiny_plan}: {expected} (a plan records ")
    second = {"kind": "cluster", "path": "clusters/a800-2x8.yaml", "sha256": "0" * 64}
    tiny_plan.write_text(yaml.safe_dump({**data, "inputs": [*inputs, second]}, sort_keys=False))
    for command in ("validate", "show", "simulate"):
        result = spindle(command, str(tiny_plan))
        assert result.exit_code == 2
        assert result.stderr == (f"error: {tiny_plan}: inputs[3].kind: a second 'cluster' "
                                 "input (one of each kind)\n")


def test_validate_checks_a_profile_against_its_graph(tiny_plan, spindle):
    """As spindle plan does: a curve whose batch is not its MetaOps' is refused."""
    profile = Path("profiles/tiny-clip-local-cpu.yaml")
    data = yaml.safe_load(profile.read_text())
    data["curves"][0]["batch_size"] += 4
    profile.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(profile))
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {profile}: curve ")
    assert f"batch_size {data['curves'][0]['batch_size']}, but MetaOp " in result.stderr


def _shorter_slice(data: dict) -> tuple[str, float]:
    """A slice of the plan that is not its wave's longest, made 1.5x longer (its wave is
    still as long): where it was, and its new time."""
    for w in data["waves"]:
        for si, s in enumerate(w["slices"]):
            if 1.5 * s["time_ms"] < w["duration_ms"]:
                s["time_ms"] *= 1.5
                return f"waves[{w['index']}].slices[{si}].time_ms", s["time_ms"]
    raise AssertionError("every slice is its wave's longest")


def test_simulate_and_explain_note_what_validate_refuses(tiny_plan, spindle):
    """They read the plan's numbers and its slices' times: where its recorded numbers are not
    its slices' (its estimate, a slice's time by the profile), which validate and run refuse,
    they say so and go on (a what-if on an edited plan), where simulate printed the edited
    estimate as the plan's without a word."""
    data = yaml.safe_load(tiny_plan.read_text())
    metaop = data["waves"][0]["slices"][0]["metaop"]
    edited = {**copy.deepcopy(data), "estimated_iteration_ms": data["estimated_iteration_ms"] * 0.9}
    where, ms = _shorter_slice(data)
    # run checks the recorded numbers; it reads no profile, so not a slice's time
    for plan, field, recorded, refusing in (
            (edited, "estimated_iteration_ms", edited["estimated_iteration_ms"],
             "validate and run refuse it"), (data, where, ms, "validate refuses it")):
        tiny_plan.write_text(yaml.safe_dump(plan, sort_keys=False))
        said = f"{tiny_plan}: {field}: recorded {recorded:g}, but "
        result = spindle("validate", str(tiny_plan))
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: {said}")
        # a slice's time moves where a spindle version reads the profile otherwise, too (a
        # --no-tensor-parallel plan of the version before curves were fitted again for it)
        assert ("or written by another version of spindle, which read the profile otherwise? "
                "`spindle plan --check` tells)" in result.stderr) == (field == where)
        for args in (("simulate", "--json"), ("explain", metaop)):
            result = spindle(args[0], str(tiny_plan), *args[1:])
            assert result.exit_code == 0, result.stderr
            assert result.stderr.startswith(f"note: {said}")
            assert result.stderr.endswith(f"; {refusing}\n")


@pytest.mark.parametrize("command", ["simulate", "show"])
def test_simulate_and_show_note_a_graph_whose_model_changed(tiny_plan, spindle, command):
    """A what-if on an edited model goes on, saying that validate and run refuse it (show said
    nothing)."""
    assert spindle(command, str(tiny_plan)).stderr == ""
    model = Path("models/tiny-clip.yaml")
    model.write_text(model.read_text().replace("ffn: 64", "ffn: 96", 1))
    result = spindle(command, str(tiny_plan))
    assert result.exit_code == 0, result.stderr
    assert result.stderr.startswith("note: graphs/tiny-clip.yaml: inputs[0].sha256: model "
                                    "'models/tiny-clip.yaml' changed since")
    assert result.stderr.endswith("validate and run refuse what is made from it\n")


def test_show_notes_a_plan_whose_inputs_changed(tiny_plan, spindle):
    """It said nothing (validate, simulate and run refuse or note such a plan), and called a
    changed graph not found."""
    assert spindle("show", str(tiny_plan)).stderr == ""
    cluster = Path("clusters/local-cpu.yaml")
    cluster.write_text(cluster.read_text().replace("name: local-cpu", "name: local-cpu-edited"))
    result = spindle("show", str(tiny_plan))
    assert result.exit_code == 0
    assert result.stderr == (f"note: {tiny_plan}: inputs[2].sha256: cluster "
                             "'clusters/local-cpu.yaml' changed since the plan was made (sha256 "
                             "mismatch)\n")
    graph = Path("graphs/tiny-clip.yaml")
    graph.write_text(graph.read_text() + "# edited\n")  # the same content: not a change
    assert spindle("show", str(tiny_plan)).stderr.count("note: ") == 1
    graph.write_text(graph.read_text().replace("batch_size: 8", "batch_size: 16"))
    result = spindle("show", str(tiny_plan))
    assert "no per-level gap: without the plan's graph (see the note above)" in result.stdout
    assert result.stderr.count("note: ") == 2
    graph.unlink()
    result = spindle("show", str(tiny_plan))
    assert "no per-level gap: without the plan's graph (not found)" in result.stdout

def test_validate_says_which_inputs_it_could_not_find(tiny_plan, spindle, tmp_path):
    alone = tmp_path / "elsewhere" / "p.yaml"
    alone.parent.mkdir()
    alone.write_text(tiny_plan.read_text())
    Path("profiles/tiny-clip-local-cpu.yaml").unlink()
    result = spindle("validate", "elsewhere/p.yaml")
    assert result.exit_code == 0, result.stderr
    # found from the working directory, as recorded, but for the profile
    assert result.stdout == ("ok elsewhere/p.yaml (plan; not checked against "
                             "profiles/tiny-clip-local-cpu.yaml: not found)\n")


def test_validate_says_a_graph_or_profile_recording_no_source_was_not_checked(tiny_plan,
                                                                              spindle):
    """A graph that records no model, or a profile no graph, is valid (hand-written ones
    are: the tests' own data), but its ok line says so, and so does a plan's made from such
    a graph: a review emptied a graph's inputs, edited its FLOPs, and validate said a plain
    ok for it and for its plan, which only `spindle run` refused."""
    graph, profile = Path("graphs/tiny-clip.yaml"), Path("profiles/tiny-clip-local-cpu.yaml")
    for path in (graph, profile):
        data = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**data, "inputs": []}, sort_keys=False))
    result = spindle("validate", str(graph), str(profile))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == (
        f"ok {graph} (metaop_graph; records no model: not checked against one)\n"
        f"ok {profile} (profile; records no metaop graph: not checked against one)\n")
    assert spindle("plan", str(graph), str(profile), "--cluster", "clusters/local-cpu.yaml",
                   "-o", "p.yaml").exit_code == 0
    result = spindle("validate", "p.yaml")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ("ok p.yaml (plan; its graph records no model: not checked against "
                             "one)\n")


def test_validate_checks_what_a_plan_says_of_itself_without_its_inputs(tiny_plan, spindle,
                                                                       tmp_path):
    """Found nowhere, its graph could not be checked, and validate said ok to a plan whose
    transfers' ranks were not its slices' (a review swapped two slices' ranks)."""
    data = yaml.safe_load(tiny_plan.read_text())
    t = data["transfers"][0]
    t["dst_ranks"] = [r for r in range(data["num_devices"]) if r not in t["dst_ranks"]][
        :len(t["dst_ranks"])]
    alone = tmp_path / "elsewhere" / "p.yaml"
    alone.parent.mkdir()
    alone.write_text(yaml.safe_dump(data, sort_keys=False))
    Path("graphs/tiny-clip.yaml").unlink()
    result = spindle("validate", "elsewhere/p.yaml")
    assert result.exit_code == 2
    assert result.stderr == (f"error: elsewhere/p.yaml: transfers[0]: {t['src']} -> {t['dst']}: "
                             "ranks differ from its slices'\n")


def test_show_rejects_options_of_other_kinds(files, spindle):
    for option in (["--plot", "p.png"], ["--text-gantt"], ["--utilization", "u.png"]):
        result = spindle("show", files["metaop_graph"], *option)
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: g.yaml: {option[0]} does not apply")
        assert not Path(option[-1]).exists()


def test_validate_lines_are_not_wrapped(small_model_data, tmp_path):
    deep = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2)
    deep.mkdir()
    path = deep / "m.yaml"
    path.write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    result = _invoke("validate", str(path))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == f"ok {path} (model)\n"


@pytest.mark.timeout(120)
def test_a_reader_closing_the_pipe_is_not_a_failure():
    # `spindle show PLAN | head -1`: the output ends early, the exit code stays 0 (rich exits
    # 1 there, the code of a difference found)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "spindle_cli", "show",
                             str(root / "plans" / "ofasys-a800-2x8.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    with proc.stdout, proc.stderr:
        assert proc.stdout.read(10)
        proc.stdout.close()
        assert proc.wait(timeout=100) == 0
        assert proc.stderr.read() == b""


class _ClosedPipe(io.StringIO):
    """A stdout whose reader has gone: every write fails as a closed pipe does."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def write(self, text: str) -> int:
        raise BrokenPipeError

    def fileno(self) -> int:
        return self.fd


@pytest.mark.parametrize("write", ["line", "table"])
def test_every_stdout_console_ends_quietly_on_a_closed_pipe(write, tmp_path, monkeypatch):
    # `spindle show PLAN | head -1` hits whichever console writes when the reader closes:
    # the one-line reports, or the tables printed at their natural width
    with open(tmp_path / "stdout", "w") as f:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(f.fileno()))
        monkeypatch.setattr(out, "quiet", False)
        table = Table("wave", "ranks")
        table.add_row("0", "0-15")
        with pytest.raises(SystemExit) as e:
            if write == "line":
                out.print("plan of ofasys")
            else:
                print_table(table)
    assert e.value.code == 0


def test_show_profile_compares_a_count_under_the_strategy_its_fit_uses():
    """qwen-val-70b's LLM at 96 devices (held out): the fit runs it data-parallel, the fastest
    profiled point is tp2. The row shows the dp point beside the fit, and names the faster."""
    from spindle_cli.artifacts import Profile
    from spindle_cli.planner import scaling

    path = REPO / "profiles" / "qwen-val-70b-a800-32x8.yaml"
    profile = load(str(path), Profile)
    rows = [line.split("│") for line in _invoke("show", str(path)).stdout.splitlines()
            if line.count("│") == 8]
    mixed = [r for r in rows if "fastest profiled" in r[7]]
    assert mixed
    for curve in profile.curves:
        for n in {p.num_devices for p in curve.points}:
            if not scaling.is_valid(curve, n, uneven=True):
                continue
            claimed = scaling.strategy(curve, n)
            point = next((p for p in curve.points if p.num_devices == n and p.feasible
                          and p.strategy == claimed), None)
            fastest = min((p for p in curve.points if p.num_devices == n and p.feasible),
                          key=lambda p: p.time_ms)
            if point is not None and fastest.strategy != claimed:
                assert any(r[1].strip() == str(n) and r[2].strip() == claimed
                           and r[3].strip() == f"{point.time_ms:.4g}"
                           and f"fastest profiled: {fastest.strategy}" in r[7] for r in mixed)


def test_validate_refuses_what_spindle_run_refuses(tmp_path, monkeypatch, spindle):
    """A graph that is not its model's (edited by hand), a plan made from such a graph, and a
    plan whose model or cluster name is not its inputs': validate passed them all, and only
    `spindle run` refused them."""
    root = Path(__file__).resolve().parents[2]
    for d in ("models", "clusters", "graphs", "profiles", "plans"):
        (tmp_path / d).symlink_to(root / d)
    monkeypatch.chdir(tmp_path)
    edited = yaml.safe_load((root / "graphs" / "tiny-clip.yaml").read_text())
    edited["metaops"][0]["first_layer"] = 5
    Path("g.yaml").write_text(yaml.safe_dump(edited))
    for args in (("profile", "g.yaml", "--hardware", "a800", "--cluster",
                  "clusters/a800-1x8.yaml", "-o", "f.yaml"),
                 ("plan", "g.yaml", "f.yaml", "--cluster", "clusters/a800-1x8.yaml",
                  "-o", "p.yaml")):
        result = spindle(*args)
        assert result.exit_code == 0
        # made as asked (a what-if), with a note of what validate and run then say
        assert ("note: g.yaml: is not the graph its model gives (edited since spindle graph "
                "wrote it?) (spindle graph ... --check -o g.yaml shows the difference); "
                "validate and run refuse what is made from it") in result.stderr
    # the plan's error names the plan, then its graph: a CI log of `validate plans/*` names
    # every file made from the stale graph, not the graph once per plan
    for name, named in (("g.yaml", "g.yaml"), ("p.yaml", "p.yaml: g.yaml")):
        result = spindle("validate", name)
        assert result.exit_code == 2
        assert result.stderr.startswith(f"error: {named}: is not the graph its model gives"), \
            result.stderr
    shipped = yaml.safe_load((root / "plans" / "tiny-clip-local-cpu-2.yaml").read_text())
    assert spindle("validate", "plans/tiny-clip-local-cpu-2.yaml").exit_code == 0
    for field, problem in (("model", "model: the plan is for model 'other', its graph for "
                                     "'tiny-clip'"),
                           ("cluster", "cluster: the plan is for cluster 'other', its cluster "
                                       "file is 'local-cpu-2'")):
        Path("plans-edited").mkdir(exist_ok=True)
        Path(f"plans-edited/{field}.yaml").write_text(yaml.safe_dump({**shipped,
                                                                      field: "other"}))
        result = spindle("validate", f"plans-edited/{field}.yaml")
        assert result.exit_code == 2
        assert result.stderr.splitlines()[0] == (f"error: plans-edited/{field}.yaml: "
                                                 f"{problem}")



def test_validate_names_a_plan_whose_graphs_model_changed(tmp_path, monkeypatch, spindle):
    # the graph's error (an ArtifactError) re-raised with the plan's name: a TypeError, exit
    # 123, for every plan of the batch
    root = Path(__file__).resolve().parents[2]
    for d in ("models", "clusters", "graphs", "profiles", "plans"):
        shutil.copytree(root / d, tmp_path / d)
    monkeypatch.chdir(tmp_path)
    model = Path("models/tiny-clip.yaml")
    model.write_text(model.read_text().replace("\ndescription: ", "\ndescription: changed, "))
    result = spindle("validate", "plans/tiny-clip-local-cpu.yaml")
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == (
        "error: plans/tiny-clip-local-cpu.yaml: graphs/tiny-clip.yaml: inputs[0].sha256: model "
        "'models/tiny-clip.yaml' changed since the metaop graph was made (sha256 mismatch)")


@pytest.mark.parametrize(("artifact", "flag"), [("plans/tiny-clip-local-cpu.yaml", "--gantt"),
                                               ("profiles/tiny-clip-local-cpu.yaml", "--plot")])
def test_show_writes_its_charts_before_a_closed_pipe_ends_it(tmp_path, monkeypatch, spindle,
                                                             artifact, flag):
    # `spindle show PLAN --gantt g.svg | head -1` (and a profile's --plot): the tables went
    # first, the reader's close ended the command with exit 0, and the chart was never drawn
    root = Path(__file__).resolve().parents[2]
    chart = tmp_path / "g.svg"
    with open(tmp_path / "stdout", "w") as f:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(f.fileno()))
        monkeypatch.setattr(out, "quiet", False)
        result = spindle("show", str(root / artifact), flag, str(chart))
    assert result.exit_code == 0
    assert chart.read_text().startswith("<?xml")


def test_show_gives_no_per_level_gap_where_the_graph_is_not_found(tmp_path, monkeypatch,
                                                                   spindle):
    # OFASys 4 tasks fuses its levels: read by the levels it records, level 0 was 15x its C*
    # and level 2 0.11x, shown as gaps, where the graph (which tells the levels apart) was
    # not found
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    plan = tmp_path / "p.yaml"
    plan.write_bytes((root / "plans" / "ofasys-4-a800-2x8.yaml").read_bytes())
    result = spindle("show", str(plan))
    assert result.exit_code == 0
    rows = result.stdout.split("levels: planned vs C*")[1].split("memory per rank")[0]
    gaps = [ln.split("│")[4].strip() for ln in rows.splitlines() if ln.startswith("│")]
    assert gaps and set(gaps) == {"-"}
    assert "no per-level gap: without the plan's graph (not found)" in result.stdout


def test_a_file_name_with_a_newline_or_an_escape_code_stays_on_one_line(tmp_path, spindle):
    """Written escaped, as Python writes them: the name's newline made a two-line ok or
    error line, and its escape code reached the terminal."""
    good = tmp_path / "bad\nname.yaml"
    good.write_text((REPO / "models" / "tiny-clip.yaml").read_text())
    missing = tmp_path / "no\x1b[31mfile.yaml"
    result = spindle("validate", str(good), str(missing))
    assert result.exit_code == 2
    assert result.stdout == f"ok {tmp_path}/bad\\nname.yaml (model)\n"
    assert result.stderr.splitlines()[0] == f"error: {tmp_path}/no\\x1b[31mfile.yaml: no such file"
    result = spindle("show", str(missing))
    assert result.stderr == f"error: {tmp_path}/no\\x1b[31mfile.yaml: no such file\n"
