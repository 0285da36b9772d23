"""`autoaccum.tune`: the emitted step is exact, studies resume, seeds reproduce, failures don't stop a study."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optuna
import pytest
from helpers import constant_measure, fake_measure, linear_problem
from seams import tune

import autoaccum
import autoaccum._device
from autoaccum import Plan, Update, workloads
from autoaccum._catalog import entry_for
from autoaccum._device import device_kind
from autoaccum._tune.race import quartiles, race
from autoaccum._tune.space import microbatch_candidates, variants
from autoaccum._worker import Timing, TrialFailed


@pytest.fixture(scope="module")
def linear() -> autoaccum.Workload:
    return workloads.linear(batch_size=24, features=16)


def test_candidates_and_variants() -> None:
    assert microbatch_candidates(24, 16) == [1, 2, 3, 4, 6, 8, 12, 16]
    assert microbatch_candidates(10, 100) == [1, 2, 5, 10, 4, 8]
    assert list(variants(["scan", "loop", "multisteps"])) == [
        "scan", "scan:unroll=2", "scan:unroll=8", "loop", "multisteps"
    ]  # fmt: skip


def test_emitted_update_equals_full_batch_step(linear: autoaccum.Workload) -> None:
    optimizer = optax.adamw(1e-2)
    result = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=optimizer,
        microbatch_bound=8,
        budget=4,
        storage=":memory:",
        strategies=["scan", "loop"],
    )
    assert result.probe is None
    assert [r.state for r in result.trials].count("COMPLETE") == 4
    # Timed in the worker, then the best configurations raced: the plan is the race's winner, at its median (no race
    # where one trial read over SLOWER_OUT times faster than the others: the plan is that fastest trial).
    if result.race:
        winner = next(r for r in result.trials if r.number == result.race[0].trial)
        assert result.plan.throughput == pytest.approx(24 / result.race[0].quartiles[1])
    else:
        winner = result.trials[0]  # (fastest first)
        assert result.plan.throughput == pytest.approx(winner.throughput)
    assert (result.plan.microbatch_size, result.plan.strategy) == (winner.microbatch_size, winner.strategy)
    assert result.plan.throughput > 0
    assert result.plan.microbatch_size <= 8 and all(r.peak_bytes is not None for r in result.trials)
    # measured (a step this small may fit in memory the worker already holds: then its growth is 0)
    assert result.peak_bytes is not None and 0 <= result.peak_bytes <= result.memory_limit_bytes

    loss, grads = jax.value_and_grad(linear.loss_fn)(linear.params, linear.batch)
    updates, _ = optimizer.update(grads, optimizer.init(linear.params), linear.params)
    expected = optax.apply_updates(linear.params, updates)
    params = jax.tree.map(jnp.array, linear.params)
    params, _, got_loss = result.update_fn(params, result.init(params), linear.batch)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_allclose(got_loss, loss, atol=1e-6)
    # The user's params were not donated: still readable.
    assert np.isfinite(np.asarray(linear.params["w"])).all()


def test_small_space_is_covered_completely(linear: autoaccum.Workload) -> None:
    calls: list[Any] = []
    result = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        microbatch_bound=4,
        storage=":memory:",
        race_rounds=0,
        measure=fake_measure(calls),
    )
    # sizes 1, 2, 3, 4 x 5 variants = 20 > EXHAUSTIVE_UP_TO, so pass n_trials to cover it all:
    assert len(calls) == len(result.trials) <= 12
    full = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        microbatch_bound=4,
        storage=":memory:",
        budget=20,
        race_rounds=0,
        measure=fake_measure(calls := []),
    )
    assert sorted(calls) == sorted(
        (m, name, tuple(sorted(opts.items())))
        for m in (1, 2, 3, 4)
        for name, opts in variants(["scan", "loop", "multisteps"]).values()
    )
    assert full.plan.microbatch_size == 4 and full.plan.strategy == "scan" and full.plan.options == {"unroll": 8}


def test_never_times_a_size_above_the_bound(linear: autoaccum.Workload) -> None:
    calls: list[Any] = []
    tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        microbatch_bound=6,
        budget=10,
        storage=":memory:",
        measure=fake_measure(calls),
    )
    assert calls and max(m for m, _, _ in calls) <= 6


def test_same_seed_same_plan(linear: autoaccum.Workload) -> None:
    def run(seed: int) -> tuple[Plan, list[Any]]:
        calls: list[Any] = []
        result = tune(
            linear.loss_fn,
            linear.params,
            linear.batch,
            optimizer=linear.optimizer,
            microbatch_bound=24,
            budget=10,
            storage=":memory:",
            seed=seed,
            measure=fake_measure(calls),
        )
        return result.plan, calls

    plan_a, calls_a = run(3)
    plan_b, calls_b = run(3)
    assert plan_a == plan_b
    assert calls_a == calls_b
    cost = {m: fake_measure()(autoaccum.build_update(linear.loss_fn, linear.optimizer, microbatch_size=m, strategy=s,
            **dict(o)), linear.params, linear.batch).seconds_per_step for m, s, o in calls_a}  # fmt: skip
    best = min(cost, key=cost.__getitem__)
    assert plan_a.microbatch_size == best  # the fake cost's optimum among the sizes tried


def test_failed_trials_do_not_stop_the_study(linear: autoaccum.Workload) -> None:
    result = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        microbatch_bound=12,
        budget=12,
        storage=":memory:",
        measure=fake_measure(fail_from=8),
    )
    failed = [r for r in result.trials if r.state == "FAIL"]
    assert failed and all("out of memory" in (r.reason or "") for r in failed)
    assert all(r.microbatch_size >= 8 for r in failed)
    assert result.plan.microbatch_size < 8
    assert result.trials[0].state == "COMPLETE"


def test_every_trial_failing_is_an_error_whose_fix_fits_the_failures(linear: autoaccum.Workload) -> None:
    kw: dict[str, Any] = dict(optimizer=linear.optimizer, microbatch_bound=2, storage=":memory:")
    with pytest.raises(RuntimeError, match=r"every trial failed .*; lower the effective batch or raise `memory_limit`"):
        tune(linear.loss_fn, linear.params, linear.batch, measure=fake_measure(fail_from=1), **kw)

    def crashing(update: Update, params: Any, batch: Any) -> Timing:
        raise TrialFailed("failed in the worker: the trial's child crashed with SIGABRT")

    with pytest.raises(RuntimeError, match=r"crashed with SIGABRT.*; each reason is the trial's own") as caught:
        tune(linear.loss_fn, linear.params, linear.batch, measure=crashing, **kw)
    assert "memory_limit" not in str(caught.value)  # (it said to raise the memory limit)


def test_interrupted_tune_resumes_without_rerunning(linear: autoaccum.Workload, tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    first: list[Any] = []
    inner = fake_measure(first)

    def interrupting(update: Update, params: Any, batch: Any) -> Timing:
        if len(first) == 5:
            raise KeyboardInterrupt  # Ctrl-C during the sixth trial
        return inner(update, params, batch)

    # n_trials: the whole grid (sizes 1-4 x 5 variants), searched by the GridSampler
    kwargs: dict[str, Any] = dict(microbatch_bound=4, budget=20, storage=storage, study_name="resume", race_rounds=0)
    with pytest.raises(KeyboardInterrupt):
        tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, measure=interrupting, **kwargs)
    assert len(first) == 5

    second: list[Any] = []
    result = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, measure=fake_measure(second), **kwargs
    )
    assert not set(first) & set(second)  # nothing measured in the first run is measured again
    assert len(first) + len(second) == 20  # and the whole grid got measured, the interrupted point included
    assert sum(r.state == "COMPLETE" for r in result.trials) == 20
    assert all(r.state == "COMPLETE" for r in result.trials), result.trials  # the interrupted one is no failure

    third: list[Any] = []  # a finished study: nothing left to run
    again = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, measure=fake_measure(third), **kwargs
    )
    assert third == []
    assert again.plan == result.plan


def test_a_configuration_whose_trials_died_unsettled_is_measured_when_proposed(
    linear: autoaccum.Workload, tmp_path: Path
) -> None:
    """A trial interrupted is queued again at once (for a worker sharing the study, or the next run); one whose
    trials all died unsettled (killed twice: the heartbeat's retry spent) is queued again when the search proposes
    it. Optuna's ``skip_if_exists`` matched the dead trials, and every later run stopped at once, saying the search
    "would time" it next (a reviewer's report)."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    kw: dict[str, Any] = dict(optimizer=linear.optimizer, microbatch_bound=4, storage=storage, study_name="s",
                              race_rounds=0)  # fmt: skip
    first: list[Any] = []

    def interrupting(update: Update, params: Any, batch: Any) -> Timing:
        first.append((update.microbatch_size, update.strategy, tuple(sorted(update.options.items()))))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune(linear.loss_fn, linear.params, linear.batch, measure=interrupting, **kw)
    study = optuna.load_study(study_name="s", storage=storage)
    (interrupted,) = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert interrupted.params in [t.system_attrs["fixed_params"] for t in waiting]  # queued again at the interrupt
    for _ in waiting:  # every queued trial dies too, unsettled: none is left queued
        trial = study.ask()
        for name, distribution in interrupted.distributions.items():
            trial.suggest_categorical(name, distribution.choices)  # type: ignore[attr-defined]
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    second: list[Any] = []
    result = tune(linear.loss_fn, linear.params, linear.batch, measure=fake_measure(second), **kw)
    assert second[:1] == first and "stopped before it finished" not in result.message
    assert any(r.state == "COMPLETE" and r.microbatch_size == interrupted.params["microbatch_size"]
               and r.strategy == first[0][1] for r in result.trials)  # fmt: skip


def test_effective_batch_larger_than_the_example_batch(linear: autoaccum.Workload) -> None:
    sizes: list[int] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        sizes.append(jax.tree.leaves(batch)[0].shape[0])
        return fake_measure()(update, params, batch)

    result = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        effective_batch=50,
        microbatch_bound=16,
        budget=3,
        storage=":memory:",
        measure=measure,
    )
    assert set(sizes) == {50}
    assert result.plan.effective_batch == 50
    assert result.plan.accumulation_steps == -(-50 // result.plan.microbatch_size)


def test_plan_round_trip_and_build(linear: autoaccum.Workload, tmp_path: Path) -> None:
    result = tune(
        linear.loss_fn,
        linear.params,
        linear.batch,
        optimizer=linear.optimizer,
        microbatch_bound=8,
        budget=3,
        storage=":memory:",
        measure=fake_measure(),
    )
    path = result.plan.save(tmp_path / "plan.json")
    loaded = Plan.load(path)
    assert loaded == result.plan
    update = loaded.build(linear.loss_fn, optax.sgd(0.1), params=linear.params)
    assert (update.microbatch_size, update.strategy, update.options) == (
        result.plan.microbatch_size,
        result.plan.strategy,
        result.plan.options,
    )


def test_plan_file_errors(linear: autoaccum.Workload, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"format": "autoaccum.plan/1", "microbatch')
    with pytest.raises(ValueError, match="is not valid JSON"):
        Plan.load(corrupt)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="is not an autoaccum Plan"):
        Plan.load(other)

    plan = Plan(10, 4, 3, "scan", params={"['w']": "float32[16]", "['b']": "float32[]"})
    with pytest.raises(ValueError, match=r"\['w'\]: plan has float32\[16\], params have float32\[8\]"):
        plan.build(linear.loss_fn, optax.sgd(0.1), params={"w": jnp.zeros(8), "b": jnp.zeros(())})
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        plan.check_params({"w": jnp.zeros(16)})
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        Plan.load(tmp_path)
    # A file with a bad value is refused when read, naming the field (they loaded, and failed later or not at all).
    for field, value, match in (
        ("accumulator_dtype", "float7", r"Plan `accumulator_dtype` must name a floating dtype .* got 'float7'"),
        ("loss_reduction", "avg", r"Plan `loss_reduction` must be one of \('mean', 'sum'\), got 'avg'"),
        ("source", "guessed", r"Plan `source` must be one of \('measured', 'predicted'\), got 'guessed'"),
    ):
        bad = tmp_path / f"{field}.json"
        bad.write_text(json.dumps({**Plan(10, 4, 3, "scan").to_dict(), field: value}))
        with pytest.raises(ValueError, match=match):
            Plan.load(bad)
    with pytest.raises(ValueError, match=r"microbatch_size=40 is above effective_batch=10"):
        Plan(10, 40, 1, "scan")


def test_a_variant_refused_twice_with_bytes_that_do_not_fall_to_the_limit_is_not_compiled_again() -> None:
    """loop's step is refused on XLA's bytes at every size (a fixed part over the limit, 1% per example): after two
    refusals at even splits, the line through them meets the limit at no size, and no smaller loop is timed (a new
    user's tune walked two such variants down to microbatch 1, 1024 steps of 9.8 s); scan is searched as before."""
    params, batch = linear_problem(batch_size=64)
    limit, calls = 10**6, []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m = update.microbatch_size
        calls.append((m, update.strategy))
        if update.strategy == "loop":
            need = int(limit * (1.2 + 0.01 * m))
            raise TrialFailed(f"out of memory: not run: XLA's buffers need {need} B", (need, limit))
        return Timing(seconds_per_step=0.01 * (64 / m) + 0.001 * m, compile_seconds=0.1, steps=5)

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    result = tune(loss_fn, params, batch, optimizer=optax.sgd(0.1), strategies=["scan", "loop"], microbatch_bound=64,
                  storage=":memory:", measure=measure, race_rounds=0)  # fmt: skip
    assert len([c for c in calls if c[1] == "loop"]) == 2, calls
    assert result.plan.strategy == "scan" and result.plan.microbatch_size < 64


def test_a_loss_that_needs_several_examples_is_tuned_above_min_microbatch() -> None:
    """A loss that takes its microbatch in two chunks runs on no fewer than two examples: with min_microbatch=8 the
    tune traces it (fingerprint, checks) on the batch's shapes and tunes it, in the worker too (it was traced on one
    example first: "cannot reshape array of shape (1, 4)"); no trial ran below 8."""
    batch = {"x": jnp.arange(64.0).reshape(16, 4) / 64}

    def loss_fn(w: jax.Array, b: Any) -> jax.Array:
        return jnp.mean((b["x"].reshape(2, -1, 4) @ w) ** 2)

    result = tune(loss_fn, jnp.ones(4), batch, optimizer=optax.sgd(0.1), min_microbatch=8, memory_limit="256MiB",
                  strategies=["scan"], budget=2, storage=":memory:", race_rounds=0)  # fmt: skip
    assert min(t.microbatch_size for t in result.trials) >= 8 and result.plan.microbatch_size >= 8


def test_a_plan_measured_elsewhere_warns_when_built_here(linear: autoaccum.Workload) -> None:
    """A plan measured on another device or jax version builds, with a warning saying so and what to do, and one
    predicted for a catalogued card this process does not run on; one measured here, and a predicted one for a target
    not in the catalog (a memory limit on this platform), build without one."""
    foreign = Plan(10, 4, 3, "scan", device="NVIDIA H100 80GB HBM3", versions={"jax": "0.4.1"})
    with pytest.warns(UserWarning, match=r"measured on NVIDIA H100 80GB HBM3 with jax 0\.4\.1, and this process runs "
                      rf"{re.escape(device_kind())} with jax {jax.__version__}.*tune again"):  # fmt: skip
        foreign.build(linear.loss_fn, optax.sgd(0.1))
    here = dataclasses.replace(foreign, device=device_kind(), versions={"jax": jax.__version__})
    older = dataclasses.replace(here, device=jax.devices()[0].platform)  # (a CPU plan saved before: "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        here.build(linear.loss_fn, optax.sgd(0.1))
        if jax.default_backend() == "cpu":
            older.build(linear.loss_fn, optax.sgd(0.1))
        dataclasses.replace(foreign, source="predicted", device="24.00 GiB").build(linear.loss_fn, optax.sgd(0.1))
    predicted = dataclasses.replace(foreign, source="predicted", device="H100-80GB")
    if entry_for(device_kind()) != "H100-80GB":
        with pytest.warns(UserWarning, match=r"predicted for H100-80GB from XLA's compiler \(nothing ran\), and this "
                          rf"process runs {re.escape(device_kind())}.*tune here"):  # fmt: skip
            predicted.build(linear.loss_fn, optax.sgd(0.1))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"effective_batch": 0}, ValueError, r"`effective_batch` must be >= 1, got effective_batch=0"),
        ({"budget": 0}, ValueError, r"`budget` must be >= 1, got budget=0"),
        ({"strategies": ["scan", "fast"]}, ValueError, r"unknown `strategy` 'fast'; choose one of"),
        ({"strategies": []}, ValueError, r"`strategies` is empty"),
        (
            {"strategies": "scan"},
            TypeError,
            r"`strategies` must be a sequence .* got the string strategies='scan'; e\.g\. strategies=\['scan'\]",
        ),
        ({"storage": "nosuchdb://x"}, ValueError, r"`storage`='nosuchdb://x' cannot be opened"),
        ({"memory_limit": "lots"}, ValueError, r"`memory_limit`='lots' does not parse"),
        ({"seed": "a"}, ValueError, r"`seed` must be an int >= 0 \(the sampler's seed\), got seed='a'"),
        ({"race_rounds": -1}, ValueError, r"`race_rounds` must be an int >= 0 \(0: no race\), got race_rounds=-1"),
        ({"on_trial": print}, TypeError, r"`on_trial` must be a list of callbacks.*e\.g\. on_trial=\[callback\]"),
        ({"on_trial": [print, 3]}, TypeError, r"`on_trial` must be a list of callbacks"),
    ],
)
def test_bad_input_fails_before_any_trial(
    linear: autoaccum.Workload, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    calls: list[Any] = []
    with pytest.raises(error, match=match):
        tune(
            linear.loss_fn,
            linear.params,
            linear.batch,
            optimizer=linear.optimizer,
            microbatch_bound=4,
            measure=fake_measure(calls),
            **{"storage": ":memory:", **kwargs},
        )
    assert calls == []


def test_a_loss_without_state_given_state_is_told_how_it_was_called(linear: autoaccum.Workload) -> None:
    """With ``state=``, the loss is called with the state: a loss that takes none is told so before anything runs
    (its own TypeError, "takes 2 positional arguments but 3 were given", named no argument of tune); one that fails
    its trace for another reason gets a note saying how it was called."""
    with pytest.raises(TypeError, match=r"`loss_fn` must take 3 arguments, loss_fn\(params, batch, state\)"):
        tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, state={"k": jnp.zeros(())},
             microbatch_bound=4, storage=":memory:", measure=fake_measure())  # fmt: skip

    def fails(p: Any, b: Any, s: Any) -> Any:
        return b["nope"], s

    with pytest.raises(KeyError, match="nope") as raised:
        tune(fails, linear.params, linear.batch, optimizer=linear.optimizer, state={"k": jnp.zeros(())},
             microbatch_bound=4, storage=":memory:", measure=fake_measure())  # fmt: skip
    assert "as loss_fn(params, batch, state), as `state` is given" in "".join(raised.value.__notes__)


