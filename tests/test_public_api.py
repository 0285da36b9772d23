"""The public surface: what ``autoaccum`` and ``autoaccum.strategies`` export, and nothing by accident."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from typing import Any

import jax.numpy as jnp
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


def test_strategies_exports() -> None:
    assert {"Strategy", "Spec", "Program", "register", "unregister", "available", "get"} <= set(strategies.__all__)
    assert {"Scan", "Loop", "MultiSteps", "weighted_grad", "apply_optimizer", "leading_size"} <= set(strategies.__all__)
    assert {"accumulate_in_jit", "mean_grads"} <= set(strategies.__all__)  # value_and_grad's pieces
    for name in strategies.__all__:
        assert hasattr(strategies, name), name


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


# The layout: an installed autoaccum creates no top-level `strategies` module.
def test_no_top_level_strategies_module() -> None:
    code = "import importlib.util, autoaccum.strategies; print(importlib.util.find_spec('strategies'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=True)
    assert out.stdout.strip() == "None"
