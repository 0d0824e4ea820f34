"""What each rank runs (`main`), from its process's entry point `spindle_cli.runtime.rank`,
started by `spindle run` through torch's elastic launcher or directly by `torchrun`.

Every rank loads and checks the plan against the world before the first collective, trains
with the wave executor, prints each step's loss on rank 0 (stdout), checkpoints and writes the
trace. `check_options` refuses options that would fail later or do nothing; `spindle run` calls
it before launching and every rank again before its first collective. A failing rank prints one
line `error: rank R: cause` on stderr, records the same line for the launcher (torchelastic
error file) and exits non-zero; its peers then fail too (their next message to it errors, or
the process-group timeout expires).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    Plan,
    Profile,
    load_recorded_input,
    sha256,
)
from spindle_cli.artifacts.files import (
    check_can_create,
    names_directory,
    output_file,
    write_text_atomic,
)
from spindle_cli.errors import ArtifactError, RuntimeFailure, SpindleError
from spindle_cli.planner.buckets import SYNC_CHUNK_BYTES
from spindle_cli.runtime import checkpoint
from spindle_cli.runtime import dist as rdist
from spindle_cli.runtime.data import load_data_source
from spindle_cli.runtime.executor import Executor
from spindle_cli.runtime.gradsync import overlap_for
from spindle_cli.runtime.groups import make_groups
from spindle_cli.runtime.held import peak_allocated, reset_peak
from spindle_cli.runtime.inputs import check_world, load_run_inputs
from spindle_cli.runtime.model import DTYPES, run_dtype
from spindle_cli.runtime.program import Program
from spindle_cli.runtime.timeouts import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from spindle_cli.runtime.trace import (
    Tracer,
    breakdown_ms,
    compute_per_step_ms,
    drift_lines,
    memory_line,
    memory_rows,
    parts_line,
    slice_compute,
    trace_document,
    write_json,
)


@dataclass(frozen=True, slots=True)
class Prediction:
    """The iteration time a run is compared with, and why it is not the simulator's, if not."""

    ms: float
    fallback: str | None = None
    """Why the plan's own estimate stands in for a simulation (None: simulated)."""
    parts: dict[str, float] | None = None
    """The simulated iteration's compute, transfer, sync and optimizer ms (those of the rank
    that ends it); None for the plan's estimate."""

    def describe(self) -> str:
        why = f" (the plan's estimate: not simulated, {self.fallback})" if self.fallback else ""
        return f"predicted {self.ms:.2f} ms{why}"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to train (what `spindle run` passes on)."""

    steps: int
    """Total training steps (a resumed run continues up to this step)."""
    seed: int = 0
    lr: float = 1e-3
    dtype: str = "fp32"
    dataset: str | None = None
    checkpoint_dir: str | None = None
    """Where checkpoints go: one after the last step, and every `checkpoint_every` steps."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: after the last step only)."""
    keep_checkpoints: int = 0
    """Keep the newest this many complete checkpoints, removing older ones (0: keep all)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint_dir`, if there is one."""
    trace_path: str | None = None
    metrics_path: str | None = None
    """Where rank 0 writes one JSON line per trained step (`Metrics`)."""
    prediction: Prediction | None = None
    """Predicted iteration time for the run's time line and the trace summary (default: the
    plan's estimate)."""
    overlap_sync: bool | None = None
    """Bucket shared layers by the wave that completes them, in chunks issued during its
    backward (GradSync); None: on NCCL only."""
    sync_chunk_bytes: int = SYNC_CHUNK_BYTES
    """The least gradient bytes of such a chunk (`buckets.sync_buckets`)."""


@dataclass(slots=True, kw_only=True)
class TrainResult:
    """What one rank saw: the losses of the steps it ran and its final parameters."""

    start_step: int
    losses: list[dict[str, float]] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


