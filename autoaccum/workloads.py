"""The built-in workloads: the classic examples of gradient-accumulation write-ups, small enough for a CPU.

Each function returns a `Workload` with synthetic data drawn from a fixed seed. On the command line,
``autoaccum tune --demo`` uses `transformer`, and any of them loads as ``autoaccum.workloads:NAME``.

Example:
  >>> from autoaccum import workloads
  >>> w = workloads.mlp(batch_size=8)
  >>> float(w.loss_fn(w.params, w.batch)) > 0
  True
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from autoaccum._knobs import Knobs
from autoaccum._workload import Workload


def _functional(model: nnx.Module, loss: Callable[[nnx.Module, Any], jax.Array]) -> tuple[Callable[..., Any], Any]:
    """``(loss_fn(params, batch), params)`` for a stateless nnx model: the pure-function view autoaccum works
    with. Only the ``nnx.Param`` leaves are differentiated; anything else the model holds (none here: no
    dropout, no batch statistics) is closed over."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return loss(nnx.merge(graphdef, params, rest), batch)

    return loss_fn, params


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class MLP(nnx.Module):
    """The optax gradient-accumulation tutorial's net: flatten, Dense 32, ReLU, Dense 32, ReLU, Dense 10."""

    def __init__(self, features: tuple[int, ...] = (32, 32, 10), *, in_features: int = 784, rngs: nnx.Rngs):
        sizes = (in_features, *features)
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)


def _image_classifier(model: nnx.Module, name: str, batch_size: int, seed: int) -> Workload:
    """``model`` on random 28x28x1 images with labels in 0..9, softmax cross-entropy, Adam(1e-3)."""
    kx, ky = jax.random.split(jax.random.key(seed))
    batch = {
        "image": jax.random.normal(kx, (batch_size, 28, 28, 1)),
        "label": jax.random.randint(ky, (batch_size,), 0, 10),
    }
    loss_fn, params = _functional(model, lambda model, b: _cross_entropy(model(b["image"]), b["label"]))
    return Workload(loss_fn, params, batch, optax.adam(1e-3), name=name)


def mlp(batch_size: int = 64, seed: int = 0) -> Workload:
    """An MLP [32, 32, 10] on 28x28x1 images with 10 classes, Adam(1e-3)."""
    return _image_classifier(MLP(rngs=nnx.Rngs(seed)), "mlp", batch_size, seed)


def linear(batch_size: int = 64, features: int = 512, seed: int = 0) -> Workload:
    """Linear regression on 512-d inputs (mean squared error), SGD(1e-2)."""
    kx, kw, kn = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (batch_size, features))
    y = x @ jax.random.normal(kw, (features,)) + 0.1 * jax.random.normal(kn, (batch_size,))
    params = {"w": jnp.zeros((features,)), "b": jnp.zeros(())}

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    return Workload(loss_fn, params, {"x": x, "y": y}, optax.sgd(1e-2), name="linear")


