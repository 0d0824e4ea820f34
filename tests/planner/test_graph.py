"""Graph contraction: MetaOps, MetaLevels and MetaOp fields, on hand-built and shipped models."""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples

from spindle_cli.artifacts import ModelSpec, input_ref, load
from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.model_check import Shape
from spindle_cli.errors import SpindleError
from spindle_cli.planner.costs import TOKEN_BYTES, layer_cost
from spindle_cli.planner.graph import Operator, build_graph, contract

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "models").glob("*.yaml"))

H = 32
MODULES = {
    "embed": {"kind": "embedding", "hidden": H, "vocab_size": 100, "max_seq_len": 64},
    "enc": {"kind": "transformer_encoder", "num_layers": 3, "hidden": H, "heads": 4, "ffn": 64},
    "enc2": {"kind": "transformer_encoder", "num_layers": 2, "hidden": H, "heads": 4, "ffn": 64},
    "proj_a": {"kind": "projection", "in_dim": H, "hidden": 16},
    "proj_b": {"kind": "projection", "in_dim": H, "hidden": 16, "pool": "mean"},
    "clip": {"kind": "contrastive_loss", "hidden": 16},
    "lm": {"kind": "lm_loss", "hidden": H, "vocab_size": 100, "target_len": 4},
}


def _task(name: str, steps: list[tuple[str, str, list[str]]], *, batch: int = 8,
          seq: int = 10) -> dict[str, object]:
    return {
        "name": name,
        "batch_size": batch,
        "inputs": {"text": {"seq_len": seq}},
        "steps": [{"name": n, "module": m, "inputs": i} for n, m, i in steps],
    }


CHAIN = [("embed", "embed", ["text"]), ("enc", "enc", ["embed"]), ("loss", "lm", ["enc"])]


def test_chain_merges_layers_of_one_step(make_model):
    g = build_graph(make_model(MODULES, [_task("t", CHAIN)]))
    assert [m.id for m in g.metaops] == ["t/embed", "t/enc", "t/loss"]
    enc = g.metaop("t/enc")
    assert (enc.num_layers, enc.first_layer, enc.level) == (3, 0, 1)
    assert enc.predecessors == ("t/embed",)
    assert g.metaop("t/loss").level == 2
    assert g.num_levels == 3


def test_branching_output_feeds_two_metaops(make_model):
    steps = [("embed", "embed", ["text"]), ("enc", "enc", ["embed"]),
             ("pa", "proj_a", ["enc"]), ("pb", "proj_b", ["enc"]), ("loss", "clip", ["pa", "pb"])]
    g = build_graph(make_model(MODULES, [_task("t", steps)]))
    assert len(g.metaops) == 5
    assert g.metaop("t/pa").predecessors == ("t/enc",) == g.metaop("t/pb").predecessors
    assert g.metaop("t/pa").level == g.metaop("t/pb").level == 2
    # the loss lists its inputs in the step's order, not alphabetically or by level
    assert g.metaop("t/loss").predecessors == ("t/pa", "t/pb")


