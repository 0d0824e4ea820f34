"""Building Profile artifacts: operator signatures -> profiled points -> fitted curves.

The same assembly serves both sources. `analytic_profile` makes the points with the roofline
model (pure, here); `spindle profile --hardware local` measures them with torch
(`spindle_cli.runtime.measure`) and hands them to `assemble_profile`.

How infeasible counts are expressed: every tried (count, strategy) is a point; a point that ran
out of memory, timed out or had more data-parallel groups than samples is stored with
feasible=false and a note, and is left out of the fit. The fit covers the longest run of
consecutive profiled counts that starts at the first count with a feasible strategy; the first
count after it with no feasible strategy ends the pieces (so does the first count slower than
the one before it, `curves.helpful_run`), and `scaling.count_range` (hence `scaling.is_valid`)
then closes the counts beyond. Held-out counts (`--validate`) are points at counts that are not
in `Profile.counts`; they are never fitted, only compared. The check is what the planner would
rely on: at each held-out count that is a valid allocation (`scaling.is_valid`), the time the
curve gives for the strategy it uses there against the profiled time of that strategy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.limits import MAX_DEVICES, MAX_DEVICES_WHY
from spindle_cli.artifacts.model import ModuleSpec
from spindle_cli.artifacts.profile import (
    Curve,
    Fingerprint,
    MemoryModel,
    OptimizerCost,
    Profile,
    ProfilePoint,
    tp_degree,
)
from spindle_cli.errors import CurveError, FieldError, SpindleError
from spindle_cli.planner import roofline, scaling
from spindle_cli.planner.curves import MEASURED_NOISE_REL, Sample, fit_curve
from spindle_cli.planner.memory import ELEMENT_BYTES, least_layer_bytes

NO_SAMPLES_NOTE = "more data-parallel groups than samples"


class Measurement(Protocol):
    """What a measurement hands back (`spindle_cli.runtime.measure.Measurement`)."""

    @property
    def feasible(self) -> bool: ...
    @property
    def time_ms(self) -> float: ...
    @property
    def peak_memory_bytes(self) -> int: ...
    @property
    def note(self) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One point to profile: an operator signature (by its representative MetaOp), a device
    count and a strategy, with the per-group batch that implies."""

    op: MetaOp
    num_devices: int
    strategy: str
    batch: int | None
    """ceil(B / groups); None when there are more groups than samples (never run)."""


def signature_ops(graph: MetaOpGraph) -> list[MetaOp]:
    """One representative MetaOp per signature (the first by id), sorted by signature (a graph
    holds MetaOps of one signature to one batch size: `MetaOpGraph`)."""
    reps: dict[str, MetaOp] = {}
    for m in sorted(graph.metaops, key=lambda m: m.id):
        reps.setdefault(m.signature, m)
    return [reps[s] for s in sorted(reps)]


def check_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """Counts sorted and de-duplicated; SpindleError unless all are positive integers a
    profile may hold (at most MAX_DEVICES)."""
    if not counts:
        raise SpindleError("no device counts to profile")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise SpindleError(f"device counts must be positive integers, got {c!r}")
        if c > MAX_DEVICES:
            raise SpindleError(f"device count {c} is above {MAX_DEVICES} ({MAX_DEVICES_WHY})")
    return tuple(sorted(set(counts)))


def heldout_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """Validation counts: the midpoint of every pair of consecutive profiled counts that has
    room for one (1,2,4,...,64 -> 3,6,12,24,48)."""
    out = []
    for lo, hi in zip(counts, counts[1:], strict=False):
        mid = (lo + hi) // 2
        if lo < mid < hi:
            out.append(mid)
    return tuple(out)


def plan_jobs(
    ops: Iterable[MetaOp],
    counts: Sequence[int],
    strategies: Callable[[MetaOp, int], list[str]],
) -> list[Job]:
    """Every (signature, count, strategy) to profile, in a stable order."""
    jobs = []
    for op in ops:
        for n in counts:
            for s in strategies(op, n):
                batch = roofline.per_device_batch(op, n, s)
                jobs.append(Job(op=op, num_devices=n, strategy=s, batch=batch))
    return jobs


def unrunnable_point(job: Job) -> ProfilePoint:
    """The infeasible point of a job with more groups than samples."""
    return ProfilePoint(
        num_devices=job.num_devices,
        strategy=job.strategy,
        feasible=False,
        time_ms=0.0,
        peak_memory_bytes=0,
        note=NO_SAMPLES_NOTE,
    )


def work_devices(batch_size: int, n: int, strategy: str) -> float:
    """The (fractional) count whose B / n equals the per-device work a point really ran:
    n * (B / groups) / ceil(B / groups); n itself when the groups divide B."""
    groups = n // tp_degree(strategy)
    return n * (batch_size / groups) / math.ceil(batch_size / groups)


