"""``scan``: one compiled program accumulates every microbatch in a ``lax.scan``, then updates once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
from autoaccum.strategies._base import (
    Program,
    PyTree,
    Spec,
    Strategy,
    accumulate_in_scan,
    apply_optimizer,
    output_dtypes,
)


class Scan(Strategy):
    """All microbatches and the optimizer step in a single jitted call (no host round-trips).

    Options:
      unroll: ``lax.scan`` unroll factor (more unrolling trades compile time and code size for speed).
    """

    name = "scan"
    options: ClassVar[Mapping[str, Sequence[Any]]] = {"unroll": (1, 2)}

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._step = jax.jit(self._update, donate_argnums=self.donate_argnums(0, 1, 3))

    def _update(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        dtypes = output_dtypes(self.spec, params, batch, state)
        acc, state = accumulate_in_scan(self.spec, params, batch, state, unroll=self.config["unroll"])
        params, opt_state, loss = apply_optimizer(self.spec, params, opt_state, acc, dtypes)
        return params, opt_state, loss, state

    def __call__(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        return self._step(params, opt_state, batch, state)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        return [Program(self._step.lower(params, opt_state, batch, state), resident_bytes=0)]
