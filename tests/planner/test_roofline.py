"""The analytic device models (planner/roofline.py): sane, positive, non-increasing times, and
the heterogeneity the paper's Fig. 4 shows (vision scales better than text)."""

from __future__ import annotations

import pytest

from spindle_cli.artifacts import MetaOpGraph, ModelSpec, load
from spindle_cli.planner import roofline
from spindle_cli.planner.graph import build_graph


@pytest.fixture(scope="module")
def clip_graph(request: pytest.FixtureRequest) -> MetaOpGraph:
    root = request.config.rootpath
    return build_graph(load(str(root / "models" / "multitask-clip.yaml"), ModelSpec))


def _time(op, n, strategy="dp", hardware="a800"):
    device = roofline.HARDWARE[hardware]
    batch = roofline.per_device_batch(op, n, strategy)
    assert batch is not None
    return roofline.operator_time_s(op, batch, strategy, device=device,
                                    links=roofline.links_for(device, None), dtype_bytes=2)


def _speedup(op, n):
    return _time(op, 1) / _time(op, n)


def test_times_are_positive_and_non_increasing_in_n(clip_graph):
    for op in clip_graph.metaops:
        times = [_time(op, n) for n in (1, 2, 4, 8, 16, 32, 64) if n <= op.batch_size]
        assert all(t > 0 for t in times), op.id
        assert all(a >= b for a, b in zip(times, times[1:], strict=False)), op.id


def test_vision_encoder_scales_better_than_text_encoder(clip_graph):
    vision = clip_graph.metaop("task5_vision_text/vision_enc")
    text = clip_graph.metaop("task5_vision_text/text_enc")
    assert vision.batch_size == text.batch_size
    for n in (8, 32, 64):
        assert _speedup(vision, n) > _speedup(text, n)
    # the gap is large (257 patches of width 1280 against 77 tokens of width 1024), and
    # nothing beats linear scaling
    assert _speedup(vision, 8) > 1.5 * _speedup(text, 8)
    assert _speedup(vision, 8) <= 8


def test_small_work_is_launch_bound(clip_graph):
    # one text embedding layer is a gather: the kernel launches dominate, so it barely scales
    embed = next(m for m in clip_graph.metaops if m.layer_kind == "embedding")
    assert _speedup(embed, 8) < 1.5
    floor = roofline.KERNELS_PER_LAYER["embedding"] * roofline.LAUNCH_S
    assert _time(embed, 8) >= floor


def test_faster_hardware_is_faster(clip_graph):
    op = clip_graph.metaop("task5_vision_text/vision_enc")
    assert _time(op, 1, hardware="h100") < _time(op, 1, hardware="a800")
    assert _time(op, 1, hardware="h200") <= _time(op, 1, hardware="h100")


def test_tensor_parallel_pays_all_reduces(clip_graph):
    op = clip_graph.metaop("task5_vision_text/vision_enc")
    device = roofline.HARDWARE["a800"]
    links = roofline.links_for(device, None)
    batch = 8
    dp = roofline.operator_time_s(op, batch, "dp", device=device, links=links, dtype_bytes=2)
    tp2 = roofline.operator_time_s(op, batch, "tp2", device=device, links=links, dtype_bytes=2)
    comm = 4 * roofline.allreduce_s(batch * op.out_seq_len * op.out_width * 2, 2, links)
    assert comm > 0
    assert tp2 > comm
    assert tp2 - comm < dp  # the sharded compute itself is cheaper than the whole layer


def test_strategies_and_batches(clip_graph):
    graph = clip_graph
    enc = graph.metaop("task5_vision_text/vision_enc")
    proj = graph.metaop("task5_vision_text/vision_proj")
    loss = graph.metaop("task5_vision_text/loss")
    assert roofline.strategies(enc, 8, 8) == ["dp", "tp2", "tp4", "tp8"]
    assert roofline.strategies(enc, 8, 4) == ["dp", "tp2", "tp4"]
    assert roofline.strategies(enc, 6, 8) == ["dp", "tp2"]
    # a degree must divide the island size: islands of 6 split into tp2 groups, not tp4
    assert roofline.strategies(enc, 8, 6) == ["dp", "tp2"]
    assert roofline.strategies(enc, 6, 3) == ["dp"]
    assert roofline.strategies(proj, 8, 8) == ["dp"]
    B = enc.batch_size
    assert roofline.per_device_batch(enc, 3, "dp") == -(-B // 3)
    assert roofline.per_device_batch(enc, 2 * B, "dp") is None
    assert roofline.per_device_batch(enc, 2 * B, "tp2") == 1
    # the contrastive loss runs on the whole gathered batch on every rank
    assert roofline.per_device_batch(loss, 16, "dp") == loss.batch_size


def test_memory_model_is_mixed_precision_adam(clip_graph):
    op = clip_graph.metaop("task5_vision_text/vision_enc")
    mem = roofline.memory_model(op, 2)
    assert mem.param_bytes == mem.grad_bytes == 2 * op.params_per_layer
    assert mem.optimizer_bytes == 12 * op.params_per_layer
    assert roofline.memory_model(op, 4).optimizer_bytes == 8 * op.params_per_layer
    one = roofline.peak_memory_bytes(op, 4, 1, 2)
    assert roofline.peak_memory_bytes(op, 4, 2, 2) < one
    assert roofline.peak_memory_bytes(op, 8, 1, 2) > one


def test_tensor_parallel_memory_reads_off_the_data_parallel_model(clip_graph):
    op = clip_graph.metaop("task5_vision_text/vision_enc")
    memory = roofline.memory_model(op, 2)
    static = memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes
    assert static == op.params_per_layer * 16  # bf16 weights and grads + fp32 Adam state
    for t in (1, 2, 4, 8):
        got = roofline.layer_memory_bytes(memory, 8, t)
        assert got == roofline.peak_memory_bytes(op, 8, t, 2)
        # weights split t ways; activations never below the replicated part
        acts = got - static / t
        assert acts == pytest.approx(memory.activation_bytes_per_sample * 8 * (
            roofline.REPLICATED_ACTIVATION_FRACTION
            + (1 - roofline.REPLICATED_ACTIVATION_FRACTION) / t), abs=1)
    assert roofline.layer_memory_bytes(memory, 8, 8) < roofline.layer_memory_bytes(memory, 8, 2)
