"""Wavefront scheduling (the paper's Algorithm 1, §3.4): ASL-tuples -> waves, level by level.

A wave is a set of MetaOp slices that run at the same time on disjoint device groups; device
counts are fixed inside a wave and activations move only between waves. Per level, each wave:
  1. proposes tuples first-fit, largest n first (then longest time), whose MetaOp's
     predecessors are finished, at most one tuple per MetaOp;
  2. extends idle devices: the admitted MetaOp with the most remaining time (at the wave's
     counts) moves to its next valid count, until nothing fits;
  3. aligns the wave to its shortest tuple: the others run as many whole operators as fit;
  4. puts remainders back with their original n, and merges the wave into the previous one
     when every slice of it repeats a (MetaOp, n) of that wave.
Levels are concatenated. Ranks are chosen later (`placement.py`).

Beyond the paper: `schedules.spindle_waves` runs each level under several VARIANTS (proposal order,
alignment rule, extension rule; the public code has the same kinds of switches) and keeps the
shortest (`without_extension` gives the same with idle devices left idle, a schedule that
re-splits fewer rows); `align_fill` aligns a wave to the span that keeps its devices
busiest; `max_ops` caps a slice so that it fits in a share of device memory;
`shorten_waves` (run at the end of every `schedule_level`) moves whole operators between a
level's waves while that shortens the level; `refine_level` searches the integer rounding
of the allocator's tuples for one that packs into shorter waves (not called by `api` yet:
planning time).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from spindle_cli.planner.allocation import AslTuple, LevelAllocation, OpCurve

_EPS = 1e-9


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """`num_ops` operators of a MetaOp on `n` devices inside one wave."""

    metaop: str
    n: int
    num_ops: int
    op_time_ms: float
    """Per-operator time at n."""

    @property
    def time_ms(self) -> float:
        """Time of the slot's operators."""
        return self.num_ops * self.op_time_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedWave:
    """A wave before placement: its level and slots (in proposal order)."""

    level: int
    slots: tuple[Slot, ...]

    @property
    def duration_ms(self) -> float:
        """The longest slot."""
        return max(s.time_ms for s in self.slots)


def align(op_times_ms: list[float], num_ops: list[int], *, rounding: str = "nearest") -> list[int]:
    """Operators each tuple runs when the wave is aligned to the shortest tuple: tuple i first
    takes k_i = max(round(t_min / tau_i), 1) operators ('nearest'; 'down' rounds down so the
    span stays t_min unless an operator is longer), the wave lasts max tau_i * k_i, then every
    tuple runs as many whole operators as fit in that span (the shortest runs all)."""
    t_min = min(t * k for t, k in zip(op_times_ms, num_ops, strict=True))
    half = 0.5 if rounding == "nearest" else _EPS
    span = max(t * min(max(math.floor(t_min / t + half), 1), k)
               for t, k in zip(op_times_ms, num_ops, strict=True))
    return [min(k, max(1, math.floor(span / t + _EPS))) for t, k in zip(op_times_ms, num_ops,
                                                                        strict=True)]


def align_fill(op_times_ms: list[float], num_ops: list[int], devices: list[int],
               *, every_operator: bool = False) -> list[int]:
    """Beyond the paper: the span that keeps the wave's devices busiest. Candidate spans are
    each tuple's full length (or, with `every_operator`, the end of each of its operators);
    the tuples longer than the span run the whole operators that fit (at least one), the
    shorter ones finish early; the candidate with the highest busy share of device-time wins
    (the shorter span on ties)."""
    pairs = list(zip(op_times_ms, num_ops, strict=True))
    if every_operator and sum(num_ops) <= _MAX_SPANS:
        spans = sorted({t * j for t, k in pairs for j in range(1, k + 1)})
    else:
        spans = sorted({t * k for t, k in pairs})
    if len(spans) * len(pairs) <= _FEW_CELLS:
        return _fill_span_by_span(pairs, devices, spans)
    # every candidate at once, one row per span (operator counts are exact in float64); the
    # busy time is summed tuple by tuple, in the order a scalar loop would
    times = np.array(op_times_ms)
    ops = np.minimum(np.array(num_ops, dtype=float),
                     np.maximum(1.0, np.floor(np.array(spans)[:, None] / times + _EPS)))
    real = (times * ops).max(axis=1)
    busy = np.zeros(len(spans))
    for i, (n, t) in enumerate(zip(devices, op_times_ms, strict=True)):
        busy = busy + n * t * ops[:, i]
    shares = (busy / (sum(devices) * real)).tolist()
    best = 0
    for i, share in enumerate(shares):
        if share > shares[best] + 1e-12:
            best = i
    return [int(k) for k in ops[best]]


