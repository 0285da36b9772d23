"""One probe trial: build the real update step for a microbatch size, run it, report whether it fit.

`compile_trial` and `run_trial` run in the worker process (the default, see `autoaccum._worker`) or in the
caller's process (``isolate=False``). A trial gets the parameters'
shapes and dtypes only (`Job`), and makes the arrays itself: a probe of a 7B-parameter model writes no 28 GB
file. The example batch travels as it is (a few rows).

What "does not fit" means in a trial (`is_oom`): an XLA error, or for a child that dies its output, that
`autoaccum._isolation.says_out_of_memory`; a ``MemoryError`` or an ``OSError`` with ``ENOMEM``. Under the CPU cap,
any other XLA error counts only if the same step then runs without the cap (`measured`: XLA's CPU kernels report
some failed allocations as e.g. ``INTERNAL: YNNPACK operation failed``).

Anything else (an exception from the user's loss, ...) is a trial error, reported with its message.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from autoaccum._batch import abstract, abstract_batch, device_copy, resize_batch
from autoaccum._device import memory_stats
from autoaccum._isolation import Outcome, says_out_of_memory
from autoaccum.strategies import Program, PyTree, layout_of, leading_size

if TYPE_CHECKING:
    from autoaccum._update import Update


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A mesh and the layouts of a trial's inputs on it, without devices, so it crosses a process boundary.

    A child rebuilds the mesh from its own first ``size`` devices (`mesh`): the probe's children see every
    device of the caller's mesh.

    Attributes:
      shape, axis_names, axis_types: the mesh (``jax.sharding.AxisType`` names).
      batch: the batch's ``PartitionSpec`` (its example axis over the batch's mesh axes).
      params: one ``PartitionSpec`` per parameter leaf (replicated, or FSDP over the batch's axes).
      shards: the pieces the batch is cut into (microbatch sizes are multiples of it).
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_types: tuple[str, ...]
    batch: Any
    params: PyTree
    shards: int

    @classmethod
    def of(cls, params: PyTree, batch: PyTree, state: PyTree | None) -> MeshSpec | None:
        """The mesh ``batch`` is sharded over, with the layouts (`autoaccum.strategies.layout_of`); None when
        it is on one device."""
        layout = layout_of(params, batch, () if state is None else state)
        if layout is None:
            return None
        mesh = layout.mesh
        types = tuple(t.name for t in getattr(mesh, "axis_types", ())) or ("Auto",) * len(mesh.axis_names)
        return cls(
            tuple(mesh.shape.values()), tuple(mesh.axis_names), types, layout.batch_spec(),
            layout.param_specs(params), layout.shards,
        )  # fmt: skip

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def mesh(self) -> jax.sharding.Mesh:
        devices = jax.devices()
        if len(devices) < self.size:
            raise RuntimeError(
                f"the mesh {dict(zip(self.axis_names, self.shape, strict=True))} needs {self.size} devices but this "
                f"process sees {len(devices)} ({devices[0].platform}); on the CPU set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={self.size} before JAX starts."
            )
        types = tuple(getattr(jax.sharding.AxisType, t) for t in self.axis_types)
        return jax.make_mesh(self.shape, self.axis_names, axis_types=types, devices=devices[: self.size])

    def shardings(self) -> tuple[PyTree, Any, Any]:
        """``NamedSharding`` of the parameters (a pytree), of the batch and of replicated values."""
        mesh = self.mesh()
        named = functools.partial(jax.sharding.NamedSharding, mesh)
        params = jax.tree.map(named, self.params, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        return params, named(self.batch), named(jax.sharding.PartitionSpec())


@dataclasses.dataclass(frozen=True)
class Job:
    """Everything a trial needs, host-side only, so that it pickles and nothing device-side crosses a process
    boundary: the parameters as ``jax.ShapeDtypeStruct`` (`materialize` makes them), the example batch and the
    model state (None: the loss takes none) as `autoaccum._batch.host_copy` makes them.

    Attributes:
      build: `autoaccum.build_update`'s other arguments (``strategy``, ``has_aux``, ``loss_reduction`` and the
        strategy's options).
      mesh: where the caller's batch is sharded (`MeshSpec`), or None on one device.
    """

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    params: PyTree
    batch: PyTree
    state: PyTree | None
    build: Mapping[str, Any]
    mesh: MeshSpec | None = None

    @property
    def devices(self) -> int:
        """Devices a trial's step runs on (the mesh's, or 1)."""
        return 1 if self.mesh is None else self.mesh.size

    def abstract_params(self) -> PyTree:
        """The parameters as ``jax.ShapeDtypeStruct``, laid out on the mesh when there is one."""
        if self.mesh is None:
            return abstract(self.params)
        shardings = self.mesh.shardings()[0]
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.params, shardings)

    def inputs(self, batch_size: int | None = None) -> tuple[PyTree, PyTree, PyTree | None]:
        """Abstract parameters, batch (``batch_size`` rows, default the example's) and model state, laid out
        on the mesh when there is one (``jax.ShapeDtypeStruct`` with shardings; the state as host arrays)."""
        example = device_copy(self.batch)
        batch = abstract_batch(example, batch_size or leading_size(example))
        params = self.abstract_params()
        if self.mesh is None:
            return params, batch, None if self.state is None else device_copy(self.state)
        _, batch_s, replicated = self.mesh.shardings()
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_s), batch)
        state = None if self.state is None else jax.device_put(device_copy(self.state), replicated)
        return params, batch, state

    @property
    def strategy(self) -> str:
        return str(self.build.get("strategy", "scan"))

    def update(self, microbatch_size: int, donate: bool = True) -> Update:
        """The update `autoaccum.build_update` makes for this job at ``microbatch_size``."""
        from autoaccum._update import build_update

        return build_update(
            self.loss_fn, self.optimizer, microbatch_size=microbatch_size, has_state=self.state is not None,
            donate=donate, **dict(self.build),
        )  # fmt: skip

    def programs(self, update: Update, batch_size: int) -> list[Program]:
        """``update``'s programs for a batch of ``batch_size`` rows, lowered from shapes alone."""
        params, batch, state = self.inputs(batch_size)
        opt_state = jax.eval_shape(update.init, params)
        return update.programs(params, opt_state, batch, *(() if state is None else (abstract(state),)))


def on_device(job: Job, device: Any, *, running: bool = False) -> AbstractContextManager[Any]:
    """Where a trial compiles and makes its arrays: ``device``, or the mesh (``jax.set_mesh``). ``running``: where its
    steps run, on a mesh no context (the arrays' shardings say where): the loop strategy's step does not run under
    ``jax.set_mesh`` ("Closing over inputs to shard_map ... Explicit axes"), as outside it."""
    if job.mesh is None:
        return jax.default_device(device)
    return contextlib.nullcontext() if running else jax.set_mesh(job.mesh.mesh())


def step(update: Update, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree | None) -> tuple[Any, ...]:
    """One call of ``update``, with or without a model state: always ``(params, opt_state, loss, state)``."""
    if state is None:
        return (*update(params, opt_state, batch), None)
    return tuple(update(params, opt_state, batch, state))


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (see the module docstring for the exact rules).

    Example:
      >>> is_oom(MemoryError())
      True
      >>> is_oom(ValueError("RESOURCE_EXHAUSTED"))
      False
    """
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    return isinstance(exc, jax.errors.JaxRuntimeError) and says_out_of_memory(str(exc))


def materialize(params: PyTree, seed: int = 0) -> PyTree:
    """Arrays shaped like ``params`` (``jax.ShapeDtypeStruct`` leaves): small varied floats in [-0.02, 0.02]
    (a sine of each element's index), zeros otherwise.

    The values only need to be ordinary (a step's memory and time do not depend on them); jit it, so that
    the arrays are made on the device without a host copy. Not random on purpose: a random normal per leaf
    is a threefry program per leaf, which took XLA:CPU 5.4 s to compile for the demo transformer (every trial
    compiles this), against a fraction of a second for one fused sine per leaf.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> made = materialize({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)})
      >>> made["w"].shape, bool(jnp.all(jnp.abs(made["w"]) <= 0.02)), int(made["n"])
      ((2, 3), True, 0)
    """
    leaves, treedef = jax.tree.flatten(params)
    made = []
    for i, x in enumerate(leaves):
        if jnp.issubdtype(x.dtype, jnp.floating):
            index = jax.lax.broadcasted_iota(jnp.float32, x.shape, len(x.shape) - 1) if x.shape else jnp.float32(0)
            for axis in range(len(x.shape) - 1):  # a distinct phase per row, so rows differ
                index = index + 7.3 * jax.lax.broadcasted_iota(jnp.float32, x.shape, axis)
            made.append((0.02 * jnp.sin(0.61803 * index + seed + i)).astype(x.dtype))
        else:
            made.append(jnp.zeros(x.shape, x.dtype))
    return jax.tree.unflatten(treedef, made)


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A trial's programs, compiled before anything of its size is allocated."""

    job: Job
    size: int
    device: Any
    update: Any
    make_params: Callable[[], PyTree]
    init: Callable[[PyTree], PyTree]
    resize: Callable[[PyTree], PyTree]
    seconds: float
    step_bytes: int | None = None
    """The most any of the step's programs allocates beyond its inputs (temporaries and outputs not aliased to
    an input, XLA's memory analysis, per device); None where unknown."""
    need_bytes: int | None = None
    """The least the step needs per device by XLA's buffer assignment (`autoaccum._memory.live_bytes` of its
    largest program, plus what stays resident beside it): a lower bound of its peak; None where unknown."""


def compile_trial(
    job: Job, size: int, device: Any, rows: int | None = None, makers: dict[Any, Any] | None = None
) -> Compiled:
    """Builds the update `build_update` makes for microbatch ``size`` and compiles every program a trial runs on
    a batch of ``rows`` examples (default ``size``: one microbatch per step, the probe's trial; a tuning trial
    gives the effective batch).

    Compiling works from abstract shapes and allocates no device buffer, so the memory measured (and, on
    the CPU, capped) afterwards is the step's: parameters, optimizer state, batch and temporaries.

    ``makers``: a dict kept across trials of one job's parameters, optimizer and batch (a tuning worker's), where
    the programs that make the parameters, the optimizer state and the batch of ``rows`` are compiled once: they
    are the same for every microbatch size, strategy and knob (0.5 s of each of the example transformer's
    trials, a tenth of its compiling).
    """
    from autoaccum._memory import live_bytes

    rows = size if rows is None else rows
    makers = {} if makers is None else makers
    start = time.perf_counter()
    update = job.update(size)
    with on_device(job, device):
        params_s = job.abstract_params()
        placed: dict[str, Any] = {}
        if job.mesh is not None:  # made where the mesh's step expects them
            shardings, batch_sharding, _ = job.mesh.shardings()
            placed = {"out_shardings": shardings}
        if "params" not in makers:
            makers["params"] = jax.jit(functools.partial(materialize, abstract(job.params)), **placed).lower().compile()
        if "init" not in makers:  # (`Update.init` is the optimizer's, the same for every strategy)
            makers["init"] = jax.jit(job.optimizer.init)
            makers["init"].lower(params_s).compile()  # the jit keeps it: the call in run_trial does not compile again
        if ("batch", rows) not in makers:
            out = {} if job.mesh is None else {"out_shardings": batch_sharding}
            resized = jax.jit(functools.partial(resize_batch, size=rows), **out)
            makers["batch", rows] = resized.lower(abstract(device_copy(job.batch))).compile()
        make_params, init, resize = makers["params"], makers["init"], makers["batch", rows]
        extra, need = [], []
        try:
            programs = job.programs(update, rows)
        except NotImplementedError:
            if job.mesh is None:
                raise
            programs = []  # (the loop strategy on an Explicit mesh, see `on_device`: its first call compiles it)
        for program in programs:
            analysis = program.lowered.compile().memory_analysis()  # likewise kept by the strategy's jitted functions
            if analysis is not None:
                extra.append(live_bytes(analysis) - analysis.argument_size_in_bytes)
                need.append(live_bytes(analysis) + program.resident_bytes)
    seconds = time.perf_counter() - start
    return Compiled(
        job, size, device, update, make_params, init, resize, seconds, max(extra, default=None), max(need, default=None)
    )


def run_trial(
    compiled: Compiled, peak: Callable[[], int | None], *, steps: int = 1, warmup: int = 0, time_first: bool = False
) -> Outcome:
    """Runs the compiled update step ``1 + warmup + steps`` times on a batch made on the device (the trial's
    rows); the last ``steps`` calls are timed one by one (``Outcome.times``; ``seconds`` is their median).

    ``time_first`` (with no ``warmup``): ``steps`` calls, the first one timed too, for a program that ran before
    in this process (its first call is then a step like the others: a tuning worker's re-timings).

    Before each call after the first, the previous one's memory is let go (`settle`). Raises whatever the step
    raises; the callers decide which errors mean "does not fit".
    """
    job, update, device = compiled.job, compiled.update, compiled.device
    with on_device(job, device):
        params = compiled.make_params()
        made = [params, compiled.init(params), compiled.resize(device_copy(job.batch)), job.inputs(1)[2]]
        del params
        jax.block_until_ready(made)
    with on_device(job, device, running=True):
        inputs = memory_stats(device).get("bytes_in_use")  # a GPU's live bytes now; None on the CPU
        before = proc_status("VmSize")
        out, first, times = run_steps(
            update, made, steps=steps, warmup=warmup, time_first=time_first, between=functools.partial(settle, before)
        )
    used = peak()
    if used is None and inputs is not None and compiled.step_bytes is not None:
        # A GPU's peak_bytes_in_use never goes down: in a process that ran bigger work before (a reused tuning
        # worker; the compiler's autotuning), it says nothing of this step. Then: the live bytes with the
        # inputs made, plus what the step's largest program allocates beyond them (XLA's buffer assignment).
        used = inputs + compiled.step_bytes
    del out
    return Outcome(
        "fits", seconds=statistics.median(times), first_seconds=first, peak_bytes=used,
        compile_seconds=compiled.seconds, times=times,
    )  # fmt: skip


def run_steps(
    update: Update,
    inputs: list[Any],
    *,
    steps: int,
    warmup: int,
    time_first: bool = False,
    between: Callable[[], None] = lambda: None,
    time_limit: float | None = None,
) -> tuple[tuple[Any, ...], float, list[float]]:
    """The one timing loop: calls ``update`` on ``inputs`` (``[params, opt_state, batch, state]``, emptied so that no
    donated buffer is held here) ``1 + warmup + steps`` times (``steps`` with ``time_first``, the first timed too),
    each call ended by ``jax.block_until_ready`` and the next one preceded by ``between()``; returns the last call's
    ``(params, opt_state, loss, state)``, the first call's seconds and the timed calls' seconds.

    Raises:
      TimeoutError: the calls so far took over ``time_limit`` seconds.
    """
    start = time.perf_counter()
    batch = inputs[2]
    out = jax.block_until_ready(step(update, *inputs))
    inputs.clear()
    first = time.perf_counter() - start
    times = [first] if time_first and not warmup else []
    for i in range(warmup + steps - len(times)):
        if time_limit is not None and time.perf_counter() - start > time_limit:
            raise TimeoutError(f"over {time_limit:g} s after {i} of {warmup + steps} steps")
        between()
        resume = time.perf_counter()
        out = jax.block_until_ready(step(update, out[0], out[1], batch, out[3]))
        if i >= warmup:
            times.append(time.perf_counter() - resume)
    return out, first, times


def settle(before: int | None, timeout: float = 1.0) -> None:
    """Waits (at most ``timeout`` s) until the address space is back near ``before`` (VmSize before a step).

    XLA:CPU releases a step's temporary arena asynchronously, after ``block_until_ready`` returns: a second
    step started at once may map its arena while the first one's is still mapped, needing twice the
    temporaries for a moment. Whether it does is a race (measured: 1 trial in 4 failed that way under a cap
    that fits with 120 MB to spare), so a trial lets the first step's memory go before running the second:
    until at most an eighth of what the step added (and at least 1 MiB) is still mapped.
    """
    if before is None:
        return
    after = proc_status("VmSize")
    if after is None:
        return
    slack = max(1 << 20, (after - before) // 8)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        now = proc_status("VmSize")
        if now is None or now <= before + slack:
            return
        time.sleep(0.002)


def oom_outcome(e: BaseException) -> Outcome:
    """The "does not fit" outcome for an error `is_oom` accepts."""
    text = str(e).strip() or type(e).__name__
    return Outcome("oom", message=text.splitlines()[0][:500])


def proc_status(field: str) -> int | None:
    """``field`` (e.g. ``"VmSize"``) of ``/proc/self/status`` in bytes, or None off Linux."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


@contextmanager
def address_space_cap(limit: int, *, resident: bool = False) -> Iterator[Callable[[], int | None]]:
    """Caps this process's address space (soft ``RLIMIT_AS``) at its current size plus ``limit``.

    Yields a function giving the bytes used above that size at the peak (None while the peak is still the
    one from before the cap). The soft limit is restored on exit.

    With ``resident``, for a process that runs many trials (`autoaccum._worker`), whose address-space
    peak only ever grows: the peak is the resident memory's (``VmHWM``, reset here through
    ``/proc/self/clear_refs``) above the resident size at entry, what the trial really touched; None where the
    reset is refused.
    """
    baseline = proc_status("VmSize")
    before_peak = proc_status("VmPeak")
    if resident:
        rss = _reset_resident_peak()
    if baseline is None:
        raise OSError(errno.ENOSYS, "the CPU memory cap needs /proc/self/status (Linux)")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = baseline + limit
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))

    def used() -> int | None:
        if resident:
            hwm = proc_status("VmHWM")
            return None if rss is None or hwm is None else max(hwm - rss, 0)
        peak = proc_status("VmPeak")
        if peak is None or before_peak is None or peak <= before_peak:
            return None
        return peak - baseline

    try:
        yield used
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@functools.cache
def _libc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _trim_heap() -> None:
    """Returns the C heap's free pages to the system, where the C library is glibc (else nothing)."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


def _reset_resident_peak() -> int | None:
    """Resets ``VmHWM`` to the resident size now (Linux 4.0+) and returns that size; None if refused.

    First the C heap's free pages go back to the system (glibc's ``malloc_trim``): a reused process keeps
    freed small allocations resident, and a trial that reused them would touch memory without raising the
    resident size (a small step measured a peak of 0).
    """
    _trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return proc_status("VmRSS")


def gpu_peak(device: Any) -> Callable[[], int | None]:
    """A function giving XLA's ``peak_bytes_in_use`` on ``device`` if it rose since now, else None."""
    from autoaccum._device import memory_stats

    before = memory_stats(device).get("peak_bytes_in_use")

    def peak() -> int | None:
        after = memory_stats(device).get("peak_bytes_in_use")
        if after is None or (before is not None and before > 0 and after <= before):
            return None
        return int(after)

    return peak


def warm_up(device: Any) -> None:
    """Starts the backend, its thread pools and the compiler, so that they are not charged to a trial."""
    jax.block_until_ready(jax.jit(lambda x: x * 2 + 1)(jax.device_put(jnp.ones(8), device)))


def measured(
    compiled: Compiled,
    platform: str,
    limit: int,
    *,
    steps: int = 1,
    warmup: int = 0,
    resident: bool = False,
    time_first: bool = False,
) -> Outcome:
    """`run_trial` under the limit (per device): the CPU's address-space cap (a GPU's allocator is capped at
    start-up).

    On the CPU, an XLA error that is not an OOM by its code (XLA's CPU kernels, e.g. YNNPACK's dot, report a
    failed allocation as ``INTERNAL: YNNPACK operation failed``) is checked by running the same step again
    without the cap: if it then runs, the cap made it fail, and the trial does not fit; if it fails again, the
    error stands. ``steps``, ``warmup``, ``time_first``: as `run_trial`; ``resident``: as `address_space_cap` (a
    reused worker).
    """
    run = functools.partial(run_trial, steps=steps, warmup=warmup, time_first=time_first)
    n = compiled.job.devices
    if platform != "cpu":
        if compiled.job.mesh is None:
            return run(compiled, gpu_peak(compiled.device))
        peaks = [gpu_peak(d) for d in jax.devices()[:n]]  # per device: the fullest one
        return run(compiled, lambda: max((p() or 0 for p in peaks), default=0) or None)
    try:
        # A mesh's CPU devices share this process: the cap is the per-device limit times the devices, the
        # peak reported per device is the process's divided by them (data parallel: equal shares).
        with address_space_cap(limit * n, resident=resident) as used:
            return run(compiled, lambda: None if (u := used()) is None else u // n)
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            raise
        run_trial(compiled, lambda: None)  # raises if the failure is not the cap's doing
        first = oom_outcome(e).message
        return Outcome("oom", message=f"{first} (under the cap; the same step runs without it)")


def guarded(run: Callable[[], Outcome]) -> Outcome:
    """``run()`` in a child process: an allocation failure (`is_oom`) is the ``"oom"`` outcome, and every other
    exception an ``"error"`` outcome with its traceback (a process boundary: the parent makes it a trial error)."""
    try:
        try:
            return run()
        except (jax.errors.JaxRuntimeError, MemoryError, OSError) as e:
            if not is_oom(e):
                raise
            return oom_outcome(e)
    except Exception as e:
        return Outcome("error", message=error_report(e))


def error_report(e: BaseException, limit: int = 3000) -> str:
    """How a child reports an exception it does not survive, the user's code first: the exception and the frames of
    its traceback outside autoaccum and the installed libraries (the loss's file and line), then the end of the
    whole traceback, in at most about ``limit`` characters.

    Example:
      >>> try:
      ...     {}["nope"]
      ... except KeyError as e:
      ...     print(error_report(e).splitlines()[0])
      KeyError: 'nope'
    """
    users = [f for f in traceback.extract_tb(e.__traceback__) if _users_file(f.filename)]
    only = traceback.TracebackException(type(e), e, None)
    if sys.version_info >= (3, 11):
        only.__notes__ = None  # (JAX's note on the frames it removed: in the whole traceback below)
    head = "".join(only.format_exception_only()).strip()
    if users:
        head += "\n" + "".join(traceback.format_list(users[-8:])).rstrip()
    whole = "".join(traceback.format_exception(type(e), e, e.__traceback__)).strip()
    room = max(limit - len(head), 500)
    tail = whole if len(whole) <= room else "..." + whole[-room:]
    return f"{head}\nThe whole traceback (autoaccum's and the libraries' frames too):\n{tail}"


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """The folders whose code is not the user's: autoaccum's (its strategies too) and the Python installation's
    (the standard library, the installed packages)."""
    import sysconfig

    import autoaccum
    from autoaccum import strategies

    paths = sysconfig.get_paths()
    folders = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    folders += [str(Path(m.__file__).parent) for m in (autoaccum, strategies) if m.__file__ is not None]
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders)


def _users_file(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.realpath(filename).startswith(_library_folders())
