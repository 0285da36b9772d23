"""Capacity per target: what an effective batch needs on one accelerator or memory limit, predicted.

A `Target` is a memory limit to plan for (a catalogued accelerator's usable memory, or a bare size); a
`Capacity` is the answer for one effective batch there: does it fit in one step, the largest microbatch,
the microbatch and accumulation steps to use, the predicted peak and a roofline step time (`StepCost`: each
microbatch and the optimizer step cost ``max(flops / peak FLOP/s, bytes accessed / bandwidth)``, a lower bound).
Both come from an `autoaccum.Estimate` (compile-only); nothing is run. (A `Plan` is different: how to run an
update, as the tuner measured it.)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from autoaccum._batch import abstract
from autoaccum._catalog import DEFAULT_SAFETY_MARGIN, Accelerator, lookup, usable_bytes
from autoaccum._checks import check_positive_int
from autoaccum._json import JsonMixin
from autoaccum._units import format_bytes, parse_bytes


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

    def work(self, effective_batch: int, microbatch_size: int) -> list[tuple[int, float, float]]:
        """``(count, flops, bytes accessed)`` of the microbatches' forward and backward passes and of the optimizer
        step in one update, whatever runs it.

        Example:
          >>> StepCost(0.0, 1e9, 0.0, 1e6, 5.0, 7.0).work(40, 16)
          [(2, 16000000000.0, 16000000.0), (1, 8000000000.0, 8000000.0), (1, 5.0, 7.0)]
        """
        total = check_positive_int(effective_batch, "effective_batch")
        m = min(check_positive_int(microbatch_size, "microbatch_size"), total)
        full, rest = divmod(total, m)
        passes = [
            (n, max(self.flops_fixed + self.flops_per_example * size, 0.0),
             max(self.bytes_accessed_fixed + self.bytes_accessed_per_example * size, 0.0))
            for n, size in [(full, m)] + ([(1, rest)] if rest else [])
        ]  # fmt: skip
        return [*passes, (1, self.optimizer_flops, self.optimizer_bytes_accessed)]

    def step_time(
        self, effective_batch: int, microbatch_size: int, accelerator: Accelerator | str
    ) -> tuple[float, Bound, float, float]:
        """Roofline estimate of one update (`work`): ``(seconds, bound, flops, bytes_accessed)``.

        Example:
          >>> cost = StepCost(0.0, 1e9, 0.0, 1e6, 0.0, 0.0)
          >>> seconds, bound, flops, _ = cost.step_time(64, 16, "H100")
          >>> bound.value, flops
          ('compute', 64000000000.0)
        """
        acc = lookup(accelerator) if isinstance(accelerator, str) else accelerator

        def roofline(flops: float, moved: float) -> float:
            return max(flops / acc.peak_flops(self.compute_dtype), moved / acc.bandwidth)

        work = self.work(effective_batch, microbatch_size)
        reduction = self.reduction_seconds(acc)
        seconds = sum(n * roofline(f, b) for n, f, b in work) + reduction
        flops, moved = sum(n * f for n, f, _ in work), sum(n * b for n, _, b in work)
        compute, memory = flops / acc.peak_flops(self.compute_dtype), moved / acc.bandwidth
        bound = Bound.MEMORY if memory > compute else Bound.COMPUTE
        return seconds, Bound.INTERCONNECT if reduction > max(compute, memory) else bound, flops, moved


@dataclasses.dataclass(frozen=True)
class Target(JsonMixin):
    """A memory limit to plan for: a catalogued accelerator, or a bare size.

    Attributes:
      name: what to call it in reports (``"A100-40GB"``, ``"24.00 GiB"``).
      memory_limit_bytes: the bytes one update step may use (reservation and safety margin already taken off).
      accelerator: the catalogue entry's name, for step-time estimates; ``None`` for a bare memory limit.
      description: the path of a GPU target description (a card of the user's own, `Target.gpu_file`), which
        XLA's GPU compiler compiles for; ``None`` otherwise.
    """

    name: str
    memory_limit_bytes: int
    accelerator: str | None = None
    description: str | None = None

    def __post_init__(self) -> None:
        value = self.memory_limit_bytes
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`Target.memory_limit_bytes` must be an int >= 1, got memory_limit_bytes={value!r}.")

    @classmethod
    def gpu(
        cls, name: str | Accelerator, mem_fraction: float | None = None, safety_margin: float = DEFAULT_SAFETY_MARGIN
    ) -> Target:
        """A catalogued accelerator (by name), its memory limit per `Accelerator.memory_limit_bytes`.

        Example:
          >>> round(Target.gpu("L4").memory_limit_bytes / 2**30, 2)  # 24 GiB x (0.75 - 0.05)
          16.8
        """
        acc = name if isinstance(name, Accelerator) else lookup(name)
        return cls(acc.name, acc.memory_limit_bytes(mem_fraction, safety_margin), acc.name)

    @classmethod
    def gpu_file(
        cls, path: str | Path, mem_fraction: float | None = None, safety_margin: float = DEFAULT_SAFETY_MARGIN
    ) -> Target:
        """A GPU described by a target description file (``autoaccum devices --target-config`` writes a real
        card's), named after the file, its memory limit by the GPU policy of `Accelerator.memory_limit_bytes`.
        No step-time estimate: the file holds no FLOP rates.

        Raises:
          ValueError: the file is not a target description (the message says what is missing).
        """
        from autoaccum._gpu_compile import describe

        path = Path(path)
        d = describe(path)
        return cls(d.name, usable_bytes(d.memory_bytes, mem_fraction=mem_fraction, safety_margin=safety_margin),
                   description=str(path))  # fmt: skip

    @classmethod
    def memory_limit(cls, size: int | str) -> Target:
        """A bare memory limit of ``size`` bytes (``"24GiB"`` or an int), used as given: no reservation or margin.

        Example:
          >>> Target.memory_limit("1GiB")
          Target(name='1.00 GiB', memory_limit_bytes=1073741824, accelerator=None, description=None)
        """
        limit = parse_bytes(size, "memory_limit")
        return cls(format_bytes(limit), limit)


@dataclasses.dataclass(frozen=True)
class Capacity(JsonMixin):
    """What an effective batch needs on one target: microbatch, accumulation steps, peak and step time.

    Every figure is a prediction from compilation (`autoaccum.estimate`); ``step_seconds`` is a roofline
    estimate.

    Attributes:
      target: the target's name.
      memory_limit_bytes: the memory the step may use there.
      effective_batch: examples per update.
      fits: whether any microbatch fits (``False``: not even one example does).
      fits_in_one_step: whether the whole effective batch fits in one step, without accumulation.
      max_microbatch: the largest microbatch predicted to fit for this effective batch (0 if none).
      microbatch_size: the microbatch to use: the smallest one with as few accumulation steps as
        ``max_microbatch`` (``ceil(B / steps)``; it divides ``B`` evenly whenever some size does).
      accumulation_steps: microbatches per update, ``ceil(B / microbatch_size)`` (0 when nothing fits).
      peak_bytes: the predicted peak at ``microbatch_size`` (at one example when nothing fits).
      step_seconds: roofline estimate of one update's time; ``None`` without accelerator figures.
      bound: whether that estimate is compute- or memory-bound (``None`` with ``step_seconds``).
      flops, bytes_accessed: the update's predicted FLOPs and bytes moved (cost analysis).
      compiler: which compiler's memory analysis answered (e.g. ``"XLA:CPU (proxy)"``).
      devices: the devices the batch is sharded over (microbatch sizes are global, bytes per device).
    """

    target: str
    memory_limit_bytes: int
    effective_batch: int
    fits: bool
    fits_in_one_step: bool
    max_microbatch: int
    microbatch_size: int
    accumulation_steps: int
    peak_bytes: int
    step_seconds: float | None
    bound: Bound | None
    flops: float
    bytes_accessed: float
    compiler: str = ""
    devices: int = 1

    json_format = "autoaccum.capacity/1"


class MemoryModel(Protocol):
    """What `capacity` needs of an `autoaccum.Estimate`."""

    @property
    def memory_limit_bytes(self) -> int: ...

    @property
    def platform(self) -> str: ...

    def largest_microbatch(self, limit: int, batch_size: int | None = None, *, runtime: bool = True) -> int: ...

    def bytes_at(self, microbatch_size: int, batch_size: int | None = None, *, runtime: bool = True) -> int: ...


def resolve_target(
    target: Target | Accelerator | str | int | None,
    default_bytes: int,
    mem_fraction: float | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Target:
    """``target`` as a `Target`: an accelerator name or entry, a size (``"24GiB"``, bytes), or ``None``.

    A string is an accelerator name unless it starts with a digit (then it is a size).

    Example:
      >>> resolve_target("2GiB", 0).memory_limit_bytes
      2147483648
    """
    if target is None:
        return Target("memory_limit", default_bytes)
    if isinstance(target, Target):
        return target
    if isinstance(target, Accelerator):
        return Target.gpu(target, mem_fraction, safety_margin)
    if isinstance(target, str) and not target.strip()[:1].isdigit():
        return Target.gpu(target, mem_fraction, safety_margin)
    if isinstance(target, (int, str)) and not isinstance(target, bool):
        return Target.memory_limit(target)
    raise TypeError(
        f"`target` must be an accelerator name such as 'A100-40GB', a size such as '24GiB' or bytes, "
        f"got {type(target).__name__} {target!r}."
    )


def capacity(
    model: MemoryModel,
    cost: StepCost,
    effective_batch: int,
    target: Target | Accelerator | str | int | None = None,
    *,
    mem_fraction: float | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> Capacity:
    """The `Capacity` of ``target`` for ``effective_batch`` under ``model`` (see `autoaccum.Estimate.capacity`)."""
    total = check_positive_int(effective_batch, "effective_batch")
    resolved = resolve_target(target, model.memory_limit_bytes, mem_fraction, safety_margin)
    runtime = resolved.accelerator is None  # a catalogued accelerator's runtime is XLA's accounting
    largest = model.largest_microbatch(resolved.memory_limit_bytes, total, runtime=runtime)
    if largest >= 1:
        steps = -(-total // largest)
        g = getattr(model, "shards", 1)  # on a mesh, global sizes in multiples of the shards
        even = -(-total // steps)  # as many steps, microbatches as even as can be
        microbatch = -(-even // g) * g
        if model.bytes_at(microbatch, total, runtime=runtime) > resolved.memory_limit_bytes:  # its last one costs more
            microbatch = largest
    else:
        steps, microbatch = 0, 1
    peak = model.bytes_at(microbatch, total, runtime=runtime)
    seconds: float | None = None
    bound: Bound | None = None
    flops = moved = 0.0
    if largest >= 1:  # (the work is the same on any target; its time is a catalogued accelerator's)
        work = cost.work(total, microbatch)
        flops, moved = sum(n * f for n, f, _ in work), sum(n * b for n, _, b in work)
    if resolved.accelerator is not None and largest >= 1:
        seconds, bound, flops, moved = cost.step_time(total, microbatch, resolved.accelerator)
    compiler = _compiler(model, resolved)
    return Capacity(
        target=resolved.name,
        memory_limit_bytes=resolved.memory_limit_bytes,
        effective_batch=total,
        fits=largest >= 1,
        fits_in_one_step=largest >= total,
        max_microbatch=largest,
        microbatch_size=microbatch,
        accumulation_steps=steps,
        peak_bytes=peak,
        step_seconds=seconds,
        bound=bound,
        flops=flops,
        bytes_accessed=moved,
        compiler=compiler,
        devices=cost.devices,
    )


def _compiler(model: MemoryModel, target: Target) -> str:
    """Which compiler's figures answer for ``target``: the model's own label (an estimate made for a GPU target),
    marked a proxy when ``target`` is another accelerator; else the platform's compiler, a proxy for any
    accelerator.

    Example:
      >>> class Model:
      ...     memory_limit_bytes, platform, compiler, target = 1, "gpu", "XLA:GPU sm_90 (compile-only)", "H100-80GB"
      >>> _compiler(Model(), Target.gpu("H100")), _compiler(Model(), Target.gpu("L4"))
      ('XLA:GPU sm_90 (compile-only)', 'XLA:GPU sm_90 for H100-80GB (proxy)')
    """
    own: str = getattr(model, "compiler", "")
    compiled_for: str | None = getattr(model, "target", None)
    if not own:
        return f"XLA:{model.platform.upper()}" + (" (proxy)" if target.accelerator is not None else "")
    if target.accelerator is None or compiled_for is None or target.accelerator == compiled_for or "proxy" in own:
        return own
    return f"{own.replace(' (compile-only)', '')} for {compiled_for} (proxy)"


def fit_cost(
    sizes: Sequence[int],
    flops: Sequence[float],
    bytes_accessed: Sequence[float],
    optimizer: tuple[float, float],
    params: Any,
    devices: int = 1,
) -> StepCost:
    """The roofline cost of a step (`StepCost`) from XLA's cost analysis of one-microbatch steps at ``sizes`` (their
    ``flops`` and ``bytes_accessed``, less the optimizer step's, ``optimizer = (flops, bytes accessed)``), fitted per
    example by least squares; the compute dtype is the floating dtype holding most of ``params``'s bytes; on a mesh
    of ``devices``, a float32 reduction of every parameter per step.

    Example:
      >>> import jax.numpy as jnp
      >>> cost = fit_cost([8, 16], [180.0, 340.0], [90.0, 170.0], (20.0, 10.0), jnp.ones(3))
      >>> round(cost.flops_fixed), round(cost.flops_per_example), cost.compute_dtype
      (0, 20, 'float32')
    """
    xs = np.asarray(sizes, float)
    flops_slope, flops_fixed = np.polyfit(xs, np.asarray(flops, float) - optimizer[0], 1)
    moved_slope, moved_fixed = np.polyfit(xs, np.asarray(bytes_accessed, float) - optimizer[1], 1)
    by_dtype: dict[str, int] = {}
    for leaf in jax.tree.leaves(abstract(params, sharded=False)):
        dtype = np.dtype(leaf.dtype)
        if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16":
            by_dtype[dtype.name] = by_dtype.get(dtype.name, 0) + int(np.prod(leaf.shape)) * dtype.itemsize
    return StepCost(
        flops_fixed=float(flops_fixed),
        flops_per_example=float(flops_slope),
        bytes_accessed_fixed=float(moved_fixed),
        bytes_accessed_per_example=float(moved_slope),
        optimizer_flops=optimizer[0],
        optimizer_bytes_accessed=optimizer[1],
        compute_dtype=max(by_dtype, key=lambda k: by_dtype[k]) if by_dtype else "float32",
        devices=devices,
        reduction_bytes=float(sum(x.size for x in jax.tree.leaves(params)) * 4) if devices > 1 else 0.0,
    )
