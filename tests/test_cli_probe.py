"""``autoaccum probe`` and ``autoaccum devices``: exit codes, JSON, and messages that say what is wrong."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import jax
import pytest
from click.testing import CliRunner, Result

import autoaccum
from autoaccum._device import resolve_memory_limit
from autoaccum.cli import main

WORKLOAD = "probe_workloads:workload"


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    print(result.output)  # shown when an assertion fails
    return result


def test_help_documents_exit_codes() -> None:
    result = invoke("probe", "--help")
    assert result.exit_code == 0
    assert "Exit codes: 0" in result.output and "--memory-limit" in result.output and "--no-isolate" in result.output


def test_devices_json_and_table() -> None:
    result = invoke("devices", "--json")
    assert result.exit_code == 0
    (cpu, *_) = json.loads(result.output)
    assert cpu["platform"] == "cpu" and cpu["total_bytes"] > 0 and "total_bytes" in cpu["sources"]
    table = invoke("devices")
    assert table.exit_code == 0 and "cpu" in table.output
    n = len(jax.devices("cpu"))  # (8 here: tests/conftest.py) one process's devices: a mesh over them splits the RAM
    each = autoaccum.format_bytes(resolve_memory_limit(autoaccum.detect_device(), None, devices=n)[0])
    assert f"The {n} CPU devices share the RAM: a run over all of them gets {each} per device." in table.output


def test_probe_json_in_process() -> None:
    result = invoke("probe", WORKLOAD, "--memory-limit", "256MiB", "--microbatch-cap", "48", "--no-isolate", "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["max_microbatch"] == 48 and data["runs"] == len(data["trials"]) <= 3
    assert data["device"]["platform"] == "cpu" and data["memory_limit_bytes"] == 256 * 2**20


def test_probe_human_output_and_nothing_fits_exits_1() -> None:
    result = invoke("probe", WORKLOAD, "--memory-limit", "4MiB", "--granularity", "1024", "--microbatch-cap", "4096")
    assert result.exit_code == 1
    assert "device:" in result.output and "out of memory" in result.output and "nothing fits" in result.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["no_such_module_xyz:f"], "cannot be found"),
        (["probe_workloads:nope"], "has no function 'nope'"),
        (["probe_workloads:not_a_workload"], "returned int, not an autoaccum.Workload"),
        (["probe_workloads:FEATURES"], "has 'FEATURES', but it is int, not a function"),
        (["probe_workloads:linear_loss"], "failed (TypeError: linear_loss() missing 2 required positional arguments"),
        (["missing/file.py:f"], "does not exist"),
        ([WORKLOAD, "--memory-limit", "lots"], "does not parse"),
        ([WORKLOAD, "--memory-limit", "1KB"], "alone need"),
        ([WORKLOAD, "--microbatch-cap", "0"], "--microbatch-cap"),
        ([WORKLOAD, "--granularity", "0"], "--granularity"),
        ([WORKLOAD, "--demo"], "not both"),
        ([], "give a WORKLOAD"),
    ],
    ids=["module", "function", "wrong-return", "not-callable", "arguments", "file", "limit-unparsable",
         "limit-below-state", "max-size",
         "granularity", "both", "none"],
)  # fmt: skip
def test_bad_input_exits_2_saying_what_is_wrong(args: list[str], message: str) -> None:
    result = invoke("probe", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "autoaccum/_workload.py" not in result.output  # (the user's frames only, none of the loader's)


def test_workload_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "my_workload.py"
    path.write_text(
        "import jax.numpy as jnp, optax, autoaccum\n"
        "def loss(w, b):\n    return jnp.mean((b['x'] @ w) ** 2)\n"
        "def make():\n"
        "    return autoaccum.Workload(loss, jnp.ones(4), {'x': jnp.ones((2, 4))}, optax.sgd(0.1))\n"
    )
    result = invoke("probe", f"{path}:make", "--memory-limit", "64MiB", "--microbatch-cap", "16", "--json")
    assert result.exit_code == 0  # the child unpickles `loss` by value: its module is not importable there
    assert json.loads(result.output)["max_microbatch"] == 16


def test_a_limit_above_the_ram_is_one_warning_line_and_the_ram_is_used() -> None:
    result = invoke("probe", WORKLOAD, "--memory-limit", "10TiB", "--microbatch-cap", "8", "--no-isolate")
    assert result.exit_code == 0
    (line,) = [line for line in result.output.splitlines() if "warning" in line.lower()]
    assert line.startswith("warning: `memory_limit`=10.00 TiB is above this machine's RAM"), line
    assert "fits under 10.00 TiB" not in result.output and "fits under" in result.output


HANGING = """\
import time
import jax, jax.numpy as jnp, optax, autoaccum


