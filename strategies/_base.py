"""The common interface every accumulation strategy implements, and the pieces they share.

A strategy turns a `Spec` (the user's loss, optimizer and microbatch size) into an update step
``(params, opt_state, batch) -> (params, opt_state, loss)`` whose result equals one optimizer step on the
gradient of the whole batch. Every strategy computes the same thing, in the same order of summation:

* the batch of ``B`` examples is cut into ``k = B // m`` microbatches of ``m`` examples, then one of
  ``r = B % m`` examples if ``r > 0``;
* microbatch ``i`` of ``n_i`` examples contributes ``(n_i / B) * grad(mean loss over it)`` to an accumulator
  held in ``accumulator_dtype``; every example therefore weighs ``1 / B``, uneven splits included;
* the accumulated gradient is cast back like the parameters and the optimizer runs once.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
LossFn = Callable[[PyTree, PyTree], Any]


@dataclasses.dataclass(frozen=True)
class Spec:
    """What every strategy is built from.

    Attributes:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (the mean over the batch's examples), or
        ``-> (scalar, aux)`` when ``has_aux``.
      optimizer: the optax optimizer; it advances once per update call.
      microbatch_size: examples per microbatch (the last one may be smaller).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      accumulator_dtype: dtype in which gradients, loss and aux are accumulated.
      donate: whether the update donates ``params`` and ``opt_state`` (the caller must not reuse them).
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    microbatch_size: int
    has_aux: bool = False
    accumulator_dtype: Any = jnp.float32
    donate: bool = True


class Accum(NamedTuple):
    """Example-weighted sums carried across microbatches, all in the accumulator dtype."""

    grads: PyTree
    loss: jax.Array
    aux: PyTree


class Program(NamedTuple):
    """One compiled program that an update call runs, for compile-only memory analysis.

    Attributes:
      lowered: the program, lowered for the call's shapes (nothing executed).
      resident_bytes: bytes that stay on the device while it runs without being its arguments
        (e.g. the optimizer state while a host-loop strategy accumulates gradients).
    """

    lowered: jax.stages.Lowered
    resident_bytes: int


def tree_bytes(tree: PyTree) -> int:
    """Bytes held by the leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def split(batch_size: int, microbatch_size: int) -> tuple[int, int]:
    """``(full, remainder)``: ``full`` microbatches of ``microbatch_size``, then one of ``remainder``."""
    return divmod(batch_size, microbatch_size)


def take(batch: PyTree, start: Any, size: int) -> PyTree:
    """Rows ``[start, start + size)`` of every leaf; ``start`` may be traced."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis=0), batch)


def leading_size(batch: PyTree) -> int:
    """The leading (example) size shared by the leaves of ``batch``, checked.

    Raises:
      ValueError: the batch has no leaves, a leaf is a scalar, or the leaves disagree on the leading size.
    """
    leaves = jax.tree_util.tree_leaves_with_path(batch)
    if not leaves:
        raise ValueError(
            f"`batch` has no array leaves ({type(batch).__name__}: {batch!r}); pass a pytree of arrays "
            "that share a leading example axis, e.g. {'x': x, 'y': y}."
        )
    sizes: dict[int, list[str]] = {}
    for path, leaf in leaves:
        shape = np.shape(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        if len(shape) == 0:
            raise ValueError(
                f"`batch` leaf {name} is a scalar; every leaf needs a leading example axis "
                "(reshape it to (B, ...) or close over it in loss_fn)."
            )
        sizes.setdefault(int(shape[0]), []).append(name)
    if len(sizes) > 1:
        listing = "; ".join(f"size {s}: {', '.join(names)}" for s, names in sorted(sizes.items()))
        raise ValueError(
            f"`batch` leaves disagree on the leading (example) size ({listing}); every leaf must have the "
            "same number of examples along axis 0."
        )
    (size,) = sizes
    if size < 1:
        raise ValueError("`batch` has 0 examples along axis 0; pass at least one example.")
    return size


def checked_loss(loss_fn: LossFn, has_aux: bool) -> Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]:
    """Wraps ``loss_fn`` to always return ``(loss, aux)``, checking its output while it is traced."""

    def wrapped(params: PyTree, batch: PyTree) -> tuple[jax.Array, PyTree]:
        out = loss_fn(params, batch)
        is_pair = isinstance(out, tuple) and len(out) == 2
        if has_aux and not is_pair:
            raise TypeError(
                f"has_aux=True but `loss_fn` returned {type(out).__name__}, not a (loss, aux) pair; "
                "return (loss, aux) or pass has_aux=False."
            )
        if not has_aux and isinstance(out, tuple):
            raise TypeError(
                f"`loss_fn` returned a tuple of {len(out)} but has_aux=False; pass has_aux=True if it "
                "returns (loss, aux), or return only the scalar loss."
            )
        loss, aux = out if has_aux else (out, ())
        loss = jnp.asarray(loss)
        if loss.shape != ():
            raise ValueError(
                f"`loss_fn` must return a scalar (the mean loss over the batch's examples) but returned "
                f"shape {loss.shape}; reduce it, e.g. with `.mean()`."
            )
        if not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(f"`loss_fn` must return a floating-point loss but returned dtype {loss.dtype}.")
        return loss, aux

    return wrapped


def weighted_grad(spec: Spec) -> Callable[[PyTree, PyTree, Any], Accum]:
    """``f(params, microbatch, weight) -> Accum`` of ``weight`` times loss, aux and gradient.

    The products are formed in ``spec.accumulator_dtype``; ``weight`` is ``n_i / B``.
    """
    value_and_grad = jax.value_and_grad(checked_loss(spec.loss_fn, spec.has_aux), has_aux=True)
    acc_dtype = spec.accumulator_dtype

    def scale(tree: PyTree, weight: Any) -> PyTree:
        return jax.tree.map(lambda x: jnp.asarray(x, acc_dtype) * jnp.asarray(weight, acc_dtype), tree)

    def f(params: PyTree, microbatch: PyTree, weight: Any) -> Accum:
        (loss, aux), grads = value_and_grad(params, microbatch)
        return Accum(scale(grads, weight), scale(loss, weight), scale(aux, weight))

    return f


def add(a: Accum, b: Accum) -> Accum:
    return jax.tree.map(jnp.add, a, b)


def zeros_like_accum(spec: Spec, params: PyTree, microbatch: PyTree) -> Accum:
    """Zeros shaped like one microbatch's `Accum`, in the accumulator dtype (abstract trace; runs nothing)."""
    shapes = jax.eval_shape(weighted_grad(spec), params, microbatch, 1.0)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def accumulate_in_scan(spec: Spec, params: PyTree, batch: PyTree, *, unroll: int = 1) -> Accum:
    """The whole batch's `Accum`, all microbatches inside one traced program (``lax.scan``)."""
    total = leading_size(batch)
    m = spec.microbatch_size
    full, rest = split(total, m)
    grad_fn = weighted_grad(spec)
    if full <= 1 and rest == 0:  # one microbatch: the plain full-batch step
        return grad_fn(params, batch, 1.0)
    acc: Accum | None = None
    if full:
        stacked = jax.tree.map(lambda x: x[: full * m].reshape(full, m, *x.shape[1:]), batch)

        def body(carry: Accum, microbatch: PyTree) -> tuple[Accum, None]:
            return add(carry, grad_fn(params, microbatch, m / total)), None

        first = jax.tree.map(lambda x: x[0], stacked)
        acc, _ = jax.lax.scan(body, zeros_like_accum(spec, params, first), stacked, unroll=unroll)  # type: ignore[arg-type]
    if rest:
        last = grad_fn(params, jax.tree.map(lambda x: x[full * m :], batch), rest / total)
        acc = last if acc is None else add(acc, last)
    assert acc is not None
    return acc


class OutDtypes(NamedTuple):
    """What ``loss_fn`` returns: the loss's dtype, the aux leaves' dtypes and shapes, the aux structure.

    Hashable, so it can be a static argument of a jitted function.
    """

    loss: Any
    aux: tuple[Any, ...]
    aux_shapes: tuple[tuple[int, ...], ...] = ()
    aux_treedef: Any = None

    def zero_sums(self, accumulator_dtype: Any) -> Accum:
        """Zero loss and aux sums (no gradients) in ``accumulator_dtype``, to start accumulating from."""
        aux = [jnp.zeros(shape, accumulator_dtype) for shape in self.aux_shapes]
        treedef = self.aux_treedef if self.aux_treedef is not None else jax.tree.structure(())
        return Accum((), jnp.zeros((), accumulator_dtype), jax.tree.unflatten(treedef, aux))


def output_dtypes(spec: Spec, params: PyTree, batch: PyTree) -> OutDtypes:
    """The dtypes of ``loss_fn``'s loss and aux on one microbatch of ``batch``.

    Traces ``loss_fn`` abstractly (``jax.eval_shape``); runs nothing.
    """
    microbatch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((min(spec.microbatch_size, x.shape[0]), *x.shape[1:]), x.dtype), batch
    )
    loss, aux = jax.eval_shape(checked_loss(spec.loss_fn, spec.has_aux), params, microbatch)
    leaves, treedef = jax.tree.flatten(aux)
    return OutDtypes(
        np.dtype(loss.dtype),
        tuple(np.dtype(x.dtype) for x in leaves),
        tuple(tuple(x.shape) for x in leaves),
        treedef,
    )


