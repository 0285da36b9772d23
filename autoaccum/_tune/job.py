"""What a tune works on: its arguments checked (`Job`), and the sizes each knob setting may time (`Space`)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle
import jax
import optax

from autoaccum._batch import abstract, abstract_batch, host_copy, resize_batch
from autoaccum._checks import check_bool, check_loss_fn, check_optimizer, check_positive_int
from autoaccum._estimate import Estimate, estimate
from autoaccum._json import JsonMixin
from autoaccum._knobs import Knobs, KnobSpace, Setting
from autoaccum._preflight import trace_loss, warn_if_not_finite, warn_of
from autoaccum._probe import LENT, ProbeResult, probe
from autoaccum._tune.result import Clock, scoped
from autoaccum._tune.search import Config
from autoaccum._tune.space import lighter, microbatch_candidates, probe_sizes, program_key, variants
from autoaccum._units import format_bytes, parse_bytes
from autoaccum._update import Update, build_update, resolve_strategy
from autoaccum._worker import Request, Worker, brief
from autoaccum.strategies import Layout, PyTree, check_params, layout_of, leading_size
from autoaccum.strategies import available as available_strategies
from autoaccum.strategies import get as get_strategy
from autoaccum.strategies._layout import check_effective_batch


@dataclasses.dataclass(frozen=True)
class Job:
    """`autoaccum.tune`'s arguments, checked (`Job.check`): the loss of each knob setting, the inputs, the space."""

    loss_fn: Callable[..., Any] | Knobs
    params: PyTree
    batch: PyTree
    optimizer: optax.GradientTransformation
    state: PyTree | None
    effective_batch: int
    names: list[str]
    knob_space: KnobSpace
    layout: Layout | None
    memory_limit: int | str | None
    min_microbatch: int
    loss_kw: dict[str, Any]
    children: bool
    """Whether the probe runs its trials in child processes (not on a TPU, unless asked)."""
    _losses: dict[Setting, Callable[..., Any]] = dataclasses.field(default_factory=dict, compare=False)

    @functools.cached_property
    def settings(self) -> list[Setting]:
        """Every setting of the knobs, the default first."""
        return self.knob_space.settings()

    @functools.cached_property
    def labels(self) -> dict[str, tuple[str, dict[str, Any]]]:
        """The strategy variants searched, by label (`autoaccum._tune.space.variants`)."""
        return variants(self.names, fsdp=self.layout is not None and self.layout.sharded_params)

    def lighter(self, label: str) -> list[str]:
        """The variants that need no more memory than ``label``'s at any size, ``label`` among them."""
        return [other for other, v in self.labels.items() if lighter(v, self.labels[label])]

    def allows(self, m: int) -> bool:
        """Whether the tuner may run microbatch ``m``: every microbatch of the split has at least ``min_microbatch``
        examples (the last one, an uneven split's remainder, too), and ``m`` splits over the mesh's shards."""
        rest, shards = self.effective_batch % m, 1 if self.layout is None else self.layout.shards
        return m >= self.min_microbatch and (rest == 0 or rest >= self.min_microbatch) and m % shards == 0

    def loss_for(self, setting: Setting) -> Callable[..., Any]:
        """The loss of ``setting`` (the loss's own knobs' values given to the factory)."""
        if setting not in self._losses:
            knobs = self.loss_fn
            self._losses[setting] = knobs.loss_fn(**setting.values) if isinstance(knobs, Knobs) else knobs
        return self._losses[setting]

    def config_of(self, params: Mapping[str, Any]) -> Config:
        """The `Config` of an Optuna trial's ``params``."""
        setting = self.settings.index(self.knob_space.setting_of(params))
        return Config(int(params["microbatch_size"]), params["strategy"], setting)

    def params_of(self, config: Config) -> dict[str, Any]:
        """The Optuna trial parameters of ``config`` (the inverse of `config_of`)."""
        knobs = self.knob_space.params_of(self.settings[config.setting])
        return {"microbatch_size": config.microbatch_size, "strategy": config.strategy, **knobs}

    def program(self, config: Config) -> tuple[Any, ...]:
        """What ``config`` compiles to: configurations with equal keys are timed once (`program_key`)."""
        return config.setting, program_key(config.microbatch_size, self.labels[config.strategy], self.effective_batch)

    def update(self, config: Config) -> Update:
        """``config``'s update, built here."""
        strategy, options = self.labels[config.strategy]
        setting = self.settings[config.setting]
        return build_update(
            self.loss_for(setting), self.optimizer, microbatch_size=config.microbatch_size, strategy=strategy,
            **setting.build, **self.loss_kw, **options,
        )  # fmt: skip

    def full_batch(self) -> PyTree:
        """The example batch resized to the effective batch (rows repeated); on a mesh, laid out as given."""
        batch = self.batch
        if self.effective_batch == leading_size(batch):
            return batch
        if self.layout is None:
            return resize_batch(batch, self.effective_batch)
        resized = resize_batch(jax.device_get(batch), self.effective_batch)
        return jax.tree.map(lambda r, x: jax.device_put(r, x.sharding), resized, batch)

    def programs(self, update: Update) -> list[Any]:
        """``update``'s programs at the effective batch, lowered from shapes (nothing runs)."""
        params = abstract(self.params)
        state = () if self.state is None else (abstract(self.state),)
        batch = abstract_batch(self.batch, self.effective_batch)
        return list(update.programs(params, jax.eval_shape(update.init, params), batch, *state))

    @classmethod
    def check(cls, loss_fn: Callable[..., Any] | Knobs, params: PyTree, batch: PyTree, **kw: Any) -> Job:
        """Checks ``tune``'s arguments (``kw``: its keyword arguments); raises ValueError or TypeError naming the
        bad one before anything runs. Traces the loss once, abstractly (its own errors come out here); runs none of
        it (`check_initial_loss` does, in the worker, where the search's sizes are bounded)."""
        optimizer, state = kw["optimizer"], kw["state"]
        check_optimizer(optimizer)
        check_params(params)
        size, given = leading_size(batch), kw["effective_batch"]
        effective_batch = size if given is None else check_positive_int(given, "effective_batch")
        _check_numbers(kw, effective_batch)
        names = _check_strategies(kw["strategies"])
        layout = layout_of(params, batch, () if state is None else state)
        if layout is not None:
            names = _on_mesh(layout, names, effective_batch, explicit=kw["strategies"] is not None)
        loss_kw = dict(has_aux=kw["has_aux"], has_state=state is not None, loss_reduction=kw["loss_reduction"])
        job = cls(
            loss_fn, params, batch, optimizer, state, effective_batch, names, kw["knob_space"], layout,
            kw["memory_limit"], kw["min_microbatch"], loss_kw, kw["children"],
        )  # fmt: skip
        default, loss = job.settings[0], job.loss_for(job.settings[0])
        if kw["memory_limit"] is not None:
            parse_bytes(kw["memory_limit"], "memory_limit")
        for name in names:  # bad input (optimizer, loss, options) fails here, not in trial 0
            build_update(loss, optimizer, microbatch_size=1, strategy=name, **default.build, **loss_kw)
        trace_loss(loss, params, batch, state)  # the loss's own error, before any child starts
        for setting in job.settings:  # every setting's loss made and its output checked, on the batch's shapes
            _check_output(job, setting)
        if kw["strategies"] is None:  # the default update's strategy ("auto" picks it) first: the probe runs it
            auto = resolve_strategy(loss, optimizer, params, batch, state, **default.build, **loss_kw)
            names.sort(key=lambda name: name != auto["strategy"])
        return job


