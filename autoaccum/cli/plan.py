"""``autoaccum plan``: predict, from compilation alone, what fits on which accelerator (nothing is run)."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import click

from autoaccum.cli._common import (
    check_output,
    check_strategies,
    resolve_workload,
    strategy_help,
    usage_error,
    workload_arguments,
)
from autoaccum.cli._console import fit_table, make_console

NOTE = "Predicted from XLA's compile-only analysis ({compilers}; nothing was run)."
GPU_MEMORY_NOTE = (
    " Usable memory = the card's memory x mem-fraction ({fraction}) - a {margin:.0%} safety margin: JAX "
    "preallocates 75% of a GPU; set XLA_PYTHON_CLIENT_MEM_FRACTION=.9 (and pass --mem-fraction .9) or "
    "XLA_PYTHON_CLIENT_PREALLOCATE=false to use more."
)
STEP_NOTE = (
    " Step time is a roofline ESTIMATE (XLA's FLOPs and bytes accessed against the datasheet peaks), a lower bound "
    "rather than a measurement."
)
"""What the footer adds where a GPU, or any catalogued accelerator, is among the targets (a memory limit has no
card, and no step time)."""
DEMO_GPUS = ("H100", "L4")
"""The cards ``--demo`` plans for without ``--gpu``: the large and the small end of the catalogue. Each card is
six compilations of GPT-2 small by XLA's GPU compiler; add others with ``--gpu`` (e.g. ``--gpu A100-40GB``)."""

GPU_NOTE = (
    "XLA:GPU sm_XY (compile-only): XLA's own GPU compiler for that card, on compile-only devices (no GPU used). "
    "XLA:CPU (proxy): the CPU compiler's figures stand in for the card's."
)


