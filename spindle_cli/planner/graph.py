"""Graph contraction (paper §3.1): the operator DAG of the selected tasks -> MetaOps and
MetaLevels.

The operator graph has one node per layer: a step whose module has `num_layers` = L becomes L
chained operators, and each step input that is another step adds an edge from that step's last
operator to this step's first operator (task data inputs are not operators). Two operators i -> j
are merged into one MetaOp iff

1. there is an edge i -> j with out-degree(i) = 1 and in-degree(j) = 1, and
2. they have the same operator type and the same input shape.

"Same operator type" means the same layer kind, the same module and the same dimensions, and j
is the layer that follows i inside that module. Requiring the same module (and consecutive
layers) makes every MetaOp map to one contiguous parameter range `[first_layer, first_layer + L)`
of one module, which is what the plan's parameter groups and the runtime need; operators of
different tasks are never connected, so two tasks that use a module with identical shapes get
separate MetaOps that share that module's parameters and one `signature` (one scaling curve).

The MetaLevel of a MetaOp is its longest-path depth (1 + the maximum level of its predecessors),
so MetaOps on one level never depend on each other. BFS depth (e.g.
`nx.topological_generations` counted from the sources) is not enough in general: with A -> B -> C
and A -> C, BFS puts C next to B although C depends on B.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import networkx as nx

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.io import as_written, derived_header, load_recorded_input
from spindle_cli.artifacts.model import ModelSpec, ModuleSpec, TaskSpec
from spindle_cli.artifacts.model_check import Shape, infer_shapes, topo_steps
from spindle_cli.errors import SpindleError
from spindle_cli.planner.costs import TOKEN_BYTES, layer_cost
from spindle_cli.planner.memory import ELEMENT_BYTES

DTYPE_BYTES = {d: ELEMENT_BYTES[d] for d in ("fp32", "bf16", "fp16")}
"""Bytes per element of each dtype a graph may count in (a run may also train in fp64)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Operator:
    """One layer of one step of one task, with the shape it runs on (whole task batch)."""

    task: str
    step: str
    module: str
    layer: int
    """Index of this layer inside its module."""
    batch_size: int
    in_shapes: tuple[Shape, ...]
    """Per-sample shapes of the step's inputs (for layers after the first: the previous output)."""
    out_shape: Shape

    @property
    def seq_len(self) -> int:
        """Input positions per sample; several sequence inputs are concatenated."""
        if len(self.in_shapes) > 1 and all(s.form == "sequence" for s in self.in_shapes):
            return sum(s.seq for s in self.in_shapes)
        return self.in_shapes[0].seq

    @property
    def in_width(self) -> int:
        """Input width per position (0 for token ids)."""
        return self.in_shapes[0].width

    def input_key(self) -> tuple[int, int, int]:
        """The input data size the contraction rule compares: (batch, seq, width)."""
        return (self.batch_size, self.seq_len, self.in_width)


def select_tasks(model: ModelSpec, tasks: Sequence[str] | None) -> list[TaskSpec]:
    """The selected tasks in model order; `None` selects every task."""
    if tasks is None:
        return list(model.tasks)
    known = [t.name for t in model.tasks]
    unknown = [t for t in tasks if t not in known]
    if unknown:
        names = ", ".join(repr(t) for t in unknown)
        raise SpindleError(
            f"unknown task{'s' if len(unknown) > 1 else ''} {names} "
            f"(model {model.name!r} has: {', '.join(known)})"
        )
    duplicates = sorted({t for t in tasks if list(tasks).count(t) > 1})
    if duplicates:
        raise SpindleError(f"task {duplicates[0]!r} is selected twice")
    if not tasks:
        raise SpindleError("no task selected")
    wanted = set(tasks)
    return [t for t in model.tasks if t.name in wanted]


