"""Real training steps, for every registered strategy: a model state threaded through the microbatches,
PRNG keys in the state and the batch, token-weighted (``loss_reduction="sum"``) losses, and microbatches that
arrive one at a time (``update.stream``).

References are computed without the library: the microbatches run in order with ``jax.value_and_grad`` at the
same params, threading the state; the gradients are summed with their weights (``n_i / B``, or
``grad(sum of loss_sum) / sum of weight``) and one optimizer step follows. Tolerances are stated per test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, copy, count_backend_compiles

import autoaccum

FEATURES = 4


def regression(batch_size: int, seed: int = 0) -> tuple[Any, Any]:
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    # Small weights keep losses near 1, where atol 1e-6 is a few float32 ulps.
    params = {"w": 0.1 * jax.random.normal(kw, (FEATURES,)), "b": jnp.zeros(())}
    batch = {"x": jax.random.normal(kx, (batch_size, FEATURES)), "y": jax.random.normal(ky, (batch_size,))}
    return params, batch


def rows(tree: Any, start: int, stop: int) -> Any:
    return jax.tree.map(lambda x: x[start:stop], tree)


def reference_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch: Any,
    state: Any,
    microbatch_size: int,
) -> tuple[Any, Any, Any, Any]:
    """Without the library: microbatches in order at the same params, threading the state; the gradients
    summed with weights ``n_i / B``; one optimizer step. ``loss_fn(params, batch, state) -> (mean, state)``."""
    total = jax.tree.leaves(batch)[0].shape[0]
    grads = jax.tree.map(jnp.zeros_like, params)
    loss = 0.0
    for start in range(0, total, microbatch_size):
        microbatch = rows(batch, start, start + microbatch_size)
        n = jax.tree.leaves(microbatch)[0].shape[0]
        (loss_i, state), grads_i = jax.value_and_grad(loss_fn, has_aux=True)(params, microbatch, state)
        grads = jax.tree.map(lambda g, gi: g + (n / total) * gi, grads, grads_i)  # noqa: B023
        loss += (n / total) * loss_i
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, state


# ---- a model state: BatchNorm-like running mean and a dropout key ----


def dropout_keep(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.bernoulli(key, 0.5, shape)


def bn_dropout_loss(params: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
    """Centres with a running mean updated per microbatch, then drops half the inputs with a fresh key."""
    key, sub = jax.random.split(state["key"])
    mean = 0.9 * state["mean"] + 0.1 * batch["x"].mean(axis=0)
    centred = batch["x"] - mean[None, :]
    pred = jnp.where(dropout_keep(sub, centred.shape), 2.0 * centred, 0.0) @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2), {"key": key, "mean": mean, "count": state["count"] + 1}


def bn_state() -> Any:
    return {"key": jax.random.key(0), "mean": jnp.zeros(FEATURES), "count": jnp.zeros((), jnp.int32)}


def test_state_threads_running_mean_and_dropout_key(strategy: str) -> None:
    # atol 1e-6 (float32): two updates (momentum carries the first into the second), microbatches 3, 3, 2.
    optimizer = optax.sgd(0.1, momentum=0.9)
    params, batch = regression(batch_size=8)
    expected, expected_opt, expected_state = params, optimizer.init(params), bn_state()
    masks = []
    for _ in range(2):
        key = expected_state["key"]
        for n in (3, 3, 2):  # the masks the reference draws: one per microbatch, fresh in each update
            key, sub = jax.random.split(key)
            masks.append(np.asarray(dropout_keep(sub, (n, FEATURES))))
        expected, expected_opt, expected_loss, expected_state = reference_step(
            bn_dropout_loss, optimizer, expected, expected_opt, batch, expected_state, 3
        )
    distinct = {m.tobytes() for m in masks}
    assert len(distinct) == len(masks), "the test needs distinct masks so that reusing a key would fail it"

    update = autoaccum.build_update(bn_dropout_loss, optimizer, microbatch_size=3, strategy=strategy, has_state=True)
    p, opt_state, state = copy(params), update.init(params), bn_state()
    for _ in range(2):
        p, opt_state, loss, state = update(p, opt_state, batch, state)
    assert_trees_close(p, expected, atol=1e-6)
    assert_trees_close(opt_state, expected_opt, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)
    np.testing.assert_allclose(state["mean"], expected_state["mean"], atol=1e-6)
    assert int(state["count"]) == 6  # three microbatches per update
    np.testing.assert_array_equal(jax.random.key_data(state["key"]), jax.random.key_data(expected_state["key"]))


# ---- state_update="once": floating state moves once per update, keys and counters still thread ----


def reference_once(
    optimizer: optax.GradientTransformation, params: Any, opt_state: Any, batch: Any, state: Any, m: int
) -> tuple[Any, Any, Any]:
    """Without the library: every microbatch sees the update's incoming running mean (its key and counter
    threaded); the gradients summed with weights ``n_i / B``; one optimizer step; the running mean moves once, to
    the example-weighted mean of the microbatches' results."""
    total = batch["x"].shape[0]
    grads = jax.tree.map(jnp.zeros_like, params)
    threaded, means = state, []
    for start in range(0, total, m):
        microbatch = rows(batch, start, start + m)
        n = microbatch["x"].shape[0]
        given = {**threaded, "mean": state["mean"]}
        (_, threaded), grads_i = jax.value_and_grad(bn_dropout_loss, has_aux=True)(params, microbatch, given)
        grads = jax.tree.map(lambda g, gi: g + (n / total) * gi, grads, grads_i)  # noqa: B023
        means.append((n / total) * np.asarray(threaded["mean"], np.float64))
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {**threaded, "mean": sum(means)}


