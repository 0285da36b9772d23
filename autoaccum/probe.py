"""The probe: the largest microbatch whose full update step really runs on this device, found in few runs.

A *trial* runs the update step training will run (`build_update` for the strategy, forward, backward and the
optimizer step, effective batch = microbatch) on a batch of that many rows made by repeating the example
batch, by default in a fresh child process under the memory limit (see `autoaccum._trial` for exactly what
counts as "does not fit").

The search (`search`) spends few real runs:

1. a compile-only estimate (`autoaccum.estimate`: usually two sizes compiled, nothing executed) gives
   a model ``bytes(m) = fixed + per_example * m`` and a predicted boundary;
2. the first real trial runs a little below the prediction (90%); every trial that fits reports the memory it
   used at its peak, counted exactly as the limit counts it, and re-anchors the model (two fitting trials
   give the real slope), so the next trial aims at the boundary itself;
3. when the model says the last fit is the largest, the next trial checks one step of ``granularity`` above
   it (then 2, 4, ... steps if that fits too, bisecting once that would pass a failure); a failure also bounds
   the model's slope from below (the step grew past the limit by then), so an estimate that under-counts
   per example does not aim past it again; when the model still reaches past a failure the next trial moves
   down by an eighth of the bracket, doubling; if two trials in a row fail to halve the bracket the next one
   bisects, so the worst case stays logarithmic.

The result is exact: ``max_microbatch`` fit and ``max_microbatch + granularity`` did not (or ``max_size`` was
reached).

Reproducibility on the CPU: the cap is on the child's address space, with glibc's malloc made predictable
(`child_env`) and every program compiled before the cap is set. For steps whose kernels only use XLA's own
buffers (the linear test workload) the memory a trial uses is then identical to the byte from run to run.
XLA:CPU also runs independent kernels concurrently and some of them (YNNPACK's dots) allocate their own
workspace, so for such models (the demo transformer) a step's peak varies between runs by a few percent
(measured: 188 to 267 MB for one size under a 256 MiB cap); the boundary is exact for the runs the probe
made, and a separate run within that margin may disagree.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import optax

from autoaccum._trial import (
    Job,
    Outcome,
    classify_exit,
    compile_trial,
    host_copy,
    is_oom,
    measured,
    oom_outcome,
)
from autoaccum.defaults import CPU_MEMORY_FRACTION, DEFAULT_MAX_SIZE, default_optimizer
from autoaccum.device import DeviceInfo, detect_device, oom_kills
from autoaccum.memory import state_bytes
from autoaccum.units import format_bytes, parse_bytes
from autoaccum.update import build_update, check_positive_int
from strategies._base import PyTree, leading_size

FIRST_MARGIN = 0.9
"""The first real trial runs at this fraction of the compile-only prediction (XLA's estimate omits the
runtime's own overheads)."""


@dataclasses.dataclass(frozen=True)
class Trial:
    """One real run of the update step at one microbatch size.

    Attributes:
      microbatch_size: examples in the microbatch (= the effective batch of the trial's step).
      fits: whether the step compiled and ran under the limit.
      seconds: the steady-state step time (the second step), when it fit.
      error: the trial's error message when it failed for another reason than memory, else None.
      peak_bytes: memory used at the peak, counted as the limit counts it (None where not measurable).
      first_seconds: compile + first step, when it fit.
      wall_seconds: the whole trial, child start-up included.
      detail: why it did not fit (the OOM message), else None.
    """

    microbatch_size: int
    fits: bool
    seconds: float | None
    error: str | None = None
    peak_bytes: int | None = None
    first_seconds: float | None = None
    wall_seconds: float | None = None
    detail: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The compile-only memory model the search starts from (nothing was executed to make it).

    Attributes:
      sizes: microbatch sizes compiled.
      peak_bytes: the predicted peak for each (`autoaccum.estimate.Point.total_bytes`: XLA's figure plus what
        the runtime needs beyond it).
      fixed_bytes: the model's bytes at size 0 (parameters, optimizer state, ...), fitted near ``predicted``.
      per_example_bytes: the model's bytes per example, fitted near ``predicted``.
      predicted: the largest multiple of the granularity the model puts under the limit (capped at max_size).
      seconds: time spent compiling.
    """

    sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    fixed_bytes: float
    per_example_bytes: float
    predicted: int
    seconds: float

    def bytes_at(self, microbatch_size: int) -> float:
        return self.fixed_bytes + self.per_example_bytes * microbatch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What `probe` found.

    Attributes:
      max_microbatch: the largest microbatch (a multiple of ``granularity``) whose update step ran; 0 if not
        even ``granularity`` fits.
      trials: every real run, in the order run.
      device: the device probed.
      memory_limit_bytes: the memory a trial could use.
      limit_source: where that limit came from.
      granularity: trial sizes are multiples of it.
      max_size: the largest size the probe would try.
      strategy: the accumulation strategy whose step was run.
      options: its options.
      state_bytes: parameters plus optimizer state.
      estimate: the compile-only model the search started from.
      isolate: whether trials ran in child processes.
      seconds: the probe's wall time.
      message: a one-line summary for people.
    """

    max_microbatch: int
    trials: tuple[Trial, ...]
    device: DeviceInfo
    memory_limit_bytes: int
    limit_source: str
    granularity: int
    max_size: int
    strategy: str
    options: Mapping[str, Any]
    state_bytes: int
    estimate: Estimate | None
    isolate: bool
    seconds: float
    message: str

    @property
    def runs(self) -> int:
        """Real runs spent."""
        return len(self.trials)

    @property
    def reached_max_size(self) -> bool:
        return self.max_microbatch + self.granularity > self.max_size and self.max_microbatch > 0

    @property
    def step_seconds(self) -> float | None:
        """The step time at ``max_microbatch`` (from its trial)."""
        for t in self.trials:
            if t.fits and t.microbatch_size == self.max_microbatch:
                return t.seconds
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "max_microbatch": self.max_microbatch,
            "runs": self.runs,
            "trials": [t.to_dict() for t in self.trials],
            "device": self.device.to_dict(),
            "memory_limit_bytes": self.memory_limit_bytes,
            "limit_source": self.limit_source,
            "granularity": self.granularity,
            "max_size": self.max_size,
            "strategy": self.strategy,
            "options": dict(self.options),
            "state_bytes": self.state_bytes,
            "estimate": None if self.estimate is None else self.estimate.to_dict(),
            "isolate": self.isolate,
            "seconds": self.seconds,
            "step_seconds": self.step_seconds,
            "message": self.message,
        }


