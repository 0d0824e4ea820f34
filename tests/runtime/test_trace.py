"""The trace's comparison of each slice's measured compute with its planned time (torch-free)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from spindle_cli.artifacts import Plan, load
from spindle_cli.runtime.trace import (
    COMPUTE_DRIFT,
    compute_per_step_ms,
    drift_lines,
    memory_line,
    memory_rows,
    parts_line,
    slice_compute,
)

PLAN = (Path(__file__).resolve().parents[1] / "data" / "plan-tiny-clip-local-cpu"
        / "expected_plan.yaml")


def _span(wave: int, step: int, phase: str, dur_ms: float) -> dict:
    return {"name": "compute", "cat": "compute", "ph": "X", "ts": 0.0, "dur": dur_ms * 1e3,
            "args": {"step": step, "wave": wave, "phase": phase}}


def _events(plan: Plan, ms_of) -> list[list[dict]]:
    """Every rank's compute spans for steps 3, 4, 5 (as after a resume): `ms_of(slice, rank,
    step)` is the slice's forward+backward on that rank, split 1:2; step 3 (warm-up) takes
    100 ms everywhere. Plus a span that is not compute and one without a wave."""
    events: list[list[dict]] = [[] for _ in range(plan.num_devices)]
    for w in plan.waves:
        for s in w.slices:
            for r in s.ranks:
                for step in (3, 4, 5):
                    total = 100.0 if step == 3 else ms_of(s, r, step)
                    events[r] += [_span(w.index, step, "forward", total / 3),
                                  _span(w.index, step, "backward", 2 * total / 3)]
    events[0].append({"name": "sync", "cat": "sync", "ph": "X", "ts": 0.0, "dur": 5e6,
                      "args": {"step": 4}})
    events[0].append({"name": "optimizer", "cat": "compute", "ph": "X", "ts": 0.0, "dur": 5e6,
                      "args": {"step": 4}})
    return events


def test_slowest_rank_per_step_and_median_over_steps() -> None:
    plan = load(str(PLAN), Plan)
    # the first rank of a slice is 1 ms slower; step 5 is 0.5 ms slower than step 4
    rows = slice_compute(plan, _events(
        plan, lambda s, r, step: s.time_ms + (1.0 if r == s.ranks[0] else 0.0)
        + (0.5 if step == 5 else 0.0)))
    slices = [(w.index, s) for w in plan.waves for s in w.slices]
    assert [(r["wave"], r["slice"]) for r in rows] == [(w, s.id) for w, s in slices]
    for row, (_, s) in zip(rows, slices, strict=True):
        assert row["metaop"] == s.metaop and row["ranks"] == list(s.ranks)
        assert (row["first"], row["last"]) == (s.first, s.last)
        assert row["planned_ms"] == s.time_ms
        # median of steps 4 and 5 on the slowest rank; warm-up step 3 left out
        assert row["measured_ms"] == pytest.approx(s.time_ms + 1.25)


def test_drift_names_the_slices_furthest_off() -> None:
    plan = load(str(PLAN), Plan)
    slices = sorted((s for w in plan.waves for s in w.slices), key=lambda s: -s.time_ms)
    heavy, second = slices[0], slices[1]
    factor = {heavy.id: 2.0, second.id: 1 + COMPUTE_DRIFT / 2}
    events = _events(plan, lambda s, r, step: s.time_ms * factor.get(s.id, 1))
    rows = slice_compute(plan, events)
    lines = drift_lines(rows, compute_per_step_ms(plan, events), plan.estimated_iteration_ms)
    planned = sum(s.time_ms for s in slices)
    measured = planned + heavy.time_ms + second.time_ms * COMPUTE_DRIFT / 2
    assert lines[0] == (f"slices' compute: measured {measured:.2f} ms, planned {planned:.2f} ms "
                        f"({measured / planned:.2f}x over {len(slices)} slices; per slice "
                        "1.00-2.00x)")
    # only the slice off by more than COMPUTE_DRIFT is named
    assert lines[1] == (f"  {heavy.id} {heavy.metaop} [{heavy.first}, {heavy.last}) on "
                        f"{len(heavy.ranks)} rank(s): {2 * heavy.time_ms:.2f} ms, planned "
                        f"{heavy.time_ms:.2f} (+100%)")
    assert lines[2].startswith("  1 slice(s) off by more than 25%: ")
    assert len(lines) == 3
    # a difference below DRIFT_FLOOR of the iteration is not named
    assert drift_lines(rows, measured, 1e6)[1:] == []
    # ranks that took turns on fewer cores are not sent to measure again
    shared = drift_lines(rows, measured, plan.estimated_iteration_ms, shared_cores=True)
    assert shared[:2] == lines[:2]
    assert shared[2].startswith("  1 slice(s) off by more than 25%: these ranks took turns on "
                                "fewer cores than ranks") and "profile --hardware" not in shared[2]
    # compute as planned: nothing to name
    exact_events = _events(plan, lambda s, r, step: s.time_ms)
    exact = slice_compute(plan, exact_events)
    assert len(drift_lines(exact, compute_per_step_ms(plan, exact_events),
                           plan.estimated_iteration_ms)) == 1


def test_compute_per_step_is_the_median_of_the_steps_totals() -> None:
    # steps 4-6 after warm-up step 3; each slice is 5 ms slower in one step, a different one
    # for each slice: every slice's median is its planned time, but each step's total is above
    plan = load(str(PLAN), Plan)
    slices = [s for w in plan.waves for s in w.slices]
    slow = {s.id: 4 + i % 3 for i, s in enumerate(slices)}
    events: list[list[dict]] = [[] for _ in range(plan.num_devices)]
    for w in plan.waves:
        for s in w.slices:
            for r in s.ranks:
                for step in (3, 4, 5, 6):
                    ms = 100.0 if step == 3 else s.time_ms + (5.0 if step == slow[s.id] else 0)
                    events[r].append(_span(w.index, step, "forward", ms))
    planned = sum(s.time_ms for s in slices)
    assert sum(r["measured_ms"] for r in slice_compute(plan, events)) == pytest.approx(planned)
    totals = sorted(planned + 5.0 * sum(1 for s in slices if slow[s.id] == k) for k in (4, 5, 6))
    assert compute_per_step_ms(plan, events) == pytest.approx(totals[1])


def test_breakdown_leaves_out_the_first_traced_step_after_a_resume() -> None:
    from spindle_cli.runtime.trace import breakdown_ms

    plan = load(str(PLAN), Plan)
    # steps 3, 4, 5 as after a resume; step 3 (warm-up) takes 100 ms per slice
    events = _events(plan, lambda s, r, step: 1.0)[0]
    per_step = sum(1.0 for w in plan.waves for s in w.slices if 0 in s.ranks)
    assert breakdown_ms(events, 3) == pytest.approx(
        {"compute": per_step, "optimizer": 5000.0 / 2, "sync": 5000.0 / 2})


def test_a_span_waits_for_the_device_before_each_clock_read() -> None:
    """On CUDA a span must time the kernels, not their launch: the tracer waits for the
    device (`synchronize`) right before it reads the clock at the span's start and end, so
    the work queued inside the span falls inside it."""
    import time

    from spindle_cli.runtime.timings import device_synchronizer
    from spindle_cli.runtime.trace import Tracer

    calls: list[str] = []

    def synchronize() -> None:
        calls.append("sync")
        time.sleep(0.002)  # a device still busy with the span's queued work

    tracer = Tracer(enabled=True, rank=0, synchronize=synchronize)
    with tracer.span("compute", "compute"):
        calls.append("work")
    assert calls == ["sync", "work", "sync"]
    # the device's wait at the end is inside the span
    assert tracer.events[0]["dur"] >= 2000
    # the CPU's work is done when a call returns: nothing to wait for there
    import torch

    assert device_synchronizer(torch.device("cpu")) is None
    assert device_synchronizer(torch.device("cuda", 0)) is not None


def test_a_gap_is_taken_out_of_the_span_it_interrupts():
    """A wait inside a compute span (the forward's wait for a ZeRO all-gather before a layer)
    is its own span, and the compute span is recorded in two parts around it: no time is in
    both, so the breakdown counts each once."""
    import time

    from spindle_cli.runtime.trace import Tracer, breakdown_ms

    tracer = Tracer(enabled=True, rank=0)
    with tracer.span("compute", "compute", step=0, wave=1, phase="forward"):
        time.sleep(0.002)
        with tracer.gap("all-gather", "sync", step=0, wave=1):
            time.sleep(0.003)
        time.sleep(0.002)
    names = [e["name"] for e in tracer.events]
    assert names == ["compute w1 fwd", "all-gather w1", "compute w1 fwd"]
    before, gap, after = tracer.events
    assert before["ts"] + before["dur"] == pytest.approx(gap["ts"], abs=1e-3)
    assert gap["ts"] + gap["dur"] == pytest.approx(after["ts"], abs=1e-3)
    assert gap["dur"] >= 3000 and before["dur"] >= 2000 and after["dur"] >= 2000
    parts = breakdown_ms(tracer.events, 1)
    assert parts["sync"] == gap["dur"] / 1e3
    assert parts["compute"] == pytest.approx((before["dur"] + after["dur"]) / 1e3)
    # a gap inside a gap cuts that one in turn: the time is still counted once
    nested = Tracer(enabled=True, rank=0)
    with nested.span("compute", "compute", step=0):
        with nested.gap("wait", "sync", step=0):
            time.sleep(0.002)
            with nested.gap("inner", "comm", step=0):
                time.sleep(0.002)
    events = nested.events
    assert sorted(e["name"] for e in events) == ["compute", "compute", "inner", "wait", "wait"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start == pytest.approx(end, abs=1e-3)
    # outside any span a gap is a span of its own
    alone = Tracer(enabled=True, rank=0)
    with alone.gap("all-gather", "sync", step=0):
        pass
    assert [e["name"] for e in alone.events] == ["all-gather"]


def test_parts_line_names_the_longest_rank_and_the_simulated_parts() -> None:
    measured = {"0": {"compute": 10.0, "comm": 1.0, "sync": 2.0, "optimizer": 0.5},
                "1": {"compute": 9.0, "comm": 0.5, "sync": 6.0}}
    simulated = {"compute": 11.0, "transfer": 0.25, "sync": 1.0, "optimizer": 0.5}
    assert parts_line(measured, simulated) == (
        "parts of a step on rank 1, the longest: compute 9.00, send/recv 0.50, sync 6.00, "
        "optimizer 0.00 ms; simulated compute 11.00, transfer 0.25, sync 1.00, optimizer "
        "0.50 ms")
    # the plan's own estimate has no parts
    assert parts_line(measured, None).endswith("optimizer 0.00 ms")


def _held(activations: int, state: tuple[int, int, int] = (100, 100, 200)) -> dict[str, int]:
    return dict(zip(("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes"),
                    (*state, activations), strict=True))


def test_memory_rows_set_each_rank_beside_its_plan_estimate() -> None:
    plan = load(str(PLAN), Plan)
    held = [_held(1000 + r) for r in range(plan.num_devices)]
    rows = memory_rows(plan, held)
    assert [r["rank"] for r in rows] == list(range(plan.num_devices))
    for row, m in zip(rows, sorted(plan.memory, key=lambda m: m.rank), strict=True):
        assert row["planned"] == {"param_bytes": m.param_bytes, "grad_bytes": m.grad_bytes,
                                  "optimizer_bytes": m.optimizer_bytes,
                                  "activation_bytes": m.activation_bytes}
        assert row["measured"] == held[row["rank"]]


def test_memory_line_names_the_most_planned_rank_and_every_ranks_activation_ratio() -> None:
    rows = [{"rank": 0, "planned": _held(1000), "measured": _held(700)},
            {"rank": 1, "planned": _held(2 * 2**20, (2**20, 2**20, 2**21)),
             "measured": _held(2**20, (2**20, 2**20, 2**21 + 16))},
            {"rank": 2, "planned": _held(0, (0, 0, 0)), "measured": _held(0, (0, 0, 0))}]
    assert memory_line(rows) == (
        "memory at a step's turn on rank 1, the most planned: activations held for backward "
        "1.0 MiB, planned 2.0 MiB (0.50x; all ranks 0.50-0.70x); weights, gradients and "
        "optimizer state 4.0 MiB, planned 4.0 MiB (1.00x)")
    # on CUDA, the allocator's peak over the run against the plan's total
    rows[1]["measured"]["peak_allocated_bytes"] = 7 * 2**20
    assert memory_line(rows).endswith(
        "(1.00x); CUDA peak allocated 7.0 MiB, planned 6.0 MiB in all")
    # one rank: no spread over ranks; nothing planned: no ratio
    assert memory_line(rows[2:]) == (
        "memory at a step's turn on rank 2, the most planned: activations held for backward "
        "0 B, planned 0 B; weights, gradients and optimizer state 0 B, planned 0 B")
    assert memory_line(rows[:1]).startswith(
        "memory at a step's turn on rank 0, the most planned: activations held for backward "
        "700 B, planned 1000 B (0.70x); ")
