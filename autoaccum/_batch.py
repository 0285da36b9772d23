"""Batches and their shapes: abstract copies (nothing allocated) and the one way a batch is resized."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autoaccum.strategies import PyTree, leading_size


def abstract(tree: PyTree) -> PyTree:
    """``jax.ShapeDtypeStruct`` of every leaf (nothing is copied or allocated).

    Example:
      >>> abstract({"w": jnp.ones((2, 3))})["w"]
      ShapeDtypeStruct(shape=(2, 3), dtype=float32)
    """
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def abstract_batch(batch: PyTree, size: int) -> PyTree:
    """``jax.ShapeDtypeStruct`` of ``batch`` resized to ``size`` examples."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *jnp.shape(x)[1:]), x.dtype), batch)


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


def host_copy(tree: PyTree) -> Any:
    """Copies of ``tree``'s leaves in host memory (numpy), so the caller's arrays are never donated or changed."""
    import numpy as np

    return jax.tree.map(lambda x: np.array(x, copy=True), tree)
