"""Measuring one operator with torch (runtime/measure.py): real timings, infeasible points
instead of crashes, the tensor-parallel shard, and the per-point cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from spindle_cli.artifacts import MetaOpGraph, ModelSpec, load
from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.planner.graph import build_graph
from spindle_cli.runtime import measure
from spindle_cli.runtime.layers import build_layer


@pytest.fixture(scope="module")
def tiny(request: pytest.FixtureRequest) -> tuple[ModelSpec, MetaOpGraph]:
    model = load(str(request.config.rootpath / "models" / "tiny-clip.yaml"), ModelSpec)
    return model, build_graph(model, tasks=["text_vision"])


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


FAST = measure.Settings(repeats=2, warmup=1)


def test_every_layer_kind_of_the_tiny_model_measures(tiny):
    model, graph = tiny
    target = measure.local_target()
    assert target.device.type in ("cpu", "cuda")
    kinds = set()
    for op in graph.metaops:
        m = measure.measure(model.modules[op.module], op, 4, "dp", target=target, settings=FAST)
        assert m.feasible and m.note == ""
        assert m.time_ms > 0
        assert m.peak_memory_bytes > 0
        kinds.add(op.layer_kind)
    assert kinds >= {"embedding", "patch_embed", "transformer_encoder", "projection",
                     "contrastive_loss"}


def test_more_samples_keep_more_activations(tiny):
    model, graph = tiny
    op = graph.metaop("text_vision/vision_enc")
    target = measure.local_target()
    spec = model.modules[op.module]
    small = measure.measure(spec, op, 1, "dp", target=target, settings=FAST)
    large = measure.measure(spec, op, 8, "dp", target=target, settings=FAST)
    assert large.peak_memory_bytes > small.peak_memory_bytes


def test_bf16_measures_a_mixed_precision_layer_and_step(tiny):
    """In bf16 a layer keeps half the activation bytes of fp32 and the same state bytes
    (2 + 2 + 12 against 4 + 4 + 8 per parameter); both losses measure (fp32 softmax from
    bf16 logits), and the optimizer step is the mixed one, on an fp32 master."""
    model, graph = tiny
    half, full = measure.local_target(dtype_name="bf16"), measure.local_target()
    assert (half.dtype, half.dtype_bytes) == (torch.bfloat16, 2)
    for op in graph.metaops:
        m = measure.measure(model.modules[op.module], op, 4, "dp", target=half, settings=FAST)
        assert m.feasible and m.time_ms > 0, op.id
    op = graph.metaop("text_vision/vision_enc")
    spec = model.modules[op.module]
    params = sum(p.numel() for p in build_layer(spec).parameters())
    small, large = (measure.measure(spec, op, 8, "dp", target=t, settings=FAST)
                    for t in (half, full))
    if half.device.type == "cpu":
        # counted: the parameters' state plus the inputs and saved activations, at dtype
        # size but for a few statistics autograd keeps in fp32 (LayerNorm's mean and rstd)
        acts = [m.peak_memory_bytes - 16 * params for m in (small, large)]
        assert 0 < 1.9 * acts[0] < acts[1] < 2 * acts[0]
    cost = measure.measure_optimizer(half, FAST)
    assert cost.ms_per_tensor >= 0 and cost.ms_per_million_params > 0


def test_timeouts_and_memory_limits_give_infeasible_points(tiny):
    model, graph = tiny
    op = graph.metaop("text_vision/vision_enc")
    spec = model.modules[op.module]
    target = measure.local_target()
    slow = measure.measure(spec, op, 4, "dp", target=target,
                           settings=measure.Settings(timeout_s=0.0))
    assert not slow.feasible and slow.note.startswith("timed out")
    if target.device.type == "cpu":
        full = measure.measure(spec, op, 4, "dp", target=target,
                               settings=measure.Settings(memory_limit_bytes=1000))
        assert not full.feasible and full.note.startswith("out of memory")


def test_an_oom_inside_torch_is_a_point_not_a_crash(tiny, monkeypatch):
    model, graph = tiny
    op = graph.metaop("text_vision/vision_enc")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(measure, "_run", oom)
    m = measure.measure(model.modules[op.module], op, 4, "dp", target=measure.local_target(),
                        settings=FAST)
    assert not m.feasible and m.note == "out of memory"

    def cublas(*args, **kwargs):
        # cuBLAS out of workspace memory: a RuntimeError that does not say 'out of memory'
        raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                           "`cublasCreate(handle)`")

    monkeypatch.setattr(measure, "_run", cublas)
    m = measure.measure(model.modules[op.module], op, 4, "dp", target=measure.local_target(),
                        settings=FAST)
    assert not m.feasible and m.note == "out of memory"

    def bug(*args, **kwargs):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(measure, "_run", bug)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure.measure(model.modules[op.module], op, 4, "dp", target=measure.local_target(),
                        settings=FAST)


def test_the_tensor_parallel_shard_holds_a_t_th_of_the_matrices(make_model):
    model = make_model(
        {"enc": {"kind": "transformer_encoder", "hidden": 64, "heads": 4, "ffn": 256},
         "embed": {"kind": "embedding", "hidden": 64, "vocab_size": 50, "max_seq_len": 8},
         "proj": {"kind": "projection", "in_dim": 64, "hidden": 16},
         "loss": {"kind": "contrastive_loss", "hidden": 16}},
        [{"name": "t", "batch_size": 4, "inputs": {"a": {"seq_len": 8}, "b": {"seq_len": 8}},
          "steps": [{"name": "ea", "module": "embed", "inputs": ["a"]},
                    {"name": "xa", "module": "enc", "inputs": ["ea"]},
                    {"name": "pa", "module": "proj", "inputs": ["xa"]},
                    {"name": "eb", "module": "embed", "inputs": ["b"]},
                    {"name": "pb", "module": "proj", "inputs": ["eb"]},
                    {"name": "l", "module": "loss", "inputs": ["pa", "pb"]}]}],
    )
    spec = model.modules["enc"]
    full = build_layer(spec)
    shard = measure.ShardedTransformerLayer(spec, 2, causal=False)
    weights = ("qkv", "out", "fc1", "fc2")
    for name in weights:
        assert getattr(shard, name).weight.numel() * 2 == getattr(full, name).weight.numel()
    x = torch.randn(2, 8, 64)
    assert shard(x).shape == full(x).shape
    assert measure.can_shard(spec, 2) and measure.can_shard(spec, 4)
    assert not measure.can_shard(spec, 8)
    assert not measure.can_shard(model.modules["proj"], 2)
    graph = build_graph(model)
    op = graph.metaop("t/xa")
    m = measure.measure(spec, op, 4, "tp2", target=measure.local_target(), settings=FAST)
    assert m.feasible and m.time_ms > 0


@pytest.fixture
def calls(monkeypatch) -> list[tuple[int, str]]:
    """(batch, strategy) of every layer actually run (`measure._measured`), not answered by
    the cache or refused by the memory limit."""
    seen: list[tuple[int, str]] = []
    real = measure._measured

    def counted(*args, **kwargs):
        seen.append(args[2:4])
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "_measured", counted)
    return seen


def test_the_cache_answers_the_second_time(tiny, tmp_path: Path, calls):
    model, graph = tiny
    op = graph.metaop("text_vision/text_enc")
    spec = model.modules[op.module]
    target = measure.local_target()
    first, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                        cache_dir=tmp_path)
    assert not hit and calls == [(4, "dp")]
    again, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                        cache_dir=tmp_path)
    assert hit and again == first and len(calls) == 1
    # another count, strategy or repeat setting is another point
    measure.cached_measure(spec, op, 4, 2, "dp", target=target, settings=FAST,
                           cache_dir=tmp_path)
    measure.cached_measure(spec, op, 2, 4, "dp", target=target,
                           settings=measure.Settings(repeats=3, warmup=1), cache_dir=tmp_path)
    assert len(calls) == 3
    # a damaged entry is measured again, not trusted
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")
    _, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                    cache_dir=tmp_path)
    assert not hit and len(calls) == 4
    _, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                    cache_dir=None)
    assert not hit and len(calls) == 5


def _point(tiny, cache_dir: Path, **kwargs):
    """text_vision's text encoder on 2 devices (batch 4, dp) through the cache in `cache_dir`:
    (measurement, from cache)."""
    model, graph = tiny
    op = graph.metaop("text_vision/text_enc")
    return measure.cached_measure(model.modules[op.module], op, 2, 4, "dp",
                                  target=measure.local_target(), settings=FAST,
                                  cache_dir=cache_dir, **kwargs)


@pytest.mark.parametrize("entry", [{"time_ms": "abc"}, {"time_ms": -5.0}, {"time_ms": 0.0},
                                   {"time_ms": 1e308}, {"feasible": "yes"},
                                   {"peak_memory_bytes": -1}, {"peak_memory_bytes": 1.5},
                                   {"extra": 1}])
def test_a_cache_entry_no_measurement_gives_is_measured_again(tiny, tmp_path: Path, calls,
                                                              entry):
    # such entries ended in an internal error, or in an error blaming the graph's sizes
    _point(tiny, tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), **entry}))
    again, hit = _point(tiny, tmp_path)
    assert not hit and again.feasible and again.time_ms > 0 and len(calls) == 2
    # and the entry is whole again
    _, hit = _point(tiny, tmp_path)
    assert hit and len(calls) == 2


def test_measuring_again_refreshes_the_cache(tiny, tmp_path: Path, calls):
    # --no-cache measured again but left the old entry, which the next run read
    _point(tiny, tmp_path)
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "time_ms": 12345.0}))
    fresh, hit = _point(tiny, tmp_path, reuse=False)
    assert not hit and len(calls) == 2
    again, hit = _point(tiny, tmp_path)
    assert hit and again == fresh and again.time_ms != 12345.0


def test_measuring_again_to_no_result_drops_the_old_entry(tiny, tmp_path: Path, monkeypatch):
    # --no-cache that now runs out of memory or time left the old feasible entry, which the
    # next run read as this point's
    _point(tiny, tmp_path)
    assert list(tmp_path.glob("*.json"))
    monkeypatch.setattr(measure, "_measured", lambda *a, **k: measure.Measurement(
        feasible=False, time_ms=0.0, peak_memory_bytes=0, note="timed out"))
    again, hit = _point(tiny, tmp_path, reuse=False)
    assert not hit and not again.feasible
    assert not list(tmp_path.glob("*.json"))


def test_the_cache_tells_one_host_processor_from_another(tiny, monkeypatch):
    """A CPU device is named by its threads alone: a cache restored onto a runner with
    another CPU reused the old one's timings."""
    _, graph = tiny
    op, target = graph.metaop("text_vision/text_enc"), measure.local_target()
    here = measure.cache_key(op, 2, 4, "dp", target=target, settings=FAST)
    assert measure.host_processor()
    monkeypatch.setattr(measure, "host_processor", lambda: "another CPU")
    assert measure.cache_key(op, 2, 4, "dp", target=target, settings=FAST) != here


