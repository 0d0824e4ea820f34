"""`spindle profile GRAPH --hardware HW -o PROFILE`: scaling curves, analytic or measured.

`--hardware a800|h100|h200` models the device with a roofline (`planner/roofline.py`, pure and
deterministic: the same graph gives a byte-identical profile). `--hardware local` measures one
layer per signature and count with torch on this machine (`runtime/measure.py`), with a
progress bar on stderr and a per-point cache, so an interrupted profile resumes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from spindle_cli.artifacts import (
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    input_ref,
    load_recorded_input,
)
from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.files import check_can_create
from spindle_cli.artifacts.limits import MAX_DEVICES, MAX_DEVICES_WHY
from spindle_cli.cli._console import err
from spindle_cli.cli.common import (
    check_output,
    emit,
    exit_with,
    load_input,
    note_stale_graph,
    recorded,
    require_torch,
)
from spindle_cli.errors import CurveError, SpindleError

DEFAULT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MAX_REPEATS = 10_000
"""The most timed iterations per point: only the warm-up is under the per-point time limit,
so an unbounded --repeats ran on with no end."""


def parse_counts(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4), in any order; SpindleError for anything but positive integers, and
    for a count given twice (as `--tasks` refuses a task given twice)."""
    counts = []
    for part in text.split(","):
        part = part.strip()
        # isdigit() alone admits digits int() refuses (superscripts) or that are not ASCII
        if not (part.isascii() and part.isdigit()) or not part.strip("0"):
            raise SpindleError(f"--counts: {part!r} is not a positive integer (in {text!r})")
        digits = part.lstrip("0")
        # int() refuses more than 4300 digits; far fewer already exceed any profile's counts
        if len(digits) > len(str(MAX_DEVICES)):
            raise SpindleError(f"--counts: a count of {len(digits)} digits is above "
                               f"{MAX_DEVICES} ({MAX_DEVICES_WHY})")
        if int(digits) in counts:
            raise SpindleError(f"--counts: {int(digits)} is given twice in {text!r}")
        counts.append(int(digits))
    return tuple(sorted(counts))


def default_counts(cluster: ClusterSpec | None) -> tuple[int, ...]:
    """Powers of two up to the cluster's size (1..64 without a cluster)."""
    top = cluster.num_devices if cluster is not None else DEFAULT_COUNTS[-1]
    out, n = [], 1
    while n <= top:
        out.append(n)
        n *= 2
    return tuple(out)


def graph_model(graph: MetaOpGraph, graph_path: str, output: str) -> tuple[ModelSpec, InputRef]:
    """The model a graph was built from (its `inputs` entry), verified by hash, and its input
    entry for a file written to `output`: the path the model was found at (the graph's entry
    names it from where the graph was made), recorded as `recorded` does."""
    path, model = load_recorded_input(graph, graph_path, ModelSpec)
    return model, input_ref(model, recorded(path, output))


@click.command()
@click.argument("graph_path", metavar="GRAPH")
@click.option("--hardware", required=True, metavar="HW",
              help="local (measure with torch here), or an analytic model: a800, h100, h200 "
                   "(a roofline of that device's own figures; the --cluster gives the memory "
                   "limit and the links).")
@click.option("--cluster", "cluster_path", default=None, metavar="CLUSTER",
              help="Cluster spec: island size and links for tensor parallelism, memory limit.")
@click.option("--counts", default=None, metavar="1,2,4,...",
              help="Device counts to profile (default: powers of two up to the cluster, or 64).")
@click.option("--validate", is_flag=True,
              help="Also profile held-out counts between them and record the fit error there.")
@click.option("--repeats", default=5, show_default=True, type=click.IntRange(1, MAX_REPEATS),
              help="Timed iterations per measured point (median kept).")
@click.option("--no-cache", is_flag=True,
              help="Measure every point again, and cache the new points (local only).")
@click.option("--allow-device-mismatch", is_flag=True,
              help="Measure here (--hardware local) even when the --cluster's devices are "
                   "another kind than this machine's (the profile then gives them this "
                   "machine's times).")
