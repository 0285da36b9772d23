"""The public surface: what ``autoaccum`` and ``autoaccum.strategies`` export, and nothing by accident."""

from __future__ import annotations

import importlib
import pkgutil
import types

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