def operator_graph(model: ModelSpec, tasks: Iterable[TaskSpec]) -> nx.DiGraph:
    """One node per layer (attribute `op`: an Operator) of every step of the given tasks.

    Each node's `preds` attribute lists its predecessor nodes in the step's input order (a
    DiGraph alone does not keep that order).
    """
    g = nx.DiGraph()
    for task in tasks:
        shapes = infer_shapes(model, task)
        by_name = {s.name: s for s in task.steps}
        for name in topo_steps(task, task.name):
            step = by_name[name]
            mod = model.modules[step.module]
            producers = [(task.name, src, model.modules[by_name[src].module].num_layers - 1)
                         for src in step.inputs if src in by_name]
            in_shapes = tuple(shapes[src] for src in step.inputs)
            for layer in range(mod.num_layers):
                node = (task.name, step.name, layer)
                op = Operator(task=task.name, step=step.name, module=step.module, layer=layer,
                              batch_size=task.batch_size, in_shapes=in_shapes,
                              out_shape=shapes[step.name])
                preds = producers if layer == 0 else [(task.name, step.name, layer - 1)]
                g.add_node(node, op=op, preds=list(preds))
                for p in preds:
                    g.add_edge(p, node)
                # Layers after the first see the previous layer's output.
                in_shapes = (shapes[step.name],)
    return g


def _same_type(a: Operator, b: Operator) -> bool:
    # Same module implies same kind and dimensions; consecutive layers keep one parameter range.
    return a.module == b.module and b.layer == a.layer + 1


def contract(g: nx.DiGraph) -> list[list[tuple[str, str, int]]]:
    """Chains of operators merged by the contraction rule, each in operator order."""
    merged_into: dict[tuple[str, str, int], tuple[str, str, int]] = {}
    for i, j in g.edges:
        a, b = g.nodes[i]["op"], g.nodes[j]["op"]
        if (g.out_degree(i) == 1 and g.in_degree(j) == 1 and _same_type(a, b)
                and a.input_key() == b.input_key()):
            merged_into[j] = i
    chains: list[list[tuple[str, str, int]]] = []
    for node in nx.topological_sort(g):
        if node in merged_into:
            continue
        chain = [node]
        while True:
            succ = [s for s in g.successors(chain[-1]) if merged_into.get(s) == chain[-1]]
            if not succ:
                break
            chain.append(succ[0])
        chains.append(chain)
    return chains


def signature(module: ModuleSpec, op: Operator, dtype: str) -> str:
    """Everything one operator's time and memory depend on, and neither its module nor its
    task name, so MetaOps of different tasks with identical workloads share one scaling curve
    (and one measurement): the module's sizes (`max_seq_len`: its position table; `pool`: how
    a projection pools) and the operator's input."""
    return (f"{module.kind}|hidden={module.hidden}|heads={module.heads}|ffn={module.ffn}"
            f"|in_width={op.in_width}|vocab={module.vocab_size}|target_len={module.target_len}"
            f"|max_seq_len={module.max_seq_len}|pool={module.pool}"
            f"|batch={op.batch_size}|seq={op.seq_len}|dtype={dtype}")


def _bytes(shape: Shape, batch_size: int, dtype_bytes: int) -> int:
    if shape.form == "tokens":
        return batch_size * shape.seq * TOKEN_BYTES
    return batch_size * shape.seq * shape.width * dtype_bytes


def _metaop(model: ModelSpec, g: nx.DiGraph, chain: list[tuple[str, str, int]], metaop_id: str,
            level: int, predecessors: tuple[str, ...], dtype: str) -> MetaOp:
    first: Operator = g.nodes[chain[0]]["op"]
    mod = model.modules[first.module]
    nbytes = DTYPE_BYTES[dtype]
    cost = layer_cost(mod, first.batch_size, first.seq_len, first.in_width)
    return MetaOp(
        id=metaop_id,
        task=first.task,
        step=first.step,
        module=first.module,
        layer_kind=mod.kind,
        first_layer=first.layer,
        num_layers=len(chain),
        batch_size=first.batch_size,
        seq_len=first.seq_len,
        in_width=first.in_width,
        out_seq_len=first.out_shape.seq,
        out_width=first.out_shape.width,
        level=level,
        predecessors=predecessors,
        signature=signature(mod, first, dtype),
        flops_per_layer=cost.flops_per_sample * first.batch_size,
        params_per_layer=cost.params,
        activation_in_bytes=sum(_bytes(s, first.batch_size, nbytes) for s in first.in_shapes),
        activation_out_bytes=_bytes(first.out_shape, first.batch_size, nbytes),
        stash_bytes_per_sample=math.ceil(cost.stash_elems_per_sample * nbytes),
    )