def make():
    def hang(x):
        time.sleep(3600)
        return x

    def loss(w, b):  # the step waits on the host forever
        stuck = jax.pure_callback(hang, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(w.sum()))
        return jnp.mean((b["x"] @ w) ** 2) + 0.0 * stuck

    return autoaccum.Workload(loss, jnp.ones(4), {"x": jnp.ones((2, 4))}, optax.sgd(0.1), name="hanging")
"""


def test_trial_timeout_ends_a_hanging_trial_and_the_running_trial_shows_its_time(tmp_path: Path) -> None:
    path = tmp_path / "hanging.py"
    path.write_text(HANGING)
    start = time.monotonic()
    result = CliRunner(env={"TTY_COMPATIBLE": "1", "COLUMNS": "100"}).invoke(
        main, ["probe", f"{path}:make", "--memory-limit", "256MiB", "--microbatch-cap", "4", "--trial-timeout", "4"]
    )
    print(result.output)
    assert result.exit_code == 1
    assert time.monotonic() - start < 120  # not the 600 s default
    assert "ran over `--trial-timeout`=4 s" in " ".join(result.output.split())  # the time-out is named, as a flag
    assert "running" in result.output and "0:00:0" in result.output  # the live line: the trial's elapsed time
    assert "--trial-timeout" in invoke("probe", "--help").output


# Workload files like scripts: a file importing its siblings loads; any failure is a clear exit 2.
def test_workload_file_imports_modules_beside_it(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text("import jax.numpy as jnp\n\ndef loss(w, b):\n    return jnp.mean(b @ w)\n")
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""\
        import jax.numpy as jnp, optax
        import autoaccum
        from models import loss

        def make():
            return autoaccum.Workload(loss, jnp.zeros(8), jnp.ones((4, 8)), optax.sgd(0.1), name="sibling")

        def broken():
            raise RuntimeError("the dataset is not downloaded")
        """)
    )
    assert autoaccum.load_workload(f"{tmp_path / 'train.py'}:make").name == "sibling"
    result = CliRunner().invoke(main, ["probe", f"{tmp_path / 'train.py'}:broken", "--memory-limit", "64MiB"])
    assert result.exit_code == 2, result.output
    assert "calling broken() from" in result.output and "the dataset is not downloaded" in result.output
    (tmp_path / "bad.py").write_text("from no_such_module import x\n")
    result = CliRunner().invoke(main, ["probe", f"{tmp_path / 'bad.py'}:make"])
    assert result.exit_code == 2 and "ModuleNotFoundError" in result.output, result.output


WIDE = """\
import jax, jax.numpy as jnp, optax
import autoaccum

def loss(params, batch):
    return jnp.mean((jax.nn.relu(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)

def workload():
    params = {"w1": jnp.zeros((256, 4096)), "w2": jnp.zeros((4096, 1))}  # the accumulator weighs 4 MiB
    batch = {"x": jnp.ones((512, 256)), "y": jnp.ones((512, 1))}
    return autoaccum.Workload(loss, params, batch, optax.sgd(0.1))
"""


def test_probe_with_an_effective_batch_answers_for_the_accumulating_step(tmp_path: Path) -> None:
    """``--effective-batch 512`` runs the step accumulating 512 examples, which also holds the accumulator and the
    whole batch: its boundary is below the one-microbatch step's (the same probe without it, the reference)."""
    (tmp_path / "wide.py").write_text(WIDE)
    spec = f"{tmp_path / 'wide.py'}:workload"
    answers = []
    for extra in ([], ["--effective-batch", "512"]):
        result = invoke("probe", spec, "--memory-limit", "24MiB", "--microbatch-cap", "512", "--json", *extra)
        assert result.exit_code == 0
        answers.append(json.loads(result.output))
    single, accumulating = answers
    assert single["effective_batch"] is None and accumulating["effective_batch"] == 512
    assert 0 < accumulating["max_microbatch"] < single["max_microbatch"], (accumulating, single)
    assert invoke("probe", spec, "--effective-batch", "0").exit_code == 2


def test_a_module_name_that_is_a_file_here_gets_its_path_suggested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``textcls:workload`` run beside ``textcls.py`` (not importable: this folder is not on the path) names the path
    to give, ``textcls.py:workload``."""
    (tmp_path / "textcls_xyz.py").write_text("def workload():\n    pass\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(autoaccum.WorkloadError, match=r"the file 'textcls_xyz.py' is here: give 'textcls_xyz.py:work"):
        autoaccum.load_workload("textcls_xyz:workload")
