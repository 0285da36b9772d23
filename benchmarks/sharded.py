"""Accumulation on a mesh: autoaccum's update against the naive ways, on 8 CPU devices in one run.

The batch is sharded along its example axis over every device (``NamedSharding(mesh, P("data"))``, an Auto
mesh of ``--xla_force_host_platform_device_count=8`` CPU devices, set here before jax is imported unless
``XLA_FLAGS`` already names a device count). The model is a ReLU MLP (784 -> 256 -> 256 -> 10 by default,
269,322 parameters, softmax cross-entropy on random data). Every variant does the same work: ``B`` examples per
update in ``k = B // m`` microbatches of ``m`` (global) examples, AdamW(1e-3) stepping once per update,
``params`` and ``opt_state`` donated:

* ours: ``autoaccum.build_update(..., strategy="scan")``, ``"loop"`` and ``"multisteps"`` with replicated
  parameters (data parallel); with ``--fsdp`` (the default) also scan and loop with the parameters sharded
  over the same axis (every leaf whose first dimension the device count divides) under the four
  ``gather_params`` x ``reduce_grads`` schedules;
* naive scan: one jitted ``lax.scan`` over ``batch.reshape(k, m, ...)`` (the row-major reshape of the sharded
  batch), ``jax.grad`` per microbatch, summed, then the optimizer; global view, replicated parameters, XLA's
  sharding propagation decides the rest;
* naive MultiSteps: ``optax.MultiSteps(adamw, every_k_schedule=k)``, one jitted call per microbatch from a
  host loop; the microbatches are contiguous slices of the batch, each sharded over all devices (as a data
  loader would deliver them), sliced before timing;
* shard-aligned scan (hand-written, not in the issue): the same global-view scan, but the reshape keeps each
  device's rows on that device (``(n, k, m/n) -> (k, n, m/n)``), so sharding propagation keeps the work data
  parallel; what a user who knows the layout writes without ``shard_map``. It counts as a baseline.
* references, not baselines: the full batch with no accumulation (one jitted ``jax.grad`` over the whole
  sharded batch), and what an expert writes by hand with ``jax.shard_map`` (each device scans its own rows, one
  ``psum`` after the loop): the yardstick for our own overhead.

For each, the compiled programs an update runs are read (``Compiled.as_text()``): the collectives executed per
update (an op inside a while loop counts once per iteration, by the loop's known trip count; a host loop's
per-microbatch program counts once per microbatch), their result shapes, and the per-device matmul FLOPs per
update (dot ops, loops counted by trip count) against the data-parallel ideal (a single-device full-batch
gradient's dot FLOPs / devices): 1.00x means each device computes only its own rows; 8.00x (on 8 devices)
means every device computes every example. ``autoaccum._hlo.collectives`` (loop vs outside) is printed alongside.

Before timing, one update of every variant from the same start is checked against the single-device reference
(``jax.grad`` on the whole batch, one optax AdamW step, no library): parameters within ``--atol`` and
Adam's first moment (``(1 - b1) * grad`` after one step) within ``--grad-atol``. Timing excludes compilation
(``--warmup`` updates first); then ``--rounds`` rounds run every variant for ``--steps`` updates each, the order
rotating from round to round; a variant's time is its median per-update time over the rounds.

Goals (issue #11): exactly one gradient reduction (all-reduce or reduce-scatter op) per update for our
data-parallel update (both strategies), and its throughput >= ``--goal`` (1.0) x the best baseline's.

Caveat: the 8 "devices" are threads of one process sharing the machine's cores (2 here), so their compute is
not parallel, and a collective is a rendezvous of 8 threads on those cores, far dearer than on real
interconnects. See benchmarks/README.md.

Run it as ``python -m benchmarks.sharded`` (about 1 minute on two shared, loaded CPU cores); ``--help`` lists the
options. Exit status: 0 when it ran (whatever the goals; the last lines say), 1 when a variant's update
disagrees with the reference or a variant raised (it is reported, the others are still timed), 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import itertools
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

# 8 CPU devices unless XLA_FLAGS already names a device count; before jax is imported.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + (
    ""
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    else " --xla_force_host_platform_device_count=8"
)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoaccum
from autoaccum._hlo import collectives

PyTree = Any
State = tuple[Any, ...]
OURS, NAIVE, REFERENCE = "autoaccum", "baseline", "reference"
REDUCTIONS = ("all-reduce", "reduce-scatter")
GATHERS = ("all-gather",)
OTHERS = ("all-to-all", "collective-permute")

# -- reading compiled HLO ------------------------------------------------------------------------------------

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\((.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+): (\w+)\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[([\d,]*)\]")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(" + "|".join(REDUCTIONS + GATHERS + OTHERS) + r")(?:-start)?\("
)
_DOT = re.compile(r"=\s*\w+\[([\d,]*)\](?:\{[^}]*\})?\s+dot\(([^)]*)\).*?lhs_contracting_dims=\{([\d,]*)\}")
_OPERAND = re.compile(r"(?:\w+\[([\d,]*)\](?:\{[^}]*\})?\s+)?%?([\w.\-]+)")
_WHILE = re.compile(r"\swhile\(.*?\bbody=%?([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(r"(?:calls|to_apply|true_computation|false_computation|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


@dataclasses.dataclass
class Cost:
    """What one program (or one update: programs times their executions) runs, per device.

    Attributes:
      ops: ``{(collective, result type): executions}``.
      dot_flops: matmul FLOPs per device (2 x result elements x contracted size, summed over dot ops).
      assumed_trips: whether some while loop had no known trip count (then ``trips`` was assumed).
    """

    ops: collections.Counter[tuple[str, str]] = dataclasses.field(default_factory=collections.Counter)
    dot_flops: float = 0.0
    assumed_trips: bool = False

    def count(self, kinds: Sequence[str]) -> int:
        return sum(n for (kind, _), n in self.ops.items() if kind in kinds)

    def times(self, n: int) -> Cost:
        return Cost(
            collections.Counter({k: v * n for k, v in self.ops.items()}), self.dot_flops * n, self.assumed_trips
        )

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.ops + other.ops, self.dot_flops + other.dot_flops, self.assumed_trips or other.assumed_trips)


def analyse(hlo_text: str, trips: int) -> Cost:
    """The collectives and dot FLOPs one call of a compiled program (``Compiled.as_text()``) executes per
    device: each computation counts as often as it runs (a while body by its loop's ``known_trip_count``,
    ``trips`` when XLA gives none; fusions and calls once per caller run; both branches of a conditional)."""
    blocks: dict[str, list[str]] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    entry, name = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line) if name is None else None
        if header:
            name = header.group(2)
            entry = name if header.group(1) else entry
            blocks[name] = []
            shapes[name] = {p: _dims(d) for p, _, d in _PARAM.findall(header.group(3))}
        elif name is not None:
            if line.strip() == "}":
                name = None
                continue
            blocks[name].append(line)
            defined = _DEF.match(line)
            if defined:
                shapes[name][defined.group(1)] = _dims(defined.group(3))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    assumed = False
    calls: dict[str, list[tuple[str, int]]] = {}
    for comp, lines in blocks.items():
        edges = []
        for line in lines:
            body = _WHILE.search(line)
            if body:
                known = _TRIPS.search(line)
                assumed = assumed or known is None
                edges.append((body.group(1), int(known.group(1)) if known else trips))
            edges += [(callee, 1) for callee in _CALLS.findall(line)]
            for group in _BRANCHES.findall(line):
                edges += [(b.strip().lstrip("%"), 1) for b in group.split(",")]
        calls[comp] = [(callee, n) for callee, n in edges if callee in blocks]
    order: list[str] = []
    seen: set[str] = set()

    def visit(comp: str) -> None:  # post-order over the (acyclic) call graph
        seen.add(comp)
        for callee, _ in calls[comp]:
            if callee not in seen:
                visit(callee)
        order.append(comp)

    visit(entry)
    runs = collections.Counter({entry: 1})
    for comp in reversed(order):
        for callee, n in calls[comp]:
            runs[callee] += runs[comp] * n
    cost = Cost(assumed_trips=assumed)
    for comp in order:
        for line in blocks[comp]:
            op = _COLLECTIVE.match(line)
            if op:
                result = re.sub(r"\{[^{}]*\}|/\*[^*]*\*/", "", op.group(1)).replace(" ", "")
                cost.ops[(op.group(2), result)] += runs[comp]
            dot = _DOT.search(line)
            if dot:
                lhs = _OPERAND.match(dot.group(2).strip())
                if lhs is None:
                    continue
                lhs_dims = _dims(lhs.group(1)) if lhs.group(1) is not None else shapes[comp].get(lhs.group(2))
                if lhs_dims is None:
                    continue
                contracted = math.prod(lhs_dims[d] for d in _dims(dot.group(3)))
                cost.dot_flops += runs[comp] * 2.0 * math.prod(_dims(dot.group(1))) * contracted
    return cost


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program an update runs, ``runs`` times per update."""

    label: str
    text: str
    runs: int


