"""Per-block rematerialisation as a knob of your own: a flax linen transformer LM whose blocks the loss factory
wraps in ``nn.remat`` with a ``jax.checkpoint`` policy, searched by `autoaccum.tune` beside the microbatch size
and the strategy.

The blocks run under ``nn.scan`` (one set of stacked weights, scanned over the layers): inside the scan, the
backward pass recomputes each block from its input instead of keeping its activations, which XLA cannot undo by
merging the recomputation back into the forward pass. The compile-only estimate shows how much larger a
microbatch each setting allows under one memory limit; the tuner gives each setting its own bound (the probe runs
once, for the default setting) and records the values it picked in the plan, whose ``build`` calls the factory
with them again. Run: ``python examples/remat_knobs.py``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import autoaccum

VOCAB, DIM, HEADS, LAYERS, LENGTH = 256, 64, 4, 4, 64


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP; ``(x, None) -> (x, None)``, the shape ``nn.scan`` takes."""

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.SelfAttention(num_heads=HEADS, deterministic=True)(nn.LayerNorm()(x), mask=mask)
        x = x + nn.Dense(DIM)(nn.gelu(nn.Dense(4 * DIM)(nn.LayerNorm()(x))))
        return x, None


class LM(nn.Module):
    """Token and position embeddings, ``LAYERS`` blocks scanned over stacked weights, a vocabulary head."""

    block_remat: str | None = None  # a jax.checkpoint_policies name, or None: keep every activation

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        position = self.param("position", nn.initializers.normal(0.02), (LENGTH, DIM))
        x = nn.Embed(VOCAB, DIM)(tokens) + position[None, : tokens.shape[1]]
        block: Any = Block
        if self.block_remat is not None:
            block = nn.remat(block, policy=getattr(jax.checkpoint_policies, self.block_remat), prevent_cse=False)
        scanned = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
        x, _ = scanned(name="blocks")(x, None)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def make_loss(block_remat: str | None = None) -> Any:
    """The loss factory: ``loss_fn(params, batch)`` for the model with its blocks rematerialised as asked."""
    model = LM(block_remat=block_remat)

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = model.apply({"params": params}, batch["tokens"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean()

    return loss_fn


def main() -> None:
    tokens = jax.random.randint(jax.random.key(0), (32, LENGTH + 1), 0, VOCAB)
    batch = {"tokens": tokens}
    params = LM().init(jax.random.key(1), tokens[:1, :-1])["params"]
    tx = optax.adamw(1e-3)
    knobs = autoaccum.Knobs(make_loss, block_remat=(None, "nothing_saveable", "dots_saveable"))

    # What each setting allows under one limit, from compiling alone (nothing runs):
    for value in knobs.choices["block_remat"]:
        est = autoaccum.estimate(
            knobs.loss_fn(block_remat=value), params, batch, optimizer=tx, memory_limit="96MiB", accumulation=False
        )
        print(f"block_remat={value!s:>16}: {est.per_example_bytes / 2**10:7.1f} KiB per example, "
              f"microbatch <= {est.max_microbatch} under 96 MiB")  # fmt: skip

    # The tuner searches the knob beside the microbatch and the strategy. Without microbatch_bound it probes the
    # default setting under memory_limit and bounds the others by their calibrated estimates (slower).
    result = autoaccum.tune(
        knobs, params, batch, optimizer=tx, microbatch_bound=16, strategies=["scan"], budget=3, storage=":memory:"
    )
    plan = result.plan
    print(f"tuned: microbatch {plan.microbatch_size} x {plan.accumulation_steps}, knobs {plan.knobs}")

    # The plan builds the loss from the factory with the values it records; its step equals the full-batch step
    # (checked with SGD, whose step is the gradient itself).
    sgd = optax.sgd(0.1)
    update = plan.build(knobs, sgd, donate=False)
    new, _, loss = update(params, sgd.init(params), batch)
    full_loss, grads = jax.jit(jax.value_and_grad(make_loss()))(params, batch)
    expected = optax.apply_updates(params, sgd.update(grads, sgd.init(params), params)[0])
    pairs = zip(jax.tree.leaves(new), jax.tree.leaves(expected), strict=True)
    gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
    print(f"loss {float(loss):.4f} (full batch {float(full_loss):.4f}); largest parameter difference {gap:.1e}")
    assert abs(float(loss) - float(full_loss)) < 1e-5 and gap < 1e-5


if __name__ == "__main__":
    main()