def _meta(plan: Plan, opts: TrainOptions) -> dict[str, Any]:
    """What a checkpoint must agree on with the run resuming from it: with the plan and data,
    the gradient buckets (`opts.overlap_sync`, resolved), whose flat tensors hold the
    optimizer state."""
    assert opts.overlap_sync is not None, "the sync mode is resolved before checkpoints"
    return {"plan_sha256": sha256(plan), "seed": opts.seed, "dtype": opts.dtype,
            "dataset": opts.dataset or "synthetic",
            "sync": f"chunked, {opts.sync_chunk_bytes} bytes" if opts.overlap_sync
            else "per-set"}


def check_options(opts: TrainOptions, *, timeout_s: float, holder: bool = True) -> None:
    """Refuse (SpindleError) options that would fail only later in the run, or do nothing.
    Reads the file system, leaves nothing on it (a probe file, `check_can_create`, is removed
    at once), uses no process group. Only a `holder` (`spindle run` before launch, a run's
    rank 0) checks that no run holds the checkpoint directory: another rank of this run may
    come to it after its rank 0 has taken the directory (`train`)."""
    for flag, path in (("--checkpoint-dir", opts.checkpoint_dir), ("--trace", opts.trace_path),
                       ("--metrics", opts.metrics_path)):
        if path == "":
            # (an empty --checkpoint-dir read as none: the run saved nothing, silently)
            raise SpindleError(f"{flag}: an empty path", hint=f"give {flag} a path, or leave "
                               "it out")
    if opts.steps < 1:
        raise SpindleError(f"--steps {opts.steps}: expected at least 1")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise SpindleError(f"--lr {opts.lr}: expected a finite number > 0")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise SpindleError(f"--timeout-s {timeout_s}: expected a finite number of seconds > 0")
    if timeout_s > MAX_TIMEOUT_S:
        raise SpindleError(f"--timeout-s {timeout_s:g}: at most {MAX_TIMEOUT_S:g} seconds "
                           "(7 days): torch's rendezvous and collectives fail on longer ones")
    if opts.checkpoint_every < 0:
        raise SpindleError(f"--checkpoint-every {opts.checkpoint_every}: expected at least 1 "
                           "(or 0: only after the last step)")
    if opts.keep_checkpoints < 0:
        raise SpindleError(f"--keep-checkpoints {opts.keep_checkpoints}: expected at least 1 "
                           "(or 0: keep all)")
    if opts.checkpoint_dir is None:
        for flag, given in (("--checkpoint-every", opts.checkpoint_every),
                            ("--keep-checkpoints", opts.keep_checkpoints),
                            ("--resume", opts.resume)):
            if given:
                raise SpindleError(f"{flag} needs --checkpoint-dir")
    else:
        checkpoint.check_dir(opts.checkpoint_dir)
        if holder:
            checkpoint.check_free(opts.checkpoint_dir)
        found = None if opts.resume else checkpoint.latest(opts.checkpoint_dir)
        if found is not None:
            # a new run would replace some of them and leave the rest to a later --resume
            raise SpindleError(
                f"--checkpoint-dir {opts.checkpoint_dir}: holds another run's checkpoints "
                f"(the newest {found.name})",
                hint="--resume continues from it; or give this run another --checkpoint-dir")
    if opts.trace_path is not None:
        _check_output_path("--trace", opts.trace_path, ".json", "a Chrome trace")
    if opts.metrics_path is not None:
        _check_output_path("--metrics", opts.metrics_path, ".jsonl", "metrics (JSON lines)")


def _check_output_path(flag: str, path: str, suffix: str, what: str) -> None:
    """A file a run writes (a Chrome trace at its end, `trace.write_json`; its metrics step by
    step, `Metrics`) into an existing directory, where `files.output_file` lets it be written
    and a file can be created (`check_can_create`, in the directory of a symlink's
    target)."""
    target = Path(path)
    example = f"{flag[2:]}{suffix}"
    if names_directory(path):
        raise SpindleError(f"{flag} {path}: names a directory (a trailing slash), not a file")
    if target.is_dir():
        raise SpindleError(f"{flag} {path}: is a directory",
                           hint=f"give a file name, e.g. {target / example}")
    if target.suffix.lower() != suffix:
        raise SpindleError(f"{flag} {path}: {what} is a {suffix} file",
                           hint=f"give a name ending in {suffix}, e.g. {example}")
    parent = target.absolute().parent
    if not parent.exists():
        raise SpindleError(f"{flag} {path}: directory does not exist")
    if not parent.is_dir():
        raise SpindleError(f"{flag} {path}: {parent} is not a directory")
    try:
        target_file = output_file(path)
    except ArtifactError as e:
        raise SpindleError(f"{flag} {e}", hint=e.hint) from None
    check_can_create(f"{flag} {path}", target_file.parent)


