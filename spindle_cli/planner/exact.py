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

The makespan is bounded below by the tuples' device-time over N and by each MetaOp's tuples
in sequence; the MILP gets that bound as a constraint (big-M formulations relax weakly: eight
one-device tuples on two devices went unproven for 10 s without it), and the cases where it is
the optimum (every tuple fits beside the others; no two tuples fit side by side) are answered
without a solver.
"""

from __future__ import annotations

import math
import threading
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

MAX_TUPLES = 16
"""Larger levels are not solved (the MILP grows with the square of the tuples)."""

TIME_LIMIT_S = 10.0
"""How long HiGHS searches a level's packing unless told (`spindle explain`'s)."""


class Packing(NamedTuple):
    """What `exact_packing` found: the shortest packing, and a proven bound below it."""

    found_ms: float
    """The makespan of the best packing found."""
    bound_ms: float
    """No packing is shorter: `found_ms` where it is proven optimal."""

    @property
    def proven(self) -> bool:
        """Whether `found_ms` is the optimum (within HiGHS's relative gap, 1e-4)."""
        return self.found_ms <= self.bound_ms * (1 + 1e-4)


def exact_packing_ms(tuples: list[tuple[str, int, float]], num_devices: int,
                     *, time_limit_s: float = TIME_LIMIT_S) -> float | None:
    """Optimal makespan of (MetaOp, n, time_ms) tuples on N devices; None when there are
    more than MAX_TUPLES tuples or HiGHS does not prove optimality within the time limit."""
    packing = exact_packing(tuples, num_devices, time_limit_s=time_limit_s)
    return packing.found_ms if packing is not None and packing.proven else None


def exact_packing(tuples: list[tuple[str, int, float]], num_devices: int,
                  *, time_limit_s: float = TIME_LIMIT_S) -> Packing | None:
    """The best packing of (MetaOp, n, time_ms) tuples on N devices HiGHS finds within the
    time limit, with the bound it proves; None when there are more than MAX_TUPLES tuples or
    it finds none in time."""
    if not tuples or len(tuples) > MAX_TUPLES:
        return None
    chains: dict[str, float] = {}
    for metaop, _, time_ms in tuples:
        chains[metaop] = chains.get(metaop, 0.0) + time_ms
    if sum(t[1] for t in tuples) <= num_devices:
        side_by_side = max(chains.values())  # each MetaOp's in sequence
        return Packing(side_by_side, side_by_side)
    if all(2 * t[1] > num_devices for t in tuples):
        one_after_another = math.fsum(chains.values())
        return Packing(one_after_another, one_after_another)
    bound = max(max(chains.values()), math.fsum(n * t for _, n, t in tuples) / num_devices)
    k = len(tuples)
    src, sink = 0, k + 1
    nodes = k + 2
    n = [num_devices] + [t[1] for t in tuples] + [num_devices]
    p = [0.0] + [t[2] for t in tuples] + [0.0]
    big_m = math.fsum(p)
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
    lb[sink] = bound
    cost = np.zeros(num_vars)
    cost[sink] = 1.0
    res = _solve(cost, constraints=LinearConstraint(np.array(rows), lo, hi),
                 integrality=integrality, bounds=Bounds(lb, ub),
                 options={"time_limit": time_limit_s})
    if res.x is None:
        return None
    found = float(res.x[sink])
    return Packing(found, found if res.status == 0 else
                   max(bound, float(getattr(res, "mip_dual_bound", bound))))


def _solve(*args: Any, **kwargs: Any) -> Any:
    """`milp` on a thread this one waits for in short joins, so that Ctrl-C and SIGTERM stop
    the command at once (HiGHS releases the GIL, but a signal is handled only once the main
    thread runs Python again: up to the time limit later)."""
    outcome: list[Any] = []

    def solve() -> None:
        try:
            outcome.append(milp(*args, **kwargs))
        except BaseException as e:  # raised again on this thread
            outcome.append(e)

    solver = threading.Thread(target=solve, daemon=True)
    solver.start()
    while solver.is_alive():
        solver.join(0.05)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
