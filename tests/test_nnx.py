"""flax nnx, the way nnx code is written: `autoaccum.nnx` against an explicit reference computed without it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import count_backend_compiles

import autoaccum
from autoaccum._plan import params_signature

as_pure = getattr(nnx, "as_pure", None) or nnx.pure  # flax < 0.12.7 calls it `pure`


class Net(nnx.Module):
    """Linear, BatchNorm, ReLU, Dropout, Linear: every kind of state nnx training code has."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 8, use_bias=False, rngs=rngs)  # no bias before BatchNorm (its gradient is 0)
        self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def loss_fn(model: Net, batch: Any) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make() -> tuple[Net, nnx.Optimizer]:
    model = Net(rngs=nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def batches(n: int = 2, size: int = 10) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(7), n)
    return [
        {"x": jax.random.normal(k, (size, 4)), "y": jax.random.normal(jax.random.fold_in(k, 1), (size, 1))}
        for k in keys
    ]


def reference_update(model: Any, optimizer: nnx.Optimizer, batch: Any, m: int, objective: Any = loss_fn) -> jax.Array:
    """Without autoaccum: microbatches in order, the model's other state threaded, (n_i / B) * grad_i summed,
    one optax step; written back to the model and optimizer."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    step = jax.jit(functools.partial(reference_step, graphdef, objective, optimizer.tx, m))  # not op by op
    params, rest, opt_state, loss = step(as_pure(params), as_pure(rest), as_pure(optimizer.opt_state), batch)
    nnx.update(model, params, rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step[...] += 1
    return loss


def reference_step(
    graphdef: Any, objective: Any, tx: Any, m: int, params: Any, rest: Any, opt_state: Any, batch: Any
) -> tuple:
    def pure(p: Any, b: Any, r: Any) -> tuple[jax.Array, Any]:
        local = nnx.merge(graphdef, p, r)
        value = objective(local, b)
        return value, as_pure(nnx.split(local, nnx.Param, ...)[2])  # type: ignore[misc]

    total = batch["x"].shape[0]
    grads = jax.tree.map(jnp.zeros_like, params)
    loss_sum = 0.0
    for start in range(0, total, m):
        micro = jax.tree.map(lambda x: x[start : start + m], batch)  # noqa: B023
        n = micro["x"].shape[0]
        (loss, rest), g = jax.value_and_grad(pure, has_aux=True)(params, micro, rest)
        grads = jax.tree.map(lambda a, b: a + (n / total) * b, grads, g)  # noqa: B023
        loss_sum += (n / total) * loss
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), rest, opt_state, jnp.asarray(loss_sum)


def assert_states_close(a: Any, b: Any, atol: float) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), atol=atol)


@pytest.mark.parametrize("strategy", ["scan", "loop", "multisteps"])
def test_nnx_step_equals_the_explicit_reference_after_two_updates(strategy: str) -> None:
    model, optimizer = make()
    ref_model, ref_optimizer = make()
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=3, strategy=strategy)  # 3 + 3 + 3 + 1
    for batch in batches():
        loss = step(model, optimizer, batch)
        expected = reference_update(ref_model, ref_optimizer, batch, 3)
        np.testing.assert_allclose(float(loss), float(expected), atol=1e-6)
    # params, BatchNorm statistics, the dropout stream's counter and the optimizer state (atol 1e-6, float32)
    assert_states_close(nnx.state(model), nnx.state(ref_model), atol=1e-6)
    assert_states_close(nnx.state(optimizer), nnx.state(ref_optimizer), atol=1e-6)
    assert int(optimizer.step[...]) == 2
    assert int(model.drop.rngs.count[...]) == 8  # one draw per microbatch, 4 per update


class CountingOptimizer(nnx.Optimizer):
    """An ``nnx.Optimizer`` that counts its ``update`` calls (each traced once under ``nnx.jit``)."""

    updates: list[int] = []  # noqa: RUF012

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> Any:
        CountingOptimizer.updates.append(1)
        return super().update(model, grads, **kwargs)


@pytest.mark.parametrize("strategy", ["scan", "loop", "multisteps"])
def test_the_step_goes_through_optimizer_update(strategy: str) -> None:
    """nnx's own ``optimizer.update`` applies the gradient: a subclass's override runs, and the result still
    equals the reference (which calls ``optimizer.update`` with the whole batch's gradient)."""
    model = Net(rngs=nnx.Rngs(0, dropout=1))
    optimizer = CountingOptimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    ref_model, ref_optimizer = make()
    CountingOptimizer.updates.clear()
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=3, strategy=strategy)
    for batch in batches():
        step(model, optimizer, batch)
        reference_update(ref_model, ref_optimizer, batch, 3)
    assert CountingOptimizer.updates == [1]  # traced once, run twice
    assert int(optimizer.step[...]) == 2
    assert_states_close(nnx.state(model), nnx.state(ref_model), atol=1e-6)
    assert_states_close(nnx.state(optimizer), nnx.state(ref_optimizer), atol=1e-6)