def _best(points: Iterable[ProfilePoint], batch_size: int) -> dict[int, Sample]:
    """The fastest feasible strategy per count (ties: the first in profiling order)."""
    best: dict[int, Sample] = {}
    for p in points:
        if not p.feasible:
            continue
        cur = best.get(p.num_devices)
        if cur is None or p.time_ms < cur.time_ms:
            best[p.num_devices] = Sample(
                num_devices=p.num_devices,
                time_ms=p.time_ms,
                strategy=p.strategy,
                work_devices=work_devices(batch_size, p.num_devices, p.strategy),
            )
    return best


def fitted_run(counts: Sequence[int], best: dict[int, Sample]) -> list[Sample]:
    """Samples of the consecutive profiled counts the fit covers (see the module docstring)."""
    run: list[Sample] = []
    for n in counts:
        if n in best:
            run.append(best[n])
        elif run:
            break
    return run


def build_curve(
    op: MetaOp,
    points: Sequence[ProfilePoint],
    *,
    counts: Sequence[int],
    memory: MemoryModel,
    validate: bool,
    noise_rel: float = 0.0,
) -> Curve:
    """The fitted Curve of one signature from all of its points. `noise_rel` is the timing
    noise a slower count may show before it ends the curve (`curves.helpful_run`)."""
    best = _best(points, op.batch_size)
    samples = fitted_run(counts, best)
    if not samples:
        # each count's reasons, counts ascending and its strategies in order
        by_count: dict[int, list[str]] = {}
        for p in sorted(points, key=lambda p: (p.num_devices, p.strategy)):
            if p.note and f"{p.strategy}: {p.note}" not in by_count.get(p.num_devices, []):
                by_count.setdefault(p.num_devices, []).append(f"{p.strategy}: {p.note}")
        notes = {p.note for p in points if p.note}
        # 'out of memory: needs N of M bytes' is the cluster's limit; a bare 'out of memory'
        # the device a measurement ran on
        limit = any(n.startswith("out of memory: needs") for n in notes)
        device = "out of memory" in notes
        reasons = "; ".join(f"{n} device{'s' if n > 1 else ''}: {', '.join(why)}"
                            for n, why in by_count.items())
        raise CurveError(
            f"signature {op.signature!r} (MetaOp {op.id}): no feasible strategy at any "
            "profiled count" + (f" ({reasons})" if reasons else ""),
            hint=("one layer does not fit a device at any profiled count: check "
                  "device.memory_bytes of the --cluster file (in bytes), or profile more "
                  "devices (--counts), a smaller model or batch" if limit else
                  "one layer does not fit the device it was measured on: profile a smaller "
                  "model or batch, or on a larger device" if device else None))
    try:
        curve = fit_curve(
            signature=op.signature,
            batch_size=op.batch_size,
            samples=samples,
            points=tuple(sorted(points, key=lambda p: (p.num_devices, p.strategy))),
            memory=memory,
            noise_rel=noise_rel,
            flat=not _work_splits(op, samples),
        )
    except FieldError as e:
        raise CurveError(f"signature {op.signature!r} (MetaOp {op.id}): its fitted curve is "
                         f"not a valid one: {e}",
                         hint="check the graph's sizes (flops_per_layer, bytes) of this "
                              "MetaOp") from None
    if not validate:
        return curve
    errors = [e.rel_error for e in heldout_errors(curve, counts)]
    return replace(curve, heldout_rel_error=max(errors) if errors else None)


def tp_allowed(degree: int, tensor_parallel: bool, island_size: int | None) -> bool:
    """Whether a plan may use a strategy of this tensor-parallel degree (1: data parallel):
    only with `tensor_parallel`, and with `island_size`, only a degree that divides it (a
    group stays inside one island, and the islands split into whole groups)."""
    return degree == 1 or (tensor_parallel
                           and (island_size is None or island_size % degree == 0))


