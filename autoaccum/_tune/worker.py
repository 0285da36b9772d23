"""Timing trials in an isolated worker process, under the probe's memory limit, reused from trial to trial.

A `TimingWorker` starts a child (`autoaccum._isolation.child_command`, kind ``worker``) under the probe's
`child_env` (on the CPU the address-space cap, on a GPU the allocator fraction; one device, or the caller's mesh)
and sends it one configuration at a time on its stdin. The worker (`serve`) builds the update for the
configuration, compiles it from shapes, makes the parameters and the effective batch on the device, and times real
steps under the cap (`autoaccum._trial.measured`); it answers on a pipe of its own, in two messages, so that
compiling and stepping have separate time limits: ``{"event": "compiled"}`` once the programs are compiled,
``{"event": "done", "outcome": ...}`` once the steps are timed. Its compiled programs stay cached (the finalists'
re-timing compiles nothing again).

The parent restarts the worker after anything but a clean fit or a step that ran over the limit to its end
(`keeps_worker`): an allocation failure (the allocator's state is not trusted after one), an error, a crash
(classified from the exit status and output as the probe's children are: `autoaccum._isolation.classify_exit`)
or a hang (killed with its process group when a limit passes). A worker killed from outside (a signal the kernel's
OOM killer did not send) times the same configuration once more, in a fresh worker. None of these reaches the
caller: each is an `Outcome` with its reason, and the study goes on. The worker ends with the parent
(`autoaccum._isolation.die_with_parent`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from autoaccum._device import oom_kills
from autoaccum._isolation import ChildRunner, Outcome, child_command, child_env, dead_child, killed_again
from autoaccum._trial import Job

_TIMEOUT: dict[str, Any] = {"event": "timeout"}

MAX_CACHED = 6
"""Configurations whose compiled programs a worker keeps: the fastest timed so far (`evicted`), so the tuner's
re-timings (the ladder's two sizes, the five finalists of its race) compile nothing again."""


def evicted(rates: Mapping[str, float], keep: int = MAX_CACHED) -> list[str]:
    """The keys of ``rates`` (examples per second of each cached configuration, 0 for one that failed) whose
    compiled programs a worker drops to keep ``keep``: the slowest, the earliest cached first among equals.

    Keeping the most recently timed ones instead recompiled two of the three finalists of a tune of the example
    transformer in its race (8.7 s of a 52 s tune): the ladder times the fastest early, then others.

    Example:
      >>> evicted({"a": 10.0, "b": 30.0, "c": 20.0, "d": 0.0}, keep=2)
      ['d', 'a']
    """
    order = sorted(rates, key=rates.__getitem__)  # (stable: the earliest first among equals)
    return order[: max(0, len(rates) - keep)]


@dataclasses.dataclass(frozen=True)
class Request:
    """One configuration to time: ``build`` (`autoaccum.build_update`'s strategy and options), the microbatch,
    and the batch's rows (the effective batch)."""

    build: Mapping[str, Any]
    microbatch_size: int
    rows: int
    steps: int
    warmup: int
    setting: int = 0
    """Which of the worker's knob settings makes the loss (`TimingWorker`'s ``settings``)."""


class TimingWorker:
    """Times configurations of one job in a child process under ``limit`` bytes (per device); see the module
    docstring. Use as a context manager; ``worker.time(request) -> Outcome``.

    Args:
      job: the probe's `Job` (parameters as shapes, the example batch, the model state).
      device: the `autoaccum.DeviceInfo` the trials run on.
      limit: bytes a trial may use, as the probe's.
      compile_timeout, step_timeout: seconds the compiling and the stepping (warm-up and timed steps) may take
        before the worker is killed as hung (None: no limit).
      settings: the values of the loss's own knobs a `Request` picks from (``job.loss_fn`` is then the
        `autoaccum.Knobs` that makes the loss); default one setting, ``{}``: ``job.loss_fn`` is the loss.
    """

    def __init__(
        self,
        job: Job,
        device: Any,
        limit: int,
        *,
        compile_timeout: float | None,
        step_timeout: float | None,
        settings: Sequence[Mapping[str, Any]] = ({},),
    ) -> None:
        self.job, self.device, self.limit = job, device, limit
        self.compile_timeout, self.step_timeout = compile_timeout, step_timeout
        self.restarts = 0
        self.compiles = 0
        """Configurations the worker compiled (not found among the programs it keeps, `MAX_CACHED`)."""
        functions = [getattr(job.loss_fn, "make_loss", job.loss_fn)]  # a Knobs travels with its factory
        self._files = ChildRunner((job, list(settings)), device, limit, functions)
        self._proc: subprocess.Popen[bytes] | None = None
        self._answers: int | None = None
        self._buffer = b""
        self._log: IO[bytes] | None = None
        self._log_path: Path | None = None
        self._kills: int | None = None  # the OOM-kill count when the trial in the worker started (`oom_kills`)

    def __enter__(self) -> TimingWorker:
        self._files.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()
        self._files.__exit__(*exc)

    def time(self, request: Request) -> Outcome:
        """Times one configuration; never raises for what happens in the worker (see the module docstring). A
        worker killed from outside (`autoaccum._isolation.dead_child`) times it once more, in a fresh worker."""
        for _ in range(2):
            outcome, again = self._attempt(request)
            if not again:
                break
        else:
            outcome = killed_again(outcome)
        if not keeps_worker(outcome):
            self._stop()  # a fresh worker for the next trial: nothing of a failed one carries over
        return outcome

    def _attempt(self, request: Request) -> tuple[Outcome, bool]:
        """`time`'s one try, and whether to try once more (the worker was killed from outside)."""
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        self._kills = oom_kills()
        try:
            self._proc.stdin.write((json.dumps(dataclasses.asdict(request)) + "\n").encode())
            self._proc.stdin.flush()
        except BrokenPipeError:
            return self._dead()
        for event, limit, doing in (("compiled", self.compile_timeout, "compiling"), ("done", self.step_timeout, "")):
            message = self._read(limit)
            if message is None:
                return self._dead()
            if message is _TIMEOUT:
                self._stop()
                what = doing or f"stepping ({request.warmup} warm-up and {request.steps} timed steps)"
                return Outcome(
                    "error", message=f"timed out: {what} ran over {limit:g} s and the worker was killed (a hang? "
                    "raise the time limit if it is only slow)."
                ), False  # fmt: skip
            if message["event"] == "done":  # (failed while compiling: no "compiled" message)
                return Outcome.from_dict(message["outcome"]), False
            assert message["event"] == event, message
            if event == "compiled" and not message.get("cached"):
                self.compiles += 1
        raise AssertionError("the worker answered without an outcome")

    def _start(self) -> None:
        directory = self._files.directory
        read_end, write_end = os.pipe()
        self._log_path = directory / f"worker-{self.restarts}.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 (closed in _stop)
        args = [str(write_end), str(self.limit)]
        command = child_command("worker", directory / "job.pkl", args, directory / "unused.json")
        self._proc = subprocess.Popen(
            command, env=child_env(self.device, self.limit, devices=self.job.devices), stdin=subprocess.PIPE,
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
        """The outcome of a worker that died mid-trial, and whether to try once more (`dead_child`); then cleaned
        up."""
        assert self._proc is not None and self._log_path is not None
        returncode = self._proc.wait()
        self._stop()
        return dead_child(returncode, self._log_path, self._kills)

    def _stop(self) -> None:
        from autoaccum._isolation import _kill_group

        if self._proc is not None:
            if self._proc.poll() is None:
                _kill_group(self._proc)
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
    """Whether the worker that produced ``outcome`` may time the next trial: after a fit, and after a step that ran
    to the end but measured a peak over the limit (`over_limit`: its memory was freed as a fit's is); not after an
    allocation failure, an error, a crash or a hang.

    Example:
      >>> keeps_worker(Outcome("oom", peak_bytes=2048)), keeps_worker(Outcome("oom", message="Out of memory"))
      (True, False)
    """
    return outcome.status == "fits" or (outcome.status == "oom" and outcome.peak_bytes is not None)


def over_limit(outcome: Outcome, limit: int) -> Outcome:
    """``outcome``, or an out-of-memory one when it fit but its measured peak is above ``limit``.

    On the CPU the cap bounds the address space's growth, and a worker that ran earlier trials keeps memory
    mapped that a later trial reuses without growing it: the cap alone let a demo trial's resident peak reach
    33.2 MiB under a 32 MiB limit. The measured peak (the resident memory the trial touched) is the check.

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
    from autoaccum._knobs import resolve
    from autoaccum._trial import compile_trial, guarded, measured, warm_up

    (job, settings), platform = load_payload(payload_path)
    device = jax.devices()[0]
    warm_up(device)
    answers = os.fdopen(answers_fd, "w", buffering=1)
    cache: dict[str, Any] = {}
    makers: dict[Any, Any] = {}  # what makes the inputs, the same for every configuration (`compile_trial`)
    rates: dict[str, float] = {}  # examples per second of each cached configuration (`evicted`)

    def run(request: Request) -> Outcome:
        key = json.dumps(
            [request.build, request.microbatch_size, request.rows, request.setting], sort_keys=True, default=str
        )
        compiled = cache.get(key)
        ran_before = compiled is not None
        answer = {"event": "compiled", "cached": ran_before}
        if compiled is None:
            loss_fn = resolve(job.loss_fn, settings[request.setting])
            sub = dataclasses.replace(job, loss_fn=loss_fn, build={**job.build, **request.build})
            compiled = cache[key] = compile_trial(
                sub, request.microbatch_size, device, rows=request.rows, makers=makers
            )
            rates[key] = 0.0
        answers.write(json.dumps(answer) + "\n")
        # A program this worker ran before, re-timed with no warm-up (the ladder's and the race's re-timings): its
        # first call is a step like the others, and is timed (a sixth of each re-timing's calls saved).
        again = ran_before and not request.warmup
        outcome = over_limit(
            measured(
                compiled, platform, limit, steps=request.steps, warmup=request.warmup, resident=True, time_first=again
            ),
            limit,
        )
        rates[key] = request.rows / outcome.seconds if outcome.status == "fits" and outcome.seconds else 0.0
        for old in evicted(rates):
            del cache[old], rates[old]
        return outcome

    for line in sys.stdin:
        request = Request(**json.loads(line))
        outcome = guarded(functools.partial(run, request))
        answers.write(json.dumps({"event": "done", "outcome": outcome.to_dict()}) + "\n")
        if not keeps_worker(outcome):
            return  # the parent starts a fresh worker
