"""`spindle profile`: analytic and measured profiles through the CLI, --check, the cache, and
bad inputs (one line `error: ...` on stderr, exit 2, no output file)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spindle_cli.artifacts import (
    MetaOpGraph,
    ModelSpec,
    Profile,
    input_ref,
    load,
    load_recorded_input,
    write_artifact,
)
from spindle_cli.cli import main
from spindle_cli.planner import scaling
from spindle_cli.planner.graph import build_graph
from spindle_cli.planner.profiling import heldout_errors


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def workdir(tmp_path: Path, repo_root: Path) -> Path:
    """A working directory holding the tiny model and its graph (model path absolute, so the
    graph finds its model from anywhere); the measure cache lands here too."""
    model_path = tmp_path / "tiny-clip.yaml"
    model_path.write_text((repo_root / "models" / "tiny-clip.yaml").read_text())
    model = load(str(model_path), ModelSpec)
    graph = build_graph(model, tasks=["text_vision"], inputs=[input_ref(model, str(model_path))])
    write_artifact(graph, str(tmp_path / "graph.yaml"))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(cwd)


def test_the_summary_says_how_many_curves_start_above_one_device(workdir, repo_root, capsys):
    # a profile of 8 devices alone plans every MetaOp on 8, one after another: the summary
    # says so, where it said only '16 curves over counts 8'
    cluster = str(repo_root / "clusters" / "a800-8x8.yaml")
    args = ["profile", "graph.yaml", "--hardware", "a800", "--cluster", cluster, "-o", "p.yaml"]
    code, _, err = _run([*args, "--counts", "8"], capsys)
    assert code == 0, err
    curves = load("p.yaml", Profile).curves
    assert f"; {len(curves)} start above 1 device (fewer devices: not profiled, or " \
           "infeasible)" in " ".join(err.split())
    code, _, err = _run([*args, "--counts", "1,8"], capsys)
    assert code == 0, err
    assert "start above 1 device" not in err


def test_analytic_profile_is_written_and_checked(workdir, repo_root, capsys):
    cluster = str(repo_root / "clusters" / "a800-8x8.yaml")
    args = ["profile", "graph.yaml", "--hardware", "a800", "--cluster", cluster,
            "--counts", "1,2,4,8", "--validate", "-o", "p.yaml"]
    code, out, err = _run(args, capsys)
    assert code == 0, err
    assert out == ""
    assert "curves over counts 1,2,4,8; max fit error at profiled counts" in err
    # 3 and 6 split none of the graph's power-of-two batches: nothing to validate there
    assert "the held-out counts 3,6 are profiled, but no curve is compared there" in " ".join(
        err.split())
    profile = load("p.yaml", Profile)
    graph = load("graph.yaml", MetaOpGraph)
    assert profile.counts == (1, 2, 4, 8)
    assert [r.kind for r in profile.inputs] == ["metaop_graph", "cluster"]
    assert {c.signature for c in profile.curves} == {m.signature for m in graph.metaops}
    assert all(c.heldout_rel_error is None for c in profile.curves)
    first = Path("p.yaml").read_bytes()

    code, _, err = _run([*args, "--check"], capsys)
    assert code == 0 and "up to date" in err
    _run(args, capsys)
    assert Path("p.yaml").read_bytes() == first  # byte-identical regeneration

    Path("p.yaml").write_text(first.decode().replace("counts:", "counts:  "))
    code, _, err = _run([*args, "--check"], capsys)
    assert code == 1 and "out of date" in err


def test_a_measured_profile_is_not_checked_by_measuring_again(workdir, capsys):
    Path("m.yaml").write_text("kept")
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "local", "-o", "m.yaml",
                         "--check"], capsys)
    assert code == 2
    assert err.startswith("error: --check compares a profile made again with the file, and a "
                          "measurement never repeats exactly")
    assert "hint: spindle validate m.yaml" in err
    assert not Path(".spindle-cache").exists()  # nothing was measured
    assert Path("m.yaml").read_text() == "kept"


def test_profile_to_stdout(workdir, capsys):
    code, out, _ = _run(["profile", "graph.yaml", "--hardware", "h200", "--counts", "1,2",
                         "-o", "-"], capsys)
    assert code == 0
    assert out.startswith("kind: profile\n")
    # without -o, stdout too (as spindle graph and spindle plan)
    assert _run(["profile", "graph.yaml", "--hardware", "h200", "--counts", "1,2"],
                capsys)[:2] == (0, out)


@pytest.fixture
def torch_threads():
    """Measuring sets torch's process-wide thread count; give the next tests theirs back."""
    import torch
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.torch
def test_measured_profile_resumes_from_the_cache(workdir, capsys, torch_threads):
    args = ["profile", "graph.yaml", "--hardware", "local", "--counts", "1,2,4,16",
            "--repeats", "1", "-o", "m.yaml"]
    code, _, err = _run(args, capsys)
    assert code == 0, err
    graph = load("graph.yaml", MetaOpGraph)
    signatures = {m.signature for m in graph.metaops}
    # contrastive loss runs at every count; the other layers cannot split 8 samples 16 ways
    runnable = 3 * (len(signatures) - 1) + 4
    unrunnable = len(signatures) - 1  # and the points say how many were not run
    assert (f"{runnable} point(s) measured, 0 from the cache, {unrunnable} with fewer samples "
            "than data-parallel groups (not run)") in err
    assert f"profiling {runnable + unrunnable} points" in err
    profile = load("m.yaml", Profile)
    assert profile.source == "measured"
    assert profile.fingerprint.hardware == "local" and profile.fingerprint.torch_version
    # measured in the dtype `spindle run` trains the graph in (bf16, mixed precision)
    assert profile.fingerprint.dtype == graph.dtype == "bf16"
    # the optimizer step is measured too: it costs more for more parameters
    assert profile.optimizer is not None
    assert profile.optimizer.time_ms(1, 2e6) > profile.optimizer.time_ms(1, 1e6) > 0
    for curve in profile.curves:
        assert all(p.time_ms > 0 for p in curve.points if p.feasible)
        if not curve.signature.startswith("contrastive_loss"):
            assert not scaling.is_valid(curve, 16)
    cache = Path(".spindle-cache/profile")
    assert len(list(cache.glob("*.json"))) == runnable + 1  # and the optimizer step's
    assert len(list(cache.glob("optimizer-*.json"))) == 1
    first = Path("m.yaml").read_bytes()

    code, _, err = _run(args, capsys)
    assert code == 0
    assert f"0 point(s) measured, {runnable} from the cache" in err
    # the same profile: its optimizer step, timed at every run, made it differ
    assert Path("m.yaml").read_bytes() == first

    code, _, err = _run([*args, "--no-cache"], capsys)
    assert code == 0
    assert f"{runnable} point(s) measured, 0 from the cache" in err