def test_state_update_once_moves_the_running_mean_once_per_update(strategy: str) -> None:
    # atol 1e-6 (float32): two updates of microbatches 3, 3, 2; by hand, the running mean takes one EMA step per
    # update towards the full batch's mean: 0.9 * mean + 0.1 * mean(x), as one full-batch step would.
    optimizer = optax.sgd(0.1, momentum=0.9)
    params, batch = regression(batch_size=8)
    update = autoaccum.build_update(
        bn_dropout_loss, optimizer, microbatch_size=3, strategy=strategy, has_state=True, state_update="once"
    )
    assert update.state_update == "once"
    p, opt_state, state = copy(params), update.init(params), bn_state()
    expected, expected_opt, expected_state = params, optimizer.init(params), bn_state()
    by_hand = np.zeros(FEATURES)
    for _ in range(2):
        p, opt_state, _, state = update(p, opt_state, batch, state)
        expected, expected_opt, expected_state = reference_once(
            optimizer, expected, expected_opt, batch, expected_state, 3
        )
        by_hand = 0.9 * by_hand + 0.1 * np.asarray(batch["x"], np.float64).mean(axis=0)
    np.testing.assert_allclose(state["mean"], by_hand, atol=1e-6)
    np.testing.assert_allclose(state["mean"], expected_state["mean"], atol=1e-6)
    assert_trees_close(p, expected, atol=1e-6)
    assert_trees_close(opt_state, expected_opt, atol=1e-6)
    assert int(state["count"]) == 6  # an int32 counter still threads: three microbatches per update
    np.testing.assert_array_equal(jax.random.key_data(state["key"]), jax.random.key_data(expected_state["key"]))


