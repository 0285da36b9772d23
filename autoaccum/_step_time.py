"""The step-time model: a roofline estimate of one update from XLA's cost analysis (never a measurement).

Each microbatch costs ``max(flops / peak FLOP/s, bytes accessed / bandwidth)`` on an accelerator's datasheet
figures, and the optimizer step the same on its own figures. On several devices (figures per device) the
update's one gradient reduction adds its bytes over the interconnect (`StepCost.reduction_seconds`). Real
steps rarely reach a roofline: read the result as a lower bound.
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
    INTERCONNECT = "interconnect"


@dataclasses.dataclass(frozen=True)
class StepCost(JsonMixin):
    """XLA's cost analysis of an update, fitted per example.

    Attributes:
      flops_fixed, flops_per_example: FLOPs of one microbatch's forward and backward pass (optimizer
        excluded) as ``fixed + per_example * m``.
      bytes_accessed_fixed, bytes_accessed_per_example: bytes moved by it, likewise.
      optimizer_flops, optimizer_bytes_accessed: one optimizer step.
      compute_dtype: the dtype of most parameter bytes, which picks the peak FLOP/s.
      devices: devices the batch is sharded over (every figure above is per device).
      reduction_bytes: the gradient sums each device reduces with the others once per update (a ring
        all-reduce, or a reduce-scatter and an all-gather, sends and receives ``2 (n - 1) / n`` of them).
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
        """The update's one gradient reduction over the interconnect (each direction at half its bandwidth);
        0 on one device.

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
        reduction = self.reduction_seconds(acc)
        seconds = sum(n * t for n, t, _, _ in parts) + opt_seconds + reduction
        flops = sum(n * f for n, _, f, _ in parts) + self.optimizer_flops
        moved = sum(n * b for n, _, _, b in parts) + self.optimizer_bytes_accessed
        compute, memory = flops / acc.peak_flops(self.compute_dtype), moved / acc.bandwidth
        bound = (
            Bound.INTERCONNECT
            if reduction > max(compute, memory)
            else Bound.MEMORY
            if memory > compute
            else Bound.COMPUTE
        )
        return seconds, bound, flops, moved
