"""``autoaccum tune`` on the command line: exit codes, human and JSON output, the saved plan."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import jax
import pytest
from click.testing import CliRunner, Result

from autoaccum import Plan
from autoaccum._device import device_kind
from autoaccum.cli import main

LINEAR = "autoaccum.workloads:linear"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def explain(result: Result) -> str:
    return f"exit {result.exit_code}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_tune_prints_table_and_saves_plan(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = run(
        "tune", LINEAR, "--microbatch-bound", "16", "--budget", "2", "--storage", ":memory:", "--out", str(out)
    )
    assert result.exit_code == 0, explain(result)
    assert "trials (best first" in result.stdout and "race: the finalists" in result.stdout
    words = " ".join(result.stdout.split())  # (rich wraps long lines at the terminal's width, at any space)
    resident = " \\(resident memory\\)" if jax.default_backend() == "cpu" else ""  # (the CPU's terms)
    assert re.search(rf"measured peak [0-9.]+ [KMG]iB{resident}", words) and "ms [" in words
    assert "best plan" in result.stdout
    assert "autoaccum.Plan.load" in result.stdout
    bar = re.search(r"(trial \d+|probing \+ tuning) +━+ +(\d+|\?)/", result.output)
    assert bar is None, bar  # off a terminal, no progress bar (its last frame was left in the file)
    plan = Plan.load(out)
    assert plan.effective_batch == 64 and plan.microbatch_size <= 16


def test_plot_of_peak_memory_against_throughput(tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "tune.png"
    result = run(
        "tune", LINEAR, "--microbatch-bound", "16", "--budget", "3", "--storage", ":memory:", "--race-rounds", "1",
        "--memory-limit", "512MiB", "--plot", str(path),
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    assert f"plot saved to {path}" in " ".join(result.stdout.split()), explain(result)  # (as `plan` says)
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (750, 450)


def test_remat_policies_searched_from_the_command_line() -> None:
    result = run(
        "tune", LINEAR, "--microbatch-bound", "8", "--strategy", "loop", "--remat", "dots_saveable", "--storage",
        ":memory:", "--race-rounds", "0", "--json", "--remat", "dots_saveable",  # repeated, as --strategy may be
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    trials = json.loads(result.stdout)["trials"]
    assert {t["remat"] for t in trials} == {None, "dots_saveable"}
    bad = run("tune", LINEAR, "--microbatch-bound", "8", "--remat", "most_saveable", "--storage", ":memory:")
    assert bad.exit_code == 2 and "remat" in bad.output


def test_tune_json(tmp_path: Path) -> None:
    result = run("tune", LINEAR, "--microbatch-bound", "8", "--budget", "2", "--storage", ":memory:", "--json")
    assert result.exit_code == 0, explain(result)
    data = json.loads(result.stdout)
    assert data["plan"]["effective_batch"] == 64
    assert len(data["trials"]) == 2 and data["trials"][0]["state"] == "COMPLETE"
    assert data["probe"] is None
    (tmp_path / "plan.json").write_text(json.dumps(data["plan"]))  # the plan in it is a plan file (no "format" before)
    assert Plan.load(tmp_path / "plan.json").microbatch_size == data["plan"]["microbatch_size"]


def test_tune_bad_input_exits_2(tmp_path: Path) -> None:
    assert run("tune").exit_code == 2
    result = run("tune", "no/such/file.py:workload")
    assert result.exit_code == 2 and "does not exist" in result.stderr, explain(result)
    result = run("tune", "autoaccum.workloads:nope")
    assert result.exit_code == 2 and "has no function 'nope'" in result.stderr, explain(result)
    for command in ("tune", "probe", "plan"):  # with --json, the error on stdout too, as exit 1's is
        result = run(command, "no/such/file.py:workload", "--json")
        assert result.exit_code == 2 and "does not exist" in result.stderr, explain(result)
        answer = json.loads(result.stdout)
        assert answer["exit_code"] == 2 and "does not exist" in answer["error"], explain(result)
    result = run("tune", LINEAR, "--budget", "many", "--json")  # an option click itself refuses
    assert result.exit_code == 2 and "'many' is not a valid integer" in json.loads(result.stdout)["error"]
    result = run("tune", LINEAR, "--storage", "nosuchdb://x", "--microbatch-bound", "4")
    assert result.exit_code == 2 and "cannot be opened" in result.stderr, explain(result)
    result = run("tune", LINEAR, "--effective-batch", "0")
    assert result.exit_code == 2, explain(result)
    result = run("tune", LINEAR, "--strategy", "fast")
    assert result.exit_code == 2, explain(result)


def test_workload_returning_the_wrong_thing(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("def workload():\n    return 42\n")
    result = run("tune", f"{script}:workload", "--microbatch-bound", "4")
    assert result.exit_code == 2 and "returned int, not an autoaccum.Workload" in result.stderr, explain(result)


def test_an_unusable_cache_folder_is_bad_input_naming_the_variable(tmp_path: Path) -> None:
    result = CliRunner(env={"AUTOACCUM_CACHE": "/proc/nope"}).invoke(
        main, ["tune", LINEAR, "--microbatch-bound", "4", "--budget", "1"], catch_exceptions=False
    )
    assert result.exit_code == 2, explain(result)
    assert "`AUTOACCUM_CACHE`='/proc/nope' cannot hold the study database" in result.stderr, explain(result)
    assert "--storage :memory:" in result.stderr and "Traceback" not in result.output, explain(result)


STATEFUL = """\
import jax.numpy as jnp, optax, autoaccum


