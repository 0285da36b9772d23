"""flax linen models through `autoaccum.build_update`'s ``has_state``: mutable collections and dropout keys.

A linen model with BatchNorm is applied with ``mutable=["batch_stats"]`` and returns the new statistics; with
Dropout it needs a fresh ``rngs={"dropout": key}`` for every microbatch of every step. Both are model state:
they must flow through the microbatches in order, microbatch i seeing what microbatch i-1 returned. `loss_fn`
writes that loss for you, and `init_state` makes the state it threads::

    variables = model.init({"params": k1, "dropout": k2}, x, train=False)
    loss_fn = autoaccum.linen.loss_fn(model, lambda apply, b: xent(apply(b["image"], train=True), b["label"]))
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=16, has_state=True)
    state = autoaccum.linen.init_state(variables, jax.random.key(1))
    params, opt_state, loss, state = update(variables["params"], tx.init(variables["params"]), batch, state)

What goes wrong silently without it: dropping the returned ``batch_stats`` leaves the statistics at their
initial values forever; closing over ``batch_stats`` bakes the first value into the jitted step; a dropout key
closed over (or passed unchanged) gives every microbatch and every step the same mask.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from autoaccum.strategies import PyTree

RNG = "rng"
"""The state entry holding the PRNG key that `loss_fn` splits for each microbatch."""


def init_state(variables: Mapping[str, Any], rng: jax.Array, mutable: Sequence[str] = ("batch_stats",)) -> dict:
    """The model state `loss_fn` threads: the ``mutable`` collections of ``variables`` and the key ``rng``.

    Example:
      >>> init_state({"params": {}, "batch_stats": {"mean": 0.0}}, jax.random.key(0))["batch_stats"]
      {'mean': 0.0}
    """
    missing = [name for name in mutable if name not in variables]
    if missing:
        raise ValueError(
            f"`variables` has no collection(s) {missing} (it has {sorted(variables)}); pass the `mutable` "
            "collections your model really has, e.g. mutable=() for a model without BatchNorm."
        )
    return {**{name: variables[name] for name in mutable}, RNG: rng}


def loss_fn(
    model: Any,
    criterion: Callable[[Callable[..., Any], PyTree], Any],
    *,
    mutable: Sequence[str] = ("batch_stats",),
    rng_streams: Sequence[str] = ("dropout",),
) -> Callable[[PyTree, PyTree, PyTree], tuple[Any, PyTree]]:
    """A ``loss_fn(params, batch, state) -> (loss, state)`` for `autoaccum.build_update` (``has_state=True``).

    Args:
      model: the linen ``nn.Module``.
      criterion: ``criterion(apply, batch) -> loss`` (or whatever ``build_update``'s ``has_aux`` and
        ``loss_reduction`` expect); ``apply(*args, **kwargs)`` runs ``model.apply`` with the parameters, the
        ``mutable`` collections of the state (their updates are kept) and a fresh key per ``rng_streams`` entry.
      mutable: the collections the model updates in training (``"batch_stats"`` for BatchNorm).
      rng_streams: the RNG streams it needs in training (``"dropout"``); the state's key is split once per
        microbatch, so each microbatch of each step draws its own randomness.

    Example:
      >>> import flax.linen as nn, jax.numpy as jnp, optax, autoaccum
      >>> model = nn.Dense(1)
      >>> variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
      >>> fn = loss_fn(model, lambda apply, b: jnp.mean(apply(b)), mutable=(), rng_streams=())
      >>> update = autoaccum.build_update(fn, optax.sgd(0.1), microbatch_size=2, has_state=True)
      >>> state = init_state(variables, jax.random.key(1), mutable=())
      >>> params, opt_state, loss, state = update(variables["params"], optax.sgd(0.1).init(variables["params"]),
      ...                                         jnp.ones((4, 3)), state)
    """

    def fn(params: PyTree, batch: PyTree, state: PyTree) -> tuple[Any, PyTree]:
        rng, *keys = jax.random.split(state[RNG], 1 + len(rng_streams))
        collections = {name: state[name] for name in mutable}
        updated: dict[str, Any] = {}

        def apply(*args: Any, **kwargs: Any) -> Any:
            variables = {"params": params, **collections, **updated}
            rngs = dict(zip(rng_streams, keys, strict=True))
            if not mutable:
                return model.apply(variables, *args, rngs=rngs, **kwargs)
            out, new = model.apply(variables, *args, rngs=rngs, mutable=list(mutable), **kwargs)
            updated.update(new)
            return out

        loss = criterion(apply, batch)
        return loss, {**collections, **updated, RNG: rng}

    return fn


__all__ = ["RNG", "init_state", "loss_fn"]
