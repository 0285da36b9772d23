"""A tune's study as this worker runs it: the configurations it times (`Trials.objective`), the loop that runs
until the study's budget is settled (`Trials.run`), and the finalists' race (`Trials.race`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna

from autoaccum._knobs import Setting
from autoaccum._tune.job import Job, Space
from autoaccum._tune.race import FINALISTS, SLOWER_OUT, Runner, race
from autoaccum._tune.result import Clock, TrialRecord, record, scoped
from autoaccum._tune.search import Config, Search, Trial
from autoaccum._tune.study import (
    MEASURES,
    State,
    config_key,
    fail_stale_trials,
    measuring,
    on_this_host,
    owner,
    settled,
    settled_configs,
)
from autoaccum._units import format_bytes
from autoaccum._update import Update
from autoaccum._worker import STEPS, WARMUP, Request, Timing, TrialFailed, Worker, brief

EXHAUSTIVE_UP_TO = 8
"""Without a budget, a space of at most this many configurations is searched whole (``GridSampler``); a larger
one until the search proposes nothing more (`autoaccum._tune.search`)."""

POLL_SECONDS = 0.5
"""How often a worker with nothing left to run looks at the trials other workers are running."""

TimeOne = Callable[[Config, int], Timing]
"""Times one configuration, ``(config, warmup steps) -> Timing``; raises `TrialFailed`."""

MEASURE: contextvars.ContextVar[Callable[..., Timing] | None] = contextvars.ContextVar("measure", default=None)
"""How `autoaccum.tune` times a configuration in this process, ``measure(update, params, batch[, state=]) ->
Timing``, instead of in the worker (`timed_by`); None: the worker (or `autoaccum._worker.time_update`)."""


def timed_by(measure: Callable[..., Timing] | None) -> contextlib.AbstractContextManager[None]:
    """Inside it, `autoaccum.tune` times configurations with ``measure`` (a test's deterministic stand-in)."""
    return scoped(MEASURE, measure)


@dataclasses.dataclass
class Trials:
    """The study of one tune, as this worker runs it (`Trials.start`).

    Attributes:
      job, space, study: what is tuned, the sizes each setting may time, the Optuna study (workers may share it).
      budget: the configurations the study settles, all workers together.
      search: what proposes the next configurations (None: the grid's sampler alone).
      searched_only: stop where the search proposes nothing more (no budget given).
      time_one, on_trial, clock: how a configuration is timed; ``callback(record, done, total)`` after each of this
        worker's trials; where compiles and timed steps add their seconds.
      ceilings: per (setting, strategy label), below the smallest size whose accumulating step ran out of memory
        (a heavier variant's bound too: `Job.lighter`); refused: per the same, its last refusal with XLA's bytes
        at an even split, ``(size, bytes)`` (`ceiling`).
    """

    job: Job
    space: Space
    study: optuna.Study
    budget: int
    search: Search | None
    searched_only: bool
    time_one: TimeOne
    on_trial: Sequence[Callable[[TrialRecord, int, int], None]]
    clock: Clock
    ceilings: dict[tuple[int, str], int] = dataclasses.field(default_factory=dict)
    refused: dict[tuple[int, str], tuple[int, int]] = dataclasses.field(default_factory=dict)
    mine: set[int] = dataclasses.field(default_factory=set)
    """The numbers of the trials this worker ran (`settled_here`)."""

    @classmethod
    def start(
        cls, job: Job, space: Space, study: optuna.Study, budget: int | None, seed: int, time_one: TimeOne,
        on_trial: Sequence[Callable[[TrialRecord, int, int], None]], clock: Clock,
    ) -> Trials:  # fmt: skip
        """Gives ``study`` its sampler: the grid's where ``budget`` covers the grid (without one, where the grid has
        at most `EXHAUSTIVE_UP_TO` points), else the search's proposals, then (with ``budget``) a seeded TPE whose
        ``constant_liar`` counts other workers' running trials as bad ones."""
        grid_points = sum(len(sizes) for sizes in space.fitting) * len(job.labels)
        exhaustive = grid_points <= EXHAUSTIVE_UP_TO if budget is None else budget >= grid_points
        if exhaustive:
            study.sampler = optuna.samplers.GridSampler(choices(job, space), seed=seed)
        else:
            with warnings.catch_warnings():  # "experimental" in some Optuna releases
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                startup = min(len(job.labels) + 2, 8)
                study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, constant_liar=True)
        search = None if exhaustive else Search(space.fitting, list(job.labels), job.effective_batch, job.program)
        settles = min(budget or grid_points, grid_points)
        return cls(job, space, study, settles, search, budget is None and not exhaustive, time_one, on_trial, clock)

    def record_probe(self) -> None:
        """The probe's fits where the search starts the default strategy (the whole batch, the largest accumulating
        size), as the study's trials of them, within the budget: they ran in the tuning worker with a trial's calls,
        so no trial times them again."""
        probed, job, eb = self.space.probed, self.job, self.job.effective_batch
        settled_now = settled_configs(self.study)
        starts = {eb, max((m for m in self.space.fitting[0] if m < eb), default=eb)} & set(self.space.fitting[0])
        ran = () if probed is None else probed.trials
        runs = [t for t in ran if t.fits and len(t.times) == STEPS and t.microbatch_size in starts]  # timed as trials
        distributions: dict[str, optuna.distributions.BaseDistribution] = {
            k: optuna.distributions.CategoricalDistribution(v) for k, v in choices(job, self.space).items()
        }
        setting = job.settings[0]
        for run in sorted(runs, key=lambda t: -t.microbatch_size)[: max(0, self.budget - len(settled_now))]:
            params = job.params_of(Config(run.microbatch_size, job.names[0]))
            if config_key(params) in settled_now:
                continue
            timing = Timing(statistics.median(run.times), run.compile_seconds or 0.0, len(run.times), run.times,
                            run.peak_bytes, run.cached_seconds)  # fmt: skip
            attrs = {MEASURES: True, "probe": True, **setting_attrs(setting), **timing_attrs(timing)}
            value = eb / timing.seconds_per_step
            self.study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=value,
                                                           user_attrs=attrs))  # fmt: skip
            added = next(t for t in reversed(self.study.get_trials(deepcopy=False)) if t.params == params)
            self.mine.add(added.number)
            for callback in self.on_trial:
                callback(record(added, eb, job.labels), len(settled_configs(self.study)), self.budget)

    def decided(self) -> int:
        """The configurations the study has decided toward its budget: those settled, and on the grid those it
        holds that are never timed (a lighter variant ran out of memory at a size at or below theirs), so that
        re-running a finished grid times nothing."""
        done = settled_configs(self.study).keys()
        if self.search is not None:
            return len(done)
        fitting = self.space.fitting
        below = {
            config_key(t.params) for t in self.study.get_trials(deepcopy=False, states=(State.PRUNED,))
            if "above_bound" in t.user_attrs
            and (c := self.job.config_of(t.params)).microbatch_size in fitting[c.setting]
        }  # fmt: skip
        return len(done | below)

    def settled_here(self) -> int:
        """The configurations this worker settled (another worker's, sharing the study, are theirs)."""
        trials = self.study.get_trials(deepcopy=False)
        return len({config_key(t.params) for t in trials if settled(t) and t.number in self.mine})

    def trial(self, number: int) -> optuna.trial.FrozenTrial:
        return next(t for t in self.study.get_trials(deepcopy=False) if t.number == number)

    def proposed(self) -> list[Config]:
        """What the search proposes to time next, given the settled trials ([]: it has finished, or there is none)."""
        if self.search is None:
            return []
        seen = []
        for t in self.study.get_trials(deepcopy=False):  # one pruned above a bound lowered by a failure: failed
            if settled(t) or (t.state == State.PRUNED and "above_bound" in t.user_attrs):
                value = float(t.value) if t.state == State.COMPLETE else None  # type: ignore[arg-type]
                seen.append(Trial(self.job.config_of(t.params), value, tuple(t.user_attrs.get("times") or ())))
        return self.search.propose(seen)

    def steer(self) -> None:
        """Queues what the search proposes next, but what is queued, being measured or settled (a configuration
        whose trial was killed, interrupted or over the budget is queued again), while the budget has a slot that
        no settled or running trial claims."""
        trials = self.study.get_trials(deepcopy=False)
        claimed = {config_key(t.params) for t in trials if measuring(t)}
        if len(claimed) >= self.budget:  # (queued again now, over the budget again: a loop)
            return
        taken = claimed | {
            config_key(t.system_attrs.get("fixed_params", {})) for t in trials if t.state == State.WAITING
        }
        for config in self.proposed():
            params = self.job.params_of(config)
            if config_key(params) not in taken:
                self.study.enqueue_trial(params)
                taken.add(config_key(params))

    def objective(self, trial: optuna.Trial) -> float:
        """One configuration's throughput: timed, or reused from the trial that times it or its program."""
        job, space = self.job, self.space
        self.mine.add(trial.number)
        params = {k: trial.suggest_categorical(k, v) for k, v in choices(job, space).items()}
        config = job.config_of(params)
        m, label, setting = config.microbatch_size, config.strategy, job.settings[config.setting]
        for name, value in setting_attrs(setting).items():
            trial.set_user_attr(name, value)
        top = space.bounds[config.setting]  # lowered by a ceiling: this variant's or a lighter one's
        bound = min(self.ceilings.get((config.setting, other), top) for other in job.lighter(label))
        if m > bound or m not in space.fitting[config.setting]:  # never timed: it claims nothing
            trial.set_user_attr("above_bound", bound)
            raise optuna.TrialPruned(f"microbatch {m} is not timed with {label}, {setting} (bound {bound})")
        reused = self._reused(trial, config)
        if reused is not None:
            return reused
        began, starts = time.perf_counter(), self.clock.started()
        try:
            timing = self.time_one(config, WARMUP)
        except TrialFailed as e:
            self.clock.spend("failed", began, starts)
            trial.set_user_attr("reason", str(e))
            if str(e).startswith("out of memory"):  # larger sizes of this strategy and setting would too
                key = (config.setting, label)
                self.ceilings[key] = self._ceiling(m, e.needs, self.refused.get(key))
                if e.needs is not None and job.effective_batch % m == 0:
                    self.refused[key] = (m, e.needs[0])
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            self.study.enqueue_trial(trial.params)  # for another worker sharing the study, or a re-run
            raise
        self.clock.spend("steps", began, starts, timing.compile_seconds)
        for name, value in timing_attrs(timing).items():
            trial.set_user_attr(name, value)
        return job.effective_batch / timing.seconds_per_step

    def _ceiling(self, m: int, needs: tuple[int, int] | None, before: tuple[int, int] | None) -> int:
        probed, one_device = self.space.probed, self.job.layout is None  # (on a mesh the state is split)
        state = probed.state_bytes if probed is not None and one_device else 0
        return ceiling(m, needs, state, self.job.effective_batch, before)

    def _reused(self, trial: optuna.Trial, config: Config) -> float | None:
        """The throughput of the trial that measures this configuration, or its program, if another does (None:
        this trial measures it); prunes this trial where the budget is claimed or another worker is measuring it."""
        holder = self.claim(trial)
        if holder is None:  # the study's budget is claimed, by this worker or others
            trial.set_user_attr("over_budget", True)
            self.study.stop()
            raise optuna.TrialPruned("the study's budget of trials is claimed")
        if holder != trial.number:  # a proposal again, a re-queued copy, or another worker's: never re-run
            trial.set_user_attr("duplicate_of", holder)
            other = self.trial(holder)
            if other.state == State.COMPLETE:
                return float(other.value)  # type: ignore[arg-type]
            raise optuna.TrialPruned(f"trial {holder} measures this configuration")
        program = self.job.program(config)
        for other in self.study.get_trials(deepcopy=False, states=(State.COMPLETE,)):
            if self.job.program(self.job.config_of(other.params)) == program:  # timing it again: noise would pick
                trial.set_user_attr("same_program_as", other.number)
                for name in ("times", "peak_bytes"):
                    if name in other.user_attrs:
                        trial.set_user_attr(name, other.user_attrs[name])
                return float(other.value)  # type: ignore[arg-type]
        return None

    def claim(self, trial: optuna.Trial) -> int | None:
        """The trial that measures ``trial``'s configuration: ``trial`` itself, an earlier one (settled, or running in
        any worker), or None where the study's budget of configurations is taken. Of trials that claim at once, the
        one of the lowest number holds a configuration, and the budget's slots go by number too; two that read
        before either wrote may both measure (a budget overshot by at most the workers but one)."""
        trial.set_user_attr(MEASURES, [owner(), trial.number])  # (a retried copy of a trial inherits its claim)
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
        if self.searched_only and not any(t.state == State.WAITING for t in study.get_trials(deepcopy=False)):
            study.stop()
        count = self.decided()
        if trial.state != State.PRUNED and "duplicate_of" not in trial.user_attrs:
            for callback in self.on_trial:
                callback(record(trial, self.job.effective_batch, self.job.labels), count, self.budget)
        if count >= self.budget:
            study.stop()

    def run(self, timeout: float | None, storage: optuna.storages.BaseStorage, beats: bool) -> None:
        """Runs trials until the study has settled its budget (or ``timeout`` seconds pass). With nothing left to
        claim while other workers still run trials, waits for those it can watch: all where the study's ``storage``
        ``beats`` (keeps heartbeats: a dead worker's trial goes stale), else this host's (a dead process is seen);
        a trial whose worker died is queued again, for this worker to run."""
        deadline = None if timeout is None else time.monotonic() + timeout
        after_round = -1
        fail_stale_trials(self.study, storage)  # a killed run's trial, queued again before anything else
        self.steer()
        labels, fitting = len(self.job.labels), self.space.fitting
        above = (len(self.space.sizes) * len(fitting) - sum(len(f) for f in fitting)) * labels  # pruned
        while True:
            count = self.decided()
            left = None if deadline is None else deadline - time.monotonic()
            if count >= self.budget or (left is not None and left <= 0):
                return
            trials = self.study.get_trials(deepcopy=False)
            if not any(t.state == State.WAITING for t in trials) and (after_round >= 0 or self.searched_only):
                if any(t.state == State.RUNNING and measuring(t) and (beats or on_this_host(t)) for t in trials):
                    fail_stale_trials(self.study, storage)
                    if not any(t.state == State.WAITING for t in self.study.get_trials(deepcopy=False)):
                        time.sleep(POLL_SECONDS if left is None else min(POLL_SECONDS, left))
                    continue
                if count == after_round or self.searched_only:  # nothing new to offer, no other worker running
                    return
            # Proposals of a measured point cost nothing and don't count; the cap only bounds the loop.
            self.study.optimize(
                self.objective, n_trials=4 * (self.budget - count) + 16 + above, timeout=left,
                catch=(TrialFailed,), callbacks=[self.report],
            )  # fmt: skip
            after_round = self.decided()

    def race(self, rounds: int) -> list[Runner]:
        """The finalists re-timed side by side (`autoaccum._tune.race`), the winner first: of the fastest entrants,
        those not `SLOWER_OUT` times slower than the fastest. Several workers on one study race once: the first to
        finish records its race (its entrants and rounds), the others take it."""
        ranked = self.entrants()
        key = {"entrants": [t.number for t in ranked], "rounds": rounds}
        recorded = self.study.user_attrs.get("race")
        close = [t for t in ranked[:FINALISTS] if float(t.value or 0) * SLOWER_OUT >= float(ranked[0].value or 0)]
        if (recorded is None or not _holds(recorded, key)) and rounds > 0 and len(close) > 1:
            finalists = [(t.number, t.number, t.user_attrs.get("times") or ()) for t in close]
            runners = race(finalists, self._retime, rounds=rounds)
            recorded = self.study.user_attrs.get("race")
            if recorded is None or not _holds(recorded, key):
                recorded = {**key, "runners": [r.to_dict() for r in runners]}
                self.study.set_user_attr("race", recorded)
        if recorded is None or not _holds(recorded, {**key, "entrants": [t.number for t in self.entrants()]}):
            return []
        return [Runner.from_dict(r) for r in recorded["runners"]]

    def entrants(self) -> list[optuna.trial.FrozenTrial]:
        """The study's measured configurations (each program once), fastest first: who may enter the race."""
        done = self.study.get_trials(deepcopy=False, states=(State.COMPLETE,))
        distinct = [t for t in done if not ({"duplicate_of", "same_program_as"} & t.user_attrs.keys())]
        return sorted(distinct, key=lambda t: (-float(t.value), t.number))  # type: ignore[arg-type]

    def _retime(self, number: int) -> tuple[float, ...] | str:
        """Trial ``number``'s configuration timed again (why not, where it failed this time)."""
        try:
            timing = self.time_one(self.job.config_of(self.trial(number).params), 0)
        except TrialFailed as e:
            return str(e)
        return timing.times or (timing.seconds_per_step,)


