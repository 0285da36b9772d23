"""The probe: the largest microbatch whose full update step really runs on this device, found in few runs.

`search` (pure Python) starts at the compile-only estimate's answer less a margin (`first_size`), re-anchors the model
``bytes(m) = fixed + per_example * m`` on each fitting trial's measured peak, steps up from the last fit and bisects
when steps do not halve the bracket. `probe` runs its trials in the worker (`autoaccum._worker`); its answer is
exact for the runs made: ``max_microbatch`` fit and the next size did not (or is above the cap).
"""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import optax

from autoaccum._batch import abstract, host_copy
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum._deprecated import renamed
from autoaccum._device import DeviceInfo, detect_device, resolve_memory_limit
from autoaccum._estimate import DEFAULT_MAX_MICROBATCH, Estimate, state_bytes
from autoaccum._isolation import Outcome
from autoaccum._json import JsonMixin
from autoaccum._preflight import trace_loss
from autoaccum._units import format_bytes, parse_bytes
from autoaccum._update import resolve_strategy
from autoaccum._worker import STEPS, WARMUP, Job, MeshSpec, Request, Server, Worker, brief, unless_oom
from autoaccum.strategies import PyTree, check_params, layout_of, leading_size, tree_bytes
from autoaccum.strategies import get as get_strategy
from autoaccum.strategies._layout import check_effective_batch

FIRST_MARGIN = 0.97
"""The first real trial runs where the compile-only estimate leaves this fraction of the bytes the limit has above
the smallest microbatch's (about this fraction of its answer; its error against the probed boundary: within 2% on
the CPU's workloads, none on an H200, benchmarks/README.md)."""

BOUND_MARGIN = 0.9
"""`ProbeResult.bound_for` answers this fraction of the calibrated estimate's size for another knob setting."""

DEFAULT_TRIAL_TIMEOUT = 600.0
"""Seconds a probe's trial (or its estimate) may run before it is killed as hung."""

LENT: contextvars.ContextVar[Worker | None] = contextvars.ContextVar("autoaccum_probe_worker", default=None)
"""A running worker of the same job and limit (tune's) that an isolated probe runs its trials in, knob setting 0
with the probe's own build and a tuning trial's calls, instead of starting one of its own."""


