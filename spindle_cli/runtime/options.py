"""The options a rank trains with (`TrainOptions`: what `spindle run` passes on) and their
checks (`check_options`), made before any process group: `spindle run` makes them before
launching, and every rank again before its first collective. Also where a run with --resume
starts (`resume_point`, `resume_note`), from what a checkpoint must agree on with the run
(`checkpoint_meta`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spindle_cli.artifacts import Plan, sha256
from spindle_cli.artifacts.files import check_can_create, names_directory, output_file
from spindle_cli.errors import ArtifactError, SpindleError
from spindle_cli.planner.buckets import SYNC_CHUNK_BYTES
from spindle_cli.runtime import checkpoint
from spindle_cli.runtime.timeouts import MAX_TIMEOUT_S
from spindle_cli.runtime.timings import Prediction


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainOptions:
    """How to train (what `spindle run` passes on)."""

    steps: int
    """Total training steps (a resumed run continues up to this step)."""
    seed: int = 0
    lr: float = 1e-3
    dtype: str = "fp32"
    dataset: str | None = None
    checkpoint_dir: str | None = None
    """Where checkpoints go: one after the last step, and every `checkpoint_every` steps."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: after the last step only)."""
    keep_checkpoints: int = 0
    """Keep the newest this many complete checkpoints, removing older ones (0: keep all)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in `checkpoint_dir`, if there is one."""
    trace_path: str | None = None
    metrics_path: str | None = None
    """Where rank 0 writes one JSON line per trained step (`Metrics`)."""
    prediction: Prediction | None = None
    """Predicted iteration time for the run's time line and the trace summary (default: the
    plan's estimate)."""
    overlap_sync: bool | None = None
    """Bucket shared layers by the wave that completes them, in chunks issued during its
    backward (GradSync); None: on NCCL only."""
    sync_chunk_bytes: int = SYNC_CHUNK_BYTES
    """The least gradient bytes of such a chunk (`buckets.sync_buckets`)."""


def checkpoint_meta(plan: Plan, opts: TrainOptions) -> dict[str, Any]:
    """What a checkpoint must agree on with the run resuming from it: with the plan and data,
    the gradient buckets (`opts.overlap_sync`, resolved), whose flat tensors hold the
    optimizer state."""
    assert opts.overlap_sync is not None, "the sync mode is resolved before checkpoints"
    return {"plan_sha256": sha256(plan), "seed": opts.seed, "dtype": opts.dtype,
            "dataset": opts.dataset or "synthetic",
            "sync": f"chunked, {opts.sync_chunk_bytes} bytes" if opts.overlap_sync
            else "per-set"}


def check_options(opts: TrainOptions, *, timeout_s: float, holder: bool = True) -> None:
    """Refuse (SpindleError) options that would fail only later in the run, or do nothing.
    Reads the file system, leaves nothing on it (a probe file, `check_can_create`, is removed
    at once), uses no process group. Only a `holder` (`spindle run` before launch, a run's
    rank 0) checks that no run holds the checkpoint directory: another rank of this run may
    come to it after its rank 0 has taken the directory (`train`)."""
    for flag, path in (("--checkpoint-dir", opts.checkpoint_dir), ("--trace", opts.trace_path),
                       ("--metrics", opts.metrics_path)):
        if path == "":
            # (an empty --checkpoint-dir read as none: the run saved nothing, silently)
            raise SpindleError(f"{flag}: an empty path", hint=f"give {flag} a path, or leave "
                               "it out")
    if opts.steps < 1:
        raise SpindleError(f"--steps {opts.steps}: expected at least 1")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise SpindleError(f"--lr {opts.lr}: expected a finite number > 0")
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise SpindleError(f"--timeout-s {timeout_s}: expected a finite number of seconds > 0")
    if timeout_s > MAX_TIMEOUT_S:
        raise SpindleError(f"--timeout-s {timeout_s:g}: at most {MAX_TIMEOUT_S:g} seconds "
                           "(7 days): torch's rendezvous and collectives fail on longer ones")
    if opts.checkpoint_every < 0:
        raise SpindleError(f"--checkpoint-every {opts.checkpoint_every}: expected at least 1 "
                           "(or 0: only after the last step)")
    if opts.keep_checkpoints < 0:
        raise SpindleError(f"--keep-checkpoints {opts.keep_checkpoints}: expected at least 1 "
                           "(or 0: keep all)")
    if opts.checkpoint_dir is None:
        for flag, given in (("--checkpoint-every", opts.checkpoint_every),
                            ("--keep-checkpoints", opts.keep_checkpoints),
                            ("--resume", opts.resume)):
            if given:
                raise SpindleError(f"{flag} needs --checkpoint-dir")
    else:
        checkpoint.check_dir(opts.checkpoint_dir)
        if holder:
            checkpoint.check_free(opts.checkpoint_dir)
        found = None if opts.resume else checkpoint.newest(opts.checkpoint_dir)
        if found is not None:
            # a new run would replace some of them and leave the rest to a later --resume;
            # an incomplete one too (a rank's file on a disk that is gone for now)
            raise SpindleError(
                f"--checkpoint-dir {opts.checkpoint_dir}: holds another run's checkpoints "
                f"(the newest {found.name})",
                hint="--resume continues from the newest complete one; or give this run "
                     "another --checkpoint-dir")
    if opts.trace_path is not None:
        _check_output_path("--trace", opts.trace_path, ".json", "a Chrome trace")
    if opts.metrics_path is not None:
        _check_output_path("--metrics", opts.metrics_path, ".jsonl", "metrics (JSON lines)")


