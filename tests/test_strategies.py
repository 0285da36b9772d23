"""Conformance suite: every registered strategy must equal one full-batch optimizer step.

References are computed without accumulation: ``jax.grad(loss_fn)(params, batch)`` on the whole batch, then
one optimizer step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, copy, count_backend_compiles, full_batch_step

import autoaccum
from autoaccum import strategies, workloads


def test_registry() -> None:
    assert strategies.available()[0] == "scan"
    assert {"scan", "loop", "multisteps"} <= set(strategies.available())
    for name in strategies.available():
        assert strategies.get(name).name == name


def test_gradients_one_to_four_average_exactly(strategy: str) -> None:
    # loss = mean(w * x): the gradient of example i is x_i, so four microbatches of one give 1, 2, 3, 4.
    loss_fn = lambda w, b: jnp.mean(w * b)  # noqa: E731
    update = autoaccum.build_update(loss_fn, optax.sgd(1.0), microbatch_size=1, strategy=strategy)
    params, _, loss = update(jnp.zeros(()), update.init(jnp.zeros(())), jnp.arange(1.0, 5.0))
    assert float(params) == -2.5
    assert float(loss) == 0.0


@pytest.mark.parametrize("microbatch_size", [1, 5, 7, 64], ids=lambda m: f"m={m}")
@pytest.mark.parametrize(
    ("optimizer", "params_atol"),
    [
        (optax.sgd(0.1), 1e-6),
        # AdamW's first step is lr * g / (|g| + eps): where |g| is near eps it amplifies float32 rounding of
        # g, so params get 1% of one lr step; the gradient itself is checked through mu = (1 - b1) g at 1e-6.
        (optax.adamw(1e-3, weight_decay=1e-2), 1e-5),
    ],
    ids=["sgd", "adamw"],
)
def test_equals_full_batch_step(strategy: str, microbatch_size: int, optimizer: Any, params_atol: float) -> None:
    w = workloads.mlp(batch_size=20)
    expected, expected_state, expected_loss = full_batch_step(
        w.loss_fn, optimizer, w.params, optimizer.init(w.params), w.batch
    )
    update = autoaccum.build_update(w.loss_fn, optimizer, microbatch_size=microbatch_size, strategy=strategy)
    params, opt_state, loss = update(copy(w.params), update.init(w.params), w.batch)
    assert_trees_close(params, expected, atol=params_atol)
    assert_trees_close(opt_state, expected_state, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)


def test_piecewise_schedule_over_two_calls(strategy: str) -> None:
    # As in the optax tutorial: 3 microbatches of 3 out of 9 examples equal one step on all 9 (atol 1e-7);
    # the schedule advances once per call, so the second call uses the second learning rate.
    # Small steps keep params well below 1, where float32 resolves 1e-7 (as in the tutorial).
    schedule = optax.piecewise_constant_schedule(0.01, {1: 0.1})
    optimizer = optax.sgd(schedule)
    w = workloads.linear(batch_size=18, features=8)
    first = jax.tree.map(lambda x: x[:9], w.batch)
    second = jax.tree.map(lambda x: x[9:], w.batch)
    expected, state, _ = full_batch_step(w.loss_fn, optimizer, w.params, optimizer.init(w.params), first)
    expected, state, expected_loss = full_batch_step(w.loss_fn, optimizer, expected, state, second)

    update = autoaccum.build_update(w.loss_fn, optimizer, microbatch_size=3, strategy=strategy)
    params, opt_state = copy(w.params), update.init(w.params)
    params, opt_state, _ = update(params, opt_state, first)
    params, opt_state, loss = update(params, opt_state, second)
    assert_trees_close(params, expected, atol=1e-7)
    assert_trees_close(opt_state, state, atol=1e-7)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-7)


def test_has_aux_is_example_weighted_mean(strategy: str) -> None:
    w = workloads.linear(batch_size=10, features=8)

    def loss_fn(params: Any, batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        pred = batch["x"] @ params["w"] + params["b"]
        return jnp.mean((pred - batch["y"]) ** 2), {"mean_pred": pred.mean(), "max_y": batch["y"].max()}

    optimizer = optax.sgd(0.1)
    (expected_loss, expected_aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(w.params, w.batch)
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=4, strategy=strategy, has_aux=True)
    params, _, (loss, aux) = update(copy(w.params), update.init(w.params), w.batch)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)
    np.testing.assert_allclose(aux["mean_pred"], expected_aux["mean_pred"], atol=1e-6)
    # A non-additive aux leaf is still averaged with example weights (4/10, 4/10, 2/10): documented behaviour.
    ys = np.asarray(w.batch["y"])
    weighted_max = 0.4 * ys[:4].max() + 0.4 * ys[4:8].max() + 0.2 * ys[8:].max()
    np.testing.assert_allclose(aux["max_y"], weighted_max, atol=1e-6)
    assert_trees_close(params, jax.tree.map(lambda p, g: p - 0.1 * g, w.params, grads), atol=1e-6)


def bf16_step_error(strategy: str, accumulator_dtype: Any) -> float:
    """Max |error| of one SGD(lr=1) step from zero on a bf16 model, 64 microbatches of 1."""
    key_x, key_y = jax.random.split(jax.random.key(1))
    batch = {"x": jax.random.normal(key_x, (64, 16)), "y": jax.random.normal(key_y, (64,))}
    bf16_batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), batch)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return jnp.mean((batch["x"] @ params + 1.0 - batch["y"]) ** 2)

    reference = -jax.grad(loss_fn)(
        jnp.zeros(16, jnp.float32), jax.tree.map(lambda x: x.astype(jnp.float32), bf16_batch)
    )
    update = autoaccum.build_update(
        loss_fn, optax.sgd(1.0), microbatch_size=1, strategy=strategy, accumulator_dtype=accumulator_dtype
    )
    params0 = jnp.zeros(16, jnp.bfloat16)
    params, _, loss = update(params0, update.init(params0), bf16_batch)
    assert params.dtype == jnp.bfloat16
    assert loss.dtype == jnp.bfloat16
    return float(jnp.max(jnp.abs(params.astype(jnp.float32) - reference)))


def test_bf16_model_accumulates_in_float32(strategy: str) -> None:
    error_f32 = bf16_step_error(strategy, jnp.float32)
    # bf16 keeps 8 significant bits: each microbatch gradient and the final cast round at ~2**-8 relative.
    assert error_f32 <= 2e-2, error_f32
    # The same step accumulated in bf16 is measurably worse, so the float32 accumulator is doing its job.
    assert bf16_step_error(strategy, jnp.bfloat16) > 2 * error_f32


def test_bf16_parameters_step_like_one_full_batch_step(strategy: str) -> None:
    """A bfloat16 model under Adam: one microbatch equals the jitted full-batch step (the gradient handed to the
    optimizer cast like the parameters, by every strategy); 4 + 4 + 2 microbatches stay within a few bfloat16
    roundings of it, and the loss, summed in float32 even with a bfloat16 accumulator, within float32's."""
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w1": (0.3 * jax.random.normal(keys[0], (8, 16))).astype(jnp.bfloat16),
              "w2": (0.3 * jax.random.normal(keys[1], (16,))).astype(jnp.bfloat16)}  # fmt: skip
    batch = {"x": jax.random.normal(keys[2], (10, 8)), "y": jax.random.normal(keys[3], (10,))}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        h = jax.nn.relu(b["x"].astype(jnp.bfloat16) @ p["w1"])
        return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - b["y"]) ** 2)

    tx = optax.adam(1e-2)
    expected = jax.jit(lambda p, s, b: full_batch_step(loss_fn, tx, p, s, b))(params, tx.init(params), batch)
    for microbatch_size, atol in ((10, 0.0), (4, 2e-2)):
        for accumulator_dtype in (jnp.float32, jnp.bfloat16):
            update = autoaccum.build_update(
                loss_fn, tx, microbatch_size=microbatch_size, strategy=strategy, accumulator_dtype=accumulator_dtype
            )
            new_params, opt_state, loss = update(copy(params), tx.init(params), batch)
            assert_trees_close((new_params, opt_state), expected[:2], atol=atol)
            np.testing.assert_allclose(float(loss), float(expected[2]), rtol=1e-6)