@dataclasses.dataclass(frozen=True)
class Trial(JsonMixin):
    """One real run of the update step at one microbatch size.

    Attributes:
      microbatch_size: examples in the microbatch (= the effective batch of the trial's step).
      fits: whether the step compiled and ran under the limit.
      seconds: the steady-state step time, when it fit; ``first_seconds``: the first step's.
      error: the trial's error message when it failed for another reason than memory, else None.
      peak_bytes: memory used at the peak, counted as the limit counts it (None where not measurable).
      wall_seconds: the whole trial, as the caller waited for it.
      detail: why it did not fit (the OOM message), else None.
      times: each timed step, seconds; compile_seconds, cached_seconds: its compiling, and what JAX's persistent
        cache saved of it (as `autoaccum.TrialRecord` has them).
    """

    microbatch_size: int
    fits: bool
    seconds: float | None
    error: str | None = None
    peak_bytes: int | None = None
    first_seconds: float | None = None
    wall_seconds: float | None = None
    detail: str | None = None
    times: tuple[float, ...] = ()
    compile_seconds: float | None = None
    cached_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class ProbeResult(JsonMixin):
    """What `probe` found.

    Attributes:
      max_microbatch: the largest microbatch (a multiple of ``granularity``; one of ``sizes`` when given) whose
        update step ran; 0 if not even the least size fits.
      trials: every real run, in the order run.
      device, memory_limit_bytes, limit_source: the device probed, the memory a trial could use and its source.
      granularity: trial sizes are multiples of it; ``microbatch_cap``: the largest size the probe would try.
      strategy, options: the accumulation strategy whose step was run, and its options.
      state_bytes: parameters plus optimizer state.
      estimate: the compile-only `autoaccum.Estimate` the search started from (None: none could be made).
      isolate: whether trials ran in the worker; ``seconds``: the probe's wall time.
      message: a one-line summary for people.
      sizes: the sizes the probe was given (it tries no other).
      effective_batch: the examples per update each trial accumulated (None: one microbatch per step).
      predicted_over: given sizes left out unrun in the tuner's worker, which refuses them: the estimate puts XLA's
        buffer assignment for them over the limit (`runnable_sizes`).
    """

    max_microbatch: int
    trials: tuple[Trial, ...]
    device: DeviceInfo
    memory_limit_bytes: int
    limit_source: str
    granularity: int
    microbatch_cap: int
    strategy: str
    options: Mapping[str, Any]
    state_bytes: int
    estimate: Estimate | None
    isolate: bool
    seconds: float
    message: str
    sizes: tuple[int, ...] | None = None
    effective_batch: int | None = None
    predicted_over: tuple[int, ...] = ()

    json_format = "autoaccum.probe/1"
    json_properties = ("runs", "step_seconds")

    @property
    def runs(self) -> int:
        """Real runs spent."""
        return len(self.trials)

    @property
    def reached_cap(self) -> bool:
        """Whether the answer is the largest size the probe could try, not a boundary the device (or the estimate
        of a size left out, `predicted_over`) set."""
        return self.max_microbatch > 0 and _stopped_by(self.max_microbatch, self.trials, self.predicted_over) is None

    @property
    def failed_above(self) -> int | None:
        """The least size above ``max_microbatch`` that ran out of memory (None: none was tried)."""
        return _failed_above(self.trials, self.max_microbatch)

    @property
    def why_not_above(self) -> str:
        """What stopped the answer from growing, for people: the least larger size that ran out of memory or was
        left out as predicted over the limit (``"19 does not"``, ``"43 is predicted not to ..."``), or ``""``."""
        return _why_not_above(self.max_microbatch, self.trials, self.predicted_over)

    def bound_for(self, other: Estimate) -> int:
        """The largest microbatch predicted to fit for another setting of the probed step (``other``'s estimate),
        without probing it: the `calibrated` answer within the limit (accumulating ``effective_batch`` examples where
        the probe did and ``other`` can tell), at `BOUND_MARGIN` of itself below the cap, as a multiple of
        ``granularity``; at least the probed answer where ``other`` predicts no more bytes there than the probed
        step's estimate (the two estimates' errors alike: a lighter setting fits where the probed one did)."""
        g = self.granularity
        top = min(self.microbatch_cap, other.microbatch_cap)
        batch = self.effective_batch if other.accumulation_bytes is not None else None  # (else one microbatch's)
        answer = min(self.calibrated(other).largest_microbatch(self.memory_limit_bytes, batch), top)
        if answer < top:
            answer = max(math.floor(answer * BOUND_MARGIN), min(answer, self._no_heavier_up_to(other, batch)))
        return answer // g * g

    def _no_heavier_up_to(self, other: Estimate, batch: int | None) -> int:
        """The probed answer where ``other`` predicts no more bytes there than the probed step's estimate, else 0."""
        m, mine = self.max_microbatch, self.estimate
        if m == 0 or mine is None or (batch is not None and mine.accumulation_bytes is None):
            return 0
        return m if other.bytes_at(m, batch) <= mine.bytes_at(m, batch) else 0

    def calibrated(self, other: Estimate) -> Estimate:
        """``other`` (an estimate of the probed step or of another setting of it) calibrated by the largest fitting
        trial's peak (else the limit); unchanged without a fitting trial or an estimate."""
        fits = [t for t in self.trials if t.fits]
        if self.estimate is None or not fits:
            return other
        largest = max(fits, key=lambda t: t.microbatch_size)
        peak = largest.peak_bytes or self.memory_limit_bytes
        return other.calibrate(largest.microbatch_size, peak, measured=self.estimate, batch_size=self.effective_batch)

    def predicted_peak(self, other: Estimate, microbatch_size: int, batch_size: int | None = None) -> int:
        """The peak bytes ``other`` (an estimate of another setting, or of this one with ``accumulation=True``)
        predicts for ``microbatch_size`` per microbatch over ``batch_size`` per update, `calibrated` by this probe.

        Example:
          >>> from autoaccum import estimate, workloads
          >>> w = workloads.mlp()
          >>> kw = dict(optimizer=w.optimizer, memory_limit="64MiB", microbatch_cap=64)
          >>> found = probe(w.loss_fn, w.params, w.batch, isolate=False, **kw)
          >>> acc = estimate(w.loss_fn, w.params, w.batch, **kw)
          >>> found.predicted_peak(acc, 16, 64) > found.predicted_peak(acc, 16), 0 < found.bound_for(acc) <= 64
          (True, True)
        """
        return self.calibrated(other).bytes_at(microbatch_size, batch_size)

    @property
    def step_seconds(self) -> float | None:
        """The step time at ``max_microbatch`` (from its trial)."""
        for t in self.trials:
            if t.fits and t.microbatch_size == self.max_microbatch:
                return t.seconds
        return None


