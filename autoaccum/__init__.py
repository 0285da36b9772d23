"""autoaccum: a memory-aware auto-tuner for gradient accumulation in JAX."""

from __future__ import annotations

from autoaccum.device import DeviceInfo, detect_device
from autoaccum.estimate import Estimate, TargetPlan, estimate
from autoaccum.plan import Plan
from autoaccum.probe import ProbeError, ProbeResult, Trial, probe
from autoaccum.tune import TrialRecord, TuneResult, tune
from autoaccum.units import format_bytes, parse_bytes
from autoaccum.update import Update, build_update
from autoaccum.workload import Workload, load_workload

__version__ = "0.1.0"

__all__ = [
    "DeviceInfo",
    "Estimate",
    "Plan",
    "ProbeError",
    "ProbeResult",
    "TargetPlan",
    "Trial",
    "TrialRecord",
    "TuneResult",
    "Update",
    "Workload",
    "__version__",
    "build_update",
    "detect_device",
    "estimate",
    "format_bytes",
    "load_workload",
    "parse_bytes",
    "probe",
    "tune",
]
