"""Pictures of a plan's timeline: a Gantt chart (SVG/PNG), utilization over time (the paper's
Fig. 9) and a text Gantt for the terminal.

Two timelines can be drawn. From the plan alone: each slice starts with its wave
(`Wave.start_ms`) and lasts its planned forward+backward `time_ms`; transfers are drawn from the
producer slice's end to the consumer wave's start; parameter sync is marked after the last wave
(its duration is not in the plan). From a simulation (`sim=`): forward and backward bars at
their simulated times (a forward cut where it stalls for a ZeRO-1/2 all-gather), every
point-to-point flow, and each parameter group's all-reduce.

matplotlib is imported inside the drawing functions only (importing it costs ~0.3 s).
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from spindle_cli.artifacts.files import replace_atomic
from spindle_cli.artifacts.plan import Plan
from spindle_cli.cli.common import check_output
from spindle_cli.errors import SpindleError
from spindle_cli.planner.simulate import SimResult

Phase = Literal["forward", "backward", "step", "sync", "stall"]
"""'stall': a forward waiting inside its slice for a later layer's ZeRO-1/2 all-gather."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Bar:
    """Work of one slice (or one sync group) on one rank."""

    rank: int
    start_ms: float
    end_ms: float
    key: str
    """What the colour stands for: the module (or the MetaOp's step without a simulation)."""
    label: str
    phase: Phase
    slice_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """Everything a picture needs, in ms."""

    num_ranks: int
    end_ms: float
    bars: tuple[Bar, ...]
    boundaries: tuple[tuple[float, str], ...]
    """Wave starts: (time, 'w<index>' or 'w<index>b' for backward)."""
    flows: tuple[tuple[int, int, float, float], ...]
    """(src rank, dst rank, start, end) of each transfer (forward and backward)."""
    sync_start_ms: float | None


def _computes(b: Bar) -> bool:
    return b.phase not in ("sync", "stall")


def _label(metaop: str, first: int, last: int) -> str:
    return f"{metaop} [{first}:{last})"


def timeline(plan: Plan, sim: SimResult | None = None) -> Timeline:
    """The timeline to draw: simulated when `sim` is given, else the plan's estimate."""
    if sim is not None:
        return _sim_timeline(plan, sim)
    bars, flows = [], []
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    # A slice ends by the next wave's start: the plan records starts rounded, so its start plus
    # its time can pass that by ~1e-8 ms, and busy_series would count the rank twice there.
    next_start = {w.index: later.start_ms for w, later in itertools.pairwise(plan.waves)}
    for w, s in plan.slices():
        starts[s.id] = w.start_ms
        ends[s.id] = min(w.start_ms + s.time_ms, next_start.get(w.index, math.inf))
        key = s.metaop.split("/", 1)[-1]
        bars += [Bar(rank=r, start_ms=w.start_ms, end_ms=ends[s.id], key=key,
                     label=_label(s.metaop, s.first, s.last), phase="step", slice_id=s.id)
                 for r in s.ranks]
    for t in plan.transfers:
        flows.append((t.src_ranks[0], t.dst_ranks[0], ends[t.src], starts[t.dst]))
    end_ms = max([w.start_ms + w.duration_ms for w in plan.waves], default=0.0)
    return Timeline(
        num_ranks=plan.num_devices, end_ms=end_ms, bars=tuple(bars),
        boundaries=tuple((w.start_ms, f"w{w.index}") for w in plan.waves),
        flows=tuple(flows), sync_start_ms=end_ms if plan.param_groups else None,
    )


