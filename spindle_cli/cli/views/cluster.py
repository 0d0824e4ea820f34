"""`spindle show CLUSTER`: sizes, device and link bandwidths."""

from __future__ import annotations

from rich.table import Table

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.cli.views import fmt_rate, print_table
from spindle_cli.units import fmt_bytes


def show(obj: ClusterSpec, path: str) -> None:
    """Print the cluster's shape, device and links as one table."""
    d = obj.device
    table = Table(title=f"cluster {obj.name} ({path})", show_header=False)
    table.add_column("field")
    table.add_column("value")
    per_device = obj.inter_node_bandwidth_bytes_per_s
    rows = [
        ("description", obj.description or "-"),
        ("devices", f"{obj.num_devices} = {obj.num_nodes} node{'s' * (obj.num_nodes > 1)} "
                    f"x {obj.devices_per_node}"),
        ("NVLink islands", f"{obj.num_devices // obj.island_size} of {obj.island_size} devices"),
        ("device", d.name),
        ("device memory", fmt_bytes(d.memory_bytes)),
        ("peak compute", f"{d.peak_flops / 1e12:.1f} TFLOP/s"),
        ("memory bandwidth", f"{d.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s"),
        ("intra-island bandwidth", fmt_rate(obj.intra_island_bandwidth_bytes_per_s)),
        ("inter-node bandwidth", f"{fmt_rate(per_device)} per device, "
                                 f"{fmt_rate(per_device * obj.devices_per_node)} per node"),
        ("link latency", f"{obj.link_latency_s * 1e6:g} us"),
    ]
    for field, value in rows:
        table.add_row(field, value)
    print_table(table)