def _check_output(job: Job, setting: Setting) -> None:
    """Traces ``setting``'s loss on the example batch's shapes with the output checks of an update (a scalar loss,
    ``(loss, aux)`` with ``has_aux``, ``(loss_sum, weight)`` with ``"sum"``); what is wrong names the setting."""
    loss = job.loss_for(setting)
    check_loss_fn(loss)
    rows = leading_size(job.batch)
    update = build_update(
        loss, job.optimizer, microbatch_size=rows, strategy=job.names[0], **setting.build, **job.loss_kw
    )
    try:
        update.accumulation.out_dtypes(job.params, job.batch, () if job.state is None else job.state)
    except (TypeError, ValueError) as e:
        if len(job.settings) > 1 and hasattr(e, "add_note"):
            e.add_note(f"(the loss of the knob setting {setting})")
        raise


def _check_numbers(kw: dict[str, Any], effective_batch: int) -> None:
    check_bool(kw["fresh"], "fresh")
    check_bool(kw["isolate"], "isolate")
    for name, what in (("race_rounds", "0: no race"), ("seed", "the sampler's seed")):
        value = kw[name]
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ValueError(f"`{name}` must be an int >= 0 ({what}), got {name}={value!r}.")
    for label in ("trial_timeout", "compile_timeout", "timeout"):
        seconds = kw[label]
        if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
            raise ValueError(f"`{label}` must be a positive number of seconds or None, got {label}={seconds!r}.")
    if kw["budget"] is not None:
        check_positive_int(kw["budget"], "budget")
    largest = effective_batch
    if kw["microbatch_bound"] is not None:
        largest = min(largest, check_positive_int(kw["microbatch_bound"], "microbatch_bound"))
    check_positive_int(kw["min_microbatch"], "min_microbatch")
    if kw["min_microbatch"] > largest:
        raise ValueError(
            f"`min_microbatch`={kw['min_microbatch']} is above the largest microbatch that may be timed ({largest}: "
            f"`effective_batch`={effective_batch}, `microbatch_bound`={kw['microbatch_bound']}); lower it."
        )


