"""Helpers shared by the subcommands: loading inputs, writing outputs, `--check`, the memory
strategies a plan uses."""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import TypeVar

from spindle_cli.artifacts import (
    MetaOpGraph,
    ModelSpec,
    Plan,
    load,
    rendered_for,
)
from spindle_cli.artifacts.base import Artifact, DerivedArtifact
from spindle_cli.artifacts.codec import shown
from spindle_cli.artifacts.files import (
    check_can_create,
    names_directory,
    output_file,
    write_rendered,
)
from spindle_cli.artifacts.io import as_written, parse_artifact, work_tree
from spindle_cli.artifacts.parsing import parse_text
from spindle_cli.cli._console import err, wrote
from spindle_cli.cli.views.plan_diff import differences
from spindle_cli.errors import (
    ArtifactError,
    FieldError,
    InputNotFound,
    SpindleError,
    has_control,
    one_line,
)

A = TypeVar("A", bound=Artifact)


def load_input(path: str, cls: type[A]) -> A:
    """Load a validated input artifact (errors are one-line ArtifactErrors)."""
    return load(path, cls)


def require_torch(command: str) -> None:
    """Refuse `command` in one line where torch cannot be imported: the planning commands run
    without it (`pip install spindle-cli`, `make core`), `spindle run` and measuring need it."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise SpindleError(f"{command} needs torch, which cannot be imported here: {e}",
                           hint="pip install 'spindle-cli[runtime]' (torch==2.13.0; README: "
                                "the CPU or CUDA build)") from None


def note_stale_graph(graph: MetaOpGraph, graph_path: str) -> None:
    """A note where the model `graph` records is found but has changed since, or does not
    give this graph: what is made from it goes on (a what-if on an edited graph), though
    `spindle validate` and `spindle run` refuse it. Nothing where no model is found."""
    from spindle_cli.planner.graph import model_of  # networkx: when needed

    if ModelSpec.KIND not in (r.kind for r in graph.inputs):
        return
    try:
        model_of(graph, graph_path)
    except InputNotFound:
        return
    except SpindleError as e:
        hint = f" ({e.hint})" if e.hint else ""
        err.print(f"note: {e}{hint}; validate and run refuse what is made from it",
                  soft_wrap=True)


def recorded(path: str, output: str) -> str:
    """How an input given as `path` is recorded in a file written to `output` (inputs are
    looked for as recorded, then above the file: `find_recorded_input`). When both lie in one
    git work tree (a checkout: the nearest directory above `output` holding `.git`), relative
    to its top, wherever the command runs: `make -C`, a CI step in another directory and the
    repository root record the same (`--check` agrees), and the checkout can move. Otherwise,
    when `output` lies in the working directory, relative to it: an absolute path inside it is
    made relative, so a file made in a checkout names its inputs the same however they were
    spelled (`--check` agrees) and finds them once the checkout moves. When `output` lies
    elsewhere, absolute: a relative path names the input from here only, and the file is read
    from elsewhere. To stdout, as given. Always normalised ('./models/x.yaml' and
    'models/../models/x.yaml' are 'models/x.yaml'). The working directory is the physical one
    or, where the shell reached it through a symlink, $PWD's spelling of it. A path that would
    be recorded with a line break or control character is refused before any work: the
    artifact's strings are one line (`codec._check_text`), so its file would not be written."""
    spelled = _spelled(path, output)
    if has_control(spelled):
        raise SpindleError(f"{shown(path)}: a path with a line break or control character "
                           f"cannot be recorded in the inputs of {shown(output)}",
                           hint="rename the file or the directory that holds it")
    return spelled


def _spelled(path: str, output: str) -> str:
    """`recorded`'s spelling of `path`, unchecked."""
    path = os.path.normpath(path)
    if output == "-":
        return path
    heres = [Path.cwd()]
    logical = os.environ.get("PWD", "")
    if os.path.isabs(logical) and os.path.isdir(logical) and os.path.samefile(logical, heres[0]):
        heres.append(Path(logical))
    given = Path(path)
    for here in heres:
        out, inp = Path(os.path.normpath(here / output)), Path(os.path.normpath(here / given))
        # as spelled, then with symlinks resolved (realpath: a loop does not raise)
        for out_at, in_at in ((out, inp), (Path(os.path.realpath(out)),
                                           Path(os.path.realpath(inp)))):
            top = work_tree(out_at)
            if top is not None and in_at.is_relative_to(top):
                return in_at.relative_to(top).as_posix()
    for here in heres:
        out = Path(os.path.normpath(here / output))
        # realpath, unlike resolve(), does not raise on a symlink loop (check_output refuses it)
        if any(p.is_relative_to(here) for p in (out, Path(os.path.realpath(out)))):
            if not given.is_absolute():
                return path
            if given.is_relative_to(here):
                return given.relative_to(here).as_posix()
    return path if given.is_absolute() else os.path.normpath(heres[-1] / given)