@pytest.mark.torch
def test_a_measured_profile_records_its_model_where_the_profile_finds_it(
        tmp_path, repo_root, capsys, torch_threads):
    # a checkout whose graph records its model relative to the checkout's root, profiled
    # from another directory: the model is found above the graph, and the profile must name
    # it so that it is found from the profile too
    checkout = tmp_path / "checkout"
    (checkout / "models").mkdir(parents=True)
    (checkout / "models" / "tiny-clip.yaml").write_text(
        (repo_root / "models" / "tiny-clip.yaml").read_text())
    model = load(str(checkout / "models" / "tiny-clip.yaml"), ModelSpec)
    graph = build_graph(model, tasks=["text_vision"],
                        inputs=[input_ref(model, "models/tiny-clip.yaml")])
    write_artifact(graph, str(checkout / "graph.yaml"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cwd = os.getcwd()
    os.chdir(elsewhere)
    try:
        code, _, err = _run(["profile", "../checkout/graph.yaml", "--hardware", "local",
                             "--counts", "1", "--repeats", "1", "--no-cache", "-o", "m.yaml"],
                            capsys)
        assert code == 0, err
        found, _ = load_recorded_input(load("m.yaml", Profile), "m.yaml", ModelSpec)
    finally:
        os.chdir(cwd)
    assert Path(found).resolve() == checkout / "models" / "tiny-clip.yaml"


@pytest.mark.torch
def test_a_cache_that_cannot_be_written_is_said_and_measured_past(workdir, capsys,
                                                                 torch_threads):
    Path(".spindle-cache").write_text("not a directory")
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "local", "--counts", "1,2",
                         "--repeats", "1", "-o", "m.yaml"], capsys)
    assert code == 0, err
    assert "note: measuring without the cache: " in err
    assert " 0 from the cache" in err and load("m.yaml", Profile).source == "measured"


