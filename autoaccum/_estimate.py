"""Capacity planning from compilation alone: the memory an update step needs at each microbatch size.

`estimate` lowers the update step with ``jax.ShapeDtypeStruct`` arguments and asks XLA what the compiled program
needs (`live_bytes`) at a few sizes; nothing is run or allocated. The points are joined
piecewise-linearly (one-microbatch steps: ``fixed + per_example * m``); an accumulating step of ``B`` examples adds
``accumulation_bytes + per_batch_example_bytes * B``. On the CPU a prediction for this machine adds what XLA's CPU
runtime allocates outside its accounting (`autoaccum._cpu_runtime`). Step times are roofline estimates
(`autoaccum._step_time`).

Example:
  >>> import autoaccum
  >>> from autoaccum import workloads
  >>> w = workloads.mlp()
  >>> est = autoaccum.estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="32MiB")
  >>> est.bytes_at(est.max_microbatch) <= est.memory_limit_bytes < est.bytes_at(est.max_microbatch + 1)
  True
  >>> est.capacity(1024, "A100-40GB").accumulation_steps
  1
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from autoaccum._batch import abstract, abstract_batch
from autoaccum._capacity import Capacity, StepCost, Target, capacity, fit_cost
from autoaccum._catalog import DEFAULT_SAFETY_MARGIN, Accelerator, usable_bytes
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum._cpu_runtime import CPU_RUNTIME_BYTES, runtime_bytes
from autoaccum._deprecated import renamed
from autoaccum._json import JsonMixin
from autoaccum._units import parse_bytes
from autoaccum._update import Update, build_update, resolve_strategy
from autoaccum.strategies import Program, PyTree, check_params, layout_of, leading_size, tree_bytes
from autoaccum.strategies._layout import check_effective_batch

DEFAULT_MAX_MICROBATCH = 16384
"""The largest microbatch the estimate and the probe consider when the caller gives no ``microbatch_cap``."""

COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""Options for the analysis compilations: no LLVM optimisation; buffer assignment and costs are unchanged."""

CPU_SINGLE_STEP_OPTIONS: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}
"""On the CPU, one-microbatch steps also compile with XLA's older loop emitter (faster; the same figures to within
0.5%: tests/test_estimate.py); accumulating steps keep the default, for which it skips a copy of the batch."""

FIRST_SIZE = 32
"""The microbatch size measured first (``microbatch_cap`` when smaller)."""

NEAR = 0.1
"""A predicted answer within this fraction of a compiled size is not compiled again."""


class Point(NamedTuple):
    """One compile-only measurement of an update step.

    Attributes:
      microbatch_size: examples per microbatch.
      batch_size: examples in the step's batch (``== microbatch_size`` for a step on one microbatch).
      peak_bytes: XLA's predicted peak, the largest over the step's programs.
      flops, bytes_accessed: XLA's cost analysis of the step's programs.
      runtime_bytes: what the platform's runtime needs beyond XLA's accounting (`runtime_bytes`; 0 off the CPU).
    """

    microbatch_size: int
    batch_size: int
    peak_bytes: int
    flops: float
    bytes_accessed: float
    runtime_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """``peak_bytes + runtime_bytes``: what the model predicts for this size."""
        return self.peak_bytes + self.runtime_bytes


