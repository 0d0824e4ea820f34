"""`spindle show GRAPH`: the MetaOps of a MetaOp graph, level by level."""

from __future__ import annotations

import math

from rich.table import Table

from spindle_cli.artifacts.graph import MetaOpGraph
from spindle_cli.cli._console import out
from spindle_cli.cli.views import fmt_count, print_table
from spindle_cli.units import fmt_bytes


def show(obj: MetaOpGraph, path: str) -> None:
    """Print one table of MetaOps grouped by MetaLevel, with their workload."""
    out.print(f"MetaOp graph of {obj.model} ({path}): {len(obj.metaops)} MetaOps on "
              f"{obj.num_levels} MetaLevels, {len(obj.tasks)} task(s), {obj.dtype}")
    table = Table()
    for col in ("level", "MetaOp", "kind", "module", "L", "batch", "seq", "GFLOPs/layer",
                "params/layer", "act out", "after"):
        numeric = col in ("level", "L", "batch", "seq", "GFLOPs/layer", "params/layer", "act out")
        table.add_column(col, justify="right" if numeric else "left")
    level = -1
    for m in obj.metaops:
        if m.level != level and level >= 0:
            table.add_section()
        table.add_row(
            str(m.level) if m.level != level else "",
            m.id,
            m.layer_kind,
            m.module if m.first_layer == 0 else f"{m.module}[{m.first_layer}:]",
            str(m.num_layers),
            str(m.batch_size),
            str(m.seq_len),
            f"{m.flops_per_layer / 1e9:.3g}",
            fmt_count(m.params_per_layer),
            fmt_bytes(m.activation_out_bytes),
            ", ".join(p.removeprefix(f"{m.task}/") for p in m.predecessors) or "-",
        )
        level = m.level
    print_table(table)
    total_flops = math.fsum(m.flops_per_layer * m.num_layers for m in obj.metaops)
    out.print(f"total: {total_flops / 1e12:.3g} TFLOPs per iteration (forward+backward)")
