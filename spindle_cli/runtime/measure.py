"""Measuring one operator with torch: forward+backward time and peak memory of one layer at
the per-device slice shape (`spindle profile --hardware local`).

- One layer from `runtime.layers.build_layer` at batch ceil(B / groups); data parallel needs
  nothing else. Tensor parallel of degree t runs the Megatron-style shard of a transformer
  layer (QKV, attention heads and MLP split t ways, LayerNorms replicated): the collectives are
  NOT measured here; the caller adds them from the cluster's link model.
- Warm-up iterations, then `repeats` timed iterations; the median is kept. CUDA events time
  the GPU, `time.perf_counter` the CPU. A timed iteration runs the layer as the executor
  does: parameter gradients zeroed in place and accumulated into, no hooks (the activation
  bytes are counted in the first warm-up iteration).
- Out of memory (CUDA OOM, or the estimate above the memory limit on the CPU, where nothing
  stops the host from swapping) and timeouts (a warm-up iteration slower than the budget) give
  an infeasible measurement, never an exception.
- Peak memory: on CUDA the allocator's peak; on the CPU, which has no allocator statistics,
  the bytes of parameters and gradients plus the activations autograd saves for backward
  (counted with saved-tensor hooks) and the input; both plus the Adam state the real step
  would hold (not allocated here).
- The optimizer step (`measure_optimizer`): AdamW as the executor steps it, on two flat
  tensors; a fixed cost per tensor and a cost per parameter. Timed at least
  OPTIMIZER_MIN_REPEATS times whatever `--repeats` says, and cached as the points are
  (`cached_optimizer`): timed at every run, it made two profiles of the same cached points
  differ (a review: 2.58 against 1.25 ms per million parameters), and the plans' simulated
  iterations with them.
- A per-point cache under `.spindle-cache/profile/` (keyed by signature, count, strategy,
  per-device batch, repeats, torch version, device and dtype) lets an interrupted profile
  resume.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spindle_cli.artifacts.codec import from_data
from spindle_cli.artifacts.files import write_text_atomic
from spindle_cli.artifacts.graph import MetaOp
from spindle_cli.artifacts.limits import MAX_MS
from spindle_cli.artifacts.model import ModuleSpec
from spindle_cli.artifacts.profile import OptimizerCost, tp_degree
from spindle_cli.errors import ArtifactError
from spindle_cli.planner.memory import state_bytes_per_param
from spindle_cli.runtime.layers import build_layer
from spindle_cli.runtime.model import DTYPES, make_optimizer, step_mixed

CACHE_DIR = Path(".spindle-cache") / "profile"
METHOD = 2
"""How a point is timed, in the cache key: 2 times steps without the saved-tensor hook and
with gradients zeroed in place, as the executor runs a layer (1 timed the hook and fresh
gradients: tiny-clip's text encoder layer 1.44-1.47 ms against 1.35-1.40, interleaved)."""
DATA_KINDS = ("embedding", "patch_embed")
"""Layer kinds whose inputs are task data (no gradient flows back into them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """One measured (count, strategy) point, before any communication time is added."""

    feasible: bool
    time_ms: float
    peak_memory_bytes: int
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How to measure."""

    repeats: int = 5
    warmup: int = 2
    timeout_s: float = 10.0
    """Budget per point: a warm-up iteration slower than this makes the point infeasible."""
    memory_limit_bytes: int | None = None
    """CPU only: skip (infeasible) a point whose estimated memory exceeds this."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """Where measurements run."""

    device: torch.device
    device_name: str
    dtype: torch.dtype
    dtype_name: str

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the measuring dtype."""
        return self.dtype.itemsize


def local_target(*, cpu_threads: int = 1, cpu: bool = False, dtype_name: str = "fp32"
                 ) -> Target:
    """CUDA device 0 when present (and not `cpu`), else the CPU, in `dtype_name` (a key of
    `model.DTYPES`): the dtype `spindle run` trains the graph in (`model.run_dtype`), so that
    a plan from the profile times and sizes what runs (bf16: mixed precision).
    `cpu`: the CPU even where a GPU is present (a cluster of CPU ranks). On the CPU with
    `cpu_threads` intra-op threads (this sets torch's process-wide thread count). One thread
    by default: a CPU rank of the `local-cpu` cluster is one process per core, and an OpenMP
    pool that spins on a core shared with another process makes small-op timings swing by
    50x."""
    if not cpu and torch.cuda.is_available():
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(device)
    else:
        torch.set_num_threads(cpu_threads)
        device = torch.device("cpu")
        name = f"cpu ({cpu_threads} thread{'' if cpu_threads == 1 else 's'})"
    return Target(device=device, device_name=name, dtype=DTYPES[dtype_name],
                  dtype_name=dtype_name)


class ShardedTransformerLayer(nn.Module):
    """The per-device part of a transformer layer under tensor parallelism of degree t
    (Megatron-LM column-parallel QKV/fc1, row-parallel out/fc2), without the all-reduces."""

    def __init__(self, spec: ModuleSpec, t: int, causal: bool) -> None:
        super().__init__()
        h = spec.hidden
        self.heads = spec.heads // t
        self.head_dim = h // spec.heads
        self.causal = causal
        width = self.heads * self.head_dim
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * width)
        self.out = nn.Linear(width, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, spec.ffn // t)
        self.fc2 = nn.Linear(spec.ffn // t, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        width = self.heads * self.head_dim
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=-1)
        shape = (b, s, self.heads, self.head_dim)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, width))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def can_shard(spec: ModuleSpec, t: int) -> bool:
    """Whether a layer of `spec` splits t ways (transformer layers with heads and ffn
    divisible by t)."""
    kinds = ("transformer_encoder", "transformer_decoder")
    return spec.kind in kinds and spec.heads % t == 0 and spec.ffn % t == 0


