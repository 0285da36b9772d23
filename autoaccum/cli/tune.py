"""``autoaccum tune``: find the fastest microbatch and strategy, print the plan, optionally save it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.text import Text

from autoaccum._units import format_bytes
from autoaccum.cli._common import (
    as_flags,
    check_output,
    check_strategies,
    renamed_option,
    resolve_workload,
    strategy_help,
    usage_error,
    workload_arguments,
)
from autoaccum.cli._console import fit_table, make_console, warnings_as_lines
from autoaccum.strategies import REMAT_POLICIES

if TYPE_CHECKING:
    from rich.console import Console

    from autoaccum import Plan

ACCUMULATOR_DTYPES = ("float32", "bfloat16", "float16")
"""The floating dtypes ``--accumulator-dtype`` takes (float64 needs ``jax_enable_x64``: use the library)."""

SNIPPET = """\
import autoaccum

plan = autoaccum.Plan.load({path!r})
# checks that params are the ones the plan was tuned for
update = plan.build({loss}, optimizer, params=params)
opt_state = update.init(params)
# one update on a batch of {batch} examples{state_note}
params, opt_state, loss{state} = update(params, opt_state, batch{state})"""

NNX_SNIPPET = """\
import autoaccum

plan = autoaccum.Plan.load({path!r})
# loss_fn(model, batch), as tuned; the model's parameters are checked against the plan's at the first call
step = autoaccum.nnx.build_update({loss}, plan=plan)
# one update of model and optimizer (an nnx.Optimizer), in place, on a batch of {batch} examples
{out} = step(model, optimizer, batch)"""


@click.command()
@workload_arguments
@click.option("--effective-batch", type=click.IntRange(min=1), help="Examples per update [default: the batch's size].")
@click.option(
    "--strategy",
    "strategy_names",
    multiple=True,
    help=strategy_help(
        "Strategies to consider (repeat the option) [default: all, the one auto picks probed]", auto=False
    ),
)
@click.option(
    "--memory-limit",
    help="Memory a step may use, e.g. 1.5GiB or 800MB; one above the device's memory is lowered to it, with a "
    "warning [default: the workload's own memory_limit where it sets one (--demo: 32MiB on the CPU, 512MiB on a "
    "GPU), else the device's].",
)
@click.option(
    "--budget",
    type=click.IntRange(min=1),
    help="Configurations the study settles, all workers together [default: the whole space if at most 8, else "
    "until the search stops].",
)
@click.option("--n-trials", "n_trials", type=click.IntRange(min=1), hidden=True, help="Deprecated: --budget.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Stop starting trials after SECONDS.")
@click.option(
    "--storage",
    help="Optuna storage: an RDB URL, or :memory: [default: the SQLite file studies.db in $AUTOACCUM_CACHE, else "
    "in $XDG_CACHE_HOME/autoaccum, else in ~/.cache/autoaccum; a folder that cannot be made or written is an error, "
    "exit 2].",
)
@click.option(
    "--study-name", help="Optuna study name [default: a fingerprint of the update program, so re-runs resume]."
)
@click.option("--fresh", is_flag=True, help="Start the study anew, deleting its earlier trials.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option(
    "--microbatch-bound", type=click.IntRange(min=1),
    help="A known bound on the microbatch: skip the probe and time no larger size [default: probe for it].",
)  # fmt: skip
@click.option("--max-microbatch", type=click.IntRange(min=1), hidden=True, help="Deprecated: --microbatch-bound.")
@click.option(
    "--min-microbatch", type=click.IntRange(min=1), default=1, show_default=True,
    help="No trial runs a smaller microbatch (e.g. where BatchNorm's statistics need enough examples).",
)  # fmt: skip
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Save the best plan as JSON here.")
@click.option(
    "--trial-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
    help="Seconds a trial's steps may take before it is recorded as failed (a hang).",
)  # fmt: skip
@click.option(
    "--compile-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
    help="Seconds a trial's compiling (or the worker's start) may take, likewise.",
)  # fmt: skip
@click.option(
    "--race-rounds", type=click.IntRange(min=0), default=4, show_default=True,
    help="Rounds of re-timing the best configurations side by side before the pick, while all stay in (a "
    "budget of timings per finalist; one that drops out leaves its rounds to the others; 0: none).",
)  # fmt: skip
@click.option(
    "--remat", "remat_policies", multiple=True, type=click.Choice(REMAT_POLICIES),
    help="Remat policies to search besides none (repeat; jax.checkpoint_policies names) [default: none: on an "
    "example model they did not lower the peak; see docs/guides/knobs.md].",
)  # fmt: skip
@click.option(
    "--accumulator-dtype", "accumulator_dtypes", multiple=True, type=click.Choice(ACCUMULATOR_DTYPES),
    help="Accumulator dtypes to search (repeat, the first probed; e.g. --accumulator-dtype float32 "
    "--accumulator-dtype bfloat16 for a bfloat16 model) [default: float32].",
)  # fmt: skip
@click.option(
    "--no-isolate", is_flag=True,
    help="Time trials in this process (no worker, no memory cap; a trial that does not fit fails here).",
)  # fmt: skip
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path),
    help="Save a PNG: each trial's measured peak memory against its throughput, the limit, the pick.",
)  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print only JSON (plan, trials, probe).")
def tune(
    workload: str | None,
    demo: bool,
    effective_batch: int | None,
    strategy_names: tuple[str, ...],
    memory_limit: str | None,
    budget: int | None,
    n_trials: int | None,
    timeout: float | None,
    storage: str | None,
    study_name: str | None,
    fresh: bool,
    seed: int,
    microbatch_bound: int | None,
    max_microbatch: int | None,
    min_microbatch: int,
    trial_timeout: float,
    compile_timeout: float,
    race_rounds: int,
    remat_policies: tuple[str, ...],
    accumulator_dtypes: tuple[str, ...],
    no_isolate: bool,
    out: Path | None,
    plot: Path | None,
    as_json: bool,
) -> None:
    """Tune microbatch size and accumulation strategy for the highest measured throughput.

    WORKLOAD is path/to/file.py:function or package.module:function returning an autoaccum.Workload;
    --demo uses the built-in transformer language model.

    \b
    Exit codes: 0 a plan was found; 1 nothing fits or every trial failed; 2 bad usage or bad input;
                130 interrupted (Ctrl-C), 143 terminated (SIGTERM): the study is kept, and running
                the same command again resumes it.
    """
    from autoaccum._knobs import BUILTIN_REMAT
    from autoaccum._tune.result import TrialRecord, scoped
    from autoaccum._tune.run import PRECOMPILE
    from autoaccum._tune.run import tune as run_tune

    if plot is not None:
        _require_matplotlib()
    check_output(out, "--out")
    check_output(plot, "--plot")
    budget = renamed_option("--budget", budget, "--n-trials", n_trials)
    microbatch_bound = renamed_option("--microbatch-bound", microbatch_bound, "--max-microbatch", max_microbatch)
    w = resolve_workload(workload, demo)
    check_strategies(strategy_names, auto=False)
    console = make_console(stderr=as_json, quiet=as_json)
    console.print(f"[bold]workload[/] {w.name}: effective batch {effective_batch or w.batch_size}")
    if memory_limit is None and w.memory_limit is not None:
        memory_limit = str(w.memory_limit)
        console.print(f"memory limit {memory_limit}: the workload's own (--memory-limit overrides it)")
    with _progress(console) as progress:
        task = progress.add_task("probing + tuning", total=None)

        def on_trial(record: TrialRecord, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=f"trial {record.number}")
            progress.console.print(f"  {_describe(record)}", markup=False, highlight=False)

        try:
            with warnings_as_lines(make_console(stderr=True) if as_json else console), scoped(PRECOMPILE, False):
                result = run_tune(
                    w.loss_fn if w.knobs is None else w.knobs,
                    w.params,
                    w.batch,
                    optimizer=w.optimizer,
                    effective_batch=effective_batch,
                    strategies=list(strategy_names) or None,
                    memory_limit=memory_limit,
                    budget=budget,
                    timeout=timeout,
                    storage=storage,
                    study_name=study_name,
                    fresh=fresh,
                    seed=seed,
                    has_aux=w.has_aux,
                    state=w.state,
                    loss_reduction=w.loss_reduction,
                    microbatch_bound=microbatch_bound,
                    min_microbatch=min_microbatch,
                    trial_timeout=trial_timeout,
                    compile_timeout=compile_timeout,
                    race_rounds=race_rounds,
                    isolate=not no_isolate,
                    remat=(None, *dict.fromkeys(remat_policies)) if remat_policies else BUILTIN_REMAT,
                    accumulator_dtype=tuple(dict.fromkeys(accumulator_dtypes)) or "float32",  # (repeats: once)
                    on_trial=[on_trial],
                )
        except (ValueError, TypeError) as e:
            raise usage_error(e) from e
        except RuntimeError as e:
            message = as_flags(str(e))
            console.print(Text.assemble(("error: ", "red"), message))
            if as_json:
                click.echo(json.dumps({"error": message}))
            raise SystemExit(1) from e

    if out is not None:
        result.plan.save(out)
    if plot is not None:
        _plot(result, plot)
    if as_json:
        click.echo(dataclasses.replace(result, message=as_flags(result.message)).to_json())
        return
    _report(console, result, out, isolated=not no_isolate, api=w.api)
    if plot is not None:
        console.print(f"plot saved to {plot}")


def _report(console: Console, result: Any, out: Path | None, *, isolated: bool, api: str = "pytree") -> None:
    """The human report of ``result``: the trials' and the race's tables, the probe, the plan, the snippet."""
    _print_table(console, result)
    plan = result.plan
    if result.probe is not None:
        probed = result.probe
        fits = "fits in one step" if probed.max_microbatch >= plan.effective_batch else "does not fit in one step"
        above = probed.why_not_above and f", {probed.why_not_above}"
        console.print(
            f"\nprobe: microbatch {probed.max_microbatch} fits under {format_bytes(probed.memory_limit_bytes)}"
            f"{above} ({probed.runs} real runs at the tuner's candidate sizes): the effective batch of "
            f"{plan.effective_batch} {fits}",
            highlight=False,
        )
    for setting, sizes in result.predicted_over.items():
        console.print(
            f"not timed: microbatch {', '.join(map(str, sizes))} at {setting}, whose accumulating step (the whole "
            "batch and the accumulator too) is predicted over the limit",
            highlight=False,
            markup=False,
        )
    options = "".join(f" {k}={v}" for k, v in plan.options.items())
    console.print(
        Text.assemble(
            "\n",
            ("best plan", "bold green"),
            f": {_split_text(plan.effective_batch, plan.microbatch_size)}, strategy {plan.strategy}{options}"
            f"{_knobs_text(plan)}, {plan.throughput:,.1f} examples/s on {plan.device}",
        )
    )
    if result.memory_limit_bytes is not None and isolated:
        peak = "not measured" if result.peak_bytes is None else format_bytes(result.peak_bytes)
        import jax  # (imported by the tune already)

        peak += " (resident memory)" if result.peak_bytes is not None and jax.default_backend() == "cpu" else ""
        limit = format_bytes(result.memory_limit_bytes)
        console.print(
            f"the plan's step: measured peak {peak}, limit {limit} (every trial ran in an isolated worker under it)",
            highlight=False,
        )
    message = as_flags(result.message)
    console.print(f"{message}; stored in {result.storage}", highlight=False, markup=False)
    units = "" if result.units is None else f" ({result.units:.1f} units of one compile + five steps of the pick)"
    phases = ", ".join(f"{name} {seconds:.1f}" for name, seconds in result.phases.items() if seconds >= 0.05)
    console.print(f"took {result.seconds:.1f} s{units}: {phases or 'nothing timed'}", highlight=False, markup=False)
    if out is None:
        console.print("the code to train with it: run again with --out plan.json (nothing is timed again)",
                      highlight=False, markup=False)  # fmt: skip
    else:
        console.print(f"plan saved to {out}\n", highlight=False, markup=False)
        console.print(snippet(plan, out, api), highlight=False, markup=False, soft_wrap=True)  # code: never re-wrapped


def snippet(plan: Plan, path: Path, api: str = "pytree") -> str:
    """The code that rebuilds ``plan`` saved at ``path`` and runs one update (with the model state, if it has one),
    through the workload's `Workload.api`.

    Example:
      >>> from autoaccum import Plan
      >>> plan = Plan(effective_batch=8, microbatch_size=4, accumulation_steps=2, strategy="scan", has_state=True)
      >>> print(snippet(plan, Path("plan.json")).splitlines()[-1])
      params, opt_state, loss, state = update(params, opt_state, batch, state)
      >>> print(snippet(plan, Path("plan.json"), "nnx").splitlines()[-1])
      loss = step(model, optimizer, batch)
    """
    loss = "knobs" if plan.knobs else "loss_fn"
    if api == "nnx":
        out = "loss, aux" if plan.has_aux else "loss"
        return NNX_SNIPPET.format(path=str(path), batch=plan.effective_batch, loss=loss, out=out)
    state_note = "; state: the model state (the Workload's), updated" if plan.has_state else ""
    return SNIPPET.format(
        path=str(path), batch=plan.effective_batch, loss=loss, state=", state" if plan.has_state else "",
        state_note=state_note,
    )  # fmt: skip


def _progress(console: Any) -> Any:
    """The trials' progress bar: live on a terminal only, and gone when it ends (the trials' lines stay)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)


