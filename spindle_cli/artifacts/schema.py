"""JSON Schema export: one schema per artifact kind, published as `schemas/<kind>.json`.

The schemas are generated from the artifact dataclasses (`codec.json_schema`), so they cannot
disagree with the loader about field names, types, required fields and numeric bounds. They do
not carry the cross-field rules of `__post_init__` (references, DAG shape, shapes); the loader
remains the authority and `spindle validate` checks both.

    python -m spindle_cli.artifacts.schema schemas/          # write every schema
    python -m spindle_cli.artifacts.schema --check schemas/  # exit 1 if one is out of date
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from spindle_cli.artifacts.base import Artifact
from spindle_cli.artifacts.codec import json_schema
from spindle_cli.artifacts.io import kinds, write_text_atomic
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


def stale_schemas(directory: Path) -> list[str]:
    """Names of the schema files in `directory` that are missing or differ from the code."""
    stale = []
    for name, text in schema_files().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(name)
    return stale


def main(argv: list[str]) -> int:
    """`python -m spindle_cli.artifacts.schema [--check] DIR`; returns the exit code."""
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    if len(args) != 1:
        print("usage: python -m spindle_cli.artifacts.schema [--check] DIR", file=sys.stderr)
        return 2
    directory = Path(args[0])
    if not directory.is_dir():
        print(f"error: {directory}: no such directory", file=sys.stderr)
        return 2
    if check:
        stale = stale_schemas(directory)
        for name in stale:
            print(f"{directory / name}: out of date (regenerate it)", file=sys.stderr)
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