def allowed_curve(profile: Profile, op: MetaOp, tensor_parallel: bool,
                  island_size: int | None) -> Curve:
    """The curve of `op`'s signature as a plan sees it that may use only the strategies
    `tp_allowed`: the profile's own where its pieces use only those; else fitted again from
    the points of the strategies allowed, as `spindle profile` fits all of them (the
    profile's curve runs each count's fastest strategy, and where that is tp2 the
    data-parallel point of the same count may be nearly as fast: dropping the count would
    hold a MetaOp to fewer devices). The profile's own where none of those points is
    feasible at a fitted count, or where the fit again would end before a count the
    profile's runs with a strategy allowed (a measured data-parallel point that timed out at
    4 devices, where tp2 ran, would end it at 2, and 8 and 16 were data parallel): the
    planner then leaves out the counts it may not use, saying why."""
    curve = profile.curve(op.signature)

    def allowed(strategy: str) -> bool:
        return tp_allowed(tp_degree(strategy), tensor_parallel, island_size)

    if all(allowed(p.strategy) for p in curve.pieces):
        return curve
    points = [p for p in curve.points if allowed(p.strategy)]
    if not any(p.feasible and p.num_devices in profile.counts for p in points):
        return curve
    refit = build_curve(op, points, counts=profile.counts, memory=curve.memory,
                        validate=False,
                        noise_rel=MEASURED_NOISE_REL if profile.source == "measured" else 0.0)
    low, high = scaling.count_range(curve)
    reach = max((n for n in profile.counts
                 if low <= n <= high and allowed(scaling.strategy(curve, n))), default=0)
    return curve if scaling.count_range(refit)[1] < reach else refit


def _work_splits(op: MetaOp, samples: Sequence[Sample]) -> bool:
    """Whether the samples' counts split the work of `op` between more devices. The
    contrastive loss's does not: each rank computes it on the whole batch
    (`roofline.per_device_batch`), so its curve is flat (`curves.fit_curve`) instead of a
    speedup fitted to the noise of a measurement."""
    return any(x.strategy != "dp" for x in samples) or len(
        {roofline.per_device_batch(op, x.num_devices, x.strategy) for x in samples}) > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldoutError:
    """The fit's error at one held-out count: what the curve claims there (strategy and time)
    against the profiled time of that strategy at that count."""

    num_devices: int
    strategy: str
    """The strategy the curve uses at this count (`scaling.strategy`)."""
    best_strategy: str
    """The fastest strategy profiled at this count (may differ at a strategy switch)."""
    rel_error: float


def heldout_errors(
    curve: Curve, counts: Sequence[int], *, uneven: bool = False
) -> list[HeldoutError]:
    """Per held-out count (a profiled count not in `counts`) that is a valid allocation
    (`scaling.is_valid`, with `uneven` splits or not): |T_curve - T| / T, with T the profiled
    time of the strategy the curve uses there, compared at the per-device work that point ran
    (n itself unless uneven). Counts outside `scaling.count_range` are not valid allocations
    and are skipped, and so are counts where the curve's strategy ran out of memory (the
    planner's memory model, not the curve, rules those out)."""
    fit_counts = set(counts)
    best = _best(curve.points, curve.batch_size)
    out = []
    for n in sorted({p.num_devices for p in curve.points} - fit_counts):
        if not scaling.is_valid(curve, n, uneven=uneven):
            continue
        claimed = scaling.strategy(curve, n)
        point = next((p for p in curve.points
                      if p.num_devices == n and p.strategy == claimed), None)
        if point is None or not point.feasible:
            continue
        at = work_devices(curve.batch_size, n, claimed)
        predicted = scaling.time_ms(curve, at)
        out.append(
            HeldoutError(
                num_devices=n,
                strategy=claimed,
                best_strategy=best[n].strategy,
                rel_error=abs(predicted - point.time_ms) / point.time_ms,
            )
        )
    return out


def assemble_profile(
    graph: MetaOpGraph,
    points: dict[str, list[ProfilePoint]],
    *,
    source: Literal["measured", "analytic"],
    fingerprint: Fingerprint,
    counts: Sequence[int],
    validate: bool,
    optimizer: OptimizerCost | None = None,
    inputs: Sequence[InputRef] = (),
) -> Profile:
    """A Profile from the points of every signature (keyed by signature) and the device's
    optimizer step."""
    curves = []
    for op in signature_ops(graph):
        curves.append(
            build_curve(
                op,
                points.get(op.signature, []),
                counts=counts,
                memory=roofline.memory_model(op, graph.dtype_bytes),
                validate=validate,
                # measured medians scatter; an analytic model is exact
                noise_rel=MEASURED_NOISE_REL if source == "measured" else 0.0,
            )
        )
    return Profile(
        **derived_header(Profile, list(inputs)),
        source=source,
        fingerprint=fingerprint,
        counts=tuple(counts),
        curves=tuple(curves),
        optimizer=optimizer,
    )


