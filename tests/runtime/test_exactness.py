"""The central runtime tests: a plan executed on gloo ranks trains exactly like one process.

Every test runs 3 AdamW steps of tiny-clip (four contrastive tasks sharing three encoders) in
float64 and compares every step's per-task loss and every parameter each rank holds with a
single-process reference training of the same model on the same data. Tolerance: relative
1e-6 (absolute 1e-9 near zero); the distributed runs differ from the reference only by
floating-point summation order (sharded batches, all-reduce), measured at ~1e-10.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from harness import run_distributed

from plans import hand_plan, whole
from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, load
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.buckets import sync_buckets
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.memory import state_bytes_per_param
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.runtime.data import SyntheticData
from spindle_cli.runtime.model import reference_training

pytestmark = pytest.mark.dist

STEPS, SEED, LR = 3, 11, 1e-2
RTOL, ATOL = 1e-6, 1e-9


def train_rank(rank: int, world: int, plan: Plan, graph: MetaOpGraph, model: ModelSpec,
               dtype: str, overlap_sync: bool | None = None, sync_chunk_bytes: int | None = None
               ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    import torch as t

    from spindle_cli.runtime.dist import World
    from spindle_cli.runtime.options import TrainOptions
    from spindle_cli.runtime.program import build_program
    from spindle_cli.runtime.training import train

    w = World(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
              backend="gloo", device=t.device("cpu"))
    opts = TrainOptions(steps=STEPS, seed=SEED, lr=LR, dtype=dtype, overlap_sync=overlap_sync)
    if sync_chunk_bytes is not None:
        opts = dataclasses.replace(opts, sync_chunk_bytes=sync_chunk_bytes)
    result = train(plan, graph, model, build_program(plan, graph, model), w, opts)
    return result.losses, result.params


@pytest.fixture(scope="module")
def model(repo_root: Any) -> ModelSpec:
    return load(str(repo_root / "models" / "tiny-clip.yaml"), ModelSpec)


@pytest.fixture(scope="module")
def graph(model: ModelSpec) -> MetaOpGraph:
    return build_graph(model, dtype="fp32")


@pytest.fixture(scope="module")
def reference(model: ModelSpec, graph: MetaOpGraph) -> tuple[list[dict[str, float]], dict]:
    data = SyntheticData(model, SEED, torch.float64)
    return reference_training(model, graph.tasks, data, steps=STEPS, seed=SEED, lr=LR,
                              dtype=torch.float64)


@pytest.fixture(scope="module")
def reference32(model: ModelSpec, graph: MetaOpGraph) -> tuple[list[dict[str, float]], dict]:
    """The single-process reference in fp32, the dtype the fp32 and bf16 runs are held to."""
    data = SyntheticData(model, SEED, torch.float32)
    return reference_training(model, graph.tasks, data, steps=STEPS, seed=SEED, lr=LR,
                              dtype=torch.float32)


@pytest.fixture(scope="module")
def repo_root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parents[2]


def planned(graph: MetaOpGraph, cluster_name: str, planner: str, repo_root: Any,
            zero: int = 0, recompute: bool = False) -> Plan:
    cluster = load(str(repo_root / "clusters" / f"{cluster_name}.yaml"), ClusterSpec)
    counts = [n for n in (1, 2, 4, 8) if n <= cluster.num_devices]
    profile = analytic_profile(graph, cluster, hardware="a800", counts=counts)
    return make_plan(graph, profile, cluster,
                     options=PlanOptions(planner=planner, zero=zero, recompute=recompute))


def assert_matches_reference(results: list[Any], reference: Any, plan: Plan,
                             graph: MetaOpGraph) -> None:
    ref_losses, ref_params = reference
    seen: set[str] = set()
    for rank, (losses, params) in enumerate(results):
        assert len(losses) == STEPS
        for step, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
            assert got.keys() == want.keys()
            for task in want:
                assert got[task] == pytest.approx(want[task], rel=RTOL), (rank, step, task)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        seen.update(params)
    # every parameter of the model is held by some rank
    assert seen == set(ref_params)
    # a rank holds exactly the layers its slices run
    for rank, (_, params) in enumerate(results):
        runs = {f"{m.module}.{layer}"
                for w in plan.waves for s in w.slices if rank in s.ranks
                for m in [graph.metaop(s.metaop)]
                for layer in range(m.first_layer + s.first, m.first_layer + s.last)}
        assert {".".join(n.split(".")[:2]) for n in params} == runs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("planner", ["spindle", "sequential", "optimus", "distmm"])
def test_four_ranks_each_planner(planner: str, graph: MetaOpGraph, model: ModelSpec,
                                 reference: Any, repo_root: Any) -> None:
    plan = planned(graph, "local-cpu", planner, repo_root)
    assert plan.num_devices == 4
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("planner", "chunk_bytes"),
                         [("spindle", None), ("sequential", None), ("sequential", 1)],
                         ids=["spindle", "sequential", "sequential-layer-chunks"])
def test_four_ranks_zero1(planner: str, chunk_bytes: int | None, graph: MetaOpGraph,
                          model: ModelSpec, reference: Any, repo_root: Any) -> None:
    """ZeRO-1: each rank steps only its shard of a shared bucket (reduce-scattered gradients,
    all-gathered parameters), which AdamW's elementwise update makes exact; also with every
    shared bucket cut into chunks of layers, each sharded on its own."""
    plan = planned(graph, "local-cpu", planner, repo_root, zero=1)
    assert plan.options["zero"] == "1"
    assert any(len(g.ranks) > 1 for g in plan.param_groups)
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64",
                              None if chunk_bytes is None else True, chunk_bytes, timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


def _executor(rank: int, world: int, plan: Plan, graph: MetaOpGraph, model: ModelSpec,
              dtype: Any = None, **options: Any) -> Any:
    """An Executor of `plan` on this gloo rank (in `dtype`, fp64 by default; the tests' seed
    and learning rate; `options`: its keyword options)."""
    import torch as t

    dtype = dtype or t.float64

    from spindle_cli.runtime.data import load_data_source
    from spindle_cli.runtime.dist import World
    from spindle_cli.runtime.executor import Executor
    from spindle_cli.runtime.groups import make_groups
    from spindle_cli.runtime.program import build_program

    w = World(rank=rank, world_size=world, local_rank=rank, local_world_size=world,
              backend="gloo", device=t.device("cpu"))
    program = build_program(plan, graph, model)
    return Executor(plan, program, model, w, make_groups(program, rank),
                    load_data_source(None, model, SEED, dtype), seed=SEED, lr=LR,
                    dtype=dtype, **options)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("planner", "chunk_bytes", "chunks"),
                         [("spindle", None, None), ("sequential", 1, None), ("sequential", 1, 1)],
                         ids=["spindle", "sequential-layer-chunks", "sequential-one-chunk"])
def test_four_ranks_zero2(planner: str, chunk_bytes: int | None, chunks: int | None,
                          graph: MetaOpGraph, model: ModelSpec, reference: Any,
                          repo_root: Any) -> None:
    """ZeRO-2: as ZeRO-1, with each sharded bucket's full gradient freed once reduce-scattered
    and allocated again by the next backward that adds to it; also with the plan's
    `sync_chunks` at 1, one chunk per wave bucket (fewer buckets than layer-sized chunks)."""
    plan = planned(graph, "local-cpu", planner, repo_root, zero=2)
    assert plan.options["zero"] == "2"
    if chunks is not None:
        metaops = {m.id: m for m in graph.metaops}
        before = sync_buckets(plan, metaops, "chunked", 1)
        plan = dataclasses.replace(plan, options=dataclasses.replace(
            PlanOptions.of(plan), sync_chunks=chunks).as_dict())
        assert len(sync_buckets(plan, metaops, "chunked", 1)) < len(before)
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64",
                              None if chunk_bytes is None else True, chunk_bytes, timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


def _gradient_storage(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                      model: ModelSpec) -> list[tuple[bool, int, int]]:
    """Two steps on layer-sized chunks; then, per bucket: whether it is sharded, its
    gradient's storage bytes and its size in bytes."""
    ex = _executor(rank, world, plan, graph, model, overlap_sync=True, sync_chunk_bytes=1)
    ex.train_step(0)
    ex.train_step(1)
    return [(b.shard is not None, b.flat.untyped_storage().nbytes(),
             b.flat.numel() * b.flat.element_size()) for b in ex.sync.buckets]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero2_keeps_only_gradient_shards_between_steps(zero: int, graph: MetaOpGraph,
                                                        model: ModelSpec,
                                                        repo_root: Any) -> None:
    """Between steps a ZeRO-2 rank holds no full gradient of a sharded bucket (its
    reduce-scattered shard stays); ZeRO-1 keeps them all; unsharded buckets keep theirs."""
    plan = planned(graph, "local-cpu", "sequential", repo_root, zero=zero)
    results = run_distributed(_gradient_storage, 4, plan, graph, model, timeout_s=90)
    buckets = [b for rank in results for b in rank]
    assert any(sharded for sharded, _, _ in buckets)
    for sharded, stored, size in buckets:
        assert stored == (0 if sharded and zero == 2 else size)


