"""What the tuner searches: microbatch candidates x every strategy and combination of its options x every
setting of the knobs (the built-in remat policies, the loss's own `autoaccum.Knobs`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class Setting:
    """One value of every knob: the remat policy around the loss, and the values of the loss's own knobs.

    Attributes:
      remat: `autoaccum.build_update`'s ``remat``.
      knobs: ``((name, value), ...)`` of the loss's `autoaccum.Knobs`, in their order (``()`` without any).
    """

    remat: str | None = None
    knobs: tuple[tuple[str, Any], ...] = ()

    @property
    def values(self) -> dict[str, Any]:
        """The loss's own knobs, ``{name: value}``."""
        return dict(self.knobs)

    def __str__(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in ((REMAT, self.remat), *self.knobs))


def settings(remat: Sequence[str | None], knobs: Knobs | None = None) -> list[Setting]:
    """Every setting of the knobs, the default (each knob's first value) first.

    Example:
      >>> [str(s) for s in settings([None, "dots_saveable"])]
      ['remat=None', "remat='dots_saveable'"]
    """
    own = [()] if knobs is None else [tuple(values.items()) for values in knobs.settings()]
    return [Setting(r, k) for r, k in itertools.product(remat, own)]


def knob_space(remat: Sequence[str | None], knobs: Knobs | None = None) -> dict[str, list[Any]]:
    """The Optuna parameters of the knobs searched: those with more than one value (the others are fixed).

    Example:
      >>> knob_space([None, "dots_saveable"])
      {'remat': [None, 'dots_saveable']}
      >>> knob_space([None])
      {}
    """
    space: dict[str, list[Any]] = {REMAT: list(remat)} if len(remat) > 1 else {}
    for name, values in ({} if knobs is None else knobs.choices).items():
        if len(values) > 1:
            space[KNOB_PREFIX + name] = list(values)
    return space


def setting_of(params: Mapping[str, Any], remat: Sequence[str | None], knobs: Knobs | None = None) -> Setting:
    """The `Setting` of a trial's Optuna ``params`` (a knob that is not searched has its only value)."""
    own = tuple((k, params.get(KNOB_PREFIX + k, v[0])) for k, v in ({} if knobs is None else knobs.choices).items())
    return Setting(params.get(REMAT, remat[0]), own)


def setting_params(setting: Setting, space: Mapping[str, Any]) -> dict[str, Any]:
    """The Optuna parameters of ``setting`` among the knobs searched (`knob_space`)."""
    params = {REMAT: setting.remat, **{KNOB_PREFIX + k: v for k, v in setting.knobs}}
    return {k: v for k, v in params.items() if k in space}


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
      ['scan', 'scan:unroll=2', 'loop']
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


def microbatch_candidates(effective_batch: int, max_microbatch: int) -> list[int]:
    """Sizes to try: divisors of the effective batch first, then powers of two and the bound itself.

    The list is not sorted: its largest entry is ``max(candidates)``, not the last one.

    Example:
      >>> microbatch_candidates(24, 16)
      [1, 2, 3, 4, 6, 8, 12, 16]
      >>> microbatch_candidates(96, 96)[-1], max(microbatch_candidates(96, 96))
      (64, 96)
    """
    bound = min(effective_batch, max_microbatch)
    divisors = [d for d in range(1, bound + 1) if effective_batch % d == 0]
    extra = {1 << i for i in range(bound.bit_length()) if 1 << i <= bound} | {bound}
    return divisors + sorted(extra - set(divisors))
