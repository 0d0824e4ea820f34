"""Bad inputs through the CLI: each gives exactly one line `error: <file>: <field>: <problem>` on
stderr (optionally followed by one `hint:` line), exit code 2, no traceback, nothing written.

Files are written into a temporary working directory and named relatively, as a user would.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

Data = dict[str, Any]


def _edit(fn: Callable[[Data], None]) -> Callable[[Data], Data]:
    def apply(data: Data) -> Data:
        data = copy.deepcopy(data)
        fn(data)
        return data

    return apply


def _step(data: Data, name: str, task: int = 0) -> Data:
    (step,) = [s for s in data["tasks"][task]["steps"] if s["name"] == name]
    return step


def _cycle(d: Data) -> None:
    # text_enc also consumes text_proj, which consumes text_enc
    _step(d, "text_enc")["inputs"] = ["text_embed", "text_proj"]


def _dangling_branch(d: Data) -> None:
    d["tasks"][0]["steps"].append({"name": "extra", "module": "text_proj", "inputs": ["text_enc"]})


def _rename_module(d: Data, old: str, new: str) -> None:
    d["modules"] = {new if k == old else k: v for k, v in d["modules"].items()}
    for task in d["tasks"]:
        for step in task["steps"]:
            if step["module"] == old:
                step["module"] = new


# id -> (edit of the valid model, expected `error:` line after the file name)
def _two_vocabularies(d: Data) -> None:
    """A second embedding, of another vocabulary, reading the first task's text input."""
    d["modules"]["text_embed_2"] = {**d["modules"]["text_embed"], "vocab_size": 60}
    steps = d["tasks"][0]["steps"]
    first = next(s for s in steps if s["module"] == "text_embed")
    enc = next(s for s in steps if first["name"] in s["inputs"])
    steps.append({"name": "text_embed_2", "module": "text_embed_2", "inputs": first["inputs"]})
    enc["inputs"] = [first["name"], "text_embed_2"]


