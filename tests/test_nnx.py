"""flax nnx, the way nnx code is written: `autoaccum.nnx` against an explicit reference computed without it."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_strategies import count_backend_compiles

import autoaccum

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


def reference_update(model: Net, optimizer: nnx.Optimizer, batch: Any, m: int) -> jax.Array:
    """Without autoaccum: microbatches in order, the model's other state threaded, (n_i / B) * grad_i summed,
    one optax step; written back to the model and optimizer."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    params, rest = as_pure(params), as_pure(rest)

    def pure(p: Any, b: Any, r: Any) -> tuple[jax.Array, Any]:
        local = nnx.merge(graphdef, p, r)
        loss = loss_fn(local, b)
        return loss, as_pure(nnx.split(local, nnx.Param, ...)[2])  # type: ignore[misc]

    total = batch["x"].shape[0]
    grads = jax.tree.map(jnp.zeros_like, params)
    loss_sum = 0.0
    for start in range(0, total, m):
        micro = jax.tree.map(lambda x: x[start : start + m], batch)  # noqa: B023
        n = micro["x"].shape[0]
        (loss, rest), g = jax.value_and_grad(pure, has_aux=True)(params, micro, rest)
        grads = jax.tree.map(lambda a, b: a + (n / total) * b, grads, g)  # noqa: B023
        loss_sum += (n / total) * loss
    opt_state = as_pure(optimizer.opt_state)
    updates, opt_state = optimizer.tx.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates), rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step[...] += 1
    return jnp.asarray(loss_sum)


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


def test_nnx_probe_estimate_and_tune_leave_the_model_alone() -> None:
    model, optimizer = make()
    before = jax.tree.map(jnp.copy, nnx.state(model))
    batch = batches(1, 16)[0]
    est = autoaccum.nnx.estimate(loss_fn, model, optimizer, batch, memory_limit="64MiB", accumulation=False)
    assert est.max_microbatch > 16
    found = autoaccum.nnx.probe(
        loss_fn, model, optimizer, batch, memory_limit="256MiB", max_microbatch=32, isolate=False
    )
    assert found.max_microbatch == 32
    result = autoaccum.nnx.tune(
        loss_fn, model, optimizer, batch, max_microbatch=8, strategies=["scan", "loop"], storage=":memory:", n_trials=3
    )
    assert_states_close(nnx.state(model), before, atol=0.0)
    loss = result.step(model, optimizer, batch)  # the plan, the nnx way
    assert jnp.isfinite(loss) and int(optimizer.step[...]) == 1


def test_nnx_probe_in_child_processes() -> None:
    """The model's state (BatchNorm statistics, the dropout stream's typed key) crosses to the trials."""
    model, optimizer = make()
    result = autoaccum.nnx.probe(
        loss_fn, model, optimizer, batches(1, 8)[0], memory_limit="256MiB", max_microbatch=64, granularity=32
    )
    assert result.max_microbatch == 64 and all(t.fits for t in result.trials)
