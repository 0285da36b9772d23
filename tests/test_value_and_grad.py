"""`autoaccum.value_and_grad` and `autoaccum.nnx.value_and_grad`: the whole batch's loss and gradient in your step.

Every result is compared with a reference computed without the library: ``jax.value_and_grad`` (or nnx's own)
on the whole batch, or, where the microbatches are meant to differ from the whole batch (a model state that
moves per microbatch, BatchNorm, dropout), a hand-written loop over the microbatches; dropout on, also
statistically (the mean over many draws). float32, atol 1e-6.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import count_backend_compiles
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoaccum
from autoaccum._hlo import collectives

ATOL = 1e-6  # float32, losses and gradients near 1: a few ulps


def assert_close(actual: Any, expected: Any, atol: float = ATOL) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, e = jax.random.key_data(a), jax.random.key_data(e)
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), atol=atol, rtol=0)


def mlp(batch_size: int, seed: int = 0) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(seed), 5)
    params = {
        "w1": 0.3 * jax.random.normal(k[0], (4, 8)),
        "b1": 0.1 * jax.random.normal(k[1], (8,)),
        "w2": 0.3 * jax.random.normal(k[2], (8,)),
    }
    batch = {"x": jax.random.normal(k[3], (batch_size, 4)), "y": jax.random.normal(k[4], (batch_size,))}
    return params, batch


def predict(params: Any, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ params["w1"] + params["b1"][None, :]) @ params["w2"]


def loss_fn(params: Any, batch: Any) -> jax.Array:
    return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)


def loss_with_aux(params: Any, batch: Any) -> tuple[jax.Array, Any]:
    error = predict(params, batch["x"]) - batch["y"]
    return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error)), "positive": jnp.mean(error > 0)}


SPLITS = [(8, 4), (10, 4), (10, 3), (7, 7), (5, 8), (9, 1)]  # even, uneven, one microbatch, m > B, m = 1


@pytest.mark.parametrize(("batch_size", "microbatch_size"), SPLITS, ids=lambda v: str(v))
def test_equals_jax_value_and_grad_on_the_whole_batch(batch_size: int, microbatch_size: int) -> None:
    params, batch = mlp(batch_size)
    grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=microbatch_size)
    assert_close(jax.jit(grad_fn)(params, batch), jax.value_and_grad(loss_fn)(params, batch))
    assert_close(grad_fn(params, batch), jax.value_and_grad(loss_fn)(params, batch))  # outside a jit too


def test_tiny_exact_case() -> None:
    """Gradients 1, 2, 3, 4 of the four examples average to exactly 2.5, split 3 + 1."""
    grad_fn = autoaccum.value_and_grad(lambda w, b: jnp.mean(w * b), microbatch_size=3)
    loss, grads = grad_fn(jnp.asarray(1.0), jnp.arange(1.0, 5.0))
    assert float(grads) == 2.5 and float(loss) == 2.5


@pytest.mark.parametrize(("batch_size", "microbatch_size"), [(8, 4), (10, 3)], ids=lambda v: str(v))
def test_has_aux_is_the_whole_batch_aux(batch_size: int, microbatch_size: int) -> None:
    params, batch = mlp(batch_size)
    grad_fn = autoaccum.value_and_grad(loss_with_aux, microbatch_size=microbatch_size, has_aux=True)
    (loss, aux), grads = jax.jit(grad_fn)(params, batch)
    (want_loss, want_aux), want_grads = jax.value_and_grad(loss_with_aux, has_aux=True)(params, batch)
    assert_close((loss, aux, grads), (want_loss, want_aux, want_grads))


def loss_with_logits(params: Any, batch: Any) -> tuple[jax.Array, Any]:
    """flax's MNIST tutorial's shape: the per-example predictions as aux, beside a scalar metric."""
    prediction = predict(params, batch["x"])
    return jnp.mean((prediction - batch["y"]) ** 2), {"prediction": prediction, "positive": jnp.mean(prediction > 0)}


@pytest.mark.parametrize(("batch_size", "microbatch_size"), [(8, 4), (10, 3), (5, 8)], ids=lambda v: str(v))
def test_per_example_aux_is_the_whole_batch_rows(batch_size: int, microbatch_size: int) -> None:
    params, batch = mlp(batch_size)
    grad_fn = autoaccum.value_and_grad(loss_with_logits, microbatch_size=microbatch_size, has_aux=True)
    got = jax.jit(grad_fn)(params, batch)
    assert_close(got, jax.value_and_grad(loss_with_logits, has_aux=True)(params, batch))


@pytest.mark.parametrize(
    ("make", "shapes"),
    [(lambda p: jnp.stack([p, 2 * p]), r"\(2, 4\) for 4 examples, \(2, 8\) for 8"),
     (lambda p: jnp.concatenate([p, p]), r"\(8,\) for 4 examples, \(16,\) for 8")],
    ids=["examples-second", "flattened"],
)  # fmt: skip
def test_an_aux_leaf_following_the_examples_but_not_as_rows_is_refused(make: Any, shapes: str) -> None:
    """Such a leaf was averaged over equal microbatches (shape (2, 5) for 10 examples, no error: a new user's
    report) and failed to broadcast over uneven ones: refused, naming it, at every split."""
    params, batch = mlp(10)

    def loss_fn(p: Any, b: Any) -> Any:
        loss, aux = loss_with_logits(p, b)
        return loss, {**aux, "odd": make(aux["prediction"])}

    for microbatch_size in (4, 5):
        grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=microbatch_size, has_aux=True)
        with pytest.raises(ValueError, match=r"aux leaf \['odd'\] changes shape with the number of examples"):
            jax.jit(grad_fn)(params, batch)
    with pytest.raises(ValueError, match=shapes):
        autoaccum.value_and_grad(loss_fn, microbatch_size=4, has_aux=True)(params, batch)


def test_per_example_aux_is_refused_on_a_mesh() -> None:
    params, batch = mlp(16)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
    grad_fn = autoaccum.value_and_grad(loss_with_logits, microbatch_size=8, has_aux=True)
    with pytest.raises(ValueError, match=r"per-example leaves.*on a mesh"):
        grad_fn(params, sharded)


def padded_lm(batch_size: int = 10, length: int = 6) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(1), 4)
    lengths = jax.random.randint(k[0], (batch_size,), 1, length + 1)
    mask = (jnp.arange(length)[None, :] < lengths[:, None]).astype(jnp.float32)
    batch = {
        "x": jax.random.normal(k[1], (batch_size, length, 4)),
        "y": jax.random.normal(k[2], (batch_size, length)),
        "mask": mask,
    }
    return {"w": 0.5 * jax.random.normal(k[3], (4,))}, batch


def token_sums(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    losses = (batch["x"] @ params["w"] - batch["y"]) ** 2
    return jnp.sum(losses * batch["mask"]), jnp.sum(batch["mask"])


@pytest.mark.parametrize("microbatch_size", [3, 4, 10])
def test_sum_reduction_is_the_token_mean_over_padding(microbatch_size: int) -> None:
    params, batch = padded_lm()

    def token_mean(params: Any, batch: Any) -> jax.Array:
        loss_sum, weight = token_sums(params, batch)
        return loss_sum / weight

    grad_fn = autoaccum.value_and_grad(token_sums, microbatch_size=microbatch_size, loss_reduction="sum")
    assert_close(jax.jit(grad_fn)(params, batch), jax.value_and_grad(token_mean)(params, batch))


def padded_next_token_lm(batch_size: int = 10, length: int = 8, vocab: int = 11, dim: int = 6) -> tuple[Any, Any]:
    """A tiny next-token LM on sequences of uneven lengths, padded; each real token carries a weight in [0.5, 1.5]."""
    k = jax.random.split(jax.random.key(3), 5)
    lengths = jax.random.randint(k[0], (batch_size,), 2, length + 2)  # tokens, the first one only an input
    real = jnp.arange(length)[None, :] + 1 < lengths[:, None]
    batch = {
        "tokens": jax.random.randint(k[1], (batch_size, length + 1), 0, vocab),
        "weights": jnp.where(real, jax.random.uniform(k[2], (batch_size, length), minval=0.5, maxval=1.5), 0.0),
    }
    params = {"embed": jax.random.normal(k[3], (vocab, dim)), "out": 0.5 * jax.random.normal(k[4], (dim, vocab))}
    return params, batch


def lm_token_sums(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
    """The weighted sum of the next-token cross-entropies and the sum of the weights (padding weighs 0)."""
    logits = jnp.tanh(params["embed"][batch["tokens"][:, :-1]]) @ params["out"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
    return jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"])


def lm_token_mean(params: Any, batch: Any) -> jax.Array:
    loss_sum, weight = lm_token_sums(params, batch)
    return loss_sum / weight


@pytest.mark.parametrize("microbatch_size", [pytest.param(3, marks=pytest.mark.slow), 4])  # (16 s; 4 is uneven too)
def test_padded_lm_with_token_weights_is_the_whole_batch_token_mean(microbatch_size: int) -> None:
    params, batch = padded_next_token_lm()
    grad_fn = autoaccum.value_and_grad(lm_token_sums, microbatch_size=microbatch_size, loss_reduction="sum")
    reference = jax.jit(jax.value_and_grad(lm_token_mean))  # compiled per shape, not run op by op
    want = reference(params, batch)
    assert_close(jax.jit(grad_fn)(params, batch), want)
    # The microbatches hold different token weights: the mean of their own token means is another number.
    starts = range(0, 10, microbatch_size)
    naive = [reference(params, rows(batch, s, microbatch_size)) for s in starts]
    sizes = [min(microbatch_size, 10 - s) / 10 for s in starts]
    naive_loss = sum(n * w for (n, _), w in zip(naive, sizes, strict=True))
    assert abs(float(naive_loss) - float(want[0])) > 1e-3


def rows(batch: Any, start: int, size: int) -> Any:
    return jax.tree.map(lambda x: x[start : start + size], batch)


def stateful_loss(params: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
    """The loss reads the state; the state moves with each microbatch's statistics (an EMA and a counter)."""
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
    loss = jnp.mean((hidden @ params["w2"] + state["ema"] - batch["y"]) ** 2)
    ema = 0.9 * state["ema"] + 0.1 * jnp.mean(jax.lax.stop_gradient(hidden))
    return loss, {"ema": ema, "count": state["count"] + 1}