class Metrics:
    """Rank 0's `--metrics FILE.jsonl`: one JSON object per trained step, written and flushed
    as the step ends (`step`, `steps`, `loss`, `losses` by task, `step_ms`), for scripts that
    would otherwise parse the loss lines. A resumed run keeps the lines of the steps its
    checkpoint holds and drops later ones (trained again), so the file is the history of the
    parameters it ends with."""

    def __init__(self, path: str, resumed_at: int) -> None:
        self.path = path
        kept = []
        if resumed_at:
            with contextlib.suppress(FileNotFoundError):
                for line in Path(path).read_text(encoding="utf-8").splitlines():
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        if json.loads(line)["step"] <= resumed_at:
                            kept.append(line + "\n")
        try:
            write_text_atomic(path, "".join(kept))
            self.file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise _cannot_write(path, e) from None

    def write(self, step: int, steps: int, losses: dict[str, float], step_ms: float) -> None:
        record = {"step": step, "steps": steps, "loss": sum(losses.values()),
                  "losses": losses, "step_ms": round(step_ms, 3)}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise _cannot_write(self.path, e) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()


def resume_point(plan: Plan, opts: TrainOptions, world_size: int) -> tuple[Path, int] | None:
    """(checkpoint, completed steps) a run with `opts.resume` continues from, or None when
    `checkpoint_dir` holds no complete checkpoint yet (the run starts from step 0);
    SpindleError when the newest one was taken by another run configuration."""
    assert opts.resume and opts.checkpoint_dir is not None
    return checkpoint.resume_point(opts.checkpoint_dir, world_size=world_size,
                                   meta=_meta(plan, opts))


def untraced(trace_path: str) -> str:
    """What a run given --trace says when no step ran (a resume with nothing left)."""
    return f"trace: no step ran, so nothing was traced ({trace_path} not written)"


def resume_note(found: tuple[Path, int] | None, opts: TrainOptions) -> str:
    """What a run with `opts.resume` says about where it starts: a line for each newer,
    damaged checkpoint it passes over (`checkpoint.passed_over`), then where it resumes."""
    if found is None:
        return f"no checkpoint in {opts.checkpoint_dir} yet: starting from step 0"
    assert opts.checkpoint_dir is not None
    path, start = found
    if start >= opts.steps:
        left = f"nothing left to train (--steps {opts.steps})"
    elif start + 1 == opts.steps:
        left = f"training step {opts.steps}"
    else:
        left = f"training steps {start + 1}-{opts.steps}"
    skipped = [f"note: passing over {newer}: {problem}"
               for newer, problem in checkpoint.passed_over(opts.checkpoint_dir)]
    return "\n".join([*skipped, f"resuming from {path} at step {start}: {left}"])


