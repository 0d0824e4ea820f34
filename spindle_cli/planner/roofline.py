"""Analytic device models: the time and memory of one operator (one layer of a MetaOp) on a
per-device slice, for `spindle profile --hardware a800|h100|h200`.

time = max(flops / (peak * eff(work)), bytes / bandwidth) + kernels * launch_cost
       + tensor-parallel all-reduce time

Constants and where they come from:
- Peak dense bf16 FLOP/s and HBM bandwidth: NVIDIA datasheets. A800 SXM4 80GB = A100 SXM4
  80GB compute and memory: 312 TFLOP/s, 2.039 TB/s (A100 datasheet); its NVLink is cut to
  400 GB/s bidirectional (A800 product brief). H100 SXM5 80GB: 989 TFLOP/s, 3.35 TB/s, NVLink
  900 GB/s bidirectional (H100 datasheet). H200 SXM 141GB: 989 TFLOP/s, 4.8 TB/s, NVLink
  900 GB/s (H200 datasheet). Link figures are used per direction (half the bidirectional one)
  unless a cluster spec gives its own.
- EFF_MAX = 0.8: large bf16 GEMMs reach about 80% of peak under cuBLAS (NVIDIA "Matrix
  Multiplication Background User's Guide"; end-to-end MFU of ~50% in Megatron-LM, Narayanan et
  al. SC'21, also pays for non-GEMM kernels and communication, which this model adds
  separately).
- KERNEL_HALF_S = 6e-6: a GEMM kernel reaches half of EFF_MAX when its ideal time at peak is
  about 6 us. Calibrated so that a 512x512x512 bf16 GEMM (0.27 GFLOP, 0.9 us ideal on an A100)
  takes about 9 us (about 10% of peak), which is what small cuBLAS GEMMs show in the same guide
  (tile and wave quantization: too few thread blocks to fill 108 SMs). This term is what makes
  small per-device work (text encoders with short sequences) scale poorly while large work
  (vision encoders with long patch sequences) scales almost linearly, as in the paper's Fig. 4.
- LAUNCH_S = 4e-6: CUDA kernel launch plus PyTorch eager dispatch, a few microseconds per
  kernel (CUDA C++ Best Practices Guide; PyTorch eager overhead measurements).
- KERNELS_PER_LAYER: kernels launched by one layer forward+backward in eager PyTorch
  (forward count times ~3 for the backward): pre-LN transformer 16 forward (2 LN, QKV, attention,
  out-proj, 2 MLP GEMMs, activation, 2 residual adds, dropouts, reshapes) -> 48; GEMM_KERNELS
  counts those that carry the FLOPs (4 GEMMs + attention forward, twice that backward).
- Memory traffic: each layer reads its weights three times (forward, backward-data,
  backward-weight) and writes the gradient once; activations kept for backward are written once
  and read twice (backward-data and backward-weight).
- Tensor parallel of degree t (Megatron-LM, Shoeybi et al. 2019): FLOPs, weights and the
  sharded activations split t ways; two all-reduces of the layer output in the forward pass and
  two in the backward, ring algorithm: 2 (t-1)/t * bytes / link_bandwidth + 2 (t-1) * latency
  (Thakur et al., "Optimization of Collective Communication Operations in MPICH", 2005).
  Without sequence parallelism about 30% of the activations stay replicated (Korthikanti et al.
  2022: 10sh of 34sh per layer).
- Optimizer state: mixed-precision Adam keeps fp32 master weights and two fp32 moments, 12
  bytes per parameter (Rajbhandari et al., ZeRO, 2020); 8 bytes when training in fp32.
- The data-parallel gradient all-reduce is NOT part of the operator time: the simulator charges
  parameter synchronization separately.
- Optimizer step (`optimizer_cost`): AdamW is elementwise and memory-bound. Per parameter it
  reads the fp32 master weight, the gradient and two fp32 moments and writes back the master
  weight, the moments and the training-dtype copy: 4+2+4+4 read + 4+4+4+2 written = 28 bytes
  with a 16-bit training dtype (4+4+4+4 + 4+4+4 = 28 in fp32). Per tensor, one multi-tensor
  kernel launch plus dispatch, OPTIMIZER_TENSOR_S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.graph import MetaOp
from spindle_cli.artifacts.profile import MemoryModel, OptimizerCost, tp_degree

EFF_MAX = 0.8
KERNEL_HALF_S = 6e-6
LAUNCH_S = 4e-6
ADAM_BYTES_PER_PARAM = 28
OPTIMIZER_TENSOR_S = 10e-6
REPLICATED_ACTIVATION_FRACTION = 10 / 34
MIN_TP_SHARD_WIDTH = 64
"""Narrowest per-device width a tensor-parallel shard may have (one attention head of 64)."""

KERNELS_PER_LAYER = {
    "embedding": 8,
    "patch_embed": 8,
    "transformer_encoder": 48,
    "transformer_decoder": 48,
    "adapter": 6,
    "projection": 6,
    "contrastive_loss": 20,
    "lm_loss": 12,
}
GEMM_KERNELS = {
    "embedding": 1,
    "patch_embed": 3,
    "transformer_encoder": 15,
    "transformer_decoder": 15,
    "adapter": 3,
    "projection": 3,
    "contrastive_loss": 6,
    "lm_loss": 3,
}
TP_KINDS = ("transformer_encoder", "transformer_decoder")
TP_DEGREES = (2, 4, 8)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceModel:
    """One accelerator as the roofline sees it."""

    name: str
    peak_flops: float
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    nvlink_bandwidth_bytes_per_s: float
    """Per direction, used for tensor-parallel collectives when no cluster spec is given."""
    island_size: int = 8


GIB = 1024**3
HARDWARE: dict[str, DeviceModel] = {
    "a800": DeviceModel(
        name="A800-SXM4-80GB",
        peak_flops=312e12,
        memory_bandwidth_bytes_per_s=2.039e12,
        memory_bytes=80 * GIB,
        nvlink_bandwidth_bytes_per_s=200e9,
    ),
    "h100": DeviceModel(
        name="H100-SXM5-80GB",
        peak_flops=989e12,
        memory_bandwidth_bytes_per_s=3.35e12,
        memory_bytes=80 * GIB,
        nvlink_bandwidth_bytes_per_s=450e9,
    ),
    "h200": DeviceModel(
        name="H200-SXM-141GB",
        peak_flops=989e12,
        memory_bandwidth_bytes_per_s=4.8e12,
        memory_bytes=141 * GIB,
        nvlink_bandwidth_bytes_per_s=450e9,
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Links:
    """What tensor-parallel collectives run over: one island's links."""

    island_size: int
    bandwidth_bytes_per_s: float
    latency_s: float


