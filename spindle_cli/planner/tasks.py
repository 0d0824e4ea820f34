"""Task-level views of a MetaOp graph: a task's MetaOps as one chain on one device group.

The task-level baselines (`baselines.optimus`, `baselines.distmm`) size device groups per
task or tower; Spindle's task-stable candidate (`balanced_counts`, used by `api.make_plan`)
sizes them by its own rule. A chain's MetaOps each run on the largest of their valid counts
that fits the group.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import replace

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner.allocation import AslTuple, LevelAllocation, OpCurve

Chain = list[tuple[str, int]]
"""MetaOps run one after another on one device group, with their device counts."""


def by_task(graph: MetaOpGraph) -> list[list[MetaOp]]:
    """Each task's MetaOps in level order (ties by id), in the graph's task order."""
    return [sorted((m for m in graph.metaops if m.task == t), key=lambda m: (m.level, m.id))
            for t in graph.tasks]


def largest_within(oc: OpCurve, n: int) -> int:
    """The largest valid count <= n (0 when there is none)."""
    return oc.counts[bisect_right(oc.counts, n) - 1]


def task_counts(ms: list[MetaOp], curves: dict[str, OpCurve], num_devices: int) -> list[int]:
    """Device counts valid for every MetaOp of a task (any count from the largest minimum up
    when the MetaOps share none)."""
    common = set(range(1, num_devices + 1))
    for m in ms:
        common &= set(curves[m.id].counts[1:])
    if common:
        return sorted(common)
    lowest = max(curves[m.id].counts[1] for m in ms)
    return list(range(lowest, num_devices + 1))


def chain_ms(ms: list[MetaOp], curves: dict[str, OpCurve], n: int) -> float:
    """Compute time of the MetaOps one after another on a group of n devices (inf when one
    has no valid count <= n)."""
    total = 0.0
    for m in ms:
        k = largest_within(curves[m.id], n)
        if k == 0:
            return math.inf
        total += m.num_layers * curves[m.id].time_at(k)
    return total


def chain(ms: list[MetaOp], curves: dict[str, OpCurve], n: int) -> Chain:
    """The MetaOps with the device count each runs on in a group of n devices."""
    result = []
    for m in ms:
        k = largest_within(curves[m.id], n)
        if k == 0:
            raise PlanInfeasible(f"{m.id}: no valid device count <= {n}")
        result.append((m.id, k))
    return result


def balanced_counts(tasks: list[list[MetaOp]], curves: dict[str, OpCurve],
                    num_devices: int) -> list[int] | None:
    """One group size per task, summing to at most N, that minimizes the longest chain
    (`chain_ms`), and among those the sum of all chains: exact, by dynamic programming over
    the tasks and the devices used so far (O(tasks x N x counts)). The task-level
    counterpart of the level allocator's equal finish: Optimus's marginal-gain rule instead
    feeds whichever task gains most per device, which need not shorten the longest one.
    None when the tasks' smallest groups do not fit."""
    # devices used -> (longest chain, sum of chains, sizes so far); the first best kept
    states: dict[int, tuple[float, float, tuple[int, ...]]] = {0: (0.0, 0.0, ())}
    for ms in tasks:
        options = [(n, chain_ms(ms, curves, n)) for n in task_counts(ms, curves, num_devices)]
        nxt: dict[int, tuple[float, float, tuple[int, ...]]] = {}
        for used in sorted(states):
            longest, total, sizes = states[used]
            for n, t in options:
                if used + n > num_devices or t == math.inf:
                    continue
                cand = (max(longest, t), total + t, sizes + (n,))
                old = nxt.get(used + n)
                if old is None or cand[:2] < old[:2]:
                    nxt[used + n] = cand
        if not nxt:
            return None
        states = nxt
    return list(min(states.values(), key=lambda s: s[:2])[2])


def task_stable(allocs: list[LevelAllocation], graph: MetaOpGraph, curves: dict[str, OpCurve],
                num_devices: int) -> list[LevelAllocation] | None:
    """Beyond the paper: `allocs` with every MetaOp's operators on one count, its task's group
    size from `balanced_counts` (the largest valid count within it), so a task keeps one
    group from its first MetaOp to its loss and its rows are never re-split between levels.
    Slower compute than the levels' own balance when encoders differ in cost, no re-split
    rows inside a task. None when the tasks' smallest groups do not fit."""
    tasks = [ms for ms in by_task(graph) if ms]
    sizes = balanced_counts(tasks, curves, num_devices)
    if sizes is None:
        return None
    count = {mid: k for ms, n in zip(tasks, sizes, strict=True)
             for mid, k in chain(ms, curves, n)}
    return [replace(a, ops=tuple(
        replace(o, tuples=(AslTuple(metaop=o.metaop, n=count[o.metaop],
                                    num_ops=sum(t.num_ops for t in o.tuples)),))
        for o in a.ops)) for a in allocs]
