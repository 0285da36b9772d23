"""A small flax.nnx transformer language model (pre-norm attention + MLP blocks, next-token cross-entropy).

Trains a few steps of 32 sequences accumulated over microbatches of 8 with each strategy and prints the
throughput. Run: ``python examples/transformer.py``.
"""

from __future__ import annotations

import time

import jax

import autoaccum
from autoaccum import strategies, workloads


def main(steps: int = 5) -> None:
    w = workloads.transformer(batch_size=32)
    for name in strategies.available():
        update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=8, strategy=name)
        params = jax.tree.map(jax.numpy.array, w.params)  # a copy: the update donates what it is given
        opt_state = update.init(params)
        params, opt_state, loss = update(params, opt_state, w.batch)  # compiles
        jax.block_until_ready(loss)
        start = time.perf_counter()
        for _ in range(steps):
            params, opt_state, loss = update(params, opt_state, w.batch)
        jax.block_until_ready(loss)
        rate = steps * w.batch_size / (time.perf_counter() - start)
        print(f"{name:>10}: loss {float(loss):.4f}  {rate:8.1f} examples/s")


if __name__ == "__main__":
    main()
