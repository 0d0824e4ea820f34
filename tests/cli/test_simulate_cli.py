"""`spindle simulate PLAN`: inputs loaded from the plan and checked, JSON and table output,
one-line errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from spindle_cli.artifacts import Plan, input_ref, load, write_artifact
from spindle_cli.cli import main

_spec = importlib.util.spec_from_file_location(
    "_sim_fixtures", Path(__file__).resolve().parents[1] / "planner" / "_sim_fixtures.py")
assert _spec is not None and _spec.loader is not None
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)


def write_case(tmp_path: Path, *, relative: bool = False, cluster=None) -> Path:
    """graph, profile, cluster (the fixture's by default) and a plan recording them; returns
    the plan's path."""
    refs = []
    for name, obj in (("graph.yaml", fx.graph()), ("profile.yaml", fx.profile()),
                      ("cluster.yaml", cluster or fx.cluster())):
        write_artifact(obj, str(tmp_path / name))
        refs.append(input_ref(obj, name if relative else str(tmp_path / name)))
    plan_path = tmp_path / "plan.yaml"
    write_artifact(fx.plan(inputs=tuple(refs)), str(plan_path))
    return plan_path


def _run(args: list[str]):
    # main() maps errors to exit codes with sys.exit, which CliRunner captures.
    import click

    @click.command(context_settings={"ignore_unknown_options": True})
    @click.argument("argv", nargs=-1, type=click.UNPROCESSED)
    def entry(argv):
        main(list(argv))

    return CliRunner().invoke(entry, args, catch_exceptions=False)


def test_json_has_the_contract_fields_with_exact_values(tmp_path):
    res = _run(["simulate", str(write_case(tmp_path)), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    data = json.loads(res.stdout)
    for key in ("iteration_ms", "compute_ms", "transfer_ms", "sync_ms", "idle_fraction",
                "lower_bound_ms", "planner", "num_devices", "peak_memory_bytes"):
        assert key in data, key
    # chunked buckets (the default): enc's top layer syncs during its backward
    assert data["iteration_ms"] == pytest.approx(61.0)
    assert data["transfer_ms"] == pytest.approx(40.0)
    assert data["sync_ms"] == pytest.approx(6.0)
    assert data["gather_wait_ms"] == 0.0  # no ZeRO: nothing to gather
    assert data["planner"] == "spindle" and data["num_devices"] == 4
    assert len(data["ranks"]) == 4 and len(data["waves"]) == 2


def test_sync_flag(tmp_path):
    res = _run(["simulate", str(write_case(tmp_path)), "--json", "--sync", "after-backward"])
    assert res.exit_code == 0, res.stderr
    head = json.loads(res.stdout)["syncs"][1]
    assert head["end_ms"] == pytest.approx(60.0)  # 55 + 5 ms instead of 27 + 5 ms
    res = _run(["simulate", str(write_case(tmp_path)), "--json", "--sync", "per-wave"])
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(65.0)  # enc whole from 55
    res = _run(["simulate", str(write_case(tmp_path)), "--json", "--sync", "sideways"])
    assert res.exit_code == 2 and "sideways" in res.stderr


def test_sync_defaults_to_the_buckets_of_the_clusters_backend(tmp_path):
    gloo = dataclasses.replace(fx.cluster(), backend="gloo")
    plan = str(write_case(tmp_path, cluster=gloo))
    res = _run(["simulate", plan, "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(65.0)  # one per rank set
    res = _run(["simulate", plan, "--json", "--sync", "chunked"])
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)


def test_progress_flag(tmp_path):
    # Each rank on its own: same 61 ms, now told as rank 0's time: its 12 ms of enc and
    # 43 ms waiting (20 for its activations to leave, 23 for head's gradients to come back)
    # instead of 15 ms of compute and 40 of transfers over the waves.
    res = _run(["simulate", str(write_case(tmp_path)), "--json", "--progress", "rank"])
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["iteration_ms"] == pytest.approx(61.0)
    assert (data["compute_ms"], data["transfer_ms"]) == pytest.approx((12.0, 43.0))
    # the table says that the transfer part holds waits as well, where waves tell transfers
    res = _run(["simulate", str(write_case(tmp_path)), "--progress", "rank"])
    assert "transfers and waits for peers" in res.stdout
    assert "inter-wave transfer (exposed)" not in res.stdout
    res = _run(["simulate", str(write_case(tmp_path))])
    assert "inter-wave transfer (exposed)" in res.stdout
    res = _run(["simulate", str(write_case(tmp_path)), "--progress", "node"])
    assert res.exit_code == 2 and "node" in res.stderr


def test_table_report_goes_to_stdout(tmp_path):
    res = _run(["simulate", str(write_case(tmp_path))])
    assert res.exit_code == 0, res.output + res.stderr
    assert "iteration" in res.stdout and "61.00" in res.stdout
    assert "per MetaOp" in res.stdout and "t/enc" in res.stdout


def test_relative_input_paths_resolve_beside_the_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(_empty_dir(tmp_path))
    res = _run(["simulate", str(write_case(tmp_path, relative=True)), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)


def test_relative_input_paths_resolve_above_the_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(_empty_dir(tmp_path))
    write_case(tmp_path, relative=True)
    (tmp_path / "plans").mkdir()
    (tmp_path / "plan.yaml").rename(tmp_path / "plans" / "plan.yaml")
    res = _run(["simulate", str(tmp_path / "plans" / "plan.yaml"), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)


def test_absolute_input_paths_are_found_beside_the_plan_once_moved(tmp_path, monkeypatch):
    """Files written outside a checkout record absolute paths (`make demo OUT=/tmp/x`): the
    directory renamed, the plan's inputs lay beside it and were not found (the hint said they
    were looked for above the plan, which an absolute path never is)."""
    monkeypatch.chdir(_empty_dir(tmp_path))
    made = tmp_path / "d1"
    made.mkdir()
    write_case(made)
    made.rename(tmp_path / "d2")
    res = _run(["simulate", str(tmp_path / "d2" / "plan.yaml"), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)
    (tmp_path / "d2" / "graph.yaml").unlink()
    res = _run(["simulate", str(tmp_path / "d2" / "plan.yaml"), "--json"])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.splitlines()[1] == (
        f"hint: it is looked for at that path and by its name beside "
        f"{tmp_path / 'd2' / 'plan.yaml'}: put the metaop_graph there (its sha256 must be "
        f"{input_ref(fx.graph(), '').sha256[:12]}...)")


def _empty_dir(tmp_path: Path) -> Path:
    here = tmp_path / "elsewhere"
    here.mkdir()
    return here


def test_a_stale_file_of_the_same_name_here_does_not_hide_the_recorded_input(tmp_path,
                                                                            monkeypatch):
    """Relative paths are tried from the working directory first: a file there with the same
    name but other content (or not an artifact at all) is passed over for the one beside the
    plan that holds the recorded content."""
    here = _empty_dir(tmp_path)
    monkeypatch.chdir(here)
    write_artifact(fx.cluster(latency_s=1e-3), str(here / "cluster.yaml"))
    (here / "graph.yaml").write_text("not: [an artifact\n")
    plan_path = write_case(tmp_path, relative=True)
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)
    # with the one beside the plan changed too, the error names the first file looked at
    write_artifact(fx.cluster(latency_s=2e-3), str(tmp_path / "cluster.yaml"))
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 2 and res.stdout == ""
    first = res.stderr.splitlines()[0]
    assert "inputs[2].sha256: cluster 'cluster.yaml' changed since the plan was made" in first


def test_a_work_tree_inside_another_checkout_reads_its_own_inputs(tmp_path, monkeypatch):
    """A git worktree under .worktrees/ of a checkout holding the same files: an input changed
    in the worktree is stale, though the outer checkout's copy holds the recorded content
    (inputs were looked for in every directory above the plan)."""
    monkeypatch.chdir(_empty_dir(tmp_path))
    outer = tmp_path / "checkout"
    inner = outer / ".worktrees" / "feat"
    (inner / "plans").mkdir(parents=True)
    (outer / ".git").mkdir()
    (inner / ".git").write_text(f"gitdir: {outer / '.git' / 'worktrees' / 'feat'}\n")
    write_case(outer, relative=True)
    for name in ("graph.yaml", "profile.yaml", "cluster.yaml"):
        (inner / name).write_bytes((outer / name).read_bytes())
    (outer / "plan.yaml").rename(inner / "plans" / "plan.yaml")
    plan_path = inner / "plans" / "plan.yaml"
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 0, res.output + res.stderr
    write_artifact(fx.cluster(latency_s=1e-3), str(inner / "cluster.yaml"))
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 2 and res.stdout == ""
    assert (f"inputs[2].sha256: cluster '{inner / 'cluster.yaml'}' changed since the plan was "
            "made" in res.stderr.splitlines()[0])


def test_inputs_outside_the_checkout_are_still_found_above_it(tmp_path, monkeypatch):
    """A plan written into a checkout from inputs beside it (recorded from where the command
    ran: shared/cluster.yaml) and read from inside the checkout: nothing of that name is in
    the checkout, so the directories above it are looked at too (bounding the search at the
    checkout's top lost them)."""
    home = tmp_path / "home"
    repo = home / "repo"
    (repo / ".git").mkdir(parents=True)
    (repo / "out").mkdir()
    shared = home / "shared"
    shared.mkdir()
    write_case(shared, relative=True)
    plan = load(str(shared / "plan.yaml"), Plan)
    refs = tuple(dataclasses.replace(r, path=f"shared/{r.path}") for r in plan.inputs)
    write_artifact(dataclasses.replace(plan, inputs=refs), str(repo / "out" / "p.yaml"))
    monkeypatch.chdir(repo)
    res = _run(["simulate", "out/p.yaml", "--json"])
    assert res.exit_code == 0, res.stderr
    assert json.loads(res.stdout)["iteration_ms"] == pytest.approx(61.0)


def test_changed_input_is_a_one_line_error(tmp_path):
    plan_path = write_case(tmp_path)
    write_artifact(fx.cluster(latency_s=1e-3), str(tmp_path / "cluster.yaml"))
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 2
    assert res.stdout == ""
    first, *rest = res.stderr.splitlines()
    assert first.startswith("error: ") and "cluster" in first
    assert "changed since the plan was made" in first
    assert all(line.startswith("hint: ") for line in rest)
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("relative", [False, True])
def test_missing_input_is_a_one_line_error_with_where_it_was_looked_for(tmp_path, monkeypatch,
                                                                         relative):
    monkeypatch.chdir(_empty_dir(tmp_path))
    plan_path = write_case(tmp_path, relative=relative)
    (tmp_path / "profile.yaml").unlink()
    res = _run(["simulate", str(plan_path)])
    assert res.exit_code == 2
    error, hint = res.stderr.splitlines()
    assert error.startswith("error: ")
    assert "inputs[1].path: profile file" in error and "not found" in error
    where = ("from the working directory and from each directory above" if relative else
             "and by its name beside")
    assert hint.startswith(f"hint: it is looked for at that path {where} {plan_path}: put the "
                           "profile there")


def test_bad_gantt_extension_writes_nothing(tmp_path):
    plan_path = write_case(tmp_path)
    res = _run(["simulate", str(plan_path), "--gantt", str(tmp_path / "g.gif")])
    assert res.exit_code == 2
    assert "unknown image type" in res.stderr
    assert not (tmp_path / "g.gif").exists()


def test_gantt_of_the_simulated_timeline(tmp_path):
    plan_path = write_case(tmp_path)
    res = _run(["simulate", str(plan_path), "--json", "--gantt", str(tmp_path / "g.svg")])
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
    json.loads(res.stdout)


def test_utilization_of_the_simulated_iteration(tmp_path):
    plan_path = write_case(tmp_path)
    res = _run(["simulate", str(plan_path), "--utilization", str(tmp_path / "u.png")])
    assert res.exit_code == 0, res.stderr
    assert (tmp_path / "u.png").read_bytes().startswith(b"\x89PNG")


def test_text_gantt_of_the_simulated_timeline_follows_the_report(tmp_path):
    # the report's tables, then the timeline: enc (A) on ranks 0-1 with its backward (a)
    # and sync (~), head (B) on ranks 2-3
    res = _run(["simulate", str(write_case(tmp_path)), "--text-gantt"])
    assert res.exit_code == 0, res.stderr
    lines = res.stdout.splitlines()
    rows = [line for line in lines if line.startswith("r")]
    # ranks 0-1 do the same, as do 2-3: a row each
    assert [row.split()[0] for row in rows] == ["r0-1", "r2-3"]
    assert "a" in rows[0] and "~" in rows[0] and "B" in rows[1]
    assert lines[-1].startswith("legend: A=enc, B=head")
    assert lines.index(next(line for line in lines if "| wave start;" in line)) > \
        lines.index(next(line for line in lines if "one iteration" in line))


def test_text_gantt_and_json_both_want_stdout(tmp_path):
    res = _run(["simulate", str(write_case(tmp_path)), "--text-gantt", "--json"])
    assert res.exit_code == 2
    assert res.stdout == ""
    assert "--text-gantt prints to stdout, as --json does" in res.stderr


REPO = Path(__file__).resolve().parents[2]


def test_placement_flag_simulates_the_waves_placed_again():
    plan_path = str(REPO / "plans" / "multitask-clip-a800-2x8.yaml")
    # placed as usual: no home ranks, no reserved ranks
    assert "ranks" not in load(plan_path, Plan).candidate
    own = _run(["simulate", plan_path, "--json"])
    naive = _run(["simulate", plan_path, "--json", "--placement", "sequential"])
    assert own.exit_code == 0 and naive.exit_code == 0, own.stderr + naive.stderr
    a, b = json.loads(own.stdout), json.loads(naive.stdout)
    assert (a["placement"], b["placement"]) == ("island", "sequential")
    assert (a["placed_again"], b["placed_again"]) == (False, True)
    # the same waves: the same compute (a forward wave may stall longer for the previous
    # step's ZeRO all-gathers on other ranks, a backward wave lasts its longest slice); on
    # consecutive ranks more rows cross the islands
    assert b["compute_ms"] == pytest.approx(a["compute_ms"])
    assert [w["backward_end_ms"] - w["backward_start_ms"] for w in b["waves"]] == \
        pytest.approx([w["backward_end_ms"] - w["backward_start_ms"] for w in a["waves"]])
    assert b["inter_island_bytes"] > a["inter_island_bytes"]
    assert b["transfer_ms"] > a["transfer_ms"]
    # the plan's own placement gives its own simulation back (the file rounds C* and the
    # estimate, which the simulation recomputes)
    same = json.loads(_run(["simulate", plan_path, "--json", "--placement", "island"]).stdout)
    assert same["ranks"] == a["ranks"] and same["syncs"] == a["syncs"]
    assert same["placed_again"]
    for key in ("iteration_ms", "transfer_ms", "sync_ms", "lower_bound_ms"):
        assert same[key] == pytest.approx(a[key]), key


def test_waves_that_do_not_fit_placed_again_are_a_one_line_error():
    res = _run(["simulate", str(REPO / "plans" / "qwen-val-70b-a800-32x8.yaml"),
                "--placement", "sequential"])
    assert res.exit_code == 2 and res.stdout == ""
    (line,) = res.stderr.splitlines()
    # the plan it was asked of, and the option that placed it again
    assert line.startswith(f"error: {REPO / 'plans' / 'qwen-val-70b-a800-32x8.yaml'}: "
                           "--placement sequential: out of memory placing")
    assert "(sequential placement)" in line


def _also_on_ranks_2_3(plan: Plan) -> Plan:
    """`plan` with a second slice of all of t/enc in wave 0, on ranks 2-3, and enc's parameter
    group listing all four ranks that hold it."""
    w0 = plan.waves[0]
    again = dataclasses.replace(w0.slices[0], id="w0.1", ranks=(2, 3))
    enc, head = plan.param_groups
    return dataclasses.replace(
        plan, waves=(dataclasses.replace(w0, slices=(*w0.slices, again)), *plan.waves[1:]),
        param_groups=(dataclasses.replace(enc, ranks=(0, 1, 2, 3)), head))


@pytest.mark.parametrize(("edit", "expected"), [
    (lambda p: dataclasses.replace(p, transfers=()),
     "error: waves[1].slices[0] (w1.0): needs inputs from ['t/enc'], the plan's transfers "
     "bring []"),
    (lambda p: dataclasses.replace(p, param_groups=p.param_groups[1:]),
     "error: param_groups: no group holds layer 0 of module 'enc' (held by ranks [0, 1])"),
    (lambda p: dataclasses.replace(p, param_groups=(
        dataclasses.replace(p.param_groups[0], ranks=(0, 1, 2)), *p.param_groups[1:])),
     "error: param_groups[0].ranks: [0, 1, 2], but layer 0 of module 'enc' is held by ranks "
     "[0, 1]"),
    (lambda p: dataclasses.replace(p, waves=p.waves[:1], transfers=()),
     "error: waves: MetaOp t/head has no slice in the plan"),
    # t/enc's operators run twice: a second slice of both on ranks 2-3 (its param group
    # updated, so only the coverage rule objects); sorted, the second range starts at 0, not 2
    (_also_on_ranks_2_3,
     "error: waves: MetaOp t/enc: operators from 2 are not covered exactly once by its slices"),
    (lambda p: dataclasses.replace(p, transfers=(
        dataclasses.replace(p.transfers[0], dst_ranks=(2,)),)),
     "error: transfers[0]: w0.0 -> w1.0: ranks differ from its slices'"),
    (lambda p: dataclasses.replace(p, transfers=(
        dataclasses.replace(p.transfers[0], src_ranks=(0, 1, 2)),)),
     "error: transfers[0]: w0.0 -> w1.0: ranks differ from its slices'"),
    # enc's layer 1 listed again, with the same ranks
    (lambda p: dataclasses.replace(p, param_groups=(
        p.param_groups[0], dataclasses.replace(p.param_groups[0], first_layer=1),
        *p.param_groups[1:])),
     "error: param_groups[1]: layer 1 of 'enc' is in two groups"),
    # a group of layers past the module's end, and one of a module no slice runs: the
    # gradient sync and its prediction counted them (a review's fuzzing)
    (lambda p: dataclasses.replace(p, param_groups=(
        dataclasses.replace(p.param_groups[0], last_layer=99), *p.param_groups[1:])),
     "error: param_groups[0]: no slice runs layer 2 of module 'enc'"),
    (lambda p: dataclasses.replace(p, param_groups=(
        *p.param_groups, dataclasses.replace(p.param_groups[0], module="nowhere", bytes=0))),
     "error: param_groups[2]: no slice runs layer 0 of module 'nowhere'"),
    # t/head's input sent twice from t/enc (a test review's mutation dropping this check
    # survived the suite)
    (lambda p: dataclasses.replace(p, transfers=(p.transfers[0], p.transfers[0])),
     "error: transfers[1]: two transfers from 't/enc' into slice w1.0"),
    # t/enc's slice runs a third operator of its two (the coverage check named it 'in no
    # slice' where this one was dropped)
    (lambda p: dataclasses.replace(p, waves=(
        dataclasses.replace(p.waves[0], slices=(dataclasses.replace(p.waves[0].slices[0],
                                                                    last=3),)),
        *p.waves[1:])),
     "error: waves[0].slices[0] (w0.0): operators [0, 3) exceed the 2 of t/enc"),
])
def test_a_plan_that_contradicts_its_graph_is_refused(tmp_path, edit, expected):
    # a hand-edited plan that no longer schedules its graph as the executor would run it
    plan_path = write_case(tmp_path)
    write_artifact(edit(load(str(plan_path), Plan)), str(plan_path))
    res = _run(["simulate", str(plan_path)])
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [expected.replace("error: ", f"error: {plan_path}: ")]


def test_a_slice_on_a_count_its_curve_gives_no_time_for_is_named(tmp_path):
    """t/enc on 3 ranks, a count its batch of 4 does not split over: simulate says so in a note
    (validate refuses it); no test edited a plan to reach this check before a test review."""
    refs = []
    for name, obj in (("graph.yaml", fx.graph()), ("profile.yaml", fx.profile()),
                      ("cluster.yaml", fx.cluster())):
        write_artifact(obj, str(tmp_path / name))
        refs.append(input_ref(obj, str(tmp_path / name)))
    plan_path = tmp_path / "plan.yaml"
    write_artifact(fx.plan(enc_ranks=(0, 1, 2), head_ranks=(3,), inputs=tuple(refs)),
                   str(plan_path))
    res = _run(["simulate", str(plan_path)])
    assert res.exit_code == 0, res.stderr
    assert (f"note: {plan_path}: waves[0].slices[0].ranks: 3 ranks, which MetaOp t/enc's "
            "curve gives no time for (") in res.stderr


def test_json_names_the_plan_it_simulated_by_path_and_sha256(tmp_path):
    # a saved result says which plan it is of, as an artifact records its inputs
    plan_path = write_case(tmp_path)
    res = _run(["simulate", str(plan_path), "--json"])
    assert res.exit_code == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["plan"] == str(plan_path)
    assert data["plan_sha256"] == input_ref(load(str(plan_path), Plan), "p").sha256
