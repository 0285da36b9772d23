"""Knobs: ``build_update(remat=...)`` reaches the compiled program and keeps the result; `autoaccum.Knobs` (the
loss's own knobs) and the remat policies are searched by the tuner, bounded per setting, recorded in the plan.

References are computed without the library: ``jax.value_and_grad`` on the whole batch, one optax step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, copy, fake_measure, full_batch_step
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from seams import nnx_tune, tune

import autoaccum
from autoaccum import Knobs, Plan, Update, strategies, workloads
from autoaccum._worker import Timing

POLICIES = strategies.REMAT_POLICIES


def small(batch_size: int = 20, seed: int = 0) -> tuple[Any, Any]:
    """A two-layer tanh regression small enough to compile in a blink."""
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": 0.3 * jax.random.normal(k[0], (8, 16)), "w2": 0.3 * jax.random.normal(k[1], (16,))}
    batch = {"x": jax.random.normal(k[2], (batch_size, 8)), "y": jax.random.normal(k[3], (batch_size,))}
    return params, batch


def small_loss(p: Any, b: Any) -> jax.Array:
    return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def lowered_text(update: Update, params: Any, batch: Any, *state: Any) -> str:
    return "\n".join(p.lowered.as_text() for p in update.programs(params, update.init(params), batch, *state))


# -- build_update(remat=...) ---------------------------------------------------------------------------------


def test_remat_changes_the_lowered_program(strategy: str) -> None:
    params, batch = small()
    plain = autoaccum.build_update(small_loss, optax.adam(1e-3), microbatch_size=8, strategy=strategy)
    assert plain.remat is None
    without = lowered_text(plain, params, batch)
    assert "optimization_barrier" not in without
    for remat in POLICIES:
        update = autoaccum.build_update(small_loss, optax.adam(1e-3), microbatch_size=8, strategy=strategy, remat=remat)
        assert update.remat == remat
        text = lowered_text(update, params, batch)
        # jax.checkpoint keeps the recomputed forward pass from being merged with the first one by a barrier
        assert text != without and "optimization_barrier" in text, remat


@pytest.mark.parametrize("remat", POLICIES)
def test_each_policy_equals_the_full_batch_step(strategy: str, remat: str) -> None:
    params, batch = small()
    optimizer = optax.sgd(0.1, momentum=0.9)
    expected, expected_state, expected_loss = full_batch_step(
        small_loss, optimizer, params, optimizer.init(params), batch
    )
    update = autoaccum.build_update(small_loss, optimizer, microbatch_size=7, strategy=strategy, remat=remat)
    params, opt_state, loss = update(copy(params), update.init(params), batch)  # 7 + 7 + 6: uneven
    assert_trees_close(params, expected, atol=1e-6)
    assert_trees_close(opt_state, expected_state, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)


@pytest.mark.parametrize("strategy", ["scan", pytest.param("multisteps", marks=pytest.mark.slow)])  # one Spec for all
def test_remat_with_aux_state_and_summed_losses(strategy: str) -> None:
    """has_aux, a PRNG key threaded as state and loss_reduction="sum" under a policy: the same update as without
    one, and the full batch's token mean (the dropout masks are drawn per microbatch, as without remat)."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": 0.3 * jax.random.normal(k[0], (5, 16)), "v": 0.3 * jax.random.normal(k[1], (16,))}
    batch = {
        "x": jax.random.normal(k[2], (10, 3, 5)),
        "y": jax.random.normal(k[3], (10, 3)),
        "mask": (jnp.arange(3)[None, :] < jnp.array([3, 1, 2, 3, 3, 1, 2, 2, 3, 1])[:, None]).astype(jnp.float32),
    }

    def loss_fn(p: Any, b: Any, key: Any) -> Any:
        key, sub = jax.random.split(key)
        keep = jax.random.bernoulli(sub, 0.8, (b["x"].shape[0], 3, 16))
        hidden = jnp.tanh(b["x"] @ p["w"]) * keep / 0.8
        errors = (hidden @ p["v"] - b["y"]) ** 2 * b["mask"]
        return ((jnp.sum(errors), jnp.sum(b["mask"])), {"max": jnp.max(errors)}), key

    optimizer = optax.adam(1e-2)
    results = []
    for remat in (None, "dots_saveable"):
        update = autoaccum.build_update(
            loss_fn, optimizer, microbatch_size=4, strategy=strategy, has_aux=True, has_state=True,
            loss_reduction="sum", remat=remat,
        )  # fmt: skip
        results.append(update(copy(params), update.init(params), batch, jax.random.key(7)))
    plain, remat = results
    assert_trees_close(remat[:2], plain[:2], atol=1e-6)
    np.testing.assert_allclose(remat[2][0], plain[2][0], atol=1e-6)
    assert_trees_close(remat[2][1], plain[2][1], atol=1e-6)
    assert jnp.array_equal(jax.random.key_data(remat[3]), jax.random.key_data(plain[3]))

    # One microbatch: no accumulation, the remat'ed step is the plain full-batch step on the same key.
    def whole(p: Any) -> Any:
        (total, count), _ = loss_fn(p, batch, jax.random.key(7))[0]
        return total / count

    loss, grads = jax.jit(jax.value_and_grad(whole))(params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    update = autoaccum.build_update(
        loss_fn, optimizer, microbatch_size=10, strategy=strategy, has_aux=True, has_state=True,
        loss_reduction="sum", remat="nothing_saveable",
    )  # fmt: skip
    got, _, (got_loss, _), _ = update(copy(params), update.init(params), batch, jax.random.key(7))
    assert_trees_close(got, optax.apply_updates(params, updates), atol=1e-6)
    np.testing.assert_allclose(got_loss, loss, atol=1e-6)


def test_remat_on_a_mesh(strategy: str) -> None:
    remat = "dots_with_no_batch_dims_saveable"
    params, batch = small(batch_size=64, seed=1)
    optimizer = optax.adam(1e-2)
    expected, _, expected_loss = full_batch_step(small_loss, optimizer, params, optimizer.init(params), batch)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    on_mesh = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    rows = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
    update = autoaccum.build_update(small_loss, optimizer, microbatch_size=24, strategy=strategy, remat=remat)
    assert "optimization_barrier" in lowered_text(update, on_mesh, rows)
    got, _, loss = update(on_mesh, update.init(on_mesh), rows)  # 24, 24, 16: uneven
    assert_trees_close(jax.device_get(got), expected, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)


@pytest.mark.parametrize("bad", ["dots", "checkpoint_dots", "", 3, jax.checkpoint_policies.dots_saveable])
def test_bad_policy_names_raise_before_compiling(bad: Any) -> None:
    traced: list[int] = []

    def loss_fn(w: Any, b: Any) -> jax.Array:
        traced.append(1)
        return jnp.mean(b @ w)

    with pytest.raises(ValueError, match=r"unknown `remat` .*; choose None \(off\) or one of 'nothing_saveable'"):
        autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=2, remat=bad)
    with pytest.raises(ValueError, match=r"unknown `remat`"):
        autoaccum.nnx.build_update(lambda m, b: jnp.mean(m(b)), microbatch_size=2, remat=bad)
    with pytest.raises((TypeError, ValueError), match=r"`remat`"):
        tune(loss_fn, jnp.ones(3), jnp.ones((4, 3)), optimizer=optax.sgd(0.1), microbatch_bound=2, remat=(None, bad))
    assert traced == []