def _sim_timeline(plan: Plan, sim: SimResult) -> Timeline:
    bars = []
    for s in sim.slices:
        label = _label(s.metaop, s.first, s.last)
        # the forward's compute runs between its stalls
        edges = [s.forward_start_ms, *(t for stall in s.forward_stalls for t in stall),
                 s.forward_end_ms]
        for r in s.ranks:
            for i, (start, end) in enumerate(itertools.pairwise(edges)):
                bars.append(Bar(rank=r, start_ms=start, end_ms=end, key=s.module, label=label,
                                phase="stall" if i % 2 else "forward", slice_id=s.slice_id))
            bars.append(Bar(rank=r, start_ms=s.backward_start_ms, end_ms=s.backward_end_ms,
                            key=s.module, label=label, phase="backward", slice_id=s.slice_id))
    for g in sim.syncs:
        if g.end_ms > g.start_ms:
            label = f"sync {g.module}[{g.first_layer}:{g.last_layer})"
            bars += [Bar(rank=r, start_ms=g.start_ms, end_ms=g.end_ms, key=g.module, label=label,
                         phase="sync", slice_id=label) for r in g.ranks]
    boundaries = [(w.forward_start_ms, f"w{w.index}") for w in sim.waves]
    boundaries += [(w.backward_start_ms, f"w{w.index}b") for w in sim.waves]
    flows = tuple((f.src_rank, f.dst_rank, f.start_ms, f.end_ms)
                  for f in sim.flows if f.kind in ("activation", "gradient"))
    return Timeline(
        num_ranks=plan.num_devices, end_ms=sim.iteration_ms, bars=tuple(bars),
        boundaries=tuple(sorted(boundaries)), flows=flows,
        # where the backward pass ends: sync_ms also counts the forward's waits for ZeRO's
        # parameter all-gathers, so the iteration less sync and step can fall inside it
        sync_start_ms=max(w.backward_end_ms for w in sim.waves) if sim.syncs else None,
    )


