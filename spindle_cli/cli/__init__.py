"""The `spindle` command: one click group; each subcommand lives in its own module and is
imported only when it runs, so `spindle plan` never pays for (or imports) torch.

Exit codes are decided here only (`_main`); `EXIT_CODES`, which `spindle --help` prints,
lists them.
"""

from __future__ import annotations

import errno
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

import click

from spindle_cli import __version__
from spindle_cli.errors import SpindleError, one_line

# command name -> (module under spindle_cli.cli, function name, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "graph": ("graph", "graph", "Contract a model's tasks into a MetaOp graph."),
    "profile": ("profile", "profile", "Measure or model scaling curves for a MetaOp graph."),
    "plan": ("plan", "plan", "Plan waves and placement for a graph on a cluster."),
    "run": ("run", "run", "Train a plan with torch.distributed, wave by wave."),
    "simulate": ("simulate", "simulate", "Simulate one training iteration of a plan."),
    "bench": ("bench", "bench", "Reproduce the paper's evaluation on simulated clusters."),
    "validate": ("inspect", "validate", "Validate artifact files."),
    "show": ("inspect", "show", "Summarize any artifact."),
    "diff": ("diff", "diff", "Semantic diff of two plans."),
    "explain": ("explain", "explain", "Explain how a plan treats one MetaOp."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        cmd = getattr(importlib.import_module(f"spindle_cli.cli.{module}"), attr)
        assert isinstance(cmd, click.Command)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


EXIT_CODES = """\b
Exit codes (every command):
  0    success
  1    --check or diff found a difference, a run failed, bench could not plan
       some configuration
  2    bad input (one line naming the file, field and problem), or an output
       the machine refused
  123  internal error (a bug)
  130  Ctrl-C; 143 SIGTERM
SPINDLE_DEBUG=1 adds the traceback to an error; the exit code stays."""


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_CODES)
@click.version_option(__version__, prog_name="spindle")
def cli() -> None:
    """Spindle: plan and run multi-task multi-modal training with wavefront scheduling.

    Stages talk through versioned artifacts: model -> graph -> profile -> plan -> run.
    """


def main(argv: list[str] | None = None) -> Any:
    """Entry point: run the CLI and map errors to one line and an exit code. SIGTERM (a CI
    job cancelled, `timeout`) ends it as Ctrl-C does, through the cleanup on the way out, so
    no temp file of a write in progress is left beside its output; it exits 143. `spindle
    run`'s launcher installs its own handler, which stops the ranks."""
    if threading.current_thread() is not threading.main_thread():
        return _main(argv)
    before = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, before)


class _Terminated(SystemExit):
    """SIGTERM arrived: exit 128 + the signal, through every cleanup on the way out."""


def _terminated(signum: int, frame: object) -> NoReturn:
    raise _Terminated(128 + signum)


def _main(argv: list[str] | None) -> Any:
    from spindle_cli.cli._console import err

    def say(line: str) -> None:
        # One unwrapped line per message: CI logs and scripts grep these (a file name's
        # newline or escape code is written escaped)
        sys.stderr.write(one_line(line) + "\n")

    debug = os.environ.get("SPINDLE_DEBUG") == "1"
    try:
        return cli.main(args=argv, prog_name="spindle", standalone_mode=False)
    except SpindleError as e:
        if debug:
            err.print_exception()
        say(f"error: {e}")
        if e.hint:
            say(f"hint: {e.hint}")
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except _Terminated as e:
        say("error: interrupted by SIGTERM")
        sys.exit(e.code)
    except click.exceptions.NoArgsIsHelpError as e:  # `spindle` alone: the help, exit 2
        sys.stderr.write(e.format_message() + "\n")
        sys.exit(2)
    except click.UsageError as e:
        say(f"error: {e.format_message()}")
        if e.ctx is not None:
            say(f"hint: see '{e.ctx.command_path} --help'")
        sys.exit(2)
    except click.ClickException as e:
        say(f"error: {e.format_message()}")
        sys.exit(2)
    except click.Abort as e:
        # click turns Ctrl-C (KeyboardInterrupt) into Abort
        ctrl_c = isinstance(e.__context__, KeyboardInterrupt)
        say("error: interrupted by SIGINT" if ctrl_c else "error: aborted")
        sys.exit(130)
    except BrokenPipeError:
        sys.exit(0)
    except OSError as e:
        if e.errno in _PATH_REFUSED and e.filename is not None:
            if debug:
                err.print_exception()
            say(f"error: {e.filename}: {e.strerror}")
            sys.exit(2)
        if e.errno not in _FULL_OR_FAILED:
            raise_internal(e, debug, say)
        if debug:
            err.print_exception()
        # what was left unwritten would fail again as the interpreter exits
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        say(f"error: {e.filename or 'stdout'}: cannot write: {e.strerror}")
        sys.exit(2)
    except Exception as e:
        raise_internal(e, debug, say)


_FULL_OR_FAILED = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS}
"""errno values of a write the machine refused (a full disk or quota, a file too large, a
device error, a read-only file system): the output's, not spindle's, failure. Writers of
files turn theirs into errors naming the file, so one that gets here without a file name was
a write to stdout (`spindle show PLAN > /dev/full`)."""


_PATH_REFUSED = {errno.ENAMETOOLONG, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR}
"""errno values of a path the machine refused to look at (a name too long, a directory
without search permission, too many symlinks): the name's problem, which the first check of
a path that gets it (Path.is_dir, is_file) raises wherever it sits."""


def raise_internal(e: Exception, debug: bool, say: Callable[[str], None]) -> NoReturn:
    """Exit 123 for an exception no handler expected: a bug."""
    from spindle_cli.cli._console import err

    if debug:
        err.print_exception(show_locals=True)
    else:
        say(f"internal error: {e!r} (a bug in spindle; rerun with SPINDLE_DEBUG=1 for the "
            "traceback)")
    sys.exit(123)
