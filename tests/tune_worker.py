"""A tuning worker: ``python tests/tune_worker.py STORAGE OUT [options]`` joins one shared study.

Used by tests/test_tune.py (SQLite) and tests/test_distributed_tuning.py (PostgreSQL). Timing is faked
(deterministic) so the tests check coordination, not speed; each configuration is appended to OUT as a JSON
line when its measurement starts. The last line on stdout is the result, as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optuna
from seams import tune

from autoaccum import Update
from autoaccum._storage import open_storage
from autoaccum._worker import Timing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage", help="an RDB URL")
    parser.add_argument("out", type=Path, help="where to append the configurations this worker measures")
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--study-name", default="shared", help="'' for the default: named after the fingerprint")
    parser.add_argument("--strategies", default=None, help="comma-separated; default all")
    parser.add_argument("--salt", type=int, default=0, help="scales the loss by 1 + salt/1e6: another fingerprint")
    parser.add_argument(
        "--heartbeat", default=None, help="INTERVAL,GRACE seconds (default: the library's); none: without"
    )
    parser.add_argument("--seconds", type=float, default=0.4, help="how long a measurement takes")
    parser.add_argument("--meet", type=Path, default=None, help="a folder where the first measurement waits ...")
    parser.add_argument("--workers", type=int, default=2, help="... until this many workers are in theirs")
    parser.add_argument("--hang", action="store_true", help="never finish the first measurement (to be killed)")
    parser.add_argument("--elsewhere", action="store_true", help="own trials as a process of another host would")
    args = parser.parse_args()
    if args.elsewhere:  # no process of this host: once killed, only its trial's heartbeat going stale tells
        socket.gethostname = lambda: "another-host"

    # A linear regression made with numpy: a worker compiles nothing before it tunes.
    rows = np.random.default_rng(0).normal(size=(24, 17)).astype(np.float32)
    batch = {"x": rows[:, :16], "y": rows[:, 16]}
    params = {"w": np.zeros(16, np.float32), "b": np.zeros((), np.float32)}
    scale = 1.0 + args.salt / 1e6

    def loss_fn(params: Any, batch: Any) -> Any:
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2) * scale

    def measure(update: Update, params: Any, batch: Any) -> Timing:
        first = not args.out.exists()
        with args.out.open("a") as f:
            f.write(json.dumps([update.microbatch_size, update.strategy, sorted(update.options.items())]) + "\n")
        if first and args.hang:
            time.sleep(600)
        if first and args.meet is not None:  # every worker holds a claim at once: they really run side by side
            (args.meet / f"{args.out.name}.met").touch()
            for _ in range(600):
                if len(list(args.meet.glob("*.met"))) >= args.workers:
                    break
                time.sleep(0.05)
        time.sleep(args.seconds)
        steps = update.accumulation_steps(jax.tree.leaves(batch)[0].shape[0])
        return Timing(seconds_per_step=0.01 * steps + 0.001 * update.microbatch_size, compile_seconds=0.1, steps=5)

    storage: Any = args.storage
    if args.heartbeat == "none":
        storage = optuna.storages.RDBStorage(args.storage)
    elif args.heartbeat:
        interval, grace = (int(s) for s in args.heartbeat.split(","))
        storage = open_storage(args.storage, heartbeat_interval=interval, grace_period=grace)[0]
    result = tune(
        loss_fn, params, batch, optimizer=optax.sgd(0.1), microbatch_bound=4, budget=args.n_trials or None,
        storage=storage, study_name=args.study_name or None, measure=measure, race_rounds=0,
        strategies=args.strategies.split(",") if args.strategies else None,
    )  # fmt: skip
    plan = {"microbatch_size": result.plan.microbatch_size, "strategy": result.plan.strategy}
    summary = {"study_name": result.study_name, "fingerprint": result.fingerprint, "new_trials": result.new_trials}
    print(json.dumps({**plan, "options": result.plan.options, **summary}))


if __name__ == "__main__":
    main()
