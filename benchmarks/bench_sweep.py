"""Plan quality beyond the bench matrix: Spindle against the best baseline on 132 small cases
(benchmarks/sweep/cases.tsv: 1-4-task subsets of the shipped models and of variants with odd,
prime or tiny batches and other layer counts, on clusters from 1x1 to 5x8 GPUs, some with
planner options). Each case is planned as `spindle graph`, `spindle profile --hardware a800
--cluster C` and `spindle plan ... OPTIONS` would (the same options for every planner) and
simulated. Prints one line per case and the counts: Spindle faster than the best baseline by
more than 0.5%, by less, tied or slower; in how many a baseline's schedule is Spindle's kept
candidate; and the planning seconds. Asserts nothing.

    python benchmarks/bench_sweep.py [--jobs 2] [ID ...]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.artifacts.io import as_written
from spindle_cli.cli.plan import plan_settings
from spindle_cli.errors import SpindleError
from spindle_cli.planner.api import fitting_plan_with_cost
from spindle_cli.planner.bench import profile_for
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.simulate import simulate

REPO = Path(__file__).resolve().parents[1]
SWEEP = REPO / "benchmarks" / "sweep"
PLANNERS = ("spindle", "sequential", "optimus", "distmm")


def flags(extra: list[str]) -> dict[str, Any]:
    """`plan_settings`' arguments from a case's `spindle plan` flags."""
    def value(flag: str, default: str) -> str:
        return extra[extra.index(flag) + 1] if flag in extra else default

    return {"placement": value("--placement", "island"), "memory": value("--memory", "auto"),
            "recompute": value("--recompute", "auto"),
            "uneven_splits": "--uneven-splits" in extra, "runnable": "--runnable" in extra,
            "tensor_parallel": "--no-tensor-parallel" not in extra}


def run_case(case: list[str]) -> tuple[str, dict[str, tuple[float | None, float, str]]]:
    """One case's line: each planner's simulated iteration (or why it has none)."""
    cid, model_name, tasks, cluster_name, extra = case
    model_file = REPO / "models" / f"{model_name}.yaml"
    if not model_file.exists():
        model_file = SWEEP / "models" / f"{model_name}.yaml"
    model = load(str(model_file), ModelSpec)
    cluster = load(str(SWEEP / "clusters" / f"{cluster_name}.yaml"), ClusterSpec)
    chosen = (None if tasks == "all" else list(model.task_sets[tasks[4:]])
              if tasks.startswith("set:") else tasks.split(","))
    graph = as_written(build_graph(model, tasks=chosen))
    profile = profile_for(graph, cluster)
    results = {}
    for planner in PLANNERS:
        start = time.perf_counter()
        try:
            options, ladder = plan_settings(planner=planner, **flags(extra.split()))
            plan, _ = fitting_plan_with_cost(graph, profile, cluster, options=options,
                                             ladder=ladder)
        except SpindleError as e:
            results[planner] = (None, 0.0, type(e).__name__)
            continue
        seconds = time.perf_counter() - start
        results[planner] = (simulate(plan, graph, profile, cluster).iteration_ms, seconds,
                            plan.candidate)
    return cid, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="only these cases")
    parser.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args()
    cases = [line.rstrip("\n").split("\t")
             for line in (SWEEP / "cases.tsv").read_text().splitlines(keepends=True)
             if line.strip() and not line.startswith("#")]
    if unknown := sorted(set(args.ids) - {c[0] for c in cases}):
        parser.error(f"no case {', '.join(unknown)} in {SWEEP / 'cases.tsv'}")
    cases = [c + [""] * (5 - len(c)) for c in cases if not args.ids or c[0] in args.ids]
    ahead = behind_little = tied = slower = baseline_kept = 0
    seconds = {planner: 0.0 for planner in PLANNERS}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for cid, results in pool.map(run_case, cases):
            ms, _, candidate = results["spindle"]
            for planner, (_, s, _) in results.items():
                seconds[planner] += s
            best = min(((r[0], p) for p, r in results.items()
                        if p != "spindle" and r[0] is not None), default=None)
            if ms is None or best is None:
                print(f"{cid}: spindle {ms}, baselines {best}: {candidate}")
                continue
            ratio = ms / best[0]
            ahead += ratio < 0.995
            behind_little += 0.995 <= ratio < 1 - 1e-9
            tied += abs(ratio - 1) <= 1e-9
            slower += ratio > 1 + 1e-9
            baseline_kept += "'s schedule" in candidate
            print(f"{cid}: spindle {ms:9.2f} ms, best baseline {best[1]:10s} {best[0]:9.2f} "
                  f"({ratio:.3f})  {candidate}")
    print(f"{len(cases)} cases: Spindle faster than the best baseline by more than 0.5% in "
          f"{ahead}, by less in {behind_little}, tied in {tied}, slower in {slower}; a "
          f"baseline's schedule kept in {baseline_kept}")
    print("planning seconds: " + ", ".join(f"{p} {s:.1f}" for p, s in seconds.items()))


if __name__ == "__main__":
    main()
