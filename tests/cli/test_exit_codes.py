"""Exit codes `spindle_cli.cli.main` gives what escapes a command (spindle_cli/cli/__init__.py):
123 and one line for a bug (the traceback only with SPINDLE_DEBUG=1), 130 for an abort.

A stand-in command module is registered under the real lazy group, so the error passes through
the same `main` every subcommand runs under.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import click
import pytest

from spindle_cli.cli import COMMANDS


@pytest.fixture
def raising(monkeypatch: pytest.MonkeyPatch):
    """Register `spindle boom`, which raises the exception `raising(exc)` is given."""

    def install(exc: BaseException) -> None:
        @click.command()
        def boom() -> None:
            raise exc

        module = types.ModuleType("spindle_cli.cli._boom")
        module.boom = boom  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "spindle_cli.cli._boom", module)
        monkeypatch.setitem(COMMANDS, "boom", ("_boom", "boom", "Raise for a test."))

    monkeypatch.delenv("SPINDLE_DEBUG", raising=False)
    return install


def test_an_internal_error_is_one_line_and_exit_123(raising, spindle):
    raising(ValueError("kaboom"))
    res = spindle("boom")
    assert res.exit_code == 123
    assert res.stdout == ""
    # the exception's repr, and where to get the traceback; no traceback itself
    assert res.stderr.splitlines() == [
        "internal error: ValueError('kaboom') (a bug in spindle; rerun with SPINDLE_DEBUG=1 "
        "for the traceback)"]


def test_spindle_debug_shows_the_traceback_and_keeps_exit_123(raising, spindle, monkeypatch):
    raising(ValueError("kaboom"))
    monkeypatch.setenv("SPINDLE_DEBUG", "1")
    res = spindle("boom")
    assert res.exit_code == 123
    assert "Traceback" in res.stderr
    assert "ValueError" in res.stderr and "kaboom" in res.stderr
    assert len(res.stderr.splitlines()) > 1


def test_an_abort_is_exit_130(raising, spindle):
    # click raises Abort when a prompt is cancelled
    raising(click.Abort())
    res = spindle("boom")
    assert res.exit_code == 130
    assert res.stdout == ""
    assert res.stderr.splitlines() == ["error: aborted"]


def test_ctrl_c_inside_a_command_is_exit_130(raising, spindle):
    # click turns a KeyboardInterrupt into Abort (after ending the line the user was on)
    raising(KeyboardInterrupt())
    res = spindle("boom")
    assert res.exit_code == 130
    # the line `spindle run` prints when Ctrl-C stops its ranks
    assert res.stderr.splitlines()[-1] == "error: interrupted by SIGINT"
    assert "Traceback" not in res.stderr


def test_ctrl_c_while_the_cli_loads_is_its_one_line_and_130():
    """Ctrl-C while `spindle` still imports click, rich and numpy (its first half second)
    printed a KeyboardInterrupt traceback: here the import of the CLI is interrupted."""
    code = ("import sys\n"
            "class Interrupting:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'spindle_cli.cli':\n"
            "            raise KeyboardInterrupt\n"
            "sys.meta_path.insert(0, Interrupting())\n"
            "from spindle_cli.__main__ import run\n"
            "run()\n")
    # from the checkout's top, whose spindle_cli `-c` imports first, wherever pytest runs
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert (r.returncode, r.stderr) == (130, "error: interrupted by SIGINT\n")
