"""`tune`: Optuna picks the microbatch size and the accumulation strategy that maximise measured throughput."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optuna

from autoaccum._batch import abstract, abstract_batch, resize_batch
from autoaccum._deprecated import renamed
from autoaccum._device import detect_device
from autoaccum._knobs import BUILTIN_REMAT, Knobs, KnobSpace, check_dtype_values, check_remat_values
from autoaccum._plan import Plan, params_signature
from autoaccum._probe import prepare
from autoaccum._storage import open_storage
from autoaccum._tune.job import Job, Space
from autoaccum._tune.race import ROUNDS, Runner
from autoaccum._tune.result import Clock, TrialRecord, TuneResult, record
from autoaccum._tune.search import Config, Search
from autoaccum._tune.space import program_key
from autoaccum._tune.study import fingerprint, quiet_optuna
from autoaccum._tune.trials import MEASURE, Trials, config_key, settled_configs, time_here, time_in_worker
from autoaccum._units import parse_bytes
from autoaccum._update import build_update
from autoaccum._version import __version__
from autoaccum._worker import Worker, time_update
from autoaccum.strategies import PyTree

EXHAUSTIVE_UP_TO = 8
"""Without ``budget``, a space of at most this many configurations is searched whole (``GridSampler``); a larger
one until the search proposes nothing more (`autoaccum._tune.search`)."""


PRECOMPILE: contextvars.ContextVar[bool] = contextvars.ContextVar("precompile", default=True)
"""Whether `tune` compiles the plan's update before it returns (the CLI, which never steps it, sets it False)."""

_WAITING = optuna.trial.TrialState.WAITING
_PRUNED = optuna.trial.TrialState.PRUNED


def _renamed(
    budget: int | None, n_trials: int | None, on_trial: Sequence[Any], callbacks: Sequence[Any] | None
) -> tuple[int | None, Sequence[Any]]:
    """``budget`` and ``on_trial``, given by their deprecated names (a `DeprecationWarning`) or their own."""
    budget = renamed("budget", budget, "n_trials", n_trials, stacklevel=4)
    return budget, renamed("on_trial", on_trial, "callbacks", callbacks, default=(), stacklevel=4)


def _isolatable() -> bool:
    """Whether trials can run in a child process here: not on a TPU, which one process owns (a warning says so)."""
    info = detect_device()
    if info.platform != "tpu":
        return True
    warnings.warn(
        f"trials run in this process, not isolated: a child process cannot have {info.name} (one process owns a "
        "TPU); a trial that does not fit fails here. Pass isolate=False to say so and silence this.",
        UserWarning,
        stacklevel=3,
    )
    return False


def _heartbeats(storage: optuna.storages.BaseStorage) -> bool:
    """Whether a dead worker's running trial is ever noticed (an RDB storage with heartbeats)."""
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None


def _versions() -> dict[str, str]:
    import flax
    import jaxlib

    return {
        "autoaccum": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
        "flax": flax.__version__, "optuna": optuna.__version__,
    }  # fmt: skip


def _program(job: Job, config: Config) -> tuple[Any, ...]:
    """What ``config`` compiles to (configurations with equal keys are timed once)."""
    return (config.setting, program_key(config.microbatch_size, job.labels[config.strategy], job.effective_batch))


def _full_batch(job: Job) -> PyTree:
    """The example batch resized to the effective batch (rows repeated); on a mesh, laid out as given."""
    batch = job.batch
    if job.effective_batch == jax.tree.leaves(batch)[0].shape[0]:
        return batch
    if job.layout is None:
        return resize_batch(batch, job.effective_batch)
    resized = resize_batch(jax.device_get(batch), job.effective_batch)
    return jax.tree.map(lambda r, x: jax.device_put(r, x.sharding), resized, batch)


