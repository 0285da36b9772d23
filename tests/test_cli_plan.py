"""``autoaccum plan``: the human table, JSON, the catalog listing, the plot and bad input (exit codes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import pytest
from click.testing import CliRunner, Result

import autoaccum
from autoaccum._catalog import names
from autoaccum.cli import main

WORKLOAD = "autoaccum.workloads:linear"  # tiny: compiles fast
CNN = "autoaccum.workloads:cnn"  # activations dominate: a small budget makes it accumulate


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", *args])


def check(result: Result, code: int) -> None:
    assert result.exit_code == code, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"


@pytest.mark.slow  # (29 s; the GPU compiles: test_plan_compiles_each_gpu_target, the CLI: test_out_writes_...)
def test_human_table_for_gpus_and_a_memory_budget() -> None:
    result = run(CNN, "--effective-batch", "1024", "--gpu", "A100-40GB", "--gpu", "l4", "--memory-limit", "64MiB")
    check(result, 0)
    out = result.output
    assert "A100-40GB" in out and "L4" in out and "64.00 MiB" in out
    assert "1024 x 1" in out  # fits in one step on the GPUs
    assert "roofline ESTIMATE" in out and "nothing was run" in out
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in out


@pytest.mark.slow
def test_json_output() -> None:
    result = run(CNN, "--effective-batch", "1024", "--gpu", "H100", "--memory-limit", "64MiB", "--json")
    check(result, 0)
    data = json.loads(result.stdout)
    h100, budget = data["targets"]
    # the H100 is compiled for by XLA's GPU compiler when the gpu-plan extra is installed (tests/test_gpu_plan.py)
    gpu = data["gpu_compiler"] is None
    # the default strategy, auto, is scan for a GPU and loop for a convnet on the CPU (the proxy without the extra)
    assert data["effective_batch"] == 1024 and data["strategy"] == ("scan" if gpu else "loop")
    assert data["workload"] == "cnn"
    assert h100["target"] == "H100-80GB" and h100["accelerator"] == "H100-80GB"
    assert h100["fits_in_one_step"] and h100["accumulation_steps"] == 1 and h100["step_seconds"] > 0
    assert h100["bound"] in ("compute", "memory")
    assert budget["accelerator"] is None and budget["accumulation_steps"] > 1 and budget["step_seconds"] is None
    assert budget["peak_bytes"] <= budget["memory_limit_bytes"] == 64 * 2**20
    assert data["estimate"]["points"] and data["estimate"]["platform"] == ("gpu" if gpu else "cpu")
    assert h100["compiler"] == ("XLA:GPU sm_90 (compile-only)" if gpu else "XLA:CPU (proxy)")


def test_mem_fraction_changes_the_usable_memory() -> None:
    result = run(WORKLOAD, "--gpu", "T4", "--mem-fraction", "0.9", "--safety-margin", "0", "--json")
    check(result, 0)
    assert json.loads(result.stdout)["targets"][0]["memory_limit_bytes"] == int(16 * 2**30 * 0.9)


@pytest.mark.parametrize("args", [["--list-gpus"], ["--gpu", "list"]])
def test_listing_the_catalog(args: list[str]) -> None:
    result = run(*args)
    check(result, 0)
    assert all(name in result.output for name in names())
    result = run(*args, "--json")
    check(result, 0)
    assert [row["name"] for row in json.loads(result.stdout)] == list(names())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "A100-40"], "Did you mean 'A100-40GB'"),
        (["--gpu", "B300"], "Known: T4, L4"),
        (["--gpu", "B300"], "on the command line --memory-limit 24GiB"),  # an option plan has
        (["--effective-batch", "0", "--gpu", "L4"], "must be >= 1, got --effective-batch 0"),
        (["--memory-limit", "12XB"], "'12XB' does not parse as a byte size"),
        (["--mem-fraction", "1.5", "--gpu", "L4"], "1.5"),
        (["--gpu", "./no-such-card.txtpb"], "no file './no-such-card.txtpb'"),  # (was: "unknown accelerator")
        (["--large", "--gpu", "L4"], "it goes with --demo"),  # (was ignored)
        (["--strategy", "bogus", "--gpu", "L4"], "'bogus' is not a registered strategy"),  # (after a compile line)
    ],
)
def test_bad_input_exits_2_before_compiling(args: list[str], message: str) -> None:
    result = run(WORKLOAD, *args)
    check(result, 2)
    assert message in result.output and "compiling" not in result.output


def test_a_missing_workload_is_a_usage_error() -> None:
    check(run("--gpu", "L4"), 2)
    check(run("no_such_module:fn", "--gpu", "L4"), 2)


def test_nothing_fits_is_that_targets_answer_and_exits_0() -> None:
    result = run(WORKLOAD, "--memory-limit", "1MiB", "--gpu", "L4", "--json")
    check(result, 0)
    l4, tiny = json.loads(result.stdout)["targets"]
    assert l4["fits"] and not tiny["fits"] and tiny["accumulation_steps"] == 0
    result = run(WORKLOAD, "--memory-limit", "1MiB")  # the only target: still an answer
    check(result, 0)
    assert "nothing fits" in result.output
    words = " ".join(result.output.split())  # (no card among the targets: no card's notes)
    assert "nothing was run" in words and "MEM_FRACTION" not in words and "sm_XY" not in words, words


def test_exits_1_only_when_no_target_could_be_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target XLA cannot compile for is shown as not planned, with XLA's error; exit 1 when that is every one."""
    from autoaccum import _estimate

    def failing(*args: object, **kwargs: object) -> None:
        raise jax.errors.JaxRuntimeError("INTERNAL: Couldn't find output tile sizes")

    monkeypatch.setattr(_estimate, "estimate", failing)
    result = run(WORKLOAD, "--memory-limit", "1GiB", "--memory-limit", "64MiB")
    check(result, 1)
    assert result.output.count("not planned") == 4  # each target's row, and its line saying why
    assert "Couldn't find output tile sizes" in result.output
    data = json.loads(run(WORKLOAD, "--memory-limit", "1GiB", "--json").stdout)
    assert data["targets"][0]["error"] == "INTERNAL: Couldn't find output tile sizes"