def test_complex_parameters_keep_their_imaginary_gradient(strategy: str) -> None:
    """Complex parameters accumulate their gradient in the complex counterpart of the accumulator's dtype: the
    imaginary part is kept, for every strategy and for the transform (a real accumulator dropped it)."""
    w = jnp.array([0.5 + 0.3j, -0.2 + 0.1j, 0.1 - 0.4j], jnp.complex64)
    x = jnp.arange(30.0).reshape(10, 3) / 10

    def loss_fn(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.abs(x @ w - 1j) ** 2)

    tx = optax.sgd(0.1)
    expected = full_batch_step(loss_fn, tx, w, tx.init(w), x)
    assert float(jnp.max(jnp.abs(expected[0].imag - w.imag))) > 0.1  # (the step moves the imaginary parts)
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=4, strategy=strategy)
    if strategy == "multisteps":  # optax.MultiSteps accumulates in one real dtype: refused, by name
        with pytest.raises(TypeError, match=r"`params` leaf <root> is complex64: strategy 'multisteps'.*'scan'"):
            update(copy(w), tx.init(w), x)
        return
    got = update(copy(w), tx.init(w), x)
    assert got[0].dtype == jnp.complex64
    assert_trees_close(got, expected, atol=1e-5)
    if strategy == "scan":  # the transform: scan's accumulation, in the caller's step
        value, grad = autoaccum.value_and_grad(loss_fn, microbatch_size=4)(w, x)
        ref_value, ref_grad = jax.value_and_grad(loss_fn)(w, x)
        np.testing.assert_allclose(grad, ref_grad, atol=1e-5)
        np.testing.assert_allclose(value, ref_value, atol=1e-5)


def test_tied_weights_are_named_before_a_donating_call_and_step_with_donate_false(strategy: str) -> None:
    """One array twice in ``params`` (tied weights) cannot be donated twice: the call names both leaves and the fix
    before anything runs (XLA's runtime error named neither), leaves the array usable, and ``donate=False`` steps
    like the full batch."""
    w = jnp.arange(3.0) / 10
    params = {"enc": w, "dec": w}
    batch = {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.zeros(8)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ (p["enc"] + 2 * p["dec"]) - b["y"]) ** 2)

    tx = optax.sgd(0.1)
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=3, strategy=strategy)
    with pytest.raises(
        ValueError, match=r"`params` leaf \['enc'\] is the same array as `params` leaf \['dec'\].*donate=False"
    ):
        update(params, update.init(params), batch)
    assert not w.is_deleted()
    lbfgs = autoaccum.build_update(loss_fn, optax.lbfgs(), microbatch_size=3, strategy=strategy)
    leaves = jax.tree.leaves(lbfgs.init({"w": w}))  # (optax puts one zero array in two of its fields)
    assert len({id(x) for x in leaves}) == len(leaves)
    kept = autoaccum.build_update(loss_fn, tx, microbatch_size=3, strategy=strategy, donate=False)
    expected = full_batch_step(loss_fn, tx, copy(params), tx.init(params), batch)
    assert_trees_close(kept(params, kept.init(params), batch), expected, atol=1e-6)


