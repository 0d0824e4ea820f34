"""Header fields shared by every artifact kind.

Every file starts with `kind` and an integer `version`. Derived artifacts (made by a Spindle
command from other artifacts) also record the `producer` and, in `inputs`, the sha256 of the
canonical form of each artifact they were made from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from spindle_cli.artifacts.codec import meta
from spindle_cli.errors import FieldError


@dataclass(frozen=True, slots=True, kw_only=True)
class InputRef:
    """An artifact this one was made from."""

    kind: str = field(metadata=meta("kind of the input artifact"))
    path: str = field(metadata=meta("path as given on the command line", path=True))
    sha256: str = field(metadata=meta("sha256 of the input's canonical JSON form"))

    def __post_init__(self) -> None:
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise FieldError("sha256", f"expected 64 lowercase hex digits, got {self.sha256!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Artifact:
    """Base of every artifact: the kind and the format version."""

    KIND: ClassVar[str] = ""
    VERSION: ClassVar[int] = 1

    kind: str = field(metadata=meta("artifact kind"))
    version: int = field(metadata=meta("format version of this kind", ge=1))

    def __post_init__(self) -> None:
        if self.kind != self.KIND:
            raise FieldError("kind", f"expected {self.KIND!r}, got {self.kind!r}")
        if self.version != self.VERSION:
            raise FieldError("version", f"expected {self.VERSION}, got {self.version}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DerivedArtifact(Artifact):
    """An artifact produced by a Spindle command from other artifacts."""

    INPUT_KINDS: ClassVar[tuple[str, ...]] = ()
    """The kinds of artifact this kind is made from."""

    producer: str = field(metadata=meta("the Spindle version that wrote this file", name=True))
    inputs: tuple[InputRef, ...] = field(metadata=meta("artifacts this one was made from"))

    def __post_init__(self) -> None:
        Artifact.__post_init__(self)
        seen: set[str] = set()
        for i, ref in enumerate(self.inputs):
            if ref.kind not in self.INPUT_KINDS:
                # readers look inputs up by kind: one of another kind is never read
                raise FieldError(f"inputs[{i}].kind",
                                 f"expected one of {', '.join(self.INPUT_KINDS)} (what a "
                                 f"{self.KIND.replace('_', ' ')} is made from), got {ref.kind!r}")
            if ref.kind in seen:
                # readers take the first: a second would pass every check unread
                raise FieldError(f"inputs[{i}].kind",
                                 f"a second {ref.kind!r} input (one of each kind)")
            seen.add(ref.kind)

    def input(self, kind: str) -> InputRef:
        """The (first) input of the given kind."""
        for ref in self.inputs:
            if ref.kind == kind:
                return ref
        raise KeyError(kind)
