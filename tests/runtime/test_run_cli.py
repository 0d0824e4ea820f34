"""`spindle run`: the real launcher end to end, refusals before launch, a crashing rank."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from spindle_cli.artifacts import ClusterSpec, ModelSpec, input_ref, load, write_artifact
from spindle_cli.cli import main
from spindle_cli.planner.api import PlanOptions, make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.profiling import analytic_profile

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def write_plan_files(tmp: Path, cluster_name: str = "local-cpu-2") -> Path:
    """graph.yaml, profile.yaml and plan.yaml for tiny-clip under `tmp`, as `spindle plan`
    would write them."""
    model_path = str(REPO / "models" / "tiny-clip.yaml")
    model = load(model_path, ModelSpec)
    graph = build_graph(model, dtype="fp32", inputs=[input_ref(model, model_path)])
    cluster_path = str(REPO / "clusters" / f"{cluster_name}.yaml")
    cluster = load(cluster_path, ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2])
    graph_path, profile_path = str(tmp / "graph.yaml"), str(tmp / "profile.yaml")
    write_artifact(graph, graph_path)
    write_artifact(profile, profile_path)
    plan = make_plan(graph, profile, cluster, options=PlanOptions(planner="spindle"),
                     inputs=(input_ref(graph, graph_path), input_ref(profile, profile_path),
                             input_ref(cluster, cluster_path)))
    write_artifact(plan, str(tmp / "plan.yaml"))
    return tmp / "plan.yaml"


def spindle(*args: str, timeout_s: float = 150) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    return subprocess.run([sys.executable, "-m", "spindle_cli", *args], capture_output=True,
                          text=True, timeout=timeout_s, env=env)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_end_to_end_two_ranks_with_trace(tmp_path: Path) -> None:
    plan = write_plan_files(tmp_path)
    trace = tmp_path / "trace.json"
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "2", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/2", "2/2"], r.stdout
    assert all(float(ln.split()[3]) > 0 for ln in lines)
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert {e["cat"] for e in spans} >= {"compute", "comm", "sync"}
    waves = {e["args"]["wave"] for e in spans if "wave" in e["args"]}
    assert waves and min(waves) == 0
    # one time axis: a rank's sync span ends once the loss all-reduce issued at the end of
    # every rank's forward has completed, so after both ranks' forward compute (100 us of
    # slack for taking the two clocks' origins)
    for step in (0, 1):
        syncs = [e for e in spans if e["name"] == "sync" and e["args"]["step"] == step]
        assert len(syncs) == 2
        forward_end = max(e["ts"] + e["dur"] for e in spans if e["cat"] == "compute"
                          and e["args"].get("step") == step
                          and e["args"].get("phase") == "forward")
        assert min(e["ts"] + e["dur"] for e in syncs) >= forward_end - 100
    summary = doc["otherData"]
    assert summary["measured_iteration_ms"] > 0
    assert set(summary["breakdown_ms_per_step"]) == {"0", "1"}
    assert all(parts["compute"] > 0 for parts in summary["breakdown_ms_per_step"].values())
    # the prediction is the simulator's (the plan's profile and cluster files are at hand),
    # as the executor on gloo runs: each rank on its own, one gradient bucket per rank set
    from spindle_cli.artifacts import MetaOpGraph, Plan, Profile
    from spindle_cli.planner.simulate import simulate

    args = (load(str(plan), Plan), load(str(tmp_path / "graph.yaml"), MetaOpGraph),
            load(str(tmp_path / "profile.yaml"), Profile),
            load(str(REPO / "clusters" / "local-cpu-2.yaml"), ClusterSpec))
    assert summary["predicted_iteration_ms"] == pytest.approx(
        simulate(*args, sync="per-set", progress="rank").iteration_ms)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sync_flag_chooses_the_gradient_buckets(tmp_path: Path) -> None:
    """--sync chunked on gloo: the same losses as the default per-set buckets (two ranks sum
    each gradient element once either way), and the trace's prediction simulates chunked
    buckets."""
    plan = write_plan_files(tmp_path)
    losses = {}
    for sync in ("per-set", "chunked"):
        trace = tmp_path / f"{sync}.json"
        r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "2", "--sync", sync,
                    "--trace", str(trace))
        assert r.returncode == 0, r.stderr
        losses[sync] = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert losses["chunked"] == losses["per-set"] and len(losses["chunked"]) == 2
    from spindle_cli.artifacts import MetaOpGraph, Plan, Profile
    from spindle_cli.planner.simulate import simulate

    args = (load(str(plan), Plan), load(str(tmp_path / "graph.yaml"), MetaOpGraph),
            load(str(tmp_path / "profile.yaml"), Profile),
            load(str(REPO / "clusters" / "local-cpu-2.yaml"), ClusterSpec))
    summary = json.loads((tmp_path / "chunked.json").read_text())["otherData"]
    assert summary["predicted_iteration_ms"] == pytest.approx(
        simulate(*args, sync="chunked", progress="rank").iteration_ms)


def invoke(*args: str) -> object:
    """`spindle ARGS` in-process through `main` (error mapping and exit codes included)."""
    import click

    @click.command(context_settings={"ignore_unknown_options": True})
    @click.argument("argv", nargs=-1, type=click.UNPROCESSED)
    def entry(argv: tuple[str, ...]) -> None:
        main(list(argv))

    return CliRunner().invoke(entry, list(args), catch_exceptions=False)


def _one_line_error(result: object) -> str:
    stderr = getattr(result, "stderr", "")
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr
    return errors[0]


def test_tensor_parallel_plan_is_refused_before_launch(tmp_path: Path) -> None:
    plan_path = write_plan_files(tmp_path)
    from spindle_cli.artifacts import Plan

    plan = load(str(plan_path), Plan)
    w0 = plan.waves[0]
    tp_slice = dataclasses.replace(w0.slices[0], strategy="tp2")
    waves = (dataclasses.replace(w0, slices=(tp_slice, *w0.slices[1:])), *plan.waves[1:])
    write_artifact(dataclasses.replace(plan, waves=waves), str(tmp_path / "tp.yaml"))
    result = invoke("run", str(tmp_path / "tp.yaml"), "--nproc-per-node", "2")
    assert result.exit_code == 2
    assert "tensor parallel" in _one_line_error(result)


@pytest.mark.parametrize(("options", "named"), [({"zero": "3"}, "ZeRO stage 3"),
                                                ({"zero": "3", "recompute": "true"},
                                                 "ZeRO stage 3"),
                                                ({"zero": "2"}, None),
                                                ({"zero": "1", "recompute": "true"}, None)])
def test_zero3_plans_are_refused_before_launch(tmp_path: Path, options: dict[str, str],
                                               named: str | None) -> None:
    plan_path = write_plan_files(tmp_path)
    from spindle_cli.artifacts import Plan

    plan = load(str(plan_path), Plan)
    saving = dataclasses.replace(plan, options={**plan.options, **options})
    write_artifact(saving, str(tmp_path / "saving.yaml"))
    result = invoke("run", str(tmp_path / "saving.yaml"), "--dry-run")
    if named is None:
        assert result.exit_code == 0, getattr(result, "stderr", "")
        return
    assert result.exit_code == 2
    line = _one_line_error(result)
    assert named in line and "implements ZeRO-1 and -2 only" in line


def test_world_size_mismatch_is_refused(tmp_path: Path) -> None:
    plan_path = write_plan_files(tmp_path)
    result = invoke("run", str(plan_path), "--nproc-per-node", "3")
    assert result.exit_code == 2
    assert "needs 2 ranks" in _one_line_error(result)


def test_changed_graph_is_refused(tmp_path: Path) -> None:
    plan_path = write_plan_files(tmp_path)
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    write_artifact(build_graph(model, dtype="bf16"), str(tmp_path / "graph.yaml"))
    result = invoke("run", str(plan_path), "--nproc-per-node", "2")
    assert result.exit_code == 2
    assert "sha256" in _one_line_error(result)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_crashing_rank_fails_every_rank_and_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    plan = write_plan_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "3", "--timeout-s", "30",
                "--dataset", "faulty_data:crash_on_rank_one", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "1")
    assert r.returncode == 1, r.stderr
    assert "error: rank 1: OSError: disk read failed (injected)" in r.stderr
    # the one-line summary names the root cause, not rank 0 (which only lost its peer)
    assert r.stderr.strip().splitlines()[-1] == \
        "error: run failed: rank 1: OSError: disk read failed (injected)"
    assert "Traceback" not in r.stderr
    # step 1 was checkpointed before the crash in step 2; nothing else is complete
    done = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert done == ["step-000001"]
    assert sorted(p.name for p in (ckpt / "step-000001").iterdir()) == \
        ["manifest.json", "rank-00000.pt", "rank-00001.pt"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hanging_rank_fails_the_run_within_the_timeout(tmp_path: Path) -> None:
    plan = write_plan_files(tmp_path)
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "3", "--timeout-s", "5",
                "--dataset", "faulty_data:hang_on_rank_one", timeout_s=120)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    # rank 0 names the rank it waited for; the launcher stopped the hung rank
    assert last.startswith("error: run failed: rank 0: lost contact with rank(s) 1 in "), last
    assert last.endswith("the launcher then stopped rank(s) 1"), last
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["--dataset", "no_such_module:make"], "No module named 'no_such_module'"),
    (["--dataset", "faulty_data"], "expected 'module:function'"),
    (["--resume"], "need --checkpoint-dir"),
    (["--trace", "/no/such/dir/trace.json"], "directory does not exist"),
    (["--nnodes", "2"], "the run has 4"),
])
def test_bad_run_options_are_refused_before_launch(tmp_path: Path, args: list[str],
                                                   expected: str) -> None:
    plan_path = write_plan_files(tmp_path)
    result = invoke("run", str(plan_path), "--nproc-per-node", "2", *args)
    assert result.exit_code == 2, getattr(result, "stderr", "")
    assert expected in _one_line_error(result)


@pytest.mark.parametrize("ranks", [["--nproc-per-node", "2"], []])
def test_dry_run_prints_every_rank_and_launches_nothing(tmp_path: Path,
                                                        ranks: list[str]) -> None:
    plan_path = write_plan_files(tmp_path)
    result = invoke("run", str(plan_path), *ranks, "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    rows = [ln for ln in result.stdout.splitlines() if ln.startswith("│")]
    assert [ln.split("│")[1].strip() for ln in rows if ln.split("│")[1].strip()] == ["0", "1"]
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.parametrize("nnodes, launched_ranks", [("1", "2"), ("2", "1")])
def test_ranks_per_node_default_to_the_plans_over_the_nodes(
        tmp_path: Path, monkeypatch, nnodes: str, launched_ranks: str) -> None:
    plan_path = write_plan_files(tmp_path)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", launched.append)
    result = invoke("run", str(plan_path), "--nnodes", nnodes, "--rdzv-endpoint", "h:29500")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    argv = launched[0]
    assert argv[argv.index("--nproc-per-node") + 1] == launched_ranks
    assert argv[argv.index("--nnodes") + 1] == nnodes


@pytest.mark.parametrize(("options", "said"), [({}, "2 ranks, 3 steps"),
                                              ({"zero": "2", "recompute": "true"},
                                               "2 ranks, ZeRO-2, recompute, 3 steps")])
def test_the_launch_line_names_the_memory_strategies(tmp_path: Path, monkeypatch,
                                                     options: dict[str, str], said: str) -> None:
    plan_path = write_plan_files(tmp_path)
    from spindle_cli.artifacts import Plan

    plan = load(str(plan_path), Plan)
    write_artifact(dataclasses.replace(plan, options={**plan.options, **options}),
                   str(tmp_path / "saving.yaml"))
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv: None)
    result = invoke("run", str(tmp_path / "saving.yaml"), "--steps", "3")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert f"spindle run: spindle plan, {len(plan.waves)} waves, {said}" in result.stderr


def test_ranks_that_do_not_split_over_the_nodes_are_refused(tmp_path: Path) -> None:
    plan_path = write_plan_files(tmp_path)
    result = invoke("run", str(plan_path), "--nnodes", "3", "--rdzv-endpoint", "h:29500")
    assert result.exit_code == 2
    assert "2 ranks do not split evenly over 3 nodes" in _one_line_error(result)


@pytest.mark.parametrize("cores, noted", [(1, True), (2, False)])
def test_more_cpu_ranks_than_cores_are_noted_at_launch(tmp_path: Path, monkeypatch,
                                                       cores: int, noted: bool) -> None:
    plan_path = write_plan_files(tmp_path)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", launched.append)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    result = invoke("run", str(plan_path), "--nproc-per-node", "2", "--backend", "gloo")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert len(launched) == 1
    note = "2 CPU ranks share 1 core here"
    assert (note in result.stderr) == noted
