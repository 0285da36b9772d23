"""Batches and their shapes: abstract copies (nothing allocated) and the one way a batch is resized."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autoaccum.strategies import PyTree, leading_size


def as_arrays(tree: PyTree) -> PyTree:
    """``tree`` with each nnx ``Variable`` replaced by its value (``nnx.as_pure``): the arrays a functional step takes,
    at the paths they have there."""
    from flax import nnx

    return (getattr(nnx, "as_pure", None) or nnx.pure)(tree)  # (flax < 0.12.7 calls it `pure`)


def _mesh_sharding(x: Any) -> jax.sharding.NamedSharding | None:
    sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


def abstract(tree: PyTree, *, sharded: bool = True) -> PyTree:
    """``jax.ShapeDtypeStruct`` of every leaf (nothing is copied or allocated), a Python number's weakly typed as
    JAX takes it; with ``sharded``, a leaf laid out over a mesh keeps its ``NamedSharding``, so programs lowered
    from it are the mesh's (memory figures per device).

    Example:
      >>> abstract({"w": jnp.ones((2, 3)), "b": 0.5})["b"]
      ShapeDtypeStruct(shape=(), dtype=float32, weak_type=True)
      >>> abstract(True).weak_type, abstract(np.float64(1.0)).weak_type  # (strongly typed, as JAX takes them)
      (False, False)
    """
    return jax.tree.map(lambda x: _struct(x, jnp.shape(x), sharded), tree)


def abstract_batch(batch: PyTree, size: int) -> PyTree:
    """``jax.ShapeDtypeStruct`` of ``batch`` resized to ``size`` examples (a mesh's sharding kept)."""
    return jax.tree.map(lambda x: _struct(x, (size, *jnp.shape(x)[1:]), True), batch)


def _struct(x: Any, shape: tuple[int, ...], sharded: bool) -> jax.ShapeDtypeStruct:
    number = type(x) in (int, float, complex)  # (Python's own: weakly typed; a bool or a NumPy scalar is not)
    dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
    weak = number or bool(getattr(x, "weak_type", False))  # (an abstract or a JAX array's own, kept)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=_mesh_sharding(x) if sharded else None, weak_type=weak)


def resize_batch(batch: PyTree, size: int) -> PyTree:
    """A batch of ``size`` examples made from ``batch`` by repeating its rows cyclically.

    The one way autoaccum grows (or cuts) an example batch to a trial's or an effective batch's size; it can
    be jitted (``size`` static) so that a trial compiles it before anything of its size exists. ``batch``
    itself is not changed.

    Example:
      >>> import numpy as np
      >>> resize_batch({"x": np.arange(3)}, 5)["x"].tolist()
      [0, 1, 2, 0, 1]
    """
    index = jnp.arange(size) % leading_size(batch)
    return jax.tree.map(lambda x: jnp.take(x, index, axis=0), batch)


@dataclasses.dataclass(frozen=True)
class HostKey:
    """A typed PRNG key array (``jax.random.key``) in host memory: its key data and its implementation."""

    data: np.ndarray
    impl: str


def host_copy(tree: PyTree) -> Any:
    """Copies of ``tree``'s leaves in host memory (numpy; typed PRNG keys as `HostKey`), so that the caller's
    arrays are never donated or changed and the copy pickles. `device_copy` is the inverse.

    Example:
      >>> tree = host_copy({"x": jnp.ones(2), "key": jax.random.key(0)})
      >>> type(tree["x"]).__name__, type(tree["key"]).__name__
      ('ndarray', 'HostKey')
    """

    def copy(x: Any) -> Any:
        if jnp.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.prng_key):
            return HostKey(np.array(jax.random.key_data(x), copy=True), str(jax.random.key_impl(x)))
        return np.array(x, copy=True)

    return jax.tree.map(copy, tree)


def device_copy(tree: PyTree) -> PyTree:
    """`host_copy`'s inverse: jax arrays, typed PRNG keys rebuilt from their `HostKey`."""

    def put(x: Any) -> Any:
        if isinstance(x, HostKey):
            return jax.random.wrap_key_data(jnp.asarray(x.data), impl=x.impl)
        return jnp.asarray(x)

    return jax.tree.map(put, tree, is_leaf=lambda x: isinstance(x, HostKey))
