"""The execution plan: waves of MetaOp slices placed on ranks (`spindle plan`, `plans/`).

Every planner (spindle and the baselines) writes this one format, and the simulator and the
runtime consume it. Times are estimates from the profile's curves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spindle_cli.artifacts.base import DerivedArtifact
from spindle_cli.artifacts.codec import field_path, meta
from spindle_cli.artifacts.io import register
from spindle_cli.artifacts.limits import (
    MAX_DEVICES,
    MAX_DEVICES_WHY,
    MAX_LAYERS,
    MAX_LAYERS_WHY,
    MAX_MS,
    MAX_MS_WHY,
)
from spindle_cli.artifacts.profile import check_strategy, tp_degree
from spindle_cli.errors import FieldError

PLANNERS = ("spindle", "sequential", "optimus", "distmm")
PLACEMENTS = ("island", "sequential")
ZERO_STAGES = (0, 1, 2, 3)
SYNC_CHUNK_COUNTS = (1, 2, 4, 8, 16)
"""The chunk counts per wave bucket a plan may ask for (`sync_chunks`, planner/buckets.py)."""
OPTION_VALUES: dict[str, tuple[str, ...]] = {
    "planner": PLANNERS,
    "placement": PLACEMENTS,
    "uneven_splits": ("true", "false"),
    "zero": tuple(map(str, ZERO_STAGES)),
    "recompute": ("true", "false"),
    "tensor_parallel": ("true", "false"),
    "sync_chunks": tuple(map(str, SYNC_CHUNK_COUNTS)),
}
"""The options a plan may record (`planner.options.PlanOptions.as_dict`) and their values."""


def tp_group_size(num_ranks: int, strategy: str) -> int:
    """Ranks per tensor-parallel group of a slice on `num_ranks` ranks: t under 'tp<t>' when t
    divides the count, else 1 (under 'dp', or a count t does not divide: the slice then runs
    data parallel)."""
    t = tp_degree(strategy)
    return t if num_ranks % t == 0 else 1


def tp_groups(ranks: tuple[int, ...], strategy: str) -> list[tuple[int, ...]]:
    """A slice's tensor-parallel groups: runs of `tp_group_size` consecutive ranks, each one
    data-parallel replica holding the same rows."""
    t = tp_group_size(len(ranks), strategy)
    return [ranks[i : i + t] for i in range(0, len(ranks), t)]


def _check_rank_list(name: str, ranks: tuple[int, ...], empty: str) -> None:
    """FieldError at `name` unless `ranks` is non-empty (`empty`: the problem when it is),
    ascending and distinct."""
    if not ranks:
        raise FieldError(name, empty)
    if list(ranks) != sorted(set(ranks)):
        raise FieldError(name, "ranks must be ascending and distinct")


@dataclass(frozen=True, slots=True, kw_only=True)
class Slice:
    """Operators [first, last) of one MetaOp run on `ranks` for the whole task batch."""

    id: str = field(metadata=meta("unique slice id: 'w<wave>.<index>'"))
    metaop: str = field(metadata=meta("MetaOp id"))
    first: int = field(metadata=meta("first operator (0-based, within the MetaOp)", ge=0))
    last: int = field(
        metadata=meta("one past the last operator", ge=1, le=MAX_LAYERS, le_why=MAX_LAYERS_WHY)
    )
    ranks: tuple[int, ...] = field(metadata=meta("ranks running the slice, ascending", ge=0))
    strategy: str = field(metadata=meta("'dp' or 'tp<t>'"))
    time_ms: float = field(metadata=meta("estimated forward+backward time of the slice", ge=0,
                                         le=MAX_MS, le_why=MAX_MS_WHY))

    def __post_init__(self) -> None:
        check_strategy(self.strategy, "strategy")
        if self.last <= self.first:
            raise FieldError("last", f"{self.last} <= first {self.first}")
        _check_rank_list("ranks", self.ranks, "a slice needs at least one rank")
        t = tp_degree(self.strategy)
        if len(self.ranks) % t:
            raise FieldError("strategy", f"{self.strategy} needs a rank count divisible by {t}, "
                                         f"the slice has {len(self.ranks)}")

    @property
    def num_layers(self) -> int:
        """Operators in the slice."""
        return self.last - self.first


@dataclass(frozen=True, slots=True, kw_only=True)
class Wave:
    """Slices that run concurrently on disjoint ranks; transfers happen between waves."""

    index: int = field(metadata=meta("wave index, from 0", ge=0))
    level: int = field(metadata=meta("MetaLevel the wave belongs to", ge=0))
    start_ms: float = field(metadata=meta("estimated start time", ge=0, le=MAX_MS,
                                          le_why=MAX_MS_WHY))
    duration_ms: float = field(metadata=meta("estimated duration (longest slice)", ge=0,
                                             le=MAX_MS, le_why=MAX_MS_WHY))
    slices: tuple[Slice, ...] = field(metadata=meta("the wave's slices"))

    def __post_init__(self) -> None:
        ranks = [r for s in self.slices for r in s.ranks]
        if len(set(ranks)) == len(ranks):
            return
        # some rank is in two slices: name the first slice that reuses one
        used: set[int] = set()
        for i, s in enumerate(self.slices):
            if used & set(s.ranks):
                raise FieldError(f"slices[{i}].ranks", f"rank {min(used & set(s.ranks))} is "
                                 "already used by another slice of this wave")
            used |= set(s.ranks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """An activation flow from a producer slice to a consumer slice (gradients flow back)."""

    src: str = field(metadata=meta("producer slice id"))
    dst: str = field(metadata=meta("consumer slice id"))
    bytes: int = field(metadata=meta("forward activation bytes (the same flow back)", ge=0))
    src_ranks: tuple[int, ...] = field(metadata=meta("producer ranks", ge=0))
    dst_ranks: tuple[int, ...] = field(metadata=meta("consumer ranks", ge=0))

    def __post_init__(self) -> None:
        for name in ("src_ranks", "dst_ranks"):
            _check_rank_list(name, getattr(self, name),
                             "a transfer needs at least one rank on each side")


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamGroup:
    """Layers [first_layer, last_layer) of a module and the ranks holding a replica of them;
    their gradients are all-reduced over exactly these ranks."""

    module: str = field(metadata=meta("module name"))
    first_layer: int = field(metadata=meta("first layer of the module", ge=0))
    last_layer: int = field(
        metadata=meta("one past the last layer", ge=1, le=MAX_LAYERS, le_why=MAX_LAYERS_WHY)
    )
    ranks: tuple[int, ...] = field(metadata=meta("ranks holding a replica, ascending", ge=0))
    bytes: int = field(metadata=meta("gradient bytes synchronized", ge=0))

    def __post_init__(self) -> None:
        if self.last_layer <= self.first_layer:
            raise FieldError("last_layer", f"{self.last_layer} <= first_layer {self.first_layer}")
        _check_rank_list("ranks", self.ranks, "a parameter group needs at least one rank")


STATE_CATEGORIES = ("param_bytes", "grad_bytes", "optimizer_bytes")
"""The `RankMemory` categories a rank keeps between steps."""
MEMORY_CATEGORIES = (*STATE_CATEGORIES, "activation_bytes")
"""Every `RankMemory` category, in field order."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """Estimated peak memory of one rank, by category."""

    rank: int = field(metadata=meta("rank", ge=0))
    param_bytes: int = field(metadata=meta("parameters", ge=0))
    grad_bytes: int = field(metadata=meta("gradients", ge=0))
    optimizer_bytes: int = field(metadata=meta("optimizer state", ge=0))
    activation_bytes: int = field(metadata=meta("activations held for backward (peak)", ge=0))

    @property
    def total_bytes(self) -> int:
        """Sum of every category."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LevelBound:
    """The relaxed optimum of one MetaLevel."""

    level: int = field(metadata=meta("MetaLevel", ge=0))
    lower_bound_ms: float = field(
        metadata=meta("relaxed optimum of the level: C* on the concave speedup envelope", ge=0,
                      le=MAX_MS, le_why=MAX_MS_WHY)
    )
    estimated_ms: float = field(metadata=meta("planned time of the level's waves", ge=0,
                                              le=MAX_MS, le_why=MAX_MS_WHY))


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class Plan(DerivedArtifact):
    """A whole training iteration: waves, transfers, parameter groups, memory, estimates."""

    KIND = "plan"
    INPUT_KINDS = ("metaop_graph", "profile", "cluster")
    """The inputs a plan file records (`spindle validate` refuses one without them)."""
    VERSION = 1

    model: str = field(metadata=meta("model name", name=True))
    cluster: str = field(metadata=meta("cluster name", name=True))
    planner: str = field(metadata=meta("planner that made the plan"))
    options: dict[str, str] = field(default_factory=dict, metadata=meta(
        "planner options: planner, placement, uneven_splits, zero, recompute, "
        "tensor_parallel, sync_chunks"))
    candidate: str = field(default="", metadata=meta(
        "which of the spindle planner's candidate schedules this is (empty for baselines)"))
    num_devices: int = field(
        metadata=meta("world size N", ge=1, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)
    )
    islands: tuple[tuple[int, ...], ...] = field(metadata=meta("ranks of each NVLink island"))
    waves: tuple[Wave, ...] = field(metadata=meta("waves in execution order"))
    transfers: tuple[Transfer, ...] = field(metadata=meta("inter-wave activation flows"))
    param_groups: tuple[ParamGroup, ...] = field(metadata=meta("parameter device groups"))
    memory: tuple[RankMemory, ...] = field(metadata=meta("estimated memory per rank"))
    levels: tuple[LevelBound, ...] = field(metadata=meta("relaxed optimum per MetaLevel"))
    lower_bound_ms: float = field(metadata=meta("sum of the levels' lower bounds", ge=0,
                                                le=MAX_MS, le_why=MAX_MS_WHY))
    estimated_iteration_ms: float = field(metadata=meta(
        "planned compute of one iteration: the sum of the waves' durations (`spindle simulate` "
        "adds transfers and gradient sync)", ge=0, le=MAX_MS, le_why=MAX_MS_WHY))

    def __post_init__(self) -> None:
        DerivedArtifact.__post_init__(self)
        self._check_options()
        self._check_islands()
        for i in range(1, len(self.levels)):
            before, level = self.levels[i - 1].level, self.levels[i].level
            if level <= before:
                # as the planner writes them: readers take a level's first entry
                raise FieldError(f"levels[{i}].level", f"{level} after {before}: each level "
                                                       "once, in ascending order")
        ids: set[str] = set()
        island_of = {r: i for i, island in enumerate(self.islands) for r in island}
        for wi, w in enumerate(self.waves):
            if w.index != wi:
                raise FieldError(f"waves[{wi}].index", f"expected {wi}, got {w.index}")
            for si, s in enumerate(w.slices):
                if s.id in ids:
                    raise FieldError(f"waves[{wi}].slices[{si}].id", f"duplicate id {s.id!r}")
                ids.add(s.id)
                if max(s.ranks) >= self.num_devices:
                    self._check_ranks(f"waves[{wi}].slices[{si}].ranks", s.ranks)
                if tp_group_size(len(s.ranks), s.strategy) == 1:
                    continue  # groups of one rank span no islands
                # a tensor-parallel group's collectives run at island (NVLink) speed in the
                # profile's curves, so none may span islands
                for group in tp_groups(s.ranks, s.strategy):
                    spans = sorted({island_of.get(r, -1) for r in group})
                    if len(spans) > 1:
                        raise FieldError(f"waves[{wi}].slices[{si}].ranks",
                                         f"tensor-parallel group {list(group)} spans islands "
                                         f"{spans}; each group must stay inside one island")
        for ti, t in enumerate(self.transfers):
            if (t.src in ids and t.dst in ids and max(t.src_ranks) < self.num_devices
                    and max(t.dst_ranks) < self.num_devices):
                continue
            for name in ("src", "dst"):
                if getattr(t, name) not in ids:
                    raise FieldError(
                        f"transfers[{ti}].{name}", f"unknown slice {getattr(t, name)!r}"
                    )
                self._check_ranks(f"transfers[{ti}].{name}_ranks", getattr(t, f"{name}_ranks"))
        for gi, g in enumerate(self.param_groups):
            if max(g.ranks) >= self.num_devices:
                self._check_ranks(f"param_groups[{gi}].ranks", g.ranks)
        # one entry per rank, in rank order (what the planner writes)
        if len(self.memory) != self.num_devices:
            raise FieldError("memory", f"expected one entry per rank ({self.num_devices}), got "
                                       f"{len(self.memory)}")
        for r, m in enumerate(self.memory):
            if m.rank != r:
                raise FieldError(f"memory[{r}].rank", f"expected {r}, got {m.rank}")

    def _check_options(self) -> None:
        """FieldError when the planner or an option is one no planner writes: a reader would
        take an unknown value for the default (`recompute: yes` would run without it)."""
        if self.planner not in PLANNERS:
            raise FieldError("planner", f"{self.planner!r} is not one of "
                                        f"{', '.join(map(repr, PLANNERS))}")
        for key, value in sorted(self.options.items()):
            where = field_path("options", key)
            if key not in OPTION_VALUES:
                raise FieldError(where, f"unknown option (expected one of "
                                        f"{', '.join(OPTION_VALUES)})")
            if value not in OPTION_VALUES[key]:
                raise FieldError(where, f"{value!r} is not one of "
                                        f"{', '.join(map(repr, OPTION_VALUES[key]))}")
        if self.options.get("planner", self.planner) != self.planner:
            raise FieldError("options.planner", f"{self.options['planner']!r} differs from "
                                                f"the plan's planner {self.planner!r}")

    def _check_islands(self) -> None:
        """FieldError unless the islands hold every rank of the plan once (an empty island or
        a rank outside the plan loaded, and `diff` and `--check` failed on it)."""
        seen: set[int] = set()
        for i, island in enumerate(self.islands):
            if not island:
                raise FieldError(f"islands[{i}]", "an empty island")
            for r in island:
                if not 0 <= r < self.num_devices:
                    raise FieldError(f"islands[{i}]", f"rank {r} is not one of the plan's "
                                                      f"ranks 0-{self.num_devices - 1}")
                if r in seen:
                    raise FieldError(f"islands[{i}]", f"rank {r} is in another island too")
                seen.add(r)
        if len(seen) != self.num_devices:
            missing = min(set(range(self.num_devices)) - seen)
            raise FieldError("islands", f"rank {missing} is in no island")

    def _check_ranks(self, where: str, ranks: tuple[int, ...]) -> None:
        """FieldError at `where` when a rank is not below num_devices (callers that check
        every list first call it only for one with such a rank, to build `where` only then)."""
        bad = [r for r in ranks if r >= self.num_devices]
        if bad:
            raise FieldError(where, f"rank {bad[0]} >= num_devices {self.num_devices}")

    def slices(self) -> list[tuple[Wave, Slice]]:
        """Every slice with its wave, in execution order."""
        return [(w, s) for w in self.waves for s in w.slices]
