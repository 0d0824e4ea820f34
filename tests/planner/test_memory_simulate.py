"""The simulator's charges for memory strategies, on the hand-built plan of _sim_fixtures
(enc: 2 layers on ranks 0-1, 12 ms fwd+bwd; head: 1 layer on ranks 2-3, 3 ms; 200 MB per rank
pair over a 20 GB/s NIC = 20 ms; NVLink 100 GB/s per rank)."""

from __future__ import annotations

import dataclasses

import _sim_fixtures as fx
import pytest

from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.planner.simulate import simulate


def run(options, graph=None):
    plan = fx.plan()
    plan = dataclasses.replace(plan, options={**plan.options, **options})
    return simulate(plan, graph or fx.graph(), fx.profile(), fx.cluster(), sync="per-wave")


def _big_enc_graph():
    # enc: 250 M params per layer -> 2 layers x 250 M x 2 B = 1 GB of bf16 weights
    g = fx.graph()
    ops = tuple(dataclasses.replace(m, params_per_layer=250_000_000) if m.module == "enc"
                else dataclasses.replace(m, params_per_layer=0) for m in g.metaops)
    return dataclasses.replace(g, metaops=ops)


def test_zero1_and_zero2_reduce_scatter_and_all_gather_under_the_next_forward():
    base = run({})
    for zero in ("1", "2"):
        r = run({"zero": zero})
        # The previous step's all-gathers of the stepped shards leave at 0: enc's 0.5 GB per
        # rank over ranks 0-1 at 100 GB/s, 0-5, head's 0.25 GB over ranks 2-3, 0-2.5. enc's
        # forward waits for its own (5-9), head's was done long before its activations
        # arrive (29); everything after is 5 ms later than without ZeRO: enc's backward
        # 52-60, then its reduce-scatter sends 0.5 GB, 60-65, and the step takes no time (no
        # optimizer cost in the profile).
        flows = [f for f in r.flows if f.kind == "sync"]
        gather = {f.label: (f.bytes, f.start_ms, f.end_ms) for f in flows
                  if f.label.startswith("all-gather")}
        assert gather == {"all-gather enc[0:2]": (500_000_000, 0.0, pytest.approx(5.0)),
                          "all-gather head[0:1]": (250_000_000, 0.0, pytest.approx(2.5))}
        w0, w1 = r.waves
        assert (w0.forward_start_ms, w0.forward_end_ms) == pytest.approx((0.0, 9.0))
        enc_slice = next(s for s in r.slices if s.module == "enc")
        assert enc_slice.forward_start_ms == pytest.approx(5.0)
        assert (w1.forward_start_ms, w0.backward_end_ms) == pytest.approx((29.0, 60.0))
        reduce = [f for f in flows if "enc" in f.label and not f.label.startswith("all-")]
        assert [(f.bytes, f.start_ms, f.end_ms) for f in reduce] == \
            [(500_000_000, 60.0, pytest.approx(65.0))] * 2
        enc = next(s for s in r.syncs if s.module == "enc")
        assert (enc.start_ms, enc.end_ms) == pytest.approx((60.0, 65.0))
        # head's bucket on ranks 2-3 is reduced 32-34.5, under enc's backward
        head = [f for f in flows if "head" in f.label and not f.label.startswith("all-")]
        assert [t for f in head for t in (f.start_ms, f.end_ms)] == \
            pytest.approx([32.0, 34.5] * 2)
        assert r.iteration_ms == pytest.approx(base.iteration_ms) == pytest.approx(65.0)
        # the 5 ms wait for enc's all-gather is sync, with the reduce-scatter's 5 ms; the
        # transfers are the activations' and gradients' 20 + 20 ms
        assert (r.transfer_ms, r.sync_ms) == pytest.approx((40.0, 10.0))
        assert r.gather_wait_ms == pytest.approx(5.0) and base.gather_wait_ms == 0.0
        assert r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms == \
            pytest.approx(r.iteration_ms)
        assert not [f for f in r.flows if f.kind == "gather"]


