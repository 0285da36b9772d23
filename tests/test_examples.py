"""Smoke tests: every script in examples/ runs to completion, every benchmark answers --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


def test_there_are_examples() -> None:
    assert {
        "mlp.py",
        "linear.py",
        "transformer.py",
        "nnx_train.py",
        "linen_resnet.py",
        "padded_lm.py",
        "remat_knobs.py",
    } <= {p.name for p in EXAMPLES}


# linear.py (a few seconds) stands for all in `pytest -q`; the others train real models for tens of seconds.
@pytest.mark.parametrize(
    "script",
    [pytest.param(p, marks=[] if p.name == "linear.py" else [pytest.mark.slow]) for p in EXAMPLES],
    ids=lambda p: p.name,
)
def test_example_runs(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.stdout.strip()


BENCHMARKS = sorted((Path(__file__).parent.parent / "benchmarks").glob("*.py"))


# Each script's --help imports jax and autoaccum in a fresh interpreter: one stands for all in `pytest -q`.
@pytest.mark.parametrize(
    "script",
    [pytest.param(p, marks=[pytest.mark.slow] if i else []) for i, p in enumerate(BENCHMARKS)],
    ids=lambda p: p.name,
)
def test_benchmarks_run_as_scripts(script: Path) -> None:
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
