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
import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autoaccum._checks import check_accumulator_dtype, check_loss_fn, floating_dtype
from autoaccum.strategies import REMAT_POLICIES, check_remat

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
        recorded in the plan's JSON), no two equal (``1 == 1.0 == True``), at least one per knob.

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
        unknown = sorted(set(choices) - _keywords(make_loss, set(choices)))
        if unknown:
            raise TypeError(
                f"knobs {unknown} are not parameters of make_loss{inspect.signature(make_loss)}; name each knob as "
                "make_loss takes it."
            )
        checked: dict[str, tuple[Any, ...]] = {}
        for name, values in choices.items():
            if isinstance(values, (str, bytes)) or not isinstance(values, (tuple, list)) or not values:
                raise TypeError(
                    f"knob `{name}` must be a non-empty tuple of the values to try, the default first, got "
                    f"{name}={values!r}; e.g. {name}=(None, 'dots_saveable')."
                )
            infinite = [v for v in values if isinstance(v, float) and not math.isfinite(v)]  # (nan != nan)
            bad = [v for v in values if not isinstance(v, _VALUE_TYPES)] + infinite
            if bad:
                raise TypeError(
                    f"knob `{name}` has values {bad!r} that a plan's JSON cannot record; use None, bools, ints, "
                    "finite floats or strings (e.g. a policy's name rather than the policy)."
                )
            equal = [(a, b) for i, a in enumerate(values) for b in values[i + 1 :] if a == b]
            if equal:
                raise ValueError(
                    f"knob `{name}` repeats a value: {name}={tuple(values)!r} ({equal[0][0]!r} == {equal[0][1]!r} in "
                    "Python, so one setting; the plan and Optuna could not tell them apart); list each value once."
                )
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
            why = [f"the Knobs lacks {unknown}"] * bool(unknown) + [f"no value is given for {missing}"] * bool(missing)
            raise ValueError(
                f"the knob values {sorted(values)} do not match this Knobs' knobs {sorted(self.choices)}: "
                f"{' and '.join(why)}; a plan tuned with other knobs needs the Knobs it was tuned with."
            )
        name = getattr(self.make_loss, "__name__", "make_loss")
        call = f"{name}({', '.join(f'{k}={v!r}' for k, v in values.items())})"
        try:
            loss_fn = self.make_loss(**values)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"autoaccum called the Knobs' make_loss as {call}.")
            raise
        if not callable(loss_fn):
            raise TypeError(
                f"the Knobs' make_loss, called as {call}, returned {type(loss_fn).__name__} {loss_fn!r}, not a loss "
                "function: make_loss(**values) -> loss_fn."
            )
        check_loss_fn(loss_fn)
        return loss_fn


