"""Task-level views of a MetaOp graph: a task's MetaOps as one chain on one device group.

The task-level baselines (`baselines.optimus`, `baselines.distmm`) size device groups per
task or tower; Spindle's task-stable candidate (`task_stable`, used by `api.make_plan`)
sizes them as DistMM-MT sizes its towers (`balanced_counts`), then tries that sizing's
nearest neighbours (`task_sizes`), and places each task on its own ranks (`home_groups`).
A chain's MetaOps each run on the largest of their valid counts that fits the group.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, replace

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner.alignment import (
    MaxOps,
    PlannedWave,
    Slot,
    align,
    compute_ms,
    merge_or_append,
)
from spindle_cli.planner.allocation import AslTuple, LevelAllocation, OpCurve
from spindle_cli.planner.shortening import shorten_waves

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


def balanced_counts(chains: list[list[MetaOp]], options: list[list[int]],
                    curves: dict[str, OpCurve], num_devices: int) -> list[int] | None:
    """One group size per chain, from its `options`, summing to at most N, that minimizes the
    longest chain (`chain_ms`), then the sum of all chains, then the sizes themselves in
    order. Exact: the longest chain is one of the chains' times, the smallest feasible one
    is found by bisection (`_fits`), and under it `_least_sum` minimizes the sum. The task-level
    counterpart of the level allocator's equal finish; Optimus's marginal-gain rule instead
    feeds whichever task gains most per device, which need not shorten the longest one.
    None when the smallest groups do not fit."""
    timed = [[(n, t) for n in sizes if (t := chain_ms(ms, curves, n)) < math.inf]
             for ms, sizes in zip(chains, options, strict=True)]
    bounds = sorted({t for chain_times in timed for _, t in chain_times})
    lo, hi = 0, len(bounds)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(timed, bounds[mid], num_devices):
            hi = mid
        else:
            lo = mid + 1
    return None if lo == len(bounds) else _least_sum(timed, bounds[lo], num_devices)


def _fits(timed: list[list[tuple[int, float]]], bound_ms: float, num_devices: int) -> bool:
    """Whether every chain has a size within `bound_ms` and their smallest such sizes sum to
    at most N: exactly when `_least_sum` finds sizes, without its dynamic programming."""
    need = 0
    for chain_times in timed:
        within = [n for n, t in chain_times if t <= bound_ms]
        if not within:
            return False
        need += min(within)
    return need <= num_devices


def _least_sum(timed: list[list[tuple[int, float]]], bound_ms: float,
               num_devices: int) -> list[int] | None:
    """Sizes with every chain within `bound_ms` and at most N devices in all, minimizing the
    sum of chains, then the sizes in order (None when none fit): dynamic programming over
    the chains, keeping the best prefix per number of devices used (both criteria only grow
    as chains are added, so the best prefix extends to the best whole)."""
    states: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for chain_times in timed:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (total, chosen) in states.items():
            for n, t in chain_times:
                if used + n <= num_devices and t <= bound_ms:
                    cand = (total + t, (*chosen, n))
                    if used + n not in nxt or cand < nxt[used + n]:
                        nxt[used + n] = cand
        if not nxt:
            return None
        states = nxt
    return list(min(states.values())[1])


SIT_OUT = (None, 2.0, 4.0)
"""`concurrent` tries these: None, every chain runs in every wave; x, a chain whose operator is
longer than x times the shortest current MetaOp remainder sits the wave out."""


def concurrent(chains: list[Chain], curves: dict[str, OpCurve], graph: MetaOpGraph,
               max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Waves for chains running side by side: each wave is aligned to the shortest current
    MetaOp remainder; the others run as many whole operators as fit. Then shortened
    (`shortening.shorten_waves`), as Spindle's levels are: a chain's MetaOp moves operators only
    between the waves it already runs in, so each chain keeps its order.

    Beyond aligning every chain in every wave: waves are barriers, so one chain's long
    operator beside the others' one-operator MetaOps (embeddings, adapters) held them all for
    its length, wave after wave (OFASys 7 tasks on 16 devices, Optimus: 125.6 ms of waves for
    tasks whose slowest takes 96.1 ms on its own ranks). Such a chain may sit a short wave
    out (`SIT_OUT`); the shortest of the tries is kept, the first on ties."""
    # a rule that sits no chain out gives the waves of the one before: shortened once
    tried = dict.fromkeys(tuple(_side_by_side(chains, curves, graph, max_ops, x))
                          for x in SIT_OUT)
    return min((shorten_waves(list(waves), max_ops) for waves in tried),
               key=compute_ms)