def test_unopenable_sqlite_path(linear: autoaccum.Workload, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'no' / 'such' / 'dir' / 'x.db'}"
    with pytest.raises(ValueError, match="cannot be opened"):
        tune(
            linear.loss_fn,
            linear.params,
            linear.batch,
            optimizer=linear.optimizer,
            microbatch_bound=4,
            storage=url,
            measure=fake_measure(),
        )


@pytest.mark.slow
def test_two_workers_share_one_study(tmp_path: Path) -> None:
    """Two processes tune one study through one SQLite file: together they measure each configuration of the
    space exactly once, and both report the same best plan (PostgreSQL: tests/test_distributed_tuning.py)."""
    import json
    import subprocess
    import sys

    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    worker = Path(__file__).parent / "tune_worker.py"
    logs = [tmp_path / f"worker{i}.jsonl" for i in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(worker), storage, str(log)], stdout=subprocess.PIPE, text=True)
        for log in logs
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    measured = [tuple(json.loads(line)[:2]) for log in logs if log.exists() for line in log.read_text().splitlines()]
    grid = {(m, s) for m in (1, 2, 3, 4) for s in ("scan", "loop", "multisteps")}
    assert grid <= set(measured)
    configurations = [tuple(json.loads(line)) for log in logs if log.exists() for line in log.read_text().splitlines()]
    assert len(configurations) == len({json.dumps(c) for c in configurations}) == 20, "each measured once"
    assert all(log.exists() for log in logs), "both workers measured something"
    plans = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert plans[0] == plans[1]


