"""The emitted update step: ``update(params, opt_state, batch) -> (params, opt_state, loss)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from autoaccum import strategies
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum.strategies import Program, PyTree, Spec, Strategy, leading_size


@dataclasses.dataclass(frozen=True)
class Update:
    """A gradient-accumulating update whose result equals one optimizer step on the whole batch.

    Call it as ``params, opt_state, loss = update(params, opt_state, batch)``; ``update.init(params)`` gives
    the optimizer state it expects. With ``donate=True`` (the default) the ``params`` and ``opt_state`` you
    pass are donated to the computation: their buffers are reused for the results and must not be used
    afterwards (rebind them, as above). ``batch`` is never donated.

    Attributes:
      microbatch_size: examples per microbatch; the last one may be smaller.
      strategy: the strategy's registered name.
      options: the strategy's options.
      accumulation: the strategy object that runs the step.
    """

    microbatch_size: int
    strategy: str
    options: dict[str, Any]
    accumulation: Strategy = dataclasses.field(repr=False, compare=False)

    def init(self, params: PyTree) -> PyTree:
        """The optimizer state for ``params``: ``optimizer.init(params)``, the same for every strategy."""
        return self.accumulation.init(params)

    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree, Any]:
        leading_size(batch)  # clear errors for a malformed batch before anything is traced
        return self.accumulation(params, opt_state, batch)

    def accumulation_steps(self, batch_size: int) -> int:
        """Microbatches per call for a batch of ``batch_size`` examples (``ceil(B / microbatch_size)``)."""
        return -(-batch_size // self.microbatch_size)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> list[Program]:
        """The compiled programs one call runs, lowered for these shapes (``jax.ShapeDtypeStruct`` work)."""
        leading_size(batch)
        return self.accumulation.programs(params, opt_state, batch)


def build_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    microbatch_size: int,
    strategy: str = "scan",
    has_aux: bool = False,
    accumulator_dtype: Any = jnp.float32,
    donate: bool = True,
    **options: Any,
) -> Update:
    """Builds a jitted update that accumulates gradients over microbatches of ``microbatch_size``.

    The result equals one step of ``optimizer`` on ``jax.grad(loss_fn)(params, batch)`` for the whole batch:
    every example weighs ``1 / B`` even when ``microbatch_size`` does not divide ``B`` (the last microbatch is
    then smaller), the returned loss equals ``loss_fn(params, batch)`` and aux is the example-weighted mean.
    The optimizer, schedules included, advances once per call.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the batch's examples; with
        ``has_aux``, ``-> (scalar, aux)``. ``batch`` is any pytree whose leaves share a leading example axis.
      optimizer: an ``optax.GradientTransformation``.
      microbatch_size: examples per microbatch (a positive int).
      strategy: how to accumulate, one of ``autoaccum.strategies.available()``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      accumulator_dtype: floating dtype for accumulating gradients, loss and aux (float32 by default, also
        for bf16 models); gradients are cast back like ``params`` before the optimizer.
      donate: donate ``params`` and ``opt_state`` to the update (saves a copy of each; the caller must not
        reuse the arrays it passed).
      **options: the strategy's options (``autoaccum.strategies.get(strategy).options``), e.g. ``unroll=2`` for scan.

    Returns:
      An `Update`; ``update.init(params)`` makes the optimizer state.

    Raises:
      TypeError, ValueError: for bad arguments, before anything is compiled. A malformed batch or a loss
        that is not a scalar is reported at the first call, also before compiling.

    Example:
      >>> import jax, jax.numpy as jnp, optax, autoaccum
      >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((10, 3)), "y": jnp.zeros((10,))}
      >>> update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=4)
      >>> params, opt_state, loss = update(jnp.ones(3), update.init(jnp.ones(3)), batch)
      >>> float(loss)
      9.0
    """
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    check_positive_int(microbatch_size, "microbatch_size")
    cls = strategies.get(strategy)
    check_bool(has_aux, "has_aux")
    check_bool(donate, "donate")
    try:
        dtype = np.dtype(accumulator_dtype)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"`accumulator_dtype` must be a floating dtype such as jnp.float32, got {accumulator_dtype!r}.")
    spec = Spec(loss_fn, optimizer, microbatch_size, has_aux, dtype, donate)
    accumulation = cls(spec, **options)
    return Update(microbatch_size, strategy, dict(accumulation.config), accumulation)
