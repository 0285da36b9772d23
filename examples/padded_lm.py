"""A padded language model batch with token weights: the update's gradient is the whole batch's token mean.

Sequences of different lengths are padded to one length; the right loss is the mean over the real tokens of
the whole batch. Averaging per-microbatch means ("mean of means") weighs the tokens of short sequences more:
a well-known silent bug. ``loss_reduction="sum"`` accumulates summed token losses and token counts and divides
once. Run: ``python examples/padded_lm.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autoaccum
from autoaccum import workloads


def main() -> None:
    model = workloads.TransformerLM(vocab=256, dim=64, heads=4, layers=2, max_len=32, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, 256)
    lengths = jnp.array([33, 4, 9, 33, 6, 18, 3, 31, 33, 10, 5, 22, 33, 7, 12, 26])
    batch = {"tokens": tokens, "mask": (jnp.arange(33)[None, :] < lengths[:, None]).astype(jnp.float32)}

    def token_sums(params: Any, batch: Any) -> tuple[jax.Array, jax.Array]:
        """(sum of the real tokens' losses, number of real tokens): what loss_reduction="sum" takes."""
        logits = nnx.merge(graphdef, params, rest)(batch["tokens"][:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])
        real = batch["mask"][:, 1:]
        return jnp.sum(losses * real), jnp.sum(real)

    def token_mean(params: Any, batch: Any) -> jax.Array:
        total, count = token_sums(params, batch)
        return total / count

    tx = optax.sgd(1.0)
    update = autoaccum.build_update(token_sums, tx, microbatch_size=4, loss_reduction="sum", donate=False)
    stepped, _, loss = update(params, tx.init(params), batch)

    def step(grads: Any) -> Any:
        return optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])

    grad = jax.jit(jax.grad(token_mean))
    expected = step(grad(params, batch))  # one step on the whole batch's token mean
    quarters = [jax.tree.map(lambda x, i=i: x[i : i + 4], batch) for i in range(0, 16, 4)]
    mean_of_means = step(jax.tree.map(lambda *g: sum(g) / 4, *(grad(params, q) for q in quarters)))

    def gap(a: Any, b: Any) -> float:
        pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(params), strict=True)
        num = sum(float(jnp.sum((x - y) ** 2)) for x, y, _ in pairs)
        den = sum(float(jnp.sum((y - p) ** 2)) for _, y, p in zip(*map(jax.tree.leaves, (a, b, params)), strict=True))
        return (num / den) ** 0.5  # relative to the size of the step

    print(f"token-mean loss {float(loss):.4f} (full batch: {float(token_mean(params, batch)):.4f})")
    print(f"mean of microbatch means: step {gap(mean_of_means, expected):.1%} off the token-mean step")
    print(f"loss_reduction='sum':     step {gap(stepped, expected):.1e} off it")
    assert gap(stepped, expected) < 1e-4 < 1e-2 < gap(mean_of_means, expected)


if __name__ == "__main__":
    main()
