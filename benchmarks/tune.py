"""Tuned plan vs exhaustive grid on the example transformer, in one run.

The grid times every microbatch x every strategy variant the tuner could pick (the same candidates and the
same timing function); the tuner runs its default study. Both winners are then re-timed side by side
(interleaved rounds, median) so the ratio compares like with like on a noisy machine.

Run: ``python benchmarks/tune.py [--effective-batch 64] [--rounds 5]``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import jax
import optax
import optuna

import autoaccum
from autoaccum import strategies, workloads
from autoaccum._tune.space import microbatch_candidates, variants
from autoaccum._tune.timing import time_update


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effective-batch", type=int, default=64)
    parser.add_argument("--max-microbatch", type=int, default=None, help="skip the probe (default: probe)")
    parser.add_argument("--rounds", type=int, default=5, help="side-by-side re-timing rounds")
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    w = workloads.transformer(batch_size=args.effective_batch, seq_len=args.seq_len)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, optax {optax.__version__}"
    )
    names = list(strategies.available())

    start = time.perf_counter()
    result = autoaccum.tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, storage=":memory:", max_microbatch=args.max_microbatch
    )
    tune_seconds = time.perf_counter() - start
    bound = result.probe.max_microbatch if result.probe is not None else args.max_microbatch
    measured = [r for r in result.trials if r.state in ("COMPLETE", "FAIL")]
    print(f"tune: {len(measured)} trials in {tune_seconds:.1f} s (probe bound {bound})")

    labels = variants(names)
    sizes = microbatch_candidates(args.effective_batch, bound)
    start = time.perf_counter()
    grid: dict[tuple[int, str], float] = {}
    for m in sizes:
        for label, (name, options) in labels.items():
            update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=m, strategy=name, **options)
            timing = time_update(update, w.params, w.batch)
            grid[(m, label)] = args.effective_batch / timing.seconds_per_step
    grid_seconds = time.perf_counter() - start
    grid_best = max(grid, key=grid.__getitem__)
    print(f"grid: {len(grid)} configurations in {grid_seconds:.1f} s")

    plan = result.plan
    tuned_label = next(k for k, v in labels.items() if v == (plan.strategy, plan.options))
    contenders = {"tuned plan": (plan.microbatch_size, tuned_label), "grid best": grid_best}
    updates = {
        key: autoaccum.build_update(
            w.loss_fn, w.optimizer, microbatch_size=m, strategy=labels[label][0], **labels[label][1]
        )
        for key, (m, label) in contenders.items()
    }
    rates: dict[str, list[float]] = {key: [] for key in contenders}
    for _ in range(args.rounds):
        for key, update in updates.items():
            rates[key].append(args.effective_batch / time_update(update, w.params, w.batch).seconds_per_step)
    median = {key: statistics.median(values) for key, values in rates.items()}

    searches = {"tuned plan": (tune_seconds, len(measured)), "grid best": (grid_seconds, len(grid))}
    rows: list[tuple[Any, ...]] = [
        (key, f"{m} x {label}", f"{median[key]:,.0f}", f"{searches[key][0]:.1f}", searches[key][1])
        for key, (m, label) in contenders.items()
    ]
    print(f"\neffective batch {args.effective_batch}, transformer (seq {args.seq_len}), side-by-side medians:\n")
    print("| | microbatch x strategy | examples/s | search seconds | configurations timed |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(
        f"\nthroughput ratio tuned / grid best: {median['tuned plan'] / median['grid best']:.3f} (goal >= 0.95); "
        f"search time ratio tuned / grid: {tune_seconds / grid_seconds:.2f} (goal < 1)"
    )


if __name__ == "__main__":
    main()