def test_equivalent_configurations_are_timed_once(linear: autoaccum.Workload) -> None:
    """With one accumulation step every strategy runs the same plain step: it is timed once, not once per
    strategy (five timings of one program would let noise pick the plan). So is scan unrolled 2 and 8 times over
    two steps (both unroll the whole loop); over four steps they differ, and both are timed."""
    calls: list[Any] = []
    result = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, effective_batch=8, microbatch_bound=8,
        budget=20, storage=":memory:", measure=fake_measure(calls), race_rounds=0,  # the whole grid
    )  # fmt: skip
    assert [m for m, _, _ in calls].count(8) == 1
    at_full = [r for r in result.trials if r.microbatch_size == 8]
    assert len(at_full) == len(variants(autoaccum.strategies.available()))  # every configuration is reported
    assert sum(r.same_program_as is None for r in at_full) == 1
    unrolled = {(m, dict(options)["unroll"]) for m, name, options in calls if name == "scan"}
    assert {(4, 2), (2, 2), (2, 8)} <= unrolled and (4, 8) not in unrolled
    two_steps = {r.options.get("unroll"): r for r in result.trials if r.microbatch_size == 4 and r.strategy == "scan"}
    assert two_steps[8].same_program_as == two_steps[2].number and two_steps[2].same_program_as is None


