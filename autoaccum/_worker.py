"""The one isolated process: every estimate, "does it fit" and "time it" request runs here, under the memory limit.

A `Worker` starts a child (`autoaccum._isolation.child_command`) that reads one `Request` a line on stdin and
answers on a pipe of its own (`serve`): ``compiled``, then ``done`` with its `Outcome`, so that compiling and stepping
have separate time limits. After anything but a fit the child is restarted (`keeps_worker`); a hung one is killed.
Nothing that happens in the child raises in the caller.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from autoaccum._device import DeviceInfo, oom_kills
from autoaccum._isolation import Outcome, child_command, child_env, dead_child, kill_group, make_directory, payload
from autoaccum._trial import Job
from autoaccum.strategies import PyTree

MAX_CACHED = 6
"""Configurations whose compiled programs a worker keeps: the fastest timed so far (`evicted`)."""

COMPILATION_CACHE = "AUTOACCUM_COMPILATION_CACHE"
"""The environment variable that turns JAX's persistent compilation cache off (``0``); on by default."""


def use_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache (in the folder JAX is given, else ``<cache folder>/jax``) in a
    worker; returns the folder, None where `COMPILATION_CACHE` is ``0`` or the folder cannot be made."""
    import jax

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
    import jax

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


class TrialFailed(Exception):
    """A configuration could not be measured (out of memory, over its time budget); the study goes on."""


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
    """One request of ``kind`` ``"estimate"``, ``"fits"`` or ``"time"``: ``build`` (over the job's), the microbatch, the
    batch's rows, the steps timed after ``warmup``, the knob ``setting`` and, for an estimate, `autoaccum.estimate`'s
    keyword arguments."""

    build: Mapping[str, Any]
    microbatch_size: int
    rows: int
    steps: int = 1
    warmup: int = 0
    setting: int = 0
    kind: str = "time"
    estimate: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Server:
    """Answers requests of one job, in the worker (`serve`) or in this process (``isolate=False``), keeping the
    compiled input makers and the fastest configurations' programs (`evicted`)."""

    def __init__(self, job: Job, settings: Sequence[Mapping[str, Any]], platform: str, device: Any, limit: int) -> None:
        self.job, self.settings, self.platform, self.device, self.limit = job, list(settings), platform, device, limit
        self.cache: dict[str, Any] = {}
        self.rates: dict[str, float] = {}  # examples per second of each cached configuration (`evicted`)
        self.makers: dict[Any, Any] = {}

    def job_for(self, request: Request) -> Job:
        """The job with the request's knob setting's loss and its build options."""
        from autoaccum._knobs import resolve

        loss_fn = resolve(self.job.loss_fn, self.settings[request.setting])
        return dataclasses.replace(self.job, loss_fn=loss_fn, build={**self.job.build, **request.build})

    def answer(self, request: Request, compiled: Callable[[bool], None] = lambda cached: None) -> Outcome:
        """The request's `Outcome`; calls ``compiled(cached)`` once its programs are compiled. A ``"time"`` request
        whose programs alone need more than the limit is not run. Raises what the step raises (see `guarded`)."""
        from autoaccum._trial import compile_trial, measured

        if request.kind == "estimate":
            from autoaccum._estimate import estimate

            job = self.job_for(request)
            params, batch, state = job.inputs()
            est = estimate(
                job.loss_fn, params, batch, optimizer=job.optimizer, state=state, memory_limit=self.limit,
                **dict(request.estimate), **dict(job.build),
            )  # fmt: skip
            compiled(False)
            return Outcome("fits", estimate=est.to_dict())
        if request.kind == "fits":
            trial = compile_trial(self.job_for(request), request.microbatch_size, self.device, makers=self.makers)
            compiled(False)
            return measured(trial, self.platform, self.limit)
        key = json.dumps([request.build, request.microbatch_size, request.rows, request.setting], sort_keys=True)
        cached = self.cache.get(key)
        ran_before = cached is not None
        if cached is None:
            cached = self.cache[key] = compile_trial(
                self.job_for(request), request.microbatch_size, self.device, rows=request.rows, makers=self.makers
            )
            self.rates[key] = 0.0
        compiled(ran_before)
        if cached.need_bytes is not None and cached.need_bytes > self.limit:  # a lower bound of the peak: not run
            del self.cache[key], self.rates[key]
            message = f"not run: XLA's buffer assignment alone needs {cached.need_bytes:,} B, over the limit of "
            return Outcome("oom", peak_bytes=cached.need_bytes, compile_seconds=cached.seconds,
                           message=message + f"{self.limit:,} B")  # fmt: skip
        again = ran_before and not request.warmup  # re-timed with no warm-up: its first call is a step like the others
        timed = measured(cached, self.platform, self.limit, steps=request.steps, warmup=request.warmup, resident=True,
                         time_first=again)  # fmt: skip
        outcome = over_limit(timed, self.limit)
        self.rates[key] = request.rows / outcome.seconds if outcome.status == "fits" and outcome.seconds else 0.0
        for old in evicted(self.rates):
            del self.cache[old], self.rates[old]
        return outcome


_TIMEOUT: dict[str, Any] = {"event": "timeout"}


class Worker:
    """Answers requests of one `Job` in a child process under ``limit`` bytes per device, as a context manager.

    ``compile_timeout``, ``step_timeout``: seconds compiling (an estimate: all of it) and stepping may take before the
    child is killed as hung (None: no limit). ``settings``: the loss's knob values a `Request` picks from."""

    def __init__(
        self,
        job: Job,
        device: DeviceInfo,
        limit: int,
        *,
        compile_timeout: float | None,
        step_timeout: float | None,
        settings: Sequence[Mapping[str, Any]] = ({},),
    ) -> None:
        self.job, self.device, self.limit, self.settings = job, device, limit, [dict(s) for s in settings]
        self.compile_timeout, self.step_timeout = compile_timeout, step_timeout
        self.restarts = 0
        self.start_seconds = 0.0  # spent starting the worker, restarts too
        self.compiles = 0  # configurations compiled (not among the programs kept)
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: int | None = None
        self._buffer = b""
        self._log_path: Path | None = None
        self._kills: int | None = None  # the OOM-kill count when the request started (`oom_kills`)

    def __enter__(self) -> Worker:
        self._dir = make_directory()
        functions = [getattr(self.job.loss_fn, "make_loss", self.job.loss_fn)]  # a Knobs travels with its factory
        try:
            (self._dir / "job.pkl").write_bytes(payload((self.job, self.settings), self.device.platform, functions))
        except BaseException:  # (a job that does not pickle, an interrupt): no folder is left behind
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        import shutil

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
                return self._hung(f"the worker did not start in {self.compile_timeout:g} s")
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write((json.dumps(dataclasses.asdict(request)) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        for event, limit in (("compiled", self.compile_timeout), ("done", self.step_timeout)):
            message = self._read(limit)
            if message is None:
                return self._dead()
            if message is _TIMEOUT:
                what = f"stepping ({request.warmup} warm-up and {request.steps} timed steps)"
                what = "compiling" if event == "compiled" else what
                what = "the compile-only estimate" if request.kind == "estimate" else what
                return self._hung(f"{what} ran over {limit:g} s and the worker was killed (a hang? raise the time "
                                  "limit if it is only slow).")  # fmt: skip
            if message["event"] == "done":  # (failed while compiling: no "compiled" message)
                return Outcome.from_dict(message["outcome"]), False
            if not message.get("cached"):
                self.compiles += 1
        raise AssertionError("the worker answered without an outcome")

    def _start(self) -> None:
        assert self._dir is not None, "use the Worker as a context manager"
        read_end, write_end = os.pipe()
        self._log_path = self._dir / f"worker-{self.restarts}.log"
        command = child_command(self._dir / "job.pkl", [str(write_end), str(self.limit)])
        env = child_env(self.device, self.limit, devices=self.job.devices)
        if _cache_dir():  # the caller's compilation cache (`use_compilation_cache`)
            env["JAX_COMPILATION_CACHE_DIR"] = str(_cache_dir())
        with open(self._log_path, "wb") as log:  # (the child holds its own copy)
            self._proc = subprocess.Popen(
                command, env=env, stdin=subprocess.PIPE,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(write_end,),
            )  # fmt: skip
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
            ready, _, _ = select.select([self._answers], [], [], left)
            if not ready:
                return _TIMEOUT
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
        """The outcome of a worker that died mid-request, and whether to try once more (`dead_child`)."""
        assert self._proc is not None and self._log_path is not None
        returncode = self._proc.wait()
        self._stop()
        return dead_child(returncode, self._log_path, self._kills)

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
    import jax

    from autoaccum._isolation import load_payload
    from autoaccum._trial import guarded, warm_up

    use_compilation_cache()
    (job, settings), platform = load_payload(payload_path)
    device = jax.devices()[0]
    warm_up(device)
    answers = os.fdopen(answers_fd, "w", buffering=1)
    server = Server(job, settings, platform, device, limit)
    answers.write(json.dumps({"event": "ready"}) + "\n")

    def compiled(cached: bool) -> None:
        answers.write(json.dumps({"event": "compiled", "cached": cached}) + "\n")

    for line in sys.stdin:
        request = Request(**json.loads(line))
        outcome = guarded(functools.partial(server.answer, request, compiled))
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
    """Times ``update`` on ``batch`` in this process (``isolate=False``) with `autoaccum._trial.run_steps`, on copies
    of ``params`` and ``state``.

    Raises:
      TrialFailed: out of memory, or the calls so far took over ``time_limit`` seconds.
    """
    import jax
    import jax.numpy as jnp

    from autoaccum._trial import is_oom, run_steps

    params = jax.tree.map(jnp.array, params)
    state = None if state is None else jax.tree.map(jnp.array, state)
    try:
        made = [params, update.init(params), batch, state]
        del params, state
        _, first, times = run_steps(update, made, steps=steps, warmup=warmup, time_limit=time_limit)
    except TimeoutError as e:
        raise TrialFailed(f"timed out: {e}") from e
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if is_oom(e):
            raise TrialFailed(f"out of memory: {(str(e) or type(e).__name__).splitlines()[0][:300]}") from e
        raise
    return Timing(statistics.median(times), first, steps, tuple(times))
