"""One simulated training iteration in progress: the state that the two ways ranks move through
the waves (planner/progress.py) share, and the steps both take. The state is the plan's
indexes, the network with its flows, and the timeline of slices and waves; the steps issue
transfers, gradient reductions and parameter all-gathers, run a forward that waits for its
all-gathers, and end the iteration (the sync left, the optimizer steps, the breakdown).
`simulate`'s module docstring describes the model; the costs read off the plan beforehand are
planner/workload.py's, the network planner/network.py's.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.plan import Plan, Slice, Wave
from spindle_cli.artifacts.profile import Profile
from spindle_cli.planner.buckets import SyncBucket, SyncMode, sync_buckets
from spindle_cli.planner.memory import state_bytes_per_param
from spindle_cli.planner.network import Network, row_flows
from spindle_cli.planner.workload import (
    SliceCost,
    check_inputs,
    held_shares,
    optimizer_step_ms,
    plan_curves,
    slice_costs,
    zero_stage,
)

FlowKind = Literal["activation", "gradient", "sync", "gather"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """What `simulate._run` computed, for `simulate._result` to report."""

    costs: dict[str, SliceCost]
    starts: dict[str, list[float]]
    """Per slice: forward start, forward end, backward start, backward end (ms)."""
    stalls: dict[str, list[tuple[float, float]]]
    """Per slice that stalled inside its forward (`SliceTiming.forward_stalls`)."""
    net: Network
    flow_meta: list[tuple[FlowKind, str, int, int, int]]
    fwd_timing: list[tuple[float, float, float]]
    bwd_timing: dict[int, tuple[float, float, float]]
    sync_start_ms: dict[int, float]
    sync_end_ms: list[float]
    iteration_ms: float
    gather_wait_ms: float | None
    """`SimResult.gather_wait_ms`."""
    parts: tuple[float, float, float, float, float]
    """The iteration as forward, backward, transfer wait, sync and optimizer (ms), summing to
    it: with waves as barriers, the sums over waves; with ranks on their own, the time of the
    rank that ends the iteration."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankTimes:
    """Per rank, with ranks on their own: forward and backward compute, and the time spent
    waiting for messages, slice peers, ZeRO-3 gathers and (stalled inside a forward) ZeRO-1/2
    all-gathers, up to its last backward boundary."""

    forward_ms: list[float]
    backward_ms: list[float]
    waiting_ms: list[float]


def bucket_label(b: SyncBucket) -> str:
    """Its layers as module[first:last] runs ('+'-joined)."""
    runs: list[tuple[str, int, int]] = []
    for module, layer in sorted(b.layers):
        if runs and runs[-1][0] == module and runs[-1][2] == layer:
            runs[-1] = (module, runs[-1][1], layer + 1)
        else:
            runs.append((module, layer, layer + 1))
    return "+".join(f"{module}[{lo}:{hi}]" for module, lo, hi in runs)


