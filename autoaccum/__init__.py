"""autoaccum: a memory-aware auto-tuner for gradient accumulation in JAX.

This module only re-exports; each concern lives in a private module named for it, and the data flows one
way: workload -> estimate (compile-only) -> probe (real runs, isolated) -> tune (search, timing) -> plan ->
update. Public submodules: `autoaccum.nnx` (flax nnx models and optimizers, the nnx way), `autoaccum.linen` (flax
linen's mutable collections and dropout keys as model state), `autoaccum.strategies`
(the accumulation strategies, `register` your own),
`autoaccum.workloads` (the built-in demo workloads) and `autoaccum.cli` (the command line).
"""

from __future__ import annotations

import autoaccum._driver_noise  # noqa: F401  (first: imports jax without the CUDA plugin's driver-less start-up lines)
from autoaccum import (
    linen,
    nnx,
    strategies,
)
from autoaccum._capacity import Capacity, Target
from autoaccum._device import DeviceInfo, MemoryLimitWarning, detect_device
from autoaccum._estimate import Estimate, estimate
from autoaccum._gpu_compile import quiet_plugin_start
from autoaccum._knobs import Knobs
from autoaccum._plan import Plan
from autoaccum._preflight import NonFiniteLossWarning
from autoaccum._probe import ProbeError, ProbeResult, Trial, probe
from autoaccum._tune.result import TrialRecord, TuneResult
from autoaccum._tune.run import tune
from autoaccum._units import format_bytes, parse_bytes
from autoaccum._update import Update, build_update
from autoaccum._value_and_grad import value_and_grad
from autoaccum._version import __version__
from autoaccum._workload import Workload, WorkloadError, load_workload

quiet_plugin_start()  # no "Unable to load CUDA" traceback where the CUDA plugin is here for its compiler only

__all__ = [
    "Capacity",
    "DeviceInfo",
    "Estimate",
    "Knobs",
    "MemoryLimitWarning",
    "NonFiniteLossWarning",
    "Plan",
    "ProbeError",
    "ProbeResult",
    "Target",
    "Trial",
    "TrialRecord",
    "TuneResult",
    "Update",
    "Workload",
    "WorkloadError",
    "__version__",
    "build_update",
    "detect_device",
    "estimate",
    "format_bytes",
    "linen",
    "load_workload",
    "nnx",
    "parse_bytes",
    "probe",
    "strategies",
    "tune",
    "value_and_grad",
]
