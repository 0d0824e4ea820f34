"""Shortening a level's waves after Algorithm 1 (beyond the paper): `shorten_waves` moves whole
operators between the waves that hold slots of the same MetaOp while that shortens the level.
`waves.schedule_level` runs it on every level it schedules.

What does not live here: building the waves (`waves.py`) and the wave types (`alignment.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spindle_cli.planner.alignment import EPS, MaxOps, PlannedWave, Slot

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
        self.slack = math.floor((span - count * t) / t + EPS)
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
    low, below = floor_ms - EPS, span - EPS
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
        kept = [min(c.num_ops, math.floor(target / c.op_time_ms + EPS)) for c in wave_cells]
        cuts.append((kept, max([k * c.op_time_ms for c, k in zip(wave_cells, kept, strict=True)],
                               default=0.0)))
    return cuts


def _shorten_one(cells: list[list[_Cell]], spans: list[float], cuts: list[list[_Cut] | None],
                 start: int) -> int:
    """The first improving move of `shorten_waves` that shortens a wave from `start` on
    (cyclically), applied (`spans` updated); returns that wave's index, or -1 when there is
    no such move. `cells`: each wave's slots; `spans`: each wave's span; `cuts`: each wave's
    `_cuts`, None until needed and again once a move changes the wave."""
    total = math.fsum(spans)
    limit = total * (1 - EPS)
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
                if not placed or math.fsum(new_spans) >= limit:
                    break
            if placed and math.fsum(new_spans) < limit:
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
