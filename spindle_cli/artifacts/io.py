"""Reading and writing artifact files: parse, check kind/version, validate, hash, atomic write.

YAML (`.yaml`, `.yml`) or JSON (`.json`) by file extension, with the same content. `-` as an
output path means stdout. Reading refuses, as one-line ArtifactErrors, what the parsers would
accept silently or crash on: a key repeated in a mapping, nesting deeper than MAX_NESTING,
integers longer than Python converts, and aliases that refer to their own value or expand the
file past MAX_EXPANDED_NODES values. Plain YAML scalars are numbers and booleans as YAML 1.2
reads them, not as YAML 1.1 (PyYAML's schema) does: `010` is 10, `1:00`, `0b1` and `on` are
strings.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from spindle_cli import __version__
from spindle_cli.artifacts.base import Artifact, DerivedArtifact, InputRef
from spindle_cli.artifacts.codec import describe_value, field_path, from_data, to_data
from spindle_cli.artifacts.limits import MAX_EXPANDED_NODES, MAX_FILE_BYTES, MAX_NESTING
from spindle_cli.errors import ArtifactError, FieldError, InputNotFound, SpindleError

A = TypeVar("A", bound=Artifact)

PRODUCER = f"spindle {__version__}"

_REGISTRY: dict[str, type[Artifact]] = {}


class _DuplicateKey(Exception):
    """A key repeated in one mapping (YAML or JSON), raised while parsing."""

    def __init__(self, field: str, key: object, where: str) -> None:
        super().__init__(field, key, where)
        self.field = field
        self.key = key
        self.where = where


class _UniqueKeys:
    """Loader mixin: refuse a key that repeats among a mapping's own keys, where PyYAML would
    keep the last value silently. Keys brought in by a `<<` merge may still be overridden."""

    _root: yaml.Node | None = None
    _merged: dict[yaml.Node, int]

    def construct_document(self, node: yaml.Node) -> Any:
        self._root, self._merged = node, {}
        return super().construct_document(node)  # type: ignore[misc]

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        own = node.value
        super().flatten_mapping(node)  # type: ignore[misc]
        if node.value is not own:
            # merged pairs were put before the node's own pairs (the merge keys are gone)
            self._merged[node] = len(node.value) - len(own)

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        # a plan's rank lists hold most of its scalars: plain decimals skip the resolvers'
        # regular expressions (same tag)
        if kind is yaml.ScalarNode and implicit[0] and _plain_decimal(value):
            return _INT_TAG
        return super().resolve(kind, value, implicit)  # type: ignore[misc,no-any-return]

    def construct_int(self, node: yaml.ScalarNode) -> int:
        """An integer as `_INT` spells it. PyYAML's `construct_yaml_int` reads YAML 1.1's:
        a leading 0 as octal, `0b` and base 60."""
        if _plain_decimal(node.value):
            return int(node.value)
        digits = node.value.replace("_", "")
        return int(digits, 16 if "x" in digits else 8 if "o" in digits else 10)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        mapping = super().construct_mapping(node, deep=deep)  # type: ignore[misc]
        merged = self._merged.get(node, 0)
        if merged == 0 and len(mapping) == len(node.value):
            return mapping  # the common case: no merge, no repeated key
        first: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value[merged:]:
            key = self.construct_object(key_node, deep=True)  # type: ignore[attr-defined]
            if key in first:
                a, b = first[key].start_mark.line + 1, key_node.start_mark.line + 1
                raise _DuplicateKey(_node_path(self._root, node, key), key,
                                    f"line {a}" if a == b else f"lines {a} and {b}")
            first[key] = key_node
        return mapping


_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"


def _plain_decimal(value: str) -> bool:
    """Whether a scalar is a decimal without sign or underscore, which int() reads as is."""
    return value.isascii() and value.isdecimal()


def _node_path(root: yaml.Node | None, target: yaml.Node, key: object) -> str:
    """The field path (`tasks[1].steps`) of `key` in the mapping node `target`, found from the
    document's root node; only computed for an error."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if node is target:
            return field_path(path, str(key))
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                stack.append((v, field_path(path, str(name))))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))
    return field_path("", str(key))


_LIBYAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _FastLoader(_UniqueKeys, _LIBYAML_LOADER):  # type: ignore[misc,valid-type]
    """The safe loader, backed by libyaml where PyYAML was built with it."""


class _SlowLoader(_UniqueKeys, yaml.SafeLoader):  # type: ignore[misc]
    """The pure-Python safe loader, whose syntax errors name the offending token."""