def test_a_refused_opt_state_leaves_the_model_state_alone(strategy: str) -> None:
    """An ``opt_state`` of another optimizer is refused before anything is donated, the carried state too, by the
    update and by `stream`."""
    params, batch = regression(batch_size=8)
    for once in ("once", "per_microbatch"):
        update = autoaccum.build_update(
            bn_dropout_loss, optax.adam(1e-3), microbatch_size=3, strategy=strategy, has_state=True, state_update=once
        )
        state = bn_state()
        with pytest.raises(TypeError, match="`opt_state` must be the optimizer's state"):
            update(params, optax.sgd(0.1).init(params), batch, state)
        with pytest.raises(TypeError, match="`opt_state` must be the optimizer's state"):
            update.stream(params, optax.sgd(0.1).init(params), [rows(batch, 0, 3), rows(batch, 3, 8)], state)
        assert not any(x.is_deleted() for x in jax.tree.leaves((params, state))), once


def test_state_update_once_streams_as_it_steps(strategy: str) -> None:
    # atol 1e-6 (float32): the same microbatches, from one batch or one at a time, give the same update.
    optimizer = optax.sgd(0.1)
    params, batch = regression(batch_size=8)
    update = autoaccum.build_update(
        bn_dropout_loss, optimizer, microbatch_size=3, strategy=strategy, has_state=True, state_update="once"
    )
    want = update(copy(params), update.init(params), batch, bn_state())
    pieces = [rows(batch, 0, 3), rows(batch, 3, 6), rows(batch, 6, 8)]
    got = update.stream(copy(params), update.init(params), pieces, bn_state())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), atol=1e-6)


@pytest.mark.parametrize("strategy_name", ["scan", "loop", "multisteps"])
def test_state_update_once_on_a_mesh(strategy_name: str) -> None:
    # 8 CPU devices, batch 32 sharded over them, microbatches of 16: each device folds its own rows, the devices'
    # means are averaged after the loop; by hand, one EMA step towards the full batch's mean (atol 1e-6).
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, batch = regression(batch_size=32)
    place = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))  # noqa: E731
    update = autoaccum.build_update(
        bn_dropout_loss, optax.adam(1e-2), microbatch_size=16, strategy=strategy_name, has_state=True,
        state_update="once",
    )  # fmt: skip
    p = place(params, PartitionSpec())
    _, _, _, state = update(p, update.init(p), place(batch, PartitionSpec("data")), place(bn_state(), PartitionSpec()))
    by_hand = 0.1 * np.asarray(batch["x"], np.float64).mean(axis=0)
    np.testing.assert_allclose(state["mean"], by_hand, atol=1e-6)
    assert int(state["count"]) == 2


def test_state_update_is_checked() -> None:
    with pytest.raises(ValueError, match=r"`state_update` must be 'per_microbatch' or 'once', got state_update='x'"):
        autoaccum.build_update(bn_dropout_loss, optax.sgd(0.1), microbatch_size=2, has_state=True, state_update="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`state_update`='once' .* has_state=False; pass has_state=True"):
        autoaccum.build_update(lambda p, b: jnp.mean(b), optax.sgd(0.1), microbatch_size=2, state_update="once")


# ---- PRNG keys, typed and raw, in the state and in the batch ----


def make_key(kind: str, seed: int) -> jax.Array:
    key = jax.random.key(seed)
    return key if kind == "typed" else jax.random.key_data(key)  # raw: uint32[2]


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_key_in_state(strategy: str, kind: str) -> None:
    # atol 1e-6 (float32); microbatches 3, 3, 1: each draws its noise from the key the previous one returned.
    def loss_fn(params: Any, batch: Any, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, batch["y"].shape)
        return jnp.mean((batch["x"] @ params["w"] + params["b"] + noise - batch["y"]) ** 2), key

    optimizer = optax.sgd(0.1)
    params, batch = regression(batch_size=7)
    expected, _, expected_loss, expected_key = reference_step(
        loss_fn, optimizer, params, optimizer.init(params), batch, make_key(kind, 1), 3
    )
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=3, strategy=strategy, has_state=True)
    p, _, loss, key = update(copy(params), update.init(params), batch, make_key(kind, 1))
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(loss, expected_loss, atol=1e-6)
    assert key.dtype == expected_key.dtype
    data = (lambda k: jax.random.key_data(k)) if kind == "typed" else np.asarray
    np.testing.assert_array_equal(data(key), data(expected_key))