@click.option("-o", "--output", default="-", show_default=True, metavar="PROFILE",
              help="Output file (.yaml, .yml or .json); '-' for stdout.")
@click.option("--check", is_flag=True,
              help="Compare with the existing output file instead of writing (exit 1 on drift); "
                   "analytic profiles only (a measurement never repeats exactly).")
def profile(graph_path: str, hardware: str, cluster_path: str | None, counts: str | None,
            validate: bool, repeats: int, no_cache: bool, allow_device_mismatch: bool,
            output: str, check: bool) -> None:
    """Scaling curves T(n) for every operator signature of GRAPH."""
    from spindle_cli.planner import roofline

    check_output(output, check=check, inputs=(graph_path, cluster_path))
    if hardware != "local":
        ctx = click.get_current_context()
        for name in ("repeats", "no_cache", "allow_device_mismatch"):
            if ctx.get_parameter_source(name) is not ParameterSource.DEFAULT:
                flag = "--" + name.replace("_", "-")
                raise SpindleError(f"{flag} applies to measured profiles (--hardware local); "
                                   f"--hardware {hardware} models its times")
    if allow_device_mismatch and cluster_path is None:
        raise SpindleError("--allow-device-mismatch: there is no --cluster to compare this "
                           "machine's devices with")
    if check and hardware == "local":
        raise SpindleError(
            "--check compares a profile made again with the file, and a measurement never "
            "repeats exactly: it applies to analytic profiles (--hardware a800, h100, h200)",
            hint=f"spindle validate {output} checks a measured profile against its inputs")
    if hardware == "local":
        require_torch("spindle profile --hardware local")
    elif hardware not in roofline.HARDWARE:
        known = ", ".join(["local", *sorted(roofline.HARDWARE)])
        raise SpindleError(f"--hardware: unknown hardware {hardware!r} (known: {known})")
    fit_counts = parse_counts(counts) if counts is not None else None
    graph = load_input(graph_path, MetaOpGraph)
    cluster = load_input(cluster_path, ClusterSpec) if cluster_path else None
    if hardware != "local":  # measuring reads the model: a changed one is an error there
        note_stale_graph(graph, graph_path)
    if fit_counts is None:
        fit_counts = default_counts(cluster)
    if cluster is not None and hardware != "local":
        _check_hardware(hardware, cluster, cluster_path or "")
    if cluster is not None and fit_counts[-1] > cluster.num_devices:
        raise SpindleError(
            f"--counts: {fit_counts[-1]} exceeds the {cluster.num_devices} devices of "
            f"{cluster_path}"
        )
    inputs = [input_ref(graph, recorded(graph_path, output))]
    if cluster is not None:
        inputs.append(input_ref(cluster, recorded(cluster_path or "", output)))
    try:
        if hardware == "local":
            result = _measured(graph, graph_path, output, cluster, cluster_path, fit_counts,
                               validate, repeats, no_cache, allow_device_mismatch, inputs)
        else:
            from spindle_cli.planner.profiling import analytic_profile

            result = analytic_profile(graph, cluster, hardware=hardware, counts=fit_counts,
                                      validate=validate, inputs=inputs)
    except CurveError as e:
        raise CurveError(f"{graph_path}: {e}", hint=e.hint) from None
    _summary(result, validate)
    exit_with(emit(result, output, check=check))


_FORM_FACTOR = re.compile(r"(sxm|pcie|hbm|nvl)\d*")
_MEMORY = re.compile(r"\d+\s*gb")