def hlo(compiled: Any) -> str:
    """The text of a ``jax.stages.Compiled``."""
    text = compiled.as_text()
    if text is None:
        raise ValueError("the compiled program has no text")
    return str(text)


def per_update(programs: Sequence[Program], trips: int) -> Cost:
    return sum((analyse(p.text, trips).times(p.runs) for p in programs), Cost())


def describe(programs: Sequence[Program], trips: int) -> str:
    """Each program, how often it runs, the library's loop/outside split and our per-call op list."""
    parts = []
    for p in programs:
        lib = collectives(p.text)
        ops = analyse(p.text, trips).ops
        listed = ", ".join(f"{n} x {kind} {shape}" for (kind, shape), n in sorted(ops.items())) or "none"
        parts.append(
            f"    {p.label} (runs {p.runs}x per update): per call {listed}; autoaccum._hlo.collectives: "
            f"loop={lib.loop} outside={lib.outside}"
        )
    return "\n".join(parts)


# -- the workload --------------------------------------------------------------------------------------------


def mlp(features: Sequence[int], batch_size: int, seed: int = 0) -> tuple[PyTree, PyTree]:
    """An MLP's parameters ``{"w0", "b0", ...}`` and a batch of random inputs with labels in 0..classes-1."""
    keys = jax.random.split(jax.random.key(seed), len(features) + 1)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(features)):
        params[f"w{i}"] = jax.random.normal(keys[i], (a, b)) * math.sqrt(2.0 / a)
        params[f"b{i}"] = jnp.zeros((b,))
    kx, ky = jax.random.split(keys[-1])
    batch = {
        "x": jax.random.normal(kx, (batch_size, features[0])),
        "y": jax.random.randint(ky, (batch_size,), 0, features[-1]),
    }
    return params, batch


