"""The probe: an exact boundary under a real memory cap, few runs, a caller that survives crashing trials.

The search is tested against simulated devices (fast, many boundaries); the real thing runs trials in child
processes under a CPU address-space cap and checks its answer with separate capped runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import signal
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import probe_workloads
import pytest
from helpers import assert_trees_close, full_batch_step

import autoaccum
import autoaccum._probe
from autoaccum import workloads
from autoaccum._capacity import StepCost
from autoaccum._device import DeviceInfo
from autoaccum._estimate import Estimate, Point
from autoaccum._isolation import classify_exit
from autoaccum._probe import FIRST_MARGIN, LENT, ProbeError, Trial, TrialRunner, prepare, runnable_sizes, search
from autoaccum._tune.space import fewest_steps, microbatch_candidates, probe_sizes
from autoaccum._worker import Worker, is_oom

# What `measured` reads of a compiled trial when `run_trial` is replaced: one device, no mesh.
ONE_DEVICE = types.SimpleNamespace(job=types.SimpleNamespace(devices=1, mesh=None))


def fake_device(fixed: float, per: float, boundary: int, noise: float = 0.0, seed: int = 0, page: int = 1):  # type: ignore[no-untyped-def]
    """``run(m)`` of a device where ``boundary`` fits and ``boundary + 1`` does not, and its limit; peaks are
    reported in whole ``page``s (as a CPU trial's address space grows), never above the limit."""
    rng = np.random.default_rng(seed)
    limit = int(fixed + per * (boundary + 0.5))
    runs: list[int] = []

    def run(m: int) -> Trial:
        runs.append(m)
        fits = fixed + per * m <= limit
        used = min(math.ceil((fixed + per * m + per * noise * rng.uniform(-1, 1)) / page) * page, limit)
        return Trial(m, fits, 0.0, peak_bytes=int(used) if fits else None)

    return run, limit, runs


def model(fixed: float, per: float, limit: int, cap: int, g: int = 1) -> dict[str, Any]:
    """What `autoaccum.probe` tells the search of a compile-only estimate: its answer at `FIRST_MARGIN` of the bytes
    above the smallest microbatch's (`autoaccum._probe.first_size`), and its slope."""
    first = limit - (1 - FIRST_MARGIN) * max(limit - fixed - per * g, 0)
    predicted = max(0, min(cap // g, math.floor((first - fixed) / per / g))) * g
    return dict(predicted=predicted, per_example_bytes=per)


BOUNDARIES = [1, 2, 3, 7, 64, 100, 999, 4096, 5000, 12345, 16383, 16384]


@pytest.mark.parametrize(
    "slope_error, fixed_error, noise, page, most",
    [
        (0.0, 0.0, 0.0, 1, 4),
        (0.05, 0.0, 0.0, 1, 5),
        (-0.05, 0.0, 0.0, 1, 6),
        (0.3, 2.0, 0.0, 1, 6),
        (0.0, 0.0, 3.0, 1, 8),
        (0.25, 0.5, 0.0, 4096, 6),
        (-0.2, 0.0, 0.0, 4096, 10),
    ],
    ids=[
        *("exact-model", "slope+5%", "slope-5%", "slope+30%-fixed*3", "noisy-peaks"),
        *("pages-slope+25%", "pages-slope-20%"),
    ],
)
def test_search_is_exact_and_spends_few_runs(
    slope_error: float, fixed_error: float, noise: float, page: int, most: int
) -> None:
    # page: the MLP's regime, under 4 KiB per example, peaks counted in 4 KiB pages
    fixed, per = (5e6, 16384.0) if page == 1 else (1.9e7, 2970.0)
    for boundary in BOUNDARIES:
        run, limit, runs = fake_device(fixed, per, boundary, noise, seed=boundary, page=page)
        estimate = model(fixed * (1 + fixed_error), per * (1 + slope_error), limit, 16384)
        found = search(run, limit=limit, max_microbatch=16384, **estimate)
        assert found == boundary, (boundary, runs)
        assert len(runs) <= most, (boundary, runs)
        assert boundary in runs and (boundary == 16384 or boundary + 1 in runs), runs


def test_search_with_an_exact_estimate_runs_the_boundary_and_the_next_size_only() -> None:
    """An estimate as exact as XLA's on a GPU (1.000 of the boundary on an H200) costs two runs, the boundary and
    the size above it, where the first trial's margin does not take it below the boundary: small boundaries (the
    124M LM's 2 and 9), and listed sizes with room above the one that fits."""
    for boundary in range(1, 16):
        run, limit, runs = fake_device(5e6, 16384.0, boundary)
        assert search(run, limit=limit, max_microbatch=16384, **model(5e6, 16384.0, limit, 16384)) == boundary
        assert runs == [boundary, boundary + 1], runs
    listed = probe_sizes(1024)
    for fit, above in itertools.pairwise(listed):
        boundary = above - 1  # the largest size below the next listed one: room above `fit` where they are apart
        if FIRST_MARGIN * (boundary + 0.5) < fit:
            continue
        run, limit, runs = fake_device(5e6, 16384.0, boundary)
        estimate = model(5e6, 16384.0, limit, 1024)
        assert search(run, limit=limit, max_microbatch=1024, sizes=listed, **estimate) == fit
        assert runs == [fit, above], (boundary, runs)


def test_search_without_an_estimate_still_finds_the_boundary() -> None:
    for boundary in BOUNDARIES:
        run, limit, runs = fake_device(5e6, 16384.0, boundary)
        assert search(run, limit=limit, max_microbatch=16384) == boundary, runs
        assert len(runs) <= 20


def test_search_granularity_max_size_and_nothing_fits() -> None:
    run, limit, runs = fake_device(1e6, 1000.0, 1234)
    assert search(run, limit=limit, max_microbatch=4096, granularity=8, **model(1e6, 1000.0, limit, 4096, 8)) == 1232
    assert all(m % 8 == 0 for m in runs) and {1232, 1240} <= set(runs)
    run, limit, runs = fake_device(1e6, 1000.0, 50_000)
    assert search(run, limit=limit, max_microbatch=300, **model(1e6, 1000.0, limit, 300)) == 300
    assert max(runs) == 300
    run, limit, runs = fake_device(1e6, 1000.0, 5)
    assert search(run, limit=limit, max_microbatch=4096, granularity=8) == 0
    assert runs == [8]


def test_search_over_listed_sizes_answers_the_largest_that_fits() -> None:
    """With ``sizes`` (the tuner's candidates) the answer is the largest listed size that fits and the next listed
    one was tried and failed; no other size is run."""
    listed = probe_sizes(1024)
    for boundary in [1, 5, 40, 42, 43, 64, 100, 341, 342, 700, 1023, 1024]:
        for estimate in ({}, model(5e6, 16384.0 * 1.2, int(5e6 + 16384.0 * (boundary + 0.5)), 1024)):
            run, limit, runs = fake_device(5e6, 16384.0, boundary)
            found = search(run, limit=limit, max_microbatch=1024, sizes=listed, **estimate)
            fitting = [s for s in listed if s <= boundary]
            assert found == fitting[-1], (boundary, runs)
            assert set(runs) <= set(listed) and found in runs, runs
            above = [s for s in listed if s > found]
            assert not above or above[0] in runs, runs
            assert len(runs) <= (4 if estimate else 8), (boundary, estimate, runs)
    run, limit, runs = fake_device(1e6, 1000.0, 5)
    assert search(run, limit=limit, max_microbatch=64, sizes=[8, 16, 6]) == 0 and runs == [6]


def test_probe_sizes_cover_every_candidate_list() -> None:
    for effective_batch in range(1, 200):
        listed = set(probe_sizes(effective_batch))
        for bound in range(1, effective_batch + 1):
            candidates = microbatch_candidates(effective_batch, bound)
            assert set(candidates) <= listed and max(candidates) <= bound
            # the fewest accumulation steps any size up to the bound allows, at the least such size
            steps = -(-effective_batch // bound)
            assert fewest_steps(effective_batch, bound) in candidates
            assert -(-effective_batch // fewest_steps(effective_batch, bound)) == steps


def test_listed_sizes_whose_buffers_are_predicted_over_the_limit_are_not_run() -> None:
    """An uneven split's last microbatch adds buffers (as in the demo: 26 x 5 needs 41 MB, 32 x 4 33 MB): a listed
    size is left out where the estimate's XLA bytes for it (by hand here) exceed the limit, whatever its order."""
    per, fixed, acc, rem, limit = 1000, 50_000, 20_000, 900, 103_000
    points = tuple(Point(m, m, fixed + per * m, 0.0, 0.0, runtime_bytes=7_000) for m in (1, 64))
    model = Estimate(
        strategy="scan", options={}, memory_limit_bytes=limit, points=points, accumulation_bytes=acc,
        per_batch_example_bytes=0.0, remainder_bytes_per_example=rem, cost=StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        microbatch_cap=64, platform="cpu", seconds=0.0,
    )  # fmt: skip
    sizes = [1, 2, 4, 8, 13, 16, 22, 26, 32, 64]
    by_hand = {m: fixed + per * m + (acc + rem * (64 % m) if m < 64 else 0) for m in sizes}
    assert by_hand[26] > limit >= by_hand[32]  # 26 x 2 + 12: the remainder's 10,800 B tip it over
    runnable, over = runnable_sizes(sizes, model, limit, 64)
    assert over == tuple(m for m in sizes[1:] if by_hand[m] > limit) and 26 in over and 32 in runnable
    assert set(runnable) | set(over) == set(sizes) and not set(runnable) & set(over)
    assert runnable_sizes([40, 64], model, 10, 64) == ((40,), (64,))  # the least size is always run


def test_the_probe_says_what_stopped_its_answer() -> None:
    """The least larger size that ran out of memory or was left out as predicted over the limit, whichever comes
    first; nothing when neither (the answer is the largest the probe could try). The tune's report prints it."""

    def result(trials: list[Trial], over: tuple[int, ...]) -> autoaccum.ProbeResult:
        return autoaccum.ProbeResult(
            max_microbatch=16, trials=tuple(trials), device=DeviceInfo("cpu", "simulated", None, None, None),
            memory_limit_bytes=2**20, limit_source="given", granularity=1, microbatch_cap=64, strategy="scan",
            options={}, state_bytes=0, estimate=None, isolate=False, seconds=0.0, message="", predicted_over=over,
        )  # fmt: skip

    ran = [Trial(16, True, 0.01, peak_bytes=2**19), Trial(22, False, None), Trial(43, False, None)]
    assert result(ran, ()).why_not_above == "22 does not"
    assert result(ran, (19, 32)).why_not_above == "19 is predicted not to (its buffers over the limit; not run)"
    assert result(ran, (26,)).why_not_above == "22 does not"
    assert result(ran[:1], (19,)).why_not_above.startswith("19 is predicted") and not result(ran[:1], ()).why_not_above
    assert not result(ran[:1], (8,)).why_not_above and result(ran[:1], (8,)).reached_cap  # a smaller size left out


def test_only_the_tuners_worker_leaves_sizes_out() -> None:
    """A probe's own trials run a step whatever XLA's figure (it can overstate the CPU's use: the probe is exact);
    in the tuner's lent worker of the same limit they run as its trials, which refuse a step whose buffers XLA puts
    over the limit, so only there are such sizes left out (nothing is started here)."""
    loss_fn, params, batch = probe_workloads.linear(features=64)
    setup = prepare(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="40MiB")
    assert not TrialRunner(setup).refuses_over_xla
    lent = Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=None, step_timeout=None)
    other = Worker(setup.job, setup.device, setup.memory_limit_bytes + 1, compile_timeout=None, step_timeout=None)
    for worker, refuses in ((lent, True), (other, False)):
        token = LENT.set(worker)
        try:
            assert TrialRunner(setup).refuses_over_xla is refuses
        finally:
            LENT.reset(token)
    assert TrialRunner(dataclasses.replace(setup, isolate=False)).refuses_over_xla  # this process, on the CPU


def test_in_this_process_on_the_cpu_no_answer_exceeds_xlas_own_bytes() -> None:
    """With ``isolate=False`` on the CPU no cap is set in this process: a failed allocation under one left XLA's
    runtime here broken (later steps of other programs returned NaN), and the heap here may hold a step's memory
    free (the cap read 512 KiB for steps of 50 MB). A size whose buffers XLA alone puts over the limit is refused,
    so the answer's step fits by XLA's own lower bound, computed here without the library; this process computes
    as before."""

    def loss_fn(p: Any, b: Any) -> jax.Array:
        h = jnp.tanh(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"])
        return jnp.mean((h @ p["w3"] - b["y"]) ** 2)

    k = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k[0], (128, 256)) * 0.05, "w2": jax.random.normal(k[1], (256, 256)) * 0.05,
              "w3": jnp.zeros(256)}  # fmt: skip
    batch = {"x": jax.random.normal(k[2], (256, 128)), "y": jnp.ones(256)}
    limit = 8 * 2**20
    tx = optax.adam(1e-3)
    found = autoaccum.probe(loss_fn, params, batch, optimizer=tx, memory_limit=limit, isolate=False)
    w = workloads.mlp(batch_size=20)  # another program, after: it read NaN after a capped probe
    expected = full_batch_step(w.loss_fn, optax.sgd(0.1), w.params, optax.sgd(0.1).init(w.params), w.batch)
    update = autoaccum.build_update(w.loss_fn, optax.sgd(0.1), microbatch_size=5, donate=False)
    assert_trees_close(update(w.params, update.init(w.params), w.batch), expected, atol=1e-6)
    m = found.max_microbatch
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=m, strategy=found.strategy)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    rows = {k: jax.ShapeDtypeStruct((m, *v.shape[1:]), v.dtype) for k, v in batch.items()}
    for program in update.programs(shapes, jax.eval_shape(tx.init, shapes), rows):
        a = program.lowered.compile().memory_analysis()
        live = a.argument_size_in_bytes + a.output_size_in_bytes + a.temp_size_in_bytes - a.alias_size_in_bytes
        assert live <= limit, (m, live)


def test_probe_at_listed_sizes_reports_the_next_size_that_failed() -> None:
    # 4096 rows of 4096 float32 inputs are 64 MiB, well above the limit; 512 rows are 8 MiB. (At a 64 MiB limit
    # the step's working set, the batch alone, equals the limit: a fresh child fits it, and so does this process
    # when its heap has the room free.)
    loss_fn, params, batch = probe_workloads.linear(features=4096)
    result = autoaccum.probe(
        loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="40MiB", microbatch_cap=4096,
        sizes=[8, 64, 512, 4096],
    )  # fmt: skip
    assert {t.microbatch_size for t in result.trials} <= {8, 64, 512, 4096}
    assert result.max_microbatch in (8, 64, 512) and not result.reached_cap
    nxt = {8: 64, 64: 512, 512: 4096}[result.max_microbatch]
    assert result.failed_above == nxt and f"; {nxt} does not" in result.message
    assert result.predicted_over == ()  # its own worker runs a size whatever XLA's figure: the probe is exact
    back = autoaccum.ProbeResult.from_json(result.to_json())
    assert back.sizes == (8, 64, 512, 4096) and back.device == result.device and back.device.id == 0  # (was None)
    assert back.to_dict() == result.to_dict()
    with pytest.raises(ValueError, match=r"`sizes`=\[3, 5\] holds \[3, 5\], not positive multiples of 2 \(`gran"):
        autoaccum.probe(loss_fn, params, batch, optimizer=optax.sgd(0.1), granularity=2, sizes=[3, 5], isolate=False)
    # one bad size among good ones is named too (it was dropped without a word), before anything runs
    with pytest.raises(ValueError, match=r"holds \[12, 20, 5000\].*up to 64 \(`microbatch_cap`.*e\.g\. sizes=\[16\]"):
        autoaccum.probe(
            loss_fn, params, batch, optimizer=optax.sgd(0.1), granularity=8, microbatch_cap=64, isolate=False,
            sizes=[12, 16, 20, 5000],
        )  # fmt: skip
    found = autoaccum.probe(  # any iterable of sizes (a generator was used up by the type check: IndexError)
        loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="40MiB", microbatch_cap=64, isolate=False,
        sizes=(8 * k for k in (1, 2, 4)),
    )  # fmt: skip
    assert found.sizes == (8, 16, 32) and found.max_microbatch in (8, 16, 32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(microbatch_cap=0), "`microbatch_cap` must be >= 1"),
        (dict(granularity=0), "`granularity` must be >= 1"),
        (dict(granularity=64, microbatch_cap=8), "below `granularity`"),
        (dict(granularity=100, microbatch_cap=1000, effective_batch=64), r"`effective_batch`=64 is below `granul"),
        (dict(memory_limit="lots"), "`memory_limit`='lots' does not parse"),
        (dict(memory_limit=-5), "`memory_limit` must be positive"),
        (dict(memory_limit=0.5), r"`memory_limit`=0.5 is less than one byte: it is a size in bytes, not a fraction"),
        (dict(memory_limit=1000), r"alone need: .*\(16388 bytes\)"),
        (dict(strategy="nope"), "unknown `strategy`"),
    ],
    ids=["max_microbatch", "granularity", "granularity-above-max", "granularity-above-batch", "unparsable-limit",
         "negative-limit", "fraction-limit", "limit-below-state", "strategy"],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_runs(kwargs: dict, match: str) -> None:
    loss_fn, params, batch = probe_workloads.linear()
    with pytest.raises(ValueError, match=match):
        autoaccum.probe(loss_fn, params, batch, optimizer=optax.sgd(0.1), **kwargs)


def test_in_this_process_an_allocation_failure_raised_as_a_value_error_is_a_failed_trial() -> None:
    """`time_update` (``isolate=False``) takes XLA's RESOURCE_EXHAUSTED raised as a ValueError (a copy to the device)
    for out of memory, as the worker does: a failed trial, not an error out of the tune."""
    from types import SimpleNamespace

    from autoaccum._worker import TrialFailed, time_update

    def init(params: Any) -> Any:
        raise ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 2097152 bytes.")

    with pytest.raises(TrialFailed, match="out of memory: RESOURCE_EXHAUSTED"):
        time_update(SimpleNamespace(init=init), {"w": jnp.zeros(2)}, {"x": jnp.ones((2, 2))})


def test_oom_classification() -> None:
    assert is_oom(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 5 bytes."))
    assert is_oom(jax.errors.JaxRuntimeError("INTERNAL: Error dispatching computation: Out of memory allocating 8"))
    assert not is_oom(jax.errors.JaxRuntimeError("INTERNAL: something else"))
    assert is_oom(MemoryError()) and not is_oom(ValueError("RESOURCE_EXHAUSTED"))
    assert is_oom(ValueError("RESOURCE_EXHAUSTED: Out of memory allocating 2097152 bytes."))  # (a copy to the device)
    abort = -signal.SIGABRT
    bad_alloc = "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc"
    assert classify_exit(abort, bad_alloc, None).status == "oom"
    crashed = classify_exit(abort, "", None)
    assert crashed.status == "error" and "SIGABRT" in (crashed.message or "")
    assert classify_exit(-signal.SIGKILL, "", True).status == "oom"
    assert classify_exit(-signal.SIGKILL, "", None).status == "error"  # unknown: a kill is not an OOM
    assert classify_exit(-signal.SIGKILL, "", False).status == "error"
    assert classify_exit(-signal.SIGSEGV, "", None).status == "error"
    assert classify_exit(1, "Traceback ...\nMemoryError", None).status == "oom"
    assert classify_exit(1, "Traceback ...\nKeyError: 'x'", None).status == "error"


def test_an_unlabelled_xla_error_under_the_cpu_cap_counts_only_if_it_runs_without_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autoaccum import _worker

    calls: list[int] = []

    def flaky(compiled: object, peak: object, fail_times: int) -> _worker.Outcome:
        calls.append(1)
        if len(calls) <= fail_times:
            raise jax.errors.JaxRuntimeError("INTERNAL: YNNPACK operation failed: error")
        return _worker.Outcome("fits")

    monkeypatch.setattr(_worker, "run_trial", lambda c, p, **kw: flaky(c, p, 1))
    outcome = _worker.measured(ONE_DEVICE, "cpu", 2**30)  # type: ignore[arg-type]
    assert outcome.status == "oom" and "runs without it" in (outcome.message or "") and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(_worker, "run_trial", lambda c, p, **kw: flaky(c, p, 2))
    with pytest.raises(jax.errors.JaxRuntimeError, match="YNNPACK"):
        _worker.measured(ONE_DEVICE, "cpu", 2**30)  # type: ignore[arg-type]


def test_in_process_probe_leaves_the_callers_arrays_alone() -> None:
    loss_fn, params, batch = probe_workloads.linear(features=8)
    before = jax.tree.map(np.array, (params, batch))
    result = autoaccum.probe(
        loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="512MiB", microbatch_cap=48, isolate=False
    )
    assert result.max_microbatch == 48 and result.reached_cap
    assert result.runs <= 3 and all(t.fits for t in result.trials)
    jax.tree.map(np.testing.assert_array_equal, before, (params, batch))
    assert float(jnp.sum(params["w"])) == 0.0  # still alive: nothing was donated


def verify(setup_kwargs: dict, sizes: list[int], workload: Any = probe_workloads.linear) -> list[bool]:
    """Separate capped runs of ``sizes``, each in a worker of its own."""
    loss_fn, params, batch = workload()
    setup = prepare(loss_fn, params, batch, **setup_kwargs)
    fits = []
    for m in sizes:
        with TrialRunner(setup) as run:
            fits.append(run(m).fits)
    return fits


def test_probe_finds_the_exact_boundary_under_a_real_cap() -> None:
    loss_fn, params, batch = probe_workloads.linear()
    before = jax.tree.map(np.array, params)
    seen: list[Trial] = []
    # 12 KiB above 100 MiB: each example needs 16 KiB, and at 100 MiB exactly the boundary's step needs 4 KiB
    # more than the cap when run uncapped, so a separate run could land either side; here both sides have 8 KiB.
    # Separate runs still varied under CI's load (twice in ~6 runs the boundary + 1 fit on its own, and in 2 of
    # about 10 CI runs the boundary + 2), so they are checked two examples (32 KiB) clear of it on each side.
    limit = 100 * 2**20 + 12 * 2**10
    kwargs = dict(optimizer=optax.sgd(0.1), memory_limit=limit, microbatch_cap=16384)
    result = autoaccum.probe(loss_fn, params, batch, progress=seen.append, **kwargs)
    m = result.max_microbatch
    assert 5000 < m < 6500, result  # 16 KiB of input per example under 100 MiB (plus slack already mapped)
    assert list(result.trials) == seen and result.runs <= 8, [(t.microbatch_size, t.fits) for t in result.trials]
    assert result.memory_limit_bytes == limit and result.estimate is not None
    assert any(t.microbatch_size == m and t.fits for t in result.trials)
    assert any(t.microbatch_size == m + 1 and not t.fits for t in result.trials)
    assert verify(kwargs, [m - 2, m + 3]) == [True, False]
    jax.tree.map(np.testing.assert_array_equal, before, params)
    assert result.to_dict()["max_microbatch"] == m


def test_probe_with_granularity_and_the_loop_strategy() -> None:
    # Half a granule (8 x 16 KiB) above 48 MiB: at 48 MiB exactly, 3072 examples need 4 KiB more than the cap
    # when run uncapped and still fit under it, by a hair, so a separate run could land either side.
    limit = 48 * 2**20 + 2**16
    loss_fn, params, batch = probe_workloads.linear()
    kwargs = dict(optimizer=optax.adam(1e-3), memory_limit=limit, microbatch_cap=8192, granularity=8, strategy="loop")
    result = autoaccum.probe(loss_fn, params, batch, **kwargs)
    m = result.max_microbatch
    assert m > 0 and m % 8 == 0 and result.runs <= 8, result.trials
    assert all(t.microbatch_size % 8 == 0 for t in result.trials)
    assert verify(kwargs, [m, m + 8]) == [True, False]


def test_a_first_trial_in_a_fresh_worker_measures_like_a_later_one() -> None:
    """What a runtime maps once per process on a step's first run (XLA:CPU: about 8 MiB of kernel code for an MLP's
    backward pass) is in every worker before its first trial: the boundary a probe finds in one worker (most of its
    trials after others) holds for first trials in workers of their own, 10% either side (about 2.5 MiB; the 8 MiB
    moved it by a quarter)."""
    loss_fn, params, batch = probe_workloads.mlp()
    kwargs = dict(optimizer=optax.adamw(1e-3), memory_limit="30MiB", microbatch_cap=8192)
    found = autoaccum.probe(loss_fn, params, batch, **kwargs)
    m, trials = found.max_microbatch, [(t.microbatch_size, t.fits, t.peak_bytes) for t in found.trials]
    assert m > 1000, trials
    assert verify(kwargs, [int(m * 0.9), int(m * 1.1) + 1], probe_workloads.mlp) == [True, False], trials


GRANULES_32 = dict(granularity=32)


def test_the_caller_survives_a_child_that_aborts() -> None:
    _, params, batch = probe_workloads.linear(features=64)
    with pytest.raises(ProbeError, match="SIGABRT") as info:
        autoaccum.probe(
            probe_workloads.abort_past_64, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB",
            microbatch_cap=128, granularity=32,
        )  # fmt: skip
    crash = info.value.trial
    assert crash.microbatch_size > 64 and not crash.fits and crash.error is not None
    assert all(t.fits for t in info.value.trials[:-1])


def test_a_trial_error_is_reported_not_taken_for_too_big() -> None:
    _, params, batch = probe_workloads.linear(features=64)
    with pytest.raises(ProbeError, match="refuses batches above 64"):
        autoaccum.probe(
            probe_workloads.raise_past_64, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB",
            microbatch_cap=128, granularity=32,
        )  # fmt: skip


def test_a_step_the_cpu_cap_cannot_see_is_judged_by_xlas_buffers() -> None:
    """At a limit of 512 B a step runs in memory the worker holds already, so the address-space cap sees no growth;
    the probe answered 'microbatch 6289 fits under 512 B' (a 32-float regression). XLA's buffers decide there."""
    loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    batch = {"x": jnp.ones((64, 32)), "y": jnp.zeros(64)}
    result = autoaccum.probe(loss_fn, jnp.zeros(32), batch, optimizer=optax.adam(1e-3), memory_limit=512)
    assert result.max_microbatch == 0 and "nothing fits" in result.message, result.message
    needs = [t.peak_bytes for t in result.trials]
    assert all(n is not None and n > 512 for n in needs), needs  # each refusal carries XLA's bytes


def test_an_effective_batch_that_alone_is_over_the_cap_is_nothing_fits() -> None:
    """Copying the effective batch (2 MiB) to the device under a 4 MiB cap fails as XLA's RESOURCE_EXHAUSTED raised
    as a ValueError: the step does not fit, not 'failed for another reason than memory' (a ProbeError)."""
    loss_fn = lambda p, b: jnp.mean((jnp.tanh(b["x"] * p["a"]).mean(axis=1) + p["b"] - b["y"]) ** 2)  # noqa: E731
    params, batch = {"a": jnp.ones(()), "b": jnp.zeros(())}, {"x": jnp.ones((256, 2048)), "y": jnp.ones(256)}
    result = autoaccum.probe(loss_fn, params, batch, optimizer=optax.adam(1e-3), memory_limit="4MiB",
                             effective_batch=256)  # fmt: skip
    assert result.max_microbatch == 0 and "nothing fits" in result.message, result.message


def test_a_loss_that_is_not_a_scalar_is_refused_before_any_child_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The update is traced on shapes in the caller: the loss's output is checked there, not in a child's first
    trial (with an explicit strategy, "auto" resolving none here, a (B,)-shaped loss got its error from a child)."""
    loss_fn, params, batch = probe_workloads.linear()
    monkeypatch.setattr(autoaccum._probe, "Worker", None)  # (a child would fail to start: TypeError)
    with pytest.raises(ValueError, match=r"must return a scalar .* returned shape \(4,\) on a microbatch of 4 "):
        autoaccum.probe(lambda p, b: loss_fn(p, b) * jnp.ones(jax.tree.leaves(b)[0].shape[:1]), params, batch,
                        optimizer=optax.sgd(0.1), memory_limit="64MiB", strategy="loop")  # fmt: skip


def test_a_bad_limit_is_named_before_the_loss_is_traced() -> None:
    """The cheap checks come first: a bad `memory_limit` is named though the loss would raise when traced."""
    _, params, batch = probe_workloads.linear()
    with pytest.raises(ValueError, match=r"`memory_limit`='lots' does not parse"):
        autoaccum.probe(lambda p, b: b["nope"].mean(), params, batch, optimizer=optax.sgd(0.1), memory_limit="lots")


def test_nothing_fits_returns_zero() -> None:
    loss_fn, params, batch = probe_workloads.linear()
    result = autoaccum.probe(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="4MiB", granularity=1024)
    assert result.max_microbatch == 0 and "nothing fits" in result.message
    assert [t.fits for t in result.trials] == [False]


@pytest.mark.gpu
def test_probe_on_a_gpu_under_a_cap() -> None:
    loss_fn, params, batch = probe_workloads.linear()
    kwargs = dict(optimizer=optax.sgd(0.1), memory_limit="1GiB", microbatch_cap=1 << 17)
    result = autoaccum.probe(loss_fn, params, batch, **kwargs)
    m = result.max_microbatch
    assert result.device.platform == "gpu" and 0 < m < 1 << 17 and result.runs <= 8
    assert verify(kwargs, [m - 1, m + 2]) == [True, False]


def test_isolated_probe_with_typed_keys_in_the_batch_and_the_state() -> None:
    _, params, batch = probe_workloads.linear(features=256)
    batch = {**batch, "key": jax.random.split(jax.random.key(3), 4)}
    state = {"key": jax.random.key(0), "count": jnp.zeros((), jnp.int32)}
    result = autoaccum.probe(
        probe_workloads.keyed_loss, params, batch, optimizer=optax.adam(1e-3), state=state, memory_limit="64MiB",
        microbatch_cap=256, granularity=64,
    )  # fmt: skip
    assert result.max_microbatch == 256 and all(t.fits for t in result.trials)
    assert int(state["count"]) == 0  # the caller's state is untouched