def links_for(device: DeviceModel, cluster: ClusterSpec | None) -> Links:
    """The cluster's island links, or the device's own NVLink figures without a cluster."""
    if cluster is None:
        return Links(
            island_size=device.island_size,
            bandwidth_bytes_per_s=device.nvlink_bandwidth_bytes_per_s,
            latency_s=5e-6,
        )
    return Links(
        island_size=cluster.island_size,
        bandwidth_bytes_per_s=cluster.intra_island_bandwidth_bytes_per_s,
        latency_s=cluster.link_latency_s,
    )


def optimizer_cost(device: DeviceModel) -> OptimizerCost:
    """The AdamW step of `device` (module docstring: memory-bound, plus a launch per tensor)."""
    return OptimizerCost(
        ms_per_tensor=OPTIMIZER_TENSOR_S * 1e3,
        ms_per_million_params=ADAM_BYTES_PER_PARAM * 1e6 / device.memory_bandwidth_bytes_per_s
        * 1e3,
    )


def optimizer_bytes_per_param(dtype_bytes: int) -> int:
    """fp32 master copy + two Adam moments with a 16-bit training dtype; moments only in fp32."""
    return 12 if dtype_bytes < 4 else 8


def memory_model(op: MetaOp, dtype_bytes: int) -> MemoryModel:
    """Per-layer memory by category under data parallelism (what `Curve.memory` records).
    Other strategies read it through `layer_memory_bytes`; each profiled point also records its
    own peak (`ProfilePoint.peak_memory_bytes`, the same formula for the analytic source)."""
    return MemoryModel(
        param_bytes=op.params_per_layer * dtype_bytes,
        grad_bytes=op.params_per_layer * dtype_bytes,
        optimizer_bytes=op.params_per_layer * optimizer_bytes_per_param(dtype_bytes),
        activation_bytes_per_sample=op.stash_bytes_per_sample,
    )


