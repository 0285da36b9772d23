"""Tune's cost as transformer LMs grow, against the exhaustive grid and a compile-only ranking (issue 31).

For each model (a `autoaccum.workloads.transformer`, vocabulary 512, at an effective batch of ``--batch``
sequences of ``--seq-len`` tokens under ``--limit``; or, with ``--workload``, a built-in MLP or CNN at ``--batch``
images):

* **tune**, ``--runs`` times, each fresh: ``python -m autoaccum tune THIS_FILE:workload --json`` in a subprocess
  with its own empty ``AUTOACCUM_CACHE``. Its wall time, its **units** (that wall time over one compile plus five
  steps of the picked program, as the pick's trial measured them: a ratio, so the machine's speed cancels), and
  its phases: the result's ``phases`` where it has them, else what the JSON allows (the probe's and the estimate's
  seconds, the trials' compiles, their steps as ``(warm-up + steps) x median``, the race's timings; the rest is
  ``other``).
* **grid**, once per model, in this process: every strategy (its default options) at every power-of-two
  microbatch size up to the tune's probe bound whose compile-only peak fits the limit, each compiled once and run
  for a warm-up and ``--steps`` timed steps (median); its wall time, its best throughput, and the tune pick's
  throughput timed the same way over that best.
* **compile-only ranking**: each grid configuration's predicted step time from XLA's cost analysis of its compiled
  programs, a roofline ``max(flops / F, bytes / B)`` per program run, with ``F`` and ``B`` measured once here (a
  matmul, a copy). Reported: the Spearman rank correlation of predicted with measured step times, and the best of
  the 3 configurations predicted fastest over the timed best.

Run: ``python benchmarks/scaling.py [--size 0.17M ...] [--large] [--workload cnn ...] [--runs 3] [--json]
[--out FILE]``; prints a Markdown table (``--json``: JSON instead; ``--out``: JSON to a file after each model;
``--render A.json ...``: the table of earlier reports), progress on stderr. ``tune s`` is the tune's own wall time
(the result's ``seconds``), ``process s`` its command's (Python and JAX start-up, loading the workload, printing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoaccum
from autoaccum import workloads
from autoaccum._estimate import live_bytes, xla_cost
from autoaccum._tune.result import UNIT_STEPS
from autoaccum._tune.trials import STEPS, WARMUP

SIZES = {"0.17M": (64, 4, 2), "0.93M": (128, 4, 4), "5.0M": (256, 8, 6)}
"""The issue's models, ``(width, heads, layers)`` at vocabulary 512 (0.170M, 0.933M and 5.02M parameters)."""
LARGE = {"19M": (512, 8, 6)}
"""``--large``: 19.5M parameters."""
VOCAB = 512
ENV = "AUTOACCUM_SCALING_LM"
"""How the tune's process and its children learn the model: JSON of `workload`'s keyword arguments."""
TRIAL_STEPS = WARMUP + STEPS
"""Steps a tune trial runs after compiling (a warm-up and five timed), for the derived ``steps`` phase."""
PHASES = ("probe", "estimate", "compile", "steps", "failed", "race", "worker_start", "build")


BUILTIN = ("mlp", "cnn", "mnist")
"""``--workload``: built-in models other than LMs (`autoaccum.workloads`), at ``--batch`` examples."""


def workload() -> autoaccum.Workload:
    """The model `ENV` describes (``dim``, ``heads``, ``layers``, ``seq_len``, ``batch``, ``limit``; or ``builtin``,
    ``batch``, ``limit``): the target of each tune, loaded by its process and its children."""
    spec = json.loads(os.environ[ENV])
    if "builtin" in spec:
        w = getattr(workloads, spec["builtin"])(batch_size=spec["batch"])
        return dataclasses.replace(w, memory_limit=spec["limit"])
    w = workloads.transformer(
        batch_size=spec["batch"], seq_len=spec["seq_len"], vocab=VOCAB, dim=spec["dim"], heads=spec["heads"],
        layers=spec["layers"],
    )  # fmt: skip
    return dataclasses.replace(w, name=f"transformer {spec['dim']}x{spec['layers']}", memory_limit=spec["limit"])