@pytest.mark.parametrize("kind", ["typed", "raw"])
def test_keys_in_batch(strategy: str, kind: str) -> None:
    # atol 1e-6 (float32): one key per example, so the full-batch step is the reference; microbatches 3, 3, 1.
    def loss_fn(params: Any, batch: Any) -> jax.Array:
        noise = jax.vmap(lambda k: jax.random.normal(k, ()))(batch["key"])
        return jnp.mean((batch["x"] @ params["w"] + params["b"] + noise - batch["y"]) ** 2)

    optimizer = optax.sgd(0.1)
    params, batch = regression(batch_size=7)
    keys = jax.random.split(jax.random.key(2), 7)
    batch = {**batch, "key": keys if kind == "typed" else jax.random.key_data(keys)}
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=3, strategy=strategy)
    p, _, actual_loss = update(copy(params), update.init(params), batch)
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)


# ---- params must be differentiable: a clear error before anything compiles ----


@pytest.mark.parametrize(
    ("leaf", "dtype"),
    [(lambda: jnp.zeros((), jnp.int32), "int32"), (lambda: jax.random.key(0), "key<fry>")],
    ids=["int-counter", "typed-key"],
)
def test_non_float_param_is_reported_before_compiling(strategy: str, leaf: Callable[[], Any], dtype: str) -> None:
    params, batch = regression(batch_size=4)
    params = {**params, "step": leaf()}
    update = autoaccum.build_update(
        lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), microbatch_size=2, strategy=strategy
    )
    opt_state = jax.eval_shape(update.init, params)  # abstract: nothing compiles making it
    match = rf"`params` leaf \['step'\] has dtype {dtype}, which cannot be differentiated.*Move it into `state`"
    with count_backend_compiles() as compiles:
        with pytest.raises(TypeError, match=match):
            update(params, opt_state, batch)
        with pytest.raises(TypeError, match=match):
            update.stream(params, opt_state, [batch])
    assert compiles == []


# ---- token-weighted losses: loss_reduction="sum" ----

LENGTHS = (6, 1, 2, 6, 3, 1, 5)  # real tokens per sequence; the rest is padding
SEQ = 6


def token_batch(seed: int = 3) -> tuple[Any, Any]:
    kx, ky, kw = jax.random.split(jax.random.key(seed), 3)
    params = {"w": jax.random.normal(kw, (FEATURES,)), "b": jnp.zeros(())}
    batch = {
        "x": jax.random.normal(kx, (len(LENGTHS), SEQ, FEATURES)),
        "y": jax.random.normal(ky, (len(LENGTHS), SEQ)),  # padding positions hold garbage too
        "mask": (jnp.arange(SEQ)[None, :] < jnp.asarray(LENGTHS)[:, None]).astype(jnp.float32),
    }
    return params, batch