def apply_optimizer(
    spec: Spec, params: PyTree, opt_state: PyTree, acc: Accum, dtypes: OutDtypes
) -> tuple[PyTree, PyTree, Any]:
    """One optimizer step on the accumulated gradient; returns ``(params, opt_state, loss)``.

    The gradient is cast back like ``params``; loss and floating aux leaves back to ``dtypes``.
    """
    grads = optax.tree.cast_like(acc.grads, params)
    updates, opt_state = spec.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, finish_loss(spec, acc, dtypes)


def finish_loss(spec: Spec, acc: Accum, dtypes: OutDtypes) -> Any:
    """The accumulated loss, or ``(loss, aux)``, cast back to the dtypes ``loss_fn`` returns."""
    loss = acc.loss.astype(dtypes.loss)
    if not spec.has_aux:
        return loss
    leaves, treedef = jax.tree.flatten(acc.aux)
    aux = [x.astype(d) if jnp.issubdtype(d, jnp.floating) else x for x, d in zip(leaves, dtypes.aux, strict=True)]
    return loss, jax.tree.unflatten(treedef, aux)


class Strategy(abc.ABC):
    """One way to accumulate gradients; subclasses are small and registered by `name`.

    Attributes:
      name: the registry key (``strategies.available()``).
      options: tunable options and the values worth trying, e.g. ``{"unroll": (1, 2)}``; the first value is
        the default.
    """

    name: ClassVar[str]
    options: ClassVar[Mapping[str, Sequence[Any]]] = {}

    def __init__(self, spec: Spec, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(f"`{k}`" for k in self.options) or "none"
            raise ValueError(f"strategy {self.name!r} has no option(s) {unknown}; its options: {known}.")
        self.spec = spec
        self.config = {k: options.get(k, v[0]) for k, v in self.options.items()}
        self._dtypes: dict[Any, OutDtypes] = {}

    def init(self, params: PyTree) -> PyTree:
        """The optimizer's own state (``optimizer.init(params)``): the same type for every strategy."""
        return self.spec.optimizer.init(params)

    @abc.abstractmethod
    def __call__(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> tuple[PyTree, PyTree, Any]:
        """One full-batch-equivalent update: ``(params, opt_state, loss)`` (loss is ``(loss, aux)`` with aux)."""

    @abc.abstractmethod
    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree) -> list[Program]:
        """The programs one call at these shapes runs, lowered (arguments may be ``ShapeDtypeStruct``)."""

    def donate_argnums(self, *argnums: int) -> tuple[int, ...]:
        return argnums if self.spec.donate else ()

    def out_dtypes(self, params: PyTree, batch: PyTree) -> OutDtypes:
        """`output_dtypes`, remembered per argument shapes so a host loop traces ``loss_fn`` once."""
        key = (
            jax.tree.structure((params, batch)),
            tuple((np.shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves((params, batch))),
        )
        if key not in self._dtypes:
            self._dtypes[key] = output_dtypes(self.spec, params, batch)
        return self._dtypes[key]

    def microbatches(self, batch: PyTree) -> list[tuple[int, int]]:
        """``(start, size)`` of each microbatch of ``batch``, in order."""
        m = self.spec.microbatch_size
        full, rest = split(leading_size(batch), m)
        return [(i * m, m) for i in range(full)] + ([(full * m, rest)] if rest else [])
