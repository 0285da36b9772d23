"""The optax gradient-accumulation tutorial's MLP [32, 32, 10] on 28x28x1 images.

Trains with 4 microbatches of 16 per step of 64 examples and checks that one accumulated step equals one
full-batch step. Run: ``python examples/mlp.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import autoaccum
from autoaccum import workloads


def main(steps: int = 20) -> None:
    w = workloads.mlp(batch_size=64)
    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=16)  # 4 accumulation steps

    # One accumulated step equals one step on the whole batch (donate=False keeps w.params readable).
    check = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=16, donate=False)
    accumulated, _, _ = check(w.params, check.init(w.params), w.batch)
    grads = jax.grad(w.loss_fn)(w.params, w.batch)
    updates, _ = w.optimizer.update(grads, w.optimizer.init(w.params), w.params)
    full = optax.apply_updates(w.params, updates)
    gap = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(accumulated), jax.tree.leaves(full), strict=True)
    )
    print(f"max |accumulated - full batch| after one step: {gap:.2e}")
    assert gap < 1e-5

    params = jax.tree.map(jnp.array, w.params)
    opt_state = update.init(params)
    for step in range(steps):
        params, opt_state, loss = update(params, opt_state, w.batch)
        if step % 5 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