def test_nnx_step_with_remat_equals_the_plain_step() -> None:
    from flax import nnx

    def make() -> tuple[Any, Any]:
        model = workloads.MLP(features=(16, 4), in_features=6, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    batch = {"x": jax.random.normal(jax.random.key(2), (12, 6)), "y": jnp.ones((12, 4))}

    def loss_fn(model: Any, b: Any) -> jax.Array:
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    losses, kernels = [], []
    for remat in (None, "dots_saveable"):
        model, optimizer = make()
        step = autoaccum.nnx.build_update(loss_fn, microbatch_size=5, remat=remat)
        losses.append(step(model, optimizer, batch))
        kernels.append(np.asarray(model.layers[0].kernel[...]))
        assert step.compiled_for(model, optimizer).remat == remat
    np.testing.assert_allclose(losses[1], losses[0], atol=1e-6)
    np.testing.assert_allclose(kernels[1], kernels[0], atol=1e-6)


# -- Knobs ----------------------------------------------------------------------------------------------------


def scaled_loss(scale: float = 1.0) -> Any:
    """A loss factory with a knob of its own (the tests' stand-in for per-layer remat: same gradient direction)."""

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return scale * jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    return loss_fn


def test_knobs_check_their_values() -> None:
    knobs = Knobs(scaled_loss, scale=(1.0, 0.5))
    assert knobs.default == {"scale": 1.0}
    assert knobs.settings() == [{"scale": 1.0}, {"scale": 0.5}]
    with pytest.raises(ValueError, match="needs at least one knob"):
        Knobs(scaled_loss)
    with pytest.raises(TypeError, match=r"knob `scale` must be a non-empty tuple"):
        Knobs(scaled_loss, scale=())
    with pytest.raises(TypeError, match=r"knob `scale` must be a non-empty tuple"):
        Knobs(scaled_loss, scale="dots_saveable")
    with pytest.raises(TypeError, match=r"knob `scale` has values .* that a plan's JSON cannot record"):
        Knobs(scaled_loss, scale=(None, jax.checkpoint_policies.dots_saveable))
    with pytest.raises(ValueError, match=r"knob `scale` repeats a value"):
        Knobs(scaled_loss, scale=(1.0, 1.0))
    for odd in (float("nan"), float("inf")):  # (nan != nan: no plan could match it; neither is JSON)
        with pytest.raises(TypeError, match=r"knob `scale` has values \[(nan|inf)\] .* finite floats"):
            Knobs(scaled_loss, scale=(1.0, odd))
    for equal in ((1, 1.0), (0.5, True, 1), (False, 0)):  # equal in Python: Optuna's categorical index conflates them
        with pytest.raises(ValueError, match=r"knob `scale` repeats a value: .* in Python, so one setting"):
            Knobs(scaled_loss, scale=equal)
    with pytest.raises(ValueError, match=r"the Knobs lacks \['size'\] and no value is given for \['scale'\]"):
        knobs.loss_fn(size=2)  # (as from a plan tuned with a knob `size`: it said "unknown ['size']")
    with pytest.raises(
        ValueError, match=r"do not match this Knobs' knobs \['scale'\]: no value is given for \[.scale.\];"
    ):
        knobs.loss_fn()  # (it said the Knobs lacked [])
    with pytest.raises(TypeError, match=r"knobs \['activation'\] are not parameters of make_loss\(scale"):
        Knobs(scaled_loss, activation=("tanh", "relu"))  # (the factory's own TypeError came from the tune)


def test_every_knob_settings_loss_is_checked_before_anything_runs() -> None:
    """What is wrong with one knob setting's loss (its output, the factory raising, returning no function) is said
    before any trial, naming the setting: it came after the probe, as a failed estimate in the worker, or bare (a
    new user's report)."""

    def make_loss(scale: float = 1.0, aux: bool = False) -> Any:
        loss = scaled_loss(scale)
        return (lambda p, b: (loss(p, b), 0.0)) if aux else loss

    def raising(scale: float = 1.0) -> Any:
        if scale == 0.5:
            raise ValueError("scale=0.5 is not supported by this build")
        return scaled_loss(scale)

    w = workloads.linear(batch_size=8, features=4)
    calls: list[Any] = []
    kw: dict[str, Any] = dict(
        optimizer=w.optimizer, memory_limit="64MiB", storage=":memory:", measure=fake_measure(calls)
    )
    with pytest.raises(TypeError, match=r"returned a tuple of 2 but has_aux=False") as caught:
        tune(Knobs(make_loss, aux=(False, True)), w.params, w.batch, **kw)
    assert "(the loss of the knob setting remat=None, aux=True)" in caught.value.__notes__
    with pytest.raises(ValueError, match=r"scale=0\.5 is not supported") as caught:
        tune(Knobs(raising, scale=(1.0, 0.5)), w.params, w.batch, **kw)
    assert "autoaccum called the Knobs' make_loss as raising(scale=0.5)." in caught.value.__notes__
    with pytest.raises(TypeError, match=r"make_loss, called as <lambda>\(scale=0.5\), returned int 42, not a loss"):
        tune(Knobs(lambda scale=1.0: 42 if scale == 0.5 else scaled_loss(scale), scale=(1.0, 0.5)), w.params,
             w.batch, **kw)  # fmt: skip
    assert calls == []


def test_tune_searches_a_knob_of_the_loss() -> None:
    w = workloads.linear(batch_size=24, features=16)
    calls: list[tuple[int, str, Any]] = []
    inner = fake_measure()

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        scale = float(update.accumulation.spec.loss_fn(params, batch) / w.loss_fn(params, batch))
        calls.append((update.microbatch_size, update.strategy, round(scale, 3)))
        timing = inner(update, params, batch)
        if round(scale, 3) == 0.5:  # the knob's second value makes every configuration 20% faster
            timing = Timing(timing.seconds_per_step * 0.8, timing.compile_seconds, timing.steps)
        return timing

    knobs = Knobs(scaled_loss, scale=(1.0, 0.5))
    result = tune(
        knobs, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=4, strategies=["scan", "loop"], budget=32,
        storage=":memory:", measure=measure, race_rounds=0,  # the grid's timings only: no finalists re-timed
    )  # fmt: skip
    # The whole grid: sizes 1..4 x (scan, scan:unroll=2, scan:unroll=8, loop) x both values of the knob, each timed
    # once.
    assert sorted(calls) == sorted(
        (m, s, scale) for m in (1, 2, 3, 4) for s in ("scan", "scan", "scan", "loop") for scale in (1.0, 0.5)
    )
    assert result.plan.knobs == {"scale": 0.5} and result.plan.remat is None
    assert {(r.knobs["scale"], r.remat) for r in result.trials} == {(1.0, None), (0.5, None)}
    # The plan builds the loss again from the factory, with the values it records.
    update = result.plan.build(knobs, w.optimizer)
    assert float(update.accumulation.spec.loss_fn(w.params, w.batch)) == 0.5 * float(w.loss_fn(w.params, w.batch))
    with pytest.raises(ValueError, match=r"tuned with knobs \{'scale': 0.5\}: pass the autoaccum.Knobs"):
        result.plan.build(w.loss_fn, w.optimizer)


def test_tune_searches_remat_policies_and_the_plan_reproduces_them(tmp_path: Path) -> None:
    w = workloads.linear(batch_size=24, features=16)
    calls: list[Any] = []
    inner = fake_measure()

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append((update.microbatch_size, update.remat))
        timing = inner(update, params, batch)
        factor = 0.9 if update.remat == "dots_saveable" else 1.0
        return Timing(timing.seconds_per_step * factor, timing.compile_seconds, timing.steps)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=3, strategies=["loop"],
        remat=(None, "nothing_saveable", "dots_saveable"), budget=9, storage=":memory:", measure=measure,
        race_rounds=0,
    )  # fmt: skip
    assert sorted(calls, key=str) == sorted(
        ((m, r) for m in (1, 2, 3) for r in (None, "nothing_saveable", "dots_saveable")), key=str
    )
    plan = result.plan
    assert plan.remat == "dots_saveable" and plan.knobs == {}
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan and loaded.remat == "dots_saveable"
    assert loaded.build(w.loss_fn, w.optimizer).remat == "dots_saveable"
    assert result.update_fn is not None and result.update_fn.remat == "dots_saveable"