def microbatch_loop(params: Any, batch: Any, state: Any, microbatch_size: int) -> tuple[Any, Any, Any]:
    """The reference: ``jax.value_and_grad`` per microbatch, the state threaded, each weighted n_i / B."""
    total = len(batch["y"])
    loss, grads = 0.0, jax.tree.map(jnp.zeros_like, params)
    for start in range(0, total, microbatch_size):
        micro = rows(batch, start, microbatch_size)
        n = len(micro["y"])
        (value, state), g = jax.value_and_grad(stateful_loss, has_aux=True)(params, micro, state)
        loss += value * n / total
        grads = jax.tree.map(lambda a, b, w=n / total: a + b * w, grads, g)
    return loss, grads, state


@pytest.mark.parametrize(("batch_size", "microbatch_size"), [(8, 4), (10, 3)], ids=lambda v: str(v))
def test_state_is_threaded_through_the_microbatches_in_order(batch_size: int, microbatch_size: int) -> None:
    params, batch = mlp(batch_size)
    state = {"ema": jnp.asarray(0.5), "count": jnp.asarray(0, jnp.int32)}
    grad_fn = autoaccum.value_and_grad(stateful_loss, microbatch_size=microbatch_size, has_state=True)
    loss, grads, new_state = jax.jit(grad_fn)(params, batch, state)
    want_loss, want_grads, want_state = microbatch_loop(params, batch, state, microbatch_size)
    assert_close((loss, grads, new_state), (want_loss, want_grads, want_state))
    assert int(new_state["count"]) == -(-batch_size // microbatch_size)  # one step per microbatch


def test_remat_changes_nothing_but_memory() -> None:
    params, batch = mlp(10)
    grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=4, remat="nothing_saveable")
    assert_close(jax.jit(grad_fn)(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_bfloat16_accumulator_within_its_precision() -> None:
    params, batch = mlp(64)
    grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=8, accumulator_dtype=jnp.bfloat16)
    loss, grads = jax.jit(grad_fn)(params, batch)
    want_loss, want_grads = jax.value_and_grad(loss_fn)(params, batch)
    assert loss.dtype == jnp.float32 and all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # cast back
    # bfloat16 keeps 8 bits: each of the 8 sums rounds by up to 2^-9 of its size (values here below 2).
    assert_close((loss, grads), (want_loss, want_grads), atol=2e-2)


def test_traces_once_inside_the_callers_jit() -> None:
    params, batch = mlp(10)
    traces = []
    grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=4)

    @jax.jit
    def step(params: Any, batch: Any) -> Any:
        traces.append(1)
        loss, grads = grad_fn(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params, _ = step(params, batch)
    params, _ = step(params, batch)
    assert len(traces) == 1


def test_outside_a_jit_compiles_once() -> None:
    params, batch = mlp(10)
    calls = []

    def counted(params: Any, batch: Any) -> jax.Array:
        calls.append(1)
        return loss_fn(params, batch)

    grad_fn = autoaccum.value_and_grad(counted, microbatch_size=4)
    grad_fn(params, batch)
    traced = len(calls)
    grad_fn(params, batch)
    assert traced > 0 and len(calls) == traced


def test_bad_input_is_refused_before_compiling() -> None:
    params, batch = mlp(8)
    jax.block_until_ready((params, batch))
    with count_backend_compiles() as compiles:
        for bad in (0, -3):
            with pytest.raises(ValueError, match=rf"`microbatch_size` must be >= 1, got microbatch_size={bad}"):
                autoaccum.value_and_grad(loss_fn, microbatch_size=bad)
        for bad in (2.0, True, "4", None):
            with pytest.raises(TypeError, match="`microbatch_size` must be an int >= 1"):
                autoaccum.value_and_grad(loss_fn, microbatch_size=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"`state` is missing.*grad_fn\(params, batch, state\)"):
            autoaccum.value_and_grad(stateful_loss, microbatch_size=4, has_state=True)(params, batch)
        with pytest.raises(TypeError, match="has_state=False"):
            autoaccum.value_and_grad(loss_fn, microbatch_size=4)(params, batch, {})
        with pytest.raises(TypeError, match=r"`loss_fn` must take 3 arguments, loss_fn\(params, batch, state\)"):
            autoaccum.value_and_grad(loss_fn, microbatch_size=4, has_state=True)  # (its own TypeError at the call)
        with pytest.raises(TypeError, match=r"must take 2 arguments.*\(w, b, s\).*, pass has_state=True"):
            autoaccum.value_and_grad(lambda w, b, s: (loss_fn(w, b), s), microbatch_size=4)(params, batch)
        for bad in (-1, 2.5, "2"):  # lax.scan's own errors at the call named none of autoaccum's arguments
            with pytest.raises(ValueError, match=rf"`unroll` must be an int >= 1 .* got unroll={bad!r}"):
                autoaccum.value_and_grad(loss_fn, microbatch_size=4, unroll=bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"`unroll` must be an int >= 1"):
                autoaccum.nnx.value_and_grad(lambda m, b: jnp.mean(m(b)), microbatch_size=4, unroll=bad)
        vector = autoaccum.value_and_grad(lambda p, b: predict(p, b["x"]), microbatch_size=4)
        with pytest.raises(ValueError, match="must return a scalar"):
            vector(params, batch)
        with pytest.raises(ValueError, match="must return a scalar"):
            jax.jit(vector)(params, batch)  # inside the caller's jit too
    assert compiles == []


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=lambda t: t.name)
def test_on_a_mesh_reduces_once_per_call(axis_type: AxisType) -> None:
    params, batch = mlp(256)  # 16 microbatches of 16: XLA keeps the loop
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
    replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    grad_fn = autoaccum.value_and_grad(loss_fn, microbatch_size=16)
    want = jax.value_and_grad(loss_fn)(params, batch)
    if axis_type == AxisType.Explicit:  # inside the caller's jit, the batch's sharding is in its type
        step = jax.jit(grad_fn)
        assert_close(jax.device_get(step(replicated, sharded)), want)
        program = collectives(step.lower(replicated, sharded).compile().as_text())
        assert program.in_loop == 0 and program.outside == {"all-reduce": 1}, program
    else:  # an Auto mesh's sharding is read from the arrays, outside a jit; inside one XLA partitions the loop
        assert_close(jax.device_get(grad_fn(replicated, sharded)), want)
        assert_close(jax.device_get(jax.jit(grad_fn)(replicated, sharded)), want)