def n_params(params: Any) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


# -- tune: a fresh run in a subprocess ------------------------------------------------------------------------


def run_tune(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One fresh ``autoaccum tune --json`` of the model ``spec`` describes: its wall time, the machine's load around
    it, and its JSON (or its error)."""
    with tempfile.TemporaryDirectory(prefix="autoaccum-scaling-") as cache:
        env = {**os.environ, ENV: json.dumps(spec), "AUTOACCUM_CACHE": cache}
        command = [sys.executable, "-m", "autoaccum", "tune", f"{Path(__file__).resolve()}:workload", "--json"]
        command += ["--memory-limit", spec["limit"]]
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        wall = time.perf_counter() - start
    out: dict[str, Any] = {"wall_seconds": wall, "load": [load, os.getloadavg()[0]], "exit": done.returncode}
    try:
        out["result"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        out["error"] = (done.stdout + done.stderr)[-2000:]
    return out


def pick_trial(result: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan's trial (the race's winner, else the best trial), and the trial that timed its program."""
    trials = {t["number"]: t for t in result["trials"]}
    number = result["race"][0]["trial"] if result.get("race") else result["trials"][0]["number"]
    pick = trials[number]
    same = pick.get("same_program_as")
    return pick, trials.get(same, pick) if same is not None else pick


def derived_phases(result: dict[str, Any]) -> dict[str, float]:
    """The phases the JSON allows when the result carries none: the probe (less its estimate), the estimate, the
    trials' compiles and steps, and the race's timed steps. Worker starts and the final build are not in it."""
    probe = result.get("probe") or {}
    estimate = (probe.get("estimate") or {}).get("seconds") or 0.0
    timed = [t for t in result["trials"] if t.get("compile_seconds") is not None]
    return {
        "probe": max((probe.get("seconds") or 0.0) - estimate, 0.0),
        "estimate": estimate,
        "compile": sum(t["compile_seconds"] for t in timed),
        "steps": sum(TRIAL_STEPS * t["seconds"][1] for t in timed if t.get("seconds")),
        "race": sum(sum(r.get("times") or ()) for r in result.get("race") or ()),
    }


def tune_figures(run: dict[str, Any]) -> dict[str, Any]:
    """Wall time, units, the pick (its configuration, compile and median step) and the phases of one tune."""
    out = {k: run[k] for k in ("wall_seconds", "load", "exit")}
    result = run.get("result") or {}
    if "trials" not in result or not result["trials"]:
        return {**out, "error": result.get("error") or run.get("error")}
    pick, timed = pick_trial(result)
    plan = result["plan"]  # the pick's configuration (its trial may share the program timed by another)
    compile_s = (timed["compile_seconds"] or 0.0) + timed.get("cached_seconds", 0.0)  # (as if uncached)
    step_s = timed["seconds"][1]
    phases = result.get("phases") or derived_phases(result)
    return {
        **out,
        "pick": {k: plan[k] for k in ("microbatch_size", "strategy", "options", "remat", "accumulator_dtype")},
        "pick_compile_seconds": compile_s,
        "pick_step_seconds": step_s,
        "units": (result.get("units") or run["wall_seconds"] / (compile_s + UNIT_STEPS * step_s)),
        "tune_seconds": result.get("seconds"),
        "phases": phases,
        "phases_from": "result" if result.get("phases") else "derived",
        "other_seconds": (result.get("seconds") or run["wall_seconds"]) - sum(phases.values()),
        "trials": len(result["trials"]),
        "pick_trial": pick["number"],
        "probe_bound": (result.get("probe") or {}).get("max_microbatch"),
        "trial_list": [_trial_line(t) for t in sorted(result["trials"], key=lambda t: t["number"])],
    }


def _trial_line(t: dict[str, Any]) -> str:
    """``#3 16 x scan unroll=2: 1,234 ex/s (compile 4.1 s)``, or the trial's reason for failing (for reading a run)."""
    options = " ".join(f"{k}={v}" for k, v in (t.get("options") or {}).items())
    head = f"#{t['number']} {t.get('microbatch_size')} x {t.get('strategy')} {options} {t.get('remat') or ''}".strip()
    if t.get("throughput") is not None:
        return f"{head}: {t['throughput']:,.0f} ex/s (compile {t.get('compile_seconds') or 0.0:.1f} s)"
    return f"{head}: {t.get('state', 'FAIL')} {(t.get('reason') or '')[:160]}"


# -- grid: every strategy x power-of-two size, in this process --------------------------------------------------


def machine_rates() -> dict[str, float]:
    """This machine's FLOP/s (a 1024 x 1024 float32 matmul) and bytes/s (adding 1 to 32M floats: read + write),
    each the best of 5 timed runs."""

    def best(f: Any, *args: Any) -> float:
        jax.block_until_ready(f(*args))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - start)
        return min(times)

    a = jnp.ones((1024, 1024), jnp.float32)
    x = jnp.ones((32 * 2**20,), jnp.float32)
    flops = 2 * 1024**3 / best(jax.jit(lambda a: a @ a), a)
    bandwidth = 2 * x.nbytes / best(jax.jit(lambda x: x + 1.0), x)
    return {"flops_per_second": flops, "bytes_per_second": bandwidth}


