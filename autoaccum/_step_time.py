"""The step-time model: a roofline estimate of one update from XLA's cost analysis, a lower bound.

Each microbatch and the optimizer step cost ``max(flops / peak FLOP/s, bytes accessed / bandwidth)`` on an
accelerator's datasheet figures; on several devices the gradient reduction adds its bytes over the interconnect.
"""

from __future__ import annotations

import dataclasses
import enum

from autoaccum._catalog import Accelerator, lookup
from autoaccum._checks import check_positive_int
from autoaccum._json import JsonMixin


class Bound(enum.Enum):
    """What limits a roofline step time: arithmetic, memory traffic or the interconnect."""

    COMPUTE = "compute"
    MEMORY = "memory"
    INTERCONNECT = "interconnect"


@dataclasses.dataclass(frozen=True)
class StepCost(JsonMixin):
    """XLA's cost analysis of an update, fitted per example (per device on a mesh of ``devices``).

    Attributes:
      flops_fixed, flops_per_example: FLOPs of one microbatch's forward and backward pass: ``fixed + per_example * m``.
      bytes_accessed_fixed, bytes_accessed_per_example: bytes moved by it, likewise.
      optimizer_flops, optimizer_bytes_accessed: one optimizer step.
      compute_dtype: the dtype of most parameter bytes, which picks the peak FLOP/s.
      reduction_bytes: the gradient sums each device reduces with the others once per update.
    """

    flops_fixed: float
    flops_per_example: float
    bytes_accessed_fixed: float
    bytes_accessed_per_example: float
    optimizer_flops: float
    optimizer_bytes_accessed: float
    compute_dtype: str = "float32"
    devices: int = 1
    reduction_bytes: float = 0.0

    def reduction_seconds(self, accelerator: Accelerator) -> float:
        """The gradient reduction over the interconnect (a ring sends ``2 (n - 1) / n`` of the bytes, each direction
        at half the bandwidth); 0 on one device.

        Example:
          >>> cost = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, devices=8, reduction_bytes=450e9 * 4 / 7)
          >>> round(cost.reduction_seconds(lookup("H100")), 6)  # 2 x 7/8 x 257 GB at 450 GB/s each way
          1.0
        """
        if self.devices <= 1 or self.reduction_bytes <= 0:
            return 0.0
        if accelerator.interconnect is None:
            raise ValueError(f"{accelerator.name} has no interconnect bandwidth in the catalog; plan for 1 device.")
        moved = 2 * (self.devices - 1) / self.devices * self.reduction_bytes
        return moved / (accelerator.interconnect / 2)

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

        def roofline(flops: float, moved: float) -> float:
            return max(flops / acc.peak_flops(self.compute_dtype), moved / acc.bandwidth)

        seconds = flops = moved = 0.0
        for n, size in [(full, m)] + ([(1, rest)] if rest else []):  # the microbatches' forward and backward passes
            f = max(self.flops_fixed + self.flops_per_example * size, 0.0)
            b = max(self.bytes_accessed_fixed + self.bytes_accessed_per_example * size, 0.0)
            seconds, flops, moved = seconds + n * roofline(f, b), flops + n * f, moved + n * b
        reduction = self.reduction_seconds(acc)
        seconds = seconds + roofline(self.optimizer_flops, self.optimizer_bytes_accessed) + reduction
        flops, moved = flops + self.optimizer_flops, moved + self.optimizer_bytes_accessed
        compute, memory = flops / acc.peak_flops(self.compute_dtype), moved / acc.bandwidth
        bound = Bound.MEMORY if memory > compute else Bound.COMPUTE
        return seconds, Bound.INTERCONNECT if reduction > max(compute, memory) else bound, flops, moved