@pytest.mark.parametrize("microbatch_size", [2, 3, 10])  # 10 rows a device: even, uneven, one microbatch
def test_inside_shard_map_equals_jax_value_and_grad_there(microbatch_size: int) -> None:
    """Inside the user's jax.shard_map each device's batch is its own; jax.value_and_grad there returns the local
    loss and the gradient of parameters the devices share summed over them, once (it failed: the scan's carry)."""
    params, batch = mlp(80)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))), batch)
    replicated = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)

    def in_shard_map(grad_fn: Any) -> Any:
        step = lambda p, b, s: jax.tree.map(lambda x: x[None], grad_fn(p, b, s))  # noqa: E731
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data"), P()), out_specs=P("data")))

    def counting(p: Any, b: Any, s: jax.Array) -> tuple[jax.Array, jax.Array]:  # a state the batch moves
        return loss_fn(p, b), s + jnp.sum(b["x"])

    want = in_shard_map(lambda p, b, s: (*jax.value_and_grad(loss_fn)(p, b), s + jnp.sum(b["x"])))
    got = in_shard_map(autoaccum.value_and_grad(counting, microbatch_size=microbatch_size, has_state=True))
    assert_close(got(replicated, sharded, jnp.float32(1.0)), want(replicated, sharded, jnp.float32(1.0)), atol=2e-6)
    program = in_shard_map(autoaccum.value_and_grad(counting, microbatch_size=2, has_state=True))
    assert collectives(program.lower(replicated, sharded, jnp.float32(1.0)).compile().as_text()).in_loop == 0