@pytest.mark.torch
def test_a_measurement_for_a_cluster_of_other_devices_is_refused(workdir, repo_root, capsys,
                                                                  torch_threads, monkeypatch):
    # this machine's CPU timed as A800s: `spindle plan` takes a measured profile to hold the
    # times of the devices of the cluster it records, so it could not refuse the plan later
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU on any machine
    cluster = str(repo_root / "clusters" / "a800-1x8.yaml")
    args = ["profile", "graph.yaml", "--hardware", "local", "--cluster", cluster,
            "--counts", "1", "--repeats", "1", "--no-cache", "-o", "m.yaml"]
    code, _, err = _run(args, capsys)
    assert code == 2
    assert err.startswith("error: --hardware local measures cpu (1 thread) here, but "
                          f"{cluster} has A800-SXM4-80GB devices")
    assert "clusters/local-cpu.yaml" in err and "--allow-device-mismatch" in err
    assert not Path("m.yaml").exists()
    code, _, err = _run([*args, "--allow-device-mismatch"], capsys)
    assert code == 0, err
    assert "measuring anyway (--allow-device-mismatch)" in err
    assert load("m.yaml", Profile).source == "measured"


@pytest.mark.torch
def test_a_cluster_of_cpu_ranks_is_measured_on_the_cpu_where_a_gpu_is_present(
        workdir, repo_root, capsys, torch_threads, monkeypatch):
    import torch

    def no_gpu_please(*args):
        raise AssertionError("measured on the GPU")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", no_gpu_please)
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "local", "--cluster",
                         str(repo_root / "clusters" / "local-cpu.yaml"), "--counts", "1",
                         "--repeats", "1", "--no-cache", "-o", "m.yaml"], capsys)
    assert code == 0, err
    assert load("m.yaml", Profile).fingerprint.device_name.startswith("cpu")


def test_allow_device_mismatch_needs_a_cluster(workdir, capsys):
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "local",
                         "--allow-device-mismatch", "-o", "m.yaml"], capsys)
    assert code == 2
    assert err.startswith("error: --allow-device-mismatch: there is no --cluster")
    assert not Path("m.yaml").exists()


@pytest.mark.parametrize("flag", [["--repeats", "3"], ["--no-cache"],
                                  ["--allow-device-mismatch"]])
def test_measurement_options_are_refused_for_an_analytic_profile(workdir, capsys, flag):
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "a800", "--counts", "1",
                         *flag, "-o", "p.yaml"], capsys)
    assert code == 2
    assert err.startswith(f"error: {flag[0]} applies to measured profiles (--hardware local)")
    assert not Path("p.yaml").exists()


@pytest.mark.parametrize(("measured", "named", "same"), [
    ("cpu (1 thread)", "cpu-core", True),
    ("cpu (1 thread)", "A800-SXM4-80GB", False),
    ("NVIDIA A800-SXM4-80GB", "A800-SXM4-80GB", True),
    ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB", True),
    ("NVIDIA GeForce RTX 4090", "RTX-4090", True),
    ("NVIDIA GeForce RTX 4090", "RTX-4090-24GB", True),
    ("Quadro RTX 8000", "RTX8000-48GB", True),
    ("NVIDIA H100 PCIe", "H100-PCIe-80GB", True),
    ("AMD Instinct MI300X", "MI300X", True),
    ("NVIDIA GeForce RTX 4090", "RTX-3090-24GB", False),
    ("NVIDIA H100 80GB HBM3", "A100-SXM4-80GB", False),
    ("NVIDIA A100-SXM4-80GB", "A800-SXM4-80GB", False),
    ("NVIDIA H200", "cpu-core", False),
])
def test_same_device_reads_torch_names_against_cluster_names(measured, named, same):
    from spindle_cli.cli.profile import same_device

    assert same_device(measured, named) is same


