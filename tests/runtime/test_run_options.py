"""Run options checked before any process group (`options.check_options`, `checkpoint.check_dir`,
`checkpoint.resume_point`) and the one-write error line of a failing rank. No ranks start here;
`test_run_cli.py` drives the same checks through `spindle run`."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from spindle_cli.errors import RuntimeFailure, SpindleError
from spindle_cli.runtime import checkpoint, output, timings, training, worker
from spindle_cli.runtime.options import TrainOptions, check_options, resume_note

META = {"plan_sha256": "ab" * 32, "seed": 0, "dtype": "fp32", "dataset": "synthetic"}


def test_check_dir_accepts_a_directory_or_a_path_it_can_make(tmp_path: Path) -> None:
    checkpoint.check_dir(str(tmp_path))
    checkpoint.check_dir(str(tmp_path / "a" / "b"))
    # the check leaves nothing behind: `save` makes the directory when it first saves
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target", ["/proc/ck", "/proc/a/b", "/sys"])
def test_check_dir_refuses_where_no_file_can_be_created(target: str) -> None:
    """os.access says yes to root here: the run trained every step, then failed to save."""
    with pytest.raises(SpindleError, match=f"^--checkpoint-dir {target}: cannot write in '/"):
        checkpoint.check_dir(target)


@pytest.mark.parametrize(("target", "said"), [
    ("file", "file: is not a directory"),
    ("file/ck", "/file is not a directory"),
    ("file/a/b", "/file is not a directory"),
    ("dangling/ck", "/dangling is not a directory"),
])
def test_check_dir_refuses_a_file_on_the_path(tmp_path: Path, target: str, said: str) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(SpindleError, match="^--checkpoint-dir ") as info:
        checkpoint.check_dir(str(tmp_path / target))
    assert said in str(info.value)


@pytest.mark.parametrize(("changes", "timeout_s", "said"), [
    ({"lr": float("nan")}, 300.0, "--lr nan: expected a finite number > 0"),
    ({"lr": float("inf")}, 300.0, "--lr inf: expected a finite number > 0"),
    ({"lr": 0.0}, 300.0, "--lr 0.0: expected a finite number > 0"),
    ({}, float("nan"), "--timeout-s nan: expected a finite number of seconds > 0"),
    ({}, float("inf"), "--timeout-s inf: expected a finite number of seconds > 0"),
    ({}, 0.0, "--timeout-s 0.0: expected a finite number of seconds > 0"),
    ({}, 1e16, "--timeout-s 1e+16: at most 604800 seconds (7 days)"),
    ({"steps": 0}, 300.0, "--steps 0: expected at least 1"),
    ({"checkpoint_every": -1}, 300.0,
     "--checkpoint-every -1: expected at least 1 (or 0: only after the last step)"),
    ({"checkpoint_every": 2}, 300.0, "--checkpoint-every needs --checkpoint-dir"),
    ({"keep_checkpoints": 2}, 300.0, "--keep-checkpoints needs --checkpoint-dir"),
    ({"keep_checkpoints": -1}, 300.0, "--keep-checkpoints -1: expected at least 1 (or 0: "
     "keep all)"),
    ({"resume": True}, 300.0, "--resume needs --checkpoint-dir"),
    ({"checkpoint_dir": "{tmp}/file"}, 300.0, "is not a directory"),
    ({"trace_path": "{tmp}"}, 300.0, "is a directory"),
    ({"trace_path": "{tmp}/trace.txt"}, 300.0, "a Chrome trace is a .json file"),
    ({"trace_path": "{tmp}/trace"}, 300.0, "a Chrome trace is a .json file"),
    ({"trace_path": "{tmp}/nowhere/trace.json"}, 300.0, "directory does not exist"),
    ({"metrics_path": "{tmp}/m.json"}, 300.0, "metrics (JSON lines) is a .jsonl file"),
    ({"metrics_path": "{tmp}"}, 300.0, "is a directory"),
    # Path drops a trailing slash: the file was written as if it were not there
    ({"trace_path": "{tmp}/t.json/"}, 300.0, "t.json/: names a directory (a trailing slash), "
     "not a file"),
    ({"metrics_path": "{tmp}/m.jsonl/"}, 300.0, "m.jsonl/: names a directory (a trailing "
     "slash), not a file"),
    ({"metrics_path": ""}, 300.0, "--metrics: an empty path"),
    ({"trace_path": "{tmp}/file/trace.json"}, 300.0, "/file is not a directory"),
    ({"trace_path": "/sys/t.json"}, 300.0, "--trace /sys/t.json: cannot write in '/sys'"),
    # an empty --checkpoint-dir was read as none (the run saved nothing); an empty --trace
    # was an internal error in the launcher
    ({"checkpoint_dir": ""}, 300.0, "--checkpoint-dir: an empty path"),
    ({"checkpoint_dir": "", "resume": True}, 300.0, "--checkpoint-dir: an empty path"),
    ({"trace_path": ""}, 300.0, "--trace: an empty path"),
])
def test_check_options_refuses(tmp_path: Path, changes: dict[str, Any], timeout_s: float,
                               said: str) -> None:
    (tmp_path / "file").write_text("x")
    changes = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v
               for k, v in changes.items()}
    with pytest.raises(SpindleError, match=re.escape(said)):
        check_options(TrainOptions(**{"steps": 2, **changes}), timeout_s=timeout_s)


def test_check_options_refuses_a_directory_another_run_writes_into(tmp_path: Path) -> None:
    with checkpoint.hold(str(tmp_path)):
        for resume in (False, True):
            with pytest.raises(SpindleError, match="another run is writing checkpoints there"):
                check_options(TrainOptions(steps=2, checkpoint_dir=str(tmp_path),
                                           resume=resume), timeout_s=300.0)
            # a rank other than 0 may check after its own rank 0 took the directory: it
            # leaves the lock to rank 0 (a loaded CI machine failed a run that way)
            check_options(TrainOptions(steps=2, checkpoint_dir=str(tmp_path), resume=resume),
                          timeout_s=300.0, holder=False)
    check_options(TrainOptions(steps=2, checkpoint_dir=str(tmp_path)), timeout_s=300.0)


def test_check_options_refuses_a_read_only_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text("{}\n")
    trace.chmod(0o444)
    with pytest.raises(SpindleError) as e:
        check_options(TrainOptions(steps=2, trace_path=str(trace)), timeout_s=1.0)
    assert str(e.value) == f"--trace {trace}: cannot write: read-only file"
    assert e.value.hint == f"make it writable (chmod u+w {trace}) to replace it"


def test_the_longest_timeout_is_one_the_workers_take() -> None:
    """`spindle run` bounds --timeout-s by MAX_TIMEOUT_S at parse time; the workers take it."""
    from spindle_cli.runtime.timeouts import MAX_TIMEOUT_S

    check_options(TrainOptions(steps=2), timeout_s=MAX_TIMEOUT_S)


def test_check_options_accepts_a_sound_run(tmp_path: Path) -> None:
    check_options(TrainOptions(steps=2, checkpoint_dir=str(tmp_path / "new" / "ck"),
                               checkpoint_every=1, resume=True,
                               trace_path=str(tmp_path / "Trace.JSON")), timeout_s=1.0)
    assert list(tmp_path.iterdir()) == []


def test_resume_point_checks_the_newest_checkpoint_without_loading_it(tmp_path: Path) -> None:
    ck = str(tmp_path)
    assert checkpoint.resume_point(ck, world_size=1, meta=META) is None
    assert checkpoint.resume_point(str(tmp_path / "missing"), world_size=1, meta=META) is None
    checkpoint.save(ck, 3, rank=0, world_size=1, state={"step": 3}, meta=META)
    assert checkpoint.resume_point(ck, world_size=1, meta=META) == (tmp_path / "step-000003", 3)
    with pytest.raises(SpindleError, match="checkpoint was taken with seed=0, this run has 1") \
            as e:
        checkpoint.resume_point(ck, world_size=1, meta={**META, "seed": 1})
    assert e.value.hint is not None and "another --checkpoint-dir" in e.value.hint
    e_seed_hint = e.value.hint  # another world size: the same advice
    with pytest.raises(SpindleError, match="checkpoint of 1 ranks, this run has 2") as e:
        checkpoint.resume_point(ck, world_size=2, meta=META)
    assert e.value.hint == e_seed_hint
    (tmp_path / "step-000003" / "rank-00000.pt").unlink()
    with pytest.raises(SpindleError, match="checkpoint lacks rank-00000.pt"):
        checkpoint.resume_point(ck, world_size=1, meta=META)
    (tmp_path / "step-000003" / checkpoint.MANIFEST).write_text("{not json")
    with pytest.raises(SpindleError, match="manifest.json: not a spindle checkpoint manifest"):
        checkpoint.resume_point(ck, world_size=1, meta=META)


def test_resume_note_says_where_the_run_starts(tmp_path: Path) -> None:
    opts = TrainOptions(steps=4, checkpoint_dir=str(tmp_path), resume=True)
    assert resume_note(None, opts) == f"no checkpoint in {tmp_path} yet: starting from step 0"
    found = tmp_path / "step-000002"
    assert resume_note((found, 2), opts) == \
        f"resuming from {found} at step 2: training steps 3-4"
    assert resume_note((found, 3), opts) == f"resuming from {found} at step 3: training step 4"
    assert resume_note((found, 4), opts) == \
        f"resuming from {found} at step 4: nothing left to train (--steps 4)"


class _Writes(io.StringIO):
    """A stderr that records each write call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_timing_line_takes_the_slowest_rank_after_the_warm_up() -> None:
    """The run's time line: the slowest rank's median step past the run's first step (which
    warms up), numbered as the run numbers its steps (from the checkpoint when resumed)."""
    # rank 1 is slower past the warm-up though rank 0's warm-up step is the longest
    fast, slow = [900.0, 10.0, 11.0, 12.0], [50.0, 20.0, 21.0, 40.0]
    simulated = timings.Prediction(17.0)
    assert timings.timing_line(0, [fast, slow], simulated) == (
        "time: 21.00 ms/step (median of steps 2-4 on the slowest rank, after step 1's "
        "warm-up), predicted 17.00 ms")
    assert timings.timing_line(3, [fast, slow], simulated).startswith(
        "time: 21.00 ms/step (median of steps 5-7 on the slowest rank, after step 4's ")
    assert timings.timing_line(3, [[900.0, 10.0], [50.0, 20.0]], timings.Prediction(5.5)) == (
        "time: 20.00 ms/step (step 5 alone, after step 4's warm-up), predicted 5.50 ms")
    assert timings.timing_line(0, [[900.0], [50.0]], timings.Prediction(5.5)) == (
        "time: 900.00 ms/step (step 1 alone, warm-up included), predicted 5.50 ms")


