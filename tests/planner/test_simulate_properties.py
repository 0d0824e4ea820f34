"""Invariants of the simulator on random small plans (hypothesis): whatever the placement,
split, sizes, links and progress mode, the timeline is causal and the breakdown adds up."""

from __future__ import annotations

import dataclasses
import itertools

import _sim_fixtures as fx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples

from spindle_cli.artifacts.plan import ParamGroup, Slice, Transfer, Wave
from spindle_cli.planner.buckets import SYNC_MODES
from spindle_cli.planner.simulate import PROGRESS_MODES, FlowTiming, simulate
from spindle_cli.planner.workload import FORWARD_SHARE

ranks = st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True).map(
    lambda r: tuple(sorted(r)))


@st.composite
def plans(draw):
    """enc (2 layers) in one or two slices, then head; any ranks; one group per slice."""
    split = draw(st.booleans())
    enc_ranges = [(0, 1), (1, 2)] if split else [(0, 2)]
    slices = []
    for w, (first, last) in enumerate(enc_ranges):
        slices.append(Slice(id=f"w{w}.0", metaop="t/enc", first=first, last=last,
                            ranks=draw(ranks), strategy="dp", time_ms=1.0))
    slices.append(Slice(id=f"w{len(enc_ranges)}.0", metaop="t/head", first=0, last=1,
                        ranks=draw(ranks), strategy="dp", time_ms=1.0))
    act = draw(st.integers(0, 10**9))
    transfers = tuple(Transfer(src=a.id, dst=b.id, bytes=act, src_ranks=a.ranks,
                               dst_ranks=b.ranks) for a, b in itertools.pairwise(slices))
    # a layer's group is the ranks of the slice running it (consistency.check_plan)
    groups = tuple(ParamGroup(module=s.metaop.split("/")[1], first_layer=s.first,
                              last_layer=s.last, ranks=s.ranks,
                              bytes=draw(st.integers(0, 10**9))) for s in slices)
    waves = tuple(Wave(index=i, level=0 if s.metaop == "t/enc" else 1, start_ms=float(i),
                       duration_ms=1.0, slices=(s,)) for i, s in enumerate(slices))
    return dataclasses.replace(fx.plan(), waves=waves, transfers=transfers,
                               param_groups=groups)


@settings(max_examples=examples(60), deadline=None)
@given(plan=plans(), batch=st.integers(1, 9), num_nodes=st.sampled_from([1, 2]),
       latency_s=st.sampled_from([0.0, 1e-5]), sync=st.sampled_from(SYNC_MODES),
       progress=st.sampled_from(PROGRESS_MODES), zero=st.sampled_from(["0", "1", "2", "3"]))
