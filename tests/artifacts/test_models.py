"""The shipped model zoo: every model loads, has the size the paper gives, and has the task
structure the evaluation relies on (task sets, the Fig. 4 pairing, losses, shared encoders)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from spindle_cli.artifacts import ClusterSpec, ModelSpec, load
from spindle_cli.artifacts.model import TaskSpec
from spindle_cli.artifacts.model_check import LOSS_KINDS, infer_shapes
from spindle_cli.planner.costs import layer_cost, module_params

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "models").glob("*.yaml"))

# Parameter totals: Table 1 of the paper for the three evaluated models, and the sizes the
# 256-GPU study names for the larger QWen-VAL variants; each within +-5%.
PARAM_BANDS = {
    "multitask-clip": 1.20e9,
    "ofasys": 0.66e9,
    "qwen-val": 9.25e9,
    "qwen-val-30b": 30e9,
    "qwen-val-70b": 70e9,
}
TOLERANCE = 0.05

# The data-parallel degree every task's global batch must split over evenly: the device counts
# the paper studies the encoder models on (up to 32), and for the LLM models the data-parallel
# groups left once the LLM, whose data-parallel replica does not fit one device, runs tensor
# parallel (64 GPUs / TP 2, 256 GPUs / TP 8); tiny-clip runs on up to 8 CPU ranks.
DATA_PARALLEL = {
    "multitask-clip": 32,
    "ofasys": 32,
    "qwen-val": 32,
    "qwen-val-30b": 32,
    "qwen-val-70b": 32,
    "tiny-clip": 8,
}


@cache
def _model(name: str) -> ModelSpec:
    return load(str(REPO / "models" / f"{name}.yaml"), ModelSpec)


def _total_params(model: ModelSpec) -> int:
    return sum(module_params(m) for m in model.modules.values())


def _encoders(model: ModelSpec, task: TaskSpec) -> set[str]:
    """Names of the transformer_encoder modules a task runs (one per modality in the CLIPs)."""
    return {
        s.module for s in task.steps if model.modules[s.module].kind == "transformer_encoder"
    }


def test_the_zoo_is_complete():
    assert {p.stem for p in SHIPPED} >= set(PARAM_BANDS) | {"tiny-clip"}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_model_loads_and_is_named_after_its_file(path):
    model = load(str(path), ModelSpec)
    assert model.name == path.stem
    assert model.description


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_model_file_starts_with_its_sources(path):
    lines = path.read_text(encoding="utf-8").splitlines()
    header = [line for line in lines[: lines.index("kind: model")] if line.startswith("#")]
    assert lines[0].startswith(f"# {path.stem}:")
    assert len(header) >= 5, "the header comment should cite where the dimensions come from"


@pytest.mark.parametrize("name", sorted(PARAM_BANDS))
def test_parameter_totals_match_the_paper(name):
    total = _total_params(_model(name))
    target = PARAM_BANDS[name]
    assert abs(total - target) <= TOLERANCE * target, f"{name}: {total / 1e9:.3f}B"


def test_tiny_clip_is_tiny():
    assert _total_params(_model("tiny-clip")) < 200_000


@pytest.mark.parametrize("name", sorted(DATA_PARALLEL))
def test_batches_split_evenly_over_the_studied_device_counts(name):
    model = _model(name)
    for task in model.tasks:
        assert task.batch_size % DATA_PARALLEL[name] == 0, task.name


@pytest.mark.parametrize("name", sorted(PARAM_BANDS))
def test_tasks_have_different_workloads(name):
    model = _model(name)
    batches = {t.batch_size for t in model.tasks}
    lengths = {tuple(sorted((k, i.seq_len) for k, i in t.inputs.items())) for t in model.tasks}
    assert len(batches) > 1
    assert len(lengths) == len(model.tasks)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_task_ends_in_a_loss(path):
    model = load(str(path), ModelSpec)
    for task in model.tasks:
        consumed = {i for s in task.steps for i in s.inputs}
        sinks = [s for s in task.steps if s.name not in consumed]
        assert sinks, task.name
        assert all(model.modules[s.module].kind in LOSS_KINDS for s in sinks), task.name


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_task_sets_name_existing_tasks(path):
    model = load(str(path), ModelSpec)
    names = [t.name for t in model.tasks]
    for members in model.task_sets.values():
        assert set(members) <= set(names)
        assert len(set(members)) == len(members)


@pytest.mark.parametrize(("name", "tasks", "sets"), [
    ("multitask-clip", 10, {"4": 4, "7": 7}),
    ("ofasys", 7, {"4": 4}),
    ("qwen-val", 3, {}),
])
def test_task_counts_and_subsets_match_the_evaluation(name, tasks, sets):
    model = _model(name)
    assert len(model.tasks) == tasks
    for set_name, size in sets.items():
        assert len(model.task_sets[set_name]) == size


def test_clip_subsets_are_nested():
    sets = _model("multitask-clip").task_sets
    assert set(sets["4"]) < set(sets["7"]) < {t.name for t in _model("multitask-clip").tasks}


def test_clip_four_task_set_is_the_fig4_pairing():
    model = _model("multitask-clip")
    pairs = [_encoders(model, model.task(t)) for t in model.task_sets["4"]]
    assert pairs == [
        {"text_enc", "audio_enc"},
        {"vision_enc", "depth_enc"},
        {"audio_enc", "thermal_enc"},
        {"motion_enc", "thermal_enc"},
    ]


def test_clip_tasks_contrast_two_modalities_in_a_shared_space():
    model = _model("multitask-clip")
    modalities = {"text", "vision", "audio", "depth", "thermal", "motion"}
    assert {e.removesuffix("_enc") for t in model.tasks for e in _encoders(model, t)} == modalities
    widths = {m.hidden for m in model.modules.values() if m.kind == "projection"}
    assert widths == {model.modules["contrastive"].hidden}
    for task in model.tasks:
        assert len(_encoders(model, task)) == 2, task.name
        assert [model.modules[s.module].kind for s in task.steps].count("contrastive_loss") == 1


def test_ofasys_runs_every_task_through_the_shared_encoder_decoder_lm():
    model = _model("ofasys")
    for task in model.tasks:
        used = {s.module for s in task.steps}
        assert {"text_embed", "lm_encoder", "lm_decoder", "lm_head"} <= used, task.name
    # Six modalities: five adapted feature inputs, plus text (token ids) in every task.
    features = {n for t in model.tasks for n, i in t.inputs.items() if i.dim}
    assert features == {"image", "box", "video", "audio", "motion"}
    assert all(any(i.dim == 0 for i in t.inputs.values()) for t in model.tasks)


def test_ofasys_decoder_reads_encoder_output_and_target_concatenated():
    model = _model("ofasys")
    for task in model.tasks:
        shapes = infer_shapes(model, task)
        assert shapes["lm_decoder"].seq == shapes["lm_encoder"].seq + task.inputs["target"].seq_len


def test_qwen_variants_share_encoders_and_grow_the_llm():
    base = _model("qwen-val")
    encoder_kinds = ("patch_embed", "transformer_encoder")
    encoders = {k: m for k, m in base.modules.items() if m.kind in encoder_kinds}
    assert set(encoders) == {"vision_patch", "vision_vit", "audio_stem", "audio_enc"}
    llm_params = module_params(base.modules["llm"])
    for name in ("qwen-val-30b", "qwen-val-70b"):
        big = _model(name)
        assert {k: m for k, m in big.modules.items() if m.kind in encoder_kinds} == encoders
        assert [t.name for t in big.tasks] == [t.name for t in base.tasks]
        assert module_params(big.modules["llm"]) > 3 * llm_params
    # The LLM is the largest module, as the paper describes QWen-VAL's cross-modal module.
    assert max(base.modules, key=lambda k: module_params(base.modules[k])) == "llm"


def test_tiny_clip_tasks_share_encoders_at_different_lengths():
    model = _model("tiny-clip")
    assert 3 <= len(model.tasks) <= 4
    assert {t.batch_size for t in model.tasks} == {8}
    seqs: dict[str, set[int]] = {}
    for task in model.tasks:
        shapes = infer_shapes(model, task)
        for step in task.steps:
            if model.modules[step.module].kind == "transformer_encoder":
                seqs.setdefault(step.module, set()).add(shapes[step.name].seq)
    users = {enc: sum(enc in _encoders(model, t) for t in model.tasks) for enc in seqs}
    assert set(users) == {"text_enc", "vision_enc", "audio_enc"}
    assert all(n >= 2 for n in users.values()), users
    assert any(len(lengths) > 1 for lengths in seqs.values()), seqs


@pytest.mark.parametrize(("name", "task_set"), [("multitask-clip", "10"), ("ofasys", "7")])
def test_largest_task_set_fits_the_smallest_paper_cluster(name, task_set):
    """The wavefront keeps every forward activation until the backward pass, so all tasks'
    stashes (bf16) must fit together in the 8 A800s the paper's smallest runs use, with room
    to spare for parameters, optimizer state and uneven placement."""
    model = _model(name)
    cluster = load(str(REPO / "clusters" / "a800-1x8.yaml"), ClusterSpec)
    stash_bytes = 0.0
    for task in (model.task(t) for t in model.task_sets[task_set]):
        shapes = infer_shapes(model, task)
        for step in task.steps:
            module = model.modules[step.module]
            ins = [shapes[i] for i in step.inputs]
            cost = layer_cost(module, task.batch_size, sum(s.seq for s in ins), ins[0].width)
            stash_bytes += 2 * cost.stash_elems_per_sample * module.num_layers * task.batch_size
    assert stash_bytes < 0.5 * cluster.num_devices * cluster.device.memory_bytes
