"""autoaccum: a memory-aware auto-tuner for gradient accumulation in JAX."""

from __future__ import annotations

from autoaccum.units import format_bytes, parse_bytes
from autoaccum.update import Update, build_update
from autoaccum.workload import Workload, load_workload

__version__ = "0.1.0"

__all__ = ["Update", "Workload", "__version__", "build_update", "format_bytes", "load_workload", "parse_bytes"]
