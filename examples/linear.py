"""Linear regression on 512-d inputs with an uneven split: 100 examples in microbatches of 32 (32+32+32+4).

Every example still weighs 1/100, so the step is exactly the full-batch step. The learning rate follows a
schedule that advances once per accumulated step. Run: ``python examples/linear.py``.
"""

from __future__ import annotations

import optax

import autoaccum
from autoaccum import workloads


def main(steps: int = 30) -> None:
    w = workloads.linear(batch_size=100)
    optimizer = optax.sgd(optax.exponential_decay(0.05, transition_steps=10, decay_rate=0.5))
    update = autoaccum.build_update(w.loss_fn, optimizer, microbatch_size=32, strategy="loop")
    print(f"{update.accumulation_steps(w.batch_size)} microbatches per step (strategy={update.strategy})")
    params, opt_state = w.params, update.init(w.params)
    first = None
    for step in range(steps):
        params, opt_state, loss = update(params, opt_state, w.batch)
        first = float(loss) if first is None else first
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  mse {float(loss):.4f}")
    assert float(loss) < first


if __name__ == "__main__":
    main()
