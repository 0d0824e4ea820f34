"""`spindle plan`, `spindle diff`, `spindle explain` and `spindle show PLAN` through the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    Plan,
    Profile,
    input_ref,
    load,
    write_artifact,
)
from spindle_cli.artifacts.limits import MAX_BANDWIDTH_BYTES_PER_S, MAX_PEAK_FLOPS
from spindle_cli.cli import cli
from spindle_cli.cli.views.plan_diff import allocations
from spindle_cli.units import fmt_bytes

CASE = Path(__file__).resolve().parents[1] / "data" / "plan-two-node-multitask"


@pytest.fixture()
def case(tmp_path, monkeypatch):
    """The golden case's inputs copied into a temporary working directory."""
    for name in ("graph", "profile", "cluster"):
        shutil.copy(CASE / f"{name}.yaml", tmp_path / f"{name}.yaml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def invoke(*args):
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    return result


def plan_args(*extra):
    return ["plan", "graph.yaml", "profile.yaml", "--cluster", "cluster.yaml", *extra]


def test_the_lines_naming_an_output_escape_its_control_characters(case, spindle):
    """As errors do: a line break in the name printed 'wrote nl' and 'x.yaml' on two lines."""
    name = "nl\nx\x1b.yaml"
    for said in ("wrote", "unchanged (not rewritten)", "up to date"):
        r = spindle(*plan_args("-o", name, *(["--check"] if said == "up to date" else [])))
        assert r.exit_code == 0, r.stderr
        assert r.stderr.splitlines()[-1] == (f"wrote {repr(name)[1:-1]}" if said == "wrote" else
                                             f"{repr(name)[1:-1]}: {said}")


def test_plan_writes_a_plan_with_its_inputs(case):
    r = invoke(*plan_args("-o", "plan.yaml"))
    assert r.exit_code == 0, r.output
    plan = load("plan.yaml", Plan)
    assert [i.kind for i in plan.inputs] == ["metaop_graph", "profile", "cluster"]
    assert [i.path for i in plan.inputs] == ["graph.yaml", "profile.yaml", "cluster.yaml"]
    assert plan.options["planner"] == "spindle"


def test_plan_to_stdout_is_yaml_only(case):
    r = subprocess.run(["spindle", *plan_args("-o", "-")], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("kind: plan\n")
    assert "estimated compute" in r.stderr and "simulated iteration" in r.stderr


def test_check_detects_drift_and_writes_nothing(case):
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    before = Path("plan.yaml").read_text()
    assert invoke(*plan_args("-o", "plan.yaml", "--check")).exit_code == 0
    r = invoke(*plan_args("--planner", "sequential", "-o", "plan.yaml", "--check"))
    assert r.exit_code == 1
    assert Path("plan.yaml").read_text() == before
    r = invoke(*plan_args("-o", "missing.yaml", "--check"))
    assert r.exit_code == 1 and not Path("missing.yaml").exists()



def test_a_plan_with_crlf_line_endings_is_stale_and_rewritten(case):
    """Only its line endings differ (a checkout with git's core.autocrlf): --check said up to
    date, and a plain run said 'unchanged (not rewritten)' and left it so."""
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    lf = Path("plan.yaml").read_bytes()
    Path("plan.yaml").write_bytes(lf.replace(b"\n", b"\r\n"))
    r = invoke(*plan_args("-o", "plan.yaml", "--check"))
    assert r.exit_code == 1
    assert r.output.splitlines()[-1].startswith("  only its line endings: CRLF, where spindle "
                                                "writes LF")
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    assert Path("plan.yaml").read_bytes() == lf

def test_absolute_input_paths_in_the_working_directory_make_the_same_plan(case):
    # a script that spells its inputs as $PWD/... records them as `make` does, relative
    invoke(*plan_args("-o", "plan.yaml"))
    absolute = [str(case / f"{name}.yaml") for name in ("graph", "profile", "cluster")]
    r = invoke("plan", absolute[0], absolute[1], "--cluster", absolute[2], "--check",
               "-o", str(case / "plan.yaml"))
    assert r.exit_code == 0, r.output
    # a plan written outside the working directory keeps the paths that find its inputs
    elsewhere = case.parent / f"{case.name}-elsewhere"
    elsewhere.mkdir()
    invoke("plan", absolute[0], absolute[1], "--cluster", absolute[2],
           "-o", str(elsewhere / "plan.yaml"))
    plan = load(str(elsewhere / "plan.yaml"), Plan)
    assert [ref.path for ref in plan.inputs] == absolute


def test_check_says_why_a_plan_is_stale(case):
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    kept = load("plan.yaml", Plan)
    profile = load("profile.yaml", Profile)
    slower = replace(profile, curves=tuple(
        replace(c, pieces=tuple(replace(q, beta_ms=q.beta_ms * 3) for q in c.pieces))
        for c in profile.curves))
    write_artifact(slower, "profile.yaml")
    r = invoke(*plan_args("-o", "plan.yaml", "--check"))
    assert r.exit_code == 1
    said = r.output.splitlines()
    assert "plan.yaml: out of date (regenerate it)" in said
    old_sha = next(i.sha256 for i in kept.inputs if i.kind == "profile")
    new_sha = input_ref(slower, "profile.yaml").sha256
    assert (f"  input profile profile.yaml changed (sha256 {old_sha[:12]} -> {new_sha[:12]})"
            in said)
    assert not any(x.startswith("  input metaop_graph") or x.startswith("  input cluster")
                   for x in said)
    # the semantic difference: three times the per-operator time is a longer iteration
    line = next(x for x in said if x.startswith("  estimated compute: "))
    assert f"{kept.estimated_iteration_ms:.3f} -> " in line and "+" in line.split("(")[1]
    assert any(x.startswith("  text: ") for x in said)
    assert load("plan.yaml", Plan) == kept


def test_check_of_a_file_that_no_longer_loads(case):
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    text = Path("plan.yaml").read_text()
    Path("plan.yaml").write_text(text.replace("num_devices:", "num_devices: -3\nx:", 1))
    r = invoke(*plan_args("-o", "plan.yaml", "--check"))
    assert r.exit_code == 1
    assert "  the file does not load: plan.yaml: " in r.output
    at, line = next((i, x) for i, x in enumerate(text.splitlines())
                    if x.startswith("num_devices:"))
    assert f"  text: 3 changed line(s), the first at line {at + 1}" in r.output
    value = line.split(":")[1]
    assert f"  -num_devices: -3\n  -x:{value}\n  +{line}" in r.output


@pytest.mark.parametrize("planner", ["sequential", "optimus", "distmm"])
def test_baseline_planners_and_options(case, planner):
    # memory none: no ZeRO stage the memory search may find faster (distmm here: ZeRO-1 by
    # 0.1 us, since its float sums are exact)
    r = invoke(*plan_args("--planner", planner, "--placement", "sequential", "--uneven-splits",
                          "--memory", "none", "-o", f"{planner}.yaml"))
    assert r.exit_code == 0, r.output
    plan = load(f"{planner}.yaml", Plan)
    assert plan.options == {"planner": planner, "placement": "sequential",
                            "uneven_splits": "true"}


@pytest.mark.parametrize("args, message", [
    (["plan", "nope.yaml", "profile.yaml", "--cluster", "cluster.yaml", "-o", "p.yaml"],
     "nope.yaml: no such file"),
    (["plan", "profile.yaml", "profile.yaml", "--cluster", "cluster.yaml", "-o", "p.yaml"],
     "expected a 'metaop_graph' artifact"),
    (["plan", "graph.yaml", "profile.yaml", "--cluster", "graph.yaml", "-o", "p.yaml"],
     "expected a 'cluster' artifact"),
    (["plan", "graph.yaml", "profile.yaml", "--cluster", "cluster.yaml", "-o", "p.txt"],
     "unknown file extension"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(case, args, message):
    r = subprocess.run(["spindle", *args], capture_output=True, text=True, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and message in r.stderr.replace("\n", "")
    assert "Traceback" not in r.stderr
    assert not Path("p.yaml").exists() and not Path("p.txt").exists()


def test_a_curve_for_another_batch_is_refused(case):
    """T(n) = alpha + beta * B / n reads B from the curve: one edited to another batch than
    its MetaOp runs would be planned at the wrong time, silently."""
    data = yaml.safe_load(Path("profile.yaml").read_text())
    curve = data["curves"][0]
    curve["batch_size"] += 1
    Path("edited.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    r = subprocess.run(["spindle", "plan", "graph.yaml", "edited.yaml", "--cluster",
                        "cluster.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2, r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith(f"error: edited.yaml: curve {curve['signature']!r}: batch_size "
                            f"{curve['batch_size']}, but MetaOp "), first
    assert first.endswith(f"runs a batch of {curve['batch_size'] - 1}")
    assert not Path("p.yaml").exists()


def _other_device_cluster() -> None:
    text = Path("cluster.yaml").read_text()
    Path("h100.yaml").write_text(text.replace("  name: test\n", "  name: H100-SXM5-80GB\n"))


def test_plan_refuses_a_profile_of_another_device(case):
    _other_device_cluster()
    r = subprocess.run(["spindle", "plan", "graph.yaml", "profile.yaml", "--cluster",
                        "h100.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2
    assert r.stderr.splitlines()[0] == ("error: profile.yaml holds the times of test devices, "
                                        "but h100.yaml has H100-SXM5-80GB")
    assert "--allow-device-mismatch" in r.stderr and "Traceback" not in r.stderr
    assert not Path("p.yaml").exists()


def test_a_device_mismatch_can_be_allowed_and_says_so(case):
    _other_device_cluster()
    r = subprocess.run(["spindle", "plan", "graph.yaml", "profile.yaml", "--cluster",
                        "h100.yaml", "--allow-device-mismatch", "-o", "p.yaml"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert "note: profile.yaml holds the times of test devices" in r.stderr.replace("\n", " ")
    assert load("p.yaml", Plan).num_devices == 8


def _measured_profile(cluster_path: str) -> None:
    """profile.yaml as a measured profile that records `cluster_path` as its cluster."""
    cluster = load(cluster_path, ClusterSpec)
    p = load("profile.yaml", Profile)
    write_artifact(replace(p, source="measured", inputs=(input_ref(cluster, cluster_path),)),
                   "measured.yaml")


def test_a_measured_profile_describes_the_cluster_it_was_measured_on(case):
    _other_device_cluster()
    _measured_profile("h100.yaml")
    r = subprocess.run(["spindle", "plan", "graph.yaml", "measured.yaml", "--cluster",
                        "cluster.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2
    assert r.stderr.startswith("error: measured.yaml holds the times of H100-SXM5-80GB "
                               "devices, but cluster.yaml has test")
    r = subprocess.run(["spindle", "plan", "graph.yaml", "measured.yaml", "--cluster",
                        "h100.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "note:" not in r.stderr


def test_a_measured_profile_whose_cluster_changed_is_planned_with_a_note(case):
    _other_device_cluster()
    _measured_profile("h100.yaml")
    Path("h100.yaml").write_text(Path("h100.yaml").read_text().replace(
        "link_latency_s: 5.0e-06", "link_latency_s: 1.0e-05"))
    r = subprocess.run(["spindle", "plan", "graph.yaml", "measured.yaml", "--cluster",
                        "cluster.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    flat = r.stderr.replace("\n", " ")
    assert "note: nothing checks that measured.yaml holds the times of cluster.yaml's test" in flat
    assert "changed since the profile was made" in flat


def test_infeasible_memory_is_a_clean_error(case):
    text = Path("cluster.yaml").read_text().replace("memory_bytes: 85899345920",
                                                    "memory_bytes: 1000")
    Path("small.yaml").write_text(text)
    r = subprocess.run(["spindle", "plan", "graph.yaml", "profile.yaml", "--cluster",
                        "small.yaml", "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2
    error, hint = r.stderr.splitlines()
    # the file and field to change, as every other bad input names them
    assert error.startswith("error: small.yaml: device.memory_bytes: out of memory placing")
    assert "bytes) are available (of 1000 B)" in error
    # which memory settings were tried, and what is left to try
    assert error.endswith("(with ZeRO-3 and recomputation, the last of 8 memory settings tried)")
    assert hint == "hint: plan for more devices, or a smaller model or batch"
    assert not Path("p.yaml").exists()


def test_diff_is_semantic(case):
    invoke(*plan_args("-o", "a.yaml"))
    invoke(*plan_args("-o", "b.yaml"))
    invoke(*plan_args("--planner", "sequential", "-o", "c.yaml"))
    r = invoke("diff", "a.yaml", "b.yaml")
    assert r.exit_code == 0 and r.output == "a.yaml and b.yaml: same plan\n"
    r = invoke("diff", "a.yaml", "c.yaml")
    assert r.exit_code == 1
    assert "input " not in r.output and "producer" not in r.output
    assert "planner: spindle -> sequential" in r.output
    # the kept spindle candidate against a baseline, which has none
    kept = load("a.yaml", Plan).candidate
    assert kept and f"candidate: {kept} -> (none)" in r.output
    assert "option planner" not in r.output and r.output.count("planner:") == 1
    # options one per line
    invoke(*plan_args("--uneven-splits", "-o", "d.yaml"))
    assert "option uneven_splits: false -> true" in invoke("diff", "a.yaml", "d.yaml").output
    assert "allocation t1/img:" in r.output
    assert "estimated compute:" in r.output
    # a level whose schedule differs, with both estimates; the same C* (same graph and profile)
    a, c = load("a.yaml", Plan), load("c.yaml", Plan)
    x, y = next((x, y) for x, y in zip(a.levels, c.levels, strict=True)
                if x.estimated_ms != y.estimated_ms)
    assert (f"level {x.level}: estimated {x.estimated_ms:.3f} -> {y.estimated_ms:.3f} ms, "
            f"C* {x.lower_bound_ms:.3f} -> {y.lower_bound_ms:.3f} ms") in r.output


def test_diff_json_gives_the_lines_and_the_figures_as_pairs(case):
    invoke(*plan_args("-o", "a.yaml"))
    invoke(*plan_args("--planner", "sequential", "-o", "c.yaml"))
    shutil.copy("a.yaml", "b.yaml")
    r = invoke("diff", "a.yaml", "b.yaml", "--json")
    assert r.exit_code == 0
    same = json.loads(r.output)
    assert same["same"] is True and same["differences"] == [] and same["allocations"] == {}
    r = invoke("diff", "a.yaml", "c.yaml", "--json")
    assert r.exit_code == 1
    got = json.loads(r.output)
    a, c = load("a.yaml", Plan), load("c.yaml", Plan)
    assert (got["a"], got["b"], got["same"]) == ("a.yaml", "c.yaml", False)
    # the lines are the text diff's, less its two header lines
    assert got["differences"] == invoke("diff", "a.yaml", "c.yaml").output.splitlines()[2:]
    assert got["estimated_compute_ms"] == [a.estimated_iteration_ms, c.estimated_iteration_ms]
    assert got["lower_bound_ms"] == [a.lower_bound_ms, c.lower_bound_ms]
    assert got["num_waves"] == [len(a.waves), len(c.waves)]
    assert got["peak_memory_bytes"] == [max(m.total_bytes for m in p.memory) for p in (a, c)]
    # the MetaOps whose allocation differs, and only those, as the text names them
    before, after = allocations(a), allocations(c)
    assert got["allocations"] == {m: [before[m], after[m]] for m in before
                                  if before[m] != after[m]}
    assert got["allocations"] and len(got["allocations"]) < len(before)


def test_diff_lists_how_the_plans_were_made(case):
    # the same schedule from a moved profile, and from a profile whose content changed
    shutil.copy("profile.yaml", "moved.yaml")
    invoke(*plan_args("-o", "a.yaml"))
    invoke("plan", "graph.yaml", "moved.yaml", "--cluster", "cluster.yaml", "-o", "b.yaml")
    r = invoke("diff", "a.yaml", "b.yaml")
    assert r.exit_code == 0
    assert r.output == ("a.yaml and b.yaml: same plan; made differently:\n"
                        "  input profile: path profile.yaml -> moved.yaml (same content)\n")
    old = load("a.yaml", Plan).inputs
    sha = next(ref.sha256 for ref in old if ref.kind == "profile")
    text = Path("a.yaml").read_text()
    Path("c.yaml").write_text(text.replace(sha, "a" * 64).replace(
        "producer: spindle", "producer: spindle 0.0.1 via"))
    r = invoke("diff", "a.yaml", "c.yaml")
    assert r.exit_code == 0, r.output
    assert (f"  input profile profile.yaml changed (sha256 {sha[:12]} -> {'a' * 12})"
            in r.output.splitlines())
    assert "  producer: spindle" in r.output
    # beside a difference in the schedule they come first
    invoke(*plan_args("--planner", "sequential", "-o", "d.yaml"))
    Path("d.yaml").write_text(Path("d.yaml").read_text().replace(sha, "a" * 64))
    lines = invoke("diff", "a.yaml", "d.yaml").output.splitlines()
    assert lines[2].startswith("input profile profile.yaml changed")
    assert "planner: spindle -> sequential" in lines


@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_json", [(), ("--json",)])
@pytest.mark.parametrize(("b", "code"), [("a.yaml", 0), ("c.yaml", 1)])
def test_diff_keeps_its_exit_code_when_the_reader_goes(case, b, code, as_json):
    # `spindle diff A B | head -1`: the reader closes the pipe; "they differ" is still 1
    invoke(*plan_args("-o", "a.yaml"))
    invoke(*plan_args("--planner", "sequential", "-o", "c.yaml"))
    proc = subprocess.Popen([sys.executable, "-m", "spindle_cli", "diff", "a.yaml", b,
                             *as_json],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the plans are even loaded
    with proc.stderr:
        assert proc.wait(timeout=100) == code
        assert proc.stderr.read() == b""


@pytest.mark.timeout(120)
def test_a_closed_stderr_does_not_stop_the_plan_being_written(case):
    # `spindle plan ... 2>&1 | head -1`: the messages go nowhere, the plan is still written
    proc = subprocess.Popen([sys.executable, "-m", "spindle_cli", *plan_args("-o", "p.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stderr.close()  # before anything is printed
    with proc.stdout:
        assert proc.wait(timeout=100) == 0
    invoke(*plan_args("-o", "again.yaml"))
    assert Path("p.yaml").read_text() == Path("again.yaml").read_text()


def test_explain_shows_n_star_tuples_and_waves(case):
    invoke(*plan_args("-o", "plan.yaml"))
    r = invoke("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 0, r.output
    assert "n* =" in r.output and "tuples before rounding" in r.output
    # each count says whether the profile measured it or the fit stands in for it
    counts = load("profile.yaml", Profile).counts
    rows = [line.split("│") for line in r.output.splitlines() if line.count("│") == 7]
    assert rows
    for row in rows:
        n, source = int(row[1]), row[6].strip()
        assert source == ("profiled" if n in counts else "fit, between profiled counts"
                          if min(counts) < n < max(counts) else "fit, beyond the profiled counts")
    assert "waves running it" in r.output
    # its slices' ranks as ranges (0-3), as spindle show writes them, not every rank listed
    ranks = [line.split("│")[5].strip() for line in
             r.output.split("waves running it")[1].splitlines() if line.count("│") == 8]
    assert ranks and all(re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", x) for x in ranks)
    assert not any(int(b) == int(a) + 1 for x in ranks for a, b in re.findall(r"(\d+),(\d+)", x))
    r = subprocess.run(["spindle", "explain", "plan.yaml", "t1/nope"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and "no MetaOp 't1/nope'" in r.stderr


@pytest.mark.parametrize(("metaop", "hint"), [
    # a misspelt task: the same module in every task
    ("text_vison/text_embed", "hint: did you mean text_audio/text_embed, "
                              "text_vision/text_embed, thumb_text/text_embed?"),
    # nothing like any id (or nothing at all): what an id looks like and where they are
    ("nope", "hint: a MetaOp is TASK/MODULE, such as text_audio/audio_embed: `spindle show "
             "graphs/tiny-clip.yaml` lists all 28"),
    ("", "hint: a MetaOp is TASK/MODULE, such as text_audio/audio_embed"),
])
def test_explain_of_an_unknown_metaop_hints_at_the_ids(metaop, hint, monkeypatch):
    monkeypatch.chdir(REPO)
    r = subprocess.run(["spindle", "explain", "plans/tiny-clip-local-cpu.yaml", metaop],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2
    error, said = r.stderr.splitlines()
    assert error == f"error: plans/tiny-clip-local-cpu.yaml: no MetaOp {metaop!r}"
    assert said.startswith(hint)


def test_explain_says_a_baseline_does_not_run_the_allocators_tuples(case):
    invoke(*plan_args("--planner", "sequential", "-o", "plan.yaml"))
    r = invoke("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 0, r.output
    assert "the plan is the sequential baseline's, which does not use the allocator" in r.output


def test_explain_says_n_lo_is_the_dummy_when_n_star_is_below_one():
    # an embedding of a 4-task level gets under one device in the relaxed optimum
    r = invoke("explain", str(REPO / "plans" / "multitask-clip-4-a800-2x8.yaml"),
               "task2_vision_depth/depth_embed")
    assert r.exit_code == 0, r.output
    star = next(ln for ln in r.output.splitlines() if "n* = " in ln)
    assert float(star.split("n* = ")[1].split()[0]) < 1
    assert star.endswith("(below the smallest valid count, 1: n_lo = 0, a dummy)")
    assert ", dummy (n = 0)" in r.output


def test_explain_gives_one_tuple_when_n_star_is_a_valid_count():
    # a contrastive loss runs no faster on more devices: n* = 1, a valid count
    r = invoke("explain", str(REPO / "plans" / "multitask-clip-4-a800-2x8.yaml"),
               "task1_text_audio/loss")
    assert r.exit_code == 0, r.output
    assert "n* = 1.000 (a valid count)" in r.output
    assert "tuples before rounding (n, ops): (1, 1.00) (n* is a valid count: one tuple)" in \
        r.output


@pytest.mark.parametrize(("name", "metaop", "spread"), [
    ("qwen-val-a800-8x8", "vision_language/text_embed", False),
    ("multitask-clip-4-a800-2x8", "task1_text_audio/text_embed", True),
])
def test_explain_gives_both_n_star_of_a_flat_metaop_at_the_levels_c_star(name, metaop, spread):
    # level 0's C* is the text embedding's time, which more devices barely shorten: the
    # relaxed optimum gives it the level's spare devices, the allocator the one that suffices;
    # a plan kept from the spread allocation is explained by that one
    plan = REPO / "plans" / f"{name}.yaml"
    assert ("spare devices spread" in load(str(plan), Plan).candidate) == spread
    r = invoke("explain", str(plan), metaop)
    assert r.exit_code == 0, r.output
    said = next(ln for ln in r.output.splitlines() if "the relaxed optimum (sum n* = N)" in ln)
    spare = float(said.split("gives it ")[1].split()[0])
    assert spare > 1 and "on 1 it already ends within 0.1% of C*" in said
    star = next(ln for ln in r.output.splitlines() if "n* = " in ln and "level 0" in ln)
    assert float(star.split("n* = ")[1].split()[0]) == pytest.approx(spare if spread else 1.0,
                                                                     abs=1e-3)
    assert ("this plan was made from the relaxed optimum's allocation" in said) == spread


@pytest.mark.parametrize("uneven", [False, True])
def test_explain_says_which_counts_do_not_divide_the_batch(case, uneven):
    # t1/img's batch of 6 on counts 1, 2, 4: 4 devices cannot split it evenly
    for name in ("graph.yaml", "profile.yaml"):
        text = Path(name).read_text()
        at = text.index("t1/img\n")
        Path(name).write_text(text[:at] + text[at:].replace("batch_size: 8", "batch_size: 6", 1))
    assert load("graph.yaml", MetaOpGraph).metaop("t1/img").batch_size == 6
    invoke(*plan_args("-o", "plan.yaml", *["--uneven-splits"] * uneven))
    r = invoke("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 0, r.output
    said = ("not valid: 4 device(s), which do not divide the batch of 6 (a data-parallel slice "
            "splits it evenly; --uneven-splits lets any count run)")
    assert (said in " ".join(r.output.split())) != uneven


@pytest.fixture(scope="module")
def uneven_vision_explained(tmp_path_factory) -> str:
    """`spindle explain` of a vision encoder (batch 64) in multitask-clip 4 tasks planned on
    16 devices with --uneven-splits."""
    out_plan = tmp_path_factory.mktemp("uneven") / "u.yaml"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        assert invoke("plan", "graphs/multitask-clip-4.yaml",
                      "profiles/multitask-clip-a800-8x8.yaml", "--cluster",
                      "clusters/a800-2x8.yaml", "--uneven-splits",
                      "-o", str(out_plan)).exit_code == 0
    r = invoke("explain", str(out_plan), "task2_vision_depth/vision_enc")
    assert r.exit_code == 0, r.output
    return r.output


def _curve_table_counts(output: str) -> list[int]:
    """The counts of explain's scaling-curve table."""
    return [int(line.split("│")[1]) for line in output.split("waves running it")[0].splitlines()
            if line.count("│") == 7]


def test_explain_says_why_a_valid_count_inside_the_split_is_not_used(uneven_vision_explained):
    # the vision encoder's n* = 6.13 splits over 5 and 8 devices, though 6 and 7 are valid
    # too (the table lists them): they lie below the concave envelope of its speedups, which
    # the bi-point split takes its counts from
    text = " ".join(uneven_vision_explained.split())
    found = re.search(r"between valid counts (\d+) and (\d+), the nearest on the concave "
                      r"envelope of its speedups \(([\d, ]+) lies? below it", text)
    assert found, text
    lo, hi = int(found[1]), int(found[2])
    listed = _curve_table_counts(uneven_vision_explained)
    assert [int(n) for n in found[3].split(", ")] == [n for n in listed if lo < n < hi]


def test_explain_names_the_counts_no_faster_than_fewer(uneven_vision_explained):
    # with uneven splits every count 1-16 is valid for a batch of 64; those running as many
    # rows per device as a smaller count are not offered, and explain says so for each
    text = " ".join(uneven_vision_explained.split())
    found = re.search(r"not offered: ([\d, ]+) device\(s\), no faster than fewer devices "
                      r"\(([^)]*)\): they would only hold more", text)
    assert found, text
    offered = _curve_table_counts(uneven_vision_explained)
    not_offered = [int(n) for n in found[1].split(", ")]
    assert sorted(offered + not_offered) == list(range(1, 17))
    pairs = [(int(n), int(k)) for group in found[2].split("; ")
             for k in [group.split(" as on ")[1]] for n in group.split(" as on ")[0].split(", ")]
    assert sorted(n for n, _ in pairs) == not_offered
    for n, k in pairs:
        assert k in offered and k < n and -(-64 // n) == -(-64 // k)


@pytest.mark.parametrize("tensor_parallel", [False, True])
def test_explain_names_the_counts_a_plan_without_tensor_parallelism_leaves_out(
        case, tensor_parallel):
    # t1/img's curve runs tensor parallel (tp2) from 3 devices: without tensor parallelism its
    # valid counts 4 and 8 are not planned, for that reason (not as no faster than fewer, nor
    # as a profiled count the MetaOp cannot use)
    data = yaml.safe_load(Path("profile.yaml").read_text())
    curve = next(c for c in data["curves"] if c["signature"] == "t1/img")
    piece = curve["pieces"][0]
    curve["pieces"] = [{**piece, "n_hi": 3}, {**piece, "n_lo": 3, "strategy": "tp2"}]
    Path("profile.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    flag = "--tensor-parallel" if tensor_parallel else "--no-tensor-parallel"
    assert invoke(*plan_args(flag, "-o", "plan.yaml")).exit_code == 0
    r = invoke("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 0, r.output
    said = ("not planned: 4, 8 device(s), tensor parallel (tp2): this plan leaves tensor "
            "parallelism out (--no-tensor-parallel)")
    assert (said in r.output) != tensor_parallel
    assert "not offered" not in r.output and "not valid" not in r.output
    assert (4 in _curve_table_counts(r.output)) == tensor_parallel


def test_explain_refuses_changed_inputs(case):
    invoke(*plan_args("-o", "plan.yaml"))
    text = Path("cluster.yaml").read_text().replace("name: test", "name: other")
    Path("cluster.yaml").write_text(text)
    r = subprocess.run(["spindle", "explain", "plan.yaml", "t1/img"], capture_output=True,
                       text=True, check=False)
    assert r.returncode == 2 and "changed since the plan was made" in r.stderr


def test_explain_names_the_plan_whose_options_are_bad(case, spindle):
    invoke(*plan_args("-o", "plan.yaml"))
    data = yaml.safe_load(Path("plan.yaml").read_text())
    data["options"]["planner"] = "x"
    Path("plan.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    r = spindle("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 2
    said = "error: plan.yaml: options.planner: 'x' is not one of"
    assert r.stderr.startswith(said), r.stderr


def _plan_with_fewer_curves() -> None:
    """plan.yaml, recording fewer.yaml: the profile without its first curve."""
    invoke(*plan_args("-o", "plan.yaml"))
    plan, profile = load("plan.yaml", Plan), load("profile.yaml", Profile)
    write_artifact(replace(profile, curves=profile.curves[1:]), "fewer.yaml")
    fewer = input_ref(load("fewer.yaml", Profile), "fewer.yaml")
    write_artifact(replace(plan, inputs=(plan.inputs[0], fewer, plan.inputs[2])), "plan.yaml")


def test_simulate_explain_and_validate_name_the_profile_without_a_curve(case, spindle):
    _plan_with_fewer_curves()
    # validate reports file by file, so its line names the plan first
    for command, named in (("simulate", "fewer.yaml"), ("explain", "fewer.yaml"),
                           ("validate", "plan.yaml: fewer.yaml")):
        r = spindle(command, "plan.yaml", *(["t1/img"] if command == "explain" else []))
        assert r.exit_code == 2, r.stderr
        assert r.stderr.startswith(f"error: {named}: no curve for MetaOp "), r.stderr
        error, hint = r.stderr.splitlines()
        assert error.endswith("not a profile of graph 'test'") and hint.startswith("hint: ")


def test_show_plan(case):
    invoke(*plan_args("-o", "plan.yaml"))
    r = invoke("show", "plan.yaml")
    assert r.exit_code == 0, r.output
    assert "gap" in r.output and "memory per rank" in r.output and "waves" in r.output
    assert f"kept candidate: {load('plan.yaml', Plan).candidate}" in r.output


def test_show_plan_text_gantt(case):
    invoke(*plan_args("-o", "plan.yaml"))
    r = invoke("show", "plan.yaml", "--text-gantt")
    assert r.exit_code == 0, r.output
    # every rank in a row of its own or in a run of ranks that do the same (r0-3)
    covered = set()
    for first, last in re.findall(r"\nr(\d+)(?:-(\d+))? ", r.output):
        covered.update(range(int(first), int(last or first) + 1))
    assert covered == set(range(8))


def test_explain_finds_inputs_above_the_plan(case, monkeypatch):
    Path("plans").mkdir()
    invoke(*plan_args("-o", "plans/plan.yaml"))
    monkeypatch.chdir(Path("plans"))
    r = invoke("explain", "plan.yaml", "t2/txt")
    assert r.exit_code == 0, r.output
    assert "tuples after rounding" in r.output


def _small_cluster(memory_bytes):
    text = Path("cluster.yaml").read_text().replace("memory_bytes: 85899345920",
                                                    f"memory_bytes: {memory_bytes}")
    Path("small.yaml").write_text(text)
    return ["plan", "graph.yaml", "profile.yaml", "--cluster", "small.yaml"]


def test_memory_auto_is_the_default_and_picks_zero_only_when_needed(case):
    # the case's replicated plan peaks at about 145 kB per rank; 100 kB needs sharding
    args = _small_cluster(100_000)
    r = subprocess.run(["spindle", *args, "--memory", "none", "--recompute", "off", "-o",
                        "p.yaml"], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and r.stderr.startswith(
        "error: small.yaml: device.memory_bytes: out of memory")
    assert not Path("p.yaml").exists()
    r = subprocess.run(["spindle", *args, "-o", "p.yaml"], capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    plan = load("p.yaml", Plan)
    zero = int(plan.options["zero"])
    assert zero >= 1 and "recompute" not in plan.options and f"ZeRO-{zero}" in r.stderr
    # people learn when the runtime cannot train this plan (it runs ZeRO-1), and how to make
    # one it can
    assert ("cannot train this plan: the plan uses ZeRO stage 3" in r.stderr) == (zero >= 3)
    assert ("`spindle plan --runnable` (or --memory zero2, zero1, none)" in r.stderr) == (
        zero >= 3)
    assert all(m.total_bytes <= 100_000 for m in plan.memory)
    # the default cluster needs nothing: the plan records no memory strategy
    assert invoke(*plan_args("-o", "big.yaml")).exit_code == 0
    assert "zero" not in load("big.yaml", Plan).options


def test_no_tensor_parallel_is_recorded_in_the_plan(case):
    assert invoke(*plan_args("--no-tensor-parallel", "-o", "dp.yaml")).exit_code == 0
    assert load("dp.yaml", Plan).options["tensor_parallel"] == "false"
    assert invoke(*plan_args("-o", "default.yaml")).exit_code == 0
    assert "tensor_parallel" not in load("default.yaml", Plan).options


def test_runnable_plans_only_what_spindle_run_trains(case):
    # at 50 kB per rank the memory search keeps ZeRO-3, which the executor does not train
    args = _small_cluster(50_000)
    r = invoke(*args, "-o", "auto.yaml")
    assert r.exit_code == 0 and load("auto.yaml", Plan).options["zero"] == "3", r.output
    r = invoke(*args, "--runnable", "-o", "runnable.yaml")
    assert r.exit_code == 0, r.output
    plan = load("runnable.yaml", Plan)
    assert plan.options["zero"] in ("0", "1", "2")
    assert plan.options["tensor_parallel"] == "false"
    assert "cannot train" not in r.output
    assert all(m.total_bytes <= 50_000 for m in plan.memory)
    r = subprocess.run(["spindle", *args, "--runnable", "--memory", "zero3", "-o", "bad.yaml"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and not Path("bad.yaml").exists()
    assert r.stderr == ("error: --runnable and --memory zero3 contradict each other: `spindle "
                        "run` trains ZeRO-1 and -2 only\n")
    # --tensor-parallel said outright is refused too, not dropped; --no-tensor-parallel agrees
    r = subprocess.run(["spindle", *args, "--runnable", "--tensor-parallel", "-o", "bad.yaml"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2 and not Path("bad.yaml").exists()
    assert r.stderr == ("error: --runnable and --tensor-parallel contradict each other: "
                        "`spindle run` trains data-parallel slices only\n")
    r = invoke(*args, "--runnable", "--no-tensor-parallel", "-o", "agreed.yaml")
    assert r.exit_code == 0, r.output
    assert Path("agreed.yaml").read_bytes() == Path("runnable.yaml").read_bytes()


def test_memory_flags_force_a_setting(case):
    r = invoke(*plan_args("--memory", "zero3", "--recompute", "on", "-o", "forced.yaml"))
    assert r.exit_code == 0, r.output
    plan = load("forced.yaml", Plan)
    assert plan.options["zero"] == "3" and plan.options["recompute"] == "true"
    assert "`spindle run` cannot train this plan: the plan uses ZeRO stage 3" in r.output
    r = invoke(*plan_args("--memory", "zero2", "--recompute", "on", "-o", "runnable.yaml"))
    assert r.exit_code == 0 and "cannot train" not in r.output
    r = invoke(*plan_args("--memory", "zero9", "-o", "bad.yaml"))
    assert r.exit_code == 2 and not Path("bad.yaml").exists()


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["ofasys-a800-2x8", "multitask-clip-4-a800-2x8"])
def test_levels_that_share_waves_get_no_per_level_gap(name, monkeypatch):
    # a fused schedule labels each wave with its lowest level: per-level times of such a plan
    # are no measure of a level (OFASys's level 0 read 93x its C*, level 5 0.31x)
    from spindle_cli.artifacts import MetaOpGraph, load_recorded_input
    from spindle_cli.cli.views.plan import mixed_waves

    monkeypatch.chdir(REPO)
    path = f"plans/{name}.yaml"
    plan = load(path, Plan)
    _, g = load_recorded_input(plan, path, MetaOpGraph)
    level_of = {m.id: m.level for m in g.metaops}
    mixed = sum(1 for w in plan.waves if {level_of[s.metaop] for s in w.slices} != {w.level})
    assert mixed_waves(plan, g) == mixed
    assert (mixed > 0) == plan.candidate.startswith("fused")
    shown = invoke("show", path).output
    note = f"{mixed} of {len(plan.waves)} waves run several levels at once"
    assert (note in shown) == (mixed > 0)
    metaop = max(plan.slices(), key=lambda ws: ws[1].time_ms)[1].metaop
    explained = " ".join(invoke("explain", path, metaop).output.split())
    if mixed:
        assert f"{mixed} of the plan's {len(plan.waves)} waves run several levels" in explained
        assert "the waves take" not in explained
    else:
        level = next(lv for lv in plan.levels if lv.level == level_of[metaop])
        assert (f"level {level.level} planned {level.estimated_ms:.3f} ms = "
                f"{level.estimated_ms / level.lower_bound_ms:.3f}x C*") in explained


@pytest.mark.parametrize("name", ["qwen-val-70b-a800-32x8", "multitask-clip-4-a800-2x8"])
def test_memory_table_groups_ranks_that_read_alike(name):
    from spindle_cli.cli.views.plan import memory_table
    from spindle_cli.units import fmt_bytes

    plan = load(str(REPO / "plans" / f"{name}.yaml"), Plan)
    table = memory_table(plan)
    cells = [list(c.cells) for c in table.columns]
    rows = list(zip(*cells, strict=True))
    by_rank = {m.rank: tuple(fmt_bytes(b) for b in (m.param_bytes, m.grad_bytes,
                                                   m.optimizer_bytes, m.activation_bytes,
                                                   m.total_bytes)) for m in plan.memory}
    covered = []
    for label, *values in rows:
        first, _, last = label.partition("-")
        ranks = list(range(int(first), int(last or first) + 1))
        assert all(by_rank[r] == tuple(values) for r in ranks), label
        covered += ranks
    assert covered == sorted(by_rank)
    # a run is as long as it can be: a new row wherever the next rank reads differently
    shown = [by_rank[r] for r in sorted(by_rank)]
    assert len(rows) == 1 + sum(a != b for a, b in zip(shown, shown[1:], strict=False))


def test_input_paths_through_a_symlinked_working_directory_are_recorded_relative(
        tmp_path, monkeypatch):
    # a shell in a symlinked directory spells $PWD through the link; getcwd() resolves it
    from spindle_cli.cli.common import recorded

    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.chdir(link)
    monkeypatch.setenv("PWD", str(link))
    assert recorded(str(link / "graphs" / "g.yaml"), "plans/p.yaml") == "graphs/g.yaml"
    assert recorded(str(real / "graphs" / "g.yaml"), str(link / "p.yaml")) == "graphs/g.yaml"
    # elsewhere, or to stdout, as given
    assert recorded(str(tmp_path / "g.yaml"), "p.yaml") == str(tmp_path / "g.yaml")
    assert recorded(str(link / "g.yaml"), "-") == str(link / "g.yaml")
    assert recorded(str(link / "g.yaml"), str(tmp_path / "p.yaml")) == str(link / "g.yaml")
    # a relative input: as given for a file written here, from here for one written elsewhere
    assert recorded("graphs/g.yaml", "plans/p.yaml") == "graphs/g.yaml"
    assert recorded("graphs/g.yaml", str(tmp_path / "p.yaml")) == str(link / "graphs/g.yaml")
    assert recorded("graphs/g.yaml", "../p.yaml") == str(link / "graphs/g.yaml")


def test_a_plan_written_elsewhere_finds_its_relative_inputs(tmp_path, monkeypatch):
    """`spindle plan graphs/...` from a checkout with -o outside it: the plan is then read
    from other directories, where the relative paths would name nothing."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "elsewhere" / "plan.yaml"
    out.parent.mkdir()
    invoke("plan", "graphs/tiny-clip.yaml", "profiles/tiny-clip-local-cpu.yaml",
           "--cluster", "clusters/local-cpu.yaml", "-o", str(out))
    monkeypatch.chdir(tmp_path)
    assert "not checked" not in invoke("validate", str(out)).output
    assert "iteration" in invoke("simulate", str(out)).output


def test_explain_counts_c_star_as_show_does_when_a_speedup_is_not_concave(case):
    # t1/img 7x faster on 4 devices than on 2: its speedup is not concave, so the level's
    # bound (on the concave envelope, as plan, show and simulate count it) is below the
    # point where every MetaOp ends together on the curves themselves
    text = Path("profile.yaml").read_text()
    at = text.index("- signature: t1/img")
    old = "  - n_lo: 1\n    n_hi: 1048576\n    alpha_ms: 0.2\n    beta_ms: 1.0\n    strategy: dp\n"
    new = ("  - n_lo: 1\n    n_hi: 4\n    alpha_ms: 0.2\n    beta_ms: 1.0\n    strategy: dp\n"
           "  - n_lo: 4\n    n_hi: 1048576\n    alpha_ms: 0.0\n    beta_ms: 0.4\n"
           "    strategy: dp\n")
    assert text[at:].startswith("- signature: t1/img") and old in text[at:]
    Path("profile.yaml").write_text(text[:at] + text[at:].replace(old, new, 1))
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    plan = load("plan.yaml", Plan)
    level = load("graph.yaml", MetaOpGraph).metaop("t1/img").level
    bound = next(lv.lower_bound_ms for lv in plan.levels if lv.level == level)
    explained = " ".join(invoke("explain", "plan.yaml", "t1/img").output.split())
    assert f"level {level}: C* = {bound:.3f} ms (on the concave envelope" in explained
    shown = invoke("show", "plan.yaml").output
    assert f"{bound:.3f}" in shown


def test_diff_says_when_transfers_only_moved(case):
    """Optimus's plan and the same plan with two ranks swapped: the same
    transfers and parameter groups between other ranks, not 'transfers: 5 -> 5'."""
    invoke(*plan_args("--planner", "optimus", "-o", "a.yaml"))
    a = load("a.yaml", Plan)
    swap = {3: 4, 4: 3}

    def moved(ranks):
        return tuple(sorted(swap.get(r, r) for r in ranks))

    b = replace(
        a,
        waves=tuple(replace(w, slices=tuple(replace(s, ranks=moved(s.ranks)) for s in w.slices))
                    for w in a.waves),
        transfers=tuple(replace(t, src_ranks=moved(t.src_ranks), dst_ranks=moved(t.dst_ranks))
                        for t in a.transfers),
        param_groups=tuple(replace(g, ranks=moved(g.ranks)) for g in a.param_groups),
        memory=tuple(sorted((replace(m, rank=swap.get(m.rank, m.rank)) for m in a.memory),
                            key=lambda m: m.rank)))
    assert b.transfers != a.transfers
    write_artifact(b, "b.yaml")
    lines = invoke("diff", "a.yaml", "b.yaml").output.splitlines()
    between = sum(t.bytes for t in a.transfers if t.src_ranks != t.dst_ranks)
    assert (f"transfers: the same {len(a.transfers)}, {fmt_bytes(between)} between different "
            "ranks, on other ranks or slices") in lines
    assert f"parameter groups: the same {len(a.param_groups)}, on other ranks or layers" in lines


def test_explain_survives_operators_too_short_to_pack(case):
    """Every operator 1e-12 ms: explain still compares the level with its C* and with the
    exact packing (HiGHS's tolerances rounded that packing to no time, and explain printed
    '-x' for the waves' share of it; the tuples fit side by side, which needs no solver)."""
    text = Path("profile.yaml").read_text()
    text = re.sub(r"alpha_ms: .*", "alpha_ms: 1.0e-12", re.sub(r"beta_ms: .*", "beta_ms: 0.0",
                                                              text))
    Path("profile.yaml").write_text(text)
    assert invoke(*plan_args("--planner", "sequential", "-o", "plan.yaml")).exit_code == 0
    r = invoke("explain", "plan.yaml", "t1/img")
    assert r.exit_code == 0, r.output
    said = re.search(r"level 0 planned 0.000 ms = ([0-9.]+)x C\*; exact packing of the "
                     r"level's \d+ tuples 0.000 ms \(([0-9.]+)x C\*; the waves take ([0-9.]+)x",
                     " ".join(r.output.split()))
    assert said is not None, r.output
    assert float(said[1]) / float(said[2]) == pytest.approx(float(said[3]), rel=2e-3)


def test_explain_gives_the_packing_found_where_it_is_not_proven(monkeypatch):
    """tiny-clip's encoders on two CPU ranks, eight one-device tuples: HiGHS proves no optimum
    in 10 s (explain then printed nothing about the packing, 10 s later)."""
    from spindle_cli.planner import exact

    monkeypatch.setattr(exact, "TIME_LIMIT_S", 0.5)
    r = invoke("explain", str(REPO / "plans" / "tiny-clip-local-cpu-2.yaml"),
               "text_vision/vision_enc")
    assert r.exit_code == 0, r.output
    said = re.search(r"the best packing of the level's 8 tuples found in 0.5 s takes "
                     r"([0-9.]+) ms \([0-9.]+x C\*\), none below ([0-9.]+) ms proven",
                     " ".join(r.output.split()))
    assert said is not None, r.output
    assert float(said[2]) < float(said[1])


@pytest.mark.parametrize("planner", ["sequential", "distmm", "optimus", "spindle"])
def test_times_near_the_bounds_plan_or_fail_cleanly(case, planner):
    """A profile of operators taking ~1e8 ms (valid) plans, although the simulated clock runs
    to 1e8 s where float spacing is far above a picosecond; one within the 1e12 ms bound that
    recomputation's extra forward pushes past it is a one-line error, not exit 123."""
    import re

    text = Path("profile.yaml").read_text()
    Path("big.yaml").write_text(re.sub(
        r"(alpha_ms|beta_ms): (.*)", lambda m: f"{m[1]}: {float(m[2]) * 1e8 + 1e8}", text))
    r = invoke("plan", "graph.yaml", "big.yaml", "--cluster", "cluster.yaml", "--planner",
               planner, "-o", "plan.yaml")
    assert r.exit_code == 0, r.output
    Path("huge.yaml").write_text(text.replace("alpha_ms: 0.2", "alpha_ms: 900000000000.0", 1))
    r = subprocess.run(["spindle", "plan", "graph.yaml", "huge.yaml", "--cluster", "cluster.yaml",
                        "--planner", planner, "--recompute", "on", "-o", "x.yaml"],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: huge.yaml: curve ") and "recomputation" in r.stderr
    assert not Path("x.yaml").exists()


@pytest.mark.timeout(120)
def test_links_and_devices_at_their_fastest_legal_rates_plan_and_simulate(case):
    """A cluster whose links, device memory and FLOP/s sit at their upper bounds plans and
    simulates to a finite iteration (past the bounds a link rate overflowed to inf, the
    simulator's flows moved NaN bytes and `spindle plan` never ended)."""
    data = yaml.safe_load(Path("cluster.yaml").read_text())
    data["intra_island_bandwidth_bytes_per_s"] = MAX_BANDWIDTH_BYTES_PER_S
    data["inter_node_bandwidth_bytes_per_s"] = MAX_BANDWIDTH_BYTES_PER_S
    data["device"].update(peak_flops=MAX_PEAK_FLOPS,
                          memory_bandwidth_bytes_per_s=MAX_BANDWIDTH_BYTES_PER_S)
    Path("cluster.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    r = invoke(*plan_args("-o", "plan.yaml"))
    assert r.exit_code == 0, r.output
    r = invoke("simulate", "plan.yaml", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    assert 0 < result["iteration_ms"] < float("inf")


@pytest.mark.parametrize("spelled", ["./graph.yaml", "sub/../graph.yaml"])
def test_check_agrees_however_a_relative_input_is_spelled(case, spelled):
    """Relative inputs are recorded normalised, so `--check` with './graph.yaml' finds the
    plan made from 'graph.yaml' up to date (it read 'path graph.yaml -> ./graph.yaml')."""
    (case / "sub").mkdir()
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    r = invoke("plan", spelled, "profile.yaml", "--cluster", "cluster.yaml", "-o", "plan.yaml",
               "--check")
    assert r.exit_code == 0, r.output
    assert "up to date" in r.output
    # and to stdout alike
    r = invoke("plan", spelled, "profile.yaml", "--cluster", "cluster.yaml", "-o", "-")
    assert r.exit_code == 0
    assert r.stdout == Path("plan.yaml").read_text()


def test_an_output_that_would_not_change_is_not_rewritten(case):
    """Regenerating a file to the same bytes leaves it alone (its modification time too), so
    make rules and watchers downstream of a `make plans` see nothing new; a change is written."""
    assert invoke(*plan_args("-o", "plan.yaml")).exit_code == 0
    os.utime("plan.yaml", ns=(1_000_000_000, 1_000_000_000))
    r = invoke(*plan_args("-o", "plan.yaml"))
    assert r.exit_code == 0 and "plan.yaml: unchanged (not rewritten)" in r.output
    assert Path("plan.yaml").stat().st_mtime_ns == 1_000_000_000
    r = invoke(*plan_args("--planner", "sequential", "-o", "plan.yaml"))
    assert r.exit_code == 0 and "wrote plan.yaml" in r.output
    assert Path("plan.yaml").stat().st_mtime_ns != 1_000_000_000


def test_inputs_in_a_checkout_are_recorded_from_its_top_wherever_the_command_runs(
        tmp_path, monkeypatch):
    """CI steps and `make -C` run from other directories than the checkout's top: the same
    file records the same paths (before, 'checkout/graphs/g.yaml' from above it and an
    absolute path from beside it, so --check failed on unchanged files)."""
    from spindle_cli.cli.common import recorded

    top = tmp_path / "checkout"
    (top / ".git").mkdir(parents=True)
    (top / "plans").mkdir()
    (top / "graphs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    for here, graph, plan in ((top, "graphs/g.yaml", "plans/p.yaml"),
                              (tmp_path, "checkout/graphs/g.yaml", "checkout/plans/p.yaml"),
                              (top / "plans", "../graphs/g.yaml", "p.yaml"),
                              (tmp_path / "elsewhere", str(top / "graphs" / "g.yaml"),
                               str(top / "plans" / "p.yaml"))):
        monkeypatch.chdir(here)
        monkeypatch.setenv("PWD", str(here))
        assert recorded(graph, plan) == "graphs/g.yaml", here
    # an input outside the checkout keeps the rules for elsewhere: absolute
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("PWD", str(tmp_path / "elsewhere"))
    assert recorded(str(tmp_path / "g.yaml"), str(top / "plans" / "p.yaml")) == \
        str(tmp_path / "g.yaml")
