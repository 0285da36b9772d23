"""The one isolated process: every estimate, "does it fit" and "time it" request runs here, under the memory limit.

A `Worker` starts a child (`autoaccum._isolation.child_command`) that reads one `Request` a line on stdin and
answers on a pipe of its own (`serve`): ``compiled``, then ``done`` with its `Outcome`, so that compiling and stepping
have separate time limits. A trial compiles the real update step from shapes (`compile_trial`) and runs it under the
limit (`measured`) in the one timing loop (`run_steps`). "Does not fit" is `is_oom`
(`autoaccum._isolation.says_out_of_memory`, ``MemoryError``, ``ENOMEM``) or, under the CPU cap, an XLA error whose
step then runs without the cap; anything else is an error with its message. After anything but a fit the child is
restarted (`keeps_worker`); a hung one is killed. Nothing that happens in the child raises in the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import hashlib
import json
import math
import os
import pickle
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from autoaccum._batch import abstract, abstract_batch, device_copy, resize_batch
from autoaccum._device import DeviceInfo, memory_stats, oom_kills
from autoaccum._isolation import (
    OUTSIDE_KILLS,
    Outcome,
    child_command,
    child_env,
    classify_exit,
    kill_group,
    load_payload,
    make_directory,
    payload,
    says_out_of_memory,
)
from autoaccum._update import spelled_out
from autoaccum.strategies import Program, PyTree, layout_of, leading_size

if TYPE_CHECKING:
    from autoaccum._update import Update


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """A mesh and the ``PartitionSpec`` of the batch and of each parameter leaf, without devices, so that it pickles (a
    child rebuilds it on its first ``size`` devices); ``shards``: the pieces the batch is cut into."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    axis_types: tuple[str, ...]
    batch: Any
    params: PyTree
    shards: int

    @classmethod
    def of(cls, params: PyTree, batch: PyTree, state: PyTree | None) -> MeshSpec | None:
        """The mesh ``batch`` is sharded over (`autoaccum.strategies.layout_of`); None on one device."""
        layout = layout_of(params, batch, () if state is None else state)
        if layout is None:
            return None
        mesh = layout.mesh
        types = tuple(t.name for t in getattr(mesh, "axis_types", ())) or ("Auto",) * len(mesh.axis_names)
        shape, names = tuple(mesh.shape.values()), tuple(mesh.axis_names)
        return cls(shape, names, types, layout.batch_spec(), layout.param_specs(params), layout.shards)

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
    """What a trial needs, host-side only so that it pickles: the parameters' shapes, host copies of the batch and of
    the model state (None: none), `autoaccum.build_update`'s other arguments and the mesh (None: one device)."""

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
        """Abstract parameters, batch (``batch_size`` rows, default the example's) and model state, on the mesh."""
        example = device_copy(self.batch)
        batch = abstract_batch(example, batch_size or leading_size(example))
        params = self.abstract_params()
        if self.mesh is None:
            return params, batch, None if self.state is None else device_copy(self.state)
        _, batch_s, replicated = self.mesh.shardings()
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_s), batch)
        state = None if self.state is None else jax.device_put(device_copy(self.state), replicated)
        return params, batch, state

    def update(self, microbatch_size: int, donate: bool = True) -> Update:
        """The update `autoaccum.build_update` makes for this job at ``microbatch_size``."""
        from autoaccum._update import build_update

        has_state = self.state is not None
        return build_update(self.loss_fn, self.optimizer, microbatch_size=microbatch_size, has_state=has_state,
                            donate=donate, **dict(self.build))  # fmt: skip

    def programs(self, update: Update, batch_size: int) -> list[Program]:
        """``update``'s programs for a batch of ``batch_size`` rows, lowered from shapes alone."""
        params, batch, state = self.inputs(batch_size)
        opt_state = jax.eval_shape(update.init, params)
        return update.programs(params, opt_state, batch, *(() if state is None else (abstract(state),)))


def on_device(job: Job, device: Any, *, running: bool = False) -> AbstractContextManager[Any]:
    """Where a trial compiles and makes its arrays: ``device``, or the mesh; where it runs (``running``): on a mesh, no
    context (the loop strategy's step does not run under ``jax.set_mesh``)."""
    if job.mesh is None:
        return jax.default_device(device)
    return contextlib.nullcontext() if running else jax.set_mesh(job.mesh.mesh())


def step(update: Update, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree | None) -> tuple[Any, ...]:
    """One call of ``update``, with or without a model state: always ``(params, opt_state, loss, state)``."""
    if state is None:
        return (*update(params, opt_state, batch), None)
    return tuple(update(params, opt_state, batch, state))