def test_the_cache_takes_its_own_temp_file_and_is_skipped_when_unwritable(tiny,
                                                                          tmp_path: Path,
                                                                          calls):
    model, graph = tiny
    op = graph.metaop("text_vision/text_enc")
    spec, target = model.modules[op.module], measure.local_target()
    key = measure.cache_key(op, 2, 4, "dp", target=target, settings=FAST)
    # another run's temp file of the same point in the way (a fixed temp name was shared)
    (tmp_path / key).with_suffix(".tmp").mkdir()
    measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                           cache_dir=tmp_path)
    _, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                    cache_dir=tmp_path)
    assert hit and len(calls) == 1
    # a cache that cannot be made is measured past, not an internal error
    (tmp_path / "file").write_text("x")
    for _ in range(2):
        m, hit = measure.cached_measure(spec, op, 2, 4, "dp", target=target, settings=FAST,
                                        cache_dir=tmp_path / "file")
        assert m.feasible and not hit
    assert len(calls) == 3


def test_decoder_adapter_and_lm_loss_measure(make_model):
    model = make_model(
        {"embed": {"kind": "embedding", "hidden": 32, "vocab_size": 50, "max_seq_len": 16},
         "patch": {"kind": "patch_embed", "in_dim": 12, "hidden": 24, "max_seq_len": 8},
         "adapt": {"kind": "adapter", "in_dim": 24, "hidden": 32},
         "llm": {"kind": "transformer_decoder", "num_layers": 2, "hidden": 32, "heads": 4,
                 "ffn": 64},
         "head": {"kind": "lm_loss", "hidden": 32, "vocab_size": 50, "target_len": 4}},
        [{"name": "cap", "batch_size": 4,
          "inputs": {"img": {"seq_len": 8, "dim": 12}, "txt": {"seq_len": 8}},
          "steps": [{"name": "p", "module": "patch", "inputs": ["img"]},
                    {"name": "a", "module": "adapt", "inputs": ["p"]},
                    {"name": "e", "module": "embed", "inputs": ["txt"]},
                    {"name": "d", "module": "llm", "inputs": ["a", "e"]},
                    {"name": "l", "module": "head", "inputs": ["d"]}]}],
    )
    graph = build_graph(model)
    target = measure.local_target()
    for op in graph.metaops:
        m = measure.measure(model.modules[op.module], op, 2, "dp", target=target, settings=FAST)
        assert m.feasible and m.time_ms > 0, op.id
    decoder = graph.metaop("cap/d")
    assert decoder.seq_len == 16  # the two inputs are concatenated along the sequence
    m = measure.measure(model.modules["llm"], decoder, 2, "tp2", target=target, settings=FAST)
    assert m.feasible