def _keywords(fn: Callable[..., Any], names: set[str]) -> set[str]:
    """The keyword arguments ``fn`` takes (``names`` where it takes any, or its signature cannot be read)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return names
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        return names
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


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


BUILTIN_REMAT: tuple[str | None, ...] = (None,)
"""The remat policies `autoaccum.tune` searches by default: off only (around the whole loss none lowered the peak
of the example models' steps: ``benchmarks/remat.py``, table in benchmarks/README.md)."""

REMAT = "remat"
"""The Optuna parameter of the built-in remat knob."""

KNOB_PREFIX = "knob:"
"""The Optuna parameters of the loss's own knobs are this followed by the knob's name."""


ACCUMULATOR_DTYPE = "accumulator_dtype"
"""The Optuna parameter of the accumulator dtype knob."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One value of every knob: the remat policy around the loss, the accumulator dtype, and the values of the
    loss's own knobs.

    Attributes:
      remat: `autoaccum.build_update`'s ``remat``.
      accumulator_dtype: `autoaccum.build_update`'s ``accumulator_dtype``, by name (``"float32"``).
      knobs: ``((name, value), ...)`` of the loss's `autoaccum.Knobs`, in their order (``()`` without any).
      dtype_searched: whether the tune searches accumulator dtypes: the text names this setting's then, float32
        included (not compared).
    """

    remat: str | None = None
    accumulator_dtype: str = "float32"
    knobs: tuple[tuple[str, Any], ...] = ()
    dtype_searched: bool = dataclasses.field(default=False, compare=False, repr=False)

    @property
    def values(self) -> dict[str, Any]:
        """The loss's own knobs, ``{name: value}``."""
        return dict(self.knobs)

    @property
    def build(self) -> dict[str, Any]:
        """The built-in knobs as `autoaccum.build_update`'s keyword arguments."""
        return {"remat": self.remat, "accumulator_dtype": self.accumulator_dtype}

    def __str__(self) -> str:
        shown = self.dtype_searched or self.accumulator_dtype != "float32"
        dtype = ((ACCUMULATOR_DTYPE, self.accumulator_dtype),) if shown else ()
        return ", ".join(f"{k}={v!r}" for k, v in ((REMAT, self.remat), *dtype, *self.knobs))


@dataclasses.dataclass(frozen=True)
class KnobSpace:
    """The knobs a tune searches: remat policies, accumulator dtypes, the loss's own `autoaccum.Knobs`; the first
    value of each is its default.

    Example:
      >>> space = KnobSpace(remat=(None, "dots_saveable"), accumulator_dtypes=("float32", "bfloat16"))
      >>> [str(s) for s in space.settings()][:2]
      ["remat=None, accumulator_dtype='float32'", "remat=None, accumulator_dtype='bfloat16'"]
      >>> space.params()
      {'remat': [None, 'dots_saveable'], 'accumulator_dtype': ['float32', 'bfloat16']}
      >>> space.setting_of({"remat": "dots_saveable"})
      Setting(remat='dots_saveable', accumulator_dtype='float32', knobs=())
      >>> KnobSpace().params()
      {}
    """

    remat: tuple[str | None, ...] = (None,)
    accumulator_dtypes: tuple[str, ...] = ("float32",)
    knobs: Knobs | None = None

    @property
    def dtype_searched(self) -> bool:
        """Whether more than one accumulator dtype is searched (`Setting.dtype_searched`)."""
        return len(self.accumulator_dtypes) > 1

    def settings(self) -> list[Setting]:
        """Every setting of the knobs, the default (each knob's first value) first."""
        own = [()] if self.knobs is None else [tuple(values.items()) for values in self.knobs.settings()]
        values = itertools.product(self.remat, self.accumulator_dtypes, own)
        return [Setting(remat, dtype, knobs, dtype_searched=self.dtype_searched) for remat, dtype, knobs in values]

    def params(self) -> dict[str, list[Any]]:
        """The Optuna parameters of the knobs searched: those with more than one value (the others are fixed)."""
        space: dict[str, list[Any]] = {}
        for name, values in ((REMAT, self.remat), (ACCUMULATOR_DTYPE, self.accumulator_dtypes)):
            if len(values) > 1:
                space[name] = list(values)
        for name, values in ({} if self.knobs is None else self.knobs.choices).items():
            if len(values) > 1:
                space[KNOB_PREFIX + name] = list(values)
        return space

    def setting_of(self, params: Mapping[str, Any]) -> Setting:
        """The `Setting` of a trial's Optuna ``params`` (a knob that is not searched has its only value)."""
        choices = {} if self.knobs is None else self.knobs.choices
        own = tuple((k, params.get(KNOB_PREFIX + k, v[0])) for k, v in choices.items())
        dtype = params.get(ACCUMULATOR_DTYPE, self.accumulator_dtypes[0])
        return Setting(params.get(REMAT, self.remat[0]), dtype, own, dtype_searched=self.dtype_searched)

    def params_of(self, setting: Setting) -> dict[str, Any]:
        """The Optuna parameters of ``setting`` among the knobs searched (`params`)."""
        params = {
            REMAT: setting.remat,
            ACCUMULATOR_DTYPE: setting.accumulator_dtype,
            **{KNOB_PREFIX + k: v for k, v in setting.knobs},
        }
        searched = self.params()
        return {k: v for k, v in params.items() if k in searched}


def check_dtype_values(accumulator_dtype: Any) -> tuple[str, ...]:
    """``accumulator_dtype`` (one floating dtype, or a sequence of them to search) as a tuple of names, checked.

    Example:
      >>> import jax.numpy as jnp
      >>> check_dtype_values(jnp.float32), check_dtype_values(("float32", jnp.bfloat16))
      (('float32',), ('float32', 'bfloat16'))
    """
    values = list(accumulator_dtype) if isinstance(accumulator_dtype, (list, tuple)) else [accumulator_dtype]
    names = []
    for value in values:
        dtype = floating_dtype(value)
        if dtype is None:
            raise TypeError(
                f"`accumulator_dtype` must be a floating dtype, or a tuple of them to search, got "
                f"accumulator_dtype={accumulator_dtype!r}; e.g. jnp.float32 or (jnp.float32, jnp.bfloat16)."
            )
        names.append(check_accumulator_dtype(value).name)
    if not names or len(set(names)) != len(names):
        raise ValueError(
            f"`accumulator_dtype` must list each dtype once, at least one, got accumulator_dtype={accumulator_dtype!r}."
        )
    return tuple(names)


def check_remat_values(remat: Any) -> tuple[str | None, ...]:
    """``remat`` as a tuple of policy names (None: off), checked; ``ValueError`` naming the bad value.

    Example:
      >>> check_remat_values([None, "dots_saveable"])
      (None, 'dots_saveable')
    """
    if isinstance(remat, str) or remat is None or not isinstance(remat, Sequence) or not remat:
        raise TypeError(
            f"`remat` must be a non-empty sequence of policy names (None: off) to search, got remat={remat!r}; "
            f"e.g. remat=(None, 'dots_saveable'); names: {', '.join(REMAT_POLICIES)}."
        )
    for value in remat:
        check_remat(value)
    if len(set(remat)) != len(remat):
        raise ValueError(f"`remat` repeats a policy: remat={tuple(remat)!r}; list each once.")
    return tuple(remat)
