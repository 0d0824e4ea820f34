"""Process-group lifecycle: backend choice, init with a timeout, teardown.

gloo on CPU (activations stay on the CPU), nccl when CUDA is present (one GPU per rank,
eager communicator init so batched P2P reuses it). Rendezvous comes from the environment that
torchrun sets (`env://`) or from an explicit store (the test harness's file store).
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from spindle_cli.errors import RuntimeFailure, SpindleError
from spindle_cli.runtime.timeouts import DEFAULT_TIMEOUT_S


class PeerLost(RuntimeFailure):
    """A message or collective with other ranks failed: they crashed, hung or disagreed. The
    root cause is usually on one of `peers`."""

    def __init__(self, where: str, peers: list[int], cause: BaseException) -> None:
        text = str(cause).strip()
        # gloo prefixes a source location and appends advice; keep the first sentence
        first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0] if text else "")
        first = first.split(". ")[0] or type(cause).__name__
        super().__init__(f"lost contact with rank(s) {', '.join(map(str, peers))} in {where} "
                         f"({first})")
        self.peers = peers


@contextmanager
def with_peers(where: str, peers: list[int]) -> Iterator[None]:
    """Turn a failed communication into PeerLost naming where it happened and with whom. Out
    of memory is this rank's own failure, not a lost peer: torch raises it as a RuntimeError
    (torch.OutOfMemoryError) from the buffers a collective allocates (NCCL's, lazily), and
    as PeerLost it was a secondary line the launcher put behind its peers' lines."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, RuntimeFailure | torch.OutOfMemoryError):
            raise
        raise PeerLost(where, sorted(set(peers)), e) from e


@dataclass(frozen=True, slots=True, kw_only=True)
class World:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def resolve_backend(backend: str) -> str:
    """'auto' -> nccl when CUDA is available, else gloo; refuse nccl without CUDA."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise SpindleError("--backend nccl needs CUDA, and no GPU is visible")
    if backend not in ("gloo", "nccl"):
        raise SpindleError(f"unknown backend {backend!r} (expected auto, gloo or nccl)")
    return backend


def check_gpus(ranks_per_node: int) -> None:
    """Refuse more nccl ranks on a node than it has visible GPUs: nccl runs one rank per GPU
    (torch fails on a device index out of range, NCCL on two ranks of one GPU, 'Duplicate GPU
    detected'), by each rank's LOCAL_RANK."""
    visible = torch.cuda.device_count()
    if ranks_per_node > visible:
        raise SpindleError(
            f"{ranks_per_node} nccl ranks per node need as many GPUs, and this node has "
            f"{visible} visible",
            hint="use --nproc-per-node <= the GPUs per node (and --nnodes for the rest), or "
                 "make them visible (CUDA_VISIBLE_DEVICES)")


def init(backend: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
         store: dist.Store | None = None, rank: int | None = None,
         world_size: int | None = None) -> World:
    """Initialize the default process group. Without `store`, rank and size come from torchrun's
    environment variables."""
    backend = resolve_backend(backend)
    if rank is None:
        rank = int(os.environ["RANK"])
        world_size = int(os.environ["WORLD_SIZE"])
    assert world_size is not None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        check_gpus(local_world)
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device, store=store,
                                rank=rank, world_size=world_size)
    else:
        device = torch.device("cpu")
        # one intra-op thread per rank: ranks share the host's cores (28x faster at 8 ranks on
        # 2 cores, runtime-design.md §5); torchrun already sets OMP_NUM_THREADS=1.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo", timeout=timeout, store=store, rank=rank,
                                world_size=world_size)
    return World(rank=rank, world_size=world_size, local_rank=local_rank,
                 local_world_size=local_world, backend=backend, device=device)


def teardown(*, synchronize: bool = False) -> None:
    """Destroy the default group (and every subgroup) if one exists. With `synchronize` (a run
    that succeeded on every rank) the ranks first meet in a barrier, so that none closes its
    connections while another still writes its results (rank 0 writes the trace after the
    last collective)."""
    if dist.is_initialized():
        if synchronize:
            rank = dist.get_rank()
            with with_peers("the barrier that ends the run",
                            [r for r in range(dist.get_world_size()) if r != rank]):
                dist.barrier()
        dist.destroy_process_group()
