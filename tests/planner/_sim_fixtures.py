"""Hand-built graph, profile, cluster and plans for simulator and view tests.

Two MetaOps of one task: `t/enc` (2 layers, level 0) feeds `t/head` (1 layer, level 1), batch
4. Curves are single alpha-beta pieces with alpha = 0, so T(n) = beta * B / n exactly.
"""

from __future__ import annotations

import dataclasses

from spindle_cli.artifacts import ClusterSpec, DeviceSpec, MetaOp, MetaOpGraph, Plan, Profile
from spindle_cli.artifacts.base import InputRef
from spindle_cli.artifacts.io import derived_header
from spindle_cli.artifacts.plan import LevelBound, ParamGroup, RankMemory, Slice, Transfer, Wave
from spindle_cli.artifacts.profile import Curve, CurvePiece, Fingerprint, MemoryModel
from spindle_cli.planner.simulate import SimResult, simulate

BATCH = 4


def cluster(*, latency_s: float = 0.0, num_nodes: int = 2) -> ClusterSpec:
    """2 nodes x 2 devices (or 1 x 4), one island per node: NVLink 100 GB/s per device,
    network 10 GB/s per device (a 20 GB/s NIC per 2-device node)."""
    return ClusterSpec(
        kind="cluster", version=1, name="toy-2x2", num_nodes=num_nodes,
        devices_per_node=4 // num_nodes, island_size=4 // num_nodes,
        device=DeviceSpec(name="toy", memory_bytes=80 * 2**30, peak_flops=1e12,
                          memory_bandwidth_bytes_per_s=1e12),
        intra_island_bandwidth_bytes_per_s=100e9, inter_node_bandwidth_bytes_per_s=10e9,
        link_latency_s=latency_s,
    )


def _metaop(mid: str, module: str, num_layers: int, level: int, preds: tuple[str, ...],
            out_bytes: int, batch: int) -> MetaOp:
    return MetaOp(
        id=mid, task="t", step=mid.split("/")[1], module=module,
        layer_kind="transformer_encoder", first_layer=0, num_layers=num_layers,
        batch_size=batch, seq_len=8, in_width=16, out_seq_len=8, out_width=16, level=level,
        predecessors=preds, signature=f"sig-{module}", flops_per_layer=6e9,
        params_per_layer=1000, activation_in_bytes=out_bytes, activation_out_bytes=out_bytes,
        stash_bytes_per_sample=1000,
    )


def graph(batch: int = BATCH) -> MetaOpGraph:
    return MetaOpGraph(
        **derived_header(MetaOpGraph, []), model="toy", tasks=("t",), dtype="bf16",
        num_levels=2,
        metaops=(
            _metaop("t/enc", "enc", 2, 0, (), 400_000_000, batch),
            _metaop("t/head", "head", 1, 1, ("t/enc",), 1_000, batch),
        ),
    )


def _curve(sig: str, beta_ms: float, batch: int) -> Curve:
    return Curve(
        signature=sig, batch_size=batch, points=(),
        pieces=(CurvePiece(n_lo=1, n_hi=4, alpha_ms=0.0, beta_ms=beta_ms, strategy="dp"),),
        memory=MemoryModel(param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                           activation_bytes_per_sample=0),
        max_rel_error=0.0,
    )


def profile(batch: int = BATCH) -> Profile:
    """enc: 3 ms per sample per operator; head: 1.5 ms."""
    return Profile(
        **derived_header(Profile, []), source="analytic",
        fingerprint=Fingerprint(hardware="toy", device_name="toy", torch_version="", dtype="bf16"),
        counts=(1, 2, 4),
        curves=(_curve("sig-enc", 3.0, batch), _curve("sig-head", 1.5, batch)),
    )


def plan(enc_ranks: tuple[int, ...] = (0, 1), head_ranks: tuple[int, ...] = (2, 3),
         *, enc_sync_bytes: int = 1_000_000_000, head_sync_bytes: int = 500_000_000,
         static_bytes: int = 0, inputs: tuple[InputRef, ...] = ()) -> Plan:
    """Wave 0 runs t/enc on `enc_ranks`, wave 1 runs t/head on `head_ranks`; one transfer;
    one parameter group per module."""
    enc = Slice(id="w0.0", metaop="t/enc", first=0, last=2, ranks=enc_ranks, strategy="dp",
                time_ms=12.0)
    head = Slice(id="w1.0", metaop="t/head", first=0, last=1, ranks=head_ranks, strategy="dp",
                 time_ms=3.0)
    return Plan(
        **derived_header(Plan, list(inputs)), model="toy", cluster="toy-2x2", planner="spindle",
        num_devices=4, islands=((0, 1), (2, 3)),
        waves=(Wave(index=0, level=0, start_ms=0.0, duration_ms=12.0, slices=(enc,)),
               Wave(index=1, level=1, start_ms=12.0, duration_ms=3.0, slices=(head,))),
        transfers=(Transfer(src="w0.0", dst="w1.0", bytes=400_000_000, src_ranks=enc_ranks,
                            dst_ranks=head_ranks),),
        param_groups=(
            ParamGroup(module="enc", first_layer=0, last_layer=2, ranks=enc_ranks,
                       bytes=enc_sync_bytes),
            ParamGroup(module="head", first_layer=0, last_layer=1, ranks=head_ranks,
                       bytes=head_sync_bytes),
        ),
        memory=tuple(RankMemory(rank=r, param_bytes=static_bytes, grad_bytes=0,
                                optimizer_bytes=0, activation_bytes=0) for r in range(4)),
        levels=(LevelBound(level=0, lower_bound_ms=6.0, estimated_ms=12.0),
                LevelBound(level=1, lower_bound_ms=1.5, estimated_ms=3.0)),
        lower_bound_ms=7.5, estimated_iteration_ms=15.0,
    )


