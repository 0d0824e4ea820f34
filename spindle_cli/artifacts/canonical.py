"""Canonical text of artifacts: the YAML and JSON every writer produces, byte for byte, and
the sha256 of an artifact's canonical JSON that derived artifacts record for their inputs.

The dumpers quote what the loaders (`parsing`) would read back as something else, and the
libyaml emitter is taken where it writes what the Python one does (`_dump`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.codec import to_data
from spindle_cli.artifacts.parsing import EXPONENT, FLOAT_TAG, INT, INT_TAG, file_format


class _Dumper(yaml.SafeDumper):
    """The safe dumper; it quotes the strings that YAML 1.1 or the loaders (`parsing`) would
    read back as something else (`08` and `0o17` are numbers to the loaders only, `on` and
    `1:00` not to them), so that other YAML readers read the file alike."""


_Dumper.add_implicit_resolver(INT_TAG, INT, list("-+0123456789"))
_Dumper.add_implicit_resolver(FLOAT_TAG, EXPONENT, list("-+0123456789"))

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


def canonical_json(obj: Artifact) -> bytes:
    """The canonical bytes that artifact hashes are computed over."""
    return json.dumps(to_data(obj), sort_keys=True, separators=(",", ":")).encode()


def sha256(obj: Artifact) -> str:
    """sha256 of the artifact's canonical form (comments and key order do not matter)."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


def render(obj: Artifact, fmt: str) -> str:
    """Serialize an artifact as canonical YAML or JSON text."""
    data = to_data(obj)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    return _dump(data)


def rendered_for(obj: Artifact, path: str) -> str:
    """The exact text `write_artifact(obj, path)` would write (for `--check`)."""
    return render(obj, "yaml" if path == "-" else file_format(path))


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
