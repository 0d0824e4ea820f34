"""Gradient buckets: which layers' gradients one collective reduces, over which ranks, after
which point of the backward pass, and in what order each rank issues them. The executor builds
its buckets from `sync_buckets` (runtime/gradsync.py) and the simulator times the same ones
(planner/simulate.py), so the two cannot drift apart.

A layer's gradient is reduced over its holders, the ranks of every slice running it (the
plan's ParamGroup ranks), once the lowest backward wave of a slice running it is done: that
wave completes it. Modes (`SyncMode`):

- 'per-set' (the executor's gloo default): one bucket per holder set, due after the lowest
  wave that completes any of its layers.
- 'per-wave': one bucket per holder set and completing wave, due after that wave's backward.
- 'chunked' (the NCCL default): every per-wave bucket cut into chunks of whole layers, in the
  order the wave's backward completes them (by module, layers descending), each due as soon
  as every slice of the wave running its layers has passed the chunk's lowest layer, like
  DDP's gradient buckets: a chunk holds at least SYNC_CHUNK_BYTES (DDP's 25 MiB), and a
  bucket has at most the plan's `sync_chunks` option's chunks (MAX_CHUNKS without it), which
  bounds the number of collectives.
- 'after-backward' (simulator only): every group whole after the last backward wave; no
  buckets.

A rank issues the buckets of one holder set in list order, a chunk only after the chunks
before it, so every rank of a set issues that set's collectives in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from spindle_cli.artifacts.graph import MetaOp
from spindle_cli.artifacts.plan import Plan

SyncMode = Literal["chunked", "per-wave", "per-set", "after-backward"]
SYNC_MODES: tuple[SyncMode, ...] = ("chunked", "per-wave", "per-set", "after-backward")


def backend_sync(backend: str) -> SyncMode:
    """The buckets the executor makes by default on `backend`: 'chunked' on nccl, where the
    all-reduces overlap the backward pass, 'per-set' on gloo, whose collective threads take
    their CPU time from the rank's compute."""
    return "chunked" if backend == "nccl" else "per-set"


SYNC_CHUNK_BYTES = 25 * 2**20
"""The least gradient bytes of a chunk (DDP's default bucket_cap_mb)."""
MAX_CHUNKS = 4
"""The most chunks one per-wave bucket is cut into, where the plan does not say
(Plan.options `sync_chunks`)."""


def max_chunks(plan: Plan) -> int:
    """The most chunks the plan's per-wave buckets are cut into under 'chunked'."""
    return int(plan.options.get("sync_chunks", MAX_CHUNKS))

LayerKey = tuple[str, int]
"""(module, layer)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncBucket:
    """Gradients reduced by one collective over `ranks`, due in backward wave `wave`."""

    ranks: tuple[int, ...]
    wave: int
    layers: tuple[LayerKey, ...]
    """Its layers, in the order the wave's backward completes them (the executor's flat
    layout)."""
    groups: tuple[int, ...]
    """Indices of the ParamGroups its layers belong to, ascending."""
    group_bytes: tuple[int, ...]
    """Its share of each of those groups' gradient bytes, by layer count."""
    passes: tuple[tuple[str, int], ...]
    """(slice id, k): the slices of `wave` running its layers, each with the number of its
    backward operators after which the bucket's layers are complete on its ranks (its whole
    slice except in 'chunked' mode). A rank running none of them has them complete when it
    starts the wave's backward."""

    @property
    def bytes(self) -> int:
        """Its gradient bytes."""
        return sum(self.group_bytes)


