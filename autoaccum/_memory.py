"""Compile-only memory analysis of an update step: what XLA says a step needs, with nothing executed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax

from autoaccum._batch import abstract, abstract_batch
from autoaccum._update import Update
from autoaccum.strategies import Program, PyTree, tree_bytes


class StepMemory(NamedTuple):
    """XLA's figures for one update call: the peak over its programs (`live_bytes` plus what stays resident outside
    the program), FLOPs and bytes accessed summed, and what the runtime needs beyond XLA's accounting."""

    peak_bytes: int
    flops: float
    bytes_accessed: float
    runtime_bytes: int = 0


def live_bytes(analysis: Any) -> int:
    """The one formula for what a compiled program needs (XLA's ``memory_analysis()``): arguments + outputs +
    temporaries - aliased (donated) bytes."""
    m = analysis
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def analyse(
    programs: Sequence[Program], compiler_options: Mapping[str, Any] | None = None
) -> tuple[StepMemory, list[jax.stages.Compiled]]:
    """Compiles ``programs`` (one update call's, `Update.programs`) and combines XLA's figures; runs nothing."""
    compiled = [program.lowered.compile(compiler_options=dict(compiler_options or {}) or None) for program in programs]
    if not compiled:
        raise ValueError("`programs` is empty: nothing to analyse.")
    peak, flops, accessed = 0, 0.0, 0.0
    for c, program in zip(compiled, programs, strict=True):
        m = c.memory_analysis()
        if m is None:
            raise RuntimeError(f"XLA gives no memory analysis on {jax.devices()[0].platform}; cannot predict memory.")
        peak = max(peak, live_bytes(m) + program.resident_bytes)
        cost = c.cost_analysis() or {}
        if isinstance(cost, list):  # older jax returns one dict per computation
            cost = cost[0] if cost else {}
        flops += float(cost.get("flops", 0.0))
        accessed += float(cost.get("bytes accessed", 0.0))
    return StepMemory(peak, flops, accessed), compiled


def step_memory(
    update: Update, params: PyTree, batch: PyTree, batch_size: int, compiler_options: Mapping[str, Any] | None = None
) -> StepMemory:
    """Compiles (never runs) ``update`` for a batch of ``batch_size`` examples shaped like ``batch``.

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> u = autoaccum.build_update(lambda w, b: jnp.mean(b @ w), optax.sgd(0.1), microbatch_size=8)
      >>> step_memory(u, jnp.ones(4), jnp.ones((8, 4)), 8).peak_bytes > 0
      True
    """
    params_s = abstract(params)
    opt_state_s = jax.eval_shape(update.init, params_s)
    return analyse(update.programs(params_s, opt_state_s, abstract_batch(batch, batch_size)), compiler_options)[0]


def state_bytes(update: Update, params: PyTree) -> int:
    """Bytes of ``params`` plus the optimizer state ``update.init`` makes for them (abstract; allocates nothing)."""
    params_s = abstract(params)
    return tree_bytes(params_s) + tree_bytes(jax.eval_shape(update.init, params_s))