def _layer(spec: ModuleSpec, strategy: str) -> nn.Module:
    t = tp_degree(strategy)
    if t == 1:
        return build_layer(spec)
    return ShardedTransformerLayer(spec, t, causal=spec.kind == "transformer_decoder")


def _inputs(spec: ModuleSpec, op: MetaOp, batch: int, target: Target) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dev, dtype = target.device, target.dtype
    grad = op.layer_kind not in DATA_KINDS
    if op.layer_kind == "embedding":
        ids = torch.randint(0, spec.vocab_size, (batch, op.seq_len), generator=gen)
        return [ids.to(dev)]
    if op.layer_kind == "contrastive_loss":
        return [
            torch.randn(batch, op.in_width, generator=gen).to(dev, dtype).requires_grad_()
            for _ in range(2)
        ]
    x = torch.randn(batch, op.seq_len, op.in_width, generator=gen).to(dev, dtype)
    x.requires_grad_(grad)
    if op.layer_kind == "lm_loss":
        targets = torch.randint(0, spec.vocab_size, (batch, spec.target_len), generator=gen)
        return [x, targets.to(dev)]
    return [x]


def _adam_bytes(num_params: int, dtype_name: str) -> int:
    """The optimizer state of `num_params` parameters, as the planner counts it
    (`memory.state_bytes_per_param`: fp32 master weights and two moments for 16-bit
    training, the moments alone at a wider dtype's width)."""
    return num_params * state_bytes_per_param(dtype_name)[2]


def _estimate_bytes(op: MetaOp, batch: int, t: int, dtype_name: str) -> int:
    weights, grads, optimizer = state_bytes_per_param(dtype_name)
    params = op.params_per_layer / t
    return int(params * (weights + grads) + int(params) * optimizer
               + op.stash_bytes_per_sample * batch)


def _is_oom(e: BaseException) -> bool:
    """torch's out-of-memory errors, and cuBLAS's failure to allocate its workspace, which
    torch raises as a plain RuntimeError without the words 'out of memory'."""
    return (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(e)
            or "CUBLAS_STATUS_ALLOC_FAILED" in str(e))


def measure(
    spec: ModuleSpec, op: MetaOp, batch: int, strategy: str, *, target: Target,
    settings: Settings,
) -> Measurement:
    """Forward+backward of one layer at `batch` samples per group under `strategy`."""
    return _over_limit(op, batch, strategy, target=target, settings=settings) or _measured(
        spec, op, batch, strategy, target=target, settings=settings)


def _over_limit(op: MetaOp, batch: int, strategy: str, *, target: Target,
                settings: Settings) -> Measurement | None:
    """The infeasible point of a CPU layer whose estimated memory exceeds
    `settings.memory_limit_bytes` (the cluster's device memory), else None."""
    if target.device.type == "cuda" or settings.memory_limit_bytes is None:
        return None
    need = _estimate_bytes(op, batch, tp_degree(strategy), target.dtype_name)
    if need <= settings.memory_limit_bytes:
        return None
    return Measurement(
        feasible=False, time_ms=0.0, peak_memory_bytes=need,
        note=f"out of memory: needs about {need} of {settings.memory_limit_bytes} bytes (the "
             "layer whole: no ZeRO or recomputation)",
    )


