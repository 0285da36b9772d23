"""Small pure-JAX problems for the probe tests (no flax: a trial's child imports this module, so keep it light)."""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autoaccum import Workload

FEATURES = 4096  # 16 KiB of float32 input per example: a 100 MiB cap bounds the microbatch near 6400


def linear_loss(params: Any, batch: Any) -> jax.Array:
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def linear(features: int = FEATURES, rows: int = 4) -> tuple[Any, Any, Any]:
    """``(loss_fn, params, batch)`` of a linear regression with ``features`` inputs."""
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(rows,)), jnp.float32),
    }
    params = {"w": jnp.zeros((features,)), "b": jnp.zeros(())}
    return linear_loss, params, batch


def mlp_loss(params: Any, batch: Any) -> jax.Array:
    hidden = jax.nn.gelu(batch["x"] @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(hidden @ params["w2"], batch["y"]).mean()


def mlp(features: int = 256, hidden: int = 512) -> tuple[Any, Any, Any]:
    """``(loss_fn, params, batch)`` of a two-layer classifier: its backward pass runs dots of transposed operands
    (on XLA:CPU the first such step in a process maps its kernels' code, about 8 MiB)."""
    params = {"w1": jnp.zeros((features, hidden)), "w2": jnp.zeros((hidden, 10))}
    return mlp_loss, params, {"x": jnp.ones((4, features)), "y": jnp.zeros(4, jnp.int32)}


def abort_past_64(params: Any, batch: Any) -> jax.Array:
    """Kills its process (SIGABRT, no allocation failure) when traced for more than 64 examples."""
    if batch["x"].shape[0] > 64:
        os.abort()
    return linear_loss(params, batch)


def raise_past_64(params: Any, batch: Any) -> jax.Array:
    if batch["x"].shape[0] > 64:
        raise ValueError("this loss refuses batches above 64 examples")
    return linear_loss(params, batch)


def workload() -> Workload:
    """The CLI's test workload (``probe_workloads:workload``)."""
    loss_fn, params, batch = linear()
    return Workload(loss_fn, params, batch, optax.sgd(1e-2), name="linear-4096")


def not_a_workload() -> int:
    return 3


def hang_past_64(params: Any, batch: Any) -> jax.Array:
    """Never returns when traced for more than 64 examples (a hung trial)."""
    if batch["x"].shape[0] > 64:
        import time

        while True:
            time.sleep(1)
    return linear_loss(params, batch)


def keyed_loss(params: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
    """A dropout-like loss with a typed PRNG key in the state and one per example in the batch."""
    key, sub = jax.random.split(state["key"])
    noise = jax.vmap(lambda k: jax.random.normal(k, ()))(batch["key"])
    keep = jax.random.bernoulli(sub, 0.9, batch["x"].shape)
    loss = jnp.mean(((batch["x"] * keep) @ params["w"] + params["b"] + 0.01 * noise - batch["y"]) ** 2)
    return loss, {"key": key, "count": state["count"] + 1}


def make_scaled_loss(scale: float = 1.0) -> Any:
    """A loss factory with one knob of its own (`knobbed`): ``scale`` times the linear regression's loss."""
    return lambda params, batch: scale * linear_loss(params, batch)


def knobbed() -> Workload:
    """The linear regression declaring a ``scale`` knob: ``autoaccum tune`` searches it."""
    from autoaccum import Knobs

    _, params, batch = linear(rows=8)
    knobs = Knobs(make_scaled_loss, scale=(1.0, 0.5))
    return Workload(make_scaled_loss(), params, batch, optax.sgd(0.1), name="knobbed", knobs=knobs)
