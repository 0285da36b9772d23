"""One JSON encoding for every result type (`Plan`, `ProbeResult`, `Estimate`, `Capacity`, `TuneResult`, ...).

A result is a frozen dataclass that mixes in `JsonMixin`: ``to_dict``/``to_json`` encode its fields
recursively (dataclasses and NamedTuples as objects, enums as their values, tuples as lists, numpy scalars as
numbers), plus the computed properties it lists in ``json_properties``; ``from_dict``/``from_json`` decode
them back into the same types, guided by the field annotations. Fields with ``metadata=NOT_JSON`` (a live
``jax.Device``, a compiled update) are left out and must have defaults. Types with a ``json_format`` tag it
as ``"format"`` and check it on loading, so one kind of file is never read as another.

Example:
  >>> import dataclasses
  >>> @dataclasses.dataclass(frozen=True)
  ... class Point(JsonMixin):
  ...     x: int
  ...     tags: tuple[str, ...] = ()
  >>> Point.from_json(Point(1, ("a",)).to_json()) == Point(1, ("a",))
  True
"""

from __future__ import annotations

import dataclasses
import enum
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

T = TypeVar("T", bound="JsonMixin")


NOT_JSON: Mapping[str, bool] = types.MappingProxyType({"json": False})
"""``dataclasses.field(metadata=NOT_JSON, default=...)`` leaves a field out of the JSON encoding."""


def encode(value: Any) -> Any:
    """``value`` as plain JSON data (see the module docstring)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {
            f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value) if f.metadata.get("json", True)
        }
        for name in getattr(type(value), "json_properties", ()):
            out[name] = encode(getattr(value, name))
        tag = getattr(type(value), "json_format", None)  # (nested too: a tune's plan reads back as a plan file)
        return {"format": tag, **out} if tag else out
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {k: encode(v) for k, v in zip(value._fields, value, strict=True)}
    if isinstance(value, enum.Enum):
        return encode(value.value)
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.dtype):
        return value.name
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"cannot encode {type(value).__name__} {value!r} as JSON; give its field metadata=NOT_JSON.")


def decode(tp: Any, value: Any) -> Any:
    """Plain JSON data ``value`` back as type ``tp`` (the inverse of `encode` for annotated types)."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return decode(arg, value)
            except (TypeError, ValueError, KeyError) as e:
                errors.append(e)
        raise ValueError(f"{value!r} matches none of {tp}: {errors}")
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v) for v in value)
        return tuple(decode(a, v) for a, v in zip(args, value, strict=True)) if args else tuple(value)
    if origin in (list, typing.List):  # noqa: UP006
        (arg,) = typing.get_args(tp) or (Any,)
        return [decode(arg, v) for v in value]
    if origin in (dict, Mapping, typing.Dict) or tp in (dict, Mapping):  # noqa: UP006
        args = typing.get_args(tp)
        arg = args[1] if len(args) == 2 else Any
        return {k: decode(arg, v) for k, v in value.items()}
    if isinstance(tp, type):
        if dataclasses.is_dataclass(tp):
            return _decode_fields(tp, value, [f.name for f in dataclasses.fields(tp) if f.metadata.get("json", True)])
        if issubclass(tp, tuple) and hasattr(tp, "_fields"):
            return _decode_fields(tp, value, list(tp._fields))
        if issubclass(tp, enum.Enum):
            return tp(value)
        if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if tp in (int, str, bool) and not isinstance(value, tp):
            raise TypeError(f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _decode_fields(cls: type, data: Any, names: list[str]) -> Any:
    if not isinstance(data, Mapping):
        raise TypeError(f"expected an object for {cls.__name__}, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: decode(hints.get(name, Any), data[name]) for name in names if name in data})


class JsonMixin:
    """``to_dict``/``to_json``/``from_dict``/``from_json`` for a frozen dataclass (see the module docstring).

    Class attributes:
      json_format: the ``"format"`` tag written and checked (None: no tag).
      json_properties: computed properties written too (ignored when reading).
    """

    json_format: ClassVar[str | None] = None
    json_properties: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON data."""
        return encode(self)

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_dict(cls: type[T], data: Any, source: str | None = None) -> T:
        """Decodes `to_dict` output; ``ValueError`` naming ``source`` when it is not one of these."""
        source = source or f"this {cls.__name__} data"
        if not isinstance(data, Mapping):
            raise ValueError(f"{source} is not a JSON object but {type(data).__name__}.")
        data = dict(data)
        tag = data.pop("format", None)
        if cls.json_format and tag != cls.json_format:
            raise ValueError(f'{source} is not an autoaccum {cls.__name__} (expected "format": {cls.json_format!r}).')
        assert dataclasses.is_dataclass(cls)
        known = {f.name for f in dataclasses.fields(cls)} | set(cls.json_properties)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source} has unknown field(s) {unknown}; it may come from a newer autoaccum.")
        try:
            decoded: T = decode(cls, data)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{source} is missing fields or has wrong types ({e}).") from e
        return decoded

    @classmethod
    def from_json(cls: type[T], text: str, source: str | None = None) -> T:
        """Parses `to_json` output; ``ValueError`` naming ``source`` when it is not valid."""
        source = source or f"this {cls.__name__} JSON"
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source} is not valid JSON ({e}).") from e
        return cls.from_dict(data, source)
