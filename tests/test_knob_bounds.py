"""A knob's bound: another setting's compile-only estimate calibrated by the default setting's probe
(`ProbeResult.bound_for`), against references computed by hand on simulated devices, and on flax nnx's ScanMLP
(the ``nnx.scan``-over-stacked-blocks MLP of flax's transforms guide) with per-block ``nnx.remat`` as a knob."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from seams import nnx_tune

import autoaccum
from autoaccum import Knobs
from autoaccum._capacity import StepCost
from autoaccum._device import DeviceInfo
from autoaccum._estimate import Estimate, Point
from autoaccum._probe import BOUND_MARGIN, ProbeResult, Trial
from autoaccum._worker import Timing

MiB = 2**20
CAP = 256


# -- simulated devices -------------------------------------------------------------------------------------------


def affine_estimate(fixed: int, per_example: int, limit: int) -> Estimate:
    """An `Estimate` of ``fixed + per_example * m`` bytes (as if compiled at 1 and at `CAP`); nothing compiled."""
    points = tuple(Point(m, m, fixed + per_example * m, 0.0, 0.0) for m in (1, CAP))
    return Estimate(
        strategy="scan", options={}, memory_limit_bytes=limit, points=points, accumulation_bytes=None,
        per_batch_example_bytes=None, remainder_bytes_per_example=None, cost=StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
        microbatch_cap=CAP, platform="cpu", seconds=0.0,
    )  # fmt: skip


def simulated_probe(fixed: int, per_example: int, missed: int, limit: int) -> ProbeResult:
    """What the probe finds where a step really needs ``missed`` bytes more than its estimate (fewer when
    negative, as in a CPU child that reuses memory mapped before the cap): the exact boundary, its trial's peak."""
    fits = [m for m in range(1, CAP + 1) if fixed + per_example * m + missed <= limit]
    k = max(fits, default=0)
    trials = [Trial(k, True, 0.01, peak_bytes=fixed + per_example * k + missed)] if k else []
    if k < CAP:
        trials.append(Trial(k + 1, False, None))
    return ProbeResult(
        max_microbatch=k, trials=tuple(trials), device=DeviceInfo("cpu", "simulated", None, None, None),
        memory_limit_bytes=limit, limit_source="given", granularity=1, microbatch_cap=CAP, strategy="scan",
        options={}, state_bytes=0, estimate=affine_estimate(fixed, per_example, limit), isolate=False, seconds=0.0,
        message="",
    )  # fmt: skip


def reference_bound(fixed: int, per_example: int, missed: int, limit: int) -> int:
    """By hand: the largest size whose estimate plus what the probe saw it miss is within the limit; the cap where
    every size is, else that size at the first trial's margin, but at least the probed boundary where the setting
    needs no more bytes there than the probed one; 0 where none is."""
    fits = [m for m in range(1, CAP + 1) if fixed + per_example * m + missed <= limit]
    if not fits:
        return 0
    if max(fits) == CAP:
        return CAP
    probed = max(m for m in range(1, CAP + 1) if PROBED[0] + PROBED[1] * m + missed <= limit)
    lighter = fixed + per_example * probed <= PROBED[0] + PROBED[1] * probed
    return max(math.floor(max(fits) * BOUND_MARGIN), min(max(fits), probed) if lighter else 0)


PROBED = (10 * MiB, 8 * 1024)  # the default setting: fixed bytes, bytes per example
OTHERS = {"remat": (10 * MiB, 3 * 1024), "wider": (13 * MiB, 16 * 1024), "alike": PROBED}


@pytest.mark.parametrize("missed", [-4 * MiB, 0, MiB], ids=["estimate-over", "exact", "estimate-under"])
@pytest.mark.parametrize("other", sorted(OTHERS))
def test_a_bound_follows_the_limit_through_the_calibrated_estimate(other: str, missed: int) -> None:
    """Every limit at which the default fits: the bound is the reference's, shrinks with the limit, is the cap where
    every size is predicted to fit (not 90% of it) and 0 where none is; the tuner's `predicted_peak` agrees."""
    limits = [4 * MiB + i * MiB // 4 for i in range(113)]  # 4 to 32 MiB
    fixed, per_example = OTHERS[other]
    bounds = []
    for limit in limits:
        found = simulated_probe(*PROBED, missed, limit)
        if found.max_microbatch == 0:
            continue  # nothing measured to calibrate by (the tuner says nothing fits)
        bound = found.bound_for(affine_estimate(fixed, per_example, limit))
        assert bound == reference_bound(fixed, per_example, missed, limit), (limit, found.max_microbatch)
        if bound:
            assert found.predicted_peak(affine_estimate(fixed, per_example, limit), bound) <= limit
        bounds.append(bound)
    assert bounds == sorted(bounds) and len(bounds) >= 4
    assert bounds[-1] == CAP and 0 < min(b for b in bounds if b) < CAP
    if other == "wider":
        assert bounds[0] == 0


# -- flax nnx's ScanMLP ------------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, features: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(features, features, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.relu(self.linear(x))


class ScanMLP(nnx.Module):
    """Stacked blocks made with ``nnx.vmap``, applied with ``nnx.scan``; ``block_remat`` wraps each block in
    ``nnx.remat`` with that policy."""

    def __init__(self, features: int, layers: int, rngs: nnx.Rngs) -> None:
        @nnx.vmap(in_axes=0, out_axes=0)
        def create(key: jax.Array) -> Block:
            return Block(features, nnx.Rngs(key))

        self.blocks = create(jax.random.split(rngs.params(), layers))

    def __call__(self, x: jax.Array, block_remat: str | None = None) -> jax.Array:
        def block(x: jax.Array, b: Block) -> jax.Array:
            return b(x)

        if block_remat is not None:
            block = nnx.remat(block, policy=getattr(jax.checkpoint_policies, block_remat))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x: jax.Array, b: Block) -> jax.Array:
            return block(x, b)

        return forward(x, self.blocks)


