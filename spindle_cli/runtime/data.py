"""Training data: seeded synthetic batches per task and input, and the hook for a user dataset.

A data source answers `rows(task, name, step, lo, hi)`: rows [lo, hi) of the global batch of
`task` at training step `step` for the data item `name`, which is a task input name or
`targets_name(loss_step)` for the targets of an `lm_loss` step. Asking by row range lets each
rank load only the samples of its slice, and makes the data position of a run just its step
number (what a checkpoint records).

Shapes (what the executor checks): token ids `[rows, seq_len]` int64; features
`[rows, seq_len, dim]` in the run's dtype; targets `[rows, target_len]` int64.

A user dataset is a `module:function` (`--dataset`), called as `function(model, seed)` (the
ModelSpec and the run's --seed) and returning an object with that `rows` method; the module is
imported as Python would with the working directory first on its path. `spindle run` reads the
first row of every data item at step 0 before launch (`check_data_source`).
"""

from __future__ import annotations

import importlib
import os
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from spindle_cli.artifacts.model import ModelSpec, TaskSpec
from spindle_cli.artifacts.model_check import targets_name
from spindle_cli.errors import SpindleError


class DataSource(Protocol):
    """Where training samples come from."""

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of data item `name` of `task` at training step `step`."""
        ...


def item_shape(model: ModelSpec, task: TaskSpec, name: str) -> tuple[tuple[int, ...], bool]:
    """Per-sample shape of a data item and whether it holds integer ids."""
    if name in task.inputs:
        spec = task.inputs[name]
        return ((spec.seq_len, spec.dim), False) if spec.dim else ((spec.seq_len,), True)
    step = name.removesuffix(":targets")
    module = next(model.modules[s.module] for s in task.steps if s.name == step)
    return (module.target_len,), True


def _vocab(model: ModelSpec, task: TaskSpec, name: str) -> int:
    """Vocabulary of the module that consumes token ids `name` (or scores targets `name`)."""
    if name in task.inputs:
        step = next(s for s in task.steps if name in s.inputs)
        return model.modules[step.module].vocab_size
    step_name = name.removesuffix(":targets")
    return model.modules[next(s.module for s in task.steps if s.name == step_name)].vocab_size


def rows_problem(x: Any, model: ModelSpec, task: TaskSpec, name: str, lo: int,
                 hi: int) -> str | None:
    """What is wrong with rows [lo, hi) of data item `name` as a data source gave them, or
    None: a tensor of the item's shape, int64 token ids inside the vocabulary that reads
    them."""
    shape, is_ids = item_shape(model, task, name)
    want = [hi - lo, *shape]
    kind = "int64 token ids" if is_ids else "float features"
    if not isinstance(x, torch.Tensor):
        return f"got {type(x).__name__}, expected {kind} {want}"
    if list(x.shape) != want or (x.dtype == torch.int64) != is_ids:
        return f"got {x.dtype} {list(x.shape)}, expected {kind} {want}"
    if is_ids and x.numel():
        vocab = _vocab(model, task, name)
        lowest, highest = int(x.min()), int(x.max())
        if lowest < 0 or highest >= vocab:
            bad = lowest if lowest < 0 else highest
            return f"holds token id {bad}, outside the vocabulary of {vocab} (ids 0-{vocab - 1})"
    return None


def data_items(model: ModelSpec, task: TaskSpec) -> list[str]:
    """Every data item of a task: its inputs, then the targets of its lm_loss steps."""
    items = list(task.inputs)
    items += [targets_name(s.name) for s in task.steps if model.modules[s.module].kind == "lm_loss"]
    return items


class SyntheticData:
    """Random token ids and Gaussian features, a pure function of (seed, task, item, step).

    Each call draws the whole global batch and returns the asked rows, so every rank sees the
    same samples whatever the split. Seeds use crc32, not `hash()`, which differs per process.
    """

    def __init__(self, model: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.seed = seed
        self.dtype = dtype
        self._cache: dict[tuple[str, str, int], torch.Tensor] = {}

    def rows(self, task: str, name: str, step: int, lo: int, hi: int) -> torch.Tensor:
        key = (task, name, step)
        if key not in self._cache:
            if len(self._cache) > 64:
                self._cache.clear()
            self._cache[key] = self._draw(task, name, step)
        return self._cache[key][lo:hi]

    def _draw(self, task_name: str, name: str, step: int) -> torch.Tensor:
        task = self.model.task(task_name)
        shape, is_ids = item_shape(self.model, task, name)
        gen = torch.Generator().manual_seed(
            zlib.crc32(f"{self.seed}/{task_name}/{name}/{step}".encode())
        )
        if is_ids:
            return torch.randint(0, _vocab(self.model, task, name), (task.batch_size, *shape),
                                 generator=gen)
        # drawn in fp32 whatever the run's dtype, so every dtype trains on the same samples
        return torch.randn((task.batch_size, *shape), generator=gen).to(self.dtype)


def dataset_factory(spec: str) -> Callable[[ModelSpec, int], DataSource]:
    """The user dataset factory named `module:function`; SpindleError when it cannot be found
    (checked before launch too)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise SpindleError(f"--dataset {spec!r}: expected 'module:function'")
    # as `python -m` and the workers (run with -m) see it: the working directory comes first
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise SpindleError(f"--dataset {spec!r}: {e}") from None
    except Exception as e:  # the user's module: a SyntaxError, or what its import runs raised
        raise SpindleError(f"--dataset {spec!r}: importing {module_name} raised {e!r}") from None
    if not callable(factory):
        raise SpindleError(f"--dataset {spec!r}: {attr} is not callable")
    return factory  # type: ignore[no-any-return]


def load_data_source(spec: str | None, model: ModelSpec, seed: int,
                     dtype: torch.dtype = torch.float32) -> DataSource:
    """The synthetic data (spec None) or a user dataset `module:function`."""
    if spec is None:
        return SyntheticData(model, seed, dtype)
    factory = dataset_factory(spec)
    try:
        source = factory(model, seed)
    except Exception as e:  # the user's code: whatever it raises is the answer
        raise SpindleError(f"--dataset {spec!r}: {spec.partition(':')[2]}(model, seed) "
                           f"raised {e!r}") from None
    if not callable(getattr(source, "rows", None)):
        raise SpindleError(f"--dataset {spec!r}: the function returned {type(source).__name__}, "
                           "which has no rows(task, name, step, lo, hi) method")
    return source  # type: ignore[no-any-return]


def check_data_source(spec: str, model: ModelSpec, tasks: Sequence[str], seed: int) -> None:
    """SpindleError unless the user dataset `spec` gives the first row of every data item of
    `tasks` at step 0 in the shape the executor checks (before launch: every rank would fail
    at its first slice otherwise)."""
    source = load_data_source(spec, model, seed)
    for name in tasks:
        task = model.task(name)
        for item in data_items(model, task):
            call = f"rows({name!r}, {item!r}, 0, 0, 1)"
            try:
                x = source.rows(name, item, 0, 0, 1)
            except Exception as e:  # the user's code: whatever it raises is the answer
                raise SpindleError(f"--dataset {spec!r}: {call} raised {e!r}") from None
            problem = rows_problem(x, model, task, item, 0, 1)
            if problem is not None:
                raise SpindleError(f"--dataset {spec!r}: {call} {problem}")