def test_the_finalists_race_and_a_lucky_trial_loses(linear: autoaccum.Workload) -> None:
    """The study's best few are re-timed side by side, interleaved; a configuration whose one trial was lucky
    (microbatch 2: 8 ms once, 10.5 ms ever after) loses to the one that is really faster (4: 10 ms). A third at
    30 ms, over `SLOWER_OUT` times slower than the lucky trial, does not race."""
    counts: dict[int, int] = {}
    order: list[int] = []
    updates: dict[int, list[Update]] = {}

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m = update.microbatch_size
        counts[m] = counts.get(m, 0) + 1
        order.append(m)
        updates.setdefault(m, []).append(update)
        base = 0.008 if (m, counts[m]) == (2, 1) else {4: 0.010, 2: 0.0105}.get(m, 0.03)
        times = tuple(base * (1 + 0.01 * i) for i in range(5))
        return Timing(times[2], 0.1, 5, times)

    kw: dict[str, Any] = dict(microbatch_bound=4, strategies=["loop"], storage=":memory:", measure=measure)
    unraced = tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, race_rounds=0, **kw)
    assert unraced.plan.microbatch_size == 2 and unraced.race == ()
    counts.clear()
    order.clear()
    updates.clear()
    result = tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, **kw)
    assert result.plan.microbatch_size == 4
    by_number = {r.number: r.microbatch_size for r in result.trials}
    sizes = [by_number[r.trial] for r in result.race]
    assert sizes == [4, 2]  # the winner, then by median
    winner, lucky = result.race
    assert winner.out_after is None and lucky.out_after is not None and lucky.out_after >= 2  # none out in round 1
    assert all(counts[m] == 1 for m in counts if m not in (2, 4)), counts  # the 30 ms ones: their trial alone
    assert result.plan.throughput == pytest.approx(24 / winner.quartiles[1])
    # Interleaved: the race's first round times each finalist once, before any is timed twice.
    trials = sum(r.same_program_as is None for r in result.trials)  # (the trials that timed their program)
    assert sorted(order[trials : trials + len(sizes)]) == sorted(sizes)
    # Each configuration's update is built once and re-timed as it is (its programs compiled once).
    assert all(len(u) > 1 and all(x is u[0] for x in u) for m, u in updates.items() if m in sizes), updates
    counts.clear()
    again = tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, **kw)
    assert again.race == result.race  # deterministic given the timings


def test_the_race_ranks_each_round_by_that_rounds_speed() -> None:
    """The machine's speed drifts from round to round (factors 1.0, 1.5, 0.7, 1.2): "a" is 5% faster than "b" in
    every round, yet their raw step times overlap across rounds. Each time over its round's median, "b" is clearly
    slower (its lower quartile above the leader's upper one) and out after the second round, the first where one
    can be; the winner's times stay the raw seconds measured."""
    speeds = iter([1.0, 1.0, 1.5, 1.5, 0.7, 0.7, 1.2, 1.2])
    base = {"a": (1.00, 1.01, 1.02), "b": (1.05, 1.06, 1.07)}

    def time_one(key: str) -> list[float]:
        f = next(speeds)
        return [f * t for t in base[key]]

    winner, loser = race([("a", 0, [9.0]), ("b", 1, [0.1])], time_one, rounds=4)
    assert (winner.trial, loser.trial) == (0, 1)
    assert loser.out_after == 2 and winner.out_after is None
    assert winner.times == pytest.approx((1.00, 1.01, 1.02, 1.50, 1.515, 1.53))
    assert winner.relative is not None and loser.relative is not None and winner.relative < 1 < loser.relative


def test_a_real_difference_inside_overlapping_spreads_is_settled_before_the_budget_runs_out() -> None:
    """Finalist "b" is 3% slower than "a" in every timing, but each timing spreads +-4%: b's lower quartile stays
    below a's upper one however many rounds run. The medians' notches narrow as the times pool and part after
    round 4, so b is out there, with a third of a six-round budget unspent."""
    base = (0.96, 0.98, 1.00, 1.02, 1.04)
    calls: list[str] = []

    def time_one(key: str) -> list[float]:
        calls.append(key)
        return [t * (1.03 if key == "b" else 1.0) for t in base]

    many = base * 100  # the quartile rule alone never settles: b's lower quartile below a's upper one
    assert quartiles([1.03 * t for t in many])[0] < quartiles(many)[2]
    winner, loser = race([("a", 0, [1.0]), ("b", 1, [1.0])], time_one, rounds=6)
    assert (winner.trial, loser.trial) == (0, 1)
    assert loser.out_after == 4 and winner.out_after is None and len(calls) == 8


def test_a_finalist_out_leaves_its_rounds_to_the_close_call() -> None:
    """Three finalists, a budget of four rounds each: "c" is clearly slower and out after round 2 (none is out
    after one round, one moment of the machine); the six timings it leaves unspent give "a" and "b", 2% apart,
    three more rounds (five in all), the close call, level (0.5% apart, their spreads overlapping)."""
    base = {"a": (1.00, 1.01, 1.02), "b": (1.005, 1.015, 1.025), "c": (1.5, 1.51, 1.52)}
    order: list[str] = []

    def time_one(key: str) -> list[float]:
        order.append(key)
        return list(base[key])

    a, b, c = race([("a", 0, [1.0]), ("b", 1, [1.0]), ("c", 2, [1.0])], time_one, rounds=4)
    assert (a.trial, b.trial, c.trial) == (0, 1, 2)
    assert (a.rounds, b.rounds, c.rounds) == (5, 5, 2) and c.out_after == 2 and a.out_after is b.out_after is None
    assert len(order) == 4 * 3  # the budget: as many timings as four rounds of all three
    assert sorted(order[:3]) == ["a", "b", "c"]  # interleaved: each once before any twice


def test_the_plan_records_the_accumulator_dtype_it_was_tuned_with(linear: autoaccum.Workload) -> None:
    result = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, microbatch_bound=4, budget=2,
        strategies=["scan"], accumulator_dtype=jnp.bfloat16, storage=":memory:", measure=fake_measure(),
    )  # fmt: skip
    assert result.plan.accumulator_dtype == "bfloat16"
    assert result.plan.build(linear.loss_fn, linear.optimizer).accumulation.spec.accumulator_dtype == jnp.bfloat16


