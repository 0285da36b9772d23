"""``benchmarks/scaling.py`` (issue 31): its arithmetic on made-up figures, and one tiny run end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "scaling.py"


scaling = load_benchmark("scaling")


def test_spearman_matches_the_rank_formula_without_ties():
    a, b = [0.3, 0.1, 0.2, 0.5, 0.4], [10.0, 30.0, 20.0, 50.0, 60.0]
    n = len(a)
    rank = lambda x: [sorted(x).index(v) for v in x]  # noqa: E731
    d2 = sum((p - q) ** 2 for p, q in zip(rank(a), rank(b), strict=True))
    assert scaling.spearman(a, b) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-12)
    assert scaling.spearman(a, a) == pytest.approx(1.0, abs=1e-12)
    assert scaling.spearman(a, [-x for x in a]) == pytest.approx(-1.0, abs=1e-12)


def test_predicted_seconds_counts_each_program_as_often_as_it_runs():
    rates = {"flops_per_second": 10.0, "bytes_per_second": 100.0}
    opt = (20.0, 100.0)  # 2 s of compute, 1 s of memory: 2 s
    body = (50.0, 1000.0)  # 5 s of compute, 10 s of memory: 10 s
    with_opt = (body[0] + opt[0], body[1] + opt[1])
    k = 4
    assert scaling.predicted_seconds("scan", k, [with_opt], opt, rates) == pytest.approx(k * 10 + 2, abs=1e-9)
    begin = (0.0, 300.0)  # 3 s
    assert scaling.predicted_seconds("multisteps", k, [begin, with_opt], opt, rates) == pytest.approx(
        3 + k * 10 + 2, abs=1e-9
    )
    zeros, middle, last = (0.0, 100.0), (20.0, 0.0), (30.0, 0.0)  # 1, 2, 3 s
    assert scaling.predicted_seconds("loop", k, [zeros, middle, last], opt, rates) == pytest.approx(
        1 + (k - 1) * 2 + 3, abs=1e-9
    )
    assert scaling.predicted_seconds("loop", 1, [last], opt, rates) == pytest.approx(3, abs=1e-9)


def made_up_result():
    trial = lambda n, m, compile_s, median, same=None: {  # noqa: E731
        "number": n, "microbatch_size": m, "strategy": "scan", "options": {}, "remat": None,
        "compile_seconds": None if same is not None else compile_s, "seconds": None if same else [0, median, 0],
        "same_program_as": same,
    }  # fmt: skip
    trials = [trial(2, 8, None, None, same=0), trial(0, 8, 4.0, 0.5), trial(1, 16, 6.0, 0.7)]
    plan = {"microbatch_size": 8, "strategy": "scan", "options": {}, "remat": None, "accumulator_dtype": "float32"}
    probe = {"seconds": 12.0, "max_microbatch": 16, "estimate": {"seconds": 5.0}}
    return {"trials": trials, "plan": plan, "probe": probe, "race": [{"trial": 2, "times": [0.5, 0.6]}]}


def test_units_and_derived_phases_from_the_tune_json():
    figures = scaling.tune_figures({"wall_seconds": 65.0, "load": [1.0, 1.0], "exit": 0, "result": made_up_result()})
    # the race's winner (trial 2) shares trial 0's program: its compile and median step make the unit
    assert figures["pick_compile_seconds"] == 4.0 and figures["pick_step_seconds"] == 0.5
    assert figures["units"] == pytest.approx(65.0 / (4.0 + 5 * 0.5), abs=1e-12)
    phases = figures["phases"]
    assert phases["probe"] == pytest.approx(7.0, abs=1e-12) and phases["estimate"] == 5.0
    assert phases["compile"] == pytest.approx(10.0, abs=1e-12)
    assert phases["steps"] == pytest.approx(6 * (0.5 + 0.7), abs=1e-12)
    assert phases["race"] == pytest.approx(1.1, abs=1e-12)
    assert figures["other_seconds"] == pytest.approx(65.0 - sum(phases.values()), abs=1e-9)


def test_the_results_own_phases_and_units_win():
    result = {**made_up_result(), "phases": {"probe": 1.0, "compile": 2.0}, "units": 7.5, "seconds": 60.0}
    figures = scaling.tune_figures({"wall_seconds": 65.0, "load": [1.0, 1.0], "exit": 0, "result": result})
    assert figures["phases"] == {"probe": 1.0, "compile": 2.0} and figures["units"] == 7.5
    assert figures["phases_from"] == "result"


def test_grid_sizes_are_powers_of_two_within_the_bound_and_the_whole_batch_once():
    configs = scaling.grid_configs(8, 8)
    sizes = sorted({c["microbatch_size"] for c in configs})
    assert sizes == [1, 2, 4, 8]
    assert [c["microbatch_size"] for c in configs].count(8) == 1
    assert max(c["microbatch_size"] for c in scaling.grid_configs(64, 20)) == 16


def test_a_built_in_model_is_measured_at_the_batch_and_limit_given(monkeypatch):
    args = scaling.parse_args(["--workload", "cnn", "--batch", "48", "--limit", "40MiB"])
    assert scaling.models(args) == [("cnn", "cnn")]  # --workload alone: none of the LMs
    assert [name for name, _ in scaling.models(scaling.parse_args(["--workload", "mlp", "--size", "0.17M"]))] == [
        "0.17M", "mlp",
    ]  # fmt: skip
    monkeypatch.setenv(scaling.ENV, json.dumps({"builtin": "cnn", "batch": 48, "limit": "40MiB"}))
    w = scaling.workload()
    assert w.batch_size == 48 and w.memory_limit == "40MiB" and w.name == "cnn"


@pytest.mark.slow
def test_a_tiny_run_reports_every_figure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a user's run has
    env["AUTOACCUM_CACHE"] = str(tmp_path)
    command = [sys.executable, str(SCRIPT), "--shape", "16,2,1", "--batch", "2", "--seq-len", "4"]
    command += ["--limit", "64MiB", "--runs", "1", "--steps", "2", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (model,) = json.loads(done.stdout)["models"]
    (tune,) = model["tunes"]
    seconds = tune["tune_seconds"] or tune["wall_seconds"]  # the tune's own wall time where its result has it
    assert tune["units"] == pytest.approx(
        seconds / (tune["pick_compile_seconds"] + 5 * tune["pick_step_seconds"]), rel=1e-6
    )
    assert sum(tune["phases"].values()) <= seconds <= tune["wall_seconds"]
    grid = model["grid"]
    timed = [r for r in grid["rows"] if "step_seconds" in r]
    assert grid["best_examples_per_second"] == max(r["examples_per_second"] for r in timed)
    assert 0 < grid["cost_top3_over_best"] <= 1 and -1 <= grid["spearman"] <= 1
    assert grid["wall_seconds"] >= sum(r["compile_seconds"] for r in grid["rows"])
