"""Torch modules for every layer kind of the model spec (`spindle_cli/artifacts/model.py`).

One module here is ONE operator (one layer) of a `ModuleSpec`: a stack of `num_layers`
transformer layers is `num_layers` separate modules, so a rank can instantiate exactly the
layers its slices run. Initialization is explicit and driven by a `torch.Generator`, so the
same (seed, module, layer) gives bit-identical weights in every process.

Call conventions (`layer(*inputs)`):
- `embedding`: token ids `[B,S]` (int64) -> `[B,S,hidden]`.
- `patch_embed`: features `[B,S,in_dim]` -> `[B,S,hidden]`.
- `transformer_encoder` / `transformer_decoder`: one or more `[B,S_i,hidden]` sequences; several
  inputs are concatenated along the sequence axis INSIDE the layer call (the model spec's rule
  for a step with several sequence inputs), giving `[B,sum(S_i),hidden]`.
- `adapter`: `[B,S,in_dim]` -> `[B,S,hidden]`; `projection`: `[B,S,in_dim]` -> `[B,hidden]`.
- `contrastive_loss`: two `[B,hidden]` embeddings -> scalar (fp32 at least: both losses take
  their softmax in fp32 from bf16 logits), the symmetric InfoNCE averaged over the B samples
  of the call (it couples every sample with every other one, so the
  executor calls it on the whole gathered batch).
- `lm_loss`: `[B,S,hidden]` and targets `[B,target_len]` (int64 token ids) -> scalar, the mean
  cross-entropy of the last `target_len` positions against the targets (the targets are data:
  a real dataset passes the next tokens; the synthetic data draws them at random).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spindle_cli.artifacts.model import ModuleSpec

INIT_STD = 0.02
"""Standard deviation of every weight matrix and embedding table (GPT-2 / CLIP convention)."""

INIT_LOGIT_SCALE = math.log(1 / 0.07)
"""Initial log inverse temperature of the contrastive loss (CLIP, Radford et al. 2021)."""


def _linear(in_dim: int, out_dim: int, gen: torch.Generator | None, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(in_dim, out_dim, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, INIT_STD, generator=gen)
        if layer.bias is not None:
            layer.bias.zero_()
    return layer


def _table(rows: int, width: int, gen: torch.Generator | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, width).normal_(0.0, INIT_STD, generator=gen))


class TokenEmbedding(nn.Module):
    """Token table + learned position table."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.tokens = _table(spec.vocab_size, spec.hidden, gen)
        self.positions = _table(spec.max_seq_len, spec.hidden, gen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens[ids] + self.positions[: ids.shape[1]]


class PatchEmbedding(nn.Module):
    """Linear patch projection + learned position table."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.proj = _linear(spec.in_dim, spec.hidden, gen)
        self.positions = _table(spec.max_seq_len, spec.hidden, gen)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features) + self.positions[: features.shape[1]]


class TransformerLayer(nn.Module):
    """Pre-LN self-attention + GELU MLP; `causal` for decoder layers. No dropout: the runtime's
    exactness against single-process training needs a deterministic forward."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None, causal: bool) -> None:
        super().__init__()
        self.heads = spec.heads
        self.causal = causal
        self.ln1 = nn.LayerNorm(spec.hidden)
        self.qkv = _linear(spec.hidden, 3 * spec.hidden, gen)
        self.out = _linear(spec.hidden, spec.hidden, gen)
        self.ln2 = nn.LayerNorm(spec.hidden)
        self.fc1 = _linear(spec.hidden, spec.ffn, gen)
        self.fc2 = _linear(spec.ffn, spec.hidden, gen)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        x = xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        shape = (b, s, self.heads, h // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Adapter(nn.Module):
    """A linear map from an encoder's width to a wider model's width, per position."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.proj = _linear(spec.in_dim, spec.hidden, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Projection(nn.Module):
    """Pool the sequence (first token or mean) and project it to the embedding width."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.pool = spec.pool
        self.proj = _linear(spec.in_dim, spec.hidden, gen)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = x[:, 0] if self.pool == "cls" else x.mean(dim=1)
        return self.proj(pooled)


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Logits in fp32 at least for the softmax and cross-entropy (bf16 keeps 8 bits of
    mantissa; torch's autocast computes them in fp32 too); fp32 and fp64 as they are."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class ContrastiveLoss(nn.Module):
    """Symmetric InfoNCE with a learned temperature (CLIP). Not separable per sample: call it
    on the whole batch."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(INIT_LOGIT_SCALE))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = F.normalize(a, dim=-1)
        b = F.normalize(b, dim=-1)
        logits = _wide(self.logit_scale.exp() * a @ b.T)
        labels = torch.arange(a.shape[0], device=a.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


class LMLoss(nn.Module):
    """Final LayerNorm + vocabulary head + cross-entropy of the last `target_len` positions."""

    def __init__(self, spec: ModuleSpec, gen: torch.Generator | None) -> None:
        super().__init__()
        self.target_len = spec.target_len
        self.ln = nn.LayerNorm(spec.hidden)
        self.head = _linear(spec.hidden, spec.vocab_size, gen, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = _wide(self.head(self.ln(x[:, -self.target_len :])))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_layer(spec: ModuleSpec, generator: torch.Generator | None = None) -> nn.Module:
    """One layer (operator) of `spec`, in float32 on the CPU. Without a generator the weights
    come from torch's global RNG (enough for timing); the executor passes a seeded one."""
    k = spec.kind
    if k == "embedding":
        return TokenEmbedding(spec, generator)
    if k == "patch_embed":
        return PatchEmbedding(spec, generator)
    if k in ("transformer_encoder", "transformer_decoder"):
        return TransformerLayer(spec, generator, causal=k == "transformer_decoder")
    if k == "adapter":
        return Adapter(spec, generator)
    if k == "projection":
        return Projection(spec, generator)
    if k == "contrastive_loss":
        return ContrastiveLoss(spec, generator)
    assert k == "lm_loss", k
    return LMLoss(spec, generator)
