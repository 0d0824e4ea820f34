"""Gradient buckets and parameter sync on this rank: what the executor calls at the points of
its step where buckets become due, and around the optimizer step.

Gradients live in flat buckets (every layer parameter and its gradient are views of one), laid
out by `planner.buckets.sync_buckets`, the layout the simulator times. With `overlap_sync` (the
default on NCCL) a set of holder ranks' layers are split by the backward wave that completes
them (the lowest wave of a slice running the layer) and then into chunks of whole layers (at
least 25 MiB, at most the plan's `sync_chunks` (4 by default) per set and wave, as DDP's
buckets): a slice's forward is cut below each chunk's lowest layer, so its backward runs
segment by segment and a chunk is all-reduced as soon as the segments above have run,
overlapping the rest of the backward. Without it (the
default on gloo, where the collective's threads take their CPU time from the rank's compute: 44
vs 52 ms per step for tiny-clip on 2 CPU ranks here) a set has one bucket, due at the lowest
wave of any of its layers. A rank issues its buckets (SUM, asynchronously) in the layout's one
global order, each once it is complete on the rank and the ones before it are issued, so any
two ranks issue the collectives they share alike, whatever process groups they belong to (as
NCCL needs); after the last backward wave the all-reduces are awaited, and AdamW
steps the buckets' flat parameters. Under ZeRO-1 and -2 (Plan.options `zero` 1, 2) a bucket of
several ranks is padded to equal shards: it is reduce-scattered instead (under ZeRO-1 in place,
into the rank's own range of the full gradient), each rank's AdamW steps (and keeps state for)
its own shard, a view of the flat parameter, and after the step the
buckets' all-gathers start, in bucket order; they overlap the next step's forward, which waits
for a bucket's only before the first operator of its layers, inside the slice (Megatron's
overlapped parameter gather; checkpoints and parameter reads wait for all). Under ZeRO-2 a
sharded bucket's full gradient also has storage only from the backward wave that first adds to
it until its reduce-scatter has completed (found done at the next chance to issue buckets on
NCCL; gloo's works do not report completion, so there at the end of the backward); between
steps a rank keeps only the reduce-scattered shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spindle_cli.artifacts.plan import Plan
from spindle_cli.planner.buckets import backend_sync, sync_buckets
from spindle_cli.runtime.dist import World, with_peers
from spindle_cli.runtime.groups import Groups
from spindle_cli.runtime.model import LayerKey
from spindle_cli.runtime.program import Program
from spindle_cli.runtime.trace import Tracer


@dataclass(slots=True)
class Bucket:
    """The parameters held by exactly `ranks` and their gradients, each as views of one flat
    tensor."""

    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    flat: torch.Tensor
    """The gradients."""
    param: nn.Parameter
    """The parameters; its .grad is `flat`."""
    ready_wave: int
    """The backward wave in which every gradient of the bucket becomes complete (-1 for a
    single rank's bucket, which is not reduced)."""
    layers: tuple[LayerKey, ...] = ()
    """The layers whose parameters it holds."""
    after: tuple[str, int] | None = None
    """(slice id, k): on this rank the bucket is complete once the backward of that slice of
    `ready_wave` has run k operators; None: at the start of that wave's backward."""
    shard: tuple[int, int] | None = None
    """ZeRO-1/2: this rank's range [lo, hi) of the flat tensors (the bucket is padded to a
    multiple of its ranks); None when the optimizer steps the whole bucket."""
    shard_grad: torch.Tensor | None = None
    """ZeRO-1/2: the reduce-scattered gradient of `shard` (ZeRO-1: a view of `flat`)."""
    grads_from: int = -1
    """ZeRO-2: the backward wave that first adds to its gradients on this rank; `flat` has
    storage from then until its reduce-scatter has completed (-1: always)."""

    def zero_grads(self) -> None:
        """Zero the gradients, giving `flat` its storage back when it was freed."""
        storage = self.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.flat.numel() * self.flat.element_size())
        self.flat.zero_()

    def free_grads(self) -> None:
        """ZeRO-2: drop the full gradients' storage (`flat` and the parameters' .grad views
        keep their shapes; `zero_grads` brings it back)."""
        self.flat.untyped_storage().resize_(0)

    def shard_param(self) -> nn.Parameter:
        """This rank's ZeRO-1/2 shard of the flat parameter (a view of it), with the
        reduce-scattered gradient."""
        assert self.shard is not None
        lo, hi = self.shard
        shard = nn.Parameter(self.param.data[lo:hi])
        shard.grad = self.shard_grad
        return shard