_FEW_CELLS = 16
"""Up to this many (span, tuple) pairs, `align_fill` tries one span at a time: numpy's fixed
cost per call outweighs the loop there (most waves have a few tuples)."""


def _fill_span_by_span(pairs: list[tuple[float, int]], devices: list[int],
                       spans: list[float]) -> list[int]:
    """`align_fill`'s choice among `spans`, one at a time, with the float operations of its
    vectorized form in the same order (so the same shares and the same choice)."""
    total = sum(devices)
    best: list[int] = []
    best_share = 0.0
    for span in spans:
        ops = [min(k, max(1, math.floor(span / t + _EPS))) for t, k in pairs]
        real = max([t * k for (t, _), k in zip(pairs, ops, strict=True)])
        busy = sum(n * t * k for n, (t, _), k in zip(devices, pairs, ops, strict=True))
        share = busy / (total * real)
        if not best or share > best_share + 1e-12:
            best, best_share = ops, share
    return best


MaxOps = Callable[[str, int], int]
"""The most operators of a MetaOp one slice on n devices may run (memory; see memory.py)."""


def merge_or_append(waves: list[PlannedWave], new: PlannedWave,
                    max_ops: MaxOps | None = None) -> None:
    """Append `new`, or fold it into the previous wave of the same level when each of its
    slots repeats a (MetaOp, n) of that wave (the previous slots just run more operators),
    unless a merged slot would exceed `max_ops`."""
    if waves and waves[-1].level == new.level:
        prev = waves[-1]
        keys = {(s.metaop, s.n): i for i, s in enumerate(prev.slots)}
        fits = max_ops is None or all(
            prev.slots[keys[(s.metaop, s.n)]].num_ops + s.num_ops <= max_ops(s.metaop, s.n)
            for s in new.slots if (s.metaop, s.n) in keys
        )
        if fits and all((s.metaop, s.n) in keys for s in new.slots):
            extra = {(s.metaop, s.n): s.num_ops for s in new.slots}
            merged = tuple(
                Slot(metaop=s.metaop, n=s.n, op_time_ms=s.op_time_ms,
                     num_ops=s.num_ops + extra.get((s.metaop, s.n), 0))
                for s in prev.slots
            )
            waves[-1] = PlannedWave(level=prev.level, slots=merged)
            return
    waves.append(new)


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
_MAX_SPANS = 4096
"""Above this many operators in a wave, `fill_steps` tries only the tuples' ends."""


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
            any_rounding = any_rounding and (max(offered) <= 1 or sum(offered) > _MAX_SPANS)
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


_SHORTEN_TARGETS = 2
"""How many shorter spans `shorten_waves` tries per wave (its operator boundaries nearest the
current span)."""


@dataclass(slots=True, eq=False)
class _Cell:
    """A slot while `shorten_waves` moves operators: only its operator count changes (see
    `set_ops`)."""

    wave: int
    op_time_ms: float
    cap: float
    """The most operators the slot may run (`max_ops`)."""
    num_ops: int
    others: tuple[_Cell, ...] = ()
    """The slots of the same MetaOp in the other waves, in wave order."""
    seen_span: float = math.nan
    """The wave span that `slack` and `grow` were worked out for (NaN: none yet): moves
    try the same spans again and again."""
    slack: int = 0
    """Whole operators that fit between the slot's end and `seen_span`."""
    grow: float = 0.0
    """What one operator more would add to `seen_span` (`_growth`)."""

    def set_ops(self, num_ops: int) -> None:
        """Change the operator count (forgets `slack` and `grow`)."""
        self.num_ops = num_ops
        self.seen_span = math.nan

    def see(self, span: float) -> None:
        """Work out `slack` and `grow` for a wave span."""
        t, count = self.op_time_ms, self.num_ops
        self.seen_span = span
        self.slack = math.floor((span - count * t) / t + _EPS)
        self.grow = _growth(span, count + 1, t, self.cap)


