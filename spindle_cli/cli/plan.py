"""`spindle plan GRAPH PROFILE --cluster C -o PLAN`: waves and placement for a graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, Profile, input_ref
from spindle_cli.artifacts.profile import profiled_device
from spindle_cli.cli._console import err
from spindle_cli.cli.common import (
    check_output,
    emit,
    exit_with,
    load_input,
    memory_text,
    note_stale_graph,
    recorded,
)
from spindle_cli.errors import ArtifactError, OutOfMemory, SpindleError

if TYPE_CHECKING:
    from spindle_cli.planner.options import PlanOptions


@click.command()
@click.argument("graph_path", metavar="GRAPH")
@click.argument("profile_path", metavar="PROFILE")
@click.option("--cluster", "cluster_path", required=True, metavar="CLUSTER",
              help="Cluster spec file (clusters/<name>.yaml).")
@click.option("--planner", type=click.Choice(["spindle", "sequential", "optimus", "distmm"]),
              default="spindle", show_default=True, help="Scheduler (the others are baselines).")
@click.option("--placement", type=click.Choice(["island", "sequential"]), default="island",
              show_default=True, help="Rank placement (sequential: the naive ablation).")
@click.option("--uneven-splits", is_flag=True,
              help="Allow data-parallel counts that do not divide the batch (Spindle keeps "
                   "the plan with even splits only where that simulates faster).")
@click.option("--memory", type=click.Choice(["auto", "none", "zero1", "zero2", "zero3"]),
              default="auto", show_default=True,
              help="ZeRO stage (sharding optimizer state, + gradients, + weights); auto: the "
                   "one whose plan simulates fastest (the least aggressive on ties).")
@click.option("--recompute", type=click.Choice(["auto", "on", "off"]), default="auto",
              show_default=True,
              help="Activation recomputation (+1/3 compute); auto: tried after every ZeRO "
                   "stage without it (Spindle: with the baselines' schedules only where memory "
                   "limited none of those), kept when its plan simulates faster.")
@click.option("--tensor-parallel/--no-tensor-parallel", default=True, show_default=True,
              help="Use the profile's tensor-parallel strategies; --no-tensor-parallel plans "
                   "data-parallel slices only (what `spindle run` executes).")
@click.option("--runnable", is_flag=True,
              help="Only what `spindle run` trains: data-parallel slices (implies "
                   "--no-tensor-parallel) and no ZeRO-3 (--memory auto searches ZeRO 0-2).")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Plan even when PROFILE holds the times of another device than the "
                   "cluster's (a what-if; a note says so).")
@click.option("-o", "--output", default="-", show_default=True, metavar="PLAN",
              help="Output file (.yaml, .yml or .json); '-' for stdout.")
@click.option("--check", is_flag=True,
              help="Re-plan in memory and compare with PLAN (exit 1 on drift, writes nothing).")
def plan(graph_path: str, profile_path: str, cluster_path: str, planner: str, placement: str,
         uneven_splits: bool, memory: str, recompute: str, tensor_parallel: bool,
         runnable: bool, allow_device_mismatch: bool, output: str, check: bool) -> None:
    """Plan the waves of GRAPH on a cluster using PROFILE's scaling curves."""
    from spindle_cli.planner.api import fitting_plan_with_cost
    from spindle_cli.planner.consistency import check_profile
    from spindle_cli.runtime.program import PlanError, check_executable

    given = click.get_current_context().get_parameter_source("tensor_parallel")
    options, ladder = plan_settings(
        planner=planner, placement=placement, uneven_splits=uneven_splits, memory=memory,
        recompute=recompute, tensor_parallel=tensor_parallel, runnable=runnable,
        tensor_parallel_given=given == click.core.ParameterSource.COMMANDLINE)
    check_output(output, check=check, inputs=(graph_path, profile_path, cluster_path))
    graph = load_input(graph_path, MetaOpGraph)
    profile = load_input(profile_path, Profile)
    cluster = load_input(cluster_path, ClusterSpec)
    note_stale_graph(graph, graph_path)
    check_device(profile, profile_path, cluster, cluster_path, allow=allow_device_mismatch)
    check_profile(graph, profile, profile_path)
    inputs = (input_ref(graph, recorded(graph_path, output)),
              input_ref(profile, recorded(profile_path, output)),
              input_ref(cluster, recorded(cluster_path, output)))
    try:
        result, iteration_ms = fitting_plan_with_cost(graph, profile, cluster, options=options,
                                                      ladder=ladder, inputs=inputs)
    except OutOfMemory as e:
        raise e.within(f"{cluster_path}: device.memory_bytes") from None
    gap = result.estimated_iteration_ms / result.lower_bound_ms if result.lower_bound_ms else 1.0
    # the compute alone can be far from the iteration (transfers, gradient sync, ZeRO-3's
    # gathers), and the planner chose by the simulated iteration: say both
    simulated = "" if iteration_ms is None else f", simulated iteration {iteration_ms:.2f} ms"
    err.print(f"{planner}: {len(result.waves)} waves, estimated compute "
              f"{result.estimated_iteration_ms:.2f} ms ({gap:.3f}x of C* "
              f"{result.lower_bound_ms:.2f} ms){simulated}{memory_text(result)}")
    if options.uneven_splits and result.options.get("uneven_splits") != "true":
        err.print("note: --uneven-splits: the plan with even splits only simulated faster, "
                  "and is kept (its options say uneven_splits false)")
    if not check:
        try:
            check_executable(result)
        except PlanError as e:
            err.print(f"note: `spindle run` cannot train this plan: {e}; {e.hint}", soft_wrap=True)
    exit_with(emit(result, output, check=check))


