"""What XLA's GPU compiler makes of one accumulation step, per microbatch: ``scan`` (`build_update`'s default on a
GPU) against ``loop`` (one compiled microbatch a call, as ``optax.MultiSteps`` runs), compile-only.

The GPU kit's throughput LM (`gpu.py`'s ``--preset``), in bfloat16, at its batch and microbatch, compiled with XLA's
GPU compiler for ``--target`` (a catalogued GPU or a card's description, `autoaccum devices --target-config`) without
a GPU (the ``gpu-plan`` extra). Per program: XLA's HLO cost analysis (FLOPs and bytes accessed; it counts a
``while`` body once, so the scan's figures are one microbatch's plus the optimizer step, as each of the loop's
programs is one microbatch's), its temporary bytes, and the ``copy`` instructions left in the bodies of ``while``
loops that hold other loops (the microbatch loop around the model's own layer loop) with the bytes they write.

Run: ``python benchmarks/gpu_bytes.py [--target H200] [--preset full] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import jax

import autoaccum
from autoaccum._batch import abstract
from autoaccum._gpu_compile import _DEFINITION, _array_bytes, check_gpu, gpu_cost, on_gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu as kit  # (the kit's workloads and presets)

STRATEGIES = ("scan", "loop")
_HEAD = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")


def nested_loop_copies(hlo: str) -> tuple[int, int]:
    """``(count, bytes)`` of the copies in the bodies of ``while`` loops whose body runs another ``while``.

    Example:
      >>> body = "%b (p: f32[4]) -> f32[4] {\\n  %c = f32[4]{0} copy(%p)\\n  %w = f32[4]{0} while(%c), body=%i\\n}"
      >>> nested_loop_copies(body + "\\nENTRY %m {\\n  %x = f32[4]{0} while(%a), body=%b\\n}")
      (1, 16)
    """
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = None if line.startswith(" ") else _HEAD.match(line)
        if head:
            name = head.group(1)
            bodies[name] = []
        elif name is not None and line.startswith(" "):
            bodies[name].append(line)
    bodies_of_loops = {m for lines in bodies.values() for line in lines for m in re.findall(r"body=%?([\w.\-]+)", line)}
    count = size = 0
    for name in bodies_of_loops & set(bodies):
        if not any(" while(" in line for line in bodies[name]):
            continue
        for line in bodies[name]:
            m = _DEFINITION.match(line)
            if m and m.group(3) == "copy" and "[]" not in m.group(2):  # (not the loop counters' scalar copies)
                count += 1
                size += _array_bytes(m.group(2))
    return count, size


def measure(target: str | Path, preset: kit.Preset) -> list[dict[str, Any]]:
    """One row per compiled program of each strategy's update (see the module docstring)."""
    w = kit.lm(preset.lm, "bfloat16", preset.batch)
    params, batch = on_gpu(target, abstract(w.params), abstract(w.batch))
    rows = []
    for strategy in STRATEGIES:
        update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=preset.microbatch, strategy=strategy)
        programs = update.programs(params, jax.eval_shape(update.init, params), batch)
        for i, program in enumerate(programs):
            compiled = program.lowered.compile()
            check_gpu(compiled)
            flops, moved = gpu_cost(compiled, program.lowered)
            if not flops:  # (the loop's zero sums: no microbatch's work)
                continue
            copies, copied = nested_loop_copies(compiled.as_text() or "")
            rows.append({
                "strategy": strategy, "program": i, "flops": flops, "bytes_accessed": moved,
                "temp_bytes": compiled.memory_analysis().temp_size_in_bytes, "nested_loop_copies": copies,
                "nested_loop_copy_bytes": copied,
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="H200", help="a catalogued GPU or a card's description file [H200]")
    parser.add_argument("--preset", default="full", choices=sorted(kit.PRESETS), help="the kit's sizes [full]")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args(argv)
    target = Path(args.target) if Path(args.target).is_file() else args.target
    preset = kit.PRESETS[args.preset]
    rows = measure(target, preset)
    if args.json:
        print(json.dumps({"target": str(args.target), "preset": args.preset, "jax": jax.__version__, "rows": rows}))
        return 0
    print(f"{args.preset} preset LM, bf16, batch {preset.batch}, microbatch {preset.microbatch}; {args.target}; "
          f"jax {jax.__version__}")  # fmt: skip
    print("| strategy | program | TFLOP | GB accessed | temp GiB | copies in nested loops | GB they write |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['program']} | {r['flops'] / 1e12:.3f} | {r['bytes_accessed'] / 1e9:.2f} | "
            f"{r['temp_bytes'] / 2**30:.2f} | {r['nested_loop_copies']} | {r['nested_loop_copy_bytes'] / 1e9:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