def test_nnx_dropout_differs_per_microbatch_and_per_update() -> None:
    model, optimizer = make()
    masks: list[Any] = []

    def recording_loss(model: Net, batch: Any) -> jax.Array:
        jax.debug.callback(lambda c: masks.append(int(c)), model.drop.rngs.count[...])
        return loss_fn(model, batch)

    step = autoaccum.nnx.build_update(recording_loss, microbatch_size=5, strategy="loop")
    for batch in batches():
        step(model, optimizer, batch)
    assert sorted(masks) == [0, 1, 2, 3]  # every microbatch of every update draws from a fresh count


def test_second_call_compiles_nothing() -> None:
    model, optimizer = make()
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=4)
    first, second = batches()
    step(model, optimizer, first)
    with count_backend_compiles() as compiles:
        step(model, optimizer, second)
    assert compiles == []


def test_plain_api_points_nnx_users_to_autoaccum_nnx() -> None:
    model, optimizer = make()
    with pytest.raises(TypeError, match=r"autoaccum\.nnx"):
        autoaccum.build_update(lambda p, b: 0.0, optimizer, microbatch_size=2)  # type: ignore[arg-type]
    update = autoaccum.build_update(lambda p, b: jnp.mean(p(b["x"])), optax.sgd(0.1), microbatch_size=2)
    with pytest.raises(TypeError, match=r"autoaccum\.nnx"):
        update(model, optax.sgd(0.1).init(nnx.state(model, nnx.Param)), batches()[0])
    with pytest.raises(TypeError, match=r"autoaccum\.nnx"):
        autoaccum.estimate(lambda p, b: 0.0, model, batches()[0], optimizer=optax.sgd(0.1), memory_limit="1GiB")
    with pytest.raises(TypeError, match=r"must be an nnx\.Optimizer"):
        autoaccum.nnx.build_update(loss_fn, microbatch_size=2)(model, optax.sgd(0.1), batches()[0])  # type: ignore[arg-type]
    for wrong in (lambda model: 0.0, lambda p, b, s: (0.0, s)):  # (a linen-style loss was told to pass has_state)
        with pytest.raises(TypeError, match=r"`loss_fn` must take 2 arguments, loss_fn\(model, batch\)"):
            autoaccum.nnx.build_update(wrong, microbatch_size=2)
        with pytest.raises(TypeError, match=r"`loss_fn` must take 2 arguments, loss_fn\(model, batch\)"):
            autoaccum.nnx.value_and_grad(wrong, microbatch_size=2)


@pytest.mark.slow
def test_nnx_probe_estimate_and_tune_leave_the_model_alone() -> None:
    model, optimizer = make()
    before = jax.tree.map(jnp.copy, nnx.state(model))
    batch = batches(1, 16)[0]
    est = autoaccum.nnx.estimate(loss_fn, model, optimizer, batch, memory_limit="64MiB", accumulation=False)
    assert est.max_microbatch > 16
    found = autoaccum.nnx.probe(
        loss_fn, model, optimizer, batch, memory_limit="256MiB", microbatch_cap=32, isolate=False
    )
    assert found.max_microbatch == 32
    result = autoaccum.nnx.tune(
        loss_fn, model, optimizer, batch, microbatch_bound=8, strategies=["scan", "loop"], storage=":memory:", budget=3
    )
    assert_states_close(nnx.state(model), before, atol=0.0)
    loss = result.step(model, optimizer, batch)  # the plan, the nnx way
    assert jnp.isfinite(loss) and int(optimizer.step[...]) == 1