def overlaps_sync(backend: str) -> bool:
    """Whether the executor buckets shared layers in chunks by completing wave by default on
    `backend` (`overlap_sync`; `buckets.backend_sync`: on NCCL, not on gloo, whose collective
    threads take the rank's CPU)."""
    return backend_sync(backend) == "chunked"


def overlap_for(sync: str, backend: str) -> bool:
    """`overlap_sync` under `spindle run --sync` SYNC ('auto': the backend's default,
    'chunked' or 'per-set') on `backend`."""
    return overlaps_sync(backend) if sync == "auto" else sync == "chunked"


class GradSync:
    """The rank's buckets over its layers' parameters, their collectives in flight, and where
    in a step's backward each becomes due."""

    def __init__(self, plan: Plan, program: Program, layers: dict[LayerKey, nn.Module],
                 world: World, groups: Groups, *, dtype: torch.dtype, tracer: Tracer,
                 overlap_sync: bool | None, chunk_bytes: int) -> None:
        self.world = world
        self.rank = world.rank
        self.dtype = dtype
        self.tracer = tracer
        self.overlap_sync = (overlaps_sync(world.backend) if overlap_sync is None
                             else overlap_sync)
        self.zero = int(plan.options.get("zero", "0"))
        self.buckets = self._make_buckets(plan, program, layers, groups, chunk_bytes)
        # the buckets of several ranks in the layout's one global order (`sync_buckets`): a
        # rank issues its own in that order, so any two ranks issue the collectives they share
        # in the same order, which NCCL needs across process groups (runtime-design.md 2.1)
        self.queue = [b for b in self.buckets if len(b.ranks) > 1]
        self.issued = 0
        """How many buckets of `queue` are issued in this step."""
        self.pending: list[Any] = []
        """The works of the buckets issued in this step, in issue order."""
        # ZeRO-1/2: the all-gathers in flight (`start_gathers`), and the sharded bucket of
        # each layer, whose all-gather the forward waits for before the layer's first operator
        self.gathering: dict[int, Any] = {}
        self.gathered_in = {key: i for i, b in enumerate(self.buckets) if b.shard is not None
                            for key in b.layers}
        # ZeRO-2: a sharded bucket's gradient storage comes with the highest wave using its
        # layers (the first backward adding to them) and goes once it is reduce-scattered
        self.releasing: list[tuple[Any, Bucket]] = []
        if self.zero >= 2:
            used = [{(sp.metaop.module, i) for sp in program.slices
                     if sp.wave == w and self.rank in sp.slice.ranks for i in sp.layers}
                    for w in range(program.num_waves)]
            for b in self.buckets:
                if b.shard is not None:
                    b.grads_from = max(w for w in range(program.num_waves)
                                       if used[w] & set(b.layers))
                    b.free_grads()

    def _make_buckets(self, plan: Plan, program: Program, layers: dict[LayerKey, nn.Module],
                      groups: Groups, chunk_bytes: int) -> list[Bucket]:
        """This rank's buckets, as `buckets.sync_buckets` lays them out: with `overlap_sync`
        'chunked' (every set's layers split by the backward wave that completes them, then in
        chunks, each all-reduced once the rank's slice has passed it), else 'per-set' (one per
        set of holder ranks, due at the lowest wave of any of its layers). The layers this rank
        holds alone form one bucket, never reduced."""
        mode = "chunked" if self.overlap_sync else "per-set"
        metaops = {sp.metaop.id: sp.metaop for sp in program.slices}
        mine = {sp.slice.id for sp in program.slices if self.rank in sp.slice.ranks}
        layout: list[tuple[tuple[int, ...], int, tuple[LayerKey, ...],
                           tuple[str, int] | None]] = []
        alone: list[LayerKey] = []
        for sb in sync_buckets(plan, metaops, mode, chunk_bytes):
            if self.rank not in sb.ranks:
                continue
            if len(sb.ranks) == 1:
                alone += sb.layers
                continue
            after = next(((sid, k) for sid, k in sb.passes if sid in mine), None)
            layout.append((sb.ranks, sb.wave, sb.layers, after))
        if alone:
            layout.append(((self.rank,), -1, tuple(alone), None))
        return [self._bucket(layers, groups, ranks, due, keys, after)
                for ranks, due, keys, after in layout]

    def _bucket(self, layers: dict[LayerKey, nn.Module], groups: Groups, ranks: tuple[int, ...],
                due: int, keys: tuple[LayerKey, ...], after: tuple[str, int] | None) -> Bucket:
        """A bucket whose parameters and gradients become views of one flat tensor each."""
        params = [p for key in keys for p in layers[key].parameters()]
        size = sum(p.numel() for p in params)
        shard = None
        if self.zero and len(ranks) > 1:
            # padded to equal shards; holder sets are sorted, as group ranks are
            width = -(-size // len(ranks))
            lo = ranks.index(self.rank) * width
            shard = (lo, lo + width)
            size = width * len(ranks)
        flat = torch.zeros(size, dtype=self.dtype, device=self.world.device)
        param = nn.Parameter(torch.zeros(size, dtype=self.dtype, device=self.world.device))
        offset = 0
        with torch.no_grad():
            for p in params:
                view = slice(offset, offset + p.numel())
                param[view].copy_(p.reshape(-1))
                p.data = param.data[view].view_as(p)
                # autograd accumulates in place into an existing .grad, so backward fills
                # the bucket directly (the DDP gradient_as_bucket_view idea)
                p.grad = flat[view].view_as(p)
                offset += p.numel()
        param.grad = flat
        shard_grad = None
        if shard is not None:
            # ZeRO-1 reduce-scatters in place, into the rank's own range of the full gradient
            # (NCCL's in-place form, as Megatron's distributed optimizer does), which the
            # planner counts once; ZeRO-2 frees the full gradient, so its shard has its own
            shard_grad = (flat[shard[0]:shard[1]] if self.zero == 1 else
                          torch.zeros(shard[1] - shard[0], dtype=self.dtype,
                                      device=self.world.device))
        return Bucket(ranks=ranks, group=groups.get(ranks), flat=flat, param=param,
                      ready_wave=due, layers=keys, after=after, shard=shard,
                      shard_grad=shard_grad)

    # ---- a step's backward ----------------------------------------------------------------

    def start_step(self) -> None:
        """Zero the gradients that have storage between steps; no bucket is issued yet."""
        for b in self.buckets:
            if b.grads_from < 0:
                b.zero_grads()
        self.issued = 0

    def start_wave(self, wave: int) -> None:
        """ZeRO-2: give the gradients that the backward of `wave` first adds to their storage
        back, zeroed."""
        for b in self.buckets:
            if b.grads_from == wave:
                b.zero_grads()

    def issue_ready(self, wave: int, passed: dict[str, int]) -> None:
        """Start the all-reduce (reduce-scatter under ZeRO-1/2) of every bucket that is
        complete on this rank now, in the backward of `wave` once each slice has run `passed`
        operators (by slice id), in queue order, so a bucket waits for the ones before it
        and any two ranks issue the ones they share alike. Each group has its own
        connections, so the transfers overlap the rest of the backward pass. First, under
        ZeRO-2, the gradient storage of the buckets whose reduce-scatter is done goes."""
        self._release_reduced(everything=False)
        while (self.issued < len(self.queue)
               and self._complete(self.queue[self.issued], wave, passed)):
            b = self.queue[self.issued]
            with with_peers("the gradient sync", [r for r in b.ranks if r != self.rank]):
                if b.shard is None:
                    self.pending.append(dist.all_reduce(b.flat, op=dist.ReduceOp.SUM,
                                                        group=b.group, async_op=True))
                else:
                    self.pending.append(dist.reduce_scatter_single(
                        b.shard_grad, b.flat, op=dist.ReduceOp.SUM, group=b.group,
                        async_op=True))
                    if b.grads_from >= 0:
                        self.releasing.append((self.pending[-1], b))
            self.issued += 1

    def _release_reduced(self, *, everything: bool) -> None:
        """ZeRO-2: free the full gradient of every bucket whose reduce-scatter has completed
        (all of them with `everything`, once the caller has waited for their works)."""
        waiting = []
        for work, b in self.releasing:
            if everything or work.is_completed():
                work.wait()
                b.free_grads()
            else:
                waiting.append((work, b))
        self.releasing = waiting

    @staticmethod
    def _complete(b: Bucket, wave: int, passed: dict[str, int]) -> bool:
        """Whether every gradient of `b` is complete on this rank (`Bucket.after`)."""
        if wave > b.ready_wave:
            return False
        return (b.after is None or wave < b.ready_wave
                or passed.get(b.after[0], 0) >= b.after[1])

    def wait_reduced(self) -> None:
        """Await the buckets' all-reduces (reduce-scatters) issued in this step."""
        with with_peers("the gradient sync", [r for b in self.buckets for r in b.ranks
                                               if b.group is not None and r != self.rank]):
            for work in self.pending:
                work.wait()
        self.pending = []
        self._release_reduced(everything=True)

    # ---- ZeRO-1/2 parameter all-gathers ---------------------------------------------------

    def start_gathers(self) -> None:
        """ZeRO-1/2: start the all-gather of every sharded bucket's stepped shards, in reverse
        bucket order (the same on every rank). Buckets are listed by due wave downwards, and
        a bucket is due in the lowest wave running its layers, where the forward first uses
        them: reversed, that is the order the next step's forward needs them in, and a group
        runs its collectives one after another (NCCL). They overlap that forward, which waits
        for a bucket's before the first operator of its layers (`await_layer`); whatever
        reads the parameters waits for all of them (`await_all`)."""
        peers = [r for b in self.buckets if b.shard is not None for r in b.ranks
                 if r != self.rank]
        with with_peers("the parameter all-gather", peers):
            for i, b in reversed(list(enumerate(self.buckets))):
                if b.shard is not None:
                    lo, hi = b.shard
                    self.gathering[i] = dist.all_gather_single(
                        b.param.data, b.param.data[lo:hi].clone(), group=b.group, async_op=True)

    def await_layer(self, key: LayerKey, step: int, wave: int) -> None:
        """ZeRO-1/2: wait for the all-gather of the bucket holding layer `key`, if still in
        flight, before the layer's operator runs (taken out of the forward's compute span)."""
        i = self.gathered_in.get(key)
        if i is not None and i in self.gathering:
            with self.tracer.gap("all-gather", "sync", step=step + 1, wave=wave):
                self.await_gathers([i])

    def await_all(self) -> None:
        """Wait for every all-gather still in flight."""
        self.await_gathers(list(self.gathering))

    def await_gathers(self, indices: list[int]) -> None:
        """Wait for the all-gathers of those buckets still in flight."""
        waiting = [i for i in indices if i in self.gathering]
        if not waiting:
            return
        with with_peers("the parameter all-gather",
                         [r for i in waiting for r in self.buckets[i].ranks if r != self.rank]):
            for i in waiting:
                self.gathering.pop(i).wait()