def loss_fn(params: PyTree, batch: PyTree) -> jax.Array:
    """Mean softmax cross-entropy of a ReLU MLP."""
    layers = len(params) // 2
    h = batch["x"]
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = jax.nn.relu(h)
    return optax.softmax_cross_entropy_with_integer_labels(h, batch["y"]).mean()


# -- the variants --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Variant:
    """One way to run a full-batch-equivalent update on the mesh.

    Attributes:
      name: the row label.
      by: ``OURS``, ``NAIVE`` or ``REFERENCE``.
      params: ``"replicated"`` or ``"FSDP"``.
      init: ``init() -> state``, a fresh ``(params, opt_state)`` from the common start (copies).
      step: ``step(state) -> state``, one update (donating ``state``).
      programs: ``programs(state) -> [Program]``, the compiled programs one update runs.
      gathers_outside: what gathers parameters outside those programs, if anything.
    """

    name: str
    by: str
    params: str
    init: Callable[[], State]
    step: Callable[[State], State]
    programs: Callable[[State], list[Program]]
    gathers_outside: str = ""


def copy(tree: PyTree) -> PyTree:
    return jax.tree.map(jnp.copy, tree)


def ours(
    name: str, params: PyTree, batch: PyTree, opt: optax.GradientTransformation, m: int, **schedule: Any
) -> Variant:
    """``autoaccum.build_update(loss_fn, opt, microbatch_size=m, strategy=name, **schedule)``."""
    update = autoaccum.build_update(loss_fn, opt, microbatch_size=m, strategy=name, **schedule)
    fsdp = any(isinstance(x.sharding, NamedSharding) and any(x.sharding.spec) for x in jax.tree.leaves(params))
    label = f"ours: {name}"
    if fsdp:
        label += f", FSDP gather={schedule['gather_params']} reduce={schedule['reduce_grads']}"

    def init() -> State:
        start = copy(params)
        return start, update.init(start)

    def step(state: State) -> State:
        return update(state[0], state[1], batch)[:2]

    def programs(state: State) -> list[Program]:
        lowered = update.programs(state[0], state[1], batch)
        if name == "scan":
            return [Program("scan update", hlo(lowered[0].lowered.compile()), 1)]
        if name == "multisteps":  # wrap, then per size a middle and a last microbatch's program
            calls = update.accumulation.microbatches(batch)
            kinds = [(size, last) for size in sorted({s for _, s in calls}) for last in (False, True)]
            progs = [Program("wrap", hlo(lowered[0].lowered.compile()), 1)]
            for (size, last), low in zip(kinds, lowered[1:], strict=True):
                n = sum(s == size and (i == len(calls) - 1) == last for i, (_, s) in enumerate(calls))
                progs.append(Program(f"{'last' if last else 'microbatch'} (m={size})", hlo(low.lowered.compile()), n))
            return progs
        # loop on a mesh: the first microbatch's program, one per distinct size of the others, then the optimizer step
        (_, first), *rest = update.accumulation.microbatches(batch)
        sizes = sorted({size for _, size in rest})
        counts = [1] + [sum(size == s for _, size in rest) for s in sizes] + [1]
        labels = [f"first microbatch (m={first})"] + [f"microbatch (m={s})" for s in sizes] + ["apply"]
        assert len(lowered) == len(counts), (len(lowered), counts)
        return [
            Program(lab, hlo(low.lowered.compile()), n) for lab, low, n in zip(labels, lowered, counts, strict=True)
        ]

    # A host loop that gathers once gets its replicated copy from jax.device_put (strategies/_sharding.py,
    # OnMesh.gathered): a runtime copy, not a collective in any compiled program.
    outside = "device_put" if fsdp and name == "loop" and schedule["gather_params"] == "once" else ""
    return Variant(label, OURS, "FSDP" if fsdp else "replicated", init, step, programs, outside)


