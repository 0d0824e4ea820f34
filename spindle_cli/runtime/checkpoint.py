"""Atomic distributed checkpoints: every rank's layers and optimizer state, the step, the data
position.

Layout: `DIR/step-000004/{rank-00000.pt, ..., manifest.json}`. Ranks write into a hidden
`DIR/.step-000004.tmp/`; after a barrier (every rank's file is complete) rank 0 writes the
manifest and renames the directory, and a second barrier makes every rank wait for it. A crash
anywhere before the rename leaves only the hidden directory, which `latest` ignores, so a
checkpoint directory without a hidden prefix is always complete, unless damaged from outside (a
rank file lost, or cut short by a full disk or a stopped copy): `latest` then passes it over
for the one before it. The checkpoint directory must be shared by all nodes.

`check_dir` and `resume_point` use the file system only (`check_dir` makes and removes one
probe file), so `spindle run` calls them before launching (and `--dry-run` reports what a
resume would start from).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spindle_cli.artifacts.files import check_can_create
from spindle_cli.errors import ArtifactError, SpindleError
from spindle_cli.runtime.dist import with_peers

MANIFEST = "manifest.json"
WRITTEN_BY = "checkpoint"
"""The key of a rank file's state under which `save` records the rank and step it wrote it
for (`load` checks and removes it)."""


@contextlib.contextmanager
def hold(directory: str) -> Iterator[None]:
    """Lock `directory` (made if missing) for the run whose rank 0 checkpoints there, while
    the context lasts or the process lives; SpindleError when another run holds it. Two runs
    given one directory at once both passed the check before launch (no checkpoint there
    yet) and replaced each other's checkpoints, one reporting success with none of its own
    kept. Once it holds the lock, what crashed saves left hidden is removed
    (`_remove_hidden`): the space a failed save asked to free, which the run's first save
    needs (other ranks write only after rank 0, the holder, has met them in
    `check_shared`)."""
    with _locked(directory):
        _remove_hidden(directory)
        yield


def check_free(directory: str) -> None:
    """SpindleError when a run holds `directory` (`hold`) now; takes nothing and changes
    nothing (the check before launch, a dry run's too): the lock is taken and let go at
    once."""
    if os.path.isdir(directory):
        with _locked(directory):
            pass


@contextlib.contextmanager
def _locked(directory: str) -> Iterator[None]:
    """`hold`'s lock: a flock on the directory itself, which leaves no file behind (some
    network file systems do not honour it across nodes)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SpindleError(
                f"--checkpoint-dir {directory}: another run is writing checkpoints there",
                hint="give this run another --checkpoint-dir, or wait until the other run "
                     "ends") from None
        yield
    finally:
        os.close(fd)


def step_dir(directory: str, step: int) -> Path:
    """Where the checkpoint taken after `step` completed steps lives."""
    return Path(directory) / f"step-{step:06d}"


_FREE_SPACE_HINT = ("free space where --checkpoint-dir lies, then --resume: the checkpoints "
                    "before this one are whole")


@contextlib.contextmanager
def _refused(path: Path) -> Iterator[None]:
    """An OSError making `path` (a full disk, a read-only file system) is an output the
    machine refused (exit code 2, as `_atomic_torch_save`'s)."""
    try:
        yield
    except OSError as e:
        raise ArtifactError(str(path), "", f"cannot write the checkpoint: {e.strerror or e}",
                            hint=_FREE_SPACE_HINT) from None


