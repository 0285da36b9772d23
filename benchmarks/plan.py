"""GPU-compiled against CPU-proxy capacity predictions, per target, and (``--probe``, on a GPU) against the probe.

For each workload and target: the peak bytes of a one-microbatch step at ``--microbatch`` examples and the largest
microbatch predicted to fit under the budget, from XLA's GPU compiler for that card (compile-only devices, the
gpu-plan extra) and from XLA's CPU compiler (the proxy, XLA's figure alone), and the seconds each estimate took.

``--probe`` (on a machine with an NVIDIA GPU) also runs ``autoaccum.probe`` on the card under the same budget
and prints predicted / probed for both answers (the goal: within 5% for the GPU-compiled one). The budget is
``--memory-limit`` (default 2GiB: small enough that the built-in workloads' answers are bounded by memory, not
by the 16384 cap), the same for the predictions and the probe.

    python benchmarks/plan.py                              # every built-in workload, H100 A100-40GB L4
    python benchmarks/plan.py --probe --target H100 --json plan.json   # on an H100

Runs on the CPU without a GPU (the GPU-compiled column needs the gpu-plan extra; without it, it says why).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import jax

import autoaccum
from autoaccum import workloads
from autoaccum._gpu_compile import compiler_status

WORKLOADS = ("linear", "mlp", "cnn", "mnist", "transformer")


def _on_cpu(tree: Any) -> Any:
    """``tree``'s shapes on this machine's CPU (on a GPU machine the default device is the GPU)."""
    mesh = jax.sharding.Mesh(jax.devices("cpu")[:1], ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _estimate(w: autoaccum.Workload, budget: int, m: int, target: str | None) -> dict[str, Any]:
    start = time.perf_counter()
    params, batch, state = w.params, w.batch, w.state
    if target is None and jax.default_backend() != "cpu":
        params, batch, state = _on_cpu(params), _on_cpu(batch), None if state is None else _on_cpu(state)
    est = autoaccum.estimate(
        w.loss_fn,
        params,
        batch,
        optimizer=w.optimizer,
        memory_limit=budget,
        has_aux=w.has_aux,
        state=state,
        loss_reduction=w.loss_reduction,
        accumulation=False,
        refine_for=[budget],
        target=target,
    )
    return {
        "compiler": est.compiler or "XLA:CPU (proxy)",
        "bytes_at_microbatch": est.bytes_at(m, runtime=False),
        "max_microbatch": est.largest_microbatch(budget, runtime=False),
        "compilations": len(est.points),
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", help="catalogued GPU (repeat) [H100, A100-40GB, L4]")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="built-in workload (repeat) [all]")
    parser.add_argument("--memory-limit", default="2GiB", help="the budget predictions and probe answer for")
    parser.add_argument("--microbatch", type=int, default=256, help="the size whose peak bytes are compared")
    parser.add_argument("--probe", action="store_true", help="also probe the real card (needs an NVIDIA GPU)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args()
    targets = args.target or ["H100", "A100-40GB", "L4"]
    budget = autoaccum.parse_bytes(args.memory_limit)
    status = compiler_status()
    machine = f"{platform.processor() or platform.machine()}, jax {jax.__version__}, devices {jax.devices()}"
    print(f"machine: {machine}\nbudget {args.memory_limit}, bytes at microbatch {args.microbatch}")
    if status is not None:
        print(f"no GPU compile here: {status}")
    rows: list[dict[str, Any]] = []
    for name in args.workload or WORKLOADS:
        w = workloads.BUILTIN[name]()
        cpu = _estimate(w, budget, args.microbatch, None)
        probed = None
        if args.probe:
            start = time.perf_counter()
            result = autoaccum.probe(
                w.loss_fn,
                w.params,
                w.batch,
                optimizer=w.optimizer,
                memory_limit=budget,
                has_aux=w.has_aux,
                state=w.state,
                loss_reduction=w.loss_reduction,
            )
            probed = {"max_microbatch": result.max_microbatch, "seconds": time.perf_counter() - start}
        for target in targets:
            gpu = _estimate(w, budget, args.microbatch, target) if status is None else None
            row = {"workload": name, "target": target, "gpu": gpu, "cpu_proxy": cpu, "probe": probed}
            if probed and probed["max_microbatch"]:
                row["ratio_gpu"] = gpu["max_microbatch"] / probed["max_microbatch"] if gpu else None
                row["ratio_cpu_proxy"] = cpu["max_microbatch"] / probed["max_microbatch"]
            rows.append(row)
            g = gpu or {"bytes_at_microbatch": float("nan"), "max_microbatch": "-", "seconds": float("nan")}
            line = (
                f"{name:12s} {target:10s} GPU {g['bytes_at_microbatch'] / 2**20:9.2f} MiB"
                f" max {g['max_microbatch']!s:>6}"
                f" ({g['seconds']:5.1f} s) | CPU proxy {cpu['bytes_at_microbatch'] / 2**20:9.2f} MiB"
                f" max {cpu['max_microbatch']:>6} ({cpu['seconds']:5.1f} s)"
            )
            if probed:
                ratio_gpu = row.get("ratio_gpu")
                line += f" | probed {probed['max_microbatch']:>6}: GPU/probe {ratio_gpu or float('nan'):.3f}"
                line += f", CPU/probe {row.get('ratio_cpu_proxy') or float('nan'):.3f}"
            print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "budget_bytes": budget, "rows": rows}, indent=2))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