def _colors(keys: list[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    return {k: cmap(i % 20) for i, k in enumerate(sorted(set(keys)))}


def save_figure(fig: Any, path: str) -> None:
    """Save a matplotlib figure atomically and reproducibly (PNG or SVG by extension), as an
    artifact is written (`replace_atomic`)."""
    import matplotlib

    check_image_path(path)
    suffix = Path(path).suffix.lower()
    # No creation date in the metadata, so the same plan draws the same bytes.
    meta = {"Date": None} if suffix == ".svg" else {"Software": None}

    def draw(tmp: str) -> None:
        # A fixed salt makes the SVG's element ids (random by default) reproducible.
        with matplotlib.rc_context({"svg.hashsalt": "spindle"}):
            fig.savefig(tmp, format=suffix[1:], dpi=110, bbox_inches="tight", metadata=meta)

    replace_atomic(path, draw, suffix=suffix)


def check_image_path(path: str) -> None:
    """SpindleError unless `save_figure` can write `path`: an .svg or .png name (not '-': an
    image is no text for stdout) in a directory that exists. Commands call it before their
    work, so a bad name prints nothing else."""
    if path == "-":
        raise SpindleError("-: an image cannot go to stdout (give an .svg or .png file)")
    check_output(path, (".svg", ".png"), "image type")


def check_chart_paths(gantt: str | None, utilization: str | None) -> None:
    """`check_image_path` for each chart given, and SpindleError where both name one file
    (the second image would replace the first)."""
    for path in (gantt, utilization):
        if path is not None:
            check_image_path(path)
    if gantt is not None and utilization is not None and \
            os.path.realpath(gantt) == os.path.realpath(utilization):
        raise SpindleError(f"{utilization}: given for both --gantt and --utilization (the "
                           "second image would replace the first)",
                           hint="give each image its own name")


def write_gantt(plan: Plan, path: str, *, sim: SimResult | None = None) -> None:
    """Draw ranks x time: one bar per slice and rank coloured by module, labelled with the
    MetaOp and operator range, wave boundaries, transfers and parameter sync."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.patches import Patch

    tl = timeline(plan, sim)
    colors = _colors([b.key for b in tl.bars])
    height = min(max(3.0, 0.28 * tl.num_ranks + 1.5), 40.0)
    fig, ax = plt.subplots(figsize=(14, height))
    # a sync overlapping compute (chunked buckets run during the backward pass) is a strip
    # below the rank's compute, not a bar over it
    syncs = any(b.phase == "sync" for b in tl.bars)
    stalls = any(b.phase == "stall" for b in tl.bars)
    # one collection of rectangles per style: a bar (patch) each took minutes for a plan of
    # 512 ranks
    styles: dict[tuple[str, str | None], list[Bar]] = {}
    for b in tl.bars:
        styles.setdefault(("black" if b.phase == "sync" else "white",
                           "///" if b.phase in ("backward", "sync") else None), []).append(b)
    for (edge, hatch), bars in styles.items():
        boxes = []
        for b in bars:
            y, h = ((b.rank + 0.3, 0.2) if b.phase == "sync" else
                    (b.rank - 0.1, 0.6) if syncs else (b.rank, 0.8))
            boxes.append([(b.start_ms, y - h / 2), (b.start_ms, y + h / 2),
                          (b.end_ms, y + h / 2), (b.end_ms, y - h / 2)])
        ax.add_collection(PolyCollection(
            boxes, facecolors=["lightgrey" if b.phase == "stall" else colors[b.key]
                               for b in bars],
            edgecolors=edge, linewidths=0.3, hatch=hatch))
    _label_slices(ax, tl, width_px=12 * 110)
    for t, name in tl.boundaries:
        ax.axvline(t, color="grey", linestyle="--", linewidth=0.6)
        ax.text(t, -0.9, name, fontsize=6, color="grey", ha="left", va="bottom")
    if tl.flows:
        segments = [((s, src), (e, dst)) for src, dst, s, e in tl.flows]
        ax.add_collection(LineCollection(segments, colors="black", linewidths=0.4, alpha=0.35))
    if tl.sync_start_ms is not None:
        ax.axvline(tl.sync_start_ms, color="black", linewidth=1.0)
        ax.text(tl.sync_start_ms, -0.9, "param sync", fontsize=7, ha="left", va="bottom")
    ax.set_ylim(tl.num_ranks - 0.5, -1.2)
    ax.set_yticks(range(0, tl.num_ranks, max(1, tl.num_ranks // 32)))
    ax.set_xlim(0, max(tl.end_ms, 1e-9) * 1.02)
    ax.set_ylabel("rank")
    ax.set_xlabel("time (ms)")
    src = "simulated" if sim is not None else "planned"
    hatch = "; hatched: backward and sync" if sim is not None else ""
    grey = "; grey: forward stalled for an all-gather" if stalls else ""
    ax.set_title(f"{plan.model} on {plan.cluster} ({plan.num_devices} devices), planner "
                 f"{plan.planner}: {src} timeline{hatch}{grey}; lines: transfers", fontsize=9)
    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              title="module" if sim is not None else "step", title_fontsize=7)
    save_figure(fig, path)
    plt.close(fig)


def _label_slices(ax: Any, tl: Timeline, width_px: float) -> None:
    # One label per slice (forward bar, or the whole step) on its first rank, on its longest
    # part (a forward cut by stalls), in the longest form that fits inside the bar (full,
    # step + range, range), or none.
    chosen: dict[tuple[str, str], Bar] = {}
    for b in tl.bars:
        if b.phase not in ("forward", "step"):
            continue
        cur = chosen.get((b.slice_id, b.phase))
        if cur is None or (b.rank == cur.rank
                           and b.end_ms - b.start_ms > cur.end_ms - cur.start_ms):
            chosen[(b.slice_id, b.phase)] = b
    span = max(tl.end_ms, 1e-9)
    char_px = 3.8  # width of one character at fontsize 5 and the figure's dpi
    for b in chosen.values():
        room = (b.end_ms - b.start_ms) / span * width_px
        metaop, _, rng = b.label.partition(" ")
        forms = (b.label, f"{metaop.split('/')[-1]} {rng}", rng)
        text = next((f for f in forms if len(f) * char_px < room), None)
        if text is not None:
            ax.text((b.start_ms + b.end_ms) / 2, b.rank, text, fontsize=5, ha="center",
                    va="center", clip_on=True)


def busy_series(tl: Timeline) -> tuple[list[float], dict[str, list[float]]]:
    """Change points and, per colour key, the number of ranks computing from each point on."""
    computing = [b for b in tl.bars if _computes(b)]
    times = sorted({t for b in computing for t in (b.start_ms, b.end_ms)})
    keys = sorted({b.key for b in computing})
    series = {k: [0.0] * len(times) for k in keys}
    index = {t: i for i, t in enumerate(times)}
    for b in computing:
        for i in range(index[b.start_ms], index[b.end_ms]):
            series[b.key][i] += 1
    return times, series


def write_utilization(plan: Plan, path: str, *, sim: SimResult | None = None) -> None:
    """Utilization over time (like the paper's Fig. 9): the share of devices computing,
    stacked by module, over one iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = timeline(plan, sim)
    times, series = busy_series(tl)
    colors = _colors(list(series))
    fig, ax = plt.subplots(figsize=(12, 4))
    if times:
        ys = [[v / tl.num_ranks for v in series[k]] for k in series]
        ax.stackplot(times, *ys, step="post", labels=list(series),
                     colors=[colors[k] for k in series])
        total = [math.fsum(col) for col in zip(*ys, strict=True)]
        mean = math.fsum(b.end_ms - b.start_ms for b in tl.bars if _computes(b)) / (
            tl.num_ranks * max(tl.end_ms, 1e-9))
        ax.step(times, total, where="post", color="black", linewidth=0.8,
                label=f"all (mean {100 * mean:.0f}%)")
    ax.set_xlim(0, max(tl.end_ms, 1e-9))
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("share of devices computing")
    src = "simulated" if sim is not None else "planned"
    ax.set_title(f"{plan.model} on {plan.cluster} ({plan.num_devices} devices), planner "
                 f"{plan.planner}: {src} utilization", fontsize=9)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save_figure(fig, path)
    plt.close(fig)


TEXT_WIDTH = 100
"""Time buckets of the text Gantt off a terminal (a log keeps its lines whole)."""


def text_gantt(plan: Plan, *, width: int | None = None, sim: SimResult | None = None) -> str:
    """A terminal Gantt: one row per run of ranks that do the same (r0-31), one character per
    time bucket, `width` of them (by default as many as fit the terminal, 40 to
    `TEXT_WIDTH`, or `TEXT_WIDTH` off one); each module (step without a simulation) has a
    letter, '.' is idle, '~' parameter sync where the rank computes nothing, ':' a forward
    stalled for a ZeRO-1/2 all-gather; backward in lower case when simulated."""
    tl = timeline(plan, sim)
    if width is None:
        from spindle_cli.cli._console import out

        label = 2 * len(str(tl.num_ranks - 1)) + 3  # 'r120-127 '
        width = (min(TEXT_WIDTH, max(40, out.width - label)) if out.is_terminal
                 else TEXT_WIDTH)
    keys = sorted({b.key for b in tl.bars if _computes(b)})
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    letters = {k: alphabet[i % len(alphabet)] for i, k in enumerate(keys)}
    span = max(tl.end_ms, 1e-9)
    grid = [["."] * width for _ in range(tl.num_ranks)]
    # Paint each bucket by its midpoint, so bars shorter than a bucket may vanish but none
    # is drawn wider than it is.
    for b in tl.bars:
        lo = round(b.start_ms / span * width)
        hi = round(b.end_ms / span * width)
        ch = {"sync": "~", "stall": ":"}.get(b.phase) or letters[b.key]
        if b.phase == "backward":
            ch = ch.lower()
        for i in range(lo, min(hi, width)):
            # compute shows through a sync that overlaps it (chunked buckets)
            if b.phase != "sync" or grid[b.rank][i] == ".":
                grid[b.rank][i] = ch
    marks = [" "] * width
    for t, _ in tl.boundaries:
        marks[min(round(t / span * width), width - 1)] = "|"
    # ranks that do the same, one after another, share a row
    runs: list[tuple[str, str]] = []
    for r, row in enumerate(grid):
        text = "".join(row)
        if runs and runs[-1][1] == text:
            runs[-1] = (f"r{runs[-1][0][1:].split('-')[0]}-{r}", text)
        else:
            runs.append((f"r{r}", text))
    pad = max(len(name) for name, _ in runs)
    # the note on its own line: after the marks it outran a terminal-wide row
    lines = [f"{'':>{pad + 1}}| wave start; {span:.1f} ms in all",
             f"{'':>{pad + 1}}{''.join(marks)}"]
    lines += [f"{name:<{pad}} {text}" for name, text in runs]
    lines.append("legend: " + ", ".join(f"{letters[k]}={k}" for k in keys)
                 + (", ~=param sync" if any(b.phase == "sync" for b in tl.bars) else "")
                 + (", :=stalled for an all-gather" if any(":" in row for row in grid) else "")
                 + (" (lower case: backward)" if sim is not None else ""))
    return "\n".join(lines)
