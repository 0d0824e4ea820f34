"""Layer modules: shapes, parameter counts against the cost model, seeded initialization."""

from __future__ import annotations

import pytest
import torch

from spindle_cli.artifacts.model import ModuleSpec
from spindle_cli.planner.costs import layer_cost
from spindle_cli.runtime.layers import build_layer

SPECS = {
    "embedding": ModuleSpec(kind="embedding", hidden=8, vocab_size=11, max_seq_len=6),
    "patch_embed": ModuleSpec(kind="patch_embed", hidden=8, in_dim=5, max_seq_len=6),
    "transformer_encoder": ModuleSpec(kind="transformer_encoder", hidden=8, heads=2, ffn=12),
    "transformer_decoder": ModuleSpec(kind="transformer_decoder", hidden=8, heads=2, ffn=12),
    "adapter": ModuleSpec(kind="adapter", hidden=10, in_dim=8),
    "projection": ModuleSpec(kind="projection", hidden=4, in_dim=8, pool="mean"),
    "contrastive_loss": ModuleSpec(kind="contrastive_loss", hidden=4),
    "lm_loss": ModuleSpec(kind="lm_loss", hidden=8, vocab_size=11, target_len=3),
}

B, S = 3, 5


def _inputs(kind: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    if kind == "embedding":
        return (torch.randint(0, 11, (B, S), generator=g),)
    if kind == "patch_embed":
        return (torch.randn(B, S, 5, generator=g),)
    if kind == "contrastive_loss":
        return (torch.randn(B, 4, generator=g), torch.randn(B, 4, generator=g))
    if kind == "lm_loss":
        return (torch.randn(B, S, 8, generator=g), torch.randint(0, 11, (B, 3), generator=g))
    return (torch.randn(B, S, 8, generator=g),)


EXPECTED_SHAPE = {
    "embedding": (B, S, 8),
    "patch_embed": (B, S, 8),
    "transformer_encoder": (B, S, 8),
    "transformer_decoder": (B, S, 8),
    "adapter": (B, S, 10),
    "projection": (B, 4),
    "contrastive_loss": (),
    "lm_loss": (),
}


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_shape_and_parameter_count(kind: str) -> None:
    spec = SPECS[kind]
    layer = build_layer(spec, torch.Generator().manual_seed(0))
    out = layer(*_inputs(kind))
    assert tuple(out.shape) == EXPECTED_SHAPE[kind]
    in_width = 5 if kind == "patch_embed" else spec.in_dim or 8
    expected = layer_cost(spec, B, S, in_width).params
    assert sum(p.numel() for p in layer.parameters()) == expected


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_same_generator_seed_gives_identical_weights(kind: str) -> None:
    a = build_layer(SPECS[kind], torch.Generator().manual_seed(7))
    b = build_layer(SPECS[kind], torch.Generator().manual_seed(7))
    c = build_layer(SPECS[kind], torch.Generator().manual_seed(8))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    if kind != "contrastive_loss":  # its only parameter is a fixed constant
        pairs = zip(a.parameters(), c.parameters(), strict=True)
        assert any(not torch.equal(pa, pc) for pa, pc in pairs)


def test_transformer_concatenates_several_inputs_along_the_sequence() -> None:
    layer = build_layer(SPECS["transformer_encoder"], torch.Generator().manual_seed(0))
    x1, x2 = torch.randn(2, 3, 8), torch.randn(2, 4, 8)
    assert torch.equal(layer(x1, x2), layer(torch.cat([x1, x2], dim=1)))


def test_decoder_is_causal_and_encoder_is_not() -> None:
    dec = build_layer(SPECS["transformer_decoder"], torch.Generator().manual_seed(0))
    enc = build_layer(SPECS["transformer_encoder"], torch.Generator().manual_seed(0))
    x = torch.randn(1, 5, 8)
    y = x.clone()
    y[:, -1, 0] += 1.0  # change only the last position (one feature: LayerNorm ignores shifts)
    assert torch.equal(dec(x)[:, :-1], dec(y)[:, :-1])
    assert not torch.equal(enc(x)[:, :-1], enc(y)[:, :-1])


def test_contrastive_loss_is_low_for_aligned_embeddings() -> None:
    layer = build_layer(SPECS["contrastive_loss"])
    a = torch.eye(4)
    assert layer(a, a).item() < layer(a, a.roll(1, dims=0)).item()