def _describe(record: Any) -> str:
    what = f"#{record.number:<3d} microbatch {record.microbatch_size:>5d} x {record.accumulation_steps:<4d}"
    what += f" {record.strategy}"
    what += "".join(f" {k}={v}" for k, v in record.options.items()) + _knobs_text(record)
    if record.throughput is not None:
        spread = "" if record.seconds is None else f" (step {_ms_spread(record.seconds)})"
        return f"{what}: {record.throughput:,.1f} examples/s{spread}"
    return f"{what}: {record.state} {as_flags(record.reason or '')}".rstrip()


def _knobs_text(record: Any) -> str:
    """`` remat=... accumulator_dtype=... knob=...`` of a trial or a plan (nothing when it ran with none)."""
    text = "" if record.remat is None else f" remat={record.remat}"
    text += "" if record.accumulator_dtype == "float32" else f" accumulator_dtype={record.accumulator_dtype}"
    return text + "".join(f" {k}={v}" for k, v in record.knobs.items())


def _ms_spread(seconds: tuple[float, float, float]) -> str:
    """``median ms [q1-q3]`` of a trial's step times."""
    q1, median, q3 = (1e3 * t for t in seconds)
    return f"{median:.3g} ms [{q1:.3g}-{q3:.3g}]"


RACE_NOTE = (
    "relative step time: the median of a finalist's step times in the race, each over its round's median (the "
    "machine's speed then). The race ranks by it, lower is faster; raw examples/s mix rounds run at different "
    "speeds, so they can rank otherwise."
)


