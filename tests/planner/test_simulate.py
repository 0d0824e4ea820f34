"""The simulator on hand-built plans with exact expected times (see _sim_fixtures for the
numbers: enc 2 layers x 3 ms/sample, head 1 layer x 1.5 ms/sample, batch 4, a 400 MB
activation, NVLink 100 GB/s per rank inside each 2-rank island (one per node), a 20 GB/s NIC
per node)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import _sim_fixtures as fx
import plan_builders as pb
import pytest

from spindle_cli.artifacts import ClusterSpec, ModelSpec, Plan, load
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.plan import (
    LevelBound,
    ParamGroup,
    RankMemory,
    Slice,
    Transfer,
    Wave,
)
from spindle_cli.errors import SpindleError
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.bench import profile_for
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.network import row_flows
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.simulate import simulate, simulated_cost


def approx_spans(spans: list[tuple[float, float]]) -> list[object]:
    """(start, end) pairs each compared approximately (pytest.approx refuses nested
    sequences from pytest 9.2 on)."""
    return [pytest.approx(span) for span in spans]


def run(plan=None, *, latency_s: float = 0.0, batch: int = fx.BATCH, num_nodes: int = 2,
        sync: str = "per-wave"):
    """The fixture plan simulated; per wave by default (each group's layers of one wave in one
    bucket), which the hand-computed times below assume."""
    return simulate(plan or fx.plan(), fx.graph(batch), fx.profile(batch),
                    fx.cluster(latency_s=latency_s, num_nodes=num_nodes), sync=sync)


def test_two_waves_one_transfer_one_sync_group_exact_times():
    r = run()
    # enc on 2 ranks: 2 layers x 3 ms x 4/2 samples = 12 ms -> forward 4, backward 8.
    # head on 2 ranks: 1 layer x 1.5 ms x 2 samples = 3 ms -> forward 1, backward 2.
    # Activations: 200 MB from rank 0 -> 2 and 1 -> 3 share node 0's 20 GB/s NIC: 20 ms.
    w0, w1 = r.waves
    assert (w0.forward_start_ms, w0.forward_end_ms) == pytest.approx((0.0, 4.0))
    assert (w1.forward_start_ms, w1.forward_end_ms) == pytest.approx((24.0, 25.0))
    assert (w1.backward_start_ms, w1.backward_end_ms) == pytest.approx((25.0, 27.0))
    assert (w0.backward_start_ms, w0.backward_end_ms) == pytest.approx((47.0, 55.0))
    # Ring all-reduce of 1 GB over 2 ranks: 2(p-1)/p * 1 GB = 1 GB at 100 GB/s = 10 ms, once
    # enc's backward is done. head's 0.5 GB (5 ms) starts when head's backward ends, on
    # NVLink ports the gradient transfer (on the NICs) does not use.
    enc_sync, head_sync = r.syncs
    assert (enc_sync.start_ms, enc_sync.end_ms) == pytest.approx((55.0, 65.0))
    assert (head_sync.start_ms, head_sync.end_ms) == pytest.approx((27.0, 32.0))
    assert r.iteration_ms == pytest.approx(65.0)
    assert r.compute_ms == pytest.approx(15.0)
    assert r.forward_ms == pytest.approx(5.0)
    assert r.backward_ms == pytest.approx(10.0)
    assert r.transfer_ms == pytest.approx(40.0)
    assert r.sync_ms == pytest.approx(10.0)
    assert r.idle_fraction == pytest.approx(1 - (12 + 12 + 3 + 3) / (4 * 65.0))
    assert r.transfer_fraction == pytest.approx(40 / 65)
    assert r.lower_bound_ms == 7.5 and r.planned_iteration_ms == 15.0


def test_chunked_buckets_sync_a_slices_upper_layers_during_its_backward():
    # The default, as the executor buckets on NCCL: enc's 1 GB group is two 0.5 GB layers,
    # each a chunk (at least a quarter of the bucket). enc's backward runs 47-55, 4 ms per
    # layer, top layer first: layer 1's ring (0.5 GB at 100 GB/s, 5 ms) starts at 51; layer
    # 0's at 55, when 0.1 GB of the first is left. They share the NVLink ports at 50 GB/s
    # each, so the first ends at 57 and the second, alone for its last 0.4 GB, at 61.
    r = run(sync="chunked")
    rings = sorted((f.label, f.start_ms, f.end_ms) for f in r.flows
                   if f.kind == "sync" and f.label.startswith("enc"))
    assert rings == [("enc[0:1]", 55.0, pytest.approx(61.0))] * 2 + [
        ("enc[1:2]", 51.0, pytest.approx(57.0))] * 2
    enc_sync, head_sync = r.syncs
    assert (enc_sync.start_ms, enc_sync.end_ms) == pytest.approx((51.0, 61.0))
    assert (head_sync.start_ms, head_sync.end_ms) == pytest.approx((27.0, 32.0))
    assert r.iteration_ms == pytest.approx(61.0)
    assert r.sync_ms == pytest.approx(6.0)
    assert simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster()).iteration_ms == 61.0


@pytest.mark.parametrize("progress", ["wave", "rank"])
def test_recomputation_runs_before_each_operators_backward(progress):
    # The executor checkpoints operator by operator: each layer's forward runs again right
    # before its backward. enc's backward is 8 ms + 4 ms recomputed (2 + 4 per layer) from
    # 48; head's 2 + 1 ms from 25. enc's top layer is complete at 54 (not at 56, as if both
    # forwards ran first): its 0.5 GB ring 54-59, layer 0's at 60-65.
    plan = dataclasses.replace(fx.plan(), options={**fx.plan().options, "recompute": "true"})
    r = simulate(plan, fx.graph(), fx.profile(), fx.cluster(), sync="chunked",
                 progress=progress)
    assert [(w.backward_start_ms, w.backward_end_ms) for w in r.waves] == approx_spans(
        [(48.0, 60.0), (25.0, 28.0)])
    rings = sorted({(f.label, f.start_ms, f.end_ms) for f in r.flows if f.kind == "sync"})
    assert rings == [("enc[0:1]", 60.0, pytest.approx(65.0)),
                     ("enc[1:2]", 54.0, pytest.approx(59.0)),
                     ("head[0:1]", 28.0, pytest.approx(33.0))]
    assert r.iteration_ms == pytest.approx(65.0)


def test_the_default_buckets_are_those_of_the_clusters_backend():
    # nccl (the default backend) chunks, as above: 61 ms. On gloo the executor makes one
    # bucket per rank set, due once its layers are done: enc's 1 GB at 55-65, head's at 27-32.
    plan, graph, profile = fx.plan(), fx.graph(), fx.profile()
    gloo = dataclasses.replace(fx.cluster(), backend="gloo")
    r = simulate(plan, graph, profile, gloo)
    assert r.iteration_ms == pytest.approx(65.0)
    assert [(s.start_ms, s.end_ms) for s in r.syncs] == approx_spans([(55.0, 65.0),
                                                                      (27.0, 32.0)])
    assert r == simulate(plan, graph, profile, gloo, sync="per-set")
    # the planner's cost follows the backend too
    assert simulated_cost(plan, graph, profile, gloo).iteration_ms == pytest.approx(65.0)
    assert simulated_cost(plan, graph, profile, fx.cluster()).iteration_ms == pytest.approx(61.0)


def test_messages_wait_for_the_boundary_of_their_consumers_wave():
    # The executor posts a boundary's messages when both ranks reach it, so a transfer that
    # skips a wave does not overlap that wave. enc (ranks 0-1) forward 0-4; aux (ranks 2-3)
    # forward 4-5; the 400 MB into head leaves once both ends reach wave 2's boundary: ranks
    # 0-1 at 4 (idle in wave 1), ranks 2-3 at 5, so 5-25 over node 0's NIC; head 25-26.
    r = simulate(fx.plan_skipping_a_wave(), fx.graph_with_aux(), fx.profile_with_aux(),
                 fx.cluster())
    enc, aux, head = r.waves
    acts = [f for f in r.flows if f.kind == "activation"]
    assert [(f.start_ms, f.end_ms) for f in acts] == approx_spans([(5.0, 25.0)] * 2)
    assert (aux.forward_start_ms, aux.forward_end_ms) == pytest.approx((4.0, 5.0))
    assert (head.forward_start_ms, head.forward_end_ms) == pytest.approx((25.0, 26.0))
    # Backward: head 26-28, then its boundary sends the gradients back 28-48, and ranks 2-3,
    # which send them, wait for them before aux (the executor's batch wait): aux 48-50, enc
    # 50-58.
    grads = [f for f in r.flows if f.kind == "gradient"]
    assert [(f.start_ms, f.end_ms) for f in grads] == approx_spans([(28.0, 48.0)] * 2)
    assert (aux.backward_start_ms, aux.backward_end_ms) == pytest.approx((48.0, 50.0))
    assert (enc.backward_start_ms, enc.backward_end_ms) == pytest.approx((50.0, 58.0))
    assert r.iteration_ms == pytest.approx(58.0)
    assert r.transfer_ms == pytest.approx(40.0)


def test_a_group_split_over_waves_syncs_each_waves_layers_once_they_are_done():
    # t/enc's layer 1 runs in wave 1, layer 0 in wave 0 (ranks 0-1; 6 ms each, backward 4):
    # backward of wave 1 ends at 11, of wave 0 at 15. The group's 1 GB syncs in two halves, as
    # the executor buckets it: layer 1's 0.5 GB (a 0.5 GB ring step at 100 GB/s: 5 ms) from 11,
    # layer 0's from 15; they share the ports from 15, so the first ends at 17 and the second,
    # alone again for its last 0.4 GB, at 21.
    r = simulate(fx.plan_split_encoder(), fx.graph(), fx.profile(), fx.cluster())
    rings = sorted((f.start_ms, f.end_ms) for f in r.flows if f.kind == "sync")
    assert rings == approx_spans([(11.0, 17.0)] * 2 + [(15.0, 21.0)] * 2)
    assert (r.syncs[0].start_ms, r.syncs[0].end_ms) == pytest.approx((11.0, 21.0))
    assert r.iteration_ms == pytest.approx(21.0)
    # after the backward pass, the whole 1 GB at once: 15-25
    r = simulate(fx.plan_split_encoder(), fx.graph(), fx.profile(), fx.cluster(),
                 sync="after-backward")
    assert r.iteration_ms == pytest.approx(25.0)


def test_zero1_all_gathers_run_in_the_order_the_forward_needs_them():
    # Under ZeRO-1 the previous step's all-gathers of ranks 0-1 leave at 0, one after the
    # other: layer 0's first (each rank sends half of its 0.5 GB at 100 GB/s: 0-2.5 ms), then
    # layer 1's (2.5-5). Wave 0's slice (enc layer 0, forward 2 ms) starts once its own is
    # done, at 2.5; wave 1's at 5. Sharing the link (or layer 1's first) would hold wave 0
    # until 5.
    plan = fx.plan_split_encoder()
    plan = dataclasses.replace(plan, options={**plan.options, "zero": "1"})
    r = simulate(plan, fx.graph(), fx.profile(), fx.cluster())
    gathers = sorted((f.label, f.start_ms, f.end_ms) for f in r.flows
                     if f.label.startswith("all-gather"))
    assert gathers == [("all-gather enc[0:1]", 0.0, pytest.approx(2.5))] * 2 + [
        ("all-gather enc[1:2]", pytest.approx(2.5), pytest.approx(5.0))] * 2
    assert [s.forward_start_ms for s in r.slices if s.wave < 2] == pytest.approx([2.5, 5.0])


def test_per_set_buckets_wait_for_every_layer_of_their_rank_set():
    # The executor's gloo buckets: one per rank set, due once its lowest wave's backward is
    # done. In the split-encoder plan ranks 0-1 hold all of enc and head: one 1 GB ring from
    # 15 (wave 0's backward end) to 25, where per wave the halves ended at 17 and 21.
    r = simulate(fx.plan_split_encoder(), fx.graph(), fx.profile(), fx.cluster(),
                 sync="per-set")
    rings = [(f.label, f.bytes, f.start_ms, f.end_ms) for f in r.flows if f.kind == "sync"]
    assert rings == [("enc[0:2]+head[0:1]", 1_000_000_000, 15.0, pytest.approx(25.0))] * 2
    assert r.iteration_ms == pytest.approx(25.0)
    # Two rank sets, each with all its layers in one wave: the same as per wave (head's 0.5 GB
    # from 27 under enc's backward), unlike after the backward pass (from 55).
    r = simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster(), sync="per-set")
    assert (r.syncs[1].start_ms, r.syncs[1].end_ms) == pytest.approx((27.0, 32.0))
    assert r.iteration_ms == pytest.approx(65.0)


def test_sync_after_backward_when_not_overlapped():
    r = simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster(), sync="after-backward")
    enc_sync, head_sync = r.syncs
    assert (head_sync.start_ms, head_sync.end_ms) == pytest.approx((55.0, 60.0))
    assert r.iteration_ms == pytest.approx(65.0)


def test_breakdown_adds_up_to_iteration():
    r = run(latency_s=1e-4)
    assert r.optimizer_ms == 0.0  # the hand-built profile has no optimizer step
    assert r.compute_ms + r.transfer_ms + r.sync_ms == pytest.approx(r.iteration_ms)


@pytest.mark.parametrize("model", ["tiny-clip", "ofasys"])
@pytest.mark.parametrize("progress", ["wave", "rank"])
def test_one_device_syncs_exactly_nothing(model, progress):
    """A one-device cluster has no gradient to reduce: the sync is exactly 0, not the rounding
    left by taking the step and the backward off the iteration (-1e-13 ms was printed as
    '-0.00 ms, -0.0%' for OFASys with each rank on its own)."""
    root = Path(__file__).resolve().parents[2]
    graph = build_graph(load(str(root / "models" / f"{model}.yaml"), ModelSpec))
    one = pb.cluster(per_node=1, memory_bytes=1 << 40)  # OFASys whole on one device
    profile = profile_for(graph, one)
    plan = make_plan(graph, profile, one)
    r = simulate(plan, graph, profile, one, progress=progress)
    assert r.sync_ms == 0.0
    assert r.compute_ms + r.transfer_ms + r.optimizer_ms == pytest.approx(r.iteration_ms)


def test_transfer_bytes_are_split_by_rows_and_counted_both_ways():
    r = run()
    acts = [f for f in r.flows if f.kind == "activation"]
    grads = [f for f in r.flows if f.kind == "gradient"]
    assert sorted((f.src_rank, f.dst_rank, f.bytes) for f in acts) == [
        (0, 2, 200_000_000), (1, 3, 200_000_000)]
    assert sorted((f.src_rank, f.dst_rank) for f in grads) == [(2, 0), (3, 1)]
    assert r.transfer_bytes == 800_000_000
    assert r.inter_island_bytes == 800_000_000


def test_same_rank_transfer_is_free():
    r = run(fx.plan(enc_ranks=(0, 1), head_ranks=(0, 1)))
    assert [f for f in r.flows if f.kind != "sync"] == []
    assert r.transfer_ms == 0.0
    # Forward: enc 0-4, head 4-5; backward: head 5-7, enc 7-15. head's 0.5 GB sync runs
    # 7-12 under enc's backward; enc's 1 GB sync 15-25 at 100 GB/s.
    assert (r.syncs[1].start_ms, r.syncs[1].end_ms) == pytest.approx((7.0, 12.0))
    assert r.iteration_ms == pytest.approx(25.0)
    assert r.sync_ms == pytest.approx(10.0)
    # Both after the backward pass, they share each rank's NVLink port: 50 GB/s each until
    # the small one ends at 10 ms, then the rest of the big one at 100 GB/s: 5 ms more.
    r = simulate(fx.plan(enc_ranks=(0, 1), head_ranks=(0, 1)), fx.graph(), fx.profile(),
                 fx.cluster(), sync="after-backward")
    assert r.syncs[1].end_ms == pytest.approx(15.0 + 10.0)
    assert r.iteration_ms == pytest.approx(15.0 + 15.0)


def test_intra_island_transfer_uses_nvlink_bandwidth():
    # enc on rank 0 only (24 ms: forward 8), head on rank 1 in the same island.
    r = run(fx.plan(enc_ranks=(0,), head_ranks=(1,), enc_sync_bytes=0, head_sync_bytes=0))
    # 400 MB at 100 GB/s = 4 ms each way.
    assert r.waves[1].forward_start_ms == pytest.approx(8.0 + 4.0)
    assert r.transfer_ms == pytest.approx(8.0)
    assert r.sync_ms == 0.0


def test_a_rank_sending_two_flows_shares_its_nvlink_port():
    # One 4-rank island. enc on rank 0 alone sends rows [0,2) to rank 1 and [2,4) to rank 2
    # at once: both 200 MB flows share rank 0's 100 GB/s port -> 4 ms (not 2).
    no_sync = {"enc_sync_bytes": 0, "head_sync_bytes": 0}
    r = run(fx.plan(enc_ranks=(0,), head_ranks=(1, 2), **no_sync), num_nodes=1)
    acts = [f for f in r.flows if f.kind == "activation"]
    assert len(acts) == 2
    assert all(f.end_ms - f.start_ms == pytest.approx(4.0) for f in acts)
    # From two ranks (0 -> 1 and 3 -> 2) each flow has a port of its own: 2 ms.
    r = run(fx.plan(enc_ranks=(0, 3), head_ranks=(1, 2), **no_sync), num_nodes=1)
    assert r.waves[1].forward_wait_ms == pytest.approx(2.0)


def test_the_node_nic_is_shared_by_every_flow_leaving_the_node():
    no_sync = {"enc_sync_bytes": 0, "head_sync_bytes": 0}
    # Alone, one 400 MB flow 0 -> 2 gets the whole 20 GB/s NIC: 20 ms.
    r = run(fx.plan(enc_ranks=(0,), head_ranks=(2,), **no_sync))
    assert r.waves[1].forward_wait_ms == pytest.approx(20.0)
    # 0 -> 2 and 0 -> 3 (200 MB each) share it: 10 GB/s each, also 20 ms.
    r = run(fx.plan(enc_ranks=(0,), head_ranks=(2, 3), **no_sync))
    acts = [f for f in r.flows if f.kind == "activation"]
    assert len(acts) == 2
    assert all(f.end_ms - f.start_ms == pytest.approx(20.0) for f in acts)


def test_message_latency_is_added_per_flow():
    base, slow = run(), run(latency_s=1e-3)
    # One latency per transfer direction, two per 2-rank ring (2(p-1) = 2 steps).
    assert slow.iteration_ms - base.iteration_ms == pytest.approx(1.0 + 1.0 + 2.0)


def test_uneven_rows_cost_the_largest_share():
    # Batch 3 on 2 ranks: rows 2 and 1; the slice takes as long as 2 rows.
    r = run(fx.plan(enc_sync_bytes=0, head_sync_bytes=0), batch=3)
    assert r.waves[0].forward_end_ms == pytest.approx(2 * 3.0 * 2 / 3)
    acts = sorted((f.src_rank, f.dst_rank, f.bytes) for f in r.flows if f.kind == "activation")
    assert acts == [(0, 2, 266_666_666), (1, 3, 133_333_333)]


def test_an_uneven_slice_is_timed_on_the_planners_piece():
    # Batch 8 on 3 ranks runs 3 rows per rank, the work of 8/3 devices: on the first piece
    # (1.0 + 1.0 * 3 = 4.0 ms), though the count 3 itself lies on the second (1.3 + 0.8 * 3 =
    # 3.7). The planner reads the piece holding the work count; so must the simulator.
    g = pb.graph([pb.metaop("t0/enc", layers=1, batch=8, params=0, act_bytes=0, stash=0)])
    p = pb.profile([pb.curve("t0/enc", 8, [(1, 3, 1.0, 1.0, "dp"),
                                           (3, 1 << 20, 1.3, 0.8, "dp")])])
    c = pb.cluster(num_nodes=1, per_node=3)
    plan = make_plan(g, p, c, options=PlanOptions(planner="sequential", uneven_splits=True))
    assert [len(s.ranks) for _, s in plan.slices()] == [3]
    assert plan.estimated_iteration_ms == pytest.approx(4.0)
    assert simulate(plan, g, p, c, progress="wave").compute_ms == pytest.approx(4.0)


def test_memory_is_static_plus_stashed_activations():
    r = run(fx.plan(static_bytes=5_000))
    # rank 0 holds 2 samples x 2 layers x 1000 bytes of enc stash; rank 2 holds 2 x 1 x 1000.
    assert [x.activation_bytes for x in r.ranks] == [4_000, 4_000, 2_000, 2_000]
    assert r.peak_memory_bytes == 9_000


def test_utilization_per_rank_and_metaop():
    r = run()
    assert [x.busy_ms for x in r.ranks] == pytest.approx([12.0, 12.0, 3.0, 3.0])
    enc = next(m for m in r.metaops if m.metaop == "t/enc")
    # 2 layers x 6 GFLOP over 24 device-ms at 1 TFLOP/s peak = 12e9 / 24e9.
    assert enc.device_ms == pytest.approx(24.0)
    assert enc.mfu == pytest.approx(0.5)


def test_row_flows_match_overlapping_rows():
    # 4 producer ranks -> 2 consumer ranks: each consumer takes two producer quarters.
    flows = row_flows(400, (0, 1, 2, 3), "dp", (4, 5), "dp", 8)
    assert sorted(flows) == [(0, 4, 100), (1, 4, 100), (2, 5, 100), (3, 5, 100)]
    # Tensor parallel consumer: both ranks of the group need all of the group's rows.
    assert sorted(row_flows(400, (0,), "dp", (0, 1), "tp2", 8)) == [(0, 1, 400)]
    # Tensor parallel producer: every rank of the group holds its output, so the consumers
    # take turns instead of all reading from its first rank
    assert sorted(row_flows(400, (0, 1), "tp2", (2, 3), "dp", 8)) == [(0, 2, 200), (1, 3, 200)]
    assert sorted(row_flows(400, (0, 1, 2, 3), "tp4", (4, 5, 6, 7), "dp", 8)) == [
        (0, 4, 100), (1, 5, 100), (2, 6, 100), (3, 7, 100)]


def test_mismatched_cluster_is_a_user_error():
    small = dataclasses.replace(fx.cluster(), num_nodes=1)
    with pytest.raises(SpindleError, match="4 devices"):
        simulate(fx.plan(), fx.graph(), fx.profile(), small)


def test_transfer_to_an_earlier_wave_is_a_user_error():
    plan = fx.plan()
    t = dataclasses.replace(plan.transfers[0], src="w1.0", dst="w0.0")
    with pytest.raises(SpindleError, match="is not in an earlier wave than"):
        simulate(dataclasses.replace(plan, transfers=(t,)), fx.graph(), fx.profile(),
                 fx.cluster())


def test_unknown_metaop_is_a_user_error():
    g = fx.graph()
    g = dataclasses.replace(g, metaops=g.metaops[:1], num_levels=1)
    with pytest.raises(SpindleError, match="t/head"):
        simulate(fx.plan(), g, fx.profile(), fx.cluster())


def test_ring_all_reduce_runs_at_its_slowest_link():
    # enc and head both on all 4 ranks: compute 2 x 3 ms x 1 + 1.5 ms x 1 = 7.5 ms, no
    # transfers. Ring 0->1->2->3->0 over 400 MB: each rank sends 2(p-1)/p x 400 MB = 600 MB;
    # the cross-node edges 1->2 and 3->0 each have a NIC to themselves: 600 MB / 20 GB/s = 30 ms.
    everyone = (0, 1, 2, 3)
    r = run(fx.plan(enc_ranks=everyone, head_ranks=everyone, enc_sync_bytes=400_000_000,
                    head_sync_bytes=0))
    assert r.compute_ms == pytest.approx(7.5)
    assert r.transfer_ms == 0.0
    assert r.sync_ms == pytest.approx(30.0)
    ring = sorted((f.src_rank, f.dst_rank, f.bytes) for f in r.flows if f.kind == "sync")
    assert ring == [(0, 1, 600_000_000), (1, 2, 600_000_000), (2, 3, 600_000_000),
                    (3, 0, 600_000_000)]


@pytest.mark.parametrize("planner", ["spindle", "sequential", "optimus", "distmm"])
def test_simulated_compute_matches_the_planners_estimate(planner):
    # The planner's slice times and the simulator's both come from the profile's curves; on
    # even splits they must agree slice by slice, and communication only adds to them.
    repo = Path(__file__).resolve().parents[2]
    model = load(str(repo / "models" / "multitask-clip.yaml"), ModelSpec)
    cluster = load(str(repo / "clusters" / "a800-2x8.yaml"), ClusterSpec)
    graph = build_graph(model, tasks=list(model.task_sets["4"]))
    profile = profile_for(graph, cluster)
    plan = make_plan(graph, profile, cluster, options=PlanOptions(planner=planner))
    r = simulate(plan, graph, profile, cluster)
    for timing, (_, planned) in zip(r.slices, plan.slices(), strict=True):
        ran = (timing.forward_end_ms - timing.forward_start_ms
               + timing.backward_end_ms - timing.backward_start_ms)
        assert ran == pytest.approx(planned.time_ms, rel=1e-9), timing.slice_id
    assert r.compute_ms == pytest.approx(plan.estimated_iteration_ms, rel=1e-9)
    assert r.iteration_ms >= r.compute_ms
    assert r.optimizer_ms > 0  # the analytic profile has an optimizer step
    assert (r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms
            == pytest.approx(r.iteration_ms))
    assert 0.0 <= r.idle_fraction < 1.0



def test_a_gradient_message_holds_up_only_the_waves_of_its_ranks():
    """With waves as barriers, the wave after a backward boundary waited for all of its
    messages, though a rank that sends or receives none of them goes on in the executor: enc
    on rank 0 feeds head on rank 2 across wave 1, whose aux runs on rank 3. Forward: enc 0-8,
    aux 8-10, the 400 MB 8-28 over the NICs, head 28-30. Backward: head 30-34, its gradients
    go back 34-54; aux, on a rank neither sends nor receives, runs 34-38 (it waited until 54),
    and enc from 54 to 70, as with each rank on its own (the iteration was 74)."""
    base = fx.plan_skipping_a_wave()
    ranks = {"t/enc": (0,), "t/aux": (3,), "t/head": (2,)}
    plan = dataclasses.replace(
        base,
        waves=tuple(dataclasses.replace(w, slices=tuple(
            dataclasses.replace(s, ranks=ranks[s.metaop]) for s in w.slices))
            for w in base.waves),
        transfers=(dataclasses.replace(base.transfers[0], src_ranks=(0,), dst_ranks=(2,)),),
        param_groups=tuple(dataclasses.replace(g, ranks=ranks[f"t/{g.module}"])
                           for g in base.param_groups))
    args = (plan, fx.graph_with_aux(), fx.profile_with_aux(), fx.cluster())
    enc, aux, head = simulate(*args).waves
    assert (head.backward_start_ms, head.backward_end_ms) == pytest.approx((30.0, 34.0))
    assert (aux.backward_start_ms, aux.backward_end_ms) == pytest.approx((34.0, 38.0))
    assert (enc.backward_start_ms, enc.backward_end_ms) == pytest.approx((54.0, 70.0))
    assert simulate(*args).iteration_ms == pytest.approx(70.0)
    assert simulate(*args, progress="rank").iteration_ms == pytest.approx(70.0)

def test_ranks_on_their_own_run_ahead_of_the_waves():
    # As the executor runs them: ranks 2-3 have nothing to receive before aux, so aux runs
    # 0-1 while enc (ranks 0-1) runs 0-4; the 400 MB into head leaves at 4, when both ends are
    # there, and takes 20 ms over node 0's NIC (4-24); head 24-25 forward, 25-27 backward.
    # Its gradients go back 27-47 (ranks 0-1 wait at that boundary from 24), then aux's
    # backward (47-49) runs beside enc's (47-55) instead of before it.
    r = simulate(fx.plan_skipping_a_wave(), fx.graph_with_aux(), fx.profile_with_aux(),
                 fx.cluster(), progress="rank")
    enc, aux, head = r.waves
    assert (aux.forward_start_ms, aux.forward_end_ms) == pytest.approx((0.0, 1.0))
    acts = [f for f in r.flows if f.kind == "activation"]
    assert [(f.start_ms, f.end_ms) for f in acts] == approx_spans([(4.0, 24.0)] * 2)
    assert (head.forward_start_ms, head.backward_end_ms) == pytest.approx((24.0, 27.0))
    grads = [f for f in r.flows if f.kind == "gradient"]
    assert [(f.start_ms, f.end_ms) for f in grads] == approx_spans([(27.0, 47.0)] * 2)
    assert (aux.backward_start_ms, aux.backward_end_ms) == pytest.approx((47.0, 49.0))
    assert (enc.backward_start_ms, enc.backward_end_ms) == pytest.approx((47.0, 55.0))
    # behind barriers the same plan takes 58 ms; the parts are rank 0's own time
    assert r.iteration_ms == pytest.approx(55.0)
    assert (r.forward_ms, r.backward_ms) == pytest.approx((4.0, 8.0))
    assert r.transfer_ms == pytest.approx(20.0 + 23.0)
    assert r.sync_ms == pytest.approx(0.0)


def test_a_slice_starts_when_all_of_its_ranks_are_there():
    # enc on ranks 0-1, head on ranks 1-2: rank 2 reaches head's boundary at 0, ranks 0-1 at
    # 4 (after enc). Head's rows 0-1 come from rank 0 to rank 1 over NVLink (200 MB at
    # 100 GB/s: 4-6), rows 2-3 from rank 1 to rank 2 over node 0's NIC (4-14); rank 1 has
    # its rows at 6 but head starts on both of its ranks at 14.
    r = simulate(fx.plan((0, 1), (1, 2), enc_sync_bytes=0, head_sync_bytes=0), fx.graph(),
                 fx.profile(), fx.cluster(), progress="rank")
    w0, w1 = r.waves
    acts = [f for f in r.flows if f.kind == "activation"]
    assert [(f.src_rank, f.dst_rank) for f in acts] == [(0, 1), (1, 2)]
    assert [(f.start_ms, f.end_ms) for f in acts] == approx_spans([(4.0, 6.0), (4.0, 14.0)])
    assert (w1.forward_start_ms, w1.forward_end_ms) == pytest.approx((14.0, 15.0))


def _zero3_plan_of_two_tasks_sharing_a_module():
    """ZeRO-3 on one 4-rank island: task a runs p0 (10 ms forward), p1 (1 ms) and x (1 ms)
    on rank 0, in waves 0-2; task b runs x (1 ms) on rank 1 in wave 2. x's layer is module m
    on both, one parameter group over ranks 0-1 whose 0.2 GB of weights each gather moves
    (0.1 GB per rank at 100 GB/s: 1 ms, after a 5 us latency)."""
    shared = {"layers": 1, "module": "m", "signature": "m", "params": 10**8, "act_bytes": 0}
    graph = pb.graph([
        pb.metaop("a/p0", layers=1, params=0, act_bytes=0),
        pb.metaop("a/p1", level=1, layers=1, preds=("a/p0",), params=0, act_bytes=0),
        pb.metaop("a/x", level=2, preds=("a/p1",), **shared),
        pb.metaop("b/x", **shared),
    ])
    profile = pb.profile([pb.alpha_beta_curve("a/p0", 8, 0.0, 30 / 8),
                          pb.alpha_beta_curve("a/p1", 8, 0.0, 3 / 8),
                          pb.alpha_beta_curve("m", 8, 0.0, 3 / 8)])

    def one(wave, index, metaop, rank, time_ms):
        return Slice(id=f"w{wave}.{index}", metaop=metaop, first=0, last=1, ranks=(rank,),
                     strategy="dp", time_ms=time_ms)

    p0, p1, ax, bx = one(0, 0, "a/p0", 0, 30.0), one(1, 0, "a/p1", 0, 3.0), \
        one(2, 0, "a/x", 0, 3.0), one(2, 1, "b/x", 1, 3.0)
    plan = Plan(
        **derived_header(Plan, []), model="test", cluster="test", planner="spindle",
        num_devices=4, islands=((0, 1, 2, 3),), options={"zero": "3"},
        waves=(Wave(index=0, level=0, start_ms=0.0, duration_ms=30.0, slices=(p0,)),
               Wave(index=1, level=1, start_ms=30.0, duration_ms=3.0, slices=(p1,)),
               Wave(index=2, level=2, start_ms=33.0, duration_ms=3.0, slices=(ax, bx))),
        transfers=(Transfer(src="w0.0", dst="w1.0", bytes=0, src_ranks=(0,), dst_ranks=(0,)),
                   Transfer(src="w1.0", dst="w2.0", bytes=0, src_ranks=(0,), dst_ranks=(0,))),
        param_groups=(ParamGroup(module="m", first_layer=0, last_layer=1, ranks=(0, 1),
                                 bytes=2 * 10**8),
                      ParamGroup(module="p0", first_layer=0, last_layer=1, ranks=(0,), bytes=0),
                      ParamGroup(module="p1", first_layer=0, last_layer=1, ranks=(0,),
                                 bytes=0)),
        memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                activation_bytes=0) for r in range(4)),
        levels=tuple(LevelBound(level=i, lower_bound_ms=t, estimated_ms=t)
                     for i, t in enumerate((30.0, 3.0, 3.0))),
        lower_bound_ms=36.0, estimated_iteration_ms=36.0,
    )
    return plan, graph, profile


def test_an_all_gather_issued_late_for_an_earlier_time_does_not_wait_for_later_ones():
    # Ranks on their own: rank 1 gathers b/x's weights 0.005-1.005 ms and runs its forward
    # 1.005-2.005; from 1.005 it gathers them again for the backward (1.01-2.01), which runs
    # 2.01-4.01. Rank 0, stepped in turn with rank 1, issues a/x's gather at 10 (when p1
    # starts) before rank 1 gets to issue that backward gather; a rank set's gathers queue in
    # the order of their times, so b/x's backward did not wait for a/x's (it ran 12.01-14.01).
    plan, graph, profile = _zero3_plan_of_two_tasks_sharing_a_module()
    r = simulate(plan, graph, profile, pb.cluster(), progress="rank", sync="per-wave")
    bx = next(s for s in r.slices if s.metaop == "b/x")
    assert (bx.forward_start_ms, bx.backward_start_ms, bx.backward_end_ms) == pytest.approx(
        (1.005, 2.01, 4.01))
    gathers = sorted({(f.label, f.start_ms, f.end_ms) for f in r.flows if f.kind == "gather"},
                     key=lambda g: g[1])
    assert [label for label, _, _ in gathers] == ["w2.1:m[0:1]"] * 2 + ["w2.0:m[0:1]"] * 2
    assert [t for _, start, end in gathers for t in (start, end)] == pytest.approx(
        [0.005, 1.005, 1.01, 2.01, 10.005, 11.005, 11.01, 12.01])
    # rank 0: p0 0-10, p1 10-11, a/x 11.005-12.005 and back 12.01-14.01, p1 to 16.01, p0 to 36.01
    assert r.iteration_ms == pytest.approx(36.01)


def _tensor_parallel_enc(plan):
    """`plan` with its enc slice in tp2 (groups of two consecutive ranks)."""
    enc = dataclasses.replace(plan.waves[0].slices[0], strategy="tp2")
    return dataclasses.replace(
        plan, waves=(dataclasses.replace(plan.waves[0], slices=(enc,)), *plan.waves[1:]))


def test_tensor_parallel_shards_are_reduced_over_their_replicas_only():
    # enc in tp2 on all 4 ranks: groups (0,1) and (2,3), each rank holding one half (shard)
    # of enc's 400 MB. Shard 0 is reduced over ranks 0 and 2, shard 1 over 1 and 3: each
    # member sends 2(c-1)/c x 200 MB = 200 MB for c = 2 copies. Both shard rings cross the
    # nodes: node 0's 20 GB/s NIC carries 0->2 and 1->3, 400 MB: 20 ms (the data-parallel
    # ring of test_ring_all_reduce_runs_at_its_slowest_link takes 30 ms).
    everyone = (0, 1, 2, 3)
    plan = _tensor_parallel_enc(fx.plan(enc_ranks=everyone, head_ranks=everyone,
                                        enc_sync_bytes=400_000_000, head_sync_bytes=0))
    r = run(plan)
    ring = sorted((f.src_rank, f.dst_rank, f.bytes) for f in r.flows if f.kind == "sync")
    assert ring == [(0, 2, 200_000_000), (1, 3, 200_000_000), (2, 0, 200_000_000),
                    (3, 1, 200_000_000)]
    assert r.sync_ms == pytest.approx(20.0)
    # one tp2 group holds a single copy: nothing to reduce
    alone = _tensor_parallel_enc(fx.plan(enc_ranks=(0, 1), head_sync_bytes=0))
    assert [f for f in run(alone).flows if f.kind == "sync"] == []


def test_a_bucket_of_tensor_and_data_parallel_layers_reduces_each_on_its_rings():
    # per-set: one bucket for enc (tp2, 400 MB) and head (dp, 400 MB) on ranks 0-3. enc's
    # shards go round 0<->2 and 1<->3 (200 MB per member), head round 0->1->2->3->0
    # (2 x 3/4 x 400 MB = 600 MB per member); before, the bucket was one ring charging enc
    # as a full copy on every rank (1.2 GB per member).
    everyone = (0, 1, 2, 3)
    plan = _tensor_parallel_enc(fx.plan(enc_ranks=everyone, head_ranks=everyone,
                                        enc_sync_bytes=400_000_000,
                                        head_sync_bytes=400_000_000))
    r = run(plan, sync="per-set")
    sent: dict[tuple[int, int], int] = {}
    for f in r.flows:
        if f.kind == "sync":
            sent[(f.src_rank, f.dst_rank)] = sent.get((f.src_rank, f.dst_rank), 0) + f.bytes
    assert sent == {(0, 2): 200_000_000, (2, 0): 200_000_000, (1, 3): 200_000_000,
                    (3, 1): 200_000_000, (0, 1): 600_000_000, (1, 2): 600_000_000,
                    (2, 3): 600_000_000, (3, 0): 600_000_000}


def test_a_bucket_with_part_of_a_group_weighs_each_ring_by_its_share_of_the_bucket():
    # P: 4 dp layers of 200 MB of gradients on ranks 0-3 (layers 0-1 complete in wave 0,
    # 2-3 in wave 1); Q: one tp2 layer of 200 MB, complete in wave 1. Wave 1's bucket holds
    # P's layers 2-3 (400 MB: 2 x 3/4 x 400 MB = 600 MB per member of P's ring) and all of
    # Q (its shard rings 0<->2 and 1<->3 reduce 100 MB each: 2 x 1/2 x 100 MB per member).
    # Weighing the bucket's 600 MB by the groups' whole bytes (800 and 200 MB) gave P's
    # ring 720 MB per member and Q's 60 MB.
    per_layer = 100_000_000  # parameters: 200 MB of bf16 gradients a layer
    graph = pb.graph([pb.metaop(m, layers=n, batch=4, module=module, signature=sig,
                                params=per_layer)
                      for m, n, module, sig in (("a/p", 4, "P", "sp"), ("c/p", 4, "P", "sp"),
                                                ("b/q", 1, "Q", "sq"), ("d/q", 1, "Q", "sq"))])
    profile = pb.profile([pb.alpha_beta_curve("sp", 4, 0.0, 1.0),
                          pb.curve("sq", 4, [(1, 2, 0.0, 1.0, "tp2"), (2, 8, 0.0, 1.0, "tp2")])])

    def piece(sid: str, metaop: str, last: int, ranks: tuple[int, ...], strategy: str = "dp",
              first: int = 0) -> Slice:
        return Slice(id=sid, metaop=metaop, first=first, last=last, ranks=ranks,
                     strategy=strategy, time_ms=1.0)

    waves = ((piece("w0.0", "a/p", 2, (0, 1)),),
             (piece("w1.0", "a/p", 4, (0, 1), first=2), piece("w1.1", "b/q", 1, (2, 3), "tp2")),
             (piece("w2.0", "c/p", 4, (2, 3)), piece("w2.1", "d/q", 1, (0, 1), "tp2")))
    everyone = (0, 1, 2, 3)
    plan = Plan(**derived_header(Plan, []), model="test", cluster="test", planner="spindle",
                num_devices=4, islands=(everyone,),
                waves=tuple(Wave(index=i, level=0, start_ms=float(i), duration_ms=1.0,
                                 slices=slices) for i, slices in enumerate(waves)),
                transfers=(Transfer(src="w0.0", dst="w1.0", bytes=4096, src_ranks=(0, 1),
                                    dst_ranks=(0, 1)),),
                param_groups=(ParamGroup(module="P", first_layer=0, last_layer=4,
                                         ranks=everyone, bytes=4 * 2 * per_layer),
                              ParamGroup(module="Q", first_layer=0, last_layer=1,
                                         ranks=everyone, bytes=2 * per_layer)),
                memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                        activation_bytes=0) for r in everyone),
                levels=(LevelBound(level=0, lower_bound_ms=1.0, estimated_ms=3.0),),
                lower_bound_ms=1.0, estimated_iteration_ms=3.0)
    r = simulate(plan, graph, profile, pb.cluster(1, 4, 4), sync="per-wave")
    sent = sorted((f.src_rank, f.dst_rank, f.bytes) for f in r.flows
                  if f.kind == "sync" and f.label == "P[2:4]+Q[0:1]")
    assert sent == sorted([(r, (r + 1) % 4, 600_000_000) for r in everyone]
                          + [(r, r ^ 2, 100_000_000) for r in everyone])


def test_layers_in_tp2_on_some_ranks_and_tp3_on_others_reduce_six_shards():
    # two tasks' MetaOps of one module, the same 2 layers (1 GB of gradients): t/enc in tp2 on
    # ranks 0-1, u/enc in tp3 on ranks 2-4. Split into six finer shards, shard j is held by
    # rank j mod 2 and by rank 2 + j mod 3: six rings of two, each member sending
    # 2 x 1/2 x 1/6 GB. Ranks 0 and 1 sit in three rings each, ranks 2-4 in two, and every
    # ring pairs one of 0-1 with one of 2-4, so each flow moves at 100/3 GB/s: 1/6 GB in 5 ms.
    # (Three shards, the largest degree, reduced half the layer on rings 0-2, 1-3, 0-4 at
    # 2 x 1/2 x 1/3 GB per member: 6.7 ms, and left rank 1's other shards out.)
    t_enc = fx._metaop("t/enc", "enc", 2, 0, (), 1_000, fx.BATCH)
    u_enc = dataclasses.replace(t_enc, id="u/enc", task="u")
    g = dataclasses.replace(fx.graph(), tasks=("t", "u"), num_levels=1, metaops=(t_enc, u_enc))
    c = dataclasses.replace(fx.cluster(num_nodes=1), name="toy-1x6", devices_per_node=6,
                            island_size=6)
    slices = (Slice(id="w0.0", metaop="t/enc", first=0, last=2, ranks=(0, 1), strategy="tp2",
                    time_ms=12.0),
              Slice(id="w0.1", metaop="u/enc", first=0, last=2, ranks=(2, 3, 4),
                    strategy="tp3", time_ms=12.0))
    plan = dataclasses.replace(
        fx.plan(), cluster="toy-1x6", num_devices=6, islands=(tuple(range(6)),),
        waves=(Wave(index=0, level=0, start_ms=0.0, duration_ms=12.0, slices=slices),),
        transfers=(),
        param_groups=(ParamGroup(module="enc", first_layer=0, last_layer=2,
                                 ranks=(0, 1, 2, 3, 4), bytes=1_000_000_000),),
        memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                activation_bytes=0) for r in range(6)),
        levels=(LevelBound(level=0, lower_bound_ms=6.0, estimated_ms=12.0),),
        lower_bound_ms=6.0, estimated_iteration_ms=12.0)
    r = simulate(plan, g, fx.profile(), c, sync="per-wave")
    sent = sorted((f.src_rank, f.dst_rank, f.bytes) for f in r.flows if f.kind == "sync")
    sixth = round(1e9 / 6)
    assert sent == sorted([(j % 2, 2 + j % 3, sixth) for j in range(6)]
                          + [(2 + j % 3, j % 2, sixth) for j in range(6)])
    assert r.sync_ms == pytest.approx(5.0)


def test_a_consumer_waits_for_its_producer_however_few_bytes_move():
    # t/enc (ranks 0-1) passes 0 bytes to t/head (ranks 2-3): with each rank on its own, no
    # message was left to wait for, and t/head started at 0 ms, before t/enc ended
    g = fx.graph()
    g = dataclasses.replace(g, metaops=(dataclasses.replace(g.metaops[0], activation_out_bytes=0),
                                        g.metaops[1]))
    plan = fx.plan(enc_sync_bytes=0, head_sync_bytes=0)
    plan = dataclasses.replace(plan, transfers=(dataclasses.replace(plan.transfers[0], bytes=0),))
    by_wave = simulate(plan, g, fx.profile(), fx.cluster())
    by_rank = simulate(plan, g, fx.profile(), fx.cluster(), progress="rank")
    start = {s.slice_id: s.forward_start_ms for s in by_rank.slices}
    end = {s.slice_id: s.forward_end_ms for s in by_rank.slices}
    assert start["w1.0"] >= end["w0.0"] > 0
    assert by_rank.iteration_ms == pytest.approx(by_wave.iteration_ms)
