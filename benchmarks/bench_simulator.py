"""How fast the simulator is, and how its iteration time compares with the planner's estimate.

Plans multitask-clip (all 10 tasks) on 16, 64 and 256 simulated A800s with every planner and
prints, per plan: point-to-point flows, simulation wall time, and the simulated iteration over
the planner's estimate (the estimate has no transfers or sync, so the ratio is >= 1 and shows
what communication adds); then the same plan with the gradients bucketed per wave instead of
in chunks (`buckets.sync_buckets`): its wall time and iteration, and the ratios of the chunked
simulation to it, measured side by side. Run: python benchmarks/bench_simulator.py
"""

from __future__ import annotations

import time
from pathlib import Path

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.errors import SpindleError
from spindle_cli.planner import bench
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.simulate import simulate

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    model = load(str(REPO / "models" / "multitask-clip.yaml"), ModelSpec)
    graph = build_graph(model)
    print(f"{'cluster':<12} {'planner':<11} {'flows':>7} {'sim s':>7} {'sim/planned':>12}"
          f"{'per-wave s':>11} {'time ratio':>11} {'iter ratio':>11}")
    for n in (16, 64, 256):
        cluster = load(str(REPO / "clusters" / f"{bench.CLUSTERS[n]}.yaml"), ClusterSpec)
        profile = bench.profile_for(graph, cluster)
        for planner in ("spindle", "sequential", "optimus", "distmm"):
            try:
                plan = make_plan(graph, profile, cluster, options=PlanOptions(planner=planner))
            except SpindleError as e:
                print(f"{cluster.name:<12} {planner:<11} planning failed: {e}")
                continue
            start = time.perf_counter()
            sim = simulate(plan, graph, profile, cluster)
            seconds = time.perf_counter() - start
            start = time.perf_counter()
            per_wave = simulate(plan, graph, profile, cluster, sync="per-wave")
            wave_seconds = time.perf_counter() - start
            print(f"{cluster.name:<12} {planner:<11} {len(sim.flows):>7} {seconds:>7.3f} "
                  f"{sim.iteration_ms / plan.estimated_iteration_ms:>12.3f}"
                  f"{wave_seconds:>11.3f} {seconds / wave_seconds:>11.2f}"
                  f"{sim.iteration_ms / per_wave.iteration_ms:>11.3f}")


if __name__ == "__main__":
    main()