@click.command()
@workload_arguments
@click.option(
    "--effective-batch",
    type=int,
    help="Examples per optimizer update (>= 1) [default: the workload's batch size].",
)
@click.option(
    "--gpu",
    "gpus",
    multiple=True,
    metavar="NAME|FILE",
    help="A catalogued accelerator to plan for, e.g. A100-40GB, L4, H100, TPU-v5e (repeat the option; --list-gpus "
    "lists them), or a GPU target description file (`autoaccum devices --target-config` writes your card's).",
)
@click.option(
    "--memory-limit",
    "memory_limits",
    multiple=True,
    metavar="SIZE",
    help="A memory limit to plan for, e.g. 24GiB, used as given (repeat the option).",
)
@click.option(
    "--devices",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Plan for this many devices of each target, the batch sharded over them (data parallel): the "
    "microbatch is global, memory per device, and the step time includes the gradient reduction over the "
    "interconnect. Compiled for as many GPUs of each --gpu target (with the gpu-plan extra), else CPU devices.",
)
@click.option("--list-gpus", is_flag=True, help="List the catalogued accelerators and exit.")
@click.option(
    "--large",
    is_flag=True,
    help="With --demo, also plan a ~1B-parameter transformer (its compilations take minutes more).",
)
@click.option(
    "--strategy",
    default="auto",
    show_default=True,
    help=strategy_help("Accumulation strategy (auto: build_update's default, as it picks on each target).", auto=True),
)
@click.option(
    "--mem-fraction",
    type=click.FloatRange(0, 1, min_open=True),
    help="Fraction of a GPU JAX may use (XLA_PYTHON_CLIENT_MEM_FRACTION) [default: 0.75 on GPUs, 1.0 on TPUs].",
)
@click.option(
    "--safety-margin",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.05,
    show_default=True,
    help="Fraction of an accelerator's memory kept free on top.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Save the first target's plan (predicted, not measured) as JSON, for Plan.load(...).build(...).",
)
@click.option("--json", "as_json", is_flag=True, help="Print only JSON.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), help="Save memory vs microbatch (PNG).")
def plan(
    workload: str | None,
    demo: bool,
    effective_batch: int | None,
    gpus: tuple[str, ...],
    memory_limits: tuple[str, ...],
    devices: int,
    list_gpus: bool,
    large: bool,
    strategy: str,
    mem_fraction: float | None,
    safety_margin: float,
    out: Path | None,
    as_json: bool,
    plot: Path | None,
) -> None:
    """Predict microbatch, accumulation steps, peak memory and step time on each target, before any run.

    WORKLOAD is path/to/file.py:function or package.module:function returning an autoaccum.Workload; --demo plans a
    model people size (GPT-2 small at sequence 1024, built from shapes only, on H100 and L4 unless --gpu names
    cards; --large adds a ~1B transformer). Targets are catalogued accelerators (--gpu) and bare memory limits
    (--memory-limit); with neither, the workload's own memory_limit where it sets one, else this machine's
    default device. With the gpu-plan extra (pip install
    "autoaccum[gpu-plan]", jax-cuda12-plugin at jax's version) each catalogued GPU is compiled for by XLA's GPU
    compiler itself, without a GPU; otherwise the CPU compiler's figures stand in (labelled "XLA:CPU (proxy)"). The
    targets are compiled for at once, a line for each compilation.

    \b
    Exit codes: 0 planned (on a target where not even one example fits, "nothing fits" is its answer);
    1 no target could be planned (XLA could not compile the step for any); 2 bad usage or bad input.
    """
    from autoaccum._capacity import Target

    console = make_console(stderr=as_json, quiet=as_json)
    if any(g.strip().lower() == "list" for g in gpus):
        click.echo("warning: --gpu list is deprecated: use --list-gpus.", err=True)
        list_gpus = True
    if list_gpus:
        _print_catalog(as_json)
        return
    if effective_batch is not None and effective_batch < 1:
        raise click.BadParameter(
            f"must be >= 1, got --effective-batch {effective_batch}.", param_hint="'--effective-batch'"
        )
    if large and not (demo and workload is None):
        raise click.BadParameter("plans the demo's ~1B-parameter model: it goes with --demo.", param_hint="'--large'")
    targets: list[Target] = []
    for name in gpus:
        try:
            if Path(name).is_file():  # a card's own description (`autoaccum devices --target-config`)
                targets.append(Target.gpu_file(name, mem_fraction, safety_margin))
            elif name.endswith((".txtpb", ".pbtxt", ".txt")) or "/" in name:
                raise ValueError(f"no file {name!r} (a card's description: `autoaccum devices --target-config`).")
            else:
                targets.append(Target.gpu(name, mem_fraction, safety_margin))
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="'--gpu'") from e
    for size in memory_limits:
        try:
            targets.append(Target.memory_limit(size))
        except (ValueError, TypeError) as e:
            raise click.BadParameter(str(e), param_hint="'--memory-limit'") from e
    if plot is not None:
        _require_matplotlib()
    check_output(out, "--out")
    check_output(plot, "--plot")
    mesh = _mesh(devices) if devices > 1 else None  # before the workload makes arrays: JAX starts then
    if demo and workload is None:
        check_strategies([strategy], auto=True)
        from autoaccum.workloads import planning_demos

        if not targets:
            targets = [Target.gpu(name, mem_fraction, safety_margin) for name in DEMO_GPUS]
        code = 0
        for i, w in enumerate(planning_demos(large=large)):
            total = w.batch_size if effective_batch is None else effective_batch
            code = _plan_one(console, w, total, targets, mesh, devices, strategy, mem_fraction, safety_margin,
                             None if i else out, as_json, None if plot is None else _nth(plot, i)) or code  # fmt: skip
        raise SystemExit(code)
    w = resolve_workload(workload, demo)
    check_strategies([strategy], auto=True)  # (once the workload's file may have registered its own)
    total = w.batch_size if effective_batch is None else effective_batch
    raise SystemExit(
        _plan_one(console, w, total, targets, mesh, devices, strategy, mem_fraction, safety_margin, out, as_json, plot)
    )


def _nth(path: Path, i: int) -> Path:
    """``path`` for the first of several plots, ``stem-2.png`` and so on for the others."""
    return path if i == 0 else path.with_name(f"{path.stem}-{i + 1}{path.suffix}")