def test_the_optimizer_step_is_timed_as_the_executor_runs_it():
    """AdamW over one flat tensor: a fixed cost per tensor plus a cost per parameter, so a
    step over the larger timed size takes several times one over the smaller."""
    cost = measure.measure_optimizer(measure.local_target(), measure.Settings(repeats=5))
    small, large = measure.OPTIMIZER_SIZES["cpu"]
    assert cost.ms_per_tensor >= 0 and cost.ms_per_million_params > 0
    assert cost.time_ms(1, large) > 2 * cost.time_ms(1, small)
    assert cost.time_ms(3, 0) == 0.0


def test_the_optimizer_step_is_cached_as_the_points_are(tmp_path: Path, monkeypatch):
    """Timed at every run, it made two profiles of the same cached points differ (a review:
    2.58 against 1.25 ms per million parameters), and the plans' simulated iterations."""
    timed = []
    costs = iter([OptimizerCost(ms_per_tensor=0.1, ms_per_million_params=2.5),
                  OptimizerCost(ms_per_tensor=0.2, ms_per_million_params=1.25),
                  OptimizerCost(ms_per_tensor=0.3, ms_per_million_params=1.0)])

    def timing(target, settings):
        timed.append(settings.repeats)
        return next(costs)

    monkeypatch.setattr(measure, "measure_optimizer", timing)
    target = measure.local_target()
    first = measure.cached_optimizer(target, FAST, tmp_path)
    assert measure.cached_optimizer(target, FAST, tmp_path) == first and len(timed) == 1
    # --no-cache times it again, and the cache takes the new cost
    again = measure.cached_optimizer(target, FAST, tmp_path, reuse=False)
    assert again != first and measure.cached_optimizer(target, FAST, tmp_path) == again
    # an entry that holds no valid cost is timed again, not trusted
    (entry,) = tmp_path.glob("optimizer-*.json")
    entry.write_text('{"ms_per_tensor": -1.0, "ms_per_million_params": 2.0}')
    assert measure.cached_optimizer(target, FAST, tmp_path).ms_per_tensor == 0.3
    assert len(timed) == 3