def test_a_progress_line_for_each_compilation() -> None:
    """While it compiles, each compilation is a line naming the target, the size and the seconds it took."""
    result = run(CNN, "--effective-batch", "1024", "--gpu", "L4", "--memory-limit", "64MiB")
    check(result, 0)
    lines = [line for line in result.output.splitlines() if ": compiled " in line]
    count = int(re.search(r"^(\d+) compilations in [\d.]+ s\.$", result.output, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert len(lines) == count >= 6
    pattern = re.compile(
        r"^  (.+): compiled (microbatch \d+( accumulating a batch of \d+)?|the optimizer step) in \d+\.\d s$"
    )
    matches = [pattern.match(line) for line in lines]
    assert all(matches), lines
    labels = {m.group(1) for m in matches if m}
    assert labels <= {"L4", "64.00 MiB", "L4, 64.00 MiB"} and any("64.00 MiB" in label for label in labels)
    assert sum("accumulating" in line for line in lines) >= 3
    assert result.output.index(lines[-1]) < result.output.index("predicted capacity")  # before the table


@pytest.mark.slow
def test_demo_plans_the_large_model_only_with_large(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoaccum import workloads

    assert [w.name for w in workloads.planning_demos()] == ["gpt2-small"]
    assert [w.name for w in workloads.planning_demos(large=True)] == ["gpt2-small", "transformer-1b"]
    tiny = workloads.sized_transformer("tiny", vocab=64, dim=16, heads=2, layers=1, seq_len=8, batch_size=64)
    asked: list[bool] = []

    def demos(large: bool = False) -> tuple[autoaccum.Workload, ...]:
        asked.append(large)
        return (tiny,)

    monkeypatch.setattr(workloads, "planning_demos", demos)
    check(run("--demo", "--memory-limit", "64MiB"), 0)
    check(run("--demo", "--large", "--memory-limit", "64MiB"), 0)
    assert asked == [False, True]


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    result = run(WORKLOAD, "--effective-batch", "2048", "--gpu", "T4", "--memory-limit", "16MiB", "--plot", str(path))
    check(result, 0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_out_writes_a_predicted_plan_that_builds(tmp_path: Path) -> None:
    """`autoaccum plan` makes a `Plan` too: the first target's, marked predicted, buildable like a tuned one."""
    path = tmp_path / "plan.json"
    check(run(CNN, "--effective-batch", "1024", "--memory-limit", "64MiB", "--out", str(path)), 0)
    plan = autoaccum.Plan.load(path)
    assert plan.source == "predicted" and plan.effective_batch == 1024 and plan.accumulation_steps > 1
    assert plan.versions["jax"] == jax.__version__ and plan.versions["autoaccum"] == autoaccum.__version__
    w = autoaccum.load_workload(CNN)
    assert plan.build(w.loss_fn, w.optimizer, params=w.params).microbatch_size == plan.microbatch_size


KNOBS_WORKLOAD = """
import jax.numpy as jnp, optax, autoaccum

def make_loss(scale=1.0):
    return lambda w, b: scale * jnp.mean((b["x"] @ w - b["y"]) ** 2)

KNOBS = autoaccum.Knobs(make_loss, scale=(1.0, 0.5))

def make():
    batch = {"x": jnp.ones((64, 256)), "y": jnp.zeros(64)}
    return autoaccum.Workload(make_loss(), jnp.zeros(256), batch, optax.adam(0.1), knobs=KNOBS)
"""


def test_a_plan_of_a_workload_with_knobs_records_their_default_and_builds_with_them(tmp_path: Path) -> None:
    """The plan is of the workload's ``loss_fn``, its knobs' default: it recorded no knobs, and building it with the
    Knobs was refused (a new user's report)."""
    (tmp_path / "knobbed.py").write_text(KNOBS_WORKLOAD)
    path = tmp_path / "plan.json"
    check(run(f"{tmp_path / 'knobbed.py'}:make", "--effective-batch", "256", "--memory-limit", "64MiB", "--out",
              str(path)), 0)  # fmt: skip
    plan = autoaccum.Plan.load(path)
    assert plan.knobs == {"scale": 1.0}
    w = autoaccum.load_workload(f"{tmp_path / 'knobbed.py'}:make")
    assert plan.build(w.knobs, w.optimizer, params=w.params).microbatch_size == plan.microbatch_size


def test_out_says_when_the_first_target_has_no_plan_to_save(tmp_path: Path) -> None:
    """Where nothing fits the first target, ``--out`` writes nothing and says so (it said nothing, exit 0)."""
    path = tmp_path / "plan.json"
    result = run(CNN, "--effective-batch", "1024", "--memory-limit", "64KiB", "--out", str(path))
    check(result, 0)
    assert not path.exists() and f"no plan saved to {path}: nothing fits there" in " ".join(result.output.split())
    as_json = run(CNN, "--effective-batch", "1024", "--memory-limit", "64KiB", "--out", str(path), "--json")
    assert json.loads(as_json.stdout)["saved"] is None and not path.exists()


@pytest.mark.slow
def test_devices_plans_a_data_parallel_mesh_per_device() -> None:
    """8 devices (this test process has 8 CPU devices): global microbatches in multiples of 8, memory per
    device (each holds an eighth of the activations), the gradient reduction's bytes in the step time."""
    import numpy as np

    from autoaccum import workloads

    args = (CNN, "--effective-batch", "1024", "--gpu", "L4", "--memory-limit", "64MiB", "--json")
    one, eight = run(*args), run(*args, "--devices", "8")
    check(one, 0)
    check(eight, 0)
    single, mesh = json.loads(one.stdout), json.loads(eight.stdout)
    assert [t["devices"] for t in mesh["targets"]] == [8, 8] and single["targets"][0]["devices"] == 1
    assert all(t["microbatch_size"] % 8 == 0 for t in mesh["targets"])
    assert mesh["targets"][1]["max_microbatch"] > 2 * single["targets"][1]["max_microbatch"]
    params = workloads.cnn().params  # the gradient, in float32, reduced once per update
    assert mesh["estimate"]["cost"]["reduction_bytes"] == 4 * sum(np.size(x) for x in jax.tree.leaves(params))
    assert mesh["estimate"]["cost"]["devices"] == 8 and mesh["estimate"]["shards"] == 8
    odd = run(CNN, "--effective-batch", "1020", "--devices", "8")
    check(odd, 2)
    assert "--effective-batch 1020 is not a multiple of --devices 8" in odd.output


def test_a_workloads_own_memory_limit_is_the_target_without_gpu_or_limit(tmp_path: Path) -> None:
    """probe and tune take the workload's limit when --memory-limit is not given; plan planned 'this machine'."""
    (tmp_path / "own_limit.py").write_text(
        "import jax.numpy as jnp, optax, autoaccum\n"
        "def workload():\n"
        "    loss_fn = lambda w, b: jnp.mean((b['x'] @ w - b['y']) ** 2)\n"
        "    batch = {'x': jnp.ones((64, 32)), 'y': jnp.zeros(64)}\n"
        "    return autoaccum.Workload(loss_fn, jnp.zeros(32), batch, optax.adam(1e-3), memory_limit='3MiB')\n"
    )
    result = run(f"{tmp_path / 'own_limit.py'}:workload", "--json")
    check(result, 0)
    (target,) = json.loads(result.stdout)["targets"]
    assert target["memory_limit_bytes"] == 3 * 2**20, target
    result = run(f"{tmp_path / 'own_limit.py'}:workload", "--memory-limit", "5MiB", "--json")
    check(result, 0)
    assert [t["memory_limit_bytes"] for t in json.loads(result.stdout)["targets"]] == [5 * 2**20]


def test_an_uneven_split_shows_its_last_microbatch() -> None:
    """'25 x 21' for an effective batch of 512 read as 525 examples: the last microbatch is 12."""
    from rich.console import Console

    from autoaccum._capacity import Capacity
    from autoaccum.cli.plan import _print_table

    def plan(m: int, steps: int) -> Capacity:
        return Capacity("L4", 2**30, 512, True, False, m, m, steps, 2**29, None, None, 0.0, 0.0)

    console = Console(record=True, width=200)
    _print_table(console, [plan(25, 21), plan(64, 8)], [None, None], 512)
    text = console.export_text()
    assert "25 x 21 (last 12)" in text and "64 x 8 " in text and "64 x 8 (last" not in text, text