def _say(line: str) -> None:
    """One line on stderr in one write: the ranks share the launcher's stderr, and `print`
    writes the text and its newline separately, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def train(plan: Plan, graph: MetaOpGraph, model: ModelSpec, program: Program,
          world: rdist.World, opts: TrainOptions,
          log: Callable[[str], None] | None = None) -> TrainResult:
    """Train on this rank (the default process group is initialized). `log` receives each
    step's loss line (data: rank 0 prints it on stdout). Rank 0 holds the checkpoint
    directory for the run (`checkpoint.hold`)."""
    with (checkpoint.hold(opts.checkpoint_dir)
          if opts.checkpoint_dir is not None and world.rank == 0 else contextlib.nullcontext()):
        return _train(plan, graph, model, program, world, opts, log)


def _train(plan: Plan, graph: MetaOpGraph, model: ModelSpec, program: Program,
           world: rdist.World, opts: TrainOptions,
           log: Callable[[str], None] | None) -> TrainResult:
    if opts.checkpoint_dir is not None and world.world_size > 1:
        checkpoint.check_shared(opts.checkpoint_dir, rank=world.rank,
                                world_size=world.world_size)
    dtype = DTYPES[opts.dtype]
    groups = make_groups(program, world.rank)
    data = load_data_source(opts.dataset, model, opts.seed, dtype)
    synchronize = device_synchronizer(world.device)
    tracer = Tracer(enabled=opts.trace_path is not None, rank=world.rank,
                    synchronize=synchronize)
    ex = Executor(plan, program, model, world, groups, data, seed=opts.seed, lr=opts.lr,
                  dtype=dtype, tracer=tracer, overlap_sync=opts.overlap_sync,
                  sync_chunk_bytes=opts.sync_chunk_bytes)
    meta = _meta(plan, replace(opts, overlap_sync=ex.sync.overlap_sync))
    start = 0
    if opts.resume:
        assert opts.checkpoint_dir is not None
        # the check `spindle run` makes before launch, made again here for a plain torchrun:
        # a directory whose checkpoints are all incomplete (a rank's file missing, say on a
        # directory that is not shared by every node) is refused, not trained over from step 0
        found = checkpoint.resume_point(opts.checkpoint_dir, world_size=world.world_size,
                                        meta=meta)
        if found is not None:
            start, state = checkpoint.load(found[0], rank=world.rank,
                                           world_size=world.world_size, meta=meta,
                                           device=world.device)
            ex.load_state(state)
        if world.rank == 0:
            _say(resume_note(found, opts))
    result = TrainResult(start_step=start)
    metrics = (Metrics(opts.metrics_path, start)
               if opts.metrics_path is not None and world.rank == 0 else None)
    if tracer.enabled:
        reset_peak(world.device)
    try:
        for step in range(start, opts.steps):
            if synchronize is not None:
                synchronize()
            t0 = time.perf_counter()
            losses = ex.train_step(step)
            if synchronize is not None:
                synchronize()  # the step's optimizer kernels too, not the next step
            result.step_ms.append((time.perf_counter() - t0) * 1e3)
            check_finite(step, losses, opts)
            result.losses.append(losses)
            done = step + 1
            if log:
                per_task = "  ".join(f"{t} {v:.6f}" for t, v in losses.items())
                log(f"step {done}/{opts.steps}  loss {sum(losses.values()):.6f}  ({per_task})")
            if metrics is not None:
                metrics.write(done, opts.steps, losses, result.step_ms[-1])
            # a checkpoint directory without an interval still gets the final state: a run
            # given somewhere to save should not end with nothing saved
            if opts.checkpoint_dir and (done == opts.steps or (
                    opts.checkpoint_every and done % opts.checkpoint_every == 0)):
                check_finite_weights(done, ex, world, opts)
                checkpoint.save(opts.checkpoint_dir, done, rank=world.rank,
                                world_size=world.world_size, state=ex.state(done), meta=meta,
                                keep=opts.keep_checkpoints)
    finally:
        if metrics is not None:
            metrics.close()
    if result.step_ms:
        gathered = _gather_timings(tracer, result, ex, world)
        predicted = (opts.prediction if opts.prediction is not None
                     else Prediction(plan.estimated_iteration_ms, "no prediction was given"))
        if world.rank == 0 and log:
            _say(timing_line(result.start_step, [g.step_ms for g in gathered], predicted))
        if opts.trace_path is not None and world.rank == 0:
            _write_trace(gathered, result, plan, world, opts, predicted)
    elif opts.trace_path is not None and world.rank == 0:
        _say(untraced(opts.trace_path))
    result.params = ex.parameters()
    return result


def check_finite(step: int, losses: dict[str, float], opts: TrainOptions) -> None:
    """RuntimeFailure unless every task's loss of (0-based) `step` is finite, raised before
    the step is logged or checkpointed, as Megatron checks its loss for NaN: a diverged run
    printed 'loss nan', saved NaN weights and exited 0. The losses are all-reduced over the
    world (`Executor.train_step`), so every rank stops at the same step."""
    bad = {task: value for task, value in losses.items() if not math.isfinite(value)}
    if not bad:
        return
    which = ", ".join(f"{task} {value}" for task, value in bad.items())
    # the loss of step k comes from the weights after step k-1, which a checkpoint of step
    # k-1 holds: resuming from it diverges again
    kept = (f"; step {step + 1} was not checkpointed, and a checkpoint of step {step} holds "
            "the weights that gave it" if opts.checkpoint_dir is not None and step else "")
    raise RuntimeFailure(
        f"step {step + 1}/{opts.steps}: the loss is not finite ({which}): training "
        f"diverged{kept}",
        hint=f"try a smaller --lr than {opts.lr:g}" + (
            ", resuming from an earlier checkpoint" if kept else ""))


def check_finite_weights(done: int, ex: Executor, world: rdist.World,
                         opts: TrainOptions) -> None:
    """Collective: RuntimeFailure unless every rank's stepped values are finite after `done`
    steps, checked before they are checkpointed: a finite loss can come with a non-finite
    gradient, whose step saved NaN weights. Every rank learns the verdict (an all-reduce of
    a flag), so all stop or all save."""
    ok = torch.tensor([1.0 if ex.finite() else 0.0], device=world.device)
    if world.world_size > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0.0:
        raise RuntimeFailure(f"step {done}/{opts.steps}: the weights are not finite after the "
                             f"step: training diverged; step {done} was not checkpointed",
                             hint=f"try a smaller --lr than {opts.lr:g}, resuming from an "
                                  "earlier checkpoint")


def device_synchronizer(device: torch.device) -> Callable[[], None] | None:
    """What waits for `device`'s queued work before a clock is read: CUDA runs kernels
    asynchronously (None on the CPU, whose work is done when a call returns)."""
    if device.type != "cuda":
        return None
    return lambda: torch.cuda.synchronize(device)


def measured_iteration_ms(step_ms: list[float]) -> float:
    """Median step time, leaving out the first step (warm-up) when there are others."""
    times = step_ms[1:] if len(step_ms) > 1 else step_ms
    return statistics.median(times) if times else 0.0


class RankTimings(NamedTuple):
    """What one rank measured over the run."""

    events: list[Any]
    """Its trace events (none without --trace)."""
    step_ms: list[float]
    origin_wall_ns: int
    """The wall-clock time of its trace clock's origin."""
    held: dict[str, int]
    """With --trace: the most it held in each category in its first step (`held`), and on
    CUDA the allocator's peak over the run ('peak_allocated_bytes')."""