def test_a_plan_gives_the_transform_and_host_strategies_are_refused() -> None:
    params, batch = mlp(10)
    plan = autoaccum.Plan(
        effective_batch=10, microbatch_size=4, accumulation_steps=3, strategy="scan", options={"unroll": 2}
    )
    assert_close(jax.jit(plan.value_and_grad(loss_fn))(params, batch), jax.value_and_grad(loss_fn)(params, batch))
    for strategy in ("loop", "multisteps"):
        host = dataclasses.replace(plan, strategy=strategy, options={})
        with pytest.raises(ValueError, match=rf"{strategy}.*cannot live inside a jit.*scan.*microbatch_size=4"):
            host.value_and_grad(loss_fn)
        with pytest.raises(ValueError, match="cannot live inside a jit") as refused:
            autoaccum.nnx.value_and_grad(lambda m, b: 0.0, plan=host)
        # the fixes an nnx model can take (the pytree functions it was told before take no model)
        assert "autoaccum.nnx.value_and_grad(loss_fn, microbatch_size=4" in str(refused.value)
        assert "autoaccum.nnx.build_update(loss_fn, plan=plan)" in str(refused.value)
        assert "plan.build(" not in str(refused.value)


# -- nnx ------------------------------------------------------------------------------------------------------


class Net(nnx.Module):
    def __init__(self, dropout: float, *, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 16, use_bias=False, rngs=rngs)  # a bias before BatchNorm has no gradient
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.drop(nnx.relu(self.norm(self.hidden(x)))))[:, 0]


