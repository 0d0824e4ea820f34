"""The cluster spec: nodes, devices, NVLink islands, memory and link bandwidths (`clusters/`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.codec import meta
from spindle_cli.artifacts.io import register
from spindle_cli.artifacts.limits import (
    MAX_BANDWIDTH_BYTES_PER_S,
    MAX_BANDWIDTH_WHY,
    MAX_DEVICES,
    MAX_DEVICES_WHY,
    MAX_LINK_LATENCY_S,
    MAX_LINK_LATENCY_WHY,
    MAX_PEAK_FLOPS,
    MAX_PEAK_FLOPS_WHY,
    MIN_BANDWIDTH_BYTES_PER_S,
    MIN_BANDWIDTH_WHY,
    MIN_MEMORY_BANDWIDTH_WHY,
    MIN_PEAK_FLOPS,
    MIN_PEAK_FLOPS_WHY,
)
from spindle_cli.errors import FieldError


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or one CPU rank for `local-cpu`)."""

    name: str = field(metadata=meta("device model, e.g. A800-80GB", name=True))
    memory_bytes: int = field(metadata=meta("usable device memory in bytes", gt=0))
    peak_flops: float = field(metadata=meta("peak dense FLOP/s at the training dtype",
                                            ge=MIN_PEAK_FLOPS, ge_why=MIN_PEAK_FLOPS_WHY,
                                            le=MAX_PEAK_FLOPS, le_why=MAX_PEAK_FLOPS_WHY))
    memory_bandwidth_bytes_per_s: float = field(
        metadata=meta("device memory bandwidth",
                      ge=MIN_BANDWIDTH_BYTES_PER_S, ge_why=MIN_MEMORY_BANDWIDTH_WHY,
                      le=MAX_BANDWIDTH_BYTES_PER_S, le_why=MAX_BANDWIDTH_WHY)
    )


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSpec(Artifact):
    """A homogeneous cluster. Ranks are numbered node by node; an island is a run of
    `island_size` consecutive ranks inside one node joined by NVLink."""

    KIND = "cluster"
    VERSION = 1

    name: str = field(metadata=meta("cluster name", name=True))
    description: str = field(default="", metadata=meta("one-line description"))
    num_nodes: int = field(
        metadata=meta("number of nodes", ge=1, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)
    )
    devices_per_node: int = field(
        metadata=meta("devices in each node", ge=1, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)
    )
    island_size: int = field(metadata=meta("devices per NVLink island", ge=1))
    device: DeviceSpec = field(metadata=meta("the device every rank runs on"))
    intra_island_bandwidth_bytes_per_s: float = field(
        metadata=meta("per-device bandwidth inside an island (NVLink)",
                      ge=MIN_BANDWIDTH_BYTES_PER_S, ge_why=MIN_BANDWIDTH_WHY,
                      le=MAX_BANDWIDTH_BYTES_PER_S, le_why=MAX_BANDWIDTH_WHY)
    )
    inter_node_bandwidth_bytes_per_s: float = field(
        metadata=meta("per-device bandwidth between nodes (InfiniBand)",
                      ge=MIN_BANDWIDTH_BYTES_PER_S, ge_why=MIN_BANDWIDTH_WHY,
                      le=MAX_BANDWIDTH_BYTES_PER_S, le_why=MAX_BANDWIDTH_WHY)
    )
    link_latency_s: float = field(
        default=5e-6,
        metadata=meta("per-message latency", ge=0, le=MAX_LINK_LATENCY_S,
                      le_why=MAX_LINK_LATENCY_WHY),
    )
    backend: Literal["nccl", "gloo"] = field(
        default="nccl",
        metadata=meta("the torch.distributed backend `spindle run` uses here (nccl on GPUs, "
                      "gloo on CPU ranks); the planner times the gradient buckets the "
                      "executor makes on it"),
    )

    def __post_init__(self) -> None:
        Artifact.__post_init__(self)
        if self.num_devices > MAX_DEVICES:
            raise FieldError(
                "num_nodes",
                f"{self.num_nodes} nodes x {self.devices_per_node} devices is "
                f"{self.num_devices} devices, more than {MAX_DEVICES} ({MAX_DEVICES_WHY})",
            )
        if self.devices_per_node % self.island_size:
            raise FieldError(
                "island_size",
                f"{self.island_size} does not divide devices_per_node {self.devices_per_node}",
            )

    @property
    def num_devices(self) -> int:
        """Total number of ranks."""
        return self.num_nodes * self.devices_per_node

    def island_of(self, rank: int) -> int:
        """Index of the island that holds `rank`."""
        return rank // self.island_size

    def node_of(self, rank: int) -> int:
        """Index of the node that holds `rank`."""
        return rank // self.devices_per_node

    def islands(self) -> list[list[int]]:
        """Ranks of every island, in order."""
        n, s = self.num_devices, self.island_size
        return [list(range(i, i + s)) for i in range(0, n, s)]

    def bandwidth_bytes_per_s(self, src: int, dst: int) -> float:
        """Bandwidth of the path between two ranks (infinite on the same rank)."""
        if src == dst:
            return float("inf")
        if self.island_of(src) == self.island_of(dst):
            return self.intra_island_bandwidth_bytes_per_s
        return self.inter_node_bandwidth_bytes_per_s