# -- the accumulator dtype ---------------------------------------------------------------------------------------


def test_the_accumulator_dtype_reaches_the_lowered_program(strategy: str) -> None:
    """A float32 model accumulating in bfloat16: the accumulating program holds bf16 sums; float32 has none."""
    params, batch = small()
    texts = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        update = autoaccum.build_update(
            small_loss, optax.sgd(0.1), microbatch_size=5, strategy=strategy, accumulator_dtype=dtype
        )
        texts[dtype] = lowered_text(update, params, batch)
    assert "bf16" not in texts[jnp.float32]
    assert "bf16" in texts[jnp.bfloat16]


def test_tune_searches_the_accumulator_dtype_and_the_plan_records_it(tmp_path: Path) -> None:
    w = workloads.linear(batch_size=24, features=16)
    calls: list[Any] = []
    inner = fake_measure()

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        dtype = jnp.dtype(update.accumulation.spec.accumulator_dtype).name
        calls.append((update.microbatch_size, dtype))
        timing = inner(update, params, batch)
        factor = 0.8 if dtype == "bfloat16" else 1.0  # made up: the bf16 accumulator is faster
        return Timing(timing.seconds_per_step * factor, timing.compile_seconds, timing.steps)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=3, strategies=["loop"],
        accumulator_dtype=(jnp.float32, jnp.bfloat16), budget=6, storage=":memory:", measure=measure,
        race_rounds=0,
    )  # fmt: skip
    assert sorted(calls) == sorted((m, d) for m in (1, 2, 3) for d in ("float32", "bfloat16"))
    assert {r.accumulator_dtype for r in result.trials} == {"float32", "bfloat16"}
    plan = result.plan
    assert plan.accumulator_dtype == "bfloat16" and plan.microbatch_size == 3
    # each setting named by its dtype, float32 too (its text read "remat=None": a new user's report)
    assert sorted(result.bounds) == [f"remat=None, accumulator_dtype={d!r}" for d in ("bfloat16", "float32")]
    loaded = Plan.load(plan.save(tmp_path / "plan.json"))
    assert loaded == plan
    assert loaded.build(w.loss_fn, w.optimizer).accumulation.spec.accumulator_dtype == jnp.bfloat16