def _check_strategies(strategies: Sequence[str] | None) -> list[str]:
    if isinstance(strategies, str):
        raise TypeError(
            f"`strategies` must be a sequence of strategy names (None: all), got the string strategies={strategies!r}; "
            f"e.g. strategies=[{strategies!r}]."
        )
    names = list(available_strategies() if strategies is None else strategies)
    if not names:
        raise ValueError(f"`strategies` is empty; choose from {', '.join(available_strategies())}.")
    for name in names:
        get_strategy(name)
    return names


def _on_mesh(layout: Layout, names: list[str], effective_batch: int, *, explicit: bool) -> list[str]:
    """The strategies that run on ``layout``'s mesh (global microbatch sizes, multiples of the shards)."""
    check_effective_batch(effective_batch, layout)
    off = [n for n in names if not get_strategy(n).supports(layout)]
    if explicit and off:
        fsdp = layout.sharded_params and "multisteps" in off
        why = " (parameters sharded over it, FSDP: multisteps needs them replicated)" if fsdp else ""
        running = [n for n in available_strategies() if get_strategy(n).supports(layout)]
        raise ValueError(
            f"`strategies` {off} do not run with these inputs on a mesh{why}; leave them out, e.g. "
            f"strategies={running}."
        )
    return [n for n in names if n not in off]


