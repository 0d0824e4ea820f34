"""Device placement (paper §3.5): concrete ranks for every slice of every wave.

Island-aware placement, greedy wave by wave:
  - a slice that fits in one NVLink island stays inside one island where one still has
    room when its turn comes, and a tensor-parallel slice that does not takes whole groups
    from each island (no group spans two). Slices that chose earlier may leave no island
    room for a later one, which then spans two (OFASys 4 tasks on 2x8 GPUs: an 8-rank
    decoder after two 4-rank adapters took an island each); choosing islands so that every
    later slice still fits in one (first fit, largest first) made the two committed plans
    where this happens simulate slower (62.6 -> 65.0 and 138.5 -> 140.5 ms), their flows
    kept on fewer ranks, so it is not done;
  - inside a wave, the slice with the heaviest incoming flow chooses first, so the heaviest
    flows claim producer/consumer co-location (on the simulator this cut the transfer wait of
    multitask-clip-4 on 32 devices from 34% to 23% of the iteration, against ordering by
    size); among equal flows larger slices go first, which keeps islands whole for them;
  - a rank's score rewards holding the producer's activations (same rank, then same island),
    already holding the slice's parameters (shared layers are not replicated again), and free
    memory (balance);
  - with `home` (Spindle's task-stable plans), a rank also scores for being in the group its
    MetaOp's task lives on;
  - with `reserve`, a rank that a slice of the wave not yet placed would keep its inputs on
    scores lower, by RESERVE_WEIGHT of that slice's own same-rank locality there: a slice
    choosing first no longer takes the producer ranks of the next one when others serve it
    almost as well (OFASys 4 tasks on 8 GPUs: 1022 instead of 1312 MiB leave their ranks);
  - a rank that would exceed its memory is never chosen. When a wave cannot be placed, the
    failed wave and then up to `_BACKTRACK_DEPTH` earlier waves are re-placed memory-first
    (worse locality, better balance); when every wave placed memory-first still fails, once
    more with each wave's slices in order of their whole need (state as well as
    activations: the activation order can leave a slice that is mostly parameters no rank);
    then PlanInfeasible names the rank, the bytes needed and the bytes available;
  - a wave whose tensor-parallel group finds no island with room (data-parallel slices
    placed before it filled every island in part) is placed again with its largest groups
    first.
`placement="sequential"` is the ablation baseline: consecutive ranks in slot order, no search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.plan import tp_group_size, tp_groups
from spindle_cli.errors import OutOfMemory, PlanInfeasible, SplitGroup
from spindle_cli.planner.memory import NO_SAVING, Ledger, MemoryStrategy
from spindle_cli.units import fmt_bytes

_BACKTRACK_DEPTH = 3
_MAX_ATTEMPTS = 16

RESERVE_WEIGHT = 0.5
"""With `reserve`: how much of a pending slice's same-rank locality on a rank a slice choosing
before it gives up for taking that rank. The planner keeps a reserved placement only when it
simulates faster (`api.make_plan`); in `spindle bench` weights 0.25-1 cut Spindle's summed
iteration below 256 GPUs alike (3569.8-3572.0 ms against 3586.3 without)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceSpec:
    """A slice to place: operators [first, last) of a MetaOp on n ranks."""

    metaop: MetaOp
    first: int
    last: int
    n: int
    strategy: str

    @property
    def num_ops(self) -> int:
        """Operators in the slice."""
        return self.last - self.first


@dataclass(frozen=True, slots=True, kw_only=True)
class Flow:
    """An activation flow between slices, addressed as (wave index, slice index)."""

    src: tuple[int, int]
    dst: tuple[int, int]
    bytes: int


Ranks = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Failure:
    wave: int
    message: str
    memory: bool = False
    """Whether a rank's memory stopped the slice (what the backtracking is for)."""
    grouping: bool = False
    """Whether free ranks were left but no island could hold the slice's tensor-parallel
    groups (the wave is then placed again with its largest groups first)."""


def _describe(s: SliceSpec) -> str:
    return f"{s.metaop.id} operators [{s.first}, {s.last}) on {s.n} ranks"


@dataclass(frozen=True, slots=True)
class _PlacedWave:
    """How an attempt placed one wave."""

    order: list[int]
    """The wave's slice indices in the order they chose (and were committed to the ledger)."""
    ranks: list[np.ndarray]
    """Every slice's ranks, ascending, as an index array; indexed like the wave."""


