"""The tuner against the exhaustive grid, and the knobs under a tight memory limit, on the example transformer.

(a) The exhaustive grid of the tuner's space (every candidate microbatch x strategy variant x remat policy it
searches), each configuration timed once as the tuner times it (the isolated worker, 5 steps after a warm-up);
then ``--runs`` times (seeds 1, 2, ...): `autoaccum.tune` with its defaults (no probe: both searches get the same
bound, the effective batch), its pick re-timed side by side with the grid's best in one worker (``--rounds``
interleaved rounds, median; a control column times the grid's best against itself, the comparison's own noise;
a pick that is the grid's best configuration itself scores 1, its side-by-side reading printed as more noise).
Goal: the tuned pick >= 0.97 of the grid's best, in <= 1/3 of the grid's time, in every run (the worst run is
reported).

(b) The demo (`autoaccum.workloads.demo`: the transformer with its blocks scanned, 128 sequences under 32 MiB on
a CPU, where without remat a microbatch of about 27 fits): `autoaccum.tune` of its plain loss with no knobs
against `autoaccum.tune` of its `autoaccum.Knobs` (each block's remat policy, ``block_remat``; whole-loss policies
too with ``--remat``), both with their defaults: each pick's throughput, re-timed side by side in one worker, and
each one's measured peak.

Run: ``python benchmarks/tune.py [--effective-batch 64] [--seq-len 64] [--runs 5] [--part a|b|both]``.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import time
from typing import Any

import jax
import optax
import optuna

import autoaccum
from autoaccum import workloads
from autoaccum._knobs import BUILTIN_REMAT
from autoaccum._probe import prepare
from autoaccum._tune.space import microbatch_candidates, program_key, variants
from autoaccum._tune.trials import STEPS, WARMUP
from autoaccum._units import format_bytes
from autoaccum._worker import Request, Worker

Config = tuple[int, str, Any]  # (microbatch, strategy variant label, remat)


def worker_for(setup: Any) -> Worker:
    """The tuner's isolated timing worker for a probe `Setup`, with generous time limits."""
    return Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=600, step_timeout=120)


def side_by_side(
    worker: Worker,
    configs: dict[str, Config],
    labels: dict[str, Any],
    rows: int,
    rounds: int,
    settings: dict[str, int] | None = None,
    outcomes: dict[str, Any] | None = None,
) -> dict[str, float]:
    """Median examples/s of each config over ``rounds`` interleaved rounds in one worker (``settings``: the index
    of each config's knob setting among the worker's, default 0; ``outcomes``: gets each config's last `Outcome`)."""
    rates: dict[str, list[float]] = {key: [] for key in configs}
    for r in range(rounds):
        keys = list(configs)[r % len(configs) :] + list(configs)[: r % len(configs)]
        for key in keys:
            m, label, remat = configs[key]
            name, options = labels[label]
            setting = (settings or {}).get(key, 0)
            build = {"strategy": name, **options, "remat": remat}
            outcome = worker.time(Request(build, m, rows, STEPS, WARMUP, setting=setting))
            if outcomes is not None:
                outcomes[key] = outcome
            if outcome.status == "fits":
                rates[key].extend(rows / t for t in outcome.times or ())
    return {key: statistics.median(v) if v else 0.0 for key, v in rates.items()}


