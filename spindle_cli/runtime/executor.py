"""The wave executor: one training step of a plan on this rank.

Forward, wave by wave: first the boundary (every transfer into the wave, `boundaries`: one
`batch_isend_irecv` per rank; a received activation becomes a leaf, so autograd stops at slice
boundaries), then the rank's slice of the wave. Backward, waves in reverse: the slice's backward
from its loss or from the gradients its consumers sent, then the boundary backward (the same
messages with roles swapped).

Gradients live in flat buckets (`gradsync`, which says how they are laid out, issued and
sharded under ZeRO-1/2): a slice's forward is cut where a bucket becomes complete part-way
through its backward, and each backward wave issues the buckets complete so far; after the last
one they are awaited and AdamW steps the buckets' flat parameters (under ZeRO-1/2 the rank's
shards, whose all-gathers then overlap the next step's forward, which waits for a layer's
before the layer's first operator). The task losses are all-reduced over the world (for the
log) asynchronously from the end of the forward pass.

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
from spindle_cli.planner.buckets import SYNC_CHUNK_BYTES
from spindle_cli.runtime.boundaries import Boundaries
from spindle_cli.runtime.data import DataSource, rows_problem, targets_name
from spindle_cli.runtime.dist import World, with_peers
from spindle_cli.runtime.gradsync import GradSync
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
    once per step (`_await_losses`), not per loss slice, which would wait for the device mid-forward
    (CUDA)."""
    segments: dict[str, list[tuple[torch.Tensor | None, torch.Tensor, int]]] = field(
        default_factory=dict)
    """Slice id -> its forward cut where buckets become complete, bottom first: (input leaf,
    None for the first; output; operators)."""
    wave: int = -1
    """The backward wave running now."""
    passed: dict[str, int] = field(default_factory=dict)
    """Slice id -> operators whose backward has run."""


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


class Executor:
    """The rank's layers, gradient buckets (`GradSync`) and optimizer, and the step loop over
    the plan."""

    def __init__(self, plan: Plan, program: Program, model: ModelSpec, world: World,
                 groups: Groups, data: DataSource, *, seed: int, lr: float,
                 dtype: torch.dtype, tracer: Tracer | None = None,
                 overlap_sync: bool | None = None,
                 sync_chunk_bytes: int = SYNC_CHUNK_BYTES) -> None:
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
        self.sync = GradSync(plan, program, self.layers, world, groups, dtype=dtype,
                             tracer=self.tracer, overlap_sync=overlap_sync,
                             chunk_bytes=sync_chunk_bytes)
        self.recompute = plan.options.get("recompute") == "true"
        # slice id -> k for each bucket complete once the slice's backward has run its top k
        # operators (`Bucket.after`): its forward is cut below them (`StepState.segments`)
        self.cuts: dict[str, set[int]] = {}
        for b in self.sync.buckets:
            if b.after is not None:
                self.cuts.setdefault(b.after[0], set()).add(b.after[1])
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
        self.stepped = [b.param if b.shard is None else b.shard_param()
                        for b in self.sync.buckets]
        # bf16: AdamW steps an fp32 master of each (`_step`)
        self.masters = ([nn.Parameter(p.detach().float()) for p in self.stepped]
                        if dtype.itemsize < 4 else [])
        stepped = self.masters or self.stepped
        self.optimizer = make_optimizer(stepped, lr) if stepped else None

    # ---- one step -------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync and AdamW for training step `step`; returns the
        loss of every task (the same on every rank)."""
        shown = step + 1  # the trace numbers steps as the loss lines and --metrics do
        self.sync.start_step()
        st = StepState()
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
            self.sync.start_wave(w)
            self.sync.issue_ready(w, st.passed)
            with self.tracer.span("compute", "compute", step=shown, wave=w, phase="backward"):
                for sp in self.my_slices[w]:
                    self._backward_slice(sp, st)
            self.sync.issue_ready(w, st.passed)
            with self.tracer.span("send/recv", "comm", step=shown, wave=w, phase="backward"):
                self.boundaries.backward(w, st.recv, st.grad_out)
        with self.tracer.span("sync", "sync", step=shown):
            self.sync.wait_reduced()
            losses = self._await_losses(loss_reduction)
        self.sync.await_all()
        if self.optimizer is not None:
            with self.tracer.span("optimizer", "compute", step=shown):
                self._step()
        if saved is not None:
            self._note_held(None)
        self.sync.start_gathers()
        return losses

    def _note_held(self, saved: SavedTensors | None) -> None:
        """Add the storages the rank holds now to `held` (each category's most): at the turn,
        with the activations `saved`, and after the optimizer step without (AdamW makes its
        state in the first step, after the first turn)."""
        weights = storages(p for _, p in self.named)
        buckets = self.sync.buckets
        grads = storages([*(b.flat for b in buckets),
                          *(b.shard_grad for b in buckets if b.shard_grad is not None)])
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

    def _await_losses(self, losses: tuple[torch.Tensor, Any]) -> dict[str, float]:
        """Await the loss reduction (`_reduce_losses`); returns the losses."""
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
        self.sync.await_layer((m.module, sp.layers[0]), step, sp.wave)
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
                self.sync.await_layer((m.module, i), step, sp.wave)
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

    def _backward_slice(self, sp: SliceProgram, st: StepState) -> None:
        """The slice's backward; buckets it completes part-way are issued in between."""
        self._backward_ops(sp, st)
        st.passed[sp.slice.id] = len(sp.layers)

    def _backward_ops(self, sp: SliceProgram, st: StepState) -> None:
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
            self.sync.issue_ready(st.wave, st.passed)
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
        self.sync.await_all()
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
        self.sync.await_all()
        return {n: p.detach().clone() for n, p in self.named}
