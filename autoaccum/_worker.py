"""The one isolated process: every estimate, "does it fit" and "time it" request runs here, under the memory limit.

A `Worker` starts a child (`autoaccum._isolation.child_command`) under `autoaccum._isolation.child_env` (on the CPU
the address-space cap, on a GPU the allocator fraction; one device, or every device of the caller's mesh) and sends
it one `Request` at a time on its stdin. The child (`serve`, answering through a `Server`) answers on a pipe of its
own, in two messages, so that compiling and stepping have separate time limits: ``{"event": "compiled"}`` once the
programs are compiled, ``{"event": "done", "outcome": ...}`` once the steps ran. Three kinds of request:

* ``"estimate"``: the compile-only `autoaccum.Estimate` of the step (`Outcome.estimate`); nothing runs;
* ``"fits"``: the probe's trial: one microbatch's step, run twice under the cap (`autoaccum._trial.measured`);
* ``"time"``: a tuning trial: warm-up and timed steps on the effective batch, the compiled programs kept for the
  finalists' re-timings (`MAX_CACHED`), the peak checked against the limit (`over_limit`); not run (out of
  memory, the worker kept) where XLA's buffer assignment alone needs more than the limit, a lower bound of the peak.

The parent restarts the worker after anything but a clean fit (`keeps_worker`): an allocation failure, an error, a
crash (classified from the exit status and output: `autoaccum._isolation.classify_exit`) or a hang (killed with its
process group when the caller's time limit passes). A worker killed from outside (a signal the kernel's OOM killer
did not send) answers the same request once more, in a fresh worker. None of these reaches the caller: each is an
`Outcome` with its reason. The worker ends with the parent (`autoaccum._isolation.die_with_parent`).
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
from typing import IO, Any

from autoaccum._device import DeviceInfo, oom_kills
from autoaccum._isolation import (
    Outcome,
    child_command,
    child_env,
    dead_child,
    kill_group,
    killed_again,
    make_directory,
    payload,
)  # fmt: skip
from autoaccum._trial import Job
from autoaccum.strategies import PyTree

MAX_CACHED = 6
"""Configurations whose compiled programs a worker keeps: the fastest timed so far (`evicted`), so the tuner's
re-timings (the ladder's two sizes, the five finalists of its race) compile nothing again."""

COMPILATION_CACHE = "AUTOACCUM_COMPILATION_CACHE"
"""The environment variable that turns JAX's persistent compilation cache off (``0``); on by default."""


def use_compilation_cache() -> Path | None:
    """Turns on JAX's persistent compilation cache, for programs of any size and compile time, in the folder this
    process's JAX is given (``JAX_COMPILATION_CACHE_DIR``, or set in its config), else ``<cache folder>/jax``
    (`autoaccum._storage.cache_folder`); a worker is given its caller's (`Worker`), so all share one. Called in the
    workers only: the caller's JAX configuration is the user's (and XLA's GPU compiler, compiling for a card with no
    client, cannot read a cache entry back). Returns the folder; None where `COMPILATION_CACHE` is ``0`` or the
    folder cannot be made (then compiling works as before)."""
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
    """How long one configuration's update took.

    Attributes:
      seconds_per_step: the median over the timed steps (compile and warm-up excluded).
      compile_seconds: the compiling (and, timed in this process, the first call).
      steps: timed steps.
      times: each timed step's seconds (empty when only the median is known).
      peak_bytes: the trial's measured peak memory (per device), when measured (in the worker).
    """

    seconds_per_step: float
    compile_seconds: float
    steps: int
    times: tuple[float, ...] = ()
    peak_bytes: int | None = None


class TrialFailed(Exception):
    """A configuration could not be measured (out of memory, over its time budget); the study goes on."""


def evicted(rates: Mapping[str, float], keep: int = MAX_CACHED) -> list[str]:
    """The keys of ``rates`` (examples per second of each cached configuration, 0 for one that failed) whose
    compiled programs a worker drops to keep ``keep``: the slowest, the earliest cached first among equals.

    Example:
      >>> evicted({"a": 10.0, "b": 30.0, "c": 20.0, "d": 0.0}, keep=2)
      ['d', 'a']
    """
    order = sorted(rates, key=rates.__getitem__)  # (stable: the earliest first among equals)
    return order[: max(0, len(rates) - keep)]


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: ``build`` (`autoaccum.build_update`'s strategy and options, over the job's), the microbatch,
    the batch's rows (the effective batch), the steps timed after ``warmup`` steps, which of the worker's knob
    settings makes the loss, the ``kind`` (``"time"``, ``"fits"`` or ``"estimate"``: see the module docstring), and
    for an estimate `autoaccum.estimate`'s other keyword arguments (``max_microbatch``, ``accumulation``, ...)."""

    build: Mapping[str, Any]
    microbatch_size: int
    rows: int
    steps: int = 1
    warmup: int = 0
    setting: int = 0
    kind: str = "time"
    estimate: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Server:
    """Answers requests of one job (`Server.answer`): in the worker (`serve`), or in this process (a probe with
    ``isolate=False``). Keeps what makes the inputs (`autoaccum._trial.compile_trial`'s ``makers``) and the fastest
    timed configurations' programs."""

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
        """The request's `Outcome`; calls ``compiled(cached)`` once its programs are compiled. Raises what the step
        raises (the callers decide what does not fit: `autoaccum._trial.guarded`)."""
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
        if cached.need_bytes is not None and cached.need_bytes > self.limit:
            del self.cache[key], self.rates[key]
            return Outcome(
                "oom", peak_bytes=cached.need_bytes, compile_seconds=cached.seconds,
                message=f"not run: XLA's buffer assignment alone needs {cached.need_bytes:,} B, over the limit of "
                f"{self.limit:,} B",
            )  # fmt: skip
        # A program this worker ran before, re-timed with no warm-up (the race's re-timings): its first call is a
        # step like the others, and is timed.
        again = ran_before and not request.warmup
        outcome = over_limit(
            measured(
                cached, self.platform, self.limit, steps=request.steps, warmup=request.warmup, resident=True,
                time_first=again,
            ),
            self.limit,
        )  # fmt: skip
        self.rates[key] = request.rows / outcome.seconds if outcome.status == "fits" and outcome.seconds else 0.0
        for old in evicted(self.rates):
            del self.cache[old], self.rates[old]
        return outcome


_TIMEOUT: dict[str, Any] = {"event": "timeout"}


class Worker:
    """Answers requests of one job in a child process under ``limit`` bytes (per device); see the module docstring.
    Use as a context manager; ``worker.ask(request) -> Outcome``.

    Args:
      job: the probe's `Job` (parameters as shapes, the example batch, the model state).
      device: the `autoaccum.DeviceInfo` the requests run on.
      limit: bytes a request may use, as the probe's.
      compile_timeout, step_timeout: seconds the compiling (an estimate: all of it) and the stepping may take before
        the worker is killed as hung (None: no limit).
      settings: the values of the loss's own knobs a `Request` picks from (``job.loss_fn`` is then the
        `autoaccum.Knobs` that makes the loss); default one setting, ``{}``: ``job.loss_fn`` is the loss.
    """

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
        self.start_seconds = 0.0
        """Seconds spent starting the worker (the child's imports and set-up, until it is ready), restarts too."""
        self.compiles = 0
        """Configurations the worker compiled (not found among the programs it keeps, `MAX_CACHED`)."""
        self._dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: int | None = None
        self._buffer = b""
        self._log: IO[bytes] | None = None
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
        """Answers one request; never raises for what happens in the worker (see the module docstring)."""
        for _ in range(2):
            outcome, again = self._attempt(request)
            if not again:
                break
        else:
            outcome = killed_again(outcome)
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
                self._stop()
                return Outcome(
                    "error", message=f"timed out: the worker did not start in {self.compile_timeout:g} s"
                ), False
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
                self._stop()
                what = {"compiled": "compiling", "done": f"stepping ({request.warmup} warm-up and "
                        f"{request.steps} timed steps)"}[event]  # fmt: skip
                if request.kind == "estimate":
                    what = "the compile-only estimate"
                return Outcome(
                    "error", message=f"timed out: {what} ran over {limit:g} s and the worker was killed (a hang? "
                    "raise the time limit if it is only slow)."
                ), False  # fmt: skip
            if message["event"] == "done":  # (failed while compiling: no "compiled" message)
                return Outcome.from_dict(message["outcome"]), False
            if not message.get("cached"):
                self.compiles += 1
        raise AssertionError("the worker answered without an outcome")

    def _start(self) -> None:
        assert self._dir is not None, "use the Worker as a context manager"
        read_end, write_end = os.pipe()
        self._log_path = self._dir / f"worker-{self.restarts}.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 (closed in _stop)
        command = child_command(self._dir / "job.pkl", [str(write_end), str(self.limit)])
        env = child_env(self.device, self.limit, devices=self.job.devices)
        if _cache_dir():  # the caller's compilation cache (`use_compilation_cache`)
            env["JAX_COMPILATION_CACHE_DIR"] = str(_cache_dir())
        self._proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(write_end,),
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
        if self._log is not None:
            self._log.close()
            self._log = None


def keeps_worker(outcome: Outcome) -> bool:
    """Whether the worker that produced ``outcome`` may answer the next request: after a fit, after a step that
    ran to the end but measured a peak over the limit (`over_limit`: its memory was freed as a fit's is), and after
    one not run because its compiled programs alone need more (`Server.answer`); not after an allocation failure,
    an error, a crash or a hang.

    Example:
      >>> keeps_worker(Outcome("oom", peak_bytes=2048)), keeps_worker(Outcome("oom", message="Out of memory"))
      (True, False)
    """
    return outcome.status == "fits" or (outcome.status == "oom" and outcome.peak_bytes is not None)


def over_limit(outcome: Outcome, limit: int) -> Outcome:
    """``outcome``, or an out-of-memory one when it fit but its measured peak is above ``limit``: in a worker that
    ran earlier trials, the CPU cap bounds only the address space's growth, and a trial may reuse memory mapped
    before it; the resident memory it touched is the check.

    Example:
      >>> over_limit(Outcome("fits", seconds=0.1, peak_bytes=2048), 1024).status
      'oom'
      >>> over_limit(Outcome("fits", seconds=0.1, peak_bytes=512), 1024).status
      'fits'
    """
    if outcome.status != "fits" or outcome.peak_bytes is None or outcome.peak_bytes <= limit:
        return outcome
    return dataclasses.replace(
        outcome,
        status="oom",
        message=f"measured peak {outcome.peak_bytes:,} B is above the limit of {limit:,} B (the step ran, over it)",
    )


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
    """Times ``update`` on ``batch`` in this process (``isolate=False``) with `autoaccum._trial.run_steps`: one
    compiling call, ``warmup`` calls, then ``steps`` timed calls. Works on copies of ``params`` and ``state`` (the
    update donates its inputs); ``state`` is given exactly when the update was built with ``has_state``.

    Raises:
      TrialFailed: XLA ran out of memory, or the calls so far exceeded ``time_limit`` seconds.
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
