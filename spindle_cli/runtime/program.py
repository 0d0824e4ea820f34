"""What every rank does, derived from a plan alone: slices, their inputs, transfers split into
row-range messages, parameter holders. Pure Python (no torch, no communication), identical on
every rank, so all ranks agree on the order of every message and collective.

Also the checks that a plan is executable against its graph and model (`build_program`): they
run on every rank before the first collective and in `spindle run` before launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.model_check import Shape, infer_shapes
from spindle_cli.artifacts.plan import Plan, Slice
from spindle_cli.errors import PlanError
from spindle_cli.planner.consistency import check_plan
from spindle_cli.planner.memory import split_rows


def rows_of(num_rows: int, ranks: tuple[int, ...], rank: int) -> tuple[int, int]:
    """The row range `rank` owns in a slice over `ranks`."""
    return split_rows(num_rows, len(ranks))[ranks.index(rank)]


@dataclass(frozen=True, slots=True)
class Message:
    """Rows [lo, hi) of one transfer, from rank `src` to rank `dst` (global row indices)."""

    src: int
    dst: int
    lo: int
    hi: int


def messages(num_rows: int, src_ranks: tuple[int, ...],
             dst_ranks: tuple[int, ...]) -> list[Message]:
    """The non-empty overlaps of producer and consumer row ranges, in (src, dst) order."""
    out = []
    for s, (a, b) in zip(src_ranks, split_rows(num_rows, len(src_ranks)), strict=True):
        for d, (c, e) in zip(dst_ranks, split_rows(num_rows, len(dst_ranks)), strict=True):
            lo, hi = max(a, c), min(b, e)
            if lo < hi:
                out.append(Message(s, d, lo, hi))
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SliceProgram:
    """One slice with everything needed to run it."""

    slice: Slice
    wave: int
    metaop: MetaOp
    layers: tuple[int, ...]
    """Indices in the module of the layers the slice runs."""
    data_inputs: tuple[str, ...]
    """Task inputs loaded from data (only for a first slice without predecessors)."""
    in_transfers: tuple[int, ...]
    """Indices in `plan.transfers` feeding the slice, in input order."""
    out_shape: tuple[int, ...]
    """Per-sample output shape ((seq, width) or (width,)); () for a loss."""
    kind: str
    """Layer kind of the MetaOp."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Program:
    """The whole plan, resolved against its graph and model."""

    slices: tuple[SliceProgram, ...]
    """In execution order (wave by wave)."""
    transfer_messages: tuple[tuple[Message, ...], ...]
    """Row messages of each plan transfer."""
    transfer_shapes: tuple[tuple[int, ...], ...]
    """Per-sample activation shape carried by each transfer."""
    holders: dict[tuple[str, int], tuple[int, ...]]
    """(module, layer) -> ranks holding a replica, ascending."""
    group_ranks: tuple[tuple[int, ...], ...]
    """Distinct rank sets (>= 2 ranks) that need a process group, sorted."""
    num_waves: int
    tasks: tuple[str, ...]

    def slice(self, slice_id: str) -> SliceProgram:
        """The slice with that id."""
        for s in self.slices:
            if s.slice.id == slice_id:
                return s
        raise KeyError(slice_id)


def _per_sample(shape: Shape) -> tuple[int, ...]:
    if shape.form == "sequence":
        return (shape.seq, shape.width)
    if shape.form == "pooled":
        return (shape.width,)
    return ()


EXECUTABLE_ZERO_STAGES = (0, 1, 2)
"""The ZeRO stages the executor trains (`check_executable`)."""


def check_executable(plan: Plan) -> None:
    """Refuse a plan the executor cannot train as planned (torch-free, so `spindle plan` says
    so too): one that counts on ZeRO-3 sharding (Plan.options `zero`, set by `spindle plan
    --memory`), since the executor keeps every layer's full weights and the plan would not fit
    the memory it was planned for, or one with tensor-parallel slices. ZeRO-1 and -2
    (optimizer state, and gradients, sharded over each bucket's ranks) and activation
    recomputation it runs."""
    zero = plan.options.get("zero", "0")
    if zero not in [str(z) for z in EXECUTABLE_ZERO_STAGES]:
        raise PlanError(
            f"the plan uses ZeRO stage {zero}; the executor implements ZeRO-1 and -2 only",
            hint="make the plan with `spindle plan --runnable` (or --memory zero2, zero1, none)",
        )
    for _, s in plan.slices():
        if s.strategy != "dp":
            raise PlanError(
                f"slice {s.id} uses strategy {s.strategy!r}; the executor runs data-parallel "
                "slices only (tensor parallelism is not supported yet)",
                hint="make the plan with `spindle plan --runnable` (or --no-tensor-parallel)",
            )


