"""What the tuner searches: microbatch candidates x every strategy and combination of its options x every
setting of the knobs (the built-in remat policies and accumulator dtypes, the loss's own `autoaccum.Knobs`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from autoaccum._checks import floating_dtype
from autoaccum._knobs import Knobs
from autoaccum.strategies import REMAT_POLICIES, SCHEDULES, check_remat
from autoaccum.strategies import get as get_strategy

BUILTIN_REMAT: tuple[str | None, ...] = (None,)
"""The remat policies `autoaccum.tune` searches by default: off, and those measured to lower the peak of an
example model's step when applied to the whole loss (``benchmarks/remat.py``, table in benchmarks/README.md)."""

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
    """

    remat: str | None = None
    accumulator_dtype: str = "float32"
    knobs: tuple[tuple[str, Any], ...] = ()

    @property
    def values(self) -> dict[str, Any]:
        """The loss's own knobs, ``{name: value}``."""
        return dict(self.knobs)

    @property
    def build(self) -> dict[str, Any]:
        """The built-in knobs as `autoaccum.build_update`'s keyword arguments."""
        return {"remat": self.remat, "accumulator_dtype": self.accumulator_dtype}

    def __str__(self) -> str:
        dtype = () if self.accumulator_dtype == "float32" else ((ACCUMULATOR_DTYPE, self.accumulator_dtype),)
        return ", ".join(f"{k}={v!r}" for k, v in ((REMAT, self.remat), *dtype, *self.knobs))


@dataclasses.dataclass(frozen=True)
class KnobSpace:
    """The knobs a tune searches: remat policies, accumulator dtypes, the loss's own `autoaccum.Knobs`; the first
    value of each is its default.

    Example:
      >>> space = KnobSpace(remat=(None, "dots_saveable"), accumulator_dtypes=("float32", "bfloat16"))
      >>> [str(s) for s in space.settings()][:2]
      ['remat=None', "remat=None, accumulator_dtype='bfloat16'"]
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

    def settings(self) -> list[Setting]:
        """Every setting of the knobs, the default (each knob's first value) first."""
        own = [()] if self.knobs is None else [tuple(values.items()) for values in self.knobs.settings()]
        return [Setting(*values) for values in itertools.product(self.remat, self.accumulator_dtypes, own)]

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
        return Setting(params.get(REMAT, self.remat[0]), params.get(ACCUMULATOR_DTYPE, self.accumulator_dtypes[0]), own)

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
        names.append(dtype.name)
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


def variants(names: Sequence[str], *, fsdp: bool = False) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{label: (strategy, options)}`` for every strategy and combination of its options; with ``fsdp``
    (parameters sharded over the batch's mesh axes) also every schedule of gathering the parameters and
    reducing the gradients (`autoaccum.build_update`'s ``gather_params`` and ``reduce_grads``).

    Example:
      >>> list(variants(["scan", "loop"]))
      ['scan', 'scan:unroll=2', 'scan:unroll=8', 'loop']
      >>> list(variants(["loop"], fsdp=True))[1]
      'loop:reduce_grads=per_microbatch'
    """
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    knobs = {k: SCHEDULES for k in ("gather_params", "reduce_grads")} if fsdp else {}
    for name in names:
        cls = get_strategy(name)
        choices = {**cls.options, **knobs}
        keys = list(choices)
        for values in itertools.product(*(choices[k] for k in keys)):
            options = dict(zip(keys, values, strict=True))
            changed = [f"{k}={v}" for k, v in options.items() if v != choices[k][0]]
            out[":".join([name, *changed])] = (name, options)
    return out


def program_key(m: int, variant: tuple[str, Mapping[str, Any]], effective_batch: int) -> tuple[Any, ...]:
    """What the compiled update of microbatch ``m`` with ``variant`` (``(strategy, options)``, a `variants` value)
    depends on, for one setting of the knobs: configurations with equal keys run the same program and are timed
    once. With one accumulation step every strategy runs the plain step; otherwise each strategy says which of
    its options matter at that many steps (`Strategy.program_options`).

    Example:
      >>> program_key(32, ("scan", {"unroll": 2}), 64) == program_key(32, ("scan", {"unroll": 8}), 64)
      True
      >>> program_key(64, ("scan", {"unroll": 1}), 64) == program_key(64, ("loop", {}), 64)
      True
      >>> program_key(16, ("scan", {"unroll": 2}), 64) == program_key(16, ("scan", {"unroll": 8}), 64)
      False
    """
    steps = -(-effective_batch // m)
    if steps == 1:
        return ("plain step",)
    name, options = variant
    return (name, m, tuple(sorted(get_strategy(name).program_options(options, steps).items())))


def microbatch_candidates(effective_batch: int, max_microbatch: int) -> list[int]:
    """Sizes to try: divisors of the effective batch first, then powers of two and the least size that takes as
    few accumulation steps as the bound (`fewest_steps`).

    The list is not sorted: its largest entry is ``max(candidates)``, not the last one.

    Example:
      >>> microbatch_candidates(24, 16)
      [1, 2, 3, 4, 6, 8, 12, 16]
      >>> microbatch_candidates(96, 96)[-1], max(microbatch_candidates(96, 96))
      (64, 96)
      >>> microbatch_candidates(128, 55)  # 55 takes 3 steps, and so does 43 (43 + 43 + 42)
      [1, 2, 4, 8, 16, 32, 43]
    """
    bound = min(effective_batch, max_microbatch)
    divisors = [d for d in range(1, bound + 1) if effective_batch % d == 0]
    extra = {1 << i for i in range(bound.bit_length()) if 1 << i <= bound} | {fewest_steps(effective_batch, bound)}
    return divisors + sorted(extra - set(divisors))


def fewest_steps(effective_batch: int, bound: int) -> int:
    """The least microbatch that needs no more accumulation steps than ``bound`` does (an even split).

    Example:
      >>> fewest_steps(128, 55), fewest_steps(128, 64), fewest_steps(100, 40)
      (43, 64, 34)
    """
    return -(-effective_batch // -(-effective_batch // bound))


def probe_sizes(effective_batch: int) -> list[int]:
    """Every size `microbatch_candidates` can list for some bound, sorted: what the tuner's probe tries, since
    a boundary between two of them changes nothing the tuner times.

    Example:
      >>> probe_sizes(12)
      [1, 2, 3, 4, 6, 8, 12]
    """
    steps = {-(-effective_batch // k) for k in range(1, effective_batch + 1)}
    return sorted(steps | {1 << i for i in range(effective_batch.bit_length())})