@pytest.mark.parametrize("progress", ["wave", "rank"])
def test_zero1_forward_stalls_inside_a_slice_for_a_later_layers_all_gather(progress):
    # Chunked buckets cut enc's 1 GB into its two layers (0.5 GB each); the previous step's
    # all-gathers leave at 0, layer 0's first (each rank sends 0.25 GB at 100 GB/s: 0-2.5),
    # then layer 1's (2.5-5). enc's slice starts once layer 0's has arrived (2.5), runs it
    # 2.5-4.5, stalls until layer 1's arrives (5) and runs it 5-7: 2.5 + 0.5 ms of sync, not
    # the 5 ms a wait for both before the slice would take. Everything after is 3 ms later.
    base = simulate(fx.plan(), fx.graph(), fx.profile(), fx.cluster(), sync="chunked",
                    progress=progress)
    _, r = fx.zero1_chunked(progress)
    gathers = sorted({(f.label, f.start_ms, f.end_ms) for f in r.flows
                      if f.label.startswith("all-gather enc")})
    assert gathers == [("all-gather enc[0:1]", 0.0, pytest.approx(2.5)),
                       ("all-gather enc[1:2]", pytest.approx(2.5), pytest.approx(5.0))]
    enc = next(s for s in r.slices if s.module == "enc")
    assert (enc.forward_start_ms, enc.forward_end_ms) == pytest.approx((2.5, 7.0))
    assert [t for stall in enc.forward_stalls for t in stall] == pytest.approx([4.5, 5.0])
    head = next(s for s in r.slices if s.module == "head")
    assert head.forward_stalls == ()
    base_head = next(s for s in base.slices if s.module == "head")
    assert head.forward_start_ms == pytest.approx(base_head.forward_start_ms + 3.0)
    assert r.compute_ms == pytest.approx(base.compute_ms)
    assert r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms == \
        pytest.approx(r.iteration_ms)
    # waves as barriers: 2.5 ms before the slice and 0.5 inside it, both in sync; ranks on
    # their own count them with their waiting
    assert r.gather_wait_ms == (pytest.approx(3.0) if progress == "wave" else None)


def test_zero1_steps_after_the_reduce_scatter():
    """With an optimizer cost, every rank steps once its groups are reduced."""
    plan = dataclasses.replace(fx.plan(), options={**fx.plan().options, "zero": "1"})
    p = dataclasses.replace(fx.profile(), optimizer=OptimizerCost(ms_per_tensor=2.0,
                                                                  ms_per_million_params=0.0))
    r = simulate(plan, fx.graph(), p, fx.cluster(), sync="per-wave")
    # enc reduced at 65 (as above), ranks 0-1 step 65-67 (one bucket)
    assert r.iteration_ms == pytest.approx(67.0)
    assert r.optimizer_ms == pytest.approx(2.0)
    assert r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms == \
        pytest.approx(r.iteration_ms)


def test_zero3_gathers_weights_before_forward_and_backward():
    g = _big_enc_graph()
    base = run({}, g)
    r = run({"zero": "3"}, g)
    # ring all-gather of 1 GB over 2 ranks: each sends 0.5 GB at 100 GB/s = 5 ms, issued at 0,
    # so enc's forward runs 5-9 instead of 0-4, and everything after shifts by 5 ms; the
    # backward gather (30-35) hides under the 20 ms gradient transfer into enc; the gradients
    # are reduce-scattered only (0.5 GB, 5 ms against the all-reduce's 10 ms)
    gathered = [f for f in r.flows if f.kind == "gather"]
    assert len(gathered) == 4 and all(f.bytes == 500_000_000 for f in gathered)
    assert {(f.src_rank, f.dst_rank) for f in gathered} == {(0, 1), (1, 0)}
    w0 = r.waves[0]
    assert (w0.forward_start_ms, w0.forward_end_ms) == pytest.approx((5.0, 9.0))
    assert r.iteration_ms == pytest.approx(base.iteration_ms + 5.0 - 5.0)
    backward = sorted(f.start_ms for f in gathered)[2:]
    assert backward == pytest.approx([30.0, 30.0])
    assert r.transfer_bytes == base.transfer_bytes
    # the forward's 5 ms wait for the weights is sync (with the 5 ms reduce-scatter); the
    # transfers wait 20 + 20 ms as without ZeRO
    assert (r.transfer_ms, r.sync_ms) == pytest.approx((base.transfer_ms, 10.0))
    assert r.gather_wait_ms == pytest.approx(5.0)
    assert r.compute_ms + r.transfer_ms + r.sync_ms == pytest.approx(r.iteration_ms)


