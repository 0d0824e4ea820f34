"""Hand-built MetaOp graphs, profiles and clusters for the planner tests (no dependency on the
graph builder or the profiler)."""

from __future__ import annotations

from spindle_cli.artifacts.cluster import ClusterSpec, DeviceSpec
from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.profile import Curve, CurvePiece, Fingerprint, MemoryModel, Profile

GIB = 1 << 30


def curve(signature: str, batch: int, pieces: list[tuple[int, int, float, float, str]]) -> Curve:
    """A curve from (n_lo, n_hi, alpha_ms, beta_ms, strategy) pieces."""
    return Curve(
        signature=signature, batch_size=batch, points=(),
        pieces=tuple(CurvePiece(n_lo=a, n_hi=b, alpha_ms=al, beta_ms=be, strategy=st)
                     for a, b, al, be, st in pieces),
        memory=MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                           activation_bytes_per_sample=0),
        max_rel_error=0.0,
    )


def two_point_curve(signature: str, batch: int, t1_ms: float, t2_ms: float) -> Curve:
    """A one-piece data-parallel curve through T(1) = t1 and T(2) = t2."""
    beta_b = 2 * (t1_ms - t2_ms)
    return curve(signature, batch, [(1, 1 << 20, t1_ms - beta_b, beta_b / batch, "dp")])


def alpha_beta_curve(signature: str, batch: int, alpha_ms: float, beta_ms: float) -> Curve:
    """T(n) = alpha + beta * B / n, data parallel."""
    return curve(signature, batch, [(1, 1 << 20, alpha_ms, beta_ms, "dp")])


def metaop(mid: str, *, level: int = 0, layers: int = 4, batch: int = 8,
           preds: tuple[str, ...] = (), module: str | None = None, signature: str | None = None,
           params: int = 1000, act_bytes: int = 4096, stash: int = 64) -> MetaOp:
    """A MetaOp '<task>/<step>' of transformer layers."""
    task, step = mid.split("/")
    return MetaOp(
        id=mid, task=task, step=step, module=module or step, layer_kind="transformer_encoder",
        first_layer=0, num_layers=layers, batch_size=batch, seq_len=16, in_width=32,
        out_seq_len=16, out_width=32, level=level, predecessors=preds,
        signature=signature or mid, flops_per_layer=1e9, params_per_layer=params,
        activation_in_bytes=act_bytes, activation_out_bytes=act_bytes,
        stash_bytes_per_sample=stash,
    )


def graph(metaops: list[MetaOp], dtype: str = "bf16") -> MetaOpGraph:
    """A graph of the given MetaOps (tasks in first-appearance order)."""
    tasks: list[str] = []
    for m in metaops:
        if m.task not in tasks:
            tasks.append(m.task)
    ordered = tuple(sorted(metaops, key=lambda m: (m.level, m.id)))
    return MetaOpGraph(**derived_header(MetaOpGraph, []), model="test", tasks=tuple(tasks),
                       dtype=dtype, num_levels=max(m.level for m in metaops) + 1, metaops=ordered)


def profile(curves: list[Curve]) -> Profile:
    """A profile holding the curves."""
    return Profile(
        **derived_header(Profile, []), source="analytic",
        fingerprint=Fingerprint(hardware="test", device_name="test", torch_version="",
                                dtype="bf16"),
        counts=(1, 2, 4), curves=tuple(sorted(curves, key=lambda c: c.signature)),
    )


def cluster(num_nodes: int = 1, per_node: int = 4, island: int | None = None,
            memory_bytes: int = 80 * GIB, name: str = "test") -> ClusterSpec:
    """A homogeneous cluster."""
    return ClusterSpec(
        kind="cluster", version=1, name=name, num_nodes=num_nodes, devices_per_node=per_node,
        island_size=island or per_node,
        device=DeviceSpec(name="test", memory_bytes=memory_bytes, peak_flops=1e14,
                          memory_bandwidth_bytes_per_s=1e12),
        intra_island_bandwidth_bytes_per_s=1e11, inter_node_bandwidth_bytes_per_s=1e10,
    )
