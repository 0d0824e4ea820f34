"""What one iteration of a plan asks of its ranks, read off the plan and its inputs before any
event is simulated: each slice's forward and backward time (from the profile's curves as the
planner saw them), what each rank holds of each parameter group, and each rank's optimizer
step. `simulate`'s module docstring describes the model; the iteration's timeline is
planner/iteration.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.plan import Plan, Slice, tp_group_size, tp_groups
from spindle_cli.artifacts.profile import Curve, Profile, tp_degree
from spindle_cli.errors import SpindleError
from spindle_cli.planner.profiling import allowed_curve

FORWARD_SHARE = 1.0 / 3.0
"""Forward share of an operator's forward+backward time; backward is the rest."""


def operator_ms(curve: Curve, s: Slice) -> float:
    """Forward+backward time of one operator of slice `s` (its slowest rank): the curve's at
    the count whose per-device batch is the slowest rank's rows (`scaling.work_count`, n itself
    when the groups divide the batch), read on the piece holding that count, as the planner
    reads it (`allocation.op_time_ms`)."""
    n = len(s.ranks)
    groups = len(tp_groups(s.ranks, s.strategy))
    rows = math.ceil(curve.batch_size / groups)
    work = n * curve.batch_size / (rows * groups)
    piece = next((p for p in curve.pieces if work <= p.n_hi), curve.pieces[-1])
    return piece.alpha_ms + piece.beta_ms * rows * groups / n


@dataclass(frozen=True, slots=True)
class SliceCost:
    slice: Slice
    wave: int
    forward_ms: float
    backward_ms: float
    operator_backward_ms: float
    """One operator's backward, with its recomputed forward when any (the executor
    checkpoints every operator on its own, so each one's forward runs again right before its
    backward)."""

    def passed_ms(self, k: int) -> float:
        """Time from the slice's backward start until its last k operators are through."""
        return self.backward_ms - (self.slice.num_layers - k) * self.operator_backward_ms


def zero_stage(plan: Plan) -> int:
    return int(plan.options.get("zero", "0"))


def recompute(plan: Plan) -> bool:
    return plan.options.get("recompute", "false") == "true"


def plan_curves(plan: Plan, metaops: dict[str, MetaOp], profile: Profile,
                 cluster: ClusterSpec) -> dict[str, Curve]:
    """The curves the plan was made from, by signature (of the MetaOps the profile has one
    for): without tensor parallelism, or with degrees that do not divide the cluster's
    islands, fitted again from the strategies left (`profiling.allowed_curve`), as the
    planner saw them."""
    tensor_parallel = plan.options.get("tensor_parallel") != "false"
    have = {c.signature for c in profile.curves}
    curves: dict[str, Curve] = {}
    for m in metaops.values():
        if m.signature in have and m.signature not in curves:
            curves[m.signature] = allowed_curve(profile, m, tensor_parallel,
                                                cluster.island_size)
    return curves


def slice_costs(plan: Plan, metaops: dict[str, MetaOp],
                 curves: dict[str, Curve]) -> dict[str, SliceCost]:
    """Every slice's times; `metaops` by id, `curves` by signature."""
    costs = {}
    # recomputation runs each operator's forward once more right before its backward
    extra = FORWARD_SHARE if recompute(plan) else 0.0
    for w, s in plan.slices():
        m = metaops[s.metaop]
        total_ms = operator_ms(curves[m.signature], s) * s.num_layers
        costs[s.id] = SliceCost(
            slice=s, wave=w.index, forward_ms=total_ms * FORWARD_SHARE,
            backward_ms=total_ms * (1.0 - FORWARD_SHARE + extra),
            operator_backward_ms=total_ms * (1.0 - FORWARD_SHARE + extra) / s.num_layers,
        )
    return costs