@dataclasses.dataclass(frozen=True)
class Estimate(JsonMixin):
    """The predicted memory and cost of an update step as a function of the microbatch size (made by `estimate`).

    Attributes:
      strategy: the accumulation strategy measured, and ``options`` its options.
      memory_limit_bytes: the memory limit ``max_microbatch`` answers for.
      points: every measurement, one-microbatch steps (``batch_size == microbatch_size``) and accumulating ones.
      accumulation_bytes: extra fixed bytes of an accumulating step (the accumulator, the loop's carry).
      per_batch_example_bytes: extra bytes per example of the whole batch in an accumulating step.
      remainder_bytes_per_example: extra bytes per example of an uneven split's smaller last microbatch.
      accumulation_runtime_bytes_per_example: the runtime's extra bytes in an accumulating step beyond a
        one-microbatch step's, per microbatch example (the three above are XLA's figures alone).
      cost: XLA's cost analysis fitted per example, for roofline step times (`StepCost`).
      microbatch_cap: microbatch sizes considered are at most this.
      platform: the backend the step was compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).
      seconds: how long the estimate took.
      shards: the pieces a mesh's batch is sharded into (sizes are global multiples of it, bytes per device); 1.
      compiler: ``"XLA:GPU sm_90 (compile-only)"``, ``"XLA:CPU (proxy)"`` for a target planned from the CPU
        compiler's figures, or ``""`` (this machine's compiler) without a target.
      target: the catalogued accelerator given as ``target`` (``None`` without one).
      calibration_bytes: added to every prediction on this device (`calibrate`); 0 as compiled.
    """

    strategy: str
    options: dict[str, Any]
    memory_limit_bytes: int
    points: tuple[Point, ...]
    accumulation_bytes: float | None
    per_batch_example_bytes: float | None
    remainder_bytes_per_example: float | None
    cost: StepCost
    microbatch_cap: int
    platform: str
    seconds: float
    accumulation_runtime_bytes_per_example: float = 0.0
    shards: int = 1
    compiler: str = ""
    target: str | None = None
    calibration_bytes: float = 0.0

    json_format = "autoaccum.estimate/1"
    json_properties = ("fixed_bytes", "per_example_bytes", "max_microbatch")

    @property
    def single_points(self) -> tuple[Point, ...]:
        """The one-microbatch measurements, one per size, by size."""
        seen: dict[int, Point] = {}
        for p in self.points:
            if p.batch_size == p.microbatch_size:
                seen.setdefault(p.microbatch_size, p)
        return tuple(seen[k] for k in sorted(seen))

    def _segment(self, m: float, runtime: bool = True) -> tuple[float, float]:
        """``(fixed, per_example)`` of the affine piece that models one-microbatch steps of ``m`` examples."""
        pts = self.single_points
        i = int(np.searchsorted([p.microbatch_size for p in pts], m))
        a, b = pts[min(max(i - 1, 0), len(pts) - 2)], pts[min(max(i, 1), len(pts) - 1)]
        c = self.calibration_bytes
        ya, yb = (a.total_bytes + c, b.total_bytes + c) if runtime else (a.peak_bytes, b.peak_bytes)
        slope = max((yb - ya) / (b.microbatch_size - a.microbatch_size), 1.0)
        return ya - slope * a.microbatch_size, slope

    @property
    def fixed_bytes(self) -> float:
        """Bytes of a one-microbatch step that do not grow with its size (the local fit at `max_microbatch`)."""
        return self._segment(max(self.max_microbatch, 1))[0]

    @property
    def per_example_bytes(self) -> float:
        """Bytes per example of a one-microbatch step (the local fit at `max_microbatch`)."""
        return self._segment(max(self.max_microbatch, 1))[1]

    def bytes_at(self, microbatch_size: int, batch_size: int | None = None, *, runtime: bool = True) -> int:
        """Predicted peak bytes of the full update step at ``microbatch_size`` examples per microbatch.

        Args:
          microbatch_size: examples per microbatch.
          batch_size: examples per update, accumulated over ``ceil(batch_size / microbatch_size)`` microbatches;
            ``None``: one microbatch.
          runtime: include what this platform's runtime needs beyond XLA's accounting (the CPU's) and the
            calibration; ``False`` gives XLA's figure alone, as for planning a GPU or TPU from a CPU.

        Raises:
          ValueError: an accumulating step was asked of an estimate made with ``accumulation=False``.

        Example:
          >>> from autoaccum import workloads
          >>> w = workloads.linear()
          >>> est = estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="64MiB")
          >>> est.bytes_at(64, 256) > est.bytes_at(64)
          True
        """
        m = check_positive_int(microbatch_size, "microbatch_size")
        total = m if batch_size is None else check_positive_int(batch_size, "batch_size")
        m = min(m, total)
        fixed, slope = self._segment(m, runtime)
        peak = fixed + slope * m
        if total > m:
            if self.accumulation_bytes is None or self.per_batch_example_bytes is None:
                raise ValueError(
                    f"`batch_size`={total} > `microbatch_size`={m} needs the accumulating step's measurements; make "
                    "the estimate with accumulation=True (the default)."
                )
            peak += self.accumulation_bytes + self.per_batch_example_bytes * total
            peak += (self.remainder_bytes_per_example or 0.0) * (total % m)
            if runtime:
                peak += self.accumulation_runtime_bytes_per_example * m
        return math.ceil(peak)

    def calibrate(
        self, microbatch_size: int, peak_bytes: int, *, measured: Estimate | None = None, batch_size: int | None = None
    ) -> Estimate:
        """This estimate plus what a step measured on this device showed the compile-only figures miss: ``peak_bytes``
        at ``microbatch_size`` (over ``batch_size`` examples; None: one microbatch) of ``measured``'s step (default
        this one's; another setting's estimate borrows the probed one's measurement). The difference is taken not to
        grow with the step.

        Example:
          >>> from autoaccum import workloads
          >>> w = workloads.linear()
          >>> est = estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="64MiB")
          >>> est.calibrate(16, est.bytes_at(16) + 2**20).bytes_at(64) - est.bytes_at(64)
          1048576
        """
        missed = peak_bytes - (self if measured is None else measured).bytes_at(microbatch_size, batch_size)
        return dataclasses.replace(self, calibration_bytes=self.calibration_bytes + missed)

    def largest_microbatch(
        self, memory_limit: int | str, batch_size: int | None = None, *, runtime: bool = True
    ) -> int:
        """The largest microbatch predicted to fit in ``memory_limit`` (bytes or ``"16GiB"``; 0 if none), with
        ``batch_size`` examples per update (at most it; ``None``: one microbatch, at most `microbatch_cap`).
        ``runtime``: as for `bytes_at`."""
        limit = parse_bytes(memory_limit)
        if batch_size is not None and self.bytes_at(batch_size, batch_size, runtime=runtime) <= limit:
            return batch_size  # the whole batch in one step
        g = self.shards  # sizes are multiples of it: bisect over units of g examples
        hi = (self.microbatch_cap if batch_size is None else batch_size - 1) // g

        def fits(units: int, remainder: bool = True) -> bool:
            m = units * g
            peak: float = self.bytes_at(m, batch_size, runtime=runtime)
            if batch_size is not None and not remainder:
                peak -= (self.remainder_bytes_per_example or 0.0) * (batch_size % m)
            return peak <= limit

        if hi < 1 or not fits(1):
            return 0
        # The largest fit leaving out the remainder (the model is increasing in m), by bisection.
        lo = bisect.bisect_right(range(1, hi + 1), False, key=lambda u: not fits(u, remainder=False))
        while not fits(lo):  # an uneven split costs its last microbatch's extra: step down to one that fits
            lo -= 1  # stops at a divisor of batch_size at the latest (no remainder)
        return lo * g

    @property
    def max_microbatch(self) -> int:
        """The largest microbatch whose one-microbatch step is predicted to fit in `memory_limit_bytes`."""
        return self.largest_microbatch(self.memory_limit_bytes)

    def accumulation_steps(self, effective_batch: int) -> int:
        """Microbatches per update for ``effective_batch`` examples under `memory_limit_bytes` (0: none fits).

        Example:
          >>> from autoaccum import workloads
          >>> w = workloads.cnn()
          >>> est = estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="64MiB")
          >>> est.accumulation_steps(1024) > 1
          True
        """
        return self.capacity(effective_batch).accumulation_steps

    def capacity(
        self,
        effective_batch: int,
        target: Target | Accelerator | str | int | None = None,
        *,
        mem_fraction: float | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
    ) -> Capacity:
        """The microbatch, accumulation steps, peak and step time for ``effective_batch`` (>= 1) on ``target``: a
        `Target`, a catalogued accelerator or its name (``"A100-40GB"``: XLA's figure alone), a memory limit on this
        machine's platform (bytes or ``"24GiB"``), or ``None`` for `memory_limit_bytes`. ``mem_fraction``,
        ``safety_margin``: for an accelerator (`Accelerator.memory_limit_bytes`). Raises ValueError for bad
        arguments (an unknown accelerator with the closest name)."""
        return capacity(
            self, self.cost, effective_batch, target, mem_fraction=mem_fraction, safety_margin=safety_margin
        )


