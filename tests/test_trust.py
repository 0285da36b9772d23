"""Answers that can be trusted: each test here failed on the code before the layout issue (#9) and passes now."""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import probe_workloads
import pytest
from click.testing import CliRunner
from seams import tune

import autoaccum
from autoaccum import Update
from autoaccum._isolation import payload
from autoaccum._probe import prepare
from autoaccum._tune.timing import Timing
from autoaccum.cli import main

ROOT = Path(__file__).parent.parent


def constant_measure(calls: list[tuple[int, str]]) -> Any:
    def measure(update: Update, params: Any, batch: Any) -> Timing:
        calls.append((update.microbatch_size, update.strategy))
        return Timing(seconds_per_step=0.01 * update.microbatch_size**0.5, compile_seconds=0.1, steps=5)

    return measure


def linear_problem(batch_size: int = 12) -> tuple[Any, Any]:
    params = {"w": jnp.zeros(4), "b": jnp.zeros(())}
    batch = {"x": jnp.ones((batch_size, 4)), "y": jnp.ones(batch_size)}
    return params, batch


# 1. Stale results: a changed loss body and optimizer (same function name) is a new study, never the old answer.
def test_changed_loss_and_optimizer_never_resume_the_old_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path))  # the default storage, in a fresh folder
    params, batch = linear_problem()

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    calls: list[tuple[int, str]] = []
    kw: dict[str, Any] = dict(
        microbatch_bound=12, strategies=["scan", "loop"], measure=constant_measure(calls), race_rounds=0
    )
    first = tune(loss_fn, params, batch, optimizer=optax.sgd(0.1), **kw)
    assert first.resumed_trials == 0 and first.new_trials >= len(calls) > 0  # one-step configurations: timed once

    def loss_fn(p: Any, b: Any) -> jax.Array:  # type: ignore[no-redef]  # same name, another body
        return jnp.mean(jnp.abs(b["x"] @ p["w"] + p["b"] - b["y"]))

    calls.clear()
    second = tune(loss_fn, params, batch, optimizer=optax.adam(1e-3), **kw)
    assert second.fingerprint != first.fingerprint and second.study_name != first.study_name
    assert second.resumed_trials == 0 and second.new_trials >= len(calls) > 0  # it timed, for itself

    calls.clear()
    again = tune(loss_fn, params, batch, optimizer=optax.adam(1e-3), **kw)  # the same setup: resumed, says so
    assert again.fingerprint == second.fingerprint and calls == []
    assert again.message.startswith(f"resumed: {second.new_trials} trials from earlier runs, 0 new")
    fresh = tune(loss_fn, params, batch, optimizer=optax.adam(1e-3), fresh=True, **kw)
    assert fresh.resumed_trials == 0 and fresh.new_trials >= len(calls) > 0


def test_the_fingerprint_sees_the_optimizers_hyperparameters_and_the_memory_limit() -> None:
    params, batch = linear_problem()
    loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)  # noqa: E731
    kw: dict[str, Any] = dict(
        microbatch_bound=12, strategies=["scan"], storage=":memory:", measure=constant_measure([])
    )
    a = tune(loss_fn, params, batch, optimizer=optax.sgd(0.1), **kw).fingerprint
    b = tune(loss_fn, params, batch, optimizer=optax.sgd(0.1, momentum=0.9), **kw).fingerprint
    c = tune(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="1GiB", **kw).fingerprint
    assert len({a, b, c}) == 3


# 2. Warm start: the largest candidate first, also when the effective batch has few divisors (B=96: 96, not 64).
def test_warm_start_enqueues_the_largest_candidate() -> None:
    params, batch = linear_problem(96)
    calls: list[tuple[int, str]] = []
    result = tune(
        lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), params, batch, optimizer=optax.sgd(0.1),
        microbatch_bound=96, strategies=["scan", "loop"], budget=3, storage=":memory:",
        measure=constant_measure(calls),
    )  # fmt: skip
    first = min(result.trials, key=lambda r: r.number)  # the warm start's ladder begins at the largest
    assert (first.microbatch_size, first.strategy) == (96, "scan") and calls[0][0] == 96


