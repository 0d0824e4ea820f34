"""`spindle run`: the real launcher end to end, refusals before launch, a crashing rank."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    Plan,
    Profile,
    input_ref,
    load,
    write_artifact,
)
from spindle_cli.cli import main
from spindle_cli.errors import RuntimeFailure, SpindleError
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.units import fmt_bytes

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def write_plan_files(tmp: Path, cluster_name: str = "local-cpu-2",
                     edit: Callable[[MetaOpGraph], MetaOpGraph] = lambda g: g,
                     options: PlanOptions | None = None, dtype: str = "fp32",
                     graph_name: str = "graph.yaml") -> Path:
    """graph.yaml (or `graph_name`), profile.yaml and plan.yaml for tiny-clip under `tmp`, as
    `spindle plan` would write them (from the graph in `dtype` as `edit` leaves it, with
    `options`)."""
    model_path = str(REPO / "models" / "tiny-clip.yaml")
    model = load(model_path, ModelSpec)
    graph = edit(build_graph(model, dtype=dtype, inputs=[input_ref(model, model_path)]))
    cluster_path = str(REPO / "clusters" / f"{cluster_name}.yaml")
    cluster = load(cluster_path, ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2])
    graph_path, profile_path = str(tmp / graph_name), str(tmp / "profile.yaml")
    write_artifact(graph, graph_path)
    write_artifact(profile, profile_path)
    plan = make_plan(graph, profile, cluster, options=options or PlanOptions(),
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
    # steps numbered as the loss lines number them
    assert {e["args"]["step"] for e in spans} == {1, 2}
    for step in (1, 2):
        syncs = [e for e in spans if e["name"] == "sync" and e["args"]["step"] == step]
        assert len(syncs) == 2
        forward_end = max(e["ts"] + e["dur"] for e in spans if e["cat"] == "compute"
                          and e["args"].get("step") == step
                          and e["args"].get("phase") == "forward")
        assert min(e["ts"] + e["dur"] for e in syncs) >= forward_end - 100
    summary = doc["otherData"]
    assert summary["measured_iteration_ms"] > 0
    # the run's time line says what the trace's summary holds
    assert (f"time: {summary['measured_iteration_ms']:.2f} ms/step (step 2 alone, after step "
            f"1's warm-up), predicted {summary['predicted_iteration_ms']:.2f} ms"
            in r.stderr.splitlines()), r.stderr
    assert set(summary["breakdown_ms_per_step"]) == {"0", "1"}
    assert all(parts["compute"] > 0 for parts in summary["breakdown_ms_per_step"].values())
    # every slice's measured compute beside its planned time, and the run says how they compare
    planned = [(s.id, s.time_ms) for w in load(str(plan), Plan).waves for s in w.slices]
    assert [(r["slice"], r["planned_ms"]) for r in summary["slices"]] == planned
    assert all(r["measured_ms"] > 0 for r in summary["slices"])
    assert "slices' compute: measured " in r.stderr
    # the prediction is the simulator's (the plan's profile and cluster files are at hand),
    # as the executor on gloo runs: each rank on its own, one gradient bucket per rank set
    from spindle_cli.planner.simulate import simulate

    args = (load(str(plan), Plan), load(str(tmp_path / "graph.yaml"), MetaOpGraph),
            load(str(tmp_path / "profile.yaml"), Profile),
            load(str(REPO / "clusters" / "local-cpu-2.yaml"), ClusterSpec))
    assert summary["predicted_iteration_ms"] == pytest.approx(
        simulate(*args, sync="per-set", progress="rank").iteration_ms)
    assert summary["predicted_by"] == "simulator"
    assert summary["predicted_with"] == {"progress": "rank", "sync": "per-set"}
    # the compute of a step, against which the slices' planned times are compared
    assert f"slices' compute: measured {summary['compute_ms_per_step']:.2f} ms" in r.stderr
    # where a step's time went on the longest rank, beside the simulated rank's parts, which
    # add up to the predicted iteration
    parts = summary["predicted_parts_ms"]
    assert sum(parts.values()) == pytest.approx(summary["predicted_iteration_ms"])
    longest = max(summary["breakdown_ms_per_step"].items(), key=lambda kv: sum(kv[1].values()))
    said = next(ln for ln in r.stderr.splitlines() if ln.startswith("parts of a step on rank "))
    assert said.startswith(f"parts of a step on rank {longest[0]}, the longest: compute "
                           f"{longest[1]['compute']:.2f}, ")
    assert said.endswith(f"; simulated compute {parts['compute']:.2f}, transfer "
                         f"{parts['transfer']:.2f}, sync {parts['sync']:.2f}, optimizer "
                         f"{parts['optimizer']:.2f} ms")
    # what each rank held at a step's turn beside its plan's estimate, and the line on it
    assert [row["rank"] for row in summary["memory"]] == [0, 1]
    for row in summary["memory"]:
        assert row["measured"]["param_bytes"] == row["planned"]["param_bytes"] > 0
        assert 0 < row["measured"]["activation_bytes"] <= row["planned"]["activation_bytes"]
    assert sum(ln.startswith("memory at a step's turn on rank ")
               for ln in r.stderr.splitlines()) == 1, r.stderr


@pytest.mark.parametrize("earlier", [False, True], ids=["no-file", "earlier-trace"])
def test_a_failed_run_says_its_trace_was_not_written(tmp_path: Path, monkeypatch,
                                                     earlier: bool) -> None:
    # the trace is written after the last step: a file of that name is an earlier run's
    plan = write_plan_files(tmp_path)
    trace = tmp_path / "trace.json"
    if earlier:
        trace.write_text("{}")

    def failing(argv, **_):
        raise RuntimeFailure("run failed: rank 0: loss is nan (test)")

    monkeypatch.setattr("spindle_cli.cli.run._launch", failing)
    result = invoke("run", str(plan), "--trace", str(trace))
    assert result.exit_code == 1
    said = "trace: not written, the run did not finish" + (
        f" ({trace} is an earlier run's)" if earlier else "")
    assert said in result.stderr.splitlines()
    assert result.stderr.splitlines()[-1] == "error: run failed: rank 0: loss is nan (test)"


def test_a_trace_the_disk_refused_is_not_called_unfinished(tmp_path: Path, monkeypatch) -> None:
    """Every step trained and the trace's own write failed (a full disk): the error names the
    trace, and the run did not say it had not finished."""
    plan = write_plan_files(tmp_path)
    trace = tmp_path / "trace.json"

    def refused(argv, **_):
        raise SpindleError(f"{trace}: cannot write: No space left on device")

    monkeypatch.setattr("spindle_cli.cli.run._launch", refused)
    result = invoke("run", str(plan), "--trace", str(trace))
    assert result.exit_code == 2
    assert "did not finish" not in result.stderr
    assert result.stderr.splitlines()[-1] == (f"error: {trace}: cannot write: No space left "
                                              "on device")


def _workers_of(plan: Path) -> list[int]:
    """The pids of the ranks running `plan` (their command lines name the worker and it)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"spindle_cli.runtime.rank" in cmdline and str(plan).encode() in cmdline:
            pids.append(int(entry.name))
    return pids


