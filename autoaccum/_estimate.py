"""Capacity planning from compilation alone: what fits on which accelerator, predicted before any run.

`estimate` lowers the update step with ``jax.ShapeDtypeStruct`` arguments and asks XLA what the compiled
program needs (``Compiled.memory_analysis()``: arguments + outputs + temporaries - aliased bytes) at a few
microbatch sizes. Nothing is executed and nothing the size of the model or the batch is allocated, so it
runs on any machine, a laptop CPU included, for models that would not fit on it.

The measurements are fitted to a model of fixed + per-example bytes:

* a step on one microbatch of ``m`` examples needs ``fixed_bytes + per_example_bytes * m`` (XLA's buffer
  assignment is not exactly affine, so the fit is local: the measured points are joined piecewise-linearly
  and the fit is refined by one compilation at the predicted answer unless a compiled size lies within `NEAR`
  of it);
* an accumulating step (a batch of ``B > m`` examples cut into microbatches of ``m``) needs that plus
  ``accumulation_bytes + per_batch_example_bytes * B``: the gradient accumulator, and the whole batch
  resident on the device (with any copy of it the strategy makes).

On the CPU, the prediction for this machine adds what XLA's CPU runtime allocates outside its accounting
(`autoaccum._cpu_runtime`: a fixed few MiB, and what a convolution materialises, read from the compiled HLO),
so that it compares with what `autoaccum.probe` measures; plans for a catalogued GPU or TPU use XLA's figure alone.

Step times come from ``Compiled.cost_analysis()`` (FLOPs and bytes accessed per microbatch, and for the
optimizer step) against an accelerator's peak FLOP/s and bandwidth: a roofline *estimate* (a lower bound
that real steps rarely reach), not a measurement.

Example:
  >>> import autoaccum
  >>> from autoaccum import workloads
  >>> w = workloads.mlp()
  >>> est = autoaccum.estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="32MiB")
  >>> est.bytes_at(est.max_microbatch) <= est.memory_limit_bytes < est.bytes_at(est.max_microbatch + 1)
  True
  >>> capacity = est.capacity(1024, "A100-40GB")
  >>> capacity.fits_in_one_step, capacity.accumulation_steps
  (True, 1)
"""

from __future__ import annotations

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
from autoaccum._capacity import Capacity, Target, capacity, fit_cost
from autoaccum._catalog import DEFAULT_SAFETY_MARGIN, Accelerator, usable_bytes
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum._cpu_runtime import CPU_RUNTIME_BYTES, runtime_bytes
from autoaccum._deprecated import renamed
from autoaccum._json import JsonMixin
from autoaccum._memory import analyse
from autoaccum._step_time import StepCost
from autoaccum._units import parse_bytes
from autoaccum._update import Update, build_update, resolve_strategy
from autoaccum.strategies import Program, PyTree, check_params, layout_of, leading_size, tree_bytes

DEFAULT_MAX_MICROBATCH = 16384
"""The largest microbatch the estimate and the probe consider when the caller gives no ``microbatch_cap``."""

COMPILER_OPTIONS: dict[str, Any] = {"xla_backend_optimization_level": 0}
"""Options for the analysis compilations: no LLVM optimisation (about 2x faster to compile). Buffer
assignment and cost analysis happen before code generation, so memory and cost figures are unchanged
(``tests/test_estimate.py`` checks this against `autoaccum._memory.step_memory`)."""

CPU_SINGLE_STEP_OPTIONS: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}
"""On the CPU, one-microbatch steps also compile with XLA's older loop emitter: about 2x faster again. Its
buffer assignment for them was never below the default's; it was above it by at most 0.2% from 17 examples
up (53 KB at 6615 examples of the MLP) and by at most 12 KB below that (1.6% at 3 examples of the CNN):
measured over the built-in workloads, every strategy, sizes 1 to 6615, YNNPACK fusions on and off;
``tests/test_estimate.py`` keeps checking it. Accumulating steps keep the default emitter: for them the older
one skips a copy of the batch that the default makes (41% of the MLP's peak at 256 x 4 examples)."""

FIRST_SIZE = 32
"""The microbatch size measured first (``microbatch_cap`` when smaller); the second is where it predicts the
answer (`_second_size`)."""

NEAR = 0.1
"""A predicted answer within this fraction of a compiled size is not compiled again: interpolating over so
short a distance errs by well under 1% (XLA's bytes per example drift by a few % over a 4x range)."""


