"""Compile-only memory analysis of an update step: what XLA says a step needs, with nothing executed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from autoaccum._batch import abstract, abstract_batch
from autoaccum._update import Update
from autoaccum.strategies import Program, PyTree, tree_bytes


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's compile-time accounting of one update call at one batch size.

    Attributes:
      batch_size: examples in the call's batch.
      peak_bytes: predicted device bytes live at the worst moment: over the call's programs, the largest of
        arguments + outputs + temporaries - aliased (donated) bytes + bytes resident outside the program.
      argument_bytes, output_bytes, temp_bytes, alias_bytes: those figures for the program that peaks.
      flops, bytes_accessed: XLA's cost analysis summed over the call's programs (for roofline estimates).
    """

    batch_size: int
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    flops: float
    bytes_accessed: float


def live_bytes(analysis: Any) -> int:
    """The one formula for what a compiled program needs (XLA's ``memory_analysis()``): arguments + outputs +
    temporaries - aliased (donated) bytes."""
    m = analysis
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def analyse(
    programs: Sequence[Program], batch_size: int = 0, compiler_options: Mapping[str, Any] | None = None
) -> tuple[StepMemory, list[jax.stages.Compiled]]:
    """Compiles ``programs`` (one update call's, see `Update.programs`) and combines XLA's figures.

    The peak is the largest, over the programs, of arguments + outputs + temporaries - aliased bytes plus
    the bytes resident outside the program; FLOPs and bytes accessed are summed. Returns the `StepMemory`
    and the compiled programs (for further inspection); nothing is executed.
    """
    options = dict(compiler_options or {})
    compiled = [program.lowered.compile(compiler_options=options or None) for program in programs]
    best: tuple[int, Any] | None = None
    flops = accessed = 0.0
    for c, program in zip(compiled, programs, strict=True):
        m = c.memory_analysis()
        if m is None:
            raise RuntimeError(f"XLA gives no memory analysis on {jax.devices()[0].platform}; cannot predict memory.")
        live = live_bytes(m) + program.resident_bytes
        if best is None or live > best[0]:
            best = (live, m)
        cost = c.cost_analysis() or {}
        if isinstance(cost, list):  # older jax returns one dict per computation
            cost = cost[0] if cost else {}
        flops += float(cost.get("flops", 0.0))
        accessed += float(cost.get("bytes accessed", 0.0))
    if best is None:
        raise ValueError("`programs` is empty: nothing to analyse.")
    live, m = best
    memory = StepMemory(
        batch_size=batch_size,
        peak_bytes=int(live),
        argument_bytes=int(m.argument_size_in_bytes),
        output_bytes=int(m.output_size_in_bytes),
        temp_bytes=int(m.temp_size_in_bytes),
        alias_bytes=int(m.alias_size_in_bytes),
        flops=flops,
        bytes_accessed=accessed,
    )
    return memory, compiled


def step_memory(
    update: Update, params: PyTree, batch: PyTree, batch_size: int, compiler_options: Mapping[str, Any] | None = None
) -> StepMemory:
    """Compiles (never runs) ``update`` for a batch of ``batch_size`` examples shaped like ``batch``.

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> from autoaccum._memory import step_memory
      >>> u = autoaccum.build_update(lambda w, b: jnp.mean(b @ w), optax.sgd(0.1), microbatch_size=8)
      >>> step_memory(u, jnp.ones(4), jnp.ones((8, 4)), 8).peak_bytes > 0
      True
    """
    params_s = abstract(params)
    opt_state_s = jax.eval_shape(update.init, params_s)
    programs = update.programs(params_s, opt_state_s, abstract_batch(batch, batch_size))
    return analyse(programs, batch_size, compiler_options)[0]


def state_bytes(update: Update, params: PyTree) -> int:
    """Bytes of ``params`` plus the optimizer state ``update.init`` makes for them (abstract; allocates nothing)."""
    params_s = abstract(params)
    return tree_bytes(params_s) + tree_bytes(jax.eval_shape(update.init, params_s))