@contextlib.contextmanager
def _training(plan: Path) -> Iterator[subprocess.Popen[str]]:
    """`spindle run PLAN` for ever, once it has printed its first step; afterwards no rank of
    it is left and its pipes are closed, however the test ended."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    launcher = subprocess.Popen([sys.executable, "-m", "spindle_cli", "run", str(plan),
                                 "--steps", "1000000"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert launcher.stdout is not None
        first = launcher.stdout.readline()
        assert first.startswith("step 1/"), first
        yield launcher
    finally:
        for pid in _workers_of(plan):
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.communicate()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ranks_stop_when_their_launcher_is_killed(tmp_path: Path) -> None:
    """A launcher killed with SIGKILL cannot stop its ranks: they stop themselves (they went
    on training, printing steps and writing checkpoints, re-parented to init)."""
    plan = write_plan_files(tmp_path)
    with _training(plan) as launcher:
        assert len(_workers_of(plan)) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while _workers_of(plan) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _workers_of(plan)
        _, err = launcher.communicate()
        assert "its launcher (pid " in err and "is gone; stopping" in err, err


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_sigterm_stops_the_run_with_its_line_alone(tmp_path: Path) -> None:
    """A scheduler's SIGTERM: exit 143, every rank stopped, and on stderr the run's line only
    (torch's agent logged 'Received 15 death signal, shutting down workers' above it)."""
    plan = write_plan_files(tmp_path)
    with _training(plan) as launcher:
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 143
        assert [ln for ln in err.splitlines() if not ln.startswith("spindle run: ")] == [
            "error: interrupted by SIGTERM: every rank was stopped"], err
        assert not _workers_of(plan)


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
    # click's usage errors (bad option values) go through the same handler; its case differs
    # in older click output ("Error: ..."), the message does not
    errors = [ln for ln in lines if ln.lower().startswith("error: ")]
    assert len(errors) == 1, stderr
    assert "Traceback" not in stderr
    return errors[0]


@pytest.mark.parametrize("flag", ["--trace", "--checkpoint-dir"])
def test_an_empty_path_is_refused_before_launch(tmp_path: Path, flag: str) -> None:
    """`--trace ''` was an internal error (the plan compared with '', the current directory);
    `--checkpoint-dir ''` ran and saved nothing."""
    plan_path = write_plan_files(tmp_path)
    for dry in ([], ["--dry-run"]):
        r = invoke("run", str(plan_path), flag, "", *dry)
        assert getattr(r, "exit_code", None) == 2
        assert _one_line_error(r) == f"error: {flag}: an empty path"


def test_tensor_parallel_plan_is_refused_before_launch(tmp_path: Path) -> None:
    # the sequential baseline runs every slice on both ranks, so tp2 makes one group of them
    plan_path = write_plan_files(tmp_path, options=PlanOptions(planner="sequential"))

    plan = load(str(plan_path), Plan)
    w0 = plan.waves[0]
    assert len(w0.slices[0].ranks) == 2
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
    saving = write_plan_files(tmp_path, options=PlanOptions(
        zero=int(options["zero"]), recompute=options.get("recompute") == "true"))
    result = invoke("run", str(saving), "--dry-run")
    if named is None:
        assert result.exit_code == 0, getattr(result, "stderr", "")
        return
    assert result.exit_code == 2
    line = _one_line_error(result)
    assert named in line and "implements ZeRO-1 and -2 only" in line
    # the way out comes with it
    assert "hint: make the plan with `spindle plan --runnable`" in result.stderr


@pytest.mark.parametrize(("key", "value"), [("recompute", "yes"), ("colour", "red")])
def test_options_the_planner_does_not_write_are_refused_before_launch(tmp_path: Path,
                                                                      key: str,
                                                                      value: str) -> None:
    # the executor reads recompute as "true" or not: 'yes' would train without it
    plan = write_plan_files(tmp_path)
    data = yaml.safe_load(plan.read_text())
    data["options"][key] = value
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("run", str(plan), "--dry-run")
    assert result.exit_code == 2
    assert _one_line_error(result).startswith(f"error: {plan}: options.{key}: ")


@pytest.mark.parametrize(("graph_dtype", "flags", "said"), [
    ("bf16", [], None),
    ("bf16", ["--dtype", "bf16"], None),
    ("bf16", ["--dtype", "fp32"], "note: the plan sizes its memory and transfers in bf16 (its "
     "graph's dtype), but this run trains in fp32: its activations and messages take 2x the "
     "plan's bytes, its parameter state 1x; --dtype auto trains it in bf16, as planned, or "
     "plan from a graph made with --dtype fp32"),
    ("fp16", [], "note: the plan's graph is fp16; this run trains in bf16 (the same bytes; "
     "fp16 would need loss scaling, which the executor does not do)"),
    ("fp32", [], None),
    ("fp32", ["--dtype", "bf16"], "note: the plan sizes its memory and transfers in fp32 (its "
     "graph's dtype), but this run trains in bf16: its activations and messages take 0.5x "
     "the plan's bytes, its parameter state 1x"),
    ("fp32", ["--dtype", "fp64"], "note: the plan sizes its memory and transfers in fp32 (its "
     "graph's dtype), but this run trains in fp64: they take 2x the plan's bytes"),
])
def test_a_run_trains_in_the_dtype_its_plan_counts_by_default(
        tmp_path: Path, monkeypatch, graph_dtype: str, flags: list[str], said: str | None
        ) -> None:
    """--dtype auto (the default) trains a plan of a bf16 or fp16 graph in bf16 (mixed
    precision: the bytes the plan counts) and one of an fp32 graph in fp32; the launch line
    says which, and the workers are told it. Another dtype says how many times the plan's
    bytes it moves and holds."""
    plan = write_plan_files(tmp_path, dtype=graph_dtype)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv, **_: launched.append(argv))
    result = invoke("run", str(plan), "--steps", "1", *flags)
    assert result.exit_code == 0, result.stderr
    trained = flags[1] if flags else "fp32" if graph_dtype == "fp32" else "bf16"
    assert f", {trained}, 1 step" in result.stderr
    argv = launched[0]
    assert argv[argv.index("--dtype") + 1] == trained
    notes = [ln for ln in result.stderr.splitlines() if ln.startswith("note: the plan")]
    assert notes == ([said] if said else [])


def test_more_nccl_ranks_than_gpus_are_refused_before_launch(tmp_path: Path,
                                                             monkeypatch) -> None:
    """nccl runs one rank per GPU: more ranks on a node than it has visible GPUs is one line
    before launch (torch failed with a device index out of range, NCCL with 'Duplicate GPU
    detected'). A machine with one visible GPU stands in (this one has none)."""
    import torch

    plan = write_plan_files(tmp_path)  # 2 ranks
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = invoke("run", str(plan), "--backend", "nccl", "--dry-run")
    assert result.exit_code == 2
    assert _one_line_error(result) == ("error: 2 nccl ranks per node need as many GPUs, and "
                                       "this node has 1 visible")
    # two nodes of one rank each fit
    result = invoke("run", str(plan), "--backend", "nccl", "--dry-run", "--nnodes", "2",
                    "--rdzv-endpoint", "127.0.0.1:29500")
    assert result.exit_code == 0, result.stderr


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


