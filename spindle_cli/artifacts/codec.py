"""Typed, validated conversion between artifact dataclasses and plain data.

Artifacts are frozen dataclasses. Each field's type drives both directions:

- `from_data(cls, data, path)` checks types, missing and unknown fields, `Literal` choices and
  numeric bounds (field metadata `ge`, `gt`, `le`; integers fit in 64 bits, floats are
  finite), then calls the constructor, whose `__post_init__` may raise `FieldError` for
  cross-field rules. Problems surface as `FieldError` whose field is the full path from the
  artifact's root (`tasks[2].steps[1].module`).
- `to_data(obj)` returns plain dicts/lists in field order with floats at a fixed precision, so
  the same artifact always serializes to the same bytes.

Supported field types: int, float, str, bool, Literal[...], nested dataclasses, tuple[X, ...],
dict[str, X] (serialized with sorted keys) and X | None.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from spindle_cli.errors import FieldError, has_control

T = TypeVar("T")

FLOAT_DIGITS = 9
"""Significant digits kept for every float written to an artifact."""

INT_LIMIT = 2**63
"""Integers in an artifact lie in [-INT_LIMIT, INT_LIMIT): counts and byte sizes never come
near 2**63 (9.2e18 bytes), and the planner's arrays hold them as 64-bit integers. A
representation limit like the finiteness of floats, so the JSON Schemas do not repeat it."""


def meta(doc: str, *, ge_why: str = "", le_why: str = "", name: bool = False,
         path: bool = False, **bounds: float) -> dict[str, Any]:
    """Field metadata: a docstring for the JSON Schema plus optional `ge`/`gt`/`le` bounds;
    `ge_why` / `le_why` say in the error message why that bound is there; `name`: a string
    that names something in one-line errors, so neither blank nor holding line breaks or
    control characters, nor beginning or ending with a space (`NAME_PATTERN`); `path`: a
    recorded file path, as a name but free to begin or end with a space (`PATH_PATTERN`)."""
    whys = {k: v for k, v in (("ge_why", ge_why), ("le_why", le_why)) if v}
    kinds = {k: True for k, v in (("name", name), ("path", path)) if v}
    return {"doc": doc, **bounds, **whys, **kinds}


TEXT_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
"""Any string: no control character or line separator (`_check_text`)."""

PATH_PATTERN = r"^(?=.*\S)[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
"""A recorded path: something besides spaces, and no control character or line separator
(what would break a one-line error); the loader asks the same (`_check_blank`,
`_check_text`). A file's name may begin with a space."""

NAME_PATTERN = r"^(?=.*\S)(?!\s)(?!.*\s$)[^\x00-\x1f\x7f-\x9f\u2028\u2029]*$"
"""A name: as PATH_PATTERN, and no space first or last, a no-break one included
(`_check_name`)."""


def _check_blank(value: str, path: str) -> None:
    """A name or path is not blank (and, as every string, one line: `_check_text`)."""
    if not value.strip():
        raise FieldError(path, "must not be blank")


def _check_name(value: str, path: str) -> None:
    """A name is not blank and neither begins nor ends with a space: errors quote names
    between other words, where a doubled space goes unseen."""
    _check_blank(value, path)
    if value != value.strip():
        raise FieldError(path, f"{shown(value)}: must not begin or end with a space")


def _check_text(value: str, path: str) -> None:
    """Every string of an artifact is one line without control characters: views print them
    as they are (a description holding an escape code reset the terminal under `spindle
    show`), and errors quote them on one line."""
    if not has_control(value):
        return
    if value.endswith("\n") and not has_control(value[:-1]):
        raise FieldError(path, "must be one line (YAML's > and | blocks keep a final line "
                               "break, >- does not)")
    raise FieldError(path, f"{shown(value)}: must not hold line breaks or control characters")


def shown(value: str, most: int = 60) -> str:
    """`value` quoted as Python writes it, cut to its first `most` characters where longer
    (an error is one line: a 5000-character value filled the terminal)."""
    if len(value) <= most:
        return repr(value)
    return f"{value[:most]!r}... ({len(value)} characters)"


def canonical_float(x: float) -> float:
    """Round to FLOAT_DIGITS significant digits; -0.0 becomes 0.0."""
    if not math.isfinite(x):
        raise ValueError(f"non-finite float {x!r} cannot be written to an artifact")
    y = float(format(x, f".{FLOAT_DIGITS}g"))
    return 0.0 if y == 0 else y