@pytest.mark.parametrize("batch_size", [16, 18], ids=["even", "uneven"])
def test_second_call_does_not_retrace(strategy: str, batch_size: int) -> None:
    traces = []
    w = workloads.linear(batch_size=batch_size, features=8)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        traces.append(jax.tree.map(jnp.shape, batch))
        return w.loss_fn(params, batch)

    update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=4, strategy=strategy)
    params, opt_state = copy(w.params), update.init(w.params)
    params, opt_state, _ = update(params, opt_state, w.batch)
    after_first = len(traces)
    assert after_first > 0
    for _ in range(2):
        params, opt_state, _ = update(params, opt_state, w.batch)
    assert len(traces) == after_first


def test_arguments_are_checked_once_per_signature_and_again_when_it_changes(
    strategy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A training loop's later calls skip the host-side checks (a fifth of the example mlp's 0.45 ms step);
    # a call whose structure, shapes, dtypes or shardings differ is checked again, with the same clear errors.
    checks = []
    real = strategies._strategy.check_params
    monkeypatch.setattr(strategies._strategy, "check_params", lambda p: (checks.append(1), real(p))[1])
    w, update = linear_update(strategy=strategy)
    params, opt_state = copy(w.params), update.init(w.params)
    for _ in range(3):
        params, opt_state, _ = update(params, opt_state, w.batch)
    assert len(checks) == 1
    params, opt_state, _ = update(params, opt_state, jax.tree.map(lambda x: x[:6], w.batch))  # new shapes
    assert len(checks) == 2
    with pytest.raises(TypeError, match=r"`params` leaf \['w'\] has dtype int32"):
        update({**params, "w": params["w"].astype(jnp.int32)}, opt_state, w.batch)
    with pytest.raises(ValueError, match=r"size 5: \['y'\]; size 8: \['x'\]"):
        update(params, opt_state, {"x": w.batch["x"], "y": w.batch["y"][:5]})


@pytest.mark.slow
def test_what_a_strategy_remembers_per_signature_is_bounded() -> None:
    # A loop over ever-new shapes (a data pipeline without padding) keeps at most MAX_SIGNATURES of each.
    w, update = linear_update(strategy="loop")
    strategy = update.accumulation
    for rows in range(1, strategies._strategy.MAX_SIGNATURES + 6):
        batch = jax.tree.map(lambda x, n=rows: jnp.resize(x, (n, *x.shape[1:])), w.batch)
        strategy.checked(w.params, batch)
        strategy.out_dtypes(w.params, batch)
    limit = strategies._strategy.MAX_SIGNATURES
    assert 0 < len(strategy._calls) <= limit and 0 < len(strategy._dtypes) <= limit


def test_signature_tells_apart_what_the_checks_depend_on() -> None:
    x = jnp.ones((4, 3))
    same = strategies.signature({"x": x}, ())
    assert strategies.signature({"x": jnp.zeros((4, 3))}, ()) == same
    assert strategies.signature({"x": x[:2]}, ()) != same  # shape
    assert strategies.signature({"x": x.astype(jnp.bfloat16)}, ()) != same  # dtype
    assert strategies.signature({"y": x}, ()) != same  # structure
    assert strategies.signature({"x": np.ones((4, 3), np.float32)}, ()) != same  # a host array: no sharding
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert strategies.signature({"x": sharded}, ()) != same  # sharding


def test_donate_false_leaves_inputs_usable(strategy: str) -> None:
    w = workloads.linear(batch_size=8, features=4)
    update = autoaccum.build_update(w.loss_fn, optax.sgd(0.1), microbatch_size=3, strategy=strategy, donate=False)
    params = copy(w.params)
    before = jax.tree.map(np.asarray, params)
    update(params, update.init(params), w.batch)
    assert_trees_close(params, before, atol=0)  # still readable and unchanged


def test_batch_is_never_donated(strategy: str) -> None:
    w = workloads.linear(batch_size=8, features=4)
    batch = copy(w.batch)
    update = autoaccum.build_update(w.loss_fn, optax.sgd(0.1), microbatch_size=3, strategy=strategy)
    update(copy(w.params), update.init(w.params), batch)
    assert_trees_close(batch, w.batch, atol=0)


def test_programs_compile_without_running(strategy: str) -> None:
    w = workloads.linear(batch_size=10, features=4)
    update = autoaccum.build_update(w.loss_fn, optax.sgd(0.1), microbatch_size=4, strategy=strategy)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), w.params)
    opt_state = jax.eval_shape(update.init, params)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), w.batch)
    programs = update.programs(params, opt_state, batch)
    assert programs
    for program in programs:
        assert program.lowered.compile().memory_analysis() is not None


# ---- bad input: clear errors, before anything is compiled ----


def linear_update(**kwargs: Any) -> Any:
    w = workloads.linear(batch_size=8, features=4)
    return w, autoaccum.build_update(w.loss_fn, optax.sgd(0.1), **{"microbatch_size": 4, **kwargs})