def check_output(path: str, suffixes: tuple[str, ...] = (".yaml", ".yml", ".json"),
                 what: str = "file extension", *, check: bool = False,
                 inputs: tuple[str | None, ...] = ()) -> None:
    """SpindleError unless `path` ('-': stdout, not with `check`) can be written or compared
    with: one of `suffixes` (else 'unknown <what>'), not a directory, in a directory that
    exists and (unless `check`) a file `replace_atomic` may replace or make (through a
    symlink, in its target's directory), and not one of the command's `inputs` (None: not
    given). Commands call it before their work, so a bad name prints nothing else and wastes
    nothing."""
    if path == "-":
        if check:
            raise SpindleError("--check compares with a file: give it as -o FILE, not '-'")
        return
    if not path:
        raise SpindleError(f"'': an empty file name (expected a {_one_of(suffixes)} file)")
    if names_directory(path):
        raise SpindleError(f"{path}: names a directory (a trailing slash), not a file")
    target = Path(path)
    if target.suffix.lower() not in suffixes:
        raise SpindleError(f"{path}: unknown {what} (expected {_one_of(suffixes)})")
    if target.is_dir():
        raise SpindleError(f"{path}: is a directory")
    parent = target.parent
    check_parent(path, parent)
    if check:
        # a pipe would block the comparison, a device never end it
        if target.exists() and not target.is_file():
            raise SpindleError(f"{path}: not a regular file")
        return
    check_can_create(path, output_file(path).parent)
    for given in inputs:
        if given is not None and target.exists() and Path(given).exists() and \
                os.path.samefile(given, target):
            raise SpindleError(f"{path}: is also an input of this command ({given}); writing "
                               "it would replace that input",
                               hint="give the output another name")


def check_parent(name: str, parent: Path) -> None:
    """SpindleError unless `parent`, the directory `name` goes to, exists and is one."""
    if not parent.exists():
        raise SpindleError(f"{name}: output directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise SpindleError(f"{name}: {str(parent)!r} is not a directory")


def _one_of(suffixes: tuple[str, ...]) -> str:
    return ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]


def emit(obj: Artifact, output: str, *, check: bool = False) -> int:
    """Write `obj` to `output` (or stdout for '-'); with `check`, compare instead and write
    nothing. Returns the exit code: 1 when `check` finds a difference. First `obj` is read
    back as its file would be: values that loading refuses (a 74-bit byte count from a huge
    model) are an error here, before anything is written, not at the next stage."""
    try:
        as_written(obj)
    except FieldError as e:
        raise ArtifactError(output, e.field, f"{e.problem}; the file would not load",
                            hint="the inputs hold sizes beyond any real model or cluster"
                            ) from None
    new = rendered_for(obj, output)
    if check:
        try:
            old = _read_exactly(output)
        except FileNotFoundError:
            err.print(f"{output}: missing (would be created)", soft_wrap=True)
            return 1
        except UnicodeDecodeError:
            err.print(f"{output}: out of date (regenerate it)", soft_wrap=True)
            err.print("  the file is not UTF-8 text", soft_wrap=True)
            return 1
        except OSError as e:  # a symlink loop, no permission
            raise ArtifactError(output, "", f"cannot read: {e.strerror or e}") from None
        if old != new:
            err.print(f"{output}: out of date (regenerate it)", soft_wrap=True)
            if old.replace("\r\n", "\n") == new:
                err.print("  only its line endings: CRLF, where spindle writes LF (a checkout "
                          "with git's core.autocrlf? '*.yaml text eol=lf' in .gitattributes "
                          "keeps LF)", soft_wrap=True)
                return 1
            for line in stale_lines(output, old, new, obj):
                err.print(f"  {line}", soft_wrap=True)
            return 1
        err.print(f"{one_line(output)}: up to date", soft_wrap=True)
        return 0
    if output != "-" and _holds_already(output, new):
        # its modification time stays, so make rules and file watchers downstream see no change
        err.print(f"{one_line(output)}: unchanged (not rewritten)", soft_wrap=True)
        return 0
    write_rendered(new, output)
    if output != "-":
        wrote(output)
    return 0