def check_inputs(plan: Plan, graph: MetaOpGraph, metaops: dict[str, MetaOp],
                  curves: dict[str, Curve], cluster: ClusterSpec) -> None:
    """That the plan fits the graph (`metaops` by id), the profile (`curves` by signature) and
    the cluster."""
    if plan.num_devices != cluster.num_devices:
        raise SpindleError(f"plan is for {plan.num_devices} devices but cluster "
                           f"{cluster.name!r} has {cluster.num_devices}")
    for _, s in plan.slices():
        if s.metaop not in metaops:
            raise SpindleError(f"plan slice {s.id} runs MetaOp {s.metaop!r}, "
                               f"which graph {graph.model!r} does not have")
        if metaops[s.metaop].signature not in curves:
            raise SpindleError(f"the profile has no curve for MetaOp {s.metaop!r}")


_UNHELD = (math.inf, 0)
"""What `held_shares` reads for a rank not seen holding a group yet."""


def held_shares(plan: Plan, metaops: dict[str, MetaOp]) -> list[dict[int, tuple[int, int]]]:
    """Per parameter group, what each of its ranks holds of its layers' weights, as
    `memory.Ledger` counts it: (t, q) for shard q of t (1/t of each layer), (1, 0) for a rank
    that runs them data-parallel; the largest share over the rank's slices (a rank that runs
    shards of a layer that do not nest, such as both halves under tp2, which
    `memory.Ledger` charges as their union, is counted here with one of them: no plan the
    planner keeps has been seen to). A rank no slice runs them on (a group that check_plan
    lets through without slices) holds them whole."""
    held: list[dict[int, tuple[int, int]]] = [{} for _ in plan.param_groups]
    of_module: dict[str, list[int]] = {}
    for gi, g in enumerate(plan.param_groups):
        of_module.setdefault(g.module, []).append(gi)
    members = [set(g.ranks) for g in plan.param_groups]
    for _, s in plan.slices():
        m = metaops[s.metaop]
        lo, hi = m.first_layer + s.first, m.first_layer + s.last
        t = tp_degree(s.strategy)
        size = tp_group_size(len(s.ranks), s.strategy)
        for gi in of_module.get(m.module, ()):
            g = plan.param_groups[gi]
            if g.first_layer < hi and lo < g.last_layer:
                holds, mine = held[gi], members[gi]
                # the slice's i-th rank is rank i % size of its tensor-parallel group
                for i, r in enumerate(s.ranks):
                    if r in mine and t < holds.get(r, _UNHELD)[0]:
                        holds[r] = (t, i % size)
    for gi, g in enumerate(plan.param_groups):
        for r in g.ranks:
            held[gi].setdefault(r, (1, 0))
    return held


def optimizer_step_ms(plan: Plan, graph: MetaOpGraph, profile: Profile,
                  held: list[dict[int, tuple[int, int]]]) -> list[float]:
    """Each rank's optimizer step (Profile.optimizer; none without it): one tensor per distinct
    rank set among the rank's parameter groups (the executor's gradient buckets on gloo),
    holding the rank's share of the groups' parameters (`held_shares`: 1/t under 'tp<t>'), a
    1/replicas share of that under ZeRO (sharded optimizer state)."""
    cost = profile.optimizer
    if cost is None:
        return [0.0] * plan.num_devices
    sharded = zero_stage(plan) >= 1
    dtype_bytes = graph.dtype_bytes
    params = [0.0] * plan.num_devices
    buckets: list[set[tuple[int, ...]]] = [set() for _ in range(plan.num_devices)]
    for gi, g in enumerate(plan.param_groups):
        holds = held[gi]
        # without ZeRO every holder steps its whole share (no division by the replicas)
        replicas = max(math.fsum(1 / t for t, _ in holds.values()), 1.0) if sharded else 1
        for r in g.ranks:
            params[r] += g.bytes / dtype_bytes / holds[r][0] / replicas
            buckets[r].add(g.ranks)
    return [cost.time_ms(len(b), n) for b, n in zip(buckets, params, strict=True)]
