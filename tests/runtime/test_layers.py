"""Layer modules: shapes, parameter counts against the cost model, seeded initialization."""

from __future__ import annotations

import math

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


def test_contrastive_loss_is_the_mean_of_both_directions_in_closed_form() -> None:
    # a = (e1, e2), b = (e1, (e1 + e2) / sqrt 2): cosine similarities a @ b.T = [[1, c], [0, c]]
    # with c = 1 / sqrt 2, scaled by s = exp(logit_scale) = 2. Matching rows (a -> b):
    # log(1 + e^(s(c - 1))) and log(1 + e^(-sc)); matching columns (b -> a): log(1 + e^(-s))
    # and log 2. The two directions differ, so only their average is the symmetric InfoNCE.
    layer = build_layer(SPECS["contrastive_loss"]).double()
    with torch.no_grad():
        layer.logit_scale.fill_(math.log(2.0))
    s, c = 2.0, 1 / math.sqrt(2)
    a = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 0, 0, 0], [1.0, 1.0, 0, 0]], dtype=torch.float64)  # normalized inside
    rows = (math.log1p(math.exp(s * (c - 1))) + math.log1p(math.exp(-s * c))) / 2
    cols = (math.log1p(math.exp(-s)) + math.log(2)) / 2
    assert abs(rows - cols) > 0.05
    assert layer(a, b).item() == pytest.approx((rows + cols) / 2, rel=1e-12)
    # symmetric: swapping the two embeddings swaps the directions, not the value
    assert layer(b, a).item() == pytest.approx((rows + cols) / 2, rel=1e-12)


def test_lm_loss_scores_only_the_last_target_len_positions() -> None:
    # target_len = 3 of S = 5 positions: changing positions 0-1 leaves the loss as it is,
    # changing any of the last 3 changes it
    layer = build_layer(SPECS["lm_loss"], torch.Generator().manual_seed(0))
    x, targets = _inputs("lm_loss")
    base = layer(x, targets)
    before = x.clone()
    before[:, :2] += torch.randn(B, 2, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(before, targets), base)
    for pos in (S - 3, S - 1):
        y = x.clone()
        y[:, pos] += torch.randn(B, 8, generator=torch.Generator().manual_seed(3))
        assert not torch.isclose(layer(y, targets), base), pos
