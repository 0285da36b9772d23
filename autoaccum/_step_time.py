"""The step-time model: a roofline estimate of one update from XLA's cost analysis (never a measurement).

Each microbatch costs ``max(flops / peak FLOP/s, bytes accessed / bandwidth)`` on an accelerator's datasheet
figures, and the optimizer step the same on its own figures. Real steps rarely reach a roofline: read the
result as a lower bound.
"""

from __future__ import annotations

import dataclasses
import enum

from autoaccum._catalog import Accelerator, lookup
from autoaccum._checks import check_positive_int
from autoaccum._json import JsonMixin


class Bound(enum.Enum):
    """What limits a roofline step time: arithmetic (``compute``) or memory traffic (``memory``)."""

    COMPUTE = "compute"
    MEMORY = "memory"


@dataclasses.dataclass(frozen=True)
class StepCost(JsonMixin):
    """XLA's cost analysis of an update, fitted per example.

    Attributes:
      flops_fixed, flops_per_example: FLOPs of one microbatch's forward and backward pass (optimizer
        excluded) as ``fixed + per_example * m``.
      bytes_accessed_fixed, bytes_accessed_per_example: bytes moved by it, likewise.
      optimizer_flops, optimizer_bytes_accessed: one optimizer step.
      compute_dtype: the dtype of most parameter bytes, which picks the peak FLOP/s.
    """

    flops_fixed: float
    flops_per_example: float
    bytes_accessed_fixed: float
    bytes_accessed_per_example: float
    optimizer_flops: float
    optimizer_bytes_accessed: float
    compute_dtype: str = "float32"

    def microbatch(self, microbatch_size: int, accelerator: Accelerator) -> tuple[float, float, float]:
        """``(seconds, flops, bytes_accessed)`` of one microbatch's forward and backward pass."""
        flops = max(self.flops_fixed + self.flops_per_example * microbatch_size, 0.0)
        moved = max(self.bytes_accessed_fixed + self.bytes_accessed_per_example * microbatch_size, 0.0)
        return max(flops / accelerator.peak_flops(self.compute_dtype), moved / accelerator.bandwidth), flops, moved

    def step_time(
        self, effective_batch: int, microbatch_size: int, accelerator: Accelerator | str
    ) -> tuple[float, Bound, float, float]:
        """Roofline estimate of one update: ``(seconds, bound, flops, bytes_accessed)``.

        Example:
          >>> cost = StepCost(0.0, 1e9, 0.0, 1e6, 0.0, 0.0)
          >>> seconds, bound, flops, _ = cost.step_time(64, 16, "H100")
          >>> bound.value, flops
          ('compute', 64000000000.0)
        """
        acc = lookup(accelerator) if isinstance(accelerator, str) else accelerator
        total = check_positive_int(effective_batch, "effective_batch")
        m = min(check_positive_int(microbatch_size, "microbatch_size"), total)
        full, rest = divmod(total, m)
        parts = [(full, *self.microbatch(m, acc))] + ([(1, *self.microbatch(rest, acc))] if rest else [])
        opt_seconds = max(
            self.optimizer_flops / acc.peak_flops(self.compute_dtype), self.optimizer_bytes_accessed / acc.bandwidth
        )
        seconds = sum(n * t for n, t, _, _ in parts) + opt_seconds
        flops = sum(n * f for n, _, f, _ in parts) + self.optimizer_flops
        moved = sum(n * b for n, _, _, b in parts) + self.optimizer_bytes_accessed
        memory_bound = moved / acc.bandwidth > flops / acc.peak_flops(self.compute_dtype)
        return seconds, Bound.MEMORY if memory_bound else Bound.COMPUTE, flops, moved