def _atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save through a hidden temporary file, on disk (fsync) before it is renamed, as
    `files.replace_atomic` makes every other file: a checkpoint committed and then lost with
    the machine's power must not hold a rank file the disk never got. A failed write is an
    output the machine refused (ArtifactError 'cannot write ...': the run ends with exit
    code 2, as every command's does) naming the file, the checkpoints before it left whole.
    A full disk makes torch say only '[enforce fail at inline_container.cc] unexpected pos N
    vs M'."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except (RuntimeError, OSError) as e:
        text = (str(e).splitlines() or [type(e).__name__])[0]
        reason = (e.strerror if isinstance(e, OSError) and e.strerror else
                  "the file system took fewer bytes than were written" if "unexpected pos" in text
                  else text)
        raise ArtifactError(str(path), "", f"cannot write the checkpoint (a full disk?): {reason}",
                            hint=_FREE_SPACE_HINT) from None
    os.replace(tmp, path)


def rank_file(rank: int) -> str:
    """The name of a rank's state file inside a checkpoint directory."""
    return f"rank-{rank:05d}.pt"


def save(directory: str, step: int, *, rank: int, world_size: int, state: dict[str, Any],
         meta: dict[str, Any], keep: int = 0) -> None:
    """Collective: write this rank's `state` for `step` completed steps; rank 0 commits, then
    with `keep` removes the checkpoints older than the newest `keep` complete ones
    (`prune`)."""
    final = step_dir(directory, step)
    tmp = final.with_name(f".{final.name}.tmp")
    with _refused(tmp):
        tmp.mkdir(parents=True, exist_ok=True)
    _atomic_torch_save({**state, WRITTEN_BY: {"rank": rank, "step": step}},
                       tmp / rank_file(rank))
    if world_size > 1:
        _barrier(f"the checkpoint of step {step}", rank, world_size)
    if rank == 0:
        # a directory not shared by every node (`check_shared` found it so at the start, but
        # a mount may go since): committing would leave a checkpoint no resume can load
        problem = _rank_files_problem(tmp, world_size)
        if problem is not None:
            raise SpindleError(f"{tmp}: after every rank wrote its file, the {problem}",
                               hint=_SHARED_HINT)
        manifest = {"step": step, "data_position": step, "world_size": world_size, **meta}
        with _refused(tmp / MANIFEST):
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        # a checkpoint of the same step is replaced by renames only: a crash leaves it whole,
        # or hidden, never half deleted
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        if old.exists():
            shutil.rmtree(old)
        _remove_hidden(directory)
        if keep:
            prune(directory, keep)
    if world_size > 1:
        _barrier(f"the checkpoint of step {step}", rank, world_size)


def _barrier(where: str, rank: int, world_size: int) -> None:
    """A barrier of every rank; a peer lost in it is PeerLost naming `where` (a rank that
    failed meanwhile, as rank 0 committing a checkpoint: its own line says why)."""
    with with_peers(where, [r for r in range(world_size) if r != rank]):
        dist.barrier()


def _remove_hidden(directory: str) -> None:
    """Remove what crashed saves left hidden under `directory` (`.step-N.tmp`, `.step-N.old`):
    no checkpoint is read from them, and only this run writes there (`hold`), which is
    starting or whose save of this step has just committed. They may hold a whole disk's
    worth: the space a failed save asks to free."""
    for path in Path(directory).glob(".step-*"):
        if path.name.endswith((".tmp", ".old")) and path.is_dir():
            shutil.rmtree(path)


_SHARED_HINT = ("give --checkpoint-dir on a file system every node mounts: each rank writes "
                "its own file into it and rank 0 commits them")


def check_shared(directory: str, *, rank: int, world_size: int) -> None:
    """Collective, before the first step: SpindleError on rank 0 unless it sees the file every
    rank writes into `directory` (made if missing). A directory that is not shared by every
    node (node-local disks) let a run finish with exit code 0 and checkpoints none of which
    would load (a rank's file missing), found only at --resume."""
    probe = Path(directory) / f".probe-rank-{rank:05d}"
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # those a killed run left: another node's would pass for one written now
            for stale in probe.parent.glob(".probe-rank-*"):
                stale.unlink(missing_ok=True)
        _barrier("the check of --checkpoint-dir", rank, world_size)
        probe.write_text(f"{rank}\n")
        _barrier("the check of --checkpoint-dir", rank, world_size)
        if rank == 0:
            unseen = [r for r in range(world_size)
                      if not (probe.parent / f".probe-rank-{r:05d}").is_file()]
            if unseen:
                raise SpindleError(
                    f"--checkpoint-dir {directory}: rank 0 does not see the files rank(s) "
                    f"{', '.join(map(str, unseen[:8]))}{' ...' if len(unseen) > 8 else ''} "
                    "wrote there: the directory is not shared by every node",
                    hint=_SHARED_HINT)
        _barrier("the check of --checkpoint-dir", rank, world_size)
    finally:
        probe.unlink(missing_ok=True)


def prune(directory: str, keep: int) -> None:
    """Remove the checkpoints under `directory` older than its newest `keep` complete ones
    (`_problem`), damaged ones among them too: `keep` complete ones stay whatever was damaged
    from outside. Each is renamed hidden before it is removed, so a
    crash leaves it whole or hidden, never half deleted (torchtitan's keep_latest_k)."""
    complete = [p for p in _step_dirs(directory) if _problem(p) is None][:keep]
    if len(complete) < keep:
        return
    oldest = _step_of(complete[-1])
    for path in [p for p in _step_dirs(directory) if _step_of(p) < oldest]:
        hidden = path.with_name(f".{path.name}.old")
        if hidden.exists():
            shutil.rmtree(hidden)
        os.replace(path, hidden)
        shutil.rmtree(hidden)


def check_dir(directory: str) -> None:
    """SpindleError unless `save` can write under `directory`: it is a directory, or it is
    missing and `save` can make it (with its missing parents), so nothing on its path is a
    file and a file can be created in the nearest existing directory (`check_can_create`;
    os.access says yes to root where the file system refuses, and the run would fail at its
    first save, after training). Leaves nothing behind."""
    existing = Path(directory).absolute()
    # lexists: a dangling symlink exists for mkdir, which then fails
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        problem = ("is not a directory" if existing == Path(directory).absolute()
                   else f"{existing} is not a directory")
        raise SpindleError(f"--checkpoint-dir {directory}: {problem}",
                           hint="give a directory, or a path where one can be made")
    check_can_create(f"--checkpoint-dir {directory}", existing)


def _step_dirs(directory: str) -> list[Path]:
    """The `step-N` directories under `directory`, most steps first (N compared as a number:
    step-1000000 is after step-999999; ASCII digits only, as `save` names them)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.name[5:].isascii() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: (_step_of(p), p.name), reverse=True)


def _step_of(path: Path) -> int:
    """The completed steps a `step-N` directory (`_step_dirs`) names."""
    return int(path.name[5:])


def _whole(path: Path) -> bool:
    """Whether `path` is a whole file of `torch.save`: a zip archive holding a pickle. Its
    directory comes last, so a file cut short (a full disk, a copy stopped midway) has none.
    Reads that directory, not the tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("/data.pkl") for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _rank_files_problem(path: Path, world_size: int) -> str | None:
    """What is wrong with the rank files of the checkpoint at `path`: some missing, or not
    whole (`_whole`); None when every rank's file is there and whole."""
    names = [rank_file(r) for r in range(world_size)]
    missing = [name for name in names if not (path / name).is_file()]
    if missing:
        return f"checkpoint lacks {_listed(missing)}"
    damaged = [name for name in names if not _whole(path / name)]
    if damaged:
        return (f"checkpoint has damaged {_listed(damaged)} (cut short, or not written by "
                "torch.save)")
    return None


def _listed(names: list[str]) -> str:
    """The first three of `names`, and how many more."""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{', '.join(names[:3])}{more}"


def _problem(path: Path) -> str | None:
    """What makes the checkpoint at `path` unusable: no readable manifest, or a rank file
    missing or damaged (`_rank_files_problem`); None when it is complete."""
    try:
        world_size = int(json.loads((path / MANIFEST).read_text())["world_size"])
    except (OSError, ValueError, TypeError, KeyError):
        return f"no readable {MANIFEST}"
    return _rank_files_problem(path, world_size)


def latest(directory: str) -> Path | None:
    """The complete checkpoint of the most steps under `directory` (`_problem`), or None. A
    damaged one (a rank file lost or cut short) is passed over for the one before it
    (`passed_over` says which and why)."""
    return _newest_complete(directory)[0]


def newest(directory: str) -> Path | None:
    """The checkpoint of the most steps under `directory`, complete or not, or None."""
    found = _step_dirs(directory)
    return found[0] if found else None


def passed_over(directory: str) -> list[tuple[Path, str]]:
    """The damaged checkpoints `latest` passes over under `directory`, newest first, each with
    what is wrong with it."""
    return _newest_complete(directory)[1]


def _newest_complete(directory: str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """`latest` and `passed_over`: one look at the checkpoints, newest first."""
    damaged: list[tuple[Path, str]] = []
    for path in _step_dirs(directory):
        problem = _problem(path)
        if problem is None:
            return path, damaged
        damaged.append((path, problem))
    return None, damaged


_OTHER_RUN_HINT = ("resume with the plan and options it was taken with, or give this run "
                   "another --checkpoint-dir")


def read_manifest(path: Path, *, world_size: int, meta: dict[str, Any]) -> int:
    """The completed steps of the checkpoint at `path`; SpindleError when it was taken by a
    different run configuration, or a rank's file is missing or damaged (`_whole`). Reads no
    tensors."""
    manifest_path = path / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        step, saved_ranks = int(manifest["step"]), int(manifest["world_size"])
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise SpindleError(f"{manifest_path}: not a spindle checkpoint manifest ({e})") from None
    if saved_ranks != world_size:
        raise SpindleError(f"{path}: checkpoint of {saved_ranks} ranks, this run has "
                           f"{world_size}", hint=_OTHER_RUN_HINT)
    for key, value in meta.items():
        if manifest.get(key) != value:
            # --dtype's default became auto (the plan's dtype): a checkpoint of a bf16 plan
            # taken before then is fp32
            hint = (f"resume with --dtype {manifest[key]}, or give this run another "
                    "--checkpoint-dir" if key == "dtype" and manifest.get(key) else
                    _OTHER_RUN_HINT)
            raise SpindleError(f"{path}: checkpoint was taken with {key}={manifest.get(key)!r}, "
                               f"this run has {value!r}", hint=hint)
    problem = _rank_files_problem(path, world_size)
    if problem is not None:
        raise SpindleError(f"{path}: {problem}")
    return step


def resume_point(directory: str, *, world_size: int,
                 meta: dict[str, Any]) -> tuple[Path, int] | None:
    """(newest complete checkpoint, its completed steps) under `directory`, checked against
    this run (`read_manifest`); None when there is none yet. Newer damaged ones are passed
    over (`passed_over`). SpindleError, naming what is wrong with the newest, when there are
    checkpoints but none is complete: starting over would replace them."""
    found = latest(directory) or newest(directory)
    if found is None:
        return None
    return found, read_manifest(found, world_size=world_size, meta=meta)


def load(path: Path, *, rank: int, world_size: int, meta: dict[str, Any],
         device: torch.device | str = "cpu") -> tuple[int, dict[str, Any]]:
    """(completed steps, this rank's state, its tensors on `device`) of a checkpoint;
    SpindleError when it was taken by a different run configuration, or this rank's file is
    damaged inside (`_damage`). The tensors go to the rank's device, not the one they were
    saved from: a resumed run may lay its ranks out on other nodes (rank 5 saved on cuda:5 may
    resume where nodes have 4 GPUs)."""
    step = read_manifest(path, world_size=world_size, meta=meta)
    file = path / rank_file(rank)
    problem = _damage(file)
    if problem is None:
        try:
            state: dict[str, Any] = torch.load(file, map_location=device, weights_only=True)
        except pickle.UnpicklingError:
            # torch's message advises weights_only=False, which is no cure for damage
            problem = "its state does not unpickle (damaged?)"
        except (RuntimeError, OSError) as e:
            # the archive is whole (its CRC-32s match): out of memory on the device, a read
            # error of the file system; nothing to remove
            raise SpindleError(f"{file}: cannot load the checkpoint: "
                               f"{(str(e).splitlines() or [type(e).__name__])[0]}",
                               hint="its archive is whole (its CRC-32s match): --resume again "
                                    "once the cause is gone") from None
        else:
            # a file copied or renamed from another rank, or from another step, loads and
            # trains on silently where the shapes agree (ZeRO shards of one size)
            problem = _misplaced(state.pop(WRITTEN_BY, None) or {"step": state.get("step")},
                                 rank=rank, step=step)
            if problem is None:
                return step, state
    raise SpindleError(f"{file}: cannot load the checkpoint: {problem}",
                       hint=_damaged_hint(path))


def _misplaced(written: dict[str, Any], *, rank: int, step: int) -> str | None:
    """What makes a rank file another rank's or another step's than the manifest says, by
    the rank and step `save` wrote into it (`WRITTEN_BY`; a checkpoint saved before it did
    has only the executor's step, and nothing says whose the file is), or None."""
    if written.get("rank", rank) != rank:
        return f"it holds rank {written['rank']}'s state (copied or renamed?)"
    if written.get("step", step) not in (step, None):
        return f"it holds the state after step {written['step']}, its {MANIFEST} says {step}"
    return None


def _damage(file: Path) -> str | None:
    """What damage inside the whole archive `file` (`_whole`) its CRC-32s show, or None. The
    check before launch reads only the archive's directory, and torch reads the tensors'
    bytes without checking them: bytes changed inside a tensor resumed silently and trained
    on NaN."""
    try:
        with zipfile.ZipFile(file) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile) as e:
        return f"its archive does not read ({e})"
    return None if bad is None else f"{bad} inside it is damaged (its CRC-32 does not match)"


def _damaged_hint(path: Path) -> str:
    """What to do about the checkpoint at `path`, which does not load: what `--resume` does
    once it is removed (`resume_point`: the complete checkpoint before it, or from step 0
    when there is none at all; a directory left with only damaged ones is refused)."""
    older = [p for p in _step_dirs(str(path.parent)) if _step_of(p) < _step_of(path)]
    if any(_problem(p) is None for p in older):
        return f"remove {path} to resume from the checkpoint before it"
    if not older:
        return f"there is no checkpoint before it: remove {path} and --resume trains from step 0"
    return ("the checkpoints before it are damaged too: train from step 0 with another "
            "--checkpoint-dir")
