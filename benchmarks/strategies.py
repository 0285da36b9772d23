"""Times every autoaccum strategy against the three hand-written ways of accumulating gradients.

The baselines are the three options of optax's "Gradient accumulation and microbatching" notebook
(``examples/gradient_accumulation_and_microbatching.ipynb``), written as a competent user would write them:

* ``manual``: one jitted ``add_gradient(params, microbatch, acc)`` per microbatch (value_and_grad, then
  ``jax.tree.map(jnp.add)`` into the donated accumulator, in the same program), then a jitted
  ``update_params`` that averages, runs the optimizer and hands back a zeroed accumulator; the microbatches
  are sliced once, before timing.
* ``optax.MultiSteps``: the optimizer wrapped in ``optax.MultiSteps(opt, every_k_schedule=k)``, one jitted
  step per (pre-sliced) microbatch.
* ``optax.microbatching``: ``optax.microbatching.microbatch(value_and_grad(loss), MEAN)`` and the optimizer
  update in one jitted step over the whole batch.

Two more rows are autoaccum's own: every strategy again with ``has_state=True``, its loss taking a typed
PRNG key, splitting it and returning the new one (a dropout-like pattern whose draw is added times zero, so the
math and the one-step check are unchanged): the cost of threading a model state through the accumulation, as
the stateless / stateful throughput ratio of the same strategy (goal: at most ``--state-goal`` overhead).
These rows are not candidates for "our best", nor is the row for ``autoaccum.value_and_grad`` inside a
step of the user's (a ``jax.jit`` step calling it, then ``optimizer.update`` and ``optax.apply_updates``, donating
``params`` and ``opt_state``), timed against ``build_update``'s ``scan`` at the same unroll, the same accumulation
(goal: at most ``--your-step-goal`` slower): after each table, ``--pair-rounds`` rounds of these two and the
default alone give the median of their per-round time ratio. Smaller tables follow for the built-in image
workloads (``--also``, default ``mlp cnn``): the plain full-batch step, our strategies and the same three
baselines. Every table has a row for ``build_update``'s default (``strategy="auto"``, which runs ``scan``, or
``loop`` on XLA:CPU for a loss with a convolution), and a summary table ends the run, a row per workload, with the
two goals: the default within ``--default-goal`` (1.10x) of the fastest hand-written time, and our best at least
``--goal`` (1.00) of their best throughput, on every workload.

Every method does the same work: ``B`` examples per step in ``k = B // m`` microbatches of ``m``, the
workload's optimizer (AdamW) stepping once per ``B`` examples, ``params`` and ``opt_state`` donated. A cheap
check first asserts that one step of every method from the same start matches the full-batch step.

Timing excludes compilation: each method runs ``--warmup`` steps first. Then ``--rounds`` rounds run every
method for ``--steps`` steps each, or as many as last ``--round-ms`` (30 ms) for a faster method (in a new
order each round, shuffled with a fixed seed, so that drifting load on a shared machine and what the previous
method left behind hit every method alike); a method's time is its median per-step time over the rounds.

Run it as ``python benchmarks/strategies.py`` (4 to 4.5 minutes on two shared, loaded CPU cores); ``--help`` lists the
options. Exit status: 0 when it ran (whether or not the goal is met; the last line says), 1 when a method's
step disagrees with the full-batch step, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import microbatching

import autoaccum
from autoaccum import strategies, workloads

PyTree = Any
State = tuple[Any, ...]
STATEFUL = "autoaccum, has_state"
YOUR_STEP = "autoaccum, your step"
DEFAULT = "default (strategy=auto)"


@dataclasses.dataclass(frozen=True)
class Summary:
    """One workload's row of the summary table (median seconds per step)."""

    workload: str
    picked: str
    default: float
    ours: tuple[str, float]
    theirs: tuple[str, float]


