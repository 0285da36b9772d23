"""The user's loss is checked in the caller before any child starts: its own errors, with its own file and line."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp

from autoaccum._preflight import initial_loss

WORKLOAD = """
import jax.numpy as jnp
import optax
import autoaccum


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"]
    return jnp.mean((pred - batch["nope"]) ** 2)  # the user's bug


def workload():
    batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros(16)}
    return autoaccum.Workload(loss_fn, {"w": jnp.zeros((4,))}, batch, optax.sgd(0.1))
"""


def test_the_cli_shows_a_loss_error_in_the_users_file_before_any_trial(tmp_path: Path) -> None:
    path = tmp_path / "wl.py"
    path.write_text(textwrap.dedent(WORKLOAD))
    for command in ("tune", "probe"):
        result = subprocess.run(
            [sys.executable, "-m", "autoaccum", command, f"{path}:workload", "--memory-limit", "64MiB"],
            capture_output=True, text=True, timeout=120, cwd=tmp_path,
        )  # fmt: skip
        output = result.stdout + result.stderr
        assert result.returncode == 2, output
        assert "raised KeyError: 'nope'" in output and f'File "{path}", line 9, in loss_fn' in output, output
        assert "# the user's bug" in output
        assert "trial" not in output.split("raised")[0] and "_worker.py" not in output and "guarded" not in output


def test_initial_loss_unpacks_state_aux_and_sums() -> None:
    params, batch = jnp.ones(2), jnp.arange(6.0).reshape(3, 2)

    def loss(
        p: jnp.ndarray, b: jnp.ndarray, s: jnp.ndarray
    ) -> tuple[tuple[tuple[jnp.ndarray, jnp.ndarray], int], jnp.ndarray]:
        total = (b @ p).sum()
        return ((total, jnp.float32(b.shape[0])), 0), s

    value = initial_loss(loss, params, batch, state=jnp.zeros(()), has_aux=True, loss_reduction="sum", rows=2)
    assert value == 0.0 + 1 + 2 + 3  # rows 0 and 1 of the batch, summed: a reference by hand