@pytest.mark.torch
def test_measured_profile_refuses_a_changed_model(workdir, capsys):
    model = Path("tiny-clip.yaml")
    model.write_text(model.read_text().replace("batch_size: 8", "batch_size: 16", 1))
    code, out, err = _run(["profile", "graph.yaml", "--hardware", "local", "-o", "m.yaml"],
                          capsys)
    assert code == 2
    assert err.startswith("error: graph.yaml: inputs[0].sha256: model") and "sha256 mismatch" in err
    assert not Path("m.yaml").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--counts", "0,2"], "error: --counts: '0' is not a positive integer"),
        (["--counts", "1,two"], "error: --counts: 'two' is not a positive integer"),
        (["--counts", "1,,2"], "error: --counts: '' is not a positive integer"),
        (["--counts", "-4"], "error: --counts: '-4' is not a positive integer"),
        # as --tasks refuses a task given twice; '02' is 2
        (["--counts", "1,2,02"], "error: --counts: 2 is given twice in '1,2,02'"),
        # digits that int() refuses (a superscript) or reads (Arabic-Indic)
        (["--counts", "1,\u00b2"], "error: --counts: '\u00b2' is not a positive integer"),
        (["--counts", "\u0663"], "error: --counts: '\u0663' is not a positive integer"),
        # more digits than int() converts
        (["--counts", "1," + "9" * 5000], "error: --counts: a count of 5000 digits is above "
                                          "1048576"),
        (["--hardware", "tpu"], "error: --hardware: unknown hardware 'tpu'"),
        (["--counts", "1,128", "--cluster", "CLUSTER"], "error: --counts: 128 exceeds the 64"),
    ],
)
def test_bad_options(workdir, repo_root, capsys, extra, message):
    extra = [str(repo_root / "clusters" / "a800-8x8.yaml") if a == "CLUSTER" else a
             for a in extra]
    args = ["profile", "graph.yaml", "--hardware", "a800", *extra, "-o", "p.yaml"]
    code, out, err = _run(args, capsys)
    assert code == 2
    assert err.startswith(message), err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""
    assert not Path("p.yaml").exists()


def test_repeats_without_end_are_refused(workdir, capsys):
    # only the warm-up is under the per-point time limit: 10**20 repeats ran on at 0%
    code, out, err = _run(["profile", "graph.yaml", "--hardware", "local", "--repeats",
                           "100000000000000000000", "-o", "p.yaml"], capsys)
    assert code == 2 and out == ""
    assert err.startswith("error: Invalid value for '--repeats': 100000000000000000000 is not "
                          "in the range 1<=x<=10000.")
    assert not Path("p.yaml").exists()


def test_bad_graph_files(workdir, capsys):
    Path("broken.yaml").write_text("kind: metaop_graph\nversion: 1\nmodel: [\n")
    Path("model-as-graph.yaml").write_text(Path("tiny-clip.yaml").read_text())
    cases = {
        "missing.yaml": "error: missing.yaml: no such file",
        "broken.yaml": "error: broken.yaml: invalid YAML",
        "model-as-graph.yaml": "error: model-as-graph.yaml: kind: expected a 'metaop_graph'",
    }
    for path, message in cases.items():
        code, _, err = _run(["profile", path, "--hardware", "a800", "-o", "p.yaml"], capsys)
        assert code == 2, path
        assert err.startswith(message), err
        assert not Path("p.yaml").exists()


def test_a_layer_that_fits_no_device_names_the_graph(workdir, repo_root, capsys):
    """A signature with no feasible count: one line naming the graph file it came from, the
    MetaOp, each count's reason, and a hint at the cluster's memory; nothing written."""
    small = Path("small.yaml")
    small.write_text((repo_root / "clusters" / "a800-8x8.yaml").read_text()
                     .replace("memory_bytes: 79456894976", "memory_bytes: 1024"))
    code, out, err = _run(["profile", "graph.yaml", "--hardware", "a800", "--cluster",
                           str(small), "--counts", "1,2", "-o", "p.yaml"], capsys)
    assert code == 2 and out == ""
    line, hint = err.strip().splitlines()
    assert line.startswith("error: graph.yaml: signature "), err
    assert "no feasible strategy at any profiled count (1 device: dp: out of memory" in line
    assert "device.memory_bytes" in hint
    assert not Path("p.yaml").exists()