class _Job(NamedTuple):
    """One estimate: for a GPU target compiled for by XLA's GPU compiler, or the proxy for every other target."""

    targets: list[Any]
    compile_for: str | Path | None
    label: str


def _jobs(targets: list[Any], status: str | None) -> list[_Job]:
    """One job per target XLA's GPU compiler compiles for, one for the rest (the CPU compiler's figures)."""
    from autoaccum._gpu_compile import known_targets

    jobs, rest = [], []
    for t in targets:
        if status is None and (t.description or t.accelerator in known_targets()):
            jobs.append(_Job([t], Path(t.description) if t.description else t.accelerator, t.name))
        else:
            rest.append(t)
    if rest:
        jobs.append(_Job(rest, None, ", ".join(t.name for t in rest)))
    return jobs


def _progress(console: Any, label: str) -> Any:
    """``estimate``'s ``on_compile``: one line per compilation, naming the target, the size and the seconds."""

    def report(point: Any, seconds: float) -> None:
        if point is None:
            what = "the optimizer step"
        elif point.batch_size == point.microbatch_size:
            what = f"microbatch {point.microbatch_size}"
        else:
            what = f"microbatch {point.microbatch_size} accumulating a batch of {point.batch_size}"
        console.print(f"  {label}: compiled {what} in {seconds:.1f} s", highlight=False)

    return report


def _estimate_all(console: Any, w: Any, trees: tuple[Any, Any, Any], total: int, strategy: str, jobs: list[_Job],
                  devices: int) -> list[Any]:  # fmt: skip
    """Every job's estimate, the jobs at once (each job's serial steps leave a core idle that another job's
    compilations fill); a job XLA could not compile has its error instead. Bad input is a usage error (exit 2)."""
    import jax

    from autoaccum._estimate import estimate
    from autoaccum._gpu_compile import gpu_mesh

    for job in jobs:  # the compile-only devices made here, one thread at a time (the plugin loads once)
        if job.compile_for is not None:
            gpu_mesh(job.compile_for, (devices,))
    params, batch, state = trees

    def run(job: _Job) -> Any:
        try:
            return estimate(
                w.loss_fn,
                params,
                batch,
                optimizer=w.optimizer,
                strategy=strategy,
                memory_limit=job.targets[0].memory_limit_bytes,
                has_aux=w.has_aux,
                state=state,
                loss_reduction=w.loss_reduction,
                refine_for=[t.memory_limit_bytes for t in job.targets],
                effective_batch=total,
                target=job.compile_for,
                on_compile=_progress(console, job.label),
            )
        except (ValueError, TypeError) as e:
            raise usage_error(e) from e
        except jax.errors.JaxRuntimeError as e:  # XLA could not compile it: this job's answer, not the others'
            return e

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def _plan_one(
    console: Any,
    w: Any,
    total: int,
    targets: list[Any],
    mesh: Any,
    devices: int,
    strategy: str,
    mem_fraction: float | None,
    safety_margin: float,
    out: Path | None,
    as_json: bool,
    plot: Path | None,
) -> int:
    """Plans ``w`` on every target and prints the result; the exit code: 0 when some target was planned (its
    answer may be "nothing fits"), 1 when none could be (each failed to compile)."""
    from autoaccum._capacity import Target
    from autoaccum._device import detect_device, resolve_memory_limit
    from autoaccum._gpu_compile import compiler_status, known_targets

    targets = list(targets)
    trees = w.params, w.batch, w.state
    if mesh is not None:
        if total % devices:
            raise click.BadParameter(
                f"--effective-batch {total} is not a multiple of --devices {devices}; each device takes an equal "
                "share of every microbatch.",
                param_hint="'--effective-batch'",
            )
        trees = _on_mesh(mesh, w)
    if not targets and w.memory_limit is not None:  # (no --gpu, no --memory-limit)
        targets.append(Target.memory_limit(str(w.memory_limit)))
        console.print(f"memory limit {w.memory_limit}: the workload's own (--memory-limit or --gpu overrides it)")
    if not targets:
        targets.append(Target("this machine", resolve_memory_limit(detect_device(), None)[0]))
    status = compiler_status()
    on = f" on {devices} devices (data parallel; microbatch global, memory per device)" if devices > 1 else ""
    console.print(
        f"[bold]workload[/] {w.name}: effective batch {total}, strategy {strategy}{on}; compiling (not running)..."
    )
    if status is not None and any(t.description or t.accelerator in known_targets() for t in targets):
        console.print(f"[yellow]CPU proxy for the GPUs[/]: {status}", highlight=False)
    start = time.perf_counter()
    jobs = _jobs(targets, status)
    answers = _estimate_all(console, w, trees, total, strategy, jobs, devices)
    by_target = {t.name: answer for job, answer in zip(jobs, answers, strict=True) for t in job.targets}
    results = [by_target[t.name] for t in targets]
    plans = [None if isinstance(r, Exception) else r.capacity(total, t) for r, t in zip(results, targets, strict=True)]
    ests = [r for r in results if not isinstance(r, Exception)]
    saved = out is not None and plans[0] is not None and plans[0].fits
    if saved:
        _predicted_plan(w, ests[0], plans[0]).save(out)
    if plot is not None and ests:
        _plot(ests, [p for p in plans if p is not None], total, plot, w.name)
    if as_json:
        data = _as_dict(w.name, total, ests[0] if ests else None, plans, results, targets)
        data["gpu_compiler"] = status
        data["saved"] = str(out) if saved else None
        click.echo(json.dumps(data, indent=2))
    else:
        _report(console, plans, results, targets, total, mem_fraction, safety_margin, time.perf_counter() - start)
        if plot is not None and ests:
            console.print(f"plot saved to {plot}")
        if saved:
            console.print(f"plan for {plans[0].target} (predicted) saved to {out}")  # type: ignore[union-attr]
        elif out is not None:
            why = "its estimate failed" if plans[0] is None else "nothing fits there"
            console.print(f"no plan saved to {out}: {why} on {targets[0].name}, the first target (--out saves its)")
    return 0 if ests else 1


