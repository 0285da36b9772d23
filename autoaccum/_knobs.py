"""`Knobs`: a loss with settings of the user's own (per-layer remat, ...) for the tuner to search.

Some trade-offs of memory for speed need the model's cooperation: rematerialising each transformer block
(``nnx.remat`` / ``nn.remat`` around it, with a policy) saves far more than a policy around the whole loss,
but only the model can say where its blocks are. A `Knobs` is a loss factory, ``make_loss(**values) ->
loss_fn``, with the values worth trying for each of its arguments; `autoaccum.tune` searches them beside the
built-in knobs, bounds the microbatch of each setting separately, and records the chosen values in the
`autoaccum.Plan` (``plan.knobs``), whose ``build`` calls the factory with them again.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from autoaccum._checks import check_loss_fn

_VALUE_TYPES = (str, int, float, bool, type(None))


@dataclasses.dataclass(frozen=True, init=False)
class Knobs:
    """A loss factory and the values of its arguments worth trying: ``Knobs(make_loss, name=(value, ...))``.

    ``make_loss(**values)`` returns a loss function as `autoaccum.build_update` takes it (the same for every
    value: same arguments, same ``has_aux``/``has_state``/``loss_reduction`` form); the first value of each knob
    is its default. Pass the `Knobs` where a loss function goes to `autoaccum.tune` (or `autoaccum.nnx.tune`,
    whose factory makes ``loss_fn(model, batch)``) and to `autoaccum.Plan.build`. Wrap blocks with
    ``jax.checkpoint`` inside the loss (``nn.remat`` in the module): the probe ships the loss to a child process,
    and a function that ``jax.checkpoint`` returned does not pickle.

    Attributes:
      make_loss: ``make_loss(**values) -> loss_fn``.
      choices: ``{name: (value, ...)}``: values are ``None``, bools, ints, floats or strings (they are
        recorded in the plan's JSON), distinct, at least one per knob.

    Raises:
      TypeError, ValueError: ``make_loss`` is not callable, no knob is given, or a knob's values are not
        as above (the message names the knob).

    Example:
      >>> import jax.numpy as jnp
      >>> def make_loss(scale=1.0):
      ...     return lambda w, b: scale * jnp.mean((b @ w) ** 2)
      >>> knobs = Knobs(make_loss, scale=(1.0, 0.5))
      >>> knobs.default, len(knobs.settings())
      ({'scale': 1.0}, 2)
      >>> float(knobs.loss_fn(scale=0.5)(jnp.ones(2), jnp.ones((3, 2))))
      2.0
    """

    make_loss: Callable[..., Callable[..., Any]]
    choices: Mapping[str, tuple[Any, ...]]

    def __init__(self, make_loss: Callable[..., Callable[..., Any]], /, **choices: Any) -> None:
        if not callable(make_loss):
            raise TypeError(
                f"`make_loss` must be callable, make_loss(**values) -> loss_fn, got {type(make_loss).__name__}."
            )
        if not choices:
            raise ValueError(
                "`Knobs` needs at least one knob: Knobs(make_loss, name=(value, ...)), e.g. "
                "Knobs(make_loss, block_remat=(None, 'dots_saveable'))."
            )
        checked: dict[str, tuple[Any, ...]] = {}
        for name, values in choices.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) or not values:
                raise TypeError(
                    f"knob `{name}` must be a non-empty tuple of the values to try, the default first, got "
                    f"{name}={values!r}; e.g. {name}=(None, 'dots_saveable')."
                )
            bad = [v for v in values if not isinstance(v, _VALUE_TYPES)]
            if bad:
                raise TypeError(
                    f"knob `{name}` has values {bad!r} that a plan's JSON cannot record; use None, bools, ints, "
                    "floats or strings (e.g. a policy's name rather than the policy)."
                )
            if len({(type(v), v) for v in values}) != len(values):
                raise ValueError(f"knob `{name}` repeats a value: {name}={tuple(values)!r}; list each value once.")
            checked[name] = tuple(values)
        object.__setattr__(self, "make_loss", make_loss)
        object.__setattr__(self, "choices", checked)

    @property
    def default(self) -> dict[str, Any]:
        """The first value of every knob."""
        return {name: values[0] for name, values in self.choices.items()}

    def settings(self) -> list[dict[str, Any]]:
        """Every combination of the knobs' values, the default first."""
        names = list(self.choices)
        return [dict(zip(names, values, strict=True)) for values in itertools.product(*self.choices.values())]

    def loss_fn(self, **values: Any) -> Callable[..., Any]:
        """``make_loss(**values)``, checked: the knobs named are exactly this object's.

        Raises:
          ValueError: a knob is missing or unknown.
          TypeError: ``make_loss`` did not return a callable.
        """
        if set(values) != set(self.choices):
            missing, unknown = sorted(set(self.choices) - set(values)), sorted(set(values) - set(self.choices))
            raise ValueError(
                f"the knobs given ({sorted(values)}) are not this loss's ({sorted(self.choices)}): missing {missing}, "
                f"unknown {unknown}; a plan tuned with other knobs needs the Knobs it was tuned with."
            )
        loss_fn = self.make_loss(**values)
        check_loss_fn(loss_fn)
        return loss_fn


def resolve(loss_fn: Any, values: Mapping[str, Any]) -> Callable[..., Any]:
    """The loss function for knob ``values``: ``loss_fn`` itself (no knobs), or its factory's for these values.

    Raises:
      ValueError: ``values`` are given (a plan tuned with knobs) but ``loss_fn`` is a plain function.
    """
    if isinstance(loss_fn, Knobs):
        return loss_fn.loss_fn(**values)
    if values:
        raise ValueError(
            f"this plan was tuned with knobs {dict(values)!r}: pass the autoaccum.Knobs it was tuned with (the "
            "loss factory), not a loss function, so that the loss is made with these values."
        )
    return loss_fn
