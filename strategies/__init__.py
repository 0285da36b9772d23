"""Interchangeable ways to accumulate gradients, behind one interface.

Example:
  >>> import strategies
  >>> strategies.available()
  ('scan', 'loop', 'multisteps')
"""

from __future__ import annotations

from strategies._base import Accum, Program, Spec, Strategy
from strategies.loop import Loop
from strategies.multisteps import MultiSteps
from strategies.scan import Scan

_REGISTRY: dict[str, type[Strategy]] = {cls.name: cls for cls in (Scan, Loop, MultiSteps)}


def available() -> tuple[str, ...]:
    """Names of the registered strategies, the default (``"scan"``) first."""
    return tuple(_REGISTRY)


def get(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists those that are).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown `strategy` {name!r}; choose one of {', '.join(map(repr, available()))}.")
    return _REGISTRY[name]


__all__ = ["Accum", "Loop", "MultiSteps", "Program", "Scan", "Spec", "Strategy", "available", "get"]