@dataclasses.dataclass(frozen=True)
class Method:
    """One way to run a full-batch-equivalent training step.

    Attributes:
      name: the row label.
      by: ``"autoaccum"`` (one of our strategies), ``STATEFUL`` (one of ours with a PRNG-key model state),
        ``YOUR_STEP`` (``autoaccum.value_and_grad`` in a step of the user's), ``"hand-written"`` (a baseline) or
        ``"reference"``.
      init: ``init(params) -> state``; the state's first item is always ``params``.
      step: ``step(state) -> state``, one step on the benchmark's batch (captured), donating ``state``.
    """

    name: str
    by: str
    init: Callable[[PyTree], State]
    step: Callable[[State], State]


def full_batch(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, batch: PyTree) -> Method:
    """The reference: one value_and_grad over the whole batch (no accumulation)."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params: PyTree, opt_state: PyTree, batch: PyTree) -> State:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return Method(
        "full batch (no accumulation)",
        "reference",
        lambda params: (params, optimizer.init(params)),
        lambda state: update(state[0], state[1], batch)[:2],
    )


def ours(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: PyTree,
    m: int,
    name: str,
    **options: Any,
) -> Method:
    """``autoaccum.build_update(..., strategy=name, **options)``."""
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=m, strategy=name, **options)
    label = name + "".join(f" {k}={v}" for k, v in options.items())
    return Method(
        label,
        "autoaccum",
        lambda params: (params, update.init(params)),
        lambda state: update(state[0], state[1], batch)[:2],
    )


def ours_stateful(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    batch: PyTree,
    m: int,
    name: str,
    **options: Any,
) -> Method:
    """``autoaccum.build_update(..., has_state=True)`` on ``loss_fn`` with a PRNG key as the model state.

    The loss splits the key, draws one number and adds it times zero (a dropout-like use that leaves the loss
    and gradient unchanged), and returns the new key: what a user threading dropout randomness writes.
    """

    def keyed_loss(params: PyTree, batch: PyTree, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        key, sub = jax.random.split(key)
        return loss_fn(params, batch) + 0.0 * jax.random.uniform(sub), key

    update = autoaccum.build_update(keyed_loss, optimizer, microbatch_size=m, strategy=name, has_state=True, **options)
    label = name + "".join(f" {k}={v}" for k, v in options.items()) + " (has_state: PRNG key)"

    def step(state: State) -> State:
        params, opt_state, _, key = update(state[0], state[1], batch, state[2])
        return params, opt_state, key

    return Method(label, STATEFUL, lambda params: (params, update.init(params), jax.random.key(0)), step)


def jitted_step(grad_fn: Callable[..., Any], optimizer: optax.GradientTransformation) -> Callable[..., State]:
    """``update(params, opt_state, batch) -> (params, opt_state, loss)`` applying ``grad_fn(params, batch) -> (loss,
    grads)`` with ``optimizer``, jitted, donating ``params`` and ``opt_state`` as ``build_update`` does."""

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params: PyTree, opt_state: PyTree, batch: PyTree) -> State:
        loss, grads = grad_fn(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update


def in_your_step(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, batch: PyTree, m: int) -> Method:
    """``autoaccum.value_and_grad`` inside a user-written ``jax.jit`` step that applies the optimizer itself,
    donating ``params`` and ``opt_state`` as ``build_update`` does."""
    update = jitted_step(autoaccum.value_and_grad(loss_fn, microbatch_size=m), optimizer)

    return Method(
        "value_and_grad in your jit step",
        YOUR_STEP,
        lambda params: (params, optimizer.init(params)),
        lambda state: update(state[0], state[1], batch)[:2],
    )


def manual(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, microbatches: list[PyTree]) -> Method:
    """The notebook's option 1: ``add_gradient`` per microbatch, then ``update_params``."""
    k = len(microbatches)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def add_gradient(params: PyTree, microbatch: PyTree, acc: PyTree) -> PyTree:
        loss, grads = jax.value_and_grad(loss_fn)(params, microbatch)
        return jax.tree.map(jnp.add, acc, (loss, grads))

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def update_params(params: PyTree, opt_state: PyTree, acc: PyTree) -> State:
        loss, grads = jax.tree.map(lambda x: x / k, acc)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.zeros_like(acc), loss

    def init(params: PyTree) -> State:
        return params, optimizer.init(params), (jnp.zeros((), jnp.float32), optax.tree.zeros_like(params))

    def step(state: State) -> State:
        params, opt_state, acc = state
        for microbatch in microbatches:
            acc = add_gradient(params, microbatch, acc)
        return update_params(params, opt_state, acc)[:3]

    return Method("manual accumulate + apply", "hand-written", init, step)


