"""The public surface: what ``autoaccum`` and ``autoaccum.strategies`` export, and nothing by accident."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoaccum
from autoaccum import strategies

PUBLIC_MODULES = {"autoaccum.cli", "autoaccum.linen", "autoaccum.nnx", "autoaccum.strategies", "autoaccum.workloads"}


def test_autoaccum_exports() -> None:
    assert set(autoaccum.__all__) == {
        "Capacity", "DeviceInfo", "Estimate", "Knobs", "MemoryLimitWarning", "NonFiniteLossWarning", "Plan",
        "ProbeError", "ProbeResult", "Target", "Trial", "TrialRecord", "TuneResult", "Update", "Workload",
        "WorkloadError", "__version__", "build_update", "detect_device", "estimate", "format_bytes", "linen",
        "load_workload", "nnx", "parse_bytes", "probe", "strategies", "tune", "value_and_grad",
    }  # fmt: skip
    for name in autoaccum.__all__:
        assert hasattr(autoaccum, name), name


def test_strategies_exports_the_registry_the_built_ins_and_what_a_new_strategy_is_built_from() -> None:
    registry = {"Strategy", "register", "unregister", "available", "get"}
    built_ins = {"Scan", "Loop", "MultiSteps", "Auto", "REMAT_POLICIES"}
    pieces = {"Spec", "Call", "Program", "Layout", "Accum", "OutDtypes", "PyTree", "weighted_grad", "add", "take",
              "apply_optimizer", "finish_loss", "output_dtypes", "accumulate_in_scan"}  # fmt: skip
    assert set(strategies.__all__) == registry | built_ins | pieces
    for name in strategies.__all__:
        assert hasattr(strategies, name), name


def test_a_strategy_of_ones_own_from_the_exported_pieces_equals_the_full_batch_step() -> None:
    """`Loop`'s idea in a few lines, from ``strategies.__all__`` alone: one jitted microbatch at a time."""
    import jax

    names = set(strategies.__all__)
    assert {"Strategy", "Spec", "Call", "Accum", "weighted_grad", "add", "take", "apply_optimizer"} <= names

    class OneAtATime(strategies.Strategy):
        name = "one_at_a_time"

        def run(self, call: Any, params: Any, opt_state: Any, batch: Any, state: Any) -> Any:
            m, size = self.spec.microbatch_size, jax.tree.leaves(batch)[0].shape[0]
            grad_fn = strategies.weighted_grad(self.spec)
            acc = None
            for start in range(0, size, m):
                part, state = jax.jit(grad_fn)(params, strategies.take(batch, start, min(m, size - start)), state)
                acc = part if acc is None else strategies.add(acc, part)
            dtypes = strategies.output_dtypes(self.spec, params, batch, state)
            params, opt_state, loss = strategies.apply_optimizer(self.spec, params, opt_state, acc, dtypes)
            return params, opt_state, loss, state

        def programs(self, params: Any, opt_state: Any, batch: Any, state: Any = ()) -> list[Any]:
            return []

    strategies.register(OneAtATime)
    try:
        loss_fn, params, batch = _linear()
        batch = {"x": jnp.arange(80.0).reshape(10, 8) / 80, "y": jnp.ones(10)}
        update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=4, strategy="one_at_a_time")
        new, _, loss = update(params, update.init(params), batch)
        full_loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        np.testing.assert_allclose(new, params - 0.1 * grads, atol=1e-6)
        np.testing.assert_allclose(loss, full_loss, atol=1e-6)
    finally:
        strategies.unregister("one_at_a_time")