class ProbeError(RuntimeError):
    """A trial failed for another reason than memory; ``trial`` has its message, ``trials`` all runs so far."""

    def __init__(self, message: str, trial: Trial, trials: tuple[Trial, ...]) -> None:
        super().__init__(message)
        self.trial = trial
        self.trials = trials


@dataclasses.dataclass(frozen=True)
class Setup:
    """A validated probe request: what to run, where, under which limit."""

    job: Job
    device: DeviceInfo
    memory_limit_bytes: int
    limit_source: str
    state_bytes: int
    microbatch_cap: int
    granularity: int
    isolate: bool
    trial_timeout: float | None
    effective_batch: int | None = None

    def rows(self, m: int) -> int:
        """The examples a trial of microbatch ``m`` runs: the effective batch when given, else ``m``."""
        return m if self.effective_batch is None else self.effective_batch


def prepare(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation,
    strategy: str = "auto",
    memory_limit: int | float | str | None = None,
    microbatch_cap: int | None = None,
    granularity: int = 1,
    has_aux: bool = False,
    state: PyTree | None = None,
    loss_reduction: str = "mean",
    isolate: bool = True,
    device: Any = None,
    options: Mapping[str, Any] | None = None,
    trial_timeout: float | None = DEFAULT_TRIAL_TIMEOUT,
    effective_batch: int | None = None,
) -> Setup:
    """Checks a probe request and resolves its device and limit; runs nothing. See `probe` for arguments."""
    check_loss_fn(loss_fn)
    check_optimizer(optimizer)
    check_params(params)
    granularity = check_positive_int(granularity, "granularity")
    cap = DEFAULT_MAX_MICROBATCH if microbatch_cap is None else check_positive_int(microbatch_cap, "microbatch_cap")
    if effective_batch is not None:
        cap = min(cap, check_positive_int(effective_batch, "effective_batch"))
    if cap < granularity:
        what = "microbatch_cap" if effective_batch is None or cap < effective_batch else "effective_batch"
        raise ValueError(
            f"`{what}`={cap} is below `granularity`={granularity}, so no size can be tried; raise {what} or lower "
            "granularity."
        )
    check_bool(isolate, "isolate")
    if memory_limit is not None:  # (before anything traces the loss)
        parse_bytes(memory_limit, "memory_limit")
    if trial_timeout is not None and not (isinstance(trial_timeout, (int, float)) and trial_timeout > 0):
        raise ValueError(f"`trial_timeout` must be a positive number of seconds or None, got {trial_timeout!r}.")
    leading_size(batch)
    build = dict(strategy=strategy, has_aux=has_aux, loss_reduction=loss_reduction, **dict(options or {}))
    build = resolve_strategy(loss_fn, optimizer, params, batch, state, **build)  # "auto": the strategy it runs here
    mesh = MeshSpec.of(params, batch, state)
    if mesh is not None:  # global microbatch sizes: multiples of the batch's shards too
        layout = layout_of(params, batch, () if state is None else state)
        assert layout is not None  # (a batch laid out over a mesh, as MeshSpec found)
        if effective_batch is not None:
            check_effective_batch(effective_batch, layout)
        if not get_strategy(build["strategy"]).supports(layout):
            raise ValueError(
                f"`strategy`={build['strategy']!r} does not run with these inputs on a mesh (multisteps: parameters "
                "sharded over it, FSDP); use strategy='scan' or 'loop'."
            )
        granularity = math.lcm(granularity, mesh.shards)
        if cap < granularity:
            raise ValueError(
                f"`microbatch_cap`={cap} is below {granularity}, the least common multiple of `granularity` and the "
                f"{mesh.shards} shards the batch is split into (microbatch sizes are global); raise microbatch_cap."
            )
    plain = abstract(params, sharded=False)  # no devices: it pickles
    job = Job(loss_fn, optimizer, plain, host_copy(batch), None if state is None else host_copy(state), build, mesh)
    update = job.update(granularity)
    info = detect_device(device)
    limit, source = resolve_memory_limit(info, memory_limit, isolate=isolate, devices=job.devices)
    needed = state_bytes(update, job.abstract_params()) + (0 if state is None else tree_bytes(abstract(state)))
    if limit <= needed:
        raise ValueError(
            f"`memory_limit`={format_bytes(limit)} ({limit} bytes) is below what the parameters, optimizer state "
            f"and model state alone need: {format_bytes(needed)} ({needed} bytes); give a limit above that."
        )
    trace_loss(loss_fn, params, batch, state)  # the loss's own error, here, before any child starts
    if mesh is None:  # and what it returns (a scalar, the aux), on shapes (the example batch: nothing runs)
        whole, more = job.update(leading_size(batch)), () if state is None else (abstract(state),)
        jax.eval_shape(whole, plain, jax.eval_shape(whole.init, plain), abstract(batch, sharded=False), *more)
    return Setup(job, info, limit, source, needed, cap, granularity, isolate, trial_timeout, effective_batch)