def _fingerprint(job: Job, limit: int | None, bound: int | None) -> str:
    """A hash of what determines a tune's answer: the lowered full-batch update (the loss's body, the optimizer,
    shapes, dtypes) and the search's inputs (the limit as resolved, the strategies, the knobs, the bounds given),
    the device and the versions. Nothing measured is in it, so a finished study is found before anything runs."""
    default = job.settings[0]
    plain = build_update(
        job.loss_for(default), job.optimizer, microbatch_size=job.effective_batch, strategy=job.names[0],
        **default.build, **job.loss_kw,
    )  # fmt: skip
    params_s = abstract(job.params)
    state_s = () if job.state is None else (abstract(job.state),)
    batch_s = abstract_batch(job.batch, job.effective_batch)
    programs = plain.programs(params_s, jax.eval_shape(plain.init, params_s), batch_s, *state_s)
    searched = {
        "strategies": list(job.labels), "knobs": job.knob_space.params(), "max_microbatch": bound,
        "min_microbatch": job.min_microbatch,
    }  # fmt: skip
    return fingerprint(
        "\n".join(p.lowered.as_text() for p in programs),
        {
            "effective_batch": job.effective_batch, "search": searched, "memory_limit": limit,
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "versions": _versions(),
        },
    )  # fmt: skip


def _open_study(
    job: Job,
    storage: optuna.storages.BaseStorage,
    name: str,
    fresh: bool,
    bound: int | None,
    clock: Clock,
    worker: Worker | None,
) -> tuple[optuna.Study, Space]:
    """The study ``name`` (created, or resumed) and the sizes each setting may time: stored with the study by the
    worker that bounded them first (the probe runs once per study), else bounded now (`Space.bound`). A trial
    interrupted earlier is queued again."""
    if fresh:
        with contextlib.suppress(KeyError):  # no such study yet: nothing to delete
            optuna.delete_study(study_name=name, storage=storage)
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
    with warnings.catch_warnings():  # "experimental" in some Optuna releases
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["examples/s"])  # what a dashboard labels the value
    stored = study.user_attrs.get("space")
    if stored is None:
        space = Space.bound(job, bound, clock, worker)
        stored = study.user_attrs.get("space")  # another worker's, if it finished first
        if stored is None:
            study.set_user_attr("space", space.to_dict(job.settings))
    if stored is not None:
        space = Space.from_dict(stored, job.settings)
    _resume(study)
    return study, space


def _worker(job: Job, setup: Any, compile_timeout: float | None, step_timeout: float | None) -> Worker:
    """The worker that estimates and times the tune's configurations under the probe's limit; it makes each
    setting's loss from the knobs (the factory travels, pickled)."""
    worker_job = setup.job if job.knobs is None else dataclasses.replace(setup.job, loss_fn=job.knobs)
    return Worker(
        worker_job, setup.device, setup.memory_limit_bytes, compile_timeout=compile_timeout, step_timeout=step_timeout,
        settings=[s.values for s in job.settings],
    )  # fmt: skip


def _sample(job: Job, space: Space, study: optuna.Study, seed: int, budget: int | None) -> tuple[int, bool, bool]:
    """Gives ``study`` its sampler: the grid's where the budget covers the grid (or, without one, the grid is at
    most `EXHAUSTIVE_UP_TO`), else a seeded TPE (constant_liar: other workers' running trials count as bad ones).
    Returns the configurations the study may settle, whether the grid is searched whole, and whether the tune
    stops where the search does (no budget given: the sampler spends nothing)."""
    labels = job.labels
    grid_points = sum(len(sizes) for sizes in space.fitting.values()) * len(labels)
    exhaustive = grid_points <= EXHAUSTIVE_UP_TO if budget is None else budget >= grid_points
    if exhaustive:
        space_params: dict[str, list[Any]] = {"microbatch_size": space.sizes, "strategy": list(labels)}
        space_params.update(job.knob_space.params())
        study.sampler = optuna.samplers.GridSampler(space_params, seed=seed)
    else:
        with warnings.catch_warnings():  # "experimental" in some Optuna releases
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            startup = min(len(labels) + 2, 8)
            study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)
    return min(budget or grid_points, grid_points), exhaustive, budget is None and not exhaustive


