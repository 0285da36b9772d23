"""`value_and_grad`: the whole batch's loss and gradient, accumulated over microbatches inside the caller's jit.

The same in-jit accumulation as the ``scan`` strategy's update (`autoaccum.strategies.accumulate_in_jit`), without
the optimizer step: the caller's own training step clips, logs and applies the gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from autoaccum._checks import check_bool, check_loss_fn, check_positive_int, floating_dtype
from autoaccum.strategies import (
    Layout,
    LossReduction,
    PyTree,
    Spec,
    accumulate_in_jit,
    check_microbatch,
    check_params,
    finish_loss,
    layout_of,
    leading_size,
    mean_grads,
)


class _Missing:
    def __repr__(self) -> str:
        return "<no state>"


_MISSING: Any = _Missing()


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    microbatch_size: int,
    has_aux: bool = False,
    has_state: bool = False,
    loss_reduction: LossReduction = "mean",
    accumulator_dtype: Any = jnp.float32,
    remat: str | None = None,
    unroll: int | bool = 1,
) -> Callable[..., tuple[Any, ...]]:
    """``jax.value_and_grad(loss_fn)`` over the whole batch, accumulated over microbatches of ``microbatch_size``.

    Returns ``grad_fn(params, batch) -> (loss, grads)``; with ``has_aux`` the loss is ``(loss, aux)``; with
    ``has_state``, ``grad_fn(params, batch, state) -> (loss, grads, state)``. Call it inside your own
    ``jax.jit`` step (it traces once per shape) or outside one (it then compiles itself). The result equals
    ``jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)`` on the whole batch: every example weighs
    ``1 / B``, also where ``microbatch_size`` does not divide ``B`` (the last microbatch is smaller), and aux is
    the example-weighted mean. ``has_state``, ``loss_reduction="sum"`` and ``remat`` are as for
    `autoaccum.build_update`: the state is threaded through the microbatches in order and never differentiated;
    with ``"sum"``, ``loss_fn`` returns ``(loss_sum, weight)`` and the result is the gradient of the summed
    ``loss_sum`` over the summed weights (the loss returned is that ratio). With the batch sharded over a mesh
    along its example axis (a concrete array's ``NamedSharding``, or inside jit an explicit mesh axis in its
    type, ``jax.make_mesh``'s default), each device accumulates its own rows and the gradients are reduced once
    per call.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (the mean over the batch's examples), or as ``has_aux``,
        ``has_state`` and ``loss_reduction`` say.
      microbatch_size: examples per microbatch (a positive int).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      has_state: whether ``loss_fn(params, batch, state)`` returns ``(loss, state)``.
      loss_reduction: ``"mean"`` or ``"sum"`` (``loss_fn`` returns ``(loss_sum, weight)``).
      accumulator_dtype: floating dtype of the sums (float32 by default); the gradient is cast back like
        ``params``.
      remat: the ``jax.checkpoint`` policy of each microbatch's loss (`autoaccum.strategies.REMAT_POLICIES`).
      unroll: the ``lax.scan`` unroll factor (the ``scan`` strategy's option).

    Returns:
      ``grad_fn(params, batch[, state]) -> (loss[, aux]), grads[, state]``.

    Raises:
      TypeError, ValueError: bad arguments, here; a malformed batch, a missing state or a ``loss_fn`` whose
        output does not match the arguments (a vector loss, say), at the call, before anything compiles.

    Example:
      >>> import jax, jax.numpy as jnp, autoaccum
      >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.arange(30.0).reshape(10, 3), "y": jnp.ones(10)}
      >>> grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=4)
      >>> loss, grads = jax.jit(grad_fn)(jnp.ones(3), batch)
      >>> expected = jax.grad(loss_fn)(jnp.ones(3), batch)
      >>> bool(jnp.allclose(grads, expected))
      True
    """
    check_loss_fn(loss_fn)
    check_positive_int(microbatch_size, "microbatch_size")
    check_bool(has_aux, "has_aux")
    check_bool(has_state, "has_state")
    dtype = floating_dtype(accumulator_dtype)
    if dtype is None:
        raise TypeError(f"`accumulator_dtype` must be a floating dtype such as jnp.float32, got {accumulator_dtype!r}.")
    # The optimizer is no part of a gradient: the caller applies it.
    spec = Spec(
        loss_fn, optax.identity(), microbatch_size, has_aux, dtype, False, has_state, loss_reduction, remat=remat
    )

    def run(params: PyTree, batch: PyTree, state: PyTree, layout: Layout | None) -> tuple[Any, PyTree, PyTree]:
        acc, state, dtypes = accumulate_in_jit(spec, params, batch, state, layout=layout, unroll=unroll)
        return finish_loss(spec, acc, dtypes), mean_grads(params, acc), state

    jitted = jax.jit(run, static_argnames=("layout",))

    def grad_fn(params: PyTree, batch: PyTree, state: PyTree = _MISSING) -> tuple[Any, ...]:
        if has_state and state is _MISSING:
            raise TypeError(
                "`state` is missing: value_and_grad was built with has_state=True, so call grad_fn(params, batch, "
                "state) with the model state loss_fn(params, batch, state) takes."
            )
        if not has_state and state is not _MISSING:
            raise TypeError(
                "`state` was passed but value_and_grad was built with has_state=False; build it with "
                "has_state=True and loss_fn(params, batch, state) -> (loss, state)."
            )
        size = leading_size(batch)
        check_params(params)
        layout = layout_of(params, batch, state if has_state else ())
        if layout is not None:
            check_microbatch(microbatch_size, layout, size)
        loss, grads, new_state = jitted(params, batch, state if has_state else (), layout=layout)
        return (loss, grads, new_state) if has_state else (loss, grads)

    return grad_fn