@pytest.mark.parametrize("bad", [jnp.int32, (jnp.float32, jnp.float32), (), "float99", (jnp.float32, "float64")])
def test_bad_accumulator_dtypes_raise_before_anything_runs(bad: Any) -> None:
    w = workloads.linear(batch_size=8, features=4)
    with pytest.raises((TypeError, ValueError), match=r"`accumulator_dtype` must|`accumulator_dtype`='float64' is 64"):
        tune(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, accumulator_dtype=bad, storage=":memory:")


def test_plan_json_keeps_knobs_and_old_plans_load() -> None:
    plan = Plan(12, 4, 3, "scan", remat="nothing_saveable", knobs={"block_remat": None, "layers": 4, "on": True})
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.knobs == {"block_remat": None, "layers": 4, "on": True}
    old = Plan(12, 4, 3, "scan").to_dict()
    del old["remat"], old["knobs"]  # written before knobs existed
    assert Plan.from_dict(old) == Plan(12, 4, 3, "scan")


def deep_residual(blocks: int = 8, dim: int = 64, seed: int = 0) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(seed), 5)
    params = {
        "w1": 0.1 * jax.random.normal(k[0], (blocks, dim, 4 * dim)),
        "w2": 0.1 * jax.random.normal(k[1], (blocks, 4 * dim, dim)),
        "out": 0.1 * jax.random.normal(k[2], (dim,)),
    }
    batch = {"x": jax.random.normal(k[3], (16, dim)), "y": jax.random.normal(k[4], (16,))}
    return params, batch