def part_a(w: autoaccum.Workload, args: argparse.Namespace) -> None:
    batch = args.effective_batch
    labels = variants(list(autoaccum.strategies.available()))
    remats = list(BUILTIN_REMAT)
    grid_configs = [(m, label, r) for m in microbatch_candidates(batch, batch) for label in labels for r in remats]
    setup = prepare(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=args.memory_limit)
    print(
        f"\n(a) tuned vs exhaustive grid: effective batch {batch}, {len(grid_configs)} grid configurations "
        f"(remat searched: {remats}), limit {format_bytes(setup.memory_limit_bytes)}\n"
    )
    # The grid is timed once, in the worker the tuner uses, each program once as the tuner times it (with one
    # accumulation step every strategy runs the plain step: `program_key`); every run's pick is then re-timed
    # against its best.
    with worker_for(setup) as wk:
        start = time.perf_counter()
        grid: dict[Config, float] = {}
        timed: dict[Any, float] = {}
        for m, label, remat in grid_configs:
            name, options = labels[label]
            key = (program_key(m, labels[label], batch), remat)
            if key not in timed:
                outcome = wk.time(Request({"strategy": name, **options, "remat": remat}, m, batch, STEPS, WARMUP))
                timed[key] = batch / outcome.seconds if outcome.status == "fits" and outcome.seconds else 0.0
            if timed[key]:
                grid[(m, label, remat)] = timed[key]
        grid_seconds = time.perf_counter() - start
    best = max(grid, key=grid.__getitem__)
    print(
        f"grid: {len(grid)} of {len(grid_configs)} configurations ran ({len(timed)} programs) in {grid_seconds:.0f} "
        f"s; best {best}\n"
    )
    print("| run | tuned | grid best | tuned / grid best | control | search s tuned / grid | goal |")
    print("|---|---|---|---:|---:|---|---|")
    ratios, times, races, trial_lines = [], [], [], []
    for run in range(1, args.runs + 1):
        start = time.perf_counter()
        result = autoaccum.tune(
            w.loss_fn, w.params, w.batch, optimizer=w.optimizer, storage=":memory:", microbatch_bound=batch,
            memory_limit=args.memory_limit, seed=run,
        )  # fmt: skip
        tune_seconds = time.perf_counter() - start
        races.append(f"run {run}: " + race_line(result))
        trial_lines.append(f"run {run}: " + trials_line(result))
        plan = result.plan
        tuned_label = next(k for k, v in labels.items() if v == (plan.strategy, plan.options))
        tuned: Config = (plan.microbatch_size, tuned_label, plan.remat)
        with worker_for(setup) as wk:
            # "control": the grid's best again, the same program: what the comparison reads on identical configs.
            rates = side_by_side(wk, {"tuned": tuned, "grid": best, "control": best}, labels, batch, args.rounds)
        # The pick may be the grid's best configuration itself: then the ratio is 1 (the same program), and the
        # side-by-side reading is one more measure of the comparison's noise, printed beside it.
        side = rates["tuned"] / rates["grid"]
        ratio, time_ratio = (1.0 if tuned == best else side), tune_seconds / grid_seconds
        ratios.append(ratio)
        times.append(time_ratio)
        met = "met" if ratio >= 0.97 and time_ratio <= 1 / 3 else "**not met**"
        reading = f"the grid's best itself (side by side read {side:.3f})" if tuned == best else "side by side"
        print(
            f"| {run} | {tuned[0]} x {tuned[1]} remat={tuned[2]} | {best[0]} x {best[1]} remat={best[2]} | "
            f"{ratio:.3f} ({reading}: {rates['tuned']:,.0f} / {rates['grid']:,.0f} ex/s) | "
            f"{rates['control'] / rates['grid']:.3f} | {time_ratio:.2f} ({tune_seconds:.0f} / {grid_seconds:.0f}) | "
            f"{met} |",
            flush=True,
        )
    print("\neach tune's race (finalist: trial's ex/s, rounds, median step time over its round's median, out after):")
    print("\n".join(races))
    print("\neach tune's trials, in order (ex/s of its one timing; = #n: the same program as trial n):")
    print("\n".join(trial_lines))
    print(
        f"\nworst of {args.runs} runs: tuned / grid best {min(ratios):.3f} (goal >= 0.97), search time ratio "
        f"{max(times):.2f} (goal <= 0.33)"
    )


def name_of(t: autoaccum.TrialRecord) -> str:
    """``16 x scan:unroll=2``, and the remat policy where there is one."""
    name = f"{t.microbatch_size} x {t.strategy}" + "".join(f":{k}={v}" for k, v in t.options.items())
    return name + (f" remat={t.remat}" if t.remat else "")


def trials_line(result: autoaccum.TuneResult) -> str:
    """The trials of one tune in the order they ran: what the search saw."""
    parts = []
    for t in sorted(result.trials, key=lambda t: t.number):
        what = f"= #{t.same_program_as}" if t.same_program_as is not None else f"{t.throughput or 0:,.0f}"
        parts.append(f"#{t.number} {name_of(t)} {what if t.state == 'COMPLETE' else t.state}")
    return "; ".join(parts)


