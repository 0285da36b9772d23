"""`value_and_grad`: the whole batch's loss and gradient, accumulated over microbatches inside the caller's jit.

The same in-jit accumulation as the ``scan`` strategy's update (`autoaccum.strategies.accumulate_in_jit`), without
the optimizer step: the caller's own training step clips, logs and applies the gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autoaccum._checks import check_accumulator_dtype, check_bool, check_loss_fn, check_positive_int
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
    to_varying,
    varying,
)
from autoaccum.strategies.scan import check_unroll


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
    ``has_state``, ``grad_fn(params, batch, state) -> (loss, grads, state)``. Call it inside your own ``jax.jit``
    step (it traces once per shape) or outside one (it then compiles itself). The result equals
    ``jax.value_and_grad(loss_fn, has_aux=has_aux)(params, batch)`` on the whole batch: every example weighs
    ``1/B``, also where ``microbatch_size`` does not divide ``B`` (the last microbatch is smaller). Aux leaves with
    the example axis (per-example logits) are the microbatches' rows in order, as on the whole batch; the others
    (scalar metrics) are the example-weighted mean. ``has_state``, ``loss_reduction="sum"`` and ``remat`` are as for
    `autoaccum.build_update`: the state is threaded through the microbatches in order and never differentiated; with
    ``"sum"``, ``loss_fn`` returns ``(loss_sum, weight)`` and the result is the gradient of the summed ``loss_sum``
    over the summed weights (the loss returned is that ratio). With the batch sharded over a mesh along its example
    axis (a concrete array's ``NamedSharding``, or inside jit an explicit mesh axis in its type, ``jax.make_mesh``'s
    default), each device accumulates its own rows and the gradients are reduced once per call. An ``AxisType.Auto``
    mesh's sharding is not in the type: inside a jit XLA then partitions the loop itself (the result is the same; it
    gathers the batch). Inside ``jax.shard_map`` each device's batch is its own: the result is
    ``jax.value_and_grad``'s there (the local loss; the gradient of parameters the devices share summed over the
    batch's axes, once per call).

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (the mean over the batch's examples), or as ``has_aux``,
        ``has_state`` and ``loss_reduction`` say.
      microbatch_size: examples per microbatch (a positive int); the last one may be smaller, and a batch of at
        most this many examples runs as one microbatch (the plain full-batch step).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; a leaf whose leading size follows the batch's (found by
        tracing ``loss_fn`` abstractly at two sizes) is per-example, on one device; one whose shape follows it
        otherwise (the examples second, flattened) is refused, whatever the split.
      has_state: whether ``loss_fn(params, batch, state)`` returns ``(loss, state)``.
      loss_reduction: ``"mean"`` or ``"sum"`` (``loss_fn`` returns ``(loss_sum, weight)``).
      accumulator_dtype: floating dtype of the gradient sums (float32 by default; the loss, aux and weights in at
        least float32); the gradient is cast back like ``params``.
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
    check_loss_fn(loss_fn, ("params", "batch", "state") if has_state else ("params", "batch"))
    dtype = check_accumulator_dtype(accumulator_dtype)
    check_unroll(unroll)
    # The optimizer is no part of a gradient: the caller applies it.
    spec = Spec(
        loss_fn, optax.identity(), microbatch_size, has_aux, dtype, False, has_state, loss_reduction, remat=remat
    )

    def run(
        params: PyTree, batch: PyTree, state: PyTree, layout: Layout | None, rows: _Rows | None
    ) -> tuple[Any, PyTree, PyTree]:
        # Inside jax.shard_map: each device accumulates its own gradient and each one invariant over the batch's
        # mesh axes is summed over them once, at the end, as jax.value_and_grad's is (not once per microbatch).
        axes = frozenset().union(*map(varying, jax.tree.leaves(batch)))
        given, params = params, jax.tree.map(lambda p: to_varying(p, axes), params)
        loss, grads, state = _run(params, batch, state, layout, rows)
        grads = jax.tree.map(
            lambda g, p: jax.lax.psum(g, tuple(sorted(axes - varying(p)))) if axes - varying(p) else g, grads, given
        )
        return loss, grads, state

    def _run(
        params: PyTree, batch: PyTree, state: PyTree, layout: Layout | None, rows: _Rows | None
    ) -> tuple[Any, PyTree, PyTree]:
        if rows is None:
            acc, state, dtypes = accumulate_in_jit(spec, params, batch, state, layout=layout, unroll=unroll)
            return finish_loss(spec, acc, dtypes), mean_grads(params, acc), state
        # Per-example aux rows travel with the state, each microbatch writing its own rows.
        row_spec = dataclasses.replace(spec, loss_fn=_rows_loss(loss_fn, has_state, rows.mask), has_state=True)
        carried = (state, rows.buffers(leading_size(batch)), jnp.zeros((), jnp.int32))
        acc, (state, filled, _), dtypes = accumulate_in_jit(
            row_spec, params, batch, carried, layout=None, unroll=unroll
        )
        loss, kept = finish_loss(row_spec, acc, dtypes)
        return (loss, rows.merge(kept, filled)), mean_grads(params, acc), state

    jitted = jax.jit(run, static_argnames=("layout", "rows"))

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
        state = state if has_state else ()
        layout = layout_of(params, batch, state)
        if layout is not None:
            check_microbatch(microbatch_size, layout, size)
        rows = _example_rows(loss_fn, has_state, params, batch, state, min(size, microbatch_size)) if has_aux else None
        if rows is not None and layout is not None:
            raise ValueError(
                "`loss_fn`'s aux has per-example leaves (their leading size follows the batch's), which value_and_grad "
                "concatenates on one device only; on a mesh, reduce them in loss_fn (e.g. jnp.mean(correct)) or "
                "compute per-example outputs such as logits in a forward pass of their own."
            )
        loss, grads, new_state = jitted(params, batch, state, layout=layout, rows=rows)
        return (loss, grads, new_state) if has_state else (loss, grads)

    return grad_fn


def _abstract(x: Any, size: int | None = None) -> jax.ShapeDtypeStruct:
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x) if size is None else (size, *np.shape(x)[1:]), dtype)


class _Rows(NamedTuple):
    """Which leaves of ``loss_fn``'s aux are per-example (hashable: a static argument).

    Attributes:
      mask: for each aux leaf (flattened order), whether its leading axis is the examples'.
      treedef: the aux's structure.
      rows: ``(trailing shape, dtype)`` of each per-example leaf.
    """

    mask: tuple[bool, ...]
    treedef: Any
    rows: tuple[tuple[tuple[int, ...], Any], ...]

    def buffers(self, size: int) -> tuple[jax.Array, ...]:
        """The whole batch's rows, zeros, for the microbatches to fill in."""
        return tuple(jnp.zeros((size, *shape), dtype) for shape, dtype in self.rows)

    def merge(self, kept: list[Any], filled: tuple[jax.Array, ...]) -> PyTree:
        """The aux: the averaged leaves (``kept``) and the per-example ones (``filled``), in their places."""
        averaged, rows = iter(kept), iter(filled)
        return jax.tree.unflatten(self.treedef, [next(rows) if r else next(averaged) for r in self.mask])