def loss_fn(w, batch, state):  # the model state counts the examples it has seen
    return jnp.mean((batch["x"] @ w - batch["y"]) ** 2), state + batch["x"].shape[0]


def workload():
    batch = {"x": jnp.ones((8, 4)), "y": jnp.zeros(8)}
    return autoaccum.Workload(loss_fn, jnp.ones(4), batch, optax.sgd(0.1), state=jnp.zeros((), jnp.int32))
"""


def test_the_printed_snippet_runs_on_a_workload_with_model_state(tmp_path: Path) -> None:
    from autoaccum import load_workload

    path, out = tmp_path / "stateful.py", tmp_path / "plan.json"
    path.write_text(STATEFUL)
    result = run(
        "tune", f"{path}:workload", "--microbatch-bound", "4", "--budget", "1", "--race-rounds", "0", "--storage",
        ":memory:", "--no-isolate", "--out", str(out),
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    code = result.stdout[result.stdout.index("import autoaccum") :]
    w = load_workload(f"{path}:workload")
    scope = dict(loss_fn=w.loss_fn, optimizer=w.optimizer, params=w.params, batch=w.batch, state=w.state)
    exec(code, scope)  # the snippet as printed
    assert int(scope["state"]) == 8, code  # one update: the state saw the batch's 8 examples


NNX_WORKLOAD = """
import jax.numpy as jnp, optax, autoaccum
from flax import nnx

def loss_fn(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)

def make():
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

def workload():
    return autoaccum.nnx.workload(loss_fn, *make(), {"x": jnp.ones((8, 4)), "y": jnp.zeros(8)})
