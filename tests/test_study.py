"""The study's storage: the default cache folder, and what a resumed study prints (nothing meant for developers)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import optuna
import pytest
from helpers import constant_measure, linear_problem
from seams import tune

from autoaccum._storage import default_storage, open_storage

WORKER = Path(__file__).parent / "tune_worker.py"
GRID = 16  # microbatch 1..4 x (scan, scan:unroll=2, scan:unroll=8, loop)


@pytest.mark.parametrize("where", ["/proc/nope", "a-file"])
def test_an_unusable_cache_folder_names_the_variable_and_the_fix(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if where == "a-file":
        (tmp_path / "a-file").write_text("")
        where = str(tmp_path / "a-file")
    monkeypatch.setenv("AUTOACCUM_CACHE", where)
    unusable = r"`AUTOACCUM_CACHE`='.*' cannot hold the study database .*set AUTOACCUM_CACHE"
    with pytest.raises(ValueError, match=unusable):
        default_storage()
    with pytest.raises(ValueError, match=r"storage=':memory:'"):
        open_storage(None)
    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path / "made" / "here"))  # a folder that can be made is
    assert default_storage() == f"sqlite:///{tmp_path / 'made' / 'here' / 'studies.db'}"


def test_a_cache_folder_whose_database_is_another_file_says_to_move_it_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "studies.db").write_text("not a database")
    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"not a database.*move '.*studies\.db' aside"):
        open_storage(None)


def test_a_cache_folder_is_the_folder_named_whatever_its_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's path went into the SQLite URL unescaped: 'run?a=1' and 'run?b=2' shared run/studies.db (the
    second resumed the first's study), and 'pc%41t' could not be opened."""
    for name in ("run?a=1", "run?b=2", "pc%41t"):
        monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path / name))
        storage, _ = open_storage(None)
        optuna.create_study(storage=storage, study_name="s")
        assert (tmp_path / name / "studies.db").is_file(), sorted(p.name for p in tmp_path.rglob("*"))
    assert not (tmp_path / "run").exists()


def start(storage: str, log: Path, *options: str) -> subprocess.Popen[str]:
    command = [sys.executable, str(WORKER), storage, str(log), "--strategies", "scan,loop", "--heartbeat", "1,2",
               "--seconds", "0.05", *options]  # fmt: skip
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def wait_until(condition: object, worker: subprocess.Popen[str]) -> None:
    for _ in range(2400):
        if condition() or worker.poll() is not None:  # type: ignore[operator]
            return
        time.sleep(0.05)


@pytest.mark.slow
def test_waiting_on_a_dead_workers_trial_prints_no_experimental_warning(tmp_path: Path) -> None:
    """A study resumed while a killed worker's trial (of another host) is still running in it: the tuner waits for
    the trial's heartbeat to go stale (Optuna's ``fail_stale_trials``, "experimental"), then measures it. Its
    stderr stays free of Optuna's ExperimentalWarning and its source line."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    victim_log, survivor_log = tmp_path / "victim.jsonl", tmp_path / "survivor.jsonl"
    victim = start(storage, victim_log, "--hang", "--elsewhere")
    wait_until(victim_log.exists, victim)
    survivor = start(storage, survivor_log)
    wait_until(lambda: len(lines(survivor_log)) >= GRID - 1, survivor)  # all but the victim's: it waits now
    victim.kill()
    victim.communicate(timeout=30)
    out, err = survivor.communicate(timeout=120)
    assert survivor.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "ExperimentalWarning" not in err and "fail_stale_trials" not in err, err
    (hung,) = lines(victim_log)
    assert hung in lines(survivor_log), "the dead worker's trial was measured again"
    assert json.loads(out.strip().splitlines()[-1])["new_trials"] >= GRID - 1


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat", ["1,3600", "none"])
def test_a_killed_runs_trial_on_this_host_is_not_waited_for(tmp_path: Path, heartbeat: str) -> None:
    """A tune killed (SIGKILL: no Ctrl-C handler runs) mid-trial leaves its trial RUNNING. The next run on the same
    host sees that the trial's process has ended and re-queues the trial at once, long before its heartbeat's grace
    period (an hour here) would end, or where the storage keeps no heartbeats (the trial stayed RUNNING for ever,
    its configuration never measured: a reviewer's report); it measures the trial itself, before anything new (here,
    a grid: first; behind the search, after what the killed run had queued already)."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    victim_log, next_log = tmp_path / "victim.jsonl", tmp_path / "next.jsonl"
    victim = start(storage, victim_log, "--hang", "--heartbeat", heartbeat)
    wait_until(victim_log.exists, victim)
    victim.kill()
    victim.communicate(timeout=30)
    rerun = start(storage, next_log, "--heartbeat", heartbeat)
    try:
        out, err = rerun.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        rerun.kill()
        pytest.fail("the next run waited on the killed run's trial")
    assert rerun.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    (hung,) = lines(victim_log)
    assert lines(next_log)[:1] == [hung], "the killed run's trial was not measured again first"
    assert json.loads(out.strip().splitlines()[-1])["new_trials"] >= GRID - 1