def field_path(path: str, name: str) -> str:
    """`path.name`: the path of a field or a mapping key. A key with line breaks or escape
    codes is shown quoted, since an error is one plain line."""
    name = name if name.isprintable() else repr(name)
    return f"{path}.{name}" if path else name


def describe_value(value: Any) -> str:
    """What a parsed value is, for error messages: 'a list', 'an integer', 'null', ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = get_origin(tp)
    if _is_optional(tp):
        if value is None:
            return None
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return _convert(inner, value, path)
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices or isinstance(value, bool):
            allowed = ", ".join(repr(c) for c in choices)
            got = (repr(value) if isinstance(value, str | int | float)
                   and not isinstance(value, bool) else describe_value(value))
            raise FieldError(path, f"must be one of {allowed}, got {got}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise FieldError(path, f"expected a boolean, got {describe_value(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            # 8.0e+10 bytes: a whole number written in exponent form (exact up to 2**53)
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldError(path, f"expected an integer, got {describe_value(value)}")
        if not -INT_LIMIT <= value < INT_LIMIT:
            raise FieldError(path, "expected a 64-bit integer, got one that needs "
                                   f"{value.bit_length() + 1} bits")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldError(path, f"expected a number, got {describe_value(value)}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond the float range
            raise FieldError(path, "expected a finite number, got an integer too large for "
                                   "a float") from None
        if not math.isfinite(number):
            raise FieldError(path, f"expected a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise FieldError(path, f"expected a string, got {describe_value(value)}")
        _check_text(value, path)
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise FieldError(path, f"expected a list, got {describe_value(value)}")
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        if item is int and all(type(v) is int for v in value) and (
                not value or -INT_LIMIT <= min(value) and max(value) < INT_LIMIT):
            return tuple(value)  # a plan's rank lists: each item as _convert would give it
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise FieldError(path, f"expected a mapping, got {describe_value(value)}")
        _, item = get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise FieldError(path, f"keys must be strings, got {k!r}")
            out[k] = _convert(item, v, field_path(path, k))
        return out
    if dataclasses.is_dataclass(tp):
        return from_data(tp, value, path)
    raise TypeError(f"unsupported artifact field type {tp!r}")


def _check_bounds(field: dataclasses.Field[Any], value: Any, path: str) -> None:
    md = field.metadata
    if value is None or isinstance(value, (str, bool)):
        return
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        if "ge" in md and v < md["ge"]:
            raise FieldError(path, f"must be >= {md['ge']}, got {_shown(v)}{_why(md, 'ge')}")
        if "gt" in md and v <= md["gt"]:
            raise FieldError(path, f"must be > {md['gt']}, got {_shown(v)}")
        if "le" in md and v > md["le"]:
            raise FieldError(path, f"must be <= {md['le']}, got {_shown(v)}{_why(md, 'le')}")


def _shown(v: float) -> str:
    # str() refuses integers of more than 4300 digits; past ~60 digits the size says enough
    if isinstance(v, int) and v.bit_length() > 200:
        return f"a {v.bit_length()}-bit integer"
    return str(v)


def _why(md: typing.Mapping[str, Any], bound: str) -> str:
    return f" ({md[bound + '_why']})" if bound + "_why" in md else ""


def _wide(raw: Any) -> bool:
    """Whether a parsed value (a number or a list of them) holds an integer beyond 64 bits."""
    if type(raw) is int:
        return not -INT_LIMIT <= raw < INT_LIMIT
    if type(raw) is list:
        return any(type(v) is int and not -INT_LIMIT <= v < INT_LIMIT for v in raw)
    return False


@functools.cache
def _layout(
    cls: type,
) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]], dict[str, bool]]:
    # Resolving type hints is costly and a profile holds thousands of records of a few classes.
    fields = {f.name: f for f in dataclasses.fields(cls)}
    bounded = {n: any(k in f.metadata for k in ("ge", "gt", "le")) for n, f in fields.items()}
    return typing.get_type_hints(cls), fields, bounded


def from_data(cls: type[T], data: Any, path: str = "") -> T:
    """Build and validate a dataclass from plain data; raise FieldError with the full path."""
    if not isinstance(data, dict):
        raise FieldError(path, f"expected a mapping, got {describe_value(data)}")
    hints, fields, bounded = _layout(cls)
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        key = str(unknown[0])
        near = difflib.get_close_matches(key, [n for n in fields if n not in data], n=1)
        raise FieldError(field_path(path, key),
                         f"unknown field (did you mean {near[0]!r}?)" if near else "unknown field")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise FieldError(field_path(path, name), "missing required field")
            continue
        raw = data[name]
        if bounded[name] and _wide(raw):
            # the field's own bound explains more than "expected a 64-bit integer" does
            _check_bounds(f, tuple(raw) if isinstance(raw, list) else raw, field_path(path, name))
        value = _convert(hints[name], raw, field_path(path, name))
        _check_bounds(f, value, field_path(path, name))
        if f.metadata.get("name"):
            _check_name(value, field_path(path, name))
        elif f.metadata.get("path"):
            _check_blank(value, field_path(path, name))
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except FieldError as e:
        raise FieldError(field_path(path, e.field), e.problem) from None


def to_data(obj: Any) -> Any:
    """Plain, canonical data for an artifact value (field order kept, dict keys sorted)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return canonical_float(obj)
    if isinstance(obj, (tuple, list)):
        return [to_data(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_data(obj[k]) for k in sorted(obj)}
    # numpy scalars and other number-likes: convert at the boundary.
    if hasattr(obj, "item"):
        return to_data(obj.item())
    raise TypeError(f"cannot serialize {type(obj).__name__} in an artifact")


def json_schema(cls: type, *, title: str | None = None) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) for an artifact dataclass."""
    defs: dict[str, Any] = {}
    root = _schema_for(cls, defs)
    schema: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
    if title:
        schema["title"] = title
    schema.update(defs.pop(cls.__name__))
    if defs:
        schema["$defs"] = {k: defs[k] for k in sorted(defs)}
    del root
    return schema


_BOUND_KEYWORDS = (("ge", "minimum"), ("gt", "exclusiveMinimum"), ("le", "maximum"))
"""Field-metadata bound -> JSON Schema keyword."""


def _bounded(prop: dict[str, Any]) -> dict[str, Any] | None:
    """The sub-schema numeric bounds apply to: the number itself, the items of a list, or the
    non-null branch of an optional field (where `from_data` checks them too)."""
    if "anyOf" in prop:
        prop = prop["anyOf"][0]
    if prop.get("type") == "array":
        prop = prop["items"]
    return prop if prop.get("type") in ("integer", "number") else None


def _schema_for(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    origin = get_origin(tp)
    if _is_optional(tp):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return {"anyOf": [_schema_for(inner, defs), {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(get_args(tp))}
    if tp is str:
        return {"type": "string", "pattern": TEXT_PATTERN}
    simple = {bool: "boolean", int: "integer", float: "number"}
    if tp in simple:
        return {"type": simple[tp]}
    if origin is tuple:
        (item,) = [a for a in get_args(tp) if a is not Ellipsis]
        return {"type": "array", "items": _schema_for(item, defs)}
    if origin is dict:
        _, item = get_args(tp)
        return {"type": "object", "additionalProperties": _schema_for(item, defs)}
    if dataclasses.is_dataclass(tp):
        name = tp.__name__
        if name not in defs:
            defs[name] = {}
            hints = typing.get_type_hints(tp)
            props: dict[str, Any] = {}
            required = []
            for f in dataclasses.fields(tp):
                prop = _schema_for(hints[f.name], defs)
                md = f.metadata
                if "doc" in md:
                    prop["description"] = md["doc"]
                if md.get("name"):
                    prop["pattern"] = NAME_PATTERN
                elif md.get("path"):
                    prop["pattern"] = PATH_PATTERN
                target = _bounded(prop)
                if target is not None:
                    for key, kw in _BOUND_KEYWORDS:
                        if key in md:
                            target[kw] = md[key]
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    required.append(f.name)
                props[f.name] = prop
            body: dict[str, Any] = {"type": "object", "additionalProperties": False}
            if tp.__doc__:
                body["description"] = " ".join(tp.__doc__.split())
            body["properties"] = props
            body["required"] = required
            defs[name] = body
        return {"$ref": f"#/$defs/{name}"}
    raise TypeError(f"unsupported artifact field type {tp!r}")