def same_device(measured: str, named: str) -> bool:
    """Whether a device torch names `measured` (`measure.local_target`: 'NVIDIA
    A800-SXM4-80GB', 'cpu (1 thread)') is of the kind a cluster spec names `named`
    ('A800-SXM4-80GB', 'cpu-core'): both CPUs; or, lower case and without punctuation, one
    name inside the other; or a model token (letters then digits: 'h100') in both, form
    factors ('sxm4', 'hbm3') aside; memory sizes ('80GB') are ignored. Lenient: a pair it
    cannot tell apart passes."""
    a, b = measured.lower(), named.lower()
    if "cpu" in a or "cpu" in b:
        return "cpu" in a and "cpu" in b
    # memory sizes aside ('RTX-4090-24GB' names an 'RTX 4090' too)
    a, b = _MEMORY.sub("", a), _MEMORY.sub("", b)
    squash_a, squash_b = re.sub(r"[^a-z0-9]", "", a), re.sub(r"[^a-z0-9]", "", b)
    if squash_a in squash_b or squash_b in squash_a:
        return True

    def models(name: str) -> set[str]:
        # letters then digits, a space or dash between them allowed ('rtx 4090')
        found = {re.sub(r"[\s_-]", "", t) for t in re.findall(r"[a-z]+[\s_-]?\d+", name)}
        return {t for t in found if not _FORM_FACTOR.fullmatch(t)}

    return bool(models(a) & models(b))


def _check_hardware(hardware: str, cluster: ClusterSpec, cluster_path: str) -> None:
    """Refuse an analytic model of other devices than the cluster's: its profile would time
    them on the cluster's memory and links, and `spindle plan` refuses it there."""
    from spindle_cli.planner import roofline

    device = roofline.HARDWARE[hardware].name
    if device == cluster.device.name:
        return
    same = [k for k, v in sorted(roofline.HARDWARE.items()) if v.name == cluster.device.name]
    known = ", ".join(f"{k} ({v.name})" for k, v in sorted(roofline.HARDWARE.items()))
    raise SpindleError(
        f"--hardware {hardware} models {device} devices, but {cluster_path} has "
        f"{cluster.device.name}",
        hint=(f"use --hardware {same[0]}" if same else
              f"no analytic model of {cluster.device.name} (models: {known}); if the cluster's "
              f"devices are {device}, write device.name: {device} in {cluster_path}; "
              "--hardware local measures the devices of this machine"))


def _summary(result: Any, validate: bool) -> None:
    """One line for people: how many curves and how well they fit (with `validate`, at the
    held-out counts too, or that no curve had one), and how many start above one device or
    end before the largest count: the planner gives a MetaOp only counts on its curve."""
    fit = max(c.max_rel_error for c in result.curves)
    line = f"{len(result.curves)} curves over counts {','.join(map(str, result.counts))}; "
    line += f"max fit error at profiled counts {fit:.1%}"
    held = [c.heldout_rel_error for c in result.curves if c.heldout_rel_error is not None]
    if held:
        line += f", at held-out counts {max(held):.1%}"
    elif validate:
        from spindle_cli.planner.profiling import heldout_counts

        held_out = ",".join(map(str, heldout_counts(result.counts)))
        line += (f"; the held-out counts {held_out} are profiled, but no curve is compared "
                 "there: none is a count a plan may use (a data-parallel count divides the "
                 "batch; --uneven-splits plans are not checked there)"
                 if held_out else
                 "; no held-out count lies between the profiled counts (1,4 holds out 2)")
    from spindle_cli.planner import scaling

    # a curve starts at its first feasible profiled count: a profile of 8 devices alone
    # plans every MetaOp on 8, one after another
    late = sum(scaling.count_range(c)[0] > 1 for c in result.curves)
    if late:
        line += f"; {late} start above 1 device (fewer devices: not profiled, or infeasible)"
    # a curve ends before a count that is slower than fewer devices (planner/curves.py)
    top = max(result.counts)
    cut = sum(scaling.count_range(c)[1] < top for c in result.curves)
    if cut:
        line += f"; {cut} end before {top} devices (more devices: infeasible or slower)"
    err.print(line, soft_wrap=True)


