"""Per-rank memory accounting for placement and for the plan's `memory` table.

Model (mixed-precision Adam): each parameter costs 2 B (bf16/fp16 weights) + 2 B (gradients) +
12 B (fp32 master copy and two Adam moments); an fp32 graph costs 4 + 4 + 8. A rank holds one
replica of every layer it ever runs, however many tasks use it (tensor-parallel slices of
degree t hold 1/t of it). Activations: forward waves run first and backward waves in reverse,
so every slice's stash is alive at the forward/backward turn; the peak is the sum over all
slices a rank runs of stash_bytes_per_sample * rows on that rank * operators.
"""

from __future__ import annotations

import numpy as np

from spindle_cli.artifacts.graph import MetaOp, MetaOpGraph
from spindle_cli.artifacts.plan import RankMemory
from spindle_cli.artifacts.profile import tp_degree


def state_bytes_per_param(dtype: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter."""
    return (4, 4, 8) if dtype == "fp32" else (2, 2, 12)


def split_rows(batch: int, groups: int) -> list[int]:
    """Rows of each data-parallel group: contiguous, the first batch % groups get one more."""
    base, extra = divmod(batch, groups)
    return [base + (1 if g < extra else 0) for g in range(groups)]


def rows_per_rank(batch: int, num_ranks: int, strategy: str) -> list[int]:
    """Rows each rank of a slice processes (ranks ascending; a tensor-parallel group of t
    consecutive ranks shares its group's rows)."""
    t = tp_degree(strategy)
    return [r for r in split_rows(batch, num_ranks // t) for _ in range(t)]


SLICE_MEMORY_SHARE = 0.5
"""The most of a device's memory one slice may take; larger slices are split over waves so
that placement can spread a big module's layers over different ranks."""


def layer_bytes_per_rank(metaop: MetaOp, n: int, strategy: str, dtype: str) -> float:
    """Memory one operator of the MetaOp needs on each of n ranks: its state (weights,
    gradients, optimizer; 1/t under tp<t>) and its stash for the largest row share."""
    per_param = sum(state_bytes_per_param(dtype))
    rows = max(rows_per_rank(metaop.batch_size, n, strategy))
    return metaop.params_per_layer * per_param / tp_degree(strategy) + \
        metaop.stash_bytes_per_sample * rows


def max_ops_per_slice(metaop: MetaOp, n: int, strategy: str, dtype: str,
                      memory_bytes: int) -> int:
    """Operators of the MetaOp one slice on n ranks may run (at least one)."""
    per_layer = layer_bytes_per_rank(metaop, n, strategy, dtype)
    if per_layer <= 0:
        return metaop.num_layers
    return max(1, int(SLICE_MEMORY_SHARE * memory_bytes // per_layer))


class Ledger:
    """Memory committed so far on every rank (mutable; one per placement attempt)."""

    def __init__(self, graph: MetaOpGraph, num_devices: int) -> None:
        self.num_devices = num_devices
        self.weight_b, self.grad_b, self.opt_b = state_bytes_per_param(graph.dtype)
        sizes: dict[str, int] = {}
        self.params_per_layer: dict[str, int] = {}
        for m in graph.metaops:
            sizes[m.module] = max(sizes.get(m.module, 0), m.first_layer + m.num_layers)
            self.params_per_layer[m.module] = max(self.params_per_layer.get(m.module, 0),
                                                  m.params_per_layer)
        self.held = {mod: np.zeros((n, num_devices)) for mod, n in sizes.items()}
        """Fraction of each (layer, rank) replica held: 1 for data parallel, 1/t for tp<t>."""
        self.activation = np.zeros(num_devices)
        self._used = np.zeros(num_devices)

    def _layer_state_bytes(self, module: str) -> float:
        return self.params_per_layer[module] * (self.weight_b + self.grad_b + self.opt_b)

    def used(self) -> np.ndarray:
        """Bytes committed on every rank (kept up to date by `commit`)."""
        return self._used

    def need(self, metaop: MetaOp, first: int, last: int, n: int, strategy: str) -> np.ndarray:
        """Extra bytes each rank would need to run the slice (rows rounded up, so the check
        holds wherever the rank sits in the slice)."""
        frac = 1.0 / tp_degree(strategy)
        rows = max(rows_per_rank(metaop.batch_size, n, strategy))
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        missing = np.maximum(frac - self.held[metaop.module][lo:hi], 0.0).sum(axis=0)
        stash = float(metaop.stash_bytes_per_sample) * rows * (last - first)
        return missing * self._layer_state_bytes(metaop.module) + stash

    def shared_fraction(self, metaop: MetaOp, first: int, last: int) -> np.ndarray:
        """Per rank, the share of the slice's layers it already holds (0..1)."""
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        return np.minimum(self.held[metaop.module][lo:hi], 1.0).mean(axis=0)

    def commit(self, metaop: MetaOp, first: int, last: int, ranks: tuple[int, ...],
               strategy: str) -> None:
        """Record that `ranks` run the slice."""
        frac = 1.0 / tp_degree(strategy)
        lo, hi = metaop.first_layer + first, metaop.first_layer + last
        idx = np.asarray(ranks)
        block = self.held[metaop.module][lo:hi, :]
        grown = np.maximum(frac - block[:, idx], 0.0).sum(axis=0)
        block[:, idx] = np.maximum(block[:, idx], frac)
        rows = np.asarray(rows_per_rank(metaop.batch_size, len(ranks), strategy), dtype=float)
        stash = float(metaop.stash_bytes_per_sample) * rows * (last - first)
        self.activation[idx] += stash
        self._used[idx] += grown * self._layer_state_bytes(metaop.module) + stash

    def table(self) -> tuple[RankMemory, ...]:
        """The plan's per-rank memory, by category."""
        params = np.zeros(self.num_devices)
        for mod, held in self.held.items():
            params += held.sum(axis=0) * self.params_per_layer[mod]
        return tuple(
            RankMemory(
                rank=r,
                param_bytes=int(round(params[r] * self.weight_b)),
                grad_bytes=int(round(params[r] * self.grad_b)),
                optimizer_bytes=int(round(params[r] * self.opt_b)),
                activation_bytes=int(round(self.activation[r])),
            )
            for r in range(self.num_devices)
        )
