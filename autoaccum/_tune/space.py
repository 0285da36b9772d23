"""What the tuner searches: microbatch candidates x every strategy and combination of its options."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from autoaccum.strategies import SCHEDULES
from autoaccum.strategies import get as get_strategy


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
