"""One rank's training (`train`): the wave executor's steps, from step 0 or a checkpoint, each
step's losses checked (`check_finite`) before they are logged, and the weights
(`check_finite_weights`) before they are checkpointed; after the last step, the run's time
line and trace (`timings`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from spindle_cli.artifacts import MetaOpGraph, ModelSpec, Plan
from spindle_cli.errors import RuntimeFailure
from spindle_cli.runtime import checkpoint
from spindle_cli.runtime import dist as rdist
from spindle_cli.runtime.data import load_data_source
from spindle_cli.runtime.executor import Executor
from spindle_cli.runtime.groups import make_groups
from spindle_cli.runtime.held import reset_peak
from spindle_cli.runtime.model import DTYPES
from spindle_cli.runtime.options import TrainOptions, checkpoint_meta, resume_note
from spindle_cli.runtime.output import Metrics, say
from spindle_cli.runtime.program import Program
from spindle_cli.runtime.timings import (
    Prediction,
    device_synchronizer,
    gather_timings,
    timing_line,
    untraced,
    write_trace,
)
from spindle_cli.runtime.trace import Tracer


@dataclass(slots=True, kw_only=True)
class TrainResult:
    """What one rank saw: the losses of the steps it ran and its final parameters."""

    start_step: int
    losses: list[dict[str, float]] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)


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
    meta = checkpoint_meta(plan, replace(opts, overlap_sync=ex.sync.overlap_sync))
    start = _resume(ex, world, opts, meta) if opts.resume else 0
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
    _report_timings(result, plan, ex, tracer, world, opts, log)
    result.params = ex.parameters()
    return result


def _resume(ex: Executor, world: rdist.World, opts: TrainOptions, meta: dict[str, Any]) -> int:
    """The step a --resume run starts from: that of the newest complete checkpoint in
    `opts.checkpoint_dir`, whose state `ex` then holds, or 0 when there is none."""
    assert opts.checkpoint_dir is not None
    # the check `spindle run` makes before launch, made again here for a plain torchrun:
    # a directory whose checkpoints are all incomplete (a rank's file missing, say on a
    # directory that is not shared by every node) is refused, not trained over from step 0
    found = checkpoint.resume_point(opts.checkpoint_dir, world_size=world.world_size, meta=meta)
    start = 0
    if found is not None:
        start, state = checkpoint.load(found[0], rank=world.rank, world_size=world.world_size,
                                       meta=meta, device=world.device)
        ex.load_state(state)
    if world.rank == 0:
        say(resume_note(found, opts))
    return start


def _report_timings(result: TrainResult, plan: Plan, ex: Executor, tracer: Tracer,
                    world: rdist.World, opts: TrainOptions,
                    log: Callable[[str], None] | None) -> None:
    """After the last step: every rank's step times gathered, and on rank 0 the line that sets
    them against the prediction (when logging) and the --trace file (or why there is none)."""
    if not result.step_ms:
        if opts.trace_path is not None and world.rank == 0:
            say(untraced(opts.trace_path))
        return
    gathered = gather_timings(tracer, result.step_ms, ex, world)
    predicted = (opts.prediction if opts.prediction is not None
                 else Prediction(plan.estimated_iteration_ms, "no prediction was given"))
    if world.rank == 0 and log:
        say(timing_line(result.start_step, [g.step_ms for g in gathered], predicted))
    if opts.trace_path is not None and world.rank == 0:
        write_trace(opts.trace_path, gathered, plan, world, predicted,
                    steps=len(result.step_ms), overlap_sync=opts.overlap_sync)


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
        with rdist.with_peers("the check that the weights are finite",
                              [r for r in range(world.world_size) if r != world.rank]):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if ok.item() == 0.0:
        raise RuntimeFailure(f"step {done}/{opts.steps}: the weights are not finite after the "
                             f"step: training diverged; step {done} was not checkpointed",
                             hint=f"try a smaller --lr than {opts.lr:g}, resuming from an "
                                  "earlier checkpoint")