def test_subprocess_error_has_no_traceback(workdir):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "spindle_cli", "profile", "graph.yaml", "--hardware", "a800",
         "--counts", "x", "-o", "p.yaml"],
        capture_output=True, text=True, check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --counts: 'x' is not a positive integer (in 'x')"
    ]
    assert "Traceback" not in proc.stderr


def test_show_prints_each_curve_and_plots(workdir, capsys):
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "a800", "--counts", "1,2,4,8,16",
                         "--validate", "-o", "p.yaml"], capsys)
    assert code == 0, err
    profile = load("p.yaml", Profile)
    code, out, err = _run(["show", "p.yaml", "--plot", "curves.png"], capsys)
    assert code == 0, err
    assert out.startswith("profile p.yaml: analytic on a800")
    assert "optimizer step: 0.01 ms per tensor + 0.0137 ms per million parameters" in out
    for curve in profile.curves:
        assert curve.signature in out
    lines = out.splitlines()
    assert sum(line.startswith("  speedup ") for line in lines) == len(profile.curves)
    assert "(held out)" in out
    assert "more data-parallel groups than samples" in out  # B = 8 cannot split 16 ways
    assert any(bar in out for bar in "▁▂▃▄▅▆▇█")
    assert Path("curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote curves.png" in err

    code, _, err = _run(["show", "p.yaml", "--plot", "nowhere/curves.png"], capsys)
    assert code == 2
    assert err.startswith("error: nowhere/curves.png: output directory 'nowhere' does not exist")
    code, _, err = _run(["show", "p.yaml", "--gantt", "g.svg"], capsys)
    assert code == 2 and "--gantt does not apply to a profile" in err


def test_sparkline_and_names():
    from spindle_cli.cli.views.profile import short_name, sparkline

    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([]) == ""
    assert sparkline([1.0, 2.0, 4.0, 8.0], 0.0, 8.0) == "▂▃▅█"
    assert sparkline([1.0, 1.0, 1.0], 0.0, 4.0) == "▃▃▃"
    assert short_name("transformer_encoder|hidden=32|heads=4|batch=8|seq=12|dtype=bf16") == (
        "transformer_encoder hidden=32 batch=8 seq=12"
    )
    assert short_name("opaque") == "opaque"


def test_show_profile_on_a_stdout_that_cannot_encode_the_bars():
    """An ASCII stdout (PYTHONIOENCODING=ascii, a C locale in CI) gets ASCII sparklines, as it
    gets rich's ASCII borders: the block characters were an internal error (exit 123)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "spindle_cli", "show",
                           "profiles/multitask-clip-a800-8x8.yaml"], cwd=root,
                          capture_output=True, env={**os.environ, "PYTHONIOENCODING": "ascii"},
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.decode("ascii").splitlines() if "  speedup " in ln]
    assert lines and all(ln.split()[1].strip("_.-:=+*#") == "" for ln in lines)
    assert any(ln.split()[1] != "_" * len(ln.split()[1]) for ln in lines)


@pytest.mark.parametrize(("counts", "said"), [
    ("1", "no held-out count lies between the profiled counts"),
    ("1,4", "at held-out counts"),
])
def test_validate_claims_an_error_only_where_it_held_a_count_out(counts, said, workdir,
                                                                  repo_root, capsys):
    # 1 alone leaves nothing between counts; 1,4 holds out 2, which splits every batch
    cluster = str(repo_root / "clusters" / "a800-8x8.yaml")
    code, _, err = _run(["profile", "graph.yaml", "--hardware", "a800", "--cluster", cluster,
                         "--counts", counts, "--validate", "-o", "p.yaml"], capsys)
    assert code == 0, err
    assert said in " ".join(err.split())
    profile = load("p.yaml", Profile)
    for c in profile.curves:
        errors = heldout_errors(c, profile.counts)
        # (from the file's rounded curve: the same error up to the rounding)
        assert c.heldout_rel_error == (pytest.approx(max(e.rel_error for e in errors), abs=1e-6)
                                       if errors else None)
    assert any(c.heldout_rel_error is not None for c in profile.curves) == (counts == "1,4")
