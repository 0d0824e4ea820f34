"""Artifacts that are well typed but absurd or inconsistent, which used to pass validation and
then hang or crash the planner, the simulator or the runtime: each is now refused on load
with `<file>: <field>: <problem>`, while every value the shipped files, the planner tests and
the benchmarks use stays legal."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spindle_cli.artifacts import ClusterSpec, MetaOpGraph, ModelSpec, Plan, Profile
from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.io import parse_artifact
from spindle_cli.artifacts.parsing import read_data
from spindle_cli.errors import ArtifactError

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "data" / "plan-tiny-clip-local-cpu"
WORKED = REPO / "tests" / "data" / "plan-worked-example"

Data = dict[str, Any]
Edit = Callable[[Data], None]

DEVICES_WHY = "about a million; the largest training clusters have ~10**5 devices"
LAYERS_WHY = "the deepest real models have a few hundred layers per module"
BANDWIDTH_WHY = "10 PB/s; the fastest links and device memories move ~10**12-10**13 B/s"
HUGE = 10**30


def _check(cls: type[Artifact], data: Data, edit: Edit, expected: str) -> None:
    """`data` loads; after `edit` it fails with exactly `x.yaml: <expected>`."""
    parse_artifact(data, "x.yaml", cls)
    bad = copy.deepcopy(data)
    edit(bad)
    with pytest.raises(ArtifactError) as e:
        parse_artifact(bad, "x.yaml", cls)
    assert str(e.value) == f"x.yaml: {expected}"


def _legal(cls: type[Artifact], data: Data, edit: Edit) -> None:
    good = copy.deepcopy(data)
    edit(good)
    parse_artifact(good, "x.yaml", cls)


def _set(path: str, value: Any) -> Edit:
    """An edit setting the value at a dotted path with list indices (`memory.0.rank`)."""
    *parents, last = path.split(".")

    def edit(data: Data) -> None:
        node: Any = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


# --- cluster -----------------------------------------------------------------------------

CLUSTER_CASES: dict[str, tuple[Edit, str]] = {
    "nodes-huge": (_set("num_nodes", HUGE),
                   f"num_nodes: must be <= 1048576, got {HUGE} ({DEVICES_WHY})"),
    "devices-per-node-huge": (_set("devices_per_node", HUGE),
                              f"devices_per_node: must be <= 1048576, got {HUGE} "
                              f"({DEVICES_WHY})"),
    "too-many-devices": (lambda d: d.update(num_nodes=2048, devices_per_node=1024),
                         "num_nodes: 2048 nodes x 1024 devices is 2097152 devices, more than "
                         f"1048576 ({DEVICES_WHY})"),
    "bandwidth-half-a-byte": (_set("intra_island_bandwidth_bytes_per_s", 0.5),
                              "intra_island_bandwidth_bytes_per_s: must be >= 1000000.0, got 0.5 "
                              "(1 MB/s; every real interconnect is at least 1000x faster)"),
    "bandwidth-tiny": (_set("inter_node_bandwidth_bytes_per_s", 1e-300),
                       "inter_node_bandwidth_bytes_per_s: must be >= 1000000.0, got 1e-300 "
                       "(1 MB/s; every real interconnect is at least 1000x faster)"),
    "peak-flops-tiny": (_set("device.peak_flops", 1e-300),
                        "device.peak_flops: must be >= 1000000.0, got 1e-300 (1 MFLOP/s; one "
                        "CPU core does over 10**9)"),
    "memory-bandwidth-tiny": (_set("device.memory_bandwidth_bytes_per_s", 1e-300),
                              "device.memory_bandwidth_bytes_per_s: must be >= 1000000.0, got "
                              "1e-300 (1 MB/s; a device's own memory is over 10**4x faster)"),
    **{f"{field}-huge": (_set(field, value), f"{field}: must be <= 1e+16, got {value!r} "
                                             f"({BANDWIDTH_WHY})")
       for field, value in (("inter_node_bandwidth_bytes_per_s", 1e308),
                            ("intra_island_bandwidth_bytes_per_s", 1e17),
                            ("device.memory_bandwidth_bytes_per_s", 1e308))},
    "peak-flops-huge": (_set("device.peak_flops", 1e308),
                        "device.peak_flops: must be <= 1e+18, got 1e+308 (1 EFLOP/s per "
                        "device; the fastest accelerators do ~10**15)"),
    "latency-huge": (_set("link_latency_s", 1e30),
                     "link_latency_s: must be <= 1.0, got 1e+30 (real links take microseconds "
                     "per message)"),
}


@pytest.mark.parametrize("case", sorted(CLUSTER_CASES))
def test_bad_cluster(case, cluster_data):
    edit, expected = CLUSTER_CASES[case]
    _check(ClusterSpec, cluster_data, edit, expected)


@pytest.mark.parametrize("edit", [
    lambda d: d.update(num_nodes=512, devices_per_node=8, island_size=8),  # bench_planner
    lambda d: d.update(num_nodes=1024, devices_per_node=1024, island_size=8),  # 2**20 exactly
    _set("inter_node_bandwidth_bytes_per_s", 1e6),
    _set("inter_node_bandwidth_bytes_per_s", 1e16),
    _set("device.peak_flops", 1e18),
    _set("link_latency_s", 1.0),
    _set("link_latency_s", 0.0),
], ids=["4096-devices", "2**20-devices", "1MB/s", "10PB/s", "1EFLOP/s", "latency-1s",
        "latency-0"])
def test_large_and_slow_clusters_stay_legal(cluster_data, edit):
    _legal(ClusterSpec, cluster_data, edit)


# --- MetaOp graph -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graph_data() -> Data:
    """The tiny-clip graph: tasks text_vision, text_audio, vision_audio, thumb_text; 4 levels;
    metaops[0] is text_audio/audio_embed (level 0, one layer, no predecessors)."""
    data = read_data(str(TINY / "graph.yaml"))
    assert data["tasks"] == ["text_vision", "text_audio", "vision_audio", "thumb_text"]
    assert (data["metaops"][0]["id"], data["num_levels"]) == ("text_audio/audio_embed", 4)
    return data


def _first_with_predecessors(d: Data) -> int:
    return next(i for i, m in enumerate(d["metaops"]) if m["predecessors"])


GRAPH_CASES: dict[str, tuple[Edit, str]] = {
    "model-blank": (_set("model", " "), "model: must not be blank"),
    "producer-blank": (_set("producer", ""), "producer: must not be blank"),
    "producer-spaced": (_set("producer", " spindle 0.1.0"),
                        "producer: ' spindle 0.1.0': must not begin or end with a space"),
    "duplicate-task": (lambda d: d["tasks"].append("text_vision"),
                       "tasks[4]: duplicate task 'text_vision'"),
    "no-metaops": (_set("metaops", []), "metaops: a graph needs at least one MetaOp"),
    "unknown-task": (_set("metaops.0.task", "x"), "metaops[0].task: unknown task 'x' (not in "
                                                  "tasks)"),
    "task-without-metaops": (lambda d: d["tasks"].append("extra"),
                             "tasks[4]: task 'extra' has no MetaOp"),
    "first-layer-huge": (_set("metaops.0.first_layer", HUGE),
                         f"metaops[0].first_layer: must be <= 99999, got {HUGE} ({LAYERS_WHY})"),
    "num-layers-huge": (_set("metaops.0.num_layers", HUGE),
                        f"metaops[0].num_layers: must be <= 100000, got {HUGE} ({LAYERS_WHY})"),
    "layers-past-the-end": (lambda d: d["metaops"][0].update(first_layer=99_999, num_layers=2),
                            "metaops[0].num_layers: layers 99999..100000 run past layer 99999, "
                            f"the last a module may have ({LAYERS_WHY})"),
    "num-levels-huge": (_set("num_levels", 10**18),
                        f"num_levels: expected 4 (MetaLevels run 0..3), got {10**18}"),
    "num-levels-beyond-64-bits": (_set("num_levels", HUGE),
                                  "num_levels: expected a 64-bit integer, got one that needs "
                                  "101 bits"),
    "num-levels-one-too-many": (_set("num_levels", 5),
                                "num_levels: expected 4 (MetaLevels run 0..3), got 5"),
    "level-without-predecessors": (_set("metaops.0.level", 2),
                                   "metaops[0].level: expected 0 (it has no predecessors), got 2"),
    "level-huge": (_set("metaops.0.level", 10**18),
                   f"metaops[0].level: expected 0 (it has no predecessors), got {10**18}"),
    # metaops 2 and 4, text_vision's and thumb_text's text embedding, share a signature
    "signature-of-another-batch": (_set("metaops.4.batch_size", 12),
                                   "metaops[4].batch_size: 12, but 'text_vision/text_embed' of "
                                   "the same signature runs 8"),
}


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_bad_graph(case, graph_data):
    edit, expected = GRAPH_CASES[case]
    _check(MetaOpGraph, graph_data, edit, expected)


def test_a_level_must_be_one_above_the_deepest_predecessor(graph_data):
    i = _first_with_predecessors(graph_data)
    m = graph_data["metaops"][i]
    _check(MetaOpGraph, graph_data, _set(f"metaops.{i}.level", m["level"] + 1),
           f"metaops[{i}].level: expected {m['level']} (one above its deepest predecessor), "
           f"got {m['level'] + 1}")


# --- profile -----------------------------------------------------------------------------

def _point(n: int, feasible: bool = True) -> Data:
    return {"num_devices": n, "strategy": "dp", "feasible": feasible,
            "time_ms": 1.0 if feasible else 0.0, "peak_memory_bytes": 1}


@pytest.fixture(scope="module")
def profile_data() -> Data:
    """The worked example's profile: three one-piece data-parallel curves with batch 2 over
    n = 1..2**20; curves[0] and [1] have a negative alpha (T stays positive up to n = 2)."""
    data = read_data(str(WORKED / "profile.yaml"))
    assert [c["batch_size"] for c in data["curves"]] == [2, 2, 2]
    assert data["curves"][0]["pieces"][0]["alpha_ms"] < 0
    return data


def _piece(alpha_ms: float, beta_ms: float, strategy: str = "dp") -> Edit:
    return lambda d: d["curves"][2]["pieces"][0].update(alpha_ms=alpha_ms, beta_ms=beta_ms,
                                                        strategy=strategy)


def _two_pieces(d: Data) -> None:
    d["curves"][2]["pieces"] = [
        {"n_lo": 1, "n_hi": 2, "alpha_ms": -1.0, "beta_ms": 0.5, "strategy": "dp"},
        {"n_lo": 2, "n_hi": 8, "alpha_ms": 1.0, "beta_ms": 1.0, "strategy": "dp"}]


PROFILE_CASES: dict[str, tuple[Edit, str]] = {
    "zero-time": (_piece(0.0, 0.0), "curves[2].pieces[0]: T(n) = alpha_ms + beta_ms * B / n is "
                                    "0 ms at n = 2 (B = 2); an operator must take at least "
                                    "1e-12 ms at every device count its piece covers"),
    "negative-time": (_piece(-10.0, 3.75), "curves[2].pieces[0]: T(n) = alpha_ms + beta_ms * B "
                                           "/ n is -6.25 ms at n = 2 (B = 2); an operator must "
                                           "take at least 1e-12 ms at every device count its "
                                           "piece covers"),
    "alpha-minus-one": (_piece(-1.0, 0.5), "curves[2].pieces[0]: T(n) = alpha_ms + beta_ms * B "
                                           "/ n is -0.5 ms at n = 2 (B = 2); an operator must "
                                           "take at least 1e-12 ms at every device count its "
                                           "piece covers"),
    # tensor parallel of degree 2 uses up to t * B = 4 devices
    "negative-under-tp": (_piece(-3.0, 3.75, "tp2"), "curves[2].pieces[0]: T(n) = alpha_ms + "
                                                     "beta_ms * B / n is -1.125 ms at n = 4 "
                                                     "(B = 2); an operator must take at least "
                                                     "1e-12 ms at every device count its piece "
                                                     "covers"),
    "first-of-two-pieces": (_two_pieces, "curves[2].pieces[0]: T(n) = alpha_ms + beta_ms * B / "
                                         "n is -0.5 ms at n = 2 (B = 2); an operator must take "
                                         "at least 1e-12 ms at every device count its piece "
                                         "covers"),
    "counts-huge": (_set("counts", [1, 9999999999999999999999]),
                    "counts: must be <= 1048576, got 9999999999999999999999 "
                    f"({DEVICES_WHY})"),
    "n-hi-huge": (_set("curves.2.pieces.0.n_hi", HUGE),
                  f"curves[2].pieces[0].n_hi: must be <= 1048576, got {HUGE} ({DEVICES_WHY})"),
    "strategy-degree-huge": (_set("curves.2.pieces.0.strategy", "tp" + "9" * 5000),
                             "curves[2].pieces[0].strategy: unknown strategy 'tp" + "9" * 5000
                             + "' (expected 'dp' or 'tp<t>', 2 <= t <= 1048576)"),
    "strategy-non-ascii-digit": (_set("curves.2.pieces.0.strategy", "tp\u00b2"),
                                 "curves[2].pieces[0].strategy: unknown strategy 'tp\u00b2' "
                                 "(expected 'dp' or 'tp<t>', 2 <= t <= 1048576)"),
    "batch-huge": (_set("curves.2.batch_size", 2**31),
                   "curves[2].batch_size: must be <= 1073741824, got 2147483648 "
                   "(about a billion samples; real global batches are below ~10**7)"),
    # finite, but on its way into sums and integer rounding it overflows to inf and NaN
    "time-huge": (_piece(1e307, 0.0), "curves[2].pieces[0]: T(n) = alpha_ms + beta_ms * B / n "
                                      "is 1e+307 ms at n = 1, above 1e+12 ms (about 30 years; "
                                      "an iteration takes seconds)"),
    # a planned iteration of inf ms, and simulate --json wrote Infinity, which is no JSON
    "optimizer-per-tensor-huge": (
        _set("optimizer", {"ms_per_tensor": 1.7e308, "ms_per_million_params": 1.0}),
        "optimizer.ms_per_tensor: must be <= 1000000000000.0, got 1.7e+308 (about 30 years; "
        "an iteration takes seconds)"),
    "optimizer-per-parameter-huge": (
        _set("optimizer", {"ms_per_tensor": 0.01, "ms_per_million_params": 1.7e308}),
        "optimizer.ms_per_million_params: must be <= 1000000000000.0, got 1.7e+308 (about 30 "
        "years; an iteration takes seconds)"),
    # a degree above every count of its piece: validated, its counts silently dropped
    "strategy-above-its-counts": (_set("curves.2.pieces", [
        {"n_lo": 1, "n_hi": 2, "alpha_ms": 1.0, "beta_ms": 1.0, "strategy": "tp999"},
        {"n_lo": 2, "n_hi": 8, "alpha_ms": 1.0, "beta_ms": 1.0, "strategy": "dp"}]),
                                  "curves[2].pieces[0].strategy: 'tp999' on 1 to 2 devices: "
                                  "fewer than one tensor-parallel group"),
    "points-repeated": (_set("curves.2.points", [_point(1), _point(2), _point(1)]),
                        "curves[2].points[2]: a second point at n = 1 under 'dp' (the first is "
                        "points[0])"),
    "points-all-infeasible": (_set("curves.2.points", [_point(1, False), _point(2, False)]),
                              "curves[2].points: no point is feasible, so there is nothing the "
                              "pieces could have been fitted to"),
    "counts-empty": (_set("counts", []), "counts: a profile needs at least one device count"),
    "counts-unsorted": (_set("counts", [4, 1, 2]),
                        "counts: device counts must be ascending, each once"),
    "counts-repeated": (_set("counts", [1, 2, 2]),
                        "counts: device counts must be ascending, each once"),
}


@pytest.mark.parametrize("case", sorted(PROFILE_CASES))
def test_bad_profile(case, profile_data):
    edit, expected = PROFILE_CASES[case]
    _check(Profile, profile_data, edit, expected)


@pytest.mark.parametrize("edit", [
    _piece(0.0, 3.75),  # alpha 0: the fitter's ideal last piece (time falls as 1 / n)
    _piece(-1.0, 1.5),  # a negative alpha where T(2) = 0.5 ms
    _piece(0.05, 0.001),  # the planner benchmarks' synthetic curves
    # a piece starting beyond the devices the batch can use (n > B = 2) is never read
    lambda d: d["curves"][2].update(pieces=[
        {"n_lo": 1, "n_hi": 2, "alpha_ms": 1.0, "beta_ms": 1.0, "strategy": "dp"},
        {"n_lo": 2, "n_hi": 4, "alpha_ms": 1.0, "beta_ms": 1.0, "strategy": "dp"},
        {"n_lo": 4, "n_hi": 8, "alpha_ms": -5.0, "beta_ms": 0.0, "strategy": "dp"}]),
], ids=["alpha-0", "negative-alpha", "bench", "beyond-batch"])
def test_positive_curves_stay_legal(profile_data, edit):
    _legal(Profile, profile_data, edit)


# --- plan --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_data() -> Data:
    """The tiny-clip plan on 4 ranks."""
    data = read_data(str(TINY / "expected_plan.yaml"))
    assert data["num_devices"] == 4 and len(data["memory"]) == 4
    return data


def _swap_memory(d: Data) -> None:
    d["memory"][0], d["memory"][1] = d["memory"][1], d["memory"][0]


PLAN_CASES: dict[str, tuple[Edit, str]] = {
    "cluster-blank": (_set("cluster", ""), "cluster: must not be blank"),
    "model-spaced": (_set("model", "tiny "), "model: 'tiny ': must not begin or end with a space"),
    "src-ranks-empty": (_set("transfers.0.src_ranks", []),
                        "transfers[0].src_ranks: a transfer needs at least one rank on each side"),
    "dst-ranks-empty": (_set("transfers.0.dst_ranks", []),
                        "transfers[0].dst_ranks: a transfer needs at least one rank on each side"),
    "dst-rank-outside": (_set("transfers.0.dst_ranks", [99]),
                         "transfers[0].dst_ranks: rank 99 >= num_devices 4"),
    "src-ranks-unsorted": (_set("transfers.0.src_ranks", [1, 0]),
                           "transfers[0].src_ranks: ranks must be ascending and distinct"),
    "memory-empty": (_set("memory", []), "memory: expected one entry per rank (4), got 0"),
    "memory-out-of-order": (_swap_memory, "memory[0].rank: expected 0, got 1"),
    "num-devices-huge": (_set("num_devices", HUGE),
                         f"num_devices: must be <= 1048576, got {HUGE} ({DEVICES_WHY})"),
    "slice-last-huge": (_set("waves.0.slices.0.last", HUGE),
                        f"waves[0].slices[0].last: must be <= 100000, got {HUGE} "
                        f"({LAYERS_WHY})"),
    "group-last-huge": (_set("param_groups.0.last_layer", HUGE),
                        f"param_groups[0].last_layer: must be <= 100000, got {HUGE} "
                        f"({LAYERS_WHY})"),
    "group-empty-range": (lambda d: d["param_groups"][0].update(first_layer=1, last_layer=1),
                          "param_groups[0].last_layer: 1 <= first_layer 1"),
    "group-backwards": (lambda d: d["param_groups"][0].update(first_layer=3, last_layer=2),
                        "param_groups[0].last_layer: 2 <= first_layer 3"),
    "group-ranks-empty": (_set("param_groups.0.ranks", []),
                          "param_groups[0].ranks: a parameter group needs at least one rank"),
    "group-rank-outside": (_set("param_groups.0.ranks", [2, 4]),
                           "param_groups[0].ranks: rank 4 >= num_devices 4"),
    "group-ranks-repeated": (_set("param_groups.0.ranks", [2, 2]),
                             "param_groups[0].ranks: ranks must be ascending and distinct"),
    # the tensor-parallel groups of a slice are runs of t of its ranks (CONTRACTS.md)
    "tp-degree-not-dividing": (lambda d: d["waves"][0]["slices"][0].update(ranks=[0],
                                                                          strategy="tp2"),
                               "waves[0].slices[0].strategy: tp2 needs a rank count divisible "
                               "by 2, the slice has 1"),
    "duration-huge": (_set("waves.0.duration_ms", 1.7e308),
                      "waves[0].duration_ms: must be <= 1000000000000.0, got 1.7e+308 (about "
                      "30 years; an iteration takes seconds)"),
}


@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_bad_plan(case, plan_data):
    edit, expected = PLAN_CASES[case]
    _check(Plan, plan_data, edit, expected)


# --- model -------------------------------------------------------------------------------

@pytest.mark.parametrize(("edit", "expected"), [
    (_set("modules.text_enc.num_layers", HUGE),
     f"modules.text_enc.num_layers: must be <= 100000, got {HUGE} ({LAYERS_WHY})"),
    (_set("tasks.0.batch_size", 2**31),
     "tasks[0].batch_size: must be <= 1073741824, got 2147483648 (about a billion samples; "
     "real global batches are below ~10**7)"),
    # sizes that passed validate and then overflowed the graph's 64-bit byte counts, an
    # error naming the graph file spindle graph was writing (a review's fuzzing)
    (_set("modules.text_embed.vocab_size", 2**63 - 1),
     f"modules.text_embed.vocab_size: must be <= 16777216, got {2**63 - 1} (about 16 million; "
     "real vocabularies and contexts are ~10**6 at most)"),
    (_set("modules.text_enc.ffn", 2**40),
     f"modules.text_enc.ffn: must be <= 1048576, got {2**40} (about a million; the widest "
     "real layers are ~10**5)"),
], ids=["layers-huge", "batch-huge", "vocabulary-huge", "width-huge"])
def test_bad_model(small_model_data, edit, expected):
    _check(ModelSpec, small_model_data, edit, expected)


def test_the_cli_names_file_and_field(cluster_data, tmp_path, spindle):
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(cluster_data, num_nodes=HUGE)))
    result = spindle("validate", str(path))
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == (f"error: {path}: num_nodes: must be <= 1048576, got {HUGE} "
                             f"({DEVICES_WHY})\n")