def _holds_already(output: str, text: str) -> bool:
    """Whether the file `output` (a regular file, through its symlinks) holds exactly `text`."""
    try:
        return Path(output).is_file() and _read_exactly(output) == text
    except (OSError, UnicodeDecodeError):
        return False


def _read_exactly(path: str) -> str:
    """The UTF-8 text of a file with its line endings as they are (read_text turns CRLF into
    LF, so a file that differs from what spindle writes only there passed --check)."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


STALE_TEXT_LINES = 8
"""Changed lines of text `stale_lines` shows at most."""
STALE_TEXT_WIDTH = 99
"""Characters of a changed line `stale_lines` shows at most."""


def _clipped(line: str, other: str) -> str:
    """`line` cut to STALE_TEXT_WIDTH characters, from a little before where it first differs
    from `other` when that lies further on, or to its end ('...' marks what is cut)."""
    if len(line) <= STALE_TEXT_WIDTH:
        return line
    width = STALE_TEXT_WIDTH - 3
    start = len(os.path.commonprefix([line, other])) - STALE_TEXT_WIDTH // 3
    if start <= 0:
        return line[:width] + "..."
    if start + width - 3 >= len(line):
        return "..." + line[-width:]
    return "..." + line[start:start + width - 3] + "..."


def provenance_changes(old: DerivedArtifact, new: DerivedArtifact) -> list[str]:
    """How `new` was made otherwise than `old`: its producer, and each recorded input whose
    content (sha256) or path changed, that is new, or that is gone."""
    lines: list[str] = []
    if old.producer != new.producer:
        lines.append(f"producer: {old.producer} -> {new.producer}")
    was = {r.kind: r for r in old.inputs}
    for ref in new.inputs:
        before = was.pop(ref.kind, None)
        if before is None:
            lines.append(f"input {ref.kind} {ref.path}: a new input")
        elif before.sha256 != ref.sha256:
            path_text = ref.path if before.path == ref.path else f"{before.path} -> {ref.path}"
            lines.append(f"input {ref.kind} {path_text} changed (sha256 "
                         f"{before.sha256[:12]} -> {ref.sha256[:12]})")
        elif before.path != ref.path:
            lines.append(f"input {ref.kind}: path {before.path} -> {ref.path} (same content)")
    lines += [f"input {ref.kind} {ref.path}: no longer an input" for ref in was.values()]
    return lines


def stale_lines(path: str, old_text: str, new_text: str, new: Artifact) -> list[str]:
    """Why the file at `path` (`old_text`) is not what the command makes now (`new`, rendered
    as `new_text`), for `--check` in CI: the recorded inputs or producer that changed, for a
    plan its semantic differences (`spindle diff`), and the first changed lines of text."""
    lines: list[str] = []
    # both as read back from text, so that numbers compare as written
    new = parse_artifact(parse_text(path, new_text), path, type(new))
    try:
        old = parse_artifact(parse_text(path, old_text), path, type(new))
    except SpindleError as e:
        lines.append(f"the file does not load: {e}")
        old = None
    if isinstance(old, DerivedArtifact) and isinstance(new, DerivedArtifact):
        lines += provenance_changes(old, new)
    if isinstance(old, Plan) and isinstance(new, Plan):
        lines += differences(old, new)
    old_lines, new_lines = old_text.splitlines(), new_text.splitlines()
    first = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=False))
                  if a != b), min(len(old_lines), len(new_lines)))
    changed: list[str] = []
    # the changed lines as a unified diff orders them; a long line is shown where it differs
    # from its counterpart (the line it replaces or that replaces it)
    matcher = difflib.SequenceMatcher(None, old_lines, new_lines)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            olds, news = old_lines[i1:i2], new_lines[j1:j2]
            changed += ["-" + _clipped(a, news[k] if k < len(news) else a)
                        for k, a in enumerate(olds)]
            changed += ["+" + _clipped(b, olds[k] if k < len(olds) else b)
                        for k, b in enumerate(news)]
    lines.append(f"text: {len(changed)} changed line(s), the first at line {first + 1}")
    lines += changed[:STALE_TEXT_LINES]
    if len(changed) > STALE_TEXT_LINES:
        lines.append(f"... {len(changed) - STALE_TEXT_LINES} more")
    return lines


def exit_with(code: int) -> None:
    """Exit with `code` when it is non-zero."""
    if code:
        sys.exit(code)


def memory_text(plan: Plan) -> str:
    """The memory strategies the plan counts on, as ', ZeRO-2, recompute' ('' for none)."""
    zero = plan.options.get("zero", "0")
    return (("" if zero == "0" else f", ZeRO-{zero}")
            + (", recompute" if plan.options.get("recompute") == "true" else ""))