def _print_table(console: Console, result: Any) -> None:
    """The trials' table, and the race's (the figure it ranks by, relative step time, beside the raw ones)."""
    columns = [("#", "right"), ("microbatch", "right"), ("steps", "right"), ("strategy", "left"),
               ("examples/s", "right"), ("step time", "left"), ("peak", "right"), ("compile s", "right"),
               ("state", "left")]  # fmt: skip
    rows = []
    for r in result.trials:
        options = "".join(f" {k}={v}" for k, v in r.options.items()) + _knobs_text(r)
        rows.append([
            str(r.number),
            str(r.microbatch_size),
            str(r.accumulation_steps),
            r.strategy + options,
            "" if r.throughput is None else f"{r.throughput:,.1f}",
            "" if r.seconds is None else _ms_spread(r.seconds),
            "" if r.peak_bytes is None else format_bytes(r.peak_bytes),
            "" if r.compile_seconds is None else f"{r.compile_seconds:.2f}",
            (r.state if r.reason is None else f"{r.state}: {as_flags(r.reason)[:60]}")
            + ("" if r.same_program_as is None else f" (same program as #{r.same_program_as}, timed once)"),
        ])  # fmt: skip
    console.print(fit_table(console, "trials (best first; step time: median [quartiles] of its timed steps)",
                            columns, rows))  # fmt: skip
    if not result.race:
        return
    columns = [("#", "right"), ("rounds", "right"), ("steps timed", "right"),
               ("relative step time", "right"), ("examples/s (median)", "right"),
               ("step time", "left"), ("result", "left")]  # fmt: skip
    rows = []
    batch = result.plan.effective_batch
    for i, runner in enumerate(result.race):
        outcome = "winner: the plan" if i == 0 else "finished" if runner.out_after is None else ""
        if runner.out_after is not None:
            failed = runner.rounds < runner.out_after  # (its re-timing in that round failed: out of memory)
            outcome = f"{'failed in' if failed else 'out after'} round {runner.out_after}"
            outcome += f": {runner.failed}" if runner.failed else ""
        rows.append([
            str(runner.trial), str(runner.rounds), str(len(runner.times)),
            "" if runner.relative is None else f"{runner.relative:.3f}",
            f"{batch / runner.quartiles[1]:,.1f}", _ms_spread(runner.quartiles), outcome,
        ])  # fmt: skip
    title = "race: the finalists re-timed side by side, interleaved (winner first: lowest relative step time)"
    console.print(fit_table(console, title, columns, rows))
    console.print(RACE_NOTE, highlight=False, markup=False)