def test_an_accumulating_step_out_of_memory_lowers_its_strategys_bound_and_tries_the_next_size_down() -> None:
    """The probe bounds one microbatch's step; a strategy's accumulating step may need more. When ``loop`` runs
    out of memory at 32 it is tried next at the largest candidate below, never again at or above a size that failed;
    out of memory there too, the search leaves it (it needs much more than scan; the sampler may spend the budget
    left on it), and ``scan`` (which fits) is not held back by ``loop``'s failures."""
    w = workloads.linear(batch_size=64, features=8)
    calls: list[tuple[int, str]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m, name = update.microbatch_size, update.strategy
        calls.append((m, name))
        if name == "loop" and m >= 8:
            raise TrialFailed(f"out of memory: RESOURCE_EXHAUSTED (fake) at microbatch {m}")
        return Timing(seconds_per_step=0.01 + 1.0 / m, compile_seconds=0.1, steps=5)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=32, strategies=["scan", "loop"],
        budget=8, storage=":memory:", measure=measure, race_rounds=0,
    )  # fmt: skip
    loop = [m for m, name in calls if name == "loop"]
    assert loop[:2] == [32, 16] and max(loop[2:], default=0) < 16  # down after a failure, never back up
    assert (32, "scan") in calls
    assert result.plan.microbatch_size == 32 and result.plan.strategy == "scan"
    failed = [r for r in result.trials if r.state == "FAIL"]
    assert {16, 32} <= {r.microbatch_size for r in failed}
    assert all(r.reason and r.reason.startswith("out of memory") for r in failed)