def _gather_timings(tracer: Tracer, result: TrainResult, ex: Executor,
                    world: rdist.World) -> list[RankTimings]:
    """Every rank's `RankTimings`, in rank order, on every rank (one collective after the
    last step)."""
    held = dict(ex.held)
    peak = peak_allocated(world.device)
    if tracer.enabled and peak is not None:
        held["peak_allocated_bytes"] = peak
    mine = RankTimings(tracer.events, result.step_ms, tracer.origin_wall_ns, held)
    if world.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, mine)
    return [RankTimings(*g) for g in gathered]


def timing_line(start_step: int, step_ms: list[list[float]], predicted: Prediction) -> str:
    """How long a step took, for the run's log: the slowest rank's median
    (`measured_iteration_ms`: the first step of the run warms up and is left out when there
    are others), beside the predicted iteration."""
    measured = max(measured_iteration_ms(ms) for ms in step_ms)
    first, last = start_step + 1, start_step + len(step_ms[0])
    which = (f"step {first} alone, warm-up included" if first == last else
             f"step {last} alone, after step {first}'s warm-up" if last == first + 1 else
             f"median of steps {first + 1}-{last} on the slowest rank, after step {first}'s "
             f"warm-up")
    return f"time: {measured:.2f} ms/step ({which}), {predicted.describe()}"


