"""The model spec: a declarative multi-task multi-modal model (hand-written YAML, `models/`).

A model is a set of named modules (stacks of identical layers of one kind) and a list of tasks.
Each task feeds its own inputs (token ids or feature patches) through a DAG of steps; a step
applies one module. A module used by several tasks shares its parameters across them.

Shapes: every activation is `[batch, seq, width]` (or `[batch, width]` after pooling). A step
with several sequence inputs concatenates them along the sequence axis (how a prefix LM or a
decoder-only LLM consumes encoder outputs); a `contrastive_loss` step takes exactly two pooled
embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.codec import meta
from spindle_cli.artifacts.io import register
from spindle_cli.artifacts.limits import (
    MAX_BATCH,
    MAX_BATCH_WHY,
    MAX_LAYERS,
    MAX_LAYERS_WHY,
    MAX_TOKENS,
    MAX_TOKENS_WHY,
    MAX_WIDTH,
    MAX_WIDTH_WHY,
)
from spindle_cli.artifacts.model_check import article
from spindle_cli.errors import FieldError

LayerKind = Literal[
    "embedding",
    "patch_embed",
    "transformer_encoder",
    "transformer_decoder",
    "adapter",
    "projection",
    "contrastive_loss",
    "lm_loss",
]
"""Layer kinds. `embedding`: token ids -> [B,S,hidden] (token + position tables).
`patch_embed`: features [B,S,in_dim] -> [B,S,hidden] (linear + position table).
`transformer_encoder` / `transformer_decoder`: pre-LN self-attention + MLP layer,
bidirectional / causal.
`adapter`: [B,S,in_dim] -> [B,S,hidden] (linear; joins an encoder to a wider LLM).
`projection`: pool ([B,S,in_dim] -> [B,in_dim], first token or mean) then linear to hidden.
`contrastive_loss`: symmetric InfoNCE over two [B,hidden] embeddings (learned temperature).
`lm_loss`: LN + vocabulary head + next-token cross-entropy over the last `target_len` positions."""

KIND_FIELDS = {
    "heads": ("transformer_encoder", "transformer_decoder"),
    "ffn": ("transformer_encoder", "transformer_decoder"),
    "in_dim": ("patch_embed", "adapter", "projection"),
    "vocab_size": ("embedding", "lm_loss"),
    "max_seq_len": ("embedding", "patch_embed"),
    "target_len": ("lm_loss",),
}
"""The layer kinds each optional size field applies to: set on another kind it is a mistake
(`heads` on a projection would be shown, and ignored)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleSpec:
    """A stack of `num_layers` identical layers of one kind; its parameters are shared by every
    task that uses it."""

    kind: LayerKind = field(metadata=meta("layer kind"))
    num_layers: int = field(
        default=1,
        metadata=meta("identical layers in the stack", ge=1, le=MAX_LAYERS, le_why=MAX_LAYERS_WHY),
    )
    hidden: int = field(metadata=meta("output width (model dimension)", ge=1, le=MAX_WIDTH,
                                      le_why=MAX_WIDTH_WHY))
    heads: int = field(default=0, metadata=meta("attention heads (transformer kinds)", ge=0,
                                                le=MAX_WIDTH, le_why=MAX_WIDTH_WHY))
    ffn: int = field(default=0, metadata=meta("MLP inner width (transformer kinds)", ge=0,
                                              le=MAX_WIDTH, le_why=MAX_WIDTH_WHY))
    in_dim: int = field(
        default=0, metadata=meta("input width (patch_embed, adapter, projection)", ge=0,
                                 le=MAX_WIDTH, le_why=MAX_WIDTH_WHY)
    )
    vocab_size: int = field(default=0, metadata=meta("vocabulary (embedding, lm_loss)", ge=0,
                                                     le=MAX_TOKENS, le_why=MAX_TOKENS_WHY))
    max_seq_len: int = field(
        default=0, metadata=meta("position table size (embedding, patch_embed)", ge=0,
                                 le=MAX_TOKENS, le_why=MAX_TOKENS_WHY)
    )
    pool: Literal["cls", "mean"] = field(default="cls", metadata=meta("projection pooling"))
    target_len: int = field(default=0, metadata=meta("lm_loss: trailing positions scored", ge=0,
                                                     le=MAX_TOKENS, le_why=MAX_TOKENS_WHY))

    def __post_init__(self) -> None:
        k = self.kind
        a = article(k)
        for name, kinds in KIND_FIELDS.items():
            value = getattr(self, name)
            if k in kinds and value < 1:
                raise FieldError(name, f"{a} {k} needs {name} >= 1")
            if k not in kinds and value:
                raise FieldError(name, f"{a} {k} has no {name} (it applies to "
                                       f"{', '.join(kinds)}); remove it")
        if k in ("transformer_encoder", "transformer_decoder") and self.hidden % self.heads:
            raise FieldError("heads", f"hidden {self.hidden} is not divisible by {self.heads}")
        if k != "projection" and self.pool != "cls":
            raise FieldError("pool", f"{a} {k} does not pool (pool applies to projection); "
                                     "remove it")
        if k not in ("transformer_encoder", "transformer_decoder") and self.num_layers != 1:
            raise FieldError("num_layers", f"{a} {k} has exactly one layer")


@dataclass(frozen=True, slots=True, kw_only=True)
class InputSpec:
    """One data input of a task: token ids (`dim: 0`) or feature patches of width `dim`."""

    seq_len: int = field(metadata=meta("sequence length (tokens or patches)", ge=1))
    dim: int = field(default=0, metadata=meta("feature width; 0 for token ids", ge=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSpec:
    """One node of a task's DAG: apply `module` to the named inputs or earlier steps."""

    name: str = field(metadata=meta("step name, unique within the task"))
    module: str = field(metadata=meta("the module this step runs"))
    inputs: tuple[str, ...] = field(metadata=meta("task inputs or other steps feeding this one"))


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSpec:
    """A task: its global batch, its data inputs and its DAG of steps."""

    name: str = field(metadata=meta("task name"))
    batch_size: int = field(
        metadata=meta("global batch size of the task", ge=1, le=MAX_BATCH, le_why=MAX_BATCH_WHY)
    )
    inputs: dict[str, InputSpec] = field(metadata=meta("data inputs, by name"))
    steps: tuple[StepSpec, ...] = field(metadata=meta("the task's steps (a DAG)"))


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec(Artifact):
    """A multi-task multi-modal model."""

    KIND = "model"
    VERSION = 1

    name: str = field(metadata=meta("model name", name=True))
    description: str = field(default="", metadata=meta("one-line description"))
    modules: dict[str, ModuleSpec] = field(metadata=meta("modules, by name"))
    tasks: tuple[TaskSpec, ...] = field(metadata=meta("all tasks of the model"))
    task_sets: dict[str, tuple[str, ...]] = field(
        default_factory=dict, metadata=meta("named task subsets (e.g. '4' for the 4-task run)")
    )

    def __post_init__(self) -> None:
        Artifact.__post_init__(self)
        from spindle_cli.artifacts.model_check import check_model

        check_model(self)

    def task(self, name: str) -> TaskSpec:
        """The task of that name."""
        for t in self.tasks:
            if t.name == name:
                return t
        raise KeyError(name)
