"""``multisteps``: ``optax.MultiSteps`` wraps the optimizer; one jitted call per microbatch from a host loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    Strategy,
    add,
    finish_loss,
    leading_size,
    take,
    tree_bytes,
    weighted_grad,
)


class MultiSteps(Strategy):
    """Accumulation by `optax.MultiSteps` (``every_k_schedule`` = the number of microbatches).

    ``MultiSteps`` averages the k gradients it is given with equal weights; to keep every example at weight
    ``1 / B`` when the last microbatch is smaller, microbatch ``i`` of ``n_i`` examples hands it
    ``k * n_i / B`` times its mean gradient. Accumulation happens in ``MultiSteps``'s ``accumulator_dtype``.

    The optimizer state it takes and returns is the optimizer's own, as for every strategy (a checkpoint
    saved under one plan restores under another): each call wraps it in an ``optax.MultiStepsState`` with a
    fresh accumulator, runs the ``k`` microbatches, and hands back the inner state.
    """

    name = "multisteps"

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._grad = weighted_grad(spec)
        self._step = jax.jit(
            self._step_fn,
            donate_argnums=(2, *self.donate_argnums(0, 1)),
            static_argnames=("size", "total", "k", "dtypes"),
        )
        self._wrap = jax.jit(self._wrap_fn, donate_argnums=self.donate_argnums(0))

    def _wrapped(self, k: int) -> optax.MultiSteps:
        return optax.MultiSteps(self.spec.optimizer, every_k_schedule=k, accumulator_dtype=self.spec.accumulator_dtype)

    def _wrap_fn(self, opt_state: PyTree, params: PyTree) -> optax.MultiStepsState:
        """A ``MultiStepsState`` around ``opt_state`` with a zero accumulator (the inner init is dead code)."""
        return self._wrapped(1).init(params)._replace(inner_opt_state=opt_state)  # the state does not depend on k

    def _step_fn(
        self,
        params: PyTree,
        opt_state: PyTree,
        sums: Accum,
        batch: PyTree,
        start: Any,
        *,
        size: int,
        total: int,
        k: int,
        dtypes: OutDtypes,
    ) -> tuple[PyTree, PyTree, Accum]:
        new = self._grad(params, take(batch, start, size), size / total)
        grads = jax.tree.map(lambda g: g * jnp.asarray(k, g.dtype), new.grads)  # MultiSteps divides by k
        updates, opt_state = self._wrapped(k).update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, add(sums, new._replace(grads=()))

    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree, Any]:
        total = leading_size(batch)
        calls = self.microbatches(batch)
        dtypes = self.out_dtypes(params, batch)
        sums = dtypes.zero_sums(self.spec.accumulator_dtype)  # the same step program for every microbatch
        state = self._wrap(opt_state, params)
        for start, size in calls:
            params, state, sums = self._step(
                params, state, sums, batch, start, size=size, total=total, k=len(calls), dtypes=dtypes
            )
        return params, state.inner_opt_state, finish_loss(self.spec, sums, dtypes)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> list[Program]:
        total = leading_size(batch)
        calls = self.microbatches(batch)
        dtypes = self.out_dtypes(params, batch)
        sums = jax.eval_shape(lambda: dtypes.zero_sums(self.spec.accumulator_dtype))
        state = jax.eval_shape(self._wrap_fn, opt_state, params)
        kw: dict[str, Any] = dict(total=total, k=len(calls), dtypes=dtypes)
        sizes = sorted({n for _, n in calls})
        steps = [Program(self._step.lower(params, state, sums, batch, 0, size=n, **kw), 0) for n in sizes]
        return [Program(self._wrap.lower(opt_state, params), tree_bytes(batch)), *steps]