@pytest.mark.parametrize("bad", [0, -3])
def test_microbatch_size_below_one(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"`microbatch_size` must be >= 1, got microbatch_size={bad}"):
        linear_update(microbatch_size=bad)


@pytest.mark.parametrize("bad", [2.5, "4", True, None])
def test_microbatch_size_not_an_int(bad: Any) -> None:
    with pytest.raises(TypeError, match=r"`microbatch_size` must be an int >= 1"):
        linear_update(microbatch_size=bad)


def test_unknown_strategy_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown `strategy` 'scna'; choose one of 'scan', 'loop', 'multisteps'"):
        linear_update(strategy="scna")


def test_unknown_strategy_option() -> None:
    with pytest.raises(ValueError, match=r"strategy 'loop' has no option\(s\) \['unroll'\]"):
        linear_update(strategy="loop", unroll=2)


@pytest.mark.parametrize("bad", [-1, 2.5, "8", None])
def test_a_bad_unroll_is_named(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"scan's option `unroll` must be an int >= 1 .*got unroll={bad!r}"):
        linear_update(strategy="scan", unroll=bad)


def test_bad_optimizer_and_dtype() -> None:
    with pytest.raises(TypeError, match=r"`optimizer` must be an optax\.GradientTransformation"):
        autoaccum.build_update(lambda p, b: 0.0, "adam", microbatch_size=2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`accumulator_dtype` must be a floating dtype"):
        linear_update(accumulator_dtype=jnp.int32)
    assert not jax.config.jax_enable_x64  # (64-bit types off, as by default: float64 would be float32)
    with pytest.raises(ValueError, match=r"`accumulator_dtype`='float64' is 64-bit, but JAX runs without"):
        linear_update(accumulator_dtype="float64")


@pytest.mark.parametrize("strategy", ["scan", "loop", "multisteps", "auto"])
def test_an_optimizer_state_or_optimizer_that_cannot_step_is_named(strategy: str) -> None:
    params, batch = {"w": jnp.ones(4)}, {"x": jnp.ones((6, 4))}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean(b["x"] @ p["w"])

    update = autoaccum.build_update(loss_fn, optax.adam(1e-3), microbatch_size=2, strategy=strategy)
    for wrong in (optax.sgd(0.1).init(params), update.init({"w": jnp.ones(3)}), None):
        with pytest.raises(TypeError, match=r"fails on these arguments .* `opt_state` must be .* update\.init"):
            update(params, wrong, batch)
    assert float(params["w"][0]) == 1.0  # not donated away by the refused call
    lookahead = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)  # wants params.fast's gradient
    synced = optax.LookaheadParams.init_synced(params)
    lookahead_loss = lambda p, b: loss_fn(p.fast, b)  # noqa: E731
    ahead = autoaccum.build_update(lookahead_loss, lookahead, microbatch_size=2, strategy=strategy, donate=False)
    with pytest.raises(TypeError, match=r"fails on a gradient shaped like the whole `params` .* though `opt_state` is "
                       r"its state .*params\.fast"):  # (optax's own words differ by release)  # fmt: skip
        ahead(synced, ahead.init(synced), batch)
    for wrong in (None, {}):  # (the optimizer step would blame `opt_state`)
        with pytest.raises(TypeError, match=r"`params` has no arrays to differentiate"):
            update(wrong, update.init(params), batch)
    lbfgs = autoaccum.build_update(loss_fn, optax.lbfgs(), microbatch_size=2, strategy=strategy)
    with pytest.raises(TypeError, match=r"`optimizer`\.update needs arguments besides .* 'value'"):
        lbfgs(params, lbfgs.init(params), batch)
    new_params, _, _ = update(params, update.init(params), batch)  # the right state steps
    assert new_params["w"].shape == (4,)
    with pytest.raises(ValueError, match=r"`accumulator_dtype`='float64' is 64-bit, but JAX runs without"):
        autoaccum.value_and_grad(lambda p, b: 0.0, microbatch_size=2, accumulator_dtype="float64")


def test_leaves_with_different_leading_sizes(strategy: str) -> None:
    w, update = linear_update(strategy=strategy)
    batch = {"x": w.batch["x"], "y": w.batch["y"][:5]}
    with pytest.raises(ValueError, match=r"size 5: \['y'\]; size 8: \['x'\]"):
        update(w.params, update.init(w.params), batch)


@pytest.mark.parametrize("batch", [{}, (), None], ids=["dict", "tuple", "none"])
def test_batch_with_no_leaves(strategy: str, batch: Any) -> None:
    w, update = linear_update(strategy=strategy)
    with pytest.raises(ValueError, match="`batch` has no array leaves"):
        update(w.params, update.init(w.params), batch)


def test_scalar_leaf_in_batch(strategy: str) -> None:
    w, update = linear_update(strategy=strategy)
    with pytest.raises(ValueError, match=r"`batch` leaf \['t'\] is a scalar"):
        update(w.params, update.init(w.params), {**w.batch, "t": jnp.ones(())})


def test_loss_that_is_not_a_scalar(strategy: str) -> None:
    update = autoaccum.build_update(lambda w, b: b @ w, optax.sgd(0.1), microbatch_size=2, strategy=strategy)
    with pytest.raises(ValueError, match=r"must return a scalar .* returned shape \(2,\) on a microbatch of 2 "):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))


