"""What the tuner returns: one `TrialRecord` per trial and the `TuneResult`."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optuna

from autoaccum._json import NOT_JSON, JsonMixin
from autoaccum._plan import Plan
from autoaccum._probe import ProbeResult
from autoaccum._tune.race import Runner, quartiles
from autoaccum._update import Update
from autoaccum.strategies import PyTree

UNIT_STEPS = 5
"""A tune's cost unit is one compile plus this many steps of the program it picks."""


@dataclasses.dataclass(frozen=True)
class TrialRecord(JsonMixin):
    """One tuning trial.

    Attributes:
      number: Optuna's trial number.
      microbatch_size, accumulation_steps, strategy, options: the configuration.
      throughput: measured examples per second (``None`` unless the trial completed).
      compile_seconds: the first (compiling) call's duration (``None`` if unknown); cached_seconds: what JAX's
        persistent cache saved it (with ``compile_seconds``, the uncached compile time).
      state: Optuna's trial state name (``COMPLETE``, ``FAIL``, ``RUNNING``, ...).
      reason: why it failed, if it did.
      same_program_as: the trial whose timing this one reuses: the same program, timed once
        (`autoaccum._tune.space.program_key`).
      seconds: ``(q1, median, q3)`` of the trial's step times, in seconds (None unless it completed);
        ``throughput`` is the effective batch over the median.
      peak_bytes: the trial's peak memory per device in the worker (None when timed in this process); on the CPU
        the resident memory the step added (`autoaccum.probe`'s own worker counts address space, which reads
        higher).
      remat: the remat policy around the loss (`autoaccum.build_update`'s ``remat``), or None.
      accumulator_dtype: the dtype gradients accumulated in, by name.
      knobs: the values of the loss's own knobs (`autoaccum.Knobs`), ``{}`` without any.
    """

    number: int
    microbatch_size: int
    accumulation_steps: int
    strategy: str
    options: dict[str, Any]
    throughput: float | None
    compile_seconds: float | None
    state: str
    reason: str | None = None
    same_program_as: int | None = None
    seconds: tuple[float, float, float] | None = None
    peak_bytes: int | None = None
    remat: str | None = None
    accumulator_dtype: str = "float32"
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    cached_seconds: float = 0.0

    @property
    def unit_seconds(self) -> float | None:
        """One compile (as if JAX's persistent cache had not had it) plus `UNIT_STEPS` steps of this trial's
        program: a tune's cost unit (None unless this trial compiled and timed it)."""
        if self.compile_seconds is None or self.seconds is None:
            return None
        return self.compile_seconds + self.cached_seconds + UNIT_STEPS * self.seconds[1]


@dataclasses.dataclass(frozen=True)
class TuneResult(JsonMixin):
    """What `tune` returns.

    Attributes:
      plan: the best configuration, ready to `Plan.save`.
      trials: every trial of the study (earlier runs' too), fastest first as the trials measured them.
      race: the finalists re-timed side by side (`autoaccum._tune.race`), the winner (the plan) first.
      memory_limit_bytes: the limit every trial ran under (per device).
      peak_bytes: the plan's measured peak memory in its trial (per device; None where not measured; on the CPU
        resident memory, as `TrialRecord.peak_bytes`).
      probe: the probe's result, or ``None`` when a bound was given (``microbatch_bound``).
      study_name: the Optuna study (named after `fingerprint` unless given).
      storage: where the study lives (an RDB URL, or ``":memory:"``).
      fingerprint: a hash of what determines the answer (the lowered update, the device, the limit, the search
        space, the versions).
      resumed_trials: trials this study had settled in earlier runs (0 for a new study).
      new_trials: trials settled in this run.
      message: a one-line summary for people ("resumed: 12 trials from earlier runs, 0 new").
      bounds: per setting of the knobs (by its text, ``"remat=None"``), the microbatch bound before any trial:
        the probe's for the default setting, the calibrated estimate's for the others, or the bound given.
      predicted_over: per setting, the sizes within its bound left out: their accumulating step predicted over.
      update_fn: the plan's update, already compiled for the effective batch's shapes (not in the JSON); it
        donates the params and optimizer state it is called with (`autoaccum.build_update`'s ``donate=True``).
      init: ``init(params) -> opt_state`` for ``update_fn`` (not in the JSON).
      step: from `autoaccum.nnx.tune`, the plan as an nnx step ``loss = step(model, optimizer, batch)`` (not in
        the JSON).
      seconds: this run's wall time.
      phases: this run's seconds per phase (`PHASES`).
      units: ``seconds`` over one compile (uncached) plus five steps of the picked program (None where
        unmeasured): the tune's cost, whatever the machine's speed.
    """

    plan: Plan
    trials: tuple[TrialRecord, ...]
    race: tuple[Runner, ...]
    memory_limit_bytes: int | None
    peak_bytes: int | None
    probe: ProbeResult | None
    study_name: str
    storage: str
    fingerprint: str
    resumed_trials: int
    new_trials: int
    message: str
    bounds: dict[str, int] = dataclasses.field(default_factory=dict)
    predicted_over: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    update_fn: Update | None = dataclasses.field(metadata=NOT_JSON, default=None, repr=False, compare=False)
    init: Callable[[PyTree], PyTree] | None = dataclasses.field(
        metadata=NOT_JSON, default=None, repr=False, compare=False
    )
    step: Any = dataclasses.field(metadata=NOT_JSON, default=None, repr=False, compare=False)
    seconds: float = 0.0
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    units: float | None = None

    json_format = "autoaccum.tune/1"


