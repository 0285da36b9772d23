"""A tuning study is an Optuna study: optuna-dashboard opens it and shows each trial's configuration and measures.

The test tunes a tiny model into a SQLite file, starts ``optuna-dashboard`` on it (a subprocess on a free port of
127.0.0.1) and reads the trials back through the dashboard's HTTP API, as its pages do.
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import optax
import pytest

import autoaccum

DASHBOARD = shutil.which("optuna-dashboard")
pytestmark = [
    pytest.mark.skipif(DASHBOARD is None, reason='optuna-dashboard is not installed (pip install -e ".[test]" has it)'),
    pytest.mark.slow,  # a real tune: tens of seconds on 2 shared cores
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, autoaccum.TuneResult]]:
    """A tuned study in a SQLite file, served by optuna-dashboard: (its base URL, the tune's result)."""

    def loss_fn(w: jnp.ndarray, batch: dict[str, jnp.ndarray]) -> jnp.ndarray:
        return jnp.mean((jnp.tanh(batch["x"] @ w) - batch["y"]) ** 2)

    batch = {"x": jnp.ones((32, 8)), "y": jnp.zeros(32)}
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    result = autoaccum.tune(loss_fn, jnp.zeros(8), batch, optimizer=optax.sgd(0.1), budget=3, storage=storage)
    port = free_port()
    assert DASHBOARD is not None
    log = tmp_path / "dashboard.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [DASHBOARD, storage, "--host", "127.0.0.1", "--port", str(port), "--quiet"], stdout=out, stderr=out
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # until it answers (bounded: 60 s)
            try:
                get(f"{base}/api/studies")
                break
            except (urllib.error.URLError, ConnectionError):
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"optuna-dashboard did not start:\n{log.read_text()}")
                time.sleep(0.2)
        yield base, result
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_the_dashboard_shows_each_trial_configuration_and_measures(dashboard: tuple[str, Any]) -> None:
    """Each completed trial shows its microbatch and strategy (parameters), its knobs, step times and measured peak
    (user attributes) and its throughput (the objective: the effective batch over the median step time)."""
    base, result = dashboard
    studies = get(f"{base}/api/studies")["study_summaries"]
    assert [s["study_name"] for s in studies] == [result.study_name], studies
    assert studies[0]["directions"] == ["maximize"]
    trials = [t for t in get(f"{base}/api/studies/{studies[0]['study_id']}")["trials"] if t["state"] == "Complete"]
    assert trials
    records = {r.number: r for r in result.trials}
    for trial in trials:
        params = {p["name"]: p["param_external_value"] for p in trial["params"]}
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        record = records[trial["number"]]
        assert int(params["microbatch_size"]) == record.microbatch_size, (params, record)
        assert params["strategy"].split(":")[0] == record.strategy, (params, record)
        assert {"remat", "accumulator_dtype", "knobs"} <= attrs.keys(), attrs  # the knobs, searched or not
        assert json.loads(attrs["knobs"]) == {} and attrs["accumulator_dtype"] == "float32", attrs
        throughput = float(trial["values"][0])
        assert throughput == pytest.approx(record.throughput, rel=1e-9), (throughput, record)
        if "same_program_as" in attrs or "duplicate_of" in attrs:  # reused another trial's measurement
            continue
        times = sorted(json.loads(attrs["times"]))
        median = statistics.median(times)
        assert throughput == pytest.approx(result.plan.effective_batch / median, rel=1e-6), (throughput, times)
        assert int(attrs["peak_bytes"]) >= 0, attrs  # the peak measured in the isolated worker, in bytes
