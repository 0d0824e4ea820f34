"""JSON Schema export: one schema per artifact kind, published as `schemas/<kind>.json`.

The schemas are generated from the artifact dataclasses (`codec.json_schema`), so they cannot
disagree with the loader about field names, types, required fields and numeric bounds. They do
not carry the cross-field rules of `__post_init__` (references, DAG shape, shapes); the loader
remains the authority and `spindle validate` checks both.

    python -m spindle_cli.artifacts.schema schemas/          # write every schema
    python -m spindle_cli.artifacts.schema --check schemas/  # exit 1 if one is out of date
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.codec import json_schema
from spindle_cli.artifacts.files import write_text_atomic
from spindle_cli.artifacts.io import kinds
from spindle_cli.errors import ArtifactError


def artifact_schema(cls: type[Artifact]) -> dict[str, Any]:
    """The JSON Schema of one artifact kind, with `kind` and `version` pinned."""
    schema = json_schema(cls, title=f"Spindle {cls.KIND} artifact, version {cls.VERSION}")
    props = schema["properties"]
    props["kind"]["const"] = cls.KIND
    # The loader reads exactly this version (newer: upgrade spindle; older: regenerate).
    props["version"]["const"] = cls.VERSION
    return schema


def render_schema(cls: type[Artifact]) -> str:
    """The exact text of `schemas/<kind>.json` (field order kept, so diffs stay readable)."""
    return json.dumps(artifact_schema(cls), indent=2, ensure_ascii=True) + "\n"


def schema_files() -> dict[str, str]:
    """File name -> text of every schema, for every registered kind."""
    return {f"{kind}.json": render_schema(cls) for kind, cls in kinds().items()}


def write_schemas(directory: Path) -> list[Path]:
    """Write every schema into `directory` (atomically, deterministically); the paths written."""
    written = []
    for name, text in schema_files().items():
        path = directory / name
        write_text_atomic(path, text)
        written.append(path)
    return written


def stale_schemas(directory: Path) -> dict[str, tuple[str, list[str]]]:
    """The schema files in `directory` that are missing, differ from the code or belong to no
    artifact kind: name -> (the problem, the first `DIFF_LINES` lines of a unified diff from
    the file to the code's schema where it differs)."""
    expected = schema_files()
    stale: dict[str, tuple[str, list[str]]] = {}
    for name, text in expected.items():
        path = directory / name
        if not path.is_file():
            stale[name] = ("missing (regenerate it)", [])
            continue
        # line endings as they are (read_text turns CRLF into LF)
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            old = f.read()
        if old.replace("\r\n", "\n") == text != old:
            stale[name] = ("out of date (regenerate it)",
                           ["only its line endings: CRLF, where the code writes LF"])
        elif old != text:
            lines = list(difflib.unified_diff(old.splitlines(), text.splitlines(),
                                              f"{name} (file)", f"{name} (code)", lineterm="",
                                              n=1))
            more = len(lines) - DIFF_LINES
            stale[name] = ("out of date (regenerate it)",
                           lines[:DIFF_LINES] + ([f"... {more} more lines"] if more > 0 else []))
    for path in sorted(directory.glob("*.json")):
        if path.name not in expected:
            stale[path.name] = ("the schema of no artifact kind (remove it)", [])
    return stale


DIFF_LINES = 20
"""The most lines of a stale schema's diff `--check` prints."""


def main(argv: list[str]) -> int:
    """`python -m spindle_cli.artifacts.schema [--check] DIR`; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m spindle_cli.artifacts.schema",
        description="Write the JSON Schema of every artifact kind into DIR (schemas/).")
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a schema in DIR is missing, differs "
                             "from the code or belongs to no kind, and say how")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"error: {directory}: no such directory", file=sys.stderr)
        return 2
    if args.check:
        stale = stale_schemas(directory)
        for name, (problem, diff) in stale.items():
            print(f"{directory / name}: {problem}", file=sys.stderr)
            for line in diff:
                print(f"  {line}", file=sys.stderr)
        if any(name in schema_files() for name in stale):
            print(f"hint: python -m spindle_cli.artifacts.schema {directory} regenerates the "
                  "schemas of the kinds", file=sys.stderr)
        return 1 if stale else 0
    try:
        written = write_schemas(directory)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
