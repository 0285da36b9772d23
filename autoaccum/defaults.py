"""Defaults shared by the probe and the tuner."""

from __future__ import annotations

import optax

DEFAULT_MAX_SIZE = 16384
"""The largest microbatch a probe tries when the caller gives no ``max_size``."""

CPU_MEMORY_FRACTION = 0.5
"""With no ``memory_limit`` on the CPU, a trial may use this fraction of the RAM available now."""


def default_optimizer() -> optax.GradientTransformation:
    """The optimizer used when none is given: ``optax.adamw(1e-3)`` (its state is 2x the parameters).

    Example:
      >>> import jax.numpy as jnp
      >>> state = default_optimizer().init(jnp.ones(3))
    """
    return optax.adamw(1e-3)
