"""``loop``: two jitted functions, "accumulate gradient" and "apply update", driven from a host loop."""

from __future__ import annotations

from typing import Any

import jax
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    Strategy,
    add,
    apply_optimizer,
    leading_size,
    take,
    tree_bytes,
    weighted_grad,
)


class Loop(Strategy):
    """The classic hand-written accumulation loop.

    ``accumulate(acc, params, batch, start)`` adds one microbatch's weighted gradient to ``acc`` (donated, so
    it is updated in place; ``acc=None`` starts a new one) and ``apply(params, opt_state, acc)`` runs the
    optimizer once. Each microbatch is one dispatch from Python; the batch stays on the device and each
    microbatch is sliced inside the compiled function.
    """

    name = "loop"

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._grad = weighted_grad(spec)
        self._accumulate = jax.jit(self._accumulate_fn, donate_argnums=(0,), static_argnames=("size", "total"))
        self._apply = jax.jit(self._apply_fn, donate_argnums=self.donate_argnums(0, 1), static_argnames=("dtypes",))

    def _accumulate_fn(
        self, acc: Accum | None, params: PyTree, batch: PyTree, start: Any, *, size: int, total: int
    ) -> Accum:
        new = self._grad(params, take(batch, start, size), size / total)
        return new if acc is None else add(acc, new)

    def _apply_fn(
        self, params: PyTree, opt_state: PyTree, acc: Accum, *, dtypes: OutDtypes
    ) -> tuple[PyTree, PyTree, Any]:
        return apply_optimizer(self.spec, params, opt_state, acc, dtypes)

    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree, Any]:
        total = leading_size(batch)
        acc = None
        for start, size in self.microbatches(batch):
            acc = self._accumulate(acc, params, batch, start, size=size, total=total)
        return self._apply(params, opt_state, acc, dtypes=self.out_dtypes(params, batch))

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> list[Program]:
        total = leading_size(batch)
        (_, first), *rest = self.microbatches(batch)
        kw: dict[str, Any] = dict(total=total)
        acc = jax.eval_shape(lambda p, b: self._accumulate_fn(None, p, b, 0, size=first, **kw), params, batch)
        lowered = [self._accumulate.lower(None, params, batch, 0, size=first, **kw)]
        lowered += [self._accumulate.lower(acc, params, batch, 0, size=n, **kw) for n in sorted({n for _, n in rest})]
        programs = [Program(low, tree_bytes(opt_state)) for low in lowered]
        dtypes = self.out_dtypes(params, batch)
        programs.append(Program(self._apply.lower(params, opt_state, acc, dtypes=dtypes), tree_bytes(batch)))
        return programs