def test_has_aux_mismatch(strategy: str) -> None:
    with_aux = lambda w, b: (jnp.mean(b @ w), {"n": 1.0})  # noqa: E731
    update = autoaccum.build_update(with_aux, optax.sgd(0.1), microbatch_size=2, strategy=strategy)
    with pytest.raises(TypeError, match="returned a tuple of 2 but has_aux=False"):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))
    without = lambda w, b: jnp.mean(b @ w)  # noqa: E731
    update = autoaccum.build_update(without, optax.sgd(0.1), microbatch_size=2, strategy=strategy, has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"has_aux=True but `loss_fn` returned an array of shape \(\) and dtype float32, not a \(loss, aux\) pair",
    ):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))


def test_a_loss_sum_and_weight_pair_is_pointed_at_loss_reduction_sum(strategy: str) -> None:
    # The pair (loss_sum, weight) without loss_reduction="sum": has_aux=True alone would train on the sum.
    pair = lambda w, b: (jnp.sum(b @ w), jnp.asarray(b.shape[0], jnp.float32))  # noqa: E731
    update = autoaccum.build_update(pair, optax.sgd(0.1), microbatch_size=2, strategy=strategy)
    with pytest.raises(TypeError, match=r'returned a tuple of 2 but has_aux=False.*pass loss_reduction="sum"'):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))
    with_aux = lambda w, b: (pair(w, b), {"n": 1.0})  # noqa: E731
    update = autoaccum.build_update(with_aux, optax.sgd(0.1), microbatch_size=2, strategy=strategy, has_aux=True)
    with pytest.raises(TypeError, match=r'where the scalar mean loss belongs.*pass loss_reduction="sum"'):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))


def test_a_token_weighted_loss_with_aux_but_no_has_aux_names_has_aux(strategy: str) -> None:
    """``((loss_sum, weight), aux)`` with loss_reduction="sum" and no has_aux: JAX's own error on the aux dict named
    neither argument (a new user's report); a weight that is no scalar is named too."""
    pair = lambda w, b: (jnp.sum(b @ w), jnp.asarray(b.shape[0], jnp.float32))  # noqa: E731
    with_aux = lambda w, b: (pair(w, b), {"n": 1.0})  # noqa: E731
    update = autoaccum.build_update(
        with_aux, optax.sgd(0.1), microbatch_size=2, strategy=strategy, loss_reduction="sum"
    )
    with pytest.raises(TypeError, match=r"\(\(loss_sum, weight\), aux\).*pass has_aux=True"):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))
    named = lambda w, b: (jnp.sum(b @ w), {"tokens": 4.0})  # noqa: E731
    update = autoaccum.build_update(named, optax.sgd(0.1), microbatch_size=2, strategy=strategy, loss_reduction="sum")
    with pytest.raises(TypeError, match=r"weight `loss_fn` returns must be a real scalar .* got dict"):
        update(jnp.ones(3), update.init(jnp.ones(3)), jnp.ones((4, 3)))


PER_EXAMPLE = {  # an aux leaf whose shape follows the examples, and its shape at 4 examples
    "rows": (lambda pred: pred, r"\(4,\)"),
    "stacked": (lambda pred: jnp.stack([pred, 2 * pred]), r"\(2, 4\)"),  # the examples second
    "flattened": (lambda pred: jnp.concatenate([pred, pred]), r"\(8,\)"),
    "per-pair": (lambda pred: pred[0::2] - pred[1::2], r"\(2,\)"),  # (shorter than the examples: missed)
}


@pytest.mark.parametrize("leaf", list(PER_EXAMPLE))
@pytest.mark.parametrize("batch_size", [8, 10], ids=["even", "uneven"])
def test_a_per_example_aux_leaf_is_refused_before_compiling(strategy: str, batch_size: int, leaf: str) -> None:
    # Averaged silently on an even split, a broadcasting error on an uneven one: refused, naming the leaf.
    make, shape = PER_EXAMPLE[leaf]

    def per_example_aux_loss(w: jax.Array, b: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        pred = b @ w
        return jnp.mean(pred**2), {"logits": make(pred), "mean_pred": jnp.mean(pred)}

    update = autoaccum.build_update(
        per_example_aux_loss, optax.sgd(0.1), microbatch_size=4, strategy=strategy, has_aux=True
    )
    batch = jnp.ones((batch_size, 3))
    refused = rf"aux leaf \['logits'\] changes shape with the number of examples \(shape {shape} for 4 examples"
    params = jnp.ones(3)
    opt_state = update.init(params)  # (outside the count: the optimizer's init compiles on a process's first call)
    with count_backend_compiles() as compiles, pytest.raises(ValueError, match=refused) as caught:
        update(params, opt_state, batch)
    assert compiles == []
    assert "autoaccum.value_and_grad, which returns per-example aux" in str(caught.value)  # the way that keeps them
    with pytest.raises(ValueError, match=refused):
        update.stream(jnp.ones(3), update.init(jnp.ones(3)), [batch[:4], batch[4:]])


def test_an_aux_leaf_as_long_as_the_microbatch_by_chance_is_averaged(strategy: str) -> None:
    # A per-class share over 4 classes, at microbatches of 4: its length does not follow the examples, so it is
    # kept and averaged with example weights (4/10, 4/10, 2/10): the full batch's share (atol 1e-6).
    labels = jnp.array([0, 1, 1, 2, 3, 3, 3, 0, 2, 1])

    def loss_fn(w: jax.Array, b: Any) -> tuple[jax.Array, jax.Array]:
        return jnp.mean((b["x"] @ w) ** 2), jnp.mean(jax.nn.one_hot(b["label"], 4), axis=0)

    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=4, strategy=strategy, has_aux=True)
    batch = {"x": jnp.ones((10, 3)), "label": labels}
    _, _, (_, share) = update(jnp.ones(3), update.init(jnp.ones(3)), batch)
    np.testing.assert_allclose(share, np.bincount(np.asarray(labels), minlength=4) / 10, atol=1e-6)