def test_recompute_adds_one_forward_to_each_backward():
    base = run({})
    r = run({"recompute": "true"})
    # enc: forward 4 ms, backward 8 + 4; head: forward 1, backward 2 + 1
    assert r.forward_ms == pytest.approx(base.forward_ms)
    assert r.backward_ms == pytest.approx(base.backward_ms + base.forward_ms)
    w0, w1 = r.waves
    assert (w1.backward_start_ms, w1.backward_end_ms) == pytest.approx((25.0, 28.0))
    assert (w0.backward_start_ms, w0.backward_end_ms) == pytest.approx((48.0, 60.0))
    assert r.iteration_ms == pytest.approx(70.0)


def test_recompute_stashes_inputs_and_one_operator():
    r = run({"recompute": "true"})
    by_rank = {s.rank: s for s in r.ranks}
    # enc keeps its whole 1000 B stash (its input is larger): 2 rows x 2 layers, plus one
    # operator's 2 x 1000 B during backward; head keeps its 1000 B / 4 rows input = 250 B.
    assert by_rank[0].activation_bytes == 1000 * 2 * 2 + 1000 * 2
    assert by_rank[2].activation_bytes == 250 * 2 * 1 + 1000 * 2


def test_zero3_gathers_with_ranks_on_their_own():
    # The first wave's weights are gathered from 0 as behind barriers (enc forward 5-9); enc's
    # backward gather leaves when ranks 0-1 pass head's backward step, at 29, once their
    # activations into head (9-29) are out.
    plan = dataclasses.replace(fx.plan(), options={**fx.plan().options, "zero": "3"})
    r = simulate(plan, _big_enc_graph(), fx.profile(), fx.cluster(), progress="rank")
    w0 = r.waves[0]
    assert (w0.forward_start_ms, w0.forward_end_ms) == pytest.approx((5.0, 9.0))
    starts = sorted(f.start_ms for f in r.flows if f.kind == "gather")
    assert starts == pytest.approx([0.0, 0.0, 29.0, 29.0])
    assert r.compute_ms + r.transfer_ms + r.sync_ms == pytest.approx(r.iteration_ms)


def test_simulated_peak_memory_is_the_plans_memory_table_under_tensor_parallelism(
        monkeypatch):
    # qwen-val-30b's committed plan runs llm layers in tp2 slices: a tp2 rank keeps part of
    # its group's stash beyond 1/2 (memory.stash_share), which the planner checked against
    # device memory; the simulation counted 1/2 and reported 1.3 GB less
    from pathlib import Path

    from spindle_cli.artifacts import (
        ClusterSpec,
        MetaOpGraph,
        Plan,
        Profile,
        load,
        load_recorded_input,
    )

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    path = "plans/qwen-val-30b-a800-32x8.yaml"
    plan = load(path, Plan)
    assert any(s.strategy == "tp2" for _, s in plan.slices())
    graph = load_recorded_input(plan, path, MetaOpGraph)[1]
    profile = load_recorded_input(plan, path, Profile)[1]
    cluster = load_recorded_input(plan, path, ClusterSpec)[1]
    result = simulate(plan, graph, profile, cluster)
    assert [r.peak_memory_bytes for r in result.ranks] == [m.total_bytes for m in plan.memory]
    assert result.peak_memory_bytes == max(m.total_bytes for m in plan.memory)