class CNN(nnx.Module):
    """A small convolutional classifier: two 3x3 conv + ReLU + 2x2 average pool blocks, then a dense head."""

    def __init__(self, *, channels: tuple[int, int] = (16, 32), classes: int = 10, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, channels[0], kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(channels[0], channels[1], kernel_size=(3, 3), rngs=rngs)
        self.head = nnx.Linear(7 * 7 * channels[1], classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        return self.head(x.reshape(x.shape[0], -1))


def cnn(batch_size: int = 64, seed: int = 0) -> Workload:
    """A small CNN on 28x28x1 images with 10 classes, Adam(1e-3)."""
    return _image_classifier(CNN(rngs=nnx.Rngs(seed)), "cnn", batch_size, seed)


class MnistCNN(nnx.Module):
    """flax's examples/mnist CNN: Conv 32 3x3, ReLU, 2x2 average pool, Conv 64 3x3, ReLU, 2x2 average pool,
    Dense 256, ReLU, Dense 10."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.dense1 = nnx.Linear(7 * 7 * 64, 256, rngs=rngs)
        self.dense2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.relu(self.dense1(x.reshape(x.shape[0], -1)))
        return self.dense2(x)


def mnist(batch_size: int = 64, seed: int = 0) -> Workload:
    """flax's MNIST CNN on 28x28x1 images with 10 classes, Adam(1e-3)."""
    return _image_classifier(MnistCNN(rngs=nnx.Rngs(seed)), "mnist", batch_size, seed)


class Block(nnx.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x)), causal."""

    def __init__(self, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class TransformerLM(nnx.Module):
    """A small decoder-only language model: token + position embeddings, pre-norm blocks, tied-free head.

    With ``scan_layers`` the blocks' weights are stacked (``nnx.vmap`` at construction) and the blocks run under
    ``nnx.scan``, the layout deep models use (MaxText, flax's scan-over-layers guide): one block compiled once,
    and each block can be rematerialised (``remat=`` a ``jax.checkpoint_policies`` name): the backward pass then
    recomputes the block from its input, which XLA cannot merge back into the forward pass inside the loop. (In
    a Python loop of blocks XLA:CPU undoes a block's remat: measured here, no lower peak.)
    """

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, max_len: int, *, scan_layers: bool = False, rngs: nnx.Rngs
    ):
        self.tokens = nnx.Embed(vocab, dim, rngs=rngs)
        self.positions = nnx.Embed(max_len, dim, rngs=rngs)
        if scan_layers:

            @nnx.split_rngs(splits=layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def stacked(rngs: nnx.Rngs) -> Block:
                return Block(dim, heads, rngs=rngs)

            self.blocks: Any = stacked(rngs)
        else:
            self.blocks = nnx.List([Block(dim, heads, rngs=rngs) for _ in range(layers)])
        self.scan_layers = scan_layers
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, remat: str | None = None) -> jax.Array:
        """Logits for ``tokens``; ``remat``: the ``jax.checkpoint_policies`` policy each block is rematerialised
        with (None: keep every activation)."""
        length = tokens.shape[1]
        x = self.tokens(tokens) + self.positions(jnp.arange(length))[None]
        mask = nnx.make_causal_mask(tokens)

        def block_step(x: jax.Array, block: Block) -> jax.Array:
            return block(x, mask)

        if remat is not None:
            block_step = nnx.remat(block_step, policy=getattr(jax.checkpoint_policies, remat))
        if self.scan_layers:
            x = nnx.scan(block_step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        else:
            for block in self.blocks:
                x = block_step(x, block)
        return self.head(self.norm(x))


BLOCK_REMAT: tuple[str | None, ...] = (None, "nothing_saveable", "dots_with_no_batch_dims_saveable")
"""The values of the ``block_remat`` knob the demo declares: off, then the policies measured to lower the scanned
transformer's peak most (per example, batch 128 of 32 tokens: 810 KiB off, 331 KiB nothing saved, 346 KiB with
dots without batch dimensions saved, 410 KiB with every dot saved; XLA:CPU's compile-only analysis)."""


def transformer(
    batch_size: int = 32,
    seq_len: int = 64,
    vocab: int = 256,
    dim: int = 64,
    heads: int = 4,
    layers: int = 2,
    seed: int = 0,
    *,
    scan_layers: bool = False,
    block_remat: tuple[str | None, ...] | None = None,
) -> Workload:
    """A small transformer language model with next-token cross-entropy, AdamW(1e-3).

    ``scan_layers``: the blocks run under ``nnx.scan`` (`TransformerLM`). ``block_remat``: the values of a
    ``block_remat`` knob (`autoaccum.Knobs`, a ``jax.checkpoint_policies`` name per value, None: off) that
    ``autoaccum tune`` searches; the workload's ``loss_fn`` is the first value's. Remat lowers the peak only with
    ``scan_layers`` (`TransformerLM`).

    Example:
      >>> w = transformer(batch_size=4, seq_len=8, scan_layers=True, block_remat=(None, "nothing_saveable"))
      >>> w.knobs.choices
      {'block_remat': (None, 'nothing_saveable')}
    """
    tokens = jax.random.randint(jax.random.key(seed), (batch_size, seq_len + 1), 0, vocab)
    make = functools.partial(TransformerLM, vocab, dim, heads, layers, seq_len, scan_layers=scan_layers)
    graphdef = nnx.split(nnx.eval_shape(lambda: make(rngs=nnx.Rngs(seed))), nnx.Param, ...)[0]
    # Initialised in one program: eagerly, each initializer compiles its own (3.9 s against 2.3 s for the demo).
    params, rest = jax.jit(lambda: nnx.split(make(rngs=nnx.Rngs(seed)), nnx.Param, ...)[1:])()
    make_loss = functools.partial(_lm_loss, graphdef, rest)
    knobs = None if block_remat is None else Knobs(make_loss, block_remat=block_remat)
    loss_fn = make_loss(None if knobs is None else knobs.default["block_remat"])
    return Workload(loss_fn, params, {"tokens": tokens}, optax.adamw(1e-3), name="transformer", knobs=knobs)


def _lm_loss(graphdef: Any, rest: Any, block_remat: str | None = None) -> Callable[..., jax.Array]:
    """The loss factory of `transformer`: ``loss_fn(params, batch)``, next-token cross-entropy, each block
    rematerialised with ``block_remat``. Module-level so that it pickles (the tuner ships it to its worker)."""

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["tokens"][:, :-1], remat=block_remat)
        return _cross_entropy(logits, batch["tokens"][:, 1:])

    return loss_fn


DEMO = {"cpu": (128, 32, "32MiB"), "gpu": (1024, 64, "512MiB")}
"""The demo's effective batch, sequence length and memory limit per platform. On the CPU a batch of 128
sequences of 32 tokens needs about 100 MiB in one step (XLA's estimate), so under 32 MiB the step must
accumulate: 32 examples fit at once (probed), and 57-60 with each block rematerialised (estimated; the
``block_remat`` knob, `BLOCK_REMAT`): fewer accumulation steps for a recomputed forward pass, the trade the tuner
times. A GPU needs room of its own inside the limit (cuBLAS workspaces, the compiler's autotuning: on an H100
nothing fits under 64 MiB), so there the demo is 1024 sequences of 64 tokens under 512 MiB."""


def demo() -> Workload:
    """The built-in demo (``--demo``): `transformer`, its blocks scanned, with an effective batch that does not fit
    in one step under the demo's memory limit (`DEMO`, by the default device's platform): the story the tool
    exists for. The probe finds what fits, the tuner picks microbatch, accumulation steps, strategy and knobs
    (the blocks' remat policy, `BLOCK_REMAT`, each value bounded by its own microbatch limit)."""
    platform = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"
    batch, seq_len, limit = DEMO[platform]
    workload = transformer(batch_size=batch, seq_len=seq_len, scan_layers=True, block_remat=BLOCK_REMAT)
    return dataclasses.replace(workload, name="demo transformer", memory_limit=limit)


def sized_transformer(
    name: str, *, vocab: int, dim: int, heads: int, layers: int, seq_len: int, batch_size: int
) -> Workload:
    """A transformer language model built from shapes only: parameters and batch are ``jax.ShapeDtypeStruct``
    (nothing is allocated), for planning models larger than this machine (`autoaccum plan`). AdamW(3e-4).

    Example:
      >>> w = sized_transformer("tiny", vocab=64, dim=32, heads=2, layers=1, seq_len=16, batch_size=4)
      >>> type(w.batch["tokens"]).__name__, w.batch_size
      ('ShapeDtypeStruct', 4)
    """
    model = nnx.eval_shape(lambda: TransformerLM(vocab, dim, heads, layers, seq_len, rngs=nnx.Rngs(0)))

    def loss(model: Any, batch: Any) -> jax.Array:
        logits = model(batch["tokens"][:, :-1])
        return _cross_entropy(logits, batch["tokens"][:, 1:])

    loss_fn, params = _functional(model, loss)
    tokens = jax.ShapeDtypeStruct((batch_size, seq_len + 1), jnp.int32)
    return Workload(loss_fn, params, {"tokens": tokens}, optax.adamw(3e-4), name=name)


def planning_demos(large: bool = False) -> tuple[Workload, ...]:
    """What ``autoaccum plan --demo`` plans: models people size, from shapes only, at an effective batch of 512
    sequences of 1024 tokens (about half a million tokens per update, GPT-2's).

    * ``gpt2-small``: GPT-2 small's shape (vocabulary 50257, width 768, 12 heads, 12 layers: 124M parameters
      with its own head, here untied: 163M);
    * with ``large`` (``plan --demo --large``), ``transformer-1b``: width 2048, 16 heads, 18 layers, the same
      vocabulary (about 1.1B parameters).
    """
    common = dict(vocab=50257, seq_len=1024, batch_size=512)
    small = sized_transformer("gpt2-small", dim=768, heads=12, layers=12, **common)
    if not large:
        return (small,)
    return small, sized_transformer("transformer-1b", dim=2048, heads=16, layers=18, **common)


BUILTIN: dict[str, Callable[..., Workload]] = {
    "mlp": mlp,
    "linear": linear,
    "cnn": cnn,
    "mnist": mnist,
    "transformer": transformer,
}
