"""The wave boundaries: every transfer into a wave, as the executor makes it on this rank.

Forward, before a wave's slices run: one `batch_isend_irecv` per rank with its messages in the
plan's canonical order (`Program.transfer_messages`), local copies for same-rank pieces; a
received activation becomes a leaf, so autograd stops at slice boundaries. Backward, after the
wave's slices: the same messages with roles swapped, each consumer sending the gradient of the
rows it received, each producer summing what its consumers sent (runtime-design.md §1.6).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spindle_cli.artifacts.plan import Plan
from spindle_cli.runtime.dist import with_peers
from spindle_cli.runtime.program import Program, rows_of


class Boundaries:
    """The transfers into each wave and the messages this rank sends and receives for them."""

    def __init__(self, plan: Plan, program: Program, rank: int, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.plan = plan
        self.program = program
        self.rank = rank
        self.dtype = dtype
        self.device = device
        wave_of = {sp.slice.id: sp.wave for sp in program.slices}
        self.into_wave: list[list[int]] = [[] for _ in range(program.num_waves)]
        for ti, t in enumerate(plan.transfers):
            self.into_wave[wave_of[t.dst]].append(ti)
        batch_of = {sp.slice.id: sp.metaop.batch_size for sp in program.slices}
        self.transfer_batch = [batch_of[t.dst] for t in plan.transfers]
        # Transfers between two slices that both run on this rank alone need no message: the
        # consumer's leaf is a detached view of the producer's output (no copy), and the
        # gradient goes back as is.
        self.same_rank = {ti for ti, t in enumerate(plan.transfers)
                          if t.src_ranks == t.dst_ranks == (rank,)}

    def _run_ops(self, ops: list[dist.P2POp], where: str) -> None:
        if ops:
            with with_peers(where, [op.peer for op in ops]):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()

    def _messages(self, ti: int, send: torch.Tensor | None, send_lo: int,
                  into: torch.Tensor | None, into_lo: int, *, backward: bool,
                  ops: list[dist.P2POp], local: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This rank's part of transfer `ti`'s messages, in their canonical order: rows sent
        from `send` (whose first row is row `send_lo` of the batch), received into `into`
        (first row `into_lo`), or copied between them on this rank. Backward, the messages
        run from their consumers to their producers."""
        me = self.rank
        for msg in self.program.transfer_messages[ti]:
            src, dst = (msg.dst, msg.src) if backward else (msg.src, msg.dst)
            if src == me and dst == me:
                assert send is not None and into is not None
                local.append((into[msg.lo - into_lo:msg.hi - into_lo],
                              send[msg.lo - send_lo:msg.hi - send_lo]))
            elif src == me:
                assert send is not None
                ops.append(dist.P2POp(dist.isend,
                                      send[msg.lo - send_lo:msg.hi - send_lo].contiguous(), dst))
            elif dst == me:
                assert into is not None
                ops.append(dist.P2POp(dist.irecv, into[msg.lo - into_lo:msg.hi - into_lo], src))

    def forward(self, w: int, recv: dict[int, torch.Tensor],
                outs: dict[str, torch.Tensor]) -> None:
        """The transfers into wave `w`: each one this rank consumes gets its received
        activation, a leaf, in `recv` (by transfer index), from the outputs of the slices
        that produce it (`outs`, by slice id, on their ranks)."""
        ops: list[dist.P2POp] = []
        local: list[tuple[torch.Tensor, torch.Tensor]] = []
        me = self.rank
        for ti in self.into_wave[w]:
            t = self.plan.transfers[ti]
            if ti in self.same_rank:
                recv[ti] = outs[t.src].detach().requires_grad_(True)
                continue
            batch = self.transfer_batch[ti]
            out, a = None, 0
            if me in t.src_ranks:
                out = outs[t.src].detach()
                a = rows_of(batch, t.src_ranks, me)[0]
            buf, c = None, 0
            if me in t.dst_ranks:
                c, e = rows_of(batch, t.dst_ranks, me)
                buf = torch.empty((e - c, *self.program.transfer_shapes[ti]), dtype=self.dtype,
                                  device=self.device)
                recv[ti] = buf
            self._messages(ti, out, a, buf, c, backward=False, ops=ops, local=local)
        self._run_ops(ops, f"the forward transfers into wave {w}")
        for dst, src in local:
            dst.copy_(src)
        for ti in self.into_wave[w]:
            if ti in recv and ti not in self.same_rank:
                recv[ti].requires_grad_(True)

    def backward(self, w: int, recv: dict[int, torch.Tensor],
                 grad_out: dict[str, torch.Tensor]) -> None:
        """The gradients of the transfers into wave `w`, back from the leaves in `recv` (which
        they leave) to their producers, each adding them to its slice's output gradient in
        `grad_out` (by slice id)."""
        ops: list[dist.P2POp] = []
        local: list[tuple[torch.Tensor, torch.Tensor]] = []
        received: list[tuple[str, torch.Tensor]] = []
        me = self.rank
        for ti in self.into_wave[w]:
            t = self.plan.transfers[ti]
            if ti in self.same_rank:
                leaf = recv[ti]
                received.append((t.src, leaf.grad if leaf.grad is not None
                                 else torch.zeros_like(leaf)))
                continue
            batch = self.transfer_batch[ti]
            grad, c = None, 0
            if me in t.dst_ranks:
                leaf = recv[ti]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                c = rows_of(batch, t.dst_ranks, me)[0]
            gbuf, a = None, 0
            if me in t.src_ranks:
                a, b = rows_of(batch, t.src_ranks, me)
                gbuf = torch.zeros((b - a, *self.program.transfer_shapes[ti]), dtype=self.dtype,
                                   device=self.device)
                received.append((t.src, gbuf))
            self._messages(ti, grad, c, gbuf, a, backward=True, ops=ops, local=local)
        self._run_ops(ops, f"the backward transfers of wave {w}")
        for dst, src in local:
            dst.copy_(src)
        for sid, g in received:
            # fan-out: a producer feeding several consumers sums their gradients
            grad_out[sid] = grad_out[sid] + g if sid in grad_out else g
        for ti in self.into_wave[w]:
            recv.pop(ti, None)
