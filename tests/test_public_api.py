"""The public surface: what ``autoaccum`` and ``strategies`` export, and nothing by accident."""

from __future__ import annotations

import autoaccum
import strategies


def test_autoaccum_exports() -> None:
    assert set(autoaccum.__all__) == {
        "DeviceInfo", "Estimate", "Plan", "ProbeError", "ProbeResult", "TargetPlan", "Trial", "TrialRecord",
        "TuneResult", "Update", "Workload", "__version__", "build_update", "detect_device", "estimate",
        "format_bytes", "load_workload", "parse_bytes", "probe", "tune",
    }  # fmt: skip
    for name in autoaccum.__all__:
        assert hasattr(autoaccum, name), name


def test_strategies_exports() -> None:
    assert set(strategies.__all__) == {
        "Accum", "Loop", "MultiSteps", "Program", "Scan", "Spec", "Strategy", "available", "get",
    }  # fmt: skip
    for name in strategies.__all__:
        assert hasattr(strategies, name), name
