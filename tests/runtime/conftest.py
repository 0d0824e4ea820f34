"""Runtime tests: forkserver workers with torch preloaded, gloo on the loopback interface."""

from __future__ import annotations

import os

import torch.multiprocessing as mp


def pytest_configure() -> None:
    mp.set_forkserver_preload(["torch", "torch.distributed"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