def test_re_running_a_finished_grid_times_nothing_where_out_of_memory_left_points_untimed(tmp_path: Path) -> None:
    """The whole grid, where scan runs out of memory from 4 up: its heavier variants at 4 are never timed, and the
    grid counts them decided. Re-running compiled one again (a configuration the first run had pruned: the grid
    was never settled) and said "1 new" (a reviewer's report)."""
    w = workloads.linear(batch_size=8, features=4)
    calls: list[tuple[int, str]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append((update.microbatch_size, update.strategy))
        if update.strategy == "scan" and update.microbatch_size >= 4:
            raise TrialFailed(f"out of memory: RESOURCE_EXHAUSTED (fake) at microbatch {update.microbatch_size}")
        steps = update.accumulation_steps(8)
        return Timing(seconds_per_step=0.01 * steps + 0.001 * update.microbatch_size, compile_seconds=0.1, steps=5)

    kw = dict(optimizer=w.optimizer, microbatch_bound=4, strategies=["scan", "loop"], race_rounds=0, budget=12,
              storage=f"sqlite:///{tmp_path / 'studies.db'}", measure=measure)  # fmt: skip
    first = tune(w.loss_fn, w.params, w.batch, **kw)
    assert calls and (4, "scan") in calls and len(calls) < 12  # the heavier unrolls at 4: never compiled
    calls.clear()
    again = tune(w.loss_fn, w.params, w.batch, **kw)
    assert calls == [] and again.new_trials == 0 and again.plan == first.plan


def test_a_variant_that_needs_more_memory_is_not_compiled_where_a_lighter_one_ran_out() -> None:
    """scan's memory grows with ``unroll`` (`Strategy.memory_grows_with`): here a step holds ``m x min(unroll,
    steps)`` examples' temporaries and runs out of memory above 16. Once ``unroll=2`` ran out at a size, ``unroll=8``
    is never measured at that size or above; the pick fits."""
    w = workloads.linear(batch_size=64, features=8)
    calls: list[tuple[int, int, bool]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m, unroll = update.microbatch_size, update.options.get("unroll", 1)
        steps = update.accumulation_steps(64)
        fits = m * min(unroll, steps) <= 16
        calls.append((m, unroll, fits))
        if not fits:
            raise TrialFailed(f"out of memory: RESOURCE_EXHAUSTED (fake) at microbatch {m}")
        return Timing(seconds_per_step=steps * (0.004 / min(unroll, steps) + 0.001 * m), compile_seconds=0.1, steps=5)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=16, strategies=["scan"],
        storage=":memory:", measure=measure, race_rounds=0,
    )  # fmt: skip
    for i, (m, unroll, _) in enumerate(calls):
        lighter_failed = [m2 for m2, u2, fits in calls[:i] if not fits and u2 <= unroll and m2 <= m]
        assert not lighter_failed or unroll == 1, (calls, i)
    assert any(not fits for _, u, fits in calls if u == 2)  # the landscape does refuse a lighter variant
    plan = result.plan
    assert plan.microbatch_size * min(plan.options.get("unroll", 1), -(-64 // plan.microbatch_size)) <= 16


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_strategy_slower_at_every_size_does_not_walk_the_tune_down_to_1(seed: int) -> None:
    """The WideResNet's landscape on a CPU (effective batch 256, a bound of 83): scan 8x slower than loop and
    multisteps at every size and faster as the size shrinks, they 5% slower a halving, with +-10% noise per trial.
    With the default budget the tune times every strategy at the largest size before any smaller size, and picks a
    fast strategy at a large size, not scan at 1."""
    w = workloads.linear(batch_size=256, features=8)
    rng = np.random.default_rng(seed)
    calls: list[tuple[int, str]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        m = update.microbatch_size
        calls.append((m, update.strategy))
        base = 8.0 * (m / 64) ** 0.3 if update.strategy == "scan" else 1.0 + 0.05 * math.log2(64 / m)
        drift = 1 + rng.uniform(-0.1, 0.1)
        times = tuple(1e-2 * base * drift * (1 + 0.01 * i) for i in range(5))
        return Timing(times[2], 0.1, 5, times)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=83, storage=":memory:", measure=measure,
        seed=seed,
    )  # fmt: skip
    first_small = next(i for i, (m, _) in enumerate(calls) if m < 64)
    assert {name for _, name in calls[:first_small]} == set(autoaccum.strategies.available())
    assert result.plan.strategy != "scan" and result.plan.microbatch_size >= 16, calls


def test_no_trial_runs_a_microbatch_below_the_floor(linear: autoaccum.Workload) -> None:
    """``min_microbatch``: whatever the landscape (here the smallest size is fastest), no trial goes below it."""
    w = workloads.linear(batch_size=64, features=8)
    calls: list[int] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append(update.microbatch_size)
        return Timing(1e-3 * update.microbatch_size, 0.1, 5)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=32, min_microbatch=8, budget=12,
        storage=":memory:", measure=measure,
    )  # fmt: skip
    assert min(calls) == 8 and result.plan.microbatch_size == 8
    assert all(r.microbatch_size >= 8 for r in result.trials)
    with pytest.raises(ValueError, match=r"`min_microbatch`=65 is above"):
        tune(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, min_microbatch=65, storage=":memory:")
    with pytest.raises(RuntimeError, match=r"no microbatch size to time between `min_microbatch`=23"):
        tune(
            w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=31, min_microbatch=23,
            storage=":memory:", measure=measure,
        )  # fmt: skip


def test_no_uneven_split_leaves_a_last_microbatch_below_the_floor() -> None:
    """``min_microbatch`` bounds every microbatch: of 20 examples with a floor of 8, 16 (its last microbatch 4) is
    never timed, though the landscape makes the largest microbatch fastest."""
    w = workloads.linear(batch_size=20, features=8)
    calls: list[int] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append(update.microbatch_size)
        return Timing(1e-3 * (21 - update.microbatch_size), 0.1, 5)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=19, min_microbatch=8, budget=12,
        storage=":memory:", measure=measure,
    )  # fmt: skip
    assert calls and all(m >= 8 and (20 % m == 0 or 20 % m >= 8) for m in calls), calls
    assert result.plan.microbatch_size == 10


def test_a_study_is_not_resumed_under_another_knob_loss_or_time_limit(tmp_path: Path) -> None:
    """A change confined to a knob setting that is not the default (its loss's constant), or to a time limit (a
    trial that timed out settles its configuration), starts a new study; the same arguments resume it."""
    params, batch = {"w": jnp.zeros(4)}, {"x": jnp.ones((8, 4)), "y": jnp.ones(8)}

    def knobs(scale: float) -> autoaccum.Knobs:
        def make_loss(heavy: bool = False) -> Any:
            x = (lambda b: jnp.tanh(b["x"] * scale)) if heavy else (lambda b: b["x"])
            return lambda p, b: jnp.mean((x(b) @ p["w"] - b["y"]) ** 2)

        return autoaccum.Knobs(make_loss, heavy=(False, True))

    kw = dict(optimizer=optax.sgd(0.1), microbatch_bound=4, storage=f"sqlite:///{tmp_path / 's.db'}", budget=2)
    first = tune(knobs(2.0), params, batch, measure=constant_measure([]), **kw)
    again = tune(knobs(2.0), params, batch, measure=constant_measure([]), **kw)
    other_loss = tune(knobs(100.0), params, batch, measure=constant_measure([]), **kw)
    other_limit = tune(knobs(2.0), params, batch, measure=constant_measure([]), trial_timeout=60.0, **kw)
    assert again.fingerprint == first.fingerprint and again.new_trials == 0
    assert len({first.fingerprint, other_loss.fingerprint, other_limit.fingerprint}) == 3
    assert other_loss.resumed_trials == other_limit.resumed_trials == 0


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's model and cores name the device on the CPU")
def test_a_study_is_not_resumed_on_another_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, whose JAX device kind is just "cpu", the study and the plan name the CPU's model and the cores
    this process may use: a study cached on a shared folder is not resumed by another machine's tune."""
    params, batch = {"w": jnp.zeros(4)}, {"x": jnp.ones((8, 4)), "y": jnp.ones(8)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    kw = dict(optimizer=optax.sgd(0.1), microbatch_bound=4, storage=f"sqlite:///{tmp_path / 's.db'}", budget=2)
    first = tune(loss_fn, params, batch, measure=constant_measure([]), **kw)
    assert first.plan.device == device_kind() and "cores)" in first.plan.device
    monkeypatch.setattr(autoaccum._device, "cpu_name", lambda: "Another CPU 9000")
    other = tune(loss_fn, params, batch, measure=constant_measure([]), **kw)
    assert other.fingerprint != first.fingerprint and other.resumed_trials == 0
    assert other.plan.device.startswith("Another CPU 9000 (")


def test_a_race_is_reused_only_with_its_rounds(tmp_path: Path) -> None:
    """A study resumed with ``race_rounds=0`` returns no race and the fastest trial, not an earlier run's race."""
    w = workloads.linear(batch_size=8, features=4)
    timings = iter(range(10**6))

    def measure(update: Update, params: Any, batch: Any) -> Timing:  # 4 reads fastest in its trial, 2 in the race
        late = next(timings) >= 6
        s = {8: 0.010, 4: 0.012 if late else 0.006, 2: 0.008, 1: 0.011}[update.microbatch_size]
        return Timing(s, 0.01, 5, (s,) * 5)

    kw = dict(optimizer=w.optimizer, microbatch_bound=8, storage=f"sqlite:///{tmp_path / 's.db'}", strategies=["loop"])
    raced = tune(w.loss_fn, w.params, w.batch, race_rounds=4, measure=measure, **kw)
    unraced = tune(w.loss_fn, w.params, w.batch, race_rounds=0, measure=measure, **kw)
    assert raced.race and raced.plan.microbatch_size == 2
    assert unraced.new_trials == 0 and not unraced.race and unraced.plan.microbatch_size == 4


def test_a_loss_that_raises_raises_its_own_error_before_any_trial(linear: autoaccum.Workload) -> None:
    """The loss is traced once in the caller, abstractly, before anything is timed: its own exception comes out."""
    calls: list[Any] = []

    def broken(params: Any, batch: Any) -> Any:
        return linear.loss_fn(params, batch) + batch["nope"].sum()

    with pytest.raises(KeyError, match="nope"):
        tune(
            broken, linear.params, linear.batch, optimizer=linear.optimizer, microbatch_bound=4, storage=":memory:",
            measure=fake_measure(calls),
        )  # fmt: skip
    assert calls == []


def test_params_of_a_class_only_the_callers_script_has_reach_the_worker(tmp_path: Path) -> None:
    """The worker evaluates the loss at the caller's parameters, pickled: a NamedTuple defined in the user's script
    (``__main__``) went by reference, the worker could not load it, and the loss's NaN went unwarned (a
    RuntimeWarning with a cut traceback instead). Here a child Python runs such a script."""
    script = tmp_path / "named.py"
    script.write_text(NAMED_PARAMS_TUNE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "AUTOACCUM_CACHE": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0 and "TUNED" in done.stdout, done.stderr[-3000:]
    assert "NonFiniteLossWarning: the loss is nan at the initial parameters" in done.stderr, done.stderr[-3000:]
    assert "could not be run" not in done.stderr, done.stderr[-3000:]


NAMED_PARAMS_TUNE = """
import typing, jax, jax.numpy as jnp, optax, autoaccum

class Params(typing.NamedTuple):
    w: jax.Array
    b: jax.Array

def loss_fn(p, b):
    return jnp.mean((b["x"] @ p.w + jnp.log(p.b) - b["y"]) ** 2)  # log(-1): NaN

batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros(8)}
autoaccum.tune(loss_fn, Params(jnp.zeros(4), -jnp.ones(())), batch, optimizer=optax.sgd(0.1), microbatch_bound=4,
               budget=1, race_rounds=0, storage=":memory:", memory_limit="256MiB")
print("TUNED")
"""


def test_a_loss_not_finite_at_the_initial_parameters_is_warned_of(linear: autoaccum.Workload) -> None:
    def nan_loss(params: Any, batch: Any) -> Any:
        return linear.loss_fn(params, batch) * jnp.nan

    with pytest.warns(autoaccum.NonFiniteLossWarning, match="the loss is nan at the initial parameters"):
        tune(
            nan_loss, linear.params, linear.batch, optimizer=linear.optimizer, microbatch_bound=4, budget=2,
            storage=":memory:", measure=fake_measure(),
        )  # fmt: skip


def test_the_initial_loss_runs_in_the_worker_and_a_crash_there_spares_the_caller(tmp_path: Path) -> None:
    """The check of the loss at the initial parameters ran the loss in the caller's process, unisolated: a loss that
    aborts there killed the user's process (a new user's, exit 134). It runs in the worker: a NaN is still warned
    of, and a crash is a warning; the caller lives on (here a child Python, so that a regression kills only it)."""
    script = tmp_path / "crash.py"
    script.write_text(CRASHING_TUNE)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "AUTOACCUM_CACHE": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0 and "CALLER ALIVE" in done.stdout, (done.returncode, done.stderr[-3000:])
    assert "NonFiniteLossWarning: the loss is nan at the initial parameters" in done.stderr, done.stderr[-3000:]
    assert "RuntimeWarning: the loss could not be run at the initial parameters in the worker" in done.stderr


CRASHING_TUNE = """
import os, jax, jax.numpy as jnp, optax, autoaccum

def loss_fn(w, b):
    x = b["x"]
    if x.shape[0] > 4:  # aborts the process only for more than 4 rows (the check runs 8)
        x = jax.pure_callback(lambda v: os.abort(), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jnp.mean((x @ w - b["y"]) ** 2)

w, batch = jnp.zeros(4), {"x": jnp.ones((16, 4)), "y": jnp.ones(16)}
kw = dict(optimizer=optax.sgd(0.1), memory_limit="64MiB", microbatch_bound=4, budget=1, race_rounds=0,
          storage=":memory:", strategies=["loop"])
autoaccum.tune(lambda w, b: jnp.mean(b["x"] @ w) * jnp.nan, w, batch, **kw)
result = autoaccum.tune(loss_fn, w, batch, **kw)
print("CALLER ALIVE", result.plan.microbatch_size)
"""


def test_a_finished_study_answers_again_without_probing_or_timing(
    linear: autoaccum.Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's bounds are stored with the study, whose name is a fingerprint of the inputs alone: re-running
    the same tune finds the study before anything runs, probes nothing, times nothing and returns the same plan."""
    import autoaccum._tune.job as job

    probes: list[int] = []

    def probe(*args: Any, **kwargs: Any) -> Any:
        probes.append(1)
        return autoaccum.probe(*args, **kwargs, isolate=False)

    monkeypatch.setattr(job, "probe", probe)
    calls: list[Any] = []
    kw: dict[str, Any] = dict(memory_limit="256MiB", budget=4, storage=f"sqlite:///{tmp_path / 's.db'}")
    first = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, measure=fake_measure(calls), **kw
    )
    assert probes == [1] and calls
    probes.clear()
    calls.clear()
    again = tune(
        linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, measure=fake_measure(calls), **kw
    )
    assert probes == [] and calls == []
    assert again.plan == first.plan and again.probe == first.probe and again.fingerprint == first.fingerprint
    assert again.message.startswith("resumed: 4 trials from earlier runs, 0 new")


def test_the_deprecated_names_still_work_with_a_warning(linear: autoaccum.Workload) -> None:
    seen: list[int] = []
    kw: dict[str, Any] = dict(microbatch_bound=4, storage=":memory:", measure=fake_measure())
    with pytest.warns(DeprecationWarning, match="`n_trials` is deprecated: pass `budget`"):
        result = tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, n_trials=2, **kw)
    assert result.new_trials == 2
    with pytest.warns(DeprecationWarning, match="`callbacks` is deprecated: pass `on_trial`"):
        tune(
            linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, budget=2,
            callbacks=[lambda record, done, total: seen.append(done)], **kw,
        )  # fmt: skip
    assert seen
    with pytest.raises(TypeError, match="give `budget` alone"):
        tune(linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, budget=2, n_trials=2, **kw)


def test_where_no_child_can_have_the_device_tune_says_so_and_runs_here(
    linear: autoaccum.Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a TPU one process owns the chip: with its defaults tune warns once and probes and times in this process,
    where isolating (the default elsewhere) would refuse."""
    import autoaccum._tune.run as run

    real = autoaccum.detect_device()
    monkeypatch.setattr(run, "detect_device", lambda: dataclasses.replace(real, platform="tpu", name="TPU v5e"))
    with pytest.warns(UserWarning, match="trials run in this process, not isolated: a child process cannot have TPU"):
        result = autoaccum.tune(
            linear.loss_fn, linear.params, linear.batch, optimizer=linear.optimizer, memory_limit="256MiB", budget=2,
            storage=":memory:",
        )  # fmt: skip
    assert result.probe is not None and result.probe.isolate is False
    assert result.plan.microbatch_size >= 1


# Warm start: the largest candidate first, also when the effective batch has few divisors (B=96: 96, not 64).
def test_warm_start_enqueues_the_largest_candidate() -> None:
    params, batch = linear_problem(96)
    calls: list[tuple[int, str]] = []
    result = tune(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), params, batch, optimizer=optax.sgd(0.1),
        microbatch_bound=96, strategies=["scan", "loop"], budget=3, storage=":memory:",
        measure=constant_measure(calls),
    )  # fmt: skip
    first = min(result.trials, key=lambda r: r.number)  # the warm start's ladder begins at the largest
    assert (first.microbatch_size, first.strategy) == (96, "scan") and calls[0][0] == 96


def test_a_trials_reason_keeps_the_users_own_error_at_the_end_of_a_long_traceback() -> None:
    """The worker's message is a traceback, the user's exception last; a reason cut to its first 900 characters
    held only the library's frames."""
    from types import SimpleNamespace

    from autoaccum._isolation import Outcome
    from autoaccum._knobs import Setting
    from autoaccum._tune.search import Config
    from autoaccum._tune.trials import time_in_worker

    traceback = "Traceback (most recent call last):\n" + '  File "autoaccum/x.py", line 1, in f\n' * 60
    traceback += '  File "faults.py", line 9, in loss_fn\nRuntimeError: boom from the user\'s loss'
    worker = SimpleNamespace(limit=2**20, time=lambda request: Outcome("error", message=traceback))
    job = SimpleNamespace(labels={"scan": ("scan", {})}, settings=[Setting()], effective_batch=8)
    with pytest.raises(TrialFailed, match=r"(?s)failed in the worker: \.\.\. .*faults\.py.*boom from the user's loss"):
        time_in_worker(job, worker)(Config(4, "scan"), 0)  # type: ignore[arg-type]


def test_a_loss_calling_back_into_python_is_warned_that_the_fingerprint_cannot_see_the_callback() -> None:
    """Changing what a callback does (a sleep per microbatch, say) kept the study: its earlier timings came back."""
    w = workloads.linear(batch_size=8, features=4)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        jax.debug.callback(lambda: None)
        return w.loss_fn(params, batch)

    with pytest.warns(UserWarning, match=r"calls back into Python .*fresh=True"):
        tune(loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=4, budget=1, storage=":memory:",
             measure=fake_measure(), race_rounds=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tune(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=4, budget=1, storage=":memory:",
             measure=fake_measure(), race_rounds=0)  # fmt: skip


def test_a_finalist_that_fails_in_the_race_keeps_why() -> None:
    """The CLI printed 'failed in round 1' and the reason (RESOURCE_EXHAUSTED, say) was thrown away."""
    reason = "out of memory in the worker (limit 24.00 MiB): RESOURCE_EXHAUSTED"

    def time_one(key: str) -> list[float] | str:
        return reason if key == "b" else [1.0, 1.0, 1.0]

    winner, failed = race([("a", 0, [1.0]), ("b", 1, [0.5]), ("c", 2, [2.0])], time_one, rounds=2)[::2]
    assert winner.failed is None and failed.trial == 1 and failed.out_after == 1 and failed.failed == reason
    assert failed.rounds == 0  # (its re-timing never ran: the CLI reads 'failed in round 1: <reason>')


def test_a_limit_above_the_machines_memory_is_warned_of_once() -> None:
    """tune resolved the limit for its worker and again in the probe: a MemoryLimitWarning each (printed twice)."""
    w = workloads.linear(batch_size=8, features=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tune(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="10TiB", budget=1, storage=":memory:",
             strategies=["scan"], race_rounds=0)  # fmt: skip
    limits = [c for c in caught if issubclass(c.category, autoaccum.MemoryLimitWarning)]
    assert len(limits) == 1, [str(c.message) for c in limits]


def test_a_trial_whose_process_ended_mid_trial_says_so() -> None:
    """A trial failed by its end (its worker killed; Optuna failed it as stale) shows why, not a bare FAIL; a trial
    failed for a reason of its own keeps that reason."""
    from autoaccum._tune.result import records

    distributions = {"microbatch_size": optuna.distributions.CategoricalDistribution([4, 8])}
    killed = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params={"microbatch_size": 8},
                                       distributions=distributions)  # fmt: skip
    own = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL, params={"microbatch_size": 4},
                                    distributions=distributions, user_attrs={"reason": "out of memory"})  # fmt: skip
    shown = {r.microbatch_size: r.reason for r in records([killed, own], 8, {})}
    assert shown[4] == "out of memory" and (shown[8] or "").startswith("did not finish: its process ended")


def test_a_python_number_in_params_is_taken_as_build_update_takes_it() -> None:
    """A Python float leaf (weakly typed, as JAX takes it) tunes and estimates as `build_update` steps it: it
    failed at the end of a whole tune (the plan's params signature read ``leaf.dtype``). The plan built from the
    result equals one full-batch step computed here."""
    params, batch = {"w": jnp.zeros(4), "b": 0.5}, {"x": jnp.arange(32.0).reshape(8, 4) / 32, "y": jnp.ones(8)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    optimizer = optax.sgd(0.1)
    estimated = autoaccum.estimate(loss_fn, params, batch, optimizer=optimizer, memory_limit="64MiB")
    assert estimated.max_microbatch >= 8
    result = tune(loss_fn, params, batch, optimizer=optimizer, microbatch_bound=4, budget=2, storage=":memory:",
                  measure=constant_measure([]))  # fmt: skip
    assert result.plan.params == {"['b']": "float32[]", "['w']": "float32[4]"}
    update = result.plan.build(loss_fn, optimizer, donate=False)
    new, _, _ = update(params, update.init(params), batch)
    grads = jax.grad(loss_fn)(jax.tree.map(jnp.asarray, params), batch)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6), new, expected))


def test_a_bound_given_above_the_effective_batch_is_reported_as_the_batch() -> None:
    """``microbatch_bound=1000`` for 8 examples bounds at 8: `TuneResult.bounds` said 1000."""
    params, batch = {"w": jnp.zeros(4)}, {"x": jnp.ones((8, 4)), "y": jnp.zeros(8)}
    result = tune(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), params, batch, optimizer=optax.sgd(0.1),
                  microbatch_bound=1000, budget=2, storage=":memory:", measure=constant_measure([]))  # fmt: skip
    assert set(result.bounds.values()) == {8} and all(r.microbatch_size <= 8 for r in result.trials)