class ProbeError(RuntimeError):
    """A trial failed for another reason than memory; ``trial`` has its message, ``trials`` all runs so far."""

    def __init__(self, message: str, trial: Trial, trials: tuple[Trial, ...]) -> None:
        super().__init__(message)
        self.trial = trial
        self.trials = trials


@dataclasses.dataclass(frozen=True)
class Setup:
    """A validated probe request: what to run, where, under which limit."""

    job: Job
    device: DeviceInfo
    memory_limit_bytes: int
    limit_source: str
    state_bytes: int
    max_size: int
    granularity: int
    isolate: bool


def prepare(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation | None = None,
    strategy: str = "scan",
    memory_limit: int | float | str | None = None,
    max_size: int | None = None,
    granularity: int = 1,
    has_aux: bool = False,
    isolate: bool = True,
    device: Any = None,
    options: Mapping[str, Any] | None = None,
) -> Setup:
    """Checks a probe request and resolves its device and limit; runs nothing. See `probe` for arguments."""
    granularity = check_positive_int(granularity, "granularity")
    size_cap = DEFAULT_MAX_SIZE if max_size is None else check_positive_int(max_size, "max_size")
    if size_cap < granularity:
        raise ValueError(
            f"`max_size`={size_cap} is below `granularity`={granularity}, so no size can be tried; raise "
            "max_size or lower granularity."
        )
    if not isinstance(isolate, bool):
        raise TypeError(f"`isolate` must be a bool, got {isolate!r}.")
    limit = None if memory_limit is None else parse_bytes(memory_limit, "memory_limit")
    optimizer = default_optimizer() if optimizer is None else optimizer
    options = dict(options or {})
    leading_size(batch)
    update = build_update(
        loss_fn, optimizer, microbatch_size=granularity, strategy=strategy, has_aux=has_aux, **options
    )
    info = detect_device(device)
    limit, source = _resolve_limit(info, limit, isolate)
    needed = state_bytes(update, params)
    if limit <= needed:
        raise ValueError(
            f"`memory_limit`={format_bytes(limit)} ({limit} bytes) is below what the parameters and optimizer "
            f"state alone need: {format_bytes(needed)} ({needed} bytes); give a limit above that."
        )
    job = Job(loss_fn, optimizer, host_copy(params), host_copy(batch), has_aux, strategy, options)
    return Setup(job, info, limit, source, needed, size_cap, granularity, isolate)