def multisteps(
    loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, microbatches: list[PyTree]
) -> Method:
    """The notebook's option 2: ``optax.MultiSteps``, one jitted step per microbatch."""
    multi = optax.MultiSteps(optimizer, every_k_schedule=len(microbatches))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params: PyTree, opt_state: PyTree, microbatch: PyTree) -> State:
        loss, grads = jax.value_and_grad(loss_fn)(params, microbatch)
        updates, opt_state = multi.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def step(state: State) -> State:
        params, opt_state = state
        for microbatch in microbatches:  # per-microbatch losses left unreduced, as when a user logs them
            params, opt_state, _ = update(params, opt_state, microbatch)
        return params, opt_state

    return Method("optax.MultiSteps", "hand-written", lambda params: (params, multi.init(params)), step)


def microbatch(loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation, batch: PyTree, m: int) -> Method:
    """The notebook's option 3: ``optax.microbatching.microbatch`` in one jitted step (MEAN accumulator)."""
    mean = microbatching.AccumulationType.MEAN
    value_and_grad = microbatching.microbatch(
        jax.value_and_grad(loss_fn), argnums=1, microbatch_size=m, accumulator=mean
    )
    update = jitted_step(value_and_grad, optimizer)

    return Method(
        "optax.microbatching.microbatch",
        "hand-written",
        lambda params: (params, optimizer.init(params)),
        lambda state: update(state[0], state[1], batch)[:2],
    )


def copy(tree: PyTree) -> PyTree:
    """A fresh copy (the methods donate what they are given)."""
    return jax.tree.map(jnp.copy, tree)


def max_abs_diff(a: PyTree, b: PyTree) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in pairs)


def first_moment(opt_state: PyTree) -> PyTree:
    """The ``mu`` of the Adam state inside ``opt_state`` (``MultiStepsState`` included)."""
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
    if len(found) != 1:
        raise ValueError(f"expected one optax.ScaleByAdamState in the optimizer state, found {len(found)}")
    return found[0].mu


def machine() -> str:
    device = jax.devices()[0]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{platform.platform()} | {platform.processor() or platform.machine()} | {cpus} CPUs usable "
        f"({os.cpu_count()} total) | jax {jax.__version__} on {device.platform} ({device.device_kind}) | "
        f"optax {optax.__version__} | flax {flax.__version__} | python {platform.python_version()}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exit status: 0 when the benchmark ran (the last line says whether the goal is met), "
        "1 when a method's step disagrees with the full-batch step, 2 for bad arguments.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--batch", type=int, default=64, help="effective batch B (examples per optimizer step)")
    p.add_argument("--microbatch", type=int, default=16, help="microbatch size m (must divide B)")
    p.add_argument("--seq-len", type=int, default=64, help="transformer sequence length")
    p.add_argument("--dim", type=int, default=64, help="transformer width")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method (compilation included)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method per round, at least")
    p.add_argument(
        "--round-ms", type=float, default=30.0, help="each method runs at least this long per round (more steps)"
    )
    p.add_argument("--rounds", type=int, default=15, help="rounds; each method's time is its median over them")
    scan_unroll = list(strategies.get("scan").options["unroll"])
    p.add_argument("--unroll", type=int, nargs="+", default=scan_unroll, help="scan unroll values to time")
    p.add_argument("--goal", type=float, default=1.00, help="required ratio of our best to their best, per workload")
    p.add_argument(
        "--state-goal", type=float, default=0.03, help="largest has_state overhead (stateful/stateless time - 1)"
    )
    p.add_argument(
        "--also",
        nargs="*",
        default=["mlp", "cnn"],
        choices=["mlp", "cnn", "mnist"],
        help="built-in image workloads timed after the transformer (full batch, ours, hand-written; same B and m)",
    )
    p.add_argument(
        "--default-goal", type=float, default=1.10, help="largest default / fastest hand-written time, per workload"
    )
    p.add_argument(
        "--pair-rounds",
        type=int,
        default=40,
        help="rounds of value_and_grad in your step, build_update's scan and the default alone, side by side",
    )
    p.add_argument(
        "--your-step-goal",
        type=float,
        default=0.03,
        help="largest value_and_grad-in-your-step overhead over build_update's scan (time ratio - 1)",
    )
    p.add_argument("--atol", type=float, default=1e-4, help="one-step check: params tolerance (~0.1 lr)")
    p.add_argument("--grad-atol", type=float, default=1e-6, help="one-step check: Adam first-moment tolerance")
    args = p.parse_args(argv)
    if min(args.batch, args.microbatch, args.steps, args.rounds, args.warmup) < 1 or args.pair_rounds < 2:
        p.error("--batch, --microbatch, --steps, --rounds and --warmup must be >= 1, --pair-rounds >= 2")
    if args.round_ms < 0:
        p.error(f"--round-ms must be >= 0 (0: exactly --steps steps a round), got {args.round_ms:g}")
    if args.batch % args.microbatch:
        p.error(f"--microbatch={args.microbatch} must divide --batch={args.batch} (as optax.microbatching needs)")
    return args