class _Dumper(yaml.SafeDumper):
    """The safe dumper; it quotes the strings that YAML 1.1 or the loaders above would read
    back as something else (`08` and `0o17` are numbers to the loaders only, `on` and `1:00`
    not to them), so that other YAML readers read the file alike."""


_EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""Numbers with an exponent that YAML 1.1 reads as text (989e12, 1.5e9: it wants a dot and
a signed exponent), as YAML 1.2 and JSON read them: numbers."""

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
"""YAML 1.2's booleans. YAML 1.1 also reads yes/no/on/off, so a module named `on` was True."""

_INT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
"""YAML 1.2's integers (decimal, `0o` octal, `0x` hex), with the sign and digit-grouping
underscores YAML 1.1 allows in them. YAML 1.1 also reads a leading 0 as octal (`010` was 8,
here 10), `0b1` as binary and `1:00` in base 60 (60): here `0b1` and `1:00` are strings, which
an integer field refuses."""

_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
                       |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                       |[-+]?\.(?:inf|Inf|INF)
                       |\.(?:nan|NaN|NAN))$""", re.X)
"""YAML 1.1's floats without base 60 (`1:30.5` was 90.5); `_EXPONENT` adds the exponent forms
YAML 1.1 lacks."""

for _loader in (_FastLoader, _SlowLoader):
    # YAML 1.1's booleans, integers and floats out, the ones above in
    _loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers
                if tag not in (_BOOL_TAG, _INT_TAG, _FLOAT_TAG)]
        for first, resolvers in _loader.yaml_implicit_resolvers.items()
    }
    _loader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))
    _loader.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
    _loader.add_implicit_resolver(_FLOAT_TAG, _FLOAT, list("-+0123456789."))
    _loader.add_constructor(_INT_TAG, _UniqueKeys.construct_int)
_Dumper.add_implicit_resolver(_INT_TAG, _INT, list("-+0123456789"))
for _cls in (_FastLoader, _SlowLoader, _Dumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _EXPONENT, list("-+0123456789"))

_LIBYAML_DUMPER = getattr(yaml, "CSafeDumper", None)


class _FastDumper(_LIBYAML_DUMPER or yaml.SafeDumper):  # type: ignore[misc]
    """`_Dumper` with libyaml's emitter, 3-4x faster on large plans. It writes the same bytes
    as the Python emitter where every string is printable ASCII and no key is empty; it
    escapes and wraps other strings (a newline, a tab, an accent) differently and writes an
    empty key otherwise, so those go to `_Dumper` (`_dump`). An empty value it writes alike
    (`''`): every baseline plan has one (`candidate`), and went to the Python emitter, 2x
    slower on a 100-task plan of 4096 devices."""


_FastDumper.yaml_implicit_resolvers = {
    first: list(resolvers) for first, resolvers in _Dumper.yaml_implicit_resolvers.items()}


def _represent_list(dumper: yaml.SafeDumper, data: list[Any]) -> yaml.SequenceNode:
    """A list of integers on one line, `ranks: [0, 1, 2, 3]` (wrapped past the line width),
    other lists a line per item: a plan's rank lists took a line per rank, 3.3x the lines
    of a 256-device plan, and a diff showed a changed rank without its slice."""
    flow = bool(data) and all(type(x) is int for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


for _dumper in (_Dumper, _FastDumper):
    _dumper.add_representer(list, _represent_list)


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey("", key, "")
            seen.add(key)
    return obj


_INTEGER_LIST = re.compile(r"\[[-0-9, \r\n]*\]")
"""A flow list of integers, its lines wrapped or not."""


def _check_nesting(path: str, text: str) -> None:
    """Refuse YAML nested deeper than MAX_NESTING before libyaml composes it (its composer
    recurses on the C stack and crashes the process on nesting in the tens of thousands)."""
    # Flow collections nest one level per bracket, block ones one level per column at most,
    # so this bound is cheap and almost always settles it without parsing. A list of integers
    # (a plan's rank lists, one per slice, transfer and group) holds no deeper one: all of
    # them count one level (a plan of over 900 such lists was parsed twice, 4.8 s of the
    # 31 s a 36 MB plan took to load).
    longest = max(map(len, text.split("\n")))
    rest = _INTEGER_LIST.sub("", text)
    if rest.count("[") + rest.count("{") + 1 + longest <= MAX_NESTING:
        return
    depth = 0
    try:
        for event in yaml.parse(text, Loader=_FastLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_NESTING:
                    line = event.start_mark.line + 1 if event.start_mark else 0
                    raise ArtifactError(path, "", f"invalid YAML at line {line}: nested more "
                                                  f"than {MAX_NESTING} levels deep")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.YAMLError:
        pass  # a syntax error: the parse below reports it


def _check_aliases(path: str, text: str) -> None:
    """Refuse YAML whose aliases refer to the value they are in, or expand it past
    MAX_EXPANDED_NODES values. Only called on text with a `*`, which every alias has."""
    try:
        root = yaml.compose(text, Loader=_FastLoader)
    except yaml.YAMLError:
        return  # a syntax error: the parse below reports it
    if root is None:
        return
    size: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        if children_done:
            open_.discard(id(node))
            size[id(node)] = min(1 + sum(size[id(c)] for c in children), MAX_EXPANDED_NODES + 1)
            continue
        if id(node) in size:
            continue
        if id(node) in open_:
            line = node.start_mark.line + 1
            raise ArtifactError(path, "", f"invalid YAML at line {line}: an alias refers to the "
                                          "value it is in")
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    if size[id(root)] > MAX_EXPANDED_NODES:
        raise ArtifactError(path, "", f"invalid YAML: its aliases expand it past "
                                      f"{MAX_EXPANDED_NODES} values")


def _value_problem(text: str, e: ValueError) -> str:
    """The problem of a ValueError raised while building values: PyYAML and json convert
    numbers and dates with int() and datetime, which raise ValueError rather than a parse
    error, for instance on an integer longer than Python converts (4300 digits by default)."""
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()
    long_int = re.search(rf"\d{{{limit + 1},}}", text) if limit else None
    if long_int:
        line = text.count("\n", 0, long_int.start()) + 1
        return f" at line {line}: integer with more than {limit} digits"
    return f": {e}"


def register(cls: type[A]) -> type[A]:
    """Class decorator: make an artifact kind loadable by `load_artifact`."""
    _REGISTRY[cls.KIND] = cls
    return cls


def kinds() -> dict[str, type[Artifact]]:
    """Every registered artifact kind, by name."""
    from spindle_cli.artifacts import cluster, graph, model, plan, profile  # noqa: F401

    return dict(sorted(_REGISTRY.items()))


def _format(path: str) -> str:
    if path == "-":
        # an input's path is recorded in what is made from it, and stdin names no file
        raise ArtifactError(path, "", "inputs are read from files, not stdin",
                            hint="write it to a file first (-o FILE) and give that")
    suffix = Path(path).suffix.lower()
    if suffix in (".yaml", ".yml"):
        return "yaml"
    if suffix == ".json":
        return "json"
    raise ArtifactError(path, "", "unknown file extension (expected .yaml, .yml or .json)")


def read_data(path: str) -> Any:
    """Parse a YAML or JSON file into plain data; one-line errors for unreadable files."""
    if Path(path).is_dir():  # before its name's suffix: a directory has none to judge
        raise ArtifactError(path, "", "is a directory, expected a file")
    fmt = _format(path)
    try:
        info = Path(path).stat()
        if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            # a pipe would block the read, a device (/dev/zero) never end it
            raise ArtifactError(path, "", "not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise ArtifactError(path, "", f"{info.st_size} bytes: larger than any artifact "
                                          f"({MAX_FILE_BYTES} bytes at most)")
        # a byte order mark (editors on Windows write one) is no part of the JSON or YAML
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ArtifactError(path, "", "no such file") from None
    except IsADirectoryError:
        raise ArtifactError(path, "", "is a directory, expected a file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(path, "", f"cannot read: {e}") from None
    return parse_text(path, text, fmt)


def parse_text(path: str, text: str, fmt: str | None = None) -> Any:
    """Parse `text` into plain data as the file `path` would be (`fmt`: 'yaml' or 'json',
    by default from the suffix); one-line errors naming `path`."""
    fmt = fmt or _format(path)
    conflict = re.search(r"^(<{7}|>{7}) ", text, re.M)
    if conflict:
        line = text.count("\n", 0, conflict.start()) + 1
        raise ArtifactError(path, "", f"git merge conflict markers at line {line}",
                            hint="resolve the conflict, or make the file again")
    try:
        return _parse(path, fmt, text)
    except _DuplicateKey as e:
        where = f" ({e.where})" if e.where else ""
        raise ArtifactError(path, e.field, f"duplicate key {e.key!r}{where}") from None
    except RecursionError:
        raise ArtifactError(path, "", f"invalid {fmt.upper()}: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError is one too, handled in _parse
        raise ArtifactError(path, "", f"invalid {fmt.upper()}{_value_problem(text, e)}") from None


def _parse(path: str, fmt: str, text: str) -> Any:
    if fmt == "json":
        try:
            return json.loads(text, object_pairs_hook=_json_object)
        except json.JSONDecodeError as e:
            raise ArtifactError(path, "", f"invalid JSON at line {e.lineno}: {e.msg}") from None
    _check_nesting(path, text)
    if "*" in text:
        _check_aliases(path, text)
    try:
        # libyaml parses large profiles ~6x faster; on an error, the pure-Python parser is
        # asked again because its messages name the offending token.
        return yaml.load(text, Loader=_FastLoader)
    except yaml.YAMLError:
        pass
    try:
        return yaml.load(text, Loader=_SlowLoader)
    except yaml.reader.ReaderError as e:
        # its own text spans two lines and counts characters from the start of the file
        line = text.count("\n", 0, e.position) + 1
        raise ArtifactError(path, "", f"invalid YAML at line {line}: unacceptable character "
                                      f"#x{e.character:04x}: {e.reason}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ArtifactError(path, "", f"invalid YAML{where}: {e.problem}") from None
    except yaml.YAMLError as e:
        raise ArtifactError(path, "", f"invalid YAML: {e}") from None


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
    try:
        return from_data(cls, data)
    except FieldError as e:
        raise ArtifactError(path, e.field, e.problem) from None


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


def names_directory(path: str) -> bool:
    """Whether an output name ends in a path separator: Path drops it, and the file was
    written where a shell would refuse (`-o x.yaml/`)."""
    return path.endswith(("/", os.sep))


def _places(ref: InputRef, owner_path: str) -> list[Path]:
    """The files that may be the input `ref` of the artifact read from `owner_path`, in the
    order `load_recorded_input` looks at them: as recorded, then above the artifact up to the
    top of its git work tree, and only where none of those exists, further up (a worktree or
    copy inside another checkout does not take that checkout's files for its own, and an
    input outside the checkout, recorded from where the command ran, is still found)."""
    owner = Path(owner_path).resolve()
    top = work_tree(owner)
    inside = [d for d in owner.parents if top is None or d.is_relative_to(top)]
    found = [p for p in (Path(ref.path), *(d / ref.path for d in inside)) if _is_file(p)]
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
        raise InputNotFound(owner_path, f"inputs[{index}].path",
                            f"{cls.KIND} file {ref.path!r} not found",
                            hint=f"it is looked for at that path from the working directory "
                                 f"and from each directory above {owner_path}: put the "
                                 f"{cls.KIND} there (its sha256 must be {ref.sha256[:12]}...)")
    place, obj = found
    if obj is None:
        there = load_artifact(str(place))  # the first file's error where it is invalid
        if there.kind != cls.KIND:
            raise ArtifactError(owner_path, f"inputs[{index}].kind",
                                f"a {cls.KIND} input recorded, but {str(place)!r} is a "
                                f"{there.kind}", hint=f"regenerate {owner_path}")
        raise ArtifactError(
            owner_path, f"inputs[{index}].sha256",
            f"{cls.KIND} {str(place)!r} changed since the {owner.kind.replace('_', ' ')} was "
            "made (sha256 mismatch)",
            hint=f"regenerate {owner_path} from the current inputs",
        )
    assert isinstance(obj, cls)  # the recorded content, kind included
    return str(place), obj


def canonical_json(obj: Artifact) -> bytes:
    """The canonical bytes that artifact hashes are computed over."""
    return json.dumps(to_data(obj), sort_keys=True, separators=(",", ":")).encode()


def sha256(obj: Artifact) -> str:
    """sha256 of the artifact's canonical form (comments and key order do not matter)."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def input_ref(obj: Artifact, path: str) -> InputRef:
    """An `inputs` entry naming an artifact and its content hash."""
    return InputRef(kind=obj.kind, path=path, sha256=sha256(obj))