def test_nnx_probe_in_child_processes() -> None:
    """The model's state (BatchNorm statistics, the dropout stream's typed key) crosses to the trials."""
    model, optimizer = make()
    result = autoaccum.nnx.probe(
        loss_fn, model, optimizer, batches(1, 8)[0], memory_limit="256MiB", microbatch_cap=64, granularity=32
    )
    assert result.max_microbatch == 64 and all(t.fits for t in result.trials)


class Viewed(nnx.Module):
    """Holds a list attribute, as flax's UNETR tutorial model does (``self.proj_view_shape = [...]``)."""

    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 6, rngs=rngs)
        self.view_shape = [2, 3]  # a list: the model's GraphDef does not hash
        self.out = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.hidden(x)).reshape((x.shape[0], *self.view_shape))
        return self.out(h.mean(axis=1))


def test_a_model_holding_a_list_attribute_steps_as_under_nnx_jit() -> None:
    # atol 1e-6 (float32), two updates of 3 + 3 + 3 + 1; the second compiles nothing.
    def make_viewed() -> tuple[Viewed, nnx.Optimizer]:
        model = Viewed(rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    model, optimizer = make_viewed()
    ref_model, ref_optimizer = make_viewed()
    first, second = batches()
    assert jnp.isfinite(nnx.jit(loss_fn)(model, first))  # what nnx.jit accepts
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=3)
    loss = step(model, optimizer, first)
    np.testing.assert_allclose(float(loss), float(reference_update(ref_model, ref_optimizer, first, 3)), atol=1e-6)
    with count_backend_compiles() as compiles:
        loss = step(model, optimizer, second)
    assert compiles == []
    np.testing.assert_allclose(float(loss), float(reference_update(ref_model, ref_optimizer, second, 3)), atol=1e-6)
    assert_states_close(nnx.state(model), nnx.state(ref_model), atol=1e-6)
    assert_states_close(nnx.state(optimizer), nnx.state(ref_optimizer), atol=1e-6)


def make_scaled_loss(scale: float = 1.0) -> Any:
    return lambda model, batch: scale * loss_fn(model, batch)


def test_a_saved_plan_builds_the_nnx_step_with_its_knobs_remat_and_accumulator_dtype(tmp_path: Any) -> None:
    # The plan as autoaccum.nnx.tune makes it (model state: has_state=True), saved and loaded; the step equals the
    # reference with the plan's knob (scale 2), microbatch 3 and strategy (float32: states atol 1e-6, loss rtol 1e-6).
    model, optimizer = make()
    ref_model, ref_optimizer = make()
    knobs = autoaccum.Knobs(make_scaled_loss, scale=(1.0, 2.0))
    signature = params_signature(autoaccum.nnx.functional(loss_fn, model, optimizer).params)
    tuned = autoaccum.Plan(
        effective_batch=10, microbatch_size=3, accumulation_steps=4, strategy="loop", has_state=True,
        remat="nothing_saveable", knobs={"scale": 2.0}, params=signature,
    )  # fmt: skip
    plan = autoaccum.Plan.load(tuned.save(tmp_path / "plan.json"))
    step = autoaccum.nnx.build_update(knobs, plan=plan)
    for batch in batches():
        loss = step(model, optimizer, batch)
        expected = reference_update(ref_model, ref_optimizer, batch, 3, objective=make_scaled_loss(2.0))
        np.testing.assert_allclose(float(loss), float(expected), rtol=1e-6)  # a loss near 7: float32 ulp 4.8e-7
    assert_states_close(nnx.state(model), nnx.state(ref_model), atol=1e-6)
    assert_states_close(nnx.state(optimizer), nnx.state(ref_optimizer), atol=1e-6)
    spec = step.compiled_for(model, optimizer).accumulation.spec
    assert (spec.microbatch_size, spec.remat, spec.accumulator_dtype) == (3, "nothing_saveable", jnp.float32)

    bf16 = dataclasses.replace(plan, accumulator_dtype="bfloat16", strategy="scan", options={"unroll": 2})
    update = autoaccum.nnx.build_update(knobs, plan=bf16, state_update="once").compiled_for(model, optimizer)
    assert (update.strategy, update.options, update.state_update) == ("scan", {"unroll": 2}, "once")
    assert update.accumulation.spec.accumulator_dtype == jnp.bfloat16


