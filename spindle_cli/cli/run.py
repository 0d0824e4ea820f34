"""`spindle run PLAN`: train a plan with torch.distributed, wave by wave.

Checks the plan, its graph and model (sha256), the world size, the node layout and every
option (`options.check_options`: paths, numbers, a checkpoint to resume from) here, before
launching, so bad input is a one-line error with exit code 2 and no process starts; `--dry-run`
runs the same checks. Then starts the workers
(`python -m spindle_cli.runtime.rank`) through torch's elastic launcher with torchrun's
semantics; on a cluster, the same worker runs under a plain `torchrun` on every node.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, Plan, Profile, load
from spindle_cli.artifacts.io import find_recorded_input, load_recorded_input
from spindle_cli.cli._console import err
from spindle_cli.cli.common import memory_text, require_torch
from spindle_cli.cli.run_failures import abort_hint, hint_of, record_of, root_cause
from spindle_cli.errors import (
    ArtifactError,
    InputNotFound,
    Interrupted,
    PlanError,
    RuntimeFailure,
    SpindleError,
)
from spindle_cli.planner.consistency import check_cluster
from spindle_cli.runtime.timeouts import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S

if TYPE_CHECKING:
    from spindle_cli.runtime.options import TrainOptions
    from spindle_cli.runtime.program import Program


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf: a range check lets nan through (every
    comparison with it is false), and neither is a learning rate or a timeout."""

    def convert(self, value: Any, param: click.Parameter | None,
                ctx: click.Context | None) -> Any:
        # finite first: inf is not a number out of range but no number at all
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