def test_the_prediction_falls_back_to_the_plans_estimate_and_says_so() -> None:
    """Every run predicts its step (the time line): by simulating the plan as the executor
    runs it when its profile and cluster simulate it, else with the plan's own estimate, so
    a profile that cannot time the plan does not stop the run; the line then says which
    prediction it is and why."""
    from dataclasses import replace

    from spindle_cli.artifacts import MetaOpGraph, Plan, load

    repo = Path(__file__).resolve().parents[2]
    path = str(repo / "plans" / "tiny-clip-local-cpu-2.yaml")
    plan, graph = load(path, Plan), load(str(repo / "graphs" / "tiny-clip.yaml"), MetaOpGraph)
    simulated = timings.predicted_iteration(path, plan, graph, overlap_sync=False)
    assert simulated.fallback is None
    assert simulated.ms > 0 and simulated.ms != plan.estimated_iteration_ms
    assert timings.timing_line(0, [[30.0, 20.0]], simulated).endswith(
        f"predicted {simulated.ms:.2f} ms")
    # a MetaOp the profile has no curve for: simulate refuses the plan
    m = graph.metaops[0]
    unknown = replace(graph, metaops=(replace(m, signature="other"), *graph.metaops[1:]))
    fallback = timings.predicted_iteration(path, plan, unknown, overlap_sync=False)
    assert fallback.ms == plan.estimated_iteration_ms
    line = timings.timing_line(0, [[30.0, 20.0]], fallback)
    assert line.startswith(f"time: 20.00 ms/step (step 2 alone, after step 1's warm-up), "
                           f"predicted {plan.estimated_iteration_ms:.2f} ms (the plan's "
                           "estimate: not simulated, ")
    assert line.endswith(f"no curve for MetaOp {m.id!r})")