def layer_memory_bytes(memory: MemoryModel, batch: int, t: int) -> int:
    """One layer's memory on one device under tensor parallelism of degree t (t = 1: data
    parallel) with `batch` samples per group: parameters, gradients and optimizer state split
    t ways (param_bytes / t, ...); activations split t ways except the part Megatron-LM keeps
    replicated without sequence parallelism (REPLICATED_ACTIVATION_FRACTION). Memory
    strategies compose on top: ZeRO divides the optimizer (and gradient) terms further by the
    data-parallel group count, recomputation replaces the activation term by the layer input."""
    static = (memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes) / t
    shard = REPLICATED_ACTIVATION_FRACTION + (1 - REPLICATED_ACTIVATION_FRACTION) / t
    return int(static + memory.activation_bytes_per_sample * batch * shard)


def strategies(op: MetaOp, n: int, island_size: int) -> list[str]:
    """Strategies worth profiling at n devices: 'dp' always; 'tp<t>' for transformer layers
    when t divides the island size (each group inside one island, the islands split into
    whole groups: `schedules.op_curves` plans no other degree) and n, and leaves shards at least
    MIN_TP_SHARD_WIDTH wide."""
    out = ["dp"]
    if op.layer_kind in TP_KINDS:
        for t in TP_DEGREES:
            wide = op.out_width % t == 0 and op.out_width // t >= MIN_TP_SHARD_WIDTH
            if island_size % t == 0 and n % t == 0 and wide:
                out.append(f"tp{t}")
    return out


def per_device_batch(op: MetaOp, n: int, strategy: str) -> int | None:
    """Samples the busiest data-parallel group gets (ceil(B / groups)); None when there are
    more groups than samples (some devices would idle: not a valid allocation). The
    contrastive loss couples every pair of samples, so each rank computes it on the whole
    gathered batch (runtime/layers.py): its work does not split."""
    if op.layer_kind == "contrastive_loss":
        return op.batch_size
    groups = n // tp_degree(strategy)
    if groups > op.batch_size:
        return None
    return math.ceil(op.batch_size / groups)


def allreduce_s(num_bytes: float, t: int, links: Links) -> float:
    """Ring all-reduce of `num_bytes` over t devices of one island."""
    if t == 1:
        return 0.0
    return 2 * (t - 1) / t * num_bytes / links.bandwidth_bytes_per_s + 2 * (t - 1) * links.latency_s


def peak_memory_bytes(op: MetaOp, batch: int, t: int, dtype_bytes: int) -> int:
    """Weights, gradients, optimizer state and kept activations of one layer on one device."""
    return layer_memory_bytes(memory_model(op, dtype_bytes), batch, t)


def operator_time_s(
    op: MetaOp, batch: int, strategy: str, *, device: DeviceModel, links: Links, dtype_bytes: int
) -> float:
    """Forward+backward time of one layer on one device of the slice (see the module
    docstring); `batch` is the per-group batch."""
    t = tp_degree(strategy)
    flops = op.flops_per_layer * batch / op.batch_size / t
    gemm_work = flops / GEMM_KERNELS[op.layer_kind]
    half_work = device.peak_flops * KERNEL_HALF_S
    eff = EFF_MAX * gemm_work / (gemm_work + half_work)
    compute_s = flops / (device.peak_flops * eff) if flops > 0 else 0.0
    shard = REPLICATED_ACTIVATION_FRACTION + (1 - REPLICATED_ACTIVATION_FRACTION) / t
    traffic = 4 * op.params_per_layer * dtype_bytes / t
    traffic += 3 * op.stash_bytes_per_sample * batch * shard
    memory_s = traffic / device.memory_bandwidth_bytes_per_s
    launch_s = KERNELS_PER_LAYER[op.layer_kind] * LAUNCH_S
    out_bytes = batch * op.out_seq_len * op.out_width * dtype_bytes
    comm_s = 4 * allreduce_s(out_bytes, t, links)
    return max(compute_s, memory_s) + launch_s + comm_s
