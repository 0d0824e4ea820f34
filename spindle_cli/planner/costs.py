"""Analytic per-operator costs from layer dimensions: FLOPs, parameters, activation bytes.

One operator is one layer of a module. FLOPs count multiply-adds as 2 and forward+backward as
3x forward (the convention of Narayanan et al., SC'21, which gives the paper's 12(6sh^2 + s^2h)
per sample for a transformer layer with ffn = 4h). Activation memory kept for backward follows
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022):
34sh + 5as^2 bytes per sample at 2-byte precision with ffn = 4h, generalized here to
(9h + 2f)s + 2.5as^2 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

from spindle_cli.artifacts.model import ModuleSpec

TOKEN_BYTES = 4
"""Token ids travel as int32."""


@dataclass(frozen=True, slots=True)
class LayerCost:
    """Costs of one operator (layer) for a given input shape."""

    flops_per_sample: float
    """Forward+backward FLOPs per sample (for the contrastive loss: per sample at batch B)."""
    params: int
    """Parameters of the layer."""
    stash_elems_per_sample: float
    """Activation elements kept for backward per sample."""


def layer_cost(module: ModuleSpec, batch_size: int, seq_len: int, in_width: int) -> LayerCost:
    """Cost of one layer of `module` on inputs of `seq_len` positions of width `in_width`."""
    h, f, a, s = module.hidden, module.ffn, module.heads, seq_len
    k = module.kind
    if k in ("transformer_encoder", "transformer_decoder"):
        fwd = 2 * (4 * s * h * h + 2 * s * h * f) + 4 * s * s * h
        params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
        stash = (9 * h + 2 * f) * s + 2.5 * a * s * s
    elif k == "embedding":
        fwd = 2 * s * h
        params = (module.vocab_size + module.max_seq_len) * h
        stash = s
    elif k in ("patch_embed", "adapter"):
        fwd = 2 * s * in_width * h
        params = in_width * h + h + (module.max_seq_len * h if k == "patch_embed" else 0)
        stash = s * in_width
    elif k == "projection":
        fwd = 2 * in_width * h + s * in_width
        params = in_width * h + h
        stash = in_width
    elif k == "contrastive_loss":
        # logits of the two directions: 2 * (B x h) @ (h x B) per batch
        fwd = 2 * 2 * batch_size * h
        params = 1
        stash = 2 * h + 2 * batch_size
    else:  # lm_loss: LayerNorm + vocabulary head over the scored positions
        t = module.target_len
        fwd = 2 * t * h * module.vocab_size
        params = h * module.vocab_size + 2 * h
        stash = t * h + t * module.vocab_size
    return LayerCost(flops_per_sample=3.0 * fwd, params=int(params), stash_elems_per_sample=stash)


def module_params(module: ModuleSpec) -> int:
    """Parameters of a whole module (all its layers)."""
    return module.num_layers * layer_cost(module, 1, 1, module.in_dim).params
