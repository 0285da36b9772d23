"""Interchangeable ways to accumulate gradients, behind one interface (installed as ``autoaccum.strategies``).

Every strategy computes the same update (see `Strategy`); they differ in how the microbatches are run. A
strategy of your own subclasses `Strategy`, builds on the pieces exported here (`weighted_grad`,
`apply_optimizer`, ...) and is made available everywhere (``build_update(strategy=...)``, the tuner, the CLI,
and the conformance test suite) by `register`. `Auto`, `build_update`'s default, is no strategy of its own: it
runs ``scan``, or ``loop`` where XLA:CPU would run a convolution slowly inside ``scan``'s loop.

Example:
  >>> from autoaccum import strategies
  >>> strategies.available()
  ('scan', 'loop', 'multisteps')
"""

from __future__ import annotations

from autoaccum.strategies._base import (
    SCHEDULES,
    Accum,
    LossReduction,
    OutDtypes,
    Program,
    PyTree,
    Schedule,
    Spec,
    accumulate_in_scan,
    add,
    apply_optimizer,
    check_params,
    finish_loss,
    leading_size,
    mean_grads,
    output_dtypes,
    signature,
    take,
    tree_bytes,
    weighted_grad,
)
from autoaccum.strategies._layout import Layout, check_microbatch, layout_of
from autoaccum.strategies._remat import REMAT_POLICIES, check_remat
from autoaccum.strategies._strategy import Call, Strategy
from autoaccum.strategies.auto import Auto, has_convolution
from autoaccum.strategies.loop import Loop
from autoaccum.strategies.multisteps import MultiSteps
from autoaccum.strategies.scan import Scan, accumulate_in_jit

_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Makes ``cls`` available under ``cls.name`` (usable as a class decorator); returns ``cls``.

    Raises:
      TypeError: ``cls`` is not a `Strategy` subclass with a string ``name``.
      ValueError: another class is already registered under that name.

    Example:
      >>> from autoaccum import strategies
      >>> class Mine(strategies.Scan):
      ...     name = "mine"
      >>> _ = strategies.register(Mine)
      >>> "mine" in strategies.available()
      True
      >>> strategies.unregister("mine")
    """
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"`cls` must be a subclass of autoaccum.strategies.Strategy, got {cls!r}.")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or ":" in name or "=" in name:
        raise TypeError(
            f"`{cls.__name__}.name` must be a non-empty string without ':' or '=', got {name!r}; set the class "
            "attribute `name`."
        )
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(
            f"a strategy named {name!r} is already registered ({_REGISTRY[name].__qualname__}); choose another "
            f"`name` for {cls.__qualname__}, or `unregister({name!r})` first."
        )
    _REGISTRY[name] = cls
    return cls


def unregister(name: str) -> None:
    """Removes the strategy registered as ``name`` (built-in ones included); unknown names raise ``ValueError``."""
    get(name)
    del _REGISTRY[name]


def available() -> tuple[str, ...]:
    """Names of the registered strategies, in registration order (the built-in default, ``"scan"``, first)."""
    return tuple(_REGISTRY)


def get(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``.

    Raises:
      ValueError: ``name`` is not registered (the message lists those that are).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown `strategy` {name!r}; choose one of {', '.join(map(repr, available()))}.")
    return _REGISTRY[name]


for _cls in (Scan, Loop, MultiSteps):
    register(_cls)
del _cls

__all__ = [
    "REMAT_POLICIES",
    "SCHEDULES",
    "Accum",
    "Auto",
    "Call",
    "Layout",
    "Loop",
    "LossReduction",
    "MultiSteps",
    "OutDtypes",
    "Program",
    "PyTree",
    "Scan",
    "Schedule",
    "Spec",
    "Strategy",
    "accumulate_in_jit",
    "accumulate_in_scan",
    "add",
    "apply_optimizer",
    "available",
    "check_microbatch",
    "check_params",
    "check_remat",
    "finish_loss",
    "get",
    "has_convolution",
    "layout_of",
    "leading_size",
    "mean_grads",
    "output_dtypes",
    "register",
    "signature",
    "take",
    "tree_bytes",
    "unregister",
    "weighted_grad",
]
