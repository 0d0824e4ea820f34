"""The one exception hierarchy of Spindle. Leaf module: imports nothing from spindle_cli.

Every error a user can cause is a `SpindleError`; the CLI prints it as one line and exits with
its `exit_code`. Anything else escaping to the CLI is a bug.
"""

from __future__ import annotations

import unicodedata

_CONTROL = ("Cc", "Zl", "Zp")
"""Unicode categories that break a line of output: control characters, line and paragraph
separators."""


def has_control(value: str) -> bool:
    """Whether `value` holds a control character or a line or paragraph separator (what
    would break a one-line error)."""
    return any(unicodedata.category(c) in _CONTROL for c in value)


def one_line(text: str) -> str:
    """`text` with its control characters and line separators escaped as Python writes them
    ('\\n', '\\x1b'): a file name holding them printed a two-line error, or sent escape codes
    to the terminal."""
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in _CONTROL else c for c in text)


class SpindleError(Exception):
    """An error caused by the user's input or environment; printed as one line."""

    exit_code = 2

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def within(self, where: str) -> SpindleError:
        """The same error (its class, exit code and hint) with its message prefixed by
        `where`: the file through which it was found."""
        outer = type(self).__new__(type(self))
        outer.__dict__.update(self.__dict__)
        outer.args = (f"{where}: {self}",)
        return outer


class ArtifactError(SpindleError):
    """An artifact file that cannot be read, parsed or validated.

    The message reads `<file>: <field path>: <problem>`.
    """

    def __init__(self, file: str, field: str, problem: str, *, hint: str | None = None) -> None:
        where = f"{file}: {field}" if field else file
        super().__init__(f"{where}: {problem}", hint=hint)
        self.file = file
        self.field = field
        self.problem = problem


class InputNotFound(ArtifactError):
    """A derived artifact's recorded input found nowhere it is looked for
    (`io.load_recorded_input`)."""


class CurveError(SpindleError):
    """An operator signature whose profiled points give no valid scaling curve (no feasible
    count, or sizes that fit no curve); the CLI names the graph it came from."""


class PlanError(SpindleError):
    """A plan that does not schedule its graph consistently, or that the executor cannot run."""


class PlanInfeasible(SpindleError):
    """The planner cannot fit the model on the cluster (e.g. out of device memory)."""


class OutOfMemory(PlanInfeasible):
    """Placement cannot keep some rank within its device memory, whatever it tried; the CLI
    names the cluster file's `device.memory_bytes`."""


class NoValidCount(PlanInfeasible):
    """A MetaOp has no device count its curve allows on the cluster, whatever the memory
    setting (its batch, the profile's feasible counts, tensor parallelism, islands)."""


class SplitGroup(PlanInfeasible):
    """Sequential placement would put a tensor-parallel group across two islands, whatever
    the memory setting."""


class RuntimeFailure(SpindleError):
    """A distributed run failed (a rank crashed, timed out or disagreed about shapes)."""

    exit_code = 1


class Interrupted(SpindleError):
    """A run stopped by a signal (Ctrl-C, a scheduler's SIGTERM): exits 128 + its number."""

    def __init__(self, message: str, signal_number: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signal_number


class FieldError(ValueError):
    """Raised inside artifact validation; the loader prefixes the file and the parent path.

    `field` is relative to the object being validated (e.g. `steps[1].module`).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem
