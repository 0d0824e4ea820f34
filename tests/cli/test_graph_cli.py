"""`spindle graph`: output files, stdout, --check, task selection and dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from spindle_cli.artifacts import MetaOpGraph, ModelSpec, input_ref, load, rendered_for
from spindle_cli.cli import cli
from spindle_cli.errors import SpindleError
from spindle_cli.planner.graph import build_graph

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "models").glob("*.yaml"))
COMMITTED_GRAPHS = sorted((REPO / "graphs").glob("*.yaml"))


@pytest.fixture
def model_path(small_model_data, tmp_path, monkeypatch) -> Path:
    # relative names, as a user types them (and short enough to print unwrapped)
    monkeypatch.chdir(tmp_path)
    path = Path("m.yaml")
    path.write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    return path


def _invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _said(stderr: str) -> str:
    """Messages for people, with line wrapping undone (the console wraps at its width)."""
    return " ".join(stderr.split())


def test_graph_writes_the_contracted_graph(model_path, tmp_path):
    out = Path("g.yaml")
    result = _invoke("graph", str(model_path), "-o", str(out))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == ""
    assert f"wrote {out}" in _said(result.stderr)
    model = load(str(model_path), ModelSpec)
    graph = load(str(out), MetaOpGraph)
    assert graph == build_graph(model, inputs=[input_ref(model, str(model_path))])
    assert graph.tasks == ("pairs", "pairs_big")
    assert graph.inputs[0].sha256 == input_ref(model, str(model_path)).sha256


def test_a_module_no_task_runs_is_noted(small_model_data, model_path):
    assert "no task runs" not in _invoke("graph", str(model_path), "-o", "g.yaml").stderr
    small_model_data["modules"]["spare"] = {"kind": "adapter", "in_dim": 8, "hidden": 8}
    model_path.write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    result = _invoke("graph", str(model_path), "-o", "g.yaml")
    assert result.exit_code == 0, result.stderr
    assert "note: m.yaml: no task runs module(s) spare" in _said(result.stderr)


def test_stdout_output_is_yaml_data_only(model_path, tmp_path):
    result = _invoke("graph", str(model_path), "-o", "-")
    assert result.exit_code == 0, result.stderr
    data = yaml.safe_load(result.stdout)
    assert data["kind"] == "metaop_graph"
    assert "wrote" not in result.stderr
    out = Path("g.yaml")
    _invoke("graph", str(model_path), "-o", str(out))
    assert out.read_text() == result.stdout
    # without -o, stdout too (as spindle plan and spindle profile)
    assert _invoke("graph", str(model_path)).stdout == result.stdout


def test_output_is_byte_identical_across_runs_and_formats(model_path, tmp_path):
    a, b, j = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "g.json"
    for out in (a, b, j):
        assert _invoke("graph", str(model_path), "-o", str(out)).exit_code == 0
    assert a.read_bytes() == b.read_bytes()
    assert load(str(j), MetaOpGraph) == load(str(a), MetaOpGraph)


def test_check_compares_and_never_writes(model_path, tmp_path):
    out = Path("g.yaml")
    missing = _invoke("graph", str(model_path), "-o", str(out), "--check")
    assert missing.exit_code == 1 and not out.exists()
    _invoke("graph", str(model_path), "-o", str(out))
    fresh = _invoke("graph", str(model_path), "-o", str(out), "--check")
    assert fresh.exit_code == 0, fresh.stderr
    assert "up to date" in _said(fresh.stderr)
    stale_text = out.read_text().replace("batch_size: 8", "batch_size: 9", 1)
    out.write_text(stale_text)
    stale = _invoke("graph", str(model_path), "-o", str(out), "--check")
    assert stale.exit_code == 1
    assert "out of date" in _said(stale.stderr)
    # what differs: the one line, as it is and as it would be
    at, line = next((i, x) for i, x in enumerate(stale_text.splitlines())
                    if "batch_size: 9" in x)
    assert f"  text: 2 changed line(s), the first at line {at + 1}" in stale.stderr
    assert f"  -{line}\n  +{line.replace('9', '8')}\n" in stale.stderr
    assert out.read_text() == stale_text


def test_check_shows_where_a_long_line_differs(model_path):
    # a signature differs only in its dtype, at its end: beyond the width a line is shown at
    out = Path("g.yaml")
    _invoke("graph", str(model_path), "--dtype", "fp32", "-o", str(out))
    stale = _invoke("graph", str(model_path), "-o", str(out), "--check")
    assert stale.exit_code == 1
    shown = [x.strip() for x in stale.stderr.splitlines() if "|dtype=" in x]
    assert shown and all(len(x) <= 100 for x in shown)
    assert any(x.startswith("-...") and x.endswith("dtype=fp32") for x in shown), shown
    assert any(x.startswith("+...") and x.endswith("dtype=bf16") for x in shown), shown


def test_task_selection_and_task_sets(model_path):
    one = yaml.safe_load(_invoke("graph", str(model_path), "--tasks", "pairs_big", "-o",
                                 "-").stdout)
    assert one["tasks"] == ["pairs_big"]
    assert {m["task"] for m in one["metaops"]} == {"pairs_big"}
    named = yaml.safe_load(_invoke("graph", str(model_path), "--task-set", "one", "-o",
                                   "-").stdout)
    assert named["tasks"] == ["pairs"]
    spaced = yaml.safe_load(_invoke("graph", str(model_path), "--tasks", "pairs_big, pairs",
                                    "-o", "-").stdout)
    assert spaced["tasks"] == ["pairs", "pairs_big"]


def test_dtype_sets_activation_bytes(model_path):
    graphs = {
        dtype: yaml.safe_load(_invoke("graph", str(model_path), "--dtype", dtype, "-o",
                                      "-").stdout)
        for dtype in ("bf16", "fp32")
    }
    enc = {d: next(m for m in g["metaops"] if m["id"] == "pairs/text_enc")
           for d, g in graphs.items()}
    assert graphs["fp32"]["dtype"] == "fp32"
    assert enc["fp32"]["activation_out_bytes"] == 2 * enc["bf16"]["activation_out_bytes"]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_graph_works_on_every_shipped_model(path, tmp_path):
    out = tmp_path / "g.yaml"
    result = _invoke("graph", str(path), "-o", str(out))
    assert result.exit_code == 0, result.stderr
    graph = load(str(out), MetaOpGraph)
    model = load(str(path), ModelSpec)
    assert graph.model == model.name
    assert len(graph.metaops) == sum(len(t.steps) for t in model.tasks)
    for name in model.task_sets:
        sub = _invoke("graph", str(path), "--task-set", name, "-o", str(tmp_path / "s.yaml"))
        assert sub.exit_code == 0, sub.stderr
        assert load(str(tmp_path / "s.yaml"), MetaOpGraph).tasks == tuple(
            t.name for t in model.tasks if t.name in model.task_sets[name])


@pytest.mark.parametrize("path", COMMITTED_GRAPHS, ids=[p.stem for p in COMMITTED_GRAPHS])
def test_committed_graphs_are_up_to_date(path, monkeypatch):
    # A committed graph must be exactly what `spindle graph` makes from its model today.
    monkeypatch.chdir(REPO)  # inputs record the model path relative to the repository
    graph = load(str(path), MetaOpGraph)
    model_path = graph.input("model").path
    model = load(model_path, ModelSpec)
    fresh = build_graph(model, tasks=list(graph.tasks), dtype=graph.dtype,
                        inputs=[input_ref(model, model_path)])
    assert rendered_for(fresh, str(path)) == path.read_text(), (
        f"{path.relative_to(REPO)} is stale: regenerate it with spindle graph {model_path} "
        f"--tasks {','.join(graph.tasks)} -o {path.relative_to(REPO)}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("make", "said"), [
    (lambda p: __import__("os").mkfifo(p), "not a regular file"),
    (lambda p: p.symlink_to(p.name), "cannot read: Too many levels of symbolic links"),
], ids=["fifo", "symlink-loop"])
def test_check_refuses_an_output_it_cannot_compare_with(tmp_path, make, said):
    """A pipe would block the comparison forever; a symlink loop cannot be read."""
    import subprocess
    import sys

    target = tmp_path / "g.yaml"
    make(target)
    r = subprocess.run([sys.executable, "-m", "spindle_cli", "graph",
                        str(REPO / "models" / "tiny-clip.yaml"), "-o", str(target), "--check"],
                       capture_output=True, text=True, timeout=50, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"error: {target}: {said}"), r.stderr


def test_a_read_only_output_is_refused_before_any_work(model_path, spindle):
    out = Path("g.yaml")
    assert spindle("graph", str(model_path), "-o", str(out)).exit_code == 0
    written = out.read_text()
    out.chmod(0o444)
    # --check only reads it
    assert spindle("graph", str(model_path), "-o", str(out), "--check").exit_code == 0
    model_path.write_text("kind: model\n")  # the output is refused before the model is read
    result = spindle("graph", str(model_path), "-o", str(out))
    assert result.exit_code == 2, result.stderr
    assert _said(result.stderr) == ("error: g.yaml: cannot write: read-only file hint: make it "
                                    f"writable (chmod u+w {out.resolve()}) to replace it")
    assert out.read_text() == written


def test_a_graph_that_would_not_load_is_not_written(tmp_path):
    """Sizes a model may hold can multiply into byte counts beyond 64 bits: the graph is
    refused before it is written, not by the next stage."""
    data = yaml.safe_load((REPO / "models" / "tiny-clip.yaml").read_text())
    # every size at its bound (modules' widths 2^20, sequences 2^24, batches 2^30)
    for module in data["modules"].values():
        module["hidden"] = 2**20
        if "in_dim" in module and module["kind"] != "patch_embed":
            module["in_dim"] = 2**20
        if "ffn" in module:
            module["ffn"] = 2**20
        if "max_seq_len" in module:
            module["max_seq_len"] = 2**24
    for task in data["tasks"]:
        task["batch_size"] = 2**30
        for item in task["inputs"].values():
            item["seq_len"] = 2**24
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "g.yaml"
    r = CliRunner().invoke(cli, ["graph", str(model), "-o", str(out)])
    assert r.exit_code != 0 and not out.exists()
    assert isinstance(r.exception, SpindleError)
    assert str(r.exception).startswith(f"{out}: metaops[")
    assert "expected a 64-bit integer" in str(r.exception)