def render(obj: Artifact, fmt: str) -> str:
    """Serialize an artifact as canonical YAML or JSON text."""
    data = to_data(obj)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return _dump(data)


def _dump(data: Any) -> str:
    """Canonical YAML of plain data: the same bytes from either emitter (`_FastDumper`)."""
    dumper = _FastDumper if _LIBYAML_DUMPER and _printable_ascii(data) else _Dumper
    return yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=False, width=100)


def _printable_ascii(data: Any) -> bool:
    """Whether every string in `data` (keys included) is printable ASCII, and no key empty."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not (item.isascii() and item.isprintable()):
                return False
        elif isinstance(item, dict):
            if "" in item:
                return False
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True


def write_artifact(obj: Artifact, path: str) -> None:
    """Write atomically (temp file in the target directory + rename); `-` writes YAML to stdout."""
    write_rendered(rendered_for(obj, path), path)


def write_rendered(text: str, path: str) -> None:
    """`write_artifact` for an artifact already rendered for `path` (`rendered_for`)."""
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    parent = Path(path).parent
    if not parent.is_dir():
        raise ArtifactError(path, "", f"output directory {str(parent)!r} does not exist")
    write_text_atomic(path, text)


def check_can_create(name: str, directory: Path) -> None:
    """SpindleError ('<name>: cannot write in <directory>: <why>') unless a file can be created
    in `directory`: one is made there and removed at once, as `write_text_atomic` makes its
    temp file. os.access cannot tell: it says yes to root where the file system refuses every
    new file (/proc, /sys, a root-squashed NFS export)."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".spindle-probe-")
    except OSError as e:
        raise SpindleError(f"{name}: cannot write in {str(directory)!r}: {e.strerror or e}"
                           ) from None
    os.close(fd)
    os.unlink(probe)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` as one step (`replace_atomic`)."""
    replace_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def replace_atomic(path: str | Path, write: Callable[[str], object], suffix: str = ".tmp"
                   ) -> None:
    """Make the file `path` names as one step: `write` fills a temp file (named to end in
    `suffix`) beside it, which is on disk before it is renamed over the file, so a failure or a
    kill leaves the old file whole. The file is the one `output_file` finds: through a
    symlink, its target (the link stays a link); a file it replaces keeps its permission bits
    (a 0600 file stays private), a new one gets the mode open() would give it (0666 less the
    umask). ArtifactError ('cannot write: ...') where `output_file` refuses, or the directory
    or the disk does."""
    target = output_file(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    except OSError as e:
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror}") from None
    try:
        try:
            write(tmp)
            os.fsync(fd)  # the file's data, whichever descriptor `write` wrote it through
        finally:
            os.close(fd)
        try:
            mode = stat.S_IMODE(target.stat().st_mode)
        except FileNotFoundError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)  # mkstemp creates 0600
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def output_file(path: str | Path) -> Path:
    """The file that writing `path` makes or replaces: `path`, or the file its symlinks lead
    to (made where a link dangles), so that the link stays a link, as with a shell's `>`.
    ArtifactError ('cannot write: ...') where that is a symlink loop, a directory, no regular
    file (a link to /dev/null must not replace the device) or a read-only file: one without
    its owner's write bit (which binds root too, whom os.access lets write anything) or one
    this user may not write (os.access, as open() sees it). A read-only file is refused, not
    replaced: `cp` and a recipe's `>` refuse it too, someone made it so on purpose (a measured
    profile cannot be made again), and `chmod u+w` is a deliberate step before `make`
    regenerates it."""
    target = Path(os.path.realpath(path))
    if target.is_symlink():  # realpath stops at a loop
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.ELOOP)}")
    try:
        info = target.stat()
    except FileNotFoundError:
        return target
    except OSError as e:
        raise ArtifactError(str(path), "", f"cannot write: {e.strerror or e}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.EISDIR)}")
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(str(path), "", "cannot write: not a regular file")
    if os.statvfs(target.parent).f_flag & os.ST_RDONLY:
        raise ArtifactError(str(path), "", f"cannot write: {os.strerror(errno.EROFS)}")
    if not info.st_mode & stat.S_IWUSR or not os.access(target, os.W_OK):
        raise ArtifactError(str(path), "", "cannot write: read-only file",
                            hint=f"make it writable (chmod u+w {target}) to replace it")
    return target


def as_written(obj: A) -> A:
    """`obj` as its file holds it: numbers rounded as the writer rounds them. What a stage
    computes from a file can differ from what it computes from the unrounded object (a
    planner near a tie keeps another candidate), so in-process pipelines that stand for the
    CLI's (`spindle bench`) pass their artifacts through this."""
    again = from_data(type(obj), to_data(obj))
    assert isinstance(again, type(obj))
    return again


def rendered_for(obj: Artifact, path: str) -> str:
    """The exact text `write_artifact(obj, path)` would write (for `--check`)."""
    return render(obj, "yaml" if path == "-" else _format(path))


def derived_header(kind: type[Artifact], inputs: list[InputRef]) -> dict[str, Any]:
    """Keyword arguments for the header fields of a new derived artifact."""
    assert issubclass(kind, DerivedArtifact)
    return {
        "kind": kind.KIND,
        "version": kind.VERSION,
        "producer": PRODUCER,
        "inputs": tuple(inputs),
    }
