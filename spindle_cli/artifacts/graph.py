"""The MetaOp graph: the contracted operator DAG of the selected tasks (`spindle graph`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spindle_cli.artifacts.base import DerivedArtifact
from spindle_cli.artifacts.codec import meta
from spindle_cli.artifacts.io import register
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
    first_layer: int = field(metadata=meta("index in the module of its first layer", ge=0))
    num_layers: int = field(metadata=meta("operators in the MetaOp (L)", ge=1))
    batch_size: int = field(metadata=meta("global batch (B)", ge=1))
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


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class MetaOpGraph(DerivedArtifact):
    """MetaOps of the selected tasks, ordered by (level, id)."""

    KIND = "metaop_graph"
    VERSION = 1

    model: str = field(metadata=meta("model name"))
    tasks: tuple[str, ...] = field(metadata=meta("selected tasks, in model order"))
    dtype: Literal["fp32", "bf16", "fp16"] = field(metadata=meta("activation/parameter dtype"))
    num_levels: int = field(metadata=meta("number of MetaLevels", ge=1))
    metaops: tuple[MetaOp, ...] = field(metadata=meta("the MetaOps"))

    def __post_init__(self) -> None:
        DerivedArtifact.__post_init__(self)
        ids: dict[str, int] = {}
        for i, m in enumerate(self.metaops):
            if m.id in ids:
                raise FieldError(f"metaops[{i}].id", f"duplicate MetaOp id {m.id!r}")
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
            if m.level >= self.num_levels:
                raise FieldError(
                    f"metaops[{i}].level", f"{m.level} >= num_levels {self.num_levels}"
                )

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
