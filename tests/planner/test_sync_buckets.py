"""The gradient bucket layout shared by the executor and the simulator (planner/buckets.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import _sim_fixtures as fx
import pytest

from spindle_cli.artifacts import MetaOpGraph, Plan, load
from spindle_cli.planner.buckets import MAX_CHUNKS, SYNC_MODES, max_chunks, sync_buckets

REPO = Path(__file__).resolve().parents[2]


def test_the_fixture_encoder_is_cut_into_one_chunk_per_layer_top_first():
    metaops = {m.id: m for m in fx.graph().metaops}
    enc_and_head = sync_buckets(fx.plan(), metaops, "chunked", chunk_bytes=1)
    assert [(b.ranks, b.wave, b.layers, b.bytes, b.passes) for b in enc_and_head] == [
        ((2, 3), 1, (("head", 0),), 500_000_000, (("w1.0", 1),)),
        ((0, 1), 0, (("enc", 1),), 500_000_000, (("w0.0", 1),)),
        ((0, 1), 0, (("enc", 0),), 500_000_000, (("w0.0", 2),)),
    ]
    # per wave the same layers make one bucket, complete at the end of the slice
    whole = sync_buckets(fx.plan(), metaops, "per-wave")
    assert [(b.layers, b.bytes, b.passes) for b in whole] == [
        ((("head", 0),), 500_000_000, (("w1.0", 1),)),
        ((("enc", 1), ("enc", 0)), 1_000_000_000, (("w0.0", 2),)),
    ]
    assert sync_buckets(fx.plan(), metaops, "after-backward") == []


def test_a_rank_set_split_over_waves_has_one_bucket_per_set_or_per_wave():
    metaops = {m.id: m for m in fx.graph().metaops}
    plan = fx.plan_split_encoder()
    per_wave = sync_buckets(plan, metaops, "per-wave")
    assert [(b.wave, b.layers) for b in per_wave] == [
        (2, (("head", 0),)), (1, (("enc", 1),)), (0, (("enc", 0),))]
    (per_set,) = sync_buckets(plan, metaops, "per-set")
    # due at the lowest wave of any of its layers, complete once that wave's slice is done
    assert (per_set.wave, per_set.passes, per_set.bytes) == (0, (("w0.0", 1),), 1_000_000_000)
    assert sorted(per_set.layers) == [("enc", 0), ("enc", 1), ("head", 0)]


@pytest.fixture(scope="module")
def shipped() -> tuple[Plan, MetaOpGraph]:
    return (load(str(REPO / "plans" / "multitask-clip-a800-2x8.yaml"), Plan),
            load(str(REPO / "graphs" / "multitask-clip.yaml"), MetaOpGraph))


@pytest.mark.parametrize("mode", [m for m in SYNC_MODES if m != "after-backward"])
@pytest.mark.parametrize("chunk_bytes", [1, 25 * 2**20])
def test_every_layer_is_in_one_bucket_of_its_holders_issued_in_backward_order(
        shipped: tuple[Plan, MetaOpGraph], mode: str, chunk_bytes: int):
    plan, graph = shipped
    metaops = {m.id: m for m in graph.metaops}
    buckets = sync_buckets(plan, metaops, mode, chunk_bytes)
    held = {(g.module, layer): gi for gi, g in enumerate(plan.param_groups)
            for layer in range(g.first_layer, g.last_layer)}
    seen = [key for b in buckets for key in b.layers]
    assert sorted(seen) == sorted(held)
    for b in buckets:
        assert {plan.param_groups[held[key]].ranks for key in b.layers} == {b.ranks}
        assert b.groups == tuple(sorted({held[key] for key in b.layers}))
    waves = [b.wave for b in buckets]
    assert waves == sorted(waves, reverse=True)
    for gi, g in enumerate(plan.param_groups):
        share = sum(b.bytes for b in buckets if b.groups == (gi,))
        if all(b.groups == (gi,) for b in buckets if gi in b.groups):
            assert abs(share - g.bytes) <= len(buckets)
    # the slices a bucket waits for: every slice of its wave running one of its layers, each
    # until it has passed the bucket's lowest layer (its whole slice but when chunked)
    by_id = {s.id: (w.index, s) for w, s in plan.slices()}
    for b in buckets:
        expected = {}
        for w, s in plan.slices():
            m = metaops[s.metaop]
            lo, hi = m.first_layer + s.first, m.first_layer + s.last
            inside = [layer for module, layer in b.layers
                      if module == m.module and lo <= layer < hi]
            if w.index == b.wave and inside:
                expected[s.id] = hi - min(inside) if mode == "chunked" else hi - lo
        assert dict(b.passes) == expected
        assert all(by_id[sid][0] == b.wave for sid, _ in b.passes)
    if mode == "per-set":
        assert len({b.ranks for b in buckets}) == len(buckets)


@pytest.mark.parametrize("most", [None, 1, 8, 16])
def test_chunks_are_whole_layers_of_at_least_their_share_of_their_wave_bucket(
        shipped: tuple[Plan, MetaOpGraph], most: int | None):
    # at most the plan's `sync_chunks` chunks per wave bucket (MAX_CHUNKS without it)
    plan, graph = shipped
    options = {k: v for k, v in plan.options.items() if k != "sync_chunks"}
    if most is not None:
        options["sync_chunks"] = str(most)
    plan = dataclasses.replace(plan, options=options)
    most = most or MAX_CHUNKS
    assert max_chunks(plan) == most
    metaops = {m.id: m for m in graph.metaops}
    whole = sync_buckets(plan, metaops, "per-wave")
    for chunk_bytes in (1, 25 * 2**20, 2**40):
        chunks = sync_buckets(plan, metaops, "chunked", chunk_bytes)
        for b in whole:
            mine = [c for c in chunks if (c.ranks, c.wave) == (b.ranks, b.wave)]
            assert 1 <= len(mine) <= most
            # the wave's layers, in the order its backward completes them
            assert [key for c in mine for key in c.layers] == sorted(
                b.layers, key=lambda k: (k[0], -k[1]))
            least = max(chunk_bytes, b.bytes / most)
            assert all(c.bytes >= least - len(b.groups) for c in mine[:-1])
            if chunk_bytes >= b.bytes:
                assert len(mine) == 1
    assert (len(sync_buckets(plan, metaops, "chunked", 1)) > len(whole)) == (most > 1)


def test_more_chunks_allowed_cut_the_wave_buckets_finer(shipped: tuple[Plan, MetaOpGraph]):
    plan, graph = shipped
    metaops = {m.id: m for m in graph.metaops}
    counts = [len(sync_buckets(dataclasses.replace(
        plan, options={**plan.options, "sync_chunks": str(most)}), metaops, "chunked", 1))
        for most in (1, 2, 4, 8, 16)]
    assert counts[0] == len(sync_buckets(plan, metaops, "per-wave"))
    assert counts == sorted(counts) and counts[3] > counts[2]