MODEL_CASES: dict[str, tuple[Callable[[Data], Data], str]] = {
    "unknown-kind": (_edit(lambda d: d.update(kind="spaceship")), "kind: unknown kind "
                     "'spaceship'"),
    "newer-version": (_edit(lambda d: d.update(version=9)), "version: model version 9 is newer "
                      "than this spindle reads (1)"),
    "missing-field": (_edit(lambda d: d["tasks"][1].pop("batch_size")),
                      "tasks[1].batch_size: missing required field"),
    "extra-field": (_edit(lambda d: d["modules"]["text_enc"].update(dropout=0.1)),
                    "modules.text_enc.dropout: unknown field"),
    "misspelled-field": (_edit(lambda d: d["modules"]["text_enc"].update(
                             num_layer=d["modules"]["text_enc"].pop("num_layers"))),
                         "modules.text_enc.num_layer: unknown field (did you mean "
                         "'num_layers'?)"),
    "wrong-type": (_edit(lambda d: d["modules"]["image_enc"].update(num_layers="two")),
                   "modules.image_enc.num_layers: expected an integer, got a string"),
    "negative-size": (_edit(lambda d: d["tasks"][0].update(batch_size=-8)),
                      "tasks[0].batch_size: must be >= 1, got -8"),
    "zero-hidden": (_edit(lambda d: d["modules"]["clip_loss"].update(hidden=0)),
                    "modules.clip_loss.hidden: must be >= 1, got 0"),
    "unknown-module": (_edit(lambda d: _step(d, "image_enc", 1).update(module="vision_enc")),
                       "tasks[1].steps[4].module: unknown module 'vision_enc' (the model's "
                       "modules: "),
    "misspelled-module": (_edit(lambda d: _step(d, "image_enc", 1).update(module="image_encc")),
                          "tasks[1].steps[4].module: unknown module 'image_encc' (did you "
                          "mean 'image_enc'?)"),
    "cycle": (_edit(_cycle), "tasks[0].steps: cycle"),
    "missing-task-input": (_edit(lambda d: _step(d, "image_embed").update(inputs=["audio"])),
                           "tasks[0].steps[3].inputs[0]: unknown input or step 'audio'"),
    "unused-input": (_edit(lambda d: d["tasks"][0]["inputs"].update(audio={"seq_len": 4})),
                     "tasks[0].inputs.audio: input is not used by any step"),
    "shape-mismatch": (_edit(lambda d: d["tasks"][0]["inputs"]["image"].update(dim=10)),
                       "tasks[0].steps[3].inputs: feature width 10 != in_dim 12 of "
                       "'image_embed'"),
    "sequence-too-long": (_edit(lambda d: d["tasks"][0]["inputs"]["text"].update(seq_len=9)),
                          "tasks[0].steps[0].inputs: sequence 9 exceeds max_seq_len 8"),
    "duplicate-step": (_edit(lambda d: _step(d, "image_enc").update(name="text_enc")),
                       "tasks[0].steps[4].name: duplicate step name 'text_enc'"),
    "duplicate-task": (_edit(lambda d: d["tasks"][1].update(name="pairs")),
                       "tasks[1].name: duplicate task name 'pairs'"),
    "heads-not-dividing-hidden": (_edit(lambda d: d["modules"]["text_enc"].update(heads=3)),
                                  "modules.text_enc.heads: hidden 16 is not divisible by 3"),
    "branch-without-loss": (_edit(_dangling_branch),
                            "tasks[0].steps[7]: output of 'extra' is not used"),
    "unknown-task-in-set": (_edit(lambda d: d["task_sets"].update(two=["pairs", "solo"])),
                            "task_sets.two[1]: unknown task 'solo' (the model's tasks: pairs, "),
    "misspelled-task-in-set": (_edit(lambda d: d["task_sets"].update(two=["pair"])),
                               "task_sets.two[0]: unknown task 'pair' (did you mean 'pairs'?)"),
    "bad-choice": (_edit(lambda d: d["modules"]["text_proj"].update(pool="max")),
                   "modules.text_proj.pool: must be one of 'cls', 'mean', got 'max'"),
    "null-choice": (_edit(lambda d: d["modules"]["text_proj"].update(pool=None)),
                    "modules.text_proj.pool: must be one of 'cls', 'mean', got null"),
    "step-named-like-an-input": (_edit(lambda d: _step(d, "text_embed").update(name="text")),
                                 "tasks[0].steps[0].name: step name 'text' is also an input of "
                                 "the task"),
    "contrastive-batch-of-one": (_edit(lambda d: d["tasks"][0].update(batch_size=1)),
                                 "tasks[0].batch_size: 1, but step 'loss' is a contrastive loss"),
    "task-name-with-slash": (_edit(lambda d: d["tasks"][0].update(name="a/b")),
                             "tasks[0].name: 'a/b': a task name cannot hold '/'"),
    "task-name-with-comma": (_edit(lambda d: d["tasks"][0].update(name="a,b")),
                             "tasks[0].name: 'a,b': a task name cannot hold ','"),
    "task-name-with-line-break": (_edit(lambda d: d["tasks"][0].update(name="a\nb")),
                                  "tasks[0].name: 'a\\nb': must not hold line breaks or "
                                  "control characters"),
    "task-name-ending-in-a-space": (_edit(lambda d: d["tasks"][0].update(name="pairs ")),
                                    "tasks[0].name: 'pairs ': a task name cannot begin or end "
                                    "with a space (--tasks strips the names it is given)"),
    "module-name-with-line-break": (_edit(lambda d: _rename_module(d, "text_enc", "text\nenc")),
                                    "tasks[0].steps[1].module: 'text\\nenc': must not hold "
                                    "line breaks or control characters"),
    "blank-module-name": (_edit(lambda d: _rename_module(d, "text_enc", " ")),
                          "modules. : a module needs a name"),
    "blank-step-name": (_edit(lambda d: d["tasks"][0]["steps"][0].update(name="")),
                        "tasks[0].steps[0].name: a step needs a name"),
    "two-vocabularies-for-one-input": (_edit(lambda d: _two_vocabularies(d)),
                                       "tasks[0].inputs.text: these token ids feed embeddings "
                                       "of vocab_size 50, 60"),
    "no-tasks": (_edit(lambda d: (d.update(tasks=[]), d.pop("task_sets"))),
                 "tasks: a model needs at least one task"),
    "empty-name": (_edit(lambda d: d.update(name=" ")), "name: must not be blank"),
    "empty-task-set": (_edit(lambda d: d["task_sets"].update(none=[])),
                       "task_sets.none: a task set needs at least one task"),
    "field-of-another-kind": (_edit(lambda d: d["modules"]["text_proj"].update(heads=4)),
                              "modules.text_proj.heads: a projection has no heads (it applies "
                              "to transformer_encoder, transformer_decoder); remove it"),
    "pool-on-a-non-projection": (_edit(lambda d: d["modules"]["image_enc"].update(pool="mean")),
                                 "modules.image_enc.pool: a transformer_encoder does not pool"),
    "layers-of-an-embedding": (_edit(lambda d: d["modules"]["text_embed"].update(num_layers=2)),
                               "modules.text_embed.num_layers: an embedding has exactly one "
                               "layer"),
}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _listing(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _assert_one_line_error(result: Any, expected: str | re.Pattern[str]) -> None:
    lines = result.stderr.splitlines()
    assert result.exit_code == 2, result.stderr
    assert result.stdout == "", result.stdout
    assert "Traceback" not in result.stderr
    assert len(lines) in (1, 2), f"expected one error line (and a hint), got:\n{result.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    found = expected.search(lines[0]) if isinstance(expected, re.Pattern) else expected in lines[0]
    assert found, f"{expected!r} not in {lines[0]!r}"
    if len(lines) == 2:
        assert lines[1].startswith("hint: "), lines[1]


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_bad_model_file(case, small_model_data, workdir, spindle):
    edit, problem = MODEL_CASES[case]
    Path("m.yaml").write_text(yaml.safe_dump(edit(small_model_data), sort_keys=False))
    before = _listing(workdir)
    result = spindle("graph", "m.yaml", "-o", "g.yaml")
    _assert_one_line_error(result, f"error: m.yaml: {problem}")
    assert _listing(workdir) == before
    again = spindle("validate", "m.yaml")
    _assert_one_line_error(again, f"error: m.yaml: {problem}")


# id -> (files to create, argv, expected `error:` line prefix)
FILE_CASES: dict[str, tuple[dict[str, str], list[str], str]] = {
    "malformed-yaml": ({"m.yaml": "kind: model\nmodules: {a: [1, 2}\n"},
                       ["graph", "m.yaml", "-o", "g.yaml"],
                       "error: m.yaml: invalid YAML at line 2"),
    "malformed-json": ({"m.json": '{"kind": "model", "version": 1,,}'},
                       ["graph", "m.json", "-o", "g.yaml"],
                       "error: m.json: invalid JSON at line 1"),
    "empty-file": ({"m.yaml": ""}, ["validate", "m.yaml"],
                   "error: m.yaml: expected a mapping at the top level"),
    "missing-file": ({}, ["graph", "absent.yaml", "-o", "g.yaml"],
                     "error: absent.yaml: no such file"),
    "directory-as-file": ({"d.yaml/x": ""}, ["show", "d.yaml"],
                          "error: d.yaml: is a directory, expected a file"),
    # a directory's name has no suffix to judge
    "directory-without-suffix": ({"d/x": ""}, ["show", "d"],
                                 "error: d: is a directory, expected a file"),
    "file-as-models-dir": ({"m.yaml": ""}, ["bench", "--quick", "--models-dir", "m.yaml"],
                           "error: --models-dir m.yaml: is not a directory"),
    "missing-clusters-dir": ({"models/x": ""}, ["bench", "--quick", "--clusters-dir", "nope"],
                             "error: --clusters-dir nope: no such directory"),
    "bad-extension": ({"m.txt": "kind: model\n"}, ["validate", "m.txt"],
                      "error: m.txt: unknown file extension"),
    # stdin names no file to record in what is made from it
    "stdin-as-input": ({}, ["graph", "-", "-o", "g.yaml"],
                       "error: -: inputs are read from files, not stdin"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_bad_file(case, workdir, spindle):
    files, argv, expected = FILE_CASES[case]
    for name, text in files.items():
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(text)
    before = _listing(workdir)
    _assert_one_line_error(spindle(*argv), expected)
    assert _listing(workdir) == before


# Option errors on a valid model: id -> (argv after the model file, expected error line)
OPTION_CASES: dict[str, tuple[list[str], str]] = {
    "unknown-task": (["--tasks", "pairs,solo", "-o", "g.yaml"],
                     "error: m.yaml: tasks: unknown task 'solo' in --tasks (known: "),
    "misspelled-task": (["--tasks", "pair", "-o", "g.yaml"],
                        "error: m.yaml: tasks: unknown task 'pair' in --tasks (did you mean "
                        "'pairs'?)"),
    "unknown-task-set": (["--task-set", "seven", "-o", "g.yaml"],
                         "error: m.yaml: task_sets: unknown task set 'seven'"),
    "tasks-and-task-set": (["--tasks", "pairs", "--task-set", "one", "-o", "g.yaml"],
                           "error: --tasks and --task-set are mutually exclusive"),
    "repeated-task": (["--tasks", "pairs,pairs", "-o", "g.yaml"],
                      "error: --tasks: task 'pairs' is given twice in 'pairs,pairs'"),
    "output-dir-missing": (["-o", "out/g.yaml"],
                           "error: out/g.yaml: output directory 'out' does not exist"),
    "output-bad-extension": (["-o", "g.txt"], "error: g.txt: unknown file extension"),
    # click's own usage errors, one line too (and a hint naming the command's help)
    "bad-choice": (["--dtype", "fp8", "-o", "g.yaml"],
                   "error: Invalid value for '--dtype': 'fp8' is not one of 'bf16', 'fp16', "
                   "'fp32'."),
    # click words it by version (8.2: "No such option: --nope", 8.4: "No such option '--nope'")
    "unknown-option": (["--nope", "-o", "g.yaml"],
                       re.compile(r"^error: No such option(: | ')--nope\b")),
}


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_bad_option(case, small_model_data, workdir, spindle):
    argv, expected = OPTION_CASES[case]
    Path("m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    before = _listing(workdir)
    _assert_one_line_error(spindle("graph", "m.yaml", *argv), expected)
    assert _listing(workdir) == before


def test_a_usage_error_names_the_help_of_its_command(workdir, spindle):
    result = spindle("frobnicate")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == ["error: No such command 'frobnicate'.",
                                          "hint: see 'spindle --help'"]
    result = spindle("plan")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: Missing argument 'GRAPH'.",
                                          "hint: see 'spindle plan --help'"]
    result = spindle("plan", "g.yaml", "p.yaml")
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: Missing option '--cluster'.",
                                          "hint: see 'spindle plan --help'"]


def test_wrong_kind_of_input(cluster_data, workdir, spindle):
    Path("c.yaml").write_text(yaml.safe_dump(cluster_data, sort_keys=False))
    result = spindle("graph", "c.yaml", "-o", "g.yaml")
    _assert_one_line_error(result, "error: c.yaml: kind: expected a 'model' artifact, got "
                                   "'cluster'")
    assert not Path("g.yaml").exists()


def test_a_stage_given_an_earlier_stage_names_the_command_between(small_model_data, workdir,
                                                                  spindle):
    Path("m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    result = spindle("profile", "m.yaml", "--hardware", "h100", "-o", "p.yaml")
    _assert_one_line_error(result, "error: m.yaml: kind: expected a 'metaop_graph' artifact, "
                                   "got 'model'")
    assert result.stderr.splitlines()[1] == ("hint: spindle graph m.yaml -o GRAPH makes its "
                                             "MetaOp graph")
    assert not Path("p.yaml").exists()


def test_show_option_for_another_kind(small_model_data, workdir, spindle):
    Path("m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    result = spindle("show", "m.yaml", "--gantt", "g.svg")
    _assert_one_line_error(result, "error: m.yaml: --gantt does not apply to a model artifact")
    assert not Path("g.svg").exists()


def test_newer_version_prints_a_hint(small_model_data, workdir, spindle):
    Path("m.yaml").write_text(yaml.safe_dump(dict(small_model_data, version=2)))
    lines = spindle("validate", "m.yaml").stderr.splitlines()
    assert lines == ["error: m.yaml: version: model version 2 is newer than this spindle reads "
                     "(1)", "hint: upgrade spindle or regenerate the file"]


def test_long_errors_stay_on_one_line(small_model_data, workdir, spindle):
    # A long path and a long problem must not be wrapped at the terminal width (80 columns
    # when stderr is not a terminal): scripts and users grep for the single `error:` line.
    deep = Path("a-rather-long-directory-name-for-models") / "and-a-nested-one-too"
    deep.mkdir(parents=True)
    path = deep / "model-with-a-long-name.yaml"
    data = copy.deepcopy(small_model_data)
    _step(data, "image_enc", 1)["module"] = "a_module_name_that_does_not_exist_anywhere"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle("validate", str(path))
    _assert_one_line_error(result, "unknown module 'a_module_name_that_does_not_exist_anywhere'")


def test_validate_names_every_invalid_file_not_only_the_first(small_model_data, workdir,
                                                               spindle):
    # a CI log of `spindle validate plans/*.yaml` names each file that needs work
    Path("good.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    Path("bad.yaml").write_text("kind: model\nversion: 1\n")
    Path("worse.json").write_text("{")
    result = spindle("validate", "good.yaml", "bad.yaml", "worse.json", "good.yaml")
    assert result.exit_code == 2
    assert result.stdout.splitlines() == ["ok good.yaml (model)", "ok good.yaml (model)"]
    assert result.stderr.splitlines() == [
        "error: bad.yaml: name: missing required field",
        "error: worse.json: invalid JSON at line 1: Expecting property name enclosed in double "
        "quotes",
        "error: 2 of 4 files are invalid (named above)",
    ]


def test_end_to_end_exit_code_and_no_traceback(small_model_data, workdir):
    # The same path through the installed entry point, in a fresh interpreter.
    data = copy.deepcopy(small_model_data)
    data["modules"]["text_enc"]["heads"] = 5
    Path("m.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "SPINDLE_DEBUG"}
    proc = subprocess.run([sys.executable, "-m", "spindle_cli", "graph", "m.yaml", "-o", "g.yaml"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == ("error: m.yaml: modules.text_enc.heads: hidden 16 is not divisible "
                           "by 5\n")
    assert not Path("g.yaml").exists()
    # with SPINDLE_DEBUG=1 the traceback comes first, and the line and exit code stay
    proc = subprocess.run([sys.executable, "-m", "spindle_cli", "graph", "m.yaml", "-o", "g.yaml"],
                          capture_output=True, text=True, env={**env, "SPINDLE_DEBUG": "1"},
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr
    assert proc.stderr.endswith("error: m.yaml: modules.text_enc.heads: hidden 16 is not "
                                "divisible by 5\n")
    assert not Path("g.yaml").exists()


@pytest.mark.parametrize(("args", "expected"), [
    (("show", "p.yaml", "--gantt", "g.bmp"), "error: g.bmp: unknown image type (expected .svg "
                                             "or .png)"),
    (("show", "p.yaml", "--utilization", "nodir/u.png"), "error: nodir/u.png: output directory "
                                                         "'nodir' does not exist"),
    (("simulate", "p.yaml", "--gantt", "g.jpg"), "error: g.jpg: unknown image type"),
    (("show", "f.yaml", "--plot", "c.pdf"), "error: c.pdf: unknown image type"),
    # an image is no text for stdout
    (("show", "p.yaml", "--gantt", "-"), "error: -: an image cannot go to stdout"),
    (("show", "p.yaml", "--utilization", "-"), "error: -: an image cannot go to stdout"),
    (("simulate", "p.yaml", "--gantt", "-"), "error: -: an image cannot go to stdout"),
    (("show", "f.yaml", "--plot", "-"), "error: -: an image cannot go to stdout"),
    # a directory that refuses new files even where os.access says yes (to root)
    (("show", "p.yaml", "--gantt", "/proc/g.png"), "error: /proc/g.png: cannot write in '/proc'"),
    (("simulate", "p.yaml", "--gantt", "/proc/g.png"),
     "error: /proc/g.png: cannot write in '/proc'"),
    # two images under one name: the second would replace the first
    (("show", "p.yaml", "--gantt", "g.svg", "--utilization", "./g.svg"),
     "error: ./g.svg: given for both --gantt and --utilization (the second image would "
     "replace the first)"),
    (("simulate", "p.yaml", "--gantt", "g.svg", "--utilization", "./g.svg"),
     "error: ./g.svg: given for both --gantt and --utilization (the second image would "
     "replace the first)"),
    (("simulate", "p.yaml", "--utilization", "u.gif"), "error: u.gif: unknown image type"),
])
def test_a_bad_image_name_fails_before_any_output(args, expected, workdir, spindle):
    root = Path(__file__).resolve().parents[2]
    Path("p.yaml").write_text((root / "plans" / "tiny-clip-local-cpu.yaml").read_text())
    Path("f.yaml").write_text((root / "profiles" / "tiny-clip-local-cpu.yaml").read_text())
    result = spindle(*args)
    _assert_one_line_error(result, expected)
    assert sorted(p.name for p in Path().iterdir()) == ["f.yaml", "p.yaml"]


@pytest.mark.parametrize(("args", "expected"), [
    (("graph", "m.yaml", "-o", "d.yaml"), "error: d.yaml: is a directory"),
    (("graph", "m.yaml", "--check", "-o", "d.yaml"), "error: d.yaml: is a directory"),
    (("graph", "m.yaml", "-o", ""),
     "error: '': an empty file name (expected a .yaml, .yml or .json file)"),
    (("graph", "m.yaml", "--check", "-o", "file/g.yaml"),
     "error: file/g.yaml: 'file' is not a directory"),
    (("profile", "g.yaml", "--hardware", "a800", "-o", "nodir/f.yaml"),
     "error: nodir/f.yaml: output directory 'nodir' does not exist"),
    (("profile", "g.yaml", "--hardware", "a800", "-o", "f.txt"),
     "error: f.txt: unknown file extension (expected .yaml, .yml or .json)"),
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "-o", "d.yaml"),
     "error: d.yaml: is a directory"),
    (("simulate", "p.yaml", "--gantt", "d.svg"), "error: d.svg: is a directory"),
    (("show", "f.yaml", "--plot", "file/c.png"), "error: file/c.png: 'file' is not a directory"),
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "-o", "/proc/p.yaml"),
     "error: /proc/p.yaml: cannot write in '/proc'"),
    # a symlink is written through: its target's directory must take the file
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "-o", "link.yaml"),
     "error: link.yaml: cannot write in '/proc'"),
    # a read-only file is not replaced
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "-o", "ro.yaml"),
     "error: ro.yaml: cannot write: read-only file"),
    (("simulate", "p.yaml", "--gantt", "ro.svg"), "error: ro.svg: cannot write: read-only file"),
    # an analytic model of other devices than the cluster's
    (("profile", "g.yaml", "--hardware", "h100", "--cluster", "c.yaml", "-o", "p.yaml"),
     "error: --hardware h100 models H100-SXM5-80GB devices, but c.yaml has cpu-core"),
    # --check has nothing to compare with on stdout
    (("graph", "m.yaml", "--check", "-o", "-"),
     "error: --check compares with a file: give it as -o FILE, not '-'"),
    (("profile", "g.yaml", "--hardware", "a800", "--check", "-o", "-"),
     "error: --check compares with a file: give it as -o FILE, not '-'"),
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "--check", "-o", "-"),
     "error: --check compares with a file: give it as -o FILE, not '-'"),
    # an output that is one of the command's inputs would destroy it
    (("graph", "m.yaml", "-o", "m.yaml"),
     "error: m.yaml: is also an input of this command (m.yaml); writing it would replace"),
    (("profile", "g.yaml", "--hardware", "a800", "-o", "./g.yaml"),
     "error: ./g.yaml: is also an input of this command (g.yaml)"),
    (("plan", "g.yaml", "f.yaml", "--cluster", "c.yaml", "-o", "c.yaml"),
     "error: c.yaml: is also an input of this command (c.yaml)"),
    # a name longer than the file system takes (it was an internal error, exit 123)
    (("graph", "m.yaml", "-o", f"{'n' * 300}.yaml"), ".yaml: File name too long"),
    (("show", "p.yaml", "--gantt", f"{'n' * 300}.svg"), ".svg: File name too long"),
    # a trailing slash: Path drops it, and new.yaml was written where a shell would refuse
    (("graph", "m.yaml", "-o", "new.yaml/"),
     "error: new.yaml/: names a directory (a trailing slash), not a file"),
    (("show", "p.yaml", "--gantt", "new.svg/"),
     "error: new.svg/: names a directory (a trailing slash), not a file"),
])
def test_an_unwritable_output_fails_before_any_work(args, expected, workdir, spindle):
    # an output that is a directory, under a file, read-only, or where no file can be made, is
    # refused up front: one line, the summary of work done is not printed, and nothing is
    # written
    root = Path(__file__).resolve().parents[2]
    sources = {"m.yaml": "models/tiny-clip.yaml", "g.yaml": "graphs/tiny-clip.yaml",
               "f.yaml": "profiles/tiny-clip-local-cpu.yaml", "c.yaml": "clusters/local-cpu.yaml",
               "p.yaml": "plans/tiny-clip-local-cpu.yaml"}
    for name, source in sources.items():
        Path(name).write_text((root / source).read_text())
    Path("file").write_text("")
    Path("d.yaml").mkdir()
    Path("d.svg").mkdir()
    Path("link.yaml").symlink_to("/proc/p.yaml")
    for name in ("ro.yaml", "ro.svg"):
        Path(name).write_text("")
        Path(name).chmod(0o444)
    before = _listing(Path())
    result = spindle(*args)
    _assert_one_line_error(result, expected)
    assert _listing(Path()) == before


