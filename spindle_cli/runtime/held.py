"""What a rank holds at the turn of a step (after its last forward wave, before its first
backward one), measured tensor by tensor in the planner's memory categories (`RankMemory`:
planner/memory.py), for a traced run to set beside the plan's estimate.

The turn is where the planner's model puts a rank's peak: every slice's stash is alive then.
Activations are the storages autograd still holds for backward (`SavedTensors`, through
`torch.autograd.graph.saved_tensors_hooks`; under recomputation a checkpointed operator saves
only its input), apart from the weights, gradients and optimizer state, which are counted on
their own. Each storage is counted once, whole, however many saved tensors view it. A
slice's output or a received activation that no operator saved is not counted (on tiny-clip
2-4% more). This works on any device (the CPU has no allocator statistics); on CUDA the
allocator's peak over the steps comes beside it (`peak_allocated`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """The distinct storages under `tensors`: address -> bytes (a freed storage has none)."""
    out: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out[s.data_ptr()] = s.nbytes()
    return out


class SavedTensors:
    """The tensors autograd saves for backward while `recording`."""

    def __init__(self) -> None:
        self._saved: list[tuple[weakref.ref[torch.Tensor], int, int]] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record what the enclosed block saves (forgetting what was recorded before)."""
        self._saved = []
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # autograd keeps what this returns until the backward that reads it: while `t` is
        # alive, so is its storage
        s = t.untyped_storage()
        self._saved.append((weakref.ref(t), s.data_ptr(), s.nbytes()))
        return t

    def held_bytes(self, besides: dict[int, int]) -> int:
        """Bytes of the recorded storages still held, apart from those in `besides`."""
        held = {ptr: n for ref, ptr, n in self._saved
                if n and ptr not in besides and ref() is not None}
        return sum(held.values())


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def reset_peak(device: torch.device) -> None:
    """Start `peak_allocated` afresh on a CUDA `device` (before the first step: building the
    model and loading a checkpoint, which holds a second copy of the state for a moment, are
    not a step's peak)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """The CUDA allocator's peak bytes on `device` since `reset_peak` (None elsewhere)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))