def race_line(result: autoaccum.TuneResult) -> str:
    """The race of one tune, winner first: what decided its pick."""
    trials = {t.number: t for t in result.trials}
    parts = []
    for r in result.race:
        t = trials[r.trial]
        name = name_of(t)
        relative = "-" if r.relative is None else f"{r.relative:.3f}"
        out = "" if r.out_after is None else f", out after {r.out_after}"
        parts.append(f"{name} ({t.throughput or 0:,.0f} ex/s, {r.rounds} rounds, {relative}{out})")
    return "; ".join(parts) or "no race"


def part_b(args: argparse.Namespace) -> None:
    w = workloads.demo()  # the scanned transformer, its block_remat knob declared (workloads.BLOCK_REMAT)
    assert w.knobs is not None
    batch, limit = w.batch_size, args.tight_limit or w.memory_limit
    remats = (None, *args.remat)
    print(
        f"\n(b) knobs under a tight limit: the demo transformer (blocks scanned), effective batch {batch}, limit "
        f"{limit}; with knobs: block_remat {w.knobs.choices['block_remat']}, whole-loss remat {remats}\n"
    )
    results = {}
    searches = (("without knobs", w.loss_fn, (None,)), ("with knobs", w.knobs, remats))
    for key, loss, search in searches:
        start = time.perf_counter()
        results[key] = autoaccum.tune(
            loss, w.params, w.batch, optimizer=w.optimizer, storage=":memory:", memory_limit=limit, remat=search,
            seed=args.seed,
        )  # fmt: skip
        print(f"{key}: {time.perf_counter() - start:.0f} s; bounds {results[key].bounds}")
    labels = variants(list(autoaccum.strategies.available()))
    settings = w.knobs.settings()
    configs, picks = {}, {}
    for key, result in results.items():
        plan = result.plan
        label = next(k for k, v in labels.items() if v == (plan.strategy, plan.options))
        configs[key] = (plan.microbatch_size, label, plan.remat)
        picks[key] = settings.index(plan.knobs or w.knobs.default)
    setup = prepare(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=limit)
    job = dataclasses.replace(setup.job, loss_fn=w.knobs)
    with Worker(
        job, setup.device, setup.memory_limit_bytes, compile_timeout=600, step_timeout=120, settings=settings
    ) as wk:
        rates = side_by_side(wk, configs, labels, batch, args.rounds, settings=picks)
    print("\n| search | pick | examples/s (side by side) | measured peak | limit |")
    print("|---|---|---:|---:|---:|")
    for key, result in results.items():
        m, label, remat = configs[key]
        knobs = settings[picks[key]]
        peak = "n/a" if result.peak_bytes is None else format_bytes(result.peak_bytes)
        limit_text = format_bytes(result.memory_limit_bytes or 0)
        print(f"| {key} | {m} x {label} remat={remat} {knobs} | {rates[key]:,.0f} | {peak} | {limit_text} |")
    print(f"\nwith knobs / without: {rates['with knobs'] / rates['without knobs']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--effective-batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="side-by-side re-timing rounds")
    parser.add_argument("--part", choices=("a", "b", "both"), default="both")
    parser.add_argument("--memory-limit", default="1GiB", help="(a): the limit trials run under")
    parser.add_argument("--tight-limit", default=None, help="(b): the limit [default: the demo's, 32MiB on a CPU]")
    parser.add_argument("--remat", action="append", default=[], help="(b): whole-loss policies searched with knobs")
    parser.add_argument("--seed", type=int, default=0, help="(b): the tuner's seed")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    w = workloads.transformer(batch_size=args.effective_batch, seq_len=args.seq_len)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, device "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}, optax {optax.__version__}; (a): transformer seq "
        f"{args.seq_len}"
    )
    if args.part in ("a", "both"):
        part_a(w, args)
    if args.part in ("b", "both"):
        part_b(args)


if __name__ == "__main__":
    main()