def test_a_plan_is_checked_against_the_model_and_the_arguments_beside_it() -> None:
    model, optimizer = make()
    plan = autoaccum.Plan(effective_batch=10, microbatch_size=3, accumulation_steps=4, strategy="scan")
    with pytest.raises(ValueError, match=r"`plan` sets `microbatch_size`, `strategy` \(the plan has microbatch_size=3"):
        autoaccum.nnx.build_update(loss_fn, plan=plan, microbatch_size=4, strategy="loop")
    with pytest.raises(TypeError, match=r"`microbatch_size` is required: pass microbatch_size=\.\.\., or a tuned plan"):
        autoaccum.nnx.build_update(loss_fn)
    other = dataclasses.replace(plan, params={"['kernel']": "float32[3, 3]"})
    with pytest.raises(ValueError, match=r"this plan was tuned for different params"):
        autoaccum.nnx.build_update(loss_fn, plan=other)(model, optimizer, batches()[0])
    smaller = dataclasses.replace(plan, opt_state_bytes=8)  # (the optimizer's state here is larger)
    with pytest.warns(UserWarning, match=r"this optimizer's state of these params needs .* tune again") as caught:
        autoaccum.nnx.build_update(loss_fn, plan=smaller)(model, optimizer, batches()[0])
    assert caught[0].filename == __file__  # (at the caller's line)


class Named(NamedTuple):
    value: jax.Array


def test_a_plan_takes_the_params_as_nnx_split_gives_them_and_its_value_and_grad_checks_the_model() -> None:
    """Plan.build's params as ``nnx.split`` gives them (Variables, whose paths end in ``.value``) are the plan's (they
    were all "missing"), also against a plan that recorded those paths; `autoaccum.nnx.value_and_grad` with a plan
    refuses another model as `build_update` does (it ran it silently)."""
    model, optimizer = make()
    _, params, _ = nnx.split(model, nnx.Param, ...)
    plan = autoaccum.Plan(effective_batch=10, microbatch_size=5, accumulation_steps=2, strategy="scan",
                          params=params_signature(nnx.to_pure_dict(params)))  # fmt: skip
    assert params_signature(params) == plan.params
    plan.build(lambda p, b: jnp.mean(b @ p["kernel"]), optimizer.tx, params=params)
    recorded = {k + ".value": v for k, v in plan.params.items()}  # (a plan made from a State before)
    dataclasses.replace(plan, params=recorded).check_params(nnx.to_pure_dict(params))
    named = {"a": Named(jnp.ones(3))}  # (a field called value, not nnx's: its paths end in .value too)
    dataclasses.replace(plan, params=params_signature(named)).check_params(named)
    other = dataclasses.replace(plan, params={"['kernel']": "float32[3, 3]"})
    grad_fn = autoaccum.nnx.value_and_grad(loss_fn, plan=other)
    with pytest.raises(ValueError, match=r"this plan was tuned for different params"):
        grad_fn(model, batches()[0])
    autoaccum.nnx.value_and_grad(loss_fn, plan=plan)(model, batches()[0])


def test_a_plan_built_the_functional_way_points_an_nnx_model_at_the_nnx_door() -> None:
    # Plan.build makes the functional update, which takes (params, opt_state, batch, state); an nnx model and
    # optimizer passed to it are pointed at autoaccum.nnx.build_update(loss_fn, plan=...), not at `state`: at the
    # call, or already at the build where the nnx loss does not take the state.
    model, optimizer = make()
    plan = autoaccum.Plan(effective_batch=10, microbatch_size=3, accumulation_steps=4, strategy="scan", has_state=True)
    with pytest.raises(TypeError, match=r"must take 3 arguments.*autoaccum\.nnx\.build_update\(loss_fn, plan="):
        plan.build(loss_fn, optimizer.tx)
    with pytest.raises(TypeError, match=r"loss_fn\(model, batch\), but its signature is \(model\) \(.*\)\.$"):
        autoaccum.nnx.value_and_grad(lambda model: 0.0, microbatch_size=4)  # (its sentence ended mid-way)
    with pytest.raises(TypeError, match=r"is an nnx\.Net.*autoaccum\.nnx\.build_update\(loss_fn, plan="):
        plan.build(lambda p, b, s: (loss_fn(p, b), s), optimizer.tx)(model, optimizer, batches()[0])


