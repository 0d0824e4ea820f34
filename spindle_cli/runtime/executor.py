"""The wave executor: one training step of a plan on this rank.

Forward, wave by wave: first the boundary (receive every activation the wave consumes; a
received activation becomes a leaf, so autograd stops at slice boundaries; same-rank pieces are
local copies), then the rank's slice of the wave. Backward, waves in reverse: the slice's
backward from its loss or from the gradients its consumers sent, then its input gradients go
back the same way (the messages with roles swapped). Transfers are split into row-range
messages (program.py). On gloo they are eager: each message is sent (tagged) as soon as the
slice that produces it has run, and a rank waits only for what it receives, so messages cross
while both sides compute. On NCCL they are rendezvous: producer and consumer exchange at the
consumer's boundary in one `batch_isend_irecv`, in the plan's canonical order.

Gradients live in flat buckets, one per set of holder ranks and backward wave that completes
them (the lowest wave of any slice running the layer; the same on every rank). A bucket is
all-reduced (SUM), asynchronously, as soon as that wave's backward has run (the overlap the
simulator assumes, like DDP's buckets), in the order of those waves, then of rank sets; after
the last backward wave the all-reduces are awaited, and AdamW steps the buckets' flat
parameters (every layer parameter is a view of one). The task losses are all-reduced over the
world (for the log) asynchronously from the end of the forward pass.

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
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.plan import Plan
from spindle_cli.errors import RuntimeFailure
from spindle_cli.runtime.data import DataSource, item_shape, targets_name
from spindle_cli.runtime.dist import World
from spindle_cli.runtime.groups import Groups
from spindle_cli.runtime.model import LayerKey, build_layers, make_optimizer, named_parameters
from spindle_cli.runtime.program import Program, SliceProgram, rows_of
from spindle_cli.runtime.trace import Tracer


class ShapeMismatch(RuntimeFailure):
    """A tensor did not have the shape the plan and model imply."""


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
def _with_peers(where: str, peers: list[int]) -> Iterator[None]:
    """Turn a failed communication into PeerLost naming where it happened and with whom."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        if isinstance(e, RuntimeFailure):
            raise
        raise PeerLost(where, sorted(set(peers)), e) from e


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
    """The backward wave after which every gradient of the bucket is complete (-1 for a
    single rank's bucket, which is not reduced)."""


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
    task_loss: dict[str, float] = field(default_factory=dict)
    """This rank's share of each task's loss."""
    sends: list[tuple[Any, dist.P2POp]] = field(default_factory=list)
    """Eager sends in flight (work, op): the op keeps its tensor alive until the send ends."""


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


