"""A tuning worker for tests/test_tune.py: ``python tests/tune_worker.py STORAGE OUT`` joins one shared study.

Timing is faked (deterministic) so the test checks coordination, not speed; each measured configuration is
appended to OUT as a JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax

from autoaccum import Update, tune, workloads
from autoaccum._tune.timing import Timing


def main(storage: str, out: str) -> None:
    w = workloads.linear(batch_size=24, features=16)

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        with open(out, "a") as f:
            f.write(json.dumps([update.microbatch_size, update.strategy, sorted(update.options.items())]) + "\n")
        time.sleep(0.4)  # long enough for the two workers' studies to overlap
        steps = update.accumulation_steps(jax.tree.leaves(batch)[0].shape[0])
        return Timing(seconds_per_step=0.01 * steps + 0.001 * update.microbatch_size, compile_seconds=0.1, steps=5)

    result = tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, max_microbatch=4, n_trials=16, storage=storage,
        study_name="shared", measure=measure,
    )  # fmt: skip
    print(json.dumps({"microbatch_size": result.plan.microbatch_size, "strategy": result.plan.strategy}))


if __name__ == "__main__":
    main(*sys.argv[1:])
