"""``multisteps``: ``optax.MultiSteps`` wraps the optimizer; one jitted call per microbatch from a host loop."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from autoaccum.strategies._base import (
    Accum,
    Program,
    PyTree,
    Spec,
    add,
    finish_loss,
    take,
    tree_bytes,
)
from autoaccum.strategies._strategy import Strategy


class MultiSteps(Strategy):
    """Accumulation by `optax.MultiSteps` (``every_k_schedule`` = the number of microbatches).

    ``MultiSteps`` averages the k gradients it is given with equal weights, while every strategy divides the
    summed gradients by the total weight (``B`` examples, or the weights ``loss_fn`` returns with
    ``loss_reduction="sum"``), which is only known once the last microbatch has run. So microbatch ``i`` hands
    it ``k`` times its unnormalised gradient sum, and at the last microbatch, where the total weight ``W`` is
    known, both that gradient and ``MultiSteps``'s running mean are divided by ``W`` (the mean is linear, so
    the inner optimizer sees exactly the summed gradients over ``W``). Accumulation happens in
    ``MultiSteps``'s ``accumulator_dtype``. The model state goes through each per-microbatch call.

    The optimizer state it takes and returns is the optimizer's own, as for every strategy (a checkpoint
    saved under one plan restores under another): each call wraps it in an ``optax.MultiStepsState`` with a
    fresh accumulator, runs the ``k`` microbatches, and hands back the inner state.
    """

    name = "multisteps"
    runs_on_mesh = False

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._step = jax.jit(
            self._step_fn,
            donate_argnums=(2, *self.donate_argnums(0, 1, 5)),
            static_argnames=("size", "k"),
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
        opt_state: optax.MultiStepsState,
        sums: Accum,
        batch: PyTree,
        start: Any,
        state: PyTree,
        *,
        size: int,
        k: int,
    ) -> tuple[PyTree, optax.MultiStepsState, Accum, PyTree]:
        new, state = self._grad(params, take(batch, start, size), state)
        sums = add(sums, new._replace(grads=()))
        # 1 before the last microbatch; the total weight at the last (a traced condition: one program per size).
        divisor = jnp.where(opt_state.mini_step == k - 1, sums.weight, jnp.ones_like(sums.weight))
        grads = jax.tree.map(lambda g: g * jnp.asarray(k, g.dtype) / divisor.astype(g.dtype), new.grads)
        acc_grads = jax.tree.map(lambda a: a / divisor.astype(a.dtype), opt_state.acc_grads)
        updates, opt_state = self._wrapped(k).update(grads, opt_state._replace(acc_grads=acc_grads), params)
        return optax.apply_updates(params, updates), opt_state, sums, state

    def __call__(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        self._one_device(params, batch, state)
        calls = self.microbatches(batch)
        dtypes = self.out_dtypes(params, batch, state)
        sums = dtypes.zero_sums(self.spec.accumulator_dtype)  # the same step program for every microbatch
        wrapped = self._wrap(opt_state, params)
        for start, size in calls:
            params, wrapped, sums, state = self._step(
                params, wrapped, sums, batch, start, state, size=size, k=len(calls)
            )
        return params, wrapped.inner_opt_state, finish_loss(self.spec, sums, dtypes), state

    def _one_device(self, params: PyTree, batch: PyTree, state: PyTree) -> None:
        if self.layout(params, batch, state) is not None:
            raise NotImplementedError(
                "strategy 'multisteps' runs on one device: optax.MultiSteps keeps one parameter-shaped gradient "
                "sum, so on a mesh it would reduce the gradients across devices for every microbatch. Use "
                "strategy='scan' or 'loop', which reduce once per update, or put the batch on one device."
            )

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        self._one_device(params, batch, state)
        calls = self.microbatches(batch)
        dtypes = self.out_dtypes(params, batch, state)
        sums = jax.eval_shape(lambda: dtypes.zero_sums(self.spec.accumulator_dtype))
        wrapped = jax.eval_shape(self._wrap_fn, opt_state, params)
        sizes = sorted({n for _, n in calls})
        steps = [
            Program(self._step.lower(params, wrapped, sums, batch, 0, state, size=n, k=len(calls)), 0) for n in sizes
        ]
        return [Program(self._wrap.lower(opt_state, params), tree_bytes(batch)), *steps]