ALLOCATION_ERRORS = (jax.errors.JaxRuntimeError, MemoryError, OSError, ValueError)
"""The exceptions an allocation failure comes as (`is_oom` decides which are one)."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` says an allocation failed (see the module docstring).

    Example:
      >>> is_oom(MemoryError()), is_oom(ValueError("RESOURCE_EXHAUSTED"))
      (True, False)
    """
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return True
    if isinstance(exc, ValueError) and str(exc).startswith("RESOURCE_EXHAUSTED:"):  # (a copy to the device)
        return says_out_of_memory(str(exc))
    return isinstance(exc, jax.errors.JaxRuntimeError) and says_out_of_memory(str(exc))


def materialize(params: PyTree, seed: int = 0) -> PyTree:
    """Arrays shaped like ``params`` (``jax.ShapeDtypeStruct`` leaves): small varied floats in [-0.02, 0.02] (a sine
    of each element's index, far cheaper to compile than a random normal), zeros otherwise. Jit it.

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


CACHE_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A trial's programs, compiled before anything of its size is allocated. Per device, None where unknown:
    ``step_bytes``, the most a program allocates beyond its inputs; ``need_bytes``, a lower bound of the peak by XLA's
    buffer assignment (the largest `autoaccum._estimate.live_bytes` plus what stays resident beside it)."""

    job: Job
    size: int
    device: Any
    update: Any
    make_params: Callable[[], PyTree]
    init: Callable[[PyTree], PyTree]
    resize: Callable[[PyTree], PyTree]
    seconds: float
    step_bytes: int | None = None
    need_bytes: int | None = None
    cached_seconds: float = 0.0
    """What JAX's persistent cache saved compiling them: its hits' compile times less reading them (with
    ``seconds``, the uncached compile time)."""
    costs: tuple[tuple[float, float], ...] = ()
    """``(flops, bytes accessed)`` of each program, by XLA's cost analysis (`autoaccum._estimate.program_cost`)."""


def compile_trial(
    job: Job, size: int, device: Any, rows: int | None = None, makers: dict[Any, Any] | None = None
) -> Compiled:
    """Compiles from shapes alone every program a trial of microbatch ``size`` runs on ``rows`` examples (default
    ``size``). ``makers``, kept across one job's trials: the compiled programs that make the inputs."""
    from autoaccum._estimate import live_bytes, program_cost

    rows = size if rows is None else rows
    makers = {} if makers is None else makers
    start = time.perf_counter()
    update = job.update(size)
    with on_device(job, device), recorded(CACHE_SAVED) as saved:
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
        extra, need, costs = [], [], []
        try:
            programs = job.programs(update, rows)
        except NotImplementedError:
            if job.mesh is None:
                raise
            programs = []  # (the loop strategy on an Explicit mesh, see `on_device`: its first call compiles it)
        for program in programs:
            executable = program.lowered.compile()  # likewise kept by the strategy's jitted functions
            costs.append(program_cost(executable, program, jax.default_backend()))
            analysis = executable.memory_analysis()
            if analysis is not None:
                live = live_bytes(analysis)
                extra.append(live - analysis.argument_size_in_bytes)
                need.append(live + program.resident_bytes)
    seconds = time.perf_counter() - start
    return Compiled(
        job, size, device, update, make_params, init, resize, seconds, max(extra, default=None),
        max(need, default=None), sum(saved), tuple(costs),
    )  # fmt: skip


@contextlib.contextmanager
def recorded(name: str) -> Iterator[list[float]]:
    """Inside it, the list gets the seconds of each event ``name`` that `jax.monitoring` records (`CACHE_SAVED`: what
    a hit of JAX's persistent compilation cache saved, the compile time it stored less reading it, below 0 where
    reading took longer)."""
    saved: list[float] = []

    def listen(event: str, duration_secs: float, **_: str | int) -> None:
        if event == name:
            saved.append(duration_secs)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield saved
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


class _Over(Exception):
    """A step's peak so far is over the limit: the calls left would not lower it."""