COMPILE_ONLY_GPU = "gpu (compile-only)"
"""How `analyse` is told its programs were laid out on compile-only GPU devices (`autoaccum._gpu_compile`)."""


def live_bytes(analysis: Any) -> int:
    """The one formula for what a compiled program needs (XLA's ``memory_analysis()``): arguments + outputs +
    temporaries - aliased (donated) bytes."""
    m = analysis
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def analyse(
    programs: Sequence[Program], options: dict[str, Any] | None = None, platform: str | None = None, size: int = 0
) -> Point:
    """Compiles (never runs) one update call's ``programs`` (`Update.programs`) for a batch of ``size`` and combines
    XLA's figures as a `Point` (microbatch size 0: the caller's): the peak over the programs of `live_bytes` plus
    what stays resident beside them, costs summed, and the runtime's bytes beyond XLA's accounting (`runtime_bytes`).

    One of our own speed-up options that this jaxlib does not know is dropped (never the user's). On
    `COMPILE_ONLY_GPU`, the programs must have compiled for GPUs, and their costs come from XLA's HLO cost analysis.
    """
    platform = platform or jax.default_backend()
    if not programs:
        raise ValueError("`programs` is empty: nothing to analyse.")
    options = dict(options or {})
    try:
        compiled = [program.lowered.compile(compiler_options=options or None) for program in programs]
    except jax.errors.JaxRuntimeError as e:
        from autoaccum._gpu_compile import GPU_COMPILER_OPTIONS

        ours = {**COMPILER_OPTIONS, **CPU_SINGLE_STEP_OPTIONS, **GPU_COMPILER_OPTIONS}
        unknown = [k for k in options if k in ours and options[k] == ours[k] and f"compile option: '{k}'" in str(e)]
        if "No such compile option" not in str(e) or not unknown:
            raise
        return analyse(programs, {k: v for k, v in options.items() if k not in unknown}, platform, size)
    peak, flops, accessed = 0, 0.0, 0.0
    for c, program in zip(compiled, programs, strict=True):
        m = c.memory_analysis()
        if m is None:
            raise RuntimeError(f"XLA gives no memory analysis on {jax.devices()[0].platform}; cannot predict memory.")
        peak = max(peak, live_bytes(m) + program.resident_bytes)
        f, b = program_cost(c, program, platform)
        flops, accessed = flops + f, accessed + b
    runtime = 0 if platform == COMPILE_ONLY_GPU else runtime_bytes(platform, compiled)
    return Point(0, size, peak, flops, accessed, runtime)