def make_loss(block_remat: str | None = None) -> Any:
    def loss_fn(model: ScanMLP, batch: Any) -> jax.Array:
        return jnp.mean((model(batch["x"], block_remat) - batch["y"]) ** 2)

    return loss_fn


@pytest.mark.parametrize("limit", ["24MiB", "8MiB"])
def test_scan_mlp_remat_setting_is_bounded_at_the_whole_batch_where_the_default_fits_it(
    limit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe finds the default's step runs the whole batch (256) under the limit; the per-block remat setting is
    estimated to need no more at any size, so its calibrated bound is 256 too (it was 230, 90% of the cap, at every
    limit), even at 8 MiB, where its uncalibrated estimate says nothing fits."""
    import autoaccum._tune.job as run  # where tune probes

    monkeypatch.setattr(run, "probe", functools.partial(autoaccum.probe, isolate=False))  # quicker here
    model = ScanMLP(128, 8, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    batch = {"x": jnp.ones((CAP, 128)), "y": jnp.ones((CAP, 128))}

    def measure(update: Any, params: Any, batch: Any, state: Any = None) -> Timing:
        return Timing(0.01 * update.accumulation_steps(CAP), 0.1, 3)

    result = nnx_tune(
        Knobs(make_loss, block_remat=(None, "nothing_saveable")), model, optimizer, batch, memory_limit=limit,
        remat=(None,), strategies=["scan"], budget=2, storage=":memory:", measure=measure, race_rounds=0,
    )  # fmt: skip
    found = result.probe
    assert found is not None and found.max_microbatch == CAP and found.estimate is not None
    remat = autoaccum.nnx.estimate(
        make_loss("nothing_saveable"), model, optimizer, batch, strategy="scan", memory_limit=found.memory_limit_bytes,
        microbatch_cap=CAP, accumulation=False,
    )  # fmt: skip
    assert all(remat.bytes_at(m) <= found.estimate.bytes_at(m) for m in (1, 16, 64, CAP))
    assert result.bounds["remat=None, block_remat=None"] == CAP
    assert result.bounds["remat=None, block_remat='nothing_saveable'"] == CAP


@pytest.mark.parametrize("block_remat", ["nothing_saveable", "dots_saveable"])
def test_another_setting_takes_the_accumulation_terms_and_compiles_fewer_steps(block_remat: str) -> None:
    """A knob's other setting (the ScanMLP with per-block remat) estimated with ``accumulation_from`` the default
    setting's estimate compiles two accumulating steps fewer and predicts the accumulating peaks of its own full
    estimate (reference: that estimate, its accumulating steps compiled) at every size, even and uneven."""
    model = ScanMLP(128, 8, nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(policy: str | None) -> Any:
        def loss_fn(params: Any, batch: Any) -> jax.Array:
            return make_loss(policy)(nnx.merge(graphdef, params, rest), batch)

        return loss_fn

    batch = {"x": jnp.ones((CAP, 128)), "y": jnp.ones((CAP, 128))}
    kw: dict[str, Any] = dict(optimizer=optax.adam(1e-3), strategy="scan", memory_limit="16MiB", microbatch_cap=CAP,
                              effective_batch=CAP)  # fmt: skip
    default = autoaccum.estimate(loss_of(None), params, batch, **kw)
    own = autoaccum.estimate(loss_of(block_remat), params, batch, **kw)
    taken = autoaccum.estimate(loss_of(block_remat), params, batch, accumulation_from=default, **kw)
    assert len(taken.points) == len(own.points) - 2
    for m in (8, 16, 48, 100, 128):
        assert taken.bytes_at(m, CAP) == pytest.approx(own.bytes_at(m, CAP), rel=0.02), m
