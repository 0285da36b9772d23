"""What the tuner returns: one `TrialRecord` per trial and the `TuneResult`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optuna

from autoaccum._json import NOT_JSON, JsonMixin
from autoaccum._plan import Plan
from autoaccum._probe import ProbeResult
from autoaccum._tune.race import Runner, quartiles
from autoaccum._update import Update
from autoaccum.strategies import PyTree


@dataclasses.dataclass(frozen=True)
class TrialRecord(JsonMixin):
    """One tuning trial.

    Attributes:
      number: Optuna's trial number.
      microbatch_size, accumulation_steps, strategy, options: the configuration.
      throughput: measured examples per second (``None`` unless the trial completed).
      compile_seconds: the first (compiling) call's duration (``None`` if unknown).
      state: Optuna's trial state name (``COMPLETE``, ``FAIL``, ``RUNNING``, ...).
      reason: why it failed, if it did.
      same_program_as: the trial whose timing this one reuses, the same program timed once: with one
        accumulation step every strategy runs the plain step; scan unrolled at least as many times as there are
        steps runs them all unrolled (`autoaccum._tune.space.program_key`).
      seconds: ``(q1, median, q3)`` of the trial's step times, in seconds (None unless it completed);
        ``throughput`` is the effective batch over the median.
      peak_bytes: the trial's peak memory per device, in the timing worker (`autoaccum._tune.worker`): on the
        CPU the resident memory the trial touched; on a GPU XLA's ``peak_bytes_in_use`` when it rose during the
        trial, else (an earlier trial or the compiler's autotuning peaked higher) the live bytes once the inputs
        were made plus the step's largest program's buffers. None when timed in this process.
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


@dataclasses.dataclass(frozen=True)
class TuneResult(JsonMixin):
    """What `tune` returns.

    Attributes:
      plan: the best configuration, ready to `Plan.save`.
      trials: every trial of the study (earlier runs' too when it was resumed), best first (as the study
        measured them; the race may then reorder the best few).
      race: the finalists re-timed side by side (`autoaccum._tune.race`), the winner (the plan) first; empty
        when there was no race (one measured configuration, or ``race_rounds=0``).
      memory_limit_bytes: the limit every trial ran under (per device).
      peak_bytes: the plan's measured peak memory in its trial (per device; None where not measured).
      probe: the probe's result, or ``None`` when a bound was given (``max_microbatch``).
      study_name: the Optuna study (named after `fingerprint` unless given).
      storage: where the study lives (an RDB URL, or ``":memory:"``).
      fingerprint: a hash of what determines the timings (the lowered update program, hence the loss's body,
        the optimizer, shapes, dtypes and options; the device, the memory limit, the search space and the
        library versions): a changed loss or optimizer never resumes an old study.
      resumed_trials: trials this study had settled in earlier runs (0 for a new study).
      new_trials: trials settled in this run.
      message: a one-line summary for people ("resumed: 12 trials from earlier runs, 0 new").
      bounds: the microbatch bound of each setting of the knobs before any trial (``"remat=None"``, or with the loss's
        own knobs ``"remat=None, block_remat='dots_saveable'"``): the probe's for the default setting, the
        calibrated compile-only estimate's for the others (`autoaccum.ProbeResult.bound_for`), or the
        ``max_microbatch`` given. Below it, a size whose accumulating step is predicted over the limit
        (`autoaccum.ProbeResult.predicted_peak`) is not timed either; a strategy whose accumulating step ran out
        of memory at a size below it is not timed at that size or above again.
      predicted_over: per setting of the knobs (as in ``bounds``), the candidate sizes within its bound that were
        not timed because their accumulating step is predicted over the limit (empty when none).
      update_fn: the plan's update, already compiled for the effective batch's shapes (not in the JSON).
      init: ``init(params) -> opt_state`` for ``update_fn`` (not in the JSON).
      step: from `autoaccum.nnx.tune`, the plan as an nnx step, ``loss = step(model, optimizer, batch)``
        (not in the JSON; None otherwise).
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

    json_format = "autoaccum.tune/1"


def record(trial: optuna.trial.FrozenTrial, effective_batch: int, labels: dict[str, Any]) -> TrialRecord:
    """The `TrialRecord` of an Optuna trial of the space ``labels`` (`autoaccum._tune.space.variants`)."""
    m = int(trial.params.get("microbatch_size", 0))
    label = trial.params.get("strategy", "")
    complete = trial.state == optuna.trial.TrialState.COMPLETE
    times = trial.user_attrs.get("times")
    name, options = labels.get(label, (label, {}))
    return TrialRecord(
        number=trial.number,
        microbatch_size=m,
        accumulation_steps=-(-effective_batch // m) if m else 0,
        strategy=name,
        options=dict(options),
        throughput=trial.value if trial.state == optuna.trial.TrialState.COMPLETE else None,
        compile_seconds=trial.user_attrs.get("compile_seconds"),
        state=trial.state.name,
        reason=trial.user_attrs.get("reason"),
        same_program_as=trial.user_attrs.get("same_program_as"),
        seconds=quartiles(times) if complete and times else None,
        peak_bytes=trial.user_attrs.get("peak_bytes"),
        remat=trial.user_attrs.get("remat"),
        accumulator_dtype=trial.user_attrs.get("accumulator_dtype", "float32"),
        knobs=dict(trial.user_attrs.get("knobs") or {}),
    )