@pytest.mark.parametrize(("backend", "torn_down"), [("gloo", True), ("nccl", False)])
def test_a_failed_nccl_rank_reports_without_destroying_its_group(
        backend: str, torn_down: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On nccl, destroying the process group waits for the collectives in flight, which a
    failed run may never complete: the rank reports and leaves without it (gloo ranks close
    their groups first, as before). The world is faked: this machine has no GPU."""
    import torch

    from spindle_cli.runtime import dist as rdist

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.setattr("sys.stderr", _Writes())
    monkeypatch.setattr(rdist, "init", lambda *a, **k: rdist.World(
        rank=0, world_size=2, local_rank=0, local_world_size=2, backend=backend,
        device=torch.device("cpu")))
    teardowns: list[bool] = []
    monkeypatch.setattr(rdist, "teardown", lambda **k: teardowns.append(True))

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(worker, "train", fail)
    code = worker.main([str(repo / "plans" / "tiny-clip-local-cpu-2.yaml"), "--steps", "1"])
    assert code == 1
    assert teardowns == ([True] if torn_down else [])


def test_a_failing_rank_writes_its_line_and_newline_at_once(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks share one stderr: `print` writes the text and the newline separately, so two
    ranks failing together printed `error: rank 0: ...error: rank 1: ...` on one line."""
    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("SPINDLE_DEBUG", raising=False)
    code = worker._report_failure(1, NotADirectoryError(20, "Not a directory", "ck/.tmp"))
    assert code == 1
    line = "error: rank 1: NotADirectoryError: [Errno 20] Not a directory: 'ck/.tmp'\n"
    assert stderr.calls == [line]
    assert json.loads(error_file.read_text())["message"] == line[len("error: "):-1]


def test_a_rank_stopped_while_writing_its_error_file_leaves_none(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """torch's launcher parses a rank's error file once the rank has ended and raised on an
    empty one: the run ended as an internal error (a CI run, a rank stopped by the launcher's
    SIGTERM as it wrote the file)."""
    def stopped(data: object, f: Any) -> None:
        f.write('{"message": ')
        raise KeyboardInterrupt  # stopped half-way (SIGTERM kills it outright there)

    monkeypatch.setattr("sys.stderr", _Writes())
    monkeypatch.setattr(worker.json, "dump", stopped)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(KeyboardInterrupt):
        worker._report_failure(1, RuntimeError("disk read failed"))
    assert not error_file.exists()


def test_out_of_memory_in_a_collective_is_the_ranks_own_failure() -> None:
    """A collective that runs out of memory (NCCL allocates its buffers lazily) fails this
    rank, named as such; any other failure of a collective is a lost peer, which the launcher
    puts behind its peers' lines."""
    import torch

    from spindle_cli.runtime.dist import PeerLost, with_peers

    with pytest.raises(torch.OutOfMemoryError):
        with with_peers("the parameter all-gather", [1]):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(PeerLost, match=r"lost contact with rank\(s\) 1 in the gradient sync"):
        with with_peers("the gradient sync", [1]):
            raise RuntimeError("Connection closed by peer")


def test_a_rank_that_lost_peers_names_them_to_the_launcher(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The error file marks a lost-peer line secondary and lists the peers, so the launcher
    can tell a peer it killed for hanging from one killed from outside (`cli.run_failures`)."""
    from spindle_cli.runtime.dist import PeerLost

    monkeypatch.setattr("sys.stderr", _Writes())
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    worker._report_failure(0, PeerLost("the gradient sync", [1, 3], RuntimeError("timed out")))
    data = json.loads(error_file.read_text())["spindle"]
    assert (data["secondary"], data["peers"]) == (True, [1, 3])
    worker._report_failure(0, RuntimeError("disk read failed"))
    data = json.loads(error_file.read_text())["spindle"]
    assert (data["secondary"], data["peers"]) == (False, [])


def test_a_rank_stopped_while_it_starts_leaves_quietly() -> None:
    """The launcher forwards Ctrl-C to every rank, often while one still imports torch or
    starts its interpreter (tracebacks, 'Fatal Python error'): ranks start with SIGINT
    blocked (`cli.run`), take it once the worker is imported, and exit 130 without a word."""
    import subprocess
    import sys

    # SIGINT arrives, blocked, during the start-up
    during_startup = ("import os, signal, sys\n"
                      "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
                      "os.kill(os.getpid(), signal.SIGINT)\n"
                      "from spindle_cli.runtime import rank\n"
                      "sys.exit(rank.start())\n")
    # SIGINT arrives while the worker's modules load
    during_import = ("import importlib.abc, sys\n"
                     "class Stop(importlib.abc.MetaPathFinder):\n"
                     "    def find_spec(self, name, path, target=None):\n"
                     "        if name == 'spindle_cli.runtime.worker':\n"
                     "            raise KeyboardInterrupt\n"
                     "sys.meta_path.insert(0, Stop())\n"
                     "from spindle_cli.runtime import rank\n"
                     "sys.exit(rank.start())\n")
    for code in (during_startup, during_import):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert (r.returncode, r.stdout, r.stderr) == (130, "", "")


def test_the_old_entry_point_says_which_one_to_use() -> None:
    """A torchrun line still naming the worker module would start ranks that train nothing and
    exit 0; it fails with one line naming the ranks' entry point."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "spindle_cli.runtime.worker", "plan.yaml"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr == ("error: the ranks' entry point is `python -m spindle_cli.runtime.rank`, "
                        "not spindle_cli.runtime.worker\n")


def test_ranks_start_with_sigint_blocked_and_the_launcher_keeps_it() -> None:
    """While `spindle run` launches, a process it starts has SIGINT blocked, and the launcher's
    own mask is as before once the launch is over."""
    import signal
    import subprocess
    import sys

    from spindle_cli.cli.run import _stops_before_ranks

    show = ("import signal\n"
            "print(int(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())))")
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    with _stops_before_ranks():
        child = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True,
                               timeout=60)
    assert child.stdout == "1\n"
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before
    assert signal.SIGINT not in before


def test_synthetic_data_is_the_same_samples_in_every_dtype() -> None:
    """A function of (seed, task, item, step) only: a run in fp64 or bf16 trains on the fp32
    run's samples, at its own precision."""
    import torch

    from spindle_cli.artifacts import ModelSpec, load
    from spindle_cli.runtime.data import SyntheticData

    model = load(str(Path(__file__).resolve().parents[2] / "models" / "tiny-clip.yaml"),
                 ModelSpec)
    task = model.tasks[0]
    item = next(name for name, spec in task.inputs.items() if spec.dim)
    drawn = {dtype: SyntheticData(model, 3, dtype).rows(task.name, item, 2, 0, 4)
             for dtype in (torch.float32, torch.float64, torch.bfloat16)}
    assert drawn[torch.float64].dtype == torch.float64
    assert torch.equal(drawn[torch.float64], drawn[torch.float32].double())
    assert torch.equal(drawn[torch.bfloat16], drawn[torch.float32].bfloat16())


def test_resume_takes_the_complete_checkpoint_of_the_most_steps(tmp_path: Path) -> None:
    ck = str(tmp_path)
    for step in (999_999, 1_000_000, 1_000_001):
        checkpoint.save(ck, step, rank=0, world_size=1, state={"step": step}, meta=META)
    # steps compare as numbers, and a checkpoint that lost a rank's file is passed over
    (tmp_path / "step-1000001" / "rank-00000.pt").unlink()
    assert checkpoint.latest(ck) == tmp_path / "step-1000000"
    assert checkpoint.resume_point(ck, world_size=1, meta=META) == \
        (tmp_path / "step-1000000", 1_000_000)
    assert checkpoint.passed_over(ck) == [(tmp_path / "step-1000001",
                                           "checkpoint lacks rank-00000.pt")]


def _cut(path: Path, size: int = 100) -> None:
    """`head -c SIZE`: a rank file cut short, as a full disk or a stopped copy leaves it."""
    path.write_bytes(path.read_bytes()[:size])


def test_resume_passes_over_a_checkpoint_with_a_cut_rank_file_and_says_so(
        tmp_path: Path) -> None:
    """As over one that lost a rank file: the run failed after launch, in torch.load, with
    a message that named no file."""
    ck = str(tmp_path)
    for step in (1, 2):
        checkpoint.save(ck, step, rank=0, world_size=1, state={"step": step}, meta=META)
    _cut(tmp_path / "step-000002" / "rank-00000.pt")
    assert checkpoint.latest(ck) == tmp_path / "step-000001"
    assert checkpoint.resume_point(ck, world_size=1, meta=META) == (tmp_path / "step-000001", 1)
    note = resume_note((tmp_path / "step-000001", 1),
                       TrainOptions(steps=3, checkpoint_dir=ck, resume=True))
    assert note.splitlines() == [
        f"note: passing over {tmp_path / 'step-000002'}: checkpoint has damaged rank-00000.pt "
        "(cut short, or not written by torch.save)",
        f"resuming from {tmp_path / 'step-000001'} at step 1: training steps 2-3"]


@pytest.mark.parametrize("size", [0, 100, -22])
def test_resume_refuses_when_the_only_checkpoint_has_a_cut_rank_file(tmp_path: Path,
                                                                     size: int) -> None:
    ck = str(tmp_path)
    checkpoint.save(ck, 2, rank=0, world_size=1, state={"w": list(range(1000))}, meta=META)
    rank_path = tmp_path / "step-000002" / "rank-00000.pt"
    # -22: all but the zip archive's end record
    _cut(rank_path, size if size >= 0 else rank_path.stat().st_size + size)
    with pytest.raises(SpindleError, match=re.escape(
            f"{tmp_path / 'step-000002'}: checkpoint has damaged rank-00000.pt (cut short")):
        checkpoint.resume_point(ck, world_size=1, meta=META)


def test_saving_a_step_again_replaces_it_whole(tmp_path: Path) -> None:
    ck = str(tmp_path)
    checkpoint.save(ck, 2, rank=0, world_size=1, state={"v": 1}, meta=META)
    checkpoint.save(ck, 2, rank=0, world_size=1, state={"v": 2}, meta=META)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    assert checkpoint.load(tmp_path / "step-000002", rank=0, world_size=1,
                           meta=META)[1] == {"v": 2}


@pytest.mark.parametrize("incomplete", [False, True])
def test_a_new_run_refuses_a_directory_holding_checkpoints(tmp_path: Path,
                                                           incomplete: bool) -> None:
    """A fresh run would replace some of another run's checkpoints and leave the rest, which
    a later --resume would then mix up; an incomplete one too (a rank's file on a disk that
    is gone for now: the run replaced the files that were there)."""
    checkpoint.save(str(tmp_path), 6, rank=0, world_size=1, state={}, meta=META)
    if incomplete:
        (tmp_path / "step-000006" / "rank-00000.pt").unlink()
    with pytest.raises(SpindleError, match="holds another run's checkpoints "
                                           r"\(the newest step-000006\)") as e:
        check_options(TrainOptions(steps=4, checkpoint_dir=str(tmp_path)), timeout_s=1.0)
    assert e.value.hint is not None and "--resume" in e.value.hint
    check_options(TrainOptions(steps=8, checkpoint_dir=str(tmp_path), resume=True),
                  timeout_s=1.0)


@pytest.mark.parametrize(("losses", "said"), [
    ({"a": float("nan"), "b": 1.0}, "(a nan)"),
    ({"a": float("inf"), "b": float("nan")}, "(a inf, b nan)"),
])
@pytest.mark.parametrize("ckpt", [None, "ck"])
def test_a_non_finite_loss_stops_the_step_naming_it(losses: dict[str, float], said: str,
                                                    ckpt: str | None) -> None:
    """The step's losses are all-reduced, so every rank decides alike; the line counts steps
    from 1, as the loss lines do."""
    opts = TrainOptions(steps=4, lr=1e30, checkpoint_dir=ckpt)
    training.check_finite(1, {"a": 2.5, "b": 1.0}, opts)
    with pytest.raises(RuntimeFailure) as e:
        training.check_finite(2, losses, opts)
    # step 3's loss comes from the weights after step 2, which a checkpoint of step 2 holds
    kept = ("; step 3 was not checkpointed, and a checkpoint of step 2 holds the weights that "
            "gave it" if ckpt else "")
    assert str(e.value) == f"step 3/4: the loss is not finite {said}: training diverged{kept}"
    assert e.value.exit_code == 1
    assert e.value.hint == "try a smaller --lr than 1e+30" + (
        ", resuming from an earlier checkpoint" if ckpt else "")


class _Weights:
    """An Executor's `finite` as a test sets it."""

    def __init__(self, finite: bool) -> None:
        self.finite = lambda: finite


@pytest.mark.parametrize("finite", [True, False])
def test_weights_that_are_not_finite_are_not_checkpointed(finite: bool) -> None:
    """A finite loss can come with a non-finite gradient, whose step leaves NaN weights: they
    are checked before a checkpoint (one rank's verdict here; with several an all-reduce of
    the flag makes it every rank's)."""
    import torch

    from spindle_cli.runtime.dist import World

    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
                  device=torch.device("cpu"))
    opts = TrainOptions(steps=4, lr=1e-3, checkpoint_dir="ck")
    if finite:
        training.check_finite_weights(2, _Weights(True), world, opts)
        return
    with pytest.raises(RuntimeFailure) as e:
        training.check_finite_weights(2, _Weights(False), world, opts)
    assert str(e.value) == ("step 2/4: the weights are not finite after the step: training "
                            "diverged; step 2 was not checkpointed")