def token_losses(params: Any, batch: Any) -> jax.Array:
    return (batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2


def token_sum(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    return jnp.sum(token_losses(params, batch) * batch["mask"]), jnp.sum(batch["mask"])


def test_sum_reduction_equals_full_batch_token_mean(strategy: str) -> None:
    # atol 1e-6 (float32); microbatches of 3, 3, 1 sequences holding 9, 10 and 5 real tokens.
    params, batch = token_batch()

    def token_mean(p: Any, b: Any) -> jax.Array:
        total, weight = token_sum(p, b)
        return total / weight

    loss, grads = jax.value_and_grad(token_mean)(params, batch)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    # The test can fail: weighting microbatches by examples (a mean of token means) gives another step.
    def mean_of_means(p: Any) -> jax.Array:
        return sum(n / len(LENGTHS) * token_mean(p, rows(batch, s, s + n)) for s, n in ((0, 3), (3, 3), (6, 1)))

    other_loss, other_grads = jax.value_and_grad(mean_of_means)(params)
    assert abs(float(other_loss) - float(loss)) > 1e-2
    assert float(jnp.max(jnp.abs(other_grads["w"] - grads["w"]))) > 1e-2

    update = autoaccum.build_update(
        token_sum, optax.sgd(0.1), microbatch_size=3, strategy=strategy, loss_reduction="sum"
    )
    p, _, actual_loss = update(copy(params), update.init(params), batch)
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)


def token_sum_with_state(params: Any, batch: Any, state: Any) -> tuple[tuple[tuple[jax.Array, jax.Array], Any], Any]:
    """Token dropout with a key from the state; aux: the largest real-token loss (weight-weighted mean)."""
    key, sub = jax.random.split(state["key"])
    keep = dropout_keep(sub, batch["mask"].shape)
    losses = token_losses(params, batch) * jnp.where(keep, 2.0, 0.0) * batch["mask"]
    aux = {"max": jnp.max(losses)}
    return ((jnp.sum(losses), jnp.sum(batch["mask"])), aux), {"key": key, "count": state["count"] + 1}


def reference_sum_with_state(params: Any, batch: Any, state: Any, starts: Any) -> tuple[Any, Any, Any, Any]:
    """Without the library: ``grad(sum of loss_sum) / sum of weight``, threading the state; aux weighted by weight."""
    grads, total, weight, aux = jax.tree.map(jnp.zeros_like, params), 0.0, 0.0, 0.0

    def loss_sum(p: Any, b: Any, s: Any) -> tuple[jax.Array, Any]:
        ((value, w), a), s = token_sum_with_state(p, b, s)
        return value, (w, a, s)

    for start, stop in starts:
        (value, (w, a, state)), g = jax.value_and_grad(loss_sum, has_aux=True)(params, rows(batch, start, stop), state)
        grads = jax.tree.map(jnp.add, grads, g)
        total, weight, aux = total + value, weight + w, aux + w * a["max"]
    return jax.tree.map(lambda p, g: p - 0.1 * g / weight, params, grads), total / weight, aux / weight, state


def test_sum_reduction_with_state_and_aux(strategy: str) -> None:
    # atol 1e-6 (float32); microbatches of 3, 3, 1 sequences, each with its own dropout key from the state.
    params, batch = token_batch()
    state0 = {"key": jax.random.key(4), "count": jnp.zeros((), jnp.int32)}
    expected, loss, aux, expected_state = reference_sum_with_state(params, batch, state0, [(0, 3), (3, 6), (6, 7)])
    update = autoaccum.build_update(
        token_sum_with_state,
        optax.sgd(0.1),
        microbatch_size=3,
        strategy=strategy,
        has_aux=True,
        has_state=True,
        loss_reduction="sum",
    )
    p, _, (actual_loss, actual_aux), state = update(copy(params), update.init(params), batch, copy(state0))
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)
    np.testing.assert_allclose(actual_aux["max"], aux, atol=1e-6)
    assert int(state["count"]) == 3
    np.testing.assert_array_equal(jax.random.key_data(state["key"]), jax.random.key_data(expected_state["key"]))


# ---- microbatches from a data loader: update.stream ----


def test_stream_of_uneven_microbatches_equals_full_batch_step(strategy: str) -> None:
    # atol 1e-6 (float32); microbatches of 3, 5, 3, 1 examples arrive as host arrays from a generator.
    sizes = (3, 5, 3, 1)
    optimizer = optax.adam(1e-2)
    params, batch = regression(batch_size=sum(sizes))
    host = jax.tree.map(np.asarray, batch)

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    def loader() -> Iterator[Any]:
        for start, n in zip(np.cumsum((0, *sizes[:-1])), sizes, strict=True):
            yield rows(host, int(start), int(start) + n)

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, expected_opt = optimizer.update(grads, optimizer.init(params), params)
    expected = optax.apply_updates(params, updates)

    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=4, strategy=strategy)
    p, opt_state = copy(params), update.init(params)
    with count_backend_compiles() as compiles:
        p, opt_state, actual_loss = update.stream(p, opt_state, loader())
        jax.block_until_ready(p)
    assert len(compiles) == len(set(sizes)) + 2  # one accumulate program per distinct size, the zero sums, the step
    assert_trees_close(p, expected, atol=1e-6)
    assert_trees_close(opt_state, expected_opt, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)
    with count_backend_compiles() as compiles:
        jax.block_until_ready(update.stream(p, opt_state, loader()))
    assert compiles == []


