"""Runtime figures: executor overhead and simulator fidelity on this machine (CPU, gloo).

1. Executor overhead. tiny-clip, one rank running the whole plan (every slice, every
   boundary as a local copy, the bucketed gradients) vs a plain PyTorch loop over the same
   layers and data (forward every task, sum the mean losses, backward, AdamW). One thread,
   fp32; steps of the two alternate, so both see the same background load; ratio of the
   median step times. Target: ratio <= 1.10.
2. Activation recomputation. The same one-rank run with the plan's `recompute` on (every
   operator in a non-reentrant torch.utils.checkpoint) and off, steps alternating: ratio of
   the median step times (the planner charges 4/3) and the bytes autograd saves for backward
   in one step (saved-tensor hooks), which recomputation cuts to the operators' inputs. Then
   the same run in bf16 mixed precision against fp32: the ratio and the bytes saved.
3. Simulator fidelity. `spindle profile --hardware local` measures tiny-clip's operators here,
   `spindle plan` plans for 2 ranks (clusters/local-cpu-2.yaml), `spindle run` trains with 2
   processes of one thread each and writes a trace whose summary holds the measured
   iteration time and the simulator's prediction. Goal: within 15%, on the median of
   --rounds independent rounds (default 3).
4. Link costs (--links): gloo between 2 local processes of one thread each, the figures
   clusters/local-cpu*.yaml take their link latency and bandwidth from. A pairwise exchange
   (both ranks send and receive in one batch_isend_irecv, as the executor's boundaries do) at
   4 B .. 4 MiB: latency = the median at 4 B, bandwidth = the slope between 64 KiB and 4 MiB;
   and 2-rank all_reduce at 4 B, 480 KB, 4 MiB for comparison with the simulated ring. Then
   "in situ": the 4 B exchange and the 480 KB all-reduce each issued after 0.1-3 ms of
   compute on both ranks, as the executor issues them (median and mean); the exchange both
   when the two ranks arrive together and when one arrives 0.3 ms after the other (timed on
   the late rank: the message alone, without the wait for the peer).

Run: python benchmarks/bench_runtime.py [--steps 30] [--rounds 3] [--skip-fidelity] [--links]
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
from collections.abc import Callable
from pathlib import Path

import torch

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, Profile, load
from spindle_cli.planner.api import make_plan
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.options import PlanOptions
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


def _one_rank(recompute: bool = False, dtype: torch.dtype = torch.float32,
              ) -> tuple[ModelSpec, MetaOpGraph, Plan, Executor]:
    """tiny-clip's Spindle plan for one rank (with recomputation when asked), and an executor
    running it on this process, in `dtype` (fp32 by default; bf16: mixed precision)."""
    model = load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, dtype="fp32")
    local = load(str(REPO / "clusters" / "local-cpu.yaml"), ClusterSpec)
    one = dataclasses.replace(local, name="local-cpu-1", devices_per_node=1, island_size=1)
    profile = analytic_profile(graph, one, hardware="a800", counts=[1])
    plan = make_plan(graph, profile, one,
                     options=PlanOptions(planner="spindle", recompute=recompute))
    program = build_program(plan, graph, model)
    world = World(rank=0, world_size=1, local_rank=0, local_world_size=1, backend="gloo",
                  device=torch.device("cpu"))
    # one rank: every group has a single rank, so no process group is needed
    ex = Executor(plan, program, model, world, {}, SyntheticData(model, SEED, dtype), seed=SEED,
                  lr=LR, dtype=dtype)
    return model, graph, plan, ex


def _print_ratios(base: tuple[str, list[float]], other: tuple[str, list[float]]) -> float:
    """Print the median and the least step times of both and the other's over the base's;
    returns the ratio of the medians."""
    for label, pick in (("median", statistics.median), ("min", min)):
        print(f"  {label:<6} {base[0]} {pick(base[1]):8.3f} ms/step   {other[0]} "
              f"{pick(other[1]):8.3f} ms/step   ratio {pick(other[1]) / pick(base[1]):.3f}")
    return statistics.median(other[1]) / statistics.median(base[1])


def executor_overhead(steps: int) -> None:
    torch.set_num_threads(1)
    model, graph, plan, ex = _one_rank()

    layers = build_layers(model, all_layer_keys(model, graph.tasks), seed=SEED)
    opt = make_optimizer([p for _, p in named_parameters(layers)], LR)
    data = SyntheticData(model, SEED)

    def plain_step(step: int) -> None:
        opt.zero_grad()
        loss = sum(task_loss(model, layers, model.task(t), data, step) for t in graph.tasks)
        loss.backward()  # type: ignore[union-attr]
        opt.step()

    plain, executed = _interleaved_ms(plain_step, ex.train_step, steps)
    ratio = _print_ratios(("plain loop", plain), ("executor", executed))
    print(f"executor overhead (1 rank, {len(plan.waves)} waves, {len(plan.transfers)} local "
          f"transfers, {steps} steps each): {ratio:.3f}x median  "
          f"(target <= 1.10: {'met' if ratio <= 1.10 else 'MISSED'})")


def _saved_bytes(ex: Executor, step: int) -> int:
    """Bytes autograd saves for backward during one training step of `ex`."""
    saved = [0]

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved[0] += x.numel() * x.element_size()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ex.train_step(step)
    return saved[0]


def recomputation(steps: int) -> None:
    torch.set_num_threads(1)
    *_, plain = _one_rank()
    *_, plan, again = _one_rank(recompute=True)
    assert plan.options["recompute"] == "true"
    kept, recomputed = _interleaved_ms(plain.train_step, again.train_step, steps)
    ratio = _print_ratios(("kept", kept), ("recomputed", recomputed))
    print(f"recomputation (1 rank, {steps} steps each): {ratio:.3f}x median (the planner "
          f"charges 4/3); saved for backward per step {_saved_bytes(plain, steps + 3) / 2**20:.2f}"
          f" -> {_saved_bytes(again, steps + 3) / 2**20:.2f} MiB")


def mixed_precision(steps: int) -> None:
    torch.set_num_threads(1)
    *_, full = _one_rank()
    *_, half = _one_rank(dtype=torch.bfloat16)
    fp32, bf16 = _interleaved_ms(full.train_step, half.train_step, steps)
    ratio = _print_ratios(("fp32", fp32), ("bf16", bf16))
    print(f"bf16 mixed precision (1 rank, {steps} steps each): {ratio:.3f}x median; saved "
          f"for backward per step "
          f"{_saved_bytes(full, steps + 3) / 2**20:.2f} -> "
          f"{_saved_bytes(half, steps + 3) / 2**20:.2f} MiB")


def _spindle(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "spindle_cli", *args], check=True)


def fidelity(steps: int, runs: int) -> None:
    """`runs` independent rounds of profile, plan and run; the goal is judged on the median
    error, since this shared machine's speed drifts between a profile and its run."""
    errors = [fidelity_round(steps) for _ in range(runs)]
    error = statistics.median(errors)
    print(f"simulator fidelity over {runs} rounds: errors "
          + ", ".join(f"{e:+.1%}" for e in errors)
          + f"; median {error:+.1%} (goal within 15%: {'met' if abs(error) <= 0.15 else 'MISSED'})")