PHASES = ("probe", "estimate", "worker_start", "compile", "steps", "failed", "race", "build")
"""The phases of a tune's wall time (`TuneResult.phases`)."""


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """Inside it, ``var`` holds ``value`` (`autoaccum._tune.trials.MEASURE`, `autoaccum._tune.run.PRECOMPILE`,
    `autoaccum._probe.LENT`)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


@dataclasses.dataclass
class Clock:
    """Seconds per phase of one tune (`PHASES`), from its start."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    seconds: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    started: Callable[[], float] = lambda: 0.0
    """The seconds the worker has spent starting so far (`autoaccum._worker.Worker.start_seconds`)."""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began, starts = time.perf_counter(), self.started()
        try:
            yield
        finally:
            self.spend(name, began, starts)

    def spend(self, name: str, began: float, starts: float, compiling: float = 0.0) -> None:
        """Adds the seconds since ``began`` to ``name``, but the worker's starts since (``starts`` then) and
        ``compiling`` seconds, which go to their own phases."""
        start = self.started() - starts
        self.seconds["worker_start"] += start
        self.seconds["compile"] += compiling
        self.seconds[name] += time.perf_counter() - began - start - compiling


def record(trial: optuna.trial.FrozenTrial, effective_batch: int, labels: dict[str, Any]) -> TrialRecord:
    """The `TrialRecord` of an Optuna trial of the space ``labels`` (`autoaccum._tune.space.variants`)."""
    m, label, attrs = int(trial.params.get("microbatch_size", 0)), trial.params.get("strategy", ""), trial.user_attrs
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    name, options = labels.get(label, (label, {}))
    reason = attrs.get("reason")
    if reason is None and trial.state == optuna.trial.TrialState.FAIL:
        reason = "did not finish: its process ended or was stopped mid-trial (killed, crashed); it settles nothing"
    return TrialRecord(
        number=trial.number, microbatch_size=m, accumulation_steps=-(-effective_batch // m) if m else 0, strategy=name,
        options=dict(options), throughput=trial.value if complete else None, state=trial.state.name,
        compile_seconds=attrs.get("compile_seconds"), reason=reason,
        same_program_as=attrs.get("same_program_as"), peak_bytes=attrs.get("peak_bytes"),
        seconds=quartiles(attrs["times"]) if complete and attrs.get("times") else None,
        remat=attrs.get("remat"), accumulator_dtype=attrs.get("accumulator_dtype", "float32"),
        knobs=dict(attrs.get("knobs") or {}), cached_seconds=attrs.get("cached_seconds", 0.0),
    )  # fmt: skip


def records(trials: Sequence[optuna.trial.FrozenTrial], eb: int, labels: dict[str, Any]) -> list[TrialRecord]:
    """The `TrialRecord` of every trial that ran its configuration (not a copy, not pruned, not interrupted: that
    configuration is queued again), fastest first."""
    skipped = {"duplicate_of", "interrupted"}
    kept = [t for t in trials if not skipped & t.user_attrs.keys() and t.state.name not in ("WAITING", "PRUNED")]
    out = [record(t, eb, labels) for t in kept]
    return sorted(out, key=lambda r: (r.throughput is None, -(r.throughput or 0.0), r.number))