# 4. Big models: a trial's payload carries shapes, not the parameters' values.
def test_probe_payload_carries_shapes_not_weights() -> None:
    params = {"w": jnp.zeros((4096, 4096)), "b": jnp.zeros(4096)}  # 64 MiB of weights
    batch = {"x": jnp.ones((2, 4096))}
    setup = prepare(
        lambda p, b: jnp.mean(b["x"] @ p["w"] + p["b"]), params, batch, optimizer=optax.sgd(0.1),
        memory_limit="2GiB",
    )  # fmt: skip
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(setup.job.params))
    data = payload(setup.job, "cpu", [setup.job.loss_fn])
    assert len(data) < 2**20, len(data)  # the 64 MiB are not in it
    assert pickle.loads(data)[1] == "cpu"


# 5. Hung children: a per-trial time limit, reported as the trial's reason.
def test_a_hung_trial_is_killed_and_reported() -> None:
    _, params, batch = probe_workloads.linear()
    with pytest.raises(autoaccum.ProbeError, match=r"timed out: the trial ran over 15 s") as caught:
        autoaccum.probe(
            probe_workloads.hang_past_64, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB",
            microbatch_cap=128, granularity=32, trial_timeout=15,
        )  # fmt: skip
    assert caught.value.trial.microbatch_size > 64 and not caught.value.trial.fits


# 10. Workload files like scripts: a file importing its siblings loads; any failure is a clear exit 2.
def test_workload_file_imports_modules_beside_it(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text("import jax.numpy as jnp\n\ndef loss(w, b):\n    return jnp.mean(b @ w)\n")
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
        import jax.numpy as jnp, optax
        import autoaccum
        from models import loss

        def make():
            return autoaccum.Workload(loss, jnp.zeros(8), jnp.ones((4, 8)), optax.sgd(0.1), name="sibling")

        def broken():
            raise RuntimeError("the dataset is not downloaded")
        """)
    )
    assert autoaccum.load_workload(f"{tmp_path / 'train.py'}:make").name == "sibling"
    result = CliRunner().invoke(main, ["probe", f"{tmp_path / 'train.py'}:broken", "--memory-limit", "64MiB"])
    assert result.exit_code == 2, result.output
    assert "calling broken() from" in result.output and "the dataset is not downloaded" in result.output
    (tmp_path / "bad.py").write_text("from no_such_module import x\n")
    result = CliRunner().invoke(main, ["probe", f"{tmp_path / 'bad.py'}:make"])
    assert result.exit_code == 2 and "ModuleNotFoundError" in result.output, result.output


# 11. Library hygiene: no Optuna trial lines in the user's log (nor a failed trial's traceback: the tuner reports
# why), and the user's verbosity is left as it was.
def test_tune_prints_no_optuna_trial_lines(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    import optuna

    before = optuna.logging.get_verbosity()
    from autoaccum._tune.timing import TrialFailed

    params, batch = linear_problem()
    measure = constant_measure([])

    def failing_at_12(update: Any, params: Any, batch: Any) -> Any:
        if update.microbatch_size == 12:
            raise TrialFailed("out of memory in the worker (a test's)")
        return measure(update, params, batch)

    with caplog.at_level(logging.INFO):
        result = tune(
            lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2), params, batch, optimizer=optax.sgd(0.1),
            microbatch_bound=12, strategies=["scan"], budget=2, storage=":memory:", measure=failing_at_12,
        )  # fmt: skip
    out, err = capfd.readouterr()
    assert any(t.reason and "a test's" in t.reason for t in result.trials)  # the failure is reported, by the tuner
    assert "Trial 0 f" not in out + err + caplog.text and "Traceback" not in out + err + caplog.text
    assert optuna.logging.get_verbosity() == before


# The layout: an installed autoaccum creates no top-level `strategies` module, and benchmarks run as scripts.
def test_no_top_level_strategies_module() -> None:
    code = "import importlib.util, autoaccum.strategies; print(importlib.util.find_spec('strategies'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None"


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmarks_run_as_scripts(script: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