def _check_output_path(flag: str, path: str, suffix: str, what: str) -> None:
    """A file a run writes (a Chrome trace at its end, `trace.write_json`; its metrics step by
    step, `Metrics`) into an existing directory, where `files.output_file` lets it be written
    and a file can be created (`check_can_create`, in the directory of a symlink's
    target)."""
    target = Path(path)
    example = f"{flag[2:]}{suffix}"
    if names_directory(path):
        raise SpindleError(f"{flag} {path}: names a directory (a trailing slash), not a file")
    if target.is_dir():
        raise SpindleError(f"{flag} {path}: is a directory",
                           hint=f"give a file name, e.g. {target / example}")
    if target.suffix.lower() != suffix:
        raise SpindleError(f"{flag} {path}: {what} is a {suffix} file",
                           hint=f"give a name ending in {suffix}, e.g. {example}")
    parent = target.absolute().parent
    if not parent.exists():
        raise SpindleError(f"{flag} {path}: directory does not exist")
    if not parent.is_dir():
        raise SpindleError(f"{flag} {path}: {parent} is not a directory")
    try:
        target_file = output_file(path)
    except ArtifactError as e:
        raise SpindleError(f"{flag} {e}", hint=e.hint) from None
    check_can_create(f"{flag} {path}", target_file.parent)


def resume_point(plan: Plan, opts: TrainOptions, world_size: int) -> tuple[Path, int] | None:
    """(checkpoint, completed steps) a run with `opts.resume` continues from, or None when
    `checkpoint_dir` holds no complete checkpoint yet (the run starts from step 0);
    SpindleError when the newest one was taken by another run configuration."""
    assert opts.resume and opts.checkpoint_dir is not None
    return checkpoint.resume_point(opts.checkpoint_dir, world_size=world_size,
                                   meta=checkpoint_meta(plan, opts))


def resume_note(found: tuple[Path, int] | None, opts: TrainOptions) -> str:
    """What a run with `opts.resume` says about where it starts: a line for each newer,
    damaged checkpoint it passes over (`checkpoint.passed_over`), then where it resumes."""
    if found is None:
        return f"no checkpoint in {opts.checkpoint_dir} yet: starting from step 0"
    assert opts.checkpoint_dir is not None
    path, start = found
    if start >= opts.steps:
        left = f"nothing left to train (--steps {opts.steps})"
    elif start + 1 == opts.steps:
        left = f"training step {opts.steps}"
    else:
        left = f"training steps {start + 1}-{opts.steps}"
    skipped = [f"note: passing over {newer}: {problem}"
               for newer, problem in checkpoint.passed_over(opts.checkpoint_dir)]
    return "\n".join([*skipped, f"resuming from {path} at step {start}: {left}"])