def _report(console: Any, plans: list[Any], results: list[Any], targets: list[Any], total: int,
            mem_fraction: float | None, safety_margin: float, seconds: float) -> None:  # fmt: skip
    """The table, the notes, what could not be planned and why, and the compilations' count and wall time."""
    _print_table(console, plans, targets, total)
    fraction = "default" if mem_fraction is None else f"{mem_fraction:g}"
    compilers = ", ".join(dict.fromkeys(p.compiler for p in plans if p is not None))
    from autoaccum._catalog import Platform, lookup

    cards = [lookup(t.accelerator) for t in targets if t.accelerator is not None]
    gpus = any(c.platform is Platform.GPU for c in cards) or any(t.description is not None for t in targets)
    note = NOTE + (GPU_MEMORY_NOTE if gpus else "") + (STEP_NOTE if cards else "")
    console.print(note.format(compilers=compilers, fraction=fraction, margin=safety_margin), highlight=False)
    if "XLA:GPU" in compilers or "(proxy)" in compilers:
        console.print(GPU_NOTE, highlight=False)
    for r, t in zip(results, targets, strict=True):
        if isinstance(r, Exception):
            console.print(f"[red]{t.name}: not planned[/], XLA could not compile the step: {r}", highlight=False)
    unique = list({id(r): r for r in results if not isinstance(r, Exception)}.values())
    count = sum(len(e.points) + 1 for e in unique)  # and one optimizer step each
    console.print(f"{count} compilations in {seconds:.1f} s.", highlight=False)


