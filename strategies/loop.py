"""``loop``: two jitted functions, "accumulate gradient" and "apply update", driven from a host loop."""

from __future__ import annotations

from typing import Any

import jax
from autoaccum.strategies._base import (
    Accum,
    Program,
    PyTree,
    Spec,
    Strategy,
    add,
    take,
    tree_bytes,
)


class Loop(Strategy):
    """The classic hand-written accumulation loop.

    ``accumulate(acc, params, batch, start, state)`` adds one microbatch's weighted sums to ``acc`` (donated,
    so it is updated in place; ``acc=None`` starts new sums) and returns them with the microbatch's new state;
    ``apply(params, opt_state, acc)`` divides by the total weight and runs the optimizer once. Each microbatch
    is one dispatch from Python; the batch stays on the device and each microbatch is sliced inside the
    compiled function.
    """

    name = "loop"

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._accumulate = jax.jit(
            self._accumulate_fn, donate_argnums=(0, *self.donate_argnums(4)), static_argnames=("size",)
        )

    def _accumulate_fn(
        self, acc: Accum | None, params: PyTree, batch: PyTree, start: Any, state: PyTree, *, size: int
    ) -> tuple[Accum, PyTree]:
        new, state = self._grad(params, take(batch, start, size), state)
        return (new if acc is None else add(acc, new)), state

    def __call__(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        dtypes = self.out_dtypes(params, batch, state)
        acc = None
        for start, size in self.microbatches(batch):
            acc, state = self._accumulate(acc, params, batch, start, state, size=size)
        params, opt_state, loss = self._apply(params, opt_state, acc, dtypes=dtypes)
        return params, opt_state, loss, state

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        (_, first), *rest = self.microbatches(batch)
        acc, _ = jax.eval_shape(lambda p, b, s: self._accumulate_fn(None, p, b, 0, s, size=first), params, batch, state)
        lowered = [self._accumulate.lower(None, params, batch, 0, state, size=first)]
        lowered += [self._accumulate.lower(acc, params, batch, 0, state, size=n) for n in sorted({n for _, n in rest})]
        programs = [Program(low, tree_bytes(opt_state)) for low in lowered]
        dtypes = self.out_dtypes(params, batch, state)
        programs.append(Program(self._apply.lower(params, opt_state, acc, dtypes=dtypes), tree_bytes(batch)))
        return programs