def test_bad_loss_is_reported_before_compiling(strategy: str) -> None:
    params, batch = jnp.ones(3), jnp.ones((4, 3))
    with count_backend_compiles() as compiles:  # the check can fail: a good loss compiles here
        good = autoaccum.build_update(
            lambda w, b: jnp.mean(b @ w), optax.sgd(0.1), microbatch_size=2, strategy=strategy
        )
        jax.block_until_ready(good(copy(params), good.init(params), batch))
    assert compiles
    update = autoaccum.build_update(lambda w, b: b @ w, optax.sgd(0.1), microbatch_size=2, strategy=strategy)
    opt_state = update.init(params)
    with count_backend_compiles() as compiles, pytest.raises(ValueError, match="must return a scalar"):
        update(params, opt_state, batch)
    assert compiles == []


def test_every_strategy_keeps_the_optimizers_own_state(strategy: str) -> None:
    """A checkpoint saved under one plan restores under another: the state is ``optimizer.init``'s, whatever
    the strategy, and a state made by one strategy's update feeds another's."""
    optimizer = optax.adamw(1e-2)
    params = {"w": jnp.ones(3), "b": jnp.zeros(())}
    loss_fn = lambda p, b: jnp.mean((b @ p["w"] + p["b"]) ** 2)  # noqa: E731
    batch = jnp.arange(12.0).reshape(4, 3) / 10
    reference = optimizer.init(params)
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=3, strategy=strategy, donate=False)
    assert jax.tree.structure(update.init(params)) == jax.tree.structure(reference)
    scan = autoaccum.build_update(loss_fn, optimizer, microbatch_size=3, strategy="scan", donate=False)
    p1, s1, _ = scan(params, reference, batch)
    p2, s2, _ = update(p1, s1, batch)  # a "restored" scan state into this strategy
    assert jax.tree.structure(s2) == jax.tree.structure(reference)
    q1, t1, _ = scan(params, reference, batch)
    q2, t2, _ = scan(q1, t1, batch)
    assert_trees_close(p2, q2, atol=1e-6)
    assert_trees_close(s2, t2, atol=1e-6)


# ---- the default: `auto` ----


def conv_loss(kernel: jax.Array, batch: jax.Array) -> jax.Array:
    dims = ("NHWC", "HWIO", "NHWC")
    return jnp.mean(jax.lax.conv_general_dilated(batch, kernel, (1, 1), "SAME", dimension_numbers=dims) ** 2)


@pytest.mark.slow
def test_auto_is_the_default_and_runs_loop_for_a_convolution_on_the_cpu() -> None:
    # XLA:CPU runs the gradient's convolutions in a loop body on its naive path (about 10x slower), so the
    # default runs a convnet from a host loop; a loss without convolutions runs as one scan.
    for w, expected in ((workloads.cnn(batch_size=10), "loop"), (workloads.mlp(batch_size=10), "scan")):
        update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=4)
        assert update.strategy == "auto"
        assert update.accumulation.choose(w.params, w.batch).name == expected
        expected_params, expected_state, expected_loss = full_batch_step(
            w.loss_fn, w.optimizer, w.params, w.optimizer.init(w.params), w.batch
        )
        params, opt_state, loss = update(copy(w.params), update.init(w.params), w.batch)  # 4 + 4 + 2
        assert_trees_close(params, expected_params, atol=1e-5)
        assert_trees_close(opt_state, expected_state, atol=1e-6)
        np.testing.assert_allclose(loss, expected_loss, atol=1e-6)


def test_auto_passes_scans_options_and_finds_nested_convolutions() -> None:
    update = autoaccum.build_update(conv_loss, optax.sgd(0.1), microbatch_size=2, unroll=2)
    assert update.options == {"unroll": 2}
    kernel, batch = jnp.ones((3, 3, 1, 2)), jnp.ones((4, 5, 5, 1))
    nested = jax.make_jaxpr(jax.jit(jax.checkpoint(jax.grad(conv_loss))))(kernel, batch)
    assert strategies.has_convolution(nested.jaxpr)
    assert not strategies.has_convolution(jax.make_jaxpr(lambda x: jnp.sum(x**2))(batch).jaxpr)
    # loop's programs: zero sums, every microbatch but the last (one program), the last with the optimizer step:
    # two compute gradients, whatever the number of microbatches (2 and 3 here)
    for rows in (4, 6):
        programs = update.programs(kernel, update.init(kernel), jnp.ones((rows, 5, 5, 1)))
        assert ["convolution" in p.lowered.as_text() for p in programs] == [False, True, True], rows


