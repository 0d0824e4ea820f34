"""Building the layers a rank needs, and the single-process reference training.

Every layer is initialized from its own generator seeded by (seed, module, layer), so a rank
that builds only some layers gets exactly the weights the reference model has for them.
The reference trains every selected task on the whole batch in one process: the loss of a step
is the sum over tasks of each task's mean loss, optimized by the same AdamW. It is what the
distributed executor must reproduce (tests/runtime) and the plain loop of the overhead bench.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch
from torch import nn

from spindle_cli.artifacts.model import ModelSpec, TaskSpec
from spindle_cli.artifacts.model_check import topo_steps
from spindle_cli.runtime.data import DataSource, targets_name
from spindle_cli.runtime.layers import build_layer

LayerKey = tuple[str, int]
"""(module name, layer index inside the module)."""

WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.999)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
"""What `spindle run --dtype` trains in (bf16 as mixed precision: `step_mixed`) and
`spindle profile --hardware local` measures in."""


def run_dtype(requested: str, graph_dtype: str) -> str:
    """The dtype a run trains in: `requested`, or for 'auto' the one its plan counts bytes in
    (its graph's dtype), bf16 for an fp16 graph (the same bytes; fp16 would need loss
    scaling, which the executor does not do)."""
    if requested != "auto":
        return requested
    return "fp32" if graph_dtype == "fp32" else "bf16"


def layer_generator(seed: int, module: str, layer: int) -> torch.Generator:
    """The generator that initializes one layer (crc32: stable across processes)."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{module}/{layer}".encode()))


def build_layers(model: ModelSpec, keys: Iterable[LayerKey], *, seed: int,
                 dtype: torch.dtype = torch.float32,
                 device: torch.device | None = None) -> dict[LayerKey, nn.Module]:
    """Seeded layers for `keys`, sorted by key (the order of parameters everywhere)."""
    out: dict[LayerKey, nn.Module] = {}
    for module, layer in sorted(set(keys)):
        built = build_layer(model.modules[module], layer_generator(seed, module, layer))
        out[(module, layer)] = built.to(dtype=dtype, device=device)
    return out


def named_parameters(layers: dict[LayerKey, nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """`module.layer.param` names and parameters, in layer-key order."""
    return [(f"{m}.{i}.{name}", p) for (m, i), layer in sorted(layers.items())
            for name, p in layer.named_parameters()]


def make_optimizer(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW, identical for the executor and the reference. The multi-tensor (foreach) update
    is elementwise, so a rank holding a subset of the parameters updates them exactly as the
    reference does (tests/runtime/test_exactness.py), and it is several times faster than the
    per-tensor loop for many small tensors. The fused kernel is faster still on CPU (~9x on
    16M fp32 elements) but not layout-independent: stepping a bucket's flat tensor and its
    parameters one by one differ in the last bit of fp32 (its vector lanes and scalar tail
    round differently), which would break that exactness."""
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=WEIGHT_DECAY, foreach=True)


def step_mixed(optimizer: torch.optim.Optimizer,
               pairs: Iterable[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Mixed precision's step: for each (bf16 weights, their fp32 master) in turn, the
    weights' gradient upcast onto the master, AdamW on it (AdamW skips a parameter without a
    gradient, so only this one moves and only one gradient is upcast at a time), and the
    master rounded back into the weights."""
    for weights, master in pairs:
        assert weights.grad is not None
        master.grad = weights.grad.float()
        optimizer.step()
        master.grad = None
        with torch.no_grad():
            weights.copy_(master)


def all_layer_keys(model: ModelSpec, tasks: Iterable[str]) -> list[LayerKey]:
    """Every layer of every module used by the tasks."""
    keys = set()
    for t in tasks:
        for step in model.task(t).steps:
            keys.update((step.module, i) for i in range(model.modules[step.module].num_layers))
    return sorted(keys)


def task_loss(model: ModelSpec, layers: dict[LayerKey, nn.Module], task: TaskSpec,
              data: DataSource, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Mean loss of one task on its whole batch at training step `step` (sum over loss steps)."""
    b = task.batch_size
    acts: dict[str, torch.Tensor] = {
        name: data.rows(task.name, name, step, 0, b).to(device) for name in task.inputs
    }
    by_name = {s.name: s for s in task.steps}
    total = None
    for name in topo_steps(task, task.name):
        s = by_name[name]
        mod = model.modules[s.module]
        ins = [acts[i] for i in s.inputs]
        if mod.kind == "lm_loss":
            ins.append(data.rows(task.name, targets_name(name), step, 0, b).to(device))
        out = layers[(s.module, 0)](*ins)
        for i in range(1, mod.num_layers):
            out = layers[(s.module, i)](out)
        if mod.kind in ("contrastive_loss", "lm_loss"):
            total = out if total is None else total + out
        else:
            acts[name] = out
    assert total is not None
    return total


def reference_training(model: ModelSpec, tasks: Iterable[str], data: DataSource, *, steps: int,
                       seed: int, lr: float, dtype: torch.dtype = torch.float32,
                       ) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """Train in one process; per-step task losses and the final parameters by name."""
    tasks = list(tasks)
    layers = build_layers(model, all_layer_keys(model, tasks), seed=seed, dtype=dtype)
    named = named_parameters(layers)
    opt = make_optimizer([p for _, p in named], lr)
    history = []
    for step in range(steps):
        opt.zero_grad()
        losses = {t: task_loss(model, layers, model.task(t), data, step) for t in tasks}
        sum(losses.values()).backward()  # type: ignore[union-attr]
        opt.step()
        history.append({t: v.item() for t, v in losses.items()})
    return history, {n: p.detach().clone() for n, p in named}