@dataclasses.dataclass(frozen=True)
class Space(JsonMixin):
    """The sizes each knob setting (by index, the default first) may time (`Space.bound`); stored with the study.

    Attributes:
      bounds: the largest microbatch whose step accumulating the effective batch fits (the probe's for the default
        setting, the calibrated estimate's for the others; ``microbatch_bound`` for all when given).
      fitting: the candidate sizes within the bound whose microbatches all have at least ``min_microbatch``
        examples and split over the mesh (`Job.allows`) and whose accumulating step is not predicted over the limit.
      predicted_over: per setting (by its text), the candidates left out as predicted over the limit.
      probed: the probe's result (None with ``microbatch_bound``).
    """

    bounds: list[int]
    fitting: list[list[int]]
    predicted_over: dict[str, list[int]]
    probed: ProbeResult | None

    @property
    def sizes(self) -> list[int]:
        return list(dict.fromkeys(m for sizes in self.fitting for m in sizes))

    @classmethod
    def bound(cls, job: Job, microbatch_bound: int | None, clock: Clock, worker: Worker | None = None) -> Space:
        """Probes the default setting's step over the effective batch (unless ``microbatch_bound`` is given) and
        bounds every other setting by its compile-only estimate calibrated by the probe (`ProbeResult.bound_for`).
        Sizes whose accumulating step the calibrated estimate predicts over the limit are left out.

        Raises:
          RuntimeError: no size at least ``min_microbatch`` fits, or none is a candidate.
        """
        eb, default = job.effective_batch, job.settings[0]
        with clock.phase("probe"):  # (the worker starts here: its start goes to its own phase)
            check_initial_loss(job, worker)
        probed = None
        if microbatch_bound is None:
            # the probe's trials run in the tuning worker, not one of their own
            with clock.phase("probe"), scoped(LENT, worker):
                probed = probe(
                    job.loss_for(default), job.params, job.batch, optimizer=job.optimizer, strategy=job.names[0],
                    memory_limit=job.memory_limit if worker is None or job.memory_limit is None else worker.limit,
                    microbatch_cap=eb, state=job.state,
                    has_aux=job.loss_kw["has_aux"], loss_reduction=job.loss_kw["loss_reduction"],
                    options=None if default.remat is None else {"remat": default.remat},
                    sizes=[m for m in probe_sizes(eb) if job.allows(m)], effective_batch=eb,
                    **({} if job.children else {"isolate": False}),  # type: ignore[arg-type]
                )  # fmt: skip
            microbatch_bound = probed.max_microbatch
        bounds = [min(microbatch_bound, eb)] * len(job.settings)  # (a bound given above the batch: the batch)
        accumulating: dict[int, Estimate] = {}
        if probed is not None:
            with clock.phase("estimate"):
                accumulating = _estimates(job, probed, bounds, worker)
        fitting: list[list[int]] = []
        over: dict[str, list[int]] = {}
        for i, b in enumerate(bounds):
            candidates = [m for m in microbatch_candidates(eb, max(b, 1)) if m <= b and job.allows(m)]
            fits = [m for m in candidates if _fits(probed, accumulating.get(i), m, eb)]
            fitting.append(fits or candidates[:1])  # all predicted over: a trial decides the smallest
            if len(fitting[i]) < len(candidates):
                over[str(job.settings[i])] = [m for m in candidates if m not in fitting[i]]
        space = cls(bounds, fitting, over, probed)
        if not space.sizes:
            raise RuntimeError(
                f"no microbatch size to time between `min_microbatch`={job.min_microbatch} and the bounds "
                f"{sorted(set(bounds))} (sizes that split {eb} examples evenly or are powers of two); lower "
                "`min_microbatch`."
            )
        return space


def check_initial_loss(job: Job, worker: Worker | None) -> None:
    """Warns where the default setting's loss is not finite at the initial parameters (`warn_if_not_finite`), in
    ``worker`` where there is one (the caller runs none of the user's loss: a crash or a hang stays there), else
    here; where the worker could not evaluate it, a RuntimeWarning says why and the tune goes on."""
    rows = max(8, job.min_microbatch)  # (a loss may need several examples)
    kw = dict(has_aux=job.loss_kw["has_aux"], loss_reduction=job.loss_kw["loss_reduction"])
    if worker is None:
        warn_if_not_finite(job.loss_for(job.settings[0]), job.params, job.batch, state=job.state, rows=rows, **kw)
        return
    inputs = worker.folder / "initial.pkl"
    copies = (host_copy(job.params), None if job.state is None else host_copy(job.state))
    inputs.write_bytes(cloudpickle.dumps(copies))  # (a class of the user's script, __main__'s, goes by value)
    try:
        outcome = worker.ask(Request({}, rows, 0, kind="loss", inputs=str(inputs)))
    finally:
        inputs.unlink()
    if outcome.status == "fits":
        warn_of(outcome.loss, rows, stacklevel=7)  # (at the caller of tune)
    else:
        message = brief(outcome.message, 600)
        warnings.warn(f"the loss could not be run at the initial parameters in the worker: {message}", RuntimeWarning,
                      stacklevel=6)  # fmt: skip