def nnx_loss(model: Net, batch: Any) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_classifier_loss(model: Net, batch: Any) -> tuple[jax.Array, jax.Array]:
    """flax's MNIST tutorial's loss: the mean cross-entropy, and the logits as aux."""
    logits = jnp.stack([model(batch["x"]), -model(batch["x"])], axis=-1)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch["label"]).mean()
    return loss, logits


def nnx_microbatch_loop(model: Net, batch: Any, microbatch_size: int, objective: Any = nnx_loss) -> tuple[Any, Any]:
    """The reference: nnx's own value_and_grad per microbatch (the model's state moving), each weighted n_i / B."""
    total = len(batch["y"])
    loss, grads = 0.0, None
    for start in range(0, total, microbatch_size):
        micro = rows(batch, start, microbatch_size)
        n = len(micro["y"])
        value, g = nnx.value_and_grad(objective)(model, micro)
        loss += value * n / total
        scaled = jax.tree.map(lambda x, w=n / total: x * w, g)
        grads = scaled if grads is None else jax.tree.map(jnp.add, grads, scaled)
    return loss, grads


def net_and_batch(dropout: float, batch_size: int = 24) -> tuple[Net, Any]:
    k = jax.random.split(jax.random.key(2), 2)
    batch = {"x": jax.random.normal(k[0], (batch_size, 4)), "y": jax.random.normal(k[1], (batch_size,))}
    return Net(dropout, rngs=nnx.Rngs(0, dropout=1)), batch


