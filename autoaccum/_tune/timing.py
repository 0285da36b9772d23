"""How the tuner measures one configuration: real update steps, compile and warm-up excluded."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from autoaccum._trial import is_oom
from autoaccum._update import Update
from autoaccum.strategies import PyTree


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long one configuration's update took.

    Attributes:
      seconds_per_step: the median over the timed steps (compile and warm-up excluded).
      compile_seconds: the first call (tracing, compiling and one step).
      steps: timed steps.
      times: each timed step's seconds (empty when only the median is known).
      peak_bytes: the trial's measured peak memory (per device), when measured (`autoaccum._tune.worker`).
    """

    seconds_per_step: float
    compile_seconds: float
    steps: int
    times: tuple[float, ...] = ()
    peak_bytes: int | None = None


class TrialFailed(Exception):
    """A configuration could not be measured (out of memory, over its time budget); the study goes on."""


def time_update(
    update: Update,
    params: PyTree,
    batch: PyTree,
    *,
    steps: int = 5,
    warmup: int = 1,
    state: PyTree | None = None,
    time_limit: float | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Times ``update`` on ``batch``: one compiling call, ``warmup`` calls, then ``steps`` timed calls.

    Works on copies of ``params`` and ``state`` (the update donates its inputs); ``state`` is given exactly
    when the update was built with ``has_state``. Each timed call ends with ``jax.block_until_ready`` on
    everything it returns.

    Raises:
      TrialFailed: XLA ran out of memory, or the calls so far exceeded ``time_limit`` seconds.
    """
    params = jax.tree.map(jnp.array, params)
    carry = () if state is None else (jax.tree.map(jnp.array, state),)

    def call(params: PyTree, opt_state: PyTree) -> tuple[PyTree, PyTree]:
        nonlocal carry
        params, opt_state, _, *carry = jax.block_until_ready(update(params, opt_state, batch, *carry))
        return params, opt_state

    try:
        opt_state = update.init(params)
        start = timer()
        params, opt_state = call(params, opt_state)
        compile_seconds = timer() - start
        times = []
        for i in range(warmup + steps):
            if time_limit is not None and timer() - start > time_limit:
                raise TrialFailed(f"timed out: over {time_limit:g} s after {i} of {warmup + steps} steps")
            t = timer()
            params, opt_state = call(params, opt_state)
            if i >= warmup:
                times.append(timer() - t)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if is_oom(e):  # the probe's rules: XLA's RESOURCE_EXHAUSTED, the CPU's allocation failures
            raise TrialFailed(f"out of memory: {(str(e) or type(e).__name__).splitlines()[0][:300]}") from e
        raise
    return Timing(statistics.median(times), compile_seconds, steps, tuple(times))