def test_diamond_uses_longest_path_not_bfs_depth(make_model):
    # A -> B -> C plus A -> C: BFS depth puts C next to B (depth 1); longest path puts it at 2.
    steps = [("a", "embed", ["text"]), ("b", "enc2", ["a"]), ("c", "enc", ["b", "a"]),
             ("loss", "lm", ["c"])]
    model = make_model(MODULES, [_task("t", steps)])
    g = build_graph(model)
    level = {m.id: m.level for m in g.metaops}
    assert level == {"t/a": 0, "t/b": 1, "t/c": 2, "t/loss": 3}
    assert g.metaop("t/c").predecessors == ("t/b", "t/a")
    bfs = nx.single_source_shortest_path_length(
        nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c"), ("c", "loss")]), "a")
    assert bfs["c"] == 1 != level["t/c"]
    # c concatenates both inputs along the sequence axis
    c = g.metaop("t/c")
    assert (c.seq_len, c.out_seq_len) == (20, 20)
    assert c.activation_in_bytes == 2 * 8 * 10 * H * 2


def test_levels_respect_predecessors_on_a_long_skip(make_model):
    steps = [("a", "embed", ["text"]), ("b", "enc2", ["a"]), ("b2", "enc2", ["b"]),
             ("c", "enc", ["a", "b2"]), ("loss", "lm", ["c"])]
    g = build_graph(make_model(MODULES, [_task("t", steps)]))
    levels = {m.id: m.level for m in g.metaops}
    for m in g.metaops:
        assert all(levels[p] < m.level for p in m.predecessors)
    assert levels["t/c"] == 3
    # b and b2 run the same module but are separate applications (layers 0-1 twice), so they
    # stay separate MetaOps: a MetaOp covers one contiguous parameter range.
    assert g.metaop("t/b").first_layer == g.metaop("t/b2").first_layer == 0


def test_identical_shapes_across_tasks_share_module_and_signature(make_model):
    model = make_model(MODULES, [_task("t1", CHAIN), _task("t2", CHAIN),
                                 _task("t3", CHAIN, batch=16)])
    g = build_graph(model)
    t1, t2, t3 = (g.metaop(f"{t}/enc") for t in ("t1", "t2", "t3"))
    assert t1.id != t2.id
    assert t1.module == t2.module == t3.module == "enc"
    assert t1.signature == t2.signature
    assert t3.signature != t1.signature  # batch differs, so the workload differs
    assert t1.level == t2.level == 1
    assert len(g.metaops) == 9


def test_signature_ignores_module_and_task_names(make_model):
    modules = {**MODULES, "enc_copy": MODULES["enc"]}
    steps2 = [("embed", "embed", ["text"]), ("x", "enc_copy", ["embed"]), ("loss", "lm", ["x"])]
    g = build_graph(make_model(modules, [_task("t1", CHAIN), _task("t2", steps2)]))
    assert g.metaop("t1/enc").signature == g.metaop("t2/x").signature
    g_long = build_graph(make_model(MODULES, [_task("t1", CHAIN, seq=12)]))
    assert g_long.metaop("t1/enc").signature != g.metaop("t1/enc").signature


def test_metaop_costs_follow_the_cost_model(make_model):
    model = make_model(MODULES, [_task("t", CHAIN, batch=8, seq=10)])
    g = build_graph(model, dtype="fp32")
    enc, embed, loss = g.metaop("t/enc"), g.metaop("t/embed"), g.metaop("t/loss")
    cost = layer_cost(model.modules["enc"], 8, 10, H)
    assert enc.flops_per_layer == pytest.approx(cost.flops_per_sample * 8)
    assert enc.params_per_layer == cost.params
    assert enc.stash_bytes_per_sample == pytest.approx(cost.stash_elems_per_sample * 4, abs=1)
    assert enc.activation_in_bytes == enc.activation_out_bytes == 8 * 10 * H * 4
    assert embed.activation_in_bytes == 8 * 10 * TOKEN_BYTES  # token ids, not the dtype
    assert embed.in_width == 0
    assert (loss.out_width, loss.activation_out_bytes) == (0, 0)
    bf16 = build_graph(model, dtype="bf16").metaop("t/enc")
    assert bf16.activation_in_bytes * 2 == enc.activation_in_bytes
    assert bf16.flops_per_layer == enc.flops_per_layer


def test_task_selection_keeps_model_order_and_names_unknown_tasks(make_model):
    model = make_model(MODULES, [_task("t1", CHAIN), _task("t2", CHAIN), _task("t3", CHAIN)])
    g = build_graph(model, tasks=["t3", "t1"])
    assert g.tasks == ("t1", "t3")
    assert {m.task for m in g.metaops} == {"t1", "t3"}
    with pytest.raises(SpindleError, match="'nope', 'gone'"):
        build_graph(model, tasks=["t1", "nope", "gone"])
    with pytest.raises(SpindleError, match="twice"):
        build_graph(model, tasks=["t1", "t1"])
    with pytest.raises(SpindleError, match="dtype"):
        build_graph(model, dtype="int8")


def test_metaops_sorted_by_level_then_id_and_inputs_recorded(make_model):
    model = make_model(MODULES, [_task("z", CHAIN), _task("a", CHAIN)])
    ref = input_ref(model, "models/hand.yaml")
    g = build_graph(model, inputs=[ref])
    keys = [(m.level, m.id) for m in g.metaops]
    assert keys == sorted(keys)
    assert g.inputs == (ref,)


def test_a_split_step_gets_numbered_metaops(make_model, monkeypatch):
    # With no two layers of the same type, every layer is its own MetaOp: ids get '#k', each
    # piece covers one layer of the module and depends on the previous one.
    monkeypatch.setattr("spindle_cli.planner.graph._same_type", lambda a, b: False)
    g = build_graph(make_model(MODULES, [_task("t", CHAIN)]))
    pieces = [g.metaop(f"t/enc#{k}") for k in range(3)]
    assert [(m.first_layer, m.num_layers, m.level) for m in pieces] == [(0, 1, 1), (1, 1, 2),
                                                                        (2, 1, 3)]
    assert [m.predecessors for m in pieces] == [("t/embed",), ("t/enc#0",), ("t/enc#1",)]
    assert g.metaop("t/loss").predecessors == ("t/enc#2",)
    assert g.metaop("t/embed").id == "t/embed"  # one piece: no suffix


def _op(step: str, layer: int, *, module: str = "m", seq: int = 4) -> Operator:
    shape = Shape("sequence", seq, 8)
    return Operator(task="t", step=step, module=module, layer=layer, batch_size=2,
                    in_shapes=(shape,), out_shape=shape)


def _graph(nodes: dict[str, Operator], edges: list[tuple[str, str]]) -> nx.DiGraph:
    g = nx.DiGraph()
    for name, op in nodes.items():
        g.add_node(name, op=op)
    g.add_edges_from(edges)
    return g


def test_contract_stops_at_branches_and_joins_inside_a_stack():
    # layers 0..3 of one module where layer 1 also feeds x and layer 3 also receives y:
    # 0-1 merge; 1->2 fails out-degree; 2-3 fails in-degree; x, y stay alone.
    nodes = {f"l{i}": _op("s", i) for i in range(4)}
    nodes["x"] = _op("x", 0, module="other")
    nodes["y"] = _op("y", 0, module="other2")
    edges = [("l0", "l1"), ("l1", "l2"), ("l2", "l3"), ("l1", "x"), ("y", "l3")]
    chains = contract(_graph(nodes, edges))
    assert sorted(chains) == sorted([["l0", "l1"], ["l2"], ["l3"], ["x"], ["y"]])


def test_contract_requires_same_type_and_input_shape():
    nodes = {"a0": _op("s", 0), "a1": _op("s", 1, seq=5), "a2": _op("s", 2, seq=5),
             "b": _op("b", 1, module="other", seq=5)}
    chains = contract(_graph(nodes, [("a0", "a1"), ("a1", "a2"), ("a2", "b")]))
    assert sorted(chains) == sorted([["a0"], ["a1", "a2"], ["b"]])


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_model_builds(path):
    model = load(str(path), ModelSpec)
    g = build_graph(model, inputs=[input_ref(model, str(path))])
    num_steps = sum(len(t.steps) for t in model.tasks)
    # a step's layers form one MetaOp (they are chained, identical and of one shape)
    assert len(g.metaops) == num_steps
    layers = sum(model.modules[s.module].num_layers for t in model.tasks for s in t.steps)
    assert sum(m.num_layers for m in g.metaops) == layers
    level = {m.id: m.level for m in g.metaops}
    for m in g.metaops:
        assert all(level[p] < m.level for p in m.predecessors), m.id
        assert m.level == 1 + max((level[p] for p in m.predecessors), default=-1)
        assert m.flops_per_layer > 0
    assert g.num_levels == 1 + max(level.values())
    for name, members in model.task_sets.items():
        sub = build_graph(model, tasks=list(members))
        assert set(sub.tasks) == set(members), name


@st.composite
def _random_dag_models(draw: st.DrawFn) -> tuple[list[tuple[str, str, list[str]]], int]:
    """A task whose transformer steps form a random DAG over one embedding, joined at the end."""
    num_steps = draw(st.integers(1, 6))
    steps: list[tuple[str, str, list[str]]] = [("s0", "embed", ["text"])]
    consumed: set[str] = set()
    for i in range(1, num_steps + 1):
        earlier = [s[0] for s in steps]
        inputs = draw(st.lists(st.sampled_from(earlier), min_size=1, max_size=3, unique=True))
        steps.append((f"s{i}", draw(st.sampled_from(["enc", "enc2"])), inputs))
        consumed.update(inputs)
    dangling = [s[0] for s in steps if s[0] not in consumed]
    steps.append(("join", "enc2", dangling))
    steps.append(("loss", "lm", ["join"]))
    return steps, draw(st.integers(4, 8))  # lm target_len is 4


@settings(max_examples=examples(40), deadline=None)
@given(_random_dag_models())
def test_levels_are_a_longest_path_layering_on_random_dags(case):
    steps, seq = case
    data = {"kind": "model", "version": 1, "name": "random", "modules": MODULES,
            "tasks": [_task("t", steps, seq=seq)]}
    model = parse_artifact(data, "<random>", ModelSpec)
    assert isinstance(model, ModelSpec)
    g = build_graph(model)
    assert len(g.metaops) == len(steps)
    dag = nx.DiGraph()
    dag.add_nodes_from(m.id for m in g.metaops)
    dag.add_edges_from((p, m.id) for m in g.metaops for p in m.predecessors)
    level = {m.id: m.level for m in g.metaops}
    for m in g.metaops:
        # every edge climbs, and every MetaOp sits right above its deepest predecessor
        assert all(level[p] < m.level for p in m.predecessors)
        assert m.level == 0 if not m.predecessors else any(
            level[p] == m.level - 1 for p in m.predecessors)
        assert m.num_layers == model.modules[m.module].num_layers
    for lv in range(g.num_levels):
        same = [m.id for m in g.metaops if m.level == lv]
        assert same, lv
        # MetaOps on one level are independent
        assert not any(nx.has_path(dag, a, b) for a in same for b in same if a != b)
    assert g.num_levels == nx.dag_longest_path_length(dag) + 1