def _gradients_held_at_once(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                            model: ModelSpec, reporting: bool) -> tuple[int, int]:
    """One ZeRO-2 step on layer-sized chunks; with `reporting`, its reduce-scatters report
    completion once done (as NCCL's do; gloo's never report it): (the most sharded buckets
    holding a full gradient at once, sharded buckets), counted whenever buckets may be
    issued."""
    import torch.distributed as dist

    from spindle_cli.runtime import gradsync

    class Reporting:
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self) -> Any:
            return self.work.wait()

        def is_completed(self) -> bool:
            self.work.wait()
            return True

    original = dist.reduce_scatter_single

    def reduce_scatter(*args: Any, **kwargs: Any) -> Reporting:
        return Reporting(original(*args, **kwargs))

    ex = _executor(rank, world, plan, graph, model, overlap_sync=True, sync_chunk_bytes=1)
    sharded = [b for b in ex.sync.buckets if b.shard is not None]
    held = [0]
    issue_ready = ex.sync.issue_ready

    def counted(*args: Any) -> Any:
        works = issue_ready(*args)
        held[0] = max(held[0], sum(1 for b in sharded if b.flat.untyped_storage().nbytes()))
        return works

    ex.sync.issue_ready = counted
    if reporting:
        # this rank process's own torch.distributed (gradsync's `dist`)
        gradsync.dist.reduce_scatter_single = reduce_scatter  # type: ignore[assignment]
    ex.train_step(0)
    return held[0], len(sharded)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reporting", [True, False])