def test_timeline_is_causal_and_the_breakdown_adds_up(plan, batch, num_nodes, latency_s,
                                                      sync, progress, zero):
    plan = dataclasses.replace(plan, options={**plan.options, "zero": zero})
    args = (plan, fx.graph(batch), fx.profile(batch),
            fx.cluster(latency_s=latency_s, num_nodes=num_nodes))
    r = simulate(*args, sync=sync, progress=progress)
    assert (r.compute_ms + r.transfer_ms + r.sync_ms + r.optimizer_ms
            == pytest.approx(r.iteration_ms))
    assert min(r.transfer_ms, r.sync_ms, r.idle_fraction) >= 0
    # the forward's waits for parameter all-gathers are a part of sync, none without ZeRO
    if progress == "wave":
        assert 0 <= r.gather_wait_ms <= r.sync_ms + 1e-9
        assert zero != "0" or r.gather_wait_ms == 0
    else:
        assert r.gather_wait_ms is None
    # a stall lies inside its slice's forward, in order, and is no compute
    for s in r.slices:
        edges = [s.forward_start_ms, *(t for stall in s.forward_stalls for t in stall),
                 s.forward_end_ms]
        assert all(a <= b + 1e-9 for a, b in itertools.pairwise(edges))
        assert zero in ("1", "2") or not s.forward_stalls
    by_id = {s.slice_id: s for s in r.slices}
    # Waves follow each other (on each rank, when ranks go on their own); every slice's
    # backward comes after its forward.
    for a, b in itertools.combinations(r.slices, 2):
        if progress == "wave" or set(a.ranks) & set(b.ranks):
            first, then = (a, b) if a.wave < b.wave else (b, a)
            assert then.forward_start_ms >= first.forward_end_ms - 1e-9
            assert first.backward_start_ms >= then.backward_end_ms - 1e-9
    for s in r.slices:
        assert s.forward_end_ms <= s.backward_start_ms + 1e-9
    # A consumer starts only after its activations arrived; a producer's backward only after
    # the gradients did.
    for f in r.flows:
        assert f.end_ms >= f.start_ms
        if f.kind == "activation":
            src, dst = f.label.split("->")
            assert f.start_ms >= by_id[src].forward_end_ms - 1e-9
            assert by_id[dst].forward_start_ms >= f.end_ms - 1e-9
        elif f.kind == "gradient":
            src, dst = f.label.split("->")
            assert f.start_ms >= by_id[src].backward_end_ms - 1e-9
            assert by_id[dst].backward_start_ms >= f.end_ms - 1e-9
    # Gradients sync only once computed: a ring over layers [lo:hi) of a module starts once
    # every slice running one of them has passed it in its backward (a slice's operators
    # take equal shares of its backward, top first), every layer of a shared group is in
    # some ring, and the iteration waits for them.
    rings = [f for f in r.flows if f.kind == "sync" and not f.label.startswith("all-gather ")]
    synced: set[tuple[str, int]] = set()
    for f in rings:
        for part in f.label.split("+"):
            module, span = part.rstrip("]").split("[")
            lo, hi = map(int, span.split(":"))
            for layer in range(lo, hi):
                synced.add((module, layer))
                for s in r.slices:
                    if s.module == module and s.first <= layer < s.last:
                        share = (s.backward_end_ms - s.backward_start_ms) / (s.last - s.first)
                        assert f.start_ms >= (s.backward_start_ms + (s.last - layer) * share
                                              - 1e-9)
    for g in plan.param_groups:
        if len(g.ranks) > 1 and g.bytes >= len(g.ranks) * (g.last_layer - g.first_layer):
            assert {(g.module, layer) for layer in range(g.first_layer, g.last_layer)} <= synced
    for g in r.syncs:
        assert g.end_ms <= r.iteration_ms + 1e-9
    # A rank set runs its all-gathers one after another: on each rank set, an all-gather's
    # ring starts only once the one issued before it has ended.
    rings: dict[tuple[str, float], list[FlowTiming]] = {}
    for f in r.flows:
        if f.kind == "gather" or f.label.startswith("all-gather "):
            rings.setdefault((f.label, f.start_ms), []).append(f)
    spans: dict[frozenset[int], list[tuple[float, float]]] = {}
    for flows in rings.values():
        spans.setdefault(frozenset(f.src_rank for f in flows), []).append(
            (flows[0].start_ms, max(f.end_ms for f in flows)))
    for one_set in spans.values():
        one_set.sort()
        for (_, end), (start, _) in itertools.pairwise(one_set):
            assert start >= end - 1e-9
    # Under ZeRO-1/2 the previous step's all-gathers leave first, the first at 0 (after its
    # ring's message latencies, at most 3 over 4 ranks), and a slice's forward runs each of
    # its layers only after the all-gather of that layer has ended: it starts after its first
    # layer's, and its forward compute from a layer on (its backward's share of it, without
    # recomputation) comes after that layer's.
    gathers = [f for f in r.flows if f.kind == "sync" and f.label.startswith("all-gather ")]
    assert bool(gathers) <= (zero in ("1", "2"))
    if gathers:
        assert min(f.start_ms for f in gathers) <= 3 * latency_s * 1e3 + 1e-9
    for f in gathers:
        for part in f.label.removeprefix("all-gather ").split("+"):
            module, span = part.rstrip("]").split("[")
            lo, hi = map(int, span.split(":"))
            for s in r.slices:
                if s.module != module or not (s.first < hi and lo < s.last):
                    continue
                first = max(lo, s.first)
                if first == s.first:
                    assert s.forward_start_ms >= f.end_ms - 1e-9
                forward_ms = ((s.backward_end_ms - s.backward_start_ms)
                              * FORWARD_SHARE / (1 - FORWARD_SHARE))
                rest_ms = forward_ms * (s.last - first) / (s.last - s.first)
                assert s.forward_end_ms >= f.end_ms + rest_ms - 1e-6
    # Bytes are conserved: between disjoint rank sets every row moves (up to the rounding of
    # each piece down to whole bytes); nothing moves more than the transfer holds.
    for t in plan.transfers:
        for label in (f"{t.src}->{t.dst}", f"{t.dst}->{t.src}"):
            pieces = [f.bytes for f in r.flows if f.label == label]
            assert sum(pieces) <= t.bytes
            if not set(t.src_ranks) & set(t.dst_ranks):
                assert sum(pieces) > t.bytes - len(pieces) - 1