def _resolve_limit(info: DeviceInfo, limit: int | None, isolate: bool) -> tuple[int, str]:
    if info.platform == "cpu":
        if limit is not None:
            return limit, "memory_limit"
        share = info.memory_limit_bytes
        if share is None:
            raise ValueError(
                "`memory_limit` is None and this machine's available RAM cannot be read; pass memory_limit, "
                "e.g. '4GiB'."
            )
        return share, f"{CPU_MEMORY_FRACTION:.0%} of available RAM ({info.sources.get('free_bytes', '?')})"
    if info.platform == "tpu" and isolate:
        raise ValueError("`isolate=True` cannot run trials on a TPU (one process owns the chip); pass isolate=False.")
    if limit is not None and not isolate:
        raise ValueError(
            f"`memory_limit`={limit} needs isolate=True on {info.platform}: the cap is set on a trial process's "
            "allocator when it starts; with isolate=False trials use this process's allocator "
            f"(bytes_limit={info.limit_bytes}). Drop memory_limit or keep isolate=True."
        )
    if limit is None:
        if info.limit_bytes is None:
            raise ValueError(f"`memory_limit` is None and {info.name} reports no allocator limit; pass memory_limit.")
        limit, source = info.limit_bytes, "XLA allocator limit (memory_stats bytes_limit)"
    else:
        source = "memory_limit"
    if info.platform == "gpu" and isolate:
        if info.total_bytes is not None and limit > info.total_bytes:
            raise ValueError(
                f"`memory_limit`={format_bytes(limit)} is above the card's {format_bytes(info.total_bytes)}; "
                "give a smaller limit."
            )
        if info.free_bytes is not None and limit > info.free_bytes:
            raise ValueError(
                f"`memory_limit`={format_bytes(limit)} is above the {format_bytes(info.free_bytes)} free on "
                f"{info.name} now (a process holds the rest: XLA preallocates 75% of the card unless "
                "XLA_PYTHON_CLIENT_PREALLOCATE=false is set before JAX starts). Free it, set that variable, "
                "pass a smaller memory_limit, or pass isolate=False."
            )
    return limit, source


def estimate(setup: Setup) -> Estimate | None:
    """`estimate_job` for ``setup``, in this process."""
    return estimate_job(
        setup.job, limit=setup.memory_limit_bytes, max_size=setup.max_size, granularity=setup.granularity
    )


def estimate_job(job: Job, *, limit: int, max_size: int, granularity: int) -> Estimate | None:
    """The compile-only model: `autoaccum.estimate` of the trial's step (one microbatch per step, the runtime's
    own needs included), summarised for the search. None if XLA runs out of memory compiling it.

    It traces ``loss_fn``, so `probe` runs it in a child process when trials are isolated.
    """
    from autoaccum.estimate import estimate as compile_only

    try:
        est = compile_only(
            job.loss_fn, job.params, job.batch, optimizer=job.optimizer, strategy=job.strategy, memory_limit=limit,
            has_aux=job.has_aux, max_size=max_size, accumulation=False, **dict(job.options),
        )  # fmt: skip
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            return None
        raise
    singles = est.single_points
    return Estimate(
        sizes=tuple(p.microbatch for p in singles),
        peak_bytes=tuple(p.total_bytes for p in singles),
        fixed_bytes=est.fixed_bytes,
        per_example_bytes=est.per_example_bytes,
        predicted=est.max_microbatch // granularity * granularity,
        seconds=est.seconds,
    )


