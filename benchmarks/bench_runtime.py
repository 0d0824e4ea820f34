"""Runtime figures: executor overhead and simulator fidelity on this machine (CPU, gloo).

1. Executor overhead. tiny-clip, one rank running the whole plan (every slice, every
   boundary as a local copy, the bucketed gradients) vs a plain PyTorch loop over the same
   layers and data (forward every task, sum the mean losses, backward, AdamW). One thread,
   fp32; steps of the two alternate, so both see the same background load; ratio of the
   median step times. Target: ratio <= 1.10.
2. Simulator fidelity. `spindle profile --hardware local` measures tiny-clip's operators here,
   `spindle plan` plans for 2 ranks (clusters/local-cpu-2.yaml), `spindle run` trains with 2
   processes of one thread each and writes a trace whose summary holds the measured iteration
   time and the simulator's prediction. Goal: within 15%.

Run: python benchmarks/bench_runtime.py [--steps 30] [--skip-fidelity]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, Profile, load
from spindle_cli.planner.api import PlanOptions, make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.simulate import simulate
from spindle_cli.runtime.data import SyntheticData
from spindle_cli.runtime.dist import World
from spindle_cli.runtime.executor import Executor
from spindle_cli.runtime.model import (
    all_layer_keys,
    build_layers,
    make_optimizer,
    named_parameters,
    task_loss,
)
from spindle_cli.runtime.program import build_program

REPO = Path(__file__).resolve().parent.parent
SEED, LR = 0, 1e-3


def _interleaved_ms(a: object, b: object, steps: int) -> tuple[list[float], list[float]]:
    """Per-step times of `a` and `b`, alternating step by step so that both see the same
    background load (after 3 warm-up steps each)."""
    times_a, times_b = [], []
    for i in range(steps + 3):
        for fn, times in ((a, times_a), (b, times_b)):
            start = time.perf_counter()
            fn(i)  # type: ignore[operator]
            if i >= 3:
                times.append((time.perf_counter() - start) * 1e3)
    return times_a, times_b


def executor_overhead(steps: int) -> None:
    torch.set_num_threads(1)
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    local = load(str(REPO / "clusters" / "local-cpu.yaml"), ClusterSpec)
    one = dataclasses.replace(local, name="local-cpu-1", devices_per_node=1, island_size=1)
    profile = analytic_profile(graph, one, hardware="a800", counts=[1])
    plan = make_plan(graph, profile, one, options=PlanOptions(planner="spindle"))
    program = build_program(plan, graph, model)
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
                  device=torch.device("cpu"))
    # one rank: every group has a single rank, so no process group is needed
    ex = Executor(plan, program, model, world, {}, SyntheticData(model, SEED), seed=SEED, lr=LR,
                  dtype=torch.float32)

    layers = build_layers(model, all_layer_keys(model, graph.tasks), seed=SEED)
    opt = make_optimizer([p for _, p in named_parameters(layers)], LR)
    data = SyntheticData(model, SEED)

    def plain_step(step: int) -> None:
        opt.zero_grad()
        loss = sum(task_loss(model, layers, model.task(t), data, step) for t in graph.tasks)
        loss.backward()  # type: ignore[union-attr]
        opt.step()

    plain, executed = _interleaved_ms(plain_step, ex.train_step, steps)
    for label, pick in (("median", statistics.median), ("min", min)):
        print(f"  {label:<6} plain loop {pick(plain):8.3f} ms/step   executor "
              f"{pick(executed):8.3f} ms/step   ratio {pick(executed) / pick(plain):.3f}")
    ratio = statistics.median(executed) / statistics.median(plain)
    print(f"executor overhead (1 rank, {len(plan.waves)} waves, {len(plan.transfers)} local "
          f"transfers, {steps} steps each): {ratio:.3f}x median  "
          f"(target <= 1.10: {'met' if ratio <= 1.10 else 'MISSED'})")


def _spindle(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "spindle_cli", *args], check=True)


def fidelity(steps: int) -> None:
    with tempfile.TemporaryDirectory(prefix="spindle-bench-") as tmp:
        d = Path(tmp)
        cluster = str(REPO / "clusters" / "local-cpu-2.yaml")
        _spindle("graph", str(REPO / "models" / "tiny-clip.yaml"), "--dtype", "fp32",
                 "-o", str(d / "graph.yaml"))
        _spindle("profile", str(d / "graph.yaml"), "--hardware", "local", "--cluster", cluster,
                 "--counts", "1,2", "-o", str(d / "profile.yaml"))
        _spindle("plan", str(d / "graph.yaml"), str(d / "profile.yaml"), "--cluster", cluster,
                 "-o", str(d / "plan.yaml"))
        _spindle("run", str(d / "plan.yaml"), "--nproc-per-node", "2", "--steps", str(steps),
                 "--trace", str(d / "trace.json"))
        doc = json.loads((d / "trace.json").read_text())
        sim = simulate(load(str(d / "plan.yaml"), Plan), load(str(d / "graph.yaml"), MetaOpGraph),
                       load(str(d / "profile.yaml"), Profile), load(cluster, ClusterSpec))
    print(f"  simulated: compute {sim.compute_ms:.2f} ms (waves), transfers {sim.transfer_ms:.2f}"
          f" ms, sync {sim.sync_ms:.2f} ms; busy per rank "
          + ", ".join(f"{r.busy_ms:.2f} ms" for r in sim.ranks))
    summary = doc["otherData"]
    for rank, parts in summary["breakdown_ms_per_step"].items():
        text = "  ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
        print(f"  measured rank {rank}: {text}")
    measured, predicted = summary["measured_iteration_ms"], summary["predicted_iteration_ms"]
    error = measured / predicted - 1
    print(f"simulator fidelity (tiny-clip, 2 ranks, {summary['planner']} plan): measured "
          f"{measured:.2f} ms/iteration, predicted {predicted:.2f} ms, error {error:+.1%} "
          f"(goal within 15%: {'met' if abs(error) <= 0.15 else 'MISSED'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-fidelity", action="store_true")
    args = parser.parse_args()
    executor_overhead(args.steps)
    if not args.skip_fidelity:
        fidelity(args.steps)


if __name__ == "__main__":
    main()
