"""What the worker's glibc malloc settings cost on the CPU: compiling and stepping, each in a process of its own.

The CPU cap counts a step's memory by the growth of the address space, for which the worker makes glibc's malloc
predictable (`autoaccum._isolation._CPU_MALLOC`: one arena, fixed thresholds). For each setting (glibc's default, the
worker's, one arena alone, the fixed thresholds alone), a child process with that environment compiles the demo's
update programs (16 x scan, 43 x scan and 16 x loop at its effective batch of 128) and times the CNN's steps over 512
images at 64 x loop and 64 x scan (a warm-up, then the median of ``--steps``). The settings run in turn, ``--runs``
rounds; reported per setting: the median over the rounds and its ratio to the default's.

Run: ``python benchmarks/malloc.py [--runs 2] [--steps 8] [--json] [--tiny]`` (``--tiny``: the MLP workload's
programs and steps, for a quick check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from autoaccum._isolation import _CPU_MALLOC

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "worker": dict(_CPU_MALLOC),
    "one arena": {"MALLOC_ARENA_MAX": _CPU_MALLOC["MALLOC_ARENA_MAX"]},
    "thresholds": {k: v for k, v in _CPU_MALLOC.items() if k != "MALLOC_ARENA_MAX"},
}
"""The environments compared: glibc's default, the worker's settings, and each half of them alone."""


def child(steps: int, tiny: bool) -> dict[str, float]:
    """Compile seconds of each program set and median step seconds of each strategy, in this process."""
    import jax

    from autoaccum import build_update, workloads
    from autoaccum._batch import abstract, abstract_batch, resize_batch
    from autoaccum.cli.tune import resolve_workload

    lm = workloads.mlp() if tiny else resolve_workload(None, True)
    out: dict[str, float] = {}
    for m, strategy in [(16, "scan"), (43, "scan"), (16, "loop")]:
        update = build_update(lm.loss_fn, lm.optimizer, microbatch_size=m, strategy=strategy)
        params = abstract(lm.params)
        programs = update.programs(params, jax.eval_shape(update.init, params), abstract_batch(lm.batch, 128))
        start = time.perf_counter()
        for program in programs:
            program.lowered.compile()
        out[f"compile {m} x {strategy}"] = time.perf_counter() - start
    w = workloads.mlp() if tiny else workloads.cnn()
    batch = resize_batch(w.batch, 512)
    for strategy in ("loop", "scan"):
        update = build_update(w.loss_fn, w.optimizer, microbatch_size=64, strategy=strategy)
        params = jax.tree.map(lambda x: x.copy(), w.params)
        params, opt_state, _ = update(params, update.init(params), batch)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            params, opt_state, loss = update(params, opt_state, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        out[f"step 64 x {strategy}"] = statistics.median(times)
    return out


def run_setting(name: str, steps: int, tiny: bool) -> dict[str, float]:
    """`child` in a subprocess with ``name``'s environment (no other MALLOC_ variable)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(SETTINGS[name], TF_CPP_MIN_LOG_LEVEL="3")
    args = [sys.executable, __file__, "--child", "--steps", str(steps)] + (["--tiny"] if tiny else [])
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(runs: int, steps: int, tiny: bool) -> dict[str, Any]:
    """Every setting ``runs`` times, in turn; per setting the median of each figure and its ratio to the default's."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for r in range(runs):
        for name in SETTINGS:
            rounds[name].append(run_setting(name, steps, tiny))
            print(f"round {r + 1}/{runs}: {name}", file=sys.stderr)
    medians = {n: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for n, rs in rounds.items()}
    ratios = {n: {k: v / medians["default"][k] for k, v in m.items()} for n, m in medians.items()}
    return {"settings": SETTINGS, "runs": runs, "steps": steps, "tiny": tiny, "seconds": medians, "ratios": ratios,
            "rounds": rounds}  # fmt: skip


def table(report: dict[str, Any]) -> str:
    """The report as Markdown: a row per setting, each figure's seconds and ratio to the default's."""
    names = list(report["seconds"]["default"])
    lines = ["| setting | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for setting, seconds in report["seconds"].items():
        cells = [f"{seconds[k]:.3f} ({report['ratios'][setting][k]:.2f}x)" for k in names]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="rounds over the settings [default: 2]")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per strategy [default: 8]")
    parser.add_argument("--tiny", action="store_true", help="the MLP's programs and steps (a quick check)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.steps, args.tiny)))
        return
    report = measure(args.runs, args.steps, args.tiny)
    print(json.dumps(report, indent=1) if args.json else table(report))


if __name__ == "__main__":
    main()