def _measured(
    spec: ModuleSpec, op: MetaOp, batch: int, strategy: str, *, target: Target,
    settings: Settings,
) -> Measurement:
    """`measure` past the memory limit: run the layer (infeasible on out-of-memory)."""
    cuda = target.device.type == "cuda"
    try:
        return _run(spec, op, batch, strategy, target=target, settings=settings)
    except (RuntimeError, MemoryError) as e:
        if not _is_oom(e):
            raise
        if cuda:
            torch.cuda.empty_cache()
        return Measurement(feasible=False, time_ms=0.0, peak_memory_bytes=0,
                           note="out of memory")


def _run(
    spec: ModuleSpec, op: MetaOp, batch: int, strategy: str, *, target: Target,
    settings: Settings,
) -> Measurement:
    cuda = target.device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(target.device)
    layer = _layer(spec, strategy).to(target.device, target.dtype)
    params = list(layer.parameters())
    inputs = _inputs(spec, op, batch, target)
    out_grad: list[torch.Tensor] = []
    saved_bytes = 0

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal saved_bytes
        saved_bytes += x.numel() * x.element_size()
        return x

    def step(count_saved: bool = False) -> None:
        """One forward+backward as the executor runs it: the parameters' gradients are
        zeroed in place and accumulated into (its gradient buckets), the inputs' are new.
        With `count_saved`, the bytes autograd saves for backward are counted (a Python
        hook per saved tensor: kept out of the timed steps)."""
        nonlocal saved_bytes
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        for x in inputs:
            x.grad = None
        if count_saved:
            saved_bytes = 0
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                y = layer(*inputs)
        else:
            y = layer(*inputs)
        if y.dim() == 0:
            y.backward()
            return
        if not out_grad:
            out_grad.append(torch.ones_like(y))
        y.backward(out_grad[0])

    for i in range(settings.warmup + 1):
        start = time.perf_counter()
        step(count_saved=i == 0)
        if cuda:
            torch.cuda.synchronize(target.device)
        if time.perf_counter() - start > settings.timeout_s:
            return Measurement(
                feasible=False, time_ms=0.0, peak_memory_bytes=0,
                note=f"timed out: one iteration took over {settings.timeout_s:g} s",
            )
    time_ms = _median_ms(step, target, settings.repeats)
    num_params = sum(p.numel() for p in params)
    adam = _adam_bytes(num_params, target.dtype_name)
    if cuda:
        peak = torch.cuda.max_memory_allocated(target.device) + adam
    else:
        tensors = sum(p.numel() * p.element_size() for p in params) * 2
        tensors += sum(x.numel() * x.element_size() for x in inputs)
        peak = tensors + saved_bytes + adam
    return Measurement(feasible=True, time_ms=time_ms, peak_memory_bytes=peak)


def _median_ms(fn: Callable[[], None], target: Target, repeats: int) -> float:
    """Median time of `fn` over `repeats` calls: CUDA events on a GPU, perf_counter on the CPU."""
    times_ms = []
    for _ in range(repeats):
        if target.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize(target.device)
            times_ms.append(begin.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times_ms.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times_ms)


OPTIMIZER_SIZES = {"cpu": (1 << 14, 1 << 20), "cuda": (1 << 20, 1 << 26)}
"""Parameters of the two flat tensors the optimizer step is timed on, per device type: the
fixed cost per tensor is the intercept of the two times, the cost per parameter their slope."""


OPTIMIZER_MIN_REPEATS = 9
"""Fewest timed steps per optimizer size. The cost per parameter is the slope between two
medians: with `--repeats 1` on a loaded machine one late step of the small tensor made it
slower than the large one, and the slope (clamped at 0) said parameters cost nothing."""


def measure_optimizer(target: Target, settings: Settings) -> OptimizerCost:
    """The AdamW step as the executor runs it (`make_optimizer` over one flat tensor per
    gradient bucket; in bf16 on its fp32 master, `step_mixed`), timed on one tensor of each
    of OPTIMIZER_SIZES, each the median of `settings.repeats` steps and at least
    OPTIMIZER_MIN_REPEATS."""
    sizes = OPTIMIZER_SIZES[target.device.type]
    times = []
    for n in sizes:
        param = nn.Parameter(torch.zeros(n, dtype=target.dtype, device=target.device))
        param.grad = torch.full_like(param, 1e-3)
        if target.dtype.itemsize < 4:
            master = nn.Parameter(param.detach().float())
            optimizer = make_optimizer([master], lr=1e-3)

            def step(optimizer: torch.optim.Optimizer = optimizer,
                     pair: tuple[nn.Parameter, nn.Parameter] = (param, master)) -> None:
                step_mixed(optimizer, [pair])
        else:
            step = make_optimizer([param], lr=1e-3).step
        for _ in range(settings.warmup + 1):
            step()
        times.append(_median_ms(step, target, max(settings.repeats, OPTIMIZER_MIN_REPEATS)))
    slope = max(0.0, (times[1] - times[0]) / (sizes[1] - sizes[0]))
    return OptimizerCost(ms_per_tensor=max(0.0, times[0] - slope * sizes[0]),
                         ms_per_million_params=slope * 1e6)


