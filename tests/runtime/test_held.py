"""What a rank holds at a step's turn, measured tensor by tensor (`runtime.held`)."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from spindle_cli.runtime.held import SavedTensors, storages


def _mlp_and_input() -> tuple[torch.nn.Sequential, dict[int, int], torch.Tensor]:
    """A small MLP, its weights' storages and a 4-row input that requires grad."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    return mlp, storages(mlp.parameters()), torch.randn(4, 8, requires_grad=True)


def test_saved_tensors_count_what_backward_still_needs_and_not_the_weights() -> None:
    mlp, weights, x = _mlp_and_input()
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
        # mul saves both factors: two views of base's one storage
        out = (base[:3] * base[3:]).sum()
        # and x * x saves x twice
        x = base * 2.0
        out = out + (x * x).sum()
    assert saved.held_bytes({}) == 2 * 6 * 4 * 4  # base's storage and x's, once each
    with saved.recording():
        pass
    assert saved.held_bytes({}) == 0
    del out


def test_under_checkpoint_only_the_operators_input_is_held() -> None:
    mlp, weights, x = _mlp_and_input()
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


def test_the_cuda_peak_starts_afresh_before_the_steps(monkeypatch) -> None:
    """A rank's building and a checkpoint's loading (a second copy of the state) are not a
    step's peak; the CPU has no allocator statistics. CUDA stands in here (no GPU)."""
    from spindle_cli.runtime import held

    peak = {"bytes": 7 << 30}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device: peak.update(bytes=0))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak["bytes"])
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert held.peak_allocated(gpu) == 7 << 30
    held.reset_peak(cpu)
    assert held.peak_allocated(cpu) is None and peak["bytes"] == 7 << 30
    held.reset_peak(gpu)
    assert held.peak_allocated(gpu) == 0
