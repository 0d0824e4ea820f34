"""Event-driven simulation of one training iteration of a Plan on its cluster.

What is modelled (and what is not):

- Compute. A slice runs `num_layers` operators of its MetaOp on `len(ranks)` devices; one
  operator takes the profile curve's time T(n) = alpha + beta * b, with b the per-device work
  (the curve as the planner saw it: without the strategies the plan may not use,
  `profiling.allowed_curve`).
  Rows are split over the data-parallel groups of the slice (groups of t ranks under 'tp<t>')
  with `split_rows`, so an uneven split costs the time of the largest share. The curves give
  forward+backward time; forward is 1/3 and backward 2/3 of it (the usual 1:2 FLOP ratio of
  the forward and backward passes, also the convention of planner/costs.py).
- Waves. Forward waves run in order, then backward waves in reverse order. By default
  (`progress` 'wave', the planner's model) a wave is a barrier: it starts when the previous
  wave has ended and the messages of its boundary have arrived. Its slices start together;
  the wave ends with its longest slice. With `progress` 'rank' each rank runs on its own, as
  the executor does: it posts a boundary's messages when it reaches the boundary, goes on
  once they have arrived, and starts a slice when all of the slice's ranks are there; a rank
  with nothing to exchange runs ahead. Then the iteration's breakdown is the time of the
  rank that ends it (its compute, its waiting, its sync and optimizer step).
- Inter-wave transfers, as the executor makes them (rendezvous boundaries). Each plan Transfer
  moves `bytes` (forward activations; the same bytes of gradients flow back). Rows are split
  between producer and consumer ranks by the overlap of their `split_rows` ranges; pieces that
  stay on one rank are free. The boundary into a wave carries the activations of every
  transfer into it, and after that wave's backward their gradients back. A message leaves
  once both of its ranks have reached the boundary (finished their slices of the waves before
  it, forward, or of the wave itself, backward), so a transfer that skips waves overlaps them
  only where its ranks compute nothing there; it costs one message latency, and then shares
  bandwidth with the flows in flight: each rank has an NVLink port inside its island, each
  node one NIC between nodes (see `network.Network`); a port carrying k flows gives each
  bandwidth/k and a flow moves at the rate of its slower port. A rank waits for its messages
  of a boundary before it computes again (the executor's batch wait), so with waves as
  barriers the next wave waits for all of a forward boundary's messages (its slices receive
  them), and a backward boundary's gradient message holds up the first wave below it with a
  slice on either of its ranks, not a wave its ranks take no part in. This is
  not max-min fair (a share a flow cannot use is not handed to the port's other flows), so
  rates err low: max-min progressive filling, tried on the committed plans, shortened their
  iterations by 0-2.2% (most on qwen-val-70b's gradient sync across NICs), changed none of
  the planner's choices on multitask-clip and OFASys at 16 and 32 devices, and made each
  simulation about 2.8x slower.
- Parameter synchronization. Gradients are all-reduced in buckets with a ring over their ranks
  (ascending): each rank sends 2(p-1)/p * bytes to its ring successor, with 2(p-1) message
  latencies; a bucket finishes with its slowest link. Under 'tp<t>' a rank holds shard q of t of
  the layers (memory.py's count, `workload.held_shares`), and each shard has its own ring over
  the c ranks holding it (rank q of every tensor-parallel group, and any data-parallel holder):
  2(c-1)/c * bytes/t per member, with 2(c-1) latencies, nothing for one copy. The shard rings of
  consecutive tensor-parallel groups all cross the same node links. ZeRO's all-gathers run on
  the same rings, and the optimizer step counts the held share. The buckets are the executor's
  (`buckets.sync_buckets`, `simulate`'s `sync`), each with its share of its groups' bytes by
  layer count: by default those of the cluster's `backend`; 'chunked' (the executor's on NCCL)
  splits a rank set's layers by the backward wave that completes their gradients (the lowest
  wave of a slice running the layer), then into chunks of whole layers, top layers first; a
  chunk starts once every slice of that wave running its layers has passed its lowest layer (the
  backward of one operator taking an equal share of the slice's) and each of its ranks has
  started the buckets before it (a rank issues its buckets of several ranks in their one global
  order), overlapping the rest of the backward pass, like DDP's gradient buckets; 'per-wave'
  each wave's layers of a set in one bucket, once that wave's slices of them have finished their
  backward; 'per-set' (its gloo default) one bucket for all groups of one rank set, once all
  their layers are done; 'after-backward' each group whole after the last backward wave. Buckets
  run concurrently and share ports with each other and with transfers. Only the sync that
  outlasts the backward pass adds to the iteration.
- Memory. Parameters, gradients and optimizer state per rank are the plan's estimate; the
  activations stashed for backward are counted from the slices as memory.py counts them
  (`memory.replayed_table`: stash_bytes_per_sample * rows * layers on each rank, a tp<t>
  rank's share of it, only inputs under recomputation), all alive at the end of the forward
  pass, where a rank peaks.

- Memory strategies (Plan.options `zero`, `recompute`; planner/memory.py). Under ZeRO a
  bucket's ring is a reduce-scatter, (p-1)/p * bytes per rank with p-1 latencies. Below stage 3
  each rank then steps its shards, and a bucket's all-gather of the stepped shards (the same
  bytes again) overlaps the next step's forward, as the executor's ZeRO-1 does: in the steady
  state one iteration simulates, every bucket's all-gather of the previous step is issued at
  0, in the order the forward first uses the buckets' layers (the executor's order), a rank
  set's all-gathers one after another (NCCL runs a process group's collectives in issue
  order on one stream: the first needed arrives first), and a slice's forward waits for the
  all-gather of the bucket holding each of its layers before that layer's operator, as the
  executor does (Megatron's overlapped parameter gather): it starts once its first layer's
  has arrived and stalls where a later one has not (the first iteration of a run has none).
  With waves as barriers a wave still ends with its last slice, and a shorter slice's
  messages leave no earlier than the simulated clock a stalled slice has reached. ZeRO-3
  has no such all-gather: it all-gathers a slice's weights (the training dtype's bytes of
  its layers) over each parameter group it touches, as a ring over
  the group's ranks, before its forward and again before its backward; a wave prefetches the
  next wave's gathers when it starts (the first forward wave's at 0, the last backward wave's
  when the forward pass ends), and a wave waits for its own like for its inputs.
  Recomputation runs each operator's forward again right before its backward (backward_ms +=
  forward_ms; the executor checkpoints operator by operator, so a chunk's layers are complete
  after their operators' recomputed forwards and backwards only) and stashes only what
  memory.py keeps, plus the largest one-operator stash alive during a backward.
- Optimizer step. Each rank steps AdamW once its own parameter groups are reduced, for the
  profile's `optimizer` cost (none when the profile has none) over one tensor per distinct rank
  set among its groups (the executor's gradient buckets on gloo; with its `overlap_sync`, the
  NCCL default, shared sets are split further, a few more tensors) and its groups' parameters
  (a 1/p share of a group of p ranks under ZeRO).

Not modelled: tensor-parallel collectives inside a slice (they are inside the measured curve),
compute/communication interference, pipelining inside a wave.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.plan import Plan, Slice, Wave
from spindle_cli.artifacts.profile import Profile
from spindle_cli.planner.buckets import SyncBucket, SyncMode, backend_sync, sync_buckets
from spindle_cli.planner.consistency import check_plan
from spindle_cli.planner.memory import (
    MemoryStrategy,
    replayed_table,
    state_bytes_per_param,
)
from spindle_cli.planner.network import GaveUp, Network, row_flows
from spindle_cli.planner.workload import (
    SliceCost,
    check_inputs,
    held_shares,
    optimizer_step_ms,
    plan_curves,
    recompute,
    slice_costs,
    zero_stage,
)

FlowKind = Literal["activation", "gradient", "sync", "gather"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceTiming:
    """When one slice ran, forward and backward."""

    slice_id: str
    metaop: str
    module: str
    wave: int
    first: int
    last: int
    ranks: tuple[int, ...]
    forward_start_ms: float
    forward_end_ms: float
    backward_start_ms: float
    backward_end_ms: float
    forward_stalls: tuple[tuple[float, float], ...] = ()
    """(start, end) of each stall inside the forward for a later layer's ZeRO-1/2 all-gather
    (the forward's compute is the rest of forward_start_ms to forward_end_ms)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WaveTiming:
    """When one wave ran, and how long it waited for its inputs, in each direction."""

    index: int
    forward_start_ms: float
    forward_end_ms: float
    forward_wait_ms: float
    """Time between the previous wave's end and this wave's start (inputs in flight)."""
    backward_start_ms: float
    backward_end_ms: float
    backward_wait_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowTiming:
    """One point-to-point message between two ranks."""

    kind: FlowKind
    label: str
    """The transfer ('src->dst' slice ids), parameter group ('module[first:last]') or ZeRO-3
    weight gather ('slice:module[first:last]')."""
    src_rank: int
    dst_rank: int
    bytes: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncTiming:
    """The gradient all-reduce of one parameter group."""

    module: str
    first_layer: int
    last_layer: int
    ranks: tuple[int, ...]
    bytes: int
    start_ms: float
    end_ms: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStats:
    """Busy time and peak memory of one rank."""

    rank: int
    busy_ms: float
    """Forward+backward compute time on the rank."""
    utilization: float
    """busy_ms / iteration_ms."""
    activation_bytes: int
    """Peak simulated activation stash."""
    peak_memory_bytes: int
    """Plan's parameter + gradient + optimizer bytes plus the simulated activation peak."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaOpStats:
    """Device time and achieved FLOP rate of one MetaOp."""

    metaop: str
    module: str
    device_ms: float
    """Sum over its slices of (forward+backward time x devices)."""
    flops: float
    """Forward+backward FLOPs of all its operators."""
    mfu: float
    """flops / (device time x the device's peak FLOP/s)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SimResult:
    """One simulated training iteration of a plan.

    iteration_ms = compute_ms + transfer_ms + sync_ms + optimizer_ms exactly: compute is the
    sum of the wave durations (both directions), transfer the time waves waited for their
    inputs (exposed inter-wave communication), sync the time from the last backward wave until
    every parameter group is synchronized plus the time waves waited, once their inputs had
    arrived, for parameter all-gathers (under ZeRO-1/2 the previous step's: how much longer
    a forward wave lasted than its longest slice's compute, its slices stalled by them; under
    ZeRO-3 the weights), optimizer the rest (the slowest rank's step after its own groups'
    sync).
    With ranks on their own (`simulate`'s progress 'rank') the same four parts are the time
    of the rank that ends the iteration: its compute, its waiting (for messages, slice peers
    and gathers), its wait for its groups' sync after its last backward boundary, its step.
    """

    planner: str
    model: str
    cluster: str
    num_devices: int
    iteration_ms: float
    compute_ms: float
    forward_ms: float
    backward_ms: float
    transfer_ms: float
    sync_ms: float
    gather_wait_ms: float | None
    """With waves as barriers, the part of sync_ms the waves spent waiting for parameter
    all-gathers (ZeRO-1/2: the forward's, for the previous step's, stalls inside slices
    included; ZeRO-3: the weights, in the forward and again in the backward); None with ranks
    on their own, whose waiting counts them with the transfers."""
    optimizer_ms: float
    idle_fraction: float
    """1 - (sum of rank busy time) / (num_devices x iteration_ms)."""
    lower_bound_ms: float
    """The plan's relaxed optimum (sum over MetaLevels of C*)."""
    planned_iteration_ms: float
    """The planner's own estimate, for comparison."""
    peak_memory_bytes: int
    transfer_bytes: int
    """Inter-wave bytes that left a rank (both directions)."""
    inter_island_bytes: int
    """The part of transfer_bytes that crossed islands."""
    ranks: tuple[RankStats, ...]
    metaops: tuple[MetaOpStats, ...]
    waves: tuple[WaveTiming, ...]
    slices: tuple[SliceTiming, ...]
    flows: tuple[FlowTiming, ...]
    syncs: tuple[SyncTiming, ...]

    @property
    def transfer_fraction(self) -> float:
        """Share of the iteration spent waiting for inter-wave transfers."""
        return self.transfer_ms / self.iteration_ms if self.iteration_ms > 0 else 0.0



Progress = Literal["wave", "rank"]
"""How ranks move from wave to wave (`simulate`)."""
PROGRESS_MODES: tuple[Progress, ...] = ("wave", "rank")

def simulate(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
             sync: SyncMode | None = None, progress: Progress = "wave") -> SimResult:
    """Simulate one training iteration of `plan` (see the module docstring for the model).

    `sync` buckets the gradients as the executor does (`buckets.sync_buckets`); by default
    as it does on the cluster's backend (`buckets.backend_sync`). 'chunked' (the executor's
    on NCCL) all-reduces each group's layers in chunks as soon as the backward wave that
    completes them has passed them, overlapping the rest of the backward pass, as
    data-parallel frameworks (PyTorch DDP, DeepSpeed) do with gradient buckets; 'per-wave'
    the same with each wave's layers of a rank set in one bucket, due at the end of the wave;
    'per-set' (the executor's on gloo) one bucket per rank set, once all of its layers are
    done; 'after-backward' every group after the last backward wave.

    `progress` 'wave' (the default) runs waves as barriers, the wave model the planner plans
    with; 'rank' runs each rank on its own, as the executor does: a rank posts a boundary's
    messages when it reaches it and goes on once they have arrived, so ranks whose slices end
    early, or that exchange nothing, run ahead (a slice still starts when all of its ranks
    are there). Then the iteration's parts are the time of the rank that ends it.

    PlanError when the plan does not schedule `graph` consistently (`consistency.check_plan`).
    """
    check_plan(plan, graph)
    return _result(plan, graph, cluster,
                   _run(plan, graph, profile, cluster, progress=progress,
                        sync=backend_sync(cluster.backend) if sync is None else sync))


class QuickCost(NamedTuple):
    """What a planner choosing among candidate plans needs of one's simulation."""

    iteration_ms: float
    transfer_ms: float
    """Waiting for inter-wave transfers (`SimResult.transfer_ms`); inf when given up."""


def simulated_cost(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
                   give_up_ms: float = math.inf) -> QuickCost:
    """`simulate(...)`'s iteration and transfer wait (with the cluster backend's buckets),
    without building the per-rank, per-slice and per-flow records of the result. Once the
    simulated clock plus the least the iteration lasts beyond it passes `give_up_ms` (checked
    when a wave ends, or a flow that a wave or the gradient sync waits for ends; with waves
    as barriers the compute of the waves still to run and the longest optimizer step count
    beyond it) the simulation stops and returns that sum, a lower bound of the iteration at
    or above `give_up_ms`: a plan that cannot beat `give_up_ms` need not be simulated to the
    end."""
    try:
        timeline = _run(plan, graph, profile, cluster, sync=backend_sync(cluster.backend),
                        give_up_ms=give_up_ms, record_flows=False)
    except GaveUp as e:
        # the bound sums the clock and the rest in another order than the simulation to the
        # end would (prefix sums), so it may round an ulp above it: shave that off, staying at
        # or above give_up_ms
        bound_ms = max(give_up_ms, e.now_ms * (1 - GIVE_UP_ROUNDING))
        return QuickCost(iteration_ms=bound_ms, transfer_ms=math.inf)
    return QuickCost(iteration_ms=timeline.iteration_ms, transfer_ms=timeline.parts[2])


GIVE_UP_ROUNDING = 1e-12
"""The relative rounding `simulated_cost` takes off a lower bound it gave up at."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Timeline:
    """What `_run` computed, for `_result` to report."""

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
class _RankTimes:
    """Per rank, with ranks on their own: forward and backward compute, and the time spent
    waiting for messages, slice peers, ZeRO-3 gathers and (stalled inside a forward) ZeRO-1/2
    all-gathers, up to its last backward boundary."""

    forward_ms: list[float]
    backward_ms: list[float]
    waiting_ms: list[float]



def _run(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
         sync: SyncMode, progress: Progress = "wave", give_up_ms: float = math.inf,
         record_flows: bool = True) -> _Timeline:
    """The event-driven timeline of `simulate`; raises GaveUp once the clock passes
    `give_up_ms`. Without `record_flows` the timeline's `flow_meta` stays empty."""
    metaops = {m.id: m for m in graph.metaops}
    curves = plan_curves(plan, metaops, profile, cluster)
    check_inputs(plan, graph, metaops, curves, cluster)
    costs = slice_costs(plan, metaops, curves)
    latency_s = cluster.link_latency_s
    net = Network(cluster, give_up_ms / 1e3)
    flow_meta: list[tuple[FlowKind, str, int, int, int]] = []

    def issue(kind: FlowKind, label: str, pieces: Sequence[tuple[int, int, int]],
              start_ms: float, latency: float, after: Sequence[int] = ()) -> list[int]:
        if record_flows:
            flow_meta.extend((kind, label, src, dst, num_bytes)
                             for src, dst, num_bytes in pieces)
        return net.add(pieces, start_ms / 1e3, latency, after)

    # the all-gathers of each rank set, by issue time (ms), and their flows: a process group
    # runs its collectives one after another, in the order they were issued (NCCL: one
    # stream per communicator). The gradient reductions of a set still overlap each other
    # here.
    gathers_on: dict[tuple[int, ...], tuple[list[float], list[list[int]]]] = {}

    def all_gather(ranks: tuple[int, ...], kind: FlowKind, label: str,
                   pieces: Sequence[tuple[int, int, int]], start_ms: float,
                   latency: float) -> list[int]:
        """`issue` an all-gather over `ranks`: its flows start once the set's all-gather
        issued last at or before `start_ms` has ended. With ranks on their own, a rank
        running ahead may issue a later gather before another rank issues an earlier one: the
        earlier one does not wait for it."""
        times, flows = gathers_on.setdefault(ranks, ([], []))
        k = bisect.bisect_right(times, start_ms)
        ids = issue(kind, label, pieces, start_ms, latency, flows[k - 1] if k else ())
        if ids:
            times.insert(k, start_ms)
            flows.insert(k, ids)
        return ids

    def pieces(t_index: int, backward: bool) -> Sequence[tuple[int, int, int]]:
        t = plan.transfers[t_index]
        src, dst = costs[t.src].slice, costs[t.dst].slice
        rows = metaops[src.metaop].batch_size
        if backward:
            return row_flows(t.bytes, dst.ranks, dst.strategy, src.ranks, src.strategy, rows)
        return row_flows(t.bytes, src.ranks, src.strategy, dst.ranks, dst.strategy, rows)

    sync_ids: dict[int, list[int]] = {gi: [] for gi in range(len(plan.param_groups))}
    sync_start_ms: dict[int, float] = {}
    # ZeRO shards the optimizer state: gradients are reduce-scattered (half an all-reduce's
    # ring); below stage 3 every rank then all-gathers the stepped shards (`post_gather`)
    sharded = zero_stage(plan) >= 1
    post_gather = 1 <= zero_stage(plan) <= 2

    held = held_shares(plan, metaops)
    optimizer_ms = optimizer_step_ms(plan, graph, profile, held)

    rings_of: dict[tuple[int, ...], list[tuple[tuple[int, ...], int, list[list[int]]]]] = {}

    def shard_rings(groups: tuple[int, ...]) -> list[tuple[tuple[int, ...], int, list[list[int]]]]:
        """The rings that reduce the layers of `groups` (one rank set), per way its ranks
        hold them (`held_shares`): (the positions in `groups` of the groups held that way, T,
        rings), where shard j of T (the least common multiple of the ranks' degrees) is
        reduced over the ranks holding it, ascending (a data-parallel rank holds every
        shard, a rank of a tp<t> group shard q of t the shards j = q mod t; layers in tp2 on
        some ranks and tp3 on others are six shards, each held by one rank of each kind). A
        bucket of tensor- and data-parallel groups reduces each part on its own rings.
        Computed once per set of groups (`ring` and `ring_steps` both ask)."""
        if groups in rings_of:
            return rings_of[groups]
        ranks = plan.param_groups[groups[0]].ranks
        parts: dict[tuple[tuple[int, int], ...], list[int]] = {}
        for k, gi in enumerate(groups):
            parts.setdefault(tuple(held[gi][r] for r in ranks), []).append(k)
        out = []
        for way, positions in parts.items():
            shards = math.lcm(*(t for t, _ in way))
            out.append((tuple(positions), shards,
                        [[r for r, (t, q) in zip(ranks, way, strict=True) if j % t == q]
                         for j in range(shards)]))
        rings_of[groups] = out
        return out

    def ring(groups: tuple[int, ...], group_bytes: Sequence[int], share: float
             ) -> list[tuple[int, int, int]]:
        """Ring collectives over `group_bytes[k]` bytes of the layers of each `groups[k]`
        (one rank set), one per shard (`shard_rings`; one ring over every rank without
        tensor parallelism): each member sends its successor `share` x (c - 1) / c of the
        shard's bytes, for c members; nothing for a shard with one copy."""
        out: list[tuple[int, int, int]] = []
        for positions, shards, rings in shard_rings(groups):
            num_bytes = sum(group_bytes[k] for k in positions)
            if num_bytes <= 0:
                continue
            for members in rings:
                c = len(members)
                if c > 1:
                    each = round(share * (c - 1) / c * num_bytes / shards)
                    out += zip(members, members[1:] + members[:1], [each] * c, strict=True)
        return out

    def ring_steps(groups: tuple[int, ...]) -> int:
        """The steps of the longest shard ring (each pays a link latency)."""
        return max(len(members) for _, _, rings in shard_rings(groups)
                   for members in rings) - 1

    def label_of(groups: tuple[int, ...]) -> str:
        return "+".join(f"{plan.param_groups[gi].module}[{plan.param_groups[gi].first_layer}:"
                        f"{plan.param_groups[gi].last_layer}]" for gi in groups)

    def bucket_label(b: SyncBucket) -> str:
        """Its layers as module[first:last] runs ('+'-joined)."""
        runs: list[tuple[str, int, int]] = []
        for module, layer in sorted(b.layers):
            if runs and runs[-1][0] == module and runs[-1][2] == layer:
                runs[-1] = (module, runs[-1][1], layer + 1)
            else:
                runs.append((module, layer, layer + 1))
        return "+".join(f"{module}[{lo}:{hi}]" for module, lo, hi in runs)

    def issue_sync(groups: tuple[int, ...], group_bytes: Sequence[int], start_ms: float,
                   label: str | None = None) -> None:
        """A ring all-reduce (reduce-scatter under ZeRO) of `group_bytes[k]` of the gradients
        of each `groups[k]` (one rank set) from `start_ms`; `label`: its layers (the groups'
        by default)."""
        steps = (1 if sharded else 2) * ring_steps(groups)
        label = label or label_of(groups)
        ids = issue("sync", label, ring(groups, group_bytes, 1.0 if sharded else 2.0),
                    start_ms, steps * latency_s)
        for gi in groups:
            sync_start_ms[gi] = min(sync_start_ms.get(gi, start_ms), start_ms)
            sync_ids[gi] += ids

    weight_b = state_bytes_per_param(graph.dtype)[0]
    gathers = zero_stage(plan) >= 3

    def issue_slice_gathers(s: Slice, start_ms: float) -> list[int]:
        """ZeRO-3: all-gather the weights of slice `s` over its groups."""
        if not gathers:
            return []
        ids: list[int] = []
        m = metaops[s.metaop]
        lo, hi = m.first_layer + s.first, m.first_layer + s.last
        for gi, g in enumerate(plan.param_groups):
            layers = min(hi, g.last_layer) - max(lo, g.first_layer)
            if g.module != m.module or layers <= 0:
                continue
            pieces = ring((gi,), (layers * m.params_per_layer * weight_b,), 1.0)
            if pieces:
                ids += all_gather(g.ranks, "gather",
                                  f"{s.id}:{g.module}[{max(lo, g.first_layer)}:"
                                  f"{min(hi, g.last_layer)}]", pieces, start_ms,
                                  ring_steps((gi,)) * latency_s)
        return ids

    def issue_gathers(wave: int, start_ms: float) -> list[int]:
        """ZeRO-3: all-gather the weights of every slice of the wave over its groups."""
        if not 0 <= wave < len(plan.waves):
            return []
        return [i for s in plan.waves[wave].slices for i in issue_slice_gathers(s, start_ms)]

    due_in_wave: dict[int, list[SyncBucket]] = {}
    for b in sync_buckets(plan, metaops, sync):
        due_in_wave.setdefault(b.wave, []).append(b)
    # ZeRO-1/2: the previous step's all-gather of every bucket (every group, without buckets)
    # leaves at 0, the buckets in reverse (the order the forward first uses their layers, as
    # the executor issues them), each rank set's one after another; `prior` holds, per slice,
    # the flows its forward waits for before each of its operators, as runs of operators that
    # wait for the same ones: (position of the run's first operator in the slice, flows)
    prior: dict[str, list[tuple[int, list[int]]]] = {}
    if post_gather:
        units = [(b.groups, b.group_bytes, bucket_label(b), b.layers)
                 for bs in reversed(due_in_wave.values()) for b in reversed(bs)]
        if not units:
            units = [((gi,), (g.bytes,), label_of((gi,)),
                      tuple((g.module, layer) for layer in range(g.first_layer, g.last_layer)))
                     for gi, g in enumerate(plan.param_groups)]
        gathered: dict[tuple[str, int], list[int]] = {}
        for groups, group_bytes, label, layers in units:
            g = plan.param_groups[groups[0]]
            ids = all_gather(g.ranks, "sync", f"all-gather {label}",
                             ring(groups, group_bytes, 1.0), 0.0, ring_steps(groups) * latency_s)
            for key in layers:
                gathered.setdefault(key, []).extend(ids)
        for _, sl in plan.slices():
            m = metaops[sl.metaop]
            runs: list[tuple[int, list[int]]] = []
            for pos in range(sl.num_layers):
                ids = gathered.get((m.module, m.first_layer + sl.first + pos), [])
                if ids and (not runs or runs[-1][1] != ids):
                    runs.append((pos, ids))
            prior[sl.id] = runs

    into_wave: dict[int, list[int]] = {}
    for i, t in enumerate(plan.transfers):
        into_wave.setdefault(costs[t.dst].wave, []).append(i)

    def boundary_messages(wave: int, backward: bool
                          ) -> list[tuple[FlowKind, str, list[tuple[int, int, int]]]]:
        """(kind, label, pieces) of every transfer into `wave`: its inputs' activations
        (forward) or, after its backward, their gradients back."""
        kind: FlowKind = "gradient" if backward else "activation"
        found = []
        for i in into_wave.get(wave, []):
            t = plan.transfers[i]
            label = f"{t.dst}->{t.src}" if backward else f"{t.src}->{t.dst}"
            found.append((kind, label, list(pieces(i, backward))))
        return found

    def issue_boundary(wave: int, backward: bool, ready_ms: list[float],
                       waiter: Callable[[int, int], int] | None = None) -> dict[int, list[int]]:
        """The messages of the boundary into `wave` (`boundary_messages`), by the wave that
        waits for them: `waiter(src, dst)` of each message's ranks (`wave` itself without
        it). A message starts once both of its ranks have reached the boundary (`ready_ms`),
        as the executor posts a boundary's messages together; a rank moves on when all of
        them have arrived. Not before the network's clock: where a slice stalled for an
        all-gather (`run_forward`) the clock may have passed a shorter slice's end, whose
        messages then leave late."""
        ids: dict[int, list[int]] = {}
        now_ms = net.now_s * 1e3
        for kind, label, found in boundary_messages(wave, backward):
            by_start: dict[float, list[tuple[int, int, int]]] = {}
            for src, dst, num_bytes in found:
                start = max(ready_ms[src], ready_ms[dst], now_ms)
                by_start.setdefault(start, []).append((src, dst, num_bytes))
            for start, group in sorted(by_start.items()):
                for (src, dst, _), i in zip(group, issue(kind, label, group, start, latency_s),
                                            strict=True):
                    ids.setdefault(wave if waiter is None else waiter(src, dst), []).append(i)
        return ids

    def reached(w: Wave, start_ms: float, end: int) -> list[float]:
        """When each rank reaches the boundary after wave `w` (started at `start_ms`): the end
        of its slices (`starts` index `end`), or the wave's start for a rank with none."""
        ready_ms = [start_ms] * plan.num_devices
        for s in w.slices:
            for r in s.ranks:
                ready_ms[r] = max(ready_ms[r], starts[s.id][end])
        return ready_ms

    def gathered_at(s: Slice, pos: int, start_ms: float, stall_ms: float,
                    gathered_ms: float) -> tuple[float, float]:
        """Slice `s`'s forward start and stall so far (`start_ms`, `stall_ms`) once it has
        waited for the all-gathers of its operators from `pos` on (`prior`), ended at
        `gathered_ms`: the executor waits before the first operator of each bucket, so the
        slice stalls there (before it starts, where pos is 0; a stall inside it is recorded
        in `stalls`)."""
        at_ms = start_ms + stall_ms + costs[s.id].forward_ms * pos / s.num_layers
        wait_ms = max(0.0, gathered_ms - at_ms)
        if pos == 0:
            return start_ms + wait_ms, stall_ms
        if wait_ms > 0:
            stalls.setdefault(s.id, []).append((at_ms, gathered_ms))
        return start_ms, stall_ms + wait_ms

    starts: dict[str, list[float]] = {s.id: [0.0] * 4 for _, s in plan.slices()}
    stalls: dict[str, list[tuple[float, float]]] = {}
    fwd_timing: list[tuple[float, float, float]] = []
    bwd_timing: dict[int, tuple[float, float, float]] = {}

    param_wait_ms = [0.0]
    """With waves as barriers: the part of the waves' waits spent on ZeRO-3 weight gathers
    after the inputs had arrived (counted as sync, not as transfer)."""

    def wait_for(now_ms: float, inputs: list[int], params: list[int]) -> float:
        """When a wave whose predecessor ended at `now_ms` starts: once the flows of its
        inputs and of its parameter all-gathers have ended."""
        inputs_ms = max(now_ms, net.finish(inputs) * 1e3)
        start_ms = max(inputs_ms, net.finish(params) * 1e3)
        param_wait_ms[0] += start_ms - inputs_ms
        return start_ms

    stalled_ms = [0.0]
    """With waves as barriers: how much longer the forward waves lasted than their longest
    slice's compute, their slices stalled by parameter all-gathers (counted as sync)."""

    def run_forward(s: Slice, ready_ms: float, rest_ms: float) -> None:
        """Slice `s`'s forward, its ranks ready at `ready_ms`, into `starts`: before each run
        of its operators that waits for all-gathers (`prior`) it stalls until they have ended
        (the executor waits before the first operator of each bucket); `rest_ms` is the least
        the iteration lasts past the slice's end."""
        c = costs[s.id]
        start_ms, stall_ms = ready_ms, 0.0
        for pos, ids in prior.get(s.id, ()):
            net.tail_s = (c.forward_ms * (s.num_layers - pos) / s.num_layers + rest_ms) / 1e3
            start_ms, stall_ms = gathered_at(s, pos, start_ms, stall_ms, net.finish(ids) * 1e3)
        starts[s.id][0] = start_ms
        starts[s.id][1] = start_ms + c.forward_ms + stall_ms

    def barrier_loops() -> tuple[list[float], _RankTimes | None]:
        """Waves as barriers (`Progress` 'wave'). Gives up (`give_up_ms`) as soon as the
        iteration must outlast it: a wave lasts at least its longest slice, and every rank
        steps its optimizer after the last backward, so the iteration lasts at least the
        waves still to compute, and the longest optimizer step, past any wave's start or
        end."""
        fwd_ms = [max([costs[s.id].forward_ms for s in w.slices], default=0.0)
                  for w in plan.waves]
        bwd_ms = [max([costs[s.id].backward_ms for s in w.slices], default=0.0)
                  for w in plan.waves]
        # the least the iteration lasts past the start of wave k's forward (fwd_rest[k]) or
        # backward (bwd_rest[k]), and past their ends (index k + 1 and k)
        bwd_rest = list(itertools.accumulate(bwd_ms, initial=max(optimizer_ms, default=0.0)))
        fwd_rest = list(itertools.accumulate(reversed(fwd_ms), initial=bwd_rest[-1]))[::-1]

        def give_up_past(now_ms: float, rest_ms: float) -> None:
            if now_ms + rest_ms > give_up_ms:
                raise GaveUp(now_ms + rest_ms)

        now_ms = 0.0
        ready = [0.0] * plan.num_devices
        prefetched = {0: issue_gathers(0, 0.0)}
        for w in plan.waves:
            inputs = issue_boundary(w.index, False, ready).get(w.index, [])
            net.tail_s = fwd_rest[w.index] / 1e3
            start_ms = wait_for(now_ms, inputs, prefetched.pop(w.index))
            prefetched[w.index + 1] = issue_gathers(w.index + 1, start_ms)
            end_ms = computed_ms = start_ms
            for s in w.slices:
                run_forward(s, start_ms, fwd_rest[w.index + 1])
                end_ms = max(end_ms, starts[s.id][1])
                computed_ms = max(computed_ms, start_ms + costs[s.id].forward_ms)
            stalled_ms[0] += end_ms - computed_ms
            ready = reached(w, start_ms, 1)
            fwd_timing.append((start_ms, end_ms, start_ms - now_ms))
            now_ms = end_ms
            give_up_past(now_ms, fwd_rest[w.index + 1])

        # a rank waits for the messages of a boundary before its next compute (the
        # executor's batch wait): a gradient message is waited for by the first wave below
        # its boundary with a slice on either of its ranks (wave 0, the last, where neither
        # computes again), not by a wave its ranks take no part in
        computes_in = [[] for _ in range(plan.num_devices)]
        for w in plan.waves:
            for s in w.slices:
                for r in s.ranks:
                    computes_in[r].append(w.index)

        def waiter(below: int) -> Callable[[int, int], int]:
            def first_below(src: int, dst: int) -> int:
                return max((waves[k - 1] for waves in (computes_in[src], computes_in[dst])
                            if (k := bisect.bisect_left(waves, below))), default=0)
            return first_below

        waiting: dict[int, list[int]] = {}
        prefetched = {len(plan.waves) - 1: issue_gathers(len(plan.waves) - 1, now_ms)}
        for w in reversed(plan.waves):
            net.tail_s = bwd_rest[w.index + 1] / 1e3
            start_ms = wait_for(now_ms, waiting.pop(w.index, []), prefetched.pop(w.index))
            prefetched[w.index - 1] = issue_gathers(w.index - 1, start_ms)
            end_ms = start_ms
            for s in w.slices:
                starts[s.id][2] = start_ms
                starts[s.id][3] = start_ms + costs[s.id].backward_ms
                end_ms = max(end_ms, starts[s.id][3])
            for below, ids in issue_boundary(w.index, True, reached(w, start_ms, 3),
                                             waiter(w.index)).items():
                waiting.setdefault(below, []).extend(ids)
            # every rank starts the wave's backward at start_ms; a rank issues its buckets of
            # several ranks in their one global order (the executor's queue)
            issued_at: dict[int, float] = {}
            for b in due_in_wave.get(w.index, []):
                at = max([start_ms, *(issued_at.get(r, start_ms) for r in b.ranks),
                          *(starts[sid][2] + costs[sid].passed_ms(k) for sid, k in b.passes)])
                if len(b.ranks) > 1:
                    issued_at.update((r, at) for r in b.ranks)
                issue_sync(b.groups, b.group_bytes, at, bucket_label(b))
            bwd_timing[w.index] = (start_ms, end_ms, start_ms - now_ms)
            now_ms = end_ms
            give_up_past(now_ms, bwd_rest[w.index])
        return [now_ms] * plan.num_devices, None

    def rank_loops() -> tuple[list[float], _RankTimes]:
        """Each rank on its own (`Progress` 'rank'): it posts the messages of a boundary
        when it reaches it and goes on once they have arrived; a slice starts when all of its
        ranks are there (and, under ZeRO-3, its weights, gathered from when its ranks started
        their previous compute step). Ranks are advanced in turn, each as far as it can go
        (one slice at a time), and the network only when every rank waits for a flow, so no
        flow starts before the network's clock; a rank running ahead may still issue flows
        later in time than another rank's next ones (`all_gather` queues by time)."""
        n = plan.num_devices
        # every rank's program: the boundary into each wave and its forward, then each wave's
        # backward and the gradients of its boundary back; (compute?, wave, backward)
        steps: list[tuple[bool, int, bool]] = []
        for w in range(len(plan.waves)):
            steps += [(False, w, False), (True, w, False)]
        for w in reversed(range(len(plan.waves))):
            steps += [(True, w, True), (False, w, True)]
        computes = [k for k, st in enumerate(steps) if st[0]]
        next_compute = dict(zip(computes, computes[1:], strict=False))
        slice_at = [{r: s for s in w.slices for r in s.ranks} for w in plan.waves]
        # a boundary's messages one by one: (kind, label, src, dst, bytes), and each rank's
        messages: dict[int, list[tuple[FlowKind, str, int, int, int]]] = {}
        mine: dict[tuple[int, int], list[int]] = {}
        for k, (is_compute, w, backward) in enumerate(steps):
            if is_compute:
                continue
            found = messages.setdefault(k, [])
            for kind, label, parts in boundary_messages(w, backward):
                for src, dst, num_bytes in parts:
                    for r in (src, dst):
                        mine.setdefault((k, r), []).append(len(found))
                    found.append((kind, label, src, dst, num_bytes))
        # a bucket's all-reduce runs once every rank of its set has issued it: a rank issues
        # it when its slice of the due wave has passed the bucket's layers (`passes`), or when
        # it starts that wave's backward if its slice runs none of them, and after the
        # buckets of the same set before it
        passed: dict[int, dict[int, float]] = {id(b): {} for bs in due_in_wave.values()
                                                for b in bs}
        passes = {id(b): dict(b.passes) for bs in due_in_wave.values() for b in bs}
        issued_at: dict[int, float] = {}
        # groups in no bucket sync whole once all of their ranks are through the backward
        bucketed = {gi for bs in due_in_wave.values() for b in bs for gi in b.groups}
        whole = [gi for gi in range(len(plan.param_groups)) if gi not in bucketed]
        pos, clock = [0] * n, [0.0] * n
        forward, backward_ms, waiting_ms = [0.0] * n, [0.0] * n, [0.0] * n
        # when each rank reached each step; the flow of each (boundary step, message)
        arrived: dict[tuple[int, int], float] = {}
        flow_of: dict[tuple[int, int], int] = {}
        # when each rank started (or passed) each compute step; a slice's ZeRO-3 gathers at
        # a compute step; the flows a blocked rank waits for
        computed: dict[tuple[int, int], float] = {}
        weights: dict[tuple[int, str], list[int]] = {}
        waits_on: dict[int, list[int]] = {}
        # a forward stalled for an all-gather: its next run of operators, start, stall so far
        forwarding: dict[tuple[int, str], tuple[int, float, float]] = {}

        def finished(ids: list[int]) -> bool:
            return not np.isnan(net.end_s[ids]).any()

        def pass_compute(k: int, r: int, at_ms: float) -> None:
            """Rank r starts (or passes) compute step k at `at_ms`: the next compute step's
            slice gathers its weights once all of its ranks have."""
            computed[(k, r)] = at_ms
            nxt = next_compute.get(k)
            s = slice_at[steps[nxt][1]].get(r) if nxt is not None else None
            if s is not None and all((k, q) in computed for q in s.ranks):
                weights[(nxt, s.id)] = issue_slice_gathers(
                    s, max(computed[(k, q)] for q in s.ranks))

        def through_backward(w: int, r: int, start_ms: float, s: Slice | None = None) -> None:
            """Rank r started wave w's backward at `start_ms`, running slice `s` (if any): it
            issues the wave's buckets of its sets."""
            for b in due_in_wave.get(w, []):
                if r not in b.ranks:
                    continue
                k = passes[id(b)].get(s.id) if s is not None else None
                ready = start_ms if k is None else start_ms + costs[s.id].passed_ms(k)
                at = max(ready, issued_at.get(r, ready))
                if len(b.ranks) > 1:
                    issued_at[r] = at
                passed[id(b)][r] = at
                if len(passed[id(b)]) == len(b.ranks):
                    issue_sync(b.groups, b.group_bytes, max(passed[id(b)].values()),
                               bucket_label(b))

        def run_slice(k: int, s: Slice, start_ms: float, stall_ms: float = 0.0) -> None:
            """Slice `s` runs compute step k from `start_ms`, stalled `stall_ms` on the way
            (a forward's all-gathers, `gathered_at`)."""
            _, w, backward = steps[k]
            c = costs[s.id]
            cost_ms = c.backward_ms if backward else c.forward_ms
            starts[s.id][2 if backward else 0] = start_ms
            starts[s.id][3 if backward else 1] = start_ms + cost_ms + stall_ms
            for q in s.ranks:
                waiting_ms[q] += start_ms - arrived[(k, q)] + stall_ms
                (backward_ms if backward else forward)[q] += cost_ms
                clock[q] = start_ms + cost_ms + stall_ms
                pos[q] += 1
                waits_on.pop(q, None)
                pass_compute(k, q, start_ms)
                if backward:
                    through_backward(w, q, start_ms, s)
            if clock[s.ranks[0]] > give_up_ms:
                raise GaveUp(clock[s.ranks[0]])

        def advance(r: int) -> bool:
            """Move rank r on as far as it can go now; whether it moved."""
            moved = False
            while pos[r] < len(steps):
                k = pos[r]
                is_compute, w, _ = steps[k]
                if (k, r) not in arrived:
                    arrived[(k, r)] = clock[r]
                    moved = True
                    for j in mine.get((k, r), []):
                        kind, label, src, dst, num_bytes = messages[k][j]
                        if (k, dst if src == r else src) in arrived:
                            start_ms = max(arrived[(k, src)], arrived[(k, dst)])
                            flow_of[(k, j)] = issue(kind, label, [(src, dst, num_bytes)],
                                                    start_ms, latency_s)[0]
                if is_compute:
                    s = slice_at[w].get(r)
                    if s is None:
                        pass_compute(k, r, clock[r])
                        if steps[k][2]:
                            through_backward(w, r, clock[r])
                        pos[r] += 1
                        continue
                    if not all((k, q) in arrived for q in s.ranks):
                        return moved
                    ids = weights.get((k, s.id), [])
                    if not finished(ids):
                        for q in s.ranks:
                            waits_on[q] = ids
                        return moved
                    # a forward waits for its all-gathers run by run, from where it stalled
                    first, start_ms, stall_ms = forwarding.pop((k, s.id), (0, max(
                        [*(arrived[(k, q)] for q in s.ranks),
                         *(float(net.end_s[i]) * 1e3 for i in ids)]), 0.0))
                    runs = [] if steps[k][2] else prior.get(s.id, [])
                    for j in range(first, len(runs)):
                        at, gathers = runs[j]
                        if not finished(gathers):
                            forwarding[(k, s.id)] = (j, start_ms, stall_ms)
                            for q in s.ranks:
                                waits_on[q] = gathers
                            return moved
                        start_ms, stall_ms = gathered_at(
                            s, at, start_ms, stall_ms, float(net.end_s[gathers].max()) * 1e3)
                    run_slice(k, s, start_ms, stall_ms)
                    return True
                ids = [flow_of.get((k, j), -1) for j in mine.get((k, r), [])]
                if -1 in ids:
                    return moved
                if not finished(ids):
                    waits_on[r] = ids
                    return moved
                leave_ms = max([clock[r], *(float(net.end_s[i]) * 1e3 for i in ids)])
                waiting_ms[r] += leave_ms - clock[r]
                clock[r] = leave_ms
                pos[r] += 1
                waits_on.pop(r, None)
                if pos[r] == len(steps):
                    for gi in whole:
                        g = plan.param_groups[gi]
                        if r in g.ranks and all(pos[q] == len(steps) for q in g.ranks):
                            issue_sync((gi,), (g.bytes,), max(clock[q] for q in g.ranks))
            return moved

        first = computes[0] if computes else None
        if first is not None:
            for s in plan.waves[steps[first][1]].slices:
                weights[(first, s.id)] = issue_slice_gathers(s, 0.0)
        while True:
            moved = True
            while moved:
                moved = False
                for r in range(n):
                    if pos[r] < len(steps) and advance(r):
                        moved = True
            if all(p == len(steps) for p in pos):
                break
            assert waits_on, "every rank waits for a peer that never comes"
            while not any(finished(ids) for ids in waits_on.values()):
                net.step()
        for w in plan.waves:
            f0 = min(starts[s.id][0] for s in w.slices)
            f1 = max(starts[s.id][1] for s in w.slices)
            prev = fwd_timing[-1][1] if fwd_timing else 0.0
            fwd_timing.append((f0, f1, max(0.0, f0 - prev)))
        prev = fwd_timing[-1][1] if fwd_timing else 0.0
        for w in reversed(plan.waves):
            b0 = min(starts[s.id][2] for s in w.slices)
            b1 = max(starts[s.id][3] for s in w.slices)
            bwd_timing[w.index] = (b0, b1, max(0.0, b0 - prev))
            prev = b1
        return clock, _RankTimes(forward_ms=forward, backward_ms=backward_ms,
                                 waiting_ms=waiting_ms)

    end_ms, rank_times = barrier_loops() if progress == "wave" else rank_loops()
    backward_end_ms = max(end_ms)

    for gi, g in enumerate(plan.param_groups):
        if gi not in sync_start_ms:
            issue_sync((gi,), (g.bytes,), max(end_ms[r] for r in g.ranks))
    groups_of: list[list[int]] = [[] for _ in range(plan.num_devices)]
    for gi, g in enumerate(plan.param_groups):
        for r in g.ranks:
            groups_of[r].append(gi)

    def stepped_ms(r: int) -> float:
        """When rank r has stepped: its optimizer runs once its backward and its own groups'
        reductions are done."""
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
    if rank_times is None:
        forward_ms = sum(end - start for start, end, _ in fwd_timing) - stalled_ms[0]
        backward_ms = sum(end - start for start, end, _ in bwd_timing.values())
        transfer_ms = (sum(wait for _, _, wait in fwd_timing)
                       + sum(wait for _, _, wait in bwd_timing.values()) - param_wait_ms[0])
        # the step: how long the last rank steps past the last reduction; the sync: the
        # reductions past the last backward (taken directly: a rank without groups syncs
        # exactly nothing, not the rounding left by subtracting the step), and the waves'
        # waits and stalls for parameter all-gathers
        step_ms = max(0.0, max(through_ms) - reduced_all_ms)
        parts = (forward_ms, backward_ms, transfer_ms,
                 reduced_all_ms - backward_end_ms + param_wait_ms[0] + stalled_ms[0], step_ms)
    else:
        # the rank that ends the iteration: its own time is compute, waiting, sync, step
        r = max(range(plan.num_devices), key=lambda q: (through_ms[q], -q))
        reduced_r = max([end_ms[r], *(reduced_ms[gi] for gi in groups_of[r])])
        parts = (rank_times.forward_ms[r], rank_times.backward_ms[r],
                 rank_times.waiting_ms[r], reduced_r - end_ms[r], optimizer_ms[r])

    return _Timeline(costs=costs, starts=starts, stalls=stalls, net=net, flow_meta=flow_meta,
                     fwd_timing=fwd_timing, bwd_timing=bwd_timing, sync_start_ms=sync_start_ms,
                     sync_end_ms=reduced_ms, iteration_ms=iteration_ms,
                     gather_wait_ms=None if rank_times is not None
                     else param_wait_ms[0] + stalled_ms[0], parts=parts)


def _result(plan: Plan, graph: MetaOpGraph, cluster: ClusterSpec, timeline: _Timeline
            ) -> SimResult:
    costs, starts, net, flow_meta = (timeline.costs, timeline.starts, timeline.net,
                                     timeline.flow_meta)
    fwd_timing, bwd_timing = timeline.fwd_timing, timeline.bwd_timing
    sync_start_ms, sync_end_ms = timeline.sync_start_ms, timeline.sync_end_ms
    iteration_ms = timeline.iteration_ms
    waves = tuple(
        WaveTiming(index=w.index, forward_start_ms=fwd_timing[w.index][0],
                   forward_end_ms=fwd_timing[w.index][1], forward_wait_ms=fwd_timing[w.index][2],
                   backward_start_ms=bwd_timing[w.index][0],
                   backward_end_ms=bwd_timing[w.index][1],
                   backward_wait_ms=bwd_timing[w.index][2])
        for w in plan.waves
    )
    forward_ms, backward_ms, transfer_ms, sync_ms, optimizer_ms = timeline.parts

    busy = [0.0] * plan.num_devices
    device_ms: dict[str, float] = {}
    slices = []
    for _, s in plan.slices():
        c, m = costs[s.id], graph.metaop(s.metaop)
        for r in s.ranks:
            busy[r] += c.forward_ms + c.backward_ms
        device_ms[s.metaop] = device_ms.get(s.metaop, 0.0) + (
            c.forward_ms + c.backward_ms) * len(s.ranks)
        st = starts[s.id]
        slices.append(SliceTiming(
            slice_id=s.id, metaop=s.metaop, module=m.module, wave=c.wave, first=s.first,
            last=s.last, ranks=s.ranks, forward_start_ms=st[0], forward_end_ms=st[1],
            backward_start_ms=st[2], backward_end_ms=st[3],
            forward_stalls=tuple(timeline.stalls.get(s.id, ()))))

    # what the slices keep for backward, as memory.py counts it (the plan's own table)
    stash = [rm.activation_bytes for rm in replayed_table(
        plan, graph, MemoryStrategy(zero=zero_stage(plan), recompute=recompute(plan)))]
    static = {rm.rank: rm.param_bytes + rm.grad_bytes + rm.optimizer_bytes for rm in plan.memory}
    ranks = tuple(
        RankStats(rank=r, busy_ms=busy[r],
                  utilization=busy[r] / iteration_ms if iteration_ms > 0 else 0.0,
                  activation_bytes=stash[r], peak_memory_bytes=static.get(r, 0) + stash[r])
        for r in range(plan.num_devices)
    )
    peak_flops_per_ms = cluster.device.peak_flops / 1e3
    metaops = tuple(
        MetaOpStats(metaop=m.id, module=m.module, device_ms=device_ms[m.id],
                    flops=m.flops_per_layer * m.num_layers,
                    mfu=m.flops_per_layer * m.num_layers / (device_ms[m.id] * peak_flops_per_ms)
                    if device_ms[m.id] > 0 else 0.0)
        for m in graph.metaops if m.id in device_ms
    )

    flows = tuple(
        FlowTiming(kind=kind, label=label, src_rank=src, dst_rank=dst, bytes=num_bytes,
                   start_ms=float(net.ready_s[i]) * 1e3, end_ms=float(net.end_s[i]) * 1e3)
        for i, (kind, label, src, dst, num_bytes) in enumerate(flow_meta)
    )
    moved = [f for f in flows if f.kind in ("activation", "gradient")]
    syncs = tuple(
        SyncTiming(module=g.module, first_layer=g.first_layer, last_layer=g.last_layer,
                   ranks=g.ranks, bytes=g.bytes, start_ms=sync_start_ms[gi],
                   end_ms=sync_end_ms[gi])
        for gi, g in enumerate(plan.param_groups)
    )
    total_busy = sum(busy)
    return SimResult(
        planner=plan.planner, model=plan.model, cluster=plan.cluster,
        num_devices=plan.num_devices, iteration_ms=iteration_ms,
        compute_ms=forward_ms + backward_ms, forward_ms=forward_ms, backward_ms=backward_ms,
        transfer_ms=transfer_ms, sync_ms=sync_ms, gather_wait_ms=timeline.gather_wait_ms,
        optimizer_ms=optimizer_ms,
        idle_fraction=1.0 - total_busy / (plan.num_devices * iteration_ms)
        if iteration_ms > 0 else 0.0,
        lower_bound_ms=plan.lower_bound_ms, planned_iteration_ms=plan.estimated_iteration_ms,
        peak_memory_bytes=max((r.peak_memory_bytes for r in ranks), default=0),
        transfer_bytes=sum(f.bytes for f in moved),
        inter_island_bytes=sum(f.bytes for f in moved
                               if cluster.island_of(f.src_rank) != cluster.island_of(f.dst_rank)),
        ranks=ranks, metaops=metaops, waves=waves, slices=tuple(slices), flows=flows,
        syncs=syncs,
    )
