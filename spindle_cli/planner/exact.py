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
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

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
