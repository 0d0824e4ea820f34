"""The multi-process test harness removes its rendezvous store's directory (multiprocessing's
own pymp-* directory is removed by multiprocessing at exit)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from harness import RanksFailed, run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _rank_sum(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return int(t.item())


def _fail(rank: int, world: int) -> None:
    raise RuntimeError(f"rank {rank} fails")


def test_harness_removes_its_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert run_distributed(_rank_sum, 2, timeout_s=60) == [3, 3]
    assert list(tmp_path.glob("spindle-store-*")) == []


def test_harness_removes_its_store_when_ranks_fail(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RanksFailed, match="rank 0 fails"):
        run_distributed(_fail, 2, timeout_s=60)
    assert list(tmp_path.glob("spindle-store-*")) == []