def test_the_optimizer_step_is_timed_enough_times_for_its_slope(monkeypatch):
    # its cost per parameter is the slope between two medians, which one late step under
    # --repeats 1 could make 0
    repeats = []
    real = measure._median_ms

    def counted(fn, target, n):
        repeats.append(n)
        return real(fn, target, n)

    monkeypatch.setattr(measure, "_median_ms", counted)
    measure.measure_optimizer(measure.local_target(), measure.Settings(repeats=1))
    assert repeats == [measure.OPTIMIZER_MIN_REPEATS] * 2
    repeats.clear()
    measure.measure_optimizer(measure.local_target(), measure.Settings(repeats=20))
    assert repeats == [20, 20]


def test_timed_steps_run_as_the_executor_does(tiny, monkeypatch):
    # the saved-tensor hook that counts activation bytes runs once, untimed; the timed steps
    # accumulate into the same gradient tensors, zeroed in place, as the executor's buckets
    model, graph = tiny
    op = graph.metaop("text_vision/text_enc")
    hooks = []
    real_hooks = torch.autograd.graph.saved_tensors_hooks

    def counting(*args):
        hooks.append(1)
        return real_hooks(*args)

    layers = []
    real_layer = measure._layer

    def keep(*args):
        layers.append(real_layer(*args))
        return layers[-1]

    seen: list[tuple[int, ...]] = []
    real_median = measure._median_ms

    def timed(fn, target, repeats):
        def step():
            fn()
            seen.append(tuple(id(p.grad) for p in layers[0].parameters()))
        return real_median(step, target, repeats)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counting)
    monkeypatch.setattr(measure, "_layer", keep)
    monkeypatch.setattr(measure, "_median_ms", timed)
    m = measure.measure(model.modules[op.module], op, 4, "dp", target=measure.local_target(),
                        settings=measure.Settings(repeats=5, warmup=2))
    assert m.feasible and m.peak_memory_bytes > 0
    assert len(hooks) == 1
    assert len(seen) == 5 and len(set(seen)) == 1
    assert all(p.grad is not None for p in layers[0].parameters())