def our_methods(
    loss_fn: Callable[..., Any], opt: optax.GradientTransformation, batch: PyTree, m: int, unroll: Sequence[int]
) -> list[Method]:
    """The default (``build_update`` without ``strategy``), then every strategy (scan once per unroll value)."""
    update = autoaccum.build_update(loss_fn, opt, microbatch_size=m)
    default = Method(
        DEFAULT, "autoaccum", lambda params: (params, update.init(params)), lambda s: update(s[0], s[1], batch)[:2]
    )
    methods = [default]
    for name in strategies.available():
        if name == "scan":
            methods += [ours(loss_fn, opt, batch, m, name, unroll=u) for u in unroll]
        else:
            methods.append(ours(loss_fn, opt, batch, m, name))
    return methods


def check_and_warm(
    methods: list[Method], params: PyTree, args: argparse.Namespace
) -> tuple[dict[str, State], dict[str, float], list[str], list[float]]:
    """One step from the same start: every method must match the first (the full-batch reference).

    Adam's first step is -lr * g / (|g| + eps) elementwise, so params can differ by up to ~lr where a gradient
    entry is ~0 and rounding flips its sign; its first moment after one step is exactly (1 - b1) * g, so the
    gradient itself (scale included) is checked there. The step also compiles; the warm-up continues from it.
    Returns the warmed states, the first-call seconds, the failures and the worst (params, mu) differences.
    """
    states, first_call = {}, {}
    reference: State = ()
    failed, worst = [], [0.0, 0.0]
    for method in methods:
        start_params = jax.block_until_ready(copy(params))
        start = time.perf_counter()  # first call: init, trace, compile and one step
        state = jax.block_until_ready(method.step(method.init(start_params)))
        first_call[method.name] = time.perf_counter() - start
        if not reference:  # the first method is the full-batch reference
            reference = jax.tree.map(np.asarray, state[:2])
        diffs = (
            max_abs_diff(state[0], reference[0]),
            max_abs_diff(first_moment(state[1]), first_moment(reference[1])),
        )
        worst = [max(a, b) for a, b in zip(worst, diffs, strict=True)]
        if diffs[0] > args.atol or diffs[1] > args.grad_atol:
            failed.append(
                f"{method.name}: max |params - full batch| = {diffs[0]:.2e} (atol={args.atol:g}), "
                f"max |Adam mu - full batch| = {diffs[1]:.2e} (atol={args.grad_atol:g})"
            )
        for _ in range(args.warmup - 1):
            state = method.step(state)
        states[method.name] = jax.block_until_ready(state)
    return states, first_call, failed, worst


