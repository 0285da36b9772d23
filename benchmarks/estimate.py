"""Estimate benchmark: the compile-only `autoaccum.estimate` against the real `autoaccum.probe`, per workload.

For each built-in example (MLP, CNN, transformer) under one memory cap, both answer "the largest microbatch
whose update step fits": the estimate by compiling a few sizes (nothing runs), the probe by running capped
trials in child processes. The table gives both answers, their ratio (estimate / probe) and the seconds each
took. Wall times depend on the machine's load (the probe's trial children, compilations on few cores).

On the CPU, XLA's YNNPACK fusions (on by default) allocate their own workspace outside XLA's accounting: for
convolutions it jumps irregularly with the batch, for the transformer's large dots a capped run's peak varies
from run to run. The CNN and transformer rows run with them off (``--xla_cpu_experimental_ynn_fusion_type=``,
in the estimate's compilations and the probe's children alike); ``--ynn`` keeps them on for every row.

Run: ``python benchmarks/estimate.py [--workload mlp --workload cnn ...] [--ynn]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import jax

import autoaccum
from autoaccum import workloads

CAPS = {"mlp": "48MiB", "cnn": "96MiB", "transformer": "256MiB"}
"""Per workload, a cap whose boundary lies well inside the probe's range (its max_microbatch is 16384)."""

NO_YNN = "xla_cpu_experimental_ynn_fusion_type"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(CAPS), help="Repeat; default: all three.")
    parser.add_argument("--ynn", action="store_true", help="Keep XLA's CPU YNNPACK fusions on for the CNN too.")
    args = parser.parse_args()
    names = args.workload or list(CAPS)
    base_flags = os.environ.get("XLA_FLAGS", "")
    rows = []
    for name in names:
        cap = CAPS[name]
        w = workloads.BUILTIN[name]()
        off = name in ("cnn", "transformer") and not args.ynn and jax.default_backend() == "cpu"
        est = autoaccum.estimate(
            w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=cap, accumulation=False,
            compiler_options={NO_YNN: ""} if off else None,
        )  # fmt: skip
        os.environ["XLA_FLAGS"] = f"{base_flags} --{NO_YNN}=".strip() if off else base_flags
        found = autoaccum.probe(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=cap)
        os.environ["XLA_FLAGS"] = base_flags
        ratio = est.max_microbatch / max(found.max_microbatch, 1)
        rows.append(
            f"| {name}{' (YNN off)' if off else ''} | {cap} | {est.max_microbatch} | {found.max_microbatch} | "
            f"{ratio:.3f} | {est.seconds:.1f} ({len(est.points)} compiles) | {found.seconds:.1f} "
            f"({found.runs} runs) | {found.seconds / est.seconds:.0f}x |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    device = autoaccum.detect_device()
    machine = f"{device.name} ({device.platform}), {os.cpu_count()} cores"
    print(f"\n{machine}, jax {jax.__version__}, {platform.platform()}\n")
    print("| workload | cap | estimate | probe | estimate / probe | estimate s | probe s | speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
