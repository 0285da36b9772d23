"""``autoaccum tune``: find the fastest microbatch and strategy, print the plan, optionally save it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from autoaccum import strategies as strategies_lib
from autoaccum.cli._common import resolve_workload, workload_arguments

SNIPPET = """\
import autoaccum
plan = autoaccum.Plan.load({path!r})
update = plan.build(loss_fn, optimizer, params=params)   # checks params match the plan
opt_state = update.init(params)
params, opt_state, loss = update(params, opt_state, batch)   # batch: {batch} examples"""


@click.command()
@workload_arguments
@click.option("--effective-batch", type=click.IntRange(min=1), help="Examples per update [default: the batch's size].")
@click.option(
    "--strategy",
    "strategy_names",
    multiple=True,
    type=click.Choice(strategies_lib.available()),
    help="Strategies to consider (repeat the option) [default: all].",
)
@click.option("--memory-limit", help="Memory a step may use, e.g. 1.5GiB or 800MB [default: the device's].")
@click.option("--n-trials", type=click.IntRange(min=1), help="Trials to run [default: all if at most 12, else 12].")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Stop starting trials after SECONDS.")
@click.option(
    "--storage",
    help="Optuna storage: an RDB URL, or :memory: [default: sqlite file in ~/.cache/autoaccum/studies.db].",
)
@click.option(
    "--study-name", help="Optuna study name [default: a fingerprint of the update program, so re-runs resume]."
)
@click.option("--fresh", is_flag=True, help="Start the study anew, deleting its earlier trials.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampler seed.")
@click.option("--max-microbatch", type=click.IntRange(min=1), help="Skip the probe; use this bound instead.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Save the best plan as JSON here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Save throughput vs microbatch (PNG).")
@click.option("--json", "as_json", is_flag=True, help="Print only JSON (plan, trials, probe).")
def tune(
    workload: str | None,
    demo: bool,
    effective_batch: int | None,
    strategy_names: tuple[str, ...],
    memory_limit: str | None,
    n_trials: int | None,
    timeout: float | None,
    storage: str | None,
    study_name: str | None,
    fresh: bool,
    seed: int,
    max_microbatch: int | None,
    out: Path | None,
    plot: Path | None,
    as_json: bool,
) -> None:
    """Tune microbatch size and accumulation strategy for the highest measured throughput.

    WORKLOAD is path/to/file.py:function or package.module:function returning an autoaccum.Workload;
    --demo uses the built-in transformer language model.

    \b
    Exit codes: 0 a plan was found; 1 nothing fits or every trial failed; 2 bad usage or bad input.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from autoaccum._tune.result import TrialRecord
    from autoaccum._tune.run import tune as run_tune

    if plot is not None:
        _require_matplotlib()
    w = resolve_workload(workload, demo)
    console = Console(stderr=as_json, quiet=as_json)
    console.print(f"[bold]workload[/] {w.name}: effective batch {effective_batch or w.batch_size}")
    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("probing + tuning", total=None)

        def on_trial(record: TrialRecord, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total, description=f"trial {record.number}")
            progress.console.print(f"  {_describe(record)}")

        try:
            result = run_tune(
                w.loss_fn,
                w.params,
                w.batch,
                optimizer=w.optimizer,
                effective_batch=effective_batch,
                strategies=list(strategy_names) or None,
                memory_limit=memory_limit,
                n_trials=n_trials,
                timeout=timeout,
                storage=storage,
                study_name=study_name,
                fresh=fresh,
                seed=seed,
                has_aux=w.has_aux,
                state=w.state,
                loss_reduction=w.loss_reduction,
                max_microbatch=max_microbatch,
                callbacks=[on_trial],
            )
        except (ValueError, TypeError) as e:
            raise click.UsageError(str(e)) from e
        except RuntimeError as e:
            console.print(f"[red]error:[/] {e}")
            if as_json:
                click.echo(json.dumps({"error": str(e)}))
            raise SystemExit(1) from e

    if out is not None:
        result.plan.save(out)
    if plot is not None:
        _plot(result.trials, plot)
    if as_json:
        click.echo(result.to_json())
        return
    _print_table(console, result)
    plan = result.plan
    console.print(
        f"\n[bold green]best plan[/]: microbatch {plan.microbatch_size} x {plan.accumulation_steps} steps "
        f"= {plan.effective_batch} examples, strategy {plan.strategy} {plan.options or ''}, "
        f"{plan.throughput:,.1f} examples/s on {plan.device}",
        soft_wrap=True,
    )
    console.print(f"{result.message}; stored in {result.storage}", highlight=False)
    if out is not None:
        console.print(f"plan saved to {out}\n")
        console.print(
            SNIPPET.format(path=str(out), batch=plan.effective_batch), highlight=False, markup=False, soft_wrap=True
        )


def _describe(record: Any) -> str:
    what = f"#{record.number:<3d} microbatch {record.microbatch_size:>5d} x {record.accumulation_steps:<4d}"
    what += f" {record.strategy}"
    what += "".join(f" {k}={v}" for k, v in record.options.items())
    if record.throughput is not None:
        return f"{what}: {record.throughput:,.1f} examples/s"
    return f"{what}: {record.state} {record.reason or ''}".rstrip()


def _print_table(console: Any, result: Any) -> None:
    from rich.table import Table

    table = Table(title="trials (best first)")
    for column in ("#", "microbatch", "steps", "strategy", "examples/s", "compile s", "state"):
        table.add_column(column, justify="right" if column not in ("strategy", "state") else "left")
    for r in result.trials:
        options = "".join(f" {k}={v}" for k, v in r.options.items())
        table.add_row(
            str(r.number),
            str(r.microbatch_size),
            str(r.accumulation_steps),
            r.strategy + options,
            "" if r.throughput is None else f"{r.throughput:,.1f}",
            "" if r.compile_seconds is None else f"{r.compile_seconds:.2f}",
            (r.state if r.reason is None else f"{r.state}: {r.reason[:60]}")
            + ("" if r.same_program_as is None else f" (same program as #{r.same_program_as}, timed once)"),
        )
    console.print(table)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise click.UsageError("--plot needs matplotlib: pip install 'autoaccum[plot]'.") from e


def _plot(trials: Any, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    by_strategy: dict[str, list[tuple[int, float]]] = {}
    for r in trials:
        if r.throughput is not None:
            label = r.strategy + "".join(f" {k}={v}" for k, v in r.options.items())
            by_strategy.setdefault(label, []).append((r.microbatch_size, r.throughput))
    for label, points in sorted(by_strategy.items()):
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("microbatch size")
    ax.set_ylabel("examples / s")
    ax.set_title("autoaccum tune: measured throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