def build_program(plan: Plan, graph: MetaOpGraph, model: ModelSpec) -> Program:
    """Resolve a plan against its graph and model; PlanError when they do not fit together
    (`check_executable`, `consistency.check_plan`)."""
    check_executable(plan)
    if plan.model != model.name or graph.model != model.name:
        raise PlanError(f"plan is for model {plan.model!r}, graph for {graph.model!r}, "
                        f"model file is {model.name!r}")
    holders = check_plan(plan, graph)
    ops = {m.id: m for m in graph.metaops}
    shapes = {t: infer_shapes(model, model.task(t)) for t in graph.tasks}
    by_id = {s.id: (w.index, s) for w in plan.waves for s in w.slices}
    # inputs of each slice: transfers by producer MetaOp
    feeding: dict[str, dict[str, int]] = {}
    for ti, t in enumerate(plan.transfers):
        feeding.setdefault(t.dst, {})[by_id[t.src][1].metaop] = ti
    slices = []
    for sid, (wave, s) in by_id.items():
        m = ops[s.metaop]
        wanted = (m.id,) if s.first > 0 else m.predecessors
        step = next(st for st in model.task(m.task).steps if st.name == m.step)
        data = tuple(step.inputs) if s.first == 0 and not m.predecessors else ()
        slices.append(SliceProgram(
            slice=s, wave=wave, metaop=m,
            layers=tuple(range(m.first_layer + s.first, m.first_layer + s.last)),
            data_inputs=data, in_transfers=tuple(feeding[sid][p] for p in wanted),
            out_shape=_per_sample(shapes[m.task][m.step]), kind=m.layer_kind,
        ))
    t_msgs, t_shapes = [], []
    for t in plan.transfers:
        src = by_id[t.src][1]
        m = ops[src.metaop]
        t_msgs.append(tuple(messages(m.batch_size, src.ranks, by_id[t.dst][1].ranks)))
        t_shapes.append(_per_sample(shapes[m.task][m.step]))
    sets = {r for r in holders.values() if len(r) > 1}
    sets |= {sp.slice.ranks for sp in slices
             if sp.kind == "contrastive_loss" and len(sp.slice.ranks) > 1}
    slices.sort(key=lambda sp: (sp.wave, plan.waves[sp.wave].slices.index(sp.slice)))
    return Program(slices=tuple(slices), transfer_messages=tuple(t_msgs),
                   transfer_shapes=tuple(t_shapes), holders=holders,
                   group_ranks=tuple(sorted(sets)), num_waves=len(plan.waves),
                   tasks=graph.tasks)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSummary:
    """What one rank does in a step (for `spindle run --dry-run`)."""

    rank: int
    num_slices: int
    layers: tuple[tuple[str, int], ...]
    """(module, layer) it holds, sorted."""
    num_sends: int
    """Forward messages it sends per step (as many gradient messages come back)."""
    num_recvs: int
    send_rows: int
    """Sample rows it sends per step, over all forward messages."""
    sync_groups: tuple[tuple[int, ...], ...]
    """Rank sets it all-reduces gradients with (>= 2 ranks)."""


def rank_summaries(program: Program, num_ranks: int) -> list[RankSummary]:
    """Per-rank work, messages and gradient groups of a program."""
    out = []
    for r in range(num_ranks):
        msgs = [m for ms in program.transfer_messages for m in ms if m.src != m.dst]
        sends = [m for m in msgs if m.src == r]
        held = tuple(k for k, ranks in program.holders.items() if r in ranks)
        groups = sorted({ranks for ranks in program.holders.values()
                         if r in ranks and len(ranks) > 1})
        out.append(RankSummary(
            rank=r, num_slices=sum(r in sp.slice.ranks for sp in program.slices), layers=held,
            num_sends=len(sends), num_recvs=sum(m.dst == r for m in msgs),
            send_rows=sum(m.hi - m.lo for m in sends), sync_groups=tuple(groups)))
    return out
