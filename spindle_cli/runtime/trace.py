"""Chrome trace events (open in Perfetto or chrome://tracing) of a run: per rank, per wave, the
compute, send/recv and sync spans, plus measured vs predicted iteration time, every slice's
measured compute against its planned time (`slice_compute`, `drift_lines`) and what every rank
held at a step's turn against its plan's memory estimate (`memory_rows`, `memory_line`).

Each rank records its own spans with a monotonic clock; the file has one process per rank
("pid" = rank), on one time axis: each rank's clock starts with its tracer (before its model
is built or a checkpoint loaded), and the ranks are aligned by the wall-clock time of those
starts (`trace_document`). Spans carry the step as the loss lines number it (from 1), the
wave and the phase.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from spindle_cli.artifacts.files import write_text_atomic
from spindle_cli.artifacts.plan import MEMORY_CATEGORIES, STATE_CATEGORIES, Plan, Slice
from spindle_cli.units import fmt_bytes

COMPUTE_DRIFT = 0.25
"""A slice whose measured compute is off its planned time by more than this share is named
after a traced run (`drift_lines`) ..."""
DRIFT_FLOOR = 0.01
"""... when the difference is also at least this share of the predicted iteration (a slice of
microseconds is mostly the executor's fixed cost per slice)."""
DRIFT_NAMED = 3
"""Slices named at most."""


class Tracer:
    """Collects complete ("X") events of one rank; a no-op when disabled. `synchronize` waits
    for the rank's device before each clock read (CUDA runs kernels asynchronously: without
    it a compute span times only the kernels' launch, and the next blocking call the rest)."""

    def __init__(self, *, enabled: bool, rank: int,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.rank = rank
        self._synchronize = synchronize
        self.events: list[dict[str, Any]] = []
        self._origin_ns = time.perf_counter_ns()
        # wall-clock time of the origin of `ts`: `trace_document` aligns the ranks' timelines
        # on it (exactly on one host; across hosts as well as their clocks agree)
        self.origin_wall_ns = time.time_ns()
        # the spans open now, innermost last: name, category, args, start of the part to come
        self._open: list[tuple[str, str, dict[str, Any], list[int]]] = []

    def _now_ns(self) -> int:
        if self._synchronize is not None:
            self._synchronize()
        return time.perf_counter_ns()

    @contextmanager
    def span(self, name: str, category: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as one span (as several where `gap`s cut it)."""
        if not self.enabled:
            yield
            return
        opened = (name, category, args, [self._now_ns()])
        self._open.append(opened)
        try:
            yield
        finally:
            self._open.pop()
            self._record(name, category, args, opened[3][0], self._now_ns())

    @contextmanager
    def gap(self, name: str, category: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as a span taken out of the innermost open one (a gap
        too), which is recorded up to here and goes on after it (a wait inside a compute
        span), so that no time is counted in both."""
        if not self.enabled or not self._open:
            with self.span(name, category, **args):
                yield
            return
        outer_name, outer_category, outer_args, outer_start = self._open[-1]
        opened = (name, category, args, [self._now_ns()])
        self._record(outer_name, outer_category, outer_args, outer_start[0], opened[3][0])
        self._open.append(opened)
        try:
            yield
        finally:
            self._open.pop()
            end = self._now_ns()
            self._record(name, category, args, opened[3][0], end)
            outer_start[0] = end

    def _record(self, name: str, category: str, args: dict[str, Any], start: int,
                end: int) -> None:
        label = name if "wave" not in args else f"{name} w{args['wave']}"
        if "phase" in args:
            label += " fwd" if args["phase"] == "forward" else " bwd"
        self.events.append({
            "name": label, "cat": category, "ph": "X", "pid": self.rank, "tid": 0,
            "ts": (start - self._origin_ns) / 1e3, "dur": (end - start) / 1e3, "args": args,
        })


def breakdown_ms(events: list[dict[str, Any]], num_steps: int) -> dict[str, float]:
    """Milliseconds per step spent in each kind of span (compute, comm, sync, optimizer) by one
    rank, leaving out its first traced step (warm-up; a resumed run's first is not step 0)
    when there are more steps."""
    skip_first = num_steps > 1
    first = min((e["args"].get("step", 0) for e in events), default=0)
    totals: dict[str, float] = {}
    for e in events:
        if skip_first and e["args"].get("step", 0) == first:
            continue
        key = "optimizer" if e["name"] == "optimizer" else e["cat"]
        totals[key] = totals.get(key, 0.0) + e["dur"] / 1e3
    steps = num_steps - 1 if skip_first else max(num_steps, 1)
    return {k: v / steps for k, v in sorted(totals.items())}


def trace_document(rank_events: list[list[dict[str, Any]]], origins_wall_ns: list[int],
                   summary: dict[str, Any]) -> dict[str, Any]:
    """The Chrome trace JSON object: every rank's events on one time axis (each rank's `ts`
    shifted by its tracer's wall-clock origin, the earliest rank's at 0, so that a message or
    collective lines up across ranks in Perfetto), process names and the summary."""
    first = min(origins_wall_ns)
    events: list[dict[str, Any]] = []
    for rank, (evs, origin) in enumerate(zip(rank_events, origins_wall_ns, strict=True)):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        shift_us = (origin - first) / 1e3
        events.extend({**e, "ts": e["ts"] + shift_us} for e in evs)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def write_json(document: dict[str, Any], path: str) -> None:
    """Write JSON atomically (`files.write_text_atomic`)."""
    write_text_atomic(path, json.dumps(document, indent=1, sort_keys=True) + "\n")


def _slice_steps(plan: Plan, rank_events: list[list[dict[str, Any]]],
                 ) -> list[tuple[int, Slice, list[float]]]:
    """Per slice of `plan`, in wave order: (wave, slice, its measured forward+backward compute
    in each traced step but the first, warm-up, when there are more): the compute spans of
    its wave on each of its ranks (a rank runs one slice per wave), the slowest rank."""
    ms: dict[tuple[int, int, int], float] = {}
    steps: set[int] = set()
    for rank, events in enumerate(rank_events):
        for e in events:
            args = e["args"]
            if e["cat"] == "compute" and "wave" in args:
                key = (rank, args["wave"], args["step"])
                ms[key] = ms.get(key, 0.0) + e["dur"] / 1e3
                steps.add(args["step"])
    counted = sorted(steps)[1:] if len(steps) > 1 else sorted(steps)
    return [(w.index, s, [max(ms.get((r, w.index, k), 0.0) for r in s.ranks) for k in counted])
            for w in plan.waves for s in w.slices]


def slice_compute(plan: Plan, rank_events: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per slice of `plan`, in wave order: where it ran, its planned forward+backward time
    (`Slice.time_ms`) and the measured one (`_slice_steps`), the median over the steps."""
    return [{"wave": w, "slice": s.id, "metaop": s.metaop, "first": s.first, "last": s.last,
             "ranks": list(s.ranks), "planned_ms": s.time_ms,
             "measured_ms": statistics.median(per_step) if per_step else 0.0}
            for w, s, per_step in _slice_steps(plan, rank_events)]


def compute_per_step_ms(plan: Plan, rank_events: list[list[dict[str, Any]]]) -> float:
    """The slices' measured compute in one step, summed over the slices, the median over the
    steps (`_slice_steps`). Not the sum of the slices' medians: slow moments hit other slices
    in other steps, and that sum read 9.3 ms where the steps took 13-15 ms of compute."""
    rows = [per_step for _, s, per_step in _slice_steps(plan, rank_events) if s.time_ms > 0]
    totals = [sum(step) for step in zip(*rows, strict=True)]
    return statistics.median(totals) if totals else 0.0


def drift_lines(rows: list[dict[str, Any]], measured: float, predicted_ms: float, *,
                shared_cores: bool = False) -> list[str]:
    """What a traced run says about `slice_compute`'s rows and the compute of a step
    (`compute_per_step_ms`, `measured`): measured against planned compute over all slices,
    and the slices furthest off (by more than COMPUTE_DRIFT of their planned time and
    DRIFT_FLOOR of the predicted iteration), with what to do about them (not measuring again
    where the ranks took turns on fewer cores, `shared_cores`)."""
    timed = [r for r in rows if r["planned_ms"] > 0]
    if not timed:
        return []
    planned = sum(r["planned_ms"] for r in timed)
    ratios = [r["measured_ms"] / r["planned_ms"] for r in timed]
    lines = [f"slices' compute: measured {measured:.2f} ms, planned {planned:.2f} ms "
             f"({measured / planned:.2f}x over {len(timed)} slices; per slice "
             f"{min(ratios):.2f}-{max(ratios):.2f}x)"]
    gap = {r["slice"]: abs(r["measured_ms"] - r["planned_ms"]) for r in timed}
    off = sorted((r for r in timed if gap[r["slice"]] > COMPUTE_DRIFT * r["planned_ms"]
                  and gap[r["slice"]] >= DRIFT_FLOOR * predicted_ms),
                 key=lambda r: (-gap[r["slice"]], r["slice"]))
    for r in off[:DRIFT_NAMED]:
        lines.append(f"  {r['slice']} {r['metaop']} [{r['first']}, {r['last']}) on "
                     f"{len(r['ranks'])} rank(s): {r['measured_ms']:.2f} ms, planned "
                     f"{r['planned_ms']:.2f} ({r['measured_ms'] / r['planned_ms'] - 1:+.0%})")
    if off and shared_cores:
        lines.append(f"  {len(off)} slice(s) off by more than {COMPUTE_DRIFT:.0%}: these ranks "
                     "took turns on fewer cores than ranks, which the profile does not "
                     "describe; compare on a core per rank")
    elif off:
        lines.append(f"  {len(off)} slice(s) off by more than {COMPUTE_DRIFT:.0%}: the profile "
                     "does not describe these devices as they ran; measure them again "
                     "(spindle profile --hardware local --no-cache) and re-plan")
    return lines


def parts_line(measured: dict[str, dict[str, float]], predicted: dict[str, float] | None,
               ) -> str:
    """Where a step's time went on the rank whose spans add up to the most (`breakdown_ms`,
    per rank), beside the simulated parts of the rank that ends the iteration."""
    rank = max(measured, key=lambda r: (sum(measured[r].values()), -int(r)))
    got = measured[rank]
    text = (f"parts of a step on rank {rank}, the longest: compute {got.get('compute', 0.0):.2f}, "
            f"send/recv {got.get('comm', 0.0):.2f}, sync {got.get('sync', 0.0):.2f}, optimizer "
            f"{got.get('optimizer', 0.0):.2f} ms")
    if predicted is None:
        return text
    return (text + f"; simulated compute {predicted['compute']:.2f}, transfer "
            f"{predicted['transfer']:.2f}, sync {predicted['sync']:.2f}, optimizer "
            f"{predicted['optimizer']:.2f} ms")


def memory_rows(plan: Plan, held: list[dict[str, int]]) -> list[dict[str, Any]]:
    """Per rank: the plan's memory estimate by category beside what the rank held at a step's
    turn (`runtime.held`; `held`, in rank order)."""
    planned = {m.rank: m for m in plan.memory}
    rows = []
    for rank, measured in enumerate(held):
        m = planned.get(rank)
        rows.append({"rank": rank,
                     "planned": {k: 0 if m is None else getattr(m, k)
                                 for k in MEMORY_CATEGORIES},
                     "measured": dict(sorted(measured.items()))})
    return rows


def memory_line(rows: list[dict[str, Any]]) -> str:
    """What a traced run says about `memory_rows`: on the rank with the most planned memory,
    its activations held for backward and its weights, gradients and optimizer state, each
    measured against planned, with the activations' ratio over every rank (and on CUDA the
    allocator's peak over the run against the plan's total)."""
    row = max(rows, key=lambda r: (sum(r["planned"].values()), -r["rank"]))
    got, want = row["measured"], row["planned"]

    def vs(measured: int, planned: int, more: str = "") -> str:
        notes = [f"{measured / planned:.2f}x"] if planned else []
        notes += [more] if more else []
        return (f"{fmt_bytes(measured)}, planned {fmt_bytes(planned)}"
                + (f" ({'; '.join(notes)})" if notes else ""))

    ratios = [r["measured"]["activation_bytes"] / r["planned"]["activation_bytes"]
              for r in rows if r["planned"]["activation_bytes"]]
    spread = f"all ranks {min(ratios):.2f}-{max(ratios):.2f}x" if len(ratios) > 1 else ""
    state = sum(got[k] for k in STATE_CATEGORIES), sum(want[k] for k in STATE_CATEGORIES)
    text = (f"memory at a step's turn on rank {row['rank']}, the most planned: activations held "
            f"for backward {vs(got['activation_bytes'], want['activation_bytes'], spread)}; "
            f"weights, gradients and optimizer state {vs(*state)}")
    if "peak_allocated_bytes" in got:
        text += (f"; CUDA peak allocated {fmt_bytes(got['peak_allocated_bytes'])}, planned "
                 f"{fmt_bytes(sum(want.values()))} in all")
    return text
