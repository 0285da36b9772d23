"""The update across processes: 2 processes x 2 CPU devices under ``jax.distributed`` (gloo collectives).

Each process runs tests/multihost_worker.py: it feeds its half of each global batch with
``jax.make_array_from_process_local_data`` and runs the same ``autoaccum.build_update`` on a mesh over all 4
devices. Both processes' results must equal the single-process full-batch step, computed here without the
library (``jax.grad`` on the whole batch, optax), atol 1e-6 in float32.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import multihost_worker as worker
import numpy as np
import optax
import pytest

ATOL = 1e-6  # float32, values near 1: a few ulps (the devices sum their rows in another order)
PROCESSES, LOCAL_DEVICES = 2, 2
TIMEOUT = 300  # seconds for both processes together; a process that fails ends the other at once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(tmp_path: Path) -> list[dict[str, Any]]:
    """Starts the worker processes and waits for them; on a failure or a hang, ends them and shows their logs."""
    port = free_port()
    # Each process's own devices; the test process's XLA_FLAGS (tests/conftest.py) are not theirs.
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
        "JAX_PLATFORMS": "cpu",
    }
    script = Path(worker.__file__)
    outs = [tmp_path / f"out{i}.json" for i in range(PROCESSES)]
    logs = [tmp_path / f"log{i}.txt" for i in range(PROCESSES)]
    procs = []
    for i in range(PROCESSES):
        with open(logs[i], "w") as log:
            argv = [sys.executable, str(script), str(i), str(PROCESSES), str(port), str(outs[i])]
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if None not in codes or any(codes):  # all done, or one failed: the others would wait for it
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * PROCESSES:
        shown = "\n".join(f"--- process {i} (exit {c}):\n{logs[i].read_text()[-6000:]}" for i, c in enumerate(codes))
        timed_out = " (timed out)" if time.monotonic() > deadline else ""
        raise AssertionError(f"worker processes failed{timed_out}:\n{shown}")
    return [json.loads(out.read_text()) for out in outs]


def reference(case: worker.Case) -> dict[str, Any]:
    """`UPDATES` optimizer steps on the whole batch's gradient, in one process on one device, without autoaccum."""
    batch = jax.tree.map(jnp.asarray, worker.batch(case))
    params = jax.tree.map(jnp.asarray, worker.params())

    def loss_fn(p: Any, b: Any) -> jax.Array:
        if case.state:
            loss_sum, weight = worker.sum_loss(p, b)
            return loss_sum / weight
        return worker.mean_loss(p, b)

    optimizer = worker.optimizer()
    opt_state = optimizer.init(params)
    losses = []
    for _ in range(worker.UPDATES):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(loss)
    state = None
    if case.state:
        # Each device threads its own state through its own microbatches (ceil(B / m) of them, every device
        # the same number) and the float leaf is averaged over the devices after each update: each device added
        # its rows' targets, so the average grows by sum(y) / devices per update.
        devices = PROCESSES * LOCAL_DEVICES
        microbatches = -(-case.batch_size // case.microbatch_size)
        seen = worker.SEEN0 + worker.UPDATES * np.sum(batch["y"]) / devices
        state = {"count": worker.UPDATES * microbatches, "seen": seen}
    return {"params": params, "losses": losses, "state": state}


@pytest.mark.slow
def test_two_processes_equal_the_single_process_step(tmp_path: Path) -> None:
    results = run_processes(tmp_path)
    for i, got in enumerate(results):
        assert (got["process_count"], got["device_count"]) == (PROCESSES, PROCESSES * LOCAL_DEVICES), f"process {i}"
        for case in worker.CASES:
            want = reference(case)
            where = f"process {i}, case {case.name}"
            for key in ("w", "b"):
                np.testing.assert_allclose(
                    got[case.name]["params"][key], want["params"][key], rtol=0, atol=ATOL, err_msg=where
                )
            np.testing.assert_allclose(got[case.name]["losses"], want["losses"], rtol=0, atol=ATOL, err_msg=where)
            if case.state:
                assert got[case.name]["state"]["count"] == want["state"]["count"], where
                np.testing.assert_allclose(
                    got[case.name]["state"]["seen"], want["state"]["seen"], rtol=0, atol=ATOL, err_msg=where
                )
    assert results[0] == results[1]  # every process holds the same replicated result