def _write_trace(gathered: list[RankTimings], result: TrainResult, plan: Plan, world: rdist.World,
                 opts: TrainOptions, predicted: Prediction) -> None:
    # the iteration ends when the slowest rank ends it: take the slowest rank's median
    measured = max(measured_iteration_ms(g.step_ms) for g in gathered)
    rank_events = [g.events for g in gathered]
    summary = {"planner": plan.planner, "num_ranks": world.world_size, "backend": world.backend,
               "steps": len(result.step_ms), "measured_iteration_ms": measured,
               "predicted_iteration_ms": predicted.ms,
               "predicted_by": "plan estimate" if predicted.fallback else "simulator",
               # as `spindle simulate --progress rank --sync SYNC` gives it
               "predicted_with": ({} if predicted.fallback else
                                  {"progress": "rank",
                                   "sync": "chunked" if opts.overlap_sync else "per-set"}),
               "measured_over_predicted": measured / predicted.ms if predicted.ms > 0 else None,
               "breakdown_ms_per_step": {str(r): breakdown_ms(g.events, len(g.step_ms))
                                         for r, g in enumerate(gathered)},
               "predicted_parts_ms": predicted.parts,
               "slices": slice_compute(plan, rank_events),
               "compute_ms_per_step": compute_per_step_ms(plan, rank_events),
               "memory": memory_rows(plan, [g.held for g in gathered])}
    assert opts.trace_path is not None
    write_json(trace_document(rank_events, [g.origin_wall_ns for g in gathered], summary),
               opts.trace_path)
    _say(f"trace: {opts.trace_path}")
    _say(parts_line(summary["breakdown_ms_per_step"], predicted.parts))
    _say(memory_line(summary["memory"]))
    shared = (world.backend == "gloo"
              and world.local_world_size > len(os.sched_getaffinity(0)))
    for line in drift_lines(summary["slices"], summary["compute_ms_per_step"], predicted.ms,
                            shared_cores=shared):
        _say(line)


def predicted_iteration(plan_path: str, plan: Plan, graph: MetaOpGraph,
                        overlap_sync: bool) -> Prediction:
    """The simulator's iteration time for the plan as the executor runs it (each rank on its
    own, with its gradient buckets: chunked with `overlap_sync`, else per rank set), when
    its profile and cluster files are at hand and simulate it, else the plan's own
    estimate."""
    from spindle_cli.planner.simulate import simulate
    try:
        _, profile = load_recorded_input(plan, plan_path, Profile)
        _, cluster = load_recorded_input(plan, plan_path, ClusterSpec)
        sim = simulate(plan, graph, profile, cluster,
                       sync="chunked" if overlap_sync else "per-set", progress="rank")
        return Prediction(sim.iteration_ms, parts={
            "compute": sim.compute_ms, "transfer": sim.transfer_ms, "sync": sim.sync_ms,
            "optimizer": sim.optimizer_ms})
    except SpindleError as e:
        # every run predicts its step: a profile that cannot simulate the plan does not stop it
        return Prediction(plan.estimated_iteration_ms, str(e))


def _device_memory_bytes(world: rdist.World) -> int:
    if world.device.type == "cuda":
        return int(torch.cuda.get_device_properties(world.device).total_memory)
    return cpu_memory_bytes(world.local_world_size)


