"""The public surface: what ``autoaccum`` and ``strategies`` export, and nothing by accident."""

from __future__ import annotations

import autoaccum
import strategies


def test_autoaccum_exports() -> None:
    expected = {"Plan", "TrialRecord", "TuneResult", "Update", "Workload", "build_update", "tune", "load_workload"}
    assert expected <= set(autoaccum.__all__)
    for name in autoaccum.__all__:
        assert hasattr(autoaccum, name), name


def test_strategies_exports() -> None:
    assert set(strategies.__all__) == {
        "Accum", "Loop", "MultiSteps", "Program", "Scan", "Spec", "Strategy", "available", "get",
    }  # fmt: skip
    for name in strategies.__all__:
        assert hasattr(strategies, name), name