_WaveKey = tuple[tuple[str, int, int, int, str], ...]


@dataclass(slots=True)
class _Node:
    """A wave placed after the waves on the path to it, and the waves placed after it."""

    wave: _PlacedWave | None
    """None at the root (no wave yet)."""
    after: dict[_WaveKey, _Node] = field(default_factory=dict)


class PlacedWaves:
    """The first attempts' wave placements of earlier `place` calls on one graph and cluster
    (the candidates of one `api.make_plan`), for the calls after them. A first attempt
    places a wave from the memory strategy, `home`, `reserve`, the wave's slices, their
    incoming flows and the waves before it (their ranks and the ledger they leave), and the
    flows into the leading waves follow from their slices (a flow comes from the MetaOp's
    previous slice, or from the last slice of a predecessor, which ends before the consumer
    starts). So a call whose leading waves hold the same slices as an earlier call's, under
    the same memory strategy, `home` and `reserve`, places them alike: `place` commits them
    to its ledger again instead of choosing their ranks (candidates often share all but
    their last waves)."""

    def __init__(self, graph: MetaOpGraph, cluster: ClusterSpec) -> None:
        self.graph = graph
        self.cluster = cluster
        self.short_of_memory = False
        """Whether memory kept a slice of some call off a free rank (it would not fit there)."""
        self._roots: dict[tuple[MemoryStrategy, tuple[tuple[str, Ranks], ...], bool],
                          _Node] = {}

    def _root(self, memory: MemoryStrategy, home: dict[str, Ranks], reserve: bool) -> _Node:
        return self._roots.setdefault((memory, tuple(sorted(home.items())), reserve),
                                      _Node(wave=None))

    def leading(self, waves: list[list[SliceSpec]], memory: MemoryStrategy,
                home: dict[str, Ranks], reserve: bool) -> list[_PlacedWave]:
        """The placements of the longest run of leading waves an earlier call placed."""
        node = self._root(memory, home, reserve)
        found = []
        for wave in waves:
            next_node = node.after.get(_wave_key(wave))
            if next_node is None:
                break
            node = next_node
            assert node.wave is not None
            found.append(node.wave)
        return found

    def record(self, waves: list[list[SliceSpec]], placed: list[_PlacedWave],
               memory: MemoryStrategy, home: dict[str, Ranks], reserve: bool) -> None:
        """Keep a first attempt's placements of the leading waves."""
        node = self._root(memory, home, reserve)
        for wave, placed_wave in zip(waves, placed, strict=False):
            node = node.after.setdefault(_wave_key(wave), _Node(wave=placed_wave))


def _wave_key(wave: list[SliceSpec]) -> _WaveKey:
    return tuple((s.metaop.id, s.first, s.last, s.n, s.strategy) for s in wave)


