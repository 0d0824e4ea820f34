"""The semantic difference of two plans (`spindle diff`, and `--check` on a stale plan):
allocations per MetaOp, waves, placement, estimated time and memory; headers such as the
producer version and input paths are not compared."""

from __future__ import annotations

import dataclasses
from typing import Any

from spindle_cli.artifacts import Plan
from spindle_cli.artifacts.codec import to_data
from spindle_cli.cli.views import rank_text
from spindle_cli.units import fmt_bytes

_HEADER = ("kind", "version", "producer", "inputs")
_MEMORY_CATEGORIES = (("params", "param_bytes"), ("grads", "grad_bytes"),
                      ("optimizer", "optimizer_bytes"), ("activations", "activation_bytes"))
"""The categories of RankMemory, named as `spindle show` heads its columns."""


def allocations(plan: Plan) -> dict[str, str]:
    """Per MetaOp, its slices as '[first:last)@n' in order, '[first:last)@n(tp<t>)' for a
    tensor-parallel one."""
    result: dict[str, list[str]] = {}
    for _, s in plan.slices():
        strategy = "" if s.strategy == "dp" else f"({s.strategy})"
        result.setdefault(s.metaop, []).append(f"[{s.first}:{s.last})@{len(s.ranks)}{strategy}")
    return {m: " ".join(v) for m, v in sorted(result.items())}


def _wave_shape(plan: Plan) -> list[tuple[tuple[str, int, int, int, str], ...]]:
    return [tuple(sorted((s.metaop, s.first, s.last, len(s.ranks), s.strategy)
                         for s in w.slices))
            for w in plan.waves]


def _options(plan: Plan) -> dict[str, str]:
    """The plan's options but its planner, each spelled out as Plan.options writes it, the
    missing ones at their defaults (a missing key means the default)."""
    from spindle_cli.planner.options import PlanOptions

    options = PlanOptions.of(plan)
    return {f.name: _option_text(getattr(options, f.name)) for f in dataclasses.fields(options)
            if f.name != "planner"}