def _usable_cache(directory: Path) -> Path | None:
    """`directory` when the measured points can be cached there; else None, said in a note
    (a read-only working directory): every point is then measured."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        check_can_create(str(directory), directory)
    except (OSError, SpindleError) as e:
        err.print(f"note: measuring without the cache: {e}", soft_wrap=True)
        return None
    return directory


def _measured(graph: MetaOpGraph, graph_path: str, output: str, cluster: ClusterSpec | None,
              cluster_path: str | None, counts: tuple[int, ...], validate: bool, repeats: int,
              no_cache: bool, allow_device_mismatch: bool, inputs: list[InputRef]) -> Any:
    from rich.progress import Progress

    from spindle_cli.artifacts.profile import Fingerprint
    from spindle_cli.planner import profiling
    from spindle_cli.runtime import measure
    from spindle_cli.runtime.model import run_dtype

    model, model_ref = graph_model(graph, graph_path, output)
    inputs.insert(1, model_ref)
    # a cluster of CPU ranks is measured on the CPU, a GPU here or not; in the dtype that
    # `spindle run` trains the graph in
    target = measure.local_target(
        cpu=cluster is not None and "cpu" in cluster.device.name.lower(),
        dtype_name=run_dtype("auto", graph.dtype))
    if cluster is not None and not same_device(target.device_name, cluster.device.name):
        problem = (f"--hardware local measures {target.device_name} here, but {cluster_path} "
                   f"has {cluster.device.name} devices")
        if not allow_device_mismatch:
            this = ("clusters/local-cpu.yaml" if target.device.type == "cpu"
                    else f"device.name: {target.device_name}")
            raise SpindleError(
                f"{problem}: the profile would give them this machine's times",
                hint="measure on a machine with those devices, model them (--hardware a800, "
                     f"h100, h200), give a cluster file of this machine's devices ({this}), "
                     "or measure anyway with --allow-device-mismatch")
        err.print(f"note: {problem}; measuring anyway (--allow-device-mismatch)",
                  soft_wrap=True)
    if target.dtype_name != graph.dtype:
        err.print(f"note: {graph_path} is {graph.dtype}; measuring in {target.dtype_name}, "
                  "which `spindle run` trains it in (the same bytes; fp16 would need loss "
                  "scaling, which the executor does not do)", soft_wrap=True)
    settings = measure.Settings(
        repeats=repeats,
        memory_limit_bytes=cluster.device.memory_bytes if cluster is not None else None,
    )
    cache_dir = _usable_cache(measure.CACHE_DIR)
    links = profiling.local_links(cluster)
    all_counts = sorted(counts + (profiling.heldout_counts(counts) if validate else ()))

    def strategies(op: Any, n: int) -> list[str]:
        spec = model.modules[op.module]
        return profiling.local_strategies(op, n, links, measure.can_shard, spec)

    jobs = profiling.plan_jobs(profiling.signature_ops(graph), all_counts, strategies)
    points: dict[str, list[Any]] = {}
    measured = cached = 0
    with Progress(console=err, transient=False) as bar:
        task = bar.add_task(f"profiling {len(jobs)} points", total=len(jobs))
        for job in jobs:
            if job.batch is None:
                point = profiling.unrunnable_point(job)
            else:
                m, hit = measure.cached_measure(
                    model.modules[job.op.module], job.op, job.num_devices, job.batch,
                    job.strategy, target=target, settings=settings, cache_dir=cache_dir,
                    reuse=not no_cache,
                )
                cached += hit
                measured += not hit
                point = profiling.measured_point(job, m, links, target.dtype_bytes)
            points.setdefault(job.op.signature, []).append(point)
            bar.advance(task)
    unrunnable = len(jobs) - measured - cached
    err.print(f"{measured} point(s) measured, {cached} from the cache"
              + (f", {unrunnable} with fewer samples than data-parallel groups (not run)"
                 if unrunnable else ""))
    optimizer = measure.cached_optimizer(target, settings, cache_dir, reuse=not no_cache)
    device_name = target.device_name
    if any(p.strategy != "dp" for pts in points.values() for p in pts):
        device_name += "; tensor-parallel collectives modelled from the cluster's links"
    return profiling.assemble_profile(
        graph, points, source="measured",
        fingerprint=Fingerprint(hardware="local", device_name=device_name,
                                torch_version=str(measure.torch.__version__),
                                dtype=target.dtype_name),
        counts=counts, validate=validate, optimizer=optimizer, inputs=inputs,
    )
