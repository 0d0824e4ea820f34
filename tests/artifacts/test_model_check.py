"""Model rules beyond field types (`artifacts.model_check`): step order, names, data items."""

from __future__ import annotations

from typing import Any

import pytest

from spindle_cli.artifacts import ModelSpec
from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.model_check import topo_steps
from spindle_cli.errors import ArtifactError


def test_a_long_chain_listed_consumer_first_is_ordered(small_model_data: dict[str, Any]):
    # 3000 steps sharing one encoder, each reading the one before, listed last to first: a
    # recursive order ran out of stack near 1000 (an internal error on a valid model)
    task = small_model_data["tasks"][0]
    steps = {s["name"]: s for s in task["steps"]}
    chain = [{"name": f"enc{i}", "module": "text_enc",
              "inputs": ["text_embed" if i == 0 else f"enc{i - 1}"]} for i in range(3000)]
    steps["text_proj"]["inputs"] = ["enc2999"]
    task["steps"] = [steps["loss"], steps["text_proj"], *reversed(chain),
                     *(s for n, s in steps.items() if n not in ("loss", "text_proj", "text_enc"))]
    model = parse_artifact(small_model_data, "deep.yaml", ModelSpec)
    order = topo_steps(model.tasks[0], "tasks[0]")
    assert sorted(order) == sorted(s.name for s in model.tasks[0].steps)
    at = {name: i for i, name in enumerate(order)}
    for s in model.tasks[0].steps:
        assert all(at[i] < at[s.name] for i in s.inputs if i in at)


def test_an_input_named_as_an_lm_loss_targets_item_is_refused():
    # the run's data has one item per input and `S:targets` per lm_loss step S: the two were
    # one item, so the run failed on batch shapes after validate, graph, plan and a dry run
    data = {
        "kind": "model", "version": 1, "name": "colon",
        "modules": {
            "emb": {"kind": "embedding", "hidden": 32, "vocab_size": 50, "max_seq_len": 32},
            "enc": {"kind": "transformer_encoder", "num_layers": 1, "hidden": 32, "heads": 4,
                    "ffn": 64},
            "head": {"kind": "lm_loss", "hidden": 32, "vocab_size": 64, "target_len": 4},
        },
        "tasks": [{"name": "t", "batch_size": 8, "inputs": {"l:targets": {"seq_len": 8}},
                   "steps": [{"name": "e", "module": "emb", "inputs": ["l:targets"]},
                             {"name": "x", "module": "enc", "inputs": ["e"]},
                             {"name": "l", "module": "head", "inputs": ["x"]}]}],
    }
    with pytest.raises(ArtifactError) as e:
        parse_artifact(data, "colon.yaml", ModelSpec)
    assert str(e.value) == ("colon.yaml: tasks[0].inputs.l:targets: names the data item of the "
                            "targets of lm_loss step 'l': rename the input")
    data["tasks"][0]["inputs"] = {"tokens": {"seq_len": 8}}
    data["tasks"][0]["steps"][0]["inputs"] = ["tokens"]
    assert parse_artifact(data, "colon.yaml", ModelSpec).name == "colon"


@pytest.mark.parametrize("name", ["caption\u00a0v2", "a\u200db"])
def test_a_task_name_may_hold_a_no_break_space_or_a_joiner(small_model_data, name):
    # as every other name: only blank names, control characters and line breaks are refused
    small_model_data["tasks"][0]["name"] = name
    small_model_data.pop("task_sets")
    assert parse_artifact(small_model_data, "m.yaml", ModelSpec).tasks[0].name == name


@pytest.mark.parametrize("text", ["first line\nsecond line", "folded\n", "a\vb", "a\x85b"])
def test_a_description_is_one_line(small_model_data, text):
    small_model_data["description"] = text
    with pytest.raises(ArtifactError) as e:
        parse_artifact(small_model_data, "m.yaml", ModelSpec)
    # a YAML block's final line break is named as such
    assert str(e.value) == ("m.yaml: description: must be one line (YAML's > and | blocks "
                            "keep a final line break, >- does not)" if text == "folded\n" else
                            f"m.yaml: description: {text!r}: must not hold line breaks or "
                            "control characters")