def _fits(probed: ProbeResult | None, accumulating: Estimate | None, m: int, effective_batch: int) -> bool:
    if probed is None or accumulating is None or m >= effective_batch:
        return True
    return probed.predicted_peak(accumulating, m, effective_batch) <= probed.memory_limit_bytes


def _estimates(job: Job, probed: ProbeResult, bounds: list[int], worker: Worker | None) -> dict[int, Estimate]:
    """Sets every other setting's bound in ``bounds`` from its estimate (in ``worker`` where there is one);
    returns each setting's estimate of its accumulating step, where the effective batch needs accumulating."""
    accumulates = probed.max_microbatch < job.effective_batch
    kw = {
        "microbatch_cap": probed.microbatch_cap, "accumulation": accumulates,
        "effective_batch": job.effective_batch if accumulates else None,
    }  # fmt: skip
    accumulating: dict[int, Estimate] = {}
    for i, setting in enumerate(job.settings):
        if i == 0 and not accumulates:
            continue  # the probe measured it
        # the accumulator and the batch are the same for every loss and remat: the first estimate's serve all
        like = next(
            (e for j, e in accumulating.items() if job.settings[j].accumulator_dtype == setting.accumulator_dtype), None
        )
        more = {} if like is None else {"accumulation_from": like}
        if i == 0 and probed.estimate is not None:
            predicted = probed.estimate  # the probe's, of the step it ran: accumulating the effective batch
        else:
            predicted = _estimate(job, setting, probed.memory_limit_bytes, worker, {**kw, **more})
        if i:
            bounds[i] = probed.bound_for(predicted)
        if accumulates:
            accumulating[i] = predicted
    if max(bounds) < job.min_microbatch:
        floor = job.min_microbatch
        raise RuntimeError(
            f"nothing fits: no microbatch of at least `min_microbatch`={floor} fits under the probe's limit "
            f"({format_bytes(probed.memory_limit_bytes)}) with any setting of the knobs; reduce the model, raise "
            "`memory_limit`" + (" or lower `min_microbatch`." if floor > 1 else ".")
        )
    return accumulating


def _estimate(job: Job, setting: Setting, limit: int, worker: Worker | None, kw: dict[str, Any]) -> Estimate:
    """``setting``'s compile-only estimate (`autoaccum.estimate`'s ``kw``): in ``worker``, else here."""
    if worker is None:
        return estimate(
            job.loss_for(setting), job.params, job.batch, optimizer=job.optimizer, strategy=job.names[0],
            memory_limit=limit, state=job.state, has_aux=job.loss_kw["has_aux"],
            loss_reduction=job.loss_kw["loss_reduction"], **setting.build, **kw,
        )  # fmt: skip
    build = {"strategy": job.names[0], **setting.build}
    wire = {k: v.to_dict() if isinstance(v, Estimate) else v for k, v in kw.items()}  # (the request travels as JSON)
    request = Request(
        build, 1, job.effective_batch, kind="estimate", setting=job.settings.index(setting), estimate=wire
    )
    outcome = worker.ask(request)
    if outcome.status != "fits" or outcome.estimate is None:
        raise RuntimeError(f"the compile-only estimate of {setting} failed in the worker: {outcome.message}")
    return Estimate.from_dict(outcome.estimate)