def _growth(span: float, count: int, op_time_ms: float, cap: float) -> float:
    """What a slot of `count` operators adds to a wave of span `span`; inf past `cap`."""
    if count > cap:
        return math.inf
    return max(span, count * op_time_ms) - span


_Cut = tuple[list[int], float]
"""A way to shorten a wave: the operators each of its slots keeps, and the wave's new span."""


def shorten_waves(waves: list[PlannedWave], max_ops: MaxOps | None = None) -> list[PlannedWave]:
    """Beyond the paper: a descent over one level's waves that keeps every slot's (MetaOp, n)
    and moves whole operators between waves. Algorithm 1 aligns one wave at a time, so the
    operators it cuts to align a wave may lengthen a later one, and ties between slots keep a
    wave long when only one of them could shrink.

    A move shortens wave w to one of its operator boundaries below its span (every slot
    longer than the new span gives up operators) and places each operator given up, one at a
    time, in the other wave holding a slot of that MetaOp whose span grows least (within
    `max_ops`); it is kept when the level gets strictly shorter. Slots left without operators
    and empty waves are dropped. Slices stay in operator order since a MetaOp has at most one
    slot per wave and operators are assigned to slices in wave order."""
    cells = [[_Cell(i, s.op_time_ms, math.inf if max_ops is None else max_ops(s.metaop, s.n),
                    s.num_ops) for s in w.slots] for i, w in enumerate(waves)]
    # a move changes operator counts only, never which waves hold a MetaOp (a slot emptied
    # by a move keeps its cell) nor its limit: both are set once
    holders: dict[str, list[_Cell]] = {}
    for w, wave_cells in zip(waves, cells, strict=True):
        for s, c in zip(w.slots, wave_cells, strict=True):
            holders.setdefault(s.metaop, []).append(c)
    for same in holders.values():
        for x, c in enumerate(same):
            c.others = (*same[:x], *same[x + 1:])
    spans = [_span(wave_cells) for wave_cells in cells]
    cuts: list[list[_Cut] | None] = [None] * len(waves)
    start = 0
    while len(waves) > 1 and start >= 0:
        start = _shorten_one(cells, spans, cuts, start)
    out = []
    for w, wave_cells in zip(waves, cells, strict=True):
        slots = tuple(s if s.num_ops == c.num_ops else
                      Slot(metaop=s.metaop, n=s.n, num_ops=c.num_ops, op_time_ms=s.op_time_ms)
                      for s, c in zip(w.slots, wave_cells, strict=True) if c.num_ops > 0)
        if slots:
            out.append(PlannedWave(level=w.level, slots=slots))
    return out


def _span(wave_cells: list[_Cell]) -> float:
    """A wave's span: its longest slot."""
    return max([c.num_ops * c.op_time_ms for c in wave_cells], default=0.0)


def _cuts(wave_cells: list[_Cell], span: float) -> list[_Cut]:
    """The cuts `shorten_waves` tries on a wave of span `span`: to each of its
    `_SHORTEN_TARGETS` operator boundaries nearest below the span, the longest first."""
    # a slot whose MetaOp has no other wave keeps all its operators: no shorter span
    floor_ms = max([c.num_ops * c.op_time_ms for c in wave_cells if not c.others], default=0.0)
    low, below = floor_ms - _EPS, span - _EPS
    boundaries: set[float] = set()
    for c in wave_cells:
        t = c.op_time_ms
        j = top = min(c.num_ops, math.ceil(below / t)) - 1  # last boundary below the span
        # down from there: once one is below the floor, so are those before it
        while j >= 0 and j > top - _SHORTEN_TARGETS and j * t >= low:
            boundaries.add(j * t)
            j -= 1
    cuts = []
    for target in sorted(boundaries, reverse=True)[:_SHORTEN_TARGETS]:
        kept = [min(c.num_ops, math.floor(target / c.op_time_ms + _EPS)) for c in wave_cells]
        cuts.append((kept, max([k * c.op_time_ms for c, k in zip(wave_cells, kept, strict=True)],
                               default=0.0)))
    return cuts


