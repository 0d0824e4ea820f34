"""Wavefront scheduling (the paper's Algorithm 1, §3.4): ASL-tuples -> waves, level by level.

A wave is a set of MetaOp slices that run at the same time on disjoint device groups; device
counts are fixed inside a wave and activations move only between waves. Per level, each wave:
  1. proposes tuples first-fit, largest n first (then longest time), whose MetaOp's
     predecessors are finished, at most one tuple per MetaOp;
  2. extends idle devices: the admitted MetaOp with the most remaining time (at the wave's
     counts) moves to its next valid count, until nothing fits;
  3. aligns the wave to its shortest tuple: the others run as many whole operators as fit
     (`alignment.align`);
  4. puts remainders back with their original n, and merges the wave into the previous one
     when every slice of it repeats a (MetaOp, n) of that wave (`alignment.merge_or_append`).
Levels are concatenated. Ranks are chosen later (`placement.py`).

Beyond the paper: `schedules.spindle_waves` runs each level under several VARIANTS (proposal order,
alignment rule, extension rule; the public code has the same kinds of switches) and keeps the
shortest (`without_extension` gives the same with idle devices left idle, a schedule that
re-splits fewer rows); `alignment.align_fill` aligns a wave to the span that keeps its devices
busiest; `max_ops` caps a slice so that it fits in a share of device memory;
`shortening.shorten_waves` (run at the end of every `schedule_level`) moves whole operators
between a level's waves while that shortens the level; `refinement.refine_level` searches the
integer rounding of the allocator's tuples for one that packs into shorter waves (not called by
`api` yet: planning time).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from spindle_cli.planner.alignment import (
    MAX_SPANS,
    MaxOps,
    PlannedWave,
    Slot,
    align,
    align_fill,
    merge_or_append,
)
from spindle_cli.planner.allocation import LevelAllocation, OpCurve
from spindle_cli.planner.shortening import shorten_waves


@dataclass(slots=True)
class _Pending:
    """A tuple's operators not yet in a wave."""

    metaop: str
    n: int
    num_ops: int
    op_time_ms: float
    """Per-operator time at n (looked up once: proposal orders and extensions ask often)."""

    @property
    def time_ms(self) -> float:
        """Time of the operators left."""
        return self.num_ops * self.op_time_ms


SORT_RULES = ("bigN_bigT", "bigT", "bigA")
"""Proposal orders: largest n first then longest time, or longest time first then largest n
(the public code's names), or, beyond the paper, largest device-time (n x time) first, which
admits long tuples on few devices before the greedy extends the others into their devices."""
ROUNDINGS = ("nearest", "down", "fill", "fill_steps")
"""How a wave is aligned: to the shortest tuple, rounding the others' operators to nearest or
down (`align`), or to the span that keeps its devices busiest among the tuples' ends or
operator boundaries (`align_fill`)."""
EXTENSIONS = ("remaining", "scheduled")
"""Which admitted MetaOp idle devices go to first (see `_extend`); beyond these, 'none' leaves
them idle (`without_extension`)."""
Variant = tuple[str, str, str]
"""(sort rule, rounding, extension), as in VARIANTS."""
VARIANTS = tuple(itertools.product(SORT_RULES, ROUNDINGS, EXTENSIONS))
"""Every (sort rule, rounding, extension) combination, tried on levels of few tuples."""
LARGE_LEVEL_VARIANTS = (("bigN_bigT", "nearest", "remaining"), ("bigN_bigT", "fill", "remaining"),
                        ("bigT", "fill", "scheduled"))
"""The variants tried on levels of more than LARGE_LEVEL tuples (planning time)."""


def without_extension(variants: tuple[Variant, ...]) -> tuple[Variant, ...]:
    """`variants` with idle devices left idle (extension 'none'), once each. An extension
    gives a MetaOp more devices for one wave only, so its rows are re-split twice: faster
    compute, more inter-wave traffic; the planner's simulator decides (`api.make_plan`)."""
    return tuple(dict.fromkeys((rule, rounding, "none") for rule, rounding, _ in variants))


LARGE_LEVEL = 128



