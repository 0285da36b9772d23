"""Renamed keywords and names: the old one keeps working for a while, with a `DeprecationWarning` naming the new."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any


def renamed(new: str, value: Any, old: str, old_value: Any, *, default: Any = None, stacklevel: int = 3) -> Any:
    """``value`` of keyword ``new``, or ``old_value`` when given under its deprecated name ``old`` (not None).

    ``stacklevel`` 3 points the warning at the caller of the function that calls this.

    Raises:
      TypeError: both names were given.

    Example:
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     renamed("budget", None, "n_trials", 6)
      6
      >>> str(caught[0].message)
      '`n_trials` is deprecated: pass `budget`.'
    """
    if old_value is None:
        return value
    if value is not default:
        raise TypeError(f"give `{new}` alone; `{old}` is its deprecated name.")
    warnings.warn(f"`{old}` is deprecated: pass `{new}`.", DeprecationWarning, stacklevel)
    return old_value


def moved_names(module: str, names: Mapping[str, tuple[str, Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that answers each deprecated ``names[old] = (new, value)`` with a warning.

    Example:
      >>> __getattr__ = moved_names("pkg", {"Old": ("pkg.New", int)})
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     __getattr__("Old")
      <class 'int'>
      >>> str(caught[0].message)
      '`pkg.Old` is deprecated: use `pkg.New`.'
    """

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new, value = names[name]
        warnings.warn(f"`{module}.{name}` is deprecated: use `{new}`.", DeprecationWarning, 2)
        return value

    return __getattr__
