"""How far Spindle's wave scheduler is from the best wave schedule a constraint solver finds for
the same level: issue 4's makespan / sum of C* target (<= 1.03) on multitask-clip 4/7/10 tasks
on 16 and 32 devices. All of that gap is in the encoder level (level 1); the other levels are
within 0.1 ms of their C*. Prints figures; asserts nothing.

Greedy: the level as `bench_planner.refined_waves` schedules it (Algorithm 1 with every
variant, `shorten_waves`, the rounding search `refine_level`, both bi-point forms).
Search: CP-SAT (OR-Tools) over every schedule of at most W waves (W = the greedy's waves + 1,
in any order, as a level's MetaOps depend only on earlier levels): per wave and MetaOp at most
one slot, on a valid device count with whole operators and within the memory cap
(`schedules.slice_limits`), the wave's counts summing to at most N, the wave as long as its longest
slot; minimize the sum of the waves. Hinted with the greedy schedule; the best found within
--seconds on --workers threads. It is no proof of optimality: CP-SAT's lower bound stays far
below C* on these models.

Run: pip install ortools; python benchmarks/bench_wave_search.py [--seconds 30] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_planner import clip, cluster_for, refined_waves

from spindle_cli.planner.alignment import MaxOps, PlannedWave
from spindle_cli.planner.allocation import LevelAllocation, OpCurve
from spindle_cli.planner.schedules import allocate, op_curves, slice_limits

UNITS_PER_MS = 10_000
"""CP-SAT works on integers: times in units of 0.1 us."""


def searched_ms(alloc: LevelAllocation, curves: dict[str, OpCurve], num_devices: int,
                max_ops: MaxOps, greedy: list[PlannedWave], seconds: float,
                workers: int) -> tuple[float, str]:
    """(the sum of wave spans of the best schedule found, CP-SAT's status) for one level."""
    from ortools.sat.python import cp_model

    ops = [x.metaop for x in alloc.ops]
    waves = sorted(greedy, key=lambda w: -w.duration_ms)
    num_waves = len(waves) + 1
    model = cp_model.CpModel()
    span = [model.new_int_var(0, 10**12, f"span{w}") for w in range(num_waves)]
    slots: dict[tuple[int, str, int], tuple[cp_model.IntVar, cp_model.IntVar]] = {}
    for w in range(num_waves):
        used = []
        for m in ops:
            oc = curves[m]
            chosen = []
            for n in oc.counts[1:]:
                cap = min(oc.metaop.num_layers, max_ops(m, n))
                on, k = model.new_bool_var(""), model.new_int_var(0, cap, "")
                model.add(k <= cap * on)
                model.add(k >= on)
                model.add(span[w] >= round(oc.time_at(n) * UNITS_PER_MS) * k)
                slots[(w, m, n)] = (on, k)
                chosen.append(on)
                used.append(n * on)
            model.add(sum(chosen) <= 1)
        model.add(sum(used) <= num_devices)
        if w + 1 < num_waves:
            model.add(span[w] >= span[w + 1])  # waves of a level are interchangeable
    for m in ops:
        model.add(sum(k for (_, mm, _), (_, k) in slots.items() if mm == m)
                  == curves[m].metaop.num_layers)
    model.minimize(sum(span))
    hint = {(w, s.metaop, s.n): s.num_ops for w, wave in enumerate(waves) for s in wave.slots}
    for key, (on, k) in slots.items():
        model.add_hint(on, key in hint)
        model.add_hint(k, hint.get(key, 0))
    for w, wave in enumerate(waves):
        model.add_hint(span[w], max(round(s.op_time_ms * UNITS_PER_MS) * s.num_ops
                                    for s in wave.slots))
    model.add_hint(span[-1], 0)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    return solver.objective_value / UNITS_PER_MS, solver.status_name(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="search time per case")
    parser.add_argument("--workers", type=int, default=2, help="CP-SAT threads")
    args = parser.parse_args()
    try:
        import ortools  # noqa: F401
    except ImportError:
        sys.exit("bench_wave_search needs OR-Tools: pip install ortools")
    print(f"== encoder level: greedy vs CP-SAT ({args.seconds:g} s, {args.workers} threads) ==")
    print(f"{'case':<16}{'greedy/C*':>10}{'search/C*':>11}{'plan/C*':>9}{'searched':>10}  status")
    for task_set in ("4", "7", "10"):
        graph, profile = clip(task_set)
        for n in (16, 32):
            cluster = cluster_for(n)
            curves = op_curves(graph, profile, n)
            level = next(a for a in allocate(graph, curves, n) if a.level == 1)
            waves, c_star_ms, _ = refined_waves(graph, profile, cluster)
            greedy = [w for w in waves if w.level == 1]
            greedy_ms = sum(w.duration_ms for w in greedy)
            t0 = time.perf_counter()
            found_ms, status = searched_ms(level, curves, n, slice_limits(graph, curves, cluster),
                                           greedy, args.seconds, args.workers)
            seconds = time.perf_counter() - t0
            plan_ms = sum(w.duration_ms for w in waves) - greedy_ms + found_ms
            print(f"clip-{task_set:>2} @ {n:<6}{greedy_ms / level.c_star_ms:>10.4f}"
                  f"{found_ms / level.c_star_ms:>11.4f}{plan_ms / c_star_ms:>9.4f}"
                  f"{seconds:>9.1f}s  {status}", flush=True)


if __name__ == "__main__":
    main()
