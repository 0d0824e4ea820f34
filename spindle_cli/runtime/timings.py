"""A run's step times against its prediction: the predicted iteration (`Prediction`, the
simulator's or the plan's estimate: `predicted_iteration`), what every rank measured
(`RankTimings`, gathered after the last step), the run's time line (`timing_line`) and, with
--trace, the trace file and its summary lines (`write_trace`; the events and their tables are
`trace`'s).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, Plan, Profile, load_recorded_input
from spindle_cli.errors import SpindleError
from spindle_cli.runtime import dist as rdist
from spindle_cli.runtime.executor import Executor
from spindle_cli.runtime.held import peak_allocated
from spindle_cli.runtime.output import say
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


def gather_timings(tracer: Tracer, step_ms: list[float], ex: Executor,
                   world: rdist.World) -> list[RankTimings]:
    """Every rank's `RankTimings` (this rank's steps took `step_ms`), in rank order, on every
    rank (one collective after the last step)."""
    held = dict(ex.held)
    peak = peak_allocated(world.device)
    if tracer.enabled and peak is not None:
        held["peak_allocated_bytes"] = peak
    mine = RankTimings(tracer.events, step_ms, tracer.origin_wall_ns, held)
    if world.world_size == 1:
        return [mine]
    gathered: list[Any] = [None] * world.world_size
    with rdist.with_peers("the gather of the ranks' timings",
                          [r for r in range(world.world_size) if r != world.rank]):
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


def write_trace(trace_path: str, gathered: list[RankTimings], plan: Plan, world: rdist.World,
                predicted: Prediction, *, steps: int, overlap_sync: bool | None) -> None:
    """Rank 0's --trace file (`trace_document`: every rank's events and a summary of the run's
    `steps`, measured against `predicted`), then its summary lines on stderr."""
    # the iteration ends when the slowest rank ends it: take the slowest rank's median
    measured = max(measured_iteration_ms(g.step_ms) for g in gathered)
    rank_events = [g.events for g in gathered]
    summary = {"planner": plan.planner, "num_ranks": world.world_size, "backend": world.backend,
               "steps": steps, "measured_iteration_ms": measured,
               "predicted_iteration_ms": predicted.ms,
               "predicted_by": "plan estimate" if predicted.fallback else "simulator",
               # as `spindle simulate --progress rank --sync SYNC` gives it
               "predicted_with": ({} if predicted.fallback else
                                  {"progress": "rank",
                                   "sync": "chunked" if overlap_sync else "per-set"}),
               "measured_over_predicted": measured / predicted.ms if predicted.ms > 0 else None,
               "breakdown_ms_per_step": {str(r): breakdown_ms(g.events, len(g.step_ms))
                                         for r, g in enumerate(gathered)},
               "predicted_parts_ms": predicted.parts,
               "slices": slice_compute(plan, rank_events),
               "compute_ms_per_step": compute_per_step_ms(plan, rank_events),
               "memory": memory_rows(plan, [g.held for g in gathered])}
    write_json(trace_document(rank_events, [g.origin_wall_ns for g in gathered], summary),
               trace_path)
    say(f"trace: {trace_path}")
    say(parts_line(summary["breakdown_ms_per_step"], predicted.parts))
    say(memory_line(summary["memory"]))
    shared = (world.backend == "gloo"
              and world.local_world_size > len(os.sched_getaffinity(0)))
    for line in drift_lines(summary["slices"], summary["compute_ms_per_step"], predicted.ms,
                            shared_cores=shared):
        say(line)


def untraced(trace_path: str) -> str:
    """What a run given --trace says when no step ran (a resume with nothing left)."""
    return f"trace: no step ran, so nothing was traced ({trace_path} not written)"
