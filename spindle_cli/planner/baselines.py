"""Baseline planners in Spindle's wave format (paper §5.1; our notes §11), so that the same
simulator and runtime consume them and the comparison measures scheduling alone.

- `sequential` (Megatron-LM / DeepSpeed temporal decoupling): tasks one after another, each
  MetaOp on the whole cluster (its largest valid count <= N), one MetaOp per wave.
- `optimus` (Spindle-Optimus, task level): every task starts at its smallest valid count and
  devices go, one valid step at a time, to the task with the largest marginal gain
  (T(n) - T(n')) / (n' - n); tasks then run concurrently on disjoint groups, each running its
  MetaOps in order. With more tasks than devices every task gets one device (or the fewest
  every task can run on: a tensor-parallel-only task needs its degree) and tasks are
  list-scheduled (longest first, onto the earliest-free group).
- `distmm` (DistMM-MT): tasks one after another; inside a task the modality towers (the MetaOps
  before the first join) run side by side on groups sized to minimize the slowest tower, then
  the joining (cross-modal) MetaOps run on the whole cluster; a task whose towers compute
  faster one after another on the whole cluster runs them so (valid counts can leave a
  heavy tower half the cluster beside a one-operator embedding: OFASys image captioning on 16
  devices, its ViT 38.3 ms on 8 against 22.8 on 16).
Concurrent chains are cut into waves with the same alignment rule as Spindle's waves, since a
plan synchronizes only at wave boundaries.
"""

from __future__ import annotations

import math

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.planner.alignment import MaxOps, PlannedWave, Slot, compute_ms
from spindle_cli.planner.allocation import OpCurve
from spindle_cli.planner.tasks import (
    balanced_counts,
    by_task,
    chain,
    chain_ms,
    concurrent,
    list_scheduled,
)


def _one_per_wave(metaops: list[MetaOp], curves: dict[str, OpCurve],
                  max_ops: MaxOps | None) -> list[PlannedWave]:
    """Each MetaOp alone on its largest valid count, split into waves only where one slice
    would not fit in memory."""
    waves = []
    for m in metaops:
        oc = curves[m.id]
        n = oc.counts[-1]
        step = m.num_layers if max_ops is None else max_ops(m.id, n)
        for first in range(0, m.num_layers, step):
            k = min(step, m.num_layers - first)
            waves.append(PlannedWave(level=m.level, slots=(
                Slot(metaop=m.id, n=n, num_ops=k, op_time_ms=oc.time_at(n)),)))
    return waves