def program_cost(compiled: jax.stages.Compiled, program: Program, platform: str) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of one compiled program, by XLA's cost analysis (on `COMPILE_ONLY_GPU`, of the
    GPU-optimised modules: `autoaccum._gpu_compile.gpu_cost`)."""
    if platform == COMPILE_ONLY_GPU:
        from autoaccum._gpu_compile import check_gpu, gpu_cost

        check_gpu(compiled)
        return gpu_cost(compiled, program.lowered)
    return xla_cost(compiled)


def xla_cost(compiled: jax.stages.Compiled) -> tuple[float, float]:
    """``(flops, bytes accessed)`` of a program compiled for this machine, by XLA's cost analysis."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax returns one dict per computation
        cost = cost[0] if cost else {}
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def step_memory(
    update: Update, params: PyTree, batch: PyTree, batch_size: int, compiler_options: dict[str, Any] | None = None
) -> Point:
    """Compiles (never runs) ``update`` for a batch of ``batch_size`` examples shaped like ``batch`` (`analyse`).

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> u = autoaccum.build_update(lambda w, b: jnp.mean(b @ w), optax.sgd(0.1), microbatch_size=8)
      >>> step_memory(u, jnp.ones(4), jnp.ones((8, 4)), 8).peak_bytes > 0
      True
    """
    params_s = abstract(params)
    opt_state_s = jax.eval_shape(update.init, params_s)
    programs = update.programs(params_s, opt_state_s, abstract_batch(batch, batch_size))
    return analyse(programs, compiler_options, size=batch_size)._replace(microbatch_size=update.microbatch_size)


def state_bytes(update: Update, params: PyTree) -> int:
    """Bytes of ``params`` plus the optimizer state ``update.init`` makes for them (abstract; allocates nothing)."""
    params_s = abstract(params)
    return tree_bytes(params_s) + tree_bytes(jax.eval_shape(update.init, params_s))


