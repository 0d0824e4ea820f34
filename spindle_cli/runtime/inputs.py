"""Loading what a run needs and checking it against the world, before any collective.

The plan names its graph in `inputs`, and the graph names its model; both are verified by
sha256 so a run never trains a model other than the one the plan was made for. Pure Python (no
torch): `spindle run` calls it before launching workers, and every worker calls it again.
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle_cli.artifacts import MetaOpGraph, ModelSpec, Plan, load, load_recorded_input
from spindle_cli.errors import SpindleError
from spindle_cli.planner.consistency import check_recorded
from spindle_cli.planner.graph import model_of
from spindle_cli.planner.memory import run_bytes
from spindle_cli.planner.options import PlanOptions
from spindle_cli.runtime.program import PlanError, Program, build_program
from spindle_cli.units import fmt_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInputs:
    """A plan with the graph and model it was made from."""

    plan_path: str
    plan: Plan
    graph: MetaOpGraph
    model: ModelSpec
    program: Program


def load_run_inputs(plan_path: str) -> RunInputs:
    """Load and cross-check the plan, its graph and its model: the graph must be the one its
    model gives (`build_graph`), so a hand-edited graph is not trained as if it were the
    model; and the plan must schedule the graph (`build_program`)."""
    plan = load(plan_path, Plan)
    graph_path, graph = load_recorded_input(plan, plan_path, MetaOpGraph)
    model = model_of(graph, graph_path)
    try:
        memory = PlanOptions.of(plan).memory
        program = build_program(plan, graph, model)
        check_recorded(plan, graph, memory)
    except SpindleError as e:
        raise e.within(plan_path) from None
    return RunInputs(plan_path=plan_path, plan=plan, graph=graph, model=model, program=program)


def check_world(plan: Plan, world_size: int, *, rank: int | None = None,
                memory_bytes: int | None = None, planned: str = "", dtype: str = "") -> None:
    """Refuse a plan that does not fit the world: its size, and (with `rank` and
    `memory_bytes`) the rank's estimated memory, counted in `planned` (its graph's dtype)
    and trained in `dtype` (`memory.run_bytes`; as planned where either is '')."""
    if world_size != plan.num_devices:
        raise SpindleError(f"the plan needs {plan.num_devices} ranks, the run has {world_size}",
                           hint=f"--nproc-per-node times --nnodes must be {plan.num_devices}")
    if rank is None or memory_bytes is None:
        return
    memory = next((m for m in plan.memory if m.rank == rank), None)
    if memory is None:
        return
    scaled = bool(planned and dtype)
    need = run_bytes(memory, planned, dtype) if scaled else memory.total_bytes
    if need > memory_bytes:
        trained = f" trained in {dtype}" if scaled and planned != dtype else ""
        raise PlanError(f"rank {rank} needs an estimated {fmt_bytes(need)}{trained}, its device "
                        f"has {fmt_bytes(memory_bytes)}")
