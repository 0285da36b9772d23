"""`tune`: Optuna picks the microbatch size and the accumulation strategy that maximise measured throughput."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import optax
import optuna

import strategies as strategies_lib
from autoaccum._trial import is_oom
from autoaccum.defaults import default_optimizer
from autoaccum.plan import Plan, params_signature
from autoaccum.update import Update, build_update, check_positive_int
from autoaccum.workload import resize_batch
from strategies._base import PyTree, leading_size

#: Trials the tuner runs when ``n_trials`` is not given and the search space is larger than this.
DEFAULT_TRIALS = 12


def default_storage() -> str:
    """The default Optuna storage: a SQLite file, ``$AUTOACCUM_CACHE`` or ``~/.cache/autoaccum``, ``studies.db``."""
    root = (
        os.environ.get("AUTOACCUM_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "autoaccum"
    )
    Path(root).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(root) / 'studies.db'}"


@dataclasses.dataclass(frozen=True)
class Timing:
    """How long one configuration's update took.

    Attributes:
      seconds_per_step: the median over the timed steps (compile and warm-up excluded).
      compile_seconds: the first call (tracing, compiling and one step).
      steps: timed steps.
    """

    seconds_per_step: float
    compile_seconds: float
    steps: int


class TrialFailed(Exception):
    """A configuration could not be measured (out of memory, over its time budget); the study goes on."""


def time_update(
    update: Update,
    params: PyTree,
    batch: PyTree,
    *,
    steps: int = 5,
    warmup: int = 1,
    time_limit: float | None = None,
    timer: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Times ``update`` on ``batch``: one compiling call, ``warmup`` calls, then ``steps`` timed calls.

    Works on a copy of ``params`` (the update donates its inputs). Each timed call ends with
    ``jax.block_until_ready`` on everything it returns.

    Raises:
      TrialFailed: XLA ran out of memory, or the calls so far exceeded ``time_limit`` seconds.
    """
    params = jax.tree.map(jnp.array, params)
    try:
        opt_state = update.init(params)
        start = timer()
        params, opt_state, _ = jax.block_until_ready(update(params, opt_state, batch))
        compile_seconds = timer() - start
        times = []
        for i in range(warmup + steps):
            if time_limit is not None and timer() - start > time_limit:
                raise TrialFailed(f"timed out: over {time_limit:g} s after {i} of {warmup + steps} steps")
            t = timer()
            params, opt_state, _ = jax.block_until_ready(update(params, opt_state, batch))
            if i >= warmup:
                times.append(timer() - t)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if is_oom(e):  # the probe's rules: XLA's RESOURCE_EXHAUSTED, the CPU's allocation failures
            raise TrialFailed(f"out of memory: {(str(e) or type(e).__name__).splitlines()[0][:300]}") from e
        raise
    return Timing(statistics.median(times), compile_seconds, steps)


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    """One tuning trial.

    Attributes:
      number: Optuna's trial number.
      microbatch_size, accumulation_steps, strategy, options: the configuration.
      throughput: measured examples per second (``None`` unless the trial completed).
      compile_seconds: the first (compiling) call's duration (``None`` if unknown).
      state: Optuna's trial state name (``COMPLETE``, ``FAIL``, ``RUNNING``, ...).
      reason: why it failed, if it did.
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


@dataclasses.dataclass(frozen=True)
class TuneResult:
    """What `tune` returns.

    Attributes:
      plan: the best configuration, ready to `Plan.save`.
      update_fn: the plan's update, already compiled for the effective batch's shapes.
      init: ``init(params) -> opt_state`` for ``update_fn``.
      trials: every trial of the study (earlier runs' too when it was resumed), best first.
      probe: the probe's result, or ``None`` when a bound was given (``max_microbatch``).
      study_name: the Optuna study.
      storage: where the study lives (an RDB URL, or ``":memory:"``).
    """

    plan: Plan
    update_fn: Update
    init: Callable[[PyTree], PyTree]
    trials: tuple[TrialRecord, ...]
    probe: Any
    study_name: str
    storage: str


def variants(names: Sequence[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{label: (strategy, options)}`` for every strategy and combination of its options.

    Example:
      >>> list(variants(["scan", "loop"]))
      ['scan', 'scan:unroll=2', 'loop']
    """
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in names:
        cls = strategies_lib.get(name)
        keys = list(cls.options)
        for values in itertools.product(*(cls.options[k] for k in keys)):
            options = dict(zip(keys, values, strict=True))
            changed = [f"{k}={v}" for k, v in options.items() if v != cls.options[k][0]]
            out[":".join([name, *changed])] = (name, options)
    return out


def microbatch_candidates(effective_batch: int, max_microbatch: int) -> list[int]:
    """Sizes to try: divisors of the effective batch first, then powers of two and the bound itself.

    Example:
      >>> microbatch_candidates(24, 16)
      [1, 2, 3, 4, 6, 8, 12, 16]
    """
    bound = min(effective_batch, max_microbatch)
    divisors = [d for d in range(1, bound + 1) if effective_batch % d == 0]
    extra = {1 << i for i in range(bound.bit_length()) if 1 << i <= bound} | {bound}
    return divisors + sorted(extra - set(divisors))


STORAGE_ATTEMPTS = 5


def raise_unopenable(url: str) -> NoReturn:
    """Re-raises the error being handled as a ``ValueError`` that names ``storage`` and the fix."""
    e = sys.exc_info()[1]
    raise ValueError(
        f"`storage`={url!r} cannot be opened ({type(e).__name__}: {str(e).splitlines()[0]}); pass an RDB URL "
        "such as 'sqlite:///studies.db' or 'postgresql://user@host/db', or ':memory:'."
    ) from e


def _open_storage(
    storage: str | optuna.storages.BaseStorage | None,
) -> tuple[optuna.storages.BaseStorage, str]:
    """Opens ``storage`` before any trial runs; ``ValueError`` naming it when it cannot be opened."""
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage, type(storage).__name__
    if storage == ":memory:":
        return optuna.storages.InMemoryStorage(), ":memory:"
    url = default_storage() if storage is None else storage
    if not isinstance(url, str):
        raise TypeError(f"`storage` must be an RDB URL string, ':memory:' or an optuna storage, got {storage!r}.")
    import sqlalchemy.exc

    # Workers that open a new database at the same moment race to create its tables (IntegrityError on
    # alembic_version, or "database is locked"): the loser retries and finds them made.
    races = (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError)
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna; we rely on them knowingly
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                opened = optuna.storages.RDBStorage(
                    url,
                    heartbeat_interval=30,
                    grace_period=90,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                )
            break
        except races:
            if attempt + 1 == STORAGE_ATTEMPTS:
                raise_unopenable(url)
            time.sleep(0.2 * (attempt + 1))
        except (sqlalchemy.exc.SQLAlchemyError, ValueError, ImportError, OSError):
            raise_unopenable(url)
    return opened, url


def _study_name(params: PyTree, batch: PyTree, effective_batch: int, loss_fn: Any, space: dict[str, Any]) -> str:
    key = json.dumps(
        {
            "params": params_signature(params),
            "batch": params_signature(batch),
            "effective_batch": effective_batch,
            "loss": f"{getattr(loss_fn, '__module__', '')}.{getattr(loss_fn, '__qualname__', '')}",
            "device": jax.devices()[0].device_kind,
            "space": space,
        },
        sort_keys=True,
    )
    return "autoaccum-" + hashlib.sha256(key.encode()).hexdigest()[:16]


_COMPLETE = optuna.trial.TrialState.COMPLETE


def _key(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(params.items()))


def _record(trial: optuna.trial.FrozenTrial, effective_batch: int, labels: dict[str, Any]) -> TrialRecord:
    m = int(trial.params.get("microbatch_size", 0))
    label = trial.params.get("strategy", "")
    name, options = labels.get(label, (label, {}))
    return TrialRecord(
        number=trial.number,
        microbatch_size=m,
        accumulation_steps=-(-effective_batch // m) if m else 0,
        strategy=name,
        options=dict(options),
        throughput=trial.value if trial.state == _COMPLETE else None,
        compile_seconds=trial.user_attrs.get("compile_seconds"),
        state=trial.state.name,
        reason=trial.user_attrs.get("reason"),
    )


def tune(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation | None = None,
    effective_batch: int | None = None,
    strategies: Sequence[str] | None = None,
    memory_limit: int | str | None = None,
    n_trials: int | None = None,
    timeout: float | None = None,
    storage: str | optuna.storages.BaseStorage | None = None,
    study_name: str | None = None,
    seed: int = 0,
    has_aux: bool = False,
    max_microbatch: int | None = None,
    trial_timeout: float | None = 120.0,
    measure: Callable[[Update, PyTree, PyTree], Timing] | None = None,
    callbacks: Sequence[Callable[[TrialRecord, int, int], None]] = (),
) -> TuneResult:
    """Finds the microbatch size and accumulation strategy with the highest measured throughput.

    First the probe bounds the microbatch (`autoaccum.probe`; no size above that bound is ever timed); then
    an Optuna study times real update steps at the effective batch: every configuration when the space is
    small (``GridSampler``), else a seeded ``TPESampler`` warm-started with the largest fitting microbatch of
    each strategy. Trials that run out of memory or over ``trial_timeout`` are recorded as failed and the
    study goes on. The study lives in ``storage``, so an interrupted tune resumes where it stopped (finished
    trials are not re-run) and several processes can tune one study together.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` mean loss (``-> (loss, aux)`` with ``has_aux``).
      params: the parameters; never donated or changed (trials work on copies).
      batch: an example batch; its leading size is the default effective batch.
      optimizer: the optax optimizer; default ``optax.adamw(1e-3)``.
      effective_batch: examples per update; may exceed the batch's size (rows are then repeated).
      strategies: strategy names to consider; default all of ``strategies.available()``.
      memory_limit: bytes (or ``"1.5GiB"``) a step may use, passed to the probe; default: the device's.
      n_trials: trials to run now; default the whole space if it has at most ``DEFAULT_TRIALS`` points,
        else ``DEFAULT_TRIALS``. A resumed study runs only the trials still missing.
      timeout: stop starting new trials after this many seconds.
      storage: an RDB URL (default: SQLite at `default_storage`), ``":memory:"`` or an optuna storage.
      study_name: default derives from the params' and batch's shapes, the effective batch, the loss's name,
        the device and the search space, so re-running the same tune resumes its study.
      seed: the sampler's seed.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      max_microbatch: skip the probe and use this bound instead.
      trial_timeout: seconds a trial may take (its compile included) before it is recorded as failed.
      measure: how a configuration is timed, ``measure(update, params, batch) -> Timing``; default
        `time_update` (tests inject a deterministic one).
      callbacks: called as ``callback(record, done, total)`` after each trial: its `TrialRecord`, the distinct
        configurations settled so far and the number the study aims for (the CLI's progress bar).

    Returns:
      A `TuneResult` whose ``update_fn`` is already compiled.

    Raises:
      ValueError, TypeError: bad arguments or an unopenable storage, before any trial runs.
      RuntimeError: nothing fits (the probe found no microbatch) or every trial failed.
    """
    batch_size = leading_size(batch)
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    optimizer = default_optimizer() if optimizer is None else optimizer
    effective_batch = batch_size if effective_batch is None else check_positive_int(effective_batch, "effective_batch")
    if n_trials is not None:
        check_positive_int(n_trials, "n_trials")
    if max_microbatch is not None:
        check_positive_int(max_microbatch, "max_microbatch")
    names = list(strategies_lib.available() if strategies is None else strategies)
    if not names:
        raise ValueError(f"`strategies` is empty; choose from {', '.join(strategies_lib.available())}.")
    for name in names:
        strategies_lib.get(name)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"`timeout` must be a positive number of seconds, got timeout={timeout!r}.")
    if memory_limit is not None:
        from autoaccum.units import parse_bytes

        parse_bytes(memory_limit)
    # Build one update per strategy so bad input (optimizer, loss, options) fails here, not in trial 0.
    for name in names:
        build_update(loss_fn, optimizer, microbatch_size=1, strategy=name, has_aux=has_aux)
    opened, storage_label = _open_storage(storage)

    probed = None
    if max_microbatch is None:
        from autoaccum.probe import probe

        probed = probe(
            loss_fn,
            params,
            batch,
            optimizer=optimizer,
            strategy=names[0],
            memory_limit=memory_limit,
            max_size=effective_batch,
            has_aux=has_aux,
        )
        max_microbatch = probed.max_microbatch
        if max_microbatch < 1:
            raise RuntimeError(
                "nothing fits: even a microbatch of 1 ran out of memory under the probe's limit "
                f"({probed.memory_limit_bytes} bytes); reduce the model or raise `memory_limit`."
            )

    labels = variants(names)
    sizes = microbatch_candidates(effective_batch, max_microbatch)
    space: dict[str, list[Any]] = {"microbatch_size": sizes, "strategy": list(labels)}
    grid_points = len(sizes) * len(labels)
    name = study_name or _study_name(params, batch, effective_batch, loss_fn, space)
    exhaustive = (n_trials is None and grid_points <= DEFAULT_TRIALS) or (n_trials or 0) >= grid_points
    sampler: optuna.samplers.BaseSampler = (
        optuna.samplers.GridSampler(space, seed=seed)
        if exhaustive
        else optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(len(labels) + 2, 8))
    )
    study = optuna.create_study(
        storage=opened, sampler=sampler, study_name=name, direction="maximize", load_if_exists=True
    )
    # Settled trials are never re-run: completed ones, and failures with a reason (out of memory, timed out).
    # A trial interrupted by Ctrl-C is marked and queued again; one killed outright stays RUNNING until its
    # heartbeat goes stale, and Optuna's RetryHeartbeatStaleTrialCallback queues it again.
    trials = study.get_trials(deepcopy=False)
    settled = {_key(t.params) for t in trials if t.state == _COMPLETE or "reason" in t.user_attrs}
    queued = {_key(t.params) for t in trials if t.state == optuna.trial.TrialState.WAITING}
    for t in trials:
        if t.user_attrs.get("interrupted") and _key(t.params) not in settled | queued:
            study.enqueue_trial(t.params)
            queued.add(_key(t.params))
    wanted = grid_points if exhaustive else (n_trials or DEFAULT_TRIALS)
    remaining = max(0, wanted - len(settled))
    if not exhaustive and not trials:
        for label in list(labels)[:wanted]:  # warm start: on most devices the largest fitting microbatch is fastest
            study.enqueue_trial({"microbatch_size": sizes[-1], "strategy": label})

    full_batch = batch if effective_batch == batch_size else jax.device_put(resize_batch(batch, effective_batch))
    timer = measure or (lambda u, p, b: time_update(u, p, b, time_limit=trial_timeout))
    best: dict[str, Any] = {}

    def objective(trial: optuna.Trial) -> float:
        m = trial.suggest_categorical("microbatch_size", sizes)
        label = trial.suggest_categorical("strategy", list(labels))
        strategy, options = labels[label]
        for other in study.get_trials(deepcopy=False, states=(_COMPLETE,)):
            if other.params == trial.params:  # TPE may propose a measured point again: reuse, don't re-run
                trial.set_user_attr("duplicate_of", other.number)
                return float(other.value)  # type: ignore[arg-type]
        update = build_update(loss_fn, optimizer, microbatch_size=m, strategy=strategy, has_aux=has_aux, **options)
        try:
            timing = timer(update, params, full_batch)
        except TrialFailed as e:
            trial.set_user_attr("reason", str(e))
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        throughput = effective_batch / timing.seconds_per_step
        trial.set_user_attr("compile_seconds", timing.compile_seconds)
        if throughput > best.get("throughput", -1.0):
            best.update(throughput=throughput, update=update, params=trial.params)
        return throughput

    def report(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        if "duplicate_of" in trial.user_attrs:
            return
        settled.add(_key(trial.params))
        for callback in callbacks:
            callback(_record(trial, effective_batch, labels), len(settled), min(wanted, grid_points))
        if len(settled) >= min(wanted, grid_points):
            study.stop()

    if remaining:
        # Proposals of an already measured point cost nothing and don't count; the cap only bounds the loop.
        study.optimize(
            objective, n_trials=4 * remaining + 16, timeout=timeout, catch=(TrialFailed,), callbacks=[report]
        )

    records = sorted(
        (
            _record(t, effective_batch, labels)
            for t in study.get_trials(deepcopy=False)
            if "duplicate_of" not in t.user_attrs and t.state != optuna.trial.TrialState.WAITING
        ),
        key=lambda r: (r.throughput is None, -(r.throughput or 0.0), r.number),
    )
    completed = study.get_trials(deepcopy=False, states=(_COMPLETE,))
    if not completed:
        reasons = "; ".join(f"#{r.number} {r.reason}" for r in records if r.reason)[:500]
        raise RuntimeError(f"every trial failed ({reasons}); lower the effective batch or raise `memory_limit`.")
    top = max(completed, key=lambda t: float(t.value))  # type: ignore[arg-type]
    strategy, options = labels[top.params["strategy"]]
    plan = Plan(
        effective_batch=effective_batch,
        microbatch_size=int(top.params["microbatch_size"]),
        accumulation_steps=-(-effective_batch // int(top.params["microbatch_size"])),
        strategy=strategy,
        options=dict(options),
        throughput=float(top.value),  # type: ignore[arg-type]
        device=jax.devices()[0].device_kind,
        has_aux=has_aux,
        accumulator_dtype="float32",
        params=params_signature(params),
        versions={"autoaccum": _version(), "jax": jax.__version__, "optax": optax.__version__},
    )
    if best.get("params") == top.params:
        update_fn = best["update"]  # measured in this process: already compiled
    else:  # the best trial ran in an earlier or another process: compile it now, on copies
        update_fn = plan.build(loss_fn, optimizer)
        copies = jax.tree.map(jnp.array, params)
        jax.block_until_ready(update_fn(copies, update_fn.init(copies), full_batch))
    return TuneResult(
        plan=plan,
        update_fn=update_fn,
        init=update_fn.init,
        trials=tuple(records),
        probe=probed,
        study_name=name,
        storage=storage_label,
    )


def _version() -> str:
    from autoaccum import __version__

    return __version__


__all__ = ["Timing", "TrialFailed", "TrialRecord", "TuneResult", "time_update", "tune", "variants"]
