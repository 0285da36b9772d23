"""What XLA's CPU runtime allocates beyond XLA's buffer accounting, so that an estimate on the CPU compares with
what `autoaccum.probe` measures there (within 20% of the probed boundary: tests/test_estimate.py).

Every constant here was measured on jax 0.10.2 (XLA:CPU with YNNPACK fusions, its default), x86-64 Linux, glibc;
another jax may allocate differently (`MEASURED_ON`). Plans for GPUs and TPUs use XLA's figure alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax

MEASURED_ON = "jax 0.10.2, XLA:CPU, x86-64 Linux, glibc"
"""Where the constants of this module were measured."""

CPU_RUNTIME_BYTES = 8 * 2**20
"""Bytes a CPU step's process grows by beyond XLA's buffer accounting, whatever the step: the runtime's
thread-local malloc arenas and bookkeeping. Measured once (jax 0.10.2, x86-64 Linux, glibc with
``MALLOC_ARENA_MAX=2``, as the probe runs trials): a trial's address space grew by 6.5-8 MB more than
XLA's figure at the smallest sizes of the MLP, CNN and transformer workloads."""

_SHAPE = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(\w+)\[([0-9,]*)\]")
_CONV = re.compile(r"convolution\(%([^\s,)]+),\s*%([^\s,)]+)\).*?window=\{([^}]*)\}.*?dim_labels=(\w+)_(\w+)->(\w+)")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLS = re.compile(r"calls=%([^\s,)]+)")

YNN_PACK_MIN_ROWS = 61
"""A YNNPACK dot (a convolution is one over its input's stencil) copies its right-hand side into a packed
buffer of its own when the product has at least this many rows (output positions): measured on x86-64 with
jax 0.10.2, a 49 MB right-hand side cost nothing extra at 60 rows and exactly its size from 61 rows up."""

YNN_PACK_MAX_COLUMNS = 128
"""The packed right-hand side holds at most this many of its columns (output features) at a time: measured,
``K x min(N, 128)`` elements for N from 16 to 512."""


def _ynn_computations(hlo_text: str) -> set[str]:
    """Names of the computations that XLA:CPU hands to YNNPACK (fusions of kind ``__ynn_fusion``)."""
    return {m.group(1) for line in hlo_text.splitlines() if "__ynn_fusion" in line for m in _CALLS.finditer(line)}


def _window(spec: str, key: str) -> list[str]:
    """One field of an HLO ``window={...}`` (``size=3x3`` -> ``["3", "3"]``), ``[]`` when absent."""
    m = re.search(rf"\b{key}=(\S+)", spec)
    return m.group(1).split("x") if m else []


def conv_patch_bytes(hlo_text: str) -> int:
    """The largest buffer a convolution of a compiled CPU program materialises outside XLA's accounting.

    What it is depends on the runtime that computes the convolution, which the compiled HLO text says (0
    without any convolution):

    * XLA:CPU's Eigen runtime (YNNPACK fusions off, or a convolution YNNPACK does not take, e.g. one with at
      most 16 input and output features) computes it as a matrix product over its input patches and
      materialises them: ``output positions x window x input features`` (225,792 bytes per example for the
      CNN's 3x3x32 input-gradient convolution, within 1.5% of the address-space growth measured);
    * YNNPACK (a convolution inside a ``__ynn_fusion``, XLA:CPU's default for most float convolutions) reads
      the patches as a view of its input and materialises only the padded input (when ``pad=`` is not all
      zero), or else the patches; and its dot packs the right-hand side (the kernel; for a weight gradient,
      the output gradient, as large as the batch) into ``K x min(N, 128)`` elements when the product has at
      least `YNN_PACK_MIN_ROWS` rows. Measured per convolution (jax 0.10.2, x86-64): a 3x3 SAME convolution
      of 1024 x 14x14x64 grew the address space by its 64 MiB padded input beyond XLA's figure, its VALID
      twin by its 162 MiB of patches, the weight gradient of 1024 x 14x14x32 -> 64 by its 32 MiB padded
      input plus its 49 MiB output gradient.

    The programs' convolutions run one after the other, so the largest of them counts.

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
    shapes: dict[str, tuple[str, list[int]]] = {}
    for line in lines:
        m = _SHAPE.match(line)
        if m:
            shapes[m.group(1)] = (m.group(2), [int(d) for d in m.group(3).split(",") if d])
    ynn = _ynn_computations(hlo_text)
    computation = ""
    largest = 0
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
        if (
            len(lhs_labels) != len(lhs_dims)
            or len(rhs_labels) != len(rhs_dims)
            or len(out_labels) != len(out_dims)
            or "f" not in lhs_labels
            or "o" not in rhs_labels
        ):
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
    """What the ``platform``'s runtime needs beyond XLA's accounting for these programs (0 off the CPU).

    On the CPU: `CPU_RUNTIME_BYTES` plus the largest `conv_patch_bytes` of the programs. On GPUs and TPUs
    XLA's buffer assignment includes the convolution workspaces, so nothing is added.
    """
    if platform != "cpu":
        return 0
    return CPU_RUNTIME_BYTES + max((conv_patch_bytes(c.as_text() or "") for c in compiled), default=0)
