"""`tune`: Optuna picks the microbatch size and the accumulation strategy that maximise measured throughput."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optuna

from autoaccum._batch import abstract, abstract_batch, resize_batch
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum._estimate import Estimate, estimate
from autoaccum._knobs import Knobs
from autoaccum._plan import Plan, params_signature
from autoaccum._preflight import trace_loss, warn_if_not_finite
from autoaccum._probe import prepare, probe
from autoaccum._tune.claims import config_key, open_claims, settled
from autoaccum._tune.race import FINALISTS, ROUNDS, Runner, race
from autoaccum._tune.result import TrialRecord, TuneResult, record
from autoaccum._tune.search import Config as SearchConfig
from autoaccum._tune.search import Search
from autoaccum._tune.search import Trial as SearchTrial
from autoaccum._tune.space import (
    BUILTIN_REMAT,
    KnobSpace,
    Setting,
    check_dtype_values,
    check_remat_values,
    microbatch_candidates,
    probe_sizes,
    program_key,
    variants,
)
from autoaccum._tune.study import fail_stale_trials, fingerprint, open_storage, quiet_optuna
from autoaccum._tune.timing import Timing, TrialFailed, time_update
from autoaccum._tune.worker import Request, TimingWorker
from autoaccum._units import format_bytes, parse_bytes
from autoaccum._update import Update, build_update
from autoaccum._version import __version__
from autoaccum.strategies import PyTree, check_params, layout_of, leading_size
from autoaccum.strategies import available as available_strategies
from autoaccum.strategies import get as get_strategy

STEPS, WARMUP = 5, 1
"""Timed steps and warm-up steps of one trial in the worker (after the compiling call)."""

RETIME_WARMUP = 0
"""Warm-up steps of the race's re-timings in the worker: none, its program ran before, so the worker times its first
call too (`autoaccum._tune.worker.serve`)."""

EXHAUSTIVE_UP_TO = 8
"""Without ``n_trials``, a space of at most this many configurations is searched whole (``GridSampler``)."""


def default_budget(grid_points: int, strategies: int) -> int:
    """The trials a tune runs without ``n_trials``: the whole space when it is small (`EXHAUSTIVE_UP_TO`), else a
    fifth of it, at least as many as the strategies (variants) and three more: the search's breadth (every
    strategy at the largest size) and a descent of a few sizes (`autoaccum._tune.search`).

    Example:
      >>> default_budget(6, 4), default_budget(28, 4), default_budget(35, 5), default_budget(100, 4)
      (6, 7, 8, 20)
    """
    if grid_points <= EXHAUSTIVE_UP_TO:
        return grid_points
    return min(grid_points, max(strategies + 3, -(-grid_points // 5)))


POLL_SECONDS = 0.5
"""How often a worker with nothing left to run looks at the trials other workers are running."""

_COMPLETE = optuna.trial.TrialState.COMPLETE
_RUNNING = optuna.trial.TrialState.RUNNING
_WAITING = optuna.trial.TrialState.WAITING
_PRUNED = optuna.trial.TrialState.PRUNED


def _settled_configs(study: optuna.Study) -> dict[str, int]:
    """``{configuration: trial number}`` of the configurations the study has settled (by any worker)."""
    return {config_key(t.params): t.number for t in study.get_trials(deepcopy=False) if settled(t)}


def _heartbeats(storage: optuna.storages.BaseStorage) -> bool:
    """Whether a dead worker's running trial is ever noticed (an RDB storage with heartbeats)."""
    return isinstance(storage, optuna.storages.RDBStorage) and storage.get_heartbeat_interval() is not None


