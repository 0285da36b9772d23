"""``benchmarks/malloc.py``: its table on made-up figures, and one tiny run end to end (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "malloc.py"
malloc = load_benchmark("malloc")


def test_the_settings_are_the_workers_and_each_half_of_it():
    from autoaccum._isolation import _CPU_MALLOC

    s = malloc.SETTINGS
    assert s["default"] == {} and s["worker"] == _CPU_MALLOC
    assert {**s["one arena"], **s["thresholds"]} == _CPU_MALLOC and not s["one arena"].keys() & s["thresholds"].keys()


def test_the_table_gives_each_figure_over_the_defaults():
    seconds = {"default": {"a": 2.0, "b": 0.5}, "worker": {"a": 3.0, "b": 1.0}}
    ratios = {n: {k: v / seconds["default"][k] for k, v in m.items()} for n, m in seconds.items()}
    rows = malloc.table({"seconds": seconds, "ratios": ratios}).splitlines()
    assert rows[0] == "| setting | a | b |" and rows[3] == "| worker | 3.000 (1.50x) | 1.000 (2.00x) |"


@pytest.mark.slow
def test_a_tiny_run_times_every_setting_in_a_process_of_its_own():
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--runs", "1", "--steps", "2", "--json"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert list(report["seconds"]) == list(malloc.SETTINGS)
    for setting, figures in report["seconds"].items():
        assert len(figures) == 5 and all(v > 0 for v in figures.values()), (setting, figures)
    assert all(r == 1.0 for r in report["ratios"]["default"].values())
