"""What XLA's CPU runtime allocates beyond XLA's buffer accounting, so that an estimate on the CPU compares with
what `autoaccum.probe` measures there. The constants were measured on `MEASURED_ON`; GPUs and TPUs need none."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax

MEASURED_ON = "jax 0.10.2, XLA:CPU, x86-64 Linux, glibc"

CPU_RUNTIME_BYTES = 3 * 2**20
"""Bytes a CPU step's process grows by beyond XLA's buffer accounting, whatever the step (malloc arenas,
bookkeeping), in a worker that has run a first gradient step (`autoaccum._worker.warm_up`)."""

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(\w+)\[([0-9,]*)\]")
_CONV = re.compile(r"convolution\(%([^\s,)]+),\s*%([^\s,)]+)\).*?window=\{([^}]*)\}.*?dim_labels=(\w+)_(\w+)->(\w+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLS = re.compile(r"calls=%([^\s,)]+)")

YNN_PACK_MIN_ROWS = 61
"""A YNNPACK dot packs its right-hand side into a buffer of its own from this many rows (output positions)."""

YNN_PACK_MAX_COLUMNS = 128
"""The packed right-hand side holds ``K x min(N, 128)`` elements."""


def _window(spec: str, key: str) -> list[str]:
    m = re.search(rf"\b{key}=(\S+)", spec)
    return m.group(1).split("x") if m else []


def conv_patch_bytes(hlo_text: str) -> int:
    """The largest buffer a convolution of a compiled CPU program materialises outside XLA's accounting (0 without
    one; convolutions run one after the other): on Eigen (outside a ``__ynn_fusion``), its input patches
    (``output positions x window x input features``); on YNNPACK, its padded input (else its patches) plus the
    packed right-hand side (`YNN_PACK_MIN_ROWS`, `YNN_PACK_MAX_COLUMNS`).

    Example:
      >>> text = '''
      ... %x = f32[8,14,14,32]{3,2,1,0} parameter(0)
      ... %k = f32[3,3,32,16]{3,2,1,0} parameter(1)
      ... %c = f32[8,14,14,16]{3,2,1,0} convolution(%x, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
      ... '''
      >>> conv_patch_bytes(text) == 8 * 14 * 14 * (3 * 3 * 32) * 4  # Eigen: the patches
      True
      >>> ynn = '''
      ... %ynn (p: f32[8,14,14,32], q: f32[3,3,32,64]) -> f32[8,14,14,64] {
      ...   %p = f32[8,14,14,32] parameter(0)
      ...   %q = f32[3,3,32,64] parameter(1)
      ...   ROOT %c = f32[8,14,14,64] convolution(%p, %q), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
      ... }
      ... ENTRY %main (x: f32[8,14,14,32], k: f32[3,3,32,64]) -> f32[8,14,14,64] {
      ...   %x = f32[8,14,14,32] parameter(0)
      ...   %k = f32[3,3,32,64] parameter(1)
      ...   %f = f32[8,14,14,64] fusion(%x, %k), calls=%ynn, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
      ... }
      ... '''
      >>> conv_patch_bytes(ynn) == 8 * 16 * 16 * 32 * 4 + (3 * 3 * 32) * 64 * 4  # YNNPACK: padded input, packed kernel
      True
    """
    lines = hlo_text.splitlines()
    matches = [m for m in map(_SHAPE.match, lines) if m]
    shapes = {m.group(1): (m.group(2), [int(d) for d in m.group(3).split(",") if d]) for m in matches}
    ynn = {m.group(1) for line in lines if "__ynn_fusion" in line for m in _CALLS.finditer(line)}
    computation, largest = "", 0
    for line in lines:
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        shape, conv = _SHAPE.match(line), _CONV.search(line)
        if shape is None or conv is None or conv.group(1) not in shapes or conv.group(2) not in shapes:
            continue
        dtype, out_dims = shapes[shape.group(1)]
        lhs_dtype, lhs_dims = shapes[conv.group(1)]
        _, rhs_dims = shapes[conv.group(2)]
        window_spec, lhs_labels, rhs_labels, out_labels = conv.group(3, 4, 5, 6)
        labelled = (len(lhs_labels), len(rhs_labels), len(out_labels)) == (len(lhs_dims), len(rhs_dims), len(out_dims))
        if not labelled or "f" not in lhs_labels or "o" not in rhs_labels:
            continue
        positions = math.prod(d for d, label in zip(out_dims, out_labels, strict=True) if label != "f")
        window = math.prod(int(w) for w in _window(window_spec, "size"))
        patches = positions * window * lhs_dims[lhs_labels.index("f")] * _itemsize(dtype)
        if computation not in ynn:  # Eigen's im2col
            largest = max(largest, patches)
            continue
        pads = [[int(p) for p in pad.split("_")] for pad in _window(window_spec, "pad")]
        if any(p != 0 for pad in pads for p in pad):
            padded = [
                d + (sum(pads[int(label)]) if label.isdigit() and int(label) < len(pads) else 0)
                for d, label in zip(lhs_dims, lhs_labels, strict=True)
            ]
            materialised = math.prod(max(d, 0) for d in padded) * _itemsize(lhs_dtype)
        else:
            materialised = patches
        columns = rhs_dims[rhs_labels.index("o")]
        depth = math.prod(rhs_dims) // max(columns, 1)
        packed = depth * min(columns, YNN_PACK_MAX_COLUMNS) * _itemsize(dtype) if positions >= YNN_PACK_MIN_ROWS else 0
        largest = max(largest, materialised + packed)
    return largest


def _itemsize(hlo_dtype: str) -> int:
    bits = re.search(r"(\d+)$", hlo_dtype)
    return 1 if hlo_dtype == "pred" or bits is None else max(1, int(bits.group(1)) // 8)


def runtime_bytes(platform: str, compiled: Sequence[jax.stages.Compiled]) -> int:
    """What the ``platform``'s runtime needs beyond XLA's accounting for these programs: on the CPU
    `CPU_RUNTIME_BYTES` plus the largest `conv_patch_bytes`; 0 elsewhere."""
    if platform != "cpu":
        return 0
    return CPU_RUNTIME_BYTES + max((conv_patch_bytes(c.as_text() or "") for c in compiled), default=0)
