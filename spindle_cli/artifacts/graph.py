"""The MetaOp graph: the contracted operator DAG of the selected tasks (`spindle graph`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spindle_cli.artifacts.base import DerivedArtifact
from spindle_cli.artifacts.codec import meta
from spindle_cli.artifacts.io import register
from spindle_cli.artifacts.limits import MAX_BATCH, MAX_BATCH_WHY, MAX_LAYERS, MAX_LAYERS_WHY
from spindle_cli.artifacts.model import LayerKind
from spindle_cli.errors import FieldError


@dataclass(frozen=True, slots=True, kw_only=True)
class MetaOp:
    """A run of `num_layers` identical consecutive operators (layers) of one task.

    All sizes are for the whole task batch and one operator (one layer); a slice of the MetaOp
    on n devices processes batch_size / n samples per device.
    """

    id: str = field(metadata=meta("unique id: '<task>/<step>'"))
    task: str = field(metadata=meta("task the MetaOp belongs to"))
    step: str = field(metadata=meta("step of the task"))
    module: str = field(metadata=meta("module whose parameters it uses (shared across tasks)"))
    layer_kind: LayerKind = field(metadata=meta("layer kind of every operator"))
    first_layer: int = field(
        metadata=meta("index in the module of its first layer", ge=0, le=MAX_LAYERS - 1,
                      le_why=MAX_LAYERS_WHY)
    )
    num_layers: int = field(
        metadata=meta("operators in the MetaOp (L)", ge=1, le=MAX_LAYERS, le_why=MAX_LAYERS_WHY)
    )
    batch_size: int = field(
        metadata=meta("global batch (B)", ge=1, le=MAX_BATCH, le_why=MAX_BATCH_WHY)
    )
    seq_len: int = field(metadata=meta("input sequence length per sample", ge=1))
    in_width: int = field(metadata=meta("input width per position (0 for token ids)", ge=0))
    out_seq_len: int = field(metadata=meta("output sequence length per sample", ge=0))
    out_width: int = field(metadata=meta("output width per position (0 for a loss)", ge=0))
    level: int = field(metadata=meta("MetaLevel: longest-path depth from the inputs", ge=0))
    predecessors: tuple[str, ...] = field(
        metadata=meta("MetaOps feeding this one, in input order")
    )
    signature: str = field(metadata=meta("operator signature; keys the scaling curves"))
    flops_per_layer: float = field(metadata=meta("forward+backward FLOPs, whole batch", ge=0))
    params_per_layer: int = field(metadata=meta("parameters per operator", ge=0))
    activation_in_bytes: int = field(metadata=meta("input activation bytes, whole batch", ge=0))
    activation_out_bytes: int = field(metadata=meta("output activation bytes, whole batch", ge=0))
    stash_bytes_per_sample: int = field(
        metadata=meta("activation bytes kept for backward per sample per operator", ge=0)
    )

    def __post_init__(self) -> None:
        end = self.first_layer + self.num_layers
        if end > MAX_LAYERS:
            raise FieldError(
                "num_layers",
                f"layers {self.first_layer}..{end - 1} run past layer {MAX_LAYERS - 1}, the "
                f"last a module may have ({MAX_LAYERS_WHY})",
            )


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class MetaOpGraph(DerivedArtifact):
    """MetaOps of the selected tasks, ordered by (level, id)."""

    KIND = "metaop_graph"
    INPUT_KINDS = ("model",)
    VERSION = 1

    model: str = field(metadata=meta("model name", name=True))
    tasks: tuple[str, ...] = field(metadata=meta("selected tasks, in model order"))
    dtype: Literal["fp32", "bf16", "fp16"] = field(metadata=meta("activation/parameter dtype"))
    num_levels: int = field(metadata=meta("number of MetaLevels", ge=1))
    metaops: tuple[MetaOp, ...] = field(metadata=meta("the MetaOps"))

    def __post_init__(self) -> None:
        DerivedArtifact.__post_init__(self)
        tasks: set[str] = set()
        for i, t in enumerate(self.tasks):
            if t in tasks:
                raise FieldError(f"tasks[{i}]", f"duplicate task {t!r}")
            tasks.add(t)
        if not self.metaops:
            raise FieldError("metaops", "a graph needs at least one MetaOp")
        ids: dict[str, int] = {}
        by_signature: dict[str, MetaOp] = {}
        for i, m in enumerate(self.metaops):
            if m.id in ids:
                raise FieldError(f"metaops[{i}].id", f"duplicate MetaOp id {m.id!r}")
            # one signature, one workload: they share a scaling curve, fitted at one batch
            same = by_signature.setdefault(m.signature, m)
            if same.batch_size != m.batch_size:
                raise FieldError(f"metaops[{i}].batch_size",
                                 f"{m.batch_size}, but {same.id!r} of the same signature runs "
                                 f"{same.batch_size}")
            if m.task not in tasks:
                raise FieldError(f"metaops[{i}].task", f"unknown task {m.task!r} (not in tasks)")
            ids[m.id] = m.level
        for i, m in enumerate(self.metaops):
            for j, p in enumerate(m.predecessors):
                if p not in ids:
                    raise FieldError(f"metaops[{i}].predecessors[{j}]", f"unknown MetaOp {p!r}")
                if ids[p] >= m.level:
                    raise FieldError(
                        f"metaops[{i}].level",
                        f"level {m.level} is not above predecessor {p!r} (level {ids[p]})",
                    )
            # a MetaLevel is the longest-path depth: one above the deepest predecessor
            depth = 1 + max((ids[p] for p in m.predecessors), default=-1)
            if m.level != depth:
                raise FieldError(
                    f"metaops[{i}].level",
                    f"expected {depth} (one above its deepest predecessor), got {m.level}"
                    if m.predecessors else f"expected 0 (it has no predecessors), got {m.level}",
                )
            if m.level >= self.num_levels:
                raise FieldError(
                    f"metaops[{i}].level", f"{m.level} >= num_levels {self.num_levels}"
                )
        deepest = max(ids.values())
        if self.num_levels != deepest + 1:
            raise FieldError(
                "num_levels",
                f"expected {deepest + 1} (MetaLevels run 0..{deepest}), got {self.num_levels}",
            )
        used = {m.task for m in self.metaops}
        for i, t in enumerate(self.tasks):
            if t not in used:
                raise FieldError(f"tasks[{i}]", f"task {t!r} has no MetaOp")

    def metaop(self, metaop_id: str) -> MetaOp:
        """The MetaOp with that id."""
        for m in self.metaops:
            if m.id == metaop_id:
                return m
        raise KeyError(metaop_id)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the graph's dtype."""
        return 4 if self.dtype == "fp32" else 2