def cpu_memory_bytes(ranks_per_node: int) -> int:
    """The memory of one of `ranks_per_node` CPU ranks on this node: they share its RAM
    (`spindle run` checks the plan against it before launch, on gloo, as every rank does)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_node


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spindle_cli.runtime.rank")
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--sync", choices=["auto", "chunked", "per-set"], default="auto")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--dataset", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--trace", default=None)
    p.add_argument("--metrics", default=None)
    return p.parse_args(argv)


def print_line(line: str) -> None:
    """A loss line on stdout (rank 0). A stdout that refuses it (its reader gone, as with
    `spindle run ... | head -2`; a full disk) ends the run as an output the machine refused
    ends every command, with `stdout: cannot write: <why>` (README, exit codes): the rank
    reported a raw BrokenPipeError. stdout then goes to /dev/null, so that the line still in
    its buffer does not fail again as the rank exits."""
    try:
        print(line, flush=True)
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise _cannot_write("stdout", e, hint="the loss lines go to stdout: keep its reader "
                           "open until the run ends, or send them to a file") from None


def _cannot_write(target: str, e: OSError, hint: str | None = None) -> ArtifactError:
    """The error of an output the machine refused (`<file or stdout>: cannot write: <why>`),
    which ends a run with exit code 2 (`_refused_output`)."""
    return ArtifactError(target, "", f"cannot write: {e.strerror or e}", hint=hint)


def _refused_output(e: BaseException) -> str | None:
    """The error line of an output the machine refused (`<file or stdout>: cannot write:
    <why>`, an ArtifactError as `files` and `print_line` raise it), or None."""
    if isinstance(e, ArtifactError) and e.problem.startswith("cannot write"):
        return str(e)
    return None


def _report_failure(rank: int, e: BaseException) -> int:
    """The rank's error line on stderr and in torch's error file, whose `spindle` entry the
    launcher reads (`cli.run_failures`): whether the line is secondary (and the peers it
    lost), the error's hint (printed once, by the launcher, under the run's line) and, for an
    output the machine refused, the line the run ends with (exit code 2)."""
    hint = None
    if isinstance(e, SpindleError):
        cause, code, hint = str(e), e.exit_code, e.hint
    else:
        cause, code = f"{type(e).__name__}: {e}", 1
    # a rank that lost a peer is rarely the root cause; the launcher prefers other ranks' lines
    secondary = isinstance(e, rdist.PeerLost)
    peers = e.peers if isinstance(e, rdist.PeerLost) else []
    line = f"rank {rank}: {cause}"
    _say(f"error: {line}")
    if os.environ.get("SPINDLE_DEBUG") == "1":
        traceback.print_exception(e)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time()),
                       "spindle": {"rank": rank, "secondary": secondary, "peers": peers,
                                   "hint": hint, "refused_output": _refused_output(e)}}, f)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one rank; returns the process exit code."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        inputs = load_run_inputs(args.plan)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_world(inputs.plan, world_size)
        opts = TrainOptions(steps=args.steps, seed=args.seed, lr=args.lr,
                            dtype=run_dtype(args.dtype, inputs.graph.dtype),
                            dataset=args.dataset, checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every,
                            keep_checkpoints=args.keep_checkpoints, resume=args.resume,
                            trace_path=args.trace, metrics_path=args.metrics)
        check_options(opts, timeout_s=args.timeout_s, holder=rank == 0)
        world = rdist.init(args.backend, timeout_s=args.timeout_s)
        try:
            check_world(inputs.plan, world.world_size, rank=world.rank,
                        memory_bytes=_device_memory_bytes(world), planned=inputs.graph.dtype,
                        dtype=opts.dtype)
            overlap = overlap_for(args.sync, world.backend)
            predicted = (predicted_iteration(args.plan, inputs.plan, inputs.graph,
                                             overlap_sync=overlap)
                         if world.rank == 0 else None)
            opts = replace(opts, prediction=predicted, overlap_sync=overlap)
            log = print_line if world.rank == 0 else None
            train(inputs.plan, inputs.graph, inputs.model, inputs.program, world, opts, log)
        except BaseException:
            # on nccl, destroying the group waits for the collectives in flight, which a failed
            # run may never complete: the rank would hang there, its error unreported, until
            # the watchdog kills it; it leaves without (`runtime.rank` exits at once)
            if world.backend != "nccl":
                rdist.teardown()
            raise
        rdist.teardown(synchronize=True)
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line and an exit code
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, KeyboardInterrupt):
            return 130  # Ctrl-C reaches every rank; the launcher says it once
        return _report_failure(rank, e)
    return 0


if __name__ == "__main__":
    # the entry point was this module until the ranks' own (it imports torch before a rank can
    # take Ctrl-C): a torchrun line still naming it would start ranks that train nothing
    sys.exit("error: the ranks' entry point is `python -m spindle_cli.runtime.rank`, not "
             "spindle_cli.runtime.worker")