def test_a_name_too_long_to_look_at_is_bad_input_not_a_bug(workdir, spindle):
    # given, or recorded in an artifact: Path.is_dir and is_file raise ENAMETOOLONG (and
    # EACCES in a directory without search permission), an internal error (exit 123)
    root = Path(__file__).resolve().parents[2]
    long = f"{'n' * 300}.yaml"
    _assert_one_line_error(spindle("validate", long), f"{long}: File name too long")
    plan = yaml.safe_load((root / "plans" / "tiny-clip-local-cpu.yaml").read_text())
    plan["inputs"][0]["path"] = long
    Path("p.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))
    result = spindle("simulate", "p.yaml")
    _assert_one_line_error(result, f"p.yaml: inputs[0].path: metaop_graph file {long!r} not "
                                   "found")


def test_an_input_path_with_a_line_break_is_refused_before_any_work(small_model_data,
                                                                    workdir, spindle):
    # the path is recorded in the output's inputs, whose strings are one line: the model was
    # contracted (and a plan planned) before the write refused it
    Path("m\nx.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    before = _listing(workdir)
    result = spindle("graph", "m\nx.yaml", "-o", "g.yaml")
    _assert_one_line_error(result, "error: 'm\\nx.yaml': a path with a line break or control "
                                   "character cannot be recorded in the inputs of 'g.yaml'")
    assert _listing(workdir) == before


def test_check_against_a_file_that_is_not_text_says_so(small_model_data, workdir, spindle):
    Path("m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    Path("g.yaml").write_bytes(bytes(range(128, 256)) * 8)
    result = spindle("graph", "m.yaml", "-o", "g.yaml", "--check")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[:2] == ["g.yaml: out of date (regenerate it)",
                                              "  the file is not UTF-8 text"]


@pytest.mark.parametrize(("source", "said", "error"), [
    ("models/tiny-clip.yaml", "cluster",
     "kind: says 'cluster', but its fields are a 'model' artifact's (modules, task_sets, "
     "tasks: not a cluster's)"),
    ("plans/tiny-clip-local-cpu.yaml", "profile",
     "kind: says 'profile', but its fields are a 'plan' artifact's (candidate, cluster, "
     "estimated_iteration_ms, ...: not a profile's)"),
])
def test_a_kind_header_that_its_fields_contradict_is_named(workdir, spindle, source, said,
                                                           error):
    # it was refused for its first field, as a typo: 'modules: unknown field (did you mean
    # 'num_nodes'?)'
    root = Path(__file__).resolve().parents[2]
    text, count = re.subn(r"^kind: \w+$", f"kind: {said}", (root / source).read_text(),
                          count=1, flags=re.M)
    assert count == 1
    Path("x.yaml").write_text(text)
    result = spindle("validate", "x.yaml")
    _assert_one_line_error(result, f"error: x.yaml: {error}")
    assert result.stderr.splitlines()[1] == "hint: fix the kind header"


def test_an_input_whose_name_begins_with_a_space_is_recorded(small_model_data, workdir,
                                                            spindle):
    # a recorded path is a file's, not a name: the rule that names do not begin with a space
    # refused the graph once it was made ('inputs[0].path: must not begin or end with a space')
    Path(" m.yaml").write_text(yaml.safe_dump(small_model_data, sort_keys=False))
    result = spindle("graph", " m.yaml", "-o", "g.yaml")
    assert result.exit_code == 0, result.stderr
    assert spindle("validate", "g.yaml").stdout == "ok g.yaml (metaop_graph)\n"


@pytest.mark.parametrize(("time_ms", "problem"), [
    (0.0, "a feasible point takes at least 1e-12 ms, got 0.0"),
    (1e308, "must be <= 1000000000000.0, got 1e+308 (about 30 years; an iteration takes "
            "seconds)")])
@pytest.mark.parametrize("command", [("validate",), ("show", "--plot", "c.png")])
def test_a_feasible_profile_points_time_is_bounded_both_ways(workdir, spindle, command,
                                                             time_ms, problem):
    # `show --plot` divided by 0: exit 123, where validate said ok
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "profiles" / "tiny-clip-local-cpu.yaml").read_text())
    curve, point = next((i, j) for i, c in enumerate(data["curves"])
                        for j, p in enumerate(c["points"]) if p["feasible"])
    data["curves"][curve]["points"][point]["time_ms"] = time_ms
    Path("p.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    result = spindle(*command[:1], "p.yaml", *command[1:])
    _assert_one_line_error(result, f"error: p.yaml: curves[{curve}].points[{point}].time_ms: "
                                   f"{problem}")
    assert not Path("c.png").exists()


def test_a_file_that_is_not_utf8_names_the_line_of_its_first_bad_byte(small_model_data,
                                                                       workdir, spindle):
    # it named the byte's offset in the file (position 4533), which no editor shows
    text = yaml.safe_dump(small_model_data, sort_keys=False)
    lines = text.splitlines(keepends=True)
    Path("m.yaml").write_bytes("".join(lines[:3]).encode() + b"# caf\xe9\n"
                               + "".join(lines[3:]).encode())
    result = spindle("validate", "m.yaml")
    _assert_one_line_error(result, "error: m.yaml: not UTF-8 text: byte 0xe9 at line 4")
    # lines as YAML counts them: old Mac files end them with a carriage return alone
    Path("m.yaml").write_bytes(b"kind: model\rversion: 1\r# caf\xe9\r")
    result = spindle("validate", "m.yaml")
    _assert_one_line_error(result, "error: m.yaml: not UTF-8 text: byte 0xe9 at line 3")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [("show", "plans/tiny-clip-local-cpu.yaml"),
                                  ("graph", "models/tiny-clip.yaml", "-o", "-")])
def test_a_full_stdout_is_a_one_line_error_not_a_bug(args):
    """stdout on a full disk: the machine's failure, said in one line with exit 2 (it was
    'internal error ... a bug in spindle', exit 123)."""
    root = Path(__file__).resolve().parents[2]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "spindle_cli", *args], cwd=root,
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "error: stdout: cannot write: No space left on device\n"