def analytic_profile(
    graph: MetaOpGraph,
    cluster: ClusterSpec | None,
    *,
    hardware: str,
    counts: Sequence[int],
    validate: bool = False,
    inputs: Sequence[InputRef] = (),
) -> Profile:
    """Scaling curves from the roofline model of `hardware` ('a800', 'h100', 'h200'). The
    cluster (optional) gives the island size and links for tensor parallelism and the device
    memory that decides out-of-memory points; without it, the hardware's own NVLink figures,
    islands of 8 and its datasheet memory."""
    if hardware not in roofline.HARDWARE:
        known = ", ".join(sorted(roofline.HARDWARE))
        raise SpindleError(f"unknown hardware {hardware!r} (analytic models: {known}, or local)")
    fit_counts = check_counts(counts)
    if cluster is not None and fit_counts[-1] > cluster.num_devices:
        raise SpindleError(
            f"device count {fit_counts[-1]} exceeds the {cluster.num_devices} devices "
            f"of cluster {cluster.name!r}"
        )
    device = roofline.HARDWARE[hardware]
    links = roofline.links_for(device, cluster)
    all_counts = sorted(fit_counts + (heldout_counts(fit_counts) if validate else ()))
    memory_bytes = cluster.device.memory_bytes if cluster is not None else device.memory_bytes

    def strategies(op: MetaOp, n: int) -> list[str]:
        return roofline.strategies(op, n, links.island_size)

    points: dict[str, list[ProfilePoint]] = {}
    for job in plan_jobs(signature_ops(graph), all_counts, strategies):
        points.setdefault(job.op.signature, []).append(
            _analytic_point(job, device, links, graph.dtype, memory_bytes)
        )
    return assemble_profile(
        graph,
        points,
        source="analytic",
        fingerprint=Fingerprint(
            hardware=hardware, device_name=device.name, torch_version="", dtype=graph.dtype
        ),
        counts=fit_counts,
        validate=validate,
        optimizer=roofline.optimizer_cost(device),
        inputs=inputs,
    )


def _analytic_point(
    job: Job, device: roofline.DeviceModel, links: roofline.Links, dtype: str, memory: int
) -> ProfilePoint:
    """A point of the roofline model; out of memory only where no memory setting the planner
    tries fits one layer (`memory.least_layer_bytes`): the planner's memory search decides
    the rest (a point judged by the layer whole made `spindle profile` refuse a graph that
    ZeRO fits)."""
    if job.batch is None:
        return unrunnable_point(job)
    t = tp_degree(job.strategy)
    dtype_bytes = ELEMENT_BYTES[dtype]
    peak = roofline.peak_memory_bytes(job.op, job.batch, t, dtype_bytes)
    least = math.ceil(least_layer_bytes(job.op, job.num_devices, job.strategy, dtype))
    if least > memory:
        return ProfilePoint(
            num_devices=job.num_devices,
            strategy=job.strategy,
            feasible=False,
            time_ms=0.0,
            peak_memory_bytes=peak,
            note=f"out of memory: needs {least} of {memory} bytes under every memory setting "
                 f"(ZeRO sharding over these {job.num_devices})",
        )
    time_s = roofline.operator_time_s(
        job.op, job.batch, job.strategy, device=device, links=links, dtype_bytes=dtype_bytes
    )
    return ProfilePoint(
        num_devices=job.num_devices,
        strategy=job.strategy,
        feasible=True,
        time_ms=time_s * 1e3,
        peak_memory_bytes=peak,
    )


def local_links(cluster: ClusterSpec | None) -> roofline.Links | None:
    """The island links measured tensor-parallel points are charged with (None: no cluster,
    so data parallel only)."""
    if cluster is None:
        return None
    return roofline.Links(
        island_size=cluster.island_size,
        bandwidth_bytes_per_s=cluster.intra_island_bandwidth_bytes_per_s,
        latency_s=cluster.link_latency_s,
    )


def local_strategies(
    op: MetaOp,
    n: int,
    links: roofline.Links | None,
    can_shard: Callable[[ModuleSpec, int], bool],
    spec: ModuleSpec,
) -> list[str]:
    """Strategies to measure at n: data parallel, and tensor parallel where the cluster has
    islands and the layer's heads and MLP split evenly."""
    island = links.island_size if links is not None else 1
    return [
        s
        for s in roofline.strategies(op, n, island)
        if s == "dp" or can_shard(spec, tp_degree(s))
    ]


def measured_point(
    job: Job,
    m: Measurement,
    links: roofline.Links | None,
    dtype_bytes: int,
) -> ProfilePoint:
    """A ProfilePoint from one measurement plus the tensor-parallel collectives the strategy
    implies, taken from the cluster's link model (one process cannot measure them)."""
    t = tp_degree(job.strategy)
    time_ms = m.time_ms
    if m.feasible and t > 1:
        assert links is not None and job.batch is not None
        out_bytes = job.batch * job.op.out_seq_len * job.op.out_width * dtype_bytes
        time_ms += 4 * roofline.allreduce_s(out_bytes, t, links) * 1e3
    return ProfilePoint(
        num_devices=job.num_devices,
        strategy=job.strategy,
        feasible=m.feasible,
        time_ms=time_ms,
        peak_memory_bytes=m.peak_memory_bytes,
        note=m.note,
    )
