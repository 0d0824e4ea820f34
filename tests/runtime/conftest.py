"""Runtime tests: forkserver workers with torch preloaded, gloo on the loopback interface."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp


def pytest_configure() -> None:
    # the in-process reference training: one thread (with 2 on a shared 2-core host it is
    # 15x slower)
    torch.set_num_threads(1)
    mp.set_forkserver_preload(["torch", "torch.distributed", "spindle_cli.runtime.worker"])
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