def search(
    run: Callable[[int], Trial],
    *,
    limit: int,
    max_size: int,
    granularity: int = 1,
    estimate: Estimate | None = None,
) -> int:
    """The largest multiple of ``granularity`` (up to ``max_size``) for which ``run`` fits, exactly.

    Model-guided bracketing, then bisection as a safeguard (see the module docstring). ``run(size)`` runs
    one trial; the search only uses ``fits`` and ``peak_bytes`` of what it returns.

    Example:
      >>> run = lambda m: Trial(m, 100 + 3 * m <= 1000, 0.0, peak_bytes=100 + 3 * m)
      >>> search(run, limit=1000, max_size=4096)
      300
    """
    g = granularity
    top = max_size // g
    lo, hi = 0, top + 1  # in granules: lo fits (0 trivially), hi does not (top + 1: beyond max_size)
    points: list[tuple[int, int]] = []  # (granules, peak bytes) of trials that fit
    per_granule = None if estimate is None or estimate.per_example_bytes <= 0 else estimate.per_example_bytes * g
    d_up, down = 1, 1 / 8  # the next step above a fit (granules), the next step below a failure (of the bracket)
    widths: list[int] = []
    while hi - lo > 1:
        prediction = _predict(points, limit, per_granule, hi if hi <= top else None)
        if prediction is None and not points and estimate is not None:
            # Below the compile-only prediction by a margin, unless it says that even max_size fits.
            prediction = top + 1.0 if estimate.predicted >= top * g else estimate.predicted / g * FIRST_MARGIN
        if prediction is None:
            cand = (lo + hi) // 2 if hi <= top else max(1, 2 * lo)
        else:
            k = math.floor(prediction)
            if k <= lo:  # the model says the last fit is the largest: check just above, growing
                cand = lo + d_up if lo + d_up < hi else (lo + hi) // 2
                d_up *= 2
            elif k >= hi > top:  # the model says max_size fits: try it
                cand = top
            elif k >= hi:  # the model over-reaches a known failure: step down, growing
                cand = hi - max(1, math.ceil((hi - lo) * down))
                down = min(0.5, down * 2)
            else:
                cand = k
        if hi <= top and len(widths) >= 3 and widths[-1] > widths[-2] / 2 and widths[-2] > widths[-3] / 2:
            cand = (lo + hi) // 2  # a real failure bounds the search and two steps did not halve it: bisect
        cand = min(max(cand, lo + 1), hi - 1)
        trial = run(cand * g)
        if trial.fits:
            lo, down = cand, 1 / 8
            if trial.peak_bytes is not None:
                points.append((cand, trial.peak_bytes))
        else:
            hi = cand
        widths.append(hi - lo)
    return lo * g


