"""Child processes (probe trials, the tuning worker): what they import, what reaches them, how they end."""

from __future__ import annotations

from pathlib import Path

import optax
import probe_workloads
import pytest
from click.testing import CliRunner

import autoaccum
from autoaccum._probe import prepare
from autoaccum._tune.worker import Request, TimingWorker
from autoaccum.cli import main


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


WORKLOAD_FILE = '''\
import functools

import jax.numpy as jnp
import optax
import probe_workloads

import autoaccum


def criterion(predicted, target):
    return jnp.mean((predicted - target) ** 2)


def scaled_loss(params, batch, scale):
    return scale * criterion(batch["x"] @ params["w"] + params["b"], batch["y"])


def schedule(count):
    return 0.1 / (1.0 + count)


def problem():
    return probe_workloads.linear(features=8)[1:]


def helper_in_the_loss():
    """The loss (a partial) calls a function of this file."""
    return autoaccum.Workload(functools.partial(scaled_loss, scale=2.0), *problem(), optax.sgd(0.1), name="helper")


def schedule_in_the_optimizer():
    """The loss is another module's; the optimizer's learning rate is a function of this file."""
    return autoaccum.Workload(probe_workloads.linear_loss, *problem(), optax.sgd(schedule), name="schedule")
'''


@pytest.mark.parametrize("function", ["helper_in_the_loss", "schedule_in_the_optimizer"])
def test_a_workload_files_own_functions_reach_the_children(tmp_path: Path, function: str) -> None:
    """A workload file is loaded under a name of its own, which a child cannot import: the functions it defines
    (a helper of the loss, the optimizer's schedule) still reach the probe's children."""
    (tmp_path / "wl.py").write_text(WORKLOAD_FILE)
    args = ["probe", f"{tmp_path / 'wl.py'}:{function}", "--memory-limit", "64MiB", "--max-microbatch", "8"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "microbatch 8 (the largest tried) fits" in result.output, result.output


FAILING_LOSS_FILE = """\
import sys

import jax.numpy as jnp
import optax
import probe_workloads

import autoaccum


def criterion(predicted, batch):
    if "autoaccum._child" in sys.modules:  # (only where a child traces it)
        return jnp.mean((predicted - batch["nope"]) ** 2)
    return jnp.mean((predicted - batch["y"]) ** 2)


def loss(params, batch):
    return criterion(batch["x"] @ params["w"] + params["b"], batch)


def module_level():
    return autoaccum.Workload(loss, *probe_workloads.linear(features=8)[1:], optax.sgd(0.1))


def nested():
    def inner_loss(params, batch):
        return criterion(batch["x"] @ params["w"] + params["b"], batch)

    return autoaccum.Workload(inner_loss, *probe_workloads.linear(features=8)[1:], optax.sgd(0.1))
"""


@pytest.mark.parametrize("function", ["module_level", "nested"])
def test_a_loss_raising_in_a_child_is_reported_from_the_users_file_first(tmp_path: Path, function: str) -> None:
    """The child's report leads with the exception and the user's own frames, by their file and line (a loss
    defined at the file's top level, and one defined in a function: its code travels by value), before autoaccum's."""
    path = tmp_path / "wl.py"
    path.write_text(FAILING_LOSS_FILE)
    result = CliRunner().invoke(
        main, ["probe", f"{path}:{function}", "--memory-limit", "64MiB", "--max-microbatch", "8"]
    )
    assert result.exit_code == 1, result.output
    report = result.output[result.output.index("failed: ") :]
    where = f'File "{path}", line 12, in criterion'
    assert report.startswith("failed: KeyError: 'nope'\n") and where in report, report
    assert report.index(where) < report.index("_trial.py") and "<dynamic-code>" not in report, report
