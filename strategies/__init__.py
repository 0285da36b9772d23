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

# A name imported `as` itself is not exported (not in `__all__`): autoaccum's own modules import it from here, never
# from the private modules.
from autoaccum.strategies._base import SCHEDULES as SCHEDULES
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    accumulate_in_scan,
    add,
    apply_optimizer,
    finish_loss,
    output_dtypes,
    take,
    weighted_grad,
)
from autoaccum.strategies._base import LossReduction as LossReduction
from autoaccum.strategies._base import Schedule as Schedule
from autoaccum.strategies._base import check_params as check_params
from autoaccum.strategies._base import leading_size as leading_size
from autoaccum.strategies._base import mean_grads as mean_grads
from autoaccum.strategies._base import signature as signature
from autoaccum.strategies._base import to_varying as to_varying
from autoaccum.strategies._base import tree_bytes as tree_bytes
from autoaccum.strategies._base import varying as varying
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._layout import check_microbatch as check_microbatch
from autoaccum.strategies._layout import layout_of as layout_of
from autoaccum.strategies._remat import REMAT_POLICIES
from autoaccum.strategies._remat import check_remat as check_remat
from autoaccum.strategies._strategy import Call, Strategy
from autoaccum.strategies.auto import Auto
from autoaccum.strategies.auto import has_convolution as has_convolution
from autoaccum.strategies.loop import Loop
from autoaccum.strategies.multisteps import MultiSteps
from autoaccum.strategies.scan import Scan
from autoaccum.strategies.scan import accumulate_in_jit as accumulate_in_jit

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
    """Names of the registered strategies, in registration order (``"scan"`` first). ``"auto"``, `build_update`'s
    default, is not one of them: it runs ``scan`` or ``loop`` (`Auto`)."""
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

# The user's surface: the registry, the built-in strategies, and the pieces a strategy of one's own is built from
# (as `Loop` and `MultiSteps` are). The rest above is imported for the package's own modules, not exported.
__all__ = [
    "REMAT_POLICIES",
    "Accum",
    "Auto",
    "Call",
    "Layout",
    "Loop",
    "MultiSteps",
    "OutDtypes",
    "Program",
    "PyTree",
    "Scan",
    "Spec",
    "Strategy",
    "accumulate_in_scan",
    "add",
    "apply_optimizer",
    "available",
    "finish_loss",
    "get",
    "output_dtypes",
    "register",
    "take",
    "unregister",
    "weighted_grad",
]
