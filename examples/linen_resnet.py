"""A flax linen ResNet with batch_stats and Dropout, accumulating over microbatches with its state threaded.

``autoaccum.linen.make_loss_fn`` applies the model with ``mutable=["batch_stats"]`` and a fresh dropout key per
microbatch; the update returns the new statistics and key. With ``state_update="once"`` the running statistics
move once per update, by the mean of the microbatches' statistics, as in one full-batch step (threaded, they
would take one EMA step per microbatch: 4 per update here).

BatchNorm in training mode normalises each microbatch by that microbatch's own statistics, so the microbatch
changes the model, not just the speed: this example keeps it at 16, and a tune of it would set that floor,
``autoaccum.tune(..., min_microbatch=16)``. Run: ``python examples/linen_resnet.py``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autoaccum


class Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = nn.Conv(self.features, (3, 3), use_bias=False)(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.BatchNorm(use_running_average=not train)(y)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(16, (3, 3), use_bias=False)(x)))
        x = Block(16)(x, train)
        x = Block(16)(x, train)
        x = nn.Dropout(0.2, deterministic=not train)(x.mean(axis=(1, 2)))
        return nn.Dense(10)(x)


def criterion(apply: object, batch: dict[str, jax.Array]) -> jax.Array:
    logits = apply(batch["image"], train=True)  # type: ignore[operator]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def main(steps: int = 3) -> None:
    model, tx = ResNet(), optax.sgd(0.05, momentum=0.9)
    kx, ky = jax.random.split(jax.random.key(0))
    batch = {"image": jax.random.normal(kx, (64, 16, 16, 3)), "label": jax.random.randint(ky, (64,), 0, 10)}
    variables = model.init(jax.random.key(1), batch["image"][:1], train=False)

    update = autoaccum.build_update(
        autoaccum.linen.make_loss_fn(model, criterion), tx, microbatch_size=16, has_state=True, state_update="once"
    )
    params, opt_state = variables["params"], tx.init(variables["params"])
    state = autoaccum.linen.init_state(variables, jax.random.key(2))
    start = variables["batch_stats"]  # init_state copied it: the update donates the copy, not the caller's arrays
    for i in range(steps):
        params, opt_state, loss, state = update(params, opt_state, batch, state)
        print(f"step {i}: loss {float(loss):.4f}")
    pairs = zip(jax.tree.leaves(state["batch_stats"]), jax.tree.leaves(start), strict=True)
    moved = max(float(jnp.abs(a - b).max()) for a, b in pairs)
    print(f"batch_stats moved by up to {moved:.4f} (dropping them would leave 0)")
    assert moved > 0


if __name__ == "__main__":
    main()
