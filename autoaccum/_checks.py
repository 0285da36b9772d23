"""Argument checks shared by every entry point: each error names the argument, its value and the fix."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np


def check_positive_int(value: Any, name: str) -> int:
    """``value`` as an int if it is one and >= 1, else an error naming the argument ``name``.

    Example:
      >>> check_positive_int(3, "microbatch_size")
      3
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`{name}` must be an int >= 1, got {type(value).__name__} {value!r}.")
    if value < 1:
        raise ValueError(f"`{name}` must be >= 1, got {name}={value}.")
    return int(value)


def check_loss_fn(loss_fn: Any, takes: Sequence[str] = (), name: str = "loss_fn") -> None:
    """Raises ``TypeError`` unless ``loss_fn`` is callable, and (where its signature can be read) takes the
    positional arguments ``takes`` names (``("params", "batch")``, say); the message calls it ``name``.

    Example:
      >>> try:
      ...     check_loss_fn(lambda model: 0.0, ("model", "batch"))
      ... except TypeError as e:
      ...     print(str(e)[:63])
      `loss_fn` must take 2 arguments, loss_fn(model, batch), but its
    """
    if not callable(loss_fn):
        raise TypeError(f"`{name}` must be callable, got {type(loss_fn).__name__}: {loss_fn!r}.")
    if not takes:
        return
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # (a builtin, say: its call will tell)
        return
    try:
        signature.bind(*takes)
    except TypeError as e:
        raise TypeError(
            f"`{name}` must take {len(takes)} arguments, {name}({', '.join(takes)}), but its signature is "
            f"{signature} ({e}){_fix_for(signature, takes) if name == 'loss_fn' else ''}."
        ) from None


def _fix_for(signature: inspect.Signature, takes: Sequence[str]) -> str:
    """What a loss of ``signature`` that does not take ``takes`` wants instead: ``has_state`` set the other way,
    or autoaccum's nnx functions."""
    if takes[0] != "params":
        return ""
    if len(takes) == 2 and _binds(signature, 3):
        return (" (for loss_fn(params, batch, state) -> (loss, new_state), pass has_state=True; to tune or probe, "
                "state=the initial state)")  # fmt: skip
    no_state = "for loss_fn(params, batch), has_state=False (to tune or probe: no `state`); " * (
        len(takes) == 3 and _binds(signature, 2)
    )
    return (
        f" ({no_state}an nnx model's loss_fn(model, batch) goes to autoaccum.nnx.build_update(loss_fn, plan=...) or "
        "its other functions)"
    )


def _binds(signature: inspect.Signature, arity: int) -> bool:
    try:
        signature.bind(*range(arity))
    except TypeError:
        return False
    return True


def check_optimizer(optimizer: Any, name: str = "optimizer") -> None:
    """Raises ``TypeError`` unless ``optimizer`` is an optax ``GradientTransformation``.

    ``None`` is refused too: how much memory a step needs depends on the optimizer's state (AdamW keeps two
    copies of the parameters, SGD none), so no memory answer is given for a guessed optimizer.
    """
    if optimizer is None:
        raise TypeError(
            f"`{name}` is required: the memory an update step needs depends on the optimizer's state (AdamW "
            "keeps 2 copies of the parameters, SGD none); pass the one training uses, e.g. optax.adamw(1e-3)."
        )
    if type(optimizer).__module__.startswith("flax.nnx"):
        raise TypeError(
            f"`{name}` is a {type(optimizer).__name__} from flax.nnx, but this function takes an optax optimizer "
            "(e.g. optax.adamw(1e-3)); for nnx models use the `autoaccum.nnx` entry points instead."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"`{name}` must be an optax.GradientTransformation (with init and update), got "
            f"{type(optimizer).__name__}; e.g. optax.adamw(1e-3)."
        )


def check_bool(value: Any, name: str) -> bool:
    """``value`` if it is a bool, else a ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False, got {type(value).__name__} {value!r}.")
    return value


def floating_dtype(value: Any) -> np.dtype | None:
    """``value`` as a floating numpy dtype (``jnp.bfloat16``, ``"float32"``, ...), or None if it is not one."""
    try:
        dtype = np.dtype(value)
    except TypeError:
        return None
    import jax.numpy as jnp  # its issubdtype knows ml_dtypes' floats (bfloat16), numpy's does not

    return dtype if jnp.issubdtype(dtype, jnp.floating) else None


def check_accumulator_dtype(value: Any) -> np.dtype:
    """``value`` as the floating dtype gradients accumulate in: TypeError naming it if it is not one, ValueError for
    a 64-bit one while JAX runs without 64-bit types (it would accumulate in 32 bits, warning at every sum)."""
    dtype = floating_dtype(value)
    if dtype is None:
        raise TypeError(f"`accumulator_dtype` must be a floating dtype such as jnp.float32, got {value!r}.")
    import jax

    if dtype.itemsize > 4 and not jax.config.read("jax_enable_x64"):
        raise ValueError(
            f"`accumulator_dtype`={value!r} is 64-bit, but JAX runs without 64-bit types and would accumulate in "
            "float32; call jax.config.update('jax_enable_x64', True) before making any array, or use jnp.float32."
        )
    return dtype
