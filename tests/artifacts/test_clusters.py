"""The shipped cluster specs: every one loads, the A800 slices are slices of the paper's
cluster, and the link figures follow from the hardware the headers cite."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

import pytest

from spindle_cli.artifacts import ClusterSpec, load
from spindle_cli.errors import ArtifactError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "clusters").glob("*.yaml"))
A800_NODES = (1, 2, 4, 8, 32)
GIB = 1024**3


@cache
def _cluster(name: str) -> ClusterSpec:
    return load(str(REPO / "clusters" / f"{name}.yaml"), ClusterSpec)


def test_every_expected_cluster_ships():
    expected = {f"a800-{n}x8" for n in A800_NODES} | {"h100-8x8", "local-cpu", "local-cpu-2"}
    assert {p.stem for p in SHIPPED} >= expected


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_cluster_loads_and_is_named_after_its_file(path):
    cluster = load(str(path), ClusterSpec)
    assert cluster.name == path.stem
    assert cluster.description
    assert path.read_text(encoding="utf-8").startswith(f"# {path.stem}:")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_links_inside_an_island_are_at_least_as_fast_as_between_nodes(path):
    c = load(str(path), ClusterSpec)
    assert c.intra_island_bandwidth_bytes_per_s >= c.inter_node_bandwidth_bytes_per_s


@pytest.mark.parametrize("nodes", A800_NODES)
def test_a800_clusters_are_slices_of_one_node_design(nodes):
    c = _cluster(f"a800-{nodes}x8")
    assert (c.num_nodes, c.devices_per_node, c.island_size) == (nodes, 8, 8)
    assert c.num_devices == 8 * nodes
    # Apart from the node count (and the words), every slice is the paper's cluster.
    ref = _cluster("a800-8x8")
    same = {"name": ref.name, "description": ref.description, "num_nodes": ref.num_nodes}
    assert dataclasses.replace(c, **same) == ref


def test_a800_figures_follow_from_the_hardware():
    c = _cluster("a800-8x8")
    assert c.num_devices == 64
    assert c.device.peak_flops == 312e12
    assert 70 * GIB <= c.device.memory_bytes < 80 * GIB  # 80 GiB less a runtime reserve
    # 400 GB/s bidirectional NVLink per A800 = 200 GB/s each way.
    assert c.intra_island_bandwidth_bytes_per_s == 400e9 / 2
    # One 400 Gb/s InfiniBand NIC per node, shared by its 8 GPUs.
    assert c.inter_node_bandwidth_bytes_per_s * c.devices_per_node == 400e9 / 8


def test_a800_islands_are_nodes():
    c = _cluster("a800-8x8")
    assert c.islands() == [list(range(i, i + 8)) for i in range(0, 64, 8)]
    assert c.bandwidth_bytes_per_s(0, 7) == c.intra_island_bandwidth_bytes_per_s
    assert c.bandwidth_bytes_per_s(7, 8) == c.inter_node_bandwidth_bytes_per_s
    assert c.node_of(63) == 7


def test_h100_is_faster_than_a800_everywhere():
    a, h = _cluster("a800-8x8"), _cluster("h100-8x8")
    assert h.num_devices == a.num_devices
    assert h.device.peak_flops > a.device.peak_flops
    assert h.device.memory_bandwidth_bytes_per_s > a.device.memory_bandwidth_bytes_per_s
    assert h.intra_island_bandwidth_bytes_per_s > a.intra_island_bandwidth_bytes_per_s
    assert h.inter_node_bandwidth_bytes_per_s > a.inter_node_bandwidth_bytes_per_s


@pytest.mark.parametrize(("name", "ranks"), [("local-cpu", 4), ("local-cpu-2", 2)])
def test_local_cpu_clusters_are_one_island_of_cpu_ranks(name, ranks):
    c = _cluster(name)
    assert (c.num_nodes, c.devices_per_node, c.island_size) == (1, ranks, ranks)
    assert c.islands() == [list(range(ranks))]
    assert c.device.memory_bytes == 4 * GIB
    # A CPU core, not an accelerator: orders of magnitude below a GPU.
    assert c.device.peak_flops < _cluster("a800-1x8").device.peak_flops / 100


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_cpu_clusters_run_gloo_and_gpu_clusters_nccl(path):
    c = load(str(path), ClusterSpec)
    assert c.backend == ("gloo" if c.name.startswith("local-cpu") else "nccl")


def test_an_unknown_backend_is_a_one_line_error(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text((REPO / "clusters" / "local-cpu.yaml").read_text().replace(
        "backend: gloo", "backend: mpi"))
    with pytest.raises(ArtifactError, match=r"c\.yaml: backend: .*'mpi'"):
        load(str(bad), ClusterSpec)