def optimizer_cost(w: autoaccum.Workload) -> tuple[float, float]:
    """(FLOPs, bytes accessed) of one optimizer step on ``w``'s parameters (update and apply), compiled alone."""

    def apply(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = w.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = jax.eval_shape(w.optimizer.init, w.params)
    return xla_cost(jax.jit(apply).lower(w.params, opt_state, w.params).compile())


def predicted_seconds(
    strategy: str, steps: int, costs: list[tuple[float, float]], opt: tuple[float, float], rates: dict[str, float]
) -> float:
    """A roofline step time from each program's cost, run as often as ``strategy`` runs it for ``steps``
    microbatches of one size. XLA counts a loop's body once: the scan's step and MultiSteps' step are one
    microbatch and one optimizer step (its ``cond`` counted once), so the microbatch is counted ``steps`` times
    and the optimizer step (``opt``) once. The loop runs its zero sums once, its microbatch program ``steps - 1``
    times and its last (the last microbatch and the optimizer step) once."""

    def roof(flops: float, accessed: float) -> float:
        return max(flops / rates["flops_per_second"], accessed / rates["bytes_per_second"])

    def less_opt(c: tuple[float, float]) -> tuple[float, float]:
        return max(c[0] - opt[0], 0.0), max(c[1] - opt[1], 0.0)

    if steps == 1:
        return sum(roof(*c) for c in costs)
    if strategy == "scan":
        return steps * roof(*less_opt(costs[0])) + roof(*opt)
    if strategy == "multisteps":
        begin, step = costs
        return roof(*begin) + steps * roof(*less_opt(step)) + roof(*opt)
    if strategy == "loop":
        runs = [1, steps - 1, 1] if len(costs) == 3 else [1] * len(costs)
        return sum(n * roof(*c) for n, c in zip(runs, costs, strict=True))
    raise ValueError(f"`strategy` {strategy!r} has no program count here; add it to predicted_seconds.")


def time_config(w: autoaccum.Workload, config: dict[str, Any], steps: int, limit: int) -> dict[str, Any]:
    """Compiles one configuration (``microbatch_size``, ``strategy``, ``options``, ``remat``), takes XLA's peak and
    costs, and, when the peak fits ``limit``, runs a warm-up and ``steps`` timed steps (median seconds)."""
    update = autoaccum.build_update(
        w.loss_fn, w.optimizer, microbatch_size=config["microbatch_size"], strategy=config["strategy"],
        remat=config.get("remat"), **config.get("options", {}),
    )  # fmt: skip
    params = jax.tree.map(jnp.array, w.params)  # a copy: the update donates it
    opt_state = update.init(params)
    start = time.perf_counter()
    programs = update.programs(params, opt_state, w.batch)
    compiled = [p.lowered.compile() for p in programs]
    out: dict[str, Any] = {**config, "compile_seconds": time.perf_counter() - start}
    peaks = []
    for c, p in zip(compiled, programs, strict=True):
        m = c.memory_analysis()
        peaks.append(live_bytes(m) + p.resident_bytes)
    out.update(peak_bytes=max(peaks), costs=[xla_cost(c) for c in compiled])
    if out["peak_bytes"] > limit:
        return out
    params, opt_state, loss = update(params, opt_state, w.batch)  # the programs above: nothing compiles again
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = update(params, opt_state, w.batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    return {
        **out,
        "step_seconds": statistics.median(times),
        "examples_per_second": w.batch_size / statistics.median(times),
    }


def grid_configs(batch: int, bound: int) -> list[dict[str, Any]]:
    """Every strategy (its options' first values) at every power-of-two size up to ``bound`` that divides ``batch``; the
    whole batch in one step once (every strategy runs the plain step there)."""
    sizes = [2**i for i in range(batch.bit_length()) if 2**i <= bound and batch % 2**i == 0]
    defaults = {
        name: {k: v[0] for k, v in autoaccum.strategies.get(name).options.items()}
        for name in autoaccum.strategies.available()
        if name != "auto"
    }
    names = list(defaults)
    return [
        {"microbatch_size": m, "strategy": name, "options": defaults[name], "remat": None}
        for m in sizes
        for name in (names[:1] if m == batch else names)
    ]


def run_grid(
    w: autoaccum.Workload, bound: int, picks: list[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Times the grid (`grid_configs`) and the tunes' picks outside it in this process; ranks the grid by cost."""
    limit = autoaccum.parse_bytes(args.limit)
    rates = machine_rates()
    opt = optimizer_cost(w)
    start = time.perf_counter()
    rows = []
    for config in grid_configs(w.batch_size, bound):
        rows.append(time_config(w, config, args.steps, limit))
        _progress(f"  grid {_label(config)}: {_fmt_row(rows[-1])}")
    wall = time.perf_counter() - start
    for row in rows:
        steps = -(-w.batch_size // row["microbatch_size"])
        row["predicted_seconds"] = predicted_seconds(row["strategy"], steps, row["costs"], opt, rates)
    timed = [r for r in rows if "step_seconds" in r]
    best = max(timed, key=lambda r: r["examples_per_second"])
    pick_rates = {}
    for pick in picks:
        same = next((r for r in timed if _label(r) == _label(pick)), None)
        row = same or time_config(w, pick, args.steps, limit)
        pick_rates[_label(pick)] = row.get("examples_per_second", 0.0) / best["examples_per_second"]
    return {
        "rates": rates, "optimizer_cost": opt, "wall_seconds": wall, "configurations": len(rows),
        "timed": len(timed), "best": _label(best), "best_examples_per_second": best["examples_per_second"],
        "pick_over_best": pick_rates, **ranking(timed), "rows": rows,
    }  # fmt: skip


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""

    def ranks(x: list[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):  # ties: their mean rank
            where = np.array(x) == v
            r[where] = r[where].mean()
        return r

    if len(a) < 2:
        return float("nan")
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def ranking(timed: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the predicted order matches the measured one: Spearman's rho of predicted with measured step
    times, and the best measured throughput among the 3 predicted fastest over the best of all."""
    predicted = [r["predicted_seconds"] for r in timed]
    measured = [r["step_seconds"] for r in timed]
    top3 = sorted(timed, key=lambda r: r["predicted_seconds"])[:3]
    best = max(r["examples_per_second"] for r in timed)
    return {
        "spearman": spearman(predicted, measured),
        "cost_top3": [_label(r) for r in top3],
        "cost_top3_over_best": max(r["examples_per_second"] for r in top3) / best,
    }


def _label(config: dict[str, Any]) -> str:
    options = ",".join(f"{k}={v}" for k, v in sorted((config.get("options") or {}).items()))
    remat = f" remat={config['remat']}" if config.get("remat") else ""
    return f"{config['microbatch_size']} x {config['strategy']}{':' + options if options else ''}{remat}"


def _fmt_row(row: dict[str, Any]) -> str:
    head = f"compile {row['compile_seconds']:.1f} s, peak {row['peak_bytes'] / 2**20:.0f} MiB"
    return head + (f", step {row['step_seconds']:.3f} s" if "step_seconds" in row else ", over the limit")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- per model, the report ----------------------------------------------------------------------------------


def measure_model(name: str, shape: tuple[int, int, int] | str, args: argparse.Namespace) -> dict[str, Any]:
    """``--runs`` fresh tunes of one model (an LM's shape, or a `BUILTIN` name), then (unless ``--no-grid``) its
    grid with the tunes' picks."""
    if isinstance(shape, str):
        spec: dict[str, Any] = {"builtin": shape, "batch": args.batch}
    else:
        dim, heads, layers = shape
        spec = {"dim": dim, "heads": heads, "layers": layers, "seq_len": args.seq_len, "batch": args.batch}
    spec["limit"] = args.limit
    os.environ[ENV] = json.dumps(spec)
    w = workload()
    out: dict[str, Any] = {"name": name, "shape": spec, "parameters": n_params(w.params), "tunes": []}
    for i in range(args.runs):
        figures = tune_figures(run_tune(spec, args.tune_timeout))
        out["tunes"].append(figures)
        _progress(
            f"{name} tune {i + 1}/{args.runs}: " + json.dumps({k: v for k, v in figures.items() if k != "phases"})
        )
        _progress(f"  phases: {json.dumps(figures.get('phases'))}")
    if args.no_grid:
        return out
    bounds = [t["probe_bound"] for t in out["tunes"] if t.get("probe_bound")]
    picks = list({_label(t["pick"]): t["pick"] for t in out["tunes"] if "pick" in t}.values())
    out["grid"] = run_grid(w, min(bounds) if bounds else w.batch_size, picks, args)
    for tune in out["tunes"]:
        if "pick" in tune:
            tune["pick_over_grid_best"] = out["grid"]["pick_over_best"][_label(tune["pick"])]
    return out


def _spread(values: list[float], digits: int = 1) -> str:
    """``median`` or ``median (min-max)`` of several runs."""
    if not values:
        return "-"
    mid = f"{statistics.median(values):.{digits}f}"
    return mid if len(values) == 1 else f"{mid} ({min(values):.{digits}f}-{max(values):.{digits}f})"


HEADER = ["parameters", "runs", "tune s", "process s", "units", "pick's compile s", "pick's step s", "pick", *PHASES]
HEADER += ["other"]
HEADER += ["grid s", "grid best ex/s", "pick / grid best", "cost rho", "cost top-3 / best"]


def table_row(m: dict[str, Any]) -> list[str]:
    """A model's row of `HEADER`: each figure the median over its runs (min-max in brackets)."""
    ok = [t for t in m["tunes"] if "units" in t]

    def col(key: str, digits: int = 1) -> str:
        return _spread([t[key] for t in ok if t.get(key) is not None], digits)

    picks = ", ".join(sorted({_label(t["pick"]) for t in ok})) or "; ".join(
        str(t.get("error"))[:80] for t in m["tunes"]
    )
    for t in ok:  # the tune's own wall time where the result carries it, else its process's
        t.setdefault("seconds", t.get("tune_seconds") or t["wall_seconds"])
        t["other"] = t["seconds"] - sum(t["phases"].values())
    row = [f"{m['parameters'] / 1e6:.2f}M", str(len(ok)), col("seconds", 0), col("wall_seconds", 0), col("units")]
    row += [col("pick_compile_seconds")]
    row += [col("pick_step_seconds", 3), picks]
    row += [_spread([t["phases"][p] for t in ok if p in t["phases"]]) for p in PHASES] + [col("other")]
    grid = m.get("grid")
    if not grid:
        return [*row, "-", "-", "-", "-", "-"]
    row += [f"{grid['wall_seconds']:.0f}", f"{grid['best_examples_per_second']:.0f} ({grid['best']})"]
    return [*row, col("pick_over_grid_best", 2), f"{grid['spearman']:.2f}", f"{grid['cost_top3_over_best']:.2f}"]


def markdown(models: list[dict[str, Any]]) -> str:
    """One table, a row per model (`table_row`)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(table_row(m)) + " |" for m in models]
    if any(t.get("phases_from") == "derived" for m in models for t in m["tunes"]):
        lines.append(
            "\nPhases derived from the trials (the result carries none): worker starts and the build are in other."
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", action="append", choices=[*SIZES, *LARGE], help="a model (repeat) [default: the issue's three]"
    )
    parser.add_argument("--large", action="store_true", help="add the 19M model")
    parser.add_argument("--shape", action="append", default=[], help="a model of your own, WIDTH,HEADS,LAYERS (repeat)")
    parser.add_argument("--workload", action="append", default=[], choices=BUILTIN, help="a built-in model (repeat)")
    parser.add_argument("--runs", type=int, default=1, help="fresh tunes per model [default: 1]")
    parser.add_argument("--batch", type=int, default=64, help="effective batch, sequences [default: 64]")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence [default: 64]")
    parser.add_argument("--limit", default="256MiB", help="memory limit [default: 256MiB]")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per grid configuration [default: 5]")
    parser.add_argument("--no-grid", action="store_true", help="tunes only")
    parser.add_argument("--tune-timeout", type=float, default=1800.0, help="seconds one tune may take")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--out", type=Path, help="also write the JSON report here, after each model")
    parser.add_argument("--render", type=Path, nargs="+", help="print the table of these JSON reports; measure nothing")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    return args


def models(args: argparse.Namespace) -> list[tuple[str, tuple[int, int, int] | str]]:
    """The models to measure, ``(name, (width, heads, layers))`` from ``--size``, ``--large`` and ``--shape``, and
    ``(name, name)`` from ``--workload``."""
    chosen: list[tuple[str, tuple[int, int, int] | str]] = [
        (s, {**SIZES, **LARGE}[s]) for s in args.size or ([] if args.shape or args.workload else list(SIZES))
    ]
    chosen += [(s, LARGE[s]) for s in LARGE if args.large and s not in dict(chosen)]
    for text in args.shape:
        try:
            dim, heads, layers = (int(x) for x in text.split(","))
        except ValueError:
            raise SystemExit(f"--shape {text!r} must be WIDTH,HEADS,LAYERS, e.g. --shape 64,4,2") from None
        chosen.append((text, (dim, heads, layers)))
    return chosen + [(name, name) for name in args.workload]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:  # tables from earlier reports
        print(markdown([m for path in args.render for m in json.loads(path.read_text())["models"]]))
        return 0
    started = time.time()
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg(), "jax": jax.__version__},
        "flags": vars(args), "models": [],
    }  # fmt: skip
    for name, shape in models(args):
        report["models"].append(measure_model(name, shape, args))
        if args.out is not None:  # after each model: what a long run measured survives its end
            args.out.write_text(json.dumps(report, indent=1, default=str))
    report["machine"]["load_after"] = os.getloadavg()
    report["seconds"] = time.time() - started
    print(json.dumps(report, indent=1, default=str) if args.json else markdown(report["models"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