def test_the_race_leaves_out_a_finalist_clearly_slower_than_the_fastest() -> None:
    """A finalist whose trial read far slower than the fastest (a new user's: 6.1 s a step against 80 ms, raced two
    rounds, a third of the tune) is not re-timed: only finalists within two readings' drift race."""
    params, batch = {"w": jnp.zeros(4)}, {"x": jnp.ones((8, 4)), "y": jnp.zeros(8)}
    calls: list[tuple[int, str, tuple[Any, ...]]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        options = tuple(sorted(update.options.items()))
        calls.append((update.microbatch_size, update.strategy, options))
        slow = 10.0 if update.strategy == "loop" else 1.0 + 0.01 * len(calls)  # (multisteps: level at every size)
        return Timing(seconds_per_step=0.01 * slow, compile_seconds=0.1, steps=5, times=(0.01 * slow,) * 5)

    result = tune(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), params, batch, optimizer=optax.sgd(0.1),
                  strategies=["multisteps", "loop"], microbatch_bound=4, budget=3, storage=":memory:",
                  measure=measure)  # fmt: skip
    timed = [c for c in calls if c[1] == "loop"]
    assert timed and len(timed) == len(set(timed)), timed  # each loop configuration timed once: never raced
    strategy = {r.number: r.strategy for r in result.trials}
    assert len(result.race) >= 2 and {strategy[r.trial] for r in result.race} == {"multisteps"}  # the level raced