def test_state_update_once_moves_batch_stats_once_per_update() -> None:
    # By hand, without autoaccum: the BatchNorm's input is h = x @ kernel (no layer before it normalises); per
    # microbatch of 3, 3, 3, 1 its mean and biased variance; the statistics move once per update:
    # 0.9 * old + 0.1 * sum_i (n_i / B) * stat_i (atol 1e-6, float32); the mean is the full batch's. The
    # parameters equal the threaded reference's (training mode normalises by the microbatch's own statistics
    # either way), and the dropout stream still draws once per microbatch.
    model, optimizer = make()
    ref_model, ref_optimizer = make()
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=3, state_update="once")
    (batch,) = batches(1)
    kernel = np.asarray(model.hidden.kernel[...], np.float64)
    old_mean, old_var = np.asarray(model.norm.mean[...]), np.asarray(model.norm.var[...])
    step(model, optimizer, batch)
    reference_update(ref_model, ref_optimizer, batch, 3)

    h = np.asarray(batch["x"], np.float64) @ kernel
    pieces = [h[i : i + 3] for i in range(0, 10, 3)]
    mean = sum(len(p) / 10 * p.mean(axis=0) for p in pieces)
    var = sum(len(p) / 10 * p.var(axis=0) for p in pieces)
    np.testing.assert_allclose(model.norm.mean[...], 0.9 * old_mean + 0.1 * mean, atol=1e-6)
    np.testing.assert_allclose(model.norm.var[...], 0.9 * old_var + 0.1 * var, atol=1e-6)
    np.testing.assert_allclose(mean, h.mean(axis=0), atol=1e-12)
    assert_states_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), atol=1e-6)
    assert int(model.drop.rngs.count[...]) == 4


def test_nnx_workload_carries_a_token_weighted_loss_to_the_update() -> None:
    """``autoaccum.nnx.workload(..., loss_reduction="sum")``: a loss returning ``(sum, weight)`` (padding masked)
    makes a workload whose update, over an uneven split (3 + 3 + 1), equals one SGD step on the whole batch's
    weighted mean, computed here by hand (atol 1e-6, float32)."""
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    k1, k2 = jax.random.split(jax.random.key(3))
    batch = {
        "x": jax.random.normal(k1, (7, 4)), "y": jax.random.normal(k2, (7, 1)),
        "mask": jnp.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
    }  # fmt: skip

    def token_loss(m: nnx.Linear, b: Any) -> tuple[jax.Array, jax.Array]:
        per_row = ((m(b["x"]) - b["y"]) ** 2)[:, 0] * b["mask"]
        return jnp.sum(per_row), jnp.sum(b["mask"])

    w = autoaccum.nnx.workload(token_loss, model, optimizer, batch, loss_reduction="sum", memory_limit="64MiB")
    assert (w.loss_reduction, w.has_aux, w.memory_limit) == ("sum", False, "64MiB")
    update = autoaccum.build_update(
        w.loss_fn, w.optimizer, microbatch_size=3, has_state=True, loss_reduction=w.loss_reduction
    )
    params, _, loss, _ = update(jax.tree.map(jnp.copy, w.params), update.init(w.params), w.batch, w.state)

    kernel, bias = np.asarray(model.kernel[...], np.float64), np.asarray(model.bias[...], np.float64)
    x, y, mask = (np.asarray(batch[k], np.float64) for k in ("x", "y", "mask"))
    residual = (x @ kernel + bias - y)[:, 0] * mask
    tokens = mask.sum()
    grad_kernel = 2 * x.T @ residual[:, None] / tokens
    grad_bias = 2 * residual.sum(keepdims=True) / tokens
    np.testing.assert_allclose(float(loss), (residual**2).sum() / tokens, atol=1e-6)
    np.testing.assert_allclose(params["kernel"], kernel - 0.5 * grad_kernel, atol=1e-6)
    np.testing.assert_allclose(params["bias"], bias - 0.5 * grad_bias, atol=1e-6)