def _endpoint(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--rdzv-endpoint: HOST:PORT (an IPv6 host in brackets), as torchrun parses it but with
    the port required: every node must name the same one."""
    if value is None:
        return None
    host, _, port = value.strip().rpartition(":")
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        raise click.BadParameter(f"{value!r} is not HOST:PORT with a port from 1 to 65535.",
                                 ctx, param)
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not re.fullmatch(r"[\w.:-]+", bare) or (":" in bare and bare == host):
        raise click.BadParameter(f"{value!r}: {host!r} is not a host name or address (write an "
                                 "IPv6 address in brackets, e.g. [::1]:29500).", ctx, param)
    return value.strip()


@click.command()
@click.argument("plan_path", metavar="PLAN")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Worker processes (ranks) on this node.  [default: the plan's ranks over "
                   "--nnodes]")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Number of nodes (each runs `spindle run` with its --node-rank).")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
              help="This node's index, from 0 to NNODES-1 (multi-node runs).")
@click.option("--rdzv-endpoint", default=None, metavar="HOST:PORT", callback=_endpoint,
              help="Rendezvous endpoint shared by all nodes (multi-node runs).")
@click.option("--steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Training steps (a resumed run continues up to this step).")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
              show_default=True, help="auto: nccl when CUDA is present, else gloo.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the initialization and the synthetic data.")
@click.option("--lr", type=FiniteFloatRange(min=0, min_open=True), default=1e-3,
              show_default=True, help="AdamW learning rate.")
@click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32", "fp64"]), default="auto",
              show_default=True,
              help="Parameter and activation dtype; bf16: mixed precision (bf16 weights, "
                   "activations, gradients and messages, AdamW on fp32 masters); auto: the "
                   "plan's, as its graph counts bytes (bf16 for bf16 and fp16 graphs).")
@click.option("--sync", type=click.Choice(["auto", "chunked", "per-set"]), default="auto",
              show_default=True,
              help="Gradient buckets: chunked, a rank set's layers by the backward wave that "
                   "completes them in chunks issued during that backward; per-set, one per "
                   "rank set after its last layer. auto: chunked on nccl, per-set on gloo "
                   "(whose collective threads take the ranks' CPU).")
@click.option("--dataset", default=None, metavar="MODULE:FUNCTION",
              help="User data: FUNCTION(model, seed) from MODULE (the working directory is on "
                   "the import path) returns an object whose rows(task, name, step, lo, hi) "
                   "gives rows [lo, hi) of a task's input (or 'STEP:targets' of an lm_loss "
                   "step) at a step: int64 token ids [rows, seq_len], features [rows, "
                   "seq_len, dim], targets [rows, target_len]. Default: synthetic data.")
@click.option("--trace", "trace_path", default=None, metavar="FILE.json",
              help="Write a Chrome trace: per rank, the compute, send/recv and sync spans of "
                   "every step and wave, with the measured step against the simulator's "
                   "prediction, each slice's compute against its planned time, and what "
                   "each rank held at a step's turn against the plan's memory estimate.")
@click.option("--metrics", "metrics_path", default=None, metavar="FILE.jsonl",
              help="Write one JSON line per trained step (step, steps, loss, losses by "
                   "task, step_ms); a resumed run keeps the lines of the steps it resumes "
                   "from.")
@click.option("--checkpoint-dir", default=None, metavar="DIR",
              help="Save a checkpoint here after the last step (and every K steps with "
                   "--checkpoint-every); made if missing, shared by all nodes.")
@click.option("--checkpoint-every", type=click.IntRange(min=1), default=None, metavar="K",
              help="Also checkpoint every K steps (needs --checkpoint-dir).")
@click.option("--keep-checkpoints", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep the newest N complete checkpoints, removing older ones once a new "
                   "one is complete (needs --checkpoint-dir; default: keep all).")
@click.option("--resume", is_flag=True,
              help="Continue from the newest complete checkpoint in --checkpoint-dir; start "
                   "from step 0 when it holds none yet (--dry-run says which).")
@click.option("--timeout-s", type=FiniteFloatRange(min=1, max=MAX_TIMEOUT_S),
              default=DEFAULT_TIMEOUT_S,
              show_default=True,
              help="Collective/P2P timeout: a silent rank fails the run after this long (at "
                   "most 7 days, past which torch's rendezvous fails).")
@click.option("--dry-run", is_flag=True,
              help="Check everything, print what each rank would do, launch nothing.")
def run(plan_path: str, nproc_per_node: int | None, nnodes: int, node_rank: int,
        rdzv_endpoint: str | None, steps: int, backend: str, seed: int, lr: float, dtype: str,
        sync: str, dataset: str | None, trace_path: str | None, metrics_path: str | None,
        checkpoint_dir: str | None,
        checkpoint_every: int | None, keep_checkpoints: int | None, resume: bool,
        timeout_s: float, dry_run: bool) -> None:
    """Train PLAN (made by `spindle plan`) on NPROC_PER_NODE x NNODES ranks and print the loss
    of every step."""
    # before torch loads (it reads this once): torch's C++ logs repeat, with a backtrace, what
    # the one-line errors say (a node that cannot reach the rendezvous prints a 50-line
    # c10d backtrace per retry); TORCH_CPP_LOG_LEVEL set by the user is kept
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    require_torch("spindle run")
    from spindle_cli.runtime.dist import check_gpus, resolve_backend
    from spindle_cli.runtime.gradsync import overlap_for
    from spindle_cli.runtime.inputs import check_world, load_run_inputs
    from spindle_cli.runtime.options import TrainOptions, check_options, resume_point

    inputs = load_run_inputs(plan_path)
    _check_cluster(inputs.plan, plan_path)
    _note_changed_inputs(inputs.plan, plan_path)
    _check_outputs_not_read(inputs.plan, plan_path, inputs.graph, trace_path, metrics_path)
    if nproc_per_node is None:
        nproc_per_node = _ranks_per_node(inputs.plan.num_devices, nnodes)
    check_world(inputs.plan, nproc_per_node * nnodes)
    dtype = _training_dtype(dtype, inputs.graph)
    resolved = resolve_backend(backend)
    if resolved == "nccl":
        check_gpus(nproc_per_node)
    if dataset is not None:
        from spindle_cli.runtime.data import check_data_source

        check_data_source(dataset, inputs.model, inputs.graph.tasks, seed)
    _check_nodes(nnodes, node_rank, rdzv_endpoint)
    if resolved == "gloo":
        _check_cpu_ranks(inputs.plan, nproc_per_node, node_rank, inputs.graph.dtype, dtype,
                         dry_run=dry_run)
    # the same options and checks as every worker's, which runs them again before training
    opts = TrainOptions(steps=steps, seed=seed, lr=lr, dtype=dtype, dataset=dataset,
                        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every or 0,
                        keep_checkpoints=keep_checkpoints or 0,
                        resume=resume, trace_path=trace_path, metrics_path=metrics_path,
                        overlap_sync=overlap_for(sync, resolved))
    check_options(opts, timeout_s=timeout_s)
    # a checkpoint of another configuration would fail every rank after launch: refuse it here
    found = resume_point(inputs.plan, opts, nproc_per_node * nnodes) if resume else None
    if dry_run:
        _print_ranks(inputs.program, inputs.plan.num_devices)
        _print_checkpoints(opts, found)
        return
    if found is not None and found[1] >= steps:
        _note_nothing_to_train(opts, found)
        return
    argv = _torchrun_argv(_worker_argv(plan_path, opts, backend=backend, sync=sync,
                                       timeout_s=timeout_s),
                          nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                          rdzv_endpoint=rdzv_endpoint, timeout_s=timeout_s)
    _print_start(inputs.plan, dtype, steps, resolved, nproc_per_node)
    _launch_noting_trace(argv, backend=resolved, trace_path=trace_path)


def _check_outputs_not_read(plan: Plan, plan_path: str, graph: MetaOpGraph,
                            trace_path: str | None, metrics_path: str | None) -> None:
    """SpindleError where --trace or --metrics names a file the run reads (`_files_read`):
    writing it would replace it."""
    read = _files_read(plan, plan_path, graph)
    for flag, target, example in (("--trace", trace_path, "trace.json"),
                                  ("--metrics", metrics_path, "metrics.jsonl")):
        if target and Path(target).exists():
            what = next((what for what, path in read if os.path.samefile(target, path)), None)
            if what is not None:
                raise SpindleError(f"{flag} {target}: is {what}; writing it would replace it",
                                   hint=f"give the file another name, e.g. {example}")


def _training_dtype(dtype: str, graph: MetaOpGraph) -> str:
    """The dtype the run trains in (`--dtype`, `auto`: the graph's), with a note where it is
    not the one the plan counts its bytes in (its graph's)."""
    from spindle_cli.runtime.model import DTYPES, run_dtype

    dtype = run_dtype(dtype, graph.dtype)
    if DTYPES[dtype].itemsize != graph.dtype_bytes:
        # a plan sized for bf16 (the graphs' default) trained in fp32: twice its activations
        err.print(f"note: the plan sizes its memory and transfers in {graph.dtype} (its "
                  f"graph's dtype), but this run trains in {dtype}: "
                  f"{_bytes_ratio(dtype, graph)}"
                  + ("; --dtype auto trains it in bf16, as planned, or plan from a graph made "
                     "with --dtype fp32" if dtype == "fp32" else ""), soft_wrap=True)
    elif graph.dtype != dtype:
        err.print(f"note: the plan's graph is {graph.dtype}; this run trains in {dtype} "
                  "(the same bytes; fp16 would need loss scaling, which the executor does "
                  "not do)", soft_wrap=True)
    return dtype


def _check_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    """SpindleError unless --node-rank is one of the --nnodes and a multi-node run has a
    rendezvous endpoint."""
    if node_rank >= nnodes:
        raise SpindleError(f"--node-rank {node_rank} with --nnodes {nnodes}: node ranks run "
                           f"from 0 to {nnodes - 1}")
    if nnodes > 1 and rdzv_endpoint is None:
        raise SpindleError("a multi-node run needs --rdzv-endpoint HOST:PORT")


def _check_cpu_ranks(plan: Plan, nproc_per_node: int, node_rank: int, planned: str,
                     dtype: str, *, dry_run: bool) -> None:
    """`_check_cpu_memory`, whose PlanError a dry run only notes."""
    try:
        _check_cpu_memory(plan, nproc_per_node, node_rank, planned, dtype)
    except PlanError as e:
        if not dry_run:
            raise
        # a GPU plan checked on a machine without its GPUs: the rest of the dry run holds
        err.print(f"note: a run on this machine's CPU ranks would fail: {e}",
                  soft_wrap=True)


def _note_nothing_to_train(opts: TrainOptions, found: tuple[Path, int]) -> None:
    """Where the checkpoint a run resumes from is at its last step already: every step is
    done, the ranks would only start up and stop (every node reads the same shared
    checkpoint directory, so none of them launches)."""
    from spindle_cli.runtime.options import resume_note
    from spindle_cli.runtime.timings import untraced

    err.print(resume_note(found, opts))
    if opts.trace_path:
        err.print(untraced(opts.trace_path))


def _worker_argv(plan_path: str, opts: TrainOptions, *, backend: str, sync: str,
                 timeout_s: float) -> list[str]:
    """The arguments of every rank's `spindle_cli.runtime.rank`: the run's options."""
    worker_args = [plan_path, "--steps", str(opts.steps), "--seed", str(opts.seed),
                   "--lr", repr(opts.lr), "--dtype", opts.dtype, "--backend", backend,
                   "--sync", sync, "--timeout-s", repr(timeout_s)]
    for flag, value in (("--dataset", opts.dataset), ("--trace", opts.trace_path),
                        ("--metrics", opts.metrics_path),
                        ("--checkpoint-dir", opts.checkpoint_dir)):
        if value is not None:
            worker_args += [flag, value]
    if opts.checkpoint_every:
        worker_args += ["--checkpoint-every", str(opts.checkpoint_every)]
    if opts.keep_checkpoints:
        worker_args += ["--keep-checkpoints", str(opts.keep_checkpoints)]
    if opts.resume:
        worker_args.append("--resume")
    return worker_args


def _torchrun_argv(worker_args: list[str], *, nproc_per_node: int, nnodes: int,
                   node_rank: int, rdzv_endpoint: str | None, timeout_s: float) -> list[str]:
    """torchrun's command line: the rendezvous, the ranks of this node, and the worker."""
    if nnodes == 1 and rdzv_endpoint is None:
        launch = ["--standalone"]
    else:
        # the static rendezvous: node ranks are the ones given (c10d's follow arrival order),
        # and a node whose peers do not come fails after the timeout (c10d waits 600 s)
        launch = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend",
                  "static", "--rdzv-endpoint", str(rdzv_endpoint), "--rdzv-conf",
                  f"timeout={math.ceil(timeout_s)}"]
    return [*launch, "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0",
            "-m", "spindle_cli.runtime.rank", *worker_args]


def _print_start(plan: Plan, dtype: str, steps: int, backend: str, nproc_per_node: int) -> None:
    """The run's first line, and a note where its CPU ranks outnumber this node's cores."""
    err.print(f"spindle run: {plan.planner} plan, {len(plan.waves)} waves, "
              f"{plan.num_devices} rank{'s' * (plan.num_devices > 1)}"
              f"{memory_text(plan)}, {dtype}, {steps} "
              f"step{'s' * (steps > 1)}")
    cores = len(os.sched_getaffinity(0))
    if backend == "gloo" and nproc_per_node > cores:
        err.print(f"note: {nproc_per_node} CPU ranks share {cores} core{'s' * (cores > 1)} here, "
                  "so they take turns and a step takes longer than the plan's prediction")


def _launch_noting_trace(argv: list[str], *, backend: str, trace_path: str | None) -> None:
    """`_launch`, with a note where the run fails before it writes its --trace."""
    before = _written_at(trace_path)
    try:
        _launch(argv, backend=backend)
    except SpindleError as e:
        # the trace is written after the last step: a failed run's is not there, and a file
        # of that name is an earlier run's (unless the failure was the trace's own write,
        # which the error names)
        if trace_path and _written_at(trace_path) == before \
                and not str(e).startswith(f"{trace_path}: "):
            err.print("trace: not written, the run did not finish"
                      + (f" ({trace_path} is an earlier run's)" if before is not None else ""))
        raise


def _written_at(path: str | None) -> int | None:
    """The modification time of `path` in ns, None where there is no such file."""
    try:
        return None if path is None else os.stat(path).st_mtime_ns
    except OSError:
        return None


def _files_read(plan: Plan, plan_path: str, graph: MetaOpGraph) -> list[tuple[str, Path]]:
    """(what it is, where) of the files a run reads: the plan, the inputs it records (its
    graph, profile and cluster) and the graph's model, where they are found."""
    names = {MetaOpGraph.KIND: "graph", Profile.KIND: "profile", ClusterSpec.KIND: "cluster"}
    found = [("the plan", Path(plan_path))]
    graph_path = None
    for ref in plan.inputs:
        where = find_recorded_input(ref, plan_path)
        if where is not None and where.exists():
            found.append((f"the plan's {names.get(ref.kind, ref.kind)}", where))
            graph_path = where if ref.kind == MetaOpGraph.KIND else graph_path
    for ref in graph.inputs if graph_path is not None else ():
        where = find_recorded_input(ref, str(graph_path))
        if where is not None and where.exists():
            found.append(("the graph's model", where))
    return found


def _ranks_per_node(num_ranks: int, nnodes: int) -> int:
    """The plan's ranks spread evenly over `nnodes` nodes (SpindleError when they cannot
    be)."""
    if num_ranks % nnodes:
        raise SpindleError(f"the plan's {num_ranks} ranks do not split evenly over {nnodes} "
                           "nodes", hint="every node runs as many ranks: plan for a multiple "
                                         f"of {nnodes} ranks, or run on fewer nodes")
    return num_ranks // nnodes


def _bytes_ratio(dtype: str, graph: MetaOpGraph) -> str:
    """How a run in `dtype` scales the bytes its plan counts in its graph's dtype:
    activations and messages by the element size, the state per parameter as
    `memory.state_bytes_per_param` counts it (an fp32 run and bf16 mixed precision both keep
    16 bytes)."""
    from spindle_cli.planner.memory import ELEMENT_BYTES, state_bytes_per_param

    acts = ELEMENT_BYTES[dtype] / graph.dtype_bytes
    state = sum(state_bytes_per_param(dtype)) / sum(state_bytes_per_param(graph.dtype))
    if acts == state:
        return f"they take {acts:g}x the plan's bytes"
    return (f"its activations and messages take {acts:g}x the plan's bytes, its parameter "
            f"state {state:g}x")


def _check_cpu_memory(plan: Plan, nproc_per_node: int, node_rank: int, planned: str,
                      dtype: str) -> None:
    """PlanError unless every rank of this node fits its share of the node's RAM, trained in
    `dtype` (the plan counts in `planned`), the check each CPU rank makes after the process
    group is up (`worker.main`): a plan made for GPUs started its 16 CPU ranks here, and the
    run ended on a raw gloo 'connectFullMesh failed' line."""
    from spindle_cli.runtime.inputs import check_world
    from spindle_cli.runtime.worker import cpu_memory_bytes

    share = cpu_memory_bytes(nproc_per_node)
    first = node_rank * nproc_per_node
    try:
        for rank in range(first, first + nproc_per_node):
            check_world(plan, plan.num_devices, rank=rank, memory_bytes=share,
                        planned=planned, dtype=dtype)
    except PlanError as e:
        raise PlanError(f"{e} (its share of this node's RAM, with {nproc_per_node} CPU ranks)",
                        hint="run it on the devices it was planned for, or plan for this "
                             "machine's cores (e.g. --cluster clusters/local-cpu-2.yaml)") from None


def _print_checkpoints(opts: TrainOptions, found: tuple[Path, int] | None) -> None:
    """--dry-run: where the run would checkpoint, and where a resume would start."""
    from spindle_cli.cli._console import out
    from spindle_cli.runtime.options import resume_note

    if opts.checkpoint_dir is None:
        return
    if found is not None and found[1] >= opts.steps:
        out.print(resume_note(found, opts))  # no step to train, no checkpoint to write
        return
    k = opts.checkpoint_every
    every = f"every {k} step{'s' * (k > 1)} and " if 0 < k < opts.steps else ""
    kept = (f", keeping the newest {opts.keep_checkpoints}" if opts.keep_checkpoints else "")
    out.print(f"checkpoints: {opts.checkpoint_dir}, {every}after step {opts.steps}{kept}")
    if opts.resume:
        out.print(resume_note(found, opts))


def _check_cluster(plan: Plan, plan_path: str) -> None:
    """The plan's recorded cluster, where this node has it, must hold as many devices as the
    plan, in its islands (workers need only the plan, its graph and its model, so a node
    without the file skips this; its other contents, its name included, do not matter to a
    run: `_note_changed_inputs` notes a file changed since)."""
    ref = next((r for r in plan.inputs if r.kind == "cluster"), None)
    found = None if ref is None else find_recorded_input(ref, plan_path)
    if found is None:
        return
    try:
        check_cluster(plan, load(str(found), ClusterSpec), name=False)
    except PlanError as e:
        raise PlanError(f"{plan_path}: {e}") from None


def _note_changed_inputs(plan: Plan, plan_path: str) -> None:
    """A note for each of the plan's recorded profile and cluster found here but changed (or
    no longer valid) since the plan was made. A run needs neither (its workers read only the
    plan, its graph and its model), so it goes on, but the plan's waves were timed on the
    old figures."""
    for cls in (Profile, ClusterSpec):
        if not any(r.kind == cls.KIND for r in plan.inputs):
            continue
        try:
            load_recorded_input(plan, plan_path, cls)
        except InputNotFound:
            continue
        except ArtifactError as e:
            err.print(f"note: {e}; training the plan as it is (`spindle plan --check` tells "
                      "whether the current inputs plan it differently)", soft_wrap=True)


def _print_ranks(program: Program, num_ranks: int) -> None:
    """The per-rank table of --dry-run (stdout: it is what the user asked for)."""
    from rich.table import Table

    from spindle_cli.cli.views import print_table, rank_text
    from spindle_cli.runtime.program import rank_summaries

    table = Table(title="per rank, one step")
    for name in ("rank", "slices", "layers held", "sends", "recvs", "rows sent",
                 "gradient groups"):
        table.add_column(name, justify="left" if name == "gradient groups" else "right")
    for s in rank_summaries(program, num_ranks):
        table.add_row(str(s.rank), str(s.num_slices), str(len(s.layers)), str(s.num_sends),
                      str(s.num_recvs), str(s.send_rows),
                      " ".join("{" + rank_text(g) + "}" for g in s.sync_groups) or "-")
    print_table(table)


def _launch(argv: list[str], *, backend: str) -> None:
    """torchrun with `argv`; a failed worker becomes a RuntimeFailure naming its rank, nodes
    that do not meet one saying where they waited."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run as torchrun

    if Path("/sys/class/net/lo").exists():
        # gloo binds to the hostname's address, which some containers cannot bind; a
        # single-node run can always use the loopback interface
        if "--standalone" in argv:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # torchrun warns when it sets this default itself
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # the elastic agent logs every worker's exit, and a signal that stops the run; the workers
    # print their own one-line errors, the launcher the run's. torch gives some of its loggers
    # their own level (the agent's: WARNING), which the parent's does not override
    for name in ("torch.distributed.elastic", *(
            n for n in logging.root.manager.loggerDict
            if n.startswith("torch.distributed.elastic."))):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        with _stops_before_ranks():
            torchrun(launch_config(argv))
    except ChildFailedError as e:
        cause = root_cause(e)
        refused = record_of(e, cause).get("refused_output")
        if isinstance(refused, str):
            # an output the machine refused ends a run as it ends every command (exit 2)
            raise SpindleError(refused, hint=hint_of(e, cause)) from None
        raise RuntimeFailure(f"run failed: {cause}",
                             hint=hint_of(e, cause) or abort_hint(cause, backend)) from None
    except (DistError, RendezvousError) as e:
        # the message's first line; torch appends a C++ backtrace
        endpoint = argv[argv.index("--rdzv-endpoint") + 1] if "--rdzv-endpoint" in argv else ""
        if endpoint and "EADDRINUSE" in str(e):
            # node 0 serves the rendezvous on that port: nothing about the other nodes
            raise SpindleError(f"--rdzv-endpoint {endpoint}: the port is in use on this node",
                               hint="give a free port (the same on every node), or end what "
                                    "holds it") from None
        raise RuntimeFailure(
            f"the nodes did not meet at {endpoint or 'the rendezvous'}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}",
            hint="start every node with the same --nnodes and --rdzv-endpoint (node 0's "
                 "address) and a different --node-rank, within --timeout-s of each other"
        ) from None
    except SignalException as e:
        # the launcher stopped every rank; checkpoints already written stay whole
        raise Interrupted(f"interrupted by {e.sigval.name}: every rank was stopped",
                          int(e.sigval)) from None


TORCHRUN_ENV_PREFIX = "PET_"
"""torchrun takes the default of every option it is not given from `PET_<OPTION>` (an
environment a torchrun or a cluster job leaves behind, e.g. PET_NNODES=3)."""


def launch_config(argv: list[str]) -> argparse.Namespace:
    """torchrun's options for `argv`, from `argv` alone: the `PET_*` variables are hidden
    while torchrun parses. `spindle run` passes the options it means; one it leaves out took
    a leftover variable's value (PET_NNODES=3 made a one-node run wait ~600 s for nodes that
    never came and then blame the rendezvous; PET_REDIRECTS, PET_TEE and
    PET_LOCAL_RANKS_FILTER swallowed or prefixed the loss lines)."""
    from torch.distributed.run import parse_args

    leftover = {k: v for k, v in os.environ.items() if k.startswith(TORCHRUN_ENV_PREFIX)}
    for name in leftover:
        del os.environ[name]
    try:
        return parse_args(argv)
    finally:
        os.environ.update(leftover)


@contextlib.contextmanager
def _stops_before_ranks() -> Iterator[None]:
    """Ctrl-C (SIGINT) or SIGTERM before torch's launcher has started the ranks ends the run
    at once. Till then the launcher may wait in C++ for the other nodes (the static
    rendezvous, up to --timeout-s), where no Python signal handler runs: a node stopped while
    it waited exited only when the wait timed out (300 s by default). A thread of ours learns
    of the signal (`signal.set_wakeup_fd`) and exits while the handler is still the one from
    before the launch; torch's agent installs its own as it starts the ranks, and forwards
    later signals to them. SIGINT is also blocked in this thread, so the ranks start with it
    blocked (a mask is inherited across exec) until they can take it quietly
    (`runtime.rank`: it arrived during a rank's interpreter start-up, 'Fatal Python error'),
    and the thread of ours takes it meanwhile."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    read, write = os.pipe()
    os.set_blocking(write, False)

    def watch() -> None:
        while data := os.read(read, 1):
            signum = data[0]
            if signum in before and signal.getsignal(signum) is before[signum]:
                sys.stderr.write(f"error: interrupted by {signal.Signals(signum).name} before "
                                 "any rank started\n")
                sys.stderr.flush()
                os._exit(128 + signum)

    thread = threading.Thread(target=watch, name="spindle-early-stop", daemon=True)
    thread.start()
    wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.set_wakeup_fd(wakeup)
        os.close(write)  # the thread reads the end of the pipe and returns
        thread.join()
        os.close(read)