def _side_by_side(chains: list[Chain], curves: dict[str, OpCurve], graph: MetaOpGraph,
                  max_ops: MaxOps | None, sit_out: float | None) -> list[PlannedWave]:
    """`concurrent`'s waves with one `SIT_OUT` rule, before shortening."""
    metaops = {m.id: m for m in graph.metaops}
    pos = [0] * len(chains)
    left = [metaops[c[0][0]].num_layers if c else 0 for c in chains]
    waves: list[PlannedWave] = []
    while True:
        active = [i for i, c in enumerate(chains) if pos[i] < len(c)]
        if not active:
            return waves
        heads = [chains[i][pos[i]] for i in active]
        taus = [curves[m].time_at(n) for m, n in heads]
        offered = [left[i] if max_ops is None else min(left[i], max_ops(m, n))
                   for i, (m, n) in zip(active, heads, strict=True)]
        # the chain with the shortest remainder always runs
        shortest = min(t * k for t, k in zip(taus, offered, strict=True))
        run = [j for j, t in enumerate(taus) if sit_out is None or t <= sit_out * shortest]
        ops = [0] * len(active)
        for j, k in zip(run, align([taus[j] for j in run], [offered[j] for j in run]),
                        strict=True):
            ops[j] = k
        slots = tuple(Slot(metaop=m, n=n, num_ops=k, op_time_ms=tau)
                      for (m, n), k, tau in zip(heads, ops, taus, strict=True) if k)
        for i, k in zip(active, ops, strict=True):
            left[i] -= k
            if left[i] == 0:
                pos[i] += 1
                if pos[i] < len(chains[i]):
                    left[i] = metaops[chains[i][pos[i]][0]].num_layers
        level = min(metaops[s.metaop].level for s in slots)
        merge_or_append(waves, PlannedWave(level=level, slots=slots), max_ops)


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskStable:
    """A task-stable allocation (`task_stable`) and where each task lives."""

    allocs: list[LevelAllocation]
    home: dict[str, tuple[int, ...]]
    """Per MetaOp: its task's group of ranks (`home_groups`), for placement to prefer."""


