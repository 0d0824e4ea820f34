"""Runtime tests: forkserver workers with torch and the runtime preloaded, gloo on the
loopback interface, one intra-op thread for the in-process reference training."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.multiprocessing as mp


def pytest_configure() -> None:
    mp.set_forkserver_preload(["torch", "torch.distributed", "spindle_cli.runtime.worker"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The reference training with 2 threads on a shared 2-core host is ~15x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