def run_steps(method: Method, state: State, steps: int) -> tuple[State, float]:
    """``steps`` steps of ``method`` from ``state``, synchronised at the end: the new state and seconds per step."""
    start = time.perf_counter()
    for _ in range(steps):
        state = method.step(state)
    state = jax.block_until_ready(state)
    return state, (time.perf_counter() - start) / steps


def time_rounds(methods: list[Method], states: dict[str, State], args: argparse.Namespace) -> dict[str, list[float]]:
    """Per-step seconds of every method in every round (in a new order each round, shuffled with a fixed seed).

    Each method runs at least ``--steps`` steps a round, and enough to last ``--round-ms`` (sized from one
    untimed pass of ``--steps`` steps): three steps of a 0.4 ms update are a 1.2 ms window, in which one
    scheduler hiccup of the machine moves the reading by 10%. Shuffled, not rotated: a rotation keeps every
    method's predecessor, and what a method leaves behind (XLA:CPU frees a step's memory after it returns) is
    charged to the next: the default, always run right after the full-batch step, read 10% to 12% slower than
    ``scan unroll=1``, the same program, in three runs.
    """
    order = random.Random(0)
    steps = {}
    for method in methods:
        states[method.name], per_step = run_steps(method, states[method.name], args.steps)
        steps[method.name] = max(args.steps, math.ceil(args.round_ms / 1e3 / per_step))
    times: dict[str, list[float]] = {method.name: [] for method in methods}
    for _ in range(args.rounds):
        for method in order.sample(methods, len(methods)):
            states[method.name], per_step = run_steps(method, states[method.name], steps[method.name])
            times[method.name].append(per_step)
    return times


def print_table(methods: list[Method], times: dict[str, list[float]], first_call: dict[str, float], b: int) -> None:
    print("| method | by | examples/s | ms/step (median) | ms/step (min) | first call (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for method in methods:
        t = statistics.median(times[method.name])
        print(
            f"| {method.name} | {method.by} | {b / t:,.0f} | {1e3 * t:.2f} | {1e3 * min(times[method.name]):.2f} "
            f"| {first_call[method.name]:.2f} |"
        )


def check_line(worst: list[float], args: argparse.Namespace) -> str:
    return (
        f"one-step check vs full batch passed: max |params diff| = {worst[0]:.1e} (atol {args.atol:g}), "
        f"max |Adam first-moment diff| = {worst[1]:.1e} (atol {args.grad_atol:g})\n"
    )


def summarize(workload: str, methods: list[Method], medians: dict[str, float], picked: str) -> Summary:
    ours_best = min((x for x in methods if x.by == "autoaccum"), key=lambda x: medians[x.name])
    theirs_best = min((x for x in methods if x.by == "hand-written"), key=lambda x: medians[x.name])
    return Summary(
        workload,
        picked,
        medians[DEFAULT],
        (ours_best.name, medians[ours_best.name]),
        (theirs_best.name, medians[theirs_best.name]),
    )


def picked_by_default(w: Any, m: int) -> str:
    """The strategy ``build_update``'s default runs for this workload here."""
    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=m)
    return str(update.accumulation.choose(w.params, w.batch).name)


def your_step_line(workload: str, times: dict[str, list[float]], picked: str, goal: float) -> str:
    """``value_and_grad`` in the user's step against ``build_update``'s ``scan`` at its default unroll (the same
    accumulation): the median over rounds of their per-round time ratio (the two ran side by side in each round),
    with its quartiles. Where the default also runs that program, its ratio to the scan row (the same program
    read twice) gives this run's noise."""
    scan = f"scan unroll={strategies.get('scan').options['unroll'][0]}"
    yours = next(name for name in times if name.startswith("value_and_grad"))

    def ratios(name: str) -> str:
        r = [a / b for a, b in zip(times[name], times[scan], strict=True)]
        q = statistics.quantiles(r, n=4)
        return f"{statistics.median(r):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})"

    ratio = statistics.median(a / b for a, b in zip(times[yours], times[scan], strict=True))
    verdict = "met" if ratio <= 1 + goal else "NOT met"
    line = (
        f"{workload}: value_and_grad in your step / build_update {scan} (time, per round, {len(times[scan])} rounds) "
        f"= {ratios(yours)}, goal <= {1 + goal:g}: {verdict}"
    )
    if picked == "scan" and scan.endswith("=1"):
        line += f"; noise: the default / {scan} (the same program) = {ratios(DEFAULT)}"
    return line