def home_groups(sizes: list[int], island_size: int, num_devices: int) -> list[tuple[int, ...]]:
    """Disjoint rank groups of the given sizes (sum <= N), largest first: a group of at least
    an island takes whole free islands, a smaller one the island with the fewest free ranks
    that still holds it (best fit, so islands stay whole for larger groups), and when none
    does, the lowest free ranks."""
    free = [list(range(k, min(k + island_size, num_devices)))
            for k in range(0, num_devices, island_size)]
    groups: list[tuple[int, ...]] = [()] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        n = sizes[i]
        if n >= island_size:
            take = [k for k, f in enumerate(free) if len(f) == island_size][: -(-n // island_size)]
        elif fits := [k for k, f in enumerate(free) if len(f) >= n]:
            take = [min(fits, key=lambda k: (len(free[k]), k))]
        else:
            take = [k for k, f in enumerate(free) if f]
        chosen: list[int] = []
        for k in take:
            want = n - len(chosen)
            chosen += free[k][:want]
            free[k] = free[k][want:]
        if len(chosen) < n:
            rest = sorted(r for f in free for r in f)[: n - len(chosen)]
            chosen += rest
            free = [[r for r in f if r not in rest] for f in free]
        groups[i] = tuple(sorted(chosen))
    return groups


NEAR_LONGEST = 1.05
"""`task_sizes` keeps a neighbour whose longest chain is within this factor of the least."""
NEIGHBOURS = 2
"""... and at most this many, nearest by longest chain then sum of chains."""


def task_sizes(graph: MetaOpGraph, curves: dict[str, OpCurve],
               num_devices: int) -> list[list[int]]:
    """Group sizes per task (in `by_task` order, tasks with MetaOps) for the task-stable
    candidate: `balanced_counts`, then its neighbours, one task a valid count up and another
    one down (or one up into spare devices), whose longest chain stays within NEAR_LONGEST
    of the least. The criteria tie or nearly tie there, and which vector simulates fastest
    depends on what they leave out (sync groups, extension, islands): OFASys 7 tasks on 32
    devices, (8, 8, 4, 2, 4, 3, 3) simulates 73.3 ms, `balanced_counts`'s (8, 8, 4, 2, 4, 2,
    4) 80.35, with the same longest chain. Empty when the smallest groups do not fit."""
    tasks = [ms for ms in by_task(graph) if ms]
    options = [task_counts(ms, curves, num_devices) for ms in tasks]
    best = balanced_counts(tasks, options, curves, num_devices)
    if best is None:
        return []
    # each task's chain at its count, a count up and a count down (None: no such count),
    # worked out once: a neighbour changes two of them
    base = [chain_ms(ms, curves, n) for ms, n in zip(tasks, best, strict=True)]
    limit = NEAR_LONGEST * max(base)
    ups = [next((n for n in options[i] if n > best[i]), None) for i in range(len(tasks))]
    downs = [max((n for n in options[i] if n < best[i]), default=None)
             for i in range(len(tasks))]
    up_ms = [0.0 if n is None else chain_ms(ms, curves, n)
             for ms, n in zip(tasks, ups, strict=True)]
    down_ms = [0.0 if n is None else chain_ms(ms, curves, n)
               for ms, n in zip(tasks, downs, strict=True)]
    # (longest chain, sum of chains) and sizes of each neighbour within the limit
    near: list[tuple[tuple[float, float], list[int]]] = []
    for i, up in enumerate(ups):
        if up is None:
            continue
        for j in (None, *range(len(tasks))):
            if j == i or (j is not None and downs[j] is None):
                continue
            sizes, times = list(best), list(base)
            sizes[i], times[i] = up, up_ms[i]
            if j is not None:
                sizes[j], times[j] = downs[j], down_ms[j]
            if sum(sizes) <= num_devices and max(times) <= limit:
                near.append(((max(times), math.fsum(times)), sizes))
    near.sort(key=lambda x: x[0])
    return [best] + [sizes for _, sizes in near[:NEIGHBOURS]]


def task_stable(allocs: list[LevelAllocation], graph: MetaOpGraph, curves: dict[str, OpCurve],
                cluster: ClusterSpec, sizes: list[int]) -> TaskStable:
    """Beyond the paper: `allocs` with every MetaOp's operators on one count, the largest valid
    one within its task's group size (`sizes`, from `task_sizes`), so a task keeps one group
    from its first MetaOp to its loss and its rows are never re-split between levels; and
    each task's group of ranks (`home_groups`). Slower compute than the levels' own balance
    when encoders differ in cost, no re-split rows inside a task."""
    tasks = [ms for ms in by_task(graph) if ms]
    count = {mid: k for ms, n in zip(tasks, sizes, strict=True)
             for mid, k in chain(ms, curves, n)}
    stable = [replace(a, ops=tuple(
        replace(o, tuples=(AslTuple(metaop=o.metaop, n=count[o.metaop],
                                    num_ops=sum(t.num_ops for t in o.tuples)),))
        for o in a.ops)) for a in allocs]
    groups = home_groups(sizes, cluster.island_size, cluster.num_devices)
    home = {m.id: g for ms, g in zip(tasks, groups, strict=True) for m in ms}
    return TaskStable(allocs=stable, home=home)


def list_scheduled(times_ms: list[float], num_lanes: int, order: list[int]) -> list[list[int]]:
    """Jobs (indices into `times_ms`) taken in `order`, each onto the lane with the least load so
    far (the lowest on ties): per lane, its jobs in the order they came."""
    loads = [0.0] * num_lanes
    members: list[list[int]] = [[] for _ in range(num_lanes)]
    for i in order:
        k = min(range(num_lanes), key=lambda k: (loads[k], k))
        loads[k] += times_ms[i]
        members[k].append(i)
    return members


LANE_CANDIDATES = 2
"""`task_lanes` returns at most this many lane sizes, least loaded first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Lanes:
    """Disjoint device groups of one size, each running its tasks one after another."""

    size: int
    tasks: list[list[int]]
    """Per lane: its tasks (indices in `by_task` order, tasks with MetaOps), in run order."""
    groups: list[tuple[int, ...]]
    """Per lane: its ranks (`home_groups`)."""
    load_ms: float
    """The longest lane's chains, one after another."""


def task_lanes(graph: MetaOpGraph, curves: dict[str, OpCurve],
               cluster: ClusterSpec) -> list[Lanes]:
    """Beyond the paper: the task-stable idea where tasks outnumber the groups (tiny-clip's 4
    tasks on 2 ranks, multitask-clip's 10 on 8, where `task_sizes` has nothing). For every
    device count g valid for all tasks that splits the cluster into at least 2 lanes and
    fewer lanes than tasks, the N // g lanes take the tasks longest first, each onto the
    least loaded lane (Optimus's list scheduling, on groups of g instead of single devices).
    A task never leaves its lane, so no rows move between ranks inside it; lanes idle only
    where their loads differ. The LANE_CANDIDATES least loaded."""
    tasks = [ms for ms in by_task(graph) if ms]
    n_dev = cluster.num_devices
    common = set.intersection(*(set(task_counts(ms, curves, n_dev)) for ms in tasks))
    found = []
    for g in sorted(common):
        num_lanes = n_dev // g
        if not 2 <= num_lanes < len(tasks):
            continue
        times = [chain_ms(ms, curves, g) for ms in tasks]
        members = list_scheduled(times, num_lanes, sorted(range(len(tasks)),
                                                          key=lambda i: (-times[i], i)))
        found.append(Lanes(size=g, tasks=members,
                           load_ms=max(math.fsum(times[i] for i in lane) for lane in members),
                           groups=home_groups([g] * num_lanes, cluster.island_size, n_dev)))
    found.sort(key=lambda x: (x.load_ms, x.size))
    return found[:LANE_CANDIDATES]


def lane_waves(graph: MetaOpGraph, curves: dict[str, OpCurve], lanes: Lanes,
               max_ops: MaxOps | None = None,
               ) -> tuple[list[PlannedWave], dict[str, tuple[int, ...]]]:
    """The lanes' chains side by side (`concurrent`) and each MetaOp's home ranks, its lane's
    group."""
    tasks = [ms for ms in by_task(graph) if ms]
    chains = [[link for i in lane for link in chain(tasks[i], curves, lanes.size)]
              for lane in lanes.tasks]
    home = {m.id: group for lane, group in zip(lanes.tasks, lanes.groups, strict=True)
            for i in lane for m in tasks[i]}
    return concurrent(chains, curves, graph, max_ops), home