def _shorten_one(cells: list[list[_Cell]], spans: list[float], cuts: list[list[_Cut] | None],
                 start: int) -> int:
    """The first improving move of `shorten_waves` that shortens a wave from `start` on
    (cyclically), applied (`spans` updated); returns that wave's index, or -1 when there is
    no such move. `cells`: each wave's slots; `spans`: each wave's span; `cuts`: each wave's
    `_cuts`, None until needed and again once a move changes the wave."""
    total = sum(spans)
    limit = total * (1 - _EPS)
    for i in (*range(start, len(cells)), *range(start)):
        here = cells[i]
        if cuts[i] is None:
            cuts[i] = _cuts(here, spans[i])
        for kept, span_here in cuts[i]:
            new_spans = list(spans)
            new_spans[i] = span_here
            added: dict[_Cell, int] = {}  # operators placed on each slot of another wave
            placed = True
            checked = False
            for c, k in zip(here, kept, strict=True):
                moving = c.num_ops - k
                if moving == 0 and checked:
                    continue  # nothing moves: the check below would repeat the last one
                checked = True
                if moving:
                    placed = _place(c.others, moving, new_spans, added)
                if not placed or sum(new_spans) >= limit:
                    break
            if placed and sum(new_spans) < limit:
                for c, k in zip(here, kept, strict=True):
                    c.set_ops(k)
                changed = {i}
                for o, k in added.items():
                    o.set_ops(o.num_ops + k)
                    changed.add(o.wave)
                for j in changed:
                    spans[j] = _span(cells[j])
                    cuts[j] = None
                return i
    return -1


def _place(others: tuple[_Cell, ...], moving: int, new_spans: list[float],
           added: dict[_Cell, int]) -> bool:
    """Place `moving` operators of one MetaOp on its slots in other waves (`others`), the
    spans of the waves in `new_spans` and the operators placed in `added`, both updated;
    returns whether all of them fit (within each slot's limit)."""
    # first the slack of the other waves, which costs nothing (the same choice, in the same
    # order, as placing those operators one at a time); on the way, what one more operator
    # would then add to each wave's span
    grows = []
    for o in others:
        j = o.wave
        span = new_spans[j]
        if span != o.seen_span:
            o.see(span)
        if o.slack > 0:
            fits = int(min(moving, o.slack, o.cap - o.num_ops))
            if fits > 0:
                added[o] = fits
                count = o.num_ops + fits
                new_spans[j] = span = max(span, count * o.op_time_ms)
                moving -= fits
                if moving == 0:
                    return True
                grows.append(_growth(span, count + 1, o.op_time_ms, o.cap))
                continue
        grows.append(o.grow)
    # then one at a time where the span grows least (the first on ties); only the chosen
    # wave's growth changes. inf marks a full slot: growths are finite since spans are (an
    # infinite span has no boundary below it, `_cuts` fails on it)
    for _ in range(moving):
        best_grow = min(grows, default=math.inf)
        if best_grow == math.inf:
            return False
        x = grows.index(best_grow)
        o = others[x]
        added[o] = count = added.get(o, 0) + 1
        count += o.num_ops
        j = o.wave
        new_spans[j] = span = max(new_spans[j], count * o.op_time_ms)
        grows[x] = _growth(span, count + 1, o.op_time_ms, o.cap)
    return True


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


MAX_REFINE_RUNS = 100
"""Runs of Algorithm 1 `refine_level` may spend on one level (planning time)."""

REFINE_VARIANTS = 3
"""How many of the best variants on the allocator's rounding each trial re-runs."""

