"""`tune`: bounds the microbatch (probe), searches and races configurations, and returns the fastest as a plan."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optuna

from autoaccum._deprecated import renamed
from autoaccum._device import detect_device, device_kind
from autoaccum._knobs import BUILTIN_REMAT, Knobs, KnobSpace, check_dtype_values, check_remat_values
from autoaccum._plan import Plan, opt_state_bytes, params_signature, versions
from autoaccum._preflight import loss_text
from autoaccum._probe import Setup, prepare
from autoaccum._storage import open_storage
from autoaccum._tune.job import Job, Space
from autoaccum._tune.race import ROUNDS, Runner
from autoaccum._tune.result import Clock, TrialRecord, TuneResult, records
from autoaccum._tune.search import Config
from autoaccum._tune.study import fingerprint, open_study, quiet_optuna, settled, settled_configs
from autoaccum._tune.trials import MEASURE, Trials, time_here, time_in_worker
from autoaccum._units import parse_bytes
from autoaccum._worker import Worker, time_update
from autoaccum.strategies import PyTree

PRECOMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("precompile", default=True)
"""Whether `tune` compiles the plan's update before it returns (the CLI, which never steps it, sets it False)."""


def _isolatable() -> bool:
    """Whether trials can run in a child process here: not on a TPU, which one process owns (a warning says so)."""
    info = detect_device()
    if info.platform != "tpu":
        return True
    warnings.warn(
        f"trials run in this process, not isolated: a child process cannot have {info.name} (one process owns a "
        "TPU); a trial that does not fit fails here. Pass isolate=False to say so and silence this.",
        UserWarning,
        stacklevel=4,
    )
    return False


def _callbacks(on_trial: Any) -> tuple[Callable[[TrialRecord, int, int], None], ...]:
    """``on_trial`` as a tuple of callables; a ``TypeError`` naming it otherwise (a bare callable included)."""
    if callable(on_trial) or not isinstance(on_trial, (list, tuple)) or not all(map(callable, on_trial)):
        raise TypeError(
            f"`on_trial` must be a list of callbacks, each `callback(record, done, total)`, got on_trial={on_trial!r};"
            " e.g. on_trial=[callback]."
        )
    return tuple(on_trial)


def _fingerprint(
    job: Job, limit: int | None, bound: int | None, timeouts: tuple[float | None, ...], isolated: bool
) -> str:
    """A hash of what determines a tune's answer: the lowered full-batch update (the loss's body, the optimizer,
    shapes, dtypes) and every other knob setting's lowered loss, the search's inputs, the time limits, the limit,
    whether trials run ``isolated`` under it, the device and the versions; nothing measured."""
    programs = job.programs(job.update(Config(job.effective_batch, job.names[0])))
    texts = [p.lowered.as_text() for p in programs]
    losses = {id(loss): loss for loss in map(job.loss_for, job.settings)}  # (settings may share a loss)
    losses.pop(id(job.loss_for(job.settings[0])))  # the default's: in the update above
    texts += [loss_text(loss, job.params, job.batch, job.state) for loss in losses.values()]
    if any(re.search(r"custom_call @\w*python\w*callback", text) for text in texts):
        warnings.warn(
            "the loss calls back into Python (jax.debug.callback, jax.pure_callback): the study's fingerprint holds "
            "the compiled program, not what the callback does; after changing the callback, tune with fresh=True "
            "(--fresh), or its earlier trials are reused.",
            UserWarning,
            stacklevel=4,
        )
    searched = {
        "strategies": list(job.labels), "knobs": job.knob_space.params(), "max_microbatch": bound,
        "min_microbatch": job.min_microbatch, "timeouts": list(timeouts),
    }  # fmt: skip
    return fingerprint(
        "\n".join(texts),
        {
            "effective_batch": job.effective_batch, "search": searched, "memory_limit": limit,
            **({} if isolated else {"isolated": False}),  # (so an isolated tune's study of an earlier release resumes)
            "device": device_kind(), "platform": jax.default_backend(), "versions": versions(),
        },
    )  # fmt: skip


def _worker(job: Job, setup: Setup, compile_timeout: float | None, step_timeout: float | None) -> Worker:
    """The worker that estimates and times configurations under the probe's limit; it makes each setting's loss
    from the knobs (the factory travels, pickled)."""
    knobs = job.loss_fn if isinstance(job.loss_fn, Knobs) else None
    worker_job = setup.job if knobs is None else dataclasses.replace(setup.job, loss_fn=knobs)  # type: ignore[arg-type]
    return Worker(
        worker_job, setup.device, setup.memory_limit_bytes, compile_timeout=compile_timeout, step_timeout=step_timeout,
        settings=[s.values for s in job.settings],
    )  # fmt: skip


