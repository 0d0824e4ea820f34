"""`spindle simulate PLAN [--json]`: simulate one training iteration of a plan.

The graph, profile and cluster are the plan's own inputs (their paths are recorded in the
plan); each must still hash to the recorded sha256, so a simulation never silently mixes a plan
with inputs it was not made from.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import click
from rich.table import Table

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, Plan, Profile, load_recorded_input
from spindle_cli.artifacts.canonical import sha256
from spindle_cli.artifacts.plan import PLACEMENTS
from spindle_cli.cli._console import err, out, wrote
from spindle_cli.cli.common import load_input, note_stale_graph
from spindle_cli.cli.views import gantt as charts
from spindle_cli.cli.views import print_table
from spindle_cli.errors import PlanError, SpindleError
from spindle_cli.planner import simulate as simulation
from spindle_cli.planner.assemble import place_again
from spindle_cli.planner.buckets import SYNC_MODES, SyncMode
from spindle_cli.planner.consistency import (
    check_cluster,
    check_plan,
    check_profile,
    check_recorded,
    check_slice_times,
)
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.schedules import options_curves
from spindle_cli.planner.simulate import SimResult
from spindle_cli.units import fmt_bytes

SUMMARY_FIELDS = (
    "planner", "model", "cluster", "num_devices", "iteration_ms", "compute_ms", "forward_ms",
    "backward_ms", "transfer_ms", "sync_ms", "gather_wait_ms", "optimizer_ms", "idle_fraction",
    "transfer_fraction", "lower_bound_ms", "planned_iteration_ms", "peak_memory_bytes",
    "transfer_bytes", "inter_island_bytes",
)
"""Scalar fields of the --json object, in order."""


class PlanInputs(NamedTuple):
    """The graph, profile and cluster a plan was made from, and where the first two are."""

    graph: MetaOpGraph
    profile: Profile
    cluster: ClusterSpec
    graph_path: str
    profile_path: str


def load_plan_inputs(plan: Plan, plan_path: str) -> PlanInputs:
    """The inputs a plan records, checked against their sha256s, the profile against the graph,
    and the plan's slices against the graph and cluster. Where the numbers the plan records
    beside its slices are not theirs (`check_recorded`, which validate and run check), a
    slice's time is not the profile's (`check_slice_times`, which validate checks: run reads
    no profile), or the graph's model changed since, a note says so: a what-if on an edited
    plan goes on."""
    graph_path, graph = load_recorded_input(plan, plan_path, MetaOpGraph)
    profile_path, profile = load_recorded_input(plan, plan_path, Profile)
    _, cluster = load_recorded_input(plan, plan_path, ClusterSpec)
    note_stale_graph(graph, graph_path)
    check_profile(graph, profile, profile_path)
    options = PlanOptions.of(plan)
    try:
        check_plan(plan, graph)
        check_cluster(plan, cluster)
    except SpindleError as e:
        raise e.within(plan_path) from None
    try:
        check_recorded(plan, graph, options.memory)
    except PlanError as e:
        err.print(f"note: {plan_path}: {e}; validate and run refuse it", soft_wrap=True)
    try:
        check_slice_times(plan, options_curves(graph, profile, cluster, options,
                                               profile_name=profile_path))
    except PlanError as e:
        # run reads no profile: it cannot tell
        err.print(f"note: {plan_path}: {e}; validate refuses it", soft_wrap=True)
    return PlanInputs(graph, profile, cluster, graph_path, profile_path)


def simulate_file(plan_path: str, *, sync: SyncMode | None = None,
                  progress: simulation.Progress = "wave",
                  placement: str | None = None) -> tuple[Plan, SimResult, str]:
    """Load a plan and its inputs (`load_plan_inputs`) and simulate it (`sync`: the gradient
    buckets, by default those of the cluster's backend); with `placement`, its waves placed
    again that way first (`assemble.place_again`), and that plan is the one returned; with the
    sha256 of the plan as read (as a file made from it records it)."""
    plan = load_input(plan_path, Plan)
    read_sha256 = sha256(plan)
    graph, profile, cluster, _, _ = load_plan_inputs(plan, plan_path)
    if placement is not None:
        try:
            plan = place_again(plan, graph, profile, cluster, placement=placement)
        except SpindleError as e:
            raise e.within(f"{plan_path}: --placement {placement}") from None
    return plan, simulation.simulate(plan, graph, profile, cluster, sync=sync,
                                     progress=progress), read_sha256


def summary(result: SimResult) -> dict[str, Any]:
    """The --json object: the scalar fields, then per-rank, per-MetaOp and per-wave detail."""
    data: dict[str, Any] = {name: getattr(result, name) for name in SUMMARY_FIELDS}
    data["ranks"] = [
        {"rank": r.rank, "busy_ms": r.busy_ms, "utilization": r.utilization,
         "activation_bytes": r.activation_bytes, "peak_memory_bytes": r.peak_memory_bytes}
        for r in result.ranks
    ]
    data["metaops"] = [
        {"metaop": m.metaop, "module": m.module, "device_ms": m.device_ms, "mfu": m.mfu}
        for m in result.metaops
    ]
    data["waves"] = [
        {"index": w.index, "forward_start_ms": w.forward_start_ms,
         "forward_end_ms": w.forward_end_ms, "forward_wait_ms": w.forward_wait_ms,
         "backward_start_ms": w.backward_start_ms, "backward_end_ms": w.backward_end_ms,
         "backward_wait_ms": w.backward_wait_ms}
        for w in result.waves
    ]
    data["syncs"] = [
        {"module": s.module, "first_layer": s.first_layer, "last_layer": s.last_layer,
         "num_ranks": len(s.ranks), "bytes": s.bytes, "end_ms": s.end_ms}
        for s in result.syncs
    ]
    return data


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def print_report(result: SimResult, path: str, progress: simulation.Progress = "wave") -> None:
    """The rich breakdown: iteration, per-rank and per-MetaOp tables (`progress` as
    simulated: by rank, the rank ending the iteration also waits for its slice peers and
    parameter gathers, and that wait is counted with its transfers)."""
    r = result
    out.print(f"{path}: {r.model} on {r.cluster} ({r.num_devices} devices), planner {r.planner}")
    table = Table(title="one iteration")
    table.add_column("part")
    table.add_column("ms", justify="right")
    table.add_column("share", justify="right")
    rows = [("forward compute", r.forward_ms), ("backward compute", r.backward_ms),
            ("inter-wave transfer (exposed)" if progress == "wave"
             else "transfers and waits for peers", r.transfer_ms),
            ("parameter sync", r.sync_ms),
            ("optimizer step", r.optimizer_ms)]
    for name, ms in rows:
        table.add_row(name, f"{ms:.2f}", _pct(ms, r.iteration_ms))
        if name == "parameter sync" and r.gather_wait_ms:
            # ZeRO: the waits for all-gathers (the forward's; ZeRO-3's backward too), not the
            # gradients' reduction
            table.add_row("  of it, waiting for all-gathers", f"{r.gather_wait_ms:.2f}",
                          _pct(r.gather_wait_ms, r.iteration_ms))
    table.add_section()
    table.add_row("iteration", f"{r.iteration_ms:.2f}", "100.0%")
    table.add_row("relaxed optimum, level by level (sum of C*)", f"{r.lower_bound_ms:.2f}",
                  f"x{r.iteration_ms / r.lower_bound_ms:.3f}" if r.lower_bound_ms > 0 else "-")
    table.add_row("planner's compute estimate", f"{r.planned_iteration_ms:.2f}", "")
    print_table(table)
    out.print(f"idle: {100 * r.idle_fraction:.1f}% of device time; bytes leaving their rank "
              f"between waves, activations and gradients: {fmt_bytes(r.transfer_bytes)} "
              f"({fmt_bytes(r.inter_island_bytes)} across islands); peak memory "
              f"{fmt_bytes(r.peak_memory_bytes)}")

    ranks = Table(title="per rank")
    for col in ("rank", "busy ms", "utilization", "activations", "peak memory"):
        ranks.add_column(col, justify="right")
    for x in r.ranks:
        ranks.add_row(str(x.rank), f"{x.busy_ms:.2f}", f"{100 * x.utilization:.1f}%",
                      fmt_bytes(x.activation_bytes), fmt_bytes(x.peak_memory_bytes))
    print_table(ranks)

    metaops = Table(title="per MetaOp")
    for col in ("MetaOp", "module", "device ms", "MFU"):
        metaops.add_column(col, justify="left" if col in ("MetaOp", "module") else "right")
    for m in r.metaops:
        metaops.add_row(m.metaop, m.module, f"{m.device_ms:.2f}", f"{100 * m.mfu:.1f}%")
    print_table(metaops)


@click.command()
@click.argument("plan_path", metavar="PLAN")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("--gantt", default=None, metavar="SVG|PNG",
              help="Also draw the simulated timeline as a Gantt chart.")
@click.option("--utilization", default=None, metavar="SVG|PNG",
              help="Also draw the share of devices computing over the simulated iteration.")
@click.option("--text-gantt", is_flag=True,
              help="Print the simulated timeline as a text Gantt chart after the report "
                   "(not with --json).")
@click.option("--sync", "sync", type=click.Choice(["auto", *SYNC_MODES]), default="auto",
              show_default=True,
              help="Gradient buckets: chunked, chunks of a rank set's layers each as soon as "
                   "the backward wave that completes them has passed them (what `spindle run` "
                   "does on nccl); per-wave, one per rank set and wave once that wave's "
                   "slices of its layers have finished their backward; per-set, one per "
                   "rank set once all its layers are done (on gloo); after-backward, every "
                   "group after the last backward wave; auto, those of the cluster's backend "
                   "(what the planner simulates).")
@click.option("--progress", type=click.Choice(simulation.PROGRESS_MODES), default="wave",
              show_default=True,
              help="wave: every wave is a barrier (the planner's model); rank: each rank "
                   "goes on once its own messages have arrived, as `spindle run` executes a "
                   "plan (the breakdown is then the time of the rank that ends the "
                   "iteration, and its transfer part includes waiting for slice peers and "
                   "parameter gathers).")
@click.option("--placement", type=click.Choice(PLACEMENTS), default=None,
              help="Simulate the plan's waves placed again this way (every slice keeps its "
                   "MetaOp, operators and device count; only its ranks change): what the "
                   "placement buys on this plan, the paper's Fig. 10 ablation. 'island' is "
                   "the plain island placement: a kept plan's home, reserved or "
                   "consecutive ranks are not kept, so compare with the plan as it is (no "
                   "--placement).")
def simulate(plan_path: str, as_json: bool, gantt: str | None, utilization: str | None,
             text_gantt: bool, sync: str, progress: simulation.Progress,
             placement: str | None) -> None:
    """Simulate one training iteration of PLAN on its cluster."""
    if as_json and text_gantt:
        raise click.UsageError("--text-gantt prints to stdout, as --json does: give one")
    charts.check_chart_paths(gantt, utilization)
    plan, result, plan_sha256 = simulate_file(plan_path, sync=None if sync == "auto" else sync,
                                              progress=progress, placement=placement)
    if gantt is not None:
        charts.write_gantt(plan, gantt, sim=result)
        wrote(gantt)
    if utilization is not None:
        charts.write_utilization(plan, utilization, sim=result)
        wrote(utilization)
    if as_json:
        click.echo(json.dumps({**summary(result),
                               "placement": plan.options.get("placement", "island"),
                               "placed_again": placement is not None,
                               "plan": plan_path, "plan_sha256": plan_sha256},
                              indent=2))
    else:
        if placement is not None:
            out.print(f"waves placed again: {placement} placement")
        print_report(result, plan_path, progress)
        if text_gantt:
            out.print(charts.text_gantt(plan, sim=result))