def sequential(graph: MetaOpGraph, curves: dict[str, OpCurve],
               max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Each task's MetaOps on the whole cluster in turn."""
    return [w for ms in by_task(graph) for w in _one_per_wave(ms, curves, max_ops)]


def optimus(graph: MetaOpGraph, curves: dict[str, OpCurve], num_devices: int,
            max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Task-level allocation by largest marginal gain; tasks run concurrently."""
    tasks = [ms for ms in by_task(graph) if ms]
    counts = [_chain_counts(ms, curves, num_devices) for ms in tasks]
    if len(tasks) > num_devices or sum(c[0] for c in counts) > num_devices:
        return _list_scheduled(tasks, curves, num_devices, max(c[0] for c in counts), graph,
                               max_ops)
    alloc = [c[0] for c in counts]
    free = num_devices - sum(alloc)
    while free > 0:
        best, best_gain = -1, -math.inf
        for i, ms in enumerate(tasks):
            higher = [n for n in counts[i] if n > alloc[i]]
            if not higher or higher[0] - alloc[i] > free:
                continue
            nxt = higher[0]
            gain = (chain_ms(ms, curves, alloc[i]) - chain_ms(ms, curves, nxt)) / (nxt - alloc[i])
            if gain > best_gain:
                best, best_gain = i, gain
        if best < 0:
            break
        nxt = next(n for n in counts[best] if n > alloc[best])
        free -= nxt - alloc[best]
        alloc[best] = nxt
    order = sorted(range(len(tasks)),
                   key=lambda i: (-chain_ms(tasks[i], curves, alloc[i]), tasks[i][0].task))
    return concurrent([chain(tasks[i], curves, alloc[i]) for i in order], curves, graph,
                      max_ops)


def _chain_counts(ms: list[MetaOp], curves: dict[str, OpCurve], num_devices: int) -> list[int]:
    """The group sizes Optimus steps a task through: from the least on which every MetaOp of
    the task has a valid count, each size where one of them gets a new one (`chain` runs each
    on its largest valid count within the group). Not only the counts valid for all of them:
    a MetaOp valid on one device only (a contrastive loss, which gains nothing from more,
    under --uneven-splits with a prime batch) held its whole task on one device."""
    lowest = max(curves[m.id].counts[1] for m in ms)
    return sorted({n for m in ms for n in curves[m.id].counts[1:] if lowest <= n <= num_devices})


def _list_scheduled(tasks: list[list[MetaOp]], curves: dict[str, OpCurve], num_devices: int,
                    size: int, graph: MetaOpGraph, max_ops: MaxOps | None) -> list[PlannedWave]:
    """Lanes of `size` devices (one device, unless some task cannot run on fewer), longest
    task first onto the earliest-free lane."""
    times = [chain_ms(ms, curves, size) for ms in tasks]
    order = sorted(range(len(tasks)), key=lambda i: (-times[i], tasks[i][0].task))
    lanes = list_scheduled(times, num_devices // size, order)
    return concurrent([[link for i in lane for link in chain(tasks[i], curves, size)]
                       for lane in lanes if lane], curves, graph, max_ops)


def _towers(ms: list[MetaOp]) -> tuple[list[list[MetaOp]], list[MetaOp]]:
    """The task's modality towers (connected MetaOps before any join) and the joining part
    (MetaOps with several inputs and everything after them)."""
    ids = {m.id for m in ms}
    joined: set[str] = set()
    for m in ms:  # level order, so predecessors come first
        if len(m.predecessors) > 1 or any(p in joined for p in m.predecessors):
            joined.add(m.id)
    rest = [m for m in ms if m.id not in joined]
    parent = {m.id: m.id for m in rest}

    def root(x: str) -> str:
        while parent[x] != x:
            x = parent[x]
        return x

    for m in rest:
        for p in m.predecessors:
            if p in ids and p in parent:
                parent[root(m.id)] = root(p)
    groups: dict[str, list[MetaOp]] = {}
    for m in rest:
        groups.setdefault(root(m.id), []).append(m)
    towers = sorted(groups.values(), key=lambda g: g[0].id)
    return towers, [m for m in ms if m.id in joined]


def _tower_sizes(towers: list[list[MetaOp]], curves: dict[str, OpCurve],
                 num_devices: int) -> list[int] | None:
    """Group sizes (sum <= N) minimizing the slowest tower, then the sum of towers, over the
    counts where a tower's time changes (`tasks.balanced_counts`)."""
    options = [sorted({c for m in t for c in curves[m.id].counts[1:]}) for t in towers]
    return balanced_counts(towers, options, curves, num_devices)


def distmm(graph: MetaOpGraph, curves: dict[str, OpCurve], num_devices: int,
           max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Tasks in sequence; towers side by side (or one after another when that computes
    faster), then the cross-modal MetaOps on all devices."""
    waves: list[PlannedWave] = []
    for ms in by_task(graph):
        towers, joined = _towers(ms)
        sizes = _tower_sizes(towers, curves, num_devices) if len(towers) > 1 else None
        if sizes is None:
            waves.extend(_one_per_wave(ms, curves, max_ops))
            continue
        chains = [chain(t, curves, n) for t, n in zip(towers, sizes, strict=True)]
        side = concurrent(chains, curves, graph, max_ops) + _one_per_wave(joined, curves,
                                                                           max_ops)
        in_turn = _one_per_wave(ms, curves, max_ops)
        faster = compute_ms(side) <= compute_ms(in_turn)
        waves.extend(side if faster else in_turn)
    return waves