def test_every_module_is_private_or_meant_to_be_imported() -> None:
    """Implementation lives in private modules; no public function shares its name with a module."""
    names = {m.name for m in pkgutil.walk_packages(autoaccum.__path__, "autoaccum.")}
    names |= {"autoaccum.strategies"} | {
        m.name for m in pkgutil.walk_packages(strategies.__path__, "autoaccum.strategies.")
    }  # installed from strategies/ (package-dir), so not below autoaccum/ in an editable install
    public = {n for n in names if not any(part.startswith("_") for part in n.split(".")[1:])}
    assert public == PUBLIC_MODULES | {"autoaccum.cli.devices", "autoaccum.cli.plan", "autoaccum.cli.probe",
                                       "autoaccum.cli.tune", "autoaccum.strategies.auto", "autoaccum.strategies.loop",
                                       "autoaccum.strategies.multisteps", "autoaccum.strategies.scan"}  # fmt: skip
    for name in autoaccum.__all__:
        value = getattr(autoaccum, name)
        if not isinstance(value, types.ModuleType):
            assert f"autoaccum.{name}" not in names, f"function {name} shadows module autoaccum.{name}"
    assert importlib.import_module("autoaccum.strategies") is strategies


def test_nothing_outside_strategies_reaches_into_its_private_base() -> None:
    from pathlib import Path

    root = Path(autoaccum.__file__).parent
    offenders = [
        str(p) for p in root.rglob("*.py") if "strategies._base" in p.read_text() and "strategies" not in p.parts
    ]
    assert offenders == []


# -- renamed names: the old one warns (DeprecationWarning) and still works ------------------------------------------


def _linear() -> tuple[Any, Any, Any]:
    loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    return loss_fn, jnp.zeros(8), {"x": jnp.ones((16, 8)), "y": jnp.zeros(16)}


def test_the_search_cap_of_probe_and_estimate_was_max_microbatch() -> None:
    loss_fn, params, batch = _linear()
    kw: dict[str, Any] = dict(optimizer=optax.sgd(0.1), memory_limit="256MiB")
    with pytest.warns(DeprecationWarning, match="`max_microbatch` is deprecated: pass `microbatch_cap`"):
        probed = autoaccum.probe(loss_fn, params, batch, max_microbatch=8, isolate=False, **kw)
    assert probed.microbatch_cap == 8 and probed.max_microbatch == 8  # the cap given; the answer under it
    with pytest.warns(DeprecationWarning, match="`max_microbatch` is deprecated: pass `microbatch_cap`"):
        est = autoaccum.estimate(loss_fn, params, batch, max_microbatch=8, accumulation=False, **kw)
    assert est.microbatch_cap == 8 and 0 < est.max_microbatch <= 8
    with pytest.raises(TypeError, match="give `microbatch_cap` alone"):
        autoaccum.probe(loss_fn, params, batch, microbatch_cap=8, max_microbatch=8, isolate=False, **kw)


def test_the_bound_tune_is_given_was_max_microbatch() -> None:
    loss_fn, params, batch = _linear()
    with pytest.warns(DeprecationWarning, match="`max_microbatch` is deprecated: pass `microbatch_bound`"):
        result = autoaccum.tune(
            loss_fn, params, batch, optimizer=optax.sgd(0.1), max_microbatch=4, strategies=["loop"], remat=(None,),
            budget=1, race_rounds=0, storage=":memory:", isolate=False,
        )  # fmt: skip
    assert result.probe is None and set(result.bounds.values()) == {4}  # not probed: bounded by the value given
    assert all(r.microbatch_size <= 4 for r in result.trials)


@pytest.mark.parametrize(
    ("command", "old", "new"),
    [("probe", "--max-microbatch", "--microbatch-cap"), ("tune", "--max-microbatch", "--microbatch-bound")],
)
def test_renamed_cli_options_are_hidden_aliases(command: str, old: str, new: str) -> None:
    from click.testing import CliRunner

    from autoaccum.cli import main

    help_text = CliRunner().invoke(main, [command, "--help"]).output
    assert new in help_text and old not in help_text
    both = CliRunner().invoke(main, [command, "autoaccum.workloads:linear", old, "4", new, "4"])
    assert both.exit_code == 2 and f"give {new} alone" in both.output, both.output