def test_a_byte_order_mark_is_read_past_in_json_as_in_yaml(workdir, spindle):
    root = Path(__file__).resolve().parents[2]
    data = yaml.safe_load((root / "clusters" / "local-cpu.yaml").read_text())
    Path("c.json").write_text("\ufeff" + json.dumps(data), encoding="utf-8")
    Path("c.yaml").write_text("\ufeff" + yaml.safe_dump(data), encoding="utf-8")
    for name in ("c.json", "c.yaml"):
        result = spindle("validate", name)
        assert result.exit_code == 0, result.stderr
        assert (result.stdout, result.stderr) == (f"ok {name} (cluster)\n", "")


def test_sigterm_during_a_write_exits_143_and_leaves_no_temp_file(workdir, monkeypatch,
                                                                   capfd):
    """A cancelled CI job's SIGTERM ends a command as Ctrl-C does: the write in progress is
    cleaned up (its temp file was left beside the output), and the handler is put back."""
    import signal

    from spindle_cli.cli import main

    root = Path(__file__).resolve().parents[2]
    Path("m.yaml").write_text((root / "models" / "tiny-clip.yaml").read_text())
    before = signal.getsignal(signal.SIGTERM)

    def terminated_while_syncing(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(os, "fsync", terminated_while_syncing)
    with pytest.raises(SystemExit) as e:
        main(["graph", "m.yaml", "-o", "g.yaml"])
    assert e.value.code == 143
    assert capfd.readouterr().err.splitlines()[-1] == "error: interrupted by SIGTERM"
    assert sorted(p.name for p in Path().iterdir()) == ["m.yaml"]
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize(("args", "command"), [
    (("run", "plans/tiny-clip-local-cpu.yaml", "--dry-run"), "spindle run"),
    (("profile", "graphs/tiny-clip.yaml", "--hardware", "local", "--cluster",
      "clusters/local-cpu.yaml", "-o", "{tmp}/m.yaml"), "spindle profile --hardware local"),
], ids=["run", "measure"])
def test_a_command_that_needs_torch_says_so_where_it_cannot_be_imported(
        spindle, monkeypatch, tmp_path, args, command):
    # planning installs without torch (`make core`); these two were an "internal error"
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    result = spindle(*(a.format(tmp=tmp_path) for a in args))
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    first, hint = result.stderr.splitlines()
    assert first.startswith(f"error: {command} needs torch, which cannot be imported here: ")
    assert hint.startswith("hint: pip install 'spindle-cli[runtime]'")
    assert not (tmp_path / "m.yaml").exists()