def test_zero2_frees_a_gradient_once_its_reduce_scatter_reports_completion(
        reporting: bool, graph: MetaOpGraph, model: ModelSpec) -> None:
    """A reduce-scatter found done at the next chance to issue buckets frees its bucket's full
    gradient then, so a rank never holds all of them at once; works that never report it
    (gloo's) hold every one until the end of the backward."""
    # every MetaOp on both ranks, one after another: a shared module's layers are in use
    # from the first to the last task using them, other buckets for a wave or two
    plan = hand_plan(graph, whole(graph, (0, 1)), 2)
    plan = dataclasses.replace(plan, options={**plan.options, "zero": "2"})
    results = run_distributed(_gradients_held_at_once, 2, plan, graph, model, reporting,
                              timeout_s=90)
    for held, sharded in results:
        assert sharded > 1
        assert (held < sharded) == reporting, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 1])
def test_four_ranks_with_recomputation(zero: int, graph: MetaOpGraph, model: ModelSpec,
                                       reference: Any, repo_root: Any) -> None:
    """Recomputation changes when activations are computed, never their values: every operator
    runs again in its backward from the input it kept."""
    plan = planned(graph, "local-cpu", "spindle", repo_root, zero=zero, recompute=True)
    assert plan.options["recompute"] == "true"
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


