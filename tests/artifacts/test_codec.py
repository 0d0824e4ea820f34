"""Canonical conversion between artifact dataclasses and plain data: round trips, determinism,
fixed float precision, numpy scalars, and field-path errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from spindle_cli.artifacts import ClusterSpec, ModelSpec, input_ref
from spindle_cli.artifacts.canonical import render
from spindle_cli.artifacts.codec import (
    FLOAT_DIGITS,
    canonical_float,
    from_data,
    json_schema,
    meta,
    to_data,
)
from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.errors import FieldError
from spindle_cli.planner.graph import build_graph


@pytest.fixture
def cluster(cluster_data) -> ClusterSpec:
    obj = parse_artifact(cluster_data, "<test>", ClusterSpec)
    assert isinstance(obj, ClusterSpec)
    return obj


def test_round_trip_model_graph_cluster(small_model, cluster):
    model = small_model
    graph = build_graph(model, inputs=[input_ref(model, "models/small.yaml")])
    for obj in (model, graph, cluster):
        again = from_data(type(obj), to_data(obj))
        assert again == obj
        assert to_data(again) == to_data(obj)


def test_yaml_and_json_give_the_same_content(small_model, cluster):
    model = small_model
    for obj in (model, cluster):
        from_yaml = yaml.safe_load(render(obj, "yaml"))
        from_json = json.loads(render(obj, "json"))
        assert from_yaml == from_json == to_data(obj)


def test_rendering_is_deterministic_and_keeps_field_order(small_model):
    model = small_model
    text = render(model, "yaml")
    assert text == render(model, "yaml")
    # field order of the dataclass, not alphabetical: kind and version come first
    assert list(yaml.safe_load(text))[:3] == ["kind", "version", "name"]
    # dict-valued fields are written with sorted keys whatever order the file used
    assert list(to_data(model)["modules"]) == sorted(model.modules)


def test_floats_are_written_at_fixed_precision():
    assert canonical_float(0.1 + 0.2) == 0.3
    assert canonical_float(1 / 3) == float("0." + "3" * FLOAT_DIGITS)
    assert str(canonical_float(-0.0)) == "0.0"
    with pytest.raises(ValueError, match="non-finite"):
        canonical_float(float("nan"))


def test_numpy_scalars_are_converted_to_plain_numbers(cluster):
    odd = dataclasses.replace(cluster, num_nodes=np.int64(2),
                              intra_island_bandwidth_bytes_per_s=np.float32(1e11))
    data = to_data(odd)
    assert type(data["num_nodes"]) is int
    assert type(data["intra_island_bandwidth_bytes_per_s"]) is float
    # both serializers reject raw numpy scalars, so this is what makes writing possible
    yaml.safe_dump(data)
    json.dumps(data)
    assert to_data(np.float64(2.5)) == 2.5 and type(to_data(np.float64(2.5))) is float


def test_errors_carry_the_full_field_path(small_model):
    model = small_model
    data = to_data(model)
    data["tasks"][0]["steps"][1]["module"] = "nowhere"
    with pytest.raises(FieldError) as e:
        from_data(ModelSpec, data)
    assert e.value.field == "tasks[0].steps[1].module"
    assert "unknown module 'nowhere'" in e.value.problem


@pytest.mark.parametrize(
    ("edit", "field", "problem"),
    [
        (lambda d: d["modules"]["text_enc"].update(heads="four"),
         "modules.text_enc.heads", "expected an integer, got a string"),
        (lambda d: d["modules"]["text_enc"].update(num_layers=True),
         "modules.text_enc.num_layers", "expected an integer, got a boolean"),
        (lambda d: d["modules"]["text_enc"].update(hidden=-32),
         "modules.text_enc.hidden", "must be >= 1"),
        (lambda d: d["tasks"][0].update(colour="red"), "tasks[0].colour", "unknown field"),
        (lambda d: d["tasks"][0].pop("batch_size"), "tasks[0].batch_size",
         "missing required field"),
        (lambda d: d["modules"]["text_proj"].update(pool="max"), "modules.text_proj.pool",
         "must be one of 'cls', 'mean'"),
        (lambda d: d.update(tasks={"a": 1}), "tasks", "expected a list, got a mapping"),
    ],
)
def test_type_and_bound_errors(small_model, edit, field, problem):
    model = small_model
    data = to_data(model)
    edit(data)
    with pytest.raises(FieldError) as e:
        from_data(ModelSpec, data)
    assert e.value.field == field
    assert problem in e.value.problem


def test_integers_are_accepted_for_float_fields(cluster_data):
    cluster_data["device"]["peak_flops"] = 10**14
    obj = from_data(ClusterSpec, cluster_data)
    assert type(obj.device.peak_flops) is float


def test_whole_numbers_are_accepted_for_integer_fields(cluster_data):
    cluster_data["device"]["memory_bytes"] = 8.0e10
    memory = from_data(ClusterSpec, cluster_data).device.memory_bytes
    assert memory == 80_000_000_000 and type(memory) is int
    # a fraction, and a float beyond 2**53 whose digits are not exact, stay errors
    for value in (2.5, 1e300):
        cluster_data["device"]["memory_bytes"] = value
        with pytest.raises(FieldError, match="expected an integer, got a number"):
            from_data(ClusterSpec, cluster_data)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Bounded:
    """A record with bounds on an optional number and on list items."""

    error: float | None = dataclasses.field(default=None, metadata=meta("an error", ge=0))
    counts: tuple[int, ...] = dataclasses.field(metadata=meta("device counts", ge=1))


def test_schema_bounds_match_the_loader_for_optional_and_list_fields():
    props = json_schema(_Bounded)["properties"]
    assert props["error"]["anyOf"][0] == {"type": "number", "minimum": 0}
    assert props["counts"]["items"] == {"type": "integer", "minimum": 1}
    assert "counts" in json_schema(_Bounded)["required"]
    with pytest.raises(FieldError, match="must be >= 0"):
        from_data(_Bounded, {"error": -1.0, "counts": [1]})
    with pytest.raises(FieldError, match="must be >= 1"):
        from_data(_Bounded, {"counts": [2, 0]})
    assert from_data(_Bounded, {"counts": [2]}).error is None


@pytest.mark.parametrize("counts, result", [
    ([], ()),
    ([1, 2, 2**63 - 1], (1, 2, 2**63 - 1)),
    ([1, 4.0], (1, 4)),
    ([1, True], "counts[1]: expected an integer, got a boolean"),
    ([1, 2**63], "counts[1]: expected a 64-bit integer, got one that needs 65 bits"),
    ([2**64, 1], "counts[0]: expected a 64-bit integer, got one that needs 66 bits"),
    ([1, "2"], "counts[1]: expected an integer, got a string"),
])
def test_integer_lists_are_checked_item_by_item(counts, result):
    # lists of plain integers (a plan's ranks) are taken whole; anything else names its item
    if isinstance(result, tuple):
        got = from_data(_Bounded, {"counts": counts}).counts
        assert got == result and all(type(v) is int for v in got)
    else:
        with pytest.raises(FieldError) as e:
            from_data(_Bounded, {"counts": counts})
        assert str(e.value) == result