def _predict(
    points: list[tuple[int, int]], limit: int, per_granule: float | None, failed: int | None = None
) -> float | None:
    """Granules at which the model meets ``limit``: the slope measured between the largest fitting trial and
    one well below it (else the estimate's), anchored at whichever fitting trial in the upper half gives the
    most cautious answer (a trial that under-reports its peak must not push the next one over the edge).

    A failure at ``failed`` granules bounds the slope from below: from a fit at ``k`` using ``u`` bytes, the
    step grew by more than ``limit - u`` bytes by ``failed``. A slope under that bound (an estimate that
    under-counts per example) would aim every next trial past the failure again, so it is raised to it.
    """
    if not points:
        return None
    k_max, u_max = max(points)
    far = [p for p in points if p[0] <= k_max - max(2, k_max // 32)]
    slope = per_granule
    if far:
        k_far, u_far = max(far)
        measured = (u_max - u_far) / (k_max - k_far)
        if measured > 0:
            slope = measured
    if failed is not None:
        bound = max((limit - u) / (failed - k) for k, u in points if k < failed)
        slope = bound if slope is None else max(slope, bound)
    if slope is None or slope <= 0:
        return None
    return min(k + (limit - u) / slope for k, u in points if 2 * k >= k_max)


class TrialRunner:
    """Runs trials of one `Setup`: ``runner(size) -> Trial``, remembering every trial in ``trials``.

    Use as a context manager (it keeps the pickled job in a temporary directory).
    """

    def __init__(self, setup: Setup, progress: Callable[[Trial], None] | None = None) -> None:
        self.setup = setup
        self.progress = progress
        self.trials: list[Trial] = []
        self._dir: Path | None = None
        self._payload: Path | None = None
        self._count = 0

    def __enter__(self) -> TrialRunner:
        if self.setup.isolate:
            self._dir = Path(tempfile.mkdtemp(prefix="autoaccum-probe-"))
            self._payload = self._dir / "job.pkl"
            self._payload.write_bytes(payload(self.setup.job, self.setup.device.platform))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def estimate(self) -> tuple[Estimate | None, str | None]:
        """The compile-only `Estimate` (in a child when isolated), and why it is None when it is."""
        if not self.setup.isolate:
            return estimate(self.setup), None
        s = self.setup
        status, data, output = self._spawn(
            ["estimate", str(s.memory_limit_bytes), str(s.max_size), str(s.granularity)], "estimate"
        )
        if status is None:
            return None, f"the compile-only estimate's child died ({output.strip()[-300:] or 'no output'})"
        if data.get("estimate") is None:
            return None, data.get("message") or "XLA could not compile the step for an estimate"
        fields = dict(data["estimate"])
        fields["sizes"], fields["peak_bytes"] = tuple(fields["sizes"]), tuple(fields["peak_bytes"])
        return Estimate(**fields), None

    def __call__(self, size: int) -> Trial:
        start = time.perf_counter()
        outcome = self._in_child(size) if self.setup.isolate else self._here(size)
        wall = time.perf_counter() - start
        trial = Trial(
            microbatch_size=size,
            fits=outcome.status == "fits",
            seconds=outcome.seconds,
            error=outcome.message if outcome.status == "error" else None,
            peak_bytes=outcome.peak_bytes,
            first_seconds=outcome.first_seconds,
            wall_seconds=wall,
            detail=outcome.message if outcome.status == "oom" else None,
        )
        self.trials.append(trial)
        if self.progress is not None:
            self.progress(trial)
        if trial.error is not None:
            raise ProbeError(f"trial at microbatch {size} failed: {trial.error}", trial, tuple(self.trials))
        return trial

    def _here(self, size: int) -> Outcome:
        info = self.setup.device
        try:
            compiled = compile_trial(self.setup.job, size, info.device)
            return measured(compiled, info.platform, self.setup.memory_limit_bytes)
        except (jax.errors.JaxRuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            return oom_outcome(e)

    def _in_child(self, size: int) -> Outcome:
        kills = oom_kills()
        status, data, output = self._spawn(["trial", str(size), str(self.setup.memory_limit_bytes)], "trial")
        if status is not None:
            return Outcome(**data)
        after = oom_kills()
        killed = None if kills is None or after is None else after > kills
        return classify_exit(status_code(output), output, killed)

    def _spawn(self, args: list[str], kind: str) -> tuple[int | None, dict[str, Any], str]:
        """Runs ``python -m autoaccum._child KIND PAYLOAD ... RESULT``: ``(0, result, output)`` if it wrote its
        result, else ``(None, {}, output)`` with the exit status prepended to the output."""
        assert self._dir is not None and self._payload is not None, "use TrialRunner as a context manager"
        self._count += 1
        result, log = self._dir / f"{kind}-{self._count}.json", self._dir / f"{kind}-{self._count}.log"
        command = [sys.executable, "-m", "autoaccum._child", args[0], str(self._payload), *args[1:], str(result)]
        with open(log, "wb") as out:
            proc = subprocess.run(
                command, env=child_env(self.setup.device, self.setup.memory_limit_bytes),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, check=False,
            )  # fmt: skip
        output = log.read_bytes()[-20000:].decode(errors="replace")
        if result.is_file():
            return 0, json.loads(result.read_text()), output
        return None, {}, f"{_STATUS}{proc.returncode}\n{output}"


_STATUS = "autoaccum-child-exit-status: "


def status_code(output: str) -> int:
    """The exit status `TrialRunner._spawn` put at the start of a dead child's output."""
    first = output.split("\n", 1)[0]
    return int(first[len(_STATUS) :]) if first.startswith(_STATUS) else 1


_CPU_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TOP_PAD_": "0",
    "MALLOC_TRIM_THRESHOLD_": "0",
}


def child_env(info: DeviceInfo, limit: int, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a trial's child: one device, its allocator capped at ``limit`` on a GPU.

    On a GPU: ``CUDA_VISIBLE_DEVICES`` selects the probed card, ``XLA_CLIENT_MEM_FRACTION`` = ``limit`` /
    the card's total (XLA's BFC allocator then hands out at most that), ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    and the default allocator (the fraction is ignored by ``platform``). On the CPU: ``JAX_PLATFORMS=cpu``
    and glibc malloc made predictable under the cap: ``MALLOC_ARENA_MAX=1`` (no per-thread arenas, which reserve
    address space in 64 MiB heaps), ``MALLOC_MMAP_THRESHOLD_=65536`` (every large buffer is its own mapping,
    released when freed; no dynamic threshold), ``MALLOC_TOP_PAD_=0`` and ``MALLOC_TRIM_THRESHOLD_=0``. Without
    them the same size fits in one child and not in the next (measured: +-50 examples at 100 MiB).

    Example:
      >>> import autoaccum
      >>> child_env(autoaccum.detect_device(), 2**30, {})["JAX_PLATFORMS"]
      'cpu'
    """
    out = dict(os.environ if env is None else env)
    out["JAX_PLATFORMS"] = info.platform
    if info.platform == "gpu":
        if info.total_bytes is None:
            raise ValueError(f"cannot cap {info.name}: its total memory is unknown (no NVML, no memory_stats).")
        out["CUDA_VISIBLE_DEVICES"] = info.visible_id or "0"
        out.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        out["XLA_CLIENT_MEM_FRACTION"] = f"{math.floor(limit / info.total_bytes * 1e6) / 1e6:.6f}"
        out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        out.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    elif info.platform == "cpu":
        for name, value in _CPU_MALLOC.items():
            out.setdefault(name, value)
    return out


def payload(job: Job, platform: str) -> bytes:
    """``job`` pickled for a child: ``(sys.path, platform, cloudpickle bytes)``.

    Functions from modules a fresh interpreter could not import (``__main__``, files loaded by path, as
    `autoaccum.load_workload` does) are pickled by value.
    """
    import cloudpickle

    with _by_value(_unimportable_modules(job.loss_fn)):
        body = cloudpickle.dumps(job)
    return pickle.dumps(([p for p in sys.path if p], platform, body))


def _unimportable_modules(fn: Any) -> list[ModuleType]:
    modules: list[ModuleType] = []
    name = getattr(fn, "__module__", None)
    if not isinstance(name, str):
        return modules
    module = sys.modules.get(name)
    if module is not None and name != "__main__":
        top = name.split(".")[0]
        if importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if p]) is None and (
            top not in sys.builtin_module_names
        ):
            modules.append(module)
    return modules


@contextmanager
def _by_value(modules: list[ModuleType]) -> Iterator[None]:
    import cloudpickle

    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)


def probe(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    optimizer: optax.GradientTransformation | None = None,
    strategy: str = "scan",
    memory_limit: int | float | str | None = None,
    max_size: int | None = None,
    granularity: int = 1,
    has_aux: bool = False,
    isolate: bool = True,
    device: Any = None,
    options: Mapping[str, Any] | None = None,
    progress: Callable[[Trial], None] | None = None,
) -> ProbeResult:
    """Finds the largest microbatch whose full update step really runs here, in few real runs.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (mean over the batch), or ``(scalar, aux)`` with has_aux.
      params: the parameters (never changed or donated: trials use copies).
      batch: an example batch; trial batches repeat its rows.
      optimizer: the optax optimizer training uses (None: `default_optimizer`, ``optax.adamw(1e-3)``).
      strategy: the accumulation strategy whose step is run (``strategies.available()``).
      memory_limit: bytes a trial may use, an int or a string like ``"1.5GiB"``/``"800MB"``. On a GPU the
        trial's XLA allocator is capped to it (so a big card can answer for a smaller one); default: XLA's
        allocator limit. On the CPU the trial's address space is capped at its size before the trial plus
        the limit (``RLIMIT_AS``); default: 50% of the RAM available now.
      max_size: the largest microbatch to try (default 16384).
      granularity: trial sizes are multiples of it (e.g. 8 for tensor cores).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      isolate: run each trial in a fresh child process (default). ``False`` runs them here, catching only
        out-of-memory errors: faster, but an abort or a segfault in a trial kills this process, memory
        fragmentation and leaked buffers carry from one trial to the next, and on the CPU this process's
        own address-space limit is lowered during each trial. On a GPU it needs ``memory_limit=None``.
      device: a ``jax.Device`` (default: the first).
      options: the strategy's options.
      progress: called with each `Trial` as it finishes.

    Returns:
      A `ProbeResult`; ``max_microbatch`` fits and ``max_microbatch + granularity`` does not (or is above
      ``max_size``); 0 when not even ``granularity`` fits.

    Raises:
      ValueError, TypeError: bad arguments, a limit that does not parse or is below the parameters' and
        optimizer state's bytes, before anything runs.
      ProbeError: a trial failed for another reason than memory (its message says why).

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> loss_fn = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros(4)}
      >>> result = autoaccum.probe(loss_fn, jnp.zeros(8), batch, optimizer=optax.sgd(0.1),
      ...                          memory_limit="256MiB", max_size=64, isolate=False)
      >>> result.max_microbatch
      64
    """
    start = time.perf_counter()
    setup = prepare(
        loss_fn, params, batch, optimizer=optimizer, strategy=strategy, memory_limit=memory_limit,
        max_size=max_size, granularity=granularity, has_aux=has_aux, isolate=isolate, device=device,
        options=options,
    )  # fmt: skip
    with TrialRunner(setup, progress) as runner:
        model, why = runner.estimate()
        best = search(
            runner, limit=setup.memory_limit_bytes, max_size=setup.max_size, granularity=setup.granularity,
            estimate=model,
        )  # fmt: skip
        trials = tuple(runner.trials)
    limit = format_bytes(setup.memory_limit_bytes)
    note = "" if why is None else f" (no compile-only estimate: {why})"
    if best == 0:
        message = (
            f"nothing fits: even a microbatch of {setup.granularity} does not run under {limit} on {setup.device.name}."
        )
    elif best + setup.granularity > setup.max_size:
        message = f"microbatch {best} (max_size) fits under {limit} on {setup.device.name}."
    else:
        message = f"microbatch {best} fits under {limit} on {setup.device.name}; {best + setup.granularity} does not."
    message += note
    return ProbeResult(
        max_microbatch=best,
        trials=trials,
        device=setup.device,
        memory_limit_bytes=setup.memory_limit_bytes,
        limit_source=setup.limit_source,
        granularity=setup.granularity,
        max_size=setup.max_size,
        strategy=strategy,
        options=dict(setup.job.options),
        state_bytes=setup.state_bytes,
        estimate=model,
        isolate=setup.isolate,
        seconds=time.perf_counter() - start,
        message=message,
    )


__all__ = ["Estimate", "ProbeError", "ProbeResult", "Trial", "default_optimizer", "probe", "search"]