class CompiledOnce:
    """``jax.jit(fn)``, compiled at the first call's arguments and reused, so its text can be read."""

    def __init__(self, fn: Callable[..., Any], donate: tuple[int, ...]) -> None:
        self._jitted = jax.jit(fn, donate_argnums=donate)
        self._compiled: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            self._compiled = self._jitted.lower(*args).compile()
        return self._compiled(*args)

    def text(self, *args: Any) -> str:
        return hlo(self._compiled or self._jitted.lower(*args).compile())


def full_batch(params: PyTree, batch: PyTree, opt: optax.GradientTransformation) -> Variant:
    """The reference row: one ``value_and_grad`` over the whole sharded batch, no accumulation."""

    def update(params: PyTree, opt_state: PyTree, batch: PyTree) -> State:
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = CompiledOnce(update, (0, 1))
    return Variant(
        "full batch (no accumulation)",
        REFERENCE,
        "replicated",
        lambda: (copy(params), opt.init(params)),
        lambda state: run(state[0], state[1], batch),
        lambda state: [Program("update", run.text(state[0], state[1], batch), 1)],
    )


def scan_update(opt: optax.GradientTransformation, k: int, microbatches: Callable[[PyTree], PyTree]) -> Callable:
    """A global-view update: ``lax.scan`` over ``microbatches(batch)`` (leading axis k), the mean of the
    microbatches' gradients, one optimizer step."""

    def update(params: PyTree, opt_state: PyTree, batch: PyTree) -> State:
        def body(acc: PyTree, microbatch: PyTree) -> tuple[PyTree, None]:
            grads = jax.grad(loss_fn)(params, microbatch)
            return jax.tree.map(jnp.add, acc, grads), None

        total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), microbatches(batch))
        grads = jax.tree.map(lambda g: g / k, total)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


def naive_scan(params: PyTree, batch: PyTree, opt: optax.GradientTransformation, m: int) -> Variant:
    """Naive 1: a plain jitted scan over the row-major reshape ``(B, ...) -> (k, m, ...)`` of the sharded batch."""
    k = len(jax.tree.leaves(batch)[0]) // m
    rows = lambda batch: jax.tree.map(lambda x: x.reshape(k, m, *x.shape[1:]), batch)  # noqa: E731
    run = CompiledOnce(scan_update(opt, k, rows), (0, 1))
    return Variant(
        "naive: lax.scan, row-major microbatches",
        NAIVE,
        "replicated",
        lambda: (copy(params), opt.init(params)),
        lambda state: run(state[0], state[1], batch),
        lambda state: [Program("scan update", run.text(state[0], state[1], batch), 1)],
    )