class Point(NamedTuple):
    """One compile-only measurement of an update step.

    Attributes:
      microbatch_size: examples per microbatch.
      batch_size: examples in the step's batch (``== microbatch_size`` for a step on one microbatch).
      peak_bytes: XLA's predicted peak: arguments + outputs + temporaries - aliased bytes (the largest
        over the step's programs, plus what stays resident outside them).
      flops, bytes_accessed: XLA's cost analysis of the step's programs.
      runtime_bytes: what the platform's runtime needs beyond XLA's accounting (`runtime_bytes`; 0 on
        GPUs and TPUs, whose buffer assignment covers everything).
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
    """The predicted memory and cost of an update step as a function of the microbatch size.

    Made by `estimate`; every figure comes from compiling, nothing was run.

    Attributes:
      strategy: the accumulation strategy measured, and ``options`` its options.
      memory_limit_bytes: the memory limit ``max_microbatch`` answers for.
      points: every measurement, one-microbatch steps (``batch_size == microbatch_size``) and accumulating ones.
      accumulation_bytes: extra fixed bytes of an accumulating step (the accumulator, the loop's carry).
      per_batch_example_bytes: extra bytes per example of the whole batch in an accumulating step.
      remainder_bytes_per_example: extra bytes per example of an uneven split's smaller last microbatch.
      accumulation_runtime_bytes_per_example: what the runtime needs beyond XLA's accounting in an
        accumulating step, less what it needs in a one-microbatch step, per microbatch example (those three
        above are XLA's figures alone). On the CPU the convolutions inside the accumulation loop get layouts
        YNNPACK does not take and run on Eigen, with its patches, where a one-microbatch step's run on YNNPACK.
      cost: XLA's cost analysis fitted per example, for roofline step times (`StepCost`).
      microbatch_cap: microbatch sizes considered are at most this (the ``microbatch_cap`` it was given).
      platform: the backend the step was compiled for (``"cpu"``, ``"gpu"``, ``"tpu"``).
      seconds: how long the estimate took.
      shards: on a mesh, the number of pieces the batch is sharded into: microbatch sizes are global and
        multiples of it, and every byte figure is per device (XLA's analysis of the mesh's program); 1 on one
        device.
      compiler: which compiler answered: ``"XLA:GPU sm_90 (compile-only)"`` for a GPU target compiled by XLA's
        GPU compiler, ``"XLA:CPU (proxy)"`` for a target planned from the CPU compiler's figures, ``""`` (this
        machine's own compiler) without a target.
      target: the catalogued accelerator given as ``target`` (``None`` without one).
      calibration_bytes: added to every prediction on this device (`bytes_at` with ``runtime``): what a step
        measured here showed the compile-only figures miss (`calibrate`); 0 as compiled.
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

    # -- memory -------------------------------------------------------------------------------------------

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
          batch_size: examples per update; ``None`` (the default) means one microbatch (``= microbatch_size``).
            A larger batch is accumulated over ``ceil(batch_size / microbatch_size)`` microbatches (the last one
            smaller when ``microbatch_size`` does not divide it).
          runtime: include what this platform's runtime needs beyond XLA's accounting (`Point.runtime_bytes`,
            the CPU's); ``False`` gives XLA's figure alone, as for planning a GPU or TPU from a CPU.

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

    def calibrate(self, microbatch_size: int, peak_bytes: int, *, measured: Estimate | None = None) -> Estimate:
        """This estimate calibrated by a step measured on this device: ``peak_bytes`` at ``microbatch_size`` examples
        (one microbatch per step, as the probe runs it) of ``measured``'s step (default this one's; another
        setting's estimate, e.g. another remat policy, borrows the measurement of the probed one). What the
        compile-only figures miss there is taken not to grow with the step (the runtime's own needs; on the CPU,
        memory mapped before the cap, which a step reuses and the cap does not count), and added to every
        prediction on this device (`calibration_bytes`).

        Example:
          >>> from autoaccum import workloads
          >>> w = workloads.linear()
          >>> est = estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="64MiB")
          >>> calibrated = est.calibrate(16, est.bytes_at(16) + 2**20)
          >>> calibrated.bytes_at(64) - est.bytes_at(64)  # XLA's figure alone (runtime=False) stays
          1048576
        """
        missed = peak_bytes - (self if measured is None else measured).bytes_at(microbatch_size)
        return dataclasses.replace(self, calibration_bytes=self.calibration_bytes + missed)

    def largest_microbatch(
        self, memory_limit: int | str, batch_size: int | None = None, *, runtime: bool = True
    ) -> int:
        """The largest microbatch predicted to fit in ``memory_limit`` (0 if none).

        Args:
          memory_limit: the budget, bytes or a string like ``"16GiB"``.
          batch_size: examples per update, accumulated over microbatches (the answer is at most
            ``batch_size``); ``None``: one microbatch per step (the answer is at most `microbatch_cap`).
          runtime: as for `bytes_at`.
        """
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
        lo = 1  # fits(lo); bisect for the largest fit (the model is increasing in m, leaving out the remainder)
        if fits(hi, remainder=False):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid, remainder=False):
                lo = mid
            else:
                hi = mid
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

    # -- capacity -----------------------------------------------------------------------------------------

    def capacity(
        self,
        effective_batch: int,
        target: Target | Accelerator | str | int | None = None,
        *,
        mem_fraction: float | None = None,
        safety_margin: float = DEFAULT_SAFETY_MARGIN,
    ) -> Capacity:
        """The microbatch, accumulation steps, peak and step time for ``effective_batch`` on ``target``.

        Args:
          effective_batch: examples per update (an int >= 1).
          target: a `Target`, a catalogued accelerator or its name (``"A100-40GB"``), a memory limit
            (int bytes or a string with a unit, ``"24GiB"``, used as given), or ``None`` for
            `memory_limit_bytes`. A bare size is a limit on this machine's platform (on a CPU, the runtime's
            needs beyond XLA's accounting count); an accelerator's peak is XLA's figure alone.
          mem_fraction, safety_margin: for an accelerator, see `Accelerator.memory_limit_bytes`.

        Raises:
          ValueError: ``effective_batch`` < 1, an unknown accelerator (with the closest name), a size that
            does not parse.
        """
        return capacity(
            self, self.cost, effective_batch, target, mem_fraction=mem_fraction, safety_margin=safety_margin
        )


# -- measuring -------------------------------------------------------------------------------------------------


COMPILE_ONLY_GPU = "gpu (compile-only)"
"""How `_analyse` is told its programs were laid out on compile-only GPU devices (`autoaccum._gpu_compile`)."""


class _Analysis(NamedTuple):
    peak_bytes: int
    flops: float
    bytes_accessed: float
    runtime_bytes: int


def _analyse(programs: Sequence[Program], options: dict[str, Any], platform: str | None = None) -> _Analysis:
    """`autoaccum._memory.analyse`, plus what the runtime needs beyond XLA's accounting.

    Our speed-up options (`COMPILER_OPTIONS`, `CPU_SINGLE_STEP_OPTIONS`) are only that: one this jaxlib does
    not know is dropped and the programs compiled without it (the user's own options are never dropped).
    ``platform=COMPILE_ONLY_GPU``: the programs are laid out on compile-only GPU devices
    (`autoaccum._gpu_compile`); they must have compiled for GPUs, and their costs come from XLA's HLO cost
    analysis of the GPU programs (`GPU_COMPILER_OPTIONS` are ours too: dropped if this jaxlib lacks one).
    """
    platform = platform or jax.default_backend()
    try:
        memory, compiled = analyse(programs, compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        from autoaccum._gpu_compile import GPU_COMPILER_OPTIONS

        ours = {**COMPILER_OPTIONS, **CPU_SINGLE_STEP_OPTIONS, **GPU_COMPILER_OPTIONS}
        unknown = [k for k in options if k in ours and options[k] == ours[k] and f"compile option: '{k}'" in str(e)]
        if "No such compile option" not in str(e) or not unknown:
            raise
        return _analyse(programs, {k: v for k, v in options.items() if k not in unknown}, platform)
    if platform == COMPILE_ONLY_GPU:
        from autoaccum._gpu_compile import check_gpu, gpu_cost

        flops = moved = 0.0
        for c, program in zip(compiled, programs, strict=True):
            check_gpu(c)
            f, b = gpu_cost(c, program.lowered)
            flops, moved = flops + f, moved + b
        return _Analysis(memory.peak_bytes, flops, moved, 0)
    return _Analysis(memory.peak_bytes, memory.flops, memory.bytes_accessed, runtime_bytes(platform, compiled))


class _Measurer:
    """Lowers update steps at given sizes and compiles them in a thread pool, caching per size.

    Tracing holds the GIL and XLA's compilation releases it: `submit` lowers a step and hands its compilation
    to the pool, so the next step's tracing overlaps the previous step's compilation.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        params: PyTree,
        batch: PyTree,
        optimizer: optax.GradientTransformation,
        state: PyTree | None,
        build: dict[str, Any],
        compiler_options: dict[str, Any],
        workers: int,
        platform: str | None = None,
        on_compile: Callable[[Point | None, float], None] | None = None,
    ) -> None:
        self.platform = platform or jax.default_backend()
        self.on_compile = on_compile
        self.params = abstract(params)
        self.batch = batch
        self.state = () if state is None else (abstract(state),)
        self.optimizer = optimizer
        self.compiler_options = compiler_options
        fast = CPU_SINGLE_STEP_OPTIONS if self.platform == "cpu" else {}
        self.single_step_options = {**fast, **compiler_options}  # compiler_options holds COMPILER_OPTIONS
        self._build: Callable[[int], Update] = lambda m: build_update(
            loss_fn, optimizer, microbatch_size=m, has_state=state is not None, **build
        )
        first = self._build(1)
        self.options = dict(first.options)
        self.opt_state = jax.eval_shape(first.init, self.params)
        self.state_bytes = tree_bytes(self.params) + tree_bytes(self.opt_state) + tree_bytes(self.state)
        self._pool = ThreadPoolExecutor(workers)
        self._pending: dict[tuple[int, int], Future[_Analysis]] = {}
        self.points: dict[tuple[int, int], Point] = {}

    def __enter__(self) -> _Measurer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(cancel_futures=True)

    def submit(self, sizes: Iterable[tuple[int, int]]) -> None:
        """Lowers the step for each ``(microbatch, batch_size)`` not measured yet and queues its compilation."""
        for m, total in sizes:
            if (m, total) not in self.points and (m, total) not in self._pending:
                start = time.perf_counter()
                batch = abstract_batch(self.batch, total)
                programs = self._build(m).programs(self.params, self.opt_state, batch, *self.state)
                options = self.single_step_options if m == total else self.compiler_options
                lowering = time.perf_counter() - start
                self._pending[m, total] = self._pool.submit(self._timed, (m, total), lowering, programs, options)

    def _timed(
        self, size: tuple[int, int] | None, lowering: float, programs: Sequence[Program], options: dict[str, Any]
    ) -> _Analysis:
        """`_analyse`, then ``on_compile`` with the size's `Point` (``None``: the optimizer step) and the seconds
        taken, ``lowering`` included (the wait for a worker is not)."""
        start = time.perf_counter()
        r = _analyse(programs, options, self.platform)
        if self.on_compile is not None:
            point = None if size is None else Point(*size, r.peak_bytes, r.flops, r.bytes_accessed, r.runtime_bytes)
            self.on_compile(point, lowering + time.perf_counter() - start)
        return r

    def measure(self, sizes: Iterable[tuple[int, int]]) -> list[Point]:
        """`Point` for each ``(microbatch, batch_size)``, compiling those not measured yet."""
        sizes = list(dict.fromkeys(sizes))
        self.submit(sizes)
        for m, total in sizes:
            if (m, total) in self._pending:
                r = self._pending.pop((m, total)).result()
                self.points[m, total] = Point(m, total, r.peak_bytes, r.flops, r.bytes_accessed, r.runtime_bytes)
        return [self.points[s] for s in sizes]

    def optimizer_cost(self) -> Future[_Analysis]:
        """Cost analysis of one optimizer step on gradients shaped like the parameters (compiled in the pool)."""

        def step(params: PyTree, opt_state: PyTree, grads: PyTree) -> tuple[PyTree, PyTree]:
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        start = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(self.params, self.opt_state, self.params)
        lowering = time.perf_counter() - start
        return self._pool.submit(self._timed, None, lowering, [Program(lowered, 0)], self.compiler_options)


def _affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs``."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


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
    **options: Any,
) -> Estimate:
    """Predicts, by compiling only, the peak memory of the update step at every microbatch size.

    Compiles (never runs) the update that `autoaccum.build_update` would emit at a few sizes: a one-microbatch
    step at `FIRST_SIZE` examples, then one where that first size predicts the answer (`_second_size`); with
    ``accumulation``, three accumulating steps (two batch sizes, one uneven split); the optimizer step alone
    (for step times); then one more at each predicted answer (`max_microbatch`, and the answer for each
    ``refine_for`` budget) not within `NEAR` of a compiled size, to refine the fit where it matters. Each
    step is traced while the previous one compiles. ``params`` and ``batch`` may be arrays or
    ``jax.ShapeDtypeStruct``: only their shapes and dtypes are used, nothing is allocated.

    On a mesh (``batch`` sharded along its example axis, ``params`` replicated or FSDP-sharded, as
    `autoaccum.build_update` takes them; ``ShapeDtypeStruct`` with a ``sharding`` too) the programs compiled are
    the mesh's: every byte figure is per device, microbatch sizes are global multiples of the batch's shards
    (`Estimate.shards`).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``-> (scalar, aux)`` with ``has_aux``).
      params: the parameters pytree (arrays or ``jax.ShapeDtypeStruct``).
      batch: an example batch; only its per-example shapes and dtypes matter, not its size.
      optimizer: the optax optimizer training uses (required: its state is part of the memory).
      strategy: the accumulation strategy (``autoaccum.strategies.available()``), or ``"auto"``
        (`autoaccum.build_update`'s default): the one it picks for these arguments (with ``target``, on a GPU), which
        `Estimate.strategy` names.
      memory_limit: the limit `Estimate.max_microbatch` answers for: bytes or ``"16GiB"``; default: what
        this machine's default device offers a step (the same policy as the probe's).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      state: the model state, when ``loss_fn(params, batch, state) -> (loss, state)`` takes one (arrays or
        ``jax.ShapeDtypeStruct``), as `autoaccum.build_update`'s ``has_state``.
      loss_reduction: ``"mean"`` or ``"sum"``, as for `autoaccum.build_update`.
      microbatch_cap: `Estimate.max_microbatch` is at most this (default `DEFAULT_MAX_MICROBATCH`, as the
        probe's ``microbatch_cap``).
      accumulation: also measure accumulating steps (needed by `Estimate.capacity` and by ``bytes_at`` with a
        ``batch_size``); ``False`` saves three compilations when only `max_microbatch` is wanted.
      effective_batch: refine the fit for plans of this many examples per update (around the largest microbatch
        of an accumulating step, rather than of a one-microbatch step, under each budget).
      refine_for: more memory limits (bytes or strings) to refine the fit around, one compilation each, e.g.
        the memory limit of each target of a capacity plan.
      compiler_options: XLA options for the analysis compilations, on top of `COMPILER_OPTIONS`.
      workers: compilations run in parallel.
      target: a catalogued GPU (``"H100"``, ``"A100-40GB"``, ... `autoaccum._gpu_compile.known_targets`) or the
        path of a target description: compile with XLA's GPU compiler for that card, on compile-only devices
        (the ``gpu-plan`` extra; no GPU needed), laid out as ``params`` and ``batch`` are (on a mesh, a mesh of
        as many GPUs). ``memory_limit`` then defaults to the card's (`autoaccum.Target.gpu`). Without the
        extra, the CPU compiler's figures stand in, labelled ``Estimate.compiler == "XLA:CPU (proxy)"``
        (`autoaccum._gpu_compile.compiler_status` says why and what to install).
      on_compile: called as each compilation finishes (in the thread that compiled it), with its `Point`
        (``None`` for the optimizer step alone) and the seconds it took to lower and compile: for progress.
      max_microbatch: deprecated name of ``microbatch_cap``.
      **options: the strategy's options (e.g. ``unroll=2``).

    Returns:
      An `Estimate`.

    Raises:
      TypeError, ValueError: bad arguments (named in the message), before anything is compiled; an unknown
        ``target`` (`autoaccum._catalog.UnknownAcceleratorError`, naming the known ones).

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
    if memory_limit is None:
        from autoaccum._device import detect_device, resolve_memory_limit

        limit = resolve_memory_limit(detect_device(), None)[0]
    else:
        limit = parse_bytes(memory_limit, "memory_limit")
    extra_limits = [parse_bytes(x, "refine_for") for x in refine_for]
    compile_options = {**COMPILER_OPTIONS, **(compiler_options or {})}
    layout = layout_of(params, batch, state)
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
    measurer = _Measurer(loss_fn, params, batch, optimizer, state, build, compile_options, workers, where, on_compile)
    with measurer:
        s1 = units(min(max(FIRST_SIZE, 2 * g), cap))
        sizes = [(s1, s1)]
        if accumulation:  # 2 and 4 microbatches of s1, and 2 of s1 plus a smaller last one
            sizes += [(s1, 2 * s1), (s1, 4 * s1), (s1, 2 * s1 + units(s1 // 2) if s1 > g else 3 * s1)]
        measurer.submit(sizes)
        opt_future = measurer.optimizer_cost()
        (single1,) = measurer.measure(sizes[:1])
        largest = cap if effective_batch is None or not accumulation else effective_batch  # a plan's microbatch <= B
        s2 = units(_second_size(single1, measurer.state_bytes, limit, largest))
        measurer.measure([(s2 if s2 != s1 else s1 + g, s2 if s2 != s1 else s1 + g)])
        fields: dict[str, Any] = dict(
            strategy=build["strategy"], options=measurer.options, memory_limit_bytes=limit, microbatch_cap=cap,
            platform=platform, shards=g, compiler=compiler, target=target_name,
        )  # fmt: skip
        if accumulation:
            fields.update(_accumulation(single1, *measurer.measure(sizes[1:])))
        else:
            fields.update(accumulation_bytes=None, per_batch_example_bytes=None, remainder_bytes_per_example=None)
        opt = opt_future.result()

        def current() -> Estimate:
            return _fitted(measurer, opt, seconds=time.perf_counter() - start, **fields)

        est = current()
        plans = effective_batch is not None and accumulation
        top = max(cap, effective_batch or 0)
        for _ in range(2):  # refine at the predicted answers until they are near a measurement (usually once)
            wanted = {est.largest_microbatch(b, effective_batch if plans else None) for b in (limit, *extra_limits)}
            done = {m for m, total in measurer.points if m == total}
            todo = [m for m in sorted(wanted) if 1 <= m <= top and not any(abs(m - k) <= NEAR * k for k in done)]
            if not todo:
                break
            measurer.measure([(m, m) for m in todo])
            est = current()
    return est


def _for_target(
    target: str | Path, memory_limit: int | str | None, compiler_options: dict[str, Any] | None, *trees: PyTree
) -> tuple[Any, ...]:
    """``(platform, compiler, target name, memory_limit, compiler_options, params, batch, state)`` of an estimate
    for a catalogued GPU or a target description: the card's limit by default; its compile-only devices and
    XLA's GPU compiler where the ``gpu-plan`` extra is installed, else the CPU compiler's figures as a proxy."""
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


def _accumulation(single: Point, acc2: Point, acc4: Point, uneven: Point) -> dict[str, float]:
    """The accumulating step's terms from three measurements at ``single``'s microbatch: at ``(s, B)`` it is the
    one-microbatch step at ``s`` + ``accumulation_bytes`` + ``per_batch_example_bytes`` * B (XLA's figures), plus
    an uneven split's extra per example of its last microbatch, plus the runtime's difference between the two
    steps (per microbatch example)."""
    s = single.microbatch_size
    fixed, per_batch = _affine(
        [acc2.batch_size, acc4.batch_size], [acc2.peak_bytes - single.peak_bytes, acc4.peak_bytes - single.peak_bytes]
    )
    expected = single.peak_bytes + fixed + per_batch * uneven.batch_size
    runtime = max(p.runtime_bytes for p in (acc2, acc4, uneven)) - single.runtime_bytes
    return dict(
        accumulation_bytes=max(fixed, 0.0),
        per_batch_example_bytes=max(per_batch, 0.0),
        remainder_bytes_per_example=max(0.0, (uneven.peak_bytes - expected) / (uneven.batch_size % s or 1)),
        accumulation_runtime_bytes_per_example=runtime / s,
    )


def _fitted(measurer: _Measurer, opt: _Analysis, **fields: Any) -> Estimate:
    """The `Estimate` of the points measured so far: ``fields``, and the roofline cost fit (`fit_cost`)."""
    singles = sorted(
        (p for p in measurer.points.values() if p.batch_size == p.microbatch_size), key=lambda p: p.microbatch_size
    )
    cost = fit_cost(
        [p.microbatch_size for p in singles], [p.flops for p in singles], [p.bytes_accessed for p in singles],
        (opt.flops, opt.bytes_accessed), measurer.params, fields["shards"],
    )  # fmt: skip
    return Estimate(points=tuple(measurer.points.values()), cost=cost, **fields)


def _second_size(first: Point, state_bytes: int, limit: int, top: int) -> int:
    """The second one-microbatch size to compile: where ``first`` predicts the answer under ``limit`` (at most
    ``top``, the largest answer wanted, or 2 when ``top`` is 1: the fit needs two sizes).

    The guess scales everything beyond the parameters and optimizer state (and the runtime's fixed bytes)
    in proportion to the microbatch, from the first size alone. It lands near the answer when activations
    dominate (then no further compilation is needed, see `NEAR`); otherwise the refinement corrects it. A
    guess too close to ``first`` measures nothing new, so half (or twice) its size is taken instead.

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
