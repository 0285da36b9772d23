"""What the caller checks of the user's loss before any child process starts: that it traces, and that it is finite
at the initial parameters."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax

from autoaccum._batch import abstract
from autoaccum.strategies import PyTree


class NonFiniteLossWarning(UserWarning):
    """The loss is NaN or infinite at the initial parameters: the tuned plan would train on it."""


def _rows(batch: PyTree, n: int) -> PyTree:
    return jax.tree.map(lambda x: x[:n], batch)


def _on_many_devices(tree: PyTree) -> bool:
    return any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1 for x in jax.tree.leaves(tree))


def _call(loss_fn: Callable[..., Any], params: PyTree, batch: PyTree, state: PyTree | None) -> Any:
    return loss_fn(params, batch) if state is None else loss_fn(params, batch, state)


def _plain(tree: PyTree) -> PyTree:
    """``tree``'s shapes and dtypes without shardings: the loss as an update calls it, on gathered parameters and
    one device's rows (on an explicit mesh, a sharded parameter's gather would need an ``out_sharding``)."""
    return abstract(tree, sharded=False)


def loss_text(loss_fn: Callable[..., Any], params: PyTree, batch: PyTree, state: PyTree | None = None) -> str:
    """``loss_fn`` lowered on the batch's shapes (nothing compiles or runs): its body, constants included, for a
    fingerprint."""
    rows = _plain(batch)
    lowered = jax.jit(lambda p, b, s: _call(loss_fn, p, b, s)).lower(_plain(params), rows, _plain(state))
    return str(lowered.as_text())


def trace_loss(loss_fn: Callable[..., Any], params: PyTree, batch: PyTree, state: PyTree | None = None) -> None:
    """Traces ``loss_fn`` once on the batch's shapes, abstractly (``jax.eval_shape``: nothing is allocated, nothing
    runs; a loss that needs several examples, in chunks, traces), on inputs without shardings (`_plain`), else as
    given. An exception the loss raises is the
    caller's own, raised here with its file and line, before any trial; a note says so.

    Example:
      >>> import jax.numpy as jnp
      >>> trace_loss(lambda p, b: (b["x"] @ p).mean(), jnp.ones(3), {"x": jnp.ones((4, 3))})
      >>> try:
      ...     trace_loss(lambda p, b: b["nope"].mean(), jnp.ones(3), {"x": jnp.ones((4, 3))})
      ... except KeyError as e:
      ...     print(repr(e))
      KeyError('nope')
    """
    inputs = (params, _plain(batch), state)  # (the batch without shardings either way)
    trace = functools.partial(jax.eval_shape, lambda p, b, s: _call(loss_fn, p, b, s))
    try:
        trace(*map(_plain, inputs))
    except Exception as e:  # the user's loss raised: re-raised unchanged, with a note of where autoaccum called it
        with contextlib.suppress(Exception):  # a loss that shards its own values: on the inputs' mesh
            trace(*inputs)
            return
        if hasattr(e, "add_note"):
            called = "loss_fn(params, batch)" if state is None else "loss_fn(params, batch, state), as `state` is given"
            e.add_note(
                f"autoaccum traced `loss_fn` as {called}, on the batch's shapes (jax.eval_shape), before starting "
                "any trial; the error above is the loss's own."
            )
        raise


def initial_loss(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    state: PyTree | None = None,
    has_aux: bool = False,
    loss_reduction: str = "mean",
    rows: int = 8,
) -> float | None:
    """The loss at ``params`` on the batch's first ``rows`` examples (``loss_sum`` for ``loss_reduction="sum"``),
    run once in this process; None where its output is not the shape autoaccum expects (reported elsewhere), and
    for a batch laid out over several devices (its rows are not taken apart here)."""
    if _on_many_devices(batch):
        return None
    out = jax.jit(lambda p, b, s: _call(loss_fn, p, b, s))(params, _rows(batch, rows), state)
    for unpack in (state is not None, has_aux, loss_reduction == "sum"):
        if unpack:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                return None
            out = out[0]
    try:
        return float(out)
    except (TypeError, ValueError):
        return None


def warn_if_not_finite(loss_fn: Callable[..., Any], params: PyTree, batch: PyTree, **kwargs: Any) -> None:
    """A `NonFiniteLossWarning` where `initial_loss` is NaN or infinite.

    Example:
      >>> import warnings, jax.numpy as jnp
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warn_if_not_finite(lambda p, b: jnp.log(p - 2).mean() * b.mean(), jnp.ones(3), jnp.ones((4, 3)))
      >>> str(caught[0].message).split(":")[0]
      "the loss is nan at the initial parameters (on the batch's first 8 examples)"
    """
    warn_of(initial_loss(loss_fn, params, batch, **kwargs), kwargs.get("rows", 8), stacklevel=4)


def warn_of(value: float | None, rows: int = 8, stacklevel: int = 3) -> None:
    """The `NonFiniteLossWarning` of an `initial_loss` ``value`` on ``rows`` examples that is NaN or infinite."""
    if value is not None and not math.isfinite(value):
        warnings.warn(
            f"the loss is {value} at the initial parameters (on the batch's first {rows} examples): the tuned plan "
            "would train on it; check the loss, the parameters' initialisation and the batch.",
            NonFiniteLossWarning,
            stacklevel=stacklevel,
        )
