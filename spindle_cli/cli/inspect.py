"""`spindle validate FILE...` and `spindle show FILE`: tools around the stages, for any kind."""

from __future__ import annotations

import importlib
import importlib.util
import inspect as pyinspect
from typing import Any

import click

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    Plan,
    Profile,
    load_artifact,
)
from spindle_cli.artifacts.base import Artifact, DerivedArtifact
from spindle_cli.artifacts.io import kinds, load_recorded_input
from spindle_cli.cli._console import err, out
from spindle_cli.cli.views import VIEW_MODULES
from spindle_cli.cli.views.gantt import check_chart_paths, check_image_path
from spindle_cli.errors import ArtifactError, InputNotFound, SpindleError, one_line
from spindle_cli.planner.consistency import (
    check_cluster,
    check_plan,
    check_profile,
    check_recorded,
    check_slice_times,
    check_transfers,
)
from spindle_cli.planner.graph import check_graph_of_model
from spindle_cli.planner.options import PlanOptions
from spindle_cli.planner.schedules import options_curves


@click.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate(files: tuple[str, ...]) -> None:
    """Validate artifact files of any kind: each is reported, valid or not (an ok line on
    stdout, an error on stderr), so a CI log of `spindle validate plans/*.yaml` names every
    invalid file (exit 2 when there is one).

    A graph, profile or plan is also checked against the inputs it records, where they are
    found: that they still hash to the recorded sha256, and that a plan schedules its graph
    consistently on its cluster (what simulate and run check before they start)."""
    invalid = 0
    for path in files:
        try:
            obj = load_artifact(path)
            notes = _check_against_inputs(obj, path)
        except SpindleError as e:
            if len(files) == 1:
                raise
            invalid += 1
            # one unwrapped line per file, like the ok lines, so scripts can grep them
            err.print(one_line(f"error: {e}"), soft_wrap=True)
            if e.hint:
                err.print(f"hint: {e.hint}", soft_wrap=True)
            continue
        note = "".join(f"; {n}" for n in notes)
        out.print(one_line(f"ok {path} ({obj.kind}{note})"), soft_wrap=True)
    if invalid:
        raise SpindleError(f"{invalid} of {len(files)} files are invalid (named above)")


_SOURCE = {"metaop_graph": "model", "profile": "metaop_graph"}
"""The input that `spindle graph` and `spindle profile` always record, which validate checks a
graph or profile against: a hand-written one records none, and an edit to it passes
unchecked (`spindle run` refuses a graph without its model)."""


def _check_against_inputs(obj: Artifact, path: str) -> list[str]:
    """Check a derived artifact against its recorded inputs (`validate`); returns what was not
    checked, for the ok line: inputs not found, and a graph or profile that records no
    `_SOURCE` (a plan's graph is checked against its model as a graph is)."""
    if not isinstance(obj, DerivedArtifact):
        return []
    notes = []
    source = _SOURCE.get(obj.kind)
    if source is not None and source not in {ref.kind for ref in obj.inputs}:
        notes.append(f"records no {source.replace('_', ' ')}: not checked against one")
    registry = kinds()
    found: dict[str, Artifact] = {}
    found_at: dict[str, str] = {}
    missing = []
    for ref in obj.inputs:
        if ref.kind in found:
            continue
        try:
            found_at[ref.kind], found[ref.kind] = load_recorded_input(obj, path,
                                                                      registry[ref.kind])
        except InputNotFound:
            missing.append(ref.path)
    model = found.get("model")
    if isinstance(obj, MetaOpGraph) and isinstance(model, ModelSpec):
        check_graph_of_model(obj, path, model)
    graph = found.get("metaop_graph")
    if isinstance(obj, Profile) and isinstance(graph, MetaOpGraph):
        # as `spindle plan` checks it: a curve for every signature, at the graph's sizes
        check_profile(graph, obj, path)
    if isinstance(obj, Plan):
        unrecorded = [k for k in Plan.INPUT_KINDS if k not in {ref.kind for ref in obj.inputs}]
        if unrecorded:
            raise ArtifactError(path, "inputs", f"no {unrecorded[0]} input recorded (a plan "
                                "records the graph, profile and cluster it was made from, "
                                "which simulate and run read)")
        graph, cluster = found.get("metaop_graph"), found.get("cluster")
        profile = found.get("profile")
        # errors name the plan first: a stale graph is reported for each plan made from it
        try:
            if isinstance(graph, MetaOpGraph):
                # as `spindle run` does: the plan's graph must be its model's, where found
                notes += [f"its graph {n}"
                          for n in _check_against_inputs(graph, found_at["metaop_graph"])]
            if isinstance(graph, MetaOpGraph) and isinstance(profile, Profile):
                check_profile(graph, profile, found_at["profile"])
            memory = PlanOptions.of(obj).memory
            if isinstance(graph, MetaOpGraph):
                check_plan(obj, graph)
                check_recorded(obj, graph, memory)
            else:
                check_transfers(obj)  # what the plan says of itself
            if isinstance(cluster, ClusterSpec):
                check_cluster(obj, cluster)
            if (isinstance(graph, MetaOpGraph) and isinstance(profile, Profile)
                    and isinstance(cluster, ClusterSpec)):
                check_slice_times(obj, options_curves(graph, profile, cluster, PlanOptions.of(
                    obj), profile_name=found_at["profile"]))
        except SpindleError as e:
            raise e.within(path) from None
    if missing:
        notes.append(f"not checked against {', '.join(missing)}: not found")
    return notes


def _view(kind: str, path: str) -> Any:
    """The `show` function of the view module for an artifact kind."""
    name = f"spindle_cli.cli.views.{VIEW_MODULES[kind]}"
    if importlib.util.find_spec(name) is None:
        raise SpindleError(f"{path}: no summary for {kind} artifacts in this spindle version",
                           hint=f"spindle validate {path} checks it")
    return importlib.import_module(name).show


@click.command()
@click.argument("path", metavar="FILE")
@click.option("--plot", default=None, metavar="SVG|PNG", help="Plot (profile: scaling curves).")
@click.option("--gantt", default=None, metavar="SVG|PNG", help="Gantt chart of a plan.")
@click.option("--utilization", default=None, metavar="SVG|PNG",
              help="Device utilization of a plan.")
@click.option("--text-gantt", is_flag=True, help="Gantt chart of a plan as text.")
def show(path: str, plot: str | None, gantt: str | None, utilization: str | None,
         text_gantt: bool) -> None:
    """Summarize any artifact (tables on stdout)."""
    given = {"plot": plot, "gantt": gantt, "utilization": utilization, "text_gantt": text_gantt}
    options = {name: value for name, value in given.items() if value not in (None, False)}
    obj = load_artifact(path)
    view = _view(obj.kind, path)
    accepted = pyinspect.signature(view).parameters
    for name in options:
        if name not in accepted:
            flag = "--" + name.replace("_", "-")
            raise SpindleError(f"{path}: {flag} does not apply to a {obj.kind} artifact")
    if "plot" in options:
        check_image_path(options["plot"])
    check_chart_paths(options.get("gantt"), options.get("utilization"))
    view(obj, path, **options)