def test_stream_with_state_and_token_sum(strategy: str) -> None:
    # atol 1e-6 (float32): the same step as the batch update, from microbatches of 2, 4 and 1 sequences.
    params, batch = token_batch()
    state0 = {"key": jax.random.key(5), "count": jnp.zeros((), jnp.int32)}
    bounds = [(0, 2), (2, 6), (6, 7)]
    expected, loss, aux, expected_state = reference_sum_with_state(params, batch, state0, bounds)
    update = autoaccum.build_update(
        token_sum_with_state,
        optax.sgd(0.1),
        microbatch_size=3,
        strategy=strategy,
        has_aux=True,
        has_state=True,
        loss_reduction="sum",
    )
    microbatches = (rows(batch, start, stop) for start, stop in bounds)
    p, _, (actual_loss, actual_aux), state = update.stream(copy(params), update.init(params), microbatches, state0)
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)
    np.testing.assert_allclose(actual_aux["max"], aux, atol=1e-6)
    assert int(state["count"]) == 3
    np.testing.assert_array_equal(jax.random.key_data(state["key"]), jax.random.key_data(expected_state["key"]))


def test_stream_with_mean_state(strategy: str) -> None:
    # atol 1e-6 (float32): BatchNorm-like state and dropout key, microbatches 3, 3, 2 streamed = the batch update.
    optimizer = optax.sgd(0.1)
    params, batch = regression(batch_size=8)
    expected, _, loss, expected_state = reference_step(
        bn_dropout_loss, optimizer, params, optimizer.init(params), batch, bn_state(), 3
    )
    update = autoaccum.build_update(bn_dropout_loss, optimizer, microbatch_size=3, strategy=strategy, has_state=True)
    microbatches = [rows(batch, 0, 3), rows(batch, 3, 6), rows(batch, 6, 8)]
    p, _, actual_loss, state = update.stream(copy(params), update.init(params), microbatches, bn_state())
    assert_trees_close(p, expected, atol=1e-6)
    np.testing.assert_allclose(actual_loss, loss, atol=1e-6)
    np.testing.assert_allclose(state["mean"], expected_state["mean"], atol=1e-6)
    assert int(state["count"]) == 3


def test_stream_of_nothing(strategy: str) -> None:
    params, _ = regression(batch_size=2)
    update = autoaccum.build_update(lambda p, b: jnp.mean(b @ p["w"]), optax.sgd(0.1), microbatch_size=2)
    with pytest.raises(ValueError, match="`microbatches` is empty"):
        update.stream(params, update.init(params), iter(()))
    one = jnp.ones((2, FEATURES))  # a malformed one is named by its place; one batch alone is named as such
    with pytest.raises(ValueError, match=r"microbatch 2 of `microbatches`: `batch` has 0 examples"):
        update.stream(params, update.init(params), [one, one, jnp.ones((0, FEATURES))])
    for batch in (one, {"x": one}):  # (an array's rows, a dict's keys were taken for microbatches)
        with pytest.raises(TypeError, match=r"`microbatches` must be an iterable of batches, got one "):
            update.stream(params, update.init(params), batch)  # type: ignore[arg-type]


# ---- compiled once; compile-only programs; misuse ----


