"""Byte quantities: parse ``"1.5GiB"``/``"800MB"``/ints and format them for people."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, name: str = "memory_limit") -> int:
    """Bytes in ``value``: an int, or a string like ``"1.5GiB"``, ``"800MB"``, ``"2e9"``.

    Example:
      >>> parse_bytes("1.5GiB")
      1610612736
      >>> try:
      ...     parse_bytes("-1GiB")
      ... except ValueError as e:
      ...     print(e)
      `memory_limit` must be positive, got memory_limit='-1GiB'.

    Raises:
      ValueError: the value does not parse, is not positive, or is under one byte (the message names ``name``).
    """
    if isinstance(value, bool):
        raise TypeError(f"`{name}` must be bytes (int) or a string like '1.5GiB', got {value!r}.")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _PATTERN.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"`{name}`={value!r} does not parse as a byte size; write e.g. 1610612736, '1.5GiB', '800MB' "
                f"(units: {', '.join(u for u in _UNITS if u)})."
            )
        number = float(match.group(1)) * _UNITS[unit]
    if not number > 0:
        raise ValueError(f"`{name}` must be positive, got {name}={value!r}.")
    if number < 1:
        raise ValueError(
            f"`{name}`={value!r} is less than one byte: it is a size in bytes, not a fraction; write e.g. '12GiB'."
        )
    return int(number)


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units, e.g. ``'1.50 GiB'``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