def fidelity_round(steps: int) -> float:
    """One round: profile, plan and run; prints the breakdown and returns measured /
    predicted - 1."""
    with tempfile.TemporaryDirectory(prefix="spindle-bench-") as tmp:
        d = Path(tmp)
        cluster = str(REPO / "clusters" / "local-cpu-2.yaml")
        _spindle("graph", str(REPO / "models" / "tiny-clip.yaml"), "--dtype", "fp32",
                 "-o", str(d / "graph.yaml"))
        _spindle("profile", str(d / "graph.yaml"), "--hardware", "local", "--cluster", cluster,
                 "--counts", "1,2", "--no-cache", "-o", str(d / "profile.yaml"))
        # the executor implements ZeRO-1/2, not ZeRO-3 (which --memory auto could pick)
        _spindle("plan", str(d / "graph.yaml"), str(d / "profile.yaml"), "--cluster", cluster,
                 "--memory", "none", "--recompute", "off", "-o", str(d / "plan.yaml"))
        _spindle("run", str(d / "plan.yaml"), "--nproc-per-node", "2", "--steps", str(steps),
                 "--trace", str(d / "trace.json"))
        doc = json.loads((d / "trace.json").read_text())
        # the gloo executor's gradient buckets and ranks, as `spindle run` predicts on gloo
        plan = load(str(d / "plan.yaml"), Plan)
        sim = simulate(plan, load(str(d / "graph.yaml"), MetaOpGraph),
                       load(str(d / "profile.yaml"), Profile), load(cluster, ClusterSpec),
                       sync="per-set", progress="rank")
    print(f"  kept candidate: {plan.candidate}")
    print(f"  simulated: compute {sim.compute_ms:.2f} ms, waiting {sim.transfer_ms:.2f}"
          f" ms, sync {sim.sync_ms:.2f} ms; busy per rank "
          + ", ".join(f"{r.busy_ms:.2f} ms" for r in sim.ranks))
    summary = doc["otherData"]
    for rank, parts in summary["breakdown_ms_per_step"].items():
        text = "  ".join(f"{k} {v:.2f} ms" for k, v in parts.items())
        print(f"  measured rank {rank}: {text}")
    measured, predicted = summary["measured_iteration_ms"], summary["predicted_iteration_ms"]
    error = measured / predicted - 1
    print(f"  round (tiny-clip, 2 ranks, {summary['planner']} plan): measured "
          f"{measured:.2f} ms/iteration, predicted {predicted:.2f} ms, error {error:+.1%}")
    return error