class Iteration:
    """The event-driven timeline of one `simulate` call in progress (`simulate._run`): the
    plan's indexes, the network and the flows issued on it, and when each slice and wave ran.
    Building it issues the previous step's ZeRO-1/2 all-gathers; `progress.run_barriers` or
    `progress.run_ranks` then moves the ranks through the waves, and `timeline` ends the
    iteration. The network raises GaveUp once the clock passes `give_up_ms`; without
    `record_flows` the timeline's `flow_meta` stays empty."""

    def __init__(self, plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                 *, sync: SyncMode, give_up_ms: float, record_flows: bool) -> None:
        self.plan = plan
        self.give_up_ms = give_up_ms
        self.record_flows = record_flows
        self.metaops = metaops = {m.id: m for m in graph.metaops}
        curves = plan_curves(plan, metaops, profile, cluster)
        check_inputs(plan, graph, metaops, curves, cluster)
        self.costs = slice_costs(plan, metaops, curves)
        self.latency_s = cluster.link_latency_s
        self.net = Network(cluster, give_up_ms / 1e3)
        self.flow_meta: list[tuple[FlowKind, str, int, int, int]] = []
        # the all-gathers of each rank set, by issue time (ms), and their flows: a process
        # group runs its collectives one after another, in the order they were issued (NCCL:
        # one stream per communicator). The gradient reductions of a set still overlap each
        # other here.
        self.gathers_on: dict[tuple[int, ...], tuple[list[float], list[list[int]]]] = {}
        self.sync_ids: dict[int, list[int]] = {gi: [] for gi in range(len(plan.param_groups))}
        self.sync_start_ms: dict[int, float] = {}
        # ZeRO shards the optimizer state: gradients are reduce-scattered (half an all-reduce's
        # ring); below stage 3 every rank then all-gathers the stepped shards (`post_gather`)
        self.sharded = zero_stage(plan) >= 1
        post_gather = 1 <= zero_stage(plan) <= 2
        self.held = held_shares(plan, metaops)
        self.optimizer_ms = optimizer_step_ms(plan, graph, profile, self.held)
        self.rings_of: dict[tuple[int, ...],
                            list[tuple[tuple[int, ...], int, list[list[int]]]]] = {}
        self.weight_b = state_bytes_per_param(graph.dtype)[0]
        self.gathers = zero_stage(plan) >= 3
        self.due_in_wave: dict[int, list[SyncBucket]] = {}
        for b in sync_buckets(plan, metaops, sync):
            self.due_in_wave.setdefault(b.wave, []).append(b)
        # ZeRO-1/2: the previous step's all-gather of every bucket (every group, without
        # buckets) leaves at 0, the buckets in reverse (the order the forward first uses their
        # layers, as the executor issues them), each rank set's one after another; `prior`
        # holds, per slice, the flows its forward waits for before each of its operators, as
        # runs of operators that wait for the same ones: (position of the run's first operator
        # in the slice, flows)
        self.prior: dict[str, list[tuple[int, list[int]]]] = (
            self._issue_post_gathers() if post_gather else {})
        self.into_wave: dict[int, list[int]] = {}
        for i, t in enumerate(plan.transfers):
            self.into_wave.setdefault(self.costs[t.dst].wave, []).append(i)
        self.starts: dict[str, list[float]] = {s.id: [0.0] * 4 for _, s in plan.slices()}
        self.stalls: dict[str, list[tuple[float, float]]] = {}
        self.fwd_timing: list[tuple[float, float, float]] = []
        self.bwd_timing: dict[int, tuple[float, float, float]] = {}
        self.param_wait_ms = 0.0
        """With waves as barriers: the part of the waves' waits spent on ZeRO-3 weight gathers
        after the inputs had arrived (counted as sync, not as transfer)."""
        self.stalled_ms = 0.0
        """With waves as barriers: how much longer the forward waves lasted than their longest
        slice's compute, their slices stalled by parameter all-gathers (counted as sync)."""

    def _issue_post_gathers(self) -> dict[str, list[tuple[int, list[int]]]]:
        """ZeRO-1/2: issue the previous step's all-gathers at 0; `prior` (see `__init__`)."""
        plan, metaops = self.plan, self.metaops
        units = [(b.groups, b.group_bytes, bucket_label(b), b.layers)
                 for bs in reversed(self.due_in_wave.values()) for b in reversed(bs)]
        if not units:
            units = [((gi,), (g.bytes,), self.label_of((gi,)),
                      tuple((g.module, layer) for layer in range(g.first_layer, g.last_layer)))
                     for gi, g in enumerate(plan.param_groups)]
        gathered: dict[tuple[str, int], list[int]] = {}
        for groups, group_bytes, label, layers in units:
            g = plan.param_groups[groups[0]]
            ids = self.all_gather(g.ranks, "sync", f"all-gather {label}",
                                  self.ring(groups, group_bytes, 1.0), 0.0,
                                  self.ring_steps(groups) * self.latency_s)
            for key in layers:
                gathered.setdefault(key, []).extend(ids)
        prior: dict[str, list[tuple[int, list[int]]]] = {}
        for _, sl in plan.slices():
            m = metaops[sl.metaop]
            runs: list[tuple[int, list[int]]] = []
            for pos in range(sl.num_layers):
                ids = gathered.get((m.module, m.first_layer + sl.first + pos), [])
                if ids and (not runs or runs[-1][1] != ids):
                    runs.append((pos, ids))
            prior[sl.id] = runs
        return prior

    def issue(self, kind: FlowKind, label: str, pieces: Sequence[tuple[int, int, int]],
              start_ms: float, latency: float, after: Sequence[int] = ()) -> list[int]:
        """Add flows to the network (`Network.add`), recorded in `flow_meta` when kept."""
        if self.record_flows:
            self.flow_meta.extend((kind, label, src, dst, num_bytes)
                                  for src, dst, num_bytes in pieces)
        return self.net.add(pieces, start_ms / 1e3, latency, after)

    def all_gather(self, ranks: tuple[int, ...], kind: FlowKind, label: str,
                   pieces: Sequence[tuple[int, int, int]], start_ms: float,
                   latency: float) -> list[int]:
        """`issue` an all-gather over `ranks`: its flows start once the set's all-gather
        issued last at or before `start_ms` has ended. With ranks on their own, a rank
        running ahead may issue a later gather before another rank issues an earlier one: the
        earlier one does not wait for it."""
        times, flows = self.gathers_on.setdefault(ranks, ([], []))
        k = bisect.bisect_right(times, start_ms)
        ids = self.issue(kind, label, pieces, start_ms, latency, flows[k - 1] if k else ())
        if ids:
            times.insert(k, start_ms)
            flows.insert(k, ids)
        return ids

    def pieces(self, t_index: int, backward: bool) -> Sequence[tuple[int, int, int]]:
        """The (src rank, dst rank, bytes) flows of transfer `t_index` (`row_flows`), or of
        its gradients back."""
        t = self.plan.transfers[t_index]
        src, dst = self.costs[t.src].slice, self.costs[t.dst].slice
        rows = self.metaops[src.metaop].batch_size
        if backward:
            return row_flows(t.bytes, dst.ranks, dst.strategy, src.ranks, src.strategy, rows)
        return row_flows(t.bytes, src.ranks, src.strategy, dst.ranks, dst.strategy, rows)

    def shard_rings(self, groups: tuple[int, ...]
                    ) -> list[tuple[tuple[int, ...], int, list[list[int]]]]:
        """The rings that reduce the layers of `groups` (one rank set), per way its ranks
        hold them (`held_shares`): (the positions in `groups` of the groups held that way, T,
        rings), where shard j of T (the least common multiple of the ranks' degrees) is
        reduced over the ranks holding it, ascending (a data-parallel rank holds every
        shard, a rank of a tp<t> group shard q of t the shards j = q mod t; layers in tp2 on
        some ranks and tp3 on others are six shards, each held by one rank of each kind). A
        bucket of tensor- and data-parallel groups reduces each part on its own rings.
        Computed once per set of groups (`ring` and `ring_steps` both ask)."""
        if groups in self.rings_of:
            return self.rings_of[groups]
        ranks = self.plan.param_groups[groups[0]].ranks
        held = self.held
        parts: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for k, gi in enumerate(groups):
            parts.setdefault(tuple(held[gi][r] for r in ranks), []).append(k)
        out = []
        for way, positions in parts.items():
            shards = math.lcm(*(t for t, _ in way))
            out.append((tuple(positions), shards,
                        [[r for r, (t, q) in zip(ranks, way, strict=True) if j % t == q]
                         for j in range(shards)]))
        self.rings_of[groups] = out
        return out

    def ring(self, groups: tuple[int, ...], group_bytes: Sequence[int], share: float
             ) -> list[tuple[int, int, int]]:
        """Ring collectives over `group_bytes[k]` bytes of the layers of each `groups[k]`
        (one rank set), one per shard (`shard_rings`; one ring over every rank without
        tensor parallelism): each member sends its successor `share` x (c - 1) / c of the
        shard's bytes, for c members; nothing for a shard with one copy."""
        out: list[tuple[int, int, int]] = []
        for positions, shards, rings in self.shard_rings(groups):
            num_bytes = sum(group_bytes[k] for k in positions)
            if num_bytes <= 0:
                continue
            for members in rings:
                c = len(members)
                if c > 1:
                    each = round(share * (c - 1) / c * num_bytes / shards)
                    out += zip(members, members[1:] + members[:1], [each] * c, strict=True)
        return out

    def ring_steps(self, groups: tuple[int, ...]) -> int:
        """The steps of the longest shard ring (each pays a link latency)."""
        return max(len(members) for _, _, rings in self.shard_rings(groups)
                   for members in rings) - 1

    def label_of(self, groups: tuple[int, ...]) -> str:
        """The groups' layers as module[first:last] ('+'-joined)."""
        param_groups = self.plan.param_groups
        return "+".join(f"{param_groups[gi].module}[{param_groups[gi].first_layer}:"
                        f"{param_groups[gi].last_layer}]" for gi in groups)

    def issue_sync(self, groups: tuple[int, ...], group_bytes: Sequence[int], start_ms: float,
                   label: str | None = None) -> None:
        """A ring all-reduce (reduce-scatter under ZeRO) of `group_bytes[k]` of the gradients
        of each `groups[k]` (one rank set) from `start_ms`; `label`: its layers (the groups'
        by default)."""
        sharded = self.sharded
        steps = (1 if sharded else 2) * self.ring_steps(groups)
        label = label or self.label_of(groups)
        ids = self.issue("sync", label, self.ring(groups, group_bytes, 1.0 if sharded else 2.0),
                         start_ms, steps * self.latency_s)
        sync_start_ms, sync_ids = self.sync_start_ms, self.sync_ids
        for gi in groups:
            sync_start_ms[gi] = min(sync_start_ms.get(gi, start_ms), start_ms)
            sync_ids[gi] += ids

    def issue_slice_gathers(self, s: Slice, start_ms: float) -> list[int]:
        """ZeRO-3: all-gather the weights of slice `s` over its groups."""
        if not self.gathers:
            return []
        ids: list[int] = []
        m = self.metaops[s.metaop]
        lo, hi = m.first_layer + s.first, m.first_layer + s.last
        for gi, g in enumerate(self.plan.param_groups):
            layers = min(hi, g.last_layer) - max(lo, g.first_layer)
            if g.module != m.module or layers <= 0:
                continue
            pieces = self.ring((gi,), (layers * m.params_per_layer * self.weight_b,), 1.0)
            if pieces:
                ids += self.all_gather(g.ranks, "gather",
                                       f"{s.id}:{g.module}[{max(lo, g.first_layer)}:"
                                       f"{min(hi, g.last_layer)}]", pieces, start_ms,
                                       self.ring_steps((gi,)) * self.latency_s)
        return ids

    def issue_gathers(self, wave: int, start_ms: float) -> list[int]:
        """ZeRO-3: all-gather the weights of every slice of the wave over its groups."""
        if not 0 <= wave < len(self.plan.waves):
            return []
        return [i for s in self.plan.waves[wave].slices
                for i in self.issue_slice_gathers(s, start_ms)]

    def boundary_messages(self, wave: int, backward: bool
                          ) -> list[tuple[FlowKind, str, list[tuple[int, int, int]]]]:
        """(kind, label, pieces) of every transfer into `wave`: its inputs' activations
        (forward) or, after its backward, their gradients back."""
        kind: FlowKind = "gradient" if backward else "activation"
        found = []
        for i in self.into_wave.get(wave, []):
            t = self.plan.transfers[i]
            label = f"{t.dst}->{t.src}" if backward else f"{t.src}->{t.dst}"
            found.append((kind, label, list(self.pieces(i, backward))))
        return found

    def issue_boundary(self, wave: int, backward: bool, ready_ms: list[float],
                       waiter: Callable[[int, int], int] | None = None) -> dict[int, list[int]]:
        """The messages of the boundary into `wave` (`boundary_messages`), by the wave that
        waits for them: `waiter(src, dst)` of each message's ranks (`wave` itself without
        it). A message starts once both of its ranks have reached the boundary (`ready_ms`),
        as the executor posts a boundary's messages together; a rank moves on when all of
        them have arrived. Not before the network's clock: where a slice stalled for an
        all-gather (`run_forward`) the clock may have passed a shorter slice's end, whose
        messages then leave late."""
        ids: dict[int, list[int]] = {}
        now_ms = self.net.now_s * 1e3
        latency_s = self.latency_s
        for kind, label, found in self.boundary_messages(wave, backward):
            by_start: dict[float, list[tuple[int, int, int]]] = {}
            for src, dst, num_bytes in found:
                start = max(ready_ms[src], ready_ms[dst], now_ms)
                by_start.setdefault(start, []).append((src, dst, num_bytes))
            for start, group in sorted(by_start.items()):
                for (src, dst, _), i in zip(group,
                                            self.issue(kind, label, group, start, latency_s),
                                            strict=True):
                    ids.setdefault(wave if waiter is None else waiter(src, dst), []).append(i)
        return ids

    def reached(self, w: Wave, start_ms: float, end: int) -> list[float]:
        """When each rank reaches the boundary after wave `w` (started at `start_ms`): the end
        of its slices (`starts` index `end`), or the wave's start for a rank with none."""
        ready_ms = [start_ms] * self.plan.num_devices
        starts = self.starts
        for s in w.slices:
            for r in s.ranks:
                ready_ms[r] = max(ready_ms[r], starts[s.id][end])
        return ready_ms

    def gathered_at(self, s: Slice, pos: int, start_ms: float, stall_ms: float,
                    gathered_ms: float) -> tuple[float, float]:
        """Slice `s`'s forward start and stall so far (`start_ms`, `stall_ms`) once it has
        waited for the all-gathers of its operators from `pos` on (`prior`), ended at
        `gathered_ms`: the executor waits before the first operator of each bucket, so the
        slice stalls there (before it starts, where pos is 0; a stall inside it is recorded
        in `stalls`)."""
        at_ms = start_ms + stall_ms + self.costs[s.id].forward_ms * pos / s.num_layers
        wait_ms = max(0.0, gathered_ms - at_ms)
        if pos == 0:
            return start_ms + wait_ms, stall_ms
        if wait_ms > 0:
            self.stalls.setdefault(s.id, []).append((at_ms, gathered_ms))
        return start_ms, stall_ms + wait_ms

    def wait_for(self, now_ms: float, inputs: list[int], params: list[int]) -> float:
        """When a wave whose predecessor ended at `now_ms` starts: once the flows of its
        inputs and of its parameter all-gathers have ended."""
        inputs_ms = max(now_ms, self.net.finish(inputs) * 1e3)
        start_ms = max(inputs_ms, self.net.finish(params) * 1e3)
        self.param_wait_ms += start_ms - inputs_ms
        return start_ms

    def run_forward(self, s: Slice, ready_ms: float, rest_ms: float) -> None:
        """Slice `s`'s forward, its ranks ready at `ready_ms`, into `starts`: before each run
        of its operators that waits for all-gathers (`prior`) it stalls until they have ended
        (the executor waits before the first operator of each bucket); `rest_ms` is the least
        the iteration lasts past the slice's end."""
        c = self.costs[s.id]
        net = self.net
        start_ms, stall_ms = ready_ms, 0.0
        for pos, ids in self.prior.get(s.id, ()):
            net.tail_s = (c.forward_ms * (s.num_layers - pos) / s.num_layers + rest_ms) / 1e3
            start_ms, stall_ms = self.gathered_at(s, pos, start_ms, stall_ms,
                                                  net.finish(ids) * 1e3)
        starts = self.starts[s.id]
        starts[0] = start_ms
        starts[1] = start_ms + c.forward_ms + stall_ms

    def timeline(self, end_ms: list[float], rank_times: RankTimes | None) -> Timeline:
        """The iteration once every rank is through its backward (at `end_ms`; `rank_times`
        with ranks on their own): the sync of the groups no bucket synced, each rank's
        optimizer step after its groups' reductions, and the breakdown (`Timeline.parts`)."""
        plan, net, optimizer_ms = self.plan, self.net, self.optimizer_ms
        sync_ids, sync_start_ms = self.sync_ids, self.sync_start_ms
        backward_end_ms = max(end_ms)

        for gi, g in enumerate(plan.param_groups):
            if gi not in sync_start_ms:
                self.issue_sync((gi,), (g.bytes,), max(end_ms[r] for r in g.ranks))
        groups_of: list[list[int]] = [[] for _ in range(plan.num_devices)]
        for gi, g in enumerate(plan.param_groups):
            for r in g.ranks:
                groups_of[r].append(gi)

        def stepped_ms(r: int) -> float:
            """When rank r has stepped: its optimizer runs once its backward and its own
            groups' reductions are done."""
            return max([end_ms[r], *(reduced_ms[gi] for gi in groups_of[r])]) + optimizer_ms[r]

        reduced_ms = []
        for gi, g in enumerate(plan.param_groups):
            # each rank of the group steps its optimizer after the group's reduction
            net.tail_s = max(optimizer_ms[r] for r in g.ranks) / 1e3
            reduced_ms.append(max(net.finish(sync_ids[gi]) * 1e3, sync_start_ms[gi])
                              if sync_ids[gi] else sync_start_ms[gi])
        # a rank is through once it has stepped (the all-gathers of ZeRO-1/2 overlap the next
        # forward)
        through_ms = [stepped_ms(r) for r in range(plan.num_devices)]
        reduced_all_ms = max([backward_end_ms, *reduced_ms])
        iteration_ms = max([reduced_all_ms, *through_ms])
        fwd_timing, bwd_timing = self.fwd_timing, self.bwd_timing
        param_wait_ms, stalled_ms = self.param_wait_ms, self.stalled_ms
        if rank_times is None:
            forward_ms = math.fsum(end - start for start, end, _ in fwd_timing) - stalled_ms
            backward_ms = math.fsum(end - start for start, end, _ in bwd_timing.values())
            transfer_ms = (math.fsum(wait for _, _, wait in fwd_timing)
                           + math.fsum(wait for _, _, wait in bwd_timing.values()) - param_wait_ms)
            # the step: how long the last rank steps past the last reduction; the sync: the
            # reductions past the last backward (taken directly: a rank without groups syncs
            # exactly nothing, not the rounding left by subtracting the step), and the waves'
            # waits and stalls for parameter all-gathers
            step_ms = max(0.0, max(through_ms) - reduced_all_ms)
            parts = (forward_ms, backward_ms, transfer_ms,
                     reduced_all_ms - backward_end_ms + param_wait_ms + stalled_ms, step_ms)
        else:
            # the rank that ends the iteration: its own time is compute, waiting, sync, step
            r = max(range(plan.num_devices), key=lambda q: (through_ms[q], -q))
            reduced_r = max([end_ms[r], *(reduced_ms[gi] for gi in groups_of[r])])
            parts = (rank_times.forward_ms[r], rank_times.backward_ms[r],
                     rank_times.waiting_ms[r], reduced_r - end_ms[r], optimizer_ms[r])

        return Timeline(costs=self.costs, starts=self.starts, stalls=self.stalls, net=net,
                        flow_meta=self.flow_meta, fwd_timing=fwd_timing, bwd_timing=bwd_timing,
                        sync_start_ms=sync_start_ms, sync_end_ms=reduced_ms,
                        iteration_ms=iteration_ms,
                        gather_wait_ms=None if rank_times is not None
                        else param_wait_ms + stalled_ms, parts=parts)
