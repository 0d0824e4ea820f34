"""What a rank holds at a step's turn, measured tensor by tensor (`runtime.held`)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from spindle_cli.runtime.held import SavedTensors, storages


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def test_saved_tensors_count_what_backward_still_needs_and_not_the_weights() -> None:
    mlp = _mlp()
    weights = storages(mlp.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    saved = SavedTensors()
    with saved.recording():
        y = mlp(x)
    # Linear saves its input (x, then GELU's output), GELU its input (the first Linear's
    # output): three 4-row storages of 8, 16 and 16 floats; the weight matrices Linear also
    # saves (not the biases) are not activations
    assert saved.held_bytes(weights) == 4 * 4 * (8 + 16 + 16)
    assert saved.held_bytes({}) == 4 * 4 * (8 + 16 + 16) + 4 * (8 * 16 + 16 * 8)
    y.sum().backward()
    # backward freed the rest; x is held by the test (and by y's graph, as a leaf)
    assert saved.held_bytes(weights) == 4 * 4 * 8
    del x, y
    assert saved.held_bytes(weights) == 0


def test_a_storage_saved_through_two_views_counts_once_and_recording_starts_afresh() -> None:
    base = torch.randn(6, 4, requires_grad=True)
    saved = SavedTensors()
    with saved.recording():
        a, b = base[:3] * 1.0, base[3:] * 1.0
        out = (a * a).sum() + (b * b).sum() + (a * b).sum()
    assert saved.held_bytes({}) == 3 * 4 * 4 * 2  # a and b: two storages, each saved twice
    with saved.recording():
        pass
    assert saved.held_bytes({}) == 0
    del out


def test_under_checkpoint_only_the_operators_input_is_held() -> None:
    mlp = _mlp()
    weights = storages(mlp.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    saved = SavedTensors()
    with saved.recording():
        y = checkpoint(mlp, x, use_reentrant=False)
    assert saved.held_bytes(weights) == 4 * 4 * 8
    del y


def test_a_freed_storage_holds_nothing() -> None:
    flat = torch.zeros(10)
    assert storages([flat, flat[2:5]]) == {flat.untyped_storage().data_ptr(): 40}
    flat.untyped_storage().resize_(0)
    assert storages([flat]) == {}
