"""Per-rank memory accounting for placement and for the plan's `memory` table.

Model (mixed-precision Adam): each parameter costs 2 B (bf16/fp16 weights) + 2 B (gradients) +
12 B (fp32 master copy and two Adam moments); an fp32 graph costs 4 + 4 + 8. A rank holds one
replica of every layer it ever runs, however many tasks use it (tensor-parallel slices of
degree t hold 1/t of it: the i-th rank of a group holds shard i of t, which is, as the
simulator's gradient rings count it, the finer shards j = i mod t of a layer split into any
multiple of t; a rank that runs other shards of a layer in other slices holds their union).
Activations: forward waves run first and backward waves in reverse, so every slice's stash is
alive at the forward/backward turn; the peak is the sum over all slices a rank runs of
stash_bytes_per_sample * rows on that rank * operators. Under 'tp<t>' a
rank keeps 1/t of the stash except the part Megatron-LM replicates without sequence
parallelism (`roofline.REPLICATED_ACTIVATION_FRACTION`, the profile's own memory model).

Memory strategies (`MemoryStrategy`), as Megatron/DeepSpeed apply them:
- ZeRO stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
  weights, over the layer's parameter device group (every rank holding a replica of it; the
  plan's `param_groups`). A rank keeps `held / replicas` of the sharded categories, where
  `replicas` sums the held fractions of the layer over all ranks (the data-parallel copies:
  g ranks under 'dp', g / t groups under 'tp<t>'). Stage 3 gathers one layer's full weights
  (its 1/t under 'tp<t>') at a time for compute: a rank also needs the largest such buffer of
  any slice it runs, counted with its parameters.
- Recomputation keeps only each operator's input per sample for backward and recomputes the
  rest in one extra forward (the planner charges +1/3 of fwd+bwd time); during the backward of
  one operator its full stash is alive again, so a rank also needs the largest one-operator
  stash of any slice it runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.plan import ZERO_STAGES, Plan, RankMemory, tp_group_size
from spindle_cli.artifacts.profile import tp_degree
from spindle_cli.planner.roofline import REPLICATED_ACTIVATION_FRACTION


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStrategy:
    """How a plan saves device memory (see the module docstring)."""

    zero: int = 0
    """ZeRO stage: 0 (replicate everything), 1 (shard optimizer state), 2 (+ gradients),
    3 (+ weights)."""
    recompute: bool = False
    """Activation recomputation: keep only each operator's input for backward."""

    def __post_init__(self) -> None:
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"unknown ZeRO stage {self.zero!r} (expected one of {ZERO_STAGES})")


NO_SAVING = MemoryStrategy()


ELEMENT_BYTES = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one element of each dtype a graph counts in or a run trains in."""


def run_bytes(memory: RankMemory, planned: str, dtype: str) -> int:
    """A rank's estimated bytes (`memory`, counted in its graph's dtype `planned`) when the run
    trains in `dtype`: activations by the element size, each state category by its bytes per
    parameter (`state_bytes_per_param`)."""
    ratios = [new / old for new, old in zip(state_bytes_per_param(dtype),
                                            state_bytes_per_param(planned), strict=True)]
    return round(memory.param_bytes * ratios[0] + memory.grad_bytes * ratios[1]
                 + memory.optimizer_bytes * ratios[2]
                 + memory.activation_bytes * ELEMENT_BYTES[dtype] / ELEMENT_BYTES[planned])


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter: a 16-bit dtype's mixed
    precision keeps fp32 master weights and moments; fp32, and fp64 (a `spindle run --dtype
    fp64`), keep both moments at their own width."""
    wide = {"fp32": 4, "fp64": 8}.get(dtype)
    return (2, 2, 12) if wide is None else (wide, wide, 2 * wide)


def split_state_bytes(dtype: str, zero: int) -> tuple[int, int]:
    """(replicated, sharded) state bytes per parameter under a ZeRO stage."""
    w, g, o = state_bytes_per_param(dtype)
    sharded = (0, o, g + o, w + g + o)[zero]
    return w + g + o - sharded, sharded