def build_graph(
    model: ModelSpec,
    *,
    tasks: Sequence[str] | None = None,
    dtype: str = "bf16",
    inputs: Sequence[InputRef] = (),
) -> MetaOpGraph:
    """Contract the operator DAG of the selected tasks into a MetaOp graph.

    `tasks` names the tasks (None: all of them); `inputs` is the InputRef of the model file.
    Raises SpindleError for unknown or repeated task names or an unknown dtype.
    """
    if dtype not in DTYPE_BYTES:
        raise SpindleError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPE_BYTES)})")
    selected = select_tasks(model, tasks)
    g = operator_graph(model, selected)
    chains = contract(g)

    owner = {node: ci for ci, chain in enumerate(chains) for node in chain}
    pieces_of_step: dict[tuple[str, str], list[int]] = {}
    for ci, chain in enumerate(chains):
        task, step, _ = chain[0]
        pieces_of_step.setdefault((task, step), []).append(ci)
    ids: list[str] = [""] * len(chains)
    for (task, step), cis in pieces_of_step.items():
        cis.sort(key=lambda ci: chains[ci][0][2])
        for k, ci in enumerate(cis):
            ids[ci] = f"{task}/{step}" if len(cis) == 1 else f"{task}/{step}#{k}"

    # chains come in topological order of their first operators, and a chain's predecessors
    # feed its first operator, so each predecessor's level is known when it is needed.
    levels: list[int] = [0] * len(chains)
    preds: list[tuple[str, ...]] = []
    for ci, chain in enumerate(chains):
        pred_chains = [owner[p] for p in g.nodes[chain[0]]["preds"]]
        levels[ci] = 1 + max((levels[p] for p in pred_chains), default=-1)
        preds.append(tuple(ids[p] for p in pred_chains))

    metaops = sorted(
        (_metaop(model, g, chain, ids[ci], levels[ci], preds[ci], dtype)
         for ci, chain in enumerate(chains)),
        key=lambda m: (m.level, m.id),
    )
    return MetaOpGraph(
        **derived_header(MetaOpGraph, list(inputs)),
        model=model.name,
        tasks=tuple(t.name for t in selected),
        dtype=dtype,  # type: ignore[arg-type]
        num_levels=1 + max(levels),
        metaops=tuple(metaops),
    )


def model_of(graph: MetaOpGraph, graph_path: str) -> ModelSpec:
    """The model `graph` (read from `graph_path`) records, found and verified by hash
    (`load_recorded_input`), of which it must be the graph (`check_graph_of_model`)."""
    _, model = load_recorded_input(graph, graph_path, ModelSpec)
    check_graph_of_model(graph, graph_path, model)
    return model


def check_graph_of_model(graph: MetaOpGraph, graph_path: str, model: ModelSpec) -> None:
    """SpindleError unless `graph` (read from `graph_path`) is the graph `build_graph` makes of
    `model` for its tasks and dtype, compared as the file holds it (a large model's FLOPs are
    rounded when written): a hand-edited graph is neither trained (`spindle run`) nor passed
    (`spindle validate`) as if it were the model."""
    made = build_graph(model, tasks=list(graph.tasks), dtype=graph.dtype, inputs=graph.inputs)
    if as_written(replace(made, producer=graph.producer)) != graph:
        raise SpindleError(f"{graph_path}: is not the graph its model gives (edited since "
                           "spindle graph wrote it?)",
                           hint=f"spindle graph ... --check -o {graph_path} shows the difference")