def _example_rows(
    loss_fn: Callable[..., Any], has_state: bool, params: PyTree, batch: PyTree, state: PyTree, size: int
) -> _Rows | None:
    """The per-example leaves of ``loss_fn``'s aux (per-example logits, say), or None without any.

    A leaf is per-example when its leading size follows the microbatch's: ``loss_fn`` is traced abstractly at
    ``size`` and ``2 * size`` examples (nothing runs). A malformed output is left to `checked_loss` to report.
    """

    def aux(n: int) -> PyTree:
        def f(p: PyTree, b: PyTree, s: PyTree) -> PyTree:
            out = loss_fn(p, b, s) if has_state else loss_fn(p, b)
            out = out[0] if has_state and isinstance(out, tuple) and len(out) == 2 else out
            return out[1] if isinstance(out, tuple) and len(out) == 2 else ()

        micro = jax.tree.map(lambda x: _abstract(x, n), batch)
        return jax.eval_shape(f, jax.tree.map(_abstract, params), micro, jax.tree.map(_abstract, state))

    one, treedef = jax.tree.flatten_with_path(aux(size))
    two = jax.tree.leaves(aux(2 * size))
    if len(one) != len(two):
        return None
    pairs = [(path, a, b) for (path, a), b in zip(one, two, strict=True)]
    mask = tuple(a.ndim >= 1 and a.shape[0] == size and b.shape == (2 * size, *a.shape[1:]) for _, a, b in pairs)
    for (path, a, b), rows in zip(pairs, mask, strict=True):
        if a.shape != b.shape and not rows:
            raise ValueError(
                f"`loss_fn`'s aux leaf {jax.tree_util.keystr(path) or '<root>'} changes shape with the number of "
                f"examples ({a.shape} for {size} examples, {b.shape} for {2 * size}) but not as rows along its "
                "leading axis: value_and_grad returns an aux leaf either averaged over the microbatches (its shape "
                "fixed) or as the whole batch's rows (the examples first); move the example axis first (e.g. "
                "jnp.moveaxis(x, 1, 0)) or reduce it in loss_fn."
            )
    if not any(mask):
        return None
    rows = tuple((tuple(a.shape[1:]), a.dtype) for (_, a), r in zip(one, mask, strict=True) if r)
    return _Rows(mask, treedef, rows)


def _rows_loss(loss_fn: Callable[..., Any], has_state: bool, mask: tuple[bool, ...]) -> Callable[..., Any]:
    """``loss_fn`` whose per-example aux leaves (``mask``) are written into the carried rows, at the microbatch's
    offset, instead of being averaged: ``f(params, batch, (state, rows, offset)) -> ((loss, kept), carried)``."""

    def wrapped(params: PyTree, batch: PyTree, carried: Any) -> tuple[Any, Any]:
        state, rows, offset = carried
        if has_state:
            out, state = loss_fn(params, batch, state)
        else:
            out = loss_fn(params, batch)
        value, aux = out
        leaves = jax.tree.leaves(aux)
        per_example = [x for x, r in zip(leaves, mask, strict=True) if r]
        rows = tuple(
            jax.lax.dynamic_update_slice_in_dim(buffer, x.astype(buffer.dtype), offset, axis=0)
            for buffer, x in zip(rows, per_example, strict=True)
        )
        kept = [x for x, r in zip(leaves, mask, strict=True) if not r]
        return (value, kept), (state, rows, offset + leading_size(batch))

    return wrapped
