"""Searching the integer rounding of the allocator's tuples for one that packs into shorter
waves (beyond the paper): `refine_level` tries roundings one operator away, each scheduled
with the variants of Algorithm 1 that did best (`best_schedule`). Not called by `api` yet
(planning time); the benchmarks compare it.

What does not live here: Algorithm 1 itself (`waves.py`) and the allocator's own rounding
(`allocation.py`).
"""

from __future__ import annotations

from dataclasses import replace

from spindle_cli.planner.alignment import EPS, MaxOps, PlannedWave, compute_ms
from spindle_cli.planner.allocation import AslTuple, LevelAllocation, OpCurve
from spindle_cli.planner.waves import Variant, schedule_level

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
        results.append((compute_ms(trial), trial))
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
    best_ms = compute_ms(best_waves)
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
                trial_ms = compute_ms(trial)
                if trial_ms < best_ms * (1 - EPS):
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