@pytest.mark.parametrize("batch_size", [6, 8], ids=["even", "uneven"])
def test_second_call_with_state_does_not_retrace(strategy: str, batch_size: int) -> None:
    traces = []

    def loss_fn(params: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
        traces.append(jax.tree.map(jnp.shape, batch))
        return bn_dropout_loss(params, batch, state)

    params, batch = regression(batch_size=batch_size)
    update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=3, strategy=strategy, has_state=True)
    p, opt_state, state = copy(params), update.init(params), bn_state()
    p, opt_state, _, state = update(p, opt_state, batch, state)
    after_first = len(traces)
    assert after_first > 0
    with count_backend_compiles() as compiles:
        for _ in range(2):
            p, opt_state, _, state = update(p, opt_state, batch, state)
        jax.block_until_ready(p)
    assert len(traces) == after_first
    assert compiles == []


def test_programs_with_state_compile_without_running(strategy: str) -> None:
    params, batch = regression(batch_size=8)
    update = autoaccum.build_update(
        bn_dropout_loss, optax.sgd(0.1), microbatch_size=3, strategy=strategy, has_state=True
    )
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    params_s = shapes(params)
    programs = update.programs(params_s, jax.eval_shape(update.init, params_s), shapes(batch), shapes(bn_state()))
    assert programs
    for program in programs:
        assert program.lowered.compile().memory_analysis() is not None


def test_state_argument_must_match_has_state() -> None:
    params, batch = regression(batch_size=4)
    stateful = autoaccum.build_update(bn_dropout_loss, optax.sgd(0.1), microbatch_size=2, has_state=True)
    with pytest.raises(TypeError, match=r"built with has_state=True, so pass the model state"):
        stateful(params, stateful.init(params), batch)
    plain = autoaccum.build_update(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), microbatch_size=2)
    with pytest.raises(TypeError, match=r"`state` was passed to update but the update was built with has_state=False"):
        plain(params, plain.init(params), batch, bn_state())


def test_loss_fn_must_return_a_like_state(strategy: str) -> None:
    params, batch = regression(batch_size=4)

    def grows(p: Any, b: Any, s: Any) -> tuple[jax.Array, Any]:
        return jnp.mean(b["x"] @ p["w"]), {"mean": jnp.concatenate([s["mean"], s["mean"]])}

    update = autoaccum.build_update(grows, optax.sgd(0.1), microbatch_size=2, strategy=strategy, has_state=True)
    opt_state, state = update.init(params), {"mean": jnp.zeros(FEATURES)}  # (made before: their programs compile)
    with (
        count_backend_compiles() as compiles,
        pytest.raises(TypeError, match=r"state leaf \['mean'\] with shape \(8,\)"),
    ):
        update(params, opt_state, batch, state)
    assert compiles == []
    lossonly = autoaccum.build_update(lambda p, b, s: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), microbatch_size=2,
                                      strategy=strategy, has_state=True)  # fmt: skip
    with pytest.raises(TypeError, match=r"returned an array of shape \(\) and dtype float32, not a \(loss, state\)"):
        lossonly(params, lossonly.init(params), batch, {"mean": jnp.zeros(FEATURES)})  # (a tracer's type was named)


def test_bad_loss_reduction_and_sum_output() -> None:
    with pytest.raises(ValueError, match=r"`loss_reduction` must be 'mean' or 'sum', got loss_reduction='tokens'"):
        autoaccum.build_update(token_sum, optax.sgd(0.1), microbatch_size=2, loss_reduction="tokens")  # type: ignore[arg-type]
    params, batch = token_batch()
    update = autoaccum.build_update(
        lambda p, b: jnp.mean(token_losses(p, b)), optax.sgd(0.1), microbatch_size=2, loss_reduction="sum"
    )
    with pytest.raises(TypeError, match=r"loss_reduction='sum' but `loss_fn` returned .* \(loss_sum, weight\)"):
        update(params, update.init(params), batch)
