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


def test_zero1_and_zero2_reduce_scatter_then_all_gather_after_the_step():
    base = run({})
    for zero in ("1", "2"):
        r = run({"zero": zero})
        enc = next(s for s in r.syncs if s.module == "enc")
        # enc's 1 GB over ranks 0-1 at 100 GB/s: the base all-reduce sends 1 GB each way,
        # 55-65; the reduce-scatter sends 0.5 GB, 55-60, the step takes no time (the profile
        # has no optimizer cost), then the all-gather of the stepped shards 0.5 GB, 60-65
        flows = [f for f in r.flows if f.kind == "sync" and "enc" in f.label]
        reduce = [f for f in flows if not f.label.startswith("all-gather")]
        gather = [f for f in flows if f.label.startswith("all-gather")]
        assert [f.bytes for f in reduce] == [f.bytes for f in gather] == [500_000_000] * 2
        assert [t for f in reduce for t in (f.start_ms, f.end_ms)] == \
            pytest.approx([55.0, 60.0] * 2)
        assert [t for f in gather for t in (f.start_ms, f.end_ms)] == \
            pytest.approx([60.0, 65.0] * 2)
        assert (enc.start_ms, enc.end_ms) == pytest.approx((55.0, 65.0))
        # head's bucket on ranks 2-3 is reduced by 29.5 and gathered after that
        head = [f for f in r.flows if f.kind == "sync" and "head" in f.label]
        assert [f.end_ms for f in head if not f.label.startswith("all-gather")] == \
            pytest.approx([29.5, 29.5])
        assert all(f.start_ms >= 29.5 and f.end_ms <= r.iteration_ms for f in head
                   if f.label.startswith("all-gather"))
        assert r.iteration_ms == pytest.approx(base.iteration_ms)
        assert r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms == \
            pytest.approx(r.iteration_ms)
        assert not [f for f in r.flows if f.kind == "gather"]


def test_zero1_all_gather_waits_for_the_step():
    """With an optimizer cost, every rank steps once its groups are reduced, and a bucket's
    all-gather leaves once all its ranks have stepped."""
    plan = dataclasses.replace(fx.plan(), options={**fx.plan().options, "zero": "1"})
    p = dataclasses.replace(fx.profile(), optimizer=OptimizerCost(ms_per_tensor=2.0,
                                                                  ms_per_million_params=0.0))
    r = simulate(plan, fx.graph(), p, fx.cluster(), sync="per-wave")
    gather = [f for f in r.flows if f.label.startswith("all-gather enc")]
    # enc reduced at 60, ranks 0-1 step 60-62 (one bucket), gather 62-67
    assert [t for f in gather for t in (f.start_ms, f.end_ms)] == pytest.approx([62.0, 67.0] * 2)
    assert r.iteration_ms == pytest.approx(67.0)
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
