"""Helpers the test modules share: a full-batch reference step, tree comparison, compile counting, and a
deterministic stand-in for the tuner's timing (``measure=``, see `seams`)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autoaccum import Update
from autoaccum._worker import Timing, TrialFailed, recorded


@functools.partial(jax.jit, static_argnums=(0, 1))  # one program, not op by op
def full_batch_step(loss_fn: Any, optimizer: Any, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
    """One optimizer step on the whole batch, without accumulation: the reference every strategy must equal."""
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def assert_trees_close(actual: Any, expected: Any, atol: float, rtol: float = 0.0) -> None:
    """Same structure, and every leaf within ``atol + rtol * |expected|`` (compared in float64, or complex128)."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        wide = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(e) else np.float64
        np.testing.assert_allclose(np.asarray(a, wide), np.asarray(e, wide), atol=atol, rtol=rtol)


def copy(tree: Any) -> Any:
    """Fresh arrays for ``tree`` (an update donates its inputs)."""
    return jax.tree.map(jnp.array, tree)


def count_backend_compiles() -> contextlib.AbstractContextManager[list[float]]:
    """Every XLA backend compilation while the block runs (the seconds of `jax.monitoring`'s compile events)."""
    return recorded("/jax/core/compile/backend_compile_duration")


def fake_measure(calls: list[tuple[int, str, tuple[Any, ...]]] | None = None, fail_from: int | None = None) -> Any:
    """A deterministic stand-in for timing: cost = per-microbatch overhead + per-example work by strategy."""
    per_example = {"scan": 1.0, "loop": 1.1, "multisteps": 1.3}

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m, name = update.microbatch_size, update.strategy
        if calls is not None:
            calls.append((m, name, tuple(sorted(update.options.items()))))
        if fail_from is not None and m >= fail_from:
            raise TrialFailed(f"out of memory: RESOURCE_EXHAUSTED (fake) at microbatch {m}")
        steps = update.accumulation_steps(jax.tree.leaves(batch)[0].shape[0])
        unroll = update.options.get("unroll", 1)
        seconds = steps * (0.004 / unroll + 0.001 * (m - 6) ** 2) + 0.01 * per_example[name]
        return Timing(seconds_per_step=seconds, compile_seconds=0.5, steps=5)

    return measure


def constant_measure(calls: list[tuple[int, str]]) -> Any:
    """A stand-in for timing whose step time grows as the square root of the microbatch; records each call."""

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append((update.microbatch_size, update.strategy))
        return Timing(seconds_per_step=0.01 * update.microbatch_size**0.5, compile_seconds=0.1, steps=5)

    return measure


def linear_problem(batch_size: int = 12) -> tuple[Any, Any]:
    """Parameters and a batch of ``batch_size`` examples for a linear regression on 4 features."""
    params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
    batch = {"x": jnp.ones((batch_size, 4)), "y": jnp.ones(batch_size)}
    return params, batch


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, registered in ``sys.modules`` (its dataclasses need it)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_autoaccum_benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