def test_a_plan_built_with_an_optimizer_whose_state_needs_more_warns(tmp_path: Path) -> None:
    """A plan records its optimizer state's bytes (also in its JSON): built for the same params with an optimizer
    whose state is larger (adam's two moments against sgd's none), it warns that its microbatch may not fit; with
    another learning rate, or a smaller state, it does not."""
    params, batch = {"w": jnp.zeros(64)}, {"x": jnp.ones((8, 64)), "y": jnp.zeros(8)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    result = tune(loss_fn, params, batch, optimizer=optax.adam(1e-3), microbatch_bound=4, budget=1, race_rounds=0,
                  storage=":memory:", measure=constant_measure([]))  # fmt: skip
    assert result.plan.opt_state_bytes == 2 * 64 * 4 + 4  # mu, nu and the count
    result.plan.save(tmp_path / "plan.json")
    plan = Plan.load(tmp_path / "plan.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.build(loss_fn, optax.adam(0.1), params=params)
        plan.build(loss_fn, optax.sgd(0.1), params=params)
    bigger = optax.chain(optax.adam(1e-3), optax.ema(0.9))
    with pytest.warns(UserWarning, match=r"this optimizer's state of these params needs .* tune again with it") as seen:
        plan.build(loss_fn, bigger, params=params)
    assert seen[0].filename == __file__  # (at the caller's line)
    with warnings.catch_warnings():  # a plan that did not record it is not checked
        warnings.simplefilter("error")
        dataclasses.replace(plan, opt_state_bytes=None).build(loss_fn, bigger, params=params)


def test_the_result_says_when_the_budget_ran_out_before_the_search_finished() -> None:
    """A budget that stops the search before it has nothing left to propose is named with what it would time next;
    a search that finished says nothing of it."""
    params, batch = linear_problem(batch_size=64)
    kw: dict[str, Any] = dict(optimizer=optax.sgd(0.1), microbatch_bound=32, storage=":memory:", race_rounds=0)

    def linear_loss(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    short = tune(linear_loss, params, batch, budget=2, measure=constant_measure([]), **kw)
    assert re.search(r"the search stopped before it finished: it would time \d+ x \w+", short.message), short.message
    whole = tune(linear_loss, params, batch, measure=constant_measure([]), **kw)
    assert "stopped before" not in whole.message and whole.new_trials > 2, whole.message
