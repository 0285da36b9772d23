"""flax linen with batch_stats and dropout through `has_state`, against an explicit reference computed without it."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close

import autoaccum


class ConvNet(nn.Module):
    """A small ResNet-style stem: Conv, BatchNorm, ReLU, Dropout, pooled Dense head."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.3, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def xent(apply: Any, batch: Any) -> jax.Array:
    logits = apply(batch["image"], train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def data(seed: int, n: int = 10) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"image": jax.random.normal(k1, (n, 8, 8, 3)), "label": jax.random.randint(k2, (n,), 0, 10)}


@functools.partial(jax.jit, static_argnums=(0, 1, 6))  # one program, not op by op
def reference(model: nn.Module, tx: Any, params: Any, opt_state: Any, state: Any, batch: Any, m: int) -> tuple:
    """Without autoaccum: microbatches in order, batch_stats threaded, a fresh dropout key split per microbatch
    from the state's key (the documented pattern), (n_i / B) * grad_i summed, one optax step."""

    def pure(params: Any, micro: Any, state: Any) -> tuple[jax.Array, Any]:
        rng, dropout = jax.random.split(state["rng"])
        logits, new = model.apply(
            {"params": params, "batch_stats": state["batch_stats"]}, micro["image"], train=True,
            mutable=["batch_stats"], rngs={"dropout": dropout},
        )  # fmt: skip
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, micro["label"]).mean()
        return loss, {"batch_stats": new["batch_stats"], "rng": rng}

    total = batch["label"].shape[0]
    grads = jax.tree.map(jnp.zeros_like, params)
    grad_fn = jax.value_and_grad(pure, has_aux=True)
    for start in range(0, total, m):
        micro = jax.tree.map(lambda x: x[start : start + m], batch)  # noqa: B023
        n = micro["label"].shape[0]
        (_, state), g = grad_fn(params, micro, state)
        grads = jax.tree.map(lambda a, b: a + (n / total) * b, grads, g)  # noqa: B023
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, state


@pytest.mark.parametrize("strategy", ["scan", "loop", "multisteps"])
def test_linen_batch_stats_and_dropout_equal_the_reference_after_two_updates(strategy: str) -> None:
    model, tx = ConvNet(), optax.adam(1e-2)
    variables = model.init({"params": jax.random.key(0)}, data(0)["image"], train=False)
    loss_fn = autoaccum.linen.make_loss_fn(model, xent)
    update = autoaccum.build_update(loss_fn, tx, microbatch_size=4, strategy=strategy, has_state=True, donate=False)
    params, opt_state = variables["params"], tx.init(variables["params"])
    state = autoaccum.linen.init_state(variables, jax.random.key(1))
    ref = (params, opt_state, state)
    for seed in (1, 2):
        batch = data(seed)
        params, opt_state, _, state = update(params, opt_state, batch, state)
        ref = reference(model, tx, *ref, batch, 4)
    assert_trees_close(params, ref[0], atol=1e-6)  # float32, atol 1e-6
    assert_trees_close(opt_state, ref[1], atol=1e-6)
    assert_trees_close(state["batch_stats"], ref[2]["batch_stats"], atol=1e-6)
    assert (jax.random.key_data(state["rng"]) == jax.random.key_data(ref[2]["rng"])).all()
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), state["batch_stats"], variables["batch_stats"])
    assert max(jax.tree.leaves(moved)) > 1e-3  # the statistics really advanced (dropping them is the silent bug)


def test_init_state_names_a_missing_collection() -> None:
    with pytest.raises(ValueError, match=r"no collection\(s\) \['batch_stats'\]"):
        autoaccum.linen.init_state({"params": {}}, jax.random.key(0))


def test_make_loss_fn_and_init_state_name_a_bad_argument() -> None:
    model = ConvNet()
    variables = model.init(jax.random.key(0), data(0)["image"], train=False)
    cases = [
        (lambda: autoaccum.linen.make_loss_fn(variables, xent), r"`model` must be a flax linen nn.Module, got dict"),
        (lambda: autoaccum.linen.make_loss_fn(model, None), r"`criterion` must be callable, got NoneType"),
        (lambda: autoaccum.linen.make_loss_fn(model, lambda batch: 0.0), r"`criterion` must take 2 arguments"),
        # one string was taken letter by letter: collections 'b', 'a', ... (a KeyError at the first call)
        (lambda: autoaccum.linen.make_loss_fn(model, xent, mutable="batch_stats"), r"mutable='batch_stats'; e\.g\."),
        (lambda: autoaccum.linen.make_loss_fn(model, xent, rng_streams="dropout"), r"`rng_streams` must be a sequence"),
        (lambda: autoaccum.linen.init_state(variables, jax.random.key(1), mutable="batch_stats"), r"`mutable` must"),
    ]
    for make, message in cases:
        with pytest.raises(TypeError, match=message):
            make()