def search(
    run: Callable[[int], Trial],
    *,
    limit: int,
    max_microbatch: int,
    granularity: int = 1,
    predicted: int | None = None,
    per_example_bytes: float | None = None,
    sizes: Sequence[int] | None = None,
) -> int:
    """The largest multiple of ``granularity`` (up to ``max_microbatch``; one of ``sizes`` when given) for which
    ``run(size)`` fits, exactly (see the module docstring). ``predicted``: where the first trial runs (the
    compile-only estimate's answer less a margin, `first_size`); ``per_example_bytes``: the estimate's slope.
    Pure Python.

    Example:
      >>> run = lambda m: Trial(m, 100 + 3 * m <= 1000, 0.0, peak_bytes=100 + 3 * m)
      >>> search(run, limit=1000, max_microbatch=4096)
      300
      >>> search(run, limit=1000, max_microbatch=4096, sizes=[64, 128, 256, 512, 1024])
      256
    """
    g = granularity
    if sizes is None:
        levels: Sequence[int] = range(1, max_microbatch // g + 1)  # in granules
    else:
        levels = sorted({s // g for s in sizes if s % g == 0 and 0 < s <= max_microbatch})
    top = levels[-1] if levels else 0
    lo, hi = 0, top + 1  # in granules: lo fits (0 trivially), hi does not (top + 1: beyond max_size)
    points: list[tuple[int, int]] = []  # (granules, peak bytes) of trials that fit
    per_granule = None if per_example_bytes is None or per_example_bytes <= 0 else per_example_bytes * g
    d_up, down = 1, 1 / 8  # the next step above a fit (granules), the next step below a failure (of the bracket)
    widths: list[int] = []
    while open_ := levels[bisect.bisect_right(levels, lo) : bisect.bisect_left(levels, hi)]:
        prediction = _predict(points, limit, per_granule, hi if hi <= top else None)
        if prediction is None and not points and predicted is not None:
            # At the compile-only prediction, unless it says that even max_microbatch fits.
            prediction = top + 1.0 if predicted >= top * g else predicted / g
        if prediction is None:
            cand = (lo + hi) // 2 if hi <= top else max(1, 2 * lo)
        else:
            k = math.floor(prediction)
            if k <= lo:  # the model says the last fit is the largest: check just above, growing
                cand = lo + d_up if lo + d_up < hi else (lo + hi) // 2
                d_up *= 2
            elif k >= hi > top:  # the model says max_microbatch fits: try it
                cand = top
            elif k >= hi:  # the model over-reaches a known failure: step down, growing
                cand = hi - max(1, math.ceil((hi - lo) * down))
                down = min(0.5, down * 2)
            else:
                cand = k
        if hi <= top and len(widths) >= 3 and widths[-1] > widths[-2] / 2 and widths[-2] > widths[-3] / 2:
            cand = (lo + hi) // 2  # a real failure bounds the search and two steps did not halve it: bisect
        below = bisect.bisect_right(open_, cand)  # the largest size left at or below the candidate, else the least
        cand = open_[below - 1] if below else open_[0]
        trial = run(cand * g)
        if trial.fits:
            lo, down = cand, 1 / 8
            if trial.peak_bytes is not None:
                points.append((cand, trial.peak_bytes))
        else:
            hi = cand
        widths.append(hi - lo)
    return lo * g


def _predict(
    points: list[tuple[int, int]], limit: int, per_granule: float | None, failed: int | None = None
) -> float | None:
    """Granules at which the model meets ``limit``: the slope between the largest fit and one well below it (else the
    estimate's), at least what a failure at ``failed`` implies, anchored at the most cautious fit of the upper half."""
    if not points:
        return None
    k_max, u_max = max(points)
    far = [p for p in points if p[0] <= k_max - max(2, k_max // 32)]
    slope = per_granule
    if far:
        k_far, u_far = max(far)
        measured = (u_max - u_far) / (k_max - k_far)
        if measured > 0:
            slope = measured
    if failed is not None:
        bound = max((limit - u) / (failed - k) for k, u in points if k < failed)
        slope = bound if slope is None else max(slope, bound)
    if slope is None or slope <= 0:
        return None
    return min(k + (limit - u) / slope for k, u in points if 2 * k >= k_max)


class TrialRunner:
    """Runs trials of one `Setup` as a context manager: ``runner(size) -> Trial``, every trial kept in ``trials``; in
    the worker (its own, or the `LENT` one), or with ``isolate=False`` in this process."""

    def __init__(self, setup: Setup, progress: Callable[[Trial], None] | None = None) -> None:
        self.setup, self.progress = setup, progress
        self.trials: list[Trial] = []
        s, limit, timeout, lent = setup, setup.memory_limit_bytes, setup.trial_timeout, LENT.get()
        self._owned = s.isolate and (lent is None or lent.limit != limit)
        self._worker = lent if s.isolate and not self._owned else None
        if self._owned:
            self._worker = Worker(s.job, s.device, limit, compile_timeout=timeout, step_timeout=timeout,
                                  timeout_names=("trial_timeout", "trial_timeout"))  # fmt: skip
        self._build = {} if self._owned else dict(s.job.build)  # (a lent worker's job has another build)
        self._server = None if s.isolate else Server(s.job, [{}], s.device.platform, s.device.device, limit, False)

    @property
    def refuses_over_xla(self) -> bool:
        """Whether a step whose buffers XLA puts over the limit is refused unrun: as the tuner's trials (in its lent
        worker), and in this process on the CPU (`Server.refuses`). A probe's own worker runs it anyway (XLA's
        figure can overstate what the step uses)."""
        return self._lent or (self._server is not None and self._server.refuses)

    @property
    def _lent(self) -> bool:
        return self._worker is not None and not self._owned

    def __enter__(self) -> TrialRunner:
        if self._owned:
            self._worker.__enter__()  # type: ignore[union-attr]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self._worker.__exit__(*exc)  # type: ignore[union-attr]

    def ask(self, request: Request) -> Outcome:
        """The worker's answer, or this process's (only an allocation failure is caught here: `is_oom`)."""
        if self._worker is not None:
            return self._worker.ask(request)
        assert self._server is not None
        return unless_oom(functools.partial(self._server.answer, request))

    def estimate(self) -> tuple[Estimate | None, str | None]:
        """The compile-only `autoaccum.Estimate` of the step trials run, and why it is None when it is."""
        cap, batch = self.setup.microbatch_cap, self.setup.effective_batch
        estimate = {"microbatch_cap": cap, "accumulation": batch is not None, "effective_batch": batch}
        outcome = self.ask(Request(self._build, 0, 0, kind="estimate", estimate=estimate))
        if outcome.status == "oom":
            return None, "XLA ran out of memory compiling the step for an estimate"
        if outcome.estimate is None:
            return None, f"the compile-only estimate failed: {brief(outcome.message, 300)}"
        return Estimate.from_dict(outcome.estimate), None

    def __call__(self, size: int) -> Trial:
        start = time.perf_counter()
        # in a lent worker, that worker's own rule and cache, and the tuner's calls: it times the same program later
        steps, warmup, kind = (STEPS, WARMUP, "time") if self._lent else (1, 0, "fits")
        outcome = self.ask(Request(self._build, size, self.setup.rows(size), steps, warmup, kind=kind))
        wall = time.perf_counter() - start
        error, detail = (outcome.message if outcome.status == status else None for status in ("error", "oom"))
        times, compiling = tuple(outcome.times or ()), (outcome.compile_seconds, outcome.cached_seconds or 0.0)
        trial = Trial(size, outcome.status == "fits", outcome.seconds, error, outcome.peak_bytes, outcome.first_seconds,
                      wall, detail, times, *compiling)  # fmt: skip
        self.trials.append(trial)
        if self.progress is not None:
            self.progress(trial)
        if trial.error is not None:
            raise ProbeError(f"trial at microbatch {size} failed: {trial.error}", trial, tuple(self.trials))
        return trial


def probe(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation,
    strategy: str = "auto",
    memory_limit: int | float | str | None = None,
    microbatch_cap: int | None = None,
    granularity: int = 1,
    has_aux: bool = False,
    state: PyTree | None = None,
    loss_reduction: str = "mean",
    isolate: bool = True,
    device: Any = None,
    options: Mapping[str, Any] | None = None,
    trial_timeout: float | None = DEFAULT_TRIAL_TIMEOUT,
    progress: Callable[[Trial], None] | None = None,
    sizes: Sequence[int] | None = None,
    effective_batch: int | None = None,
    max_microbatch: int | None = None,
) -> ProbeResult:
    """Finds the largest microbatch whose full update step really runs here, in few real runs.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (mean over the batch), or ``(scalar, aux)`` with has_aux.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``: trials make their own arrays; yours are never
        changed, copied to disk or donated).
      batch: an example batch; trial batches repeat its rows.
      optimizer: the optax optimizer training uses (its state is part of the memory).
      strategy: the accumulation strategy whose step is run, or ``"auto"``: the one `autoaccum.build_update` picks.
      memory_limit: bytes a trial may use (an int or ``"1.5GiB"``): a GPU's allocator is capped to it, the CPU's
        address space grows by at most it. Default: `autoaccum._device.resolve_memory_limit`.
      microbatch_cap: the largest microbatch to try (default 16384).
      granularity: trial sizes are multiples of it (e.g. 8 for tensor cores).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      state: the model state of ``loss_fn(params, batch, state) -> (loss, state)``, as `autoaccum.build_update`'s
        ``has_state``; trials get a copy.
      loss_reduction: ``"mean"`` or ``"sum"``, as for `autoaccum.build_update`.
      isolate: run trials in the worker process (default). ``False`` runs them here, catching only out-of-memory
        errors: a crash kills this process, and leaked memory carries over. On a GPU it needs ``memory_limit=None``;
        on the CPU no cap is set here (a failed allocation under one can leave XLA's runtime broken): a size fits
        when XLA's buffer assignment fits the limit and the step runs, and its peak is not measured.
      device: a ``jax.Device`` (default: the first).
      options: the strategy's options.
      trial_timeout: seconds a trial (or the estimate, or the worker's start) may run before it is reported as hung;
        None: no limit.
      progress: called with each `Trial` as it finishes.
      sizes: try only these microbatch sizes (multiples of ``granularity`` up to ``microbatch_cap``).
      effective_batch: run the step that accumulates this many examples per update in microbatches of the size
        tried (the last one smaller where it does not divide; sizes up to it); default: one microbatch per step.
      max_microbatch: deprecated name of ``microbatch_cap``.

    Returns:
      A `ProbeResult`: ``max_microbatch`` fits and the next size does not (or is above ``microbatch_cap``).

    Raises:
      ValueError, TypeError: bad arguments, or a limit below the parameters' and optimizer state's bytes.
      ProbeError: a trial failed for another reason than memory, or hung.

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros(4)}
      >>> result = autoaccum.probe(loss_fn, jnp.zeros(8), batch, optimizer=optax.sgd(0.1),
      ...                          memory_limit="256MiB", microbatch_cap=64, isolate=False)
      >>> result.max_microbatch
      64
    """
    start = time.perf_counter()
    microbatch_cap = renamed("microbatch_cap", microbatch_cap, "max_microbatch", max_microbatch)
    setup = prepare(
        loss_fn, params, batch, optimizer=optimizer, strategy=strategy, memory_limit=memory_limit,
        microbatch_cap=microbatch_cap, granularity=granularity, has_aux=has_aux, state=state,
        loss_reduction=loss_reduction, isolate=isolate, device=device, options=options, trial_timeout=trial_timeout,
        effective_batch=effective_batch,
    )  # fmt: skip
    if sizes is not None:
        sizes = _check_sizes(sizes, setup)
    with TrialRunner(setup, progress) as runner:
        model, why = runner.estimate()
        g = setup.granularity
        answer = None if model is None else first_size(model, setup.memory_limit_bytes, g, effective_batch)
        over: tuple[int, ...] = ()
        runnable = sizes
        if sizes is not None and model is not None and runner.refuses_over_xla:
            runnable, over = runnable_sizes(sizes, model, setup.memory_limit_bytes, effective_batch)
        best = search(
            runner, limit=setup.memory_limit_bytes, max_microbatch=setup.microbatch_cap, granularity=g,
            predicted=None if answer is None else min(answer, setup.microbatch_cap) // g * g,
            per_example_bytes=None if model is None else model.per_example_bytes, sizes=runnable,
        )  # fmt: skip
        trials = tuple(runner.trials)
    where, above = (
        f"under {format_bytes(setup.memory_limit_bytes)} on {setup.device.name}",
        _why_not_above(best, trials, over),
    )
    if effective_batch is not None:
        where += f", accumulating {effective_batch} examples"
    if best == 0:
        least = setup.granularity if sizes is None else sizes[0]
        message = f"nothing fits: even a microbatch of {least} does not run {where}."
    elif not above:
        message = f"microbatch {best} (the largest tried) fits {where}."
    else:
        message = f"microbatch {best} fits {where}; {above}."
    message += "" if why is None else f" (no compile-only estimate: {why})"
    if over:
        message += f" Not run, their buffers predicted over the limit: {', '.join(map(str, over))}."
    build = setup.job.build
    options = {k: v for k, v in build.items() if k not in ("strategy", "has_aux", "loss_reduction")}
    return ProbeResult(
        best, trials, setup.device, setup.memory_limit_bytes, setup.limit_source, setup.granularity,
        setup.microbatch_cap, build["strategy"], options, setup.state_bytes, model, setup.isolate,
        time.perf_counter() - start, message, sizes, effective_batch, over,
    )  # fmt: skip


def first_size(model: Estimate, limit: int, granularity: int, effective_batch: int | None) -> int:
    """Where the search's first trial runs: the estimate's largest microbatch under the limit less `FIRST_MARGIN`'s
    share of the bytes above the smallest microbatch's."""
    least = model.bytes_at(granularity, effective_batch)
    return model.largest_microbatch(int(limit - (1 - FIRST_MARGIN) * max(limit - least, 0)), effective_batch)


def runnable_sizes(
    sizes: Sequence[int], model: Estimate, limit: int, effective_batch: int | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``sizes`` (sorted) split into those the probe may run and those it leaves out: every size but the least whose
    step's buffers, as XLA assigns them and the compile-only estimate predicts them, exceed ``limit``; the tuner's
    worker would refuse such a step after compiling it (`TrialRunner.refuses_over_xla`). (An uneven split's last
    microbatch adds buffers: such a size can need more than a larger even one.)"""
    over = tuple(m for m in sizes[1:] if model.bytes_at(m, effective_batch, runtime=False) > limit)
    return tuple(m for m in sizes if m not in over), over


def _stopped_by(best: int, trials: Sequence[Trial], over: Sequence[int]) -> tuple[int, bool] | None:
    """The least size above ``best`` that ran out of memory or was left out as predicted over (`runnable_sizes`),
    and whether it ran; None: neither."""
    failed, skipped = _failed_above(trials, best), min((m for m in over if m > best), default=None)
    if skipped is not None and (failed is None or skipped < failed):
        return skipped, False
    return None if failed is None else (failed, True)


def _why_not_above(best: int, trials: Sequence[Trial], over: Sequence[int]) -> str:
    stopped = _stopped_by(best, trials, over)
    if stopped is None:
        return ""
    size, ran = stopped
    return f"{size} does not" if ran else f"{size} is predicted not to (its buffers over the limit; not run)"


def _failed_above(trials: Sequence[Trial], size: int) -> int | None:
    return min((t.microbatch_size for t in trials if not t.fits and t.microbatch_size > size), default=None)


def _check_sizes(sizes: Iterable[int], setup: Setup) -> tuple[int, ...]:
    """``sizes`` as `probe` tries them (sorted), or a ValueError naming those that are not positive multiples of the
    granularity up to the cap."""
    listed = list(sizes) if isinstance(sizes, Iterable) and not isinstance(sizes, (str, bytes)) else None
    if listed is None or not all(isinstance(s, int) and not isinstance(s, bool) for s in listed):
        raise TypeError(f"`sizes` must be a sequence of ints (microbatch sizes), got {sizes!r}.")
    g, cap = setup.granularity, setup.microbatch_cap
    bad = [s for s in listed if not (0 < s <= cap and s % g == 0)]
    if bad or not listed:
        kept = sorted({s for s in listed if s not in bad})
        instead = f"e.g. sizes={kept}" if kept else f"e.g. sizes={[g * k for k in (1, 2, 4) if g * k <= cap]}"
        raise ValueError(
            f"`sizes`={listed!r} holds {bad or 'nothing'}, not positive multiples of {g} (`granularity`, or its least "
            f"common multiple with a mesh's shards) up to {cap} (`microbatch_cap`, at most `effective_batch`), which "
            f"the probe cannot try; give only such sizes ({instead}), or sizes=None to search every multiple."
        )
    return tuple(sorted(set(listed)))
