"""A tune's study: the configurations it times (`Trials.objective`), what the search queues next (`Trials.steer`),
the loop that runs until the study's budget is settled (`Trials.run`), and the finalists' race (`Trials.race`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import optuna

from autoaccum._knobs import KnobSpace, Setting
from autoaccum._tune.job import Job, Space
from autoaccum._tune.race import FINALISTS, Runner, race
from autoaccum._tune.result import Clock, TrialRecord, record
from autoaccum._tune.search import Config, Search, Trial
from autoaccum._tune.space import program_key
from autoaccum._tune.study import fail_stale_trials
from autoaccum._units import format_bytes
from autoaccum._update import Update, build_update
from autoaccum._worker import Timing, TrialFailed

STEPS, WARMUP = 5, 1
"""Timed steps and warm-up steps of one trial in the worker (after the compiling call)."""

RETIME_WARMUP = 0
"""Warm-up steps of the race's re-timings in the worker: none, its program ran before, so the worker times its first
call too (`autoaccum._worker.Server`)."""

POLL_SECONDS = 0.5
"""How often a worker with nothing left to run looks at the trials other workers are running."""

_COMPLETE = optuna.trial.TrialState.COMPLETE
_FAIL = optuna.trial.TrialState.FAIL
_RUNNING = optuna.trial.TrialState.RUNNING
_WAITING = optuna.trial.TrialState.WAITING
_PRUNED = optuna.trial.TrialState.PRUNED

MEASURE: contextvars.ContextVar[Callable[..., Timing] | None] = contextvars.ContextVar("measure", default=None)
"""How `autoaccum.tune` times a configuration in this process, ``measure(update, params, batch[, state=]) ->
Timing``, instead of in the worker (`timed_by`); None: the worker (or `autoaccum._tune.timing.time_update`)."""


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """Inside it, ``var`` holds ``value`` (`MEASURE`, `autoaccum._tune.run.PRECOMPILE`)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def timed_by(measure: Callable[..., Timing] | None) -> contextlib.AbstractContextManager[None]:
    """Inside it, `autoaccum.tune` times configurations with ``measure`` (a test's deterministic stand-in)."""
    return scoped(MEASURE, measure)


MEASURES = "measures"
"""The user attribute a trial sets before it looks for another that measures its configuration (`Trials.claim`)."""


def config_key(params: Mapping[str, Any]) -> str:
    """One configuration as a short string: a hash of its parameters (of any length: a strategy's options).

    Example:
      >>> key = config_key({"strategy": "scan", "microbatch_size": 4})
      >>> key == config_key({"microbatch_size": 4, "strategy": "scan"}), len(key)
      (True, 32)
    """
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:32]