def time_your_step(
    workload: str, methods: list[Method], states: dict[str, State], picked: str, args: argparse.Namespace
) -> None:
    """``--pair-rounds`` rounds of ``value_and_grad`` in the user's step, ``build_update``'s scan and the default
    alone (shuffled each round, as `time_rounds`), then `your_step_line`."""
    scan = f"scan unroll={strategies.get('scan').options['unroll'][0]}"
    pair = [x for x in methods if x.name in (DEFAULT, scan) or x.by == YOUR_STEP]
    times = time_rounds(pair, states, argparse.Namespace(**{**vars(args), "rounds": args.pair_rounds}))
    print(your_step_line(workload, times, picked, args.your_step_goal))


def print_summary(rows: list[Summary], args: argparse.Namespace) -> None:
    print(
        "| workload | default runs | default / their best (time) | our best | their best | our best / their best "
        "(throughput) |"
    )
    print("|---|---|---:|---|---|---:|")
    for r in rows:
        print(
            f"| {r.workload} | {r.picked} | {r.default / r.theirs[1]:.3f} | {r.ours[0]} | {r.theirs[0]} | "
            f"{r.theirs[1] / r.ours[1]:.3f} |"
        )
    worst_default = max(r.default / r.theirs[1] for r in rows)
    worst_best = min(r.theirs[1] / r.ours[1] for r in rows)
    print(
        f"\ndefault within {args.default_goal:g}x of the fastest hand-written on every workload: "
        f"{'met' if worst_default <= args.default_goal else 'NOT met'} (worst {worst_default:.3f}x); "
        f"our best >= {args.goal:g} of theirs on every workload: {'met' if worst_best >= args.goal else 'NOT met'} "
        f"(worst {worst_best:.3f})"
    )