def _mesh(devices: int) -> Any:
    """A mesh of ``devices`` CPU devices to compile the plan for (XLA's analysis is per device)."""
    flag = "--xla_force_host_platform_device_count"
    if flag not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts its CPU backend, which is not yet
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={devices}".strip()
    import jax

    cpus = jax.devices("cpu")
    if len(cpus) < devices:
        raise click.UsageError(
            f"--devices {devices} compiles for {devices} CPU devices but JAX started with {len(cpus)}; run with "
            f"XLA_FLAGS={flag}={devices}."
        )
    return jax.make_mesh((devices,), ("data",), devices=cpus[:devices], axis_types=(jax.sharding.AxisType.Explicit,))


def _on_mesh(mesh: Any, w: Any) -> tuple[Any, Any, Any]:
    """The workload's parameters and state replicated on ``mesh``, its example batch sharded over it."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from autoaccum._batch import resize_batch

    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    n = mesh.size
    batch = resize_batch(jax.device_get(w.batch), -(-w.batch_size // n) * n)  # a multiple of the devices
    state = None if w.state is None else jax.device_put(w.state, replicated)
    return jax.device_put(w.params, replicated), jax.device_put(batch, rows), state


def _predicted_plan(w: Any, est: Any, capacity: Any) -> Any:
    from autoaccum._plan import Plan, opt_state_bytes, params_signature, versions

    return Plan(
        effective_batch=capacity.effective_batch,
        microbatch_size=capacity.microbatch_size,
        accumulation_steps=capacity.accumulation_steps,
        strategy=est.strategy,
        options=dict(est.options),
        source="predicted",
        device=capacity.target,
        has_aux=w.has_aux,
        has_state=w.state is not None,
        loss_reduction=w.loss_reduction,
        knobs={} if w.knobs is None else dict(w.knobs.default),  # (its loss_fn: the knobs' default, planned)
        params=params_signature(w.params),
        versions=versions(),
        opt_state_bytes=opt_state_bytes(w.optimizer, w.params),
    )


def _print_catalog(as_json: bool) -> None:
    from autoaccum._catalog import ACCELERATORS
    from autoaccum._units import format_bytes

    if as_json:
        rows = [
            {
                "name": a.name,
                "platform": a.platform.value,
                "memory_bytes": a.memory_bytes,
                "memory_limit_bytes": a.memory_limit_bytes(),
                "bf16_flops": a.bf16_flops,
                "fp32_flops": a.fp32_flops,
                "tf32_flops": a.tf32_flops,
                "bandwidth": a.bandwidth,
                "aliases": list(a.aliases),
                "source": a.source,
            }
            for a in ACCELERATORS
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    headers = ("name", "memory", "memory limit (default)", "bf16 TFLOP/s", "fp32 TFLOP/s", "tf32 TFLOP/s", "bandwidth",
               "aliases")  # fmt: skip
    columns = [(header, "left" if header in ("name", "aliases") else "right") for header in headers]
    cells = [
        (
            a.name,
            format_bytes(a.memory_bytes),
            format_bytes(a.memory_limit_bytes()),
            f"{a.bf16_flops / 1e12:,.1f}",
            "-" if a.fp32_flops is None else f"{a.fp32_flops / 1e12:,.1f}",
            "-" if a.tf32_flops is None else f"{a.tf32_flops / 1e12:,.1f}",
            f"{a.bandwidth / 1e9:,.0f} GB/s",
            ", ".join(a.aliases),
        )
        for a in ACCELERATORS
    ]
    console = make_console()
    console.print(fit_table(console, "catalogued accelerators (datasheet figures)", columns, cells))


def _print_table(console: Any, plans: list[Any], targets: list[Any], total: int) -> None:
    """One row per target: its plan, "nothing fits" where not one example does, "not planned" where XLA failed."""
    from rich.text import Text

    from autoaccum._units import format_bytes

    devices = next((p.devices for p in plans if p is not None), 1)
    per = f" on {devices} devices each (microbatch global, memory per device)" if devices > 1 else ""
    title = f"predicted capacity for an effective batch of {total}{per} (estimates, nothing was run)"
    headers = (
        "target",
        "memory limit",
        "one step?",
        "max microbatch",
        "microbatch x steps",
        "peak",
        "step time (est.)",
    )
    columns = [(header, "left" if header == "target" else "right") for header in headers]
    rows: list[tuple[str | Text, ...]] = []
    for p, t in zip(plans, targets, strict=True):
        if p is None:
            rows.append(
                (t.name, format_bytes(t.memory_limit_bytes), "-", "-", Text("not planned", style="red"), "-", "-")
            )
            continue
        split: str | Text = Text("nothing fits", style="red")
        if p.fits:
            last = p.effective_batch - p.microbatch_size * (p.accumulation_steps - 1)  # an uneven split's remainder
            split = f"{p.microbatch_size} x {p.accumulation_steps}" + (
                f" (last {last})" if last != p.microbatch_size else ""
            )
        seconds = "-" if p.step_seconds is None else f"{_seconds(p.step_seconds)} ({p.bound.value}-bound)"
        rows.append((
            p.target,
            format_bytes(p.memory_limit_bytes),
            "yes" if p.fits_in_one_step else "no",
            str(p.max_microbatch),
            split,
            format_bytes(p.peak_bytes),
            seconds,
        ))  # fmt: skip
    console.print(fit_table(console, title, columns, rows))


def _seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _as_dict(
    name: str, total: int, est: Any, plans: list[Any], results: list[Any], targets: list[Any]
) -> dict[str, Any]:
    """The JSON: each target's capacity (or, not planned, its ``error``) and the first estimate."""
    strategy = None if est is None else est.strategy
    out: dict[str, Any] = {"workload": name, "effective_batch": total, "strategy": strategy, "targets": []}
    for p, r, t in zip(plans, results, targets, strict=True):
        if p is None:
            row = {"target": t.name, "memory_limit_bytes": t.memory_limit_bytes, "error": str(r)}
            out["targets"].append({**row, "accelerator": t.accelerator})
        else:
            out["targets"].append({**p.to_dict(), "accelerator": t.accelerator})
    out["estimate"] = None if est is None else est.to_dict()
    out["note"] = (
        "predictions from XLA compile-only analysis (see each target's compiler); step_seconds is a roofline estimate"
    )
    return out


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise click.UsageError("--plot needs matplotlib: pip install 'autoaccum[plot]'.") from e


