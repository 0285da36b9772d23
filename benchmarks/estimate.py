"""Estimate benchmark: the compile-only `autoaccum.estimate` against the real `autoaccum.probe`, per workload.

For each example (the built-in MLP, CNN and transformer, and flax's MNIST CNN) under one memory cap, both
answer "the largest microbatch whose update step fits": the estimate by compiling a few sizes (nothing runs),
the probe by running capped trials in child processes. The table gives both answers, their ratio (estimate /
probe) and the seconds each took. Wall times depend on the machine's load (the probe's trial children,
compilations on few cores).

Every row runs with XLA's default flags, as users run (on the CPU: YNNPACK fusions on). ``--no-ynn`` adds a
second row per workload with XLA:CPU's YNNPACK fusions off (``--xla_cpu_experimental_ynn_fusion_type=``, in the
estimate's compilations and the probe's children alike), where the Eigen runtime computes the convolutions.

Run: ``python benchmarks/estimate.py [--workload mlp --workload mnist ...] [--no-ynn]``; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable

import jax

import autoaccum
from autoaccum import workloads

NO_YNN = "xla_cpu_experimental_ynn_fusion_type"


WORKLOADS: dict[str, tuple[Callable[[], autoaccum.Workload], str]] = {
    "mlp": (workloads.mlp, "48MiB"),
    "cnn": (workloads.cnn, "96MiB"),
    "transformer": (workloads.transformer, "256MiB"),
    "mnist": (workloads.mnist, "1GiB"),
}
"""Per workload, a cap whose boundary lies well inside the probe's range (its max_microbatch is 16384)."""


def row(name: str, ynn: bool) -> str:
    make, cap = WORKLOADS[name]
    w = make()
    base_flags = os.environ.get("XLA_FLAGS", "")
    est = autoaccum.estimate(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=cap, accumulation=False,
        compiler_options=None if ynn else {NO_YNN: ""},
    )  # fmt: skip
    os.environ["XLA_FLAGS"] = base_flags if ynn else f"{base_flags} --{NO_YNN}=".strip()
    try:
        found = autoaccum.probe(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=cap)
    finally:
        os.environ["XLA_FLAGS"] = base_flags
    ratio = est.max_microbatch / max(found.max_microbatch, 1)
    return (
        f"| {name}{'' if ynn else ' (YNN off)'} | {cap} | {est.max_microbatch} | {found.max_microbatch} | "
        f"{ratio:.3f} | {est.seconds:.1f} ({len(est.points)}) | {found.seconds:.1f} ({found.runs}) | "
        f"{found.seconds / est.seconds:.0f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="Repeat; default: all.")
    parser.add_argument("--no-ynn", action="store_true", help="Also measure with XLA:CPU's YNNPACK fusions off.")
    args = parser.parse_args()
    rows = []
    for name in args.workload or list(WORKLOADS):
        for ynn in (True, False) if args.no_ynn and jax.default_backend() == "cpu" else (True,):
            rows.append(row(name, ynn))
            print(rows[-1], file=sys.stderr, flush=True)
    device = autoaccum.detect_device()
    machine = f"{device.name} ({device.platform}), {os.cpu_count()} cores"
    print(f"\n{machine}, jax {jax.__version__}, {platform.platform()}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n")
    header = (
        "| workload | cap | estimate | probe | estimate / probe | estimate s (compiles) | probe s (runs) | speed-up |"
    )
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