def kept_bytes_per_sample(metaop: MetaOp, recompute: bool) -> int:
    """Activation bytes one operator keeps per sample until its backward: its stash, or with
    recomputation only its input (the larger of the MetaOp's input and output per sample,
    since inner operators take the previous operator's output), never more than the stash."""
    if not recompute:
        return metaop.stash_bytes_per_sample
    boundary = max(metaop.activation_in_bytes, metaop.activation_out_bytes)
    return min(metaop.stash_bytes_per_sample, -(-boundary // metaop.batch_size))


def stash_share(strategy: str) -> float:
    """The share of a tensor-parallel group's stash one of its ranks keeps (1 under 'dp')."""
    t = tp_degree(strategy)
    if t == 1:
        return 1.0
    return REPLICATED_ACTIVATION_FRACTION + (1.0 - REPLICATED_ACTIVATION_FRACTION) / t


def kept_bytes_per_rank_sample(metaop: MetaOp, strategy: str, recompute: bool) -> float:
    """What one operator keeps for backward per row on one rank of a slice: the stash share
    under tensor parallelism, or with recomputation the whole input (replicated over the
    tensor-parallel group)."""
    if recompute:
        return float(kept_bytes_per_sample(metaop, True))
    return metaop.stash_bytes_per_sample * stash_share(strategy)


def layer_params(graph: MetaOpGraph) -> dict[str, int]:
    """Parameters of one layer of each module: the most any of its MetaOps counts (a
    ParamGroup's gradient bytes are its layers times this times the gradient's bytes)."""
    per_layer: dict[str, int] = {}
    for m in graph.metaops:
        per_layer[m.module] = max(per_layer.get(m.module, 0), m.params_per_layer)
    return per_layer


def split_rows(num_rows: int, num_parts: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) row ranges of `num_rows` over `num_parts` data-parallel groups; the
    first `num_rows % num_parts` get one extra row (docs/CONTRACTS.md). The one rule the
    planner's memory, the simulator's flows and the runtime's messages share."""
    base, extra = divmod(num_rows, num_parts)
    out, lo = [], 0
    for i in range(num_parts):
        hi = lo + base + (i < extra)
        out.append((lo, hi))
        lo = hi
    return out


def rows_per_rank(batch: int, num_ranks: int, strategy: str) -> list[int]:
    """Rows each rank of a slice processes (ranks ascending; a tensor-parallel group of t
    consecutive ranks shares its group's rows)."""
    t = tp_group_size(num_ranks, strategy)
    return [hi - lo for lo, hi in split_rows(batch, num_ranks // t) for _ in range(t)]


@lru_cache(maxsize=4096)
def max_rows_per_rank(batch: int, num_ranks: int, strategy: str) -> int:
    """The most rows one rank of a slice processes (`rows_per_rank`; cached)."""
    return max(rows_per_rank(batch, num_ranks, strategy))


@lru_cache(maxsize=4096)
def _rows_array(batch: int, num_ranks: int, strategy: str) -> np.ndarray:
    """`rows_per_rank` as floats, cached and read-only (callers must not write to it)."""
    rows = np.asarray(rows_per_rank(batch, num_ranks, strategy), dtype=float)
    rows.flags.writeable = False
    return rows


SLICE_MEMORY_SHARE = 0.5
"""The most of a device's memory one slice may take; larger slices are split over waves so
that placement can spread a big module's layers over different ranks."""


def layer_bytes_per_rank(metaop: MetaOp, n: int, strategy: str, dtype: str,
                         memory: MemoryStrategy = NO_SAVING) -> float:
    """Memory one operator of the MetaOp needs on each of n ranks: its state (weights,
    gradients, optimizer; 1/t under tp<t>; sharded parts over the slice's n / t copies) and
    what it keeps for backward for the largest row share."""
    t = tp_degree(strategy)
    replicated, sharded = split_state_bytes(dtype, memory.zero)
    rows = max_rows_per_rank(metaop.batch_size, n, strategy)
    per_param = replicated + sharded / max(n // t, 1)
    return metaop.params_per_layer * per_param / t + \
        kept_bytes_per_rank_sample(metaop, strategy, memory.recompute) * rows


def max_ops_per_slice(metaop: MetaOp, n: int, strategy: str, dtype: str,
                      memory_bytes: int, memory: MemoryStrategy = NO_SAVING) -> int:
    """Operators of the MetaOp one slice on n ranks may run (at least one)."""
    per_layer = layer_bytes_per_rank(metaop, n, strategy, dtype, memory)
    if per_layer <= 0:
        return metaop.num_layers
    budget = SLICE_MEMORY_SHARE * memory_bytes - _recompute_peak(metaop, n, strategy, memory) \
        - _gather_buffer(metaop, strategy, dtype, memory)
    return max(1, int(budget // per_layer))


def least_layer_bytes(metaop: MetaOp, n: int, strategy: str, dtype: str) -> float:
    """The least memory one operator of the MetaOp needs on each of n ranks under the memory
    settings the planner tries (every ZeRO stage, with and without recomputation: its state
    sharded over the copies, under ZeRO-3 its weights gathered while it computes; with
    recomputation its input kept for backward and its stash alive again in its backward;
    on one device ZeRO shards nothing and only adds), its state sharded over the slice's own
    copies as `max_ops_per_slice` sizes slices (a module another slice holds too may shard
    over more ranks in placement): where this does not fit a device, the planner does not run
    the MetaOp on n."""
    return min(layer_bytes_per_rank(metaop, n, strategy, dtype, m)
               + _recompute_peak(metaop, n, strategy, m)
               + _gather_buffer(metaop, strategy, dtype, m)
               for m in (MemoryStrategy(zero=z, recompute=r)
                         for z in ZERO_STAGES for r in (False, True)))


def _gather_buffer(metaop: MetaOp, strategy: str, dtype: str, memory: MemoryStrategy) -> float:
    """ZeRO-3: one layer's weights gathered on a rank while it computes."""
    if memory.zero < 3:
        return 0.0
    return metaop.params_per_layer * state_bytes_per_param(dtype)[0] / tp_degree(strategy)


def _recompute_peak(metaop: MetaOp, n: int, strategy: str, memory: MemoryStrategy) -> float:
    """The one-operator stash alive again during its backward under recomputation."""
    if not memory.recompute:
        return 0.0
    rows = max_rows_per_rank(metaop.batch_size, n, strategy)
    return metaop.stash_bytes_per_sample * stash_share(strategy) * rows


class Ledger:
    """Memory committed so far on every rank (mutable; one per placement attempt)."""

    def __init__(self, graph: MetaOpGraph, num_devices: int,
                 memory: MemoryStrategy = NO_SAVING) -> None:
        self.num_devices = num_devices
        self.memory = memory
        self.weight_b, self.grad_b, self.opt_b = state_bytes_per_param(graph.dtype)
        self.replicated_b, self.sharded_b = split_state_bytes(graph.dtype, memory.zero)
        sizes: dict[str, int] = {}
        self.params_per_layer = layer_params(graph)
        for m in graph.metaops:
            sizes[m.module] = max(sizes.get(m.module, 0), m.first_layer + m.num_layers)
        self.held = {mod: np.zeros((n, num_devices)) for mod, n in sizes.items()}
        """Fraction of each (layer, rank) replica held: 1 for data parallel, 1/t for tp<t>,
        the union of the shards held for several tensor-parallel positions."""
        self._shards_held: dict[str, np.ndarray] = {}
        """Per module that a tensor-parallel slice ran, which of the layer's `_parts` finer
        shards each (layer, rank) holds: [layer, rank, shard]."""
        self._parts = 1
        self.activation = np.zeros(num_devices)
        self.peak = np.zeros(num_devices)
        """The largest one-operator stash a rank recomputes (0 without recomputation)."""
        self.buffer = np.zeros(num_devices)
        """The largest one-layer weight buffer a rank gathers (0 below ZeRO-3)."""
        self.dtype = graph.dtype
        self._used = np.zeros(num_devices)

    def kept_per_sample(self, metaop: MetaOp) -> int:
        """Bytes per sample an operator of the MetaOp keeps for backward."""
        return kept_bytes_per_sample(metaop, self.memory.recompute)

    def _shards(self, held: np.ndarray, replicas: np.ndarray) -> np.ndarray:
        """Per rank, the parameter-equivalents of a module's sharded state it keeps."""
        return (held / replicas[:, None]).sum(axis=0)

    @staticmethod
    def _replicas(held: np.ndarray) -> np.ndarray:
        return np.maximum(held.sum(axis=1), 1.0)

    def used(self) -> np.ndarray:
        """Bytes committed on every rank (kept up to date by `commit`)."""
        return self._used

    def wave_replicas(self, slices: Iterable[tuple[MetaOp, int, int, int, str]],
                      ) -> dict[str, np.ndarray]:
        """Per module, the replicas of each layer that one wave's slices (metaop, first, last,
        n, strategy) will hold between them once placed: at least that many hold it after
        the wave, since a wave uses a rank once (`need`'s `coming`)."""
        out: dict[str, np.ndarray] = {}
        for metaop, first, last, n, strategy in slices:
            held = out.setdefault(metaop.module, np.zeros(len(self.held[metaop.module])))
            held[metaop.first_layer + first:metaop.first_layer + last] += n / tp_degree(strategy)
        return out

    def need(self, metaop: MetaOp, first: int, last: int, n: int, strategy: str,
             coming: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """Extra bytes each rank would need to run the slice (rows rounded up, so the check
        holds wherever the rank sits in the slice). Sharded state as if the slice's n ranks
        were the only new holders, the least sharing possible, or with `coming`
        (`wave_replicas` of the slice's wave) as if the wave's slices were: a slice that
        shares a layer with a larger one of its wave is charged the shard it keeps once
        that one is placed too, not the whole state."""
        frac = 1.0 / tp_degree(strategy)
        rows = max_rows_per_rank(metaop.batch_size, n, strategy)
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        block = self.held[metaop.module][lo:hi]
        missing = np.maximum(frac - block, 0.0).sum(axis=0)
        stash = kept_bytes_per_rank_sample(metaop, strategy, self.memory.recompute) * rows * \
            (last - first)
        per_layer = self.params_per_layer[metaop.module]
        extra = missing * (per_layer * self.replicated_b) + stash
        if self.sharded_b:
            now = self._replicas(block)
            after = np.maximum(now, n * frac if coming is None else coming[metaop.module][lo:hi])
            grown = (np.maximum(block, frac) / after[:, None]).sum(axis=0) - \
                self._shards(block, now)
            extra = extra + grown * (per_layer * self.sharded_b)
        # the recomputation peak and the ZeRO-3 buffer are 0 everywhere without them
        if self.memory.recompute:
            peak = _recompute_peak(metaop, n, strategy, self.memory)
            extra = extra + np.maximum(peak - self.peak, 0.0)
        if self.memory.zero >= 3:
            buffer = _gather_buffer(metaop, strategy, self.dtype, self.memory)
            extra = extra + np.maximum(buffer - self.buffer, 0.0)
        return extra

    def shared_fraction(self, metaop: MetaOp, first: int, last: int) -> np.ndarray:
        """Per rank, the share of the slice's layers it already holds (0..1; a held share is
        at most 1, `commit`)."""
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        return self.held[metaop.module][lo:hi].sum(axis=0) / (hi - lo)

    def commit(self, metaop: MetaOp, first: int, last: int, ranks: tuple[int, ...] | np.ndarray,
               strategy: str) -> np.ndarray:
        """Record that `ranks` (in slice order, a tuple or an integer array) run the slice;
        returns, per rank of the slice, whether it now holds more of some layer than its
        largest share (other tensor-parallel shards of it, from other slices), which `need`
        does not foresee."""
        t = tp_degree(strategy)
        frac = 1.0 / t
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        idx = np.asarray(ranks)
        block = self.held[metaop.module][lo:hi, :]
        before = self._shards(block, self._replicas(block)) if self.sharded_b else None
        held = block[:, idx]
        largest = np.maximum(held, frac)
        if t > 1 or metaop.module in self._shards_held:
            union = self._hold_shards(metaop.module, lo, hi, idx, t,
                                      tp_group_size(len(idx), strategy))
            mixed = union > largest
            if mixed.any():
                largest = np.where(mixed, union, largest)
            beyond = mixed.any(axis=0)
        else:
            beyond = np.zeros(len(idx), dtype=bool)
        grown = (largest - held).sum(axis=0)
        block[:, idx] = largest
        rows = _rows_array(metaop.batch_size, len(ranks), strategy)
        stash = kept_bytes_per_rank_sample(metaop, strategy, self.memory.recompute) * rows * \
            (last - first)
        self.activation[idx] += stash
        per_layer = self.params_per_layer[metaop.module]
        self._used[idx] += grown * (per_layer * self.replicated_b) + stash
        if before is not None:
            # a new holder also shrinks every other holder's shard of these layers
            after = self._shards(block, self._replicas(block))
            self._used += (after - before) * (per_layer * self.sharded_b)
        if self.memory.recompute:
            peak = np.maximum(self.peak[idx], _recompute_peak(metaop, len(ranks), strategy,
                                                              self.memory))
            self._used[idx] += peak - self.peak[idx]
            self.peak[idx] = peak
        if self.memory.zero >= 3:
            buffer = np.maximum(self.buffer[idx], _gather_buffer(metaop, strategy, self.dtype,
                                                                 self.memory))
            self._used[idx] += buffer - self.buffer[idx]
            self.buffer[idx] = buffer
        return beyond

    def _hold_shards(self, module: str, lo: int, hi: int, idx: np.ndarray, t: int,
                     size: int) -> np.ndarray:
        """Mark layers [lo, hi) of `module` held by ranks `idx` (in slice order: the i-th of a
        group of `size` holds shard i mod size of t), and return the share of each (layer,
        rank) now held. The finer shards are refined to a multiple of t first: finer shard j
        of the refinement lies in shard j mod `_parts`, so each module's array repeats."""
        parts = math.lcm(self._parts, t)
        if parts != self._parts:
            for mod, shards in self._shards_held.items():
                self._shards_held[mod] = np.tile(shards, (1, 1, parts // self._parts))
            self._parts = parts
        if module not in self._shards_held:
            whole = self.held[module] >= 1.0
            self._shards_held[module] = np.repeat(whole[:, :, None], parts, axis=2)
        shards = self._shards_held[module]
        mine = np.arange(parts) % t == (np.arange(len(idx)) % size)[:, None]
        block = shards[lo:hi, idx] | mine
        shards[lo:hi, idx] = block
        return np.count_nonzero(block, axis=2) / parts

    def holder_ranges(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(module, first layer, last layer + 1, ranks) for every maximal range of a module's
        layers held (in any share) by the same ranks, by module name then layer."""
        modules = sorted(self.held)
        # every module's layers one after another, a row each
        holds = np.concatenate([self.held[module] for module in modules]) > 0
        held = holds.any(axis=1).tolist()
        # whether a row's holders differ from the next row's
        changed = (holds[1:] != holds[:-1]).any(axis=1).tolist()
        ranges = []
        row = 0
        for module in modules:
            num_layers = len(self.held[module])
            start = None
            for layer in range(num_layers):
                if not held[row + layer]:
                    continue
                if start is None:
                    start = layer
                if layer + 1 == num_layers or not held[row + layer + 1] or changed[row + layer]:
                    ranges.append((module, start, layer + 1,
                                   tuple(holds[row + start].nonzero()[0].tolist())))
                    start = None
            row += num_layers
        return ranges

    def table(self) -> tuple[RankMemory, ...]:
        """The plan's per-rank memory, by category."""
        zero = self.memory.zero
        full = np.zeros(self.num_devices)
        shard = np.zeros(self.num_devices)
        # per rank, the parameters the unsharded categories count (full) and the sharded ones
        # (shard), each only where some category is
        for mod, held in self.held.items():
            if zero < 3:
                full += held.sum(axis=0) * self.params_per_layer[mod]
            if zero >= 1:
                shard += self._shards(held, self._replicas(held)) * self.params_per_layer[mod]
        weights = shard if zero >= 3 else full
        grads = shard if zero >= 2 else full
        optimizer = shard if zero >= 1 else full
        return tuple(
            RankMemory(rank=r, param_bytes=p, grad_bytes=g, optimizer_bytes=o, activation_bytes=a)
            for r, (p, g, o, a) in enumerate(zip(
                _whole_bytes(weights * self.weight_b + self.buffer),
                _whole_bytes(grads * self.grad_b),
                _whole_bytes(optimizer * self.opt_b),
                _whole_bytes(self.activation + self.peak), strict=True))
        )


def _whole_bytes(values: np.ndarray) -> list[int]:
    """Per rank, the bytes rounded half to even (as `round` does) to whole bytes."""
    return [int(v) for v in np.rint(values).tolist()]


def replayed_table(plan: Plan, graph: MetaOpGraph, memory: MemoryStrategy
                   ) -> tuple[RankMemory, ...]:
    """The per-rank memory `plan`'s slices hold under `memory`: each slice committed to a
    Ledger in wave order, as placement committed it (the plan's `memory` table, for a plan
    whose table was not edited)."""
    ops = {m.id: m for m in graph.metaops}
    ledger = Ledger(graph, plan.num_devices, memory)
    for _, s in plan.slices():
        ledger.commit(ops[s.metaop], s.first, s.last, s.ranks, s.strategy)
    return ledger.table()