EXCHANGE_BYTES = (4, 4096, 65536, 1 << 20, 4 << 20)
ALL_REDUCE_BYTES = (4, 480_000, 4 << 20)


# Compute spans before each in-situ message, cycled: the wave lengths of tiny-clip's plans on
# a CPU rank (0.05-2 ms).
IN_SITU_SPANS_S = (1e-4, 3e-4, 1e-3, 3e-3)


def _exchange(peer: int) -> Callable[[], None]:
    """A 4 B pairwise exchange in one batch_isend_irecv, as the executor's boundaries post it."""
    import torch.distributed as dist

    x, y = torch.zeros(1), torch.empty(1)

    def run() -> None:
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return run


def _after_compute_s(fn: Callable[[], None], repeats: int, rank: int,
                     lag_s: float = 0.0) -> list[float]:
    """Seconds `fn` takes on this rank when issued after a span of compute (IN_SITU_SPANS_S,
    cycled), after 10 warm-up rounds. With `lag_s`, one rank computes that much longer, the
    two taking turns, and only the late rank's rounds are kept: its peer is already waiting,
    so they time the message alone."""
    a = torch.randn(64, 64)
    spans = []
    for i in range(repeats + 10):
        late = i % 2 == rank
        start = time.perf_counter()
        while time.perf_counter() - start < (IN_SITU_SPANS_S[i % len(IN_SITU_SPANS_S)]
                                             + (lag_s if late else 0.0)):
            a @ a
        start = time.perf_counter()
        fn()
        if i >= 10 and (late or lag_s == 0.0):
            spans.append(time.perf_counter() - start)
    return spans


def _timed_ms(fn: object, repeats: int) -> list[float]:
    import torch.distributed as dist

    times = []
    for _ in range(repeats + 10):
        dist.barrier()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append((time.perf_counter() - start) * 1e3)
    return times[10:]


def _link_worker(rank: int, port: int, repeats: int) -> None:
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer = 1 - rank
    exchange = {}
    for num_bytes in EXCHANGE_BYTES:
        x = torch.zeros(max(1, num_bytes // 4))
        y = torch.empty_like(x)

        def swap(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        exchange[num_bytes] = statistics.median(_timed_ms(swap, repeats))
    reduce = {}
    for num_bytes in ALL_REDUCE_BYTES:
        z = torch.zeros(max(1, num_bytes // 4))
        reduce[num_bytes] = statistics.median(_timed_ms(lambda z=z: dist.all_reduce(z), repeats))
    # in situ: issued after compute, as the executor issues them; a gloo message costs far
    # more when both ranks arrive together (each thread goes to sleep in its wait) than when
    # one is already waiting
    z = torch.zeros(120_000)
    in_situ = {
        "exchange 4 B, together": _after_compute_s(_exchange(peer), repeats, rank),
        "exchange 4 B, 0.3 ms late": _after_compute_s(_exchange(peer), repeats, rank, 3e-4),
        "all_reduce 480000 B": _after_compute_s(lambda: dist.all_reduce(z), repeats, rank),
    }
    if rank == 0:
        for label, spans in in_situ.items():
            print(f"  in situ {label:<26} median {statistics.median(spans) * 1e6:8.1f} us  "
                  f"mean {statistics.fmean(spans) * 1e6:8.1f} us")
        for b, ms in exchange.items():
            print(f"  exchange   {b:>8d} B each way: median {ms * 1e3:8.1f} us")
        for b, ms in reduce.items():
            print(f"  all_reduce {b:>8d} B (2 ranks): median {ms * 1e3:8.1f} us")
        lo, hi = 65536, 4 << 20
        bandwidth = (hi - lo) / ((exchange[hi] - exchange[lo]) / 1e3)
        print(f"link costs (gloo, 2 processes, {repeats} repeats): latency "
              f"{exchange[4] * 1e3:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s each way")
    dist.destroy_process_group()


def link_costs(repeats: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_link_worker, args=(29533, repeats), nprocs=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip-fidelity", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="fidelity rounds (median)")
    parser.add_argument("--links", action="store_true", help="only the gloo link costs")
    args = parser.parse_args()
    if args.links:
        link_costs(repeats=100)
        return
    executor_overhead(args.steps)
    recomputation(args.steps)
    mixed_precision(args.steps)
    if not args.skip_fidelity:
        fidelity(args.steps, args.rounds)


if __name__ == "__main__":
    main()