"""


def test_the_printed_snippet_runs_on_an_nnx_workload_and_a_rerun_names_the_flag(tmp_path: Path) -> None:
    """An nnx workload's snippet is the nnx way (`autoaccum.nnx.build_update`, a step on the model and its
    nnx.Optimizer): the pytree one failed on them. A re-run resumes, and says how to start over: --fresh."""
    import importlib.util

    import numpy as np

    path, out = tmp_path / "nnx_workload.py", tmp_path / "plan.json"
    path.write_text(NNX_WORKLOAD)
    args = ["tune", f"{path}:workload", "--microbatch-bound", "4", "--budget", "1", "--race-rounds", "0",
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--no-isolate", "--out", str(out)]  # fmt: skip
    result = run(*args)
    assert result.exit_code == 0, explain(result)
    code = result.stdout[result.stdout.index("import autoaccum") :]
    spec = importlib.util.spec_from_file_location("nnx_workload", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    model, optimizer = module.make()
    before = np.array(model.kernel[...])
    scope = dict(loss_fn=module.loss_fn, model=model, optimizer=optimizer, batch=module.workload().batch)
    exec(code, scope)  # the snippet as printed
    assert np.isfinite(float(scope["loss"])) and not np.allclose(model.kernel[...], before), code
    again = run(*args)
    assert again.exit_code == 0 and "resumed" in again.stdout, explain(again)
    words = " ".join(again.stdout.split())
    assert "pass --fresh to start over" in words and "fresh=True" not in words, explain(again)
    as_json = run(*args, "--json")  # (its message said fresh=True: a new user's report)
    assert "pass --fresh to start over" in json.loads(as_json.stdout)["message"], explain(as_json)


def test_a_study_name_of_another_setup_names_the_fresh_flag(tmp_path: Path) -> None:
    args = ["tune", LINEAR, "--budget", "1", "--race-rounds", "0", "--study-name", "mine", "--no-isolate",
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}"]  # fmt: skip
    assert run(*args, "--microbatch-bound", "4").exit_code == 0
    other = run(*args, "--microbatch-bound", "2")
    assert other.exit_code == 2 and "pass --fresh to start it over" in " ".join(other.output.split()), explain(other)
    assert "fresh=True" not in other.output, explain(other)


@pytest.mark.parametrize("option", ["--out", "--plot"])
def test_an_output_file_that_cannot_be_written_is_refused_before_anything_runs(option: str, tmp_path: Path) -> None:
    path = tmp_path / "missing" / "plan.json"
    result = CliRunner().invoke(main, ["tune", LINEAR, "--storage", ":memory:", option, str(path)])
    assert result.exit_code == 2, explain(result)
    assert f"{option} " in result.output and "does not exist; make it first" in result.output, explain(result)
    assert "trial" not in result.output.lower(), explain(result)  # refused before the probe and the trials


def test_off_a_terminal_nothing_is_cut_or_wrapped(tmp_path: Path) -> None:
    result = CliRunner(env={"COLUMNS": "80"}).invoke(  # a terminal's width (pytest-xdist sets it): not this output's
        main, ["tune", LINEAR, "--microbatch-bound", "16", "--budget", "3", "--storage", ":memory:",
               "--race-rounds", "2", "--no-isolate"], catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    lines = result.stdout.splitlines()
    headers = ("microbatch", "steps", "strategy", "examples/s", "step time", "peak", "compile s", "state")
    assert any(all(h in line for h in headers) for line in lines), explain(result)  # the trials' header, whole
    assert any("relative step time" in line and "examples/s (median)" in line for line in lines), explain(result)
    assert "…" not in result.stdout, explain(result)
    (best,) = [line for line in lines if line.startswith("best plan")]
    assert best.endswith(f"examples/s on {device_kind()}"), explain(result)  # one line, not wrapped at 80 columns


def test_on_a_narrow_terminal_lines_fit_and_words_are_whole() -> None:
    result = CliRunner(env={"TTY_COMPATIBLE": "1", "COLUMNS": "60"}).invoke(  # rich takes this for a terminal
        main, ["tune", LINEAR, "--microbatch-bound", "16", "--budget", "3", "--storage", ":memory:",
               "--race-rounds", "2", "--no-isolate"], catch_exceptions=False,
    )  # fmt: skip
    assert result.exit_code == 0, explain(result)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", result.stdout)  # no colours, no cursor moves
    lines = [line.split("\r")[-1] for line in text.splitlines()]  # a live line's last state
    too_long = [line for line in lines if len(line) > 60]
    assert not too_long, explain(result)
    words = " ".join(" ".join(lines).split())  # lines wrapped at spaces join back into their sentences
    assert "examples, strategy " in words and f"examples/s on {device_kind()}" in words, explain(result)
    assert "#0: microbatch " in words or "│ microbatch" in text, explain(result)


def test_the_race_table_shows_the_figure_the_race_ranks_by(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's race once named a winner at 1,294.8 examples/s over a finisher at 1,306.4: by raw medians, over
    rounds run at different speeds of the machine. The table shows the relative step time it ranks by."""
    from autoaccum import TrialRecord, TuneResult
    from autoaccum._tune.race import Runner

    plan = Plan(effective_batch=64, microbatch_size=8, accumulation_steps=8, strategy="scan", throughput=1294.8)
    trials = tuple(
        TrialRecord(n, m, 64 // m, s, {}, 1300.0, 0.1, "COMPLETE") for n, m, s in ((0, 8, "scan"), (1, 16, "loop"))
    )
    race = (Runner(0, (64 / 1294.8,), 4, None, 0.971), Runner(1, (64 / 1306.4,), 4, None, 1.013))
    fake = TuneResult(plan, trials, race, None, None, None, "s", ":memory:", "f", 0, 2, "new study s: 2 trials")
    monkeypatch.setattr("autoaccum._tune.run.tune", lambda *args, **kwargs: fake)
    result = run("tune", LINEAR, "--storage", ":memory:")
    assert result.exit_code == 0, explain(result)
    (winner,) = [line for line in result.stdout.splitlines() if "winner: the plan" in line]
    (finisher,) = [line for line in result.stdout.splitlines() if "finished" in line]
    assert "0.971" in winner and "1,294.8" in winner and "1.013" in finisher and "1,306.4" in finisher
    assert "relative step time" in result.stdout and "The race ranks by it" in " ".join(result.stdout.split())


def test_a_bad_value_is_named_by_its_flag() -> None:
    """The library names its arguments (`min_microbatch`); on the command line the error names the flags given."""
    result = run("tune", LINEAR, "--min-microbatch", "600", "--effective-batch", "512", "--storage", ":memory:")
    words = " ".join(result.output.split())
    assert result.exit_code == 2 and "`--min-microbatch`=600 is above" in words and "`--effective-batch`=512" in words


def test_a_trials_reason_names_the_flags() -> None:
    """A failed trial's reason (the library's words) names the command's flags on the command line."""
    from autoaccum._tune.result import TrialRecord
    from autoaccum.cli.tune import _describe
    from autoaccum.cli.tune import tune as tune_command

    reason = "timed out: stepping ran over `trial_timeout`=8 s and the worker was killed (raise `trial_timeout`)"
    record = TrialRecord(3, 4, 2, "scan", {}, None, None, "FAIL", reason=reason)
    with click.Context(tune_command):
        assert "ran over `--trial-timeout`=8 s" in _describe(record) and "raise `--trial-timeout`" in _describe(record)