def test_the_cache_keeps_neither_a_memory_verdict_nor_a_failed_run(tiny, tmp_path: Path,
                                                                  calls, monkeypatch):
    """The memory limit is the cluster's, not the point's: a point measured for a large device
    answers from the cache for a small one only after the small one's limit is applied, and a
    point over a small device's limit is measured for a large one. A run that failed (out of
    memory, timed out) is not kept: it depends on the moment."""
    model, graph = tiny
    op = graph.metaop("text_vision/vision_enc")
    spec = model.modules[op.module]
    target = measure.local_target()
    small = measure.Settings(repeats=2, warmup=1, memory_limit_bytes=1000)
    large = measure.Settings(repeats=2, warmup=1, memory_limit_bytes=1 << 32)

    def point(settings: measure.Settings) -> tuple[measure.Measurement, bool]:
        return measure.cached_measure(spec, op, 1, 4, "dp", target=target, settings=settings,
                                      cache_dir=tmp_path)

    refused, hit = point(small)
    assert not refused.feasible and "out of memory" in refused.note and not hit and not calls
    fits, hit = point(large)
    assert fits.feasible and not hit and len(calls) == 1
    refused, hit = point(small)
    assert not refused.feasible and not hit
    again, hit = point(large)
    assert hit and again == fits and len(calls) == 1

    failed = measure.Measurement(feasible=False, time_ms=0.0, peak_memory_bytes=0,
                                 note="timed out: one iteration took over 10 s")
    monkeypatch.setattr(measure, "_measured", lambda *args, **kwargs: failed)
    for f in tmp_path.glob("*.json"):
        f.unlink()
    assert point(large) == (failed, False)
    assert not list(tmp_path.glob("*.json"))