def _split_text(effective_batch: int, m: int) -> str:
    """How ``effective_batch`` examples split into microbatches of ``m``, for people.

    Example:
      >>> _split_text(128, 32), _split_text(100, 64)
      ('microbatch 32 x 4 steps = 128 examples', 'microbatch 64 x 2 steps (the last 36) = 100 examples')
    """
    steps, rest = -(-effective_batch // m), effective_batch % m
    uneven = f" (the last {rest})" if rest and steps > 1 else ""
    return f"microbatch {m} x {steps} steps{uneven} = {effective_batch} examples"


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise click.UsageError("--plot needs matplotlib: pip install 'autoaccum[plot]'.") from e


def _plot(result: Any, path: Path) -> None:
    """Measured peak memory (x) against throughput (y) for every trial that fit: the Pareto front (no other
    trial is both leaner and faster) joined by a line, the pick circled, the memory limit as a vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 2**20
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    points = [(r.peak_bytes / mib, r.throughput, r) for r in result.trials if r.throughput and r.peak_bytes is not None]
    by_strategy: dict[str, list[tuple[float, float]]] = {}
    for x, y, r in points:
        label = r.strategy + "".join(f" {k}={v}" for k, v in r.options.items()) + _knobs_text(r)
        by_strategy.setdefault(label, []).append((x, y))
    for label, xy in sorted(by_strategy.items()):
        xs, ys = zip(*xy, strict=True)
        ax.scatter(xs, ys, label=label, s=28, alpha=0.8)
    front, best = [], -1.0
    for x, y, _ in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            front.append((x, y))
            best = y
    if front:
        ax.plot(*zip(*front, strict=True), color="0.4", linewidth=1, linestyle="--", label="Pareto front")
    plan = result.plan
    pick = next(
        (p for p in points if (p[2].microbatch_size, p[2].strategy, p[2].options)
         == (plan.microbatch_size, plan.strategy, plan.options)), None,
    )  # fmt: skip
    if pick is not None:
        ax.scatter([pick[0]], [pick[1]], s=220, facecolors="none", edgecolors="red", linewidths=1.5, label="pick")
    if result.memory_limit_bytes is not None:
        ax.axvline(result.memory_limit_bytes / mib, color="red", linewidth=1, label="memory limit")
    ax.set_xlabel("measured peak memory of the step (MiB)")
    ax.set_ylabel("examples / s")
    ax.set_title(f"autoaccum tune: effective batch {plan.effective_batch}", fontsize=11)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
