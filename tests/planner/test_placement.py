"""Placement (islands, flows, memory, backtracking) and the memory ledger."""

from __future__ import annotations

import pytest
import yaml
from plan_builders import GIB, cluster, curve, graph, metaop, profile

from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.memory import Ledger, rows_per_rank, split_rows, state_bytes_per_param
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.placement import Flow, PlacedWaves, SliceSpec, _shortage, place


def spec(m, first, last, n, strategy="dp"):
    return SliceSpec(metaop=m, first=first, last=last, n=n, strategy=strategy)


def test_split_rows_gives_the_first_groups_one_extra_row():
    assert split_rows(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert split_rows(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert rows_per_rank(10, 8, "tp2") == [3, 3, 3, 3, 2, 2, 2, 2]
    assert state_bytes_per_param("bf16") == (2, 2, 12)
    assert state_bytes_per_param("fp32") == (4, 4, 8)


def test_ledger_counts_one_replica_per_rank_and_every_stash():
    a = metaop("t1/enc", layers=4, batch=8, module="enc", params=100, stash=10)
    b = metaop("t2/enc", layers=4, batch=4, module="enc", params=100, stash=10)
    g = graph([a, b])
    led = Ledger(g, 4)
    led.commit(a, 0, 4, (0, 1), "dp")
    led.commit(b, 0, 2, (1, 2), "dp")  # rank 1 already holds layers 0-1 of enc
    table = {m.rank: m for m in led.table()}
    assert table[0].param_bytes == 4 * 100 * 2 and table[0].optimizer_bytes == 4 * 100 * 12
    assert table[1].param_bytes == 4 * 100 * 2
    assert table[2].param_bytes == 2 * 100 * 2
    assert table[3].total_bytes == 0
    assert table[0].activation_bytes == 10 * 4 * 4  # 4 rows x 4 operators
    assert table[1].activation_bytes == 10 * 4 * 4 + 10 * 2 * 2
    assert led.used()[1] == table[1].total_bytes
    # need() charges only the layers a rank does not hold yet, plus the stash
    need = led.need(b, 2, 4, 2, "dp")
    assert need[1] == pytest.approx(10 * 2 * 2)
    assert need[2] == pytest.approx(2 * 100 * 16 + 10 * 2 * 2)
    assert need[3] == pytest.approx(2 * 100 * 16 + 10 * 2 * 2)


def test_a_slice_that_fits_an_island_stays_inside_one():
    g = graph([metaop("t/a", layers=2, batch=8), metaop("t/b", layers=2, batch=8)])
    c = cluster(num_nodes=2, per_node=4)
    waves = [[spec(g.metaop("t/a"), 0, 2, 2), spec(g.metaop("t/b"), 0, 2, 4)]]
    [[ra, rb]], _ = place(waves, [], g, c)
    assert len({r // 4 for r in rb}) == 1
    assert len({r // 4 for r in ra}) == 1
    assert not set(ra) & set(rb)


def test_the_consumer_lands_on_its_producers_ranks():
    a = metaop("t/a", layers=2, batch=8, act_bytes=1 << 20)
    g = graph([a, metaop("t/other", layers=2, batch=8)])
    c = cluster(num_nodes=2, per_node=4)
    waves = [[spec(g.metaop("t/other"), 0, 1, 4), spec(a, 0, 1, 2)],
             [spec(a, 1, 2, 2), spec(g.metaop("t/other"), 1, 2, 4)]]
    flows = [Flow(src=(0, 1), dst=(1, 0), bytes=1 << 20), Flow(src=(0, 0), dst=(1, 1), bytes=1)]
    ranks, _ = place(waves, flows, g, c)
    assert ranks[1][0] == ranks[0][1]
    assert ranks[1][1] == ranks[0][0]


def test_a_slice_goes_to_its_home_ranks_when_nothing_else_pulls_it():
    g = graph([metaop("t/a", layers=2, batch=8), metaop("u/b", layers=2, batch=8)])
    c = cluster(num_nodes=2, per_node=4)
    waves = [[spec(g.metaop("t/a"), 0, 1, 2), spec(g.metaop("u/b"), 0, 1, 2)],
             [spec(g.metaop("u/b"), 1, 2, 2), spec(g.metaop("t/a"), 1, 2, 2)]]
    home = {"t/a": (6, 7), "u/b": (2, 3)}
    ranks, _ = place(waves, [], g, c, home=home)
    assert ranks == [[(6, 7), (2, 3)], [(2, 3), (6, 7)]]
    # without homes the two slices take the first free ranks of the first island
    plain, _ = place(waves, [], g, c)
    assert plain[0] != ranks[0]


def test_sequential_placement_uses_consecutive_ranks_in_slot_order():
    g = graph([metaop("t/a", layers=2, batch=8), metaop("t/b", layers=2, batch=8)])
    c = cluster(num_nodes=2, per_node=4)
    waves = [[spec(g.metaop("t/a"), 0, 2, 2), spec(g.metaop("t/b"), 0, 2, 4)]]
    ranks, _ = place(waves, [], g, c, mode="sequential")
    assert ranks == [[(0, 1), (2, 3, 4, 5)]]


def test_locality_gives_way_to_memory_when_a_rank_would_overflow():
    # two 1-rank slices of one MetaOp: locality wants the second on the first's rank, but the
    # two stashes do not fit on one rank, so the wave is re-placed memory-first
    a = metaop("t/a", layers=2, batch=4, params=0, stash=100, act_bytes=1 << 20)
    g = graph([a])
    c = cluster(num_nodes=1, per_node=2, memory_bytes=600)
    waves = [[spec(a, 0, 1, 1)], [spec(a, 1, 2, 1)]]
    flows = [Flow(src=(0, 0), dst=(1, 0), bytes=1 << 20)]
    placements = PlacedWaves(g, c)
    ranks, ledger = place(waves, flows, g, c, placements=placements)
    assert ranks[0][0] != ranks[1][0]
    assert max(m.total_bytes for m in ledger.table()) <= 600
    # which the search takes for memory limiting its candidates (`api.fitting_plan_with_cost`)
    assert placements.short_of_memory
    c = cluster(num_nodes=1, per_node=2)
    roomy = PlacedWaves(g, c)
    assert place(waves, flows, g, c, placements=roomy)[0] == [[(0,)], [(0,)]]
    assert not roomy.short_of_memory


def test_infeasible_placement_names_the_rank_and_the_bytes():
    a = metaop("t/a", layers=2, batch=4, params=0, stash=100)
    g = graph([a])
    c = cluster(num_nodes=1, per_node=2, memory_bytes=300)
    short = r"needs 400 B \(400 bytes\) more but only 300 B \(300 bytes\) are available"
    with pytest.raises(PlanInfeasible, match=r"rank \d " + short):
        place([[spec(a, 0, 1, 1)]], [], g, c)
    with pytest.raises(PlanInfeasible, match=r"rank 0 " + short):
        place([[spec(a, 0, 1, 1)]], [], g, c, mode="sequential")


def test_a_rank_given_a_second_shard_of_its_layers_is_charged_both():
    # consecutive ranks: the tp2 group (0, 1) in wave 0, then (1, 2) behind a one-rank slice,
    # so rank 1 runs shard 1 and then shard 0 of the same four layers: all of them
    a = metaop("t1/enc", layers=4, batch=4, module="enc", params=100, stash=0)
    b = metaop("t2/enc", layers=4, batch=4, module="enc", params=100, stash=0)
    o = metaop("t3/other", layers=1, batch=4, module="other", params=0, stash=0)
    g = graph([a, b, o])
    waves = [[spec(a, 0, 4, 2, "tp2")], [spec(o, 0, 1, 1), spec(b, 0, 4, 2, "tp2")]]
    # half of 4 layers of 100 parameters at 16 B each: 3200 B; all of them: 6400 B
    ranks, ledger = place(waves, [], g, cluster(per_node=4, memory_bytes=6400), mode="sequential")
    assert ranks == [[(0, 1)], [(0,), (1, 2)]]
    assert [m.total_bytes for m in ledger.table()] == [3200, 6400, 3200, 0]
    short = r"needs 3.1 KiB \(3200 bytes\) more but only 1.8 KiB \(1800 bytes\) are available"
    with pytest.raises(PlanInfeasible, match=r"rank 1 also holds other tensor-parallel shards "
                                             r"of its layers and " + short):
        place(waves, [], g, cluster(per_node=4, memory_bytes=5000), mode="sequential")


def test_zero_sharding_lets_placement_fit_what_replicas_do_not():
    from spindle_cli.planner.memory import MemoryStrategy

    # 4 layers x 1000 params on 4 ranks: 64000 B replicated, 4 x 1000 x 16 / 4 = 16000 B
    # under ZeRO-3 plus one gathered layer (2000 B) and 4 layers x 8 B x 2 rows of stash
    a = metaop("t/a", layers=4, batch=8, params=1000, stash=8)
    g = graph([a])
    c = cluster(per_node=4, memory_bytes=20_000)
    waves = [[spec(a, 0, 4, 4)]]
    with pytest.raises(PlanInfeasible, match="out of memory"):
        place(waves, [], g, c)
    for mode in ("island", "sequential"):
        [[ranks]], ledger = place(waves, [], g, c, mode=mode, memory=MemoryStrategy(zero=3))
        assert ranks == (0, 1, 2, 3)
        assert [m.total_bytes for m in ledger.table()] == [16000 + 2000 + 64] * 4



@pytest.mark.parametrize("zero", [1, 2, 3])
def test_a_slice_sharing_a_layer_with_a_larger_one_of_its_wave_is_charged_its_shard(zero):
    """A layer that two slices of one wave run, on 1 and 3 ranks, ends with 4 holders: the
    1-rank slice, whichever is placed first, needs a quarter of the sharded state, not all
    of it (placed first by its incoming flow, it was refused where consecutive ranks fit:
    'rank 0 needs 30.5 MiB more', the whole state, on 20-32 MB devices)."""
    from spindle_cli.planner.assemble import _flows
    from spindle_cli.planner.memory import MemoryStrategy

    p = 10**6
    pre = metaop("t0/pre", layers=1, batch=4, module="pre", params=0, act_bytes=10**6, stash=0)
    a = metaop("t0/head", level=1, layers=2, batch=4, module="head", params=p,
               preds=("t0/pre",), stash=1000)
    b = metaop("t1/head", level=0, layers=2, batch=3, module="head", params=p, stash=1000)
    g = graph([pre, a, b])
    waves = [[spec(pre, 0, 1, 1)], [spec(b, 0, 2, 3), spec(a, 0, 2, 1)]]
    memory = MemoryStrategy(zero=zero)
    # what every rank ends with, consecutively placed
    _, ledger = place(waves, _flows(g, waves), g, cluster(per_node=4, memory_bytes=10**9),
                      mode="sequential", memory=memory)
    peak = max(m.total_bytes for m in ledger.table())
    c = cluster(per_node=4, memory_bytes=peak + 10**5)
    for mode in ("island", "sequential"):
        ranks, ledger = place(waves, _flows(g, waves), g, c, mode=mode, memory=memory)
        assert sorted(len(r) for r in ranks[1]) == [1, 3]
        assert max(m.total_bytes for m in ledger.table()) <= c.device.memory_bytes

def test_reserved_ranks_stay_with_the_slice_whose_rows_are_there():
    # wave 2: a2 keeps half of its rows on rank 0 or on rank 2 (a tie); rank 2 holds a's big
    # parameters, so memory balance sends a2 to rank 0, which holds all of b2's rows. With
    # `reserve`, rank 0 is b2's and a2 takes rank 2.
    c, a, b = (metaop("t/c", layers=1, batch=4, params=10),
               metaop("t/a", layers=1, batch=4, params=10**8),
               metaop("u/b", layers=1, batch=4, params=10))
    a2, b2 = metaop("t/a2", layers=1, batch=4, params=10), metaop("u/b2", layers=1, batch=4,
                                                                 params=10)
    g = graph([c, a, b, a2, b2])
    waves = [[spec(c, 0, 1, 1)], [spec(a, 0, 1, 1), spec(b, 0, 1, 1)],
             [spec(a2, 0, 1, 1), spec(b2, 0, 1, 1)]]
    home = {"t/c": (0,), "t/a": (2,), "u/b": (0,)}
    flows = [Flow(src=(0, 0), dst=(2, 0), bytes=10 << 20),
             Flow(src=(1, 0), dst=(2, 0), bytes=10 << 20),
             Flow(src=(1, 1), dst=(2, 1), bytes=5 << 20)]
    plain, _ = place(waves, flows, g, cluster(per_node=4), home=home)
    reserved, _ = place(waves, flows, g, cluster(per_node=4), home=home, reserve=True)
    assert plain[:2] == reserved[:2] == [[(0,)], [(2,), (0,)]]
    assert plain[2][0] == (0,) and plain[2][1] != (0,)
    assert reserved[2] == [(2,), (0,)]


def test_tensor_parallel_groups_never_span_islands():
    # 2 islands of 4. p and q keep their rows on ranks 0 and 4 and choose first, leaving three
    # free ranks in each island to the 6-rank tp2 slice t: filling them would pair ranks 3 and
    # 5 across islands. The wave is placed again (balance first) so that every pair fits.
    p, q = metaop("u/p", layers=2, batch=8), metaop("v/q", layers=2, batch=8)
    t = metaop("w/t", layers=1, batch=8)
    g = graph([p, q, t])
    waves = [[spec(p, 0, 1, 1), spec(q, 0, 1, 1)],
             [spec(p, 1, 2, 1), spec(q, 1, 2, 1), spec(t, 0, 1, 6, "tp2")]]
    flows = [Flow(src=(0, 0), dst=(1, 0), bytes=10 << 20),
             Flow(src=(0, 1), dst=(1, 1), bytes=10 << 20)]
    ranks, _ = place(waves, flows, g, cluster(num_nodes=2, per_node=4),
                     home={"u/p": (0,), "v/q": (4,)})
    tp = ranks[1][2]
    assert len(tp) == 6
    assert all(tp[k] // 4 == tp[k + 1] // 4 for k in range(0, 6, 2))
    assert sorted(r for s in ranks[1] for r in s) == list(range(8))


def test_a_plan_whose_tensor_parallel_group_spans_islands_is_rejected(tmp_path, spindle):
    from _sim_fixtures import plan

    from spindle_cli.artifacts import Plan, load, write_artifact

    path = tmp_path / "p.yaml"
    write_artifact(plan(enc_ranks=(0, 1)), str(path))
    text = path.read_text()
    assert "strategy: dp" in text
    # the encoder slice becomes one tp2 group on ranks 1 and 2, across islands (0, 1), (2, 3)
    data = yaml.safe_load(text)
    data["waves"][0]["slices"][0].update(strategy="tp2", ranks=[1, 2])
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(path))
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: {path}: waves[0].slices[0].ranks: tensor-parallel group [1, 2] spans islands "
        "[0, 1]; each group must stay inside one island")
    data["waves"][0]["slices"][0].update(ranks=[2, 3])
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    # inside island (2, 3) the group reads well (validate goes on to want the plan's inputs,
    # which this hand-made plan does not record)
    assert load(str(path), Plan).waves[0].slices[0].ranks == (2, 3)


def test_sequential_placement_refuses_a_tensor_parallel_group_across_islands():
    a, t = metaop("u/a", layers=1, batch=8), metaop("w/t", layers=1, batch=8)
    g = graph([a, t])
    c = cluster(num_nodes=2, per_node=4)
    # ranks 0 | 1-2 | 3-4: the second tp2 group would pair ranks 3 and 4
    waves = [[spec(a, 0, 1, 1), spec(t, 0, 1, 4, "tp2")]]
    with pytest.raises(PlanInfeasible, match=r"tensor-parallel group \[3, 4\] of .* in wave 0"):
        place(waves, [], g, c, mode="sequential")
    waves = [[spec(a, 0, 1, 2), spec(t, 0, 1, 4, "tp2")]]
    ranks, _ = place(waves, [], g, c, mode="sequential")
    assert ranks == [[(0, 1), (2, 3, 4, 5)]]


def test_a_memory_shortage_is_named_when_backtracking_ends_elsewhere():
    # ZeRO-3 on 100 MB devices: the first placement runs out of memory; the memory-first
    # re-placements scatter slices and then find no island room for enc1's tp4 groups. The
    # error names the shortage (rank, bytes), the cause: with 80 GiB the graph plans.
    g = graph([metaop("t0/enc0", layers=6, batch=3, module="enc0", params=10_000_000,
                      act_bytes=0, stash=0),
               metaop("t0/enc1", layers=3, batch=3, module="enc1", params=0, act_bytes=0,
                      stash=0),
               metaop("t0/head4", layers=3, batch=3, module="head4", params=0, act_bytes=0,
                      stash=0)])
    p = profile([curve("t0/enc0", 3, [(1, 1 << 20, 0.38, 0.25, "dp")]),
                 curve("t0/enc1", 3, [(1, 1 << 20, 0.27, 2.35, "tp4")]),
                 curve("t0/head4", 3, [(1, 1 << 20, 0.27, 0.70, "dp")])])
    small = cluster(num_nodes=2, per_node=8, memory_bytes=100_000_000)
    with pytest.raises(PlanInfeasible, match=r"out of memory placing .* rank \d+ needs .* "
                                             r"bytes\) more but only .* bytes\) are available"):
        make_plan(g, p, small, options=PlanOptions(zero=3))
    make_plan(g, p, cluster(num_nodes=2, per_node=8, memory_bytes=80 * GIB),
              options=PlanOptions(zero=3))


def test_the_shortage_named_is_the_one_backtracking_could_not_get_round():
    # 2 ranks of 1000 B. Locality puts a's second slice on its first one's rank (800 B), so c
    # (300 B on each rank) fits only once wave 1 is placed again memory-first, on the other
    # rank. d (800 B on one rank) then fits nowhere: the error names d in wave 3, not c.
    a = metaop("t/a", layers=2, batch=4, params=0, stash=100, act_bytes=1 << 20)
    c = metaop("u/c", layers=1, batch=4, params=0, stash=150)
    d = metaop("v/d", layers=1, batch=4, params=0, stash=200)
    g = graph([a, c, d])
    small = cluster(num_nodes=1, per_node=2, memory_bytes=1000)
    waves = [[spec(a, 0, 1, 1)], [spec(a, 1, 2, 1)], [spec(c, 0, 1, 2)]]
    flows = [Flow(src=(0, 0), dst=(1, 0), bytes=1 << 20)]
    ranks, ledger = place(waves, flows, g, small)
    assert ranks[0] != ranks[1]
    assert [m.total_bytes for m in ledger.table()] == [700, 700]
    with pytest.raises(PlanInfeasible, match=(
            r"^out of memory placing v/d operators \[0, 1\) on 1 ranks in wave 3: rank \d needs "
            r"800 B \(800 bytes\) more but only 300 B \(300 bytes\) are available")):
        place([*waves, [spec(d, 0, 1, 1)]], flows, g, small)


def test_a_tensor_parallel_group_finds_room_when_the_islands_fill_up():
    # 3 islands of 8: three 5-rank data-parallel slices, placed first (larger), would take one
    # island each and leave 3 ranks per island, too few for the 4-rank tp4 group; the wave is
    # placed again with its largest group first
    ops = [metaop(f"t{i}/enc", layers=1, batch=5, module=f"enc{i}", act_bytes=0, stash=0)
           for i in range(4)]
    g = graph(ops)
    wave = [spec(ops[0], 0, 1, 5), spec(ops[1], 0, 1, 5), spec(ops[2], 0, 1, 5),
            spec(ops[3], 0, 1, 4, "tp4")]
    ranks, _ = place([wave], [], g, cluster(num_nodes=3, per_node=8))
    (placed,) = ranks
    assert len({r for rs in placed for r in rs}) == 19
    assert len({r // 8 for r in placed[3]}) == 1
    assert all(len(rs) == s.n for rs, s in zip(placed, wave, strict=True))


def test_a_tensor_parallel_group_stopped_by_memory_names_the_rank_and_the_bytes():
    # 2 islands of 4 ranks of 700 B. x and y hold 200 B on three ranks of each island; the tp2
    # slice t needs 647 B on each of its ranks, which only ranks 3 and 7 have: every rank is
    # free, but no island has two with room. Rank 0 is short the least of those that are.
    x = metaop("t/x", layers=1, batch=3, params=0, stash=200)
    y = metaop("u/y", layers=1, batch=3, params=0, stash=200)
    t = metaop("w/t", layers=1, batch=2, params=0, stash=500)
    g = graph([x, y, t])
    waves = [[spec(x, 0, 1, 3), spec(y, 0, 1, 3)], [spec(t, 0, 1, 2, "tp2")]]
    with pytest.raises(PlanInfeasible, match=(
            r"^out of memory placing w/t operators \[0, 1\) on 2 ranks in wave 1 with each "
            r"tensor-parallel group of 2 inside one island: rank 0 needs 648 B \(648 bytes\) "
            r"more but only 500 B \(500 bytes\) are available \(of 700 B\)$")):
        place(waves, [], g, cluster(num_nodes=2, per_node=4, memory_bytes=700))


def _rows_kept(src, dst, batch):
    """Rows each consumer rank already holds from the producer: both split `batch` in rank
    order (`split_rows`), so position j of a slice owns the j-th contiguous range."""
    def ranges(ranks):
        return dict(zip(ranks, split_rows(batch, len(ranks)), strict=True))

    have, need = ranges(src), ranges(dst)
    return sum(max(0, min(need[r][1], have[r][1]) - max(need[r][0], have[r][0]))
               for r in dst if r in have)


def test_local_ranks_of_a_smaller_consumer_are_every_kth_producer_rank():
    from spindle_cli.planner.placement import _local_ranks

    # 4 producer ranks, a 2-rank consumer (k = 2): consumer position j needs the rows of
    # producer positions 2j and 2j + 1, so ranks 0 and 2 each keep half their rows local
    assert _local_ranks((0, 1, 2, 3), 2) == (0, 2)
    assert _rows_kept((0, 1, 2, 3), (0, 2), 8) == 4
    # two neighbours keep only the first position's share: rank 1's rows are 2-3, it needs 4-7
    assert _rows_kept((0, 1, 2, 3), (0, 1), 8) == 2
    assert _local_ranks((4, 5, 6, 7, 8, 9), 3) == (4, 6, 8)
    assert _local_ranks((4, 5, 6, 7, 8, 9), 2) == (4, 7)
    # k not whole, or a consumer as large as the producer: every producer rank may be reused
    assert _local_ranks((0, 1, 2, 3), 3) == (0, 1, 2, 3)
    assert _local_ranks((0, 1), 4) == (0, 1)


def test_a_slice_that_is_mostly_parameters_is_not_left_without_a_rank():
    # ranks of 850 B. Wave 0 puts 200 B of activations on a rank; in wave 1 the activation
    # order places the 100 B slice first, on the emptier rank, and the 704 B of state of
    # v/p then fit nowhere. Ordered by their whole need, v/p goes first onto the empty rank.
    z = metaop("t/z", layers=1, batch=4, params=0, stash=50)
    s = metaop("u/s", layers=1, batch=4, params=0, stash=25)
    p = metaop("v/p", layers=1, batch=4, params=44, stash=0)
    g = graph([z, s, p])
    waves = [[spec(z, 0, 1, 1)], [spec(s, 0, 1, 1), spec(p, 0, 1, 1)]]
    ranks, ledger = place(waves, [], g, cluster(num_nodes=1, per_node=2, memory_bytes=850))
    assert ranks[1][1] != ranks[0][0] and ranks[1][0] == ranks[0][0]
    assert sorted(m.total_bytes for m in ledger.table()) == [300, 704]
    with pytest.raises(PlanInfeasible, match="needs"):
        place(waves, [], g, cluster(num_nodes=1, per_node=2, memory_bytes=700))


def test_a_shortage_is_told_in_whole_bytes_with_the_need_above_the_room():
    # a rank's share of a sharded layer is a fraction of a byte: 647.06 B needed, 500.4 free
    said = _shortage(647.0588, 500.4, 1000.0)
    assert said == ("needs 648 B (648 bytes) more but only 500 B (500 bytes) are available "
                    "(of 1000 B)")
    assert "needs 700 B (700 bytes)" in _shortage(700.0000000001, 0.0, 1000.0)