def workload_table(args: argparse.Namespace, name: str) -> int | Summary:
    """Full batch, our strategies and the baselines on the built-in image workload ``name`` (same B and m)."""
    b, m = args.batch, args.microbatch
    w = workloads.BUILTIN[name](batch_size=b)
    microbatches = [jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], w.batch) for i in range(b // m)]
    methods = [
        full_batch(w.loss_fn, w.optimizer, w.batch),
        *our_methods(w.loss_fn, w.optimizer, w.batch, m, args.unroll),
        manual(w.loss_fn, w.optimizer, microbatches),
        multisteps(w.loss_fn, w.optimizer, microbatches),
        microbatch(w.loss_fn, w.optimizer, w.batch, m),
        in_your_step(w.loss_fn, w.optimizer, w.batch, m),
    ]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(w.params))
    print(
        f"\n{name} table: workloads.{name}, {n_params:,} params, 28x28x1 images, the workload's optimizer "
        f"(Adam 1e-3); B={b}, m={m} (k={b // m}), {args.rounds} rounds x {args.steps} steps or {args.round_ms:g} ms\n"
    )
    states, first_call, failed, worst = check_and_warm(methods, w.params, args)
    if failed:
        print(f"{name} one-step check FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(check_line(worst, args))
    times = time_rounds(methods, states, args)
    print_table(methods, times, first_call, b)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    full = medians[methods[0].name]
    row = summarize(name, methods, medians, picked_by_default(w, m))
    print(
        f"\n{name}: default ({row.picked}) {b / row.default:,.0f} ex/s; our best {row.ours[0]} "
        f"({b / row.ours[1]:,.0f} ex/s); their best {row.theirs[0]} ({b / row.theirs[1]:,.0f} ex/s); "
        f"full batch {b / full:,.0f} ex/s"
    )
    time_your_step(name, methods, states, row.picked, args)
    print()
    return row


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    b, m = args.batch, args.microbatch
    k = b // m
    w = workloads.transformer(batch_size=b, seq_len=args.seq_len, dim=args.dim, layers=args.layers)
    loss_fn, opt, batch = w.loss_fn, w.optimizer, w.batch
    microbatches = [jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], batch) for i in range(k)]
    jax.block_until_ready(microbatches)

    stateless = our_methods(loss_fn, opt, batch, m, args.unroll)
    # The stateful twin of each strategy at its default options (scan: unroll=1, the default strategy).
    default_unroll = strategies.get("scan").options["unroll"][0]
    pairs = [
        (
            next(x for x in stateless if x.name == name + (f" unroll={default_unroll}" if name == "scan" else "")),
            ours_stateful(loss_fn, opt, batch, m, name, **({"unroll": default_unroll} if name == "scan" else {})),
        )
        for name in strategies.available()
    ]
    methods = [full_batch(loss_fn, opt, batch), *stateless, *(s for _, s in pairs)]
    methods += [
        manual(loss_fn, opt, microbatches),
        multisteps(loss_fn, opt, microbatches),
        microbatch(loss_fn, opt, batch, m),
        in_your_step(loss_fn, opt, batch, m),
    ]

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(w.params))
    print(f"machine: {machine()}")
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} (empty: XLA:CPU defaults, YNNPACK on)")
    print(
        f"workload: transformer LM, {n_params:,} params, seq_len={args.seq_len}, dim={args.dim}, "
        f"layers={args.layers}, the workload's optimizer (AdamW 1e-3)"
    )
    print(
        f"batch B={b}, microbatch m={m} (k={k} microbatches), {args.rounds} rounds x {args.steps} steps or "
        f"{args.round_ms:g} ms\n"
    )

    states, first_call, failed, worst = check_and_warm(methods, w.params, args)
    if failed:
        print("one-step check FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(check_line(worst, args))

    times = time_rounds(methods, states, args)
    print_table(methods, times, first_call, b)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    best = {name: min(ts) for name, ts in times.items()}

    print()
    for plain, keyed in pairs:
        ratio_state = medians[keyed.name] / medians[plain.name]  # = stateless / stateful throughput
        floor_state = best[keyed.name] / best[plain.name]
        verdict_state = "met" if ratio_state - 1 <= args.state_goal else "NOT met"
        print(
            f"has_state overhead, {plain.name}: stateless / stateful throughput = {ratio_state:.3f} "
            f"(overhead {100 * (ratio_state - 1):+.1f}%, goal <= {100 * args.state_goal:g}%: {verdict_state}); "
            f"at the least-disturbed round {floor_state:.3f}"
        )

    rows = [summarize("transformer", methods, medians, picked_by_default(w, m))]
    time_your_step("transformer", methods, states, rows[0].picked, args)
    for name in args.also:
        row = workload_table(args, name)
        if not isinstance(row, Summary):
            return row
        rows.append(row)

    our_best = min((x for x in methods if x.by == "autoaccum"), key=lambda x: medians[x.name])
    their_best = min((x for x in methods if x.by == "hand-written"), key=lambda x: medians[x.name])
    ours_t, theirs_t = medians[our_best.name], medians[their_best.name]
    ratio = theirs_t / ours_t
    print(
        f"\ntransformer: our best: {our_best.name} ({b / ours_t:,.0f} ex/s); "
        f"their best: {their_best.name} ({b / theirs_t:,.0f} ex/s)"
    )
    verdict = "met" if ratio >= args.goal else "NOT met"
    floor = min(best[x.name] for x in methods if x.by == "hand-written") / min(
        best[x.name] for x in methods if x.by == "autoaccum"
    )
    print(f"ratio at the least-disturbed round (min ms/step, a noise floor) = {floor:.3f}")
    print(f"ratio our best / their best (median throughput) = {ratio:.3f} (goal >= {args.goal:g}: {verdict})")
    print("\nsummary (median per-step times):\n")
    print_summary(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