def graph_with_aux(batch: int = BATCH) -> MetaOpGraph:
    """`graph` plus `t/aux` (1 layer, level 0, no predecessors), which runs between t/enc and
    t/head in `plan_skipping_a_wave`."""
    g = graph(batch)
    aux = _metaop("t/aux", "aux", 1, 0, (), 1_000, batch)
    return MetaOpGraph(**derived_header(MetaOpGraph, []), model="toy", tasks=("t",),
                       dtype="bf16", num_levels=2,
                       metaops=(g.metaops[0], aux, g.metaops[1]))


def profile_with_aux(batch: int = BATCH) -> Profile:
    """`profile` plus t/aux at 1.5 ms per sample per operator."""
    p = profile(batch)
    return Profile(**derived_header(Profile, []), source="analytic", fingerprint=p.fingerprint,
                   counts=p.counts, curves=(_curve("sig-aux", 1.5, batch), *p.curves))


def plan_skipping_a_wave() -> Plan:
    """Wave 0: t/enc on ranks 0-1; wave 1: t/aux on ranks 2-3; wave 2: t/head on ranks 2-3,
    fed by t/enc across the two nodes (a transfer that skips wave 1). No parameter sync."""
    enc = Slice(id="w0.0", metaop="t/enc", first=0, last=2, ranks=(0, 1), strategy="dp",
                time_ms=12.0)
    aux = Slice(id="w1.0", metaop="t/aux", first=0, last=1, ranks=(2, 3), strategy="dp",
                time_ms=3.0)
    head = Slice(id="w2.0", metaop="t/head", first=0, last=1, ranks=(2, 3), strategy="dp",
                 time_ms=3.0)
    return Plan(
        **derived_header(Plan, []), model="toy", cluster="toy-2x2", planner="spindle",
        num_devices=4, islands=((0, 1), (2, 3)),
        waves=(Wave(index=0, level=0, start_ms=0.0, duration_ms=12.0, slices=(enc,)),
               Wave(index=1, level=0, start_ms=12.0, duration_ms=3.0, slices=(aux,)),
               Wave(index=2, level=1, start_ms=15.0, duration_ms=3.0, slices=(head,))),
        transfers=(Transfer(src="w0.0", dst="w2.0", bytes=400_000_000, src_ranks=(0, 1),
                            dst_ranks=(2, 3)),),
        param_groups=tuple(
            ParamGroup(module=m, first_layer=0, last_layer=n, ranks=r, bytes=0)
            for m, n, r in (("aux", 1, (2, 3)), ("enc", 2, (0, 1)), ("head", 1, (2, 3)))),
        memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                activation_bytes=0) for r in range(4)),
        levels=(LevelBound(level=0, lower_bound_ms=6.0, estimated_ms=15.0),
                LevelBound(level=1, lower_bound_ms=1.5, estimated_ms=3.0)),
        lower_bound_ms=7.5, estimated_iteration_ms=18.0,
    )


def plan_split_encoder() -> Plan:
    """t/enc's two layers in waves 0 and 1, then t/head in wave 2, all on ranks 0-1 (no
    transfer between ranks); t/enc's parameter group holds 1 GB, t/head's none."""
    ranks = (0, 1)
    slices = [Slice(id="w0.0", metaop="t/enc", first=0, last=1, ranks=ranks, strategy="dp",
                    time_ms=6.0),
              Slice(id="w1.0", metaop="t/enc", first=1, last=2, ranks=ranks, strategy="dp",
                    time_ms=6.0),
              Slice(id="w2.0", metaop="t/head", first=0, last=1, ranks=ranks, strategy="dp",
                    time_ms=3.0)]
    return Plan(
        **derived_header(Plan, []), model="toy", cluster="toy-2x2", planner="spindle",
        num_devices=4, islands=((0, 1), (2, 3)),
        waves=tuple(Wave(index=i, level=min(i, 1), start_ms=6.0 * i, duration_ms=s.time_ms,
                         slices=(s,)) for i, s in enumerate(slices)),
        transfers=(Transfer(src="w0.0", dst="w1.0", bytes=400_000_000, src_ranks=ranks,
                            dst_ranks=ranks),
                   Transfer(src="w1.0", dst="w2.0", bytes=400_000_000, src_ranks=ranks,
                            dst_ranks=ranks)),
        param_groups=(ParamGroup(module="enc", first_layer=0, last_layer=2, ranks=ranks,
                                 bytes=1_000_000_000),
                      ParamGroup(module="head", first_layer=0, last_layer=1, ranks=ranks,
                                 bytes=0)),
        memory=tuple(RankMemory(rank=r, param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                                activation_bytes=0) for r in range(4)),
        levels=(LevelBound(level=0, lower_bound_ms=6.0, estimated_ms=12.0),
                LevelBound(level=1, lower_bound_ms=1.5, estimated_ms=3.0)),
        lower_bound_ms=7.5, estimated_iteration_ms=15.0,
    )


def zero1_chunked(progress: str = "wave") -> tuple[Plan, SimResult]:
    """`plan` under ZeRO-1, simulated with chunked buckets: enc runs layer 0 2.5-4.5 ms,
    stalls until layer 1's all-gather arrives (5) and runs it 5-7; 60.5 ms in all
    (test_memory_simulate works it out)."""
    zero = dataclasses.replace(plan(), options={**plan().options, "zero": "1"})
    return zero, simulate(zero, graph(), profile(), cluster(), sync="chunked", progress=progress)