def _result(job: Job, space: Space, study: optuna.Study, runners: list[Runner], limit: int | None) -> TuneResult:
    """The plan (the race's winner, else the fastest trial), its update compiled from shapes unless `PRECOMPILE`
    is off (its step ran in the worker), and every trial that ran, fastest first."""
    eb, trials = job.effective_batch, study.get_trials(deepcopy=False)
    ran = records(trials, eb, job.labels)
    completed = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    if not completed:
        reasons = "; ".join(f"#{r.number} {r.reason}" for r in ran if r.reason)[:500]
        memory = all((r.reason or "").startswith("out of memory") for r in ran)
        fix = (
            "lower the effective batch or raise `memory_limit`"
            if memory
            else ("each reason is the trial's own (the loss's error, a crash, a step over `trial_timeout`): fix it")
        )
        raise RuntimeError(f"every trial failed ({reasons}); {fix}.")
    top = max(completed, key=lambda t: float(t.value))  # type: ignore[arg-type]
    throughput = float(top.value)  # type: ignore[arg-type]
    if runners:  # the race's winner, at the median of every step it was timed
        top = next(t for t in trials if t.number == runners[0].trial)
        throughput = eb / runners[0].quartiles[1]
    strategy, options = job.labels[top.params["strategy"]]
    chosen = job.knob_space.setting_of(top.params)
    m = int(top.params["microbatch_size"])
    plan = Plan(
        effective_batch=eb, microbatch_size=m, accumulation_steps=-(-eb // m), strategy=strategy,
        options=dict(options), throughput=throughput, device=device_kind(), **job.loss_kw,
        accumulator_dtype=chosen.accumulator_dtype, remat=chosen.remat, knobs=chosen.values,
        params=params_signature(job.params), versions=versions(),
        opt_state_bytes=opt_state_bytes(job.optimizer, job.params),
    )  # fmt: skip
    update_fn = plan.build(job.loss_fn, job.optimizer)  # keeps the executables: the first call compiles nothing
    if PRECOMPILE.get():
        for program in job.programs(update_fn):
            program.lowered.compile()
    return TuneResult(
        plan=plan, trials=tuple(ran), race=tuple(runners), memory_limit_bytes=limit,
        peak_bytes=top.user_attrs.get("peak_bytes"), probe=space.probed, study_name=study.study_name, storage="",
        fingerprint="", resumed_trials=0, new_trials=0, message="",
        bounds={str(setting): bound for setting, bound in zip(job.settings, space.bounds, strict=True)},
        predicted_over=space.predicted_over, update_fn=update_fn, init=update_fn.init,
    )  # fmt: skip


def _summary(
    result: TuneResult, resumed: int, new: int, seconds: float, untimed: list[str], unsearched: list[str]
) -> dict[str, Any]:
    """The result's message (naming the knob settings ``untimed`` and the configurations the search would have timed
    next, ``unsearched``), and its cost in units: ``seconds`` over one compile plus five steps of the pick (its
    compile as if JAX's persistent cache had not had it)."""
    message = f"new study {result.study_name}: {new} trials"
    if resumed:
        message = f"resumed: {resumed} trials from earlier runs, {new} new (study {result.study_name}; pass fresh=True"
        message += " to start over)"
    if untimed:
        message += f"; knob settings not timed within the budget: {'; '.join(untimed)} (a larger budget times them)"
    if unsearched:
        message += (
            f"; the search stopped before it finished: it would time {', '.join(unsearched[:3])}"
            f"{' and more' if len(unsearched) > 3 else ''} next (a larger `budget` or `timeout` times them)"
        )
    number = result.race[0].trial if result.race else result.trials[0].number
    pick = next(r for r in result.trials if r.number == number)
    units = None if pick.unit_seconds is None else seconds / pick.unit_seconds
    return dict(resumed_trials=resumed, new_trials=new, message=message, seconds=seconds, units=units)


@quiet_optuna()
def tune(
    loss_fn: Callable[..., Any] | Knobs,
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation,
    effective_batch: int | None = None,
    strategies: Sequence[str] | None = None,
    memory_limit: int | str | None = None,
    budget: int | None = None,
    timeout: float | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
    fresh: bool = False,
    seed: int = 0,
    has_aux: bool = False,
    state: PyTree | None = None,
    loss_reduction: str = "mean",
    accumulator_dtype: Any | Sequence[Any] = jnp.float32,
    microbatch_bound: int | None = None,
    min_microbatch: int = 1,
    remat: Sequence[str | None] = BUILTIN_REMAT,
    trial_timeout: float | None = 120.0,
    compile_timeout: float | None = 600.0,
    isolate: bool | None = None,
    race_rounds: int = ROUNDS,
    on_trial: Sequence[Callable[[TrialRecord, int, int], None]] = (),
    n_trials: int | None = None,
    callbacks: Sequence[Callable[[TrialRecord, int, int], None]] | None = None,
    max_microbatch: int | None = None,
) -> TuneResult:
    """Finds the microbatch size, accumulation strategy and knobs with the highest measured throughput.

    The probe bounds the microbatch for the default knob setting (each knob's first value), the calibrated
    compile-only estimate the others. Real update steps at the effective batch are timed in an isolated worker:
    the whole space when it is small, else what the search proposes (`autoaccum._tune.search`); the finalists
    then race side by side for the pick. The study lives in ``storage`` under a fingerprint of the inputs:
    re-running returns its plan without timing anything, an interrupted tune resumes, several processes share
    one study and one budget and return the same plan, and a changed loss or optimizer starts a new study.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss (``-> (loss, aux)`` with ``has_aux``), or an
        `autoaccum.Knobs` whose factory makes it for each value of the loss's own knobs (``plan.knobs``).
      params: the parameters; tune never donates or changes them (trials work on copies); the returned
        ``update_fn`` donates what it is called with, as `autoaccum.build_update`'s does.
      batch: an example batch; its leading size is the default effective batch.
      optimizer: the optax optimizer training uses (required: its state is part of the memory).
      effective_batch: examples per update; may exceed the batch's size (rows are then repeated).
      strategies: strategy names to consider, the first probed; default: all of
        ``autoaccum.strategies.available()``, the one ``"auto"`` picks here first.
      memory_limit: bytes (or ``"1.5GiB"``) a step may use; default: the device's (`autoaccum.probe`).
      budget: the configurations the study settles (measured, or failed: out of memory, timed out), earlier
        runs' and other workers' included. Default: the whole space if it has at most `EXHAUSTIVE_UP_TO` points
        (`autoaccum._tune.trials`), else until the search stops; a larger budget is spent by TPE after the search.
      timeout: stop starting new trials (and waiting for other workers' trials) after this many seconds of the
        search, counted once the probe has bounded the sizes; the race and the build come after.
      storage: an RDB URL (default: SQLite at `autoaccum._storage.default_storage`; several hosts:
        ``"postgresql+psycopg://user@host/db"``), ``":memory:"`` or an optuna storage.
      study_name: default: ``"autoaccum-"`` + the fingerprint, so re-running the same tune resumes its study; a
        name whose study holds another fingerprint's trials is refused (``fresh=True`` starts it over).
      fresh: start the study anew, deleting earlier trials of the same name.
      seed: the sampler's seed.
      has_aux, state, loss_reduction: as for `autoaccum.build_update` (``state``: its ``has_state``; trials and
        the returned update start from copies of it).
      accumulator_dtype: the dtype gradients accumulate in, or a tuple of dtypes to search, the first probed.
      microbatch_bound: a known bound on the microbatch: skip the probe and time no size above it.
      min_microbatch: no trial (and no probe trial) runs a smaller microbatch, an uneven split's last one
        included; set it where a smaller one changes the model, not just the speed (BatchNorm in training mode).
      remat: the remat policies to search (`autoaccum.build_update`'s ``remat``, None: off), the first probed.
      trial_timeout, compile_timeout: seconds a trial's steps, and its compiling (or the worker's start), may take
        before it is recorded as failed (the worker restarts); in the probe, before the tune ends (`ProbeError`).
      isolate: probe and time in a worker process under the memory limit (`autoaccum._worker`); ``False``: in
        this process, with no cap. Default: isolated, except on a TPU (a warning says so).
      race_rounds: timings per finalist of the race before the pick (`autoaccum._tune.race`; 0: no race).
      on_trial: ``callback(record, done, total)`` after each trial: its `TrialRecord`, the configurations settled
        so far and the most the study settles.
      n_trials, callbacks, max_microbatch: deprecated names of ``budget``, ``on_trial`` and ``microbatch_bound``.

    Returns:
      A `TuneResult` whose ``update_fn`` is already compiled.

    Raises:
      ValueError, TypeError: bad arguments or an unopenable storage, before any trial runs.
      RuntimeError: nothing fits (the probe found no microbatch) or every trial failed.
      autoaccum.ProbeError: a probe's trial failed for another reason than memory (a crash, an error, a hang): the
        step at the probed size does not run, whatever its speed.
    """
    clock = Clock()
    budget = renamed("budget", budget, "n_trials", n_trials, stacklevel=4)
    on_trial = _callbacks(renamed("on_trial", on_trial, "callbacks", callbacks, default=(), stacklevel=4))
    bound = renamed("microbatch_bound", microbatch_bound, "max_microbatch", max_microbatch, stacklevel=4)
    children = _isolatable() if isolate is None else bool(isolate) or detect_device().platform != "tpu"
    isolate = children if isolate is None else isolate
    knobs = loss_fn if isinstance(loss_fn, Knobs) else None
    knob_space = KnobSpace(check_remat_values(remat), check_dtype_values(accumulator_dtype), knobs)
    job = Job.check(
        loss_fn, params, batch, optimizer=optimizer, effective_batch=effective_batch, strategies=strategies,
        memory_limit=memory_limit, budget=budget, timeout=timeout, fresh=fresh, has_aux=has_aux, state=state,
        loss_reduction=loss_reduction, microbatch_bound=bound, min_microbatch=min_microbatch,
        trial_timeout=trial_timeout, compile_timeout=compile_timeout, isolate=isolate, children=children,
        race_rounds=race_rounds, knob_space=knob_space, seed=seed,
    )  # fmt: skip
    setup = None  # the worker's job and limit: the probe's, checked before anything runs
    measure = MEASURE.get()  # tests time with a stand-in (`autoaccum._tune.trials.timed_by`)
    if measure is None and isolate:
        default = job.settings[0]
        setup = prepare(
            job.loss_for(default), params, batch, optimizer=optimizer, strategy=job.names[0], memory_limit=memory_limit,
            microbatch_cap=job.effective_batch, has_aux=has_aux, state=state, loss_reduction=loss_reduction,
            options={"accumulator_dtype": default.accumulator_dtype},
        )  # fmt: skip
    opened, storage_label = open_storage(storage)
    limit = None if memory_limit is None else parse_bytes(memory_limit, "memory_limit")
    limit = limit if setup is None else setup.memory_limit_bytes
    key = _fingerprint(job, limit, bound, (trial_timeout, compile_timeout), isolated=setup is not None)
    with contextlib.ExitStack() as stack:
        worker = None if setup is None else stack.enter_context(_worker(job, setup, compile_timeout, trial_timeout))
        if worker is not None:
            clock.started = functools.partial(getattr, worker, "start_seconds")
        bounded = functools.partial(Space.bound, job, bound, clock, worker)
        study, space, probed_here = open_study(opened, study_name or f"autoaccum-{key}", key, fresh, bounded)
        resumed = len(settled_configs(study))
        timer = measure or functools.partial(time_update, time_limit=trial_timeout)
        time_one = time_here(job, timer) if worker is None else time_in_worker(job, worker)
        trials = Trials.start(job, space, study, budget, seed, time_one, on_trial, clock)
        if probed_here and worker is not None:  # its runs were the tuner's, in this worker
            trials.record_probe()
        beats = isinstance(opened, optuna.storages.RDBStorage) and opened.get_heartbeat_interval() is not None
        trials.run(timeout, opened, beats)  # (without heartbeats, another host's dead worker is never noticed)
        unsearched = [f"{c.microbatch_size} x {c.strategy}" + f" ({job.settings[c.setting]})" * (c.setting > 0)
                      for c in trials.proposed()]  # fmt: skip
        with clock.phase("race"):
            runners = trials.race(race_rounds)
    if setup is None and space.probed is not None:
        limit = space.probed.memory_limit_bytes
    with clock.phase("build"):
        result = _result(job, space, study, runners, limit)
    timed = {job.config_of(t.params).setting for t in study.get_trials(deepcopy=False) if settled(t)}
    untimed = [str(setting) for i, setting in enumerate(job.settings) if i not in timed]
    seconds = time.perf_counter() - clock.start
    summary = _summary(result, resumed, trials.settled_here(), seconds, untimed, unsearched)
    return dataclasses.replace(result, storage=storage_label, fingerprint=key, phases=dict(clock.seconds), **summary)
