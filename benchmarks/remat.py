"""Rematerialisation benchmark: which ``jax.checkpoint`` policies, applied to the whole loss of a microbatch
(`autoaccum.build_update`'s ``remat=``), lower an update step's peak memory.

For each built-in workload and each policy, XLA's compile-only peak (nothing runs) of the scan strategy's step
at one microbatch of ``--microbatch`` examples and of an accumulating step (``--microbatch`` x 4), as a
fraction of the same step without remat; then, with ``--probe LIMIT``, the probe's real boundary under a
capped child process per policy (slow: a few real trials each). A policy belongs in the tuner's search
(`autoaccum._tune.space.BUILTIN_REMAT`) only if it lowers the peak of some workload.

Run: ``python benchmarks/remat.py [--workload transformer ...] [--microbatch 64] [--probe 256MiB]``; prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import os
import platform

import jax
from autoaccum.strategies import REMAT_POLICIES

import autoaccum
from autoaccum import workloads
from autoaccum._estimate import step_memory

POLICIES: tuple[str | None, ...] = (None, *REMAT_POLICIES)


def peak(w: autoaccum.Workload, remat: str | None, microbatch: int, batch: int) -> int:
    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=microbatch, remat=remat)
    return step_memory(update, w.params, w.batch, batch).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", action="append", choices=sorted(workloads.BUILTIN))
    parser.add_argument("--microbatch", type=int, default=64)
    parser.add_argument("--probe", metavar="LIMIT", help="also probe each policy's boundary under this limit")
    args = parser.parse_args()
    names = args.workload or ["mlp", "cnn", "mnist", "transformer"]
    m = args.microbatch
    print(
        f"jax {jax.__version__}, {platform.machine()} {jax.devices()[0].device_kind}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, microbatch {m}\n"
    )
    probe_col = f" probe {args.probe} |" if args.probe else ""
    print(f"| workload | remat | one step (MiB) | ratio | {m} x 4 (MiB) | ratio |{probe_col}")
    print("|---|---|---|---|---|---|" + ("---|" if args.probe else ""))
    for name in names:
        w = workloads.BUILTIN[name]()
        base = (peak(w, None, m, m), peak(w, None, m, 4 * m))
        for remat in POLICIES:
            one, acc = base if remat is None else (peak(w, remat, m, m), peak(w, remat, m, 4 * m))
            cells = f"| {name} | {remat} | {one / 2**20:.2f} | {one / base[0]:.3f} | {acc / 2**20:.2f} | "
            cells += f"{acc / base[1]:.3f} |"
            if args.probe:
                found = autoaccum.probe(
                    w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=args.probe,
                    options={"remat": remat},
                )  # fmt: skip
                cells += f" {found.max_microbatch} ({found.runs} runs) |"
            print(cells, flush=True)


if __name__ == "__main__":
    main()