def _option_text(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _islands(plan: Plan) -> str:
    """'[0-7] [8-15]'."""
    return " ".join(f"[{rank_text(island)}]" for island in plan.islands)


def _bytes_change(a: int, b: int) -> str:
    """'1.0 GiB -> 1.5 GiB (+512.0 MiB)'."""
    return f"{fmt_bytes(a)} -> {fmt_bytes(b)} ({'+' if b >= a else '-'}{fmt_bytes(abs(b - a))})"


def _digits(x: float, y: float) -> int:
    """Decimals that show the difference of two times in ms: 3, or more where it is smaller
    than 0.001 ms (a difference that prints as +0.000 still makes the plans differ)."""
    digits = 3
    while digits < 9 and x != y and round(x, digits) == round(y, digits):
        digits += 1
    return digits


def _change_ms(x: float, y: float) -> str:
    """'1.000 -> 1.500 ms'."""
    digits = _digits(x, y)
    return f"{x:.{digits}f} -> {y:.{digits}f} ms"


def _first(items: list[str], most: int = 5) -> str:
    """The first `most` items, comma-separated, with how many more."""
    more = f", and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _peak(plan: Plan) -> int:
    return max((m.total_bytes for m in plan.memory), default=0)


def figures(a: Plan, b: Plan) -> dict[str, object]:
    """What `spindle diff --json` gives beside the lines, each as [a, b]: the estimated
    compute and C* (ms), the peak memory of a rank (bytes), the waves, and the allocations
    of the MetaOps whose allocation differs (`allocations`' text; null where a plan has no
    such MetaOp)."""
    alloc_a, alloc_b = allocations(a), allocations(b)
    return {
        "estimated_compute_ms": [a.estimated_iteration_ms, b.estimated_iteration_ms],
        "lower_bound_ms": [a.lower_bound_ms, b.lower_bound_ms],
        "peak_memory_bytes": [_peak(a), _peak(b)],
        "num_waves": [len(a.waves), len(b.waves)],
        "allocations": {m: [alloc_a.get(m), alloc_b.get(m)]
                        for m in sorted(set(alloc_a) | set(alloc_b))
                        if alloc_a.get(m) != alloc_b.get(m)},
    }


def differences(a: Plan, b: Plan) -> list[str]:
    """Human-readable lines, one per difference; empty when the plans are the same."""
    # options as the plans mean them: a missing key is the default
    da = {k: v for k, v in to_data(a).items() if k not in _HEADER} | {"options": _options(a)}
    db = {k: v for k, v in to_data(b).items() if k not in _HEADER} | {"options": _options(b)}
    if da == db:
        return []
    lines = _setting_lines(a, b, da, db)
    lines += _allocation_lines(a, b)
    lines += _wave_lines(a, b)
    lines += _estimate_lines(a, b)
    lines += _memory_lines(a, b)
    if da["transfers"] != db["transfers"]:
        lines.append(_transfer_line(a, b))
    if da["param_groups"] != db["param_groups"]:
        lines.append(_param_group_line(a, b))
    if not lines:
        lines.append("other fields differ")
    return lines


def _setting_lines(a: Plan, b: Plan, da: dict[str, Any], db: dict[str, Any]) -> list[str]:
    """What the plans were made for and how: model, cluster, planner, candidate, devices,
    islands and options (`da`, `db`: the plans' data, their options spelled out)."""
    lines = [f"{key}: {da[key] or '(none)'} -> {db[key] or '(none)'}"
             for key in ("model", "cluster", "planner", "candidate", "num_devices")
             if da[key] != db[key]]
    if a.islands != b.islands:
        lines.append(f"islands: {_islands(a)} -> {_islands(b)}")
    # one line per option that differs (the planner has its own line above)
    lines += [f"option {k}: {v} -> {db['options'][k]}" for k, v in da["options"].items()
              if v != db["options"][k]]
    return lines


def _allocation_lines(a: Plan, b: Plan) -> list[str]:
    """A line per MetaOp whose allocation differs."""
    alloc_a, alloc_b = allocations(a), allocations(b)
    return [f"allocation {m}: {alloc_a.get(m, '-')} -> {alloc_b.get(m, '-')}"
            for m in sorted(set(alloc_a) | set(alloc_b)) if alloc_a.get(m) != alloc_b.get(m)]


def _wave_lines(a: Plan, b: Plan) -> list[str]:
    """The waves' count and the waves that run other slices; where every wave runs the same
    slices, what differs within them (`_same_wave_lines`)."""
    lines: list[str] = []
    shape_a, shape_b = _wave_shape(a), _wave_shape(b)
    if len(shape_a) != len(shape_b):
        lines.append(f"waves: {len(shape_a)} -> {len(shape_b)}")
    changed = [i for i, (x, y) in enumerate(zip(shape_a, shape_b, strict=False)) if x != y]
    if changed:
        lines.append(f"waves with other slices: {', '.join(map(str, changed[:20]))}"
                     + (" ..." if len(changed) > 20 else ""))
    if shape_a == shape_b:
        lines += _same_wave_lines(a, b)
    return lines


def _same_wave_lines(a: Plan, b: Plan) -> list[str]:
    """For plans whose waves run the same slices: their placement, the slices' and waves'
    estimates and the waves' levels."""
    lines: list[str] = []
    # slices matched by what they run, not by their order within the wave
    slices_b = {(w.index, s.metaop, s.first, s.last): s for w, s in b.slices()}
    pairs = [(s, slices_b[(w.index, s.metaop, s.first, s.last)]) for w, s in a.slices()]
    moved = sum(1 for sa, sb in pairs if sa.ranks != sb.ranks)
    if moved:
        lines.append(f"placement: {moved} slice(s) on other ranks")
    retimed = [f"{sa.id} {sa.metaop} {_change_ms(sa.time_ms, sb.time_ms)}"
               for sa, sb in pairs if sa.time_ms != sb.time_ms]
    if retimed:
        lines.append(f"slice estimates: {len(retimed)} slice(s) with other times: "
                     + _first(retimed))
    waves = list(zip(a.waves, b.waves, strict=True))
    longer = [f"wave {x.index} {_change_ms(x.duration_ms, y.duration_ms)}"
              for x, y in waves if x.duration_ms != y.duration_ms]
    moved_start = sum(1 for x, y in waves if x.start_ms != y.start_ms)
    if longer or moved_start:
        parts = ([f"{len(longer)} wave(s) with another duration: {_first(longer)}"]
                 if longer else [])
        parts += [f"{moved_start} wave(s) starting at another time"] if moved_start else []
        lines.append(f"wave estimates: {'; '.join(parts)}")
    relabelled = [f"wave {x.index} {x.level} -> {y.level}" for x, y in waves
                  if x.level != y.level]
    if relabelled:
        lines.append(f"wave levels: {', '.join(relabelled)}")
    return lines


def _estimate_lines(a: Plan, b: Plan) -> list[str]:
    """The estimated compute, C*, and each level's estimate and C*; the levels' numbers."""
    lines: list[str] = []
    if a.estimated_iteration_ms != b.estimated_iteration_ms:
        delta = b.estimated_iteration_ms - a.estimated_iteration_ms
        rel = (f", {delta / a.estimated_iteration_ms:+.1%}" if a.estimated_iteration_ms
               else "")
        digits = _digits(a.estimated_iteration_ms, b.estimated_iteration_ms)
        lines.append(f"estimated compute: {a.estimated_iteration_ms:.{digits}f} -> "
                     f"{b.estimated_iteration_ms:.{digits}f} ms ({delta:+.{digits}f} ms{rel})")
    if a.lower_bound_ms != b.lower_bound_ms:
        lines.append(f"C*: {_change_ms(a.lower_bound_ms, b.lower_bound_ms)}")
    levels_b = {lv.level: lv for lv in b.levels}
    for x in a.levels:
        y = levels_b.get(x.level)
        if y is not None and (x.estimated_ms, x.lower_bound_ms) != (y.estimated_ms,
                                                                     y.lower_bound_ms):
            lines.append(f"level {x.level}: estimated {_change_ms(x.estimated_ms, y.estimated_ms)}"
                         f", C* {_change_ms(x.lower_bound_ms, y.lower_bound_ms)}")
    numbers_a, numbers_b = ([str(lv.level) for lv in p.levels] for p in (a, b))
    if numbers_a != numbers_b:
        lines.append(f"levels: {', '.join(numbers_a)} -> {', '.join(numbers_b)}")
    return lines


def _memory_lines(a: Plan, b: Plan) -> list[str]:
    """The peak memory of a rank, and the ranks of both plans whose memory changed: in which
    categories, and the most on one rank (a rank one plan lacks is no change to 0 B: the
    change of device count has its own line)."""
    lines: list[str] = []
    peak_a, peak_b = _peak(a), _peak(b)
    if peak_a != peak_b:
        lines.append(f"peak memory: {_bytes_change(peak_a, peak_b)}")
    mem_a, mem_b = {m.rank: m for m in a.memory}, {m.rank: m for m in b.memory}
    common = sorted(set(mem_a) & set(mem_b))
    ranks_changed = [r for r in common if mem_a[r] != mem_b[r]]
    if ranks_changed:
        # every category, so that memory moved between them at the same total shows too
        categories = [name for name, attr in _MEMORY_CATEGORIES
                      if any(getattr(mem_a[r], attr) != getattr(mem_b[r], attr)
                             for r in ranks_changed)]

        def change(r: int) -> int:
            return mem_b[r].total_bytes - mem_a[r].total_bytes

        most = max(ranks_changed, key=lambda r: (abs(change(r)), -r))
        where = f"({rank_text(tuple(ranks_changed))})"
        both = "" if len(mem_a) == len(mem_b) else f" of the {len(common)} both plans have"
        biggest = (f"; the most on rank {most}: "
                   f"{_bytes_change(mem_a[most].total_bytes, mem_b[most].total_bytes)}"
                   if change(most) else "")
        lines.append(f"memory changed on {len(ranks_changed)} rank(s){both} {where}: "
                     f"{', '.join(categories)}{biggest}")
    return lines


def _transfer_line(a: Plan, b: Plan) -> str:
    """How the transfers of two plans whose transfers differ differ: in count and bytes, or
    the same bytes on other ranks or slices."""
    moved_a = sum(t.bytes for t in a.transfers if t.src_ranks != t.dst_ranks)
    moved_b = sum(t.bytes for t in b.transfers if t.src_ranks != t.dst_ranks)
    if ([t.bytes for t in a.transfers], moved_a) != ([t.bytes for t in b.transfers],
                                                     moved_b):
        total_a, total_b = (sum(t.bytes for t in p.transfers) for p in (a, b))
        return (f"transfers: {len(a.transfers)} -> {len(b.transfers)}; bytes "
                f"{_bytes_change(total_a, total_b)}, between different ranks "
                f"{_bytes_change(moved_a, moved_b)}")
    return (f"transfers: the same {len(a.transfers)}, {fmt_bytes(moved_a)} "
            "between different ranks, on other ranks or slices")


def _param_group_line(a: Plan, b: Plan) -> str:
    """How the parameter groups of two plans whose groups differ differ: in count and bytes,
    or the same groups on other ranks or layers."""
    if [g.bytes for g in a.param_groups] != [g.bytes for g in b.param_groups]:
        total_a, total_b = (sum(g.bytes for g in p.param_groups) for p in (a, b))
        return (f"parameter groups: {len(a.param_groups)} -> {len(b.param_groups)}; "
                f"bytes {_bytes_change(total_a, total_b)}")
    return f"parameter groups: the same {len(a.param_groups)}, on other ranks or layers"
