"""``autoaccum probe``: the largest microbatch whose full update step really runs on this device."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import click
from rich.text import Text

from autoaccum._probe import DEFAULT_TRIAL_TIMEOUT
from autoaccum._units import format_bytes
from autoaccum.cli._common import (
    as_flags,
    check_strategies,
    renamed_option,
    resolve_workload,
    strategy_help,
    usage_error,
    workload_arguments,
)
from autoaccum.cli._console import fit_table, make_console, warnings_as_lines

if TYPE_CHECKING:
    from rich.console import Console

    from autoaccum._probe import ProbeResult, Trial


@click.command()
@workload_arguments
@click.option(
    "--strategy", default="auto", show_default=True,
    help=strategy_help("Accumulation strategy whose update step each trial runs (auto: build_update's default).",
                       auto=True),
)  # fmt: skip
@click.option(
    "--memory-limit",
    help="Memory a trial may use, e.g. 1.5GiB or 800MB; one above the device's memory is lowered to it, with a "
    "warning [default: the workload's own memory_limit where it sets one (--demo: 32MiB on the CPU, 512MiB on a "
    "GPU), else XLA's allocator limit on a GPU, 50% of available RAM on the CPU].",
)
@click.option(
    "--microbatch-cap", type=int, default=16384, show_default=True,
    help="Largest microbatch to try (the search's cap; the answer is the largest that fits).",
)  # fmt: skip
@click.option("--max-microbatch", type=int, hidden=True, help="Deprecated: --microbatch-cap.")
@click.option("--granularity", type=int, default=1, show_default=True, help="Try only multiples of this (e.g. 8).")
@click.option(
    "--effective-batch", type=click.IntRange(min=1),
    help="Run the step that accumulates this many examples per update (tune's): the answer is the largest microbatch "
    "an update of that many examples can use [default: one microbatch per step].",
)  # fmt: skip
@click.option(
    "--trial-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_TRIAL_TIMEOUT,
    show_default=True,
    help="Seconds a trial (compiling and running its step in a child process), or the compile-only estimate, "
    "may take before it is killed and reported as hung (exit 1).",
)  # fmt: skip
@click.option(
    "--no-isolate", is_flag=True,
    help="Run trials in this process (faster; a crashing trial kills it, and memory can carry over; no "
    "--trial-timeout; on the CPU no cap: a size fits when XLA's buffers fit the limit and the step runs).",
)  # fmt: skip
@click.option(
    "--json", "as_json", is_flag=True,
    help='Print only JSON: the ProbeResult, or {"error": ..., "trials": [...]} where a trial failed for another '
    "reason than memory (exit 1).",
)  # fmt: skip
def probe(
    workload: str | None,
    demo: bool,
    strategy: str,
    memory_limit: str | None,
    microbatch_cap: int,
    max_microbatch: int | None,
    granularity: int,
    effective_batch: int | None,
    trial_timeout: float,
    no_isolate: bool,
    as_json: bool,
) -> None:
    """Find the largest microbatch whose update step (forward, backward, optimizer) fits in memory.

    WORKLOAD is path/to/file.py:function or package.module:function returning an autoaccum.Workload;
    --demo uses the built-in transformer language model. Each trial runs the real step in a worker process
    under the memory limit (restarted when a trial crashes, hangs or leaves it unsound); a compile-only
    estimate picks where to start.

    \b
    Exit codes: 0 found a microbatch that fits;
                1 nothing fits, or a trial failed for another reason than memory;
                2 bad usage or bad input (workload, limit, granularity);
                130 interrupted (Ctrl-C); 143 terminated (SIGTERM).
    """
    # The children need the GPU memory: keep this process from preallocating 75% of it when JAX starts.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from autoaccum._probe import ProbeError, prepare
    from autoaccum._probe import probe as run_probe
    from autoaccum._units import parse_bytes

    microbatch_cap = renamed_option("--microbatch-cap", microbatch_cap, "--max-microbatch", max_microbatch)
    if microbatch_cap < 1:
        raise click.BadParameter(f"must be >= 1, got {microbatch_cap}.", param_hint="--microbatch-cap")
    if granularity < 1:
        raise click.BadParameter(f"must be >= 1, got {granularity}.", param_hint="--granularity")
    if memory_limit is not None:
        try:
            parse_bytes(memory_limit, "--memory-limit")
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--memory-limit") from e
    w = resolve_workload(workload, demo)
    check_strategies([strategy], auto=True)
    console = make_console(stderr=as_json, quiet=as_json)
    if memory_limit is None and w.memory_limit is not None:
        memory_limit = str(w.memory_limit)
        console.print(f"memory limit {memory_limit}: the workload's own (--memory-limit overrides it)")

    console.print(f"probing [bold]{w.name}[/] ({strategy}) ...")
    kwargs = dict(
        optimizer=w.optimizer, strategy=strategy, memory_limit=memory_limit, microbatch_cap=microbatch_cap,
        granularity=granularity, has_aux=w.has_aux, state=w.state, loss_reduction=w.loss_reduction,
        isolate=not no_isolate, trial_timeout=None if no_isolate else trial_timeout, effective_batch=effective_batch,
    )  # fmt: skip
    with warnings_as_lines(make_console(stderr=True) if as_json else console):
        try:
            prepare(w.loss_fn, w.params, w.batch, **kwargs)  # bad input is exit 2; errors in trials are exit 1
        except (ValueError, TypeError) as e:
            raise usage_error(e) from e
        try:
            with _LiveTrials(console, None if no_isolate else trial_timeout) as live:
                result = run_probe(w.loss_fn, w.params, w.batch, progress=live.finished, **kwargs)
        except ProbeError as e:
            message = as_flags(str(e))
            if as_json:
                trials = [t.to_dict() for t in e.trials]
                click.echo(json.dumps({"error": message, "trials": trials}, indent=2))
            else:
                console.print(Text.assemble(("error: ", "bold red"), message))
            raise SystemExit(1) from e
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        _report(console, result)
    if result.max_microbatch == 0:
        raise SystemExit(1)


class _LiveTrials:
    """The probe's progress: a line per finished trial, and on a terminal a live line with the running trial's
    elapsed time (and when it will be killed), so that a slow or hanging step shows itself."""

    def __init__(self, console: Console, timeout: float | None) -> None:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.console, self.timeout, self.done = console, timeout, 0
        columns = (SpinnerColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))  # the time first
        self.progress = Progress(*columns, console=console, transient=True) if console.is_terminal else None
        if self.progress is not None:
            self.task = self.progress.add_task(self._running("estimate + trial 1"), total=None)

    def __enter__(self) -> _LiveTrials:
        if self.progress is not None:
            self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.__exit__(None, None, None)

    def _running(self, what: str) -> str:
        killed = "" if self.timeout is None else f"; a child is killed after {self.timeout:g} s (--trial-timeout)"
        return f"{what} running{killed}"

    def finished(self, t: Trial) -> None:
        """Prints trial ``t``'s line; the live line moves on to the next trial."""
        self.done += 1
        details = [] if t.seconds is None else [f"step {t.seconds:.4f} s"]
        details += [] if t.peak_bytes is None or not t.fits else [f"peak {format_bytes(t.peak_bytes)}"]
        details += [] if t.wall_seconds is None else [f"trial {t.wall_seconds:.1f} s"]
        outcome = "[green]fits[/]" if t.fits else "[red]out of memory[/]" if t.error is None else "[bold red]error[/]"
        more = f" ({', '.join(details)})" if details else ""
        self.console.print(f"  microbatch {t.microbatch_size:>7}: {outcome}{more}")
        if self.progress is not None and t.error is None:  # (an error ends the probe)
            self.progress.reset(self.task, description=self._running(f"trial {self.done + 1}"))


def _report(console: Console, result: ProbeResult) -> None:
    d = result.device
    console.print(
        f"device: {d.name} ({d.platform}); limit {format_bytes(result.memory_limit_bytes)} ({result.limit_source})",
        markup=False,
    )
    columns = [("#", "right"), ("microbatch", "right"), ("result", "left"), ("step s", "right"), ("peak", "right"),
               ("trial s", "right")]  # fmt: skip
    rows = [
        (
            str(i), str(t.microbatch_size), "fits" if t.fits else ("out of memory" if t.error is None else "error"),
            "" if t.seconds is None else f"{t.seconds:.4f}",
            "" if t.peak_bytes is None else format_bytes(t.peak_bytes),
            "" if t.wall_seconds is None else f"{t.wall_seconds:.1f}",
        )
        for i, t in enumerate(result.trials, 1)
    ]  # fmt: skip
    console.print(fit_table(console, f"{result.runs} trials in {result.seconds:.1f} s", columns, rows))
    console.print(Text(result.message, style="bold green" if result.max_microbatch else "bold red"))
