"""Shared fixtures: paths to the shipped files and a builder for hand-written models."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.cli import main

REPO = Path(__file__).resolve().parent.parent

# Property tests draw the same examples on every machine and in CI, so a failure reproduces
# everywhere; `pytest --hypothesis-profile=explore` draws fresh random examples, 3x as many
# (`hypothesis_scale.examples`).
settings.register_profile("spindle", derandomize=True, database=None)
settings.register_profile("explore", max_examples=300)
settings.load_profile("spindle")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `torch` skip where torch is not installed (`make test-oldest`, whose
    oldest Python has no CPU build of it here); everywhere else they run."""
    if importlib.util.find_spec("torch") is not None:
        return
    for item in items:
        if "torch" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs torch, which is not installed"))


@pytest.fixture
def repo_root() -> Path:
    """The repository root (shipped models/, clusters/, schemas/ live under it)."""
    return REPO


@pytest.fixture
def tiny_clip_path() -> Path:
    """The shipped tiny model, the default input of CLI tests."""
    return REPO / "models" / "tiny-clip.yaml"


@pytest.fixture
def cluster_data() -> dict[str, Any]:
    """A small valid cluster spec as plain data (2 nodes x 4 devices, islands of 2)."""
    return {
        "kind": "cluster",
        "version": 1,
        "name": "test-2x4",
        "num_nodes": 2,
        "devices_per_node": 4,
        "island_size": 2,
        "device": {"name": "test-gpu", "memory_bytes": 16 * 2**30, "peak_flops": 1.0e14,
                   "memory_bandwidth_bytes_per_s": 1.0e12},
        "intra_island_bandwidth_bytes_per_s": 1.0e11,
        "inter_node_bandwidth_bytes_per_s": 1.25e10,
    }


@pytest.fixture
def small_model(small_model_data: dict[str, Any]) -> ModelSpec:
    """`small_model_data` parsed and validated."""
    obj = parse_artifact(small_model_data, "<test>", ModelSpec)
    assert isinstance(obj, ModelSpec)
    return obj


@pytest.fixture
def small_model_data() -> dict[str, Any]:
    """A valid two-task CLIP-style model as plain data; tests edit it to make bad inputs."""
    return {
        "kind": "model",
        "version": 1,
        "name": "small",
        "modules": {
            "text_embed": {"kind": "embedding", "hidden": 16, "vocab_size": 50, "max_seq_len": 8},
            "text_enc": {"kind": "transformer_encoder", "num_layers": 2, "hidden": 16,
                         "heads": 2, "ffn": 32},
            "text_proj": {"kind": "projection", "in_dim": 16, "hidden": 8},
            "image_embed": {"kind": "patch_embed", "in_dim": 12, "hidden": 16, "max_seq_len": 8},
            "image_enc": {"kind": "transformer_encoder", "num_layers": 2, "hidden": 16,
                          "heads": 2, "ffn": 32},
            "image_proj": {"kind": "projection", "in_dim": 16, "hidden": 8, "pool": "mean"},
            "clip_loss": {"kind": "contrastive_loss", "hidden": 8},
        },
        "tasks": [
            {
                "name": name,
                "batch_size": batch,
                "inputs": {"text": {"seq_len": 6}, "image": {"seq_len": 8, "dim": 12}},
                "steps": [
                    {"name": "text_embed", "module": "text_embed", "inputs": ["text"]},
                    {"name": "text_enc", "module": "text_enc", "inputs": ["text_embed"]},
                    {"name": "text_proj", "module": "text_proj", "inputs": ["text_enc"]},
                    {"name": "image_embed", "module": "image_embed", "inputs": ["image"]},
                    {"name": "image_enc", "module": "image_enc", "inputs": ["image_embed"]},
                    {"name": "image_proj", "module": "image_proj", "inputs": ["image_enc"]},
                    {"name": "loss", "module": "clip_loss", "inputs": ["text_proj", "image_proj"]},
                ],
            }
            for name, batch in (("pairs", 4), ("pairs_big", 8))
        ],
        "task_sets": {"one": ["pairs"]},
    }


@pytest.fixture
def make_model() -> Callable[..., ModelSpec]:
    """Build a validated ModelSpec from `modules` and `tasks` written as plain data."""

    def make(modules: dict[str, Any], tasks: list[dict[str, Any]], **extra: Any) -> ModelSpec:
        data = {"kind": "model", "version": 1, "name": "hand-built",
                "modules": modules, "tasks": tasks, **extra}
        obj = parse_artifact(data, "<test>", ModelSpec)
        assert isinstance(obj, ModelSpec)
        return obj

    return make


@dataclass(frozen=True, slots=True)
class CliResult:
    """What one `spindle` invocation produced."""

    exit_code: int
    stdout: str
    stderr: str


@pytest.fixture
def spindle(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run `spindle ARGS...` in-process through the real entry point (`cli.main`, which maps
    errors to one line and an exit code) and capture stdout and stderr apart."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run
