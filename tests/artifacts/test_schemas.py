"""The published JSON Schemas: up to date with the code, valid, and matched by every shipped
artifact."""

from __future__ import annotations

import copy
import json
import os
import stat
from pathlib import Path

import jsonschema
import pytest

from spindle_cli.artifacts import ModelSpec, input_ref, load
from spindle_cli.artifacts.codec import to_data
from spindle_cli.artifacts.io import kinds, load_artifact, parse_artifact
from spindle_cli.artifacts.parsing import read_data
from spindle_cli.artifacts.schema import main, schema_files, stale_schemas, write_schemas
from spindle_cli.errors import ArtifactError
from spindle_cli.planner.graph import build_graph

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "schemas"
SHIPPED = sorted(
    p for folder in ("models", "clusters", "graphs", "profiles", "plans")
    for p in (REPO / folder).rglob("*") if p.suffix in (".yaml", ".yml", ".json")
)
REGENERATE = "regenerate with: python -m spindle_cli.artifacts.schema schemas/"


def _schema(kind: str) -> dict[str, object]:
    return json.loads((SCHEMAS / f"{kind}.json").read_text())


def _validator(kind: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(_schema(kind))


def test_committed_schemas_are_up_to_date():
    assert stale_schemas(SCHEMAS) == {}, REGENERATE
    assert set(schema_files()) == {f"{k}.json" for k in kinds()}


def test_generation_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    write_schemas(a)
    write_schemas(b)
    for name in schema_files():
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert sorted(p.name for p in a.iterdir()) == sorted(schema_files())


def test_check_mode_reports_drift(tmp_path, capsys):
    write_schemas(tmp_path)
    assert main(["--check", str(tmp_path)]) == 0
    (tmp_path / "model.json").write_text("{}\n")
    (tmp_path / "cluster.json").unlink()
    (tmp_path / "extra.json").write_text("{}\n")
    capsys.readouterr()
    assert main(["--check", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    # what is wrong with each, the changed lines of a stale one included
    assert f"{tmp_path / 'model.json'}: out of date (regenerate it)" in lines
    assert "  --- model.json (file)" in lines and "  -{}" in lines
    assert f"{tmp_path / 'cluster.json'}: missing (regenerate it)" in lines
    assert f"{tmp_path / 'extra.json'}: the schema of no artifact kind (remove it)" in lines
    assert "hint: python -m spindle_cli.artifacts.schema" in "\n".join(lines)
    assert main([str(tmp_path)]) == 0
    # a stray file alone: regenerating does not remove it, so no hint says it would
    assert main(["--check", str(tmp_path)]) == 1
    assert "regenerates" not in capsys.readouterr().err
    (tmp_path / "extra.json").unlink()
    assert main(["--check", str(tmp_path)]) == 0



def test_check_mode_reports_a_schema_with_crlf_line_endings(tmp_path, capsys):
    """As spindle --check does: read_text turned CRLF into LF, so it passed."""
    write_schemas(tmp_path)
    crlf = (tmp_path / "plan.json").read_bytes().replace(b"\n", b"\r\n")
    (tmp_path / "plan.json").write_bytes(crlf)
    capsys.readouterr()
    assert main(["--check", str(tmp_path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'plan.json'}: out of date (regenerate it)" in lines
    assert "  only its line endings: CRLF, where the code writes LF" in lines
    assert main([str(tmp_path)]) == 0
    assert main(["--check", str(tmp_path)]) == 0

def test_help_and_unknown_options_are_not_directories(capsys):
    assert main(["--help"]) == 0
    assert "--check" in capsys.readouterr().out
    assert main(["--bogus", "schemas"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("kind", sorted(kinds()))
def test_schemas_are_valid_draft_2020_12(kind):
    jsonschema.Draft202012Validator.check_schema(_schema(kind))
    assert _schema(kind)["properties"]["kind"]["const"] == kind  # type: ignore[index]


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(REPO)) for p in SHIPPED])
def test_every_shipped_artifact_validates(path):
    data = read_data(str(path))
    obj = parse_artifact(data, str(path))
    _validator(obj.kind).validate(data)


@pytest.mark.parametrize("path", sorted((REPO / "models").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_graphs_of_shipped_models_validate(path):
    model = load(str(path), ModelSpec)
    graph = build_graph(model, inputs=[input_ref(model, str(path))])
    _validator("metaop_graph").validate(to_data(graph))


def test_schema_rejects_what_the_loader_rejects(small_model_data):
    v = _validator("model")
    v.validate(small_model_data)
    bad_cases = []
    extra = copy.deepcopy(small_model_data)
    extra["colour"] = "red"
    bad_cases.append(extra)
    wrong_type = copy.deepcopy(small_model_data)
    wrong_type["modules"]["text_enc"]["heads"] = "two"
    bad_cases.append(wrong_type)
    negative = copy.deepcopy(small_model_data)
    negative["tasks"][0]["batch_size"] = -1
    bad_cases.append(negative)
    missing = copy.deepcopy(small_model_data)
    del missing["tasks"][0]["steps"][0]["module"]
    bad_cases.append(missing)
    wrong_kind = copy.deepcopy(small_model_data)
    wrong_kind["kind"] = "cluster"
    bad_cases.append(wrong_kind)
    for data in bad_cases:
        assert not v.is_valid(data), data


def test_every_string_is_one_line_without_control_characters(cluster_data, tmp_path):
    # not names alone: `spindle show` printed a description's terminal escape codes as they
    # were (set-title, clear-screen), and errors quote any field (a review's fuzzing)
    for text in ("\x1b]0;title\x07", "a\x1b[2Jb", "two\nlines"):
        data = copy.deepcopy(cluster_data)
        data["description"] = text
        assert not _validator("cluster").is_valid(data)
        path = tmp_path / "c.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ArtifactError) as e:
            load_artifact(str(path))
        assert str(e.value) == (f"{path}: description: {text!r}: must not hold line breaks or "
                                "control characters")
    # a long value is quoted in part: the error stays one readable line
    data = copy.deepcopy(cluster_data)
    data["description"] = "x" * 5000 + "\x1b"
    path.write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as e:
        load_artifact(str(path))
    assert str(e.value) == (f"{path}: description: {'x' * 60!r}... (5001 characters): must "
                            "not hold line breaks or control characters")


@pytest.mark.parametrize("name", ["", "  ", "a800\nx", "a800\x00", "a800\x1b[31m",
                                  "a800\u2028x", " a800", "a800 ", "\u00a0a800", "a800\u3000"])
def test_a_blank_or_unprintable_name_is_refused_by_loader_and_schema(cluster_data, tmp_path,
                                                                      name):
    # it names the cluster (and the device) in one-line errors
    for where in (("name",), ("device", "name")):
        data = copy.deepcopy(cluster_data)
        target = data
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = name
        assert not _validator("cluster").is_valid(data)
        path = tmp_path / "c.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ArtifactError) as e:
            load_artifact(str(path))
        problem = ("must not be blank" if not name.strip() else
                   "must not begin or end with a space" if name != name.strip() else
                   "must not hold line breaks or control characters")
        assert f"{path}: {'.'.join(where)}: " in str(e.value) and problem in str(e.value)
        assert "\n" not in str(e.value)
    # spaces, punctuation and any other printable or formatting character are fine (a
    # no-break space, a joiner: names and paths hold them)
    for name in ("a800 2x8 (lab)", "a800\u00a02x8", "gpu\u200dnode", "\u30af\u30e9\u30b9\u30bf"):
        cluster_data["name"] = name
        assert _validator("cluster").is_valid(cluster_data)
        path = tmp_path / "ok.json"
        path.write_text(json.dumps(cluster_data))
        assert load_artifact(str(path)).name == name


def test_schema_files_are_written_as_open_would_make_them(tmp_path):
    # mkstemp makes its file 0600; a published schema is as readable as any other file
    umask = os.umask(0o022)
    try:
        write_schemas(tmp_path)
    finally:
        os.umask(umask)
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in tmp_path.iterdir()} == {oct(0o644)}


def test_a_directory_that_refuses_files_is_one_error_line(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path / 'cluster.json'}: cannot write: "
                                       "Permission denied\n")