def _plot(ests: list[Any], plans: list[Any], total: int, path: Path, name: str) -> None:
    """Predicted peak memory against the microbatch: one curve per compiler that answered, each target's budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    unique = list({id(e): e for e in ests}.values())
    top = max([total, *(p.max_microbatch for p in plans), *(pt.microbatch_size for e in unique for pt in e.points)])
    sizes = np.unique(np.geomspace(1, max(top, 2) * 1.5, 200).astype(int))
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, est in enumerate(unique):
        label = est.compiler or f"XLA:{est.platform.upper()}"
        if est.target:
            label = f"{est.target}, {label}"
        color = f"C{i % 10}"
        ax.plot(sizes, [est.bytes_at(int(m)) / 2**30 for m in sizes], color=color, label=f"{label}: one step")
        under = sizes[sizes < total]
        if len(under):
            ax.plot(under, [est.bytes_at(int(m), total) / 2**30 for m in under], "--", color=color, linewidth=1)
        singles = est.single_points
        ax.plot([p.microbatch_size for p in singles], [p.peak_bytes / 2**30 for p in singles], "o", color=color)
    for i, p in enumerate(plans):
        color = f"C{(i + len(unique)) % 10}"
        ax.axhline(p.memory_limit_bytes / 2**30, color=color, linestyle=":", linewidth=1)
        ax.annotate(
            f"{p.target} budget", (sizes[0], p.memory_limit_bytes / 2**30), color=color, va="bottom", fontsize=8
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("microbatch size (examples)")
    ax.set_ylabel("predicted peak memory per device (GiB)")
    ax.set_title(
        f"{name}: predicted peak memory by microbatch (compile-only)\n"
        f"solid: one microbatch per step; dashed: accumulating to {total}; dots: compiled sizes; dotted: budgets",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
