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

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.artifacts.plan import Plan
from spindle_cli.artifacts.profile import Profile
from spindle_cli.planner.buckets import SyncMode, backend_sync
from spindle_cli.planner.consistency import check_plan
from spindle_cli.planner.iteration import FlowKind, Iteration, Timeline
from spindle_cli.planner.memory import MemoryStrategy, replayed_table
from spindle_cli.planner.network import GIVE_UP_ROUNDING, GaveUp
from spindle_cli.planner.progress import run_barriers, run_ranks
from spindle_cli.planner.workload import recompute, zero_stage


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


def _run(plan: Plan, graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec, *,
         sync: SyncMode, progress: Progress = "wave", give_up_ms: float = math.inf,
         record_flows: bool = True) -> Timeline:
    """The event-driven timeline of `simulate`; raises GaveUp once the clock passes
    `give_up_ms`. Without `record_flows` the timeline's `flow_meta` stays empty."""
    it = Iteration(plan, graph, profile, cluster, sync=sync, give_up_ms=give_up_ms,
                   record_flows=record_flows)
    end_ms, rank_times = run_barriers(it) if progress == "wave" else run_ranks(it)
    return it.timeline(end_ms, rank_times)


def _result(plan: Plan, graph: MetaOpGraph, cluster: ClusterSpec, timeline: Timeline
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
    total_busy = math.fsum(busy)
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
