"""How an update moves the model state: once per microbatch (threaded), or its floating leaves once per update.

With ``state_update="per_microbatch"`` (the default) microbatch ``i`` sees the state microbatch ``i - 1``
returned, as if the microbatches were separate steps: a BatchNorm's running statistics then take one EMA step per
microbatch, ``k`` steps per update. With ``state_update="once"`` every microbatch's loss sees the floating leaves
as the update received them, and the update returns, for each floating leaf, the example-weighted mean of what
the microbatches returned: an EMA ``s <- m * s + (1 - m) * x_i`` then moves once per update, by ``(1 - m)``
towards the mean of the microbatches' ``x_i`` (for a running mean, the full batch's mean of the same
activations). The other leaves (PRNG keys, counters) are threaded either way, so each microbatch still draws
fresh randomness. This is the rule the devices of a mesh already follow after the loop (`combine_state`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

PyTree = Any


def is_floating(x: Any) -> bool:
    """Whether a state leaf (array, ``ShapeDtypeStruct`` or Python float) is averaged by ``state_update="once"``."""
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    return bool(jnp.issubdtype(dtype, jnp.floating))


class MeanState(NamedTuple):
    """The state an update with ``state_update="once"`` carries through its microbatches.

    Attributes:
      state: the model state: each floating leaf the example-weighted mean of what the microbatches so far
        returned (what the update received, before the first), the other leaves what the last one returned.
      start: the floating leaves as the update received them, in flattening order: every microbatch's loss sees
        these.
      examples: the examples seen so far (a float32 scalar).
    """

    state: PyTree
    start: tuple[Any, ...]
    examples: jax.Array


def begin(state: PyTree) -> MeanState:
    """The `MeanState` an update starts from (no example seen yet).

    Example:
      >>> carried = begin({"mean": jnp.zeros(2), "steps": jnp.zeros((), jnp.int32)})
      >>> len(carried.start), float(carried.examples)
      (1, 0.0)
    """
    start = tuple(jnp.copy(x) for x in jax.tree.leaves(state) if is_floating(x))
    return MeanState(state, start, jnp.zeros((), jnp.float32))


def given(carried: MeanState) -> PyTree:
    """The state a microbatch's loss sees: floating leaves as the update received them, the rest threaded."""
    leaves, treedef = jax.tree.flatten(carried.state)
    start = iter(carried.start)
    return jax.tree.unflatten(treedef, [next(start) if is_floating(x) else x for x in leaves])


def fold(carried: MeanState, new_state: PyTree, examples: int) -> MeanState:
    """``carried`` after a microbatch of ``examples`` examples whose loss returned ``new_state``: its floating
    leaves join the running example-weighted mean, the other leaves replace the carried ones.

    Example:
      >>> carried = begin({"mean": jnp.zeros(())})
      >>> carried = fold(carried, {"mean": jnp.asarray(1.0)}, 3)
      >>> float(fold(carried, {"mean": jnp.asarray(5.0)}, 1).state["mean"])  # (3 * 1 + 1 * 5) / 4
      2.0
    """
    seen = carried.examples + examples
    weight = examples / seen

    def one(mean: jax.Array, new: jax.Array) -> jax.Array:
        if not is_floating(new):
            return new
        wide = jnp.promote_types(new.dtype, jnp.float32)
        return (mean.astype(wide) + (new.astype(wide) - mean.astype(wide)) * weight.astype(wide)).astype(new.dtype)

    return MeanState(jax.tree.map(one, carried.state, new_state), carried.start, seen)


def end(carried: MeanState) -> PyTree:
    """The state an update with ``state_update="once"`` returns."""
    return carried.state