class _Refusing(io.StringIO):
    """A stdout that refuses every flush with `error` (a closed pipe, a full disk)."""

    def __init__(self, fd: int, error: OSError) -> None:
        super().__init__()
        self.fd, self.error = fd, error

    def flush(self) -> None:
        raise self.error

    def fileno(self) -> int:
        return self.fd


@pytest.mark.parametrize(("error", "said"), [
    (BrokenPipeError(32, "Broken pipe"), "stdout: cannot write: Broken pipe"),
    (OSError(28, "No space left on device"), "stdout: cannot write: No space left on device"),
])
def test_a_loss_line_stdout_refuses_is_an_output_error(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       error: OSError, said: str) -> None:
    """What the rank reports (and records for the launcher) when stdout refuses a loss line:
    the README's `<file or stdout>: cannot write: <why>`, not a raw BrokenPipeError; stdout
    then goes nowhere, so the rank can exit without failing on it again."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("SPINDLE_DEBUG", raising=False)
    monkeypatch.setattr("sys.stderr", _Writes())
    with open(tmp_path / "stdout", "w") as f:
        monkeypatch.setattr("sys.stdout", _Refusing(f.fileno(), error))
        with pytest.raises(SpindleError) as e:
            output.print_line("step 3/4  loss 1.0")
        assert str(e.value) == said
        assert worker._report_failure(0, e.value) == 2
        assert (tmp_path / "stdout").stat().st_ino != Path(f"/proc/self/fd/{f.fileno()}"
                                                          ).stat().st_ino
    record = json.loads(error_file.read_text())
    assert record["message"] == f"rank 0: {said}"
    assert record["spindle"]["refused_output"] == said
    assert record["spindle"]["hint"] == e.value.hint


def test_a_world_of_another_size_says_how_many_ranks_the_plan_needs() -> None:
    from spindle_cli.artifacts import Plan, load
    from spindle_cli.runtime.inputs import check_world

    plan = load(str(Path(__file__).resolve().parents[2] / "plans" / "tiny-clip-local-cpu.yaml"),
                Plan)
    check_world(plan, plan.num_devices)
    with pytest.raises(SpindleError) as e:
        check_world(plan, 2)
    assert str(e.value) == f"the plan needs {plan.num_devices} ranks, the run has 2"
    assert e.value.hint == f"--nproc-per-node times --nnodes must be {plan.num_devices}"


def test_a_datasets_error_names_where_and_keeps_its_traceback() -> None:
    """An error raised by a --dataset's rows() said only 'ValueError: boom'; it now names the
    task, item, step and rows, and chains the dataset's own exception (its frames are what
    SPINDLE_DEBUG=1 prints), while a SpindleError keeps its own line and hint."""
    from types import SimpleNamespace

    from spindle_cli.artifacts import ModelSpec, load
    from spindle_cli.runtime.executor import Executor

    model = load(str(Path(__file__).resolve().parents[2] / "models" / "tiny-clip.yaml"),
                 ModelSpec)
    task = model.tasks[0]
    name = next(iter(task.inputs))
    sp = SimpleNamespace(metaop=SimpleNamespace(task=task.name))

    def executor(error: Exception) -> Any:
        def rows(*args: object) -> None:
            raise error
        return SimpleNamespace(model=model, data=SimpleNamespace(rows=rows))

    boom = ValueError("boom")
    with pytest.raises(RuntimeFailure) as e:
        Executor._load(executor(boom), sp, name, 2, 0, 4)
    assert str(e.value) == (f"data {task.name}/{name} at step 3 (rows({task.name!r}, "
                            f"{name!r}, 2, 0, 4)) raised ValueError('boom')")
    assert e.value.__cause__ is boom
    own = SpindleError("no such shard", hint="mount it")
    with pytest.raises(SpindleError) as e:
        Executor._load(executor(own), sp, name, 2, 0, 4)
    assert e.value is own
