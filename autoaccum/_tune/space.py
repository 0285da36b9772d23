"""What the tuner searches: the microbatch candidates and every strategy with each combination of its options
(the knobs' settings are `autoaccum._knobs.KnobSpace`)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from autoaccum.strategies import SCHEDULES
from autoaccum.strategies import get as get_strategy


def variants(names: Sequence[str], *, fsdp: bool = False) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{label: (strategy, options)}`` for every strategy and combination of its options; with ``fsdp`` (sharded
    parameters) also every schedule of `autoaccum.build_update`'s ``gather_params`` and ``reduce_grads``.

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


def lighter(a: tuple[str, Mapping[str, Any]], b: tuple[str, Mapping[str, Any]]) -> bool:
    """Whether variant ``a`` needs no more memory than ``b`` at any size (`variants` values): the same strategy,
    ``a``'s options no larger in its ``memory_grows_with``, equal in the others.

    Example:
      >>> lighter(("scan", {"unroll": 2}), ("scan", {"unroll": 8})), lighter(("scan", {"unroll": 8}), ("scan", {}))
      (True, False)
    """
    (name, mine), (other, theirs) = a, b
    if name != other:
        return False
    cls = get_strategy(name)
    defaults = {k: v[0] for k, v in cls.options.items()}
    x, y = {**defaults, **mine}, {**defaults, **theirs}
    return all(x[k] <= y[k] if k in cls.memory_grows_with else x[k] == y[k] for k in {*x, *y})


def program_key(m: int, variant: tuple[str, Mapping[str, Any]], effective_batch: int) -> tuple[Any, ...]:
    """What microbatch ``m`` with ``variant`` (a `variants` value) compiles to, for one knob setting: equal keys
    run the same program (one step: the plain step; else the options `Strategy.program_options` keeps).

    Example:
      >>> program_key(32, ("scan", {"unroll": 2}), 64) == program_key(32, ("scan", {"unroll": 8}), 64)
      True
      >>> program_key(16, ("scan", {"unroll": 2}), 64) == program_key(16, ("scan", {"unroll": 8}), 64)
      False
    """
    steps = -(-effective_batch // m)
    if steps == 1:
        return ("plain step",)
    name, options = variant
    return (name, m, tuple(sorted(get_strategy(name).program_options(options, steps).items())))


def microbatch_candidates(effective_batch: int, cap: int) -> list[int]:
    """Sizes to try, not sorted: divisors of the effective batch, then powers of two and the least size that takes
    as few accumulation steps as the bound (`fewest_steps`).

    Example:
      >>> microbatch_candidates(24, 16), microbatch_candidates(128, 55)
      ([1, 2, 3, 4, 6, 8, 12, 16], [1, 2, 4, 8, 16, 32, 43])
    """
    bound = min(effective_batch, cap)
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
    """Every size `microbatch_candidates` lists for some bound, sorted: the sizes the tuner's probe tries.

    Example:
      >>> probe_sizes(12)
      [1, 2, 3, 4, 6, 8, 12]
    """
    steps = {-(-effective_batch // k) for k in range(1, effective_batch + 1)}
    return sorted(steps | {1 << i for i in range(effective_batch.bit_length())})