def place(waves: list[list[SliceSpec]], flows: list[Flow], graph: MetaOpGraph,
          cluster: ClusterSpec, *, mode: str = "island", memory: MemoryStrategy = NO_SAVING,
          home: dict[str, Ranks] | None = None, reserve: bool = False,
          placements: PlacedWaves | None = None) -> tuple[list[list[Ranks]], Ledger]:
    """Ranks for every slice (indexed like `waves`) and the memory ledger of the placement,
    with per-rank memory under the plan's memory strategy. `home` (island mode): ranks each
    MetaOp's slices prefer, weighed like keeping every incoming row local (a task-stable
    plan's task groups, `tasks.home_groups`). `reserve` (island mode): ranks are reserved
    for the slices that would keep their inputs there (module docstring). `placements`
    (island mode): the leading waves earlier calls placed, reused and extended."""
    if mode == "sequential":
        return _place_sequential(waves, graph, cluster, memory)
    assert placements is None or (placements.graph is graph and placements.cluster is cluster)
    incoming: dict[tuple[int, int], list[Flow]] = {}
    for f in flows:
        incoming.setdefault(f.dst, []).append(f)
    home = home or {}
    memory_first: set[int] = set()
    # the shortage of memory in the latest wave any attempt reached (the first one found there):
    # when the backtracking does not get round it, that is the cause to name, not what a
    # memory-first attempt ran into instead (a slice scattered for memory can leave no island
    # room for a tensor-parallel group), nor a shortage in an earlier wave that it got round
    short: _Failure | None = None
    # waves whose slices are placed largest tensor-parallel group first: the usual order can
    # fill every island with data-parallel slices, leaving no island room for a group
    groups_first: set[int] = set()
    everything = set(range(len(waves)))
    # the last attempts, every wave memory-first: in activation order unless the loop ends on
    # that having failed, then by whole need
    last = (False, True)
    # the waves the latest attempt placed, and how it placed each wave (`_wave_settings`);
    # at first those an earlier call's first attempt placed
    placed = placements.leading(waves, memory, home, reserve) if placements else []
    settings = _wave_settings(len(placed), set(), set(), False)

    def attempt(memory_first: set[int], by_need: bool = False
                ) -> tuple[list[list[Ranks]], Ledger] | _Failure:
        """`_attempt`, keeping the leading waves the latest attempt placed the same way: a
        pass is deterministic, so they would be placed again alike."""
        nonlocal settings
        now = _wave_settings(len(waves), memory_first, groups_first, by_need)
        same = next((wi for wi, before in enumerate(settings) if before != now[wi]),
                    len(settings))
        del placed[same:]
        settings = now
        result = _attempt(waves, incoming, graph, cluster, memory_first, memory, home, reserve,
                          groups_first, placed, by_need=by_need, placements=placements)
        if placements is not None and not any(map(any, now)):
            placements.record(waves, placed, memory, home, reserve)
        return result

    for _ in range(_MAX_ATTEMPTS):
        result = attempt(memory_first)
        if not isinstance(result, _Failure):
            return result
        short = _named_shortage(short, result)
        k = result.wave
        if result.grouping and k not in groups_first:
            groups_first.add(k)
            continue
        for j in range(k, max(-1, k - _BACKTRACK_DEPTH - 1), -1):
            if j not in memory_first:
                memory_first.add(j)
                break
        else:
            if memory_first == everything:
                last = (True,)
                break
            memory_first = set(everything)
    for by_need in last:
        result = attempt(everything, by_need)
        if not isinstance(result, _Failure):
            return result
        short = _named_shortage(short, result)
    failure = short or result
    raise (OutOfMemory if failure.memory else PlanInfeasible)(failure.message)


def _named_shortage(short: _Failure | None, result: _Failure) -> _Failure | None:
    """The memory shortage to name if placement gives up: `result` when it is one in a later
    wave than `short` (the backtracking got round that one), else `short`."""
    if result.memory and (short is None or result.wave > short.wave):
        return result
    return short


def _wave_settings(num_waves: int, memory_first: set[int], groups_first: set[int],
                   by_need: bool) -> list[tuple[bool, bool, bool]]:
    """What `_attempt` reads, besides the ledger and the waves before it, to place each wave:
    whether it is memory-first, whether it takes its slices by need, whether largest groups
    go first."""
    return [(wi in memory_first, by_need and wi in memory_first, wi in groups_first)
            for wi in range(num_waves)]


