"""The optimizer-step cost of a profile (Profile.optimizer): its arithmetic, its validation, the
analytic model's dependence on memory bandwidth, and profiles written before it existed."""

from __future__ import annotations

from pathlib import Path

import pytest

from spindle_cli.artifacts import MetaOpGraph, Profile, load
from spindle_cli.artifacts.codec import to_data
from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.profile import OptimizerCost
from spindle_cli.errors import ArtifactError
from spindle_cli.planner.profiling import analytic_profile
from spindle_cli.planner.roofline import HARDWARE

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def graph() -> MetaOpGraph:
    return load(str(REPO / "graphs" / "tiny-clip.yaml"), MetaOpGraph)


def test_time_is_per_tensor_plus_per_parameter():
    cost = OptimizerCost(ms_per_tensor=0.5, ms_per_million_params=2.0)
    assert cost.time_ms(3, 2_500_000) == pytest.approx(3 * 0.5 + 2.5 * 2.0)
    assert cost.time_ms(2, 0) == 0.0


def test_analytic_cost_scales_with_memory_bandwidth(graph: MetaOpGraph):
    a800 = analytic_profile(graph, None, hardware="a800", counts=[1, 2]).optimizer
    h200 = analytic_profile(graph, None, hardware="h200", counts=[1, 2]).optimizer
    assert a800 is not None and h200 is not None
    bandwidth = {name: HARDWARE[name].memory_bandwidth_bytes_per_s for name in ("a800", "h200")}
    ratio = bandwidth["h200"] / bandwidth["a800"]
    assert a800.ms_per_million_params / h200.ms_per_million_params == pytest.approx(ratio)
    # memory-bound: a billion parameters take tens of milliseconds on an A800, not seconds
    assert 5 < a800.time_ms(1, 1e9) < 50


def test_a_profile_without_it_still_loads(graph: MetaOpGraph):
    data = to_data(analytic_profile(graph, None, hardware="a800", counts=[1, 2]))
    del data["optimizer"]
    assert parse_artifact(data, "old.yaml", Profile).optimizer is None


def test_a_negative_cost_names_the_field(graph: MetaOpGraph):
    data = to_data(analytic_profile(graph, None, hardware="a800", counts=[1, 2]))
    data["optimizer"]["ms_per_tensor"] = -1.0
    with pytest.raises(ArtifactError, match=r"bad\.yaml: optimizer\.ms_per_tensor: .*"):
        parse_artifact(data, "bad.yaml", Profile)