def cached_optimizer(target: Target, settings: Settings, cache_dir: Path | None,
                     reuse: bool = True) -> OptimizerCost:
    """`measure_optimizer`, through the cache as `cached_measure` (keyed by the sizes timed as
    a point by its shape, `_entry_name`); an entry that holds no valid cost is timed again."""
    if cache_dir is None:
        return measure_optimizer(target, settings)
    path = cache_dir / _entry_name(
        {"optimizer": list(OPTIMIZER_SIZES[target.device.type]),
         "optimizer_repeats": max(settings.repeats, OPTIMIZER_MIN_REPEATS)},
        target=target, settings=settings, prefix="optimizer-")
    if reuse:
        try:
            return from_data(OptimizerCost, json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):  # unreadable, not JSON, or no valid cost (FieldError)
            pass
    cost = measure_optimizer(target, settings)
    _store(path, asdict(cost))
    return cost


def cache_key(op: MetaOp, n: int, batch: int, strategy: str, *, target: Target,
              settings: Settings) -> str:
    """The file name of a point in the cache."""
    return _entry_name({"signature": op.signature, "num_devices": n, "batch": batch,
                        "strategy": strategy}, target=target, settings=settings)


def _entry_name(what: dict[str, Any], *, target: Target, settings: Settings,
                prefix: str = "") -> str:
    """The file name of a cache entry for `what` was timed, how (repeats, warm-up, `METHOD`)
    and where (torch version, device, host processor, dtype)."""
    key = {**what, "repeats": settings.repeats, "warmup": settings.warmup,
           "torch": str(torch.__version__), "device": target.device_name,
           "processor": host_processor(), "dtype": target.dtype_name, "method": METHOD}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return f"{prefix}{digest[:32]}.json"


@functools.cache
def host_processor() -> str:
    """The host's CPU model ('model name' in /proc/cpuinfo, else `platform.processor()`): a
    CPU device is named by its threads alone (`local_target`), so a cache restored onto
    another machine (a CI runner) reused another CPU's timings; a GPU's small operators are
    timed by the host's kernel launches too."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _store(path: Path, data: dict[str, Any]) -> None:
    """Write a cache entry through a temp file of its own (two runs measuring the same point
    at once each write one). The CLI checks the cache can be written before it starts
    (`cli.profile._usable_cache`), so a failure here is the cache failing mid-run (the disk
    full): the entry is measured again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, sort_keys=True))
    except (OSError, ArtifactError):
        pass


def _cached(path: Path) -> Measurement | None:
    """The feasible measurement a cache entry holds; None where it is missing, cut short, of
    another layout or holds what no measurement gives (a time that is not a positive finite
    number of ms up to `MAX_MS`, a negative size): such an entry is simply measured again (it
    is a cache)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or set(data) != {f.name for f in fields(Measurement)}:
        return None
    time_ms, peak, note = data["time_ms"], data["peak_memory_bytes"], data["note"]
    if (data["feasible"] is not True or type(time_ms) not in (int, float)
            or not 0 < time_ms <= MAX_MS or type(peak) is not int or peak < 0
            or not isinstance(note, str)):
        return None
    return Measurement(feasible=True, time_ms=float(time_ms), peak_memory_bytes=peak, note=note)


def cached_measure(
    spec: ModuleSpec, op: MetaOp, n: int, batch: int, strategy: str, *, target: Target,
    settings: Settings, cache_dir: Path | None, reuse: bool = True,
) -> tuple[Measurement, bool]:
    """`measure`, through the cache when `cache_dir` is given; returns (result, from cache).
    Without `reuse` (`--no-cache`) the point is measured again and the cache takes the new
    result. The cache holds only what a run measured: the memory limit is the cluster's, so it
    is applied before the cache is read, and an infeasible run (out of memory, timed out)
    depends on the moment (other processes' memory, the machine's load), so it is not
    stored."""
    if cache_dir is None:
        return measure(spec, op, batch, strategy, target=target, settings=settings), False
    over = _over_limit(op, batch, strategy, target=target, settings=settings)
    if over is not None:
        return over, False
    path = cache_dir / cache_key(op, n, batch, strategy, target=target, settings=settings)
    cached = _cached(path) if reuse else None
    if cached is not None:
        return cached, True
    result = _measured(spec, op, batch, strategy, target=target, settings=settings)
    if not result.feasible:
        if not reuse:  # measured again: what the entry held is no longer this point's
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        return result, False
    _store(path, asdict(result))
    return result, False
