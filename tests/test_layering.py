"""torch is imported only by spindle_cli.runtime, and only when a command needs it.

Each check runs in a fresh interpreter (this test process may already hold torch) and asserts
`"torch" not in sys.modules` after importing the pure layers or after running a command.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = "models/tiny-clip.yaml"
CLUSTER = "clusters/a800-1x8.yaml"


def _run_python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_importing_pure_layers_and_cli_never_imports_torch():
    proc = _run_python(
        """
        import importlib, pkgutil, sys
        import spindle_cli.errors, spindle_cli.artifacts, spindle_cli.planner, spindle_cli.cli
        names = []
        for pkg in (spindle_cli.artifacts, spindle_cli.planner, spindle_cli.cli):
            for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if info.name.endswith("__main__"):
                    continue
                importlib.import_module(info.name)
                names.append(info.name)
        assert "spindle_cli.planner.graph" in names, names
        assert "spindle_cli.cli.inspect" in names, names
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not leaked, leaked[:5]
        # matplotlib is imported only inside the functions that draw (docs/CONTRACTS.md)
        assert "matplotlib" not in sys.modules
        print(len(names))
        """,
        REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 10


def _commands(tmp: Path) -> dict[str, list[list[str]]]:
    """Command name -> the command lines to run (prerequisites first), for commands that exist."""
    graph = ["graph", TINY, "-o", str(tmp / "g.yaml")]
    profile = ["profile", str(tmp / "g.yaml"), "--hardware", "a800", "--cluster", CLUSTER,
               "-o", str(tmp / "p.yaml")]
    commands = {
        "graph": [graph],
        "validate": [graph, ["validate", TINY, CLUSTER, str(tmp / "g.yaml")]],
        "show": [graph, ["show", TINY], ["show", str(tmp / "g.yaml")]],
    }
    plan = ["plan", str(tmp / "g.yaml"), str(tmp / "p.yaml"), "--cluster", CLUSTER,
            "-o", str(tmp / "plan.yaml")]
    made = [graph, profile, plan]
    commands |= {
        "profile": [graph, profile],
        "plan": made,
        "simulate": [*made, ["simulate", str(tmp / "plan.yaml"), "--json"]],
        "explain": [*made, ["explain", str(tmp / "plan.yaml"), "text_audio/audio_embed"]],
        "diff": [*made, ["diff", str(tmp / "plan.yaml"), str(tmp / "plan.yaml")]],
    }
    return commands


@pytest.mark.parametrize("command", sorted(_commands(Path("."))))
def test_running_a_command_never_imports_torch(command, tmp_path):
    lines = _commands(tmp_path)[command]
    proc = _run_python(
        f"""
        import sys
        from spindle_cli.cli import main
        for argv in {lines!r}:
            try:
                main(argv)
            except SystemExit as e:
                assert e.code in (0, None), (argv, e.code)
        leaked = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        assert not leaked, leaked[:5]
        """,
        REPO,
    )
    assert proc.returncode == 0, proc.stderr
