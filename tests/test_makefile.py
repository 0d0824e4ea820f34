"""The Makefile's artifact targets: every committed graph, profile and plan is made by
`make plans`, each after the files it reads, and verified by plans-check, each check on its
own (so that `make -k` names every stale file)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MEASURED = {"profiles/tiny-clip-local-cpu.yaml"}
"""Made once by `make measure` and only validated by `make plans`."""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(*targets: str, check: bool = False) -> list[str]:
    """The spindle commands `make -n` would run for `targets` (with CHECK=--check when
    `check`), continuation lines joined."""
    text = subprocess.run(["make", "--no-print-directory", "-n", *targets,
                           *["CHECK=--check"] * check],
                          cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout
    lines = [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines()]
    return [line for line in lines if "spindle_cli " in line]


def writes(command: str) -> str:
    return re.search(r" -o (\S+)", command).group(1)


COMMITTED = {str(p.relative_to(REPO)) for d in ("graphs", "profiles", "plans")
             for p in (REPO / d).glob("*.yaml")}


@pytest.mark.parametrize(("targets", "check"), [(["plans"], False),
                                               (["graphs", "profiles", "plans"], True),
                                               (["plans"], True)],
                         ids=["make plans", "plans-check", "make plans CHECK=--check"])
def test_every_committed_artifact_is_made_and_checked(targets, check):
    # what `make plans` runs, and what plans-check runs with CHECK=--check; `make plans
    # CHECK=--check` (which `make help` offers) checked the plans alone, and passed with
    # every graph stale against its model
    commands = dry_run(*targets, check=check)
    made = [writes(c) for c in commands if " -o " in c]
    assert all((" --check " in c) == check for c in commands if " -o " in c)
    assert len(made) == len(set(made)), "a file made twice"
    assert set(made) == COMMITTED - MEASURED
    assert any(f"validate {m}" in c for m in MEASURED for c in commands)


def test_checks_do_not_wait_for_each_other():
    # under CHECK nothing is written: a plan's check runs without its graph's and profile's,
    # so `make -k plans-check` reaches it when they are stale too
    commands = dry_run("plan/tiny-clip-local-cpu", check=True)
    assert [writes(c) for c in commands if " -o " in c] == ["plans/tiny-clip-local-cpu.yaml"]


@pytest.mark.parametrize("plan", sorted(p.stem for p in (REPO / "plans").glob("*.yaml")))
def test_a_plan_target_first_makes_the_files_it_reads(plan):
    commands = dry_run(f"plan/{plan}")
    assert writes(commands[-1]) == f"plans/{plan}.yaml"
    graph, profile = re.search(r"plan (\S+) (\S+) ", commands[-1]).groups()
    before = commands[:-1]
    assert any(writes(c) == graph for c in before if " -o " in c)
    assert any(f"validate {profile}" in c if profile in MEASURED else
               " -o " in c and writes(c) == profile for c in before)
    # and the profile's own graph before the profile
    if profile not in MEASURED:
        made_profile = next(i for i, c in enumerate(before) if " -o " in c
                            and writes(c) == profile)
        reads = re.search(r"profile (\S+) ", before[made_profile]).group(1)
        assert any(writes(c) == reads for c in before[:made_profile] if " -o " in c)


def test_a_python_with_spaces_gets_one_install_stamp():
    # `uv run python`: the stamp's name was three words, so make touched run and python too
    text = subprocess.run(["make", "--no-print-directory", "-n", "-B", "install",
                           "PYTHON=uv run python"], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout
    touches = [line for line in text.splitlines() if "touch" in line]
    assert touches == ["mkdir -p .make/ && touch .make/installed-uv_run_python"]


def test_clean_refuses_an_empty_out():
    r = subprocess.run(["make", "--no-print-directory", "-n", "clean", "OUT="], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "OUT is empty: make clean would remove /demo" in r.stderr
    assert "rm -rf" not in r.stdout


@pytest.mark.parametrize("out", ["/", "//", "/.", "/tmp/.."])
@pytest.mark.parametrize(("target", "would"), [("clean", "remove"), ("demo", "write to")])
def test_an_out_at_the_root_is_refused(target, would, out):
    # OUT=/ passed the empty-OUT guard: `rm -rf //demo`; refused as the Makefile is read,
    # before install runs (so nothing is printed in a fresh checkout either)
    r = subprocess.run(["make", "--no-print-directory", "-n", target, f"OUT={out}"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"OUT '{out}' is the root directory: make {target} would {would} /demo" in r.stderr
    assert "rm -rf" not in r.stdout and "mkdir" not in r.stdout


@pytest.mark.parametrize(("target", "what"), [
    ("bench", "its planning times differ from run to run"),
    ("measure", "a measurement cannot be reproduced"),
])
def test_targets_that_cannot_check_refuse_check(target, what):
    # CHECK=--check promises that nothing is written: bench and measure wrote their files
    r = subprocess.run(["make", "--no-print-directory", "-n", target, "CHECK=--check"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert f"make {target} has no --check: {what}" in r.stderr
    assert " bench " not in r.stdout and " profile " not in r.stdout


def test_schemas_check_writes_nothing():
    assert subprocess.run(["make", "--no-print-directory", "-n", "schemas", "CHECK=--check"],
                          cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=60).stdout.splitlines()[-1].split() == [
        "python3", "-m", "spindle_cli.artifacts.schema", "--check", "schemas/"]


@pytest.mark.parametrize("target", ["clean", "demo"])
def test_an_out_with_spaces_is_refused(target):
    # make splits it: `rm -rf my out/demo` would remove the directory my
    r = subprocess.run(["make", "--no-print-directory", "-n", target, "OUT=my out"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "OUT 'my out' has spaces: make would read it as 2 paths" in r.stderr
    assert "rm -rf" not in r.stdout and "mkdir" not in r.stdout


@pytest.mark.parametrize(("target", "runs"), [
    ("graph/tiny-clip", "fresh-python -m spindle_cli graph models/tiny-clip.yaml"),
    ("schemas", "fresh-python -m spindle_cli.artifacts.schema --check schemas/")])
def test_artifact_targets_install_the_planner_without_torch(target, runs):
    # a CI job that only runs plans-check, or checks the schemas, needs the planner, which
    # never imports torch (schemas installed torch and the test tools)
    text = subprocess.run(["make", "--no-print-directory", "-n", target, "PYTHON=fresh-python",
                           "CHECK=--check"], cwd=REPO, capture_output=True, text=True,
                          check=True, timeout=60).stdout
    installs = [line for line in text.splitlines() if "pip install" in line]
    assert installs == ["fresh-python -m pip install --quiet -e ."]
    assert runs in text


def test_make_alone_lists_the_targets_and_installs_nothing():
    """`make` alone ran the first target, which installed torch."""
    shown = subprocess.run(["make", "--no-print-directory"], cwd=REPO, capture_output=True,
                           text=True, check=True, timeout=60).stdout
    listed = [line.split()[1] for line in shown.splitlines()]
    assert listed[:2] == ["demo", "test"]  # the README's two commands first
    phony = re.search(r"^\.PHONY:(.*?[^\\])$", (REPO / "Makefile").read_text(),
                      re.MULTILINE | re.DOTALL).group(1).replace("\\", " ").split()
    assert set(listed) <= set(phony) and len(set(listed)) == len(listed)
    dry = subprocess.run(["make", "-n"], cwd=REPO, capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert "pip" not in dry


def test_test_oldest_pins_every_floor_that_pyproject_names():
    # make test-oldest pins each `>=` floor `==` with sed: a requirement written another way
    # (`~=`, an upper bound) would go unpinned there, and the floor untested
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+(>=|==)[0-9.]+", r) for r in requirements)
    text = subprocess.run(["make", "--no-print-directory", "-n", "test-oldest"], cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=60).stdout
    (sed,) = [line for line in text.replace("\\\n", " ").splitlines() if line.startswith("sed ")]
    pins = subprocess.run(re.split(r"\s+>\s+", sed)[0], shell=True, cwd=REPO,
                          capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert pins == [r.replace(">=", "==") for r in requirements if ">=" in r]