def test_loss_fn_without_has_state_is_told_to_pass_it() -> None:
    model, tx = ConvNet(), optax.sgd(0.1)
    variables = model.init({"params": jax.random.key(0)}, data(0)["image"], train=False)
    loss_fn = autoaccum.linen.make_loss_fn(model, xent)
    with pytest.raises(TypeError, match=r"takes and returns a model state .* but has_state=False; pass has_state=True"):
        autoaccum.build_update(loss_fn, tx, microbatch_size=4)  # refused when built: nothing has been traced
    with pytest.raises(TypeError, match=r"called without one: pass has_state=True"):
        loss_fn(variables["params"], data(0))  # as probe, estimate or tune call it without `state=`


def test_init_state_leaves_the_callers_variables_and_key_usable() -> None:
    # The update donates the state (the default): init_state's copies go, the caller's arrays stay (atol 0).
    model, tx = ConvNet(), optax.sgd(0.1)
    variables = model.init({"params": jax.random.key(0)}, data(0)["image"], train=False)
    rng = jax.random.key(1)
    before = jax.tree.map(np.asarray, variables["batch_stats"])
    update = autoaccum.build_update(autoaccum.linen.make_loss_fn(model, xent), tx, microbatch_size=4, has_state=True)
    params = jax.tree.map(jnp.copy, variables["params"])
    state = autoaccum.linen.init_state(variables, rng)
    _, _, _, state = update(params, tx.init(params), data(1), state)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(variables["batch_stats"]))
    assert not rng.is_deleted()
    assert_trees_close(variables["batch_stats"], before, atol=0.0)
    jax.random.split(rng)  # still a key


class MLP(nn.Module):
    """Dense (no bias), BatchNorm, ReLU, Dense: the BatchNorm's input does not depend on any statistics."""

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Dense(6, use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(nn.relu(x))


def test_state_update_once_moves_batch_stats_once_per_update_by_the_microbatches_mean() -> None:
    # By hand, without autoaccum: h = x @ kernel; per microbatch of 4, 4, 2 the batch mean and (biased) variance
    # of h; the running statistics move once: 0.9 * old + 0.1 * sum_i (n_i / B) * stat_i (atol 1e-6, float32).
    # The mean is the full batch's; threaded per microbatch they would take three EMA steps instead.
    model, tx = MLP(), optax.sgd(0.1)
    x = jax.random.normal(jax.random.key(3), (10, 5))
    batch = {"x": x, "y": jax.random.normal(jax.random.key(4), (10, 1))}
    variables = model.init(jax.random.key(0), x[:1], train=False)
    criterion = lambda apply, b: jnp.mean((apply(b["x"], train=True) - b["y"]) ** 2)  # noqa: E731
    update = autoaccum.build_update(
        autoaccum.linen.make_loss_fn(model, criterion, rng_streams=()), tx, microbatch_size=4, has_state=True,
        state_update="once",
    )  # fmt: skip
    params = jax.tree.map(jnp.copy, variables["params"])
    _, _, _, state = update(params, tx.init(params), batch, autoaccum.linen.init_state(variables, jax.random.key(1)))

    h = np.asarray(x, np.float64) @ np.asarray(variables["params"]["Dense_0"]["kernel"], np.float64)
    pieces = [h[0:4], h[4:8], h[8:10]]
    mean = sum(len(p) / 10 * p.mean(axis=0) for p in pieces)
    var = sum(len(p) / 10 * p.var(axis=0) for p in pieces)
    stats = state["batch_stats"]["BatchNorm_0"]
    old = variables["batch_stats"]["BatchNorm_0"]
    np.testing.assert_allclose(stats["mean"], 0.9 * np.asarray(old["mean"]) + 0.1 * mean, atol=1e-6)
    np.testing.assert_allclose(stats["var"], 0.9 * np.asarray(old["var"]) + 0.1 * var, atol=1e-6)
    np.testing.assert_allclose(mean, h.mean(axis=0), atol=1e-12)  # the full batch's mean