@pytest.mark.slow
def test_nnx_one_microbatch_equals_nnx_value_and_grad() -> None:
    model, batch = net_and_batch(dropout=0.0)
    reference = nnx.clone(model)
    got = autoaccum.nnx.value_and_grad(nnx_loss, microbatch_size=24)(model, batch)
    assert_close(got, nnx.value_and_grad(nnx_loss)(reference, batch))
    assert_close(nnx.state(model), nnx.state(reference))  # BatchNorm's statistics moved alike


@pytest.mark.parametrize("dropout", [0.0, 0.5], ids=["dropout_off", "dropout_on"])
def test_nnx_microbatches_move_batchnorm_and_rngs_in_order(dropout: float) -> None:
    """Against a hand-written loop over the microbatches: BatchNorm's statistics and the dropout stream advance
    per microbatch, in order (the same masks as the loop draws)."""
    model, batch = net_and_batch(dropout)
    reference = nnx.clone(model)
    grad_fn = autoaccum.nnx.value_and_grad(nnx_loss, microbatch_size=8)
    got = nnx.jit(lambda m, b: grad_fn(m, b))(model, batch)
    assert_close(got, nnx_microbatch_loop(reference, batch, 8))
    assert_close(nnx.state(model), nnx.state(reference))
    assert int(model.drop.rngs.count[...]) == (3 if dropout else 0)  # 24 = 3 x 8


def nnx_linear_loss(model: Net, batch: Any) -> jax.Array:
    """Linear in the dropped units: (inverted) dropout leaves its expected gradient the dropout-off one."""
    return jnp.mean(model(batch["x"]) * batch["y"])


def test_nnx_dropout_on_is_unbiased_and_draws_per_microbatch() -> None:
    """Dropout on, statistically: over many calls (each microbatch drawing its own masks) the mean gradient is the
    dropout-off gradient of the hand-written microbatch loop, within 5 standard errors of the mean."""
    model, batch = net_and_batch(dropout=0.5)
    reference = nnx.clone(model)
    reference.drop.deterministic = True
    _, want = nnx_microbatch_loop(reference, batch, 8, nnx_linear_loss)
    grad_fn = autoaccum.nnx.value_and_grad(nnx_linear_loss, microbatch_size=8)
    calls = 64
    draws = [jax.tree.leaves(grad_fn(model, batch)[1]) for _ in range(calls)]
    assert int(model.drop.rngs.count[...]) == 3 * calls  # one draw per microbatch, 3 microbatches a call
    spread = 0.0
    for i, expected in enumerate(jax.tree.leaves(want)):
        samples = np.stack([np.asarray(d[i]) for d in draws])
        standard_error = samples.std(axis=0, ddof=1) / np.sqrt(calls)
        np.testing.assert_array_less(np.abs(samples.mean(axis=0) - expected), 5 * standard_error + ATOL)
        spread = max(spread, float(samples.std(axis=0).max()))
    assert spread > 1e-3  # the masks change from call to call: dropout is on


def test_nnx_in_the_users_step_with_optimizer_and_metrics() -> None:
    """flax's MNIST tutorial's step, with nnx.value_and_grad swapped for autoaccum's."""
    model, batch = net_and_batch(dropout=0.5)
    reference = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    want_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    grad_fn = autoaccum.nnx.value_and_grad(nnx_loss, microbatch_size=8)
    traces = []

    @nnx.jit
    def train_step(model: Net, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: Any) -> None:
        traces.append(1)
        loss, grads = grad_fn(model, batch)
        metrics.update(loss=loss)
        optimizer.update(model, grads)

    want_losses = []
    for _ in range(2):
        train_step(model, optimizer, metrics, batch)
        want_loss, grads = nnx_microbatch_loop(reference, batch, 8)
        want_optimizer.update(reference, grads)
        want_losses.append(want_loss)
    assert len(traces) == 1 and int(optimizer.step[...]) == 2
    assert_close(nnx.state(model), nnx.state(reference))
    np.testing.assert_allclose(metrics.compute()["loss"], np.mean(want_losses), atol=ATOL)


