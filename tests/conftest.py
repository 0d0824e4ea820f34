"""Shared fixtures: paths to the shipped files and a builder for hand-written models."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.model import ModelSpec

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    """The repository root (shipped models/, clusters/, schemas/ live under it)."""
    return REPO


@pytest.fixture
def tiny_clip_path() -> Path:
    """The shipped tiny model, the default input of CLI tests."""
    return REPO / "models" / "tiny-clip.yaml"


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
