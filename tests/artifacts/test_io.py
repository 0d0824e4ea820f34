"""Reading and writing artifact files: formats, kind/version checks, hashes, atomic writes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_scale import examples

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
from spindle_cli.artifacts.io import as_written, derived_header, parse_artifact
from spindle_cli.artifacts.parsing import _FastLoader, _SlowLoader, read_data
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


def test_writing_through_a_symlink_replaces_its_target_and_keeps_the_link(small_model,
                                                                         tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "m.yaml").write_text("old content\n")
    link = tmp_path / "m.yaml"
    link.symlink_to(Path("real") / "m.yaml")
    write_artifact(small_model, str(link))
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "m.yaml")
    assert (tmp_path / "real" / "m.yaml").read_text() == rendered_for(small_model, str(link))
    # the temp file went beside the target, and is gone
    assert _files(tmp_path / "real") == ["m.yaml"]
    # a dangling link's target is made, as `>` would make it
    (tmp_path / "new.yaml").symlink_to(Path("real") / "new.yaml")
    write_artifact(small_model, str(tmp_path / "new.yaml"))
    assert (tmp_path / "new.yaml").is_symlink()
    assert load(str(tmp_path / "real" / "new.yaml"), ModelSpec) == small_model


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o664])
def test_a_replaced_file_keeps_its_permission_bits(small_model, tmp_path, mode):
    path = tmp_path / "m.yaml"
    path.write_text("old content\n")
    path.chmod(mode)
    write_artifact(small_model, str(path))
    assert stat.S_IMODE(path.stat().st_mode) == mode
    assert path.read_text() == rendered_for(small_model, str(path))


def test_a_new_file_gets_the_mode_open_would_give_it(small_model, tmp_path):
    umask = os.umask(0o027)
    try:
        write_artifact(small_model, str(tmp_path / "m.yaml"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "m.yaml").stat().st_mode) == 0o640


@pytest.mark.parametrize("through_a_link", [False, True])
def test_a_read_only_file_is_refused_not_replaced(small_model, tmp_path, through_a_link):
    target = tmp_path / "m.yaml"
    target.write_text("old content\n")
    target.chmod(0o444)
    path = target
    if through_a_link:
        path = tmp_path / "link.yaml"
        path.symlink_to(target.name)
    with pytest.raises(ArtifactError) as e:
        write_artifact(small_model, str(path))
    assert str(e.value) == f"{path}: cannot write: read-only file"
    assert e.value.hint == f"make it writable (chmod u+w {target}) to replace it"
    assert target.read_text() == "old content\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o444
    assert path.is_symlink() == through_a_link


def test_a_file_on_a_read_only_file_system_says_so_without_a_chmod_hint(small_model, tmp_path,
                                                                         monkeypatch):
    # a read-only mount (a CI checkout bind-mounted ro): chmod cannot help there
    target = tmp_path / "m.yaml"
    target.write_text("old content\n")
    statvfs = os.statvfs

    def read_only(path):
        got = statvfs(path)
        return os.statvfs_result((*got[:8], got.f_flag | os.ST_RDONLY, got.f_namemax))

    monkeypatch.setattr(os, "statvfs", read_only)
    with pytest.raises(ArtifactError) as e:
        write_artifact(small_model, str(target))
    assert str(e.value) == f"{target}: cannot write: Read-only file system"
    assert e.value.hint is None
    assert target.read_text() == "old content\n"


@pytest.mark.parametrize(("make", "problem"), [
    (lambda p: p.symlink_to(p.name), "Too many levels of symbolic links"),
    (lambda p: p.symlink_to("/dev/null"), "not a regular file"),
    (lambda p: os.mkfifo(p), "not a regular file"),
    (lambda p: p.symlink_to(p.parent), "Is a directory"),
], ids=["loop", "device", "fifo", "directory"])
def test_what_is_no_regular_file_is_not_replaced(small_model, tmp_path, make, problem):
    path = tmp_path / "m.yaml"
    make(path)
    before = os.lstat(path)
    with pytest.raises(ArtifactError, match=f"^{path}: cannot write: {problem}$"):
        write_artifact(small_model, str(path))
    assert os.lstat(path) == before
    assert _files(tmp_path) == ["m.yaml"]


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
        ("m.yaml", "kind: model\nversion: 0\n",
         "version: expected a format version (an integer from 1), got 0"),
        ("m.yaml", "kind: model\nversion: -1\n",
         "version: expected a format version (an integer from 1), got -1"),
        ("m.yaml", "kind: model\nversion: '1'\n",
         "version: expected a format version (an integer from 1), got a string"),
        # as a missing kind is named (it said got null)
        ("m.yaml", "kind: model\n",
         "version: missing required field (the format version, an integer from 1)"),
        ("m.yaml", "kind: model\nversion:\n",
         "version: expected a format version (an integer from 1), got null"),
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


YAML_12_SCALARS = [
    # decimals, with the sign and underscores YAML 1.1 allows; a leading 0 is not octal
    ("0", 0), ("7", 7), ("4095", 4095), ("010", 10), ("0012", 12), ("00", 0), ("08", 8),
    ("+5", 5), ("-3", -3), ("1_000", 1000), ("-1_0", -10),
    # YAML 1.2's other bases; binary and base 60 are YAML 1.1's only
    ("0x1f", 31), ("-0x10", -16), ("0o17", 15), ("0b101", "0b101"), ("190:20:30", "190:20:30"),
    ("1:00", "1:00"), ("1.0", 1.0), ("1:30.5", "1:30.5"), (".5", 0.5),
    # booleans: true and false in three spellings; yes/no/on/off are YAML 1.1's only
    ("true", True), ("True", True), ("FALSE", False), ("tRue", "tRue"), ("yes", "yes"),
    ("No", "No"), ("on", "on"), ("OFF", "OFF"),
    ("'12'", "12"), ('"12"', "12"), ("\uff10", "\uff10"), ("١٢", "١٢"),
    ("12a", "12a"), ("~", None),
]


@pytest.mark.parametrize("loader", [_FastLoader, _SlowLoader])
def test_plain_scalars_read_as_yaml_1_2_reads_them(loader):
    # plain decimals take a shortcut past the resolvers; every other spelling goes the long way
    text = "".join(f"k{i}: {v}\n" for i, (v, _) in enumerate(YAML_12_SCALARS))
    read = list(yaml.load(text + "r: [0, 1, 010, +2]\n", Loader=loader).values())
    expected = [value for _, value in YAML_12_SCALARS] + [[0, 1, 10, 2]]
    assert read == expected
    assert [type(v) for v in read] == [type(v) for v in expected]


@pytest.mark.parametrize(("spelling", "nodes"), [("010", 10), ("0x10", 16), ("0o17", 15)])
def test_integer_fields_read_yaml_1_2_integers(repo_root, tmp_path, spelling, nodes):
    text = (repo_root / "clusters" / "local-cpu-2.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("\nnum_nodes: 1\n", f"\nnum_nodes: {spelling}\n"))
    assert load(str(path), ClusterSpec).num_nodes == nodes


@pytest.mark.parametrize("spelling", ["1:00", "0b1"])
def test_yaml_1_1_integer_forms_are_strings_an_integer_field_refuses(repo_root, tmp_path,
                                                                     spelling):
    text = (repo_root / "clusters" / "local-cpu-2.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("\nnum_nodes: 1\n", f"\nnum_nodes: {spelling}\n"))
    with pytest.raises(ArtifactError) as e:
        load(str(path), ClusterSpec)
    assert str(e.value) == f"{path}: num_nodes: expected an integer, got a string"


def test_names_that_yaml_1_1_reads_as_booleans_are_names(tiny_clip_path, tmp_path):
    text = tiny_clip_path.read_text().replace("clip_loss", "on").replace("name: loss,", "name: no,")
    path = tmp_path / "m.yaml"
    path.write_text(text)
    model = load(str(path), ModelSpec)
    assert "on" in model.modules
    assert model.tasks[0].steps[-1].name == "no"
    # written back quoted, so that YAML 1.1 readers read them as names too
    out = tmp_path / "again.yaml"
    write_artifact(model, str(out))
    assert "  'on':" in out.read_text()
    assert yaml.safe_load(out.read_text())["tasks"][0]["steps"][-1]["name"] == "no"
    assert load(str(out), ModelSpec) == model


@pytest.mark.parametrize(("spelling", "problem"), [
    ("True", None), ("yes", "expected a boolean, got a string"),
    ("off", "expected a boolean, got a string"),
])
def test_boolean_fields_take_yaml_1_2_booleans(repo_root, tmp_path, spelling, problem):
    text = (repo_root / "profiles" / "tiny-clip-local-cpu.yaml").read_text()
    assert "\n    feasible: true\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("\n    feasible: true\n", f"\n    feasible: {spelling}\n", 1))
    if problem is None:
        assert load(str(path), Profile) == load(str(repo_root / "profiles" /
                                                      "tiny-clip-local-cpu.yaml"), Profile)
        return
    with pytest.raises(ArtifactError, match=f": {problem}$") as e:
        load(str(path), Profile)
    assert ".feasible: " in str(e.value)


def test_strings_only_yaml_1_2_reads_as_integers_are_written_quoted(small_model, tmp_path):
    for text in ("08", "0o17", "-0_9"):
        odd = dataclasses.replace(small_model, description=text)
        out = tmp_path / "m.yaml"
        write_artifact(odd, str(out))
        assert f"description: '{text}'" in out.read_text()
        assert load(str(out), ModelSpec) == odd


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


_TRICKY = ["", "08", "0o17", "0x1F", "010", "1:00", "1e5", "989e12", "on", "yes", "No", "true",
           "~", "null", "-", "- a", "a: b", "#c", "'q'", '"d"', "[x]", "{y}", "&a", "*a", "!t",
           "|", ">", "%", "@", "`", "a" * 130, " lead", "trail ", "tab\there", "line\nbreak",
           "accent é", "中文", "\x85", "\u2028", "emoji 😀"]


_KEYS = st.sampled_from(_TRICKY) | st.text(max_size=40)


@settings(max_examples=examples(300), deadline=None)
@given(st.dictionaries(_KEYS, st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(_TRICKY) | st.text(max_size=160),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_KEYS, inner, max_size=4),
    max_leaves=20), max_size=5))
def test_both_yaml_emitters_write_the_same_bytes(data: dict[str, object]) -> None:
    """Artifacts are written by libyaml's emitter where it writes what the Python emitter
    does (printable ASCII strings), else by the Python one: an artifact's data (a mapping)
    renders byte for byte as the pure-Python emitter renders it."""
    from spindle_cli.artifacts.canonical import _dump, _Dumper

    text = _dump(data)
    assert text == yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                             width=100)
