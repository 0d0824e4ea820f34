"""A fail-fast multi-process gloo harness (runtime-design.md §3.2).

`run_distributed(fn, world, *args)` runs `fn(rank, world, *args)` in `world` forkserver
processes (torch preloaded by conftest.py) that share a fresh file store, with a short
process-group timeout, and returns every rank's result. A rank that raises, dies or hangs past
the deadline makes it raise `RanksFailed` listing each rank's error, so a broken schedule fails
the test instead of blocking CI.
"""

from __future__ import annotations

import datetime
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """Some ranks raised, died or hung; `errors` maps rank -> message."""

    def __init__(self, errors: dict[int, str]) -> None:
        super().__init__("\n".join(f"rank {r}: {m}" for r, m in sorted(errors.items())))
        self.errors = errors


def _entry(fn: Callable[..., Any], rank: int, world: int, store_path: str, q: Any,
           args: tuple[Any, ...], pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        # plain pickle bytes: torch's queue pickler would pass tensors as shared-memory handles
        # that die with the process
        q.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60,
                    pg_timeout_s: float = 15) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; results in rank order."""
    ctx = mp.get_context("forkserver")
    store_dir = tempfile.mkdtemp(prefix="spindle-store-")
    store_path = str(Path(store_dir) / "store")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, store_path, q, args, pg_timeout_s),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            if time.monotonic() > deadline:
                for r in range(world):
                    if r not in results and r not in errors:
                        errors[r] = "hung (no result before the harness deadline)"
                break
            try:
                rank, status, value = q.get(timeout=0.2)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in results and r not in errors:
                        # give a dying rank's queued message a moment to arrive
                        time.sleep(0.2)
                        if q.empty():
                            errors[r] = f"died with exit code {p.exitcode}"
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
                deadline = min(deadline, time.monotonic() + pg_timeout_s + 5)
    finally:
        for p in procs:
            p.join(timeout=2)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store_dir, ignore_errors=True)
    if errors:
        raise RanksFailed(errors)
    return [results[r] for r in range(world)]