def test_a_plan_tuned_without_aux_serves_a_loss_returning_metrics() -> None:
    """``has_aux`` describes the loss passed, not a tuned choice: a plan tuned on a plain loss gives the transform
    of a step's loss returning metrics (refused before, with advice that could not be taken: a new user's case)."""
    params, batch = mlp(10)
    plan = autoaccum.Plan(effective_batch=10, microbatch_size=4, accumulation_steps=3, strategy="scan")
    want = jax.value_and_grad(loss_with_aux, has_aux=True)(params, batch)
    assert_close(jax.jit(plan.value_and_grad(loss_with_aux, has_aux=True))(params, batch), want)
    aux_plan = dataclasses.replace(plan, has_aux=True)
    assert_close(jax.jit(aux_plan.value_and_grad(loss_with_aux))(params, batch), want)
    assert_close(plan.value_and_grad(loss_fn)(params, batch), jax.value_and_grad(loss_fn)(params, batch))

    model, nnx_batch = net_and_batch(dropout=0.0)
    reference = nnx.clone(model)

    def with_metric(m: Net, b: Any) -> tuple[jax.Array, jax.Array]:
        return nnx_loss(m, b), jnp.mean(b["y"])

    (loss, metric), grads = autoaccum.nnx.value_and_grad(with_metric, plan=plan, has_aux=True)(model, nnx_batch)
    want_loss, want_grads = nnx_microbatch_loop(reference, nnx_batch, 4)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)
    assert_close(grads, want_grads)
    np.testing.assert_allclose(metric, jnp.mean(nnx_batch["y"]), atol=ATOL)


def test_nnx_plan_gives_the_transform() -> None:
    model, batch = net_and_batch(dropout=0.0)
    reference = nnx.clone(model)
    plan = autoaccum.Plan(effective_batch=24, microbatch_size=8, accumulation_steps=3, strategy="scan")
    got = autoaccum.nnx.value_and_grad(nnx_loss, plan=plan)(model, batch)
    assert_close(got, nnx_microbatch_loop(reference, batch, 8))
    with pytest.raises(ValueError, match="`microbatch_size`"):
        autoaccum.nnx.value_and_grad(nnx_loss, plan=plan, microbatch_size=4)


def test_nnx_mnist_tutorial_step_with_one_line_changed() -> None:
    """The tutorial's step, logits as aux into an Accuracy metric: equal to nnx's own on one microbatch."""
    model, batch = net_and_batch(dropout=0.0)
    batch["label"] = (batch["y"] > 0).astype(jnp.int32)
    reference = nnx.clone(model)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    want_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    want_metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))

    def train_step(value_and_grad: Any) -> Any:
        @nnx.jit
        def step(model: Net, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch: Any) -> None:
            grad_fn = value_and_grad(nnx_classifier_loss, has_aux=True)  # the one line
            (loss, logits), grads = grad_fn(model, batch)
            metrics.update(loss=loss, logits=logits, labels=batch["label"])
            optimizer.update(model, grads)

        return step

    ours = train_step(functools.partial(autoaccum.nnx.value_and_grad, microbatch_size=24))
    ours(model, optimizer, metrics, batch)
    train_step(nnx.value_and_grad)(reference, want_optimizer, want_metrics, batch)
    assert_close(metrics.compute(), want_metrics.compute())
    assert_close(nnx.state(model), nnx.state(reference))
    # Split in three microbatches, the logits are still the whole batch's rows (BatchNorm per microbatch aside).
    grad_fn = autoaccum.nnx.value_and_grad(nnx_classifier_loss, microbatch_size=8, has_aux=True)
    (_, logits), _ = grad_fn(nnx.clone(model), batch)
    assert logits.shape == (24, 2)
