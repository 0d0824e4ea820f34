"""The Makefile's artifact targets: every committed graph, profile and plan is made (and with
CHECK=--check verified) by `make plans`, each after the files it reads."""

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


def dry_run(*targets: str) -> list[str]:
    """The spindle commands `make -n` would run for `targets`, continuation lines joined."""
    text = subprocess.run(["make", "--no-print-directory", "-n", *targets, "CHECK=--check"],
                          cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout
    lines = [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines()]
    return [line for line in lines if "spindle_cli " in line]


def writes(command: str) -> str:
    return re.search(r" -o (\S+)", command).group(1)


def test_make_plans_covers_every_committed_artifact():
    commands = dry_run("plans")
    made = [writes(c) for c in commands if " -o " in c]
    assert all(" --check " in c for c in commands if " -o " in c)
    assert len(made) == len(set(made)), "a file made twice"
    committed = {str(p.relative_to(REPO)) for d in ("graphs", "profiles", "plans")
                 for p in (REPO / d).glob("*.yaml")}
    assert set(made) == committed - MEASURED
    assert any(f"validate {m}" in c for m in MEASURED for c in commands)


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
