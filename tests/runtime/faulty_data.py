"""User-dataset hooks for the failure tests (imported by worker processes via --dataset)."""

from __future__ import annotations

import os
import time

import torch

from spindle_cli.artifacts.model import ModelSpec
from spindle_cli.runtime.data import SyntheticData


class CrashOnRankOne(SyntheticData):
    """Synthetic data, but rank 1 raises when it loads data for training step 1."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        if step == 1 and os.environ.get("RANK") == "1":
            raise OSError("disk read failed (injected)")
        return super().rows(task, name, step, lo, hi)


class NarrowFeaturesOnRankZero(SyntheticData):
    """Synthetic data whose feature inputs lose a column on rank 0."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        x = super().rows(task, name, step, lo, hi)
        if x.dim() == 3 and os.environ.get("RANK") == "0":
            return x[..., :-1]
        return x


def crash_on_rank_one(model: ModelSpec, seed: int) -> CrashOnRankOne:
    return CrashOnRankOne(model, seed)


def narrow_features_on_rank_zero(model: ModelSpec, seed: int) -> NarrowFeaturesOnRankZero:
    return NarrowFeaturesOnRankZero(model, seed)


class HangOnRankOne(SyntheticData):
    """Synthetic data, but rank 1 stops responding in training step 1."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        if step == 1 and os.environ.get("RANK") == "1":
            time.sleep(3600)
        return super().rows(task, name, step, lo, hi)


def hang_on_rank_one(model: ModelSpec, seed: int) -> HangOnRankOne:
    return HangOnRankOne(model, seed)


def returns_nothing(model: ModelSpec, seed: int) -> None:
    """A factory that forgot its return statement."""


class WrongShape(SyntheticData):
    """Rows without their sequence and width."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        return torch.zeros(hi - lo)


def wrong_shape(model: ModelSpec, seed: int) -> WrongShape:
    return WrongShape(model, seed)


class Unreadable(SyntheticData):
    """Data whose files cannot be read."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        raise OSError("no such shard")


def unreadable(model: ModelSpec, seed: int) -> Unreadable:
    return Unreadable(model, seed)


def missing_file(model: ModelSpec, seed: int) -> SyntheticData:
    """A factory whose own set-up fails (its data file is gone)."""
    with open("no-such-data.json", encoding="utf-8") as f:
        f.read()
    return SyntheticData(model, seed)


class OutOfVocabulary(SyntheticData):
    """Token ids past the vocabulary (a tokenizer for another model)."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        x = super().rows(task, name, step, lo, hi)
        return x + 100_000 if x.dtype == torch.int64 else x


def out_of_vocabulary(model: ModelSpec, seed: int) -> OutOfVocabulary:
    return OutOfVocabulary(model, seed)