def run_trial(
    compiled: Compiled,
    peak: Callable[[], int | None],
    *,
    steps: int = 1,
    warmup: int = 0,
    time_first: bool = False,
    stop_above: int | None = None,
) -> Outcome:
    """Makes the inputs on the device and runs the compiled step (`run_steps`), letting each call's memory go before
    the next (`settle`); ``peak()`` then gives the memory used. With ``stop_above``, the calls stop once ``peak()``
    is above it (the outcome has no step times). Raises whatever the step raises."""
    job, update, device = compiled.job, compiled.update, compiled.device
    with on_device(job, device):
        params = compiled.make_params()
        made = [params, compiled.init(params), compiled.resize(device_copy(job.batch)), job.inputs(1)[2]]
        del params
        jax.block_until_ready(made)
    with on_device(job, device, running=True):
        inputs = memory_stats(device).get("bytes_in_use")  # a GPU's live bytes now; None on the CPU
        before = proc_status("VmSize")

        def between() -> None:
            settle(before)
            if stop_above is not None and (so_far := peak() or 0) > stop_above:
                raise _Over(so_far)

        try:
            out, first, times = run_steps(update, made, steps=steps, warmup=warmup, time_first=time_first,
                                          between=between)  # fmt: skip
        except _Over as over:
            return Outcome("fits", peak_bytes=over.args[0], compile_seconds=compiled.seconds, times=[],
                           cached_seconds=compiled.cached_seconds)  # fmt: skip
    used = peak()
    if used is None and inputs is not None and compiled.step_bytes is not None:
        used = inputs + compiled.step_bytes  # a GPU's peak did not rise (bigger work ran before): live + the step's
    del out
    return Outcome("fits", seconds=statistics.median(times), first_seconds=first, peak_bytes=used,
                   compile_seconds=compiled.seconds, times=times, cached_seconds=compiled.cached_seconds,
                   costs=[list(c) for c in compiled.costs])  # fmt: skip


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
    """The one timing loop: calls ``update`` on ``inputs`` (``[params, opt_state, batch, state]``, emptied here: no
    donated buffer is held) ``1 + warmup + steps`` times (one fewer with ``time_first``, the first call timed too),
    ``between()`` before each call after the first. Returns the last ``(params, opt_state, loss, state)``, the first
    call's seconds and the timed calls'; raises ``TimeoutError`` once the calls took over ``time_limit`` seconds."""
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
    """Waits (at most ``timeout`` s) until at most an eighth (at least 1 MiB) of what a step added to the address space
    since ``before`` is still mapped: XLA:CPU releases a step's arena after ``block_until_ready`` returns."""
    after = None if before is None else proc_status("VmSize")
    if before is None or after is None:
        return
    slack = max(1 << 20, (after - before) // 8)
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        now = proc_status("VmSize")
        if now is None or now <= before + slack:
            return
        time.sleep(0.002)


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (its type's name without one), a part repeated in a row (``"a: a: b"``, as
    XLA:CPU nests "Error dispatching computation") once, at most 500 characters.

    Example:
      >>> first_line(RuntimeError("INTERNAL: Error dispatching: Error dispatching: out of memory"))
      'INTERNAL: Error dispatching: out of memory'
    """
    parts = (str(e).strip() or type(e).__name__).splitlines()[0].split(": ")
    return ": ".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])[:500]


def unless_oom(run: Callable[[], Outcome]) -> Outcome:
    """``run()``, or the ``"oom"`` outcome when it raises an allocation failure (`is_oom`); else it raises."""
    try:
        return run()
    except ALLOCATION_ERRORS as e:
        if not is_oom(e):
            raise
        return Outcome("oom", message=first_line(e))


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
    """Caps this process's address space (soft ``RLIMIT_AS``, restored on exit) at its size now plus ``limit``, never
    above a limit it already has (a user's ``ulimit -v``, which it was raised to); yields a function giving the bytes
    used above that size at the peak (None while the peak is the one from before). With ``resident`` (a reused
    worker): the resident peak (``VmHWM``, reset here) above the resident size now."""
    baseline = proc_status("VmSize")
    before_peak = proc_status("VmPeak")
    if resident:
        rss = _reset_resident_peak()
    if baseline is None:
        raise OSError(errno.ENOSYS, "the CPU memory cap needs /proc/self/status (Linux)")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = min([baseline + limit] + [lim for lim in (soft, hard) if lim != resource.RLIM_INFINITY])
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
def _malloc_trim() -> Callable[[int], int]:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return lambda pad: 0


def _reset_resident_peak() -> int | None:
    """Resets ``VmHWM`` to the resident size after returning the C heap's free pages, and returns that size (None if
    refused)."""
    _malloc_trim()(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return proc_status("VmRSS")


def gpu_peak(device: Any) -> Callable[[], int | None]:
    """A function giving XLA's ``peak_bytes_in_use`` on ``device`` if it rose since now, else None."""
    before = memory_stats(device).get("peak_bytes_in_use")

    def peak() -> int | None:
        after = memory_stats(device).get("peak_bytes_in_use")
        if after is None or (before is not None and before > 0 and after <= before):
            return None
        return int(after)

    return peak


def warm_up(device: Any) -> None:
    """Starts the backend, its thread pools and the compiler, and runs a small gradient step, so that what a runtime
    maps once per process on a first step (XLA:CPU: its dot kernels' code, about 8 MiB) is not charged to a trial."""
    x = jax.device_put(jnp.ones((64, 64)), device)
    jax.block_until_ready(jax.jit(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w))))(x, x))


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
    """`run_trial` under the limit per device: on the CPU the address-space cap (a GPU's allocator is capped at start).
    An XLA error under the cap that is not an OOM by its text does not fit if the same step then runs without the
    cap, else it stands. ``resident``: as for `address_space_cap`, and the calls stop once the peak is over the
    limit (`over_limit` reports it)."""
    stop = limit if resident else None
    run = functools.partial(run_trial, steps=steps, warmup=warmup, time_first=time_first, stop_above=stop)
    n = compiled.job.devices
    if platform != "cpu":
        if compiled.job.mesh is None:
            return run(compiled, gpu_peak(compiled.device))
        peaks = [gpu_peak(d) for d in jax.devices()[:n]]  # per device: the fullest one
        return run(compiled, lambda: max((p() or 0 for p in peaks), default=0) or None)
    try:  # a mesh's CPU devices share this process (data parallel: equal shares)
        with address_space_cap(limit * n, resident=resident) as used:
            return run(compiled, lambda: None if (u := used()) is None else u // n)
    except jax.errors.JaxRuntimeError as e:
        if is_oom(e):
            raise
        run_trial(compiled, lambda: None)  # raises if the failure is not the cap's doing
        first = first_line(e)
        return Outcome("oom", message=f"{first} (under the cap; the same step runs without it)")


_INTERRUPTED: list[int] = []
"""The SIGINTs this child received (`serve` counts them): a KeyboardInterrupt without one is the user's code's."""


def _interrupted(signum: int, frame: Any) -> None:
    _INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def guarded(run: Callable[[], Outcome]) -> Outcome:
    """``run()`` in a child process: an allocation failure (`is_oom`) is the ``"oom"`` outcome, any other exception
    (a KeyboardInterrupt that no SIGINT raised too) an ``"error"`` outcome with its traceback."""
    try:
        return unless_oom(run)
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, KeyboardInterrupt) and _INTERRUPTED:
            raise
        return Outcome("error", message=error_report(e))