def aligned_scan(params: PyTree, batch: PyTree, opt: optax.GradientTransformation, m: int, n: int) -> Variant:
    """A global-view scan whose microbatch ``i`` is every device's ``i``-th block of ``m / n`` rows (no data
    moves to form it): ``(B, ...) -> (n, k, m/n, ...) -> (k, n, m/n, ...) -> (k, m, ...)``."""
    k = len(jax.tree.leaves(batch)[0]) // m

    def blocks(batch: PyTree) -> PyTree:
        return jax.tree.map(
            lambda x: x.reshape(n, k, m // n, *x.shape[1:]).swapaxes(0, 1).reshape(k, m, *x.shape[1:]), batch
        )

    run = CompiledOnce(scan_update(opt, k, blocks), (0, 1))
    return Variant(
        "hand-written: lax.scan, shard-aligned microbatches",
        NAIVE,
        "replicated",
        lambda: (copy(params), opt.init(params)),
        lambda state: run(state[0], state[1], batch),
        lambda state: [Program("scan update", run.text(state[0], state[1], batch), 1)],
    )


def shard_map_scan(params: PyTree, batch: PyTree, opt: optax.GradientTransformation, m: int, mesh: Any) -> Variant:
    """The reference for our overhead: what an expert writes by hand with ``jax.shard_map``. Each device scans
    its own rows in ``k`` blocks of ``m / n`` with the parameters marked device-varying (so nothing is reduced
    inside the loop), one ``psum`` of the gradient sums after it, then the optimizer on the global arrays."""
    n = mesh.size
    k = len(jax.tree.leaves(batch)[0]) // m

    def local(params: PyTree, batch: PyTree) -> PyTree:
        params = jax.tree.map(lambda p: jax.lax.pcast(p, "data", to="varying"), params)
        blocks = jax.tree.map(lambda x: x.reshape(k, m // n, *x.shape[1:]), batch)

        def body(acc: PyTree, microbatch: PyTree) -> tuple[PyTree, None]:
            return jax.tree.map(jnp.add, acc, jax.grad(loss_fn)(params, microbatch)), None

        zeros = jax.tree.map(lambda p: jax.lax.pcast(jnp.zeros(p.shape, p.dtype), "data", to="varying"), params)
        total, _ = jax.lax.scan(body, zeros, blocks)
        return jax.lax.psum(total, "data")

    def update(params: PyTree, opt_state: PyTree, batch: PyTree) -> State:
        total = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())(params, batch)
        grads = jax.tree.map(lambda g: g / (n * k), total)  # the mean of n * k per-block mean gradients
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = CompiledOnce(update, (0, 1))
    return Variant(
        "hand-written: shard_map + lax.scan, one psum",
        REFERENCE,
        "replicated",
        lambda: (copy(params), opt.init(params)),
        lambda state: run(state[0], state[1], batch),
        lambda state: [Program("scan update", run.text(state[0], state[1], batch), 1)],
    )


def naive_multisteps(params: PyTree, microbatches: list[PyTree], opt: optax.GradientTransformation) -> Variant:
    """Naive 2: ``optax.MultiSteps``, one jitted call per (sharded) microbatch from a host loop."""
    multi = optax.MultiSteps(opt, every_k_schedule=len(microbatches))

    def update(params: PyTree, opt_state: PyTree, microbatch: PyTree) -> State:
        grads = jax.grad(loss_fn)(params, microbatch)
        updates, opt_state = multi.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    run = CompiledOnce(update, (0, 1))

    def step(state: State) -> State:
        for microbatch in microbatches:
            state = run(state[0], state[1], microbatch)
        return state

    return Variant(
        "naive: optax.MultiSteps, host loop",
        NAIVE,
        "replicated",
        lambda: (copy(params), multi.init(params)),
        step,
        lambda state: [Program("microbatch step", run.text(state[0], state[1], microbatches[0]), len(microbatches))],
    )


# -- checking and timing -------------------------------------------------------------------------------------


def max_abs_diff(a: PyTree, b: PyTree) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


def first_moment(opt_state: PyTree) -> PyTree:
    """The ``mu`` of the Adam state inside ``opt_state`` (``MultiStepsState`` included)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    (found,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    return found.mu


@dataclasses.dataclass
class Result:
    variant: Variant
    first_call: float = 0.0
    diffs: tuple[float, float] = (0.0, 0.0)
    cost: Cost | None = None
    detail: str = ""
    error: str = ""
    times: list[float] = dataclasses.field(default_factory=list)
    state: State = ()


def prepare(variant: Variant, reference: State, args: argparse.Namespace, k: int) -> Result:
    """One update from the common start, checked against the reference; the programs read; warm-up."""
    result = Result(variant)
    try:
        start = time.perf_counter()
        state = jax.block_until_ready(variant.step(variant.init()))
        result.first_call = time.perf_counter() - start
        params, opt_state = jax.device_get(state)
        result.diffs = (
            max_abs_diff(params, reference[0]),
            max_abs_diff(first_moment(opt_state), first_moment(reference[1])),
        )
        programs = variant.programs(variant.init())
        result.cost = per_update(programs, k)
        result.detail = describe(programs, k)
        for _ in range(args.warmup - 1):
            state = variant.step(state)
        result.state = jax.block_until_ready(state)
    except Exception as e:  # reported in the table; the other variants still run
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return result


def time_rounds(results: list[Result], args: argparse.Namespace) -> None:
    """Per-update seconds of every variant in every round (the order rotating from round to round)."""
    for r in range(args.rounds):
        shift = r % len(results)
        for result in results[shift:] + results[:shift]:
            state = result.state
            start = time.perf_counter()
            for _ in range(args.steps):
                state = result.variant.step(state)
            result.state = jax.block_until_ready(state)
            result.times.append((time.perf_counter() - start) / args.steps)


def machine(n: int) -> str:
    device = jax.devices()[0]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = " | load average {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()) if hasattr(os, "getloadavg") else ""
    return (
        f"{platform.platform()} | {platform.processor() or platform.machine()} | {cpus} CPUs usable "
        f"({os.cpu_count()} total) | {n} jax devices ({device.platform}, {device.device_kind}) | jax "
        f"{jax.__version__} | optax {optax.__version__} | python {platform.python_version()}{load}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit status: 0 when the benchmark ran (the last lines say whether the goals are met), 1 when a "
        "variant's update disagrees with the reference or raised, 2 for bad arguments.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=256, help="effective batch B (examples per update)")
    p.add_argument("--microbatch", type=int, default=32, help="global microbatch size m (divides B; devices divide m)")
    p.add_argument("--hidden", type=int, default=256, help="MLP hidden width")
    p.add_argument("--layers", type=int, default=2, help="MLP hidden layers")
    p.add_argument("--inputs", type=int, default=784, help="MLP input features")
    p.add_argument("--classes", type=int, default=10, help="MLP output classes")
    p.add_argument(
        "--fsdp", action=argparse.BooleanOptionalAction, default=True, help="also our FSDP variants (8 rows)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed updates per variant (compilation included)")
    p.add_argument("--steps", type=int, default=2, help="timed updates per variant per round")
    p.add_argument("--rounds", type=int, default=10, help="rounds; a variant's time is its median over them")
    p.add_argument("--goal", type=float, default=1.0, help="required throughput ratio ours / best baseline")
    p.add_argument("--atol", type=float, default=1e-4, help="one-update check: params tolerance (~0.1 lr)")
    p.add_argument("--grad-atol", type=float, default=1e-6, help="one-update check: Adam first-moment tolerance")
    args = p.parse_args(argv)
    n = len(jax.devices())
    if min(args.batch, args.microbatch, args.steps, args.rounds, args.warmup, args.hidden, args.layers) < 1:
        p.error("--batch, --microbatch, --steps, --rounds, --warmup, --hidden and --layers must be >= 1")
    if args.batch % args.microbatch or args.microbatch % n:
        p.error(f"--microbatch={args.microbatch} must divide --batch={args.batch} and be a multiple of {n} devices")
    if n < 2:
        p.error(
            "one jax device only: XLA_FLAGS names a device count below 2; run with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 (the default when XLA_FLAGS names none)"
        )
    return args


def _variants(args: argparse.Namespace) -> tuple[list[Any], Any, dict[str, Any]]:
    """The variants timed, the single-device reference step, and what the header and the table need."""
    b, m = args.batch, args.microbatch
    k = b // m
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    features = (args.inputs, *[args.hidden] * args.layers, args.classes)
    host_params, host_batch = jax.device_get(mlp(features, b))
    opt = optax.adamw(1e-3)

    # The reference: one device, no library, the whole batch.
    grads = jax.jit(jax.grad(loss_fn))(host_params, host_batch)
    updates, ref_opt_state = opt.update(grads, opt.init(host_params), host_params)
    reference = jax.device_get((optax.apply_updates(host_params, updates), ref_opt_state))
    ideal_flops = analyse(hlo(jax.jit(jax.grad(loss_fn)).lower(host_params, host_batch).compile()), 1).dot_flops
    ideal_flops /= n

    params = jax.device_put(host_params, replicated)
    batch = jax.device_put(host_batch, rows)
    microbatches = [
        jax.device_put(jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], host_batch), rows) for i in range(k)
    ]
    fsdp = {
        name: jax.device_put(x, NamedSharding(mesh, P("data") if x.shape[0] % n == 0 else P()))
        for name, x in host_params.items()
    }
    variants = [
        full_batch(params, batch, opt),
        ours("scan", params, batch, opt, m),
        ours("loop", params, batch, opt, m),
        ours("multisteps", params, batch, opt, m),
    ]
    if args.fsdp:
        for name in ("scan", "loop"):
            for gather in ("once", "per_microbatch"):
                for reduce in ("once", "per_microbatch"):
                    variants.append(ours(name, fsdp, batch, opt, m, gather_params=gather, reduce_grads=reduce))
    variants += [
        naive_scan(params, batch, opt, m),
        naive_multisteps(params, microbatches, opt),
        aligned_scan(params, batch, opt, m, n),
        shard_map_scan(params, batch, opt, m, mesh),
    ]
    about = dict(
        n=n, k=k, features=features, ideal_flops=ideal_flops,
        n_params=sum(x.size for x in jax.tree.leaves(host_params)),
        replicated_leaves=sorted(name for name, x in fsdp.items() if not any(x.sharding.spec)),
    )  # fmt: skip
    return variants, reference, about


def _header(args: argparse.Namespace, about: dict[str, Any]) -> None:
    n, features = about["n"], about["features"]
    print(f"machine: {machine(n)}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '').strip()!r}")
    print(
        f"workload: MLP {' -> '.join(map(str, features))} (ReLU), {about['n_params']:,} params, softmax "
        f"cross-entropy, AdamW(1e-3); batch sharded over {n} devices (Auto mesh, axis 'data')"
    )
    print(
        f"B={args.batch}, microbatch m={args.microbatch} (k={about['k']} microbatches, {args.microbatch // n} rows "
        f"per device per microbatch), {args.rounds} rounds x {args.steps} updates, warm-up {args.warmup}"
    )
    if args.fsdp:
        print(
            "FSDP: every parameter sharded on its first dimension over 'data', except "
            f"{about['replicated_leaves']} (replicated)"
        )
    print()


def _checked(results: list[Any], args: argparse.Namespace) -> bool:
    """Prints the one-update check against the reference; False where a variant is off it."""
    failed = [
        f"{r.variant.name}: max |params - reference| = {r.diffs[0]:.2e} (atol {args.atol:g}), max |Adam mu - "
        f"reference| = {r.diffs[1]:.2e} (atol {args.grad_atol:g})"
        for r in results
        if not r.error and (r.diffs[0] > args.atol or r.diffs[1] > args.grad_atol)
    ]
    if failed:
        print("one-update check FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return False
    errors = [r for r in results if r.error]
    ok = [r for r in results if not r.error]
    worst = [max(r.diffs[i] for r in ok) for i in range(2)]
    print(
        f"one-update check vs the single-device reference passed for {len(ok)} variants: max |params diff| = "
        f"{worst[0]:.1e} (atol {args.atol:g}), max |Adam first-moment diff| = {worst[1]:.1e} (atol {args.grad_atol:g})"
    )
    if errors:
        print(f"{len(errors)} variant(s) raised before timing (ERROR rows; the error follows the table)")
    print()
    return True


def _table(results: list[Any], args: argparse.Namespace, ideal_flops: float) -> tuple[Any, dict[str, float]]:
    """Times the variants that ran and prints their table; returns the best baseline and the medians."""
    ok, errors = [r for r in results if not r.error], [r for r in results if r.error]
    time_rounds(ok, args)
    medians = {r.variant.name: statistics.median(r.times) for r in ok}
    mins = {r.variant.name: min(r.times) for r in ok}
    best = min((r for r in ok if r.variant.by == NAIVE), key=lambda r: medians[r.variant.name])
    print(
        "| variant | params | reductions / update | all-gathers / update | compute per device (x data-parallel) "
        "| examples/s | ms/update (median) | ms/update (min) | vs best baseline | first call (s) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r.error:
            print(f"| {r.variant.name} | {r.variant.params} | | | | ERROR | | | | |")
            continue
        assert r.cost is not None
        t = medians[r.variant.name]
        other = r.cost.count(OTHERS)
        gathers = f"{r.cost.count(GATHERS)}" + (f" (+{other} all-to-all/permute)" if other else "")
        gathers += f" + {r.variant.gathers_outside}" if r.variant.gathers_outside else ""
        trips = " (trip count assumed)" if r.cost.assumed_trips else ""
        print(
            f"| {r.variant.name} | {r.variant.params} | {r.cost.count(REDUCTIONS)}{trips} | {gathers} | "
            f"{r.cost.dot_flops / ideal_flops:.2f}x | {args.batch / t:,.0f} | {1e3 * t:.2f} | "
            f"{1e3 * mins[r.variant.name]:.2f} | {medians[best.variant.name] / t:.3f} | {r.first_call:.2f} |"
        )
    for r in errors:
        print(f"ERROR {r.variant.name}: {r.error}")
    if any(r.variant.gathers_outside for r in ok):
        print(
            "'+ device_put': the host loop gathers the FSDP parameters once per update with jax.device_put to a "
            "replicated sharding (a runtime copy), outside the programs Update.programs lists"
        )
    return best, medians


def _goals(results: list[Any], args: argparse.Namespace, best: Any, medians: dict[str, float]) -> None:
    ok = [r for r in results if not r.error]
    mins = {r.variant.name: min(r.times) for r in ok}
    best_t = medians[best.variant.name]
    best_min = min(mins[r.variant.name] for r in ok if r.variant.by == NAIVE)
    print("\ncompiled programs per update (per call: collective x result type; loops counted by trip count):")
    for r in ok:
        print(
            f"  {r.variant.name} (one-update check: max |params diff| {r.diffs[0]:.1e}, max |Adam mu diff| "
            f"{r.diffs[1]:.1e}):\n{r.detail}"
        )
    print(
        f"\nbest baseline: {best.variant.name} ({args.batch / best_t:,.0f} ex/s); ratios are median-throughput "
        "ratios, 'least-disturbed' compares each side's fastest round"
    )
    expert = "hand-written: shard_map + lax.scan, one psum"
    for r in ok:
        if r.variant.by != OURS or r.variant.params != "replicated":
            continue
        assert r.cost is not None
        name, t = r.variant.name, medians[r.variant.name]
        reductions = r.cost.count(REDUCTIONS)
        print(
            f"goal, {name}: reductions per update = {reductions} (goal exactly 1: "
            f"{'met' if reductions == 1 else 'NOT met'}); throughput / best baseline = {best_t / t:.3f} (goal >= "
            f"{args.goal:g}: {'met' if best_t / t >= args.goal else 'NOT met'}); least-disturbed "
            f"{best_min / mins[name]:.3f}"
        )
    for r in ok:
        if r.variant.by == OURS and r.variant.params == "replicated" and expert in medians:
            print(
                f"informational, {r.variant.name} / {expert} (throughput; 1.0: no overhead over the hand-written "
                f"shard_map) = {medians[expert] / medians[r.variant.name]:.3f}"
            )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    variants, reference, about = _variants(args)
    _header(args, about)
    results = [prepare(v, reference, args, about["k"]) for v in variants]
    if not _checked(results, args):
        return 1
    best, medians = _table(results, args, about["ideal_flops"])
    _goals(results, args, best, medians)
    errors = [r for r in results if r.error]
    if errors:
        print(f"{len(errors)} variant(s) raised (see ERROR after the table)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