def _one_step_counts(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                     model: ModelSpec) -> tuple[dict[str, int], int]:
    """One step: each layer's forward calls, and the bytes autograd saved for backward outside
    recomputed operators while the step ran."""
    ex = _executor(rank, world, plan, graph, model)
    calls: dict[str, int] = {}

    def counted(forward: Any, name: str) -> Any:
        # a wrapper, not a forward hook: recomputation runs the forward without module hooks
        def run(*args: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return forward(*args)

        return run

    for (module, i), layer in ex.layers.items():
        layer.forward = counted(layer.forward, f"{module}.{i}")
    saved = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved[0] += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ex.train_step(0)
    return calls, saved[0]


@pytest.mark.timeout(120)
def test_recomputation_runs_each_operator_again_and_keeps_less(graph: MetaOpGraph,
                                                                model: ModelSpec) -> None:
    """The same plan with and without recomputation on one rank: every operator but the
    losses (which keep their inputs either way) runs its forward twice, and autograd keeps
    less outside the recomputed operators."""
    one = hand_plan(graph, whole(graph, (0,)), 1)
    again = dataclasses.replace(one, options={**one.options, "recompute": "true"})
    (plain_calls, plain_saved), = run_distributed(_one_step_counts, 1, one, graph, model,
                                                  timeout_s=60)
    (calls, saved), = run_distributed(_one_step_counts, 1, again, graph, model, timeout_s=60)
    losses = {m.module for m in graph.metaops if m.layer_kind == "contrastive_loss"}
    assert plain_calls.keys() == calls.keys()
    for name, count in plain_calls.items():
        assert calls[name] == (count if name.split(".")[0] in losses else 2 * count), name
    assert saved < plain_saved / 2


@pytest.mark.timeout(120)
def test_two_ranks_spindle_plan(graph: MetaOpGraph, model: ModelSpec, reference: Any,
                                repo_root: Any) -> None:
    plan = planned(graph, "local-cpu-2", "spindle", repo_root)
    results = run_distributed(train_rank, 2, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


@pytest.mark.timeout(120)
def test_fused_plan_whose_waves_mix_levels(graph: MetaOpGraph, model: ModelSpec,
                                           reference: Any, repo_root: Any) -> None:
    """Spindle's fused candidate (schedules.fused_waves): a task's next MetaOps start while another
    task's encoder still runs, so one wave holds slices of several MetaLevels."""
    from spindle_cli.planner.assemble import assemble
    from spindle_cli.planner.schedules import allocate, fused_waves, op_curves

    cluster = load(str(repo_root / "clusters" / "local-cpu.yaml"), ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2, 4])
    curves = op_curves(graph, profile, 4)
    allocs = allocate(graph, curves, 4)
    plan = assemble(graph, curves, cluster, PlanOptions(), (), allocs,
                    fused_waves(graph, curves, allocs, 4))
    assert any(len({graph.metaop(s.metaop).level for s in w.slices}) > 1 for w in plan.waves)
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


def shared_encoder_plan(graph: MetaOpGraph) -> Plan:
    """text_enc (shared by three tasks) runs on a different rank group for each task, split by
    layer for one of them; uneven row splits (8 rows over 3 ranks); the contrastive losses run
    on overlapping groups; one loss gathers over 3 ranks."""
    place: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {}
    for m in graph.metaops:
        place[m.id] = [(0, m.num_layers, (m.level % 4,))]
    place["text_vision/text_enc"] = [(0, 1, (0, 1)), (1, 2, (1, 2, 3))]
    place["text_audio/text_enc"] = [(0, 2, (2, 3))]
    place["thumb_text/text_enc"] = [(0, 2, (0, 1, 3))]
    place["text_vision/loss"] = [(0, 1, (0, 1, 2))]
    place["text_audio/loss"] = [(0, 1, (1, 3))]
    place["vision_audio/vision_enc"] = [(0, 2, (3,)), (2, 3, (0, 2))]
    return hand_plan(graph, place, 4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("overlap_sync", "chunk_bytes"), [(False, None), (True, None), (True, 1)],
                         ids=["one-bucket-per-set", "per-wave", "layer-chunks"])
def test_shared_encoder_on_different_rank_groups(overlap_sync: bool, chunk_bytes: int | None,
                                                 graph: MetaOpGraph, model: ModelSpec,
                                                 reference: Any) -> None:
    """With 1-byte chunks every shared bucket is cut into up to 4 chunks of layers, issued
    while the slices' backward runs (test_buckets checks that some are)."""
    plan = shared_encoder_plan(graph)
    enc_groups = {s.ranks for w in plan.waves for s in w.slices if "/text_enc" in s.metaop}
    assert len(enc_groups) >= 3
    text_enc_groups = [g for g in plan.param_groups if g.module == "text_enc"]
    assert {g.ranks for g in text_enc_groups} == {(0, 1, 2, 3)}
    results = run_distributed(train_rank, 4, plan, graph, model, "fp64", overlap_sync,
                              chunk_bytes, timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


@pytest.mark.timeout(120)
def test_a_rank_without_work_still_takes_part(graph: MetaOpGraph, model: ModelSpec,
                                              reference: Any) -> None:
    """Rank 2 runs no slice: it holds no parameters but joins the loss reduction."""
    plan = hand_plan(graph, whole(graph, (0, 1)), 3)
    results = run_distributed(train_rank, 3, plan, graph, model, "fp64", timeout_s=90)
    assert results[2][1] == {}
    assert_matches_reference(results, reference, plan, graph)


def _assert_losses_close(losses: list[dict[str, float]], ref_losses: list[dict[str, float]],
                         *, rel: float) -> None:
    """Every step's every task loss within `rel` of the reference's."""
    for got, want in zip(losses, ref_losses, strict=True):
        for task in want:
            assert got[task] == pytest.approx(want[task], rel=rel)


@pytest.mark.timeout(120)
def test_float32_two_ranks_close_to_reference(graph: MetaOpGraph, model: ModelSpec,
                                              reference32: Any, repo_root: Any) -> None:
    """fp32 (the default dtype): losses within 1e-5 relative. Parameters: AdamW normalizes each
    update, so a gradient element near zero whose last bits differ can move that weight by up
    to a fraction of the learning rate; so at most 1% of elements may differ by more than 1e-5,
    and none by more than the learning rate."""
    plan = planned(graph, "local-cpu-2", "distmm", repo_root)
    ref_losses, ref_params = reference32
    results = run_distributed(train_rank, 2, plan, graph, model, "fp32", timeout_s=90)
    for losses, params in results:
        _assert_losses_close(losses, ref_losses, rel=1e-5)
        diffs = torch.cat([(v - ref_params[n]).abs().flatten() for n, v in params.items()])
        assert (diffs > 1e-5).float().mean().item() < 0.01
        assert diffs.max().item() < LR


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [0, 2])
def test_bf16_mixed_precision_tracks_float32(zero: int, graph: MetaOpGraph, model: ModelSpec,
                                             reference32: Any, repo_root: Any) -> None:
    """bf16 (mixed precision) on four ranks, without ZeRO and under ZeRO-2: every step's task
    losses within 1% of the fp32 reference's (bf16 keeps 8 bits of mantissa; measured: 0.4%),
    the weights bf16 and close to the reference's: AdamW moves a weight by about the learning
    rate whatever its gradient's size, so one whose gradient is near zero moves the other way
    where bf16 rounds the gradient's sign away (measured: median 2e-4, 1% of the weights more
    than the learning rate apart)."""
    plan = planned(graph, "local-cpu", "spindle", repo_root, zero=zero)
    ref_losses, ref_params = reference32
    results = run_distributed(train_rank, 4, plan, graph, model, "bf16", timeout_s=90)
    for losses, params in results:
        _assert_losses_close(losses, ref_losses, rel=1e-2)
        assert {v.dtype for v in params.values()} == {torch.bfloat16}
        diffs = torch.cat([(v.float() - ref_params[n]).abs().flatten()
                           for n, v in params.items()])
        assert diffs.median().item() < LR / 10
        assert (diffs > LR).float().mean().item() < 0.03


def _state_bytes(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                 model: ModelSpec) -> tuple[int, int, int, int, set[Any]]:
    """One bf16 step: (parameters this rank holds, bytes of its weights, of its gradient
    buckets, of its optimizer state: fp32 masters and AdamW's tensors; and their dtypes)."""
    import torch as t

    ex = _executor(rank, world, plan, graph, model, t.bfloat16)
    ex.train_step(0)
    held = sum(b.param.numel() for b in ex.sync.buckets)
    weights = sum(b.param.numel() * b.param.element_size() for b in ex.sync.buckets)
    grads = sum(b.flat.numel() * b.flat.element_size() for b in ex.sync.buckets)
    state = [v for st in ex.optimizer.state.values() for v in st.values() if v.dim() > 0]
    optimizer = sum(v.numel() * v.element_size() for v in [*state, *ex.masters])
    return held, weights, grads, optimizer, {v.dtype for v in [*state, *ex.masters]}


@pytest.mark.timeout(120)
def test_bf16_holds_what_the_planner_counts_for_a_bf16_graph(graph: MetaOpGraph,
                                                             model: ModelSpec,
                                                             repo_root: Any) -> None:
    """The planner's mixed-precision model (`memory.state_bytes_per_param`: 2 bytes of
    weights, 2 of gradients, 12 of optimizer state): each rank holds exactly that, its
    optimizer state (fp32 masters and both moments) on every parameter it steps."""
    plan = planned(graph, "local-cpu", "spindle", repo_root)
    for held, weights, grads, optimizer, dtypes in run_distributed(
            _state_bytes, 4, plan, graph, model, timeout_s=90):
        assert held > 0
        assert (weights, grads, optimizer) == tuple(
            n * held for n in state_bytes_per_param("bf16"))
        assert dtypes == {torch.float32}



def _held_at_turn(rank: int, world: int, plan: Plan, graph: MetaOpGraph, model: ModelSpec,
                  dtype: Any) -> tuple[dict[str, int], int, int]:
    """Two traced steps: (what the rank held, `Executor.held`, measured in the first only,
    where AdamW makes its state in the optimizer step, after the turn; its buckets; how many
    steps recorded what autograd saves)."""
    from spindle_cli.runtime.trace import Tracer

    ex = _executor(rank, world, plan, graph, model, dtype, tracer=Tracer(enabled=True, rank=rank))
    recording, recorded = ex.saved.recording, [0]

    def counted() -> Any:
        recorded[0] += 1
        return recording()

    ex.saved.recording = counted
    ex.train_step(0)
    first = dict(ex.held)
    ex.train_step(1)
    assert ex.held == first
    return ex.held, len(ex.sync.buckets), recorded[0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("zero", "recompute", "dtype"),
                         [(0, False, "fp32"), (1, False, "fp32"), (2, False, "bf16"),
                          (0, True, "fp32")])
def test_a_traced_rank_holds_what_its_plan_counts(zero: int, recompute: bool, dtype: str,
                                                  model: ModelSpec, repo_root: Any) -> None:
    """At the turn of a step each rank holds the weights, gradients and optimizer state its
    plan counts (up to a shard's padding and AdamW's step counter: 64 bytes a bucket; ZeRO-1
    reduce-scatters in place, where a separate shard buffer held a fraction more), and its
    activations held for backward are no more than planned: without recomputation at least
    half (tiny-clip: ~0.73x), with it only the operators' inputs, the plan also counting one
    operator's stash alive again in backward."""
    graph = build_graph(model, dtype=dtype)
    plan = planned(graph, "local-cpu", "spindle", repo_root, zero=zero, recompute=recompute)
    run_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    results = run_distributed(_held_at_turn, 4, plan, graph, model, run_dtype, timeout_s=90)
    for m, (held, buckets, recorded) in zip(sorted(plan.memory, key=lambda m: m.rank),
                                            results, strict=True):
        # only the first step, which the step times leave out, pays for the recording
        assert recorded == 1
        for category in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert 0 <= held[category] - getattr(m, category) <= 64 * buckets, (m.rank,
                                                                                  category)
        assert held["activation_bytes"] <= m.activation_bytes
        if not recompute:
            assert held["activation_bytes"] >= m.activation_bytes / 2

SMALL_MODEL = {
    "kind": "model", "version": 1, "name": "small-lm",
    "modules": {
        "tok": {"kind": "embedding", "hidden": 16, "vocab_size": 32, "max_seq_len": 8},
        "patch": {"kind": "patch_embed", "in_dim": 6, "hidden": 16, "max_seq_len": 8},
        "enc": {"kind": "transformer_encoder", "num_layers": 2, "hidden": 16, "heads": 2,
                "ffn": 32},
        "adapter": {"kind": "adapter", "in_dim": 16, "hidden": 16},
        "dec": {"kind": "transformer_decoder", "num_layers": 2, "hidden": 16, "heads": 2,
                "ffn": 32},
        "lm": {"kind": "lm_loss", "hidden": 16, "vocab_size": 32, "target_len": 3},
        "proj_t": {"kind": "projection", "in_dim": 16, "hidden": 8, "pool": "cls"},
        "proj_i": {"kind": "projection", "in_dim": 16, "hidden": 8, "pool": "mean"},
        "clip": {"kind": "contrastive_loss", "hidden": 8},
    },
    "tasks": [
        {"name": "caption", "batch_size": 2,
         "inputs": {"text": {"seq_len": 5}, "image": {"seq_len": 4, "dim": 6}},
         "steps": [
             {"name": "patch", "module": "patch", "inputs": ["image"]},
             {"name": "enc", "module": "enc", "inputs": ["patch"]},
             {"name": "adapter", "module": "adapter", "inputs": ["enc"]},
             {"name": "tok", "module": "tok", "inputs": ["text"]},
             {"name": "dec", "module": "dec", "inputs": ["adapter", "tok"]},
             {"name": "lm", "module": "lm", "inputs": ["dec"]}]},
        {"name": "align", "batch_size": 5,
         "inputs": {"text": {"seq_len": 6}, "image": {"seq_len": 4, "dim": 6}},
         "steps": [
             {"name": "tok", "module": "tok", "inputs": ["text"]},
             {"name": "text_enc", "module": "enc", "inputs": ["tok"]},
             {"name": "proj_t", "module": "proj_t", "inputs": ["text_enc"]},
             {"name": "patch", "module": "patch", "inputs": ["image"]},
             {"name": "image_enc", "module": "enc", "inputs": ["patch"]},
             {"name": "proj_i", "module": "proj_i", "inputs": ["image_enc"]},
             {"name": "clip", "module": "clip", "inputs": ["proj_t", "proj_i"]}]},
    ],
}


@pytest.mark.timeout(120)
def test_lm_loss_concatenated_inputs_and_ranks_with_no_rows() -> None:
    """A prefix LM (decoder over [adapter output, text tokens]) with an lm_loss, batch 2 on 3
    ranks (rank 2 gets no rows), next to a contrastive task with batch 5 over 3 ranks (uneven
    split, padded gather); the encoder is shared by both tasks and used twice by one."""
    from spindle_cli.artifacts.io import parse_artifact

    model = parse_artifact(SMALL_MODEL, "<small-lm>", ModelSpec)
    assert isinstance(model, ModelSpec)
    graph = build_graph(model, dtype="fp32")
    place = {m.id: [(0, m.num_layers, (0, 1, 2))] for m in graph.metaops}
    place["caption/enc"] = [(0, 1, (1,)), (1, 2, (0, 2))]
    place["align/image_enc"] = [(0, 2, (2,))]
    place["align/proj_t"] = [(0, 1, (0, 1))]
    plan = hand_plan(graph, place, 3)
    data = SyntheticData(model, SEED, torch.float64)
    reference = reference_training(model, graph.tasks, data, steps=STEPS, seed=SEED, lr=LR,
                                   dtype=torch.float64)
    results = run_distributed(train_rank, 3, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)


def _gathers_in_flight(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                       model: ModelSpec) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Two ZeRO-1 steps: how many all-gathers are still in flight when a step returns, and
    after reading the parameters."""
    ex = _executor(rank, world, plan, graph, model)
    ex.train_step(0)
    ex.train_step(1)
    in_flight = len(ex.sync.gathering)
    params = ex.parameters()
    return in_flight, len(ex.sync.gathering), params


@pytest.mark.timeout(120)
def test_zero1_all_gathers_overlap_the_next_forward(graph: MetaOpGraph, model: ModelSpec,
                                                    repo_root: Any) -> None:
    """A step returns with its all-gathers in flight (the next forward waits for each bucket
    before using it); reading the parameters waits for them, and every rank of a bucket then
    holds the same values of its layers."""
    plan = planned(graph, "local-cpu", "sequential", repo_root, zero=1)
    results = run_distributed(_gathers_in_flight, 4, plan, graph, model, timeout_s=90)
    sharded = [r for r in range(4) if any(len(g.ranks) > 1 and r in g.ranks
                                          for g in plan.param_groups)]
    assert sharded and all(results[r][0] > 0 for r in sharded)
    assert all(after == 0 for _, after, _ in results)
    for name in results[sharded[0]][2]:
        values = [params[name] for _, _, params in results if name in params]
        assert all(torch.equal(v, values[0]) for v in values)


def _operators_and_gathers(rank: int, world: int, plan: Plan, graph: MetaOpGraph,
                           model: ModelSpec) -> list[tuple[str, Any, bool]]:
    """A ZeRO-1 step with a bucket per layer, after one that started the all-gathers: in
    order, each forward slice begun ('slice', its id, False), each forward operator run ('op',
    its layer, whether its bucket's all-gather was still in flight) and each wait for
    all-gathers ('wait', the buckets, False)."""
    ex = _executor(rank, world, plan, graph, model, overlap_sync=True, sync_chunk_bytes=1)
    ex.train_step(0)
    key_of = {id(layer): key for key, layer in ex.layers.items()}
    log: list[tuple[str, Any, bool]] = []
    forward, operator, await_gathers = ex._forward_slice, ex._operator, ex.sync.await_gathers

    def logged_forward(sp: Any, *args: Any) -> None:
        log.append(("slice", sp.slice.id, False))
        forward(sp, *args)

    def logged_operator(layer: Any, *ins: torch.Tensor) -> torch.Tensor:
        key = key_of[id(layer)]
        log.append(("op", key, ex.sync.gathered_in.get(key) in ex.sync.gathering))
        return operator(layer, *ins)

    def logged_await(indices: list[int]) -> None:
        log.append(("wait", tuple(i for i in indices if i in ex.sync.gathering), False))
        await_gathers(indices)

    ex._forward_slice, ex._operator, ex.sync.await_gathers = (logged_forward, logged_operator,
                                                              logged_await)
    ex.train_step(1)
    return log


@pytest.mark.timeout(120)
def test_zero1_forward_waits_for_each_layers_all_gather_before_its_operator(
        graph: MetaOpGraph, model: ModelSpec, repo_root: Any) -> None:
    """With a bucket per layer, a slice's forward waits for each layer's all-gather right
    before the layer's operator (what the simulator charges, `simulate`'s `prior`), not for
    all of them before the slice: no operator runs on parameters still being gathered, and
    waits fall between two operators of one slice (no slice begins between them)."""
    plan = planned(graph, "local-cpu", "sequential", repo_root, zero=1)
    logs = run_distributed(_operators_and_gathers, 4, plan, graph, model, timeout_s=90)
    ops = [entry for log in logs for entry in log if entry[0] == "op"]
    assert ops and not any(in_flight for _, _, in_flight in ops)
    between = [log[i][1] for log in logs for i in range(1, len(log) - 1)
               if log[i][0] == "wait" and log[i][1] and log[i - 1][0] == log[i + 1][0] == "op"]
    assert between


FAN_OUT_MODEL = {
    "kind": "model", "version": 1, "name": "fan-out",
    "modules": {
        "tok": {"kind": "embedding", "hidden": 16, "vocab_size": 32, "max_seq_len": 8},
        "patch": {"kind": "patch_embed", "in_dim": 6, "hidden": 16, "max_seq_len": 8},
        "enc": {"kind": "transformer_encoder", "num_layers": 2, "hidden": 16, "heads": 2,
                "ffn": 32},
        "proj_t": {"kind": "projection", "in_dim": 16, "hidden": 8, "pool": "cls"},
        "proj_i": {"kind": "projection", "in_dim": 16, "hidden": 8, "pool": "mean"},
        "clip": {"kind": "contrastive_loss", "hidden": 8},
        "adapter": {"kind": "adapter", "in_dim": 16, "hidden": 16},
        "lm": {"kind": "lm_loss", "hidden": 16, "vocab_size": 32, "target_len": 3},
    },
    "tasks": [
        {"name": "both", "batch_size": 4,
         "inputs": {"text": {"seq_len": 5}, "image": {"seq_len": 4, "dim": 6}},
         "steps": [
             {"name": "tok", "module": "tok", "inputs": ["text"]},
             {"name": "enc", "module": "enc", "inputs": ["tok"]},
             {"name": "proj_t", "module": "proj_t", "inputs": ["enc"]},
             {"name": "patch", "module": "patch", "inputs": ["image"]},
             {"name": "proj_i", "module": "proj_i", "inputs": ["patch"]},
             {"name": "clip", "module": "clip", "inputs": ["proj_t", "proj_i"]},
             {"name": "adapter", "module": "adapter", "inputs": ["enc"]},
             {"name": "lm", "module": "lm", "inputs": ["adapter"]}]},
    ],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consumers", [((1,), (2,)), ((1, 2), (2,))],
                         ids=["same-wave", "later-wave"])
def test_an_output_feeding_two_steps_on_other_ranks_sums_their_gradients(
        consumers: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    """The encoder's output feeds a projection (into a contrastive loss) and an adapter (into
    an lm_loss), both on other ranks than the encoder: its backward needs the sum of both
    consumers' gradients. The consumers run in one wave (both gradients come back at one
    boundary), or in two (rows split over 2 ranks for one; they come back at two)."""
    from spindle_cli.artifacts.io import parse_artifact

    model = parse_artifact(FAN_OUT_MODEL, "<fan-out>", ModelSpec)
    assert isinstance(model, ModelSpec)
    graph = build_graph(model, dtype="fp32")
    proj_ranks, adapter_ranks = consumers
    place = {m.id: [(0, m.num_layers, (0,))] for m in graph.metaops}
    place["both/proj_t"] = [(0, 1, proj_ranks)]
    place["both/adapter"] = [(0, 1, adapter_ranks)]
    place["both/lm"] = [(0, 1, (1, 2))]
    plan = hand_plan(graph, place, 3)
    slices = {s.id: (w.index, s) for w in plan.waves for s in w.slices}
    wave = {s.metaop: w for w, s in slices.values()}
    from_enc = [t for t in plan.transfers if slices[t.src][1].metaop == "both/enc"]
    assert {slices[t.dst][1].metaop for t in from_enc} == {"both/proj_t", "both/adapter"}
    assert all(t.src_ranks == (0,) and 0 not in t.dst_ranks for t in from_enc)
    assert (wave["both/proj_t"] == wave["both/adapter"]) == (proj_ranks == (1,))
    data = SyntheticData(model, SEED, torch.float64)
    reference = reference_training(model, graph.tasks, data, steps=STEPS, seed=SEED, lr=LR,
                                   dtype=torch.float64)
    results = run_distributed(train_rank, 3, plan, graph, model, "fp64", timeout_s=90)
    assert_matches_reference(results, reference, plan, graph)