def _attempt(waves: list[list[SliceSpec]], incoming: dict[tuple[int, int], list[Flow]],
             graph: MetaOpGraph, cluster: ClusterSpec,
             memory_first: set[int], memory: MemoryStrategy,
             home: dict[str, Ranks], reserve: bool, groups_first: set[int],
             placed: list[_PlacedWave], *, by_need: bool = False,
             placements: PlacedWaves | None = None
             ) -> tuple[list[list[Ranks]], Ledger] | _Failure:
    """One pass over the waves (`place`); `by_need`: memory-first waves take their slices in
    order of their largest per-rank need instead of their activations. `placed`: the leading
    waves as an earlier attempt with the same settings placed them, committed to the ledger
    again in the same order instead of chosen again (the same ranks and the same ledger); the
    waves this attempt places are appended to it. `placements`: the calls' record, told when
    memory keeps a slice off a free rank (`PlacedWaves.short_of_memory`)."""
    n_dev = cluster.num_devices
    cap = float(cluster.device.memory_bytes)
    island_of = np.arange(n_dev) // cluster.island_size
    ledger = Ledger(graph, n_dev, memory)
    for done, wave in zip(placed, waves, strict=False):
        for i in done.order:
            s = wave[i]
            ledger.commit(s.metaop, s.first, s.last, done.ranks[i], s.strategy)
    # every slice's ranks so far, ascending, as an index array
    rows = [done.ranks for done in placed]
    for wi in range(len(placed), len(waves)):
        wave = waves[wi]
        free = np.ones(n_dev, dtype=bool)
        ranks: list[np.ndarray | None] = [None] * len(wave)
        coming = _wave_replicas(ledger, wave)

        def heaviest_in(i: int, wi: int = wi) -> int:
            return max((f.bytes for f in incoming.get((wi, i), [])), default=0)

        def per_rank_stash(i: int, wave: list[SliceSpec] = wave) -> float:
            s = wave[i]
            return ledger.kept_per_sample(s.metaop) * s.metaop.batch_size * s.num_ops / s.n

        if wi in memory_first and by_need:
            needs = [float(ledger.need(s.metaop, s.first, s.last, s.n, s.strategy,
                                       coming).max())
                     for s in wave]
            order = sorted(range(len(wave)), key=lambda i: (-needs[i], i))
        elif wi in memory_first:
            # largest per-rank load first (LPT) balances memory best
            order = sorted(range(len(wave)), key=lambda i: (-per_rank_stash(i), i))
        else:
            order = sorted(range(len(wave)), key=lambda i: (-heaviest_in(i), -wave[i].n, i))
        if wi in groups_first:
            order.sort(key=lambda i: -tp_group_size(wave[i].n, wave[i].strategy))
        flow_score = claims = None
        if wi not in memory_first:
            same, island = _locality([incoming.get((wi, i), []) for i in range(len(wave))],
                                     [s.n for s in wave], rows, island_of, n_dev)
            flow_score = 4.0 * (2.0 * same + island) / 3.0
            if reserve and len(wave) > 1:
                # row k: what the k-th slice to choose gives up, for the largest same-rank
                # locality of the slices choosing after it (those not placed yet)
                claim = np.maximum.accumulate(same[order[:0:-1]], axis=0)[::-1]
                claims = 4.0 * RESERVE_WEIGHT * 2.0 * claim / 3.0
        for k, i in enumerate(order):
            s = wave[i]
            used = ledger.used()
            need = ledger.need(s.metaop, s.first, s.last, s.n, s.strategy, coming)
            ok = free & (used + need <= cap)
            if placements is not None and np.count_nonzero(ok) < np.count_nonzero(free):
                placements.short_of_memory = True
            if np.count_nonzero(ok) < s.n:
                return _failure(wi, s, free, used, need, cap)
            headroom = (cap - used - need) / cap
            if flow_score is None:
                score = headroom
            else:
                score = flow_score[i]
                if claims is not None and k < len(claims):
                    score = score - claims[k]
                score = score + (2.0 * ledger.shared_fraction(s.metaop, s.first, s.last) +
                                 headroom)
                if s.metaop.id in home:
                    score[list(home[s.metaop.id])] += 4.0
            group = tp_group_size(s.n, s.strategy)
            chosen = _choose(np.where(ok, score, -np.inf), s.n, cluster.island_size, group)
            if chosen is None:
                return _grouping_failure(wi, s, free, used, need, cap, cluster.island_size,
                                         group)
            free[chosen] = False
            before = used[chosen]
            beyond = ledger.commit(s.metaop, s.first, s.last, chosen, s.strategy)
            failure = _shards_failure(wi, s, chosen, beyond, before, ledger.used(), cap)
            if failure is not None:
                return failure
            ranks[i] = chosen
        placed.append(_PlacedWave(order=order, ranks=[r for r in ranks if r is not None]))
        rows.append(placed[-1].ranks)
    return [[tuple(r.tolist()) for r in row] for row in rows], ledger


def _wave_replicas(ledger: Ledger, wave: list[SliceSpec]) -> dict[str, np.ndarray] | None:
    """The replicas of each layer the wave's slices will hold between them
    (`Ledger.wave_replicas`), where ZeRO shards state over them (None: nothing sharded)."""
    if not ledger.sharded_b:
        return None
    return ledger.wave_replicas((s.metaop, s.first, s.last, s.n, s.strategy) for s in wave)