def best_schedule(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                  predecessors: dict[str, tuple[str, ...]], finished: set[str],
                  variants: tuple[Variant, ...],
                  max_ops: MaxOps | None = None) -> tuple[list[PlannedWave], tuple[Variant, ...]]:
    """The shortest of `schedule_level` under each variant (the first on ties), and the
    variants from the best to the worst; `finished` is not changed."""
    results = []
    for rule, rounding, extension in variants:
        trial = schedule_level(alloc, curves, num_devices, predecessors, set(finished),
                               sort_rule=rule, rounding=rounding, extension=extension,
                               max_ops=max_ops)
        results.append((sum(w.duration_ms for w in trial), trial))
    ranking = sorted(range(len(variants)), key=lambda i: (round(results[i][0], 9), i))
    return results[ranking[0]][1], tuple(variants[i] for i in ranking)


def refine_level(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                 predecessors: dict[str, tuple[str, ...]], finished: set[str],
                 variants: tuple[Variant, ...], *, max_ops: MaxOps | None = None,
                 max_runs: int = MAX_REFINE_RUNS, trial_variants: int = REFINE_VARIANTS,
                 ) -> tuple[LevelAllocation, list[PlannedWave]]:
    """Beyond the paper: search the integer rounding of the MetaOps' bi-point tuples. The
    allocator rounds l-bar and l to the nearest integers one MetaOp at a time, but which
    rounding packs best into waves depends on all of them: one operator more or less on a
    count moves the level's area by one operator, while a better fit can save most of a
    wave's misalignment.

    First-improvement descent: MetaOps in order of decreasing work, each neighbour of its
    tuples (`_neighbours`) scheduled with the `trial_variants` variants that did best on the
    allocator's rounding (`best_schedule`); a neighbour is kept when the level gets strictly
    shorter. Stops after a pass without improvement or when the
    next trial would pass `max_runs` runs of Algorithm 1. Returns the kept allocation and its
    waves (the plain schedule when nothing improves); `finished` is updated as
    `schedule_level` does."""
    best_waves, ranking = best_schedule(alloc, curves, num_devices, predecessors, finished,
                                        variants, max_ops)
    best_ms = sum(w.duration_ms for w in best_waves)
    runs = len(variants)
    # trials rerun only the variants that did best on the allocator's rounding: on the clip
    # models the best variant rarely changes with one operator, and each run costs ms
    variants = ranking[:trial_variants]
    order = sorted(range(len(alloc.ops)), key=lambda i: (-curves[alloc.ops[i].metaop].work_ms, i))
    improved = True
    while improved:
        improved = False
        for i in order:
            for tuples in _neighbours(alloc.ops[i].tuples, curves[alloc.ops[i].metaop]):
                if runs + len(variants) > max_runs:
                    finished |= {x.metaop for x in alloc.ops}
                    return alloc, best_waves
                runs += len(variants)
                ops = list(alloc.ops)
                ops[i] = replace(ops[i], tuples=tuples)
                trial_alloc = replace(alloc, ops=tuple(ops))
                trial, _ = best_schedule(trial_alloc, curves, num_devices, predecessors,
                                         finished, variants, max_ops)
                trial_ms = sum(w.duration_ms for w in trial)
                if trial_ms < best_ms * (1 - _EPS):
                    alloc, best_waves, best_ms, improved = trial_alloc, trial, trial_ms, True
                    break
    finished |= {x.metaop for x in alloc.ops}
    return alloc, best_waves


def _neighbours(tuples: tuple[AslTuple, ...], oc: OpCurve) -> list[tuple[AslTuple, ...]]:
    """Roundings one operator away: between the two tuples (both ways), or, for a MetaOp with
    one tuple, one operator split off onto the valid count below or above."""
    counts = oc.counts[1:]

    def make(pairs: list[tuple[int, int]]) -> tuple[AslTuple, ...]:
        return tuple(AslTuple(metaop=oc.metaop.id, n=n, num_ops=k) for n, k in pairs if k > 0)

    if len(tuples) == 2:
        (n1, k1), (n2, k2) = ((t.n, t.num_ops) for t in tuples)
        return [make([(n1, k1 + d), (n2, k2 - d)]) for d in (-1, 1)
                if k1 + d >= 0 and k2 - d >= 0]
    (t,) = tuples
    if t.num_ops < 2:
        return []
    i = counts.index(t.n)
    return [make([(t.n, t.num_ops - 1), (counts[j], 1)])
            for j in (i + 1, i - 1) if 0 <= j < len(counts)]
