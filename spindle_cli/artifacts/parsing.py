"""Parsing artifact files into plain data, with the checks that make reading safe.

YAML (`.yaml`, `.yml`) or JSON (`.json`) by file extension, with the same content. Reading
refuses, as one-line ArtifactErrors, what the parsers would accept silently or crash on: a key
repeated in a mapping, nesting deeper than MAX_NESTING, integers longer than Python converts,
and aliases that refer to their own value or expand the file past MAX_EXPANDED_NODES values.
Plain YAML scalars are numbers and booleans as YAML 1.2 reads them, not as YAML 1.1 (PyYAML's
schema) does: `010` is 10, `1:00`, `0b1` and `on` are strings. Checking a file's kind and
fields lives in `io`, writing canonical text in `canonical`.
"""

from __future__ import annotations

import json
import re
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from spindle_cli.artifacts.codec import field_path
from spindle_cli.artifacts.limits import MAX_EXPANDED_NODES, MAX_FILE_BYTES, MAX_NESTING
from spindle_cli.errors import ArtifactError


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
        """Put the pairs `<<` merges before the node's own pairs (the merge keys gone), so
        that constructing it keeps the last of each key: its own over merged ones, and of a
        list of merged mappings the earlier ones. PyYAML's own (as of 6.0.3) does the same;
        6.0.4 keeps the first pair of a one-character key instead (a mapping that merged one
        which merged another lost its own value to the innermost one), so it is not used."""
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        own: list[tuple[yaml.Node, yaml.Node]] = []
        merging = False  # an empty mapping merges nothing, but its `<<` goes all the same
        for key_node, value_node in node.value:
            if key_node.tag != _MERGE_TAG:
                if key_node.tag == _VALUE_TAG:
                    key_node.tag = _STR_TAG
                own.append((key_node, value_node))
                continue
            merging = True
            if isinstance(value_node, yaml.MappingNode):
                sources = [value_node]
            elif isinstance(value_node, yaml.SequenceNode):
                sources = value_node.value[::-1]
            else:
                raise _not_merged(node, value_node, "a mapping or list of mappings")
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise _not_merged(node, source, "a mapping")
                self.flatten_mapping(source)
                merged.extend(source.value)
        if merging:
            node.value = merged + own
            self._merged[node] = len(merged)

    def resolve(self, kind: type[yaml.Node], value: Any, implicit: tuple[bool, bool]) -> str:
        # a plan's rank lists hold most of its scalars: plain decimals skip the resolvers'
        # regular expressions (same tag)
        if kind is yaml.ScalarNode and implicit[0] and _plain_decimal(value):
            return INT_TAG
        return super().resolve(kind, value, implicit)  # type: ignore[misc,no-any-return]

    def construct_int(self, node: yaml.ScalarNode) -> int:
        """An integer as `INT` spells it. PyYAML's `construct_yaml_int` reads YAML 1.1's:
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


def _not_merged(node: yaml.Node, value: yaml.Node, expected: str) -> yaml.MarkedYAMLError:
    """PyYAML's error for a `<<` of `value`, which is not what it merges."""
    return yaml.constructor.ConstructorError(
        "while constructing a mapping", node.start_mark,
        f"expected {expected} for merging, but found {value.id}", value.start_mark)


_MERGE_TAG = "tag:yaml.org,2002:merge"
_VALUE_TAG = "tag:yaml.org,2002:value"
_STR_TAG = "tag:yaml.org,2002:str"
_BOOL_TAG = "tag:yaml.org,2002:bool"
INT_TAG = "tag:yaml.org,2002:int"
FLOAT_TAG = "tag:yaml.org,2002:float"


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


EXPONENT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
"""Numbers with an exponent that YAML 1.1 reads as text (989e12, 1.5e9: it wants a dot and
a signed exponent), as YAML 1.2 and JSON read them: numbers."""

_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
"""YAML 1.2's booleans. YAML 1.1 also reads yes/no/on/off, so a module named `on` was True."""

INT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+)$")
"""YAML 1.2's integers (decimal, `0o` octal, `0x` hex), with the sign and digit-grouping
underscores YAML 1.1 allows in them. YAML 1.1 also reads a leading 0 as octal (`010` was 8,
here 10), `0b1` as binary and `1:00` in base 60 (60): here `0b1` and `1:00` are strings, which
an integer field refuses."""

_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?
                       |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                       |[-+]?\.(?:inf|Inf|INF)
                       |\.(?:nan|NaN|NAN))$""", re.X)
"""YAML 1.1's floats without base 60 (`1:30.5` was 90.5); `EXPONENT` adds the exponent forms
YAML 1.1 lacks."""

for _loader in (_FastLoader, _SlowLoader):
    # YAML 1.1's booleans, integers and floats out, the ones above in
    _loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers
                if tag not in (_BOOL_TAG, INT_TAG, FLOAT_TAG)]
        for first, resolvers in _loader.yaml_implicit_resolvers.items()
    }
    _loader.add_implicit_resolver(_BOOL_TAG, _BOOL, list("tTfF"))
    _loader.add_implicit_resolver(INT_TAG, INT, list("-+0123456789"))
    _loader.add_implicit_resolver(FLOAT_TAG, _FLOAT, list("-+0123456789."))
    _loader.add_implicit_resolver(FLOAT_TAG, EXPONENT, list("-+0123456789"))
    _loader.add_constructor(INT_TAG, _UniqueKeys.construct_int)


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
    except yaml.YAMLError as e:
        # libyaml 0.2.6 (PyYAML 6.0.4 bundles it) stops at 1000 levels itself, MAX_NESTING
        mark = getattr(e, "problem_mark", None)
        if getattr(e, "problem", None) == "exceeded maximum nesting depth" and mark is not None:
            raise ArtifactError(path, "", f"invalid YAML at line {mark.line + 1}: nested more "
                                          f"than {MAX_NESTING} levels deep") from None
        # a syntax error: the parse below reports it


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


def file_format(path: str) -> str:
    """'yaml' or 'json', as the suffix of `path` says; an ArtifactError for stdin and others."""
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
    fmt = file_format(path)
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
    except UnicodeDecodeError as e:
        line = len(re.findall(rb"\r\n|\r|\n", e.object[:e.start])) + 1  # as YAML counts
        raise ArtifactError(path, "", f"not UTF-8 text: byte 0x{e.object[e.start]:02x} at line "
                                      f"{line}") from None
    except OSError as e:
        raise ArtifactError(path, "", f"cannot read: {e}") from None
    return parse_text(path, text, fmt)


def parse_text(path: str, text: str, fmt: str | None = None) -> Any:
    """Parse `text` into plain data as the file `path` would be (`fmt`: 'yaml' or 'json',
    by default from the suffix); one-line errors naming `path`."""
    fmt = fmt or file_format(path)
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
