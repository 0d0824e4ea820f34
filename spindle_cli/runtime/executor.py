"""The wave executor: one training step of a plan on this rank.

Forward, wave by wave: first the boundary (every transfer into the wave, `boundaries`: one
`batch_isend_irecv` per rank; a received activation becomes a leaf, so autograd stops at slice
boundaries), then the rank's slice of the wave. Backward, waves in reverse: the slice's backward
from its loss or from the gradients its consumers sent, then the boundary backward (the same
messages with roles swapped).

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
steps a rank keeps only the reduce-scattered shards. The task
losses are all-reduced over the world (for the log) asynchronously from the end of the forward
pass.

In bf16 (mixed precision, the planner's memory model of a bf16 graph: 2 bytes of weights, 2 of
gradients and 12 of optimizer state per parameter) the layers, activations, gradients and every
message are bf16, and AdamW steps an fp32 master copy of what the rank steps (a bucket, or its
ZeRO shard), one bucket at a time: the bucket's gradient is upcast, stepped into the master and
its moments, and the master rounded back into the bf16 weights that the all-gather sends. The
losses are computed in fp32 from bf16 logits (`layers`). No loss scaling: bf16 has fp32's range.

Under activation recomputation (Plan.options `recompute`) every operator of a slice runs
inside a non-reentrant `torch.utils.checkpoint`: only its input is kept for backward, and its
forward runs again when its backward needs the rest (planner/memory.py counts one operator's
full stash alive at a time; the planner charges a third more compute).

Every rank walks the same global sequence of boundaries and collectives, and each one involves
only ranks that all reach it, so the schedule cannot deadlock (runtime-design.md §2.2).

Loss normalization: a task's loss on a rank is its share of the task's mean loss (local rows /
global batch for per-sample losses), so the summed gradients equal the single-process gradient
of the sum over tasks of each task's mean loss. The contrastive loss couples all samples: every
rank of its slice gathers the whole batch of both embeddings, computes the full loss, keeps the
gradient of its own rows, and adds 1/n of the temperature's gradient (the all-reduce sums n).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.plan import MEMORY_CATEGORIES, Plan
from spindle_cli.errors import RuntimeFailure, SpindleError
from spindle_cli.planner.buckets import SYNC_CHUNK_BYTES, backend_sync, sync_buckets
from spindle_cli.runtime.boundaries import Boundaries
from spindle_cli.runtime.data import DataSource, rows_problem, targets_name
from spindle_cli.runtime.dist import World, with_peers
from spindle_cli.runtime.groups import Groups
from spindle_cli.runtime.held import SavedTensors, storages
from spindle_cli.runtime.model import (
    LayerKey,
    build_layers,
    make_optimizer,
    named_parameters,
    step_mixed,
)
from spindle_cli.runtime.program import Program, SliceProgram, rows_of
from spindle_cli.runtime.trace import Tracer


class ShapeMismatch(RuntimeFailure):
    """A tensor did not have the shape the plan and model imply."""


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


@dataclass(slots=True)
class StepState:
    """Tensors alive during one step."""

    recv: dict[int, torch.Tensor] = field(default_factory=dict)
    """Transfer index -> received activation (a leaf) on a consumer rank."""
    out: dict[str, torch.Tensor] = field(default_factory=dict)
    """Slice id -> its output (with graph) on a producer rank."""
    grad_out: dict[str, torch.Tensor] = field(default_factory=dict)
    """Slice id -> gradient of its output, summed over its consumers."""
    loss: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    """Loss slice id -> (scaled loss, gathered leaves for a contrastive loss)."""
    task_loss: dict[str, torch.Tensor] = field(default_factory=dict)
    """This rank's share of each task's loss, in fp64 on the rank's device: read on the host
    once per step (`_sync`), not per loss slice, which would wait for the device mid-forward
    (CUDA)."""
    segments: dict[str, list[tuple[torch.Tensor | None, torch.Tensor, int]]] = field(
        default_factory=dict)
    """Slice id -> its forward cut where buckets become complete, bottom first: (input leaf,
    None for the first; output; operators)."""
    wave: int = -1
    """The backward wave running now."""
    passed: dict[str, int] = field(default_factory=dict)
    """Slice id -> operators whose backward has run."""
    issued: int = 0
    """How many buckets of `Executor.queue` are issued."""


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def overlaps_sync(backend: str) -> bool:
    """Whether the executor buckets shared layers in chunks by completing wave by default on
    `backend` (`overlap_sync`; `buckets.backend_sync`: on NCCL, not on gloo, whose collective
    threads take the rank's CPU)."""
    return backend_sync(backend) == "chunked"


def overlap_for(sync: str, backend: str) -> bool:
    """`overlap_sync` under `spindle run --sync` SYNC ('auto': the backend's default,
    'chunked' or 'per-set') on `backend`."""
    return overlaps_sync(backend) if sync == "auto" else sync == "chunked"


class Executor:
    """The rank's layers, buckets and optimizer, and the step loop over the plan."""

    def __init__(self, plan: Plan, program: Program, model: ModelSpec, world: World,
                 groups: Groups, data: DataSource, *, seed: int, lr: float,
                 dtype: torch.dtype, tracer: Tracer | None = None,
                 overlap_sync: bool | None = None,
                 sync_chunk_bytes: int = SYNC_CHUNK_BYTES) -> None:
        self.plan = plan
        self.program = program
        self.model = model
        self.world = world
        self.rank = world.rank
        self.groups = groups
        self.data = data
        self.dtype = dtype
        self.lr = lr
        self.tracer = tracer or Tracer(enabled=False, rank=world.rank)
        # a traced run measures what the rank holds in its first step (`held`), whose time
        # the run's and the trace's step times leave out as warm-up: recording what
        # autograd saves costs every operator a Python call (tiny-clip's step on 2 CPU
        # ranks, 19 -> 23 ms)
        self.saved = SavedTensors() if self.tracer.enabled else None
        self.held: dict[str, int] = {}
        """The most the rank held in each category (`plan.MEMORY_CATEGORIES`) in that step: at its
        turn, and its state after its optimizer step."""
        me = self.rank
        self.my_slices = [[sp for sp in program.slices if sp.wave == w and me in sp.slice.ranks]
                          for w in range(program.num_waves)]
        self.boundaries = Boundaries(plan, program, me, dtype=dtype, device=world.device)
        keys = [(m, i) for (m, i), ranks in program.holders.items() if me in ranks]
        self.layers: dict[LayerKey, nn.Module] = build_layers(
            model, keys, seed=seed, dtype=dtype, device=world.device)
        self.overlap_sync = (overlaps_sync(world.backend) if overlap_sync is None
                             else overlap_sync)
        self.zero = int(plan.options.get("zero", "0"))
        self.recompute = plan.options.get("recompute") == "true"
        self.buckets = self._make_buckets(sync_chunk_bytes)
        # the buckets of several ranks in the layout's one global order (`sync_buckets`): a
        # rank issues its own in that order, so any two ranks issue the collectives they share
        # in the same order, which NCCL needs across process groups (runtime-design.md 2.1)
        self.queue = [b for b in self.buckets if len(b.ranks) > 1]
        self.cuts: dict[str, set[int]] = {}
        for b in self.buckets:
            if b.after is not None:
                self.cuts.setdefault(b.after[0], set()).add(b.after[1])
        # ZeRO-1/2: the all-gathers in flight (`_start_gathers`), and the sharded bucket of
        # each layer, whose all-gather the forward waits for before the layer's first operator
        self.gathering: dict[int, Any] = {}
        self.gathered_in = {key: i for i, b in enumerate(self.buckets) if b.shard is not None
                            for key in b.layers}
        used = [{(sp.metaop.module, i) for sp in self.my_slices[w] for i in sp.layers}
                for w in range(program.num_waves)]
        # ZeRO-2: a sharded bucket's gradient storage comes with the highest wave using its
        # layers (the first backward adding to them) and goes once it is reduce-scattered
        self.releasing: list[tuple[Any, Bucket]] = []
        if self.zero >= 2:
            for b in self.buckets:
                if b.shard is not None:
                    b.grads_from = max(w for w in range(program.num_waves)
                                       if used[w] & set(b.layers))
                    b.free_grads()
        self.named = named_parameters(self.layers)
        # AdamW is elementwise, so stepping each bucket's flat parameter updates every layer
        # parameter (a view of it) exactly as stepping them one by one would; one tensor per
        # bucket instead of ~100 small ones cuts the step's per-tensor overhead (3 ms -> a
        # memory-bound fraction of a millisecond for tiny-clip on one CPU thread). A rank
        # the plan leaves idle holds no parameters (AdamW refuses an empty list). Under
        # ZeRO-1/2 the optimizer steps (and keeps state for) this rank's shard of a shared
        # bucket only: a parameter that is a view of the bucket's flat parameter, so the
        # step updates the shard in place; the all-gather after the step fills in the
        # others.
        self.stepped = [b.param if b.shard is None else self._shard_param(b)
                        for b in self.buckets]
        # bf16: AdamW steps an fp32 master of each (`_step`)
        self.masters = ([nn.Parameter(p.detach().float()) for p in self.stepped]
                        if dtype.itemsize < 4 else [])
        stepped = self.masters or self.stepped
        self.optimizer = make_optimizer(stepped, lr) if stepped else None

    def _make_buckets(self, chunk_bytes: int) -> list[Bucket]:
        """This rank's buckets, as `buckets.sync_buckets` lays them out: with `overlap_sync`
        'chunked' (every set's layers split by the backward wave that completes them, then in
        chunks, each all-reduced once the rank's slice has passed it), else 'per-set' (one per
        set of holder ranks, due at the lowest wave of any of its layers). The layers this rank
        holds alone form one bucket, never reduced."""
        mode = "chunked" if self.overlap_sync else "per-set"
        metaops = {sp.metaop.id: sp.metaop for sp in self.program.slices}
        mine = {sp.slice.id for sp in self.program.slices if self.rank in sp.slice.ranks}
        layout: list[tuple[tuple[int, ...], int, tuple[LayerKey, ...],
                           tuple[str, int] | None]] = []
        alone: list[LayerKey] = []
        for sb in sync_buckets(self.plan, metaops, mode, chunk_bytes):
            if self.rank not in sb.ranks:
                continue
            if len(sb.ranks) == 1:
                alone += sb.layers
                continue
            after = next(((sid, k) for sid, k in sb.passes if sid in mine), None)
            layout.append((sb.ranks, sb.wave, sb.layers, after))
        if alone:
            layout.append(((self.rank,), -1, tuple(alone), None))
        return [self._bucket(ranks, due, keys, after) for ranks, due, keys, after in layout]

    def _bucket(self, ranks: tuple[int, ...], due: int, keys: tuple[LayerKey, ...],
                after: tuple[str, int] | None) -> Bucket:
        """A bucket whose parameters and gradients become views of one flat tensor each."""
        params = [p for key in keys for p in self.layers[key].parameters()]
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
        return Bucket(ranks=ranks, group=self.groups.get(ranks), flat=flat, param=param,
                      ready_wave=due, layers=keys, after=after, shard=shard,
                      shard_grad=shard_grad)

    @staticmethod
    def _shard_param(b: Bucket) -> nn.Parameter:
        """This rank's ZeRO-1/2 shard of a bucket's flat parameter (a view of it), with the
        reduce-scattered gradient."""
        assert b.shard is not None
        lo, hi = b.shard
        shard = nn.Parameter(b.param.data[lo:hi])
        shard.grad = b.shard_grad
        return shard

    # ---- one step -------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync and AdamW for training step `step`; returns the
        loss of every task (the same on every rank)."""
        shown = step + 1  # the trace numbers steps as the loss lines and --metrics do
        for b in self.buckets:
            if b.grads_from < 0:
                b.zero_grads()
        st = StepState()
        pending: list[Any] = []
        saved = self.saved if not self.held else None
        with saved.recording() if saved is not None else nullcontext():
            for w in range(self.program.num_waves):
                with self.tracer.span("send/recv", "comm", step=shown, wave=w,
                                      phase="forward"):
                    self.boundaries.forward(w, st.recv, st.out)
                with self.tracer.span("compute", "compute", step=shown, wave=w,
                                      phase="forward"):
                    for sp in self.my_slices[w]:
                        self._forward_slice(sp, st, step)
        if saved is not None:
            self._note_held(saved)
        loss_reduction = self._reduce_losses(st)
        for w in reversed(range(self.program.num_waves)):
            st.wave = w
            for b in self.buckets:
                if b.grads_from == w:
                    b.zero_grads()
            pending += self._issue_ready(st)
            with self.tracer.span("compute", "compute", step=shown, wave=w, phase="backward"):
                for sp in self.my_slices[w]:
                    self._backward_slice(sp, st, pending)
            pending += self._issue_ready(st)
            with self.tracer.span("send/recv", "comm", step=shown, wave=w, phase="backward"):
                self.boundaries.backward(w, st.recv, st.grad_out)
        with self.tracer.span("sync", "sync", step=shown):
            losses = self._sync(pending, loss_reduction)
        self._await_gathers(list(self.gathering))
        if self.optimizer is not None:
            with self.tracer.span("optimizer", "compute", step=shown):
                self._step()
        if saved is not None:
            self._note_held(None)
        self._start_gathers()
        return losses

    def _note_held(self, saved: SavedTensors | None) -> None:
        """Add the storages the rank holds now to `held` (each category's most): at the turn,
        with the activations `saved`, and after the optimizer step without (AdamW makes its
        state in the first step, after the first turn)."""
        weights = storages(p for _, p in self.named)
        grads = storages([*(b.flat for b in self.buckets),
                          *(b.shard_grad for b in self.buckets if b.shard_grad is not None)])
        state = [v for st in (self.optimizer.state.values() if self.optimizer else ())
                 for v in st.values() if torch.is_tensor(v)]
        optimizer = storages([*state, *self.masters])
        now = dict(zip(MEMORY_CATEGORIES, (sum(weights.values()), sum(grads.values()),
                                    sum(optimizer.values()),
                                    0 if saved is None else
                                    saved.held_bytes({**weights, **grads, **optimizer})),
                       strict=True))
        for k, v in now.items():
            self.held[k] = max(self.held.get(k, 0), v)

    def _step(self) -> None:
        """AdamW on what this rank steps; in bf16 on the fp32 masters, one bucket at a time
        (`step_mixed`)."""
        assert self.optimizer is not None
        if self.masters:
            step_mixed(self.optimizer, zip(self.stepped, self.masters, strict=True))
        else:
            self.optimizer.step()

    def _start_gathers(self) -> None:
        """ZeRO-1/2: start the all-gather of every sharded bucket's stepped shards, in reverse
        bucket order (the same on every rank). Buckets are listed by due wave downwards, and
        a bucket is due in the lowest wave running its layers, where the forward first uses
        them: reversed, that is the order the next step's forward needs them in, and a group
        runs its collectives one after another (NCCL). They overlap that forward, which waits
        for a bucket's before the first operator of its layers (`_await_layer`); whatever
        reads the parameters waits for all of them (`_await_gathers`)."""
        peers = [r for b in self.buckets if b.shard is not None for r in b.ranks
                 if r != self.rank]
        with with_peers("the parameter all-gather", peers):
            for i, b in reversed(list(enumerate(self.buckets))):
                if b.shard is not None:
                    lo, hi = b.shard
                    self.gathering[i] = dist.all_gather_single(
                        b.param.data, b.param.data[lo:hi].clone(), group=b.group, async_op=True)

    def _await_layer(self, key: LayerKey, step: int, wave: int) -> None:
        """ZeRO-1/2: wait for the all-gather of the bucket holding layer `key`, if still in
        flight, before the layer's operator runs (taken out of the forward's compute span)."""
        i = self.gathered_in.get(key)
        if i is not None and i in self.gathering:
            with self.tracer.gap("all-gather", "sync", step=step + 1, wave=wave):
                self._await_gathers([i])

    def _await_gathers(self, indices: list[int]) -> None:
        """Wait for the all-gathers of those buckets still in flight."""
        waiting = [i for i in indices if i in self.gathering]
        if not waiting:
            return
        with with_peers("the parameter all-gather",
                         [r for i in waiting for r in self.buckets[i].ranks if r != self.rank]):
            for i in waiting:
                self.gathering.pop(i).wait()

    def _issue_ready(self, st: StepState) -> list[Any]:
        """Start the all-reduce (reduce-scatter under ZeRO-1/2) of every bucket that is
        complete on this rank now, in queue order, so a bucket waits for the ones before it
        and any two ranks issue the ones they share alike. Each group has its own
        connections, so the transfers overlap the rest of the backward pass. First, under
        ZeRO-2, the gradient storage of the buckets whose reduce-scatter is done goes."""
        self._release_reduced(everything=False)
        works = []
        while st.issued < len(self.queue) and self._complete(self.queue[st.issued], st):
            b = self.queue[st.issued]
            with with_peers("the gradient sync", [r for r in b.ranks if r != self.rank]):
                if b.shard is None:
                    works.append(dist.all_reduce(b.flat, op=dist.ReduceOp.SUM,
                                                 group=b.group, async_op=True))
                else:
                    works.append(dist.reduce_scatter_single(
                        b.shard_grad, b.flat, op=dist.ReduceOp.SUM, group=b.group,
                        async_op=True))
                    if b.grads_from >= 0:
                        self.releasing.append((works[-1], b))
            st.issued += 1
        return works

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
    def _complete(b: Bucket, st: StepState) -> bool:
        """Whether every gradient of `b` is complete on this rank (`Bucket.after`)."""
        if st.wave > b.ready_wave:
            return False
        return (b.after is None or st.wave < b.ready_wave
                or st.passed.get(b.after[0], 0) >= b.after[1])

    @staticmethod
    def _add_loss(st: StepState, task: str, loss: torch.Tensor) -> None:
        """Add a loss slice's value to its task's, in fp64 (as a Python float summed)."""
        value = loss.detach().to(torch.float64)
        st.task_loss[task] = st.task_loss[task] + value if task in st.task_loss else value

    def _reduce_losses(self, st: StepState) -> tuple[torch.Tensor, Any]:
        """Start the all-reduce of the task losses over the world (they are known once the
        forward pass has run, so it overlaps the backward pass); returns the vector and its
        work (None on one rank)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.world.device)
        vec = torch.stack([st.task_loss.get(t, zero) for t in self.program.tasks])
        if self.world.world_size == 1:
            return vec, None
        others = [r for r in range(self.world.world_size) if r != self.rank]
        with with_peers("the loss reduction", others):
            return vec, dist.all_reduce(vec, op=dist.ReduceOp.SUM, async_op=True)

    def _sync(self, pending: list[Any], losses: tuple[torch.Tensor, Any]) -> dict[str, float]:
        """Await the bucket all-reduces and the loss reduction; returns the losses."""
        with with_peers("the gradient sync", [r for b in self.buckets for r in b.ranks
                                               if b.group is not None and r != self.rank]):
            for work in pending:
                work.wait()
        self._release_reduced(everything=True)
        vec, work = losses
        if work is not None:
            others = [r for r in range(self.world.world_size) if r != self.rank]
            with with_peers("the loss reduction", others):
                work.wait()
        return dict(zip(self.program.tasks, vec.tolist(), strict=True))

    # ---- slices ---------------------------------------------------------------------------

    def _load(self, sp: SliceProgram, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        task = self.model.task(sp.metaop.task)
        # steps numbered as the loss lines number them (from 1); rows() takes them from 0
        where = (f"data {task.name}/{name} at step {step + 1} (rows({task.name!r}, {name!r}, "
                 f"{step}, {lo}, {hi}))")
        try:
            x = self.data.rows(task.name, name, step, lo, hi)
        except SpindleError:
            raise  # its own line and hint
        except Exception as e:  # a --dataset's code: whatever it raises, said where (its
            # traceback chained, for SPINDLE_DEBUG=1)
            raise RuntimeFailure(f"{where} raised {e!r}") from e
        problem = rows_problem(x, self.model, task, name, lo, hi)
        if problem is not None:
            raise ShapeMismatch(f"{where}: {problem}")
        is_ids = x.dtype == torch.int64
        return x.to(self.world.device, dtype=None if is_ids else self.dtype)

    def _forward_slice(self, sp: SliceProgram, st: StepState, step: int) -> None:
        m = sp.metaop
        lo, hi = rows_of(m.batch_size, sp.slice.ranks, self.rank)
        if sp.data_inputs:
            ins = [self._load(sp, name, step, lo, hi) for name in sp.data_inputs]
        else:
            ins = [st.recv[ti] for ti in sp.in_transfers]
        first = self.layers[(m.module, sp.layers[0])]
        self._await_layer((m.module, sp.layers[0]), step, sp.wave)
        if sp.kind == "contrastive_loss":
            full = [self._gather(x, sp) for x in ins]
            loss = first(*full)
            st.loss[sp.slice.id] = (loss, full)
            if self.rank == sp.slice.ranks[0]:
                self._add_loss(st, m.task, loss)
            return
        if sp.kind == "lm_loss":
            if hi > lo:
                targets = self._load(sp, targets_name(m.step), step, lo, hi)
                loss = first(ins[0], targets) * ((hi - lo) / m.batch_size)
                st.loss[sp.slice.id] = (loss, [])
                self._add_loss(st, m.task, loss)
            return
        if hi == lo:
            out = torch.empty((0, *sp.out_shape), dtype=self.dtype, device=self.world.device)
        else:
            # a bucket complete after the slice's top k operators cuts the graph below them,
            # so backward can run segment by segment and issue it in between
            n = len(sp.layers)
            begins = {n - k for k in self.cuts.get(sp.slice.id, ()) if 0 < k < n}
            segments: list[tuple[torch.Tensor | None, torch.Tensor, int]] = []
            leaf: torch.Tensor | None = None
            out, ops = self._operator(first, *ins), 1
            for pos, i in enumerate(sp.layers[1:], start=1):
                if pos in begins:
                    segments.append((leaf, out, ops))
                    leaf = out.detach().requires_grad_(True)
                    out, ops = leaf, 0
                self._await_layer((m.module, i), step, sp.wave)
                out, ops = self._operator(self.layers[(m.module, i)], out), ops + 1
            if segments:
                st.segments[sp.slice.id] = [*segments, (leaf, out, ops)]
        if _shape(out) != [hi - lo, *sp.out_shape]:
            raise ShapeMismatch(f"slice {sp.slice.id} ({m.id}) produced {_shape(out)}, "
                                f"expected {[hi - lo, *sp.out_shape]}")
        st.out[sp.slice.id] = out

    def _operator(self, layer: nn.Module, *ins: torch.Tensor) -> torch.Tensor:
        """One operator's forward; under recomputation only its inputs are kept for backward,
        which runs its forward again."""
        if self.recompute:
            return checkpoint(layer, *ins, use_reentrant=False)
        return layer(*ins)

    def _gather(self, x: torch.Tensor, sp: SliceProgram) -> torch.Tensor:
        """The whole batch of `x` from every rank of the slice, as a new leaf (`x` itself on a
        single rank)."""
        ranks = sp.slice.ranks
        batch = sp.metaop.batch_size
        if len(ranks) == 1:
            return x
        # all_gather needs equal sizes: pad every piece to the largest split
        width = math.ceil(batch / len(ranks))
        padded = torch.zeros((width, *x.shape[1:]), dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x.detach()
        pieces = [torch.empty_like(padded) for _ in ranks]
        with with_peers(f"the batch gather of slice {sp.slice.id}",
                         [r for r in ranks if r != self.rank]):
            dist.all_gather(pieces, padded, group=self.groups[ranks])
        rows = [hi - lo for lo, hi in
                (rows_of(batch, ranks, r) for r in ranks)]
        return torch.cat([p[:n] for p, n in zip(pieces, rows, strict=True)]).requires_grad_(True)

    def _backward_slice(self, sp: SliceProgram, st: StepState, pending: list[Any]) -> None:
        """The slice's backward; buckets it completes part-way are issued in between (their
        works go to `pending`)."""
        self._backward_ops(sp, st, pending)
        st.passed[sp.slice.id] = len(sp.layers)

    def _backward_ops(self, sp: SliceProgram, st: StepState, pending: list[Any]) -> None:
        sid = sp.slice.id
        if sp.kind == "contrastive_loss" and len(sp.slice.ranks) == 1:
            st.loss[sid][0].backward()
            return
        if sp.kind == "contrastive_loss":
            loss, full = st.loss[sid]
            layer = self.layers[(sp.metaop.module, sp.layers[0])]
            params = list(layer.parameters())
            grads = torch.autograd.grad(loss, [*full, *params])
            lo, hi = rows_of(sp.metaop.batch_size, sp.slice.ranks, self.rank)
            for ti, g in zip(sp.in_transfers, grads[: len(full)], strict=True):
                st.recv[ti].grad = g[lo:hi].contiguous()
            n = len(sp.slice.ranks)
            for p, g in zip(params, grads[len(full):], strict=True):
                assert p.grad is not None
                p.grad.add_(g, alpha=1.0 / n)
            return
        if sp.kind == "lm_loss":
            if sid in st.loss:
                st.loss[sid][0].backward()
            return
        out = st.out[sid]
        grad = st.grad_out.get(sid)
        if not (out.numel() and out.requires_grad and grad is not None):
            return
        segments = st.segments.get(sid, [(None, out, len(sp.layers))])
        for leaf, seg_out, ops in reversed(segments):
            torch.autograd.backward(seg_out, grad)
            st.passed[sid] = st.passed.get(sid, 0) + ops
            pending += self._issue_ready(st)
            grad = leaf.grad if leaf is not None else None

    # ---- state ----------------------------------------------------------------------------

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint keeps of this rank: parameters (their all-gathers awaited),
        optimizer state, completed steps."""
        return {"step": step, "params": self.parameters(),
                "masters": [m.detach().clone() for m in self.masters],
                "optimizer": self.optimizer.state_dict() if self.optimizer else {}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state()` output (the same plan on the same rank), keeping this run's
        learning rate."""
        self._await_gathers(list(self.gathering))
        params = dict(self.named)
        if set(state["params"]) != set(params):
            raise RuntimeFailure(f"checkpoint holds parameters {sorted(state['params'])[:3]}..., "
                                 f"this rank runs {sorted(params)[:3]}...")
        masters = state.get("masters", [])
        if [m.shape for m in masters] != [m.shape for m in self.masters]:
            raise RuntimeFailure(f"checkpoint holds fp32 master tensors of "
                                 f"{[m.numel() for m in masters][:3]}... elements, this rank "
                                 f"steps {[m.numel() for m in self.masters][:3]}...")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["params"][name])
            for mine, saved in zip(self.masters, masters, strict=True):
                mine.copy_(saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            # load_state_dict restores the saved hyperparameters too: train on at this run's
            # learning rate (--lr), not the one the checkpoint was taken with
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr

    def finite(self) -> bool:
        """Whether every value this rank steps (its fp32 masters in bf16) is finite."""
        return all(bool(torch.isfinite(p).all()) for p in self.masters or self.stepped)

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by `module.layer.param` name (detached copies)."""
        self._await_gathers(list(self.gathering))
        return {n: p.detach().clone() for n, p in self.named}
