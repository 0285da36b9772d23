"""Timing trials in the isolated worker: under the limit, and an OOM, a crash or a hang never reaches the caller."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from seams import tune

import autoaccum
from autoaccum._probe import prepare, probe
from autoaccum._worker import (
    MAX_CACHED,
    STEPS,
    WARMUP,
    Request,
    Timing,
    Worker,
    compile_trial,
    over_limit,
    run_trial,
)


def linear_loss(params: Any, batch: Any) -> jax.Array:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def troubled_loss(params: Any, batch: Any) -> jax.Array:
    """In a worker (not in the process that set ``TROUBLE_PARENT``, which traces the loss too): crashes
    the process when traced for microbatch 2, hangs in every step of microbatch 4 (a callback that sleeps there:
    the program is the same in both processes, as the worker's check of the loss wants)."""
    m = batch["x"].shape[0]
    worker = str(os.getpid()) != os.environ.get("TROUBLE_PARENT")
    if worker and m == 2:
        os.abort()
    jax.debug.callback(lambda: time.sleep(600) if worker and m == 4 else None)
    return linear_loss(params, batch)


def chatty_loss(params: Any, batch: Any) -> jax.Array:
    """In a worker: prints text that reads as out of memory when traced for microbatch 2, aborts for 4."""
    m = batch["x"].shape[0]
    if str(os.getpid()) != os.environ.get("TROUBLE_PARENT"):
        if m == 2:
            print("Out of memory? no: a user's log line", flush=True)
        if m == 4:
            os.abort()
    return linear_loss(params, batch)


def interrupting_loss(params: Any, batch: Any) -> jax.Array:
    """In a worker: raises KeyboardInterrupt itself when traced for microbatch 2 (no signal was sent)."""
    if batch["x"].shape[0] == 2 and str(os.getpid()) != os.environ.get("TROUBLE_PARENT"):
        raise KeyboardInterrupt("the loss's own")
    return linear_loss(params, batch)


def problem(features: int = 256, rows: int = 4) -> tuple[Any, Any]:
    params = {"w": jnp.zeros((features, 8))}
    batch = {"x": jnp.ones((rows, features)), "y": jnp.ones((rows, 8))}
    return params, batch


def test_a_trial_over_the_limit_fails_in_the_worker_unrun_where_xla_says_so() -> None:
    params, batch = problem()
    setup = prepare(linear_loss, params, batch, optimizer=optax.adam(1e-3), memory_limit="128MiB")
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        fits = w.time(Request({"strategy": "scan"}, 16, 64, 3, 1))
        assert fits.status == "fits" and fits.times is not None and len(fits.times) == 3
        assert fits.seconds == sorted(fits.times)[1] and fits.peak_bytes is not None
        assert fits.peak_bytes < setup.memory_limit_bytes
        # 40,000 rows of 256 float32 features, a 41 MB batch made in the worker: its measured peak holds it.
        big = w.time(Request({"strategy": "scan"}, 40_000, 40_000, 3, 1))
        assert big.status == "fits" and big.peak_bytes is not None
        assert 40_000 * 256 * 4 <= big.peak_bytes < setup.memory_limit_bytes
        # 300,000 rows of 256 float32 features: a 307 MB batch, over the 128 MiB limit (1 accumulation step). XLA's
        # buffer assignment alone says so: it is not run, and the worker goes on.
        over = w.time(Request({"strategy": "scan"}, 300_000, 300_000, 3, 1))
        assert over.status == "oom" and "not run" in (over.message or ""), over
        assert over.peak_bytes is not None and over.peak_bytes >= 300_000 * 256 * 4
        again = w.time(Request({"strategy": "loop"}, 16, 64, 3, 1))
        assert again.status == "fits" and w.restarts == 1
    assert params["w"].shape == (256, 8) and not params["w"].is_deleted()  # the caller's arrays untouched


def test_a_crash_is_judged_by_what_the_worker_wrote_since_its_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier request's output that mentions running out of memory does not make a later crash an OOM."""
    monkeypatch.setenv("TROUBLE_PARENT", str(os.getpid()))
    params, batch = problem(rows=8)  # (the worker checks the loss at the batch's 8 rows: it aborts at 4)
    setup = prepare(chatty_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="128MiB")
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        assert w.time(Request({"strategy": "scan"}, 2, 2)).status == "fits"
        crash = w.time(Request({"strategy": "scan"}, 4, 4))
    assert crash.status == "error" and "SIGABRT" in (crash.message or ""), crash


def test_a_keyboard_interrupt_the_loss_raises_is_its_error_not_a_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt raised by the user's code (no SIGINT reached the worker) is reported as the trial's error,
    once; it read as a kill from outside ("run once more, it was killed again")."""
    monkeypatch.setenv("TROUBLE_PARENT", str(os.getpid()))
    params, batch = problem(rows=8)
    setup = prepare(interrupting_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="128MiB")
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        interrupted = w.time(Request({"strategy": "scan"}, 2, 2))
        assert w.time(Request({"strategy": "scan"}, 4, 4)).status == "fits"
    assert interrupted.status == "error", interrupted
    assert (interrupted.message or "").startswith("KeyboardInterrupt: the loss's own"), interrupted.message
    assert "killed" not in (interrupted.message or ""), interrupted.message


def test_a_step_over_the_limit_stops_after_its_first_call() -> None:
    """With ``stop_above``, a trial's calls stop once the peak so far reads above it: one call, no step times, and
    `over_limit` reports it out of memory; under it, every call runs (1 + warm-up + timed)."""
    calls: list[int] = []

    def counted_loss(params: Any, batch: Any) -> jax.Array:
        jax.debug.callback(lambda: calls.append(1))
        return linear_loss(params, batch)

    params, batch = problem(features=16)
    setup = prepare(counted_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB")
    compiled = compile_trial(setup.job, 4, jax.devices()[0])
    over = run_trial(compiled, lambda: 2**40, steps=5, warmup=1, stop_above=2**30)
    jax.effects_barrier()
    assert over.times == [] and over.peak_bytes == 2**40 and len(calls) == 1, (over, calls)
    assert over_limit(over, 2**30).status == "oom"
    under = run_trial(compiled, lambda: 2**20, steps=5, warmup=1, stop_above=2**30)
    jax.effects_barrier()
    assert under.times is not None and len(under.times) == 5 and len(calls) == 1 + 7
    assert over_limit(under, 2**30).status == "fits"


@pytest.mark.slow
def test_a_crashing_and_a_hanging_trial_are_recorded_and_the_study_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TROUBLE_PARENT", str(os.getpid()))
    params, batch = problem(features=16)
    with (
        pytest.warns(RuntimeWarning, match=r"loss could not be run at the initial parameters in the worker: timed"),
        pytest.warns(UserWarning, match=r"calls back into Python"),  # (the fingerprint cannot see the callback)
    ):
        result = tune(  # (the check of the initial loss hangs too, on the batch's 4 rows: a warning, in the worker)
            troubled_loss, params, batch, optimizer=optax.sgd(0.1), microbatch_bound=4, strategies=["loop"],
            storage=":memory:", compile_timeout=120, trial_timeout=8, memory_limit="256MiB",
        )  # fmt: skip
    reasons = {r.microbatch_size: r.reason or "" for r in result.trials}
    assert "SIGABRT" in reasons[2], reasons[2]
    assert "timed out: stepping" in reasons[4] and "raise `trial_timeout`" in reasons[4], reasons[4]
    assert result.plan.microbatch_size == 1 and {r.microbatch_size: r.state for r in result.trials} == {
        1: "COMPLETE",
        2: "FAIL",
        4: "FAIL",
    }
    assert result.peak_bytes is not None and result.peak_bytes <= result.memory_limit_bytes


def slow_small_loss(params: Any, batch: Any) -> jax.Array:
    """Sleeps 10 ms per microbatch of fewer than 16 examples: every configuration at 8 or 4 is slower than 16 x 4."""
    if batch["x"].shape[0] < 16:
        jax.debug.callback(lambda: time.sleep(0.01))
    return linear_loss(params, batch)


@pytest.mark.slow
def test_the_worker_keeps_the_fastest_programs_so_the_race_compiles_nothing_again() -> None:
    """The fastest configuration was timed first; after more configurations than the worker keeps, all slower,
    timing it again compiles nothing (the finalists of a tune are re-timed this way)."""
    params, batch = problem(features=16)
    setup = prepare(slow_small_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB")
    builds = [{"strategy": "scan", "unroll": 1}, {"strategy": "scan", "unroll": 2}, {"strategy": "loop"}]
    slower = [(build, m) for m in (8, 4) for build in [*builds, {"strategy": "multisteps"}]]
    assert len(slower) > MAX_CACHED
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        fastest = w.time(Request({"strategy": "scan"}, 16, 64, 2, 0))
        assert fastest.status == "fits" and w.compiles == 1
        for build, m in slower:
            outcome = w.time(Request(build, m, 64, 2, 0))
            assert outcome.status == "fits" and outcome.seconds and fastest.seconds
            assert outcome.seconds > fastest.seconds + 0.05, (build, m, outcome.seconds, fastest.seconds)
        assert w.compiles == 1 + len(slower)
        again = w.time(Request({"strategy": "scan"}, 16, 64, 2, 0))
        assert again.status == "fits" and w.compiles == 1 + len(slower)  # (kept the most recent: compiled again)


def test_a_build_spelled_with_its_defaults_is_the_program_the_worker_ran() -> None:
    """The probe asks for the default strategy's build as `prepare` resolves it (no options), a trial for the same
    program with every option and knob spelled out: the worker compiles it once, so the race re-times the probe's
    fit without a compile."""
    params, batch = problem(features=16)
    setup = prepare(linear_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB")
    spelled = {"strategy": "scan", "unroll": 1, "remat": None, "accumulator_dtype": "float32"}
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        assert w.time(Request({"strategy": "scan"}, 8, 32, 2, 0)).status == "fits" and w.compiles == 1
        assert w.time(Request(spelled, 8, 32, 2, 0)).status == "fits" and w.compiles == 1
        assert w.time(Request({**spelled, "unroll": 2}, 8, 32, 2, 0)).status == "fits" and w.compiles == 2


def test_the_probe_of_a_tune_runs_in_the_tunes_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker serves the tune's probe, estimates and timings: only one is ever started (its restarts after an
    out-of-memory aside), and the probe's trials ran in it, each with a trial's warm-up and timed steps (so that the
    probe's verdict at a size is the one the tuner's trial there gets)."""
    started: list[int] = []
    asked: list[Request] = []
    start, ask = Worker._start, Worker.ask

    def counted(self: Worker) -> None:
        started.append(id(self))
        start(self)

    def recorded(self: Worker, request: Request) -> Any:
        asked.append(request)
        return ask(self, request)

    monkeypatch.setattr(Worker, "_start", counted)
    monkeypatch.setattr(Worker, "ask", recorded)
    params, batch = problem(features=64)
    batch = {k: jnp.tile(v, (8, 1)) for k, v in batch.items()}  # 32 examples
    result = tune(linear_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="128MiB", storage=":memory:")
    assert result.probe is not None and result.probe.runs >= 1 and result.trials
    assert len(set(started)) == 1, started
    probed = [r for r in asked if r.kind == "time"][: result.probe.runs]
    assert [r.microbatch_size for r in probed] == [t.microbatch_size for t in result.probe.trials]
    assert all((r.steps, r.warmup) == (STEPS, WARMUP) for r in probed), probed


def test_bad_time_limits_are_refused_before_anything_runs() -> None:
    params, batch = problem(features=16)
    for kw in ({"trial_timeout": 0}, {"compile_timeout": -1.0}, {"race_rounds": -1}, {"isolate": "yes"}):
        with pytest.raises((ValueError, TypeError), match=next(iter(kw))):
            tune(linear_loss, params, batch, optimizer=optax.sgd(0.1), microbatch_bound=4, storage=":memory:", **kw)


def wide_loss(params: Any, batch: Any) -> jax.Array:
    """A one-hidden-layer MLP whose 4 MiB first layer makes the accumulator weigh as much as 64 examples."""
    return jnp.mean((jax.nn.relu(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def test_the_tuners_probe_runs_the_accumulating_step_and_nothing_above_its_boundary_is_timed() -> None:
    """The tuner's probe runs the step the tuner times: the one accumulating the effective batch (512), which also
    holds the accumulator and the whole batch. Under 24 MiB its boundary lies below the largest one-microbatch step
    (a probe of its own, without ``effective_batch``: the reference); a size above it ran out of memory, and no size
    above the boundary, nor one the calibrated estimate predicts over the limit, is timed. (Re-running the boundary
    elsewhere is no check: the CPU's peak of one step varies by a few percent from run to run.)"""
    params = {"w1": jnp.zeros((256, 4096)), "w2": jnp.zeros((4096, 1))}
    batch = {"x": jnp.ones((512, 256)), "y": jnp.ones((512, 1))}
    timed: list[int] = []

    def measure(update: Any, params: Any, batch: Any) -> Timing:
        timed.append(update.microbatch_size)
        return Timing(seconds_per_step=0.01 + 1 / update.microbatch_size, compile_seconds=0.1, steps=3)

    result = tune(
        wide_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="24MiB", strategies=["scan"],
        storage=":memory:", measure=measure, race_rounds=0,
    )  # fmt: skip
    found = result.probe
    assert found is not None and found.effective_batch == 512 and found.estimate is not None
    boundary, limit = found.max_microbatch, found.memory_limit_bytes
    single = probe(wide_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit=limit, microbatch_cap=512)
    assert 0 < boundary < single.max_microbatch, (boundary, single.max_microbatch)
    assert found.failed_above is not None and timed and max(timed) <= boundary, (found.trials, timed)
    assert all(found.predicted_peak(found.estimate, m, 512) <= limit for m in timed)


def test_the_probes_fits_are_the_studys_trials_of_what_they_ran() -> None:
    """The tuner's probe runs its trials in the tuning worker with a trial's calls: its fit at the bound, where the
    search starts the default strategy, is the study's trial there (its step times, not a second timing of the same
    program, which at the boundary could even read over the limit where the probe's fit), within the budget."""
    from autoaccum._tune.race import quartiles

    params = {"w1": jnp.zeros((256, 4096)), "w2": jnp.zeros((4096, 1))}
    batch = {"x": jnp.ones((512, 256)), "y": jnp.ones((512, 1))}
    kwargs: dict[str, Any] = dict(optimizer=optax.sgd(0.1), memory_limit="24MiB", strategies=["scan", "loop"],
                                  storage=":memory:", race_rounds=0)  # fmt: skip
    result = autoaccum.tune(wide_loss, params, batch, **kwargs)
    assert result.probe is not None and 0 < result.probe.max_microbatch < 512
    (run,) = [t for t in result.probe.trials if t.microbatch_size == result.probe.max_microbatch]
    same = [r for r in result.trials if r.microbatch_size == run.microbatch_size and r.strategy == "scan"]
    same = [r for r in same if r.options.get("unroll", 1) == 1]
    assert len(same) == 1 and same[0].seconds == quartiles(run.times), (run, same)
    told: list[tuple[int, int]] = []
    kwargs["memory_limit"] = "17MiB"  # (where the probe fits at two sizes the tune may time: 32 and 64)
    one = autoaccum.tune(wide_loss, params, batch, budget=1, on_trial=[lambda r, done, of: told.append((done, of))],
                         **kwargs)  # fmt: skip
    assert one.new_trials == 1 and told and all(done <= of == 1 for done, of in told), told


def test_the_worker_compiles_what_makes_the_inputs_once_and_each_trial_steps_on_the_same_inputs() -> None:
    """A worker's trials share the programs that make the parameters, the optimizer state and the batch
    (`compile_trial`'s ``makers``): compiled for the first trial only (a new batch size gets its own), and a later
    trial of another strategy and size makes exactly the inputs a trial compiled on its own makes."""
    from autoaccum._batch import device_copy
    from autoaccum._worker import compile_trial, step

    params, batch = problem(features=16)
    setup = prepare(linear_loss, params, batch, optimizer=optax.adam(0.1), memory_limit="256MiB")
    job, device = setup.job, jax.devices()[0]
    loop = dataclasses.replace(job, build={**job.build, "strategy": "loop"})
    makers: dict[Any, Any] = {}
    first = compile_trial(job, 4, device, rows=8, makers=makers)
    later = compile_trial(loop, 2, device, rows=8, makers=makers)
    other_rows = compile_trial(loop, 2, device, rows=6, makers=makers)
    assert later.make_params is first.make_params and later.init is first.init and later.resize is first.resize
    assert other_rows.resize is not first.resize and other_rows.make_params is first.make_params
    assert jax.tree.leaves(other_rows.resize(device_copy(job.batch)))[0].shape[0] == 6
    alone = compile_trial(loop, 2, device, rows=8)  # its own makers
    results = []
    for compiled in (later, alone):
        p = compiled.make_params()
        o = compiled.init(p)
        b = compiled.resize(device_copy(job.batch))
        results.append(step(compiled.update, p, o, b, job.inputs(1)[2])[:3])
    for shared, own in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        assert jnp.allclose(shared, own, rtol=0, atol=0), (shared, own)


def test_a_re_timing_of_a_program_the_worker_ran_before_times_its_first_call() -> None:
    """A configuration timed again with no warm-up (the ladder's and the race's re-timings) runs ``steps`` calls,
    the first timed as well (its program ran before in the worker); its first timing ran an untimed first call
    and the warm-up before its ``steps`` timed ones. In the process, `run_trial` calls the step that many times."""
    from autoaccum._worker import compile_trial, run_trial

    params, batch = problem(features=16)
    setup = prepare(linear_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB")
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        first = w.time(Request({"strategy": "scan"}, 4, 8, 3, 1))
        again = w.time(Request({"strategy": "scan"}, 4, 8, 3, 0))
    assert first.status == again.status == "fits" and len(first.times) == len(again.times) == 3
    assert first.first_seconds not in first.times and again.times[0] == again.first_seconds

    calls = []

    def counted(params: Any, batch: Any) -> jax.Array:
        jax.debug.callback(lambda: calls.append(1))
        return linear_loss(params, batch)

    job = dataclasses.replace(setup.job, loss_fn=counted)
    compiled = compile_trial(job, 8, jax.devices()[0])
    for time_first, warmup, expected in ((False, 1, 1 + 1 + 3), (True, 0, 3), (True, 1, 1 + 1 + 3)):
        calls.clear()
        outcome = run_trial(compiled, lambda: None, steps=3, warmup=warmup, time_first=time_first)
        jax.effects_barrier()
        assert len(calls) == expected and len(outcome.times) == 3, (time_first, warmup, len(calls))


@pytest.mark.slow
def test_tune_on_an_8_device_cpu_mesh_times_its_trials_in_the_worker_under_the_cap() -> None:
    """Every trial of a tune on the 8 CPU devices of tests/conftest.py is timed in the worker, which sees the mesh:
    each records the peak the worker measured (per device), within the limit."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    params, batch = problem(features=64)
    batch = {k: jnp.concatenate([v] * 8) for k, v in batch.items()}  # 32 examples, 4 per device
    placed = jax.device_put(batch, NamedSharding(mesh, P("data")))
    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    result = tune(
        linear_loss, replicated, placed, optimizer=optax.sgd(0.1), memory_limit="256MiB", effective_batch=64,
        microbatch_bound=32, strategies=["loop"], budget=3, storage=":memory:", seed=0, race_rounds=0,
    )  # fmt: skip
    done = [t for t in result.trials if t.state == "COMPLETE"]
    assert done and all(t.microbatch_size % 8 == 0 for t in result.trials)
    for t in done:
        assert t.peak_bytes is not None and 0 < t.peak_bytes <= 256 * 2**20, t


@pytest.mark.slow
def test_a_second_worker_finds_the_programs_of_the_first_in_the_compilation_cache(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers share JAX's persistent compilation cache under the study's cache folder: the first one writes its
    programs there, a second one timing the same configuration finds every program (writes nothing new) and reports
    the compile time the cache saved it; with AUTOACCUM_COMPILATION_CACHE=0 nothing is written."""
    from autoaccum._worker import use_compilation_cache

    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)  # (this process's: the workers' come from the variable)
    try:
        params, batch = problem(features=16)
        setup = prepare(linear_loss, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB")
        files: list[set[str]] = []
        saved: list[float | None] = []
        for _ in range(2):
            with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
                outcome = w.ask(Request({"strategy": "scan"}, 4, 8, 2, 0))
                assert outcome.status == "fits"
                assert outcome.costs and all(flops > 0 and moved > 0 for flops, moved in outcome.costs)
            files.append({p.name for p in (tmp_path / "jax").iterdir()})
            saved.append(outcome.cached_seconds)
        assert files[0] and files[1] == files[0], files
        assert saved[0] == 0 and saved[1], saved  # what the hits saved (their compile time less reading them)
        monkeypatch.setenv("AUTOACCUM_COMPILATION_CACHE", "0")
        assert use_compilation_cache() is None
        monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path / "off"))
        with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
            assert w.ask(Request({"strategy": "scan"}, 4, 8, 2, 0)).status == "fits"
        assert not (tmp_path / "off").exists()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


CALLER_WITH_A_CACHE = """
import sys, jax, autoaccum
from autoaccum import workloads
from autoaccum._worker import CACHE_SAVED, recorded
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
w = workloads.cnn()
with recorded(CACHE_SAVED) as saved:
    result = autoaccum.tune(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit="32MiB", budget=1,
                            storage=":memory:", effective_batch=512, strategies=["loop"])
print("PLAN", result.plan.microbatch_size, "HITS", len(saved))
"""


@pytest.mark.slow
def test_the_plan_compiles_from_the_workers_cache_where_the_caller_has_one(tmp_path: Any) -> None:
    """docs/concepts/plan.md: with JAX's persistent cache on in the caller, the worker writes there and tune's own
    compile of the plan's (accumulating) update is read back from it: a cache hit in the caller."""
    import subprocess
    import sys

    env = {**os.environ, "AUTOACCUM_CACHE": str(tmp_path / "studies")}
    run = subprocess.run([sys.executable, "-c", CALLER_WITH_A_CACHE, str(tmp_path / "jax")], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    words = run.stdout.split()
    plan, hits = int(words[words.index("PLAN") + 1]), int(words[words.index("HITS") + 1])
    assert plan < 512 and hits >= 1, run.stdout  # an accumulating plan, its programs read back here
    assert any((tmp_path / "jax").iterdir())


GLOBAL_LOSS = """
import jax.numpy as jnp

SCALE = 1.0  # what a fresh import of this module holds


def loss_fn(w, b):
    return jnp.mean((b["x"] @ w) ** 2) * SCALE
"""


def test_a_worker_refuses_a_loss_that_differs_from_the_callers(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker imports the loss's module afresh: a module global the caller changed at run time does not reach
    it, and it would measure another program (a new user's probe answered 512 for a loss needing 4x the limit there).
    The caller's and the worker's losses, lowered on one example, must agree: else every request fails, saying why."""
    import importlib
    import sys

    (tmp_path / "loss_with_a_global.py").write_text(GLOBAL_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("loss_with_a_global")
    monkeypatch.setitem(sys.modules, "loss_with_a_global", module)
    params, batch = jnp.ones(4), {"x": jnp.ones((16, 4))}
    kw = dict(optimizer=optax.sgd(0.1), memory_limit="64MiB", sizes=[8])
    assert autoaccum.probe(module.loss_fn, params, batch, **kw).max_microbatch == 8  # as imported: the same loss
    monkeypatch.setattr(module, "SCALE", 3.0)
    with pytest.raises(autoaccum.ProbeError, match="the loss the worker loaded is not the one this process runs"):
        autoaccum.probe(module.loss_fn, params, batch, **kw)


@pytest.mark.parametrize("how", ["config", "context", "policing"])
def test_the_worker_runs_the_loss_under_the_callers_jax_settings(how: str) -> None:
    """A JAX setting the caller made at run time (``jax.config.update``, or a context such as
    ``jax.default_matmul_precision``) changes what the loss lowers to: the worker takes it, and runs the caller's
    program (it refused every request: a new user's tune under ``"highest"`` precision). One that polices the
    caller's own code (a transfer guard) is not the worker's: its machinery moves inputs to the device."""
    params, batch = jnp.ones((4, 4)), {"x": jnp.ones((16, 4))}

    def loss_fn(w: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ w) ** 2)

    kw = dict(optimizer=optax.sgd(0.1), memory_limit="64MiB", sizes=[8])
    before = jax.config.values["jax_default_matmul_precision"]
    settings: Any = contextlib.nullcontext()
    if how == "config":
        jax.config.update("jax_default_matmul_precision", "highest")
    elif how == "context":
        settings = jax.default_matmul_precision("highest")
    else:
        settings = jax.transfer_guard_host_to_device("disallow")
    try:
        with settings:
            assert autoaccum.probe(loss_fn, params, batch, **kw).max_microbatch == 8
    finally:
        jax.config.update("jax_default_matmul_precision", before)


class Unpicklable(autoaccum.strategies.Scan):
    name = "unpicklable"
    lock = __import__("threading").Lock()  # (no pickle of it: the class cannot travel)


class Marked(autoaccum.strategies.Loop):
    name = "loop"  # in place of the built-in: the worker must run this one

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with open(os.environ["AUTOACCUM_TEST_MARK"], "a") as f:  # (the worker inherits the variable)
            f.write(f"{os.getpid()}\n")
        return super().run(*args, **kwargs)


def test_registered_strategies_reach_the_worker_as_registered_here(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A strategy registered in place of a built-in one runs in the worker (it ran the built-in one there); one
    whose class does not pickle keeps no other strategy from the worker (every probe failed: a reviewer's
    report)."""
    from autoaccum import strategies

    mark = tmp_path / "ran"
    monkeypatch.setenv("AUTOACCUM_TEST_MARK", str(mark))
    monkeypatch.setattr(strategies, "_REGISTRY", dict(strategies._REGISTRY))  # (restored as it was, in its order)
    params, batch = problem(features=8, rows=16)
    kw: dict[str, Any] = dict(optimizer=optax.sgd(0.1), memory_limit="64MiB", sizes=[8], effective_batch=16)
    strategies.register(Unpicklable)
    strategies.unregister("loop")
    strategies.register(Marked)
    assert autoaccum.probe(linear_loss, params, batch, strategy="scan", **kw).max_microbatch == 8
    assert autoaccum.probe(linear_loss, params, batch, strategy="loop", **kw).max_microbatch == 8
    assert mark.exists() and set(mark.read_text().split()) - {str(os.getpid())}, "the worker ran another loop"


def test_the_cap_never_raises_an_address_space_limit_the_process_already_has() -> None:
    """A user's ``ulimit -v`` (a soft RLIMIT_AS) below the cap was raised to it for the trial (a reviewer's
    report): the trial may use no more than the user allowed, and the limit is restored after."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from autoaccum._worker import address_space_cap, proc_status\n"
        "soft = proc_status('VmSize') + (512 << 20)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (soft, resource.RLIM_INFINITY))\n"
        "with address_space_cap(8 << 30):\n"
        "    inside = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
        "print(inside <= soft, resource.getrlimit(resource.RLIMIT_AS)[0] == soft)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]
