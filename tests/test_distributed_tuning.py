"""Several workers (one per host in real life) tune one study through PostgreSQL, Optuna's RDB storage.

The tests need a PostgreSQL database: ``AUTOACCUM_TEST_POSTGRES=postgresql://...``, which `.ci/postgres` sets
(``.ci/postgres pytest -q tests/test_distributed_tuning.py`` starts a throwaway one). Without it they are
skipped, except under CI (``CI`` set), where skipping would hide them: there they fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy

WORKER = Path(__file__).parent / "tune_worker.py"
GRID = 16  # microbatch 1..4 x (scan, scan:unroll=2, scan:unroll=8, loop)


@pytest.fixture
def postgres() -> Iterator[str]:
    """The URL of a database of this test's own, dropped after it (tests run side by side: a study or Optuna's
    tables made by one are not another's)."""
    url = os.environ.get("AUTOACCUM_TEST_POSTGRES")
    if not url:
        reason = "AUTOACCUM_TEST_POSTGRES is not set; `.ci/postgres pytest -q tests/test_distributed_tuning.py` sets it"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (under CI these tests must run, not be skipped)")
        pytest.skip(reason)
    name = f"test_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
        yield sqlalchemy.engine.make_url(url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def close(storage: optuna.storages.RDBStorage) -> None:
    storage.remove_session()
    storage.engine.dispose()


def load(url: str, name: str) -> list[optuna.trial.FrozenTrial]:
    """The trials of study ``name``, read once."""
    storage = optuna.storages.RDBStorage(url)
    try:
        return optuna.load_study(study_name=name, storage=storage).get_trials()
    finally:
        close(storage)


def start(url: str, log: Path, *options: str) -> subprocess.Popen[str]:
    """A worker on the study of the tiny linear workload (``--salt``: this test's own fingerprint)."""
    command = [sys.executable, str(WORKER), url, str(log), "--study-name", "", "--strategies", "scan,loop", *options]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(worker: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = worker.communicate(timeout=120)
    assert worker.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def wait_for(log: Path, worker: subprocess.Popen[str]) -> None:
    """Until ``worker`` has started measuring (its log exists)."""
    for _ in range(1200):
        if log.exists() or worker.poll() is not None:
            break
        time.sleep(0.05)
    assert log.exists(), f"the worker never started a trial: {worker.communicate()}"


def measured(log: Path) -> list[tuple[Any, ...]]:
    """The configurations a worker started measuring, in order."""
    if not log.exists():
        return []
    return [tuple(json.dumps(x) for x in json.loads(line)) for line in log.read_text().splitlines()]


def settled_configurations(trials: list[optuna.trial.FrozenTrial]) -> list[tuple[Any, ...]]:
    return [
        tuple(sorted(t.params.items()))
        for t in trials
        if "duplicate_of" not in t.user_attrs
        and (t.state == optuna.trial.TrialState.COMPLETE or "reason" in t.user_attrs)
    ]


@pytest.mark.parametrize(
    ("n_trials", "settles"),
    [(5, 5), pytest.param(GRID, GRID, marks=pytest.mark.slow)],  # the whole grid: the same sharing, more trials
    ids=["tpe-budget=5", "grid-every-point"],
)
def test_two_workers_share_the_budget_and_measure_each_configuration_once(
    postgres: str, tmp_path: Path, n_trials: int, settles: int
) -> None:
    """Asked for ``n_trials`` each, two workers settle ``n_trials`` configurations together (the study's budget,
    not one each; one more where both claimed the last slot at once), run side by side, measure a configuration
    at most twice (each worker's sampler has the same seed: on their own they would start on the same point, and
    measure every point twice), and return the same best plan."""
    salt = str(uuid.uuid4().int % 10**6)
    logs = [tmp_path / f"worker{i}.jsonl" for i in range(2)]
    workers = [
        start(postgres, log, "--n-trials", str(n_trials), "--salt", salt, "--seconds", "0.2", "--meet", str(tmp_path))
        for log in logs
    ]
    results = [finish(w) for w in workers]

    assert results[0]["study_name"] == results[1]["study_name"] == f"autoaccum-{results[0]['fingerprint']}"
    configurations = settled_configurations(load(postgres, results[0]["study_name"]))
    assert settles <= len(set(configurations)) <= min(settles + 1, GRID)
    both = measured(logs[0]) + measured(logs[1])
    assert measured(logs[0]) and measured(logs[1]), "both workers measured"
    assert all(both.count(c) <= 2 for c in both), "a configuration measured at most twice"
    assert len(both) <= len(set(both)) + 1, "twice only where two workers claimed it at once"
    assert results[0] == {**results[1], "new_trials": results[0]["new_trials"]}  # the same plan, the same study
    # each counts its own: both counted every trial the study settled while it ran (a reviewer's report)
    assert len(set(configurations)) <= sum(r["new_trials"] for r in results) <= len(set(configurations)) + 1


def test_a_killed_workers_trial_is_requeued_and_finished_by_the_other(postgres: str, tmp_path: Path) -> None:
    """A worker of another host killed (SIGKILL) mid-trial leaves its trial RUNNING; its heartbeat goes stale (1 s
    beats, 3 s grace here; 30 s and 90 s by default), the other worker fails it, Optuna's
    RetryHeartbeatStaleTrialCallback queues it again and the other worker measures it: the study ends with every
    configuration settled once."""
    salt = str(uuid.uuid4().int % 10**6)
    common = ("--salt", salt, "--heartbeat", "1,3", "--seconds", "0.1")
    victim_log, survivor_log = tmp_path / "victim.jsonl", tmp_path / "survivor.jsonl"
    victim = start(postgres, victim_log, *common, "--hang", "--elsewhere")
    survivor = start(postgres, survivor_log, *common)
    wait_for(victim_log, victim)
    wait_for(survivor_log, survivor)  # both are measuring
    victim.send_signal(signal.SIGKILL)
    victim.communicate(timeout=30)
    result = finish(survivor)

    trials = load(postgres, result["study_name"])
    killed = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(killed) == 1 and "reason" not in killed[0].user_attrs
    retried = [t for t in trials if t.system_attrs.get("failed_trial") == killed[0].number]
    assert [t.state for t in retried] == [optuna.trial.TrialState.COMPLETE]
    assert retried[0].params == killed[0].params
    configurations = settled_configurations(trials)
    assert len(configurations) == len(set(configurations)) == GRID
    (hung,) = measured(victim_log)
    assert len(measured(survivor_log)) == len(set(measured(survivor_log))) == GRID
    assert hung in measured(survivor_log)  # finished by the other worker
