"""What each rank runs (`main`), from its process's entry point `spindle_cli.runtime.rank`,
started by `spindle run` through torch's elastic launcher or directly by `torchrun`.

Every rank loads and checks the plan against the world before the first collective, trains
with the wave executor (`training.train`), prints each step's loss on rank 0 (stdout),
checkpoints and writes the trace. `options.check_options` refuses options that would fail later
or do nothing; `spindle run` calls it before launching and every rank again before its first
collective. A failing rank prints one line `error: rank R: cause` on stderr, records the same
line for the launcher (torchelastic error file, `_report_failure`) and exits non-zero; its peers
then fail too (their next message to it errors, or the process-group timeout expires).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import replace

import torch

from spindle_cli.errors import ArtifactError, SpindleError
from spindle_cli.runtime import dist as rdist
from spindle_cli.runtime.gradsync import overlap_for
from spindle_cli.runtime.inputs import check_world, load_run_inputs
from spindle_cli.runtime.model import DTYPES, run_dtype
from spindle_cli.runtime.options import TrainOptions, check_options
from spindle_cli.runtime.output import print_line, say
from spindle_cli.runtime.timeouts import DEFAULT_TIMEOUT_S
from spindle_cli.runtime.timings import predicted_iteration
from spindle_cli.runtime.training import train


def _device_memory_bytes(world: rdist.World) -> int:
    if world.device.type == "cuda":
        return int(torch.cuda.get_device_properties(world.device).total_memory)
    return cpu_memory_bytes(world.local_world_size)


def cpu_memory_bytes(ranks_per_node: int) -> int:
    """The memory of one of `ranks_per_node` CPU ranks on this node: they share its RAM
    (`spindle run` checks the plan against it before launch, on gloo, as every rank does)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ranks_per_node


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m spindle_cli.runtime.rank")
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto")
    p.add_argument("--sync", choices=["auto", "chunked", "per-set"], default="auto")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--dataset", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--trace", default=None)
    p.add_argument("--metrics", default=None)
    return p.parse_args(argv)


def _refused_output(e: BaseException) -> str | None:
    """The error line of an output the machine refused (`<file or stdout>: cannot write:
    <why>`, an ArtifactError as `files` and `print_line` raise it), or None."""
    if isinstance(e, ArtifactError) and e.problem.startswith("cannot write"):
        return str(e)
    return None


def _report_failure(rank: int, e: BaseException) -> int:
    """The rank's error line on stderr and in torch's error file, whose `spindle` entry the
    launcher reads (`cli.run_failures`): whether the line is secondary (and the peers it
    lost), the error's hint (printed once, by the launcher, under the run's line) and, for an
    output the machine refused, the line the run ends with (exit code 2)."""
    hint = None
    if isinstance(e, SpindleError):
        cause, code, hint = str(e), e.exit_code, e.hint
    else:
        cause, code = f"{type(e).__name__}: {e}", 1
    # a rank that lost a peer is rarely the root cause; the launcher prefers other ranks' lines
    secondary = isinstance(e, rdist.PeerLost)
    peers = e.peers if isinstance(e, rdist.PeerLost) else []
    line = f"rank {rank}: {cause}"
    say(f"error: {line}")
    if os.environ.get("SPINDLE_DEBUG") == "1":
        traceback.print_exception(e)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # whole or not at all: the launcher parses it once the rank has ended, and a rank
        # stopped while writing it (SIGTERM from the launcher, a peer having failed) left it
        # empty, on which the launcher's parse raised
        partial = f"{error_file}.partial"
        with open(partial, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time()),
                       "spindle": {"rank": rank, "secondary": secondary, "peers": peers,
                                   "hint": hint, "refused_output": _refused_output(e)}}, f)
        os.replace(partial, error_file)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run one rank; returns the process exit code."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        inputs = load_run_inputs(args.plan)
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        check_world(inputs.plan, world_size)
        opts = TrainOptions(steps=args.steps, seed=args.seed, lr=args.lr,
                            dtype=run_dtype(args.dtype, inputs.graph.dtype),
                            dataset=args.dataset, checkpoint_dir=args.checkpoint_dir,
                            checkpoint_every=args.checkpoint_every,
                            keep_checkpoints=args.keep_checkpoints, resume=args.resume,
                            trace_path=args.trace, metrics_path=args.metrics)
        check_options(opts, timeout_s=args.timeout_s, holder=rank == 0)
        world = rdist.init(args.backend, timeout_s=args.timeout_s)
        try:
            check_world(inputs.plan, world.world_size, rank=world.rank,
                        memory_bytes=_device_memory_bytes(world), planned=inputs.graph.dtype,
                        dtype=opts.dtype)
            overlap = overlap_for(args.sync, world.backend)
            predicted = (predicted_iteration(args.plan, inputs.plan, inputs.graph,
                                             overlap_sync=overlap)
                         if world.rank == 0 else None)
            opts = replace(opts, prediction=predicted, overlap_sync=overlap)
            log = print_line if world.rank == 0 else None
            train(inputs.plan, inputs.graph, inputs.model, inputs.program, world, opts, log)
        except BaseException:
            # on nccl, destroying the group waits for the collectives in flight, which a failed
            # run may never complete: the rank would hang there, its error unreported, until
            # the watchdog kills it; it leaves without (`runtime.rank` exits at once)
            if world.backend != "nccl":
                rdist.teardown()
            raise
        rdist.teardown(synchronize=True)
    except BaseException as e:  # noqa: BLE001 - every failure becomes one line and an exit code
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, KeyboardInterrupt):
            return 130  # Ctrl-C reaches every rank; the launcher says it once
        return _report_failure(rank, e)
    return 0


if __name__ == "__main__":
    # the entry point was this module until the ranks' own (it imports torch before a rank can
    # take Ctrl-C): a torchrun line still naming it would start ranks that train nothing
    sys.exit("error: the ranks' entry point is `python -m spindle_cli.runtime.rank`, not "
             "spindle_cli.runtime.worker")
