"""The study's storage: the default cache folder, and what a resumed study prints (nothing meant for developers)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoaccum._tune.study import default_storage, open_storage

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


def test_waiting_on_a_dead_workers_trial_prints_no_experimental_warning(tmp_path: Path) -> None:
    """A study resumed while a killed worker's trial is still running in it: the tuner waits for the trial's
    heartbeat to go stale (Optuna's ``fail_stale_trials``, "experimental"), then measures it. Its stderr stays
    free of Optuna's ExperimentalWarning and its source line."""
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    victim_log, survivor_log = tmp_path / "victim.jsonl", tmp_path / "survivor.jsonl"
    victim = start(storage, victim_log, "--hang")
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