class _Measurer:
    """Lowers update steps at given sizes and compiles them in a thread pool (XLA releases the GIL: tracing the next
    step overlaps compiling the last), keeping each ``(microbatch, batch_size)``'s `Point` (``(0, 0)``: the
    optimizer step alone) in the order asked for."""

    def __init__(
        self,
        make_update: Callable[[int], Update],
        optimizer: optax.GradientTransformation,
        params: PyTree,
        batch: PyTree,
        state: PyTree | None,
        options: dict[str, Any],
        platform: str,
        on_compile: Callable[[Point | None, float], None] | None,
        workers: int,
    ) -> None:
        self.make_update, self.optimizer, self.batch, self.platform = make_update, optimizer, batch, platform
        self.params, self.state, self.on_compile = (
            abstract(params),
            () if state is None else (abstract(state),),
            on_compile,
        )
        fast = CPU_SINGLE_STEP_OPTIONS if platform == "cpu" else {}
        self.compiler_options = {True: {**fast, **options}, False: options}  # by: is it a one-microbatch step?
        first = make_update(1)
        self.options = dict(first.options)
        self.opt_state = jax.eval_shape(first.init, self.params)
        self.state_bytes = tree_bytes(self.params) + tree_bytes(self.opt_state) + tree_bytes(self.state)
        self.pool = ThreadPoolExecutor(workers)
        self.futures: dict[tuple[int, int], Future[Point]] = {}
        self.points: dict[tuple[int, int], Point] = {}

    def __enter__(self) -> _Measurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(cancel_futures=True)

    def submit(self, sizes: Iterable[tuple[int, int]]) -> None:
        """Lowers the step for each ``(microbatch, batch_size)`` not submitted yet and queues its compilation."""
        for m, total in sizes:
            if (m, total) in self.futures:
                continue
            start = time.perf_counter()
            if (m, total) == (0, 0):
                lowered = jax.jit(self._optimizer_step, donate_argnums=(0, 1))
                programs = [Program(lowered.lower(self.params, self.opt_state, self.params), 0)]
            else:
                step = self.make_update(m)
                programs = step.programs(self.params, self.opt_state, abstract_batch(self.batch, total), *self.state)
            lowering = time.perf_counter() - start
            self.futures[m, total] = self.pool.submit(self._analysed, (m, total), lowering, programs)

    def measure(self, sizes: Sequence[tuple[int, int]]) -> list[Point]:
        """`Point` for each ``(microbatch, batch_size)``, compiling those not measured yet."""
        self.submit(sizes)
        for size in sizes:
            self.points.setdefault(size, self.futures[size].result())
        return [self.points[s] for s in sizes]

    def singles(self) -> list[Point]:
        """The one-microbatch points measured, by size."""
        return sorted(p for (m, total), p in self.points.items() if m == total != 0)

    def _optimizer_step(self, params: PyTree, opt_state: PyTree, grads: PyTree) -> tuple[PyTree, PyTree]:
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def _analysed(self, size: tuple[int, int], lowering: float, programs: Sequence[Program]) -> Point:
        """The `Point` of ``size``, given to ``on_compile`` (``None`` for the optimizer step) with the seconds taken,
        ``lowering`` included."""
        start = time.perf_counter()
        options = self.compiler_options[size[0] == size[1] != 0]
        point = analyse(programs, options, self.platform, size[1])._replace(microbatch_size=size[0])
        if self.on_compile is not None:
            self.on_compile(point if size != (0, 0) else None, lowering + time.perf_counter() - start)
        return point


