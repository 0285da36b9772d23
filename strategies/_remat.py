"""Rematerialisation: a ``jax.checkpoint`` policy around each microbatch's loss, chosen by name.

A policy decides which of the forward pass's intermediate values the backward pass keeps and which it
recomputes. Applied to the whole loss of a microbatch, it can lower the step's peak only where XLA would keep
values the backward pass can recompute cheaply; the tuner searches only the policies measured to do so
(``benchmarks/README.md``). Per-layer rematerialisation needs the model's cooperation (``nnx.remat``,
``nn.remat``): declare it as a knob of your own (`autoaccum.Knobs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _offload_dots() -> Callable[..., bool]:
    return jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")


_POLICIES: dict[str, Callable[[], Callable[..., Any]]] = {
    "nothing_saveable": lambda: jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": lambda: jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": lambda: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dot_with_no_batch_dims": _offload_dots,
}

REMAT_POLICIES: tuple[str, ...] = tuple(_POLICIES)
"""The names ``remat`` takes (besides ``None``, off), after ``jax.checkpoint_policies``:

* ``"nothing_saveable"``: keep only the loss's inputs, recompute the whole forward pass in the backward pass;
* ``"dots_saveable"``: keep the results of matrix products, recompute the rest (elementwise work);
* ``"dots_with_no_batch_dims_saveable"``: keep only products without batch dimensions;
* ``"offload_dot_with_no_batch_dims"``: as the last, but move the kept products to the host's pinned memory
  (``memory_kind="pinned_host"``) and back; only on devices that have such a memory.
"""

OFFLOADING: frozenset[str] = frozenset({"offload_dot_with_no_batch_dims"})
"""The policies that move values to the host's memory (they save device memory only off the CPU)."""


def host_offload_supported(device: Any = None) -> bool:
    """Whether ``device`` (default: the first) has a pinned host memory that a policy may offload to."""
    device = jax.devices()[0] if device is None else device
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False


def check_remat(remat: Any) -> None:
    """Raises ``ValueError`` naming ``remat``, its value and the valid names, unless it is one of them or None.

    Example:
      >>> check_remat("dots_saveable")
      >>> check_remat("dots")
      Traceback (most recent call last):
      ...
      ValueError: unknown `remat` 'dots'; choose None (off) or one of 'nothing_saveable', 'dots_saveable', \
'dots_with_no_batch_dims_saveable', 'offload_dot_with_no_batch_dims' (named after jax.checkpoint_policies).
    """
    if remat is None:
        return
    if not isinstance(remat, str) or remat not in _POLICIES:
        names = ", ".join(map(repr, REMAT_POLICIES))
        raise ValueError(
            f"unknown `remat` {remat!r}; choose None (off) or one of {names} (named after jax.checkpoint_policies)."
        )
    if remat in OFFLOADING and not host_offload_supported():
        raise ValueError(
            f"`remat`={remat!r} offloads to the host's pinned memory, which {jax.devices()[0].device_kind} does "
            "not have; choose a policy that does not offload, e.g. 'dots_with_no_batch_dims_saveable'."
        )


def rematerialised(fn: Callable[..., Any], remat: str | None) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with the policy named ``remat`` (``fn`` itself when ``remat`` is None)."""
    if remat is None:
        return fn
    check_remat(remat)
    return jax.checkpoint(fn, policy=_POLICIES[remat]())
