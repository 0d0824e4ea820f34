"""Loading artifacts: the registry of kinds, the kind/version checks, validation, and finding
the inputs a derived artifact records.

Reading a file into plain data lives in `parsing`, canonical text and hashes in `canonical`,
writing files in `files`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

from spindle_cli import __version__
from spindle_cli.artifacts.base import Artifact, DerivedArtifact, InputRef
from spindle_cli.artifacts.canonical import sha256
from spindle_cli.artifacts.codec import describe_value, from_data, to_data
from spindle_cli.artifacts.parsing import read_data
from spindle_cli.errors import ArtifactError, FieldError, InputNotFound

A = TypeVar("A", bound=Artifact)

PRODUCER = f"spindle {__version__}"

_REGISTRY: dict[str, type[Artifact]] = {}


def register(cls: type[A]) -> type[A]:
    """Class decorator: make an artifact kind loadable by `load_artifact`."""
    _REGISTRY[cls.KIND] = cls
    return cls


def kinds() -> dict[str, type[Artifact]]:
    """Every registered artifact kind, by name."""
    from spindle_cli.artifacts import cluster, graph, model, plan, profile  # noqa: F401

    return dict(sorted(_REGISTRY.items()))


MADE_BY = {
    ("model", "metaop_graph"): "spindle graph {path} -o GRAPH makes its MetaOp graph",
    ("metaop_graph", "profile"): "spindle profile {path} --hardware HW -o PROFILE makes its "
                                 "profile",
    ("metaop_graph", "plan"): "spindle plan {path} PROFILE --cluster CLUSTER -o PLAN makes a "
                              "plan",
    ("profile", "plan"): "spindle plan GRAPH {path} --cluster CLUSTER -o PLAN makes a plan",
}
"""(kind given, kind expected) -> the command that makes the expected kind from the given one."""


def parse_artifact(data: Any, path: str, expect: type[A] | None = None) -> Artifact:
    """Validate plain data as an artifact: kind and version first, then every field."""
    registry = kinds()
    if not isinstance(data, dict):
        raise ArtifactError(path, "", "expected a mapping at the top level")
    kind = data.get("kind")
    if kind is None:
        raise ArtifactError(path, "kind", "missing required field")
    if not isinstance(kind, str):
        raise ArtifactError(path, "kind", f"expected a string, got {describe_value(kind)}")
    if kind not in registry:
        raise ArtifactError(path, "kind", f"unknown kind {kind!r} (known: {', '.join(registry)})")
    cls = registry[kind]
    if expect is not None and cls is not expect:
        raise ArtifactError(path, "kind", f"expected a {expect.KIND!r} artifact, got {kind!r}",
                            hint=MADE_BY.get((kind, expect.KIND), "").format(path=path) or None)
    version = data.get("version")
    if "version" not in data:
        raise ArtifactError(path, "version", "missing required field (the format version, "
                                             "an integer from 1)")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        got = version if isinstance(version, int) and not isinstance(version, bool) else (
            describe_value(version))
        raise ArtifactError(path, "version",
                            f"expected a format version (an integer from 1), got {got}")
    if version > cls.VERSION:
        raise ArtifactError(
            path,
            "version",
            f"{kind} version {version} is newer than this spindle reads ({cls.VERSION})",
            hint="upgrade spindle or regenerate the file",
        )
    if version < cls.VERSION:
        raise ArtifactError(
            path, "version", f"{kind} version {version} is no longer read (this spindle reads "
                             f"version {cls.VERSION})", hint="regenerate the file")
    _check_kind_fits(data, path, cls, registry)
    try:
        return from_data(cls, data)
    except FieldError as e:
        raise ArtifactError(path, e.field, e.problem) from None


def _check_kind_fits(data: dict[Any, Any], path: str, cls: type[Artifact],
                     registry: dict[str, type[Artifact]]) -> None:
    """ArtifactError at `kind` where the top-level fields are not of the kind the file says
    but all of another kind's (a model headed `kind: cluster` was refused for its first field,
    'modules: unknown field (did you mean 'num_nodes'?)')."""
    unknown = sorted(map(str, set(data) - {f.name for f in dataclasses.fields(cls)}))
    if not unknown:
        return
    fits = [k for k, other in registry.items() if other is not cls
            and set(data) <= {f.name for f in dataclasses.fields(other)}]
    if fits:
        listed = ", ".join(unknown[:3]) + (", ..." if len(unknown) > 3 else "")
        raise ArtifactError(path, "kind", f"says {cls.KIND!r}, but its fields are a "
                                          f"{fits[0]!r} artifact's ({listed}: not a "
                                          f"{cls.KIND}'s)", hint="fix the kind header")


def load_artifact(path: str, expect: type[A] | None = None) -> Any:
    """Load and validate an artifact file. With `expect`, the kind must match."""
    return parse_artifact(read_data(path), path, expect)


def load(path: str, cls: type[A]) -> A:
    """Load an artifact of a known kind (typed)."""
    obj = load_artifact(path, cls)
    assert isinstance(obj, cls)
    return obj


def work_tree(path: Path) -> Path | None:
    """The top of the git work tree `path` lies in (the nearest directory above it holding
    `.git`, a directory or, in a worktree or submodule, a file), or None."""
    return next((d for d in path.parents if (d / ".git").exists()), None)


def _places(ref: InputRef, owner_path: str) -> list[Path]:
    """The files that may be the input `ref` of the artifact read from `owner_path`, in the
    order `load_recorded_input` looks at them: as recorded, then above the artifact up to the
    top of its git work tree, and only where none of those exists, further up (a worktree or
    copy inside another checkout does not take that checkout's files for its own, and an
    input outside the checkout, recorded from where the command ran, is still found). An
    absolute path, recorded for files outside a checkout, is also looked for by its name
    beside the artifact: the two were moved together (`make demo OUT=/tmp/x`, then the
    directory renamed)."""
    owner = Path(owner_path).resolve()
    recorded = Path(ref.path)
    if recorded.is_absolute():
        return [p for p in dict.fromkeys((recorded, owner.parent / recorded.name))
                if _is_file(p)]
    top = work_tree(owner)
    inside = [d for d in owner.parents if top is None or d.is_relative_to(top)]
    found = [p for p in (recorded, *(d / ref.path for d in inside)) if _is_file(p)]
    if found or top is None:
        return found
    return [d / ref.path for d in owner.parents if not d.is_relative_to(top)
            and _is_file(d / ref.path)]


def _is_file(path: Path) -> bool:
    """Whether `path` is a file one may read; False where the name cannot be looked at (too
    long, a directory without search permission), which Path.is_file raises."""
    try:
        return path.is_file()
    except OSError:
        return False


def _find(ref: InputRef, owner_path: str) -> tuple[Path, Artifact | None] | None:
    """The first of `_places` holding a valid artifact with the content `ref` records, with that
    artifact; else the first place, with None; None where there is no place."""
    places = _places(ref, owner_path)
    for place in places:
        try:
            obj = load_artifact(str(place))
        except ArtifactError:
            continue
        if obj.kind == ref.kind and sha256(obj) == ref.sha256:
            return place, obj
    return (places[0], None) if places else None


def find_recorded_input(ref: InputRef, owner_path: str) -> Path | None:
    """Where the input `ref` of the artifact read from `owner_path` is (`load_recorded_input`
    says where it looks): the first place holding the recorded content, else the first
    holding a file of that name; None where there is none."""
    found = _find(ref, owner_path)
    return None if found is None else found[0]


def load_recorded_input(owner: DerivedArtifact, owner_path: str, cls: type[A]) -> tuple[str, A]:
    """Load the input of kind `cls.KIND` that `owner` (read from `owner_path`) records, and check
    it still hashes to the recorded sha256. Returns the path it was found at and the artifact.

    Paths are recorded relative to the top of the git checkout holding both files, to where the
    command that made `owner` ran, or absolute (`cli.common.recorded`): try the path as
    written, then relative to the directory of `owner_path` and each one above it up to the
    top of its git work tree, and beyond only where none of those exists (`_places`;
    committed plans record paths relative to the repository root), and take the first file
    with the recorded content: a stale file of the same name in the working directory does
    not hide the input beside the artifact. Where no file has it, the error is the first
    file's (invalid, or changed since).
    """
    kinds_recorded = [r.kind for r in owner.inputs]
    if cls.KIND not in kinds_recorded:
        raise ArtifactError(owner_path, "inputs", f"no {cls.KIND} input recorded")
    index = kinds_recorded.index(cls.KIND)
    ref = owner.inputs[index]
    found = _find(ref, owner_path)
    if found is None:
        where = (f"at that path and by its name beside {owner_path}"
                 if Path(ref.path).is_absolute() else
                 f"at that path from the working directory and from each directory above "
                 f"{owner_path}")
        raise InputNotFound(owner_path, f"inputs[{index}].path",
                            f"{cls.KIND} file {ref.path!r} not found",
                            hint=f"it is looked for {where}: put the {cls.KIND} there (its "
                                 f"sha256 must be {ref.sha256[:12]}...)")
    place, obj = found
    if obj is None:
        there = load_artifact(str(place))  # the first file's error where it is invalid
        if there.kind != cls.KIND:
            raise ArtifactError(owner_path, f"inputs[{index}].kind",
                                f"a {cls.KIND} input recorded, but {str(place)!r} is a "
                                f"{there.kind}",
                                hint=f"put the {cls.KIND} {owner_path} was made from back at "
                                     f"{str(place)!r}, or regenerate {owner_path}")
        raise ArtifactError(
            owner_path, f"inputs[{index}].sha256",
            f"{cls.KIND} {str(place)!r} changed since the {owner.kind.replace('_', ' ')} was "
            "made (sha256 mismatch)",
            hint=f"regenerate {owner_path} from the current inputs",
        )
    assert isinstance(obj, cls)  # the recorded content, kind included
    return str(place), obj


def input_ref(obj: Artifact, path: str) -> InputRef:
    """An `inputs` entry naming an artifact and its content hash."""
    return InputRef(kind=obj.kind, path=path, sha256=sha256(obj))


def as_written(obj: A) -> A:
    """`obj` as its file holds it: numbers rounded as the writer rounds them. What a stage
    computes from a file can differ from what it computes from the unrounded object (a
    planner near a tie keeps another candidate), so in-process pipelines that stand for the
    CLI's (`spindle bench`) pass their artifacts through this."""
    again = from_data(type(obj), to_data(obj))
    assert isinstance(again, type(obj))
    return again


def derived_header(kind: type[Artifact], inputs: list[InputRef]) -> dict[str, Any]:
    """Keyword arguments for the header fields of a new derived artifact."""
    assert issubclass(kind, DerivedArtifact)
    return {
        "kind": kind.KIND,
        "version": kind.VERSION,
        "producer": PRODUCER,
        "inputs": tuple(inputs),
    }
