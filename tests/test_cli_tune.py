"""``autoaccum tune`` on the command line: exit codes, human and JSON output, the saved plan."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from autoaccum import Plan
from autoaccum.cli import main

LINEAR = "autoaccum.workloads:linear"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def explain(result: Result) -> str:
    return f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_tune_prints_table_and_saves_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = run(
        "tune", LINEAR, "--max-microbatch", "16", "--n-trials", "2", "--storage", ":memory:", "--out", str(out)
    )
    assert result.exit_code == 0, explain(result)
    assert "trials (best first" in result.stdout and "race: the finalists" in result.stdout
    words = " ".join(result.stdout.split())  # (rich wraps long lines at the terminal's width, at any space)
    assert "measured peak" in words and "ms [" in words  # the spread: median [quartiles]
    assert "best plan" in result.stdout
    assert "autoaccum.Plan.load" in result.stdout
    plan = Plan.load(out)
    assert plan.effective_batch == 64 and plan.microbatch_size <= 16


def test_plot_of_peak_memory_against_throughput(tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "tune.png"
    result = run(
        "tune", LINEAR, "--max-microbatch", "16", "--n-trials", "3", "--storage", ":memory:", "--race-rounds", "1",
        "--memory-limit", "512MiB", "--plot", str(path),
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (750, 450)


def test_remat_policies_searched_from_the_command_line() -> None:
    result = run(
        "tune", LINEAR, "--max-microbatch", "8", "--strategy", "loop", "--remat", "dots_saveable", "--storage",
        ":memory:", "--race-rounds", "0", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    trials = json.loads(result.stdout)["trials"]
    assert {t["remat"] for t in trials} == {None, "dots_saveable"}
    bad = run("tune", LINEAR, "--max-microbatch", "8", "--remat", "most_saveable", "--storage", ":memory:")
    assert bad.exit_code == 2 and "remat" in bad.output


def test_tune_json(tmp_path: Path) -> None:
    result = run("tune", LINEAR, "--max-microbatch", "8", "--n-trials", "2", "--storage", ":memory:", "--json")
    assert result.exit_code == 0, explain(result)
    data = json.loads(result.stdout)
    assert data["plan"]["effective_batch"] == 64
    assert len(data["trials"]) == 2 and data["trials"][0]["state"] == "COMPLETE"
    assert data["probe"] is None


def test_tune_bad_input_exits_2(tmp_path: Path) -> None:
    assert run("tune").exit_code == 2
    result = run("tune", "no/such/file.py:workload")
    assert result.exit_code == 2 and "does not exist" in result.stderr, explain(result)
    result = run("tune", "autoaccum.workloads:nope")
    assert result.exit_code == 2 and "has no function 'nope'" in result.stderr, explain(result)
    result = run("tune", LINEAR, "--storage", "nosuchdb://x", "--max-microbatch", "4")
    assert result.exit_code == 2 and "cannot be opened" in result.stderr, explain(result)
    result = run("tune", LINEAR, "--effective-batch", "0")
    assert result.exit_code == 2, explain(result)
    result = run("tune", LINEAR, "--strategy", "fast")
    assert result.exit_code == 2, explain(result)


def test_workload_returning_the_wrong_thing(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("def workload():\n    return 42\n")
    result = run("tune", f"{script}:workload", "--max-microbatch", "4")
    assert result.exit_code == 2 and "returned int, not an autoaccum.Workload" in result.stderr, explain(result)


def test_an_unusable_cache_folder_is_bad_input_naming_the_variable(tmp_path: Path) -> None:
    result = CliRunner(env={"AUTOACCUM_CACHE": "/proc/nope"}).invoke(
        main, ["tune", LINEAR, "--max-microbatch", "4", "--n-trials", "1"], catch_exceptions=False
    )
    assert result.exit_code == 2, explain(result)
    assert "`AUTOACCUM_CACHE`='/proc/nope' cannot hold the study database" in result.stderr, explain(result)
    assert "--storage :memory:" in result.stderr and "Traceback" not in result.output, explain(result)