def _resume(study: optuna.Study) -> None:
    """Queues again the trials interrupted by Ctrl-C (one killed outright stays RUNNING until its heartbeat goes
    stale; then Optuna's RetryHeartbeatStaleTrialCallback queues it again)."""
    trials = study.get_trials(deepcopy=False)
    earlier = settled_configs(study)
    queued = {config_key(t.params) for t in trials if t.state == _WAITING}
    for t in trials:
        if t.user_attrs.get("interrupted") and config_key(t.params) not in earlier.keys() | queued:
            study.enqueue_trial(t.params)
            queued.add(config_key(t.params))


def _result(
    job: Job, space: Space, study: optuna.Study, runners: list[Runner], full_batch: PyTree, limit: int | None
) -> TuneResult:
    """The plan (the race's winner, else the fastest trial), compiled here from shapes (nothing runs: its step ran
    in the worker), and every settled trial, fastest first."""
    eb, labels = job.effective_batch, job.labels
    records = sorted(
        (
            record(t, eb, labels)
            for t in study.get_trials(deepcopy=False)
            if "duplicate_of" not in t.user_attrs and t.state not in (_WAITING, _PRUNED)
        ),
        key=lambda r: (r.throughput is None, -(r.throughput or 0.0), r.number),
    )
    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not completed:
        reasons = "; ".join(f"#{r.number} {r.reason}" for r in records if r.reason)[:500]
        raise RuntimeError(f"every trial failed ({reasons}); lower the effective batch or raise `memory_limit`.")
    top = max(completed, key=lambda t: float(t.value))  # type: ignore[arg-type]
    throughput = float(top.value)  # type: ignore[arg-type]
    if runners:  # the race's winner, at the median of every step it was timed
        top = next(t for t in study.get_trials(deepcopy=False) if t.number == runners[0].trial)
        throughput = eb / runners[0].quartiles[1]
    if study.user_attrs.get("plan_trial") != top.number:
        study.set_user_attr("plan_trial", top.number)  # the plan's trial, for whoever looks at the study
    strategy, options = labels[top.params["strategy"]]
    chosen = job.knob_space.setting_of(top.params)
    m = int(top.params["microbatch_size"])
    plan = Plan(
        effective_batch=eb, microbatch_size=m, accumulation_steps=-(-eb // m), strategy=strategy,
        options=dict(options), throughput=throughput, device=jax.devices()[0].device_kind, **job.loss_kw,
        accumulator_dtype=chosen.accumulator_dtype, remat=chosen.remat, knobs=chosen.values,
        params=params_signature(job.params), versions=_versions(),
    )  # fmt: skip
    # The jitted functions keep the executables, so the caller's first call does not compile again.
    update_fn = plan.build(job.loss_fn, job.optimizer)
    if PRECOMPILE.get():
        params_a = abstract(job.params)
        state_s = () if job.state is None else (abstract(job.state),)
        batch_s = abstract_batch(full_batch, eb)
        for program in update_fn.programs(params_a, jax.eval_shape(update_fn.init, params_a), batch_s, *state_s):
            program.lowered.compile()
    name = study.study_name
    return TuneResult(
        plan=plan, trials=tuple(records), race=tuple(runners), memory_limit_bytes=limit,
        peak_bytes=top.user_attrs.get("peak_bytes"), probe=space.probed, study_name=name, storage="",
        fingerprint="", resumed_trials=0, new_trials=0, message="",
        bounds={str(setting): bound for setting, bound in space.bounds.items()},
        predicted_over=space.predicted_over, update_fn=update_fn, init=update_fn.init,
    )  # fmt: skip


def _units(result: TuneResult, runners: list[Runner], seconds: float) -> float | None:
    """``seconds`` over one compile plus five steps of the picked program, as its trial measured them."""
    number = runners[0].trial if runners else result.trials[0].number
    pick = next(r for r in result.trials if r.number == number)
    if pick.compile_seconds is None or pick.seconds is None:
        return None
    return seconds / (pick.compile_seconds + 5 * pick.seconds[1])


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

    The probe bounds the microbatch for the default knob setting (each knob's first value); the compile-only
    estimate, calibrated by the probe, bounds the others and leaves out sizes whose accumulating step it predicts
    over the limit. Real update steps at the effective batch are then timed in an isolated worker: the whole
    space when it is small, else what the search proposes (`autoaccum._tune.search`), and the finalists race side
    by side for the pick. Trials that run out of memory or time out are recorded as failed. The study lives in
    ``storage`` under a fingerprint of the inputs (`TuneResult.fingerprint`): re-running returns its plan without
    timing anything, an interrupted tune resumes, several processes (one per host) share one study and one
    budget and return the same plan, and a changed loss or optimizer starts a new study.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss (``-> (loss, aux)`` with ``has_aux``), or an
        `autoaccum.Knobs` whose factory makes it for each value of the loss's own knobs (the plan records
        the values picked in ``plan.knobs``).
      params: the parameters; never donated or changed (trials work on copies).
      batch: an example batch; its leading size is the default effective batch.
      optimizer: the optax optimizer training uses (required: its state is part of the memory).
      effective_batch: examples per update; may exceed the batch's size (rows are then repeated).
      strategies: strategy names to consider, the first probed; default all of
        ``autoaccum.strategies.available()``, the one ``"auto"`` picks here (`autoaccum.build_update`'s default)
        first.
      memory_limit: bytes (or ``"1.5GiB"``) a step may use, passed to the probe; default: the device's
        (`autoaccum.probe`).
      budget: the configurations the study settles (measured, or failed: out of memory, timed out), earlier
        runs' and other workers' included. Default: the whole space if it has at most `EXHAUSTIVE_UP_TO` points,
        else until the search stops; a larger budget is spent by Optuna's TPE sampler after the search.
      timeout: stop starting new trials (and waiting for other workers' trials) after this many seconds.
      storage: an RDB URL (default: SQLite at `autoaccum._storage.default_storage`; several hosts:
        ``"postgresql+psycopg://user@host/db"``), ``":memory:"`` or an optuna storage (e.g. an
        ``optuna.storages.RDBStorage`` with other heartbeat timings).
      study_name: default: ``"autoaccum-"`` + the fingerprint, so re-running the same tune resumes its study.
      fresh: start the study anew, deleting earlier trials of the same name.
      seed: the sampler's seed.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      state: the model state, when ``loss_fn(params, batch, state) -> (loss, state)`` takes one, as
        `autoaccum.build_update`'s ``has_state`` (trials and the returned update start from copies of it).
      loss_reduction: ``"mean"`` or ``"sum"`` (``loss_fn`` returns ``(loss_sum, weight)``), as for
        `autoaccum.build_update`.
      accumulator_dtype: the dtype gradients accumulate in, as for `autoaccum.build_update`, or a tuple of dtypes
        to search as a knob, the first probed (e.g. ``(jnp.float32, jnp.bfloat16)``).
      microbatch_bound: a known bound on the microbatch: skip the probe and time no size above it (for every
        setting of the knobs).
      min_microbatch: a floor: no trial (and no probe trial) runs a smaller microbatch. Set it where a smaller
        microbatch changes the model, not just the speed (BatchNorm in training mode normalises each microbatch by
        its own statistics).
      remat: the remat policies to search (`autoaccum.build_update`'s ``remat``, None: off), the first one
        probed; default `autoaccum._knobs.BUILTIN_REMAT`.
      trial_timeout: seconds a trial's steps (warm-up and timed) may take before the trial is recorded as failed
        (a hang: the worker is killed and restarted).
      compile_timeout: seconds a trial's compiling may take, likewise.
      isolate: probe and time each configuration in a worker process under the memory limit (`autoaccum._worker`):
        an out-of-memory, a crash or a hang is the trial's failure and the worker restarts. ``False``: in this
        process, with no cap. Default: isolated, except on a TPU (one process owns it; a warning says so).
      race_rounds: timings per finalist of the race before the pick (`autoaccum._tune.race`; 0: no race).
      on_trial: ``callback(record, done, total)`` after each trial: its `TrialRecord`, the configurations settled
        so far and the most the study settles.
      n_trials, callbacks: deprecated names of ``budget`` and ``on_trial`` (in Optuna they mean this worker's
        trials and ``callback(study, trial)``).
      max_microbatch: deprecated name of ``microbatch_bound``.

    Returns:
      A `TuneResult` whose ``update_fn`` is already compiled.

    Raises:
      ValueError, TypeError: bad arguments or an unopenable storage, before any trial runs.
      RuntimeError: nothing fits (the probe found no microbatch) or every trial failed.
    """
    clock = Clock()
    budget, on_trial = _renamed(budget, n_trials, on_trial, callbacks)
    bound = renamed("microbatch_bound", microbatch_bound, "max_microbatch", max_microbatch)
    children = _isolatable() if isolate is None else bool(isolate) or detect_device().platform != "tpu"
    isolate = children if isolate is None else isolate
    knobs = loss_fn if isinstance(loss_fn, Knobs) else None
    job = Job.check(
        loss_fn, params, batch, optimizer=optimizer, effective_batch=effective_batch, strategies=strategies,
        memory_limit=memory_limit, budget=budget, timeout=timeout, fresh=fresh, has_aux=has_aux, state=state,
        loss_reduction=loss_reduction, microbatch_bound=bound, min_microbatch=min_microbatch,
        trial_timeout=trial_timeout, compile_timeout=compile_timeout, isolate=isolate, children=children,
        race_rounds=race_rounds,
        knob_space=KnobSpace(check_remat_values(remat), check_dtype_values(accumulator_dtype), knobs),
    )  # fmt: skip
    # The worker's job and limit: the probe's (checked here, before anything runs); on a mesh, the worker sees it.
    setup = None
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
    key = _fingerprint(job, limit, bound)
    full_batch = _full_batch(job)
    with contextlib.ExitStack() as stack:
        worker = None if setup is None else stack.enter_context(_worker(job, setup, compile_timeout, trial_timeout))
        if worker is not None:
            clock.started = functools.partial(getattr, worker, "start_seconds")
        study, space = _open_study(job, opened, study_name or f"autoaccum-{key}", fresh, bound, clock, worker)
        settles, exhaustive, searched_only = _sample(job, space, study, seed, budget)
        resumed = len(settled_configs(study))
        if worker is None:
            timer = measure or functools.partial(time_update, time_limit=trial_timeout)
            time_one = time_here(job, timer, full_batch)
        else:
            time_one = time_in_worker(job, worker, worker.limit)
        search = None if exhaustive else Search([space.fitting[s] for s in job.settings], list(job.labels),
                                                 job.effective_batch, functools.partial(_program, job))  # fmt: skip
        trials = Trials(job, space, study, settles, search, time_one, on_trial, searched_only, clock)
        trials.run(timeout, _heartbeats(opened))
        with clock.phase("race"):
            runners = trials.race(race_rounds)
    if setup is None and space.probed is not None:
        limit = space.probed.memory_limit_bytes
    with clock.phase("build"):
        result = _result(job, space, study, runners, full_batch, limit)
    new = len(settled_configs(study)) - resumed
    name = study.study_name
    message = f"new study {name}: {new} trials"
    if resumed:
        message = (
            f"resumed: {resumed} trials from earlier runs, {new} new (study {name}; pass fresh=True to start over)"
        )
    seconds = time.perf_counter() - clock.start
    return dataclasses.replace(
        result, storage=storage_label, fingerprint=key, resumed_trials=resumed, new_trials=new, message=message,
        seconds=seconds, phases=dict(clock.seconds), units=_units(result, runners, seconds),
    )  # fmt: skip
