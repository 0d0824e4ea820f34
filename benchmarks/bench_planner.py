"""Quality and speed of the planner (`spindle plan`), against the targets of issue 4. Prints
figures and ratios; asserts nothing (run: python benchmarks/bench_planner.py [--quick]).

1. Estimated makespan / sum of C* for multitask-clip 4/7/10 tasks on 16 and 32 devices
   (target <= 1.03), with and without --uneven-splits, with both bi-point forms and the
   rounding search of `refinement.refine_level` ("refined", waves only; see `refined`), the
   baselines' ratios and Spindle's speedup over each, and, per level small enough for the
   MILP, the exact packing of the level's rounded tuples (how much of the gap the bi-point
   discretization alone costs, and how the wave scheduler compares with the best packing of
   those fixed tuples), and the refined makespan with every operator cut into 2, 4 and 16
   equal pieces (`finer_operators`: what slices ending inside an operator could reach, as
   scheduled with each piece paying a share of the operator's fixed cost, and costed with
   every operator a slice touches paying all of it). Spindle keeps the candidate that
   simulates fastest, so its makespan here (compute only) can be longer than another
   candidate's; a plan that overlaps levels (Spindle's fused candidate, optimus, distmm) is
   not bounded by the sum of per-level C*.
2. Placement ablation: island-aware vs sequential placement (the kept waves placed again on
   consecutive ranks, and a plan made for sequential placement), inter-wave bytes that leave
   a rank / cross islands and the simulated share of the iteration spent waiting for
   transfers.
3. Planning time: multitask-clip 10 tasks on 64 devices (target < 0.3 s) and a synthetic
   4096-device, 100-task model (target < 10 s); and `spindle plan`'s search over memory
   settings (`fitting_plan_with_cost`) beside the same search with every setting planned
   alone, for multitask-clip 4/7/10 tasks on 32 devices (the dynamic bench's replanning).
4. Optimus's waves: their compute against its slowest task's own chain on its device group
   (`optimus_alignment`: what waves as barriers charge the baseline).

Profiles are analytic (a800 roofline, counts 1..64 on a800-8x8), built in-process, so the
figures do not depend on the committed files.
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    Plan,
    Profile,
    input_ref,
    load,
)
from spindle_cli.artifacts.cluster import DeviceSpec
from spindle_cli.artifacts.graph import MetaOp
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.profile import Curve, CurvePiece, Fingerprint, MemoryModel
from spindle_cli.errors import PlanInfeasible
from spindle_cli.planner import baselines, scaling, schedules, search
from spindle_cli.planner.alignment import PlannedWave
from spindle_cli.planner.allocation import allocate_level_analytic
from spindle_cli.planner.api import (
    MemoryBinding,
    compute_bound_ms,
    fitting_plan_with_cost,
    make_plan,
    memory_ladder,
)
from spindle_cli.planner.assemble import place_again
from spindle_cli.planner.exact import MAX_TUPLES, exact_packing_ms
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.refinement import refine_level
from spindle_cli.planner.schedules import allocate, op_curves, options_curves, slice_limits
from spindle_cli.planner.simulate import simulate, simulated_cost
from spindle_cli.planner.waves import LARGE_LEVEL, LARGE_LEVEL_VARIANTS, VARIANTS

ROOT = Path(__file__).resolve().parent.parent
COUNTS_64 = (1, 2, 4, 8, 16, 32, 64)
BASELINES = ("sequential", "optimus", "distmm")


def clip(task_set: str) -> tuple[MetaOpGraph, Profile]:
    spec = load(str(ROOT / "models" / "multitask-clip.yaml"), ModelSpec)
    graph = build_graph(spec, tasks=list(spec.task_sets[task_set]),
                        inputs=[input_ref(spec, "models/multitask-clip.yaml")])
    cluster = cluster_file("a800-8x8")
    return graph, analytic_profile(graph, cluster, hardware="a800", counts=COUNTS_64)


def cluster_file(name: str) -> ClusterSpec:
    return load(str(ROOT / "clusters" / f"{name}.yaml"), ClusterSpec)


def _ratio(plan: Plan) -> float:
    return plan.estimated_iteration_ms / plan.lower_bound_ms


def exact_levels(graph: MetaOpGraph, profile: Profile, n: int) -> str:
    """'level: exact/C* greedy/exact' for the levels the MILP can solve."""
    curves = op_curves(graph, profile, n)
    plan = make_plan(graph, profile, cluster_for(n))
    planned = {lv.level: lv.estimated_ms for lv in plan.levels}
    parts = []
    for a in allocate(graph, curves, n):
        tuples = [(t.metaop, t.n, t.num_ops * curves[t.metaop].time_at(t.n))
                  for x in a.ops for t in x.tuples]
        if len(tuples) > MAX_TUPLES or a.c_star_ms < 1.0:
            continue  # tiny levels (embeddings, losses) do not move the total
        best = exact_packing_ms(tuples, n, time_limit_s=20)
        if best is None:
            parts.append(f"L{a.level}: MILP not solved in 20 s ({len(tuples)} tuples)")
        else:
            ratio = planned[a.level] / best
            parts.append(f"L{a.level}: exact packing of the rounded tuples "
                         f"{best / a.c_star_ms:.3f}x C*; the waves take {ratio:.3f}x of it "
                         "(below 1: extension beats any packing of the fixed tuples)")
    return "; ".join(parts) or f"no level with <= {MAX_TUPLES} tuples"


def refined_waves(graph: MetaOpGraph, profile: Profile,
                  cluster: ClusterSpec) -> tuple[list[PlannedWave], float, float]:
    """(waves, sum of C*, planning s) of Spindle's waves when every level is scheduled from
    both bi-point forms (`allocation.allocate_level` and `allocate_level_analytic`), each with
    the rounding search `refinement.refine_level`, keeping the shorter
    (`schedules.spindle_waves` does neither yet). Waves only, before placement."""
    t0 = time.perf_counter()
    n = cluster.num_devices
    curves = op_curves(graph, profile, n)
    allocs = allocate(graph, curves, n)
    max_ops = slice_limits(graph, curves, cluster)
    preds = {m.id: m.predecessors for m in graph.metaops}
    finished: set[str] = set()
    waves: list[PlannedWave] = []
    for a in allocs:
        variants = (VARIANTS if sum(len(x.tuples) for x in a.ops) <= LARGE_LEVEL
                    else LARGE_LEVEL_VARIANTS)
        level_curves = [curves[x.metaop] for x in a.ops]
        waves += min((refine_level(b, curves, n, preds, set(finished), variants,
                                   max_ops=max_ops)[1]
                      for b in (a, allocate_level_analytic(a.level, level_curves, n))),
                     key=lambda level: sum(w.duration_ms for w in level))
        finished |= {x.metaop for x in a.ops}
    return waves, sum(a.c_star_ms for a in allocs), time.perf_counter() - t0


def refined(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec) -> tuple[float, float]:
    """(makespan / C*, planning s) of `refined_waves`; the makespan is the sum of wave
    durations, as in Plan.estimated_iteration_ms."""
    waves, c_star_ms, seconds = refined_waves(graph, profile, cluster)
    return sum(w.duration_ms for w in waves) / c_star_ms, seconds


FINER = (2, 4, 16)
"""Pieces per operator in `finer_operators`."""


def finer_operators(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec,
                    pieces: int) -> tuple[float, float]:
    """What slices that end inside an operator (part of its rows) could reach: the refined
    waves with every operator cut into `pieces` equal ones (L x pieces operators, each curve's
    alpha and beta over `pieces`, so C* is unchanged), as makespan / C* twice:
      - as scheduled, an idealization: a piece pays 1/pieces of the operator's fixed cost
        alpha;
      - the same waves costed as they would run: a slice pays alpha once for every operator
        it runs a part of (a part of an operator launches all of its kernels), and beta for
        its pieces. alpha is 0.30 ms per transformer layer on the a800 profiles (launches and
        the low efficiency of small GEMMs, planner/roofline.py), a quarter of vision_enc's
        1.31 ms on 8 devices."""
    cut = replace(graph, metaops=tuple(replace(m, num_layers=m.num_layers * pieces)
                                       for m in graph.metaops))
    scaled = replace(profile, curves=tuple(
        replace(c, pieces=tuple(replace(q, alpha_ms=q.alpha_ms / pieces,
                                        beta_ms=q.beta_ms / pieces) for q in c.pieces))
        for c in profile.curves))
    waves, c_star_ms, _ = refined_waves(cut, scaled, cluster)
    done: dict[str, int] = {}
    real_ms = 0.0
    for w in waves:
        span_ms = 0.0
        for s in w.slots:
            first = done.get(s.metaop, 0)
            done[s.metaop] = last = first + s.num_ops
            touched = -(-last // pieces) - first // pieces
            alpha_ms = scaling.alpha_ms(profile.curve(graph.metaop(s.metaop).signature), s.n)
            span_ms = max(span_ms, touched * alpha_ms
                          + s.num_ops * (s.op_time_ms - alpha_ms / pieces))
        real_ms += span_ms
    return sum(w.duration_ms for w in waves) / c_star_ms, real_ms / c_star_ms


def cluster_for(n: int) -> ClusterSpec:
    return cluster_file({16: "a800-2x8", 32: "a800-4x8", 64: "a800-8x8"}[n])


def quality(quick: bool) -> None:
    print("== 1. makespan / sum C* (target <= 1.03) ==")
    print(f"{'case':<16}{'spindle':>9}{'uneven':>9}{'refined':>9}"
          + "".join(f"{b:>12}" for b in BASELINES) + "   speedup vs " + "/".join(BASELINES))
    for task_set in ("4", "7", "10"):
        graph, profile = clip(task_set)
        for n in (16, 32):
            row = f"clip-{task_set:>2} @ {n:<4}  "
            try:
                sp = make_plan(graph, profile, cluster_for(n))
            except PlanInfeasible as e:
                print(f"{row}spindle infeasible: {e}")
                continue
            un = make_plan(graph, profile, cluster_for(n), options=PlanOptions(uneven_splits=True))
            ref = refined(graph, profile, cluster_for(n))[0]
            row += f"{_ratio(sp):>9.3f}{_ratio(un):>9.3f}{ref:>9.3f}"
            speed = []
            for b in BASELINES:
                try:
                    bp = make_plan(graph, profile, cluster_for(n), options=PlanOptions(planner=b))
                    row += f"{_ratio(bp):>12.3f}"
                    speed.append(f"{bp.estimated_iteration_ms / sp.estimated_iteration_ms:.2f}x")
                except PlanInfeasible:
                    row += f"{'OOM':>12}"
                    speed.append("OOM")
            print(row + "   " + " / ".join(speed))
            if not quick:
                print(f"    {exact_levels(graph, profile, n)}")
                cluster = cluster_for(n)
                finer = ", ".join("{} pieces {:.3f} (costed {:.3f})".format(
                    k, *finer_operators(graph, profile, cluster, k)) for k in FINER)
                print("    refined with every operator cut into equal pieces, as scheduled "
                      f"(costed with alpha per operator touched): {finer}")


def _transfer_text(plan: Plan, graph: MetaOpGraph, profile: Profile,
                   cluster: ClusterSpec) -> str:
    moved = sum(t.bytes for t in plan.transfers if t.src_ranks != t.dst_ranks)
    sim = simulate(plan, graph, profile, cluster)
    return (f"{moved / 2**30:.2f} GiB leave their ranks, "
            f"{sim.inter_island_bytes / 2**30:.2f} GiB cross islands (sim, both ways), "
            f"transfer wait {sim.transfer_fraction:.1%} of {sim.iteration_ms:.1f} ms")


def ablation() -> None:
    print("== 2. placement ablation (island-aware; sequential: the same waves, and replanned) ==")
    for task_set, n in (("4", 16), ("4", 32), ("10", 32)):
        graph, profile = clip(task_set)
        cluster = cluster_for(n)
        print(f"clip-{task_set} @ {n}:")
        island: Plan | None = None
        for name in ("island", "sequential, same waves", "sequential, replanned"):
            try:
                if name == "island":
                    plan = island = make_plan(graph, profile, cluster)
                elif name == "sequential, same waves":
                    if island is None:
                        continue
                    plan = place_again(island, graph, profile, cluster, placement="sequential")
                else:
                    plan = make_plan(graph, profile, cluster,
                                     options=PlanOptions(placement="sequential"))
                text = _transfer_text(plan, graph, profile, cluster)
            except PlanInfeasible as e:
                text = f"infeasible ({str(e)[:60]}...)"
            print(f"  {name:22s} {text}")


def synthetic(num_tasks: int, num_nodes: int, seed: int = 0) -> tuple[MetaOpGraph, Profile,
                                                                          ClusterSpec]:
    """Tasks of 2-3 towers (embed, encoder, projection) joined by a loss; alpha-beta curves."""
    rng = random.Random(seed)
    metaops, curves = [], []
    for t in range(num_tasks):
        batch = rng.choice([256, 512, 768, 1024, 2048])
        towers = []
        for e in range(rng.choice([2, 3])):
            mod = f"mod{rng.randrange(12)}"
            prev: tuple[str, ...] = ()
            for lvl, (step, layers) in enumerate(((f"{mod}_embed", 1),
                                                  (f"{mod}_enc", rng.randint(6, 32)),
                                                  (f"{mod}_proj", 1))):
                mid = f"task{t}/{step}#{e}"
                metaops.append(MetaOp(
                    id=mid, task=f"task{t}", step=f"{step}#{e}", module=step,
                    layer_kind="transformer_encoder", first_layer=0, num_layers=layers,
                    batch_size=batch, seq_len=128, in_width=768, out_seq_len=128, out_width=768,
                    level=lvl, predecessors=prev, signature=mid, flops_per_layer=1e12,
                    params_per_layer=7_000_000 if "enc" in step else 100_000,
                    activation_in_bytes=batch * 196608, activation_out_bytes=batch * 196608,
                    stash_bytes_per_sample=4096))
                alpha, beta = rng.uniform(0.05, 0.5), rng.uniform(0.01, 0.2)
                curves.append(Curve(
                    signature=mid, batch_size=batch, points=(),
                    pieces=(CurvePiece(n_lo=1, n_hi=1 << 16, alpha_ms=alpha, beta_ms=beta,
                                       strategy="dp"),),
                    memory=MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                       activation_bytes_per_sample=0),
                    max_rel_error=0.0))
                prev = (mid,)
            towers.append(prev[0])
        mid = f"task{t}/loss"
        metaops.append(MetaOp(
            id=mid, task=f"task{t}", step="loss", module="loss", layer_kind="contrastive_loss",
            first_layer=0, num_layers=1, batch_size=batch, seq_len=1, in_width=768,
            out_seq_len=0, out_width=0, level=3, predecessors=tuple(towers), signature=mid,
            flops_per_layer=1e9, params_per_layer=1, activation_in_bytes=0,
            activation_out_bytes=0, stash_bytes_per_sample=16))
        curves.append(Curve(
            signature=mid, batch_size=batch, points=(),
            pieces=(CurvePiece(n_lo=1, n_hi=1 << 16, alpha_ms=0.05, beta_ms=0.001,
                               strategy="dp"),),
            memory=MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                               activation_bytes_per_sample=0),
            max_rel_error=0.0))
    metaops.sort(key=lambda m: (m.level, m.id))
    graph = MetaOpGraph(**derived_header(MetaOpGraph, []), model="synthetic",
                        tasks=tuple(f"task{t}" for t in range(num_tasks)), dtype="bf16",
                        num_levels=4, metaops=tuple(metaops))
    profile = Profile(**derived_header(Profile, []), source="analytic",
                      fingerprint=Fingerprint(hardware="synthetic", device_name="synthetic",
                                              torch_version="", dtype="bf16"),
                      counts=(1,), curves=tuple(sorted(curves, key=lambda c: c.signature)))
    cluster = ClusterSpec(
        kind="cluster", version=1, name=f"synthetic-{num_nodes}x8", num_nodes=num_nodes,
        devices_per_node=8, island_size=8,
        device=DeviceSpec(name="A800-80GB", memory_bytes=80 * 2**30, peak_flops=3.12e14,
                          memory_bandwidth_bytes_per_s=2.0e12),
        intra_island_bandwidth_bytes_per_s=2.0e11, inter_node_bandwidth_bytes_per_s=2.5e10)
    return graph, profile, cluster


def _time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setting_by_setting(graph: MetaOpGraph, profile: Profile, cluster: ClusterSpec) -> float:
    """`fitting_plan_with_cost`'s search with nothing shared between the memory settings:
    each planned alone (`make_plan_with_cost`; under recomputation the baselines' schedules
    only where memory limited no setting without it, as the search does) and its plan
    simulated again; the best iteration."""
    best = math.inf
    binding = MemoryBinding(memory_ladder())
    for zero, recompute in memory_ladder():
        options = PlanOptions(zero=zero, recompute=recompute)
        own = binding.own(recompute)
        curves = options_curves(graph, profile, cluster, options)
        if compute_bound_ms(graph, curves, cluster.num_devices) >= best:
            continue
        try:
            plan = search.make_plan_with_cost(graph, profile, cluster, options=options, own=own,
                                              limited=binding.limits(recompute))[0]
        except PlanInfeasible:
            binding.unfit(recompute)
            continue
        best = min(best, simulated_cost(plan, graph, profile, cluster,
                                        give_up_ms=best).iteration_ms)
    return best


def memory_search() -> None:
    """The memory search with schedules shared between settings against each setting planned
    alone, both without the finer gradient chunks that `fitting_plan_with_cost` tries after
    its search (on candidates of any setting, which planning alone does not see)."""
    cluster = cluster_file("a800-4x8")
    choices, search.SYNC_CHUNK_CHOICES = search.SYNC_CHUNK_CHOICES, ()
    try:
        for task_set in ("4", "7", "10"):
            _compare_memory_search(task_set, cluster)
    finally:
        search.SYNC_CHUNK_CHOICES = choices


def _compare_memory_search(task_set: str, cluster: ClusterSpec) -> None:
    graph, profile = clip(task_set)
    t0 = time.perf_counter()
    _, shared_ms = fitting_plan_with_cost(graph, profile, cluster)
    t1 = time.perf_counter()
    alone_ms = setting_by_setting(graph, profile, cluster)
    t2 = time.perf_counter()
    same = "same best iteration" if shared_ms == alone_ms else (
        f"best iterations differ: {shared_ms:.3f} against {alone_ms:.3f} ms")
    print(f"memory search, clip-{task_set} @ 32: {t1 - t0:.2f} s, every setting planned "
          f"alone {t2 - t1:.2f} s ({(t1 - t0) / (t2 - t1):.2f}x); {same}")


# make_plan's stages, as search (make_plan_with_cost) and its Schedules look them up: what
# `breakdown` times
STAGES = {"simulations": ((search, "simulated_cost"),),
          "placement and plan building": ((search, "assemble"),),
          "wave schedules": ((schedules, "level_schedule"), (search, "fused_waves"),
                             (search, "lane_waves"), (search, "task_stable"))}


def breakdown(fn: Callable[[], object]) -> tuple[dict[str, float], int]:
    """Seconds one call of `fn` spends in each of make_plan's STAGES, and how many candidate
    plans it simulated; by wrapping the functions search calls for them."""
    spent = dict.fromkeys(STAGES, 0.0)
    calls = {"simulations": 0}

    def timed(stage: str, f: Callable[..., object]) -> Callable[..., object]:
        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - t0
                calls[stage] = calls.get(stage, 0) + 1
        return wrapper

    originals = {(module, name): getattr(module, name)
                 for names in STAGES.values() for module, name in names}
    try:
        for stage, names in STAGES.items():
            for module, name in names:
                setattr(module, name, timed(stage, originals[(module, name)]))
        fn()
    finally:
        for (module, name), f in originals.items():
            setattr(module, name, f)
    return spent, calls["simulations"]


def speed() -> None:
    print("== 3. planning time ==")
    graph, profile = clip("10")
    cluster = cluster_file("a800-8x8")
    t = _time(lambda: make_plan(graph, profile, cluster), 5)
    plan = make_plan(graph, profile, cluster)
    print(f"clip-10 @ 64: {t:.3f} s (target < 0.3 s; median of 5); {len(plan.waves)} waves, "
          f"makespan/C* {_ratio(plan):.3f}")
    spent, simulated = breakdown(lambda: make_plan(graph, profile, cluster))
    print("  of one plan: " + ", ".join(f"{stage} {s:.3f} s" for stage, s in spent.items())
          + f" ({simulated} candidates simulated)")
    ratio, t = refined(graph, profile, cluster)
    print(f"clip-10 @ 64 waves, both bi-point forms + refine_level: {t:.3f} s (allocation + "
          f"waves only), makespan/C* {ratio:.3f}")
    # 4096 devices: the first candidate and the baselines' schedules are simulated; 1024: the
    # largest cluster on which every candidate is (search.SIMULATED_CHOICE_MAX_DEVICES), so
    # the slowest to plan
    for nodes in (512, 128):
        graph, profile, cluster = synthetic(100, nodes)
        t0 = time.perf_counter()
        plan = make_plan(graph, profile, cluster)
        t = time.perf_counter() - t0
        print(f"synthetic 100 tasks ({len(graph.metaops)} MetaOps) @ {cluster.num_devices}: "
              f"{t:.2f} s (target < 10 s); {len(plan.waves)} waves, makespan/C* "
              f"{_ratio(plan):.3f}")
    memory_search()


def optimus_alignment() -> None:
    """Optimus's tasks run side by side on their own device groups; its plan cuts them into
    waves, which the planner's model (waves as barriers) aligns, so a task with a short MetaOp
    waits for the others' longer operators. Planned compute against the slowest task's own
    chain on its group (what running the tasks without barriers would take, transfers and
    sync aside)."""
    print("== 4. Optimus: its waves' compute / its slowest task on its own ranks ==")
    for name, sets in (("multitask-clip", ("4", "7", "10")), ("ofasys", ("4", "7"))):
        spec = load(str(ROOT / "models" / f"{name}.yaml"), ModelSpec)
        for task_set in sets:
            graph = build_graph(spec, tasks=list(spec.task_sets[task_set]))
            profile = analytic_profile(graph, cluster_file("a800-8x8"), hardware="a800",
                                       counts=COUNTS_64)
            cells = []
            for n in (16, 32):
                waves = baselines.optimus(graph, op_curves(graph, profile, n), n)
                busy: dict[str, float] = {}
                groups: dict[str, int] = {}
                for w in waves:
                    for s in w.slots:
                        task = graph.metaop(s.metaop).task
                        busy[task] = busy.get(task, 0.0) + s.num_ops * s.op_time_ms
                        groups[task] = max(groups.get(task, 0), s.n)
                planned = sum(w.duration_ms for w in waves)
                shared = " (tasks share groups)" if sum(groups.values()) > n else ""
                cells.append(f"@{n}: {planned:.1f} / {max(busy.values()):.1f} ms = "
                             f"{planned / max(busy.values()):.3f}{shared}")
            print(f"{name}-{task_set:<3} " + "; ".join(cells))


def main() -> None:
    quick = "--quick" in sys.argv
    quality(quick)
    ablation()
    speed()
    optimus_alignment()


if __name__ == "__main__":
    main()
