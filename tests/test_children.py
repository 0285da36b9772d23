"""Child processes (probe trials, the tuning worker): what they import, what reaches them, how they end."""

from __future__ import annotations

from pathlib import Path

import optax
import probe_workloads
import pytest

import autoaccum
from autoaccum._probe import prepare
from autoaccum._tune.worker import Request, TimingWorker


def test_children_run_the_parents_autoaccum_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a folder holding another `autoaccum` (a checkout of the repository, with an installed autoaccum), the
    probe's children and the tuning worker import the package this process runs, not the folder's."""
    decoy = tmp_path / "autoaccum"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the working folder`s autoaccum was imported')\n")
    monkeypatch.chdir(tmp_path)
    loss_fn, params, batch = probe_workloads.linear(features=8)
    result = autoaccum.probe(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="64MiB", max_microbatch=8)
    assert result.max_microbatch == 8 and all(t.error is None for t in result.trials), result.trials
    setup = prepare(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="64MiB")
    with TimingWorker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        assert w.time(Request({"strategy": "scan"}, 4, 8, 2, 0)).status == "fits"
