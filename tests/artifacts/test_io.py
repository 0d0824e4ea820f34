"""Reading and writing artifact files: formats, kind/version checks, hashes, atomic writes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml

from spindle_cli.artifacts import (
    PRODUCER,
    ClusterSpec,
    MetaOpGraph,
    ModelSpec,
    Profile,
    input_ref,
    load,
    load_artifact,
    rendered_for,
    sha256,
    write_artifact,
)
from spindle_cli.artifacts.io import (
    _FastLoader,
    _SlowLoader,
    as_written,
    derived_header,
    parse_artifact,
    read_data,
)
from spindle_cli.errors import ArtifactError
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.profiling import analytic_profile


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_two_writes_are_byte_identical(small_model, tmp_path):
    model = small_model
    for ext in ("yaml", "json"):
        a, b = tmp_path / f"a.{ext}", tmp_path / f"b.{ext}"
        write_artifact(model, str(a))
        write_artifact(model, str(b))
        assert a.read_bytes() == b.read_bytes()
        assert a.read_text() == rendered_for(model, str(a))


def test_yaml_and_json_files_load_to_the_same_artifact(small_model, tmp_path):
    model = small_model
    write_artifact(model, str(tmp_path / "m.yaml"))
    write_artifact(model, str(tmp_path / "m.json"))
    write_artifact(model, str(tmp_path / "m.yml"))
    objs = [load(str(tmp_path / f"m.{ext}"), ModelSpec) for ext in ("yaml", "json", "yml")]
    assert objs[0] == objs[1] == objs[2] == model
    assert len({sha256(o) for o in objs}) == 1


def test_hash_ignores_comments_and_key_order(small_model, small_model_data, tmp_path):
    model = small_model
    reordered = dict(reversed(list(small_model_data.items())))
    path = tmp_path / "m.yaml"
    path.write_text("# a comment\n" + yaml.safe_dump(reordered, sort_keys=False))
    assert sha256(load(str(path), ModelSpec)) == sha256(model)
    changed = dict(small_model_data, name="other")
    assert sha256(parse_artifact(changed, "<t>", ModelSpec)) != sha256(model)


def test_atomic_write_leaves_no_temp_files(small_model, tmp_path):
    model = small_model
    path = tmp_path / "m.yaml"
    write_artifact(model, str(path))
    write_artifact(model, str(path))
    assert _files(tmp_path) == ["m.yaml"]


def test_failed_write_keeps_the_old_file(small_model, tmp_path, monkeypatch):
    model = small_model
    path = tmp_path / "m.yaml"
    path.write_text("old content\n")

    def fail(src: str, dst: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", fail)
    # one line naming the file, not an internal error
    with pytest.raises(ArtifactError, match=r"m.yaml: cannot write: No space left on device"):
        write_artifact(model, str(path))
    assert path.read_text() == "old content\n"
    assert _files(tmp_path) == ["m.yaml"]


def test_a_directory_that_refuses_files_is_an_artifact_error(small_model, tmp_path,
                                                              monkeypatch):
    def refuse(**kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ArtifactError, match="m.yaml: cannot write: Read-only file system"):
        write_artifact(small_model, str(tmp_path / "m.yaml"))
    assert _files(tmp_path) == []


def test_write_to_missing_directory_is_an_error(small_model, tmp_path):
    model = small_model
    with pytest.raises(ArtifactError, match="output directory .* does not exist"):
        write_artifact(model, str(tmp_path / "nope" / "m.yaml"))
    assert _files(tmp_path) == []


def test_dash_writes_yaml_to_stdout(small_model, capsys):
    model = small_model
    write_artifact(model, "-")
    assert yaml.safe_load(capsys.readouterr().out)["name"] == "small"


@pytest.mark.parametrize(
    ("name", "content", "problem"),
    [
        ("m.yaml", "kind: model\nversion: [1\n", "invalid YAML at line"),
        ("m.json", '{"kind": "model",', "invalid JSON at line 1"),
        ("m.txt", "kind: model\n", "unknown file extension"),
        ("m.yaml", "- 1\n- 2\n", "expected a mapping at the top level"),
        ("m.yaml", "version: 1\n", "kind: missing required field"),
        ("m.yaml", "kind: spaceship\nversion: 1\n", "kind: unknown kind 'spaceship'"),
        ("m.yaml", "kind: model\nversion: 7\n", "version: model version 7 is newer"),
        ("m.yaml", "kind: model\nversion: 0\n", "no longer supported"),
        ("m.yaml", "kind: model\nversion: '1'\n", "version: expected an integer"),
    ],
)
def test_read_errors_name_file_field_and_problem(tmp_path, name, content, problem):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ArtifactError) as e:
        load_artifact(str(path))
    message = str(e.value)
    assert message.startswith(f"{path}: ")
    assert problem in message
    assert "\n" not in message


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ArtifactError, match="no such file"):
        load_artifact(str(tmp_path / "absent.yaml"))
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(ArtifactError, match="is a directory"):
        load_artifact(str(tmp_path / "dir.yaml"))


def test_newer_version_has_a_hint(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("kind: model\nversion: 2\n")
    with pytest.raises(ArtifactError) as e:
        load_artifact(str(path))
    assert e.value.hint is not None and "upgrade" in e.value.hint


def test_expected_kind_is_enforced(small_model, tmp_path):
    model = small_model
    path = tmp_path / "m.yaml"
    write_artifact(model, str(path))
    with pytest.raises(ArtifactError, match="expected a 'metaop_graph' artifact, got 'model'"):
        load(str(path), MetaOpGraph)


def test_derived_artifacts_record_producer_and_input_hashes(small_model, tmp_path):
    model = small_model
    path = tmp_path / "m.yaml"
    write_artifact(model, str(path))
    ref = input_ref(model, str(path))
    graph = build_graph(model, inputs=[ref])
    header = derived_header(MetaOpGraph, [ref])
    assert (graph.producer, graph.inputs) == (PRODUCER, (ref,)) == (header["producer"],
                                                                    header["inputs"])
    assert ref.sha256 == sha256(load(str(path), ModelSpec))
    out = tmp_path / "g.json"
    write_artifact(graph, str(out))
    data = json.loads(out.read_text())
    assert data["inputs"] == [{"kind": "model", "path": str(path), "sha256": ref.sha256}]
    assert load(str(out), MetaOpGraph) == graph


def test_fast_yaml_parser_reads_the_same_data(repo_root):
    # read_data parses with libyaml when available; the data must equal the reference parser's
    for path in sorted((repo_root / "models").glob("*.yaml")) + sorted(
            (repo_root / "clusters").glob("*.yaml")):
        assert read_data(str(path)) == yaml.safe_load(path.read_text()), path


INTEGER_LIKE = ["0", "7", "4095", "010", "0012", "00", "+5", "-3", "1_000", "0x1f", "0b101",
                "0o17", "190:20:30", "1.0", "'12'", '"12"', "\uff10", "١٢", "12a", "-1_0", "~"]


@pytest.mark.parametrize("loader", [_FastLoader, _SlowLoader])
def test_integer_scalars_read_as_the_reference_loader_reads_them(loader):
    # plain decimals take a shortcut past the resolvers; every other spelling goes the long way
    text = "".join(f"k{i}: {v}\n" for i, v in enumerate(INTEGER_LIKE)) + "r: [0, 1, 010, +2]\n"
    ours, reference = yaml.load(text, Loader=loader), yaml.safe_load(text)
    assert ours == reference
    assert [type(v) for v in ours.values()] == [type(v) for v in reference.values()]


def test_numbers_with_an_exponent_are_numbers_as_in_json(small_model, tmp_path):
    # YAML 1.1 reads 989e12 and 1.5e9 as text (it wants a dot and a signed exponent)
    path = tmp_path / "c.yaml"
    path.write_text("a: 989e12\nb: 1.5e9\nc: 1_000e3\nd: '1e5'\ne: e5\nf: -2E-3\n")
    assert read_data(str(path)) == {"a": 989e12, "b": 1.5e9, "c": 1e6, "d": "1e5", "e": "e5",
                                    "f": -2e-3}
    # so a string that reads as such a number is written quoted
    odd = dataclasses.replace(small_model, description="1e5")
    out = tmp_path / "m.yaml"
    write_artifact(odd, str(out))
    assert "description: '1e5'" in out.read_text()
    assert load(str(out), ModelSpec) == odd


def test_as_written_is_what_the_file_holds(tmp_path):
    # an analytic profile's times have more digits than a file keeps
    root = Path(__file__).resolve().parents[2]
    graph = load(str(root / "graphs" / "tiny-clip.yaml"), MetaOpGraph)
    cluster = load(str(root / "clusters" / "a800-1x8.yaml"), ClusterSpec)
    profile = analytic_profile(graph, cluster, hardware="a800", counts=[1, 2, 4, 8])
    write_artifact(profile, str(tmp_path / "p.yaml"))
    read = load(str(tmp_path / "p.yaml"), Profile)
    assert read != profile
    assert as_written(profile) == read
    assert as_written(read) == read
