"""What every rank does, derived from a plan alone: slices, their inputs, transfers split into
row-range messages, parameter holders. Pure Python (no torch, no communication), identical on
every rank, so all ranks agree on the order of every message and collective.

Also the checks that a plan is executable against its graph and model (`check_program`): they
run on every rank before the first collective and in `spindle run` before launch.
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.artifacts.model_check import Shape, infer_shapes
from spindle_cli.artifacts.plan import Plan, Slice
from spindle_cli.errors import SpindleError


class PlanError(SpindleError):
    """A plan the executor cannot run (unsupported strategy, inconsistent with its graph)."""


def split_rows(num_rows: int, num_parts: int) -> list[tuple[int, int]]:
    """Contiguous row ranges of `num_rows` over `num_parts` ranks; the first
    `num_rows % num_parts` ranks get one extra row (docs/CONTRACTS.md)."""
    base, rem = divmod(num_rows, num_parts)
    out, start = [], 0
    for i in range(num_parts):
        end = start + base + (i < rem)
        out.append((start, end))
        start = end
    return out


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
    """Resolve a plan against its graph and model; PlanError when they do not fit together."""
    check_executable(plan)
    if plan.model != model.name or graph.model != model.name:
        raise PlanError(f"plan is for model {plan.model!r}, graph for {graph.model!r}, "
                        f"model file is {model.name!r}")
    ops = {m.id: m for m in graph.metaops}
    shapes = {t: infer_shapes(model, model.task(t)) for t in graph.tasks}
    by_id: dict[str, tuple[int, Slice]] = {}
    for w in plan.waves:
        for s in w.slices:
            if s.metaop not in ops:
                raise PlanError(f"slice {s.id}: unknown MetaOp {s.metaop!r}")
            by_id[s.id] = (w.index, s)
    # inputs of each slice: transfers by producer MetaOp
    feeding: dict[str, dict[str, int]] = {}
    for ti, t in enumerate(plan.transfers):
        src_op = by_id[t.src][1].metaop
        if src_op in feeding.setdefault(t.dst, {}):
            raise PlanError(f"transfers[{ti}]: two transfers from {src_op!r} into slice {t.dst}")
        if by_id[t.src][0] >= by_id[t.dst][0]:
            raise PlanError(f"transfers[{ti}]: {t.src} is not in an earlier wave than {t.dst}")
        feeding[t.dst][src_op] = ti
    covered: dict[str, list[tuple[int, int]]] = {}
    slices = []
    for sid, (wave, s) in by_id.items():
        m = ops[s.metaop]
        if s.last > m.num_layers:
            raise PlanError(f"slice {sid}: operators [{s.first}, {s.last}) exceed the "
                            f"{m.num_layers} of {m.id}")
        covered.setdefault(m.id, []).append((s.first, s.last))
        wanted = (m.id,) if s.first > 0 else m.predecessors
        got = feeding.get(sid, {})
        if set(got) != set(wanted):
            raise PlanError(f"slice {sid} needs inputs from {sorted(wanted)}, plan transfers "
                            f"bring {sorted(got)}")
        step = next(st for st in model.task(m.task).steps if st.name == m.step)
        data = tuple(step.inputs) if s.first == 0 and not m.predecessors else ()
        slices.append(SliceProgram(
            slice=s, wave=wave, metaop=m,
            layers=tuple(range(m.first_layer + s.first, m.first_layer + s.last)),
            data_inputs=data, in_transfers=tuple(got[p] for p in wanted),
            out_shape=_per_sample(shapes[m.task][m.step]), kind=m.layer_kind,
        ))
    for mid, ranges in covered.items():
        ranges.sort()
        expect = 0
        for a, b in ranges:
            if a != expect:
                raise PlanError(f"MetaOp {mid}: operators from {expect} are not covered exactly "
                                "once by its slices")
            expect = b
        if expect != ops[mid].num_layers:
            raise PlanError(f"MetaOp {mid}: operators from {expect} are in no slice")
    missing = sorted(set(ops) - set(covered))
    if missing:
        raise PlanError(f"MetaOp {missing[0]} has no slice in the plan")
    t_msgs, t_shapes = [], []
    for t in plan.transfers:
        src = by_id[t.src][1]
        dst = by_id[t.dst][1]
        if t.src_ranks != src.ranks or t.dst_ranks != dst.ranks:
            raise PlanError(f"transfer {t.src} -> {t.dst}: ranks differ from its slices'")
        m = ops[src.metaop]
        t_msgs.append(tuple(messages(m.batch_size, src.ranks, dst.ranks)))
        t_shapes.append(_per_sample(shapes[m.task][m.step]))
    holders: dict[tuple[str, int], set[int]] = {}
    for sp in slices:
        for layer in sp.layers:
            holders.setdefault((sp.metaop.module, layer), set()).update(sp.slice.ranks)
    frozen = {k: tuple(sorted(v)) for k, v in sorted(holders.items())}
    _check_param_groups(plan, frozen)
    sets = {r for r in frozen.values() if len(r) > 1}
    sets |= {sp.slice.ranks for sp in slices
             if sp.kind == "contrastive_loss" and len(sp.slice.ranks) > 1}
    slices.sort(key=lambda sp: (sp.wave, plan.waves[sp.wave].slices.index(sp.slice)))
    return Program(slices=tuple(slices), transfer_messages=tuple(t_msgs),
                   transfer_shapes=tuple(t_shapes), holders=frozen,
                   group_ranks=tuple(sorted(sets)), num_waves=len(plan.waves),
                   tasks=graph.tasks)


def _check_param_groups(plan: Plan, holders: dict[tuple[str, int], tuple[int, ...]]) -> None:
    """Every layer a slice runs must be in exactly one ParamGroup whose ranks are exactly its
    holders: the gradient sync relies on it."""
    seen: dict[tuple[str, int], tuple[int, ...]] = {}
    for i, g in enumerate(plan.param_groups):
        for layer in range(g.first_layer, g.last_layer):
            key = (g.module, layer)
            if key in seen:
                raise PlanError(f"param_groups[{i}]: layer {layer} of {g.module!r} is in two "
                                "groups")
            seen[key] = g.ranks
    for key, ranks in holders.items():
        if seen.get(key) != ranks:
            raise PlanError(f"layer {key[1]} of module {key[0]!r} is held by ranks {list(ranks)} "
                            f"but its param group lists {list(seen.get(key, ()))}")


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