def settled(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` settled its configuration: measured it, or failed it for a reason of the configuration's
    own (out of memory, over the time limit). A copy reusing another trial's result settles nothing."""
    if "duplicate_of" in trial.user_attrs:
        return False
    return trial.state == _COMPLETE or (trial.state == _FAIL and "reason" in trial.user_attrs)


def measuring(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` (of any worker) is measuring its configuration or has settled it."""
    attrs = trial.user_attrs
    if trial.state == _RUNNING:
        return bool(attrs.get(MEASURES)) and not ({"duplicate_of", "over_budget"} & attrs.keys())
    return settled(trial)


def settled_configs(study: optuna.Study) -> dict[str, int]:
    """``{configuration: trial number}`` of the configurations the study has settled (by any worker)."""
    return {config_key(t.params): t.number for t in study.get_trials(deepcopy=False) if settled(t)}


def entrants(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's measured configurations (each program once), fastest first: who may enter the race."""
    done = study.get_trials(deepcopy=False, states=(_COMPLETE,))
    distinct = [t for t in done if not ({"duplicate_of", "same_program_as"} & t.user_attrs.keys())]
    return sorted(distinct, key=lambda t: (-float(t.value), t.number))  # type: ignore[arg-type]


def searched(study: optuna.Study, knob_space: KnobSpace, index: Mapping[Setting, int]) -> list[Trial]:
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
        out.append(Trial(Config(m, t.params["strategy"], setting), value, times.get(source, ())))
    return out


@dataclasses.dataclass
class Trials:
    """The study of one tune, as this worker runs it.

    Attributes:
      job, space: what is tuned and the sizes each setting may time.
      study: the Optuna study (several workers may share it).
      budget: the configurations the study settles, all workers together.
      search: what proposes the next configurations (None: the grid's sampler alone).
      time_one: times one configuration ``(microbatch, label, setting, warmup) -> Timing`` (raises `TrialFailed`).
      on_trial: ``callback(record, done, total)`` after each of this worker's trials.
      searched_only: stop where the search proposes nothing more (no budget given), the sampler spending nothing.
      clock: where the trials' compiles and timed steps add their seconds.
    """

    job: Job
    space: Space
    study: optuna.Study
    budget: int
    search: Search | None
    time_one: Callable[[int, str, Setting, int], Timing]
    on_trial: Sequence[Callable[[TrialRecord, int, int], None]] = ()
    searched_only: bool = False
    clock: Clock = dataclasses.field(default_factory=Clock)
    ceilings: dict[tuple[Setting, str], int] = dataclasses.field(default_factory=dict)
    """Per (setting, strategy label): below a size whose accumulating step ran out of memory."""

    def by_number(self) -> dict[int, optuna.trial.FrozenTrial]:
        return {t.number: t for t in self.study.get_trials(deepcopy=False)}

    def steer(self) -> None:
        """Queues what the search proposes next (a configuration queued or settled already is not queued again)."""
        if self.search is None:
            return
        settings, knob_space = self.job.settings, self.job.knob_space
        index = {s: i for i, s in enumerate(settings)}
        for config in self.search.propose(searched(self.study, knob_space, index)):
            params = {"microbatch_size": config.microbatch_size, "strategy": config.strategy}
            self.study.enqueue_trial({**params, **knob_space.params_of(settings[config.setting])}, skip_if_exists=True)

    def objective(self, trial: optuna.Trial) -> float:
        """One configuration's throughput: timed, or reused from the trial that times it or its program."""
        job, knob_params = self.job, self.job.knob_space.params()
        m = trial.suggest_categorical("microbatch_size", self.space.sizes)
        label = trial.suggest_categorical("strategy", list(job.labels))
        setting = job.knob_space.setting_of({k: trial.suggest_categorical(k, v) for k, v in knob_params.items()})
        trial.set_user_attr("remat", setting.remat)
        trial.set_user_attr("accumulator_dtype", setting.accumulator_dtype)
        trial.set_user_attr("knobs", setting.values)
        bound = min(self.space.bounds[setting], self.ceilings.get((setting, label), self.space.bounds[setting]))
        if m > bound or m not in self.space.fitting[setting]:  # never timed: it claims nothing
            trial.set_user_attr("above_bound", bound)
            raise optuna.TrialPruned(f"microbatch {m} is not timed with {label}, {setting} (bound {bound})")
        reused = self._reused(trial, m, label, knob_params)
        if reused is not None:
            return reused
        began, starts = time.perf_counter(), self.clock.started()
        try:
            timing = self.time_one(m, label, setting, WARMUP)
        except TrialFailed as e:
            self.clock.spend("failed", began, starts)
            trial.set_user_attr("reason", str(e))
            if str(e).startswith("out of memory"):
                # The accumulating step also holds the whole batch and the accumulator, in buffers of its strategy's
                # own: larger sizes of this strategy (and setting) are not timed again, only to run out of memory.
                self.ceilings[(setting, label)] = m - 1
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        self.clock.spend("steps", began, starts, timing.compile_seconds)
        trial.set_user_attr("compile_seconds", timing.compile_seconds)
        trial.set_user_attr("times", list(timing.times or (timing.seconds_per_step,)))
        if timing.peak_bytes is not None:
            trial.set_user_attr("peak_bytes", timing.peak_bytes)
        return self.job.effective_batch / timing.seconds_per_step

    def _reused(self, trial: optuna.Trial, m: int, label: str, knob_params: Mapping[str, Any]) -> float | None:
        """The throughput of the trial that measures this configuration, or its program, if another does (None:
        this trial measures it); prunes this trial where the budget is claimed or another worker is measuring it."""
        holder = self.claim(trial)
        if holder is None:  # the study's budget is claimed, by this worker or others
            trial.set_user_attr("over_budget", True)
            self.study.stop()
            raise optuna.TrialPruned("the study's budget of trials is claimed")
        if holder != trial.number:  # a proposal again, a re-queued copy, or another worker's: never re-run
            trial.set_user_attr("duplicate_of", holder)
            other = self.by_number()[holder]
            if other.state == _COMPLETE:
                return float(other.value)  # type: ignore[arg-type]
            raise optuna.TrialPruned(f"trial {holder} measures this configuration")
        labels, eb = self.job.labels, self.job.effective_batch
        program = program_key(m, labels[label], eb)
        for other in self.study.get_trials(deepcopy=False, states=(_COMPLETE,)):
            same_knobs = all(other.params.get(k) == trial.params[k] for k in knob_params)
            other_m, other_label = int(other.params["microbatch_size"]), other.params["strategy"]
            if same_knobs and program_key(other_m, labels[other_label], eb) == program:
                # The same program (one accumulation step; scan unrolled 2 or 8 times over two steps): timing it
                # again would only let noise pick between identical programs.
                trial.set_user_attr("same_program_as", other.number)
                for name in ("times", "peak_bytes"):  # (read where the trial is shown: the dashboard)
                    if name in other.user_attrs:
                        trial.set_user_attr(name, other.user_attrs[name])
                return float(other.value)  # type: ignore[arg-type]
        return None

    def claim(self, trial: optuna.Trial) -> int | None:
        """The trial that measures ``trial``'s configuration: ``trial`` itself, an earlier one (settled, or running in
        any worker), or None where the study's budget of configurations is taken. Every worker reads the same
        study: of trials that claim at once, the one of the lowest number holds a configuration, and the budget's
        slots go by number too; two that read before either wrote may both measure (a budget overshot by at most
        the workers but one, a configuration measured at most twice)."""
        trial.set_user_attr(MEASURES, True)
        holders: dict[str, int] = {}
        for t in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number):
            if t.number == trial.number or measuring(t):
                holders.setdefault(config_key(t.params), t.number)
        holder = holders[config_key(trial.params)]
        if holder != trial.number:
            return holder
        return holder if sorted(holders.values()).index(holder) < self.budget else None

    def report(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        """After each trial: the search's next proposals, ``on_trial``, and a stop once the budget is settled."""
        self.steer()
        if self.searched_only and not self._waiting():
            study.stop()
        count = len(settled_configs(study))
        if trial.state != _PRUNED and "duplicate_of" not in trial.user_attrs:
            for callback in self.on_trial:
                callback(record(trial, self.job.effective_batch, self.job.labels), count, self.budget)
        if count >= self.budget:
            study.stop()

    def _waiting(self) -> bool:
        return any(t.state == _WAITING for t in self.study.get_trials(deepcopy=False))

    def run(self, timeout: float | None, heartbeats: bool) -> None:
        """Runs trials until the study has settled its budget (or ``timeout`` seconds pass). With nothing left to
        claim while other workers still run trials, waits for them: a trial whose worker died goes stale
        (``heartbeats``) and is queued again, for this worker to run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        after_round = -1
        self.steer()
        space = self.space
        grid_points = sum(len(f) for f in space.fitting.values()) * len(self.job.labels)
        above = len(space.sizes) * len(self.job.labels) * len(space.fitting) - grid_points  # pruned proposals
        while True:
            count = len(settled_configs(self.study))
            left = None if deadline is None else deadline - time.monotonic()
            if count >= self.budget or (left is not None and left <= 0):
                return
            trials = self.study.get_trials(deepcopy=False)
            idle = not any(t.state == _WAITING for t in trials)
            if idle and (after_round >= 0 or self.searched_only):
                if heartbeats and any(t.state == _RUNNING and measuring(t) for t in trials):
                    time.sleep(POLL_SECONDS if left is None else min(POLL_SECONDS, left))
                    fail_stale_trials(self.study)
                    continue
                if count == after_round or self.searched_only:  # nothing new to offer, no other worker running
                    return
            # Proposals of an already measured point cost nothing and don't count; the cap only bounds the loop.
            self.study.optimize(
                self.objective, n_trials=4 * (self.budget - count) + 16 + above, timeout=left,
                catch=(TrialFailed,), callbacks=[self.report],
            )  # fmt: skip
            after_round = len(settled_configs(self.study))

    def race(self, rounds: int) -> list[Runner]:
        """The finalists re-timed side by side (`autoaccum._tune.race`), the winner first. Several workers on one
        study race once: the first to finish records its race, the others take it."""
        ranked = entrants(self.study)
        key = [t.number for t in ranked]
        recorded = self.study.user_attrs.get("race")
        if (recorded is None or recorded["entrants"] != key) and rounds > 0 and len(ranked) > 1:
            runners = race(
                [(t.number, t.number, t.user_attrs.get("times") or ()) for t in ranked[:FINALISTS]], self._retime,
                rounds=rounds,
            )  # fmt: skip
            recorded = self.study.user_attrs.get("race")
            if recorded is None or recorded["entrants"] != key:
                recorded = {"entrants": key, "runners": [r.to_dict() for r in runners]}
                self.study.set_user_attr("race", recorded)
        if recorded is None or recorded["entrants"] != [t.number for t in entrants(self.study)]:
            return []
        return [Runner.from_dict(r) for r in recorded["runners"]]

    def _retime(self, number: int) -> tuple[float, ...] | None:
        """Trial ``number``'s configuration timed again (None if it failed this time)."""
        params = self.by_number()[number].params
        setting = self.job.knob_space.setting_of(params)
        try:
            timing = self.time_one(int(params["microbatch_size"]), params["strategy"], setting, RETIME_WARMUP)
        except TrialFailed:
            return None
        return timing.times or (timing.seconds_per_step,)


def time_here(job: Job, measure: Callable[..., Timing], full_batch: Any) -> Callable[[int, str, Setting, int], Timing]:
    """Times configurations in this process with ``measure(update, params, batch[, state=])``; each configuration's
    update is kept, so timing it again compiles nothing again."""
    updates: dict[tuple[int, str, Setting], Update] = {}
    with_state: dict[str, Any] = {} if job.state is None else {"state": job.state}

    def time_one(m: int, label: str, setting: Setting, warmup: int) -> Timing:
        if (m, label, setting) not in updates:
            strategy, options = job.labels[label]
            updates[(m, label, setting)] = build_update(
                job.loss_for(setting), job.optimizer, microbatch_size=m, strategy=strategy, **setting.build,
                **job.loss_kw, **options,
            )  # fmt: skip
        return measure(updates[(m, label, setting)], job.params, full_batch, **with_state)

    return time_one


def time_in_worker(job: Job, worker: Any, limit: int) -> Callable[[int, str, Setting, int], Timing]:
    """Times configurations in ``worker`` (`autoaccum._worker.Worker`), under ``limit`` bytes."""
    from autoaccum._worker import Request

    settings = job.settings

    def time_one(m: int, label: str, setting: Setting, warmup: int) -> Timing:
        strategy, options = job.labels[label]
        request = Request({"strategy": strategy, **options, **setting.build}, m, job.effective_batch, STEPS, warmup)
        outcome = worker.time(dataclasses.replace(request, setting=settings.index(setting)))
        if outcome.status == "oom":
            raise TrialFailed(f"out of memory in the worker (limit {format_bytes(limit)}): {outcome.message}")
        if outcome.status != "fits":
            message = (outcome.message or "").strip()
            raise TrialFailed(f"failed in the worker: {message if len(message) < 900 else message[:900] + ' ...'}")
        times = tuple(outcome.times or ())
        return Timing(outcome.seconds or 0.0, outcome.compile_seconds or 0.0, len(times), times, outcome.peak_bytes)

    return time_one
