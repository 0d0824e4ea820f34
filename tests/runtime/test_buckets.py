"""The executor's buckets (runtime/gradsync.py): each holds its layers' parameters and
gradients as views of two flat tensors, AdamW steps the flat parameter, and a bucket's
all-reduce is due after the lowest wave of any slice running its layers (with overlap_sync,
shared layers are bucketed by that wave, so each all-reduce starts as soon as it can)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, load
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.runtime.data import SyntheticData
from spindle_cli.runtime.dist import World
from spindle_cli.runtime.executor import Executor
from spindle_cli.runtime.program import build_program

REPO = Path(__file__).resolve().parents[2]


def _one_rank_executor() -> Executor:
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    local = load(str(REPO / "clusters" / "local-cpu.yaml"), ClusterSpec)
    one = dataclasses.replace(local, name="local-cpu-1", devices_per_node=1, island_size=1)
    profile = analytic_profile(graph, one, hardware="a800", counts=[1])
    plan = make_plan(graph, profile, one, options=PlanOptions(planner="spindle"))
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
                  device=torch.device("cpu"))
    return Executor(plan, build_program(plan, graph, model), model, world, {},
                    SyntheticData(model, 0), seed=0, lr=1e-3, dtype=torch.float32)


def _inside(t: torch.Tensor, flat: torch.Tensor) -> bool:
    start = flat.data_ptr()
    end = start + flat.numel() * flat.element_size()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


def test_layer_parameters_and_gradients_are_views_of_their_bucket_and_follow_the_step():
    ex = _one_rank_executor()
    (bucket,) = ex.sync.buckets  # one rank: every layer is held by (0,)
    assert bucket.param.grad is bucket.flat
    for _, p in ex.named:
        assert _inside(p, bucket.param) and _inside(p.grad, bucket.flat)
    assert ex.optimizer is not None
    assert [q for g in ex.optimizer.param_groups for q in g["params"]] == [bucket.param]
    before = {n: p.detach().clone() for n, p in ex.named}
    ex.train_step(0)
    changed = [n for n, p in ex.named if not torch.equal(p.detach(), before[n])]
    # the step updated the flat parameter, and every layer parameter saw it
    assert len(changed) == len(before)
    for _, p in ex.named:
        offset = (p.data_ptr() - bucket.param.data_ptr()) // p.element_size()
        assert torch.equal(p.detach().reshape(-1),
                           bucket.param.detach()[offset:offset + p.numel()])


@pytest.mark.parametrize("overlap_sync", [False, True])
def test_buckets_are_due_after_the_wave_that_completes_them_and_reduced_in_that_order(
        overlap_sync: bool):
    """Without overlap_sync (gloo's default) one bucket per holder set, due at the lowest wave
    of any of its layers; with it (NCCL's default) shared layers are split by the wave that
    completes them."""
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = load(str(REPO / "graphs" / "tiny-clip.yaml"), MetaOpGraph)
    plan = load(str(REPO / "plans" / "tiny-clip-local-cpu-2.yaml"), Plan)
    program = build_program(plan, graph, model)
    for rank in (0, 1):
        world = World(rank=rank, world_size=2, local_rank=rank, local_world_size=2,
                      backend="gloo", device=torch.device("cpu"))
        # building the executor does not communicate: no process group needed
        ex = Executor(plan, program, model, world, {}, SyntheticData(model, 0), seed=0,
                      lr=1e-3, dtype=torch.float32, overlap_sync=overlap_sync)
        assert ex.sync.buckets
        ready = {}
        for sp in program.slices:
            for i in sp.layers:
                key = (sp.metaop.module, i)
                ready[key] = min(ready.get(key, sp.wave), sp.wave)
        held = {key: ranks for key, ranks in program.holders.items() if rank in ranks}
        lowest = {}
        for key, ranks in held.items():
            lowest[ranks] = min(lowest.get(ranks, ready[key]), ready[key])

        due = {key: -1 if len(ranks) == 1 else ready[key] if overlap_sync else lowest[ranks]
               for key, ranks in held.items()}
        for b in ex.sync.buckets:
            mine = [key for key, ranks in held.items() if ranks == b.ranks
                    and due[key] == b.ready_wave]
            # the bucket holds exactly those layers' parameters
            assert b.flat.numel() == sum(p.numel() for key in mine
                                         for p in ex.layers[key].parameters())
        assert sorted((b.ranks, b.ready_wave) for b in ex.sync.buckets) == sorted(
            {(ranks, due[key]) for key, ranks in held.items()})
        shared = [b for b in ex.sync.buckets if len(b.ranks) > 1]
        assert len(shared) > 1 if overlap_sync else len(shared) == len({b.ranks for b in shared})
        # backward runs waves downwards: the bucket completed first is reduced first
        waves = [b.ready_wave for b in ex.sync.buckets]
        assert waves == sorted(waves, reverse=True)


def test_layer_chunks_cut_a_slice_and_are_issued_in_order_on_every_rank():
    """With 1-byte chunks (overlap_sync) each shared bucket of a wave is cut into at most 4
    chunks of whole layers, top layers first; a rank whose slice of that wave runs a chunk's
    layers has it complete after the slice's operators above the chunk's lowest layer (its
    forward is cut there), and any two ranks queue the buckets they share in the same order,
    whatever their rank sets (NCCL needs one order across process groups)."""
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    cluster = load(str(REPO / "clusters" / "local-cpu.yaml"), ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2, 4])
    plan = make_plan(graph, profile, cluster, options=PlanOptions(planner="sequential"))
    program = build_program(plan, graph, model)
    queues = []
    cut = False
    for rank in range(4):
        world = World(rank=rank, world_size=4, local_rank=rank, local_world_size=4,
                      backend="gloo", device=torch.device("cpu"))
        ex = Executor(plan, program, model, world, {}, SyntheticData(model, 0), seed=0,
                      lr=1e-3, dtype=torch.float32, overlap_sync=True, sync_chunk_bytes=1)
        by_slice = {sp.slice.id: sp for sp in program.slices}
        queue = [(b.ranks, b.ready_wave, b.layers) for b in ex.sync.queue]
        assert queue and all(rank in ranks and len(ranks) > 1 for ranks, _, _ in queue)
        queues.append(queue)
        waves = [w for _, w, _ in queue]
        assert waves == sorted(waves, reverse=True)
        for b in ex.sync.buckets:
            if b.after is None:
                continue
            sid, k = b.after
            sp = by_slice[sid]
            assert rank in sp.slice.ranks and sp.wave == b.ready_wave
            assert 1 <= k <= len(sp.layers)
            cut = cut or k < len(sp.layers)
        assert set(ex.cuts) <= {sp.slice.id for sp in program.slices if rank in sp.slice.ranks}
    assert cut, "no chunk completes before the end of its slice"
    for a in queues:
        for b in queues:
            assert [x for x in a if x in b] == [x for x in b if x in a]


@pytest.mark.parametrize("overlap_sync", [True, False])
def test_ranks_issue_the_buckets_they_share_in_one_order_across_groups(overlap_sync: bool):
    """Spindle's plan gives tiny-clip's ranks overlapping holder sets, hence several process
    groups per rank: NCCL needs the collectives two ranks share issued in the same order on
    both, whichever groups they run on."""
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    cluster = load(str(REPO / "clusters" / "local-cpu.yaml"), ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2, 4])
    plan = make_plan(graph, profile, cluster)
    program = build_program(plan, graph, model)
    queues = []
    for rank in range(4):
        world = World(rank=rank, world_size=4, local_rank=rank, local_world_size=4,
                      backend="gloo", device=torch.device("cpu"))
        ex = Executor(plan, program, model, world, {}, SyntheticData(model, 0), seed=0,
                      lr=1e-3, dtype=torch.float32, overlap_sync=overlap_sync,
                      sync_chunk_bytes=1)
        queues.append([(b.ranks, b.ready_wave, b.layers) for b in ex.sync.queue])
    assert max(len({ranks for ranks, _, _ in queue}) for queue in queues) > 1
    for a in queues:
        for b in queues:
            assert [x for x in a if x in b] == [x for x in b if x in a]
