"""Exact packing of one level's ASL-tuples (a MILP solved by HiGHS), to measure the greedy's
own loss: C* is a relaxed bound that integer counts often cannot reach, so the gap of a plan
to C* mixes the discretization loss with the wave scheduler's loss. The exact optimum of
packing the same rounded tuples separates the two.

Formulation: single-resource project scheduling with the resource-flow model (Artigues,
Michelon and Reusser, EJOR 2003). Nodes are a source, the tuples and a sink; y_uv = 1 when v
starts after u ends, and f_uv devices flow from u to v. Every tuple receives and passes on
exactly its n devices, the source supplies N and the sink absorbs N, so at any time at most N
devices are busy; two tuples of one MetaOp are ordered (its operators run in sequence). The
makespan is the sink's start. Tuples keep their n and whole operator counts; unlike waves,
they need no common boundaries, so the optimum is a bound for any wave schedule of them.

`realign_waves` is the other use of HiGHS here: for a fixed wave structure (which MetaOp runs
on how many devices in which wave), the best operator counts and wave durations.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from spindle_cli.planner.waves import MaxOps, PlannedWave, Slot

MAX_TUPLES = 16
"""Larger levels are not solved (the MILP grows with the square of the tuples)."""


def exact_packing_ms(tuples: list[tuple[str, int, float]], num_devices: int,
                     *, time_limit_s: float = 10.0) -> float | None:
    """Optimal makespan of (MetaOp, n, time_ms) tuples on N devices; None when there are
    more than MAX_TUPLES tuples or HiGHS does not prove optimality within the time limit."""
    if not tuples or len(tuples) > MAX_TUPLES:
        return None
    k = len(tuples)
    src, sink = 0, k + 1
    nodes = k + 2
    n = [num_devices] + [t[1] for t in tuples] + [num_devices]
    p = [0.0] + [t[2] for t in tuples] + [0.0]
    big_m = sum(p)
    arcs = [(u, v) for u in range(nodes) for v in range(nodes)
            if u != v and u != sink and v != src]
    arc_index = {a: i for i, a in enumerate(arcs)}
    n_s, n_a = nodes, len(arcs)
    y0, f0 = n_s, n_s + n_a
    num_vars = n_s + 2 * n_a
    rows, lo, hi = [], [], []

    def row() -> np.ndarray:
        return np.zeros(num_vars)

    for (u, v), i in arc_index.items():
        r = row()  # S_v - S_u - M y_uv >= p_u - M
        r[v], r[u], r[y0 + i] = 1.0, -1.0, -big_m
        rows.append(r), lo.append(p[u] - big_m), hi.append(np.inf)
        r = row()  # f_uv <= min(n_u, n_v) y_uv
        r[f0 + i], r[y0 + i] = 1.0, -float(min(n[u], n[v]))
        rows.append(r), lo.append(-np.inf), hi.append(0.0)
    for u in range(nodes):
        if u != sink:
            r = row()
            for v in range(nodes):
                if (u, v) in arc_index:
                    r[f0 + arc_index[(u, v)]] = 1.0
            rows.append(r), lo.append(n[u]), hi.append(n[u])
        if u != src:
            r = row()
            for w in range(nodes):
                if (w, u) in arc_index:
                    r[f0 + arc_index[(w, u)]] = 1.0
            rows.append(r), lo.append(n[u]), hi.append(n[u])
    for a in range(1, k + 1):
        for b in range(a + 1, k + 1):
            r = row()
            r[y0 + arc_index[(a, b)]], r[y0 + arc_index[(b, a)]] = 1.0, 1.0
            same = tuples[a - 1][0] == tuples[b - 1][0]
            rows.append(r), lo.append(1.0 if same else 0.0), hi.append(1.0)
    lb = np.zeros(num_vars)
    ub = np.full(num_vars, np.inf)
    ub[src] = 0.0
    ub[y0:f0] = 1.0
    for u in range(1, k + 1):
        lb[y0 + arc_index[(u, sink)]] = 1.0
    integrality = np.zeros(num_vars)
    integrality[y0:f0] = 1
    cost = np.zeros(num_vars)
    cost[sink] = 1.0
    res = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi),
               integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit_s})
    if res.status != 0 or res.x is None:
        return None
    return float(res.x[sink])


REALIGN_NODE_LIMIT = 2000
"""Branch-and-bound nodes `realign_waves` lets HiGHS explore: a node limit, unlike a time
limit, gives the same answer on every machine, so plans stay reproducible."""


def realign_waves(waves: list[PlannedWave], max_ops: MaxOps | None = None, *,
                  node_limit: int = REALIGN_NODE_LIMIT) -> list[PlannedWave] | None:
    """Beyond the paper: re-choose the operator counts of one level's waves, keeping each
    wave's slots (MetaOp, n), to minimize the sum of wave durations. Algorithm 1 aligns one
    wave at a time, so an operator cut from a wave to align it may lengthen a later one; here
    all waves are aligned together.

    MILP: integer k_s >= 0 operators per slot (at most `max_ops`), D_w >= k_s * T_s for
    each slot of wave w, sum of k over a MetaOp's slots = its operators; minimize sum D_w. A
    slot left with no operator is dropped (its devices idle), and so is an empty wave. Returns
    None unless HiGHS finds, within `node_limit` nodes, waves strictly shorter than the
    given ones. Slices stay in operator order: each MetaOp has at most one slot per wave."""
    slots = [(w, s) for w, wave in enumerate(waves) for s in wave.slots]
    num_slots, num_waves = len(slots), len(waves)
    metaops = sorted({s.metaop for _, s in slots})
    num_vars = num_slots + num_waves
    rows = np.zeros((num_slots + len(metaops), num_vars))
    lo = np.zeros(num_slots + len(metaops))
    hi = np.full(num_slots + len(metaops), np.inf)
    for i, (w, s) in enumerate(slots):
        rows[i, num_slots + w], rows[i, i] = 1.0, -s.op_time_ms  # D_w - T_s k_s >= 0
    for j, m in enumerate(metaops):
        r = num_slots + j
        total = 0
        for i, (_, s) in enumerate(slots):
            if s.metaop == m:
                rows[r, i] = 1.0
                total += s.num_ops
        lo[r] = hi[r] = total
    ub = np.full(num_vars, np.inf)
    for i, (_, s) in enumerate(slots):
        ub[i] = lo[num_slots + metaops.index(s.metaop)]
        if max_ops is not None:
            ub[i] = min(ub[i], max_ops(s.metaop, s.n))
    cost = np.zeros(num_vars)
    cost[num_slots:] = 1.0
    integrality = np.zeros(num_vars)
    integrality[:num_slots] = 1
    res = milp(cost, constraints=LinearConstraint(rows, lo, hi), integrality=integrality,
               bounds=Bounds(np.zeros(num_vars), ub), options={"node_limit": node_limit})
    if res.x is None:
        return None
    ops = [round(float(x)) for x in res.x[:num_slots]]
    new = [PlannedWave(level=wave.level, slots=tuple(
               Slot(metaop=s.metaop, n=s.n, num_ops=k, op_time_ms=s.op_time_ms)
               for (w, s), k in zip(slots, ops, strict=True) if w == wi and k > 0))
           for wi, wave in enumerate(waves)]
    new = [w for w in new if w.slots]
    before_ms = sum(w.duration_ms for w in waves)
    if sum(w.duration_ms for w in new) >= before_ms * (1 - 1e-9):
        return None
    return new
