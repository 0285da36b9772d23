"""flax linen models through `autoaccum.build_update`'s ``has_state``: mutable collections and dropout keys.

A linen model with BatchNorm is applied with ``mutable=["batch_stats"]`` and returns the new statistics; with
Dropout it needs a fresh ``rngs={"dropout": key}`` for every microbatch of every step. Both are model state:
they must flow through the microbatches in order, microbatch i seeing what microbatch i-1 returned.
`make_loss_fn` writes that loss for you, and `init_state` makes the state it threads::

    variables = model.init({"params": k1, "dropout": k2}, x, train=False)
    loss_fn = autoaccum.linen.make_loss_fn(model, lambda apply, b: xent(apply(b["image"], train=True), b["label"]))
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=16, has_state=True)
    state = autoaccum.linen.init_state(variables, jax.random.key(1))
    params, opt_state, loss, state = update(variables["params"], tx.init(variables["params"]), batch, state)

What goes wrong silently without it: dropping the returned ``batch_stats`` leaves the statistics at their
initial values forever; closing over ``batch_stats`` bakes the first value into the jitted step; a dropout key
closed over (or passed unchanged) gives every microbatch and every step the same mask.

What accumulation cannot make equal to one full-batch step: BatchNorm in training mode normalises each
microbatch by that microbatch's statistics, so the gradient differs from the full batch's, more as the
microbatch shrinks (keep it above a floor: ``autoaccum.tune(..., min_microbatch=...)``). The running
statistics take one EMA step per microbatch, ``k`` per update; ``build_update(..., state_update="once")``
moves them once per update, by the mean of the microbatches' statistics: the running mean as one full-batch step
would move it, the running variance not quite (it leaves out how the microbatches' means differ).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from autoaccum._checks import check_loss_fn
from autoaccum._deprecated import moved_names
from autoaccum.strategies import PyTree

RNG = "rng"
"""The state entry holding the PRNG key that a `make_loss_fn` loss splits for each microbatch."""


def init_state(variables: Mapping[str, Any], rng: jax.Array, mutable: Sequence[str] = ("batch_stats",)) -> dict:
    """The model state a `make_loss_fn` loss threads: copies of the ``mutable`` collections of ``variables`` and
    of ``rng``.

    They are copies, so that an update that donates the state (``build_update``'s default) leaves ``variables``
    and ``rng`` usable.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from autoaccum.linen import init_state
      >>> init_state({"params": {}, "batch_stats": {"mean": jnp.zeros(2)}}, jax.random.key(0))["batch_stats"]
      {'mean': Array([0., 0.], dtype=float32)}
    """
    mutable = _names(mutable, "mutable", "batch_stats")
    missing = [name for name in mutable if name not in variables]
    if missing:
        raise ValueError(
            f"`variables` has no collection(s) {missing} (it has {sorted(variables)}); pass the `mutable` "
            "collections your model really has, e.g. mutable=() for a model without BatchNorm."
        )
    return jax.tree.map(jnp.copy, {**{name: variables[name] for name in mutable}, RNG: rng})


def make_loss_fn(
    model: Any,
    criterion: Callable[[Callable[..., Any], PyTree], Any],
    *,
    mutable: Sequence[str] = ("batch_stats",),
    rng_streams: Sequence[str] = ("dropout",),
) -> Loss:
    """A ``loss_fn(params, batch, state) -> (loss, state)`` for `autoaccum.build_update` (``has_state=True``).

    ``build_update`` refuses it without ``has_state=True`` (it threads the model state), and calling it without a
    state says so.

    Args:
      model: the linen ``nn.Module``.
      criterion: ``criterion(apply, batch) -> loss`` (or whatever ``build_update``'s ``has_aux`` and
        ``loss_reduction`` expect); ``apply(*args, **kwargs)`` runs ``model.apply`` with the parameters, the
        ``mutable`` collections of the state (their updates are kept) and a fresh key per ``rng_streams`` entry.
      mutable: the collections the model updates in training (``"batch_stats"`` for BatchNorm).
      rng_streams: the RNG streams it needs in training (``"dropout"``); the state's key is split once per
        microbatch, so each microbatch of each step draws its own randomness.

    Example:
      >>> import flax.linen as nn, jax, jax.numpy as jnp, optax, autoaccum
      >>> from autoaccum.linen import init_state, make_loss_fn
      >>> model = nn.Dense(1)
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> fn = make_loss_fn(model, lambda apply, b: jnp.mean(apply(b)), mutable=(), rng_streams=())
      >>> update = autoaccum.build_update(fn, optax.sgd(0.1), microbatch_size=2, has_state=True)
      >>> state = init_state(variables, jax.random.key(1), mutable=())
      >>> params, opt_state, loss, state = update(variables["params"], optax.sgd(0.1).init(variables["params"]),
      ...                                         jnp.ones((4, 3)), state)
    """
    if not callable(getattr(model, "apply", None)):
        raise TypeError(
            f"`model` must be a flax linen nn.Module, got {type(model).__name__}; pass the module itself (not its "
            "variables), or for an nnx model use autoaccum.nnx."
        )
    check_loss_fn(criterion, ("apply", "batch"), name="criterion")
    return Loss(
        model, criterion, _names(mutable, "mutable", "batch_stats"), _names(rng_streams, "rng_streams", "dropout")
    )


def _names(value: Any, arg: str, example: str) -> tuple[str, ...]:
    """``value`` as a tuple of collection or stream names; ``TypeError`` naming ``arg`` for one string or non-str."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"`{arg}` must be a sequence of names, got {arg}={value!r}; e.g. {arg}=({example!r},) or ().")
    return tuple(value)


class _NoState:
    def __repr__(self) -> str:
        return "<no state>"


_NO_STATE: Any = _NoState()


@dataclasses.dataclass(frozen=True)
class Loss:
    """``loss(params, batch, state) -> (loss, state)``: a linen model's loss with its state threaded (`make_loss_fn`).

    Attributes:
      model: the linen ``nn.Module``.
      criterion: ``criterion(apply, batch) -> loss``.
      mutable: the collections the model updates in training.
      rng_streams: the RNG streams it needs in training.
      has_state: always True: `autoaccum.build_update` refuses this loss without ``has_state=True``.
    """

    model: Any
    criterion: Callable[[Callable[..., Any], PyTree], Any]
    mutable: tuple[str, ...] = ("batch_stats",)
    rng_streams: tuple[str, ...] = ("dropout",)
    has_state: ClassVar[bool] = True

    def __call__(self, params: PyTree, batch: PyTree, state: PyTree = _NO_STATE) -> tuple[Any, PyTree]:
        """The criterion on ``batch`` with the model's collections and keys from ``state``; ``(loss, state)``.

        Raises:
          TypeError: ``state`` is missing (the update was built without ``has_state=True``).
        """
        if state is _NO_STATE:
            raise TypeError(
                "autoaccum.linen.make_loss_fn(...) takes and returns the model state (loss_fn(params, batch, state) -> "
                "(loss, state)) but was called without one: pass has_state=True to build_update, the state to the "
                "update (state = autoaccum.linen.init_state(variables, key)), and state=state to probe, estimate "
                "and tune."
            )
        rng, *keys = jax.random.split(state[RNG], 1 + len(self.rng_streams))
        collections = {name: state[name] for name in self.mutable}
        updated: dict[str, Any] = {}

        def apply(*args: Any, **kwargs: Any) -> Any:
            variables = {"params": params, **collections, **updated}
            rngs = dict(zip(self.rng_streams, keys, strict=True))
            if not self.mutable:
                return self.model.apply(variables, *args, rngs=rngs, **kwargs)
            out, new = self.model.apply(variables, *args, rngs=rngs, mutable=list(self.mutable), **kwargs)
            updated.update(new)
            return out

        loss = self.criterion(apply, batch)
        return loss, {**collections, **updated, RNG: rng}


__all__ = ["RNG", "Loss", "init_state", "make_loss_fn"]

__getattr__ = moved_names(__name__, {"loss_fn": ("autoaccum.linen.make_loss_fn", make_loss_fn)})  # the old name