def test_the_old_probe_option_still_works_saying_so() -> None:
    import json

    from click.testing import CliRunner

    from autoaccum.cli import main

    args = ["probe", "autoaccum.workloads:linear", "--memory-limit", "256MiB", "--max-microbatch", "8", "--no-isolate"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: --max-microbatch is deprecated: use --microbatch-cap." in result.stderr
    assert json.loads(result.stdout)["microbatch_cap"] == 8


# -- one default strategy: "auto", resolved to the strategy the default update runs, everywhere ---------------------


def _conv() -> tuple[Any, Any, Any]:
    """A loss with a convolution: on XLA:CPU "auto" runs it from a host loop (`autoaccum.strategies.Auto`)."""

    def loss_fn(w: Any, b: Any) -> Any:
        y = jax.lax.conv_general_dilated(b, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y**2)

    return loss_fn, jnp.ones((3, 3, 1, 2)), jnp.ones((8, 6, 6, 1))


def test_the_default_strategy_is_the_default_updates_everywhere() -> None:
    import inspect

    from autoaccum.cli.plan import plan as plan_command
    from autoaccum.cli.probe import probe as probe_command

    defaults = {
        fn.__name__: inspect.signature(fn).parameters["strategy"].default
        for fn in (autoaccum.build_update, autoaccum.probe, autoaccum.estimate)
    }
    options = {
        cmd.name: next(p.default for p in cmd.params if p.name == "strategy") for cmd in (plan_command, probe_command)
    }
    assert set(defaults.values()) == set(options.values()) == {"auto"}, (defaults, options)


def test_probe_estimate_and_tune_measure_the_strategy_auto_picks_and_name_it() -> None:
    loss_fn, params, batch = _conv()
    sgd = optax.sgd(0.1)
    update = autoaccum.build_update(loss_fn, sgd, microbatch_size=4)
    runs = update.accumulation.choose(params, batch).name
    assert runs == "loop"  # this test runs on the CPU
    probed = autoaccum.probe(
        loss_fn, params, batch, optimizer=sgd, memory_limit="256MiB", microbatch_cap=8, isolate=False
    )
    est = autoaccum.estimate(loss_fn, params, batch, optimizer=sgd, memory_limit="256MiB", accumulation=False)
    tuned = autoaccum.tune(
        loss_fn, params, batch, optimizer=sgd, memory_limit="256MiB", remat=(None,), budget=1, race_rounds=0,
        storage=":memory:", isolate=False,
    )  # fmt: skip
    assert probed.strategy == est.strategy == runs and "unroll" not in probed.options
    assert tuned.probe is not None and tuned.probe.strategy == runs  # the probe ran the default update's program
    assert autoaccum.strategies.Auto(update.accumulation.spec).choose(params, batch, platform="gpu").name == "scan"


# -- the command line: one way to list the catalog, choices checked, a workload's own strategy by name ---------------


def test_gpu_list_is_a_deprecated_spelling_of_list_gpus() -> None:
    from click.testing import CliRunner

    from autoaccum.cli import main

    listed = CliRunner().invoke(main, ["plan", "--list-gpus", "--json"])
    old = CliRunner().invoke(main, ["plan", "--gpu", "list", "--json"])
    assert listed.exit_code == old.exit_code == 0, old.output
    assert old.stdout == listed.stdout and "--gpu list is deprecated: use --list-gpus" in old.stderr
    assert "'--gpu list'" not in CliRunner().invoke(main, ["plan", "--help"]).output


@pytest.mark.parametrize(("option", "bad"), [("--remat", "most_saveable"), ("--accumulator-dtype", "int8")])
def test_tune_knob_options_are_choices(option: str, bad: str) -> None:
    from click.testing import CliRunner

    from autoaccum.cli import main

    result = CliRunner().invoke(main, ["tune", "autoaccum.workloads:linear", option, bad])
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output, result.output


WORKLOAD_WITH_A_STRATEGY = """
import jax.numpy as jnp
import optax

import autoaccum
from autoaccum import strategies


@strategies.register
class FromFile(strategies.Loop):
    name = "from_file"


def make():
    batch = {"x": jnp.ones((16, 8)), "y": jnp.zeros(16)}
    return autoaccum.Workload(lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), jnp.zeros(8), batch, optax.sgd(0.1))
"""


def test_a_strategy_the_workload_file_registers_can_be_named(tmp_path: Any) -> None:
    import json

    from click.testing import CliRunner

    from autoaccum.cli import main

    path = tmp_path / "mine.py"
    path.write_text(WORKLOAD_WITH_A_STRATEGY)
    args = ["probe", f"{path}:make", "--memory-limit", "256MiB", "--microbatch-cap", "8", "--no-isolate", "--json"]
    try:
        result = CliRunner().invoke(main, [*args, "--strategy", "from_file"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["strategy"] == "from_file"
    finally:
        if "from_file" in strategies.available():
            strategies.unregister("from_file")
    bad = CliRunner().invoke(main, ["probe", "autoaccum.workloads:linear", "--strategy", "from_nowhere"])
    assert bad.exit_code == 2 and "'from_nowhere' is not a registered strategy" in bad.output, bad.output


def test_a_strategy_registered_here_reaches_the_worker_whatever_module_the_loss_is_from(tmp_path: Any) -> None:
    """The worker imports the loss's module, not the workload file: a strategy that file registered was unknown
    there ("unknown `strategy` 'from_file'" for every trial; a new user's report). Registered strategies travel
    with the job."""
    import json

    from click.testing import CliRunner

    from autoaccum.cli import main

    (tmp_path / "losses.py").write_text("import jax.numpy as jnp\n\ndef loss_fn(w, b):\n"
                                        "    return jnp.mean((b['x'] @ w - b['y']) ** 2)\n")  # fmt: skip
    path = tmp_path / "mine.py"
    own_loss = 'lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)'
    workload = WORKLOAD_WITH_A_STRATEGY.replace(own_loss, "losses.loss_fn")
    path.write_text(workload.replace("import optax", "import losses\nimport optax"))
    assert "losses.loss_fn" in path.read_text()
    args = ["probe", f"{path}:make", "--memory-limit", "256MiB", "--microbatch-cap", "8", "--json"]
    try:
        result = CliRunner().invoke(main, [*args, "--strategy", "from_file"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["strategy"] == "from_file" and json.loads(result.stdout)["isolate"]
    finally:
        if "from_file" in strategies.available():
            strategies.unregister("from_file")


# The layout: an installed autoaccum creates no top-level `strategies` module.
def test_no_top_level_strategies_module() -> None:
    code = "import importlib.util, autoaccum.strategies; print(importlib.util.find_spec('strategies'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None"


def test_the_nnx_step_is_a_model_update_and_nnx_update_its_old_name() -> None:
    assert "ModelUpdate" in autoaccum.nnx.__all__ and "Update" not in autoaccum.nnx.__all__
    step = autoaccum.nnx.build_update(lambda model, b: jnp.mean(model(b) ** 2), microbatch_size=2)
    assert isinstance(step, autoaccum.nnx.ModelUpdate) and not isinstance(step, autoaccum.Update)
    with pytest.warns(
        DeprecationWarning, match=r"`autoaccum.nnx.Update` is deprecated: use `autoaccum.nnx.ModelUpdate`"
    ):
        assert autoaccum.nnx.Update is autoaccum.nnx.ModelUpdate


def test_linen_make_loss_fn_and_its_old_name() -> None:
    import flax.linen as nn

    model = nn.Dense(1)
    variables = model.init(jax.random.key(0), jnp.ones((1, 3)))
    criterion = lambda apply, b: jnp.mean(apply(b) ** 2)  # noqa: E731
    new = autoaccum.linen.make_loss_fn(model, criterion, mutable=(), rng_streams=())
    with pytest.warns(DeprecationWarning, match=r"`autoaccum.linen.loss_fn` is deprecated: use .*make_loss_fn`"):
        old = autoaccum.linen.loss_fn(model, criterion, mutable=(), rng_streams=())
    state = autoaccum.linen.init_state(variables, jax.random.key(1), mutable=())
    batch = jnp.arange(6.0).reshape(2, 3)
    expected = float(jnp.mean(model.apply(variables, batch) ** 2))  # the criterion on the model, by hand
    assert old == new and abs(float(new(variables["params"], batch, state)[0]) - expected) < 1e-6
    assert "make_loss_fn" in autoaccum.linen.__all__ and "loss_fn" not in autoaccum.linen.__all__