@pytest.mark.parametrize(("rows", "loops"), [(8, False), (32, True)])
def test_scan_unrolled_8_times_leaves_no_loop_at_up_to_8_steps(rows: int, loops: bool) -> None:
    # What the tuner's `scan:unroll=8` is for: with no loop left, XLA:CPU gives a convolution its fast kernel.
    update = autoaccum.build_update(conv_loss, optax.sgd(0.1), microbatch_size=1, strategy="scan", unroll=8)
    kernel, batch = jnp.ones((3, 3, 1, 2)), jnp.ones((rows, 5, 5, 1))
    (program,) = update.programs(kernel, update.init(kernel), batch)
    assert ("while" in program.lowered.compile().as_text()) == loops
    expected, _, _ = full_batch_step(conv_loss, optax.sgd(0.1), kernel, optax.sgd(0.1).init(kernel), batch)
    assert_trees_close(update(jnp.ones((3, 3, 1, 2)), update.init(kernel), batch)[0], expected, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])  # (21 s)
def test_scan_compiles_no_more_fusions_than_optax_microbatching(name: str) -> None:
    # The accumulated gradient is scaled once, by a multiply that XLA folds into the optimizer's own fusions: a
    # divide per element (or a scaling per microbatch) was a pass of its own over every gradient (mlp 64 fusions
    # against optax.microbatching's 60, the transformer 256 against 235).
    w = workloads.mlp(batch_size=32) if name == "mlp" else workloads.transformer(batch_size=8, seq_len=8, layers=1)
    m = jax.tree.leaves(w.batch)[0].shape[0] // 4
    value_and_grad = optax.microbatching.microbatch(
        jax.value_and_grad(w.loss_fn),
        argnums=1,
        microbatch_size=m,
        accumulator=optax.microbatching.AccumulationType.MEAN,
    )

    @jax.jit
    def theirs(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = w.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=m, strategy="scan")
    (program,) = update.programs(w.params, update.init(w.params), w.batch)
    expected = theirs.lower(w.params, w.optimizer.init(w.params), w.batch).compile().as_text().count(" fusion(")
    assert program.lowered.compile().as_text().count(" fusion(") <= expected


def test_an_update_on_a_partial_sum_that_is_not_finite_never_reaches_the_parameters(strategy: str) -> None:
    """optax.MultiSteps runs the optimizer on every partial sum and multiplies the updates it drops by 0, which
    keeps a NaN: prodigy on a first microbatch whose gradient is 0 gave NaN parameters, and so did k times a float16
    token sum (overflowing float16 before the last microbatch divides it)."""
    loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    batch = {"x": jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]), "y": jnp.array([1.0, 1.0, 5.0, 0.0])}
    w, prodigy = jnp.ones(2), optax.contrib.prodigy()  # rows 0-1 fitted exactly at w: a zero first gradient
    updates, _ = prodigy.update(jax.grad(loss_fn)(w, batch), prodigy.init(w), w)
    want = optax.apply_updates(w, updates)
    update = autoaccum.build_update(loss_fn, prodigy, microbatch_size=2, strategy=strategy)
    np.testing.assert_allclose(update(w, update.init(w), batch)[0], want, atol=1e-6)

    def token_sum(p: Any, b: Any) -> tuple[jax.Array, jax.Array]:  # per token in float32, summed over tokens
        error = (b["x"] @ p["w"] + p["b"][0]).astype(jnp.float32) - b["y"]  # (a 0-d `0 * inf` is 0, not NaN)
        return jnp.sum(error**2 * b["mask"]), jnp.sum(b["mask"])

    batch = {"x": jax.random.normal(jax.random.key(0), (16, 250, 2)).astype(jnp.float16),
             "y": jnp.full((16, 250), 10.0), "mask": jnp.ones((16, 250))}  # fmt: skip
    params = {"w": jnp.zeros(2, jnp.float16), "b": jnp.zeros(1, jnp.float16)}
    grads = jax.grad(lambda p: (lambda s, n: s / n)(*token_sum(p, batch)))(params)  # 4 x 1000 tokens: sums of 8e4
    want = optax.apply_updates(params, jax.tree.map(lambda g: -1e-2 * g, grads))
    update = autoaccum.build_update(token_sum, optax.sgd(1e-2), microbatch_size=4, strategy=strategy,
                                    loss_reduction="sum")  # fmt: skip
    got = update(params, update.init(params), batch)[0]
    assert_trees_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), got),
        jax.tree.map(lambda x: x.astype(jnp.float32), want),
        atol=5e-3,
    )


