"""`spindle show PROFILE [--plot FILE.svg|png]`: every scaling curve as a table and a sparkline,
and optionally a picture of the curves like the paper's Fig. 4 (speedup T(1)/T(n) against n).
"""

from __future__ import annotations

import math

from rich.table import Table

from spindle_cli.artifacts.profile import Curve, Profile, ProfilePoint
from spindle_cli.cli._console import out, wrote
from spindle_cli.cli.views import print_table
from spindle_cli.planner import scaling
from spindle_cli.units import fmt_bytes

BARS = "▁▂▃▄▅▆▇█"
ASCII_BARS = "_.-:=+*#"
"""The sparkline's levels where stdout cannot encode the block characters (LC_ALL=C, a
PYTHONIOENCODING=ascii CI log), as rich falls back to ASCII borders there."""


def sparkline(values: list[float], lo: float | None = None, hi: float | None = None, *,
              bars: str = BARS) -> str:
    """One character of `bars` per value, scaled from `lo` to `hi` (default: the smallest and
    the largest value); values outside are clipped."""
    if not values:
        return ""
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    if hi - lo <= 1e-12 * max(abs(hi), 1.0):
        return bars[0] * len(values)
    top = len(bars) - 1
    return "".join(bars[round(min(max((v - lo) / (hi - lo), 0.0), 1.0) * top)] for v in values)


def short_name(signature: str) -> str:
    """A compact label: the layer kind and the fields that tell same-kind curves apart."""
    parts = signature.split("|")
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    keep = [f"{k}={fields[k]}" for k in ("hidden", "batch", "seq") if k in fields]
    return " ".join([parts[0], *keep]) if keep else signature


def _best(points: tuple[ProfilePoint, ...]) -> dict[int, ProfilePoint]:
    best: dict[int, ProfilePoint] = {}
    for p in points:
        if p.feasible and (p.num_devices not in best or p.time_ms < best[p.num_devices].time_ms):
            best[p.num_devices] = p
    return best


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _curve_table(curve: Curve, fitted: set[int]) -> Table:
    best = _best(curve.points)
    counts = sorted({p.num_devices for p in curve.points})
    t1 = scaling.time_ms(curve, 1)
    table = Table()
    for col in ("n", "strategy", "profiled ms", "fit ms", "speedup", "peak memory", "note"):
        table.add_column(col, justify="left" if col in ("strategy", "note") else "right")
    for n in counts:
        tried = [p for p in curve.points if p.num_devices == n]
        point = best.get(n)
        kind = "" if n in fitted else " (held out)"
        if point is None:
            notes = sorted({p.note for p in tried if p.note})
            table.add_row(str(n), "-", "infeasible", "-", "-", "-", "; ".join(notes) + kind)
            continue
        # what the planner reads for n: the time at the per-device batch n really runs
        valid = scaling.is_valid(curve, n, uneven=True)
        fit = scaling.time_ms(curve, scaling.work_count(curve, n)) if valid else None
        # counts past the curve's end are slower than a smaller count: kept, never planned
        slower = n > scaling.count_range(curve)[1]
        beyond = "; slower than fewer devices, not used" if slower else ""
        # a row compares like with like: the strategy the fit uses here, when it was profiled
        # (a held-out count between two strategies may be fastest under neither)
        claimed = scaling.strategy(curve, n) if valid else point.strategy
        same = next((p for p in tried if p.feasible and p.strategy == claimed), None)
        if same is not None and same is not point:
            beyond += f"; fastest profiled: {point.strategy} {point.time_ms:.4g} ms"
            point = same
        table.add_row(
            str(n),
            point.strategy,
            f"{point.time_ms:.4g}",
            "-" if fit is None else f"{fit:.4g}",
            "-" if fit is None else f"{t1 / fit:.2f}x",
            fmt_bytes(point.peak_memory_bytes),
            (kind.strip() + beyond).lstrip("; "),
        )
    return table


def show(obj: Profile, path: str, plot: str | None = None) -> None:
    """Print a header, then per curve its points against the fit and a speedup sparkline;
    with `plot`, also draw the speedup curves to an SVG or PNG (`gantt.save_figure`), first:
    a reader closing the pipe (`show PROFILE --plot F | head`) ends the command at its next
    line."""
    if plot is not None:
        plot_profile(obj, plot)
        wrote(plot)
    f = obj.fingerprint
    torch = f", torch {f.torch_version}" if f.torch_version else ""
    out.print(
        f"profile {path}: {obj.source} on {f.hardware} ({f.device_name}{torch}, {f.dtype}), "
        f"{len(obj.curves)} curves, counts {','.join(map(str, obj.counts))}"
    )
    if obj.optimizer is not None:
        out.print(f"optimizer step: {obj.optimizer.ms_per_tensor:.3g} ms per tensor + "
                  f"{obj.optimizer.ms_per_million_params:.3g} ms per million parameters")
    fitted = set(obj.counts)
    levels = BARS if out.encoding.lower().startswith("utf") else ASCII_BARS
    for curve in obj.curves:
        out.print(f"{curve.signature} (B={curve.batch_size})")
        print_table(_curve_table(curve, fitted))
        valid = [n for n in obj.counts if scaling.is_valid(curve, n, uneven=True)]
        t1 = scaling.time_ms(curve, 1)
        speedups = [t1 / scaling.time_ms(curve, n) for n in valid]
        # Bars from 0 to the largest count: linear scaling climbs to the top bar, a curve
        # that does not scale stays flat and low.
        bars = sparkline(speedups, 0.0, float(valid[-1]), bars=levels) if valid else ""
        out.print(
            f"  speedup {bars} {speedups[-1]:.2f}x at {valid[-1]}  "
            f"floor {scaling.floor_ms(curve):.4g} ms  fit error {_pct(curve.max_rel_error)}"
            f"  held-out error {_pct(curve.heldout_rel_error)} (at valid counts, the"
            " curve's strategy)"
            if valid
            else "  no valid count"
        )
        out.print("")


def plot_profile(obj: Profile, path: str) -> None:
    """Speedup T(1)/T(n) of every curve against n on log2 axes, points and fitted lines, with
    the linear ideal dashed (the paper's Fig. 4)."""
    from matplotlib.figure import Figure

    from spindle_cli.cli.views.gantt import save_figure

    fig = Figure(figsize=(12 if len(obj.curves) > 12 else 9, 6), layout="constrained")
    ax = fig.add_subplot()
    top = max(obj.counts)
    grid = [2 ** (i / 16) for i in range(int(16 * math.log2(top)) + 1)]
    for curve in obj.curves:
        t1 = scaling.time_ms(curve, 1)
        lo, hi = scaling.count_range(curve)
        xs = [n for n in grid if lo <= n <= min(hi, top)]
        (line,) = ax.plot(xs, [t1 / scaling.time_ms(curve, n) for n in xs], linewidth=1.2,
                          label=short_name(curve.signature))
        best = _best(curve.points)
        pts = sorted((n, p.time_ms) for n, p in best.items() if lo <= n <= hi)
        ax.plot([n for n, _ in pts], [t1 / t for _, t in pts], "o", markersize=3,
                color=line.get_color())
    ax.plot([1, top], [1, top], "k--", linewidth=0.8, label="linear")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("devices n")
    ax.set_ylabel("speedup T(1) / T(n)")
    ax.set_title(f"scaling curves: {obj.source}, {obj.fingerprint.device_name}")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=6, ncol=2 if len(obj.curves) > 24 else 1, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    save_figure(fig, path)