def plan_settings(*, planner: str = "spindle", placement: str = "island",
                  uneven_splits: bool = False, memory: str = "auto", recompute: str = "auto",
                  tensor_parallel: bool = True, runnable: bool = False,
                  tensor_parallel_given: bool = False,
                  ) -> tuple[PlanOptions, tuple[tuple[int, bool], ...]]:
    """The planner options and memory ladder `spindle plan` plans with, from its flags;
    SpindleError where --runnable contradicts --memory zero3 or a --tensor-parallel given."""
    from spindle_cli.planner.api import memory_ladder
    from spindle_cli.planner.options import PlanOptions
    from spindle_cli.runtime.program import EXECUTABLE_ZERO_STAGES

    ladder = memory_ladder(memory, recompute)
    if runnable:
        if memory == "zero3":
            raise SpindleError("--runnable and --memory zero3 contradict each other: `spindle "
                               "run` trains ZeRO-1 and -2 only")
        if tensor_parallel and tensor_parallel_given:
            raise SpindleError("--runnable and --tensor-parallel contradict each other: "
                               "`spindle run` trains data-parallel slices only")
        tensor_parallel = False
        ladder = tuple((z, r) for z, r in ladder if z in EXECUTABLE_ZERO_STAGES)
    return PlanOptions(planner=planner, placement=placement, uneven_splits=uneven_splits,
                       tensor_parallel=tensor_parallel), ladder


def check_device(profile: Profile, profile_path: str, cluster: ClusterSpec, cluster_path: str,
                 *, allow: bool) -> None:
    """Refuse a profile that holds another device's times than the cluster's
    (`profiled_device`), unless `allow`; a note when it cannot tell, or when allowed."""
    try:
        device = profiled_device(profile, profile_path)
    except ArtifactError as e:
        err.print(f"note: nothing checks that {profile_path} holds the times of "
                  f"{cluster_path}'s {cluster.device.name} devices: {e}", soft_wrap=True)
        return
    if device == cluster.device.name:
        return
    problem = (f"{profile_path} holds the times of {device} devices, but {cluster_path} has "
               f"{cluster.device.name}")
    if not allow:
        raise SpindleError(problem, hint="profile the graph for this cluster (spindle profile "
                           f"GRAPH --cluster {cluster_path} ...), or plan with these times "
                           "anyway with --allow-device-mismatch")
    err.print(f"note: {problem}; planning with them (--allow-device-mismatch)", soft_wrap=True)
