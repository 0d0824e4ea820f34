"""A wave before placement (`PlannedWave`, its `Slot`s) and the alignment step of Algorithm 1
(§3.4): how many operators each tuple of a wave runs (`align`, the paper's rule: to the
shortest tuple; beyond the paper, `align_fill`: to the span that keeps the wave's devices
busiest), and folding a wave into the previous one when it repeats its slots
(`merge_or_append`). `MaxOps` caps a slice so that it fits in a share of device memory.

Shared by Algorithm 1 (`waves.py`), the moves between a level's waves (`shortening.py`), the
task-level chains (`tasks.py`) and the baselines (`baselines.py`). What does not live here:
choosing the tuples of a wave (`waves.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

EPS = 1e-9
"""The tolerance of the wave code's float comparisons (operator boundaries, spans, level
lengths)."""


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
    """The level it was scheduled at (consecutive waves of one level may merge). Moving
    operators between waves can empty its lowest-level slot; the plan's wave then takes its
    slices' lowest level (`assemble`)."""
    slots: tuple[Slot, ...]

    @property
    def duration_ms(self) -> float:
        """The longest slot."""
        return max(s.time_ms for s in self.slots)


class _Timed(Protocol):
    @property
    def duration_ms(self) -> float: ...


def compute_ms(waves: Iterable[_Timed]) -> float:
    """The waves' durations added up exactly (math.fsum): the same on every Python, where
    sum() rounds floats differently from 3.12 on (a test plan's schedule changed with it)."""
    return math.fsum(w.duration_ms for w in waves)


def align(op_times_ms: list[float], num_ops: list[int], *, rounding: str = "nearest") -> list[int]:
    """Operators each tuple runs when the wave is aligned to the shortest tuple: tuple i first
    takes k_i = max(round(t_min / tau_i), 1) operators ('nearest'; 'down' rounds down so the
    span stays t_min unless an operator is longer), the wave lasts max tau_i * k_i, then every
    tuple runs as many whole operators as fit in that span (the shortest runs all)."""
    t_min = min(t * k for t, k in zip(op_times_ms, num_ops, strict=True))
    half = 0.5 if rounding == "nearest" else EPS
    span = max(t * min(max(math.floor(t_min / t + half), 1), k)
               for t, k in zip(op_times_ms, num_ops, strict=True))
    return [min(k, max(1, math.floor(span / t + EPS))) for t, k in zip(op_times_ms, num_ops,
                                                                       strict=True)]


def align_fill(op_times_ms: list[float], num_ops: list[int], devices: list[int],
               *, every_operator: bool = False) -> list[int]:
    """Beyond the paper: the span that keeps the wave's devices busiest. Candidate spans are
    each tuple's full length (or, with `every_operator`, the end of each of its operators);
    the tuples longer than the span run the whole operators that fit (at least one), the
    shorter ones finish early; the candidate with the highest busy share of device-time wins
    (the shorter span on ties)."""
    pairs = list(zip(op_times_ms, num_ops, strict=True))
    if every_operator and sum(num_ops) <= MAX_SPANS:
        spans = sorted({t * j for t, k in pairs for j in range(1, k + 1)})
    else:
        spans = sorted({t * k for t, k in pairs})
    if len(spans) * len(pairs) <= _FEW_CELLS:
        return _fill_span_by_span(pairs, devices, spans)
    # every candidate at once, one row per span (operator counts are exact in float64); the
    # busy time is summed tuple by tuple, in the order a scalar loop would
    times = np.array(op_times_ms)
    ops = np.minimum(np.array(num_ops, dtype=float),
                     np.maximum(1.0, np.floor(np.array(spans)[:, None] / times + EPS)))
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

MAX_SPANS = 4096
"""Above this many operators in a wave, `align_fill` with `every_operator` (rounding
'fill_steps') tries only the tuples' ends."""


def _fill_span_by_span(pairs: list[tuple[float, int]], devices: list[int],
                       spans: list[float]) -> list[int]:
    """`align_fill`'s choice among `spans`, one at a time, with the float operations of its
    vectorized form in the same order (so the same shares and the same choice)."""
    total = sum(devices)
    best: list[int] = []
    best_share = 0.0
    for span in spans:
        ops = [min(k, max(1, math.floor(span / t + EPS))) for t, k in pairs]
        real = max([t * k for (t, _), k in zip(pairs, ops, strict=True)])
        busy = math.fsum(n * t * k for n, (t, _), k in zip(devices, pairs, ops, strict=True))
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