def test_a_microbatch_of_weight_zero_adds_no_aux(strategy: str) -> None:
    """An aux that is a ratio over the microbatch's tokens is 0/0 on an all-padding one: it weighs 0 (was NaN)."""

    def loss_fn(w: jax.Array, b: Any) -> tuple[tuple[jax.Array, jax.Array], Any]:
        error = (b["x"] @ w - b["y"]) ** 2 * b["mask"]
        return (jnp.sum(error), jnp.sum(b["mask"])), {"token_mse": jnp.sum(error) / jnp.sum(b["mask"])}

    x, mask = jnp.arange(12.0).reshape(6, 2) / 10, jnp.array([0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # microbatch 0: padding
    batch, w = {"x": x, "y": jnp.ones(6), "mask": mask}, jnp.ones(2)
    error = (x @ w - 1.0) ** 2 * mask
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=2, strategy=strategy,
                                    loss_reduction="sum", has_aux=True)  # fmt: skip
    (loss, aux) = update(w, update.init(w), batch)[2]
    np.testing.assert_allclose([loss, aux["token_mse"]], [error.sum() / 3] * 2, atol=1e-6)


def test_the_inputs_an_update_donates_are_named_when_reused_or_shared(strategy: str) -> None:
    w = jnp.ones(2)
    loss_fn = lambda w, b: jnp.mean((b @ w) ** 2)  # noqa: E731
    prodigy = autoaccum.build_update(loss_fn, optax.contrib.prodigy(), microbatch_size=2, strategy=strategy)
    prodigy(w, prodigy.init(w), jnp.ones((4, 2)))  # prodigy keeps the initial parameters: init copies them
    w = jnp.ones(2)
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=2, strategy=strategy)
    opt_state = update.init(w)
    update(w, opt_state, jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"`params` leaf <root> was donated to an earlier call .*donate=False"):
        update(w, opt_state, jnp.ones((4, 2)))  # (XLA's own "Buffer has been deleted or donated" before)
    zeros = jnp.zeros(())
    for state_update in ("per_microbatch", "once"):
        counting = autoaccum.build_update(lambda p, b, s: (loss_fn(p, b), s), optax.sgd(0.1), microbatch_size=2,
                                          strategy=strategy, has_state=True, state_update=state_update)  # fmt: skip
        w = jnp.ones(2)
        with pytest.raises(ValueError, match=r"`state` leaf \['sq'\] is the same array as .*copy one of them"):
            counting(w, counting.init(w), jnp.ones((4, 2)), {"mean": zeros, "sq": zeros})


def test_stream_names_a_microbatch_unlike_the_first(strategy: str) -> None:
    w = jnp.ones(2)
    update = autoaccum.build_update(lambda p, b: jnp.mean(b["x"] @ p), optax.sgd(0.1), microbatch_size=2,
                                    strategy=strategy)  # fmt: skip
    with pytest.raises(ValueError, match=r"microbatch 1 of `microbatches` is a .*unlike microbatch 0's"):
        update.stream(w, update.init(w), [{"x": jnp.ones((2, 2))}, {"z": jnp.ones((2, 2))}])


@pytest.mark.parametrize("state_update", ["per_microbatch", "once"])
def test_a_failed_stream_leaves_every_input_and_a_finished_one_donates_them(strategy: str, state_update: str) -> None:
    """A loader that raises, a malformed or an empty stream left the caller's state deleted (the first microbatch's
    program had taken it): nothing changed, yet it could not go on (a new user's report). A stream that finishes
    donates the inputs as a call does; a reused or shared input is named as a call names it."""

    def loss_fn(p: jax.Array, b: Any, s: Any) -> tuple[jax.Array, Any]:
        return jnp.mean((b @ p) ** 2), {"seen": s["seen"] + b.shape[0], "mean": s["mean"] * 0.9 + jnp.mean(b)}

    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=2, strategy=strategy, has_state=True,
                                    state_update=state_update)  # fmt: skip

    def inputs() -> tuple[Any, Any, Any]:
        w = jnp.ones(3)
        return w, update.init(w), {"seen": jnp.zeros((), jnp.int32), "mean": jnp.zeros(())}

    def loader_that_fails() -> Any:
        yield jnp.ones((2, 3))
        yield jnp.ones((2, 3))
        raise RuntimeError("the loader died")

    for stream, error in [
        (loader_that_fails(), RuntimeError),
        ([jnp.ones((2, 3)), jnp.ones((2, 4))], TypeError),  # (the loss's own error: a product of other shapes)
        ([], ValueError),
    ]:
        w, opt_state, state = inputs()
        with pytest.raises(error):
            update.stream(w, opt_state, stream, state)
        assert not any(x.is_deleted() for x in jax.tree.leaves((w, opt_state, state)))
        update.stream(w, opt_state, [jnp.ones((2, 3))], state)  # and it goes on with them
    w, opt_state, state = inputs()
    update.stream(w, opt_state, [jnp.ones((2, 3)), jnp.ones((1, 3))], state)
    assert all(x.is_deleted() for x in jax.tree.leaves((w, opt_state, state)))
    with pytest.raises(ValueError, match=r"`params` leaf <root> was donated to an earlier call .*donate=False"):
        update.stream(w, opt_state, [jnp.ones((2, 3))], state)  # (XLA's "Buffer has been deleted or donated")
    w, opt_state, state = inputs()
    with pytest.raises(ValueError, match=r"`state` leaf \['mean'\] is the same array as `params` leaf"):
        update.stream(w, opt_state, [jnp.ones((2, 3))], {"seen": state["seen"], "mean": w})


def test_stream_traces_the_loss_at_the_microbatches_own_size(strategy: str) -> None:
    """`microbatch_size` plays no part in a stream: a loss that takes examples in pairs streams microbatches of 4
    and 2 with microbatch_size=3 (it was traced at 3 rows first, and failed)."""

    def pairs(p: jax.Array, b: jax.Array) -> jax.Array:
        x = b.reshape(-1, 2, 3) @ p
        return jnp.mean((x[:, 0] - x[:, 1]) ** 2)

    w = jnp.arange(3.0)
    batch = jnp.arange(18.0).reshape(6, 3) % 5
    update = autoaccum.build_update(pairs, optax.sgd(0.1), microbatch_size=3, strategy=strategy, donate=False)
    got = update.stream(w, update.init(w), [batch[:4], batch[4:]])
    want_loss, grads = jax.value_and_grad(pairs)(w, batch)
    np.testing.assert_allclose(got[2], want_loss, atol=1e-5)
    np.testing.assert_allclose(got[0], w - 0.1 * grads, atol=1e-5)