@pytest.mark.slow
def test_a_worker_with_no_slot_left_waits_without_queueing_again(tmp_path: Path) -> None:
    """Two workers, a budget of 3: once the fast one finds every slot claimed (the slow one measuring the last), it
    waits for it. It re-queued its over-budget configuration at once, round after round, writing a trial each
    time (69 of them in a reviewer's run)."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    slow_log, fast_log = tmp_path / "slow.jsonl", tmp_path / "fast.jsonl"
    slow = start(storage, slow_log, "--n-trials", "3", "--seconds", "4")
    wait_until(slow_log.exists, slow)
    fast = start(storage, fast_log, "--n-trials", "3")
    for worker in (slow, fast):
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    trials = optuna.load_study(study_name="shared", storage=storage).get_trials()
    over = [t for t in trials if "over_budget" in t.user_attrs]
    assert len(over) <= 2, [(t.number, t.state.name, t.params) for t in trials]


def test_a_retried_copy_of_a_killed_trial_is_not_failed_for_its_inherited_claim(tmp_path: Path) -> None:
    """Optuna's retry of a dead worker's trial copies its user attributes, the claim of the dead process among
    them: until the worker that took the copy claims it, another worker failed it again as the dead process's, and
    the worker measuring it then crashed ("Cannot tell a FAIL trial"; a reviewer's report). A claim names its
    trial's number: an inherited one is not the copy's."""
    from autoaccum._tune.study import MEASURES, fail_stale_trials, owner

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host, boot, _ = owner().split(" ", 2)
    dead = f"{host} {boot} {done.stdout.strip()}"  # a process of this host that has ended
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'studies.db'}")
    study = optuna.create_study(storage=storage)
    killed, copy = study.ask(), study.ask()
    killed.set_user_attr(MEASURES, [dead, killed.number])
    copy.set_user_attr(MEASURES, [dead, killed.number])  # inherited, not yet claimed by its new worker
    fail_stale_trials(study, storage)
    states = {t.number: t.state for t in study.get_trials()}
    assert states[killed.number] == optuna.trial.TrialState.FAIL
    assert states[copy.number] == optuna.trial.TrialState.RUNNING


def test_a_study_name_given_again_for_another_setup_is_refused(tmp_path: Path) -> None:
    """A ``study_name`` given by hand for a changed model and optimizer: the study holds the first tune's trials,
    so the second tune refuses it before anything runs, naming study_name and fresh=True (it resumed them and
    returned the first model's plan); with fresh=True it tunes anew."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    params, batch = linear_problem()
    kw: dict[str, Any] = dict(microbatch_bound=4, budget=2, storage=storage, study_name="mine", race_rounds=0)
    first = tune(lambda p, b: jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2), params, batch,
                 optimizer=optax.sgd(0.1), measure=constant_measure([]), **kw)  # fmt: skip

    def other(p: Any, b: Any) -> jax.Array:
        return jnp.mean(jnp.abs(b["x"] @ p["w"] - b["y"]))

    calls: list[tuple[int, str]] = []
    with pytest.raises(ValueError, match=r"`study_name`='mine' holds the trials of another tune .* fresh=True"):
        tune(other, params, batch, optimizer=optax.adam(1e-3), measure=constant_measure(calls), **kw)
    assert calls == []
    again = tune(other, params, batch, optimizer=optax.adam(1e-3), measure=constant_measure(calls), fresh=True, **kw)
    assert again.resumed_trials == 0 and calls and again.fingerprint != first.fingerprint


# Stale results: a changed loss body and optimizer (same function name) is a new study, never the old answer.
def test_changed_loss_and_optimizer_never_resume_the_old_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path))  # the default storage, in a fresh folder
    params, batch = linear_problem()

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    calls: list[tuple[int, str]] = []
    kw: dict[str, Any] = dict(
        microbatch_bound=12, strategies=["scan", "loop"], budget=4, measure=constant_measure(calls), race_rounds=0
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


def test_a_study_timed_in_this_process_is_not_resumed_by_an_isolated_tune(tmp_path: Path) -> None:
    """Trials timed here (``isolate=False``) ran under no cap: an isolated tune of the same setup, where a step over
    the limit fails, starts its own study (it resumed the other's: a reviewer's report)."""
    import autoaccum
    from autoaccum import workloads

    w = workloads.linear(batch_size=8, features=4)
    kw: dict[str, Any] = dict(optimizer=w.optimizer, microbatch_bound=4, strategies=["scan"], budget=1, race_rounds=0,
                              memory_limit="64MiB", storage=f"sqlite:///{tmp_path / 'studies.db'}")  # fmt: skip
    here = autoaccum.tune(w.loss_fn, w.params, w.batch, isolate=False, **kw)
    isolated = autoaccum.tune(w.loss_fn, w.params, w.batch, **kw)
    assert here.fingerprint != isolated.fingerprint and isolated.resumed_trials == 0


# Library hygiene: no Optuna trial lines in the user's log (nor a failed trial's traceback: the tuner reports
# why), and the user's verbosity is left as it was.
def test_tune_prints_no_optuna_trial_lines(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    import optuna

    before = optuna.logging.get_verbosity()
    from autoaccum._worker import TrialFailed

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