def test_a_changed_profile_is_noted_and_the_plan_still_runs(tmp_path: Path) -> None:
    # a run needs only the plan, its graph and its model; the profile the waves were timed
    # on, where found but changed since, is worth a line before the run
    plan_path = write_plan_files(tmp_path)
    profile = tmp_path / "profile.yaml"
    profile.write_text(profile.read_text().replace("max_rel_error: 0.0", "max_rel_error: 0.5",
                                                   1))
    result = invoke("run", str(plan_path), "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert (f"note: {plan_path}: inputs[1].sha256: profile '{profile}' changed since the plan "
            "was made (sha256 mismatch); training the plan as it is") in " ".join(
                getattr(result, "stderr", "").split())
    # found nowhere: nothing to say
    profile.unlink()
    result = invoke("run", str(plan_path), "--dry-run")
    assert result.exit_code == 0
    assert "note:" not in getattr(result, "stderr", "")


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
    # the data item, step and rows the dataset's error came from (it said only the error)
    said = (r"rank 1: data \w+/\w+ at step 2 \(rows\('\w+', '\w+', 1, \d+, \d+\)\) raised "
            r"OSError\('disk read failed \(injected\)'\)")
    assert re.search(f"^error: {said}$", r.stderr, re.MULTILINE), r.stderr
    # the one-line summary names the root cause, not rank 0 (which only lost its peer)
    assert re.fullmatch(f"error: run failed: {said}", r.stderr.strip().splitlines()[-1])
    assert "Traceback" not in r.stderr
    # each rank's line ends with its own newline, however close together the ranks fail
    assert all(ln.count("error: ") == 1 for ln in r.stderr.splitlines() if "error: " in ln), \
        r.stderr
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
    # nothing else: no traceback, nor the C++ runtime's 'terminate called without an active
    # exception' from a failed rank's shutdown
    assert all(ln.startswith(("spindle run: ", "error: ")) for ln in r.stderr.splitlines()), \
        r.stderr


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize(("args", "expected"), [
    (["--dataset", "no_such_module:make"], "No module named 'no_such_module'"),
    (["--dataset", "faulty_data"], "expected 'module:function'"),
    (["--dataset", "faulty_data:returns_nothing"],
     "the function returned NoneType, which has no rows(task, name, step, lo, hi) method"),
    (["--dataset", "faulty_data:wrong_shape"],
     "rows('text_vision', 'text', 0, 0, 1) got torch.float32 [1], expected int64 token ids [1, "),
    (["--dataset", "faulty_data:unreadable"],
     "rows('text_vision', 'text', 0, 0, 1) raised OSError('no such shard')"),
    (["--dataset", "faulty_data:missing_file"],
     "--dataset 'faulty_data:missing_file': missing_file(model, seed) raised "
     "FileNotFoundError(2, 'No such file or directory')"),
    (["--dataset", "json:loads"], "loads(model, seed) raised TypeError("),
    (["--dataset", "faulty_data:out_of_vocabulary"],
     "outside the vocabulary of 128 (ids 0-127)"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--keep-checkpoints", "2"], "--keep-checkpoints needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/file"], "file: is not a directory"),
    (["--checkpoint-dir", "{tmp}/file/ck"], "/file is not a directory"),
    (["--checkpoint-dir", "{tmp}/file", "--resume"], "file: is not a directory"),
    (["--trace", "/no/such/dir/trace.json"], "directory does not exist"),
    (["--trace", "{tmp}"], "is a directory"),
    (["--trace", "{tmp}/trace.txt"], "a Chrome trace is a .json file"),
    (["--trace", "{tmp}/file/trace.json"], "/file is not a directory"),
    # directories that refuse new files even where os.access says yes (to root): the run
    # trained every step, then failed to save
    (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir /proc/ck: cannot write in '/proc'"),
    (["--checkpoint-dir", "/proc/ck", "--resume"], "cannot write in '/proc'"),
    (["--trace", "/sys/t.json"], "--trace /sys/t.json: cannot write in '/sys'"),
    (["--lr", "nan"], "nan is not a finite number"),
    (["--lr", "inf"], "inf is not a finite number"),
    (["--timeout-s", "nan"], "nan is not a finite number"),
    (["--timeout-s", "inf"], "inf is not a finite number"),
    (["--timeout-s", "0"], "0.0 is not in the range 1<=x<=604800.0"),
    # past torch's limits: every rank failed (OverflowError), or the rendezvous at once
    (["--timeout-s", "1e16"], "1e+16 is not in the range 1<=x<=604800.0"),
    (["--timeout-s", "1e10"], "10000000000.0 is not in the range 1<=x<=604800.0"),
    (["--nnodes", "2", "--nproc-per-node", "2"], "the run has 4"),
    (["--nnodes", "2", "--node-rank", "5", "--rdzv-endpoint", "h:29500"],
     "--node-rank 5 with --nnodes 2: node ranks run from 0 to 1"),
    (["--node-rank", "1"], "--node-rank 1 with --nnodes 1: node ranks run from 0 to 0"),
    (["--rdzv-endpoint", "nonsense"], "'nonsense' is not HOST:PORT"),
    (["--rdzv-endpoint", "h:"], "'h:' is not HOST:PORT"),
    (["--rdzv-endpoint", "h:65536"], "'h:65536' is not HOST:PORT"),
    (["--rdzv-endpoint", "::1:29500"], "write an IPv6 address in brackets"),
])
def test_bad_run_options_are_refused_before_launch(tmp_path: Path, monkeypatch,
                                                   args: list[str], expected: str,
                                                   dry_run: bool) -> None:
    """The run refuses what its dry run refuses, with one line, and launches nothing."""
    plan_path = write_plan_files(tmp_path)
    (tmp_path / "file").write_text("x")
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    args = [a.format(tmp=tmp_path) for a in args]
    result = invoke("run", str(plan_path), *args, *["--dry-run"] * dry_run)
    assert result.exit_code == 2, getattr(result, "stderr", "")
    assert expected in _one_line_error(result)
    assert not launched


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("over", ["plan", "graph"])
def test_a_trace_over_a_file_the_run_reads_is_refused(tmp_path: Path, monkeypatch, over: str,
                                                       dry_run: bool) -> None:
    # the plan as JSON; a JSON graph passed the suffix check, and the run replaced the plan's
    # graph with its trace
    plan = write_plan_files(tmp_path, graph_name="graph.json")
    if over == "plan":
        target = tmp_path / "plan.json"
        target.write_text(json.dumps(yaml.safe_load(plan.read_text())))
        plan, what = target, "the plan"
    else:
        target, what = tmp_path / "graph.json", "the plan's graph"
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    before = target.read_text()
    result = invoke("run", str(plan), "--trace", str(target), *["--dry-run"] * dry_run)
    assert result.exit_code == 2
    assert f"--trace {target}: is {what}; writing it would replace it" in \
        _one_line_error(result)
    assert not launched and target.read_text() == before


def _wider_batch(graph: MetaOpGraph) -> MetaOpGraph:
    """The graph with its first MetaOp's batch doubled: not what the model gives."""
    first = graph.metaops[0]
    return dataclasses.replace(graph, metaops=(
        dataclasses.replace(first, batch_size=2 * first.batch_size), *graph.metaops[1:]))


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_graph_that_is_not_its_models_is_refused(tmp_path: Path, monkeypatch,
                                                   dry_run: bool) -> None:
    # planned from consistently, so every recorded sha256 matches: only the model can tell
    plan = write_plan_files(tmp_path, edit=_wider_batch)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    result = invoke("run", str(plan), *["--dry-run"] * dry_run)
    assert result.exit_code == 2
    assert _one_line_error(result).startswith(
        f"error: {tmp_path / 'graph.yaml'}: is not the graph its model gives")
    assert not launched


@pytest.mark.parametrize("plan", sorted(p.name for p in (REPO / "plans").glob("*.yaml")))
def test_every_committed_plan_passes_the_run_checks(plan: str, monkeypatch) -> None:
    # the rebuilt graph is compared as the file holds it: a800 graphs' FLOPs are rounded when
    # written, and every a800 plan was refused as "not the graph its model gives"
    from spindle_cli.runtime.inputs import load_run_inputs

    monkeypatch.chdir(REPO)
    path = f"plans/{plan}"
    if any(s.strategy.startswith("tp") for _, s in load(path, Plan).slices()):
        with pytest.raises(SpindleError, match="the executor runs data-"):
            load_run_inputs(path)
    else:
        assert load_run_inputs(path).plan == load(path, Plan)


def test_a_plan_for_another_cluster_size_is_refused(tmp_path: Path) -> None:
    # a plan for the 4 ranks of local-cpu, its cluster input pointed at local-cpu-2 (sha256
    # and all, so only the sizes disagree)
    plan = write_plan_files(tmp_path, cluster_name="local-cpu")
    data = yaml.safe_load(plan.read_text())
    two = str(REPO / "clusters" / "local-cpu-2.yaml")
    ref = next(r for r in data["inputs"] if r["kind"] == "cluster")
    ref.update(path=two, sha256=input_ref(load(two, ClusterSpec), two).sha256)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("run", str(plan), "--dry-run")
    assert result.exit_code == 2
    assert _one_line_error(result) == (f"error: {plan}: the plan is for 4 devices but its "
                                       "cluster has 2")


def test_a_renamed_cluster_file_is_noted_not_refused(tmp_path: Path) -> None:
    # the plan's cluster file renamed since (its devices and islands as they were): a run
    # needs neither its name nor its figures, so it notes the change and goes on, as for any
    # other change to the file
    plan = write_plan_files(tmp_path)
    data = yaml.safe_load(plan.read_text())
    ref = next(r for r in data["inputs"] if r["kind"] == "cluster")
    renamed = tmp_path / "renamed.yaml"
    renamed.write_text((REPO / "clusters" / "local-cpu-2.yaml").read_text().replace(
        "name: local-cpu-2", "name: my-laptop"))
    ref["path"] = str(renamed)
    plan.write_text(yaml.safe_dump(data, sort_keys=False))
    result = invoke("run", str(plan), "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert "changed since the plan was made" in result.stderr


def test_a_dataset_module_in_the_working_directory_is_found(tmp_path: Path,
                                                           monkeypatch) -> None:
    plan_path = write_plan_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    Path("my_rows.py").write_text("from spindle_cli.runtime.data import SyntheticData\n"
                                  "def make(model, seed):\n"
                                  "    return SyntheticData(model, seed)\n")
    result = invoke("run", str(plan_path), "--dataset", "my_rows:make", "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")


def test_a_dataset_module_that_does_not_import_is_refused(tmp_path: Path, monkeypatch) -> None:
    plan_path = write_plan_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    Path("broken_rows.py").write_text("def make(model, seed:\n    return None\n")
    result = invoke("run", str(plan_path), "--dataset", "broken_rows:make", "--dry-run")
    assert result.exit_code == 2, getattr(result, "stderr", "")
    assert "--dataset 'broken_rows:make': importing broken_rows raised SyntaxError(" in \
        _one_line_error(result)


def test_sound_run_options_are_passed_on_and_create_nothing(tmp_path: Path,
                                                            monkeypatch) -> None:
    plan_path = write_plan_files(tmp_path)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    ckpt, trace = tmp_path / "new" / "ckpt", tmp_path / "trace.json"
    result = invoke("run", str(plan_path), "--checkpoint-dir", str(ckpt), "--resume",
                    "--trace", str(trace), "--rdzv-endpoint", "[::1]:29500", "--lr", "0.01")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    argv = launched[0]
    assert argv[argv.index("--rdzv-endpoint") + 1] == "[::1]:29500"
    # the static rendezvous keeps node ranks as given and waits at most --timeout-s
    assert argv[argv.index("--rdzv-backend") + 1] == "static"
    assert argv[argv.index("--rdzv-conf") + 1] == "timeout=300"
    assert argv[argv.index("--checkpoint-dir") + 1] == str(ckpt)
    assert "--resume" in argv and "--checkpoint-every" not in argv
    # the workers make the checkpoint directory when they first save
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(("every", "said"), [([], "after step 5"),
                                             (["--checkpoint-every", "2"],
                                              "every 2 steps and after step 5"),
                                             (["--checkpoint-every", "5"], "after step 5"),
                                             (["--checkpoint-every", "1", "--keep-checkpoints",
                                               "2"], "every 1 step and after step 5, keeping "
                                                     "the newest 2")])
def test_dry_run_says_when_the_run_checkpoints(tmp_path: Path, every: list[str],
                                               said: str) -> None:
    plan_path = write_plan_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    result = invoke("run", str(plan_path), "--steps", "5", "--checkpoint-dir", str(ckpt),
                    *every, "--resume", "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    lines = result.stdout.splitlines()
    assert f"checkpoints: {ckpt}, {said}" in lines
    # --resume without a checkpoint yet starts from step 0 (as the workers do, and say)
    assert f"no checkpoint in {ckpt} yet: starting from step 0" in lines
    assert not ckpt.exists()


def test_worker_refuses_bad_options_before_the_process_group(tmp_path: Path,
                                                             monkeypatch) -> None:
    """Under a plain `torchrun`, every rank runs the checks of `spindle run` before
    initializing the process group."""
    from spindle_cli.runtime import worker

    plan_path = write_plan_files(tmp_path)
    inits: list[object] = []
    monkeypatch.setattr(worker.rdist, "init", lambda *a, **k: inits.append(a))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    assert worker.main([str(plan_path), "--trace", str(tmp_path / "trace.txt")]) == 2
    assert worker.main([str(plan_path), "--lr", "nan"]) == 2
    assert not inits


@pytest.fixture(scope="module")
def one_step_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(plan, checkpoint dir) of a real 2-rank, 1-step run given --checkpoint-dir alone."""
    tmp = tmp_path_factory.mktemp("one_step")
    plan = write_plan_files(tmp)
    ckpt = tmp / "ckpt"
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "1", "--timeout-s", "60",
                "--checkpoint-dir", str(ckpt))
    assert r.returncode == 0, r.stderr
    return plan, ckpt


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_checkpoint_dir_alone_saves_after_the_last_step(
        one_step_checkpoint: tuple[Path, Path]) -> None:
    _, ckpt = one_step_checkpoint
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000001"]
    assert sorted(p.name for p in (ckpt / "step-000001").iterdir()) == \
        ["manifest.json", "rank-00000.pt", "rank-00001.pt"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize(("args", "said"), [
    (["--steps", "3"], "resuming from {ckpt}/step-000001 at step 1: training steps 2-3"),
    (["--steps", "1"], "resuming from {ckpt}/step-000001 at step 1: nothing left to train"),
    (["--seed", "1"], "error: {ckpt}/step-000001: checkpoint was taken with seed=0, this run "
                      "has 1"),
    (["--dtype", "fp64"], "checkpoint was taken with dtype='fp32', this run has 'fp64'"),
    # the optimizer state lives in the gradient buckets' flat tensors
    (["--sync", "chunked"], "checkpoint was taken with sync='per-set', this run has 'chunked, "),
])
def test_resume_is_checked_against_the_checkpoint_before_launch(
        one_step_checkpoint: tuple[Path, Path], monkeypatch, args: list[str], said: str,
        dry_run: bool) -> None:
    plan, ckpt = one_step_checkpoint
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    said = said.format(ckpt=ckpt)
    result = invoke("run", str(plan), "--checkpoint-dir", str(ckpt), "--resume", *args,
                    *["--dry-run"] * dry_run)
    if "checkpoint was taken" in said:
        assert result.exit_code == 2, getattr(result, "stderr", "")
        assert said in _one_line_error(result)
        assert not launched
    elif dry_run:
        assert result.exit_code == 0, getattr(result, "stderr", "")
        assert any(ln.startswith(said) for ln in result.stdout.splitlines()), result.stdout
        # with nothing left no step runs, so no checkpoint is written
        assert ("nothing left" in said) is not any(
            ln.startswith("checkpoints:") for ln in result.stdout.splitlines())
    elif "nothing left" in said:
        # every step done: the ranks would only start and stop, so none is launched
        assert result.exit_code == 0, getattr(result, "stderr", "")
        assert said in " ".join(getattr(result, "stderr", "").split())
        assert not launched
    else:
        # the workers say where they resume from (rank 0, on stderr)
        assert result.exit_code == 0, getattr(result, "stderr", "")
        assert len(launched) == 1


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_a_cut_rank_file_is_passed_over_before_launch(tmp_path: Path, monkeypatch,
                                                      dry_run: bool) -> None:
    """A rank file cut short (`head -c 100`) made the dry run promise a resume from its
    checkpoint, and the real run fail after launch in torch.load, naming no file. Checkpoints
    of 2 ranks are made here without a process group: rank 0's state under both names."""
    from spindle_cli.runtime import checkpoint, options

    plan_path = write_plan_files(tmp_path)
    plan = load(str(plan_path), Plan)
    ckpt = tmp_path / "ckpt"
    meta = options.checkpoint_meta(plan, options.TrainOptions(steps=1, overlap_sync=False))
    for step in (1, 2):
        checkpoint.save(str(ckpt), step, rank=0, world_size=1, state={"step": step}, meta=meta)
        saved = checkpoint.step_dir(str(ckpt), step)
        manifest = saved / checkpoint.MANIFEST
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "world_size": 2}))
        (saved / "rank-00001.pt").write_bytes((saved / "rank-00000.pt").read_bytes())
    cut = ckpt / "step-000002" / "rank-00001.pt"
    cut.write_bytes(cut.read_bytes()[:100])
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    result = invoke("run", str(plan_path), "--steps", "3", "--checkpoint-dir", str(ckpt),
                    "--resume", *["--dry-run"] * dry_run)
    assert result.exit_code == 0, getattr(result, "stderr", "")
    if dry_run:
        assert result.stdout.splitlines()[-2:] == [
            f"note: passing over {ckpt / 'step-000002'}: checkpoint has damaged rank-00001.pt "
            "(cut short, or not written by torch.save)",
            f"resuming from {ckpt / 'step-000001'} at step 1: training steps 2-3"]
    else:
        assert len(launched) == 1
    # with no whole checkpoint left, the run is refused before launch, naming the file
    (ckpt / "step-000001" / "rank-00001.pt").write_bytes(b"")
    result = invoke("run", str(plan_path), "--steps", "3", "--checkpoint-dir", str(ckpt),
                    "--resume", *["--dry-run"] * dry_run)
    assert result.exit_code == 2, getattr(result, "stderr", "")
    assert _one_line_error(result) == (f"error: {ckpt / 'step-000002'}: checkpoint has damaged "
                                       "rank-00001.pt (cut short, or not written by torch.save)")
    assert len(launched) == (0 if dry_run else 1)


@pytest.mark.parametrize("ranks", [["--nproc-per-node", "2"], []])
def test_dry_run_prints_every_rank_and_launches_nothing(tmp_path: Path,
                                                        ranks: list[str]) -> None:
    plan_path = write_plan_files(tmp_path)
    result = invoke("run", str(plan_path), *ranks, "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    rows = [ln for ln in result.stdout.splitlines() if ln.startswith("│")]
    assert [ln.split("│")[1].strip() for ln in rows if ln.split("│")[1].strip()] == ["0", "1"]
    assert not list(tmp_path.glob("*.json"))


def test_dry_run_prints_its_rank_table_whole_in_a_narrow_terminal(monkeypatch) -> None:
    # qwen-val's 64 ranks: its gradient groups' rank sets, each rank listed, ran to 1,800
    # columns, and a pipe or a narrow terminal cut them into ellipses
    monkeypatch.setenv("COLUMNS", "40")
    result = invoke("run", str(REPO / "plans" / "qwen-val-a800-8x8.yaml"), "--dry-run")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    rows = [ln for ln in result.stdout.splitlines() if ln.startswith("│")]
    assert [int(ln.split("│")[1]) for ln in rows] == list(range(64))
    assert "…" not in result.stdout
    groups = " ".join(ln.split("│")[7] for ln in rows)
    assert re.search(r"\{\d+-\d+", groups)  # runs of ranks as ranges: {0-31}
    assert not any(int(b) == int(a) + 1 for a, b in re.findall(r"(\d+),(\d+)", groups))


@pytest.mark.parametrize("nnodes, launched_ranks", [("1", "2"), ("2", "1")])
def test_ranks_per_node_default_to_the_plans_over_the_nodes(
        tmp_path: Path, monkeypatch, nnodes: str, launched_ranks: str) -> None:
    plan_path = write_plan_files(tmp_path)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    result = invoke("run", str(plan_path), "--nnodes", nnodes, "--rdzv-endpoint", "h:29500")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    argv = launched[0]
    assert argv[argv.index("--nproc-per-node") + 1] == launched_ranks
    assert argv[argv.index("--nnodes") + 1] == nnodes


@pytest.mark.parametrize(("options", "said"), [({}, "2 ranks, fp32, 3 steps"),
                                              ({"zero": "2", "recompute": "true"},
                                               "2 ranks, ZeRO-2, recompute, fp32, 3 steps")])
def test_the_launch_line_names_the_memory_strategies(tmp_path: Path, monkeypatch,
                                                     options: dict[str, str], said: str) -> None:
    saving = write_plan_files(tmp_path, options=PlanOptions(
        zero=int(options.get("zero", "0")), recompute=options.get("recompute") == "true"))
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv, **_: None)
    result = invoke("run", str(saving), "--steps", "3")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    waves = len(load(str(saving), Plan).waves)
    assert f"spindle run: spindle plan, {waves} waves, {said}" in result.stderr


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
    monkeypatch.setattr("spindle_cli.cli.run._launch",
                        lambda argv, **_: launched.append(argv))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    result = invoke("run", str(plan_path), "--nproc-per-node", "2", "--backend", "gloo")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert len(launched) == 1
    note = "2 CPU ranks share 1 core here"
    assert (note in result.stderr) == noted


@pytest.mark.parametrize(("signum", "code"), [(2, 130), (15, 143)])
def test_an_interrupted_run_exits_with_the_signal_not_as_a_bug(tmp_path: Path, monkeypatch,
                                                              signum: int, code: int) -> None:
    """Ctrl-C, or a scheduler's SIGTERM, reaches the launcher as torchrun's SignalException:
    one line and 128 + the signal, not an internal error."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted(args: object) -> None:
        raise SignalException("Process 1 got signal", sigval=signal.Signals(signum))

    plan_path = write_plan_files(tmp_path)
    monkeypatch.setattr(torch.distributed.run, "run", interrupted)
    result = invoke("run", str(plan_path), "--steps", "1")
    assert result.exit_code == code, getattr(result, "stderr", "")
    name = signal.Signals(signum).name
    assert _one_line_error(result) == f"error: interrupted by {name}: every rank was stopped"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_resume_with_nothing_left_writes_no_trace(one_step_checkpoint: tuple[Path, Path],
                                                    tmp_path: Path) -> None:
    """No step ran, so there is nothing to compare with the plan (it reported -100% drift)."""
    plan, ckpt = one_step_checkpoint
    trace = tmp_path / "trace.json"
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "1", "--timeout-s", "60",
                "--checkpoint-dir", str(ckpt), "--resume", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    assert f"trace: no step ran, so nothing was traced ({trace} not written)" in r.stderr
    assert not trace.exists()


def _failure(exitcode: int, timestamp: int, message: str = "",
             secondary: bool = False, hint: str | None = None,
             peers: tuple[int, ...] = ()) -> object:
    """A torchrun ProcessFailure as `root_cause` reads it."""
    from types import SimpleNamespace

    return SimpleNamespace(
        message=message, exitcode=exitcode, timestamp=timestamp,
        error_file_data=({"spindle": {"secondary": secondary, "peers": list(peers),
                                      "hint": hint}} if message else {}),
        signal_name=lambda: signal.Signals(-exitcode).name if exitcode < 0 else "")


@pytest.mark.parametrize(("failures", "said"), [
    # rank 1 killed from outside; the launcher then stopped rank 0
    ({0: _failure(-15, 2), 1: _failure(-9, 3)}, "rank 1 was killed by signal 9 (SIGKILL)"),
    # rank 0 saw its peer go first; rank 1 was killed from outside, not by the launcher
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1", secondary=True, peers=(1,)),
      1: _failure(-9, 2)}, "rank 1 was killed by signal 9 (SIGKILL)"),
    # rank 1 hung (or was stopped): rank 0 lost contact with it, and the launcher killed it
    # once its SIGTERM went unanswered for 30 s; rank 2 stopped when asked
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1", secondary=True, peers=(1,)),
      1: _failure(-9, 31), 2: _failure(-15, 31)},
     "rank 0: lost contact with rank(s) 1; rank 1 then did not stop when asked and the "
     "launcher killed it (SIGKILL): hung, or stopped (SIGSTOP); the launcher also stopped "
     "rank(s) 2"),
    # killed late, but no rank lost contact with it: not the launcher's kill of a hung rank
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 2", secondary=True, peers=(2,)),
      1: _failure(-9, 31), 2: _failure(-15, 31)}, "rank 1 was killed by signal 9 (SIGKILL)"),
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1", secondary=True),
      1: _failure(-15, 2)},
     "rank 0: lost contact with rank(s) 1; the launcher then stopped rank(s) 1"),
    # the rank its peer lost ended by SIGTERM and its connection closed: sent from outside
    # (a review's kill -TERM); rank 2 was stopped by the launcher
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1 (Connection reset by peer)",
                  secondary=True, peers=(1,)),
      1: _failure(-15, 1), 2: _failure(-15, 1)},
     "rank 0: lost contact with rank(s) 1 (Connection reset by peer); rank 1 had ended by "
     "SIGTERM from outside the run (its peers saw its connection close, not time out); the "
     "launcher also stopped rank(s) 2"),
    # lost in a collective, whose line names every peer: the launcher's SIGTERM to rank 1
    # and the outside one to rank 3 cannot be told apart (a review's run blamed both)...
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1, 3 in the gradient sync",
                  secondary=True, peers=(1, 3)),
      1: _failure(-15, 1), 2: _failure(-15, 1), 3: _failure(-15, 1)},
     "rank 0: lost contact with rank(s) 1, 3 in the gradient sync; of ranks 1, 3, one or "
     "more had ended by SIGTERM from outside the run and the launcher stopped the others "
     "(their peers saw a connection close in a collective of them all, not time out: which, "
     "they cannot tell); the launcher also stopped rank(s) 2"),
    # ... unless a transfer's line names one of them alone
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1, 3 in the gradient sync",
                  secondary=True, peers=(1, 3)),
      2: _failure(1, 1, "rank 2: lost contact with rank(s) 3 in the transfers of wave 4",
                  secondary=True, peers=(3,)),
      1: _failure(-15, 1), 3: _failure(-15, 1)},
     "rank 0: lost contact with rank(s) 1, 3 in the gradient sync; rank 3 had ended by SIGTERM "
     "from outside the run (its peers saw its connection close, not time out); the launcher "
     "also stopped rank(s) 1"),
    # ... and a collective's line naming one of them beside a live peer does not (a diff
    # review: rank 2 lost rank 3 in a reduction of 0, 1 and 3; rank 0 then lost 2 in a
    # sync of 1 and 2, which named rank 1 as the one killed from outside)
    ({2: _failure(1, 1, "rank 2: lost contact with rank(s) 0, 1, 3 in the loss reduction",
                  secondary=True, peers=(0, 1, 3)),
      0: _failure(1, 2, "rank 0: lost contact with rank(s) 1, 2 in the gradient sync",
                  secondary=True, peers=(1, 2)),
      1: _failure(-15, 2), 3: _failure(-15, 1)},
     "rank 2: lost contact with rank(s) 0, 1, 3 in the loss reduction; of ranks 1, 3, one or "
     "more had ended by SIGTERM from outside the run and the launcher stopped the others "
     "(their peers saw a connection close in a collective of them all, not time out: which, "
     "they cannot tell)"),
    # ... and where the peer timed out waiting for it, it hung and the launcher stopped it
    ({0: _failure(1, 1, "rank 0: lost contact with rank(s) 1 (Application timeout caused "
                        "pair closure)", secondary=True, peers=(1,)),
      1: _failure(-15, 1)},
     "rank 0: lost contact with rank(s) 1 (Application timeout caused pair closure); the "
     "launcher then stopped rank(s) 1"),
    ({0: _failure(-15, 2), 1: _failure(1, 5, "rank 1: OSError: disk read failed")},
     "rank 1: OSError: disk read failed"),
    ({0: _failure(-15, 4), 1: _failure(-15, 2)}, "rank 1 was killed by signal 15 (SIGTERM)"),
    ({1: _failure(3, 2)}, "rank 1 exited with code 3"),
    # a SIGINT to one rank alone (it said 'exited with code 130')
    ({0: _failure(-15, 3), 2: _failure(130, 2)},
     "rank 2 was interrupted (SIGINT) from outside the run"),
])
def test_a_failed_run_names_the_rank_that_failed_first(failures: dict[int, object],
                                                       said: str) -> None:
    from types import SimpleNamespace

    from spindle_cli.cli.run_failures import root_cause

    assert root_cause(SimpleNamespace(failures=failures)) == said


def test_a_failed_run_gives_the_hint_of_the_rank_it_names() -> None:
    """A rank's error hint (a damaged checkpoint: remove it) reached only the rank's error
    file; the run's error line now carries it, from the rank that line names."""
    from types import SimpleNamespace

    from spindle_cli.cli.run_failures import hint_of, root_cause

    damaged = _failure(1, 1, "rank 0: ck/rank-00000.pt: cannot load the checkpoint",
                       hint="remove ck/step-000003 to resume from the checkpoint before it")
    lost = _failure(1, 2, "rank 1: lost contact with rank(s) 0", secondary=True,
                    hint="other")
    for failures in ({0: damaged, 1: lost}, {0: damaged, 1: _failure(-15, 3)}):
        e = SimpleNamespace(failures=failures)
        assert hint_of(e, root_cause(e)) == \
            "remove ck/step-000003 to resume from the checkpoint before it"
    e = SimpleNamespace(failures={0: _failure(-15, 2), 1: _failure(-9, 3)})
    assert hint_of(e, root_cause(e)) is None


def test_an_aborted_nccl_rank_is_explained() -> None:
    """On nccl a collective that times out does not raise in the rank: NCCL's watchdog aborts
    it (SIGABRT, no line of its own), so the run's error says what that most likely means;
    gloo ranks report a lost peer themselves, and other signals are other causes."""
    from spindle_cli.cli.run_failures import abort_hint

    aborted = "rank 1 was killed by signal 6 (SIGABRT)"
    hint = abort_hint(aborted, "nccl")
    assert hint is not None and "--timeout-s" in hint and "watchdog" in hint
    assert abort_hint(aborted, "gloo") is None
    assert abort_hint("rank 1 was killed by signal 9 (SIGKILL)", "nccl") is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nodes_take_the_node_rank_they_are_given(tmp_path: Path, monkeypatch) -> None:
    """Two single-rank 'nodes' on this machine: the one started second with --node-rank 0
    holds rank 0 (it prints the losses); torchrun's c10d rendezvous ranked them by arrival."""
    plan = write_plan_files(tmp_path)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    endpoint = f"127.0.0.1:{_free_port()}"
    node = ["run", str(plan), "--steps", "1", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", endpoint, "--timeout-s", "60"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    second = subprocess.Popen([sys.executable, "-m", "spindle_cli", *node, "--node-rank", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    first = spindle(*node, "--node-rank", "0", timeout_s=200)
    out, err = second.communicate(timeout=200)
    assert first.returncode == 0 and second.returncode == 0, (first.stderr, err)
    assert first.stdout.startswith("step 1/1  loss ")
    assert out == ""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_rendezvous_port_in_use_is_bad_input(tmp_path: Path) -> None:
    """Node 0 serves the rendezvous on its --rdzv-endpoint port: one held by another process
    failed the run (exit 1) saying the nodes did not meet, with a hint about --nnodes."""
    import socket

    plan = write_plan_files(tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        endpoint = f"127.0.0.1:{held.getsockname()[1]}"
        r = spindle("run", str(plan), "--steps", "1", "--nnodes", "1", "--nproc-per-node", "2",
                    "--rdzv-endpoint", endpoint, "--timeout-s", "10", timeout_s=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[1:] == [
        f"error: --rdzv-endpoint {endpoint}: the port is in use on this node",
        "hint: give a free port (the same on every node), or end what holds it"]


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_node_that_cannot_reach_the_rendezvous_prints_no_cpp_log(tmp_path: Path,
                                                                   monkeypatch) -> None:
    # node 1 connects to node 0's store, which is not there: torch's C++ log printed a c10d
    # backtrace for every retry before the one-line error
    plan = write_plan_files(tmp_path)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    endpoint = f"127.0.0.1:{_free_port()}"
    r = spindle("run", str(plan), "--steps", "1", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", "1", "--rdzv-endpoint", endpoint, "--timeout-s", "3",
                timeout_s=60)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith("spindle run: ") and lines[2].startswith("hint: "), r.stderr
    assert lines[1].startswith(f"error: the nodes did not meet at {endpoint}: ")
    assert len(lines) == 3, r.stderr


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_node_waiting_for_its_peers_stops_at_once(tmp_path: Path, monkeypatch,
                                                    signum: int) -> None:
    """Ctrl-C or SIGTERM while node 0 waits in torch's C++ rendezvous for a node that never
    comes: it stopped only when the wait timed out (here 90 s; 300 by default)."""
    import socket

    plan = write_plan_files(tmp_path)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    node = subprocess.Popen(
        [sys.executable, "-m", "spindle_cli", "run", str(plan), "--steps", "1", "--nnodes",
         "2", "--nproc-per-node", "1", "--node-rank", "0", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "--timeout-s", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        # waiting: its store listens for the other node
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert node.poll() is None and time.monotonic() < deadline, node.communicate()
            time.sleep(0.1)
        time.sleep(0.5)
        node.send_signal(signum)
        out, err = node.communicate(timeout=15)
    finally:
        node.kill()
        node.communicate()
    name = signal.Signals(signum).name
    assert node.returncode == 128 + signum, err
    assert err.splitlines()[-1] == f"error: interrupted by {name} before any rank started", err
    assert out == ""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_node_whose_peers_never_come_fails_within_the_timeout(tmp_path: Path,
                                                                monkeypatch) -> None:
    plan = write_plan_files(tmp_path)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    endpoint = f"127.0.0.1:{_free_port()}"
    r = spindle("run", str(plan), "--steps", "1", "--nnodes", "2", "--nproc-per-node", "1",
                "--node-rank", "0", "--rdzv-endpoint", endpoint, "--timeout-s", "3",
                timeout_s=60)
    assert r.returncode == 1, r.stderr
    assert _one_line_error(r).startswith(f"error: the nodes did not meet at {endpoint}: ")


def test_torchrun_variables_left_in_the_environment_do_not_change_the_launch(
        tmp_path: Path, monkeypatch) -> None:
    """torchrun takes an option it is not given from PET_<OPTION>: PET_NNODES=3 made a
    one-node run wait ~600 s for nodes that never came, then blame the rendezvous, and
    PET_REDIRECTS / PET_TEE / PET_LOCAL_RANKS_FILTER swallowed or prefixed the loss lines. The
    launch is the same with them as without."""
    import torch.distributed.run

    plan_path = write_plan_files(tmp_path)
    launched: list[object] = []
    monkeypatch.setattr(torch.distributed.run, "run", launched.append)
    # what `_launch` sets in the environment when missing, set here so that the test undoes it
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    leftover = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_REDIRECTS": "3", "PET_TEE": "3",
                "PET_LOCAL_RANKS_FILTER": "1", "PET_MAX_RESTARTS": "5", "PET_NO_PYTHON": "1",
                "PET_RDZV_ENDPOINT": "elsewhere:1", "PET_LOG_DIR": str(tmp_path / "logs")}
    for name in leftover:
        monkeypatch.delenv(name, raising=False)
    for args in ([], ["--rdzv-endpoint", "localhost:29500"]):
        launched.clear()
        assert invoke("run", str(plan_path), "--steps", "2", *args).exit_code == 0
        for name, value in leftover.items():
            monkeypatch.setenv(name, value)
        result = invoke("run", str(plan_path), "--steps", "2", *args)
        assert result.exit_code == 0, getattr(result, "stderr", "")
        clean, polluted = (vars(config) for config in launched)
        assert polluted == clean
        # one node ("1:1" is torchrun's MIN:MAX form), each rank's lines as they are
        assert clean["nnodes"] in ("1", "1:1"), clean
        assert clean["tee"] == clean["redirects"] == "0" and not clean["local_ranks_filter"]
        # the variables stay for whoever else reads them
        assert {name: os.environ[name] for name in leftover} == leftover
        for name in leftover:
            monkeypatch.delenv(name)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_diverged_run_stops_at_the_first_non_finite_loss(tmp_path: Path) -> None:
    """--lr 1e30 makes step 2's loss NaN: the run printed 'loss nan', checkpointed the NaN
    weights and exited 0. Now it fails (exit 1) naming the step and tasks, and the step is not
    checkpointed."""
    plan = write_plan_files(tmp_path)
    ckpt = tmp_path / "ckpt"
    r = spindle("run", str(plan), "--nproc-per-node", "2", "--steps", "3", "--lr", "1e30",
                "--timeout-s", "30", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    assert r.returncode == 1, r.stderr
    assert [ln.split()[1] for ln in r.stdout.splitlines()] == ["1/3"], r.stdout
    last, hint = r.stderr.strip().splitlines()[-2:]
    # both ranks see the same loss and stop at once: the launcher names the first to fail
    # (by torch's timestamps, whole seconds), either of them under load
    assert re.match(r"error: run failed: rank [01]: step 2/3: the loss is not finite "
                    r"\(text_vision nan", last), r.stderr
    assert last.endswith("): training diverged; step 2 was not checkpointed, and a checkpoint "
                         "of step 1 holds the weights that gave it"), last
    assert hint == "hint: try a smaller --lr than 1e+30, resuming from an earlier checkpoint"
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == \
        ["step-000001"]


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_closed_stdout_ends_the_run_as_the_exit_codes_say(tmp_path: Path) -> None:
    """`spindle run ... | head -2`: rank 0's loss line then fails, which the run reported as
    `error: rank 0: BrokenPipeError: ...` with exit 1; an output the machine refused is
    `error: stdout: cannot write: <why>`, exit 2 (README)."""
    plan = write_plan_files(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "spindle_cli", "run", str(plan),
                             "--steps", "1000000", "--timeout-s", "30"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("step 1/")
        proc.stdout.close()
        _, err = proc.communicate(timeout=100)
    finally:
        for pid in _workers_of(plan):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == 2, err
    assert "error: rank 0: stdout: cannot write: Broken pipe" in err
    assert err.strip().splitlines()[-2:] == [
        "error: stdout: cannot write: Broken pipe",
        "hint: the loss lines go to stdout: keep its reader open until the run ends, or send "
        "them to a file"], err
    assert "Traceback" not in err


def test_an_output_a_rank_could_not_write_is_the_runs_error() -> None:
    """A rank's record of an output the machine refused (stdout, a trace on a full disk)
    makes the run's error that line, exit 2; other failures stay 'run failed', exit 1."""
    from types import SimpleNamespace

    from spindle_cli.cli.run_failures import record_of, root_cause

    refused = _failure(2, 1, "rank 0: stdout: cannot write: Broken pipe")
    refused.error_file_data["spindle"]["refused_output"] = "stdout: cannot write: Broken pipe"
    lost = _failure(1, 2, "rank 1: lost contact with rank(s) 0", secondary=True, peers=(0,))
    e = SimpleNamespace(failures={0: refused, 1: lost})
    assert record_of(e, root_cause(e))["refused_output"] == \
        "stdout: cannot write: Broken pipe"
    e = SimpleNamespace(failures={0: _failure(-15, 2), 1: _failure(-9, 3)})
    assert record_of(e, root_cause(e)) == {}


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_cpu_ranks_that_do_not_fit_the_nodes_ram_are_refused_before_launch(
        monkeypatch, dry_run: bool) -> None:
    """Each CPU rank checks its plan memory against its share of the node's RAM once the
    process group is up: a GPU plan started 16 CPU ranks and could end on a raw gloo
    'connectFullMesh failed'. `spindle run` makes the same check before launch; its dry run
    says so in a note and goes on (a GPU plan is dry-run on a machine without its GPUs)."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr("spindle_cli.runtime.worker.cpu_memory_bytes",
                        lambda ranks_per_node: 2 * 2**30)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv, **_: launched.append(argv))
    flags = ["--dry-run"] if dry_run else []
    result = invoke("run", "plans/multitask-clip-4-a800-2x8.yaml", "--backend", "gloo", *flags)
    problem = (r"rank 0 needs an estimated [\d.]+ GiB, its device has 2\.0 GiB \(its share "
               r"of this node's RAM, with 16 CPU ranks\)")
    if dry_run:
        assert result.exit_code == 0, result.stderr
        assert re.search(f"note: a run on this machine's CPU ranks would fail: {problem}",
                         result.stderr)
    else:
        assert result.exit_code == 2, getattr(result, "stderr", "")
        assert re.fullmatch(f"error: {problem}", _one_line_error(result))
    assert not launched
    result = invoke("run", "plans/tiny-clip-local-cpu-2.yaml", "--backend", "gloo", *flags)
    assert result.exit_code == 0, getattr(result, "stderr", "")
    assert len(launched) == (0 if dry_run else 1)


def test_the_ram_check_counts_the_bytes_of_the_dtype_the_run_trains_in(monkeypatch) -> None:
    """The plan counts its bytes in its graph's dtype (tiny-clip: fp32); a --dtype fp64 run
    takes twice them, and was checked against the plan's bytes as written."""
    monkeypatch.chdir(REPO)
    plan = load("plans/tiny-clip-local-cpu-2.yaml", Plan)
    need = max(m.total_bytes for m in plan.memory)
    monkeypatch.setattr("spindle_cli.runtime.worker.cpu_memory_bytes",
                        lambda ranks_per_node: int(1.5 * need))
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv, **_: launched.append(argv))
    result = invoke("run", "plans/tiny-clip-local-cpu-2.yaml", "--dtype", "fp32")
    assert result.exit_code == 0, getattr(result, "stderr", "")
    result = invoke("run", "plans/tiny-clip-local-cpu-2.yaml", "--dtype", "fp64")
    assert result.exit_code == 2
    rank0 = next(m for m in plan.memory if m.rank == 0)
    assert _one_line_error(result).startswith(
        f"error: rank 0 needs an estimated {fmt_bytes(2 * rank0.total_bytes)} trained in fp64, "
        f"its device has {fmt_bytes(int(1.5 * need))}")
    assert len(launched) == 1


def test_metrics_go_to_the_workers_and_a_bad_name_is_refused_before_launch(
        tmp_path: Path, monkeypatch) -> None:
    plan = write_plan_files(tmp_path)
    launched: list[list[str]] = []
    monkeypatch.setattr("spindle_cli.cli.run._launch", lambda argv, **_: launched.append(argv))
    metrics = str(tmp_path / "m.jsonl")
    result = invoke("run", str(plan), "--steps", "1", "--metrics", metrics)
    assert result.exit_code == 0, result.stderr
    argv = launched[0]
    assert argv[argv.index("--metrics") + 1] == metrics
    result = invoke("run", str(plan), "--metrics", str(tmp_path / "m.txt"), "--dry-run")
    assert result.exit_code == 2
    assert _one_line_error(result) == (f"error: --metrics {tmp_path / 'm.txt'}: metrics (JSON "
                                       "lines) is a .jsonl file")