def test_the_step_donates_the_models_arrays_unless_told_not_to() -> None:
    """docs/guides/nnx.md: a clone sharing the model's arrays loses them to the step; with donate=False it keeps
    them, and the step moves the model all the same."""
    x = {"x": jnp.ones((4, 4))}
    for donate in (True, False):
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
        teacher, before, snapshot = nnx.clone(model), np.array(model.kernel[...]), nnx.clone(optimizer)
        step = autoaccum.nnx.build_update(lambda m, b: jnp.mean(m(b["x"]) ** 2), microbatch_size=2, donate=donate)
        step(model, optimizer, x)
        assert not np.allclose(model.kernel[...], before)
        if donate:
            with pytest.raises(RuntimeError, match="deleted"):
                teacher(jnp.ones((1, 4)))
        else:  # the optimizer's copies too (its step was donated all the same)
            np.testing.assert_array_equal(teacher.kernel[...], before)
            assert int(snapshot.step[...]) == 0 and int(optimizer.step[...]) == 1


def test_an_optimizer_of_another_model_is_refused_before_anything_is_donated() -> None:
    """An nnx.Optimizer made for another model: named before the step runs, the model left whole (a pytree error
    came after the model's arrays were donated, and they were lost). One step reused with an optimizer of another
    ``wrt`` over the same optax transformation (train the head, then everything) steps it (it blamed loss_fn)."""
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 1, rngs=nnx.Rngs(1)))
    other = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    step = autoaccum.nnx.build_update(lambda m, b: jnp.mean(m(b) ** 2), microbatch_size=4)
    with pytest.raises(ValueError, match=r"`optimizer`'s state is not .* nnx\.Optimizer\(model, tx, wrt=\.\.\.\)"):
        step(model, nnx.Optimizer(other, optax.adam(1e-2), wrt=nnx.Param), jnp.ones((8, 3)))
    assert model.layers[0].kernel[...].shape == (3, 4)  # not deleted
    tx = optax.sgd(0.1)
    head = nnx.All(nnx.Param, nnx.PathContains(1))
    first = np.array(model.layers[0].kernel[...])
    step(model, nnx.Optimizer(model, tx, wrt=head), jnp.ones((8, 3)))
    np.testing.assert_array_equal(model.layers[0].kernel[...], first)  # (frozen)
    step(model, nnx.Optimizer(model, tx, wrt=nnx.Param), jnp.ones((8, 3)))
    assert not np.allclose(model.layers[0].kernel[...], first)


def test_a_wrt_that_selects_nothing_is_named() -> None:
    """It was told that `params` had no arrays and was pointed at `update.init` (a new user's report)."""
    model, _ = make()
    with pytest.raises(ValueError, match=r"`wrt`=.*Cache.* selects no variable of the model, which holds .*Param"):
        autoaccum.nnx.value_and_grad(loss_fn, microbatch_size=4, wrt=nnx.Cache)(model, batches()[0])
    empty = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Cache)
    with pytest.raises(ValueError, match=r"the optimizer's `wrt`=.*Cache.* selects no variable"):
        autoaccum.nnx.build_update(loss_fn, microbatch_size=4)(model, empty, batches()[0])


def test_a_failed_stream_leaves_the_model_usable() -> None:
    """A loader that raised mid-stream left the model's BatchNorm statistics deleted: the model could not run
    again (a new user's report)."""
    model, optimizer = make()
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=4)

    def loader_that_fails() -> Any:
        yield batches()[0]
        raise RuntimeError("the loader died")

    with pytest.raises(RuntimeError, match="the loader died"):
        step.stream(model, optimizer, loader_that_fails())
    model(batches()[0]["x"])
    before = np.array(model.hidden.kernel[...])
    step.stream(model, optimizer, batches())
    assert int(optimizer.step[...]) == 1
    assert not np.allclose(model.hidden.kernel[...], before)