def make_deep_loss(block_remat: str | None = None) -> Any:
    """A deep residual MLP scanned over its blocks; the knob wraps the block in jax.checkpoint with the policy it
    names (inside a scan over the layers, where XLA cannot merge the recomputation back into the forward pass)."""

    def block(h: jax.Array, w: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        return h + jnp.tanh(jnp.tanh(h @ w[0]) * 1.5) @ w[1], None

    def loss_fn(params: Any, batch: Any) -> jax.Array:  # jax.checkpoint made inside: the loss pickles
        step = block
        if block_remat is not None:
            step = jax.checkpoint(block, policy=getattr(jax.checkpoint_policies, block_remat))
        h, _ = jax.lax.scan(step, batch["x"], (params["w1"], params["w2"]))
        return jnp.mean((h @ params["out"] - batch["y"]) ** 2)

    return loss_fn


@pytest.mark.slow  # (48 s; test_knob_bounds.py bounds a remat setting by its own estimate in 8 s)
def test_each_setting_of_the_knobs_gets_its_own_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs once, for the default setting; the per-block remat setting's bound comes from its compile-only
    estimate, calibrated by the probe, and is far larger (the backward pass keeps a block's input, not its
    activations); no size above a setting's bound is timed."""
    import autoaccum._tune.job as run  # where tune probes

    # The probe's trials run in this process (isolate=False, under the same limit): as exact, and quicker here.
    monkeypatch.setattr(run, "probe", functools.partial(autoaccum.probe, isolate=False))
    params, batch = deep_residual()
    made: dict[int, str | None] = {}

    def make_loss(block_remat: str | None) -> Any:
        loss_fn = make_deep_loss(block_remat)
        made[id(loss_fn)] = block_remat
        return loss_fn

    calls: list[tuple[int, str | None]] = []

    def measure(update: Update, params: Any, batch: Any) -> Timing:  # each microbatch costs 10 ms, whatever its size
        calls.append((update.microbatch_size, made[id(update.accumulation.spec.loss_fn)]))
        return Timing(0.01 * update.accumulation_steps(jax.tree.leaves(batch)[0].shape[0]), 0.5, 5)

    knobs = Knobs(make_loss, block_remat=(None, "nothing_saveable"))
    result = tune(
        knobs, params, batch, optimizer=optax.sgd(0.1), effective_batch=4096, memory_limit="24MiB",
        strategies=["loop"], remat=(None,), budget=8, storage=":memory:", measure=measure,
    )  # fmt: skip
    assert result.probe is not None
    probed = result.probe.max_microbatch
    remat_bound = result.bounds["remat=None, block_remat='nothing_saveable'"]
    assert result.bounds["remat=None, block_remat=None"] == probed > 0
    assert remat_bound > 2 * probed
    limit = {None: probed, "nothing_saveable": remat_bound}
    assert calls and all(m <= limit[value] for m, value in calls)
    assert any(m > probed for m, value in calls if value == "nothing_saveable")
    assert result.plan.knobs == {"block_remat": "nothing_saveable"}  # fewer, larger microbatches


def test_nnx_tune_searches_a_knob_of_the_loss() -> None:
    """A factory of nnx losses: the knob picks the nnx.remat policy of the layers the loss calls."""
    from flax import nnx

    model = workloads.MLP(features=(16, 4), in_features=6, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = {"x": jax.random.normal(jax.random.key(3), (8, 6)), "y": jnp.ones((8, 4))}

    def make_loss(layer_remat: str | None = None) -> Any:
        def layer(linear: Any, x: jax.Array) -> jax.Array:
            return linear(x)

        if layer_remat is not None:
            layer = nnx.remat(layer, policy=getattr(jax.checkpoint_policies, layer_remat))

        def loss_fn(model: Any, b: Any) -> jax.Array:
            h = nnx.relu(layer(model.layers[0], b["x"]))
            return jnp.mean((layer(model.layers[1], h) - b["y"]) ** 2)

        return loss_fn

    seen: list[Any] = []

    def measure(update: Update, params: Any, batch: Any, state: Any) -> Timing:
        text = lowered_text(update, params, batch, state)
        seen.append(("optimization_barrier" in text, update.microbatch_size))
        return Timing(0.01 * (2 if "optimization_barrier" in text else 1), 0.1, 3)  # remat: slower here

    knobs = Knobs(make_loss, layer_remat=(None, "nothing_saveable"))
    result = nnx_tune(
        knobs, model, optimizer, batch, microbatch_bound=8, strategies=["loop"], budget=8, storage=":memory:",
        measure=measure,
    )  # fmt: skip
    assert {remat for remat, _ in seen} == {False, True}  # both values reached the compiled program
    assert result.plan.knobs == {"layer_remat": None}
    before = np.asarray(model.layers[0].kernel[...])
    loss = result.step(model, optimizer, batch)
    assert np.isfinite(float(loss)) and not np.allclose(model.layers[0].kernel[...], before)


# -- the built-in transformer's block_remat knob (the demo's) --------------------------------------------------


@pytest.mark.slow
def test_scanned_transformer_block_remat_keeps_the_gradient_and_lowers_the_estimate() -> None:
    """Each value of the scanned transformer's ``block_remat`` knob reaches the lowered program and gives the loss
    and gradient of no remat (the reference: ``jax.value_and_grad`` of the plain loss); remat lowers the compile-
    only estimate of the memory per example (measured ~2x at this size, ~2.4x at the demo's; asserted >= 1.5x)."""
    w = workloads.transformer(
        batch_size=8, seq_len=8, vocab=32, dim=16, heads=2, scan_layers=True, block_remat=workloads.BLOCK_REMAT
    )
    assert w.knobs is not None and w.knobs.default == {"block_remat": None}
    results = {}
    for value in workloads.BLOCK_REMAT:
        lowered = jax.jit(jax.value_and_grad(w.knobs.loss_fn(block_remat=value))).lower(w.params, w.batch)
        assert ("optimization_barrier" in lowered.as_text()) == (value is not None), value
        results[value] = lowered.compile()(w.params, w.batch)
    ref_loss, ref_grads = results[None]
    for loss, grads in results.values():
        np.testing.assert_allclose(float(loss), float(ref_loss), atol=1e-6)
        assert_trees_close(grads, ref_grads, atol=1e-6)
    per_example = {
        value: autoaccum.estimate(
            w.knobs.loss_fn(block_remat=value),
            w.params,
            w.batch,
            optimizer=w.optimizer,
            accumulation=False,
            memory_limit="256MiB",  # a fixed limit, not half of the RAM free now
        ).per_example_bytes
        for value in (None, "nothing_saveable")
    }
    assert per_example[None] >= 1.5 * per_example["nothing_saveable"], per_example


def test_a_workloads_knobs_are_searched_by_the_cli_tune() -> None:
    from click.testing import CliRunner

    from autoaccum.cli import main

    args = ["tune", "tests/probe_workloads.py:knobbed", "--max-microbatch", "4", "--strategy", "loop",
            "--n-trials", "2", "--storage", ":memory:", "--race-rounds", "0", "--json"]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    trials = json.loads(result.stdout)["trials"]
    assert {t["knobs"]["scale"] for t in trials} == {1.0, 0.5}
    with pytest.raises(TypeError, match=r"`Workload.knobs` must be an autoaccum.Knobs .* got dict"):
        dataclasses.replace(workloads.linear(batch_size=4), knobs={"block_remat": (None,)})
    with pytest.raises(ValueError, match=r'`Workload.api` must be "pytree" or "nnx", got api=\'flax\''):
        dataclasses.replace(workloads.linear(batch_size=4), api="flax")


def test_a_knob_setting_the_budget_never_reaches_is_named_in_the_message() -> None:
    """A budget spent before the knobs (the breadth of strategy variants first) left them untimed, silently."""
    w = workloads.linear(batch_size=24, features=16)
    knobs = Knobs(scaled_loss, scale=(1.0, 0.5))
    result = tune(
        knobs, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=4, strategies=["scan", "loop"], budget=2,
        storage=":memory:", measure=fake_measure(), race_rounds=0,
    )  # fmt: skip
    timed = {r.knobs["scale"] for r in result.trials if r.throughput is not None}
    assert timed == {1.0}, result.trials
    assert "knob settings not timed within the budget: remat=None, scale=0.5" in result.message, result.message
    result = tune(
        knobs, w.params, w.batch, optimizer=w.optimizer, microbatch_bound=4, strategies=["scan"], budget=32,
        storage=":memory:", measure=fake_measure(), race_rounds=0,
    )  # fmt: skip
    assert "not timed" not in result.message, result.message
