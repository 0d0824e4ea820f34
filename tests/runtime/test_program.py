"""The pure part of the runtime: row splits, transfer messages, plan checks (no processes)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plans import hand_plan, whole
from spindle_cli.artifacts import MetaOpGraph, ModelSpec, load
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.memory import split_rows
from spindle_cli.runtime.program import (
    PlanError,
    build_program,
    check_executable,
    messages,
)

REPO = Path(__file__).resolve().parents[2]

rank_sets = st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True).map(
    lambda r: tuple(sorted(r)))


@given(st.integers(0, 40), rank_sets, rank_sets)
def test_messages_move_every_row_exactly_once(rows: int, src: tuple[int, ...],
                                              dst: tuple[int, ...]) -> None:
    msgs = messages(rows, src, dst)
    covered = sorted((m.lo, m.hi) for m in msgs)
    assert sum(hi - lo for lo, hi in covered) == rows
    for (_, hi), (lo, _) in zip(covered, covered[1:], strict=False):
        assert hi == lo
    src_rows = dict(zip(src, split_rows(rows, len(src)), strict=True))
    dst_rows = dict(zip(dst, split_rows(rows, len(dst)), strict=True))
    for m in msgs:
        assert src_rows[m.src][0] <= m.lo < m.hi <= src_rows[m.src][1]
        assert dst_rows[m.dst][0] <= m.lo < m.hi <= dst_rows[m.dst][1]
    # canonical order: both sides of a pair see the same sequence
    assert msgs == sorted(msgs, key=lambda m: (src.index(m.src), dst.index(m.dst)))


@pytest.fixture(scope="module")
def model() -> ModelSpec:
    return load(str(REPO / "models" / "tiny-clip.yaml"), ModelSpec)


@pytest.fixture(scope="module")
def graph(model: ModelSpec) -> MetaOpGraph:
    return build_graph(model, dtype="fp32")


def test_program_of_a_whole_model_plan(graph: MetaOpGraph, model: ModelSpec) -> None:
    program = build_program(hand_plan(graph, whole(graph, (0, 1)), 2), graph, model)
    assert len(program.slices) == len(graph.metaops)
    assert program.group_ranks == ((0, 1),)
    enc = [s for s in program.slices if s.metaop.id == "text_vision/vision_enc"]
    assert enc[0].layers == (0, 1, 2) and enc[0].out_shape == (16, 32)
    loss = next(s for s in program.slices if s.metaop.id == "thumb_text/loss")
    # inputs follow MetaOp.predecessors order, not transfer order
    srcs = [program.slice(hand_plan(graph, whole(graph, (0, 1)), 2).transfers[t].src)
            .metaop.id for t in loss.in_transfers]
    assert srcs == list(graph.metaop("thumb_text/loss").predecessors)


def test_tensor_parallel_slices_are_refused(graph: MetaOpGraph, model: ModelSpec) -> None:
    plan = hand_plan(graph, whole(graph, (0, 1)), 2, strategy="tp2")
    with pytest.raises(PlanError, match="tensor parallelism is not supported"):
        build_program(plan, graph, model)
    # the same check, without the graph and model, is what `spindle plan` notes
    with pytest.raises(PlanError) as refused:
        check_executable(plan)
    assert "--no-tensor-parallel" in str(refused.value.hint)
    check_executable(hand_plan(graph, whole(graph, (0, 1)), 2))


def test_param_groups_must_match_the_holders(graph: MetaOpGraph, model: ModelSpec) -> None:
    plan = hand_plan(graph, whole(graph, (0, 1)), 2)
    bad = dataclasses.replace(plan.param_groups[0], ranks=(0,))
    plan = dataclasses.replace(plan, param_groups=(bad, *plan.param_groups[1:]))
    with pytest.raises(PlanError, match=r"param_groups\[0\]\.ranks: \[0\], but layer 0 of "
                                        r"module .* is held by ranks \[0, 1\]"):
        build_program(plan, graph, model)


def test_a_missing_transfer_is_refused(graph: MetaOpGraph, model: ModelSpec) -> None:
    plan = hand_plan(graph, whole(graph, (0, 1)), 2)
    plan = dataclasses.replace(plan, transfers=plan.transfers[1:])
    with pytest.raises(PlanError, match="needs inputs from"):
        build_program(plan, graph, model)


def test_uncovered_operators_are_refused(graph: MetaOpGraph, model: ModelSpec) -> None:
    plan = hand_plan(graph, whole(graph, (0,)), 1)
    waves = []
    for w in plan.waves:
        slices = tuple(dataclasses.replace(s, last=2) if s.metaop == "text_vision/vision_enc"
                       else s for s in w.slices)
        waves.append(dataclasses.replace(w, slices=slices))
    with pytest.raises(PlanError, match="in no slice"):
        build_program(dataclasses.replace(plan, waves=tuple(waves)), graph, model)


def test_rank_summaries_balance_sends_and_receives(graph: MetaOpGraph, model: ModelSpec) -> None:
    from spindle_cli.runtime.program import rank_summaries

    place = whole(graph, (0, 1))
    place["text_vision/text_enc"] = [(0, 2, (2,))]
    program = build_program(hand_plan(graph, place, 3), graph, model)
    summaries = rank_summaries(program, 3)
    assert sum(s.num_sends for s in summaries) == sum(s.num_recvs for s in summaries) > 0
    # rank 2 runs only text_vision's text encoder: it gets 8 rows from two ranks, sends them on
    assert (summaries[2].num_recvs, summaries[2].num_sends, summaries[2].send_rows) == (2, 2, 8)
    assert summaries[2].layers == (("text_enc", 0), ("text_enc", 1))
    assert summaries[2].sync_groups == ((0, 1, 2),)