def _proposal_key(rule: str) -> Callable[[_Pending], tuple[float, float, str]]:
    if rule == "bigT":
        return lambda p: (-p.time_ms, -p.n, p.metaop)
    if rule == "bigA":
        return lambda p: (-p.n * p.time_ms, -p.n, p.metaop)
    return lambda p: (-p.n, -p.time_ms, p.metaop)


def schedule_level(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                   predecessors: dict[str, tuple[str, ...]], finished: set[str],
                   *, sort_rule: str = "bigN_bigT", rounding: str = "nearest",
                   extension: str = "remaining",
                   max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Algorithm 1 for one level (`wavefront_level`), then `shorten_waves`."""
    return shorten_waves(wavefront_level(alloc, curves, num_devices, predecessors, finished,
                                         sort_rule=sort_rule, rounding=rounding,
                                         extension=extension, max_ops=max_ops), max_ops)


def wavefront_level(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                    predecessors: dict[str, tuple[str, ...]], finished: set[str],
                    *, sort_rule: str = "bigN_bigT", rounding: str = "nearest",
                    extension: str = "remaining",
                    max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Algorithm 1 for one level, without `shorten_waves` (variants often build the same
    waves, and callers that try several shorten each distinct result once). `finished` holds
    the MetaOps completed by earlier levels and is updated with this level's MetaOps. With
    `max_ops`, a tuple offers a wave at most that many operators (the rest stays pending), so
    no slice outgrows device memory."""
    return traced_wavefront_level(alloc, curves, num_devices, predecessors, finished,
                                  sort_rule=sort_rule, rounding=rounding, extension=extension,
                                  max_ops=max_ops).waves


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedWaves:
    """`wavefront_level`'s waves and which of its switches made no difference on the way: a
    variant that differs only in those switches builds the same waves."""

    waves: list[PlannedWave]
    any_sort_rule: bool
    """Every proposal order sorted the pending tuples alike in every wave."""
    any_extension: bool
    """Both extension rules would have given idle devices alike in every wave."""
    any_rounding: bool
    """The other rounding of the same kind ('nearest'/'down', 'fill'/'fill_steps') would
    have aligned every wave alike."""

    def covers(self, variant: tuple[str, str, str], traced: tuple[str, str, str]) -> bool:
        """Whether `variant` builds the same waves as `traced`, the variant traced here."""
        (rule, rounding, extension), (t_rule, t_rounding, t_extension) = variant, traced
        kind = {"nearest": 0, "down": 0, "fill": 1, "fill_steps": 1}
        return ((rule == t_rule or self.any_sort_rule)
                and (extension == t_extension
                     or (self.any_extension and "none" not in (extension, t_extension)))
                and (rounding == t_rounding
                     or (self.any_rounding and kind[rounding] == kind[t_rounding])))


def traced_wavefront_level(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                           predecessors: dict[str, tuple[str, ...]], finished: set[str],
                           *, sort_rule: str = "bigN_bigT", rounding: str = "nearest",
                           extension: str = "remaining",
                           max_ops: MaxOps | None = None) -> TracedWaves:
    """`wavefront_level`, noting which switches mattered (`TracedWaves`)."""
    pending = [_Pending(metaop=t.metaop, n=t.n, num_ops=t.num_ops,
                        op_time_ms=curves[t.metaop].time_at(t.n))
               for a in alloc.ops for t in a.tuples]
    tuples_of: dict[str, list[_Pending]] = {}  # each MetaOp's tuples, in pending order
    for p in pending:
        tuples_of.setdefault(p.metaop, []).append(p)
    ready: set[str] = set()  # MetaOps seen with every predecessor finished, ready for good
    key = _proposal_key(sort_rule)
    other_keys = [_proposal_key(r) for r in SORT_RULES if r != sort_rule]
    any_sort_rule = any_extension = any_rounding = True
    waves: list[PlannedWave] = []
    while pending:
        order = sorted(pending, key=key)
        if any_sort_rule:
            any_sort_rule = all(all(a is b for a, b in zip(sorted(pending, key=k), order,
                                                            strict=True))
                                for k in other_keys)
        free = num_devices
        admitted: list[_Pending] = []
        in_wave: set[str] = set()
        for p in order:
            if p.n > free or p.metaop in in_wave:
                continue
            if p.metaop not in ready:
                if not all(q in finished for q in predecessors[p.metaop]):
                    continue
                ready.add(p.metaop)
            admitted.append(p)
            in_wave.add(p.metaop)
            free -= p.n
        assert admitted, "no tuple fits in an empty wave"
        if any_extension and free > 0:
            # the rules differ only in the time of an admitted MetaOp's tuples left pending
            any_extension = not any(q is not p and q.num_ops > 0
                                    for p in admitted for q in tuples_of[p.metaop])
        counts = {p.metaop: p.n for p in admitted}
        free = _extend(admitted, counts, tuples_of, curves, free, extension)
        taus = [curves[p.metaop].time_at(counts[p.metaop]) for p in admitted]
        offered = [p.num_ops if max_ops is None else min(p.num_ops, max_ops(p.metaop,
                                                                          counts[p.metaop]))
                   for p in admitted]
        if rounding in ("fill", "fill_steps"):
            ops = align_fill(taus, offered, [counts[p.metaop] for p in admitted],
                             every_operator=rounding == "fill_steps")
            # both try the same spans when no tuple offers more than one operator, or when
            # 'fill_steps' falls back to the tuples' ends
            any_rounding = any_rounding and (max(offered) <= 1 or sum(offered) > MAX_SPANS)
        else:
            ops = align(taus, offered, rounding=rounding)
            other = "down" if rounding == "nearest" else "nearest"
            any_rounding = any_rounding and align(taus, offered, rounding=other) == ops
        slots = tuple(Slot(metaop=p.metaop, n=counts[p.metaop], num_ops=k, op_time_ms=tau)
                      for p, k, tau in zip(admitted, ops, taus, strict=True))
        for p, k in zip(admitted, ops, strict=True):
            p.num_ops -= k
        pending = [p for p in pending if p.num_ops > 0]
        finished |= {p.metaop for p in admitted
                     if all(q.num_ops == 0 for q in tuples_of[p.metaop])}
        merge_or_append(waves, PlannedWave(level=alloc.level, slots=slots), max_ops)
    return TracedWaves(waves=waves, any_sort_rule=any_sort_rule, any_extension=any_extension,
                       any_rounding=any_rounding)


def _extend(admitted: list[_Pending], counts: dict[str, int],
            tuples_of: dict[str, list[_Pending]], curves: dict[str, OpCurve], free: int,
            rule: str = "remaining") -> int:
    """Give idle devices to the admitted MetaOps with the most remaining time (at the wave's
    counts, with their other tuples left pending, from `tuples_of`; rule 'remaining', the
    paper's) or the longest tuple in this wave ('scheduled'), one valid step at a time, or
    to none (rule 'none'); returns the devices still idle. A step goes to the next count that
    runs faster (a flat curve's embedding on more devices only syncs across more), and a
    MetaOp whose step does not fit never will (free devices only shrink): it leaves the heap."""
    if rule == "none" or free == 0:
        return free
    rest: dict[str, float] = {}
    if rule == "remaining":
        for p in admitted:
            for q in tuples_of[p.metaop]:
                if q is not p and q.num_ops > 0:
                    rest[q.metaop] = rest.get(q.metaop, 0.0) + q.time_ms
    ops = {p.metaop: p.num_ops for p in admitted}

    def remaining_ms(m: str) -> float:
        return rest.get(m, 0.0) + ops[m] * curves[m].time_at(counts[m])

    heap = [(-remaining_ms(p.metaop), p.metaop) for p in admitted]
    heapq.heapify(heap)
    while free > 0 and heap:
        _, m = heapq.heappop(heap)
        cur = counts[m]
        nxt = curves[m].faster_count(cur)
        if nxt is not None and nxt - cur <= free:
            counts[m] = nxt
            free -= nxt - cur
            heapq.heappush(heap, (-remaining_ms(m), m))
    return free
