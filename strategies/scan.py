"""``scan``: one compiled program accumulates every microbatch in a ``lax.scan``, then updates once."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
from autoaccum.strategies._base import (
    Program,
    PyTree,
    Spec,
    accumulate_in_scan,
    apply_optimizer,
    output_dtypes,
)
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._sharding import OnMesh
from autoaccum.strategies._strategy import Call, Strategy


class Scan(Strategy):
    """All microbatches and the optimizer step in a single jitted call (no host round-trips).

    Options:
      unroll: ``lax.scan`` unroll factor (more unrolling trades compile time and code size for speed).
    """

    name = "scan"
    options: ClassVar[Mapping[str, Sequence[Any]]] = {"unroll": (1, 2)}

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._step = jax.jit(self._update, donate_argnums=self.donate_argnums(0, 1, 3), static_argnames=("layout",))

    def _update(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree, layout: Layout | None = None
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        dtypes = output_dtypes(self.spec, params, batch, state)
        accumulate = functools.partial(accumulate_in_scan, unroll=self.config["unroll"])
        if layout is None:
            acc, state = accumulate(self.spec, params, batch, state)
        else:  # each device accumulates its own rows; one reduction after the loop
            acc, state = OnMesh(self.spec, layout).accumulate(accumulate, params, batch, state, dtypes)
        params, opt_state, loss = apply_optimizer(self.spec, params, opt_state, acc, dtypes)
        return params, opt_state, loss, state

    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        return self._step(params, opt_state, batch, state, layout=call.layout)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        layout = self.layout(params, batch, state)
        return [Program(self._step.lower(params, opt_state, batch, state, layout=layout), resident_bytes=0)]
