"""What a rank writes as it runs: lines for people on stderr, each in one write (`say`), and
rank 0's loss lines on stdout (`print_line`) and --metrics file (`Metrics`). An output the
machine refused raises `<file or stdout>: cannot write: <why>`, with which the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from spindle_cli.artifacts.files import write_text_atomic
from spindle_cli.errors import ArtifactError


def say(line: str) -> None:
    """One line on stderr in one write: the ranks share the launcher's stderr, and `print`
    writes the text and its newline separately, so two ranks' lines could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def print_line(line: str) -> None:
    """A loss line on stdout (rank 0). A stdout that refuses it (its reader gone, as with
    `spindle run ... | head -2`; a full disk) ends the run as an output the machine refused
    ends every command, with `stdout: cannot write: <why>` (README, exit codes): the rank
    reported a raw BrokenPipeError. stdout then goes to /dev/null, so that the line still in
    its buffer does not fail again as the rank exits."""
    try:
        print(line, flush=True)
    except OSError as e:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise _cannot_write("stdout", e, hint="the loss lines go to stdout: keep its reader "
                           "open until the run ends, or send them to a file") from None


def _cannot_write(target: str, e: OSError, hint: str | None = None) -> ArtifactError:
    """The error of an output the machine refused (`<file or stdout>: cannot write: <why>`),
    which ends a run with exit code 2 (`worker._refused_output`)."""
    return ArtifactError(target, "", f"cannot write: {e.strerror or e}", hint=hint)


class Metrics:
    """Rank 0's `--metrics FILE.jsonl`: one JSON object per trained step, written and flushed
    as the step ends (`step`, `steps`, `loss`, `losses` by task, `step_ms`), for scripts that
    would otherwise parse the loss lines. A resumed run keeps the lines of the steps its
    checkpoint holds and drops later ones (trained again), so the file is the history of the
    parameters it ends with."""

    def __init__(self, path: str, resumed_at: int) -> None:
        self.path = path
        kept = []
        if resumed_at:
            with contextlib.suppress(FileNotFoundError):
                for line in Path(path).read_text(encoding="utf-8").splitlines():
                    with contextlib.suppress(ValueError, TypeError, KeyError):
                        if json.loads(line)["step"] <= resumed_at:
                            kept.append(line + "\n")
        try:
            write_text_atomic(path, "".join(kept))
            self.file = open(path, "a", encoding="utf-8")
        except OSError as e:
            raise _cannot_write(path, e) from None

    def write(self, step: int, steps: int, losses: dict[str, float], step_ms: float) -> None:
        record = {"step": step, "steps": steps, "loss": sum(losses.values()),
                  "losses": losses, "step_ms": round(step_ms, 3)}
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as e:
            raise _cannot_write(self.path, e) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