def estimate(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation,
    strategy: str = "auto",
    memory_limit: int | str | None = None,
    has_aux: bool = False,
    state: PyTree | None = None,
    loss_reduction: str = "mean",
    microbatch_cap: int | None = None,
    accumulation: bool = True,
    effective_batch: int | None = None,
    refine_for: Sequence[int | str] = (),
    compiler_options: dict[str, Any] | None = None,
    workers: int = 2,
    target: str | Path | None = None,
    on_compile: Callable[[Point | None, float], None] | None = None,
    max_microbatch: int | None = None,
    accumulation_from: Estimate | None = None,
    **options: Any,
) -> Estimate:
    """Predicts, by compiling only, the peak memory of the update step at every microbatch size.

    Compiles (never runs) the update `autoaccum.build_update` would emit: one microbatch of `FIRST_SIZE`, then one
    where that predicts the answer (`_second_size`); with ``accumulation``, three accumulating steps; the optimizer
    step alone; then one at each predicted answer not within `NEAR` of a compiled size. ``params``, ``batch`` and
    ``state`` may be arrays or ``jax.ShapeDtypeStruct``; on a mesh (the batch sharded along its examples) every
    byte figure is per device and sizes are global multiples of the shards.

    Args:
      loss_fn, params, batch, optimizer, strategy, has_aux, state, loss_reduction: as for `autoaccum.probe`.
      memory_limit: the limit `Estimate.max_microbatch` answers for (bytes or ``"16GiB"``); default: what this
        machine's default device offers a step (the probe's policy), or a ``target``'s.
      microbatch_cap: `Estimate.max_microbatch` is at most this (default `DEFAULT_MAX_MICROBATCH`).
      accumulation: also measure accumulating steps (for `Estimate.capacity` and ``bytes_at`` with a
        ``batch_size``); ``False`` saves three compilations.
      effective_batch: refine the fit for plans of this many examples per update (with ``accumulation``, also
        the largest microbatch considered: nothing above it is compiled).
      refine_for: more memory limits to refine the fit around, one compilation each.
      compiler_options: XLA options for the analysis compilations, on top of `COMPILER_OPTIONS` (and, on a GPU,
        `analysis_options`).
      workers: compilations run in parallel.
      target: a catalogued GPU (``"H100"``, ...) or the path of a target description: compile with XLA's GPU compiler
        for that card on compile-only devices (the ``gpu-plan`` extra; ``"auto"`` picks a GPU's strategy); without
        it the CPU compiler's figures stand in (``Estimate.compiler == "XLA:CPU (proxy)"``).
      on_compile: called as each compilation finishes with its `Point` (``None`` for the optimizer step) and the
        seconds it took to lower and compile.
      max_microbatch: deprecated name of ``microbatch_cap``.
      accumulation_from: an estimate of the same step with another loss of the same
        parameters and batch (a knob's other setting): its accumulator and batch terms are taken, and of the
        accumulating steps only the uneven split is compiled.
      **options: the strategy's options (e.g. ``unroll=2``).

    Raises:
      TypeError, ValueError: bad arguments (named in the message), before anything is compiled; an unknown
        ``target`` (naming the known ones).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> params = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)  # 64 MiB, never allocated
      >>> batch = jax.ShapeDtypeStruct((1, 4096), jnp.float32)
      >>> est = estimate(lambda w, x: jnp.mean(x @ w), params, batch, optimizer=optax.sgd(0.1),
      ...                memory_limit="512MiB", accumulation=False)
      >>> 0 < est.max_microbatch and est.bytes_at(est.max_microbatch) <= 512 * 2**20
      True
    """
    start = time.perf_counter()
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    check_params(params)
    leading_size(batch)
    microbatch_cap = renamed("microbatch_cap", microbatch_cap, "max_microbatch", max_microbatch)
    cap = DEFAULT_MAX_MICROBATCH if microbatch_cap is None else check_positive_int(microbatch_cap, "microbatch_cap")
    if effective_batch is not None:
        check_positive_int(effective_batch, "effective_batch")
    check_positive_int(workers, "workers")
    check_bool(accumulation, "accumulation")
    platform, compiler, target_name = jax.default_backend(), "", None
    if target is not None:
        platform, compiler, target_name, memory_limit, compiler_options, params, batch, state = _for_target(
            target, memory_limit, compiler_options, params, batch, state
        )
    layout = layout_of(params, batch, state)
    if layout is not None and effective_batch is not None:
        check_effective_batch(effective_batch, layout)
    limit = _limit(memory_limit, layout)
    extra_limits = [parse_bytes(x, "refine_for") for x in refine_for]
    g = 1 if layout is None else layout.shards  # on a mesh: global sizes, multiples of the batch's shards
    if cap < g:
        raise ValueError(
            f"`microbatch_cap`={cap} is below the {g} shards the batch is split into; microbatch sizes are global "
            f"and multiples of {g}: pass microbatch_cap >= {g}."
        )

    def units(m: int) -> int:  # m rounded down to a multiple of g (at least g)
        return max(g, m // g * g)

    build = resolve_strategy(
        loss_fn, optimizer, params, batch, state, None if target is None else "gpu", strategy=strategy,
        has_aux=has_aux, loss_reduction=loss_reduction, **options,
    )  # fmt: skip
    where = COMPILE_ONLY_GPU if platform == "gpu" and target is not None else platform
    compile_options = {**COMPILER_OPTIONS, **analysis_options(platform, target), **(compiler_options or {})}

    def make_update(m: int) -> Update:
        return build_update(loss_fn, optimizer, microbatch_size=m, has_state=state is not None, **build)

    measurer = _Measurer(make_update, optimizer, params, batch, state, compile_options, where, on_compile, workers)
    with measurer:
        s1 = units(min(max(FIRST_SIZE, 2 * g), cap))
        sizes = [(s1, s1)]
        if accumulation:  # 2 and 4 microbatches of s1 (unless taken), and 2 of s1 plus a smaller last one
            sizes += [] if accumulation_from is not None else [(s1, 2 * s1), (s1, 4 * s1)]
            sizes += [(s1, 2 * s1 + units(s1 // 2) if s1 > g else 3 * s1)]
        measurer.submit([*sizes, (0, 0)])
        (single1,) = measurer.measure(sizes[:1])
        largest = cap if effective_batch is None or not accumulation else min(cap, effective_batch)  # plans: <= B
        s2 = units(_second_size(single1, measurer.state_bytes, limit, largest))
        measurer.measure([(s2, s2) if s2 != s1 else (s1 + g, s1 + g)])
        fields: dict[str, Any] = dict(
            strategy=build["strategy"], options=measurer.options, memory_limit_bytes=limit, microbatch_cap=largest,
            platform=platform, shards=g, compiler=compiler, target=target_name,
        )  # fmt: skip
        if accumulation:
            fields.update(_accumulation(single1, measurer.measure(sizes[1:]), accumulation_from))
        else:
            fields.update(accumulation_bytes=None, per_batch_example_bytes=None, remainder_bytes_per_example=None)
        opt = measurer.futures[0, 0].result()
        est = _fitted(measurer, opt, seconds=time.perf_counter() - start, **fields)
        plans = effective_batch is not None and accumulation
        top = max(cap, effective_batch or 0)
        for _ in range(2):  # refine at the predicted answers until they are near a measurement (usually once)
            wanted = {est.largest_microbatch(b, effective_batch if plans else None) for b in (limit, *extra_limits)}
            done = [p.microbatch_size for p in measurer.singles()]
            todo = [m for m in sorted(wanted) if 1 <= m <= top and not any(abs(m - k) <= NEAR * k for k in done)]
            if not todo:
                break
            measurer.measure([(m, m) for m in todo])
            est = _fitted(measurer, opt, seconds=time.perf_counter() - start, **fields)
    return est


def _limit(memory_limit: int | str | None, layout: Any) -> int:
    """``memory_limit`` in bytes; None: this machine's default device's (the probe's policy), per device of
    ``layout``'s mesh (a CPU mesh's devices share the RAM)."""
    if memory_limit is not None:
        return parse_bytes(memory_limit, "memory_limit")
    from autoaccum._device import detect_device, resolve_memory_limit

    return resolve_memory_limit(detect_device(), None, devices=1 if layout is None else layout.mesh.size)[0]


def analysis_options(platform: str, target: str | Path | None) -> dict[str, Any]:
    """The options of an estimate's compiles beyond `COMPILER_OPTIONS`: on a GPU here (no ``target``), those of
    compile-only GPU programs (`autoaccum._gpu_compile.GPU_COMPILER_OPTIONS`: no Triton tiling autotuned, code
    generation not optimised), whose plans matched the probed boundary on an H200; a probe calibrates its estimate by
    the peak it measures. A ``target`` brings its own (`_for_target`), the CPU none.

    Example:
      >>> analysis_options("gpu", None)["xla_gpu_enable_triton_gemm"], analysis_options("cpu", None)
      (False, {})
    """
    if platform != "gpu" or target is not None:
        return {}
    from autoaccum._gpu_compile import GPU_COMPILER_OPTIONS

    return dict(GPU_COMPILER_OPTIONS)


def _for_target(
    target: str | Path, memory_limit: int | str | None, compiler_options: dict[str, Any] | None, *trees: PyTree
) -> tuple[Any, ...]:
    """``(platform, compiler, target name, memory_limit, compiler_options, params, batch, state)`` of an estimate for
    a GPU target: the card's limit by default; its compile-only devices and XLA's GPU compiler where the
    ``gpu-plan`` extra is installed, else the CPU compiler's figures as a proxy."""
    from autoaccum._gpu_compile import compiler_status, describe, on_gpu

    description = describe(target)  # an unknown target fails here, naming the known ones
    if memory_limit is None and not isinstance(target, Path):
        memory_limit = Target.gpu(description.name).memory_limit_bytes
    elif memory_limit is None:  # a card of the user's own: the GPU policy of `Accelerator.memory_limit_bytes`
        memory_limit = usable_bytes(description.memory_bytes)
    if compiler_status() is not None:
        return (jax.default_backend(), "XLA:CPU (proxy)", description.name, memory_limit, compiler_options, *trees)
    from autoaccum._gpu_compile import GPU_COMPILER_OPTIONS

    options = {**GPU_COMPILER_OPTIONS, **(compiler_options or {})}
    compiler = f"XLA:GPU {description.arch} (compile-only)"
    return ("gpu", compiler, description.name, memory_limit, options, *on_gpu(target, *trees))


def _accumulation(single: Point, points: Sequence[Point], like: Estimate | None) -> dict[str, float]:
    """The accumulating step's terms from measurements at ``single``'s microbatch (see `Estimate`): 2 and 4
    microbatches, then an uneven split; with ``like``, its accumulator and batch terms and the uneven split alone."""
    s, uneven = single.microbatch_size, points[-1]
    if like is None:
        acc2, acc4 = points[:2]
        ys = [acc2.peak_bytes - single.peak_bytes, acc4.peak_bytes - single.peak_bytes]
        slope, intercept = (float(v) for v in np.polyfit([float(acc2.batch_size), float(acc4.batch_size)], ys, 1))
    else:
        slope, intercept = like.per_batch_example_bytes or 0.0, like.accumulation_bytes or 0.0
    expected = single.peak_bytes + intercept + slope * uneven.batch_size
    runtime = max(p.runtime_bytes for p in points) - single.runtime_bytes
    return dict(
        accumulation_bytes=max(intercept, 0.0),
        per_batch_example_bytes=max(slope, 0.0),
        remainder_bytes_per_example=max(0.0, (uneven.peak_bytes - expected) / (uneven.batch_size % s or 1)),
        accumulation_runtime_bytes_per_example=runtime / s,
    )


def _fitted(measurer: _Measurer, opt: Point, **fields: Any) -> Estimate:
    """The `Estimate` of the points measured so far: ``fields``, and the roofline cost fit (`fit_cost`)."""
    singles = measurer.singles()
    cost = fit_cost(
        [p.microbatch_size for p in singles], [p.flops for p in singles], [p.bytes_accessed for p in singles],
        (opt.flops, opt.bytes_accessed), measurer.params, fields["shards"],
    )  # fmt: skip
    return Estimate(points=tuple(measurer.points.values()), cost=cost, **fields)


def _second_size(first: Point, state_bytes: int, limit: int, top: int) -> int:
    """The second one-microbatch size to compile: where ``first`` predicts the answer under ``limit``, scaling
    everything beyond the state (and the runtime's fixed bytes) with the microbatch; at most ``top`` (2 when
    ``top`` is 1); half (or twice) ``first`` when that is within `NEAR` of it.

    Example:
      >>> first = Point(32, 32, peak_bytes=33 * 2**20, flops=0.0, bytes_accessed=0.0)  # 1 MiB fixed + 1 MiB each
      >>> _second_size(first, state_bytes=2**20, limit=257 * 2**20, top=16384)
      256
      >>> _second_size(first, state_bytes=2**20, limit=34 * 2**20, top=16384)  # 33 is too near 32
      16
    """
    fixed = state_bytes + (CPU_RUNTIME_BYTES if first.runtime_bytes else 0)
    per_example = max(first.total_bytes - fixed, 1) / first.microbatch_size
    guess = min(max(int((limit - fixed) / per_example), 1), max(top, 2))
    if abs(guess - first.microbatch_size) <= NEAR * first.microbatch_size:
        guess = first.microbatch_size // 2 if first.microbatch_size > 1 else 2
    return guess
