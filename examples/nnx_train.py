"""A flax nnx training loop with Dropout and BatchNorm: tune the accumulation, then train with the plan.

The model and its ``nnx.Optimizer`` are written the way nnx's own docs write them; ``autoaccum.nnx.tune``
finds the microbatch and strategy for an effective batch of 128 under a memory limit, and the tuned step
updates the model and optimizer in place, each microbatch drawing its own dropout mask. BatchNorm in training
mode normalises each microbatch by its own statistics, so the tune keeps the microbatch at 16 or more
(``min_microbatch``), and the step built from the plan moves the running statistics once per update, by the
mean of the microbatches' statistics (``state_update="once"``). Run: ``python examples/nnx_train.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import autoaccum


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs) -> None:
        self.conv = nnx.Conv(1, 16, kernel_size=(3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(16, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.drop(nnx.relu(self.norm(self.conv(x))))
        return self.head(x.mean(axis=(1, 2)))


def loss_fn(model: Net, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def main(steps: int = 5) -> None:
    model = Net(rngs=nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    kx, ky = jax.random.split(jax.random.key(0))
    batch = {"image": jax.random.normal(kx, (128, 16, 16, 1)), "label": jax.random.randint(ky, (128,), 0, 10)}

    result = autoaccum.nnx.tune(
        loss_fn, model, optimizer, batch, memory_limit="512MiB", min_microbatch=16, microbatch_bound=64, budget=4,
        strategies=["scan", "loop"], storage=":memory:",
    )  # fmt: skip
    plan = result.plan
    print(f"plan: microbatch {plan.microbatch_size} x {plan.accumulation_steps}, {plan.strategy}")
    assert plan.microbatch_size >= 16
    step = autoaccum.nnx.build_update(loss_fn, plan=plan, state_update="once")  # as from Plan.load("plan.json")
    model.train()
    for i in range(steps):
        loss = step(model, optimizer, batch)  # updates model and optimizer in place
        print(f"step {i}: loss {float(loss):.4f}, BatchNorm mean[0] {float(model.norm.mean[...][0]):+.4f}")
    assert int(optimizer.step[...]) == steps
    assert bool(jnp.isfinite(loss))


if __name__ == "__main__":
    main()
