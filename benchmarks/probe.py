"""Probe benchmark: our search against the two usual batch-size finders, on one workload under one cap.

All three use the same isolated trial runner (`autoaccum.probe.TrialRunner`: a fresh child process per
trial, the real update step, the same memory cap), so only the search differs:

* ``autoaccum.probe``: compile-only estimate, then model-guided bracketing and bisection;
* doubling then bisecting (PyTorch Lightning's ``BatchSizeFinder(mode="binsearch")``): 1, 2, 4, ... until a
  trial fails, then bisect between the last fit and the failure;
* halve on OOM (Accelerate's ``find_executable_batch_size``): start at ``max_microbatch``, halve until a trial fits.

Run: ``python benchmarks/probe.py [--workload transformer] [--memory-limit 256MiB] [--max-microbatch 16384]``.
It prints a Markdown table: real runs, wall seconds, and the size found as a fraction of the true boundary
(the largest size that fits, which the probe finds exactly; checked by two extra capped runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import autoaccum
from autoaccum import workloads
from autoaccum._probe import Trial, TrialRunner, prepare


def doubling_then_bisect(run: Callable[[int], Trial], max_microbatch: int) -> int:
    lo, size = 0, 1
    while size <= max_microbatch and run(size).fits:
        lo, size = size, size * 2
    hi = min(size, max_microbatch + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if run(mid).fits else (lo, mid)
    return lo


def halve_on_oom(run: Callable[[int], Trial], max_microbatch: int) -> int:
    size = max_microbatch
    while size >= 1 and not run(size).fits:
        size //= 2
    return size


def _describe(t: Trial) -> str:
    if t.fits:
        return f"{t.microbatch_size} fits"
    return f"{t.microbatch_size} no ({(t.detail or t.error or '').splitlines()[0][:120]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="transformer", choices=sorted(workloads.BUILTIN))
    parser.add_argument("--memory-limit", default="256MiB")
    parser.add_argument("--max-microbatch", type=int, default=16384)
    args = parser.parse_args()

    w = workloads.BUILTIN[args.workload]()
    setup = prepare(
        w.loss_fn,
        w.params,
        w.batch,
        optimizer=w.optimizer,
        memory_limit=args.memory_limit,
        microbatch_cap=args.max_microbatch,
    )
    info = setup.device
    ram = autoaccum.format_bytes(info.total_bytes or 0)
    print(f"machine: {info.name} ({info.platform}, {platform.machine()}, {os.cpu_count()} cores), {ram} RAM")
    print(f"workload: {args.workload}; cap {args.memory_limit} per trial; max_microbatch {args.max_microbatch}")

    rows = []
    start = time.perf_counter()
    ours = autoaccum.probe(
        w.loss_fn,
        w.params,
        w.batch,
        optimizer=w.optimizer,
        memory_limit=args.memory_limit,
        microbatch_cap=args.max_microbatch,
    )
    rows.append(("autoaccum.probe", ours.runs, time.perf_counter() - start, ours.max_microbatch))
    print("autoaccum.probe: " + ", ".join(_describe(t) for t in ours.trials))
    boundary = ours.max_microbatch
    with TrialRunner(setup) as run:
        check = [run(boundary).fits, run(boundary + 1).fits] if boundary < args.max_microbatch else [run(boundary).fits]
    print(
        f"true boundary: {boundary} (separate runs: {boundary} fits={check[0]}"
        + (f", {boundary + 1} fits={check[1]})" if len(check) > 1 else ")")
    )
    startup = []
    for name, finder in (("doubling then bisect", doubling_then_bisect), ("halve on OOM", halve_on_oom)):
        with TrialRunner(setup) as run:
            start = time.perf_counter()
            found = finder(run, args.max_microbatch)
            rows.append((name, len(run.trials), time.perf_counter() - start, found))
            print(f"{name}: " + ", ".join(_describe(t) for t in run.trials))
            startup += [(t.wall_seconds or 0) - (t.first_seconds or 0) - (t.seconds or 0) for t in run.trials if t.fits]
    print()
    print("| search | real runs | wall s | size found | found / true boundary |")
    print("|---|---:|---:|---:|---:|")
    for name, runs, seconds, found in rows:
        print(f"| {name} | {runs} | {seconds:.1f} | {found} | {found / boundary:.3f} |")
    if startup:
        print(
            f"\nper-trial overhead outside the two timed steps (child start-up, jax import, compile): "
            f"median {sorted(startup)[len(startup) // 2]:.2f} s"
        )


if __name__ == "__main__":
    main()