def error_report(e: BaseException, limit: int = 3000) -> str:
    """How a child reports an exception: the exception and its frames in the user's files first, then the end of the
    whole traceback, in about ``limit`` characters.

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
    embedded = _called_back(str(e))
    if embedded is not None:
        head = f"{embedded}\n(raised in a callback of the loss: {head.split(TRACEBACK)[0].strip().rstrip(':')})"
    whole = "".join(traceback.format_exception(type(e), e, e.__traceback__)).strip()
    room = max(limit - len(head), 500)
    tail = whole if len(whole) <= room else "..." + whole[-room:]
    return f"{head}{WHOLE}{tail}"


TRACEBACK = "Traceback (most recent call last):"


def _called_back(message: str) -> str | None:
    """The exception a host callback raised and its frames in the user's files, from an XLA error whose ``message``
    holds the callback's traceback as text (None: it holds none).

    Example:
      >>> print(_called_back("INTERNAL: CpuCallback error: " + TRACEBACK + '\\n  File "/my/loss.py", line 3, in f'
      ...                    "\\n    return 1 / 0\\nZeroDivisionError: division by zero"))
      ZeroDivisionError: division by zero
        File "/my/loss.py", line 3, in f
          return 1 / 0
      >>> _called_back("ValueError: my own report: " + TRACEBACK) is None  # (no callback's)
      True
    """
    if TRACEBACK not in message or "callback" not in message.split(TRACEBACK, 1)[0].lower():
        return None
    lines = message.split(TRACEBACK, 1)[1].strip("\n").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not starts:
        return None
    frames, last = [], starts[-1] + 1
    while last < len(lines) and lines[last].startswith("    "):  # (the last frame's source lines)
        last += 1
    for i in starts:
        if _users_file(lines[i].split('"')[1]):
            frames += [lines[i], *(line for line in lines[i + 1 : i + 3] if line.startswith("    "))]
    return "\n".join([*lines[last:], *frames]).strip() or None


WHOLE = "\nThe whole traceback (autoaccum's and the libraries' frames too):\n"
"""Where an `error_report`'s head (the exception and the user's frames) ends."""


def brief(message: str | None, limit: int) -> str:
    """A child's ``message`` in about ``limit`` characters: an `error_report`'s head (the exception and the user's
    frames), else its end (a crash's output ends with its reason).

    Example:
      >>> brief("KeyError: 'x'" + WHOLE + "Traceback ..." * 99, 40), brief("a" * 50 + " SIGABRT", 8)
      ("KeyError: 'x'", '... SIGABRT')
    """
    text = (message or "").strip()
    if WHOLE in text:
        head = text.split(WHOLE)[0].strip()
        return head if len(head) <= limit else head[:limit] + " ..."
    return text if len(text) <= limit else "... " + text[-limit:].lstrip()


@functools.cache
def _library_folders() -> tuple[str, ...]:
    """The folders whose code is not the user's: autoaccum's (its strategies too) and the Python installation's."""
    import sysconfig

    import autoaccum
    from autoaccum import strategies

    paths = sysconfig.get_paths()
    folders = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    folders += [str(Path(m.__file__).parent) for m in (autoaccum, strategies) if m.__file__ is not None]
    return tuple(os.path.join(os.path.realpath(f), "") for f in folders)


def _users_file(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.realpath(filename).startswith(_library_folders())


STEPS, WARMUP = 5, 1
"""Timed steps and warm-up steps of one tuning trial in the worker (a re-timing in the race warms up none); the
probe's trials in a tuning worker run the same, so that their verdict is the one the trial gets."""

MAX_CACHED = 6
"""Configurations whose compiled programs a worker keeps: the fastest timed so far (`evicted`)."""

COMPILATION_CACHE = "AUTOACCUM_COMPILATION_CACHE"
"""The environment variable that turns JAX's persistent compilation cache off (``0``); on by default."""


def use_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache (in the folder JAX is given, else ``<cache folder>/jax``) in a
    worker; returns the folder, None where `COMPILATION_CACHE` is ``0`` or the folder cannot be made."""
    if os.environ.get(COMPILATION_CACHE, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from autoaccum._storage import cache_folder

    folder = Path(_cache_dir() or cache_folder()[0] / "jax")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def _cache_dir() -> str | None:
    return jax.config.values.get("jax_compilation_cache_dir")


@dataclasses.dataclass(frozen=True)
class Timing:
    """One configuration's timing: the median of ``steps`` timed steps (``times``), the compiling, and the measured peak
    per device (in the worker)."""

    seconds_per_step: float
    compile_seconds: float
    steps: int
    times: tuple[float, ...] = ()
    peak_bytes: int | None = None
    cached_seconds: float = 0.0
    """Of the compile time, what JAX's persistent cache saved."""


class TrialFailed(Exception):
    """A configuration could not be measured (out of memory, over its time budget); the study goes on. ``needs``:
    where it was refused before running, XLA's compile-only bytes and the limit they exceed."""

    def __init__(self, message: str, needs: tuple[int, int] | None = None) -> None:
        super().__init__(message)
        self.needs = needs


def evicted(rates: Mapping[str, float], keep: int = MAX_CACHED) -> list[str]:
    """The keys of ``rates`` (examples per second of each cached configuration) a worker drops to keep ``keep``:
    the slowest, the earliest cached first among equals.

    Example:
      >>> evicted({"a": 10.0, "b": 30.0, "c": 20.0, "d": 0.0}, keep=2)
      ['d', 'a']
    """
    order = sorted(rates, key=rates.__getitem__)  # (stable: the earliest first among equals)
    return order[: max(0, len(rates) - keep)]


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of ``kind`` ``"estimate"``, ``"fits"``, ``"time"`` or ``"loss"``: ``build`` (over the job's), the
    microbatch, the batch's rows, the steps timed after ``warmup``, the knob ``setting``; for an estimate,
    `autoaccum.estimate`'s keyword arguments; for a loss, the file holding the caller's parameters and state."""

    build: Mapping[str, Any]
    microbatch_size: int
    rows: int
    steps: int = 1
    warmup: int = 0
    setting: int = 0
    kind: str = "time"
    estimate: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inputs: str = ""


def loss_digest(job: Job, setting: Mapping[str, Any]) -> str:
    """A hash of the loss ``job`` runs at knob ``setting``, lowered on the batch's shapes
    (`autoaccum._preflight.loss_text`): the caller's and the worker's must agree, else the worker would measure
    another program than the caller's (a module global the caller changed at run time is not what the worker's
    fresh import of the module holds)."""
    from autoaccum._knobs import resolve
    from autoaccum._preflight import loss_text

    batch, state = jax.eval_shape(lambda: device_copy((job.batch, job.state)))  # shapes: nothing compiles
    text = loss_text(resolve(job.loss_fn, setting), job.params, batch, state)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


LOSS_DIFFERS = (
    "the loss the worker loaded is not the one this process runs: lowered on the batch's shapes, their programs "
    "differ. The worker imports the loss's module afresh, so module-level values this process changed at run time "
    "(a global set by a script or by the workload function) do not reach it; pass such values through the loss "
    "itself (a closure, functools.partial) or define them at import time."
)


class Server:
    """Answers requests of one job, in the worker (`serve`) or in this process (``isolate=False``), keeping the
    compiled input makers and the fastest configurations' programs (`evicted`)."""

    def __init__(
        self, job: Job, settings: Sequence[Mapping[str, Any]], platform: str, device: Any, limit: int,
        capped: bool = True,
    ) -> None:  # fmt: skip
        self.job, self.settings, self.platform, self.device, self.limit = job, list(settings), platform, device, limit
        self.cache: dict[str, Any] = {}
        self.rates: dict[str, float] = {}  # examples per second of each cached configuration (`evicted`)
        self.makers: dict[Any, Any] = {}
        self.capped = capped
        """Whether steps run under the CPU cap. False (this process, ``isolate=False``): a failed allocation under a
        cap can leave the runtime broken, and the heap here may hold a step's memory free (the cap reads low)."""

    @property
    def refuses(self) -> bool:
        """Whether a ``"fits"`` request whose programs alone need more than the limit is not run (the others then
        run uncapped, unmeasured): uncapped on the CPU. A ``"time"`` request always is."""
        return not self.capped and self.platform == "cpu"

    def job_for(self, request: Request) -> Job:
        """The job with the request's knob setting's loss and its build options."""
        from autoaccum._knobs import resolve

        loss_fn = resolve(self.job.loss_fn, self.settings[request.setting])
        return dataclasses.replace(self.job, loss_fn=loss_fn, build={**self.job.build, **request.build})

    def answer(self, request: Request, compiled: Callable[[bool], None] = lambda cached: None) -> Outcome:
        """The request's `Outcome`; calls ``compiled(cached)`` once its programs are compiled. A ``"time"`` request
        whose programs alone need more than the limit is not run. Raises what the step raises (see `guarded`)."""
        if request.kind == "loss":
            compiled(False)
            return self._loss(request)
        if request.kind == "estimate":
            from autoaccum._estimate import Estimate, estimate

            job = self.job_for(request)
            params, batch, state = job.inputs()
            kw = dict(request.estimate)  # (as JSON carried it: an estimate it names comes as its dict)
            if kw.get("accumulation_from") is not None:
                kw["accumulation_from"] = Estimate.from_dict(kw["accumulation_from"])
            est = estimate(
                job.loss_fn, params, batch, optimizer=job.optimizer, state=state, memory_limit=self.limit,
                **kw, **dict(job.build),
            )  # fmt: skip
            compiled(False)
            return Outcome("fits", estimate=est.to_dict())
        if request.kind == "fits":
            trial = compile_trial(
                self.job_for(request), request.microbatch_size, self.device, rows=request.rows, makers=self.makers
            )
            compiled(False)
            if self.refuses:
                return self._refused(trial) or run_trial(trial, lambda: None)
            outcome = measured(trial, self.platform, self.limit)  # run even if XLA's figure is over: the probe is exact
            if outcome.status == "fits" and outcome.peak_bytes is None:  # the cap saw nothing: XLA's figure decides
                return self._refused(trial) or outcome
            return outcome
        job = self.job_for(request)  # keyed by the build it resolves to: the probe's and a trial's meet
        spelled = spelled_out(job.build)
        key = json.dumps([spelled, request.microbatch_size, request.rows, request.setting], sort_keys=True, default=str)
        cached = self.cache.get(key)
        ran_before = cached is not None
        if cached is None:
            cached = self.cache[key] = compile_trial(
                job, request.microbatch_size, self.device, rows=request.rows, makers=self.makers
            )
            self.rates[key] = 0.0
        compiled(ran_before)
        refused = self._refused(cached)
        if refused is not None:
            del self.cache[key], self.rates[key]
            return refused
        again = ran_before and not request.warmup  # re-timed with no warm-up: its first call is a step like the others
        timed = measured(cached, self.platform, self.limit, steps=request.steps, warmup=request.warmup, resident=True,
                         time_first=again)  # fmt: skip
        outcome = over_limit(timed, self.limit)
        self.rates[key] = request.rows / outcome.seconds if outcome.status == "fits" and outcome.seconds else 0.0
        for old in evicted(self.rates):
            del self.cache[old], self.rates[old]
        return outcome

    def _loss(self, request: Request) -> Outcome:
        """The loss at the caller's parameters and state (`host_copy` pickles in ``request.inputs``) on the batch's
        first examples (`autoaccum._preflight.initial_loss`), uncapped: it is no trial."""
        from autoaccum._preflight import initial_loss

        job = self.job_for(request)
        with open(request.inputs, "rb") as f:
            params, state = (None if x is None else device_copy(x) for x in pickle.load(f))
        aux, reduction = job.build.get("has_aux", False), job.build.get("loss_reduction", "mean")
        value = initial_loss(job.loss_fn, params, device_copy(job.batch), state=state, has_aux=aux,
                             loss_reduction=reduction, rows=request.microbatch_size or 8)  # fmt: skip
        return Outcome("fits", loss=value)

    def _refused(self, compiled: Compiled) -> Outcome | None:
        """The out-of-memory outcome of a step whose programs alone need more than the limit (a lower bound of its
        peak: it is not run), else None."""
        need = compiled.need_bytes
        if need is None or need <= self.limit:
            return None
        message = f"not run: XLA's buffer assignment alone needs {need:,} B, over the limit of {self.limit:,} B"
        return Outcome("oom", peak_bytes=need, compile_seconds=compiled.seconds, message=message, need_bytes=need)


_TIMEOUT: dict[str, Any] = {"event": "timeout"}

READ_SLICE = 0.25
"""The longest a worker's caller waits in one system call (an interrupt takes effect within it)."""


class Worker:
    """Answers requests of one `Job` in a child process under ``limit`` bytes per device, as a context manager.

    ``compile_timeout``, ``step_timeout``: seconds compiling (an estimate: all of it) and stepping may take before the
    child is killed as hung (None: no limit); ``timeout_names``: the caller's arguments they come from, which a
    timeout's message names. ``settings``: the loss's knob values a `Request` picks from."""

    def __init__(
        self,
        job: Job,
        device: DeviceInfo,
        limit: int,
        *,
        compile_timeout: float | None,
        step_timeout: float | None,
        settings: Sequence[Mapping[str, Any]] = ({},),
        timeout_names: tuple[str, str] = ("compile_timeout", "trial_timeout"),
    ) -> None:
        self.job, self.device, self.limit, self.settings = job, device, limit, [dict(s) for s in settings]
        self.compile_timeout, self.step_timeout, self.timeout_names = compile_timeout, step_timeout, timeout_names
        self.restarts = 0
        self.start_seconds = 0.0  # spent starting the worker, restarts too
        self.compiles = 0  # configurations compiled (not among the programs kept)
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: int | None = None
        self._buffer = b""
        self._log_path: Path | None = None
        self._kills: int | None = None  # the OOM-kill count when the request started (`oom_kills`)
        self._log_start = 0  # the log's size when the request started: a death is judged by what came after

    def __enter__(self) -> Worker:
        self._dir = make_directory()
        functions = [getattr(self.job.loss_fn, "make_loss", self.job.loss_fn)]  # a Knobs travels with its factory
        try:
            job = (self.job, self.settings, loss_digest(self.job, self.settings[0]))
            (self._dir / "job.pkl").write_bytes(payload(job, self.device.platform, functions))
        except BaseException:  # (a job that does not pickle, an interrupt): no folder is left behind
            self.__exit__()
            raise
        return self

    @property
    def folder(self) -> Path:
        """The worker's own folder (removed on exit): files a request names go here."""
        assert self._dir is not None, "use the Worker as a context manager"
        return self._dir

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def ask(self, request: Request) -> Outcome:
        """Answers one request; never raises for what happens in the child."""
        for _ in range(2):
            outcome, again = self._attempt(request)
            if not again:
                break
        else:
            outcome = dataclasses.replace(outcome, message=f"{outcome.message} Run once more, it was killed again.")
        if not keeps_worker(outcome):
            self._stop()  # a fresh worker for the next request: nothing of a failed one carries over
        return outcome

    time = ask  # (a tuning trial's name for it)

    def _attempt(self, request: Request) -> tuple[Outcome, bool]:
        """`ask`'s one try, and whether to try once more (the worker was killed from outside)."""
        self._kills = oom_kills()
        if self._proc is None:
            began = time.perf_counter()
            self._start()
            ready = self._read(self.compile_timeout)
            self.start_seconds += time.perf_counter() - began
            if ready is None:
                return self._dead()
            if ready is _TIMEOUT:
                name = self.timeout_names[0]
                return self._hung(f"the worker did not start in `{name}`={self.compile_timeout:g} s; raise `{name}`.")
        assert self._proc is not None and self._proc.stdin is not None and self._log_path is not None
        self._log_start = self._log_path.stat().st_size if self._log_path.exists() else 0
        try:
            self._proc.stdin.write((json.dumps(dataclasses.asdict(request)) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        for event, limit, name in zip(("compiled", "done"), (self.compile_timeout, self.step_timeout),
                                      self.timeout_names, strict=True):  # fmt: skip
            message = self._read(limit)
            if message is None:
                return self._dead()
            if message is _TIMEOUT:
                what = f"stepping ({request.warmup} warm-up and {request.steps} timed steps)"
                what = "compiling" if event == "compiled" else what
                what = "the compile-only estimate" if request.kind == "estimate" else what
                what = "the loss at the initial parameters" if request.kind == "loss" else what
                return self._hung(f"{what} ran over `{name}`={limit:g} s and the worker was killed (a hang? raise "
                                  f"`{name}` if it is only slow).")  # fmt: skip
            if message["event"] == "done":  # (failed while compiling: no "compiled" message)
                return Outcome.from_dict(message["outcome"]), False
            if not message.get("cached"):
                self.compiles += 1
        raise AssertionError("the worker answered without an outcome")

    def _start(self) -> None:
        assert self._dir is not None, "use the Worker as a context manager"
        read_end, write_end = os.pipe()
        self._log_path, self._log_start = self._dir / f"worker-{self.restarts}.log", 0
        command = child_command(self._dir / "job.pkl", [str(write_end), str(self.limit)])
        env = child_env(self.device, self.limit, devices=self.job.devices)
        if _cache_dir():  # the caller's compilation cache (`use_compilation_cache`)
            env["JAX_COMPILATION_CACHE_DIR"] = str(_cache_dir())
        try:
            with open(self._log_path, "wb") as log:  # (the child holds its own copy)
                self._proc = subprocess.Popen(
                    command, env=env, stdin=subprocess.PIPE,
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(write_end,),
                )  # fmt: skip
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        self._answers, self._buffer = read_end, b""
        self.restarts += 1

    def _read(self, limit: float | None) -> dict[str, Any] | None:
        """The worker's next message; `_TIMEOUT` after ``limit`` seconds; None if it died first."""
        assert self._answers is not None
        deadline = None if limit is None else time.monotonic() + limit
        while b"\n" not in self._buffer:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return _TIMEOUT
            # In slices: a signal the kernel hands to another thread (Optuna's heartbeat, rich's refresh) wakes
            # no select of this one, and Python raises its KeyboardInterrupt here only once this call returns.
            ready, _, _ = select.select([self._answers], [], [], READ_SLICE if left is None else min(left, READ_SLICE))
            if not ready:
                continue
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        message: dict[str, Any] = json.loads(line)
        return message

    def _hung(self, what: str) -> tuple[Outcome, bool]:
        self._stop()
        return Outcome("error", message=f"timed out: {what}"), False

    def _dead(self) -> tuple[Outcome, bool]:
        """The outcome of a worker that died mid-request (`classify_exit` of its log's end, an OOM kill judged by the
        count since the request began), and whether to try once more: killed from outside (`OUTSIDE_KILLS`)."""
        assert self._proc is not None and self._log_path is not None
        returncode = self._proc.wait()
        self._stop()
        with open(self._log_path, "rb") as log:
            log.seek(self._log_start)
            output = log.read()[-20000:].decode(errors="replace")
        now = oom_kills()
        outcome = classify_exit(returncode, output, None if self._kills is None or now is None else now > self._kills)
        return outcome, -returncode in OUTSIDE_KILLS and outcome.status != "oom"

    def _stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                kill_group(self._proc)
            self._proc.wait()
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc = None
        if self._answers is not None:
            os.close(self._answers)
            self._answers = None


def keeps_worker(outcome: Outcome) -> bool:
    """Whether the child that produced ``outcome`` may answer the next request: after a fit, or an out-of-memory
    outcome with a measured (or XLA's) peak, where the child itself is sound.

    Example:
      >>> keeps_worker(Outcome("oom", peak_bytes=2048)), keeps_worker(Outcome("oom", message="Out of memory"))
      (True, False)
    """
    return outcome.status == "fits" or (outcome.status == "oom" and outcome.peak_bytes is not None)


def over_limit(outcome: Outcome, limit: int) -> Outcome:
    """``outcome``, or an out-of-memory one when it fit with a measured peak above ``limit`` (in a reused worker the
    CPU cap bounds only the address space's growth).

    Example:
      >>> over_limit(Outcome("fits", seconds=0.1, peak_bytes=2048), 1024).status
      'oom'
    """
    if outcome.status != "fits" or outcome.peak_bytes is None or outcome.peak_bytes <= limit:
        return outcome
    message = f"measured peak {outcome.peak_bytes:,} B is above the limit of {limit:,} B (the step ran, over it)"
    return dataclasses.replace(outcome, status="oom", message=message)


def serve(payload_path: str, answers_fd: int, limit: int) -> None:
    """The worker's loop (in the child): one `Request` per line of stdin, its `Outcome` on ``answers_fd``."""
    use_compilation_cache()
    signal.signal(signal.SIGINT, _interrupted)
    (job, settings, expected), platform = load_payload(payload_path)
    device = jax.devices()[0]
    warm_up(device)
    answers = os.fdopen(answers_fd, "w", buffering=1)
    server = Server(job, settings, platform, device, limit)
    differs = loss_digest(job, settings[0]) != expected
    answers.write(json.dumps({"event": "ready"}) + "\n")

    def compiled(cached: bool) -> None:
        answers.write(json.dumps({"event": "compiled", "cached": cached}) + "\n")

    for line in sys.stdin:
        request = Request(**json.loads(line))
        outcome = (
            Outcome("error", message=LOSS_DIFFERS)
            if differs
            else guarded(functools.partial(server.answer, request, compiled))
        )
        answers.write(json.dumps({"event": "done", "outcome": outcome.to_dict()}) + "\n")
        if not keeps_worker(outcome):
            return  # the parent starts a fresh worker


def time_update(
    update: Any,
    params: PyTree,
    batch: PyTree,
    *,
    steps: int = 5,
    warmup: int = 1,
    state: PyTree | None = None,
    time_limit: float | None = None,
) -> Timing:
    """Times ``update`` on ``batch`` in this process (``isolate=False``) with `run_steps`, on copies
    of ``params`` and ``state``.

    Raises:
      TrialFailed: out of memory, or the calls so far took over ``time_limit`` seconds.
    """
    params = jax.tree.map(jnp.array, params)
    state = None if state is None else jax.tree.map(jnp.array, state)
    try:
        made = [params, update.init(params), batch, state]
        del params, state
        _, first, times = run_steps(update, made, steps=steps, warmup=warmup, time_limit=time_limit)
    except TimeoutError as e:
        raise TrialFailed(f"timed out: {e}") from e
    except ALLOCATION_ERRORS as e:
        if is_oom(e):
            raise TrialFailed(f"out of memory: {first_line(e)[:300]}") from e
        raise
    return Timing(statistics.median(times), first, steps, tuple(times))
