"""`PlanOptions`: what a plan is made with (planner, placement, splits, memory strategy, tensor
parallelism, gradient chunks), recorded in Plan.options and read back from it.

What does not live here: the memory settings the memory search tries (`api.memory_ladder`).
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle_cli.artifacts.plan import PLACEMENTS, PLANNERS, SYNC_CHUNK_COUNTS, ZERO_STAGES, Plan
from spindle_cli.planner.buckets import MAX_CHUNKS
from spindle_cli.planner.memory import MemoryStrategy


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanOptions:
    """Planner options; recorded in Plan.options."""

    planner: str = "spindle"
    """'spindle' (wavefront scheduling) or a baseline: 'sequential', 'optimus', 'distmm'."""
    placement: str = "island"
    """'island' (locality- and memory-aware) or 'sequential' (consecutive ranks; ablation)."""
    uneven_splits: bool = False
    """Allow any data-parallel count n <= B (per-device batch ceil(B / n))."""
    zero: int = 0
    """ZeRO stage 0..3 (memory.py): shard optimizer state, + gradients, + weights over each
    layer's parameter device group."""
    recompute: bool = False
    """Activation recomputation: keep only operator inputs, one extra forward (+1/3 time)."""
    tensor_parallel: bool = True
    """Use the profile's tensor-parallel counts; off: data-parallel slices only, as `spindle
    run` executes them."""
    sync_chunks: int = MAX_CHUNKS
    """The most chunks a wave's gradient bucket of one rank set is cut into under 'chunked'
    (`buckets.max_chunks`); `api.fitting_plan_with_cost` sets it
    (`search.SYNC_CHUNK_CHOICES`)."""

    def __post_init__(self) -> None:
        if self.planner not in PLANNERS:
            raise ValueError(f"unknown planner {self.planner!r} (expected one of {PLANNERS})")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {self.placement!r} (expected {PLACEMENTS})")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"unknown ZeRO stage {self.zero!r} (expected one of {ZERO_STAGES})")
        if type(self.sync_chunks) is not int or self.sync_chunks not in SYNC_CHUNK_COUNTS:
            raise ValueError(f"unknown chunk count {self.sync_chunks!r} (expected one of "
                             f"{SYNC_CHUNK_COUNTS})")

    @classmethod
    def of(cls, plan: Plan) -> PlanOptions:
        """The options `plan` was made with (`as_dict` read back; a Plan records only known
        options, `Plan._check_options`)."""
        o = plan.options
        return cls(planner=plan.planner, placement=o.get("placement", "island"),
                   uneven_splits=o.get("uneven_splits") == "true",
                   zero=int(o.get("zero", "0")), recompute=o.get("recompute") == "true",
                   tensor_parallel=o.get("tensor_parallel") != "false",
                   sync_chunks=int(o.get("sync_chunks", MAX_CHUNKS)))

    @property
    def memory(self) -> MemoryStrategy:
        """The memory strategy the options ask for."""
        return MemoryStrategy(zero=self.zero, recompute=self.recompute)

    def as_dict(self) -> dict[str, str]:
        """The options as Plan.options records them. `zero` and `recompute` appear only when
        on, `tensor_parallel` only when off and `sync_chunks` only when not MAX_CHUNKS, so a
        plan that uses none of them reads the same as before they existed (a reader takes a
        missing key as the default)."""
        options = {"planner": self.planner, "placement": self.placement,
                   "uneven_splits": "true" if self.uneven_splits else "false"}
        if self.zero:
            options["zero"] = str(self.zero)
        if self.recompute:
            options["recompute"] = "true"
        if not self.tensor_parallel:
            options["tensor_parallel"] = "false"
        if self.sync_chunks != MAX_CHUNKS:
            options["sync_chunks"] = str(self.sync_chunks)
        return options