def _entrants(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's measured configurations (each program once), fastest first: who may enter the race."""
    done = study.get_trials(deepcopy=False, states=(_COMPLETE,))
    distinct = [t for t in done if not ({"duplicate_of", "same_program_as"} & t.user_attrs.keys())]
    return sorted(distinct, key=lambda t: (-float(t.value), t.number))  # type: ignore[arg-type]


def _searched(study: optuna.Study, knob_space: KnobSpace, index: Mapping[Setting, int]) -> list[SearchTrial]:
    """The study's settled configurations as the search sees them: each completed one's throughput and step times
    (a trial that reused another's timing, that one's), each failed one (out of memory, timed out; above a bound
    lowered by such a failure) as failed. Pending and interrupted trials are not settled."""
    trials = study.get_trials(deepcopy=False)
    times = {t.number: tuple(t.user_attrs.get("times") or ()) for t in trials}
    out = []
    for t in trials:
        if t.state == _COMPLETE:
            source = t.user_attrs.get("same_program_as", t.user_attrs.get("duplicate_of", t.number))
            value: float | None = float(t.value)  # type: ignore[arg-type]
        elif settled(t) or (t.state == _PRUNED and "above_bound" in t.user_attrs):
            source, value = t.number, None
        else:
            continue
        m, setting = int(t.params["microbatch_size"]), index[knob_space.setting_of(t.params)]
        out.append(SearchTrial(SearchConfig(m, t.params["strategy"], setting), value, times.get(source, ())))
    return out


def _retime(
    trial: optuna.trial.FrozenTrial, time_config: Callable[[optuna.trial.FrozenTrial], Timing]
) -> tuple[float, ...] | None:
    """A finalist's step times measured again (None if it failed this time)."""
    try:
        timing = time_config(trial)
    except TrialFailed:
        return None
    return timing.times or (timing.seconds_per_step,)


def _versions() -> dict[str, str]:
    import flax
    import jaxlib

    return {
        "autoaccum": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
        "flax": flax.__version__, "optuna": optuna.__version__,
    }  # fmt: skip


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
    n_trials: int | None = None,
    timeout: float | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
    fresh: bool = False,
    seed: int = 0,
    has_aux: bool = False,
    state: PyTree | None = None,
    loss_reduction: str = "mean",
    accumulator_dtype: Any | Sequence[Any] = jnp.float32,
    max_microbatch: int | None = None,
    min_microbatch: int = 1,
    remat: Sequence[str | None] = BUILTIN_REMAT,
    trial_timeout: float | None = 120.0,
    compile_timeout: float | None = 600.0,
    isolate: bool = True,
    race_rounds: int = ROUNDS,
    measure: Callable[[Update, PyTree, PyTree], Timing] | None = None,
    callbacks: Sequence[Callable[[TrialRecord, int, int], None]] = (),
) -> TuneResult:
    """Finds the microbatch size, accumulation strategy and knobs with the highest measured throughput.

    The knobs trade memory for speed: the remat policy around each microbatch's loss (``remat``), the
    accumulator's dtype (``accumulator_dtype``), and the loss's own (pass an `autoaccum.Knobs`, a loss factory,
    as ``loss_fn``). Each setting of them has its own microbatch bound: the probe runs once, for the default
    setting (each knob's first value), and every other setting's bound is its compile-only estimate calibrated
    by what the probe measured (`ProbeResult.bound_for`). Where the effective batch needs accumulating, a size
    whose accumulating step (which also holds the accumulator and the whole batch) the calibrated estimate predicts
    over the limit is not timed (`ProbeResult.predicted_peak`).

    First the probe bounds the microbatch (`autoaccum.probe`, trying only the sizes the tuner can time,
    `autoaccum._tune.space.probe_sizes`; no size above a setting's bound is ever timed); then an Optuna study times
    real update steps at the effective batch: every configuration when the space is small (``GridSampler``), else a
    seeded ``TPESampler`` after what the search proposes (`autoaccum._tune.search`: every strategy at the largest
    size, every other knob setting, then halving the fastest while each half is clearly faster, then the other
    strategies at the size it stopped at); the finalists are then re-timed side by side (the race, which picks).
    Trials that run out of memory or
    over ``trial_timeout`` are recorded as failed and the study goes on. The study lives in ``storage``, so an
    interrupted tune resumes where it stopped (finished trials are not re-run) and several processes (one per host)
    can tune one study together: each configuration is measured once, by the worker that claims it first
    (`autoaccum._tune.claims`), and each worker returns once the study's budget is settled, so all return the same
    plan; a worker that dies mid-trial leaves a trial that another one runs again once its heartbeat is stale
    (90 s). A study is identified by a fingerprint of what determines its timings
    (`TuneResult.fingerprint`): change the loss's body or the optimizer and a new study starts, never the old one's
    answer.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss (``-> (loss, aux)`` with ``has_aux``), or an
        `autoaccum.Knobs` whose factory makes it for each value of the loss's own knobs (the plan records
        the values picked in ``plan.knobs``).
      params: the parameters; never donated or changed (trials work on copies).
      batch: an example batch; its leading size is the default effective batch.
      optimizer: the optax optimizer training uses (required: its state is part of the memory).
      effective_batch: examples per update; may exceed the batch's size (rows are then repeated).
      strategies: strategy names to consider; default all of ``autoaccum.strategies.available()``.
      memory_limit: bytes (or ``"1.5GiB"``) a step may use, passed to the probe; default: the device's
        (`autoaccum.probe`).
      n_trials: the study's budget: the configurations it settles (measured, or failed for a reason such as
        out of memory), earlier runs' and other workers' included, so a resumed study runs only the trials
        still missing and two workers asked for 6 settle 6 together, not 12. Default `default_budget`: the whole
        space if it has at most `EXHAUSTIVE_UP_TO` points, else a fifth of it (at least the strategies and three).
      timeout: stop starting new trials (and waiting for other workers' trials) after this many seconds.
      storage: an RDB URL (default: SQLite at `autoaccum._tune.study.default_storage`; several hosts:
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
        to search as a knob, the first probed (for a bfloat16 model, ``(jnp.float32, jnp.bfloat16)``: a bfloat16
        accumulator halves its memory and rounds each microbatch's sum to 8 bits of mantissa). The plan records
        the one picked.
      max_microbatch: skip the probe and use this bound instead (for every setting of the knobs).
      min_microbatch: a floor: no trial (and no probe trial) runs a smaller microbatch. Set it where a smaller
        microbatch changes the model, not just the speed (BatchNorm in training mode normalises each microbatch by
        its own statistics).
      remat: the remat policies to search (`autoaccum.build_update`'s ``remat``, None: off), the first one
        probed; default `autoaccum._tune.space.BUILTIN_REMAT`, off and the policies measured to lower an
        example model's peak. ``(None,)`` searches none.
      trial_timeout: seconds a trial's steps (warm-up and timed) may take before the trial is recorded as failed
        (a hang: the worker is killed and restarted).
      compile_timeout: seconds a trial's compiling may take, likewise.
      isolate: time each configuration in a worker process under the probe's memory limit (the default; see
        `autoaccum._tune.worker`): an out-of-memory, a crash or a hang is recorded as the trial's failure, the
        worker restarts, and the caller's process never runs a trial. ``False``: time in this process, with no
        cap (faster to start; a trial that does not fit fails here).
      race_rounds: rounds of re-timing the study's best configurations side by side before the pick, while
        all stay in (a budget of this many timings per finalist: those one that is out leaves go to more rounds
        of the others; `autoaccum._tune.race`; 0: pick the study's best as measured).
      measure: how a configuration is timed in this process, ``measure(update, params, batch) -> Timing``
        (with ``state`` given: ``measure(update, params, batch, state=state)``), instead of the worker (tests
        inject a deterministic one); with ``isolate=False`` the default is `autoaccum._tune.timing.time_update`.
      callbacks: called as ``callback(record, done, total)`` after each trial: its `TrialRecord`, the distinct
        configurations settled so far and the number the study aims for (the CLI's progress bar).

    Returns:
      A `TuneResult` whose ``update_fn`` is already compiled.

    Raises:
      ValueError, TypeError: bad arguments or an unopenable storage, before any trial runs.
      RuntimeError: nothing fits (the probe found no microbatch) or every trial failed.
    """
    batch_size = leading_size(batch)
    knobs = loss_fn if isinstance(loss_fn, Knobs) else None
    knob_space = KnobSpace(check_remat_values(remat), check_dtype_values(accumulator_dtype), knobs)
    knob_settings = knob_space.settings()
    losses: dict[Setting, Callable[..., Any]] = {}

    def loss_for(setting: Setting) -> Callable[..., Any]:
        if setting not in losses:
            losses[setting] = loss_fn.loss_fn(**setting.values) if isinstance(loss_fn, Knobs) else loss_fn
        return losses[setting]

    default = knob_settings[0]
    check_loss_fn(loss_for(default))
    check_optimizer(optimizer)
    check_params(params)
    check_bool(fresh, "fresh")
    check_bool(isolate, "isolate")
    if not (isinstance(race_rounds, int) and not isinstance(race_rounds, bool) and race_rounds >= 0):
        raise ValueError(f"`race_rounds` must be an int >= 0 (0: no race), got race_rounds={race_rounds!r}.")
    for label, seconds in (("trial_timeout", trial_timeout), ("compile_timeout", compile_timeout)):
        if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
            raise ValueError(f"`{label}` must be a positive number of seconds or None, got {label}={seconds!r}.")
    effective_batch = batch_size if effective_batch is None else check_positive_int(effective_batch, "effective_batch")
    if n_trials is not None:
        check_positive_int(n_trials, "n_trials")
    if max_microbatch is not None:
        check_positive_int(max_microbatch, "max_microbatch")
    check_positive_int(min_microbatch, "min_microbatch")
    if min_microbatch > min(effective_batch, max_microbatch or effective_batch):
        raise ValueError(
            f"`min_microbatch`={min_microbatch} is above the largest microbatch that may be timed "
            f"({min(effective_batch, max_microbatch or effective_batch)}: `effective_batch`={effective_batch}, "
            f"`max_microbatch`={max_microbatch}); lower it."
        )
    names = list(available_strategies() if strategies is None else strategies)
    if not names:
        raise ValueError(f"`strategies` is empty; choose from {', '.join(available_strategies())}.")
    for name in names:
        get_strategy(name)
    layout = layout_of(params, batch, () if state is None else state)
    shards = 1 if layout is None else layout.shards
    if layout is not None:  # on a mesh: global microbatch sizes, multiples of the shards; mesh strategies only
        if effective_batch % shards:
            raise ValueError(
                f"`effective_batch`={effective_batch} is not a multiple of the {shards} shards the batch is split "
                f"into over mesh axes {layout.batch_axes}; use a multiple of {shards}."
            )
        off = [n for n in names if not get_strategy(n).supports(layout)]
        if strategies is not None and off:
            raise ValueError(
                f"`strategies` {off} do not run with these inputs on a mesh (e.g. multisteps with sharded "
                "parameters); leave them out."
            )
        names = [n for n in names if n not in off]
    if timeout is not None and not timeout > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds, got timeout={timeout!r}.")
    limit_bytes = None if memory_limit is None else parse_bytes(memory_limit, "memory_limit")
    loss_kw: dict[str, Any] = dict(has_aux=has_aux, has_state=state is not None, loss_reduction=loss_reduction)
    # Build one update per strategy so bad input (optimizer, loss, options) fails here, not in trial 0.
    for name in names:
        build_update(loss_for(default), optimizer, microbatch_size=1, strategy=name, **default.build, **loss_kw)
    trace_loss(loss_for(default), params, batch, state)  # the loss's own error, here, before any child starts
    warn_if_not_finite(loss_for(default), params, batch, state=state, has_aux=has_aux, loss_reduction=loss_reduction)
    setup = None
    # The worker's job and limit: the probe's (checked here, before anything runs). On a mesh, trials are timed
    # in this process for now: the worker's accumulating programs on a mesh are not built from shapes yet.
    if measure is None and isolate and layout is None:
        setup = prepare(
            loss_for(default), params, batch, optimizer=optimizer, strategy=names[0], memory_limit=memory_limit,
            max_microbatch=effective_batch, has_aux=has_aux, state=state, loss_reduction=loss_reduction,
            options={"accumulator_dtype": default.accumulator_dtype},
        )  # fmt: skip
    opened, storage_label = open_storage(storage)

    probed = None
    if max_microbatch is None:
        probed = probe(
            loss_for(default),
            params,
            batch,
            optimizer=optimizer,
            strategy=names[0],
            memory_limit=memory_limit,
            max_microbatch=effective_batch,
            has_aux=has_aux,
            state=state,
            loss_reduction=loss_reduction,
            options=None if default.remat is None else {"remat": default.remat},
            sizes=[m for m in probe_sizes(effective_batch) if m >= min_microbatch],
        )
        max_microbatch = probed.max_microbatch
    bounds = {setting: max_microbatch for setting in knob_settings}
    # Where the effective batch does not fit in one step, the accumulating step also holds the accumulator and the
    # whole batch (and, for an uneven split, a second program for the last microbatch): each setting's estimate of
    # it, calibrated by the probe, drops the sizes predicted over the limit, so they are not timed only to run out
    # of memory (on the demo transformer, three trials of about 20 s each).
    accumulating: dict[Setting, Estimate] = {}
    if probed is not None:  # every other setting's bound, and every setting's accumulating step: estimated
        accumulates = max_microbatch < effective_batch
        for setting in knob_settings:
            if setting == default and not accumulates:
                continue  # the probe measured it
            predicted = estimate(
                loss_for(setting), params, batch, optimizer=optimizer, strategy=names[0],
                memory_limit=probed.memory_limit_bytes, max_microbatch=probed.microbatch_cap,
                accumulation=accumulates, effective_batch=effective_batch if accumulates else None, has_aux=has_aux,
                state=state, loss_reduction=loss_reduction, **setting.build,
            )  # fmt: skip
            if setting != default:
                bounds[setting] = probed.bound_for(predicted)
            if accumulates:
                accumulating[setting] = predicted
        if max(bounds.values()) < min_microbatch:
            raise RuntimeError(
                f"nothing fits: no microbatch of at least `min_microbatch`={min_microbatch} fits under the probe's "
                f"limit ({format_bytes(probed.memory_limit_bytes)}) with any setting of the knobs; reduce the model, "
                "raise `memory_limit`" + (" or lower `min_microbatch`." if min_microbatch > 1 else ".")
            )

    ceilings: dict[tuple[Setting, str], int] = {}  # (setting, strategy label): below a size that ran out of memory
    labels = variants(names, fsdp=layout is not None and layout.sharded_params)

    def predicted_to_fit(setting: Setting, m: int) -> bool:
        if setting not in accumulating or m >= effective_batch or probed is None:
            return True
        return probed.predicted_peak(accumulating[setting], m, effective_batch) <= probed.memory_limit_bytes

    fitting: dict[Setting, list[int]] = {}
    predicted_over: dict[str, list[int]] = {}
    for s, b in bounds.items():
        candidates = [m for m in microbatch_candidates(effective_batch, max(b, 1)) if m % shards == 0 and b >= m]
        candidates = [m for m in candidates if m >= min_microbatch]
        # (every size predicted over: the smallest is still timed, and a real trial decides)
        fitting[s] = [m for m in candidates if predicted_to_fit(s, m)] or candidates[:1]
        if len(fitting[s]) < len(candidates):
            predicted_over[str(s)] = [m for m in candidates if m not in fitting[s]]
    sizes = list(dict.fromkeys(m for s in knob_settings for m in fitting[s]))
    if not sizes:
        raise RuntimeError(
            f"no microbatch size to time between `min_microbatch`={min_microbatch} and the bounds "
            f"{sorted(set(bounds.values()))} (sizes that split {effective_batch} examples evenly or are powers of "
            "two); lower `min_microbatch`."
        )
    knob_params = knob_space.params()
    space: dict[str, list[Any]] = {"microbatch_size": sizes, "strategy": list(labels), **knob_params}
    grid_points = sum(len(fitting[s]) for s in knob_settings) * len(labels)  # the configurations within bounds
    plain = build_update(
        loss_for(default), optimizer, microbatch_size=effective_batch, strategy=names[0], **default.build, **loss_kw
    )
    params_s = abstract(params)
    state_s = () if state is None else (abstract(state),)
    programs = plain.programs(
        params_s, jax.eval_shape(plain.init, params_s), abstract_batch(batch, effective_batch), *state_s
    )
    key = fingerprint(
        "\n".join(p.lowered.as_text() for p in programs),
        {
            "effective_batch": effective_batch, "space": space, "memory_limit": limit_bytes,
            "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "versions": _versions(),
        },
    )  # fmt: skip
    name = study_name or f"autoaccum-{key}"
    if fresh:
        with contextlib.suppress(KeyError):  # no such study yet: nothing to delete
            open_claims(opened, opened.get_study_id_from_name(name)).clear()
            optuna.delete_study(study_name=name, storage=opened)
    wanted = default_budget(grid_points, len(labels)) if n_trials is None else n_trials
    exhaustive = wanted >= grid_points
    sampler: optuna.samplers.BaseSampler
    if exhaustive:
        sampler = optuna.samplers.GridSampler(space, seed=seed)
    else:
        # constant_liar: other workers' running trials count as bad ones, so TPE proposes something else.
        with warnings.catch_warnings():  # "experimental" in some Optuna releases
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=min(len(labels) + 2, 8), constant_liar=True
            )
    study = optuna.create_study(
        storage=opened, sampler=sampler, study_name=name, direction="maximize", load_if_exists=True
    )
    # A configuration is measured by the trial that wins its claim (`autoaccum._tune.claims`), once for the
    # study, whichever worker runs it; settled ones (completed, or failed for a reason: out of memory, timed out)
    # are never re-run. A trial interrupted by Ctrl-C is marked and queued again; one killed outright stays
    # RUNNING until its heartbeat goes stale, then Optuna's RetryHeartbeatStaleTrialCallback queues it again.
    claims = open_claims(opened, opened.get_study_id_from_name(name))
    trials = study.get_trials(deepcopy=False)

    def by_number() -> dict[int, optuna.trial.FrozenTrial]:
        return {t.number: t for t in study.get_trials(deepcopy=False)}

    earlier = _settled_configs(study)
    resumed = len(earlier)
    claimed = {row[0] for row in claims.rows().values()}
    for config, number in earlier.items():  # trials settled before they were claimed: record their claims
        if config not in claimed:
            claims.claim(config, number, None, by_number)
    queued = {config_key(t.params) for t in trials if t.state == _WAITING}
    for t in trials:
        if t.user_attrs.get("interrupted") and config_key(t.params) not in earlier.keys() | queued:
            study.enqueue_trial(t.params)
            queued.add(config_key(t.params))
    budget = min(wanted, grid_points)  # the study's, shared by every worker on it
    setting_index = {s: i for i, s in enumerate(knob_settings)}

    def program_of(config: SearchConfig) -> tuple[Any, ...]:
        variant = labels[config.strategy]
        return (config.setting, program_key(config.microbatch_size, variant, effective_batch))

    # The search proposes the configurations to time next from the study's settled trials (`Search`); the
    # sampler spends the rest of the budget. A small space is the grid's alone.
    sized = [fitting[s] for s in knob_settings]
    search = None if exhaustive else Search(sized, list(labels), effective_batch, program_of)

    def steer() -> None:
        """Queues what the search proposes next (a configuration queued or settled already is not queued again)."""
        if search is None:
            return
        for config in search.propose(_searched(study, knob_space, setting_index)):
            setting = knob_settings[config.setting]
            params = {"microbatch_size": config.microbatch_size, "strategy": config.strategy}
            study.enqueue_trial({**params, **knob_space.params_of(setting)}, skip_if_exists=True)

    full_batch = batch
    if effective_batch != batch_size and layout is None:
        full_batch = resize_batch(batch, effective_batch)
    elif effective_batch != batch_size:  # on a mesh: resized on the host, then laid out as given
        resized = resize_batch(jax.device_get(batch), effective_batch)
        full_batch = jax.tree.map(lambda r, x: jax.device_put(r, x.sharding), resized, batch)
    timer = measure or functools.partial(time_update, time_limit=trial_timeout)
    with_state: dict[str, Any] = {} if state is None else {"state": state}
    worker = None
    if setup is not None:  # the worker makes each setting's loss from the knobs (the factory travels, pickled)
        job = setup.job if knobs is None else dataclasses.replace(setup.job, loss_fn=knobs)  # type: ignore[arg-type]
        worker = TimingWorker(
            job, setup.device, setup.memory_limit_bytes, compile_timeout=compile_timeout, step_timeout=trial_timeout,
            settings=[s.values for s in knob_settings],
        )  # fmt: skip
    limit_label = None if setup is None else format_bytes(setup.memory_limit_bytes)

    updates: dict[tuple[int, str, Setting], Update] = {}

    def time_config(trial: optuna.Trial | optuna.trial.FrozenTrial, warmup: int = WARMUP) -> Timing:
        """Times the configuration of ``trial`` (its Optuna parameters): in the worker (after ``warmup`` steps),
        or here."""
        m = int(trial.params["microbatch_size"])
        strategy, options = labels[trial.params["strategy"]]
        setting = knob_space.setting_of(trial.params)
        if worker is None:  # (each configuration's update is kept: timing it again compiles nothing again)
            config = (m, trial.params["strategy"], setting)
            if config not in updates:
                updates[config] = build_update(
                    loss_for(setting), optimizer, microbatch_size=m, strategy=strategy, **setting.build, **loss_kw,
                    **options,
                )  # fmt: skip
            return timer(updates[config], params, full_batch, **with_state)
        build = {"strategy": strategy, **options, **setting.build}
        index = knob_settings.index(setting)
        outcome = worker.time(Request(build, m, effective_batch, STEPS, warmup, setting=index))
        if outcome.status == "oom":
            raise TrialFailed(f"out of memory in the worker (limit {limit_label}): {outcome.message}")
        if outcome.status != "fits":
            message = (outcome.message or "").strip()
            raise TrialFailed(f"failed in the worker: {message if len(message) < 900 else message[:900] + ' ...'}")
        times = tuple(outcome.times or ())
        return Timing(outcome.seconds or 0.0, outcome.compile_seconds or 0.0, len(times), times, outcome.peak_bytes)

    def retime(number: int) -> tuple[float, ...] | None:
        """Trial ``number``'s configuration timed again, for the finalists' race."""
        return _retime(by_number()[number], functools.partial(time_config, warmup=RETIME_WARMUP))

    def objective(trial: optuna.Trial) -> float:
        m = trial.suggest_categorical("microbatch_size", sizes)
        trial.suggest_categorical("strategy", list(labels))
        setting = knob_space.setting_of({k: trial.suggest_categorical(k, v) for k, v in knob_params.items()})
        trial.set_user_attr("remat", setting.remat)
        trial.set_user_attr("accumulator_dtype", setting.accumulator_dtype)
        trial.set_user_attr("knobs", setting.values)
        label = trial.params["strategy"]
        bound = min(bounds[setting], ceilings.get((setting, label), bounds[setting]))
        if m > bound:  # never timed: not a configuration of the study's (it claims nothing)
            trial.set_user_attr("above_bound", bound)
            raise optuna.TrialPruned(f"microbatch {m} is above the bound of {label}, {setting} ({bound})")
        holder = claims.claim(config_key(trial.params), trial.number, budget, by_number)
        if holder is None:  # the study's budget is claimed, by this worker or others
            trial.set_user_attr("over_budget", True)
            study.stop()
            raise optuna.TrialPruned("the study's budget of trials is claimed")
        if holder != trial.number:
            # Measured already (TPE may propose a point again; a re-queued copy), or being measured by another
            # worker: reuse the result, never re-run.
            trial.set_user_attr("duplicate_of", holder)
            other = by_number()[holder]
            if other.state == _COMPLETE:
                return float(other.value)  # type: ignore[arg-type]
            raise optuna.TrialPruned(f"trial {holder} measures this configuration")
        program = program_key(m, labels[label], effective_batch)
        for other in study.get_trials(deepcopy=False, states=(_COMPLETE,)):
            same_knobs = all(other.params.get(k) == trial.params[k] for k in knob_params)
            other_m, other_label = int(other.params["microbatch_size"]), other.params["strategy"]
            if same_knobs and program_key(other_m, labels[other_label], effective_batch) == program:
                # The same program (with one accumulation step every strategy runs the plain step; scan unrolled
                # 2 or 8 times over 2 steps unrolls them both): timing it again would only let noise pick
                # between identical programs.
                trial.set_user_attr("same_program_as", other.number)
                return float(other.value)  # type: ignore[arg-type]
        try:
            timing = time_config(trial)
        except TrialFailed as e:
            trial.set_user_attr("reason", str(e))
            if str(e).startswith("out of memory") and m <= bound:
                # The probe bounds one microbatch's step; the accumulating step also holds the whole effective
                # batch and the accumulator, in buffers of its strategy's own. A size that ran out of memory
                # there lowers the bound of this strategy (and setting): larger sizes are not timed again, only
                # to run out of memory too.
                ceilings[(setting, label)] = m - 1
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        trial.set_user_attr("compile_seconds", timing.compile_seconds)
        trial.set_user_attr("times", list(timing.times or (timing.seconds_per_step,)))
        if timing.peak_bytes is not None:
            trial.set_user_attr("peak_bytes", timing.peak_bytes)
        return effective_batch / timing.seconds_per_step

    def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        steer()
        count = len(_settled_configs(study))
        if trial.state != _PRUNED and "duplicate_of" not in trial.user_attrs:
            for callback in callbacks:
                callback(record(trial, effective_batch, labels), count, budget)
        if count >= budget:
            study.stop()

    # Run until the study has settled its budget. With nothing left to claim while other workers still run
    # trials, wait for them: a trial whose worker died goes stale and is queued again, for this worker to run.
    deadline = None if timeout is None else time.monotonic() + timeout
    after_round = -1
    steer()
    above = len(sizes) * len(labels) * len(knob_settings) - grid_points  # proposals above a bound: pruned
    with contextlib.ExitStack() as stack:
        if worker is not None:
            stack.enter_context(worker)
        while True:
            count = len(_settled_configs(study))
            left = None if deadline is None else deadline - time.monotonic()
            if count >= budget or (left is not None and left <= 0):
                break
            trials = study.get_trials(deepcopy=False)
            if after_round >= 0 and not any(t.state == _WAITING for t in trials):
                holders = {number for _, number in claims.rows().values()}
                if _heartbeats(opened) and any(t.state == _RUNNING and t.number in holders for t in trials):
                    time.sleep(POLL_SECONDS if left is None else min(POLL_SECONDS, left))
                    fail_stale_trials(study)
                    continue
                if count == after_round:  # the sampler has nothing new to offer, and no other worker is running
                    break
            # Proposals of an already measured point cost nothing and don't count; the cap only bounds the loop.
            study.optimize(
                objective, n_trials=4 * (budget - count) + 16 + above, timeout=left, catch=(TrialFailed,),
                callbacks=[report],
            )  # fmt: skip
            after_round = len(_settled_configs(study))

        # The finalists, re-timed side by side (`autoaccum._tune.race`): the pick is not decided by one
        # trial's noise. Several workers on one study race once: the first to finish records its race, the
        # others take it.
        entrants = _entrants(study)
        settled_key = [t.number for t in entrants]
        race_record = study.user_attrs.get("race")
        if (race_record is None or race_record["entrants"] != settled_key) and race_rounds > 0 and len(entrants) > 1:
            runners = race(
                [(t.number, t.number, t.user_attrs.get("times") or ()) for t in entrants[:FINALISTS]], retime,
                rounds=race_rounds,
            )  # fmt: skip
            race_record = study.user_attrs.get("race")
            if race_record is None or race_record["entrants"] != settled_key:
                race_record = {"entrants": settled_key, "runners": [r.to_dict() for r in runners]}
                study.set_user_attr("race", race_record)
    runners = []
    if race_record is not None and race_record["entrants"] == [t.number for t in _entrants(study)]:
        runners = [Runner.from_dict(r) for r in race_record["runners"]]

    records = sorted(
        (
            record(t, effective_batch, labels)
            for t in study.get_trials(deepcopy=False)
            if "duplicate_of" not in t.user_attrs and t.state not in (_WAITING, _PRUNED)
        ),
        key=lambda r: (r.throughput is None, -(r.throughput or 0.0), r.number),
    )
    completed = study.get_trials(deepcopy=False, states=(_COMPLETE,))
    if not completed:
        reasons = "; ".join(f"#{r.number} {r.reason}" for r in records if r.reason)[:500]
        raise RuntimeError(f"every trial failed ({reasons}); lower the effective batch or raise `memory_limit`.")
    top = max(completed, key=lambda t: float(t.value))  # type: ignore[arg-type]
    throughput = float(top.value)  # type: ignore[arg-type]
    if runners:  # the race's winner, at the median of every step it was timed
        top = by_number()[runners[0].trial]
        throughput = effective_batch / runners[0].quartiles[1]
    strategy, options = labels[top.params["strategy"]]
    chosen = knob_space.setting_of(top.params)
    plan = Plan(
        effective_batch=effective_batch,
        microbatch_size=int(top.params["microbatch_size"]),
        accumulation_steps=-(-effective_batch // int(top.params["microbatch_size"])),
        strategy=strategy,
        options=dict(options),
        throughput=throughput,
        device=jax.devices()[0].device_kind,
        has_aux=has_aux,
        has_state=state is not None,
        loss_reduction=loss_reduction,
        accumulator_dtype=chosen.accumulator_dtype,
        remat=chosen.remat,
        knobs=chosen.values,
        params=params_signature(params),
        versions=_versions(),
    )
    # Compiled here from shapes for the effective batch (nothing runs: the step ran in the worker, under the
    # limit); the jitted functions keep the executables, so the caller's first call does not compile again.
    update_fn = plan.build(loss_fn, optimizer)
    params_a = abstract(params)
    for program in update_fn.programs(
        params_a, jax.eval_shape(update_fn.init, params_a), abstract_batch(full_batch, effective_batch), *state_s
    ):
        program.lowered.compile()
    new = len(_settled_configs(study)) - resumed
    if resumed:
        message = (
            f"resumed: {resumed} trials from earlier runs, {new} new (study {name}; pass fresh=True to start over)"
        )
    else:
        message = f"new study {name}: {new} trials"
    if setup is not None:
        limit_bytes = setup.memory_limit_bytes
    elif probed is not None:
        limit_bytes = probed.memory_limit_bytes
    return TuneResult(
        plan=plan,
        trials=tuple(records),
        race=tuple(runners),
        memory_limit_bytes=limit_bytes,
        peak_bytes=top.user_attrs.get("peak_bytes"),
        probe=probed,
        study_name=name,
        storage=storage_label,
        fingerprint=key,
        resumed_trials=resumed,
        new_trials=new,
        message=message,
        bounds={str(setting): bound for setting, bound in bounds.items()},
        predicted_over=predicted_over,
        update_fn=update_fn,
        init=update_fn.init,
    )