def sync_buckets(plan: Plan, metaops: Mapping[str, MetaOp], mode: SyncMode,
                 chunk_bytes: int = SYNC_CHUNK_BYTES) -> list[SyncBucket]:
    """The plan's gradient buckets under `mode` (none for 'after-backward'), in issue order:
    by due wave downwards (the backward's order), then by when the wave's slices are expected
    to have completed them (the operators of each slice they wait for, at the slice's planned
    time per operator), then by their first ParamGroup, the chunks of one bucket in the order
    the backward completes them."""
    if mode == "after-backward":
        return []
    group_of: dict[LayerKey, int] = {}
    for gi, g in enumerate(plan.param_groups):
        for layer in range(g.first_layer, g.last_layer):
            group_of[(g.module, layer)] = gi
    # per (wave, module): (slice id, absolute layers [lo, hi)) of the slices running grouped
    # layers of the module in that wave
    runs: dict[tuple[int, str], list[tuple[str, int, int]]] = {}
    completing: dict[LayerKey, int] = {}
    for w, s in plan.slices():
        m = metaops[s.metaop]
        lo, hi = m.first_layer + s.first, m.first_layer + s.last
        grouped = [layer for layer in range(lo, hi) if (m.module, layer) in group_of]
        if not grouped:
            continue
        runs.setdefault((w.index, m.module), []).append((s.id, lo, hi))
        for layer in grouped:
            completing[(m.module, layer)] = min(completing.get((m.module, layer), w.index),
                                                w.index)
    if mode == "per-set":
        lowest: dict[tuple[int, ...], int] = {}
        for key, wave in completing.items():
            ranks = plan.param_groups[group_of[key]].ranks
            lowest[ranks] = min(lowest.get(ranks, wave), wave)
        completing = {key: lowest[plan.param_groups[group_of[key]].ranks] for key in completing}
    # per (holder set, wave): its layers, ordered by their first group, then the backward order
    merged: dict[tuple[tuple[int, ...], int], list[LayerKey]] = {}
    for key, wave in sorted(completing.items(), key=lambda kv: (group_of[kv[0]], kv[1])):
        merged.setdefault((plan.param_groups[group_of[key]].ranks, wave), []).append(key)
    buckets = []
    for (ranks, wave), keys in merged.items():
        keys.sort(key=lambda k: (k[0], -k[1]))
        chunks = (_chunks(plan, group_of, keys, chunk_bytes, max_chunks(plan))
                  if mode == "chunked" else [keys])
        for chunk in chunks:
            buckets.append(_bucket(plan, group_of, runs, ranks, wave, chunk,
                                   whole=mode != "chunked"))
    # within a wave, in the order the plan expects them complete: each rank issues its
    # buckets in this one order, so a bucket never waits for one that completes later
    times = {s.id: s.time_ms / s.num_layers for _, s in plan.slices()}
    buckets.sort(key=lambda b: (-b.wave, max((k * times[sid] for sid, k in b.passes),
                                             default=0.0)))
    return buckets


def _layer_bytes(plan: Plan, gi: int) -> float:
    g = plan.param_groups[gi]
    return g.bytes / (g.last_layer - g.first_layer)


def _chunks(plan: Plan, group_of: dict[LayerKey, int], keys: list[LayerKey],
            chunk_bytes: int, most: int) -> list[list[LayerKey]]:
    """`keys` cut into runs of at least max(chunk_bytes, total / most) bytes (the last may
    hold less)."""
    sizes = [_layer_bytes(plan, group_of[k]) for k in keys]
    least = max(chunk_bytes, math.ceil(math.fsum(sizes) / most))
    chunks: list[list[LayerKey]] = [[]]
    held = 0.0
    for key, size in zip(keys, sizes, strict=True):
        if held >= least:
            chunks.append([])
            held = 0.0
        chunks[-1].append(key)
        held += size
    return chunks


def _bucket(plan: Plan, group_of: dict[LayerKey, int],
            runs: dict[tuple[int, str], list[tuple[str, int, int]]], ranks: tuple[int, ...],
            wave: int, keys: list[LayerKey], *, whole: bool) -> SyncBucket:
    """The bucket of layers `keys`: its groups, its share of their bytes, and how far each
    slice of `wave` running some of them must get (the whole slice when `whole`)."""
    counts: dict[int, int] = {}
    layers_of: dict[str, list[int]] = {}
    for module, layer in keys:
        counts[group_of[(module, layer)]] = counts.get(group_of[(module, layer)], 0) + 1
        layers_of.setdefault(module, []).append(layer)
    passes = []
    for module, layers in layers_of.items():
        for sid, lo, hi in runs.get((wave, module), []):
            inside = [layer for layer in layers if lo <= layer < hi]
            if inside:
                passes.append((sid, hi - lo if whole else hi - min(inside)))
    groups = tuple(sorted(counts))
    return SyncBucket(ranks=ranks, wave=wave, layers=tuple(keys), groups=groups,
                      group_bytes=tuple(_share(plan, gi, counts[gi]) for gi in groups),
                      passes=tuple(passes))


def _share(plan: Plan, gi: int, num_layers: int) -> int:
    """Group gi's gradient bytes for `num_layers` of its layers, by layer count."""
    g = plan.param_groups[gi]
    return round(g.bytes * num_layers / (g.last_layer - g.first_layer))