def choices(job: Job, space: Space) -> dict[str, list[Any]]:
    """Each Optuna parameter of a configuration and its values: the grid, the objective's and the recorded trials'."""
    return {"microbatch_size": space.sizes, "strategy": list(job.labels), **job.knob_space.params()}


def setting_attrs(setting: Setting) -> dict[str, Any]:
    """A trial's user attributes for its knob setting (`autoaccum._tune.result.record` reads them)."""
    return {"remat": setting.remat, "accumulator_dtype": setting.accumulator_dtype, "knobs": setting.values}


def timing_attrs(timing: Timing) -> dict[str, Any]:
    """A measured trial's user attributes for its timing: compile seconds, step times and its measured peak."""
    attrs = {"compile_seconds": timing.compile_seconds, "cached_seconds": timing.cached_seconds,
             "times": list(timing.times or (timing.seconds_per_step,))}  # fmt: skip
    return attrs if timing.peak_bytes is None else {**attrs, "peak_bytes": timing.peak_bytes}


def _holds(recorded: dict[str, Any], key: dict[str, Any]) -> bool:
    """Whether a recorded race raced ``key``'s entrants over its rounds."""
    return all(recorded.get(k) == v for k, v in key.items())


def ceiling(
    m: int, needs: tuple[int, int] | None, state_bytes: int, effective_batch: int, before: tuple[int, int] | None = None
) -> int:
    """The largest size left to time after microbatch ``m`` ran out of memory: below ``m``; where ``m`` splits the
    batch evenly and ``needs`` gives XLA's bytes for it and the limit, at most where the line from ``state_bytes``
    at size 0 through ``needs`` meets the limit (no size that fits lies beyond: the bytes that do not grow with the
    microbatch are at least the state's). With ``before``, the same variant's refusal at a larger even size
    ``(size, bytes)``: at most where the line through both meets it (0 where its bytes do not fall with the size).

    Example:
      >>> ceiling(16, (100, 34), state_bytes=1, effective_batch=128)  # 1 + 6.19 m bytes: 5 fits, 6 would not
      5
      >>> # 10 + 5.625 m through both refusals: 4 fits; bytes that barely fall: none fits
      >>> ceiling(16, (100, 34), 1, 128, before=(32, 190)), ceiling(16, (100, 34), 1, 128, before=(32, 101))
      (4, 0)
    """
    if needs is None or effective_batch % m:  # (an uneven split's last microbatch costs extra)
        return m - 1
    need, limit = needs
    if need <= limit or need <= state_bytes:
        return m - 1
    top = min(m - 1, int(m * (limit - state_bytes) / (need - state_bytes)))
    if before is None or before[0] <= m:
        return top
    rise = before[1] - need  # over (before[0] - m) examples
    return 0 if rise <= 0 else max(0, min(top, m + (limit - need) * (before[0] - m) // rise))


def time_here(job: Job, measure: Callable[..., Timing]) -> TimeOne:
    """Times configurations in this process with ``measure(update, params, batch[, state=])``; each configuration's
    update is kept, so timing it again compiles nothing again."""
    updates: dict[Config, Update] = {}
    batch, state = job.full_batch(), {} if job.state is None else {"state": job.state}

    def time_one(config: Config, warmup: int) -> Timing:
        if config not in updates:
            updates[config] = job.update(config)
        return measure(updates[config], job.params, batch, **state)

    return time_one


def time_in_worker(job: Job, worker: Worker) -> TimeOne:
    """Times configurations in ``worker``, under its limit."""

    def time_one(config: Config, warmup: int) -> Timing:
        strategy, options = job.labels[config.strategy]
        build = {"strategy": strategy, **options, **job.settings[config.setting].build}
        request = Request(build, config.microbatch_size, job.effective_batch, STEPS, warmup, config.setting)
        outcome = worker.time(request)
        if outcome.status == "oom":
            raise TrialFailed(
                f"out of memory in the worker (limit {format_bytes(worker.limit)}): {outcome.message}",
                None if outcome.need_bytes is None else (outcome.need_bytes, worker.limit),
            )
        if outcome.status != "fits":
            raise TrialFailed(f"failed in the worker: {brief(outcome.message, 900)}")
        times = tuple(outcome.times or ())
        return Timing(outcome.seconds or 0.0, outcome.compile_seconds or 0.0, len(times), times, outcome.peak_bytes,
                      outcome.cached_seconds or 0.0)  # fmt: skip

    return time_one