def _local_ranks(src: Ranks | np.ndarray, n: int) -> Ranks | np.ndarray:
    """The producer ranks worth reusing for a consumer of n ranks. Rows are split in rank
    order, so when n divides the producer's count k times, consumer position j needs the rows
    of producer positions jk..jk+k-1: reusing every k-th producer rank keeps 1/k of each
    consumer's rows local, while taking k neighbours would keep at most one position's."""
    if n < len(src) and len(src) % n == 0:
        return src[:: len(src) // n]
    return src


def _locality(flows: list[list[Flow]], ns: list[int], placed: list[list[np.ndarray]],
              island_of: np.ndarray, n_dev: int) -> tuple[np.ndarray, np.ndarray]:
    """0..1 per slice (row) and rank, for slices with incoming `flows` on `ns` ranks (`placed`:
    the producers' rank arrays): the byte-weighted share of a slice's incoming flows the rank
    would keep on the same rank, and inside the same island (0 for a slice without incoming
    bytes). A slice's flow score is (2 x same + island) / 3."""
    same, island = np.zeros((len(flows), n_dev)), np.zeros((len(flows), n_dev))
    totals = np.ones(len(flows))
    num_islands = int(island_of[-1]) + 1
    for i, (fs, n) in enumerate(zip(flows, ns, strict=True)):
        total = sum(f.bytes for f in fs)
        if total <= 0:
            continue
        totals[i] = total
        for f in fs:
            src = placed[f.src[0]][f.src[1]]
            islands = np.zeros(num_islands, dtype=bool)
            islands[island_of[src]] = True
            same[i][_local_ranks(src, n)] += f.bytes
            island[i][islands[island_of]] += f.bytes
    return same / totals[:, None], island / totals[:, None]


def _choose(score: np.ndarray, n: int, island_size: int, group: int = 1) -> np.ndarray | None:
    """n ranks with finite score, ascending: inside the one island with the best top-n total
    when possible, else filling the islands with the most usable ranks first, a multiple of
    `group` ranks from each (a tensor-parallel slice's groups of consecutive ranks stay inside
    one island); None when the islands cannot give n that way."""
    if n == 1:
        # the best island's best rank below: the first rank with the best score
        best = int(score.argmax())
        return np.array([best]) if np.isfinite(score[best]) else None
    by_island = score.reshape(-1, island_size)
    # the ranks of each island, best score first
    ranks = (-by_island).argsort(axis=1, kind="stable") + _island_starts(len(score),
                                                                          island_size)
    ranked = score[ranks]
    if n <= island_size:
        top = ranked[:, :n].sum(axis=1)
        if np.isfinite(top).any():
            return np.sort(ranks[int(top.argmax()), :n])
    finite = np.isfinite(ranked)
    usable = finite.sum(axis=1)
    totals = np.where(finite, ranked, 0.0).sum(axis=1)
    # islands with the most usable ranks first, then the best total score, then index
    islands = np.lexsort((np.arange(len(usable)), -totals, -usable))
    # in that order each island gives its best usable ranks in whole groups until n are taken
    # (only a multiple of `group` can add up to n)
    whole = usable[islands] - usable[islands] % group
    taken = np.cumsum(whole)
    if n % group or taken[-1] < n:
        return None
    gives = np.minimum(whole, np.maximum(n - (taken - whole), 0))
    return np.sort(ranks[islands][np.arange(island_size) < gives[:, None]])


@lru_cache(maxsize=64)
def _island_starts(num_devices: int, island_size: int) -> np.ndarray:
    """Each island's first rank, as a column (cached and read-only)."""
    starts = np.arange(0, num_devices, island_size)[:, None]
    starts.flags.writeable = False
    return starts


def _failure(wi: int, s: SliceSpec, free: np.ndarray, used: np.ndarray, need: np.ndarray,
             cap: float) -> _Failure:
    """Name the rank that stops the slice: among the free ranks ordered by how well the slice
    fits, the first one it cannot fit on (the slice needs n of them)."""
    if int(free.sum()) < s.n:
        return _Failure(wave=wi, message=f"wave {wi}: fewer than {s.n} free ranks left for "
                                         f"{_describe(s)}")
    slack = np.where(free, cap - used - need, -np.inf)
    order = np.argsort(-slack, kind="stable")
    r = int(next(int(k) for k in order if slack[k] < 0))
    return _Failure(
        wave=wi, memory=True,
        message=(f"out of memory placing {_describe(s)} in wave {wi}: rank {r} "
                 f"{_shortage(need[r], cap - used[r], cap)}"),
    )


def _shards_failure(wi: int, s: SliceSpec, chosen: np.ndarray, beyond: np.ndarray,
                    before: np.ndarray, used: np.ndarray, cap: float) -> _Failure | None:
    """A memory failure when a rank of `chosen` that now holds other tensor-parallel shards
    of the slice's layers (`beyond`, which `Ledger.need` does not foresee) ends above `cap`;
    None when they all fit."""
    over = beyond & (used[chosen] > cap)
    if not over.any():
        return None
    k = int(over.argmax())
    r = int(chosen[k])
    return _Failure(
        wave=wi, memory=True,
        message=(f"out of memory placing {_describe(s)} in wave {wi}: rank {r} also holds "
                 f"other tensor-parallel shards of its layers and "
                 f"{_shortage(used[r] - before[k], cap - before[k], cap)}"),
    )


def _grouping_failure(wi: int, s: SliceSpec, free: np.ndarray, used: np.ndarray,
                      need: np.ndarray, cap: float, island_size: int, group: int) -> _Failure:
    """No island has room for a tensor-parallel group of the slice. When the free ranks alone
    would hold its groups, memory is what stops it: name the free rank short of memory that
    comes closest to fitting."""
    where = f"with each tensor-parallel group of {group} inside one island"
    if _choose(np.where(free, 0.0, -np.inf), s.n, island_size, group) is None:
        return _Failure(wave=wi, grouping=True,
                        message=f"wave {wi}: no {s.n} free ranks for {_describe(s)} {where}")
    r = int(np.argmax(np.where(free & (used + need > cap), cap - used - need, -np.inf)))
    return _Failure(
        wave=wi, grouping=True, memory=True,
        message=(f"out of memory placing {_describe(s)} in wave {wi} {where}: rank {r} "
                 f"{_shortage(need[r], cap - used[r], cap)}"),
    )


def _shortage(need: float, free: float, capacity: float) -> str:
    """'needs 24.0 GiB (25784090624 bytes) more but only ... are available (of ...)'. Whole
    bytes, the need rounded up and the room down (a share of a sharded or tensor-parallel
    layer is a fraction of a byte), so the need stays above the room."""
    need_b, free_b = math.ceil(round(need, 6)), math.floor(round(max(free, 0.0), 6))
    return (f"needs {fmt_bytes(need_b)} ({need_b} bytes) more but only {fmt_bytes(free_b)} "
            f"({free_b} bytes) are available (of {fmt_bytes(capacity)})")


def _place_sequential(waves: list[list[SliceSpec]], graph: MetaOpGraph, cluster: ClusterSpec,
                      memory: MemoryStrategy) -> tuple[list[list[Ranks]], Ledger]:
    cap = float(cluster.device.memory_bytes)
    ledger = Ledger(graph, cluster.num_devices, memory)
    placed: list[list[Ranks]] = []
    for wi, wave in enumerate(waves):
        start = 0
        row: list[Ranks] = []
        coming = _wave_replicas(ledger, wave)
        for s in wave:
            chosen = tuple(range(start, start + s.n))
            start += s.n
            split = next((g for g in tp_groups(chosen, s.strategy)
                          if g[0] // cluster.island_size != g[-1] // cluster.island_size), None)
            if split is not None:
                raise SplitGroup(
                    f"sequential placement puts the tensor-parallel group {list(split)} of "
                    f"{_describe(s)} in wave {wi} across two islands",
                    hint="island placement (the default) keeps each group inside an island; "
                         "or plan without tensor parallelism (--no-tensor-parallel)")
            used = ledger.used()
            need = ledger.need(s.metaop, s.first, s.last, s.n, s.strategy, coming)
            over = [r for r in chosen if used[r] + need[r] > cap]
            if over:
                r = over[0]
                raise OutOfMemory(
                    f"out of memory placing {_describe(s)} in wave {wi} (sequential placement): "
                    f"rank {r} {_shortage(need[r], cap - used[r], cap)}"
                )
            before = ledger.used()[list(chosen)]
            beyond = ledger.commit(s.metaop, s.first, s.last, chosen, s.strategy)
            failure = _shards_failure(wi, s, np.array(chosen), beyond, before, ledger.used(),
                                      cap)
            if failure is not None:
                raise OutOfMemory(f"{failure.message} (sequential placement)")
            row.append(chosen)
        placed.append(row)
    return placed, ledger
