"""The README stays true: its Python snippets run, its commands are the ones CI and users run."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from autoaccum import workloads

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
BASH = re.findall(r"```bash\n(.*?)```", README, re.S)
PYTHON = re.findall(r"```python\n(.*?)```", README, re.S)


def test_opens_with_two_commands() -> None:
    assert README.index("```bash") < README.index("```python")
    demo, tests = (block.strip() for block in BASH[:2])
    assert demo == "pip install -e . && autoaccum tune --demo --budget 6"
    assert tests == 'pip install -e ".[test]" && pytest -q'


def test_ci_runs_the_readme_test_command_exactly() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert BASH[1].strip() in ci


@pytest.mark.parametrize(
    "snippet",
    [pytest.param(s, marks=[pytest.mark.slow] if re.search(r"\b(tune|probe)\(", s) else []) for s in PYTHON],
    ids=[f"snippet{i}" for i in range(len(PYTHON))],
)
def test_python_snippet_runs(snippet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "README.md", "exec"), {"__name__": "__readme__"})


@pytest.mark.slow  # the demo's whole tune: minutes on 2 shared cores
def test_demo_command_runs(tmp_path: Path) -> None:
    """The README's first command, after its install step: the main job on the demo workload."""
    command = BASH[0].strip().split("&&", 1)[1].strip()
    argv = shlex.split(command)
    assert argv[0] == "autoaccum"
    env = {**os.environ, "AUTOACCUM_CACHE": str(tmp_path)}  # a fresh study, not the user's cache
    result = subprocess.run(
        [sys.executable, "-m", "autoaccum", *argv[1:]], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "best plan" in result.stdout
    # The demo's story: under its memory limit the effective batch does not fit in one step; the plan accumulates.
    batch, _, limit = workloads.DEMO["cpu"]
    assert f"memory limit {limit}" in result.stdout and "does not fit in one step" in result.stdout
    split = rf"microbatch (\d+) x (\d+) steps( \(the last \d+\))? = {batch} examples"  # (an uneven split: its last)
    steps = re.search(rf"best plan.*: {split}", result.stdout)
    assert steps is not None and int(steps.group(2)) > 1, result.stdout
    # Trials over the limit fail as out of memory in the worker, which goes on serving (no other failure).
    assert "failed in the worker" not in result.stdout and "timed out" not in result.stdout, result.stdout
