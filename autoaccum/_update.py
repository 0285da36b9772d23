"""The emitted update step: ``update(params, opt_state, batch) -> (params, opt_state, loss)``.

With a model state (``has_state=True``): ``update(params, opt_state, batch, state) -> (params, opt_state, loss,
state)``; from a data loader: ``update.stream(params, opt_state, microbatches[, state])``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax.numpy as jnp
import optax

from autoaccum._checks import (
    check_accumulator_dtype,
    check_bool,
    check_loss_fn,
    check_optimizer,
    check_positive_int,
)
from autoaccum.strategies import (
    Auto,
    LossReduction,
    Program,
    PyTree,
    Schedule,
    Spec,
    Strategy,
    check_params,
    layout_of,
    leading_size,
)
from autoaccum.strategies import get as get_strategy


class _Missing:
    def __repr__(self) -> str:
        return "<no state>"


_MISSING: Any = _Missing()


@dataclasses.dataclass(frozen=True)
class Update:
    """A gradient-accumulating update whose result equals one optimizer step on the whole batch.

    Call it as ``params, opt_state, loss = update(params, opt_state, batch)``, or, built with
    ``has_state=True``, as ``params, opt_state, loss, state = update(params, opt_state, batch, state)``;
    ``update.init(params)`` gives the optimizer state it expects. ``update.stream(...)`` takes the microbatches
    from an iterable instead of one batch. With ``donate=True`` (the default) the ``params``, ``opt_state`` and
    ``state`` you pass are donated to the computation: their buffers are reused for the results and must not be
    used afterwards (rebind them, as above). ``batch`` is never donated.

    Attributes:
      microbatch_size: examples per microbatch; the last one may be smaller.
      strategy: the strategy's registered name, or ``"auto"`` (`autoaccum.strategies.Auto`).
      options: the strategy's options.
      accumulation: the strategy object that runs the step.
    """

    microbatch_size: int
    strategy: str
    options: dict[str, Any]
    accumulation: Strategy = dataclasses.field(repr=False, compare=False)

    @property
    def has_state(self) -> bool:
        """Whether ``loss_fn`` threads a model state (the update then takes and returns ``state``)."""
        return self.accumulation.spec.has_state

    @property
    def remat(self) -> str | None:
        """The ``jax.checkpoint`` policy each microbatch's loss runs under (None: off)."""
        return self.accumulation.spec.remat

    @property
    def state_update(self) -> str:
        """``"per_microbatch"`` (the state is threaded) or ``"once"`` (its floating leaves move once per update)."""
        return self.accumulation.spec.state_update

    @property
    def loss_reduction(self) -> str:
        """``"mean"`` (``loss_fn`` returns the mean loss) or ``"sum"`` (it returns ``(loss_sum, weight)``)."""
        return self.accumulation.spec.loss_reduction

    def init(self, params: PyTree) -> PyTree:
        """The optimizer state for ``params``: ``optimizer.init(params)``, the same for every strategy."""
        return self.accumulation.init(params)

    def _state(self, state: PyTree, call: str, params: PyTree) -> PyTree:
        if self.has_state and state is _MISSING:
            check_params(params)  # an nnx model passed here is pointed at autoaccum.nnx, not at `state`
            raise TypeError(
                f"the update was built with has_state=True, so pass the model state: `{call}(params, opt_state, "
                f"{'microbatches' if call == 'update.stream' else 'batch'}, state)`."
            )
        if not self.has_state and state is not _MISSING:
            raise TypeError(
                f"`state` was passed to {call} but the update was built with has_state=False; build it with "
                "build_update(..., has_state=True) and loss_fn(params, batch, state) -> (loss, state)."
            )
        return state if self.has_state else ()

    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = _MISSING) -> tuple[Any, ...]:
        """``(params, opt_state, loss)``, or ``(params, opt_state, loss, state)`` with ``has_state``."""
        state = self._state(state, "update", params)
        # The strategy checks the batch and params (clear errors before anything is traced) once per signature.
        params, opt_state, loss, state = self.accumulation(params, opt_state, batch, state)
        return (params, opt_state, loss, state) if self.has_state else (params, opt_state, loss)

    def stream(
        self, params: PyTree, opt_state: PyTree, microbatches: Iterable[PyTree], state: PyTree = _MISSING
    ) -> tuple[Any, ...]:
        """One update on microbatches that arrive one at a time (e.g. from a data loader).

        The result equals one full-batch step on the concatenation of the microbatches, whose sizes may differ:
        with ``loss_reduction="mean"`` microbatch ``i`` of ``n_i`` examples weighs ``n_i / N`` (``N`` all the
        examples seen), with ``"sum"`` the gradient is that of the summed ``loss_sum`` over the summed weights.
        The sums are accumulated unnormalised and divided once at the end. One program is compiled per distinct
        microbatch size, plus one that makes the zero sums (on one device, per distinct size of the first
        microbatch) and one for the optimizer step. ``microbatch_size`` plays no part here. The inputs are donated
        once the update is made: a stream that fails (a loader that raises, a malformed microbatch) leaves them, as
        the stream runs on a copy of ``state`` (held beside yours until the end: a state as large as a model, the
        frozen weights of an nnx model's LoRA, is held twice).

        Args:
          params: the parameters (donated with ``donate=True``).
          opt_state: the optimizer state (donated with ``donate=True``).
          microbatches: any iterable of batch pytrees (host or device arrays), consumed once.
          state: the model state, only and always with ``has_state=True``.

        Returns:
          ``(params, opt_state, loss)``, or ``(params, opt_state, loss, state)`` with ``has_state``.

        Raises:
          ValueError: ``microbatches`` is empty, or a microbatch is malformed.

        Example:
          >>> import jax.numpy as jnp, optax, autoaccum
          >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
          >>> update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=4)
          >>> loader = ({"x": jnp.ones((n, 3)), "y": jnp.zeros((n,))} for n in (4, 4, 2))
          >>> params, opt_state, loss = update.stream(jnp.ones(3), update.init(jnp.ones(3)), loader)
          >>> float(loss)
          9.0
        """
        state = self._state(state, "update.stream", params)
        check_params(params)
        params, opt_state, loss, state = self.accumulation.stream(params, opt_state, microbatches, state)
        return (params, opt_state, loss, state) if self.has_state else (params, opt_state, loss)

    def accumulation_steps(self, batch_size: int) -> int:
        """Microbatches per call for a batch of ``batch_size`` examples (``ceil(B / microbatch_size)``)."""
        return -(-batch_size // self.microbatch_size)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = _MISSING) -> list[Program]:
        """The compiled programs one call runs, lowered for these shapes (``jax.ShapeDtypeStruct`` work).

        ``state`` (shapes suffice) is passed only and always with ``has_state``.
        """
        state = self._state(state, "update.programs", params)
        leading_size(batch)
        check_params(params)
        return self.accumulation.programs(params, opt_state, batch, self.accumulation.carried(state))


def build_update(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    microbatch_size: int,
    strategy: str = "auto",
    has_aux: bool = False,
    has_state: bool = False,
    loss_reduction: LossReduction = "mean",
    accumulator_dtype: Any = jnp.float32,
    donate: bool = True,
    gather_params: Schedule = "once",
    reduce_grads: Schedule = "once",
    remat: str | None = None,
    state_update: Schedule = "per_microbatch",
    **options: Any,
) -> Update:
    """Builds a jitted update that accumulates gradients over microbatches of ``microbatch_size``.

    The result equals one step of ``optimizer`` on ``jax.grad(loss_fn)(params, batch)`` for the whole batch:
    every example weighs ``1 / B`` even when ``microbatch_size`` does not divide ``B`` (the last microbatch is
    then smaller), the returned loss equals ``loss_fn(params, batch)`` and aux is the example-weighted mean.
    The optimizer, schedules included, advances once per call.

    This holds for a loss that is a mean (or a sum) of per-example terms, and a state that does not depend on the
    batch's statistics (a PRNG key, a step counter). It does not hold where examples are coupled: each microbatch
    is a batch of its own to ``loss_fn``, so BatchNorm in training mode normalises each microbatch by its own
    statistics (the gradient changes, more as the microbatch shrinks), and a loss that couples examples (a ratio
    of batch means, a Dice or Jaccard term over the batch, a contrastive loss over in-batch negatives) is computed
    per microbatch and averaged. Keep such microbatches large (``tune``'s ``min_microbatch``). The running
    statistics take one step per microbatch by default; ``state_update="once"`` moves them once per update.

    The three ways of calling ``loss_fn`` compose: wherever ``loss`` stands below, ``has_aux`` puts
    ``(loss, aux)``, and ``loss_reduction="sum"`` makes ``loss`` the pair ``(loss_sum, weight)``.

    * ``has_state=True``: ``loss_fn(params, batch, state) -> (loss, state)`` and ``update(params, opt_state,
      batch, state) -> (params, opt_state, loss, state)``. ``state`` is any pytree (BatchNorm statistics, a PRNG
      key, typed ``jax.random.key`` or raw ``uint32``, counters); microbatch ``i`` sees the state microbatch
      ``i - 1`` returned, the update returns the last one, and it is never differentiated. Split a key inside
      ``loss_fn`` and return the new one, so each microbatch and each update draws fresh randomness.
    * ``loss_reduction="sum"``: ``loss_fn`` returns ``(loss_sum, weight)``, e.g. the summed token losses and the
      number of real tokens. The gradient is ``grad(sum of loss_sum) / (sum of weight)`` over all microbatches:
      exactly the full-batch token mean, also over padded, uneven microbatches; the returned loss is
      ``sum of loss_sum / sum of weight`` and aux is the weight-weighted mean of the microbatches' aux.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the batch's examples; see above for
        ``has_aux``, ``has_state`` and ``loss_reduction``. ``batch`` is any pytree whose leaves share a leading
        example axis. Every leaf of ``params`` must be floating (counters and keys belong in ``state``).
      optimizer: an ``optax.GradientTransformation``.
      microbatch_size: examples per microbatch (a positive int); the last one may be smaller, and a batch of at
        most this many examples runs as one microbatch (the plain full-batch step).
      strategy: how to accumulate, one of ``autoaccum.strategies.available()``, or ``"auto"``: ``"scan"`` (the
        whole update in one program), except on XLA:CPU for a ``loss_fn`` with a convolution, ``"loop"``
        (XLA:CPU runs convolutions inside a loop body about 10x slower; see `autoaccum.strategies.Auto`).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``. Aux is averaged over the microbatches, so each leaf
        must keep its shape whatever the number of examples (scalar metrics, per-class counts): a leaf with the
        example axis (per-example logits) is refused at the first call, before compiling.
      has_state: whether ``loss_fn`` takes and returns a model state (then the update does too).
      loss_reduction: ``"mean"`` (``loss_fn`` returns the mean loss) or ``"sum"`` (it returns
        ``(loss_sum, weight)``).
      accumulator_dtype: floating dtype for accumulating gradients (float32 by default, also for bf16 models);
        they are cast back like ``params`` before the optimizer. The loss, aux and weights sum in it too, in at
        least float32.
      donate: donate ``params``, ``opt_state`` and ``state`` to the update (saves a copy of each; the caller
        must not reuse the arrays it passed).
      gather_params: with ``params`` sharded over the batch's mesh axes (FSDP), gather them ``"once"`` per
        update (a full copy on each device) or ``"per_microbatch"`` (less memory, more communication).
      reduce_grads: on a mesh, reduce the gradient sums across devices ``"once"`` per update (a full-size sum
        on each device) or ``"per_microbatch"`` (with FSDP: sharded sums, more communication).
      remat: rematerialisation: the ``jax.checkpoint`` policy each microbatch's loss runs under, named after
        ``jax.checkpoint_policies`` (``autoaccum.strategies.REMAT_POLICIES``: ``"nothing_saveable"``,
        ``"dots_saveable"``, ``"dots_with_no_batch_dims_saveable"``, and where the device has pinned host memory
        ``"offload_dot_with_no_batch_dims"``), or None (off, the default). The result is the same; the memory
        and the time of a step change. Per-layer policies need the model's cooperation: see `autoaccum.Knobs`.
      state_update: how the model state moves (``has_state``): ``"per_microbatch"`` (the default) threads it,
        microbatch ``i`` seeing what ``i - 1`` returned, so an EMA of batch statistics (BatchNorm's running mean
        and variance) takes one step per microbatch, ``k`` per update; ``"once"`` gives every microbatch the
        floating leaves as the update received them and returns their example-weighted mean over the
        microbatches: the EMA then moves once per update, towards the mean of the microbatches' statistics (for
        the running mean, the full batch's mean). Keys, counters and other non-floating leaves are threaded
        either way.
      **options: the strategy's options (``autoaccum.strategies.get(strategy).options``), e.g. ``unroll=2`` for scan.

    Returns:
      An `Update`; ``update.init(params)`` makes the optimizer state.

    Raises:
      TypeError, ValueError: for bad arguments, before anything is compiled. A malformed batch, a
        non-floating ``params`` leaf, or a ``loss_fn`` whose output does not match ``has_aux``, ``has_state``
        and ``loss_reduction`` is reported at the first call, also before compiling.

    Example:
      >>> import jax, jax.numpy as jnp, optax, autoaccum
      >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((10, 3)), "y": jnp.zeros((10,))}
      >>> update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=4)
      >>> params, opt_state, loss = update(jnp.ones(3), update.init(jnp.ones(3)), batch)
      >>> float(loss)
      9.0

      With a model state (a PRNG key for dropout) and a token-weighted loss over padded sequences:

      >>> def loss_fn(w, b, key):
      ...     key, sub = jax.random.split(key)
      ...     keep = jax.random.bernoulli(sub, 0.9, b["mask"].shape)
      ...     token_losses = (b["x"] @ w - b["y"]) ** 2 * keep / 0.9
      ...     return (jnp.sum(token_losses * b["mask"]), jnp.sum(b["mask"])), key
      >>> batch = {"x": jnp.ones((10, 5, 3)), "y": jnp.zeros((10, 5)), "mask": jnp.ones((10, 5))}
      >>> update = autoaccum.build_update(
      ...     loss_fn, optax.sgd(0.1), microbatch_size=4, has_state=True, loss_reduction="sum"
      ... )
      >>> params, opt_state, loss, key = update(jnp.ones(3), update.init(jnp.ones(3)), batch, jax.random.key(0))
      >>> loss.shape
      ()
    """
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    check_positive_int(microbatch_size, "microbatch_size")
    cls = Auto if strategy == Auto.name else get_strategy(strategy)
    check_bool(has_aux, "has_aux")
    check_bool(has_state, "has_state")
    check_bool(donate, "donate")
    if getattr(loss_fn, "has_state", False) is True and not has_state:
        raise TypeError(
            f"`loss_fn` ({type(loss_fn).__name__}) takes and returns a model state (loss_fn(params, batch, state) -> "
            "(loss, state)), but has_state=False; pass has_state=True, and the state to the update: "
            "update(params, opt_state, batch, state), with e.g. autoaccum.linen.init_state(variables, key)."
        )
    check_loss_fn(loss_fn, ("params", "batch", "state") if has_state else ("params", "batch"))
    dtype = check_accumulator_dtype(accumulator_dtype)
    spec = Spec(
        loss_fn,
        optimizer,
        microbatch_size,
        has_aux,
        dtype,
        donate,
        has_state,
        loss_reduction,
        gather_params=gather_params,
        reduce_grads=reduce_grads,
        remat=remat,
        state_update=state_update,
    )
    accumulation = cls(spec, **options)
    return Update(microbatch_size, strategy, dict(accumulation.config), accumulation)


def resolve_strategy(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    params: PyTree,
    batch: PyTree,
    state: PyTree | None = None,
    platform: str | None = None,
    **build: Any,
) -> dict[str, Any]:
    """``build`` (`build_update`'s keywords) with ``strategy="auto"`` (the default) replaced by the strategy that
    `autoaccum.strategies.Auto` picks for these arguments, and only that strategy's options kept; any other
    strategy as given. The probe, the estimate and the tuner measure the program the default update runs:
    where the batch lives, or on ``platform`` (``"gpu"`` for a card planned for from here).

    Traces the loss abstractly (``params``, ``batch`` and ``state`` may be shapes); nothing runs.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> resolve_strategy(lambda w, b: jnp.mean(b @ w), optax.sgd(0.1), jnp.ones(3), jnp.ones((4, 3)))
      {'strategy': 'scan'}
    """
    build = {"strategy": Auto.name, **build}
    if build["strategy"] != Auto.name:
        return build
    has_state = build.get("has_state", state is not None)
    kw = {k: v for k, v in build.items() if k != "has_state"}
    # Auto looks at one microbatch's loss: the smallest, one example (one per shard on a mesh), as the caller's
    # preflight traces it (a loss that fails only on larger batches fails in the worker, which names the user's file).
    layout = layout_of(params, batch, () if state is None else state)
    smallest = 1 if layout is None else layout.shards
    update = build_update(loss_fn, optimizer, microbatch_size=smallest, donate=False, has_state=has_state, **kw)
    auto: Any = update.accumulation  # an `Auto`
    chosen = auto.choose(params, batch, auto.carried(() if state is None else state), platform)
    kept = {k: v for k, v in build.items() if k not in Auto.options or k in chosen.options}
    return {**kept, "strategy": chosen.name}


def spelled_out(build: Mapping[str, Any]) -> dict[str, Any]:
    """``build`` (`build_update`'s keywords) with every default of `build_update` and of its strategy filled in, the
    accumulator's dtype by name: two builds of one update are equal.

    Example:
      >>> spelled_out({"strategy": "scan"}) == spelled_out({"strategy": "scan", "unroll": 1, "remat": None})
      True
    """
    defaults = _build_defaults()
    name = build.get("strategy", defaults["strategy"])
    strategy = Auto if name == Auto.name else get_strategy(name)
    full = {**defaults, **{k: v[0] for k, v in strategy.options.items()}, **build}
    return {**full, "accumulator_dtype": jnp.dtype(full["accumulator_dtype"]).name}


@functools.cache
def _build_defaults() -> dict[str, Any]:
    """`build_update`'s keyword arguments with their defaults (read once: `spelled_out` runs for every request)."""
    keywords = inspect.signature(build_update).parameters.values()
    return {p.name: p.default for p in keywords if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