class Executor:
    """The rank's layers, buckets and optimizer, and the step loop over the plan."""

    def __init__(self, plan: Plan, program: Program, model: ModelSpec, world: World,
                 groups: Groups, data: DataSource, *, seed: int, lr: float,
                 dtype: torch.dtype, tracer: Tracer | None = None,
                 eager: bool | None = None) -> None:
        self.plan = plan
        self.program = program
        self.model = model
        self.world = world
        self.rank = world.rank
        self.groups = groups
        self.data = data
        self.dtype = dtype
        self.tracer = tracer or Tracer(enabled=False, rank=world.rank)
        me = self.rank
        self.my_slices = [[sp for sp in program.slices if sp.wave == w and me in sp.slice.ranks]
                          for w in range(program.num_waves)]
        wave_of = {sp.slice.id: sp.wave for sp in program.slices}
        self.into_wave: list[list[int]] = [[] for _ in range(program.num_waves)]
        self.out_of_wave: list[list[int]] = [[] for _ in range(program.num_waves)]
        for ti, t in enumerate(plan.transfers):
            self.into_wave[wave_of[t.dst]].append(ti)
            self.out_of_wave[wave_of[t.src]].append(ti)
        # Eager transfers (gloo): a rank sends as soon as the producing (forward) or consuming
        # (backward) slice has run and waits only for what it receives, so a message crosses
        # while both sides compute, as the simulator assumes. Rendezvous (NCCL, which ignores
        # tags and may queue a receive behind an unmatched send on the pair's stream): both
        # sides exchange at the consumer's boundary in one batch.
        self.eager = world.backend == "gloo" if eager is None else eager
        sizes = [len(m) for m in program.transfer_messages]
        self.message_base = [sum(sizes[:ti]) for ti in range(len(sizes))]
        batch_of = {sp.slice.id: sp.metaop.batch_size for sp in program.slices}
        self.transfer_batch = [batch_of[t.dst] for t in plan.transfers]
        # Transfers between two slices that both run on this rank alone need no message: the
        # consumer's leaf is a detached view of the producer's output (no copy), and the
        # gradient goes back as is.
        self.same_rank = {ti for ti, t in enumerate(plan.transfers)
                          if t.src_ranks == t.dst_ranks == (me,)}
        keys = [(m, i) for (m, i), ranks in program.holders.items() if me in ranks]
        self.layers: dict[LayerKey, nn.Module] = build_layers(
            model, keys, seed=seed, dtype=dtype, device=world.device)
        self.buckets = self._make_buckets()
        self.named = named_parameters(self.layers)
        # AdamW is elementwise, so stepping each bucket's flat parameter updates every layer
        # parameter (a view of it) exactly as stepping them one by one would; one tensor per
        # bucket instead of ~100 small ones cuts the step's per-tensor overhead (3 ms -> a
        # memory-bound fraction of a millisecond for tiny-clip on one CPU thread).
        # A rank the plan leaves idle holds no parameters (AdamW refuses an empty list).
        flat = [b.param for b in self.buckets]
        self.optimizer = make_optimizer(flat, lr) if flat else None

    def _make_buckets(self) -> list[Bucket]:
        """One bucket per set of holder ranks and, for a set of several ranks, per backward
        wave that completes its layers' gradients (the lowest wave of a slice running each),
        so that each all-reduce starts as soon as its gradients are complete (the simulator's
        per-parameter-group sync); a single-rank set has nothing to reduce and one bucket."""
        ready: dict[LayerKey, int] = {}
        for sp in self.program.slices:
            for i in sp.layers:
                key = (sp.metaop.module, i)
                ready[key] = min(ready.get(key, sp.wave), sp.wave)
        by_key: dict[tuple[tuple[int, ...], int], list[nn.Parameter]] = {}
        for key, ranks in self.program.holders.items():
            if key in self.layers:
                due = ready[key] if len(ranks) > 1 else -1
                by_key.setdefault((ranks, due), []).extend(self.layers[key].parameters())
        buckets = []
        for ranks, due in sorted(by_key, key=lambda k: (-k[1], k[0])):
            params = by_key[(ranks, due)]
            size = sum(p.numel() for p in params)
            flat = torch.zeros(size, dtype=self.dtype, device=self.world.device)
            param = nn.Parameter(torch.empty(size, dtype=self.dtype, device=self.world.device))
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
            buckets.append(Bucket(ranks=ranks, group=self.groups.get(ranks), flat=flat,
                                  param=param, ready_wave=due))
        return buckets

    # ---- one step -------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """Forward, backward, gradient sync and AdamW for training step `step`; returns the
        loss of every task (the same on every rank)."""
        for b in self.buckets:
            b.flat.zero_()
        st = StepState()
        pending: list[Any] = []
        receive = "recv" if self.eager else "send/recv"
        for w in range(self.program.num_waves):
            with self.tracer.span(receive, "comm", step=step, wave=w, phase="forward"):
                self._forward_boundary(w, st)
            with self.tracer.span("compute", "compute", step=step, wave=w, phase="forward"):
                for sp in self.my_slices[w]:
                    self._forward_slice(sp, st, step)
            if self.eager:
                with self.tracer.span("send", "comm", step=step, wave=w, phase="forward"):
                    self._post_forward_sends(w, st)
        loss_reduction = self._reduce_losses(st)
        for w in reversed(range(self.program.num_waves)):
            if self.eager:
                with self.tracer.span(receive, "comm", step=step, wave=w, phase="backward"):
                    self._receive_gradients(w, st)
            with self.tracer.span("compute", "compute", step=step, wave=w, phase="backward"):
                for sp in self.my_slices[w]:
                    self._backward_slice(sp, st)
            pending += self._start_all_reduces(w)
            name = "send" if self.eager else "send/recv"
            with self.tracer.span(name, "comm", step=step, wave=w, phase="backward"):
                self._backward_boundary(w, st)
        with self.tracer.span("sync", "sync", step=step):
            self._wait([work for work, _ in st.sends], [op.peer for _, op in st.sends],
                       "the transfers of this step")
            losses = self._sync(pending, loss_reduction)
        if self.optimizer is not None:
            with self.tracer.span("optimizer", "compute", step=step):
                self.optimizer.step()
        return losses

    def _start_all_reduces(self, w: int) -> list[Any]:
        """Issue the all-reduce of every bucket that backward wave `w` completes (each group
        has its own connections, so the transfers overlap the rest of the backward pass)."""
        works = []
        for b in self.buckets:
            if b.ready_wave == w and b.group is not None:
                with _with_peers("the gradient sync", [r for r in b.ranks if r != self.rank]):
                    works.append(dist.all_reduce(b.flat, op=dist.ReduceOp.SUM, group=b.group,
                                                 async_op=True))
        return works

    def _reduce_losses(self, st: StepState) -> tuple[torch.Tensor, Any]:
        """Start the all-reduce of the task losses over the world (they are known once the
        forward pass has run, so it overlaps the backward pass); returns the vector and its
        work (None on one rank)."""
        vec = torch.tensor([st.task_loss.get(t, 0.0) for t in self.program.tasks],
                           dtype=torch.float64, device=self.world.device)
        if self.world.world_size == 1:
            return vec, None
        others = [r for r in range(self.world.world_size) if r != self.rank]
        with _with_peers("the loss reduction", others):
            return vec, dist.all_reduce(vec, op=dist.ReduceOp.SUM, async_op=True)

    def _sync(self, pending: list[Any], losses: tuple[torch.Tensor, Any]) -> dict[str, float]:
        """Await the bucket all-reduces and the loss reduction; returns the losses."""
        with _with_peers("the gradient sync", [r for b in self.buckets for r in b.ranks
                                               if b.group is not None and r != self.rank]):
            for work in pending:
                work.wait()
        vec, work = losses
        if work is not None:
            others = [r for r in range(self.world.world_size) if r != self.rank]
            with _with_peers("the loss reduction", others):
                work.wait()
        return dict(zip(self.program.tasks, vec.tolist(), strict=True))

    # ---- slices ---------------------------------------------------------------------------

    def _load(self, sp: SliceProgram, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        task = self.model.task(sp.metaop.task)
        shape, is_ids = item_shape(self.model, task, name)
        x = self.data.rows(task.name, name, step, lo, hi)
        want = [hi - lo, *shape]
        if _shape(x) != want or (x.dtype == torch.int64) != is_ids:
            kind = "int64 token ids" if is_ids else "float features"
            raise ShapeMismatch(f"data {task.name}/{name} at step {step}, rows [{lo}, {hi}): "
                                f"got {x.dtype} {_shape(x)}, expected {kind} {want}")
        return x.to(self.world.device, dtype=None if is_ids else self.dtype)

    def _forward_slice(self, sp: SliceProgram, st: StepState, step: int) -> None:
        m = sp.metaop
        lo, hi = rows_of(m.batch_size, sp.slice.ranks, self.rank)
        if sp.data_inputs:
            ins = [self._load(sp, name, step, lo, hi) for name in sp.data_inputs]
        else:
            ins = [st.recv[ti] for ti in sp.in_transfers]
        first = self.layers[(m.module, sp.layers[0])]
        if sp.kind == "contrastive_loss":
            full = [self._gather(x, sp) for x in ins]
            loss = first(*full)
            st.loss[sp.slice.id] = (loss, full)
            if self.rank == sp.slice.ranks[0]:
                st.task_loss[m.task] = st.task_loss.get(m.task, 0.0) + loss.item()
            return
        if sp.kind == "lm_loss":
            if hi > lo:
                targets = self._load(sp, targets_name(m.step), step, lo, hi)
                loss = first(ins[0], targets) * ((hi - lo) / m.batch_size)
                st.loss[sp.slice.id] = (loss, [])
                st.task_loss[m.task] = st.task_loss.get(m.task, 0.0) + loss.item()
            return
        if hi == lo:
            out = torch.empty((0, *sp.out_shape), dtype=self.dtype, device=self.world.device)
        else:
            out = first(*ins)
            for i in sp.layers[1:]:
                out = self.layers[(m.module, i)](out)
        if _shape(out) != [hi - lo, *sp.out_shape]:
            raise ShapeMismatch(f"slice {sp.slice.id} ({m.id}) produced {_shape(out)}, "
                                f"expected {[hi - lo, *sp.out_shape]}")
        st.out[sp.slice.id] = out

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
        with _with_peers(f"the batch gather of slice {sp.slice.id}",
                         [r for r in ranks if r != self.rank]):
            dist.all_gather(pieces, padded, group=self.groups[ranks])
        rows = [hi - lo for lo, hi in
                (rows_of(batch, ranks, r) for r in ranks)]
        return torch.cat([p[:n] for p, n in zip(pieces, rows, strict=True)]).requires_grad_(True)

    def _backward_slice(self, sp: SliceProgram, st: StepState) -> None:
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
        if out.numel() and out.requires_grad and grad is not None:
            torch.autograd.backward(out, grad)

    # ---- boundaries -----------------------------------------------------------------------

    def _tag(self, ti: int, k: int, backward: bool) -> int:
        """A tag unique to message k of transfer ti in one direction: eager sends are posted
        in production order and received in consumption order, so messages between two ranks
        are matched by tag, not by posting order (gloo honours tags; NCCL, which ignores them,
        uses rendezvous boundaries)."""
        return 2 * (self.message_base[ti] + k) + backward

    def _wait(self, works: list[Any], peers: list[int], where: str) -> None:
        with _with_peers(where, peers):
            for work in works:
                work.wait()

    def _run_ops(self, ops: list[dist.P2POp], where: str) -> list[Any]:
        """Issue `ops`; returns their works. Eager (gloo): one by one, which costs about half
        of a `batch_isend_irecv` per message to post (gloo does not coalesce a batch anyway);
        rendezvous: as one batch, as NCCL needs."""
        if not ops:
            return []
        with _with_peers(where, [op.peer for op in ops]):
            if self.eager:
                return [op.op(op.tensor, op.peer, tag=op.tag) for op in ops]
            return list(dist.batch_isend_irecv(ops))

    def _forward_ops(self, ti: int, st: StepState, *, send: bool,
                     receive: bool) -> list[dist.P2POp]:
        """This rank's messages of transfer ti's activations: sends of the producer's rows
        and/or receives into a new buffer (`st.recv`); receiving also does the pieces that
        stay on this rank."""
        t = self.plan.transfers[ti]
        me = self.rank
        if ti in self.same_rank:
            if receive:
                st.recv[ti] = st.out[t.src].detach().requires_grad_(True)
            return []
        batch = self.transfer_batch[ti]
        out, a = None, 0
        if me in t.src_ranks:
            out = st.out[t.src].detach()
            a = rows_of(batch, t.src_ranks, me)[0]
        buf, c = None, 0
        if receive and me in t.dst_ranks:
            c, e = rows_of(batch, t.dst_ranks, me)
            buf = torch.empty((e - c, *self.program.transfer_shapes[ti]), dtype=self.dtype,
                              device=self.world.device)
            st.recv[ti] = buf
        ops = []
        for k, msg in enumerate(self.program.transfer_messages[ti]):
            if msg.src == me and msg.dst == me:
                if receive:
                    assert out is not None and buf is not None
                    buf[msg.lo - c:msg.hi - c].copy_(out[msg.lo - a:msg.hi - a])
            elif msg.src == me and send:
                assert out is not None
                ops.append(dist.P2POp(dist.isend, out[msg.lo - a:msg.hi - a].contiguous(),
                                      msg.dst, tag=self._tag(ti, k, False)))
            elif msg.dst == me and receive:
                assert buf is not None
                ops.append(dist.P2POp(dist.irecv, buf[msg.lo - c:msg.hi - c], msg.src,
                                      tag=self._tag(ti, k, False)))
        return ops

    def _backward_ops(self, ti: int, st: StepState, received: list[tuple[str, torch.Tensor]],
                      *, send: bool, receive: bool) -> list[dist.P2POp]:
        """This rank's messages of transfer ti's gradients (the activations' messages with
        roles swapped): sends of the consumer's input gradient and/or receives into a new
        buffer of the producer, appended to `received` with the pieces that stay here."""
        t = self.plan.transfers[ti]
        me = self.rank
        if ti in self.same_rank:
            if receive:
                leaf = st.recv[ti]
                received.append((t.src, leaf.grad if leaf.grad is not None
                                 else torch.zeros_like(leaf)))
            return []
        batch = self.transfer_batch[ti]
        grad, c = None, 0
        if me in t.dst_ranks:
            leaf = st.recv[ti]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            c = rows_of(batch, t.dst_ranks, me)[0]
        gbuf, a = None, 0
        if receive and me in t.src_ranks:
            a, b = rows_of(batch, t.src_ranks, me)
            gbuf = torch.zeros((b - a, *self.program.transfer_shapes[ti]), dtype=self.dtype,
                               device=self.world.device)
            received.append((t.src, gbuf))
        ops = []
        for k, msg in enumerate(self.program.transfer_messages[ti]):
            if msg.src == me and msg.dst == me:
                if receive:
                    assert grad is not None and gbuf is not None
                    gbuf[msg.lo - a:msg.hi - a].copy_(grad[msg.lo - c:msg.hi - c])
            elif msg.dst == me and send:
                assert grad is not None
                ops.append(dist.P2POp(dist.isend, grad[msg.lo - c:msg.hi - c].contiguous(),
                                      msg.src, tag=self._tag(ti, k, True)))
            elif msg.src == me and receive:
                assert gbuf is not None
                ops.append(dist.P2POp(dist.irecv, gbuf[msg.lo - a:msg.hi - a], msg.dst,
                                      tag=self._tag(ti, k, True)))
        return ops

    def _forward_boundary(self, w: int, st: StepState) -> None:
        """Receive every activation wave `w` consumes (and, at a rendezvous boundary, send this
        rank's share of them); wait for the receives."""
        ops = [op for ti in self.into_wave[w]
               for op in self._forward_ops(ti, st, send=not self.eager, receive=True)]
        where = f"the forward transfers into wave {w}"
        self._wait(self._run_ops(ops, where), [op.peer for op in ops], where)
        for ti in self.into_wave[w]:
            if ti not in self.same_rank and ti in st.recv:
                st.recv[ti].requires_grad_(True)

    def _post_forward_sends(self, w: int, st: StepState) -> None:
        """Eager: send the activations wave `w` produced as soon as it has run."""
        ops = [op for ti in self.out_of_wave[w]
               for op in self._forward_ops(ti, st, send=True, receive=False)]
        st.sends += zip(self._run_ops(ops, f"the forward transfers out of wave {w}"),
                        ops, strict=True)

    def _backward_boundary(self, w: int, st: StepState) -> None:
        """After wave `w`'s backward: send the gradients of its inputs. At a rendezvous
        boundary, also receive the gradients of its producers' outputs and wait."""
        received: list[tuple[str, torch.Tensor]] = []
        ops = [op for ti in self.into_wave[w]
               for op in self._backward_ops(ti, st, received, send=True,
                                            receive=not self.eager)]
        where = f"the backward transfers of wave {w}"
        works = self._run_ops(ops, where)
        if self.eager:
            st.sends += zip(works, ops, strict=True)
            return
        self._wait(works, [op.peer for op in ops], where)
        self._add_gradients(received, st)
        for ti in self.into_wave[w]:
            st.recv.pop(ti, None)

    def _receive_gradients(self, w: int, st: StepState) -> None:
        """Eager, before wave `w`'s backward: receive the gradients of its outputs from their
        consumers (sent as soon as each consumer's backward ran) and wait."""
        received: list[tuple[str, torch.Tensor]] = []
        ops = [op for ti in self.out_of_wave[w]
               for op in self._backward_ops(ti, st, received, send=False, receive=True)]
        where = f"the backward transfers out of wave {w}"
        self._wait(self._run_ops(ops, where), [op.peer for op in ops], where)
        self._add_gradients(received, st)
        for ti in self.out_of_wave[w]:
            st.recv.pop(ti, None)

    @staticmethod
    def _add_gradients(received: list[tuple[str, torch.Tensor]], st: StepState) -> None:
        for sid, g in received:
            # fan-out: a producer feeding several consumers sums their gradients
            st.grad_out[sid] = st.grad_out[sid] + g if sid in st.grad_out else g

    # ---- state ----------------------------------------------------------------------------

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint keeps of this rank: parameters, optimizer state, completed steps."""
        return {"step": step, "params": self.parameters(),
                "optimizer": self.optimizer.state_dict() if self.optimizer else {}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore `state()` output (the same plan on the same rank)."""
        params = dict(self.named)
        if set(state["params"]) != set(params):
            raise RuntimeFailure(f"checkpoint holds parameters {sorted(state['params'])[:3]}..., "
                                 f"this rank runs {sorted(params)[:3]}...")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state["params"][name])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by `module.layer.param` name (detached copies)."""
        return {n: p.detach().clone() for n, p in self.named}
