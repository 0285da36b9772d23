"""The common interface every accumulation strategy implements, and the pieces they share.

A strategy turns a `Spec` (the user's loss, optimizer and microbatch size) into an update step
``(params, opt_state, batch, state) -> (params, opt_state, loss, state)`` whose result equals one optimizer
step on the gradient of the whole batch. Every strategy computes the same thing, in the same order:

* the batch of ``B`` examples is cut into ``k = B // m`` microbatches of ``m`` examples, then one of
  ``r = B % m`` examples if ``r > 0``;
* microbatch ``i`` runs ``loss_fn`` on the model state that microbatch ``i - 1`` returned (the caller's state
  for the first) and contributes unnormalised sums to an `Accum` held in ``accumulator_dtype``: with
  ``loss_reduction="mean"``, ``n_i`` times its mean loss's gradient, loss and aux, and the weight ``n_i``; with
  ``"sum"``, the gradient of its ``loss_sum``, ``loss_sum``, ``weight_i`` times its aux, and ``weight_i``;
* the sums are divided once, by the total weight (``B`` for ``"mean"``: every example weighs ``1 / B``, uneven
  splits included; for ``"sum"``, e.g. the number of real tokens: every token weighs ``1 / W``), the gradient
  is cast back like the parameters and the optimizer runs once. The state is never differentiated.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from autoaccum.strategies import _state
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._remat import check_remat, rematerialised

PyTree = Any
LossFn = Callable[..., Any]
LossReduction = Literal["mean", "sum"]
LOSS_REDUCTIONS: tuple[str, ...] = ("mean", "sum")
Schedule = Literal["once", "per_microbatch"]
SCHEDULES: tuple[str, ...] = ("once", "per_microbatch")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What every strategy is built from.

    Attributes:
      loss_fn: ``loss_fn(params, batch) -> loss``, ``loss_fn(params, batch, state) -> (loss, state)`` when
        ``has_state``; ``loss`` is ``(loss, aux)`` when ``has_aux``, and in it the scalar is the mean over the
        batch's examples (``loss_reduction="mean"``) or the pair ``(loss_sum, weight)`` (``"sum"``).
      optimizer: the optax optimizer; it advances once per update call.
      microbatch_size: examples per microbatch (the last one may be smaller).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      accumulator_dtype: dtype in which gradients are accumulated (the loss, aux and weights: `sums_dtype`).
      donate: whether the update donates ``params``, ``opt_state`` and ``state`` (the caller must not reuse
        them).
      has_state: whether ``loss_fn`` takes and returns a model state, threaded through the microbatches.
      loss_reduction: ``"mean"`` or ``"sum"`` (see ``loss_fn``).
      gather_params: with parameters sharded over the batch's mesh axes (FSDP), gather them ``"once"`` per
        update (a full copy on each device) or ``"per_microbatch"`` (less memory, more communication).
      reduce_grads: on a mesh, reduce the gradient sums across devices ``"once"`` per update (a full-size
        gradient sum on each device) or ``"per_microbatch"`` (sharded sums with FSDP, more communication).
      remat: the ``jax.checkpoint`` policy applied to each microbatch's loss, by name (`REMAT_POLICIES`), or
        None (off).
      state_update: ``"per_microbatch"``: microbatch ``i`` sees the state microbatch ``i - 1`` returned; or
        ``"once"``: the state's floating leaves (BatchNorm's running statistics) move once per update, by the
        example-weighted mean of what the microbatches return from the update's incoming state, and the loss
        is then called with the strategies' state as a `MeanState` (see `autoaccum.strategies._state`).
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    microbatch_size: int
    has_aux: bool = False
    accumulator_dtype: Any = jnp.float32
    donate: bool = True
    has_state: bool = False
    loss_reduction: LossReduction = "mean"
    gather_params: Schedule = "once"
    reduce_grads: Schedule = "once"
    remat: str | None = None
    state_update: Schedule = "per_microbatch"

    @property
    def sums_dtype(self) -> Any:
        """The dtype of the loss, aux and weight sums: ``accumulator_dtype``, at least float32 (a few scalars: a
        bfloat16 sum would round the loss, and a token count above 256)."""
        return jnp.promote_types(self.accumulator_dtype, jnp.float32)

    def __post_init__(self) -> None:
        check_remat(self.remat)
        for name in ("gather_params", "reduce_grads"):
            if getattr(self, name) not in SCHEDULES:
                raise ValueError(
                    f"`{name}` must be 'once' or 'per_microbatch', got {name}={getattr(self, name)!r}; 'once' per "
                    "update uses more memory and less communication."
                )
        if self.state_update not in SCHEDULES:
            raise ValueError(
                f"`state_update` must be 'per_microbatch' or 'once', got state_update={self.state_update!r}; 'once' "
                "moves the state's floating leaves (BatchNorm's running statistics) once per update."
            )
        if self.state_update == "once" and not self.has_state:
            raise ValueError(
                "`state_update`='once' moves the model state once per update, but has_state=False; pass "
                "has_state=True with loss_fn(params, batch, state) -> (loss, state), or leave state_update out."
            )
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"`loss_reduction` must be 'mean' or 'sum', got loss_reduction={self.loss_reduction!r}; use 'sum' "
                "when loss_fn returns (loss_sum, weight), e.g. summed token losses and the number of real tokens."
            )


class Accum(NamedTuple):
    """Unnormalised weighted sums carried across microbatches, all in the accumulator dtype.

    Dividing ``grads``, ``loss`` and ``aux`` by ``weight`` (`apply_optimizer`, `finish_loss`) gives the
    full-batch values.
    """

    grads: PyTree
    loss: jax.Array
    aux: PyTree
    weight: jax.Array


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
    """Bytes the leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``) hold on one device: a leaf sharded
    over a mesh (``NamedSharding``) counts its shard."""

    def one(x: Any) -> int:
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if isinstance(sharding, jax.sharding.NamedSharding) else x.shape
        return int(np.prod(shape)) * x.dtype.itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def dtype_of(x: Any) -> Any:
    """The dtype of an array, a ``ShapeDtypeStruct`` or a Python scalar; extended dtypes (PRNG keys) as they are."""
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


def _is_nnx_object(value: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # not imported: not an nnx object
    return nnx is not None and isinstance(value, (nnx.Module, nnx.Optimizer))


def check_params(params: PyTree) -> None:
    """Raises ``TypeError`` where ``params`` has no arrays, or naming the first leaf ``jax.grad`` cannot differentiate.

    Integer counters, booleans and PRNG keys belong in the model state, which flows through the microbatches
    without being differentiated. A flax nnx module is pointed at `autoaccum.nnx`.
    """
    if _is_nnx_object(params):
        raise TypeError(
            f"`params` is an nnx.{type(params).__name__}; this function takes a pytree of arrays. For nnx models "
            "use autoaccum.nnx (build_update, probe, estimate, tune), which differentiate what nnx.Optimizer's "
            "`wrt` selects and thread the rest (RNG streams, BatchStat) as model state; for a saved plan, "
            "autoaccum.nnx.build_update(loss_fn, plan=autoaccum.Plan.load(path)), then step(model, optimizer, batch)."
        )
    if not jax.tree.leaves(params):
        shown = repr(params) if len(repr(params)) <= 60 else repr(params)[:60] + "..."
        raise TypeError(
            f"`params` has no arrays to differentiate (got {type(params).__name__}: {shown}); pass the parameters "
            "pytree, the one whose optimizer state update.init(params) made."
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        dtype = dtype_of(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            name = jax.tree_util.keystr(path) or "<root>"
            raise TypeError(
                f"`params` leaf {name} has dtype {dtype}, which cannot be differentiated (gradients are taken with "
                "respect to every leaf of `params`). Move it into `state`: build_update(..., has_state=True) with "
                "loss_fn(params, batch, state) -> (loss, state), or close over it in loss_fn if it is a constant."
            )


def check_distinct(**trees: PyTree) -> None:
    """Raises ``ValueError`` where one array is two leaves of the donated ``trees`` (tied weights): a call would
    donate its buffer twice."""
    seen: dict[int, str] = {}
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            where = f"`{name}` leaf {jax.tree_util.keystr(path) or '<root>'}"
            if isinstance(leaf, jax.Array) and seen.setdefault(id(leaf), where) != where:
                fixes = {"opt_state": "pass update.init(params)", "state": "copy one of them (jnp.copy)"}
                fix = fixes.get(name, "keep one leaf and use it twice in loss_fn")
                raise ValueError(
                    f"{where} is the same array as {seen[id(leaf)]} (tied weights?): the update donates its inputs "
                    f"and cannot donate one buffer twice; {fix}, or build with donate=False."
                )


def signature(*trees: PyTree) -> Any:
    """What an update call's host-side checks and choices depend on, hashable: the trees' structure and each
    leaf's shape, dtype and sharding (None for host arrays), read in one flatten.

    A strategy checks the arguments and decides its layout and microbatches once per signature, so a training
    loop's later calls pay one flatten before the jitted call (on the example mlp's 0.45 ms update, checking
    every call cost a fifth of the step).
    """
    leaves, treedef = jax.tree.flatten(trees)
    return treedef, tuple((np.shape(x), getattr(x, "dtype", type(x)), getattr(x, "sharding", None)) for x in leaves)


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


class LossOutputs(NamedTuple):
    """What `checked_loss` returns beside the differentiated scalar."""

    aux: PyTree
    weight: jax.Array
    state: PyTree


def _is_pair(out: Any) -> bool:
    return isinstance(out, tuple) and len(out) == 2


def _check_same_state(state: PyTree, new_state: PyTree) -> None:
    """The state ``loss_fn`` returns must look like the one it was given: it is the next microbatch's input."""
    fix = "return the new state with the same structure, shapes and dtypes as the state loss_fn receives"
    given: Any = jax.tree.structure(state)
    returned: Any = jax.tree.structure(new_state)
    if returned != given:
        raise TypeError(
            f"`loss_fn` returned a state of structure {returned} but was given {given}; {fix} (it is the next "
            "microbatch's input)."
        )
    for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(new_state), strict=True):
        if (np.shape(old), dtype_of(old)) != (np.shape(new), dtype_of(new)):
            raise TypeError(
                f"`loss_fn` returned state leaf {jax.tree_util.keystr(path) or '<root>'} with shape {np.shape(new)} "
                f"and dtype {dtype_of(new)}, but was given shape {np.shape(old)} and dtype {dtype_of(old)}; {fix}."
            )


def checked_loss(spec: Spec) -> Callable[[PyTree, PyTree, PyTree], tuple[jax.Array, LossOutputs]]:
    """Wraps ``spec.loss_fn`` as ``f(params, batch, state) -> (loss, LossOutputs(aux, weight, state))``.

    ``loss`` is the scalar to differentiate: the mean loss (``loss_reduction="mean"``, and ``weight`` is the
    number of examples ``n``) or ``loss_sum`` (``"sum"``, and ``weight`` is the one ``loss_fn`` returned).
    Without ``has_aux`` aux is ``()``; without ``has_state`` the state passes through unchanged; with
    ``state_update="once"`` the state is a `MeanState` (the loss sees `given` of it, and its result is folded in).
    The output is checked while it is traced, so mistakes are reported before anything compiles.
    """

    def wrapped(params: PyTree, batch: PyTree, state: PyTree) -> tuple[jax.Array, LossOutputs]:
        once = spec.has_state and spec.state_update == "once"
        state_in = _state.given(state) if once else state
        out, new_state = _call_loss(spec, params, batch, state_in)
        value, aux = _split_aux(spec, out)
        loss, weight = _loss_and_weight(spec, value, batch)
        if spec.has_aux:
            _check_aux(spec, aux, params, batch, state_in)
        if once:
            new_state = _state.fold(state, new_state, leading_size(batch))
        return loss, LossOutputs(aux, weight, new_state)

    return wrapped


def _call_loss(spec: Spec, params: PyTree, batch: PyTree, state: PyTree) -> tuple[Any, PyTree]:
    """``loss_fn``'s output (without the state) and the state it returned (``state`` without ``has_state``)."""
    if not spec.has_state:
        return spec.loss_fn(params, batch), state
    out = spec.loss_fn(params, batch, state)
    if not _is_pair(out):
        value_name = "(loss_sum, weight)" if spec.loss_reduction == "sum" else "loss"
        raise TypeError(
            f"has_state=True but `loss_fn` returned {_described(out)}, not a ({value_name}, state) pair; "
            f"return the new state after the {'(loss, aux)' if spec.has_aux else value_name}, or pass "
            "has_state=False."
        )
    out, new_state = out
    _check_same_state(state, new_state)
    return out, new_state


_SUM_FIX = (
    "if it returns (loss_sum, weight), e.g. the summed token losses and the number of real tokens, pass "
    'loss_reduction="sum" (has_aux=True would train on the sum and report the weight as aux)'
)


def _described(value: Any) -> str:
    """``value`` for an error message: an array by its shape and dtype (a tracer's type name says nothing)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    return type(value).__name__


def _split_aux(spec: Spec, out: Any) -> tuple[Any, PyTree]:
    """``(value, aux)`` of ``loss_fn``'s output (aux ``()`` without ``has_aux``), its shape checked."""
    is_sum = spec.loss_reduction == "sum"
    value_name = "(loss_sum, weight)" if is_sum else "loss"
    if spec.has_aux and not _is_pair(out):
        raise TypeError(
            f"has_aux=True but `loss_fn` returned {_described(out)}, not a ({value_name}, aux) pair; "
            "return (loss, aux) or pass has_aux=False."
        )
    if not spec.has_aux and not is_sum and isinstance(out, tuple):
        raise TypeError(
            f"`loss_fn` returned a tuple of {len(out)} but has_aux=False and loss_reduction='mean'; {_SUM_FIX}; "
            "if it returns (loss, aux), pass has_aux=True; otherwise return only the scalar mean loss."
        )
    if not spec.has_aux and is_sum and _is_pair(out) and _is_pair(out[0]):
        raise TypeError(
            "`loss_fn` returned ((loss_sum, weight), aux) but has_aux=False; pass has_aux=True, or return only the "
            "pair (loss_sum, weight)."
        )
    value, aux = out if spec.has_aux else (out, ())
    if not is_sum and isinstance(value, tuple):
        raise TypeError(
            f"`loss_fn` returned a tuple of {len(value)} where the scalar mean loss belongs "
            f"(loss_reduction='mean'); {_SUM_FIX}."
        )
    return value, aux


def _loss_and_weight(spec: Spec, value: Any, batch: PyTree) -> tuple[jax.Array, jax.Array]:
    """The scalar to differentiate and its weight (``(loss_sum, weight)``, or the mean and the examples)."""
    is_sum = spec.loss_reduction == "sum"
    if is_sum:
        if not _is_pair(value):
            raise TypeError(
                f"loss_reduction='sum' but `loss_fn` returned {_described(value)} where the pair "
                "(loss_sum, weight) belongs; return e.g. (jnp.sum(token_losses * mask), jnp.sum(mask)), or "
                "pass loss_reduction='mean' for a mean loss."
            )
        loss, weight = value
        fix = "(e.g. the number of real tokens, jnp.sum(mask))"
        if not (
            isinstance(weight, (jax.Array, np.ndarray, np.generic, int, float)) or hasattr(weight, "__jax_array__")
        ):
            raise TypeError(f"loss_reduction='sum': the weight `loss_fn` returns must be a real scalar {fix}, got "
                            f"{type(weight).__name__}.")  # fmt: skip
        weight = jnp.asarray(weight)
        if weight.shape != () or not (
            jnp.issubdtype(weight.dtype, jnp.floating) or jnp.issubdtype(weight.dtype, jnp.integer)
        ):
            raise TypeError(
                f"loss_reduction='sum': the weight `loss_fn` returns must be a real scalar {fix}, got shape "
                f"{weight.shape} and dtype {weight.dtype}."
            )
    else:
        loss, weight = value, jnp.asarray(leading_size(batch), spec.sums_dtype)
    loss = jnp.asarray(loss)
    what = "the summed loss over the batch's examples" if is_sum else "the mean loss over the batch's examples"
    if loss.shape != ():
        raise ValueError(
            f"`loss_fn` must return a scalar ({what}) but returned shape {loss.shape} on a microbatch of "
            f"{leading_size(batch)} example(s); reduce it, e.g. with "
            f"`{'.sum()' if is_sum else '.mean()'}`."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"`loss_fn` must return a floating-point loss but returned dtype {loss.dtype}.")
    return loss, weight


def _check_aux(spec: Spec, aux: PyTree, params: PyTree, batch: PyTree, state: PyTree) -> None:
    """Refuses an aux leaf with the microbatch's example axis (per-example logits, say).

    Aux is averaged over the microbatches, weighted like the loss, so every microbatch's aux must have the same
    shapes. Where a leaf is not a scalar, the aux is traced again (abstractly) at twice as many examples: a leaf
    whose shape follows is refused (rows, or one value per pair of examples); one whose shape does not (a per-class
    vector that happens to be as long) is kept.
    """
    n = leading_size(batch)
    suspects = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(aux) if np.ndim(leaf) >= 1]
    if not suspects:
        return

    def aux_only(params: PyTree, batch: PyTree, state: PyTree) -> PyTree:
        out = spec.loss_fn(params, batch, state)[0] if spec.has_state else spec.loss_fn(params, batch)
        return out[1]

    def abstract(x: Any, size: int | None = None) -> jax.ShapeDtypeStruct:
        shape = np.shape(x) if size is None else (size, *np.shape(x)[1:])
        return jax.ShapeDtypeStruct(shape, dtype_of(x))

    doubled = jax.eval_shape(
        aux_only, jax.tree.map(abstract, params), jax.tree.map(lambda x: abstract(x, 2 * n), batch),
        jax.tree.map(abstract, state),
    )  # fmt: skip
    shapes = {path: np.shape(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(doubled)}
    for path, leaf in suspects:
        if shapes.get(path, np.shape(leaf)) != np.shape(leaf):
            name = jax.tree_util.keystr(path) or "<root>"
            raise ValueError(
                f"`loss_fn`'s aux leaf {name} changes shape with the number of examples (shape {np.shape(leaf)} for "
                f"{n} examples, {shapes[path]} for {2 * n}): aux is averaged over the microbatches, weighted like the "
                "loss, so each leaf must keep "
                "its shape whatever the number of examples (a scalar metric, a per-class count). Reduce it over "
                "the examples in loss_fn (e.g. jnp.mean(correct)), compute per-example outputs such as logits in a "
                "forward pass of their own, or accumulate inside a step of your own with autoaccum.value_and_grad, "
                "which returns per-example aux as the whole batch's rows (on one device)."
            )


def weighted_grad(spec: Spec, *, scale_grads: bool = True) -> Callable[[PyTree, PyTree, PyTree], tuple[Accum, PyTree]]:
    """``f(params, microbatch, state) -> (Accum, state)``: one microbatch's unnormalised sums and its new state.

    With ``loss_reduction="mean"`` the sums are ``n`` times the mean loss's gradient, loss and aux, with weight
    ``n`` (the microbatch's examples); with ``"sum"``, the gradient of ``loss_sum``, ``loss_sum``, ``weight``
    times aux, and ``weight``: the gradients in ``spec.accumulator_dtype``, the rest in ``spec.sums_dtype``.
    ``state`` is not differentiated. Without ``scale_grads`` the mean loss's gradient is left unscaled (the caller
    scales the sum of equal microbatches once). With ``spec.remat`` the loss runs under ``jax.checkpoint`` with
    that policy.
    """
    value_and_grad = jax.value_and_grad(rematerialised(checked_loss(spec), spec.remat), has_aux=True)
    acc_dtype, sums_dtype = spec.accumulator_dtype, spec.sums_dtype
    is_sum = spec.loss_reduction == "sum"

    def scale(tree: PyTree, factor: Any, dtype: Any = sums_dtype) -> PyTree:
        def one(x: Any) -> Any:
            d = jnp.promote_types(dtype, x.dtype) if jnp.iscomplexobj(x) else dtype  # (a complex gradient stays so)
            return jnp.asarray(x, d) * jnp.asarray(factor, d)

        return jax.tree.map(one, tree)

    def f(params: PyTree, microbatch: PyTree, state: PyTree) -> tuple[Accum, PyTree]:
        (loss, out), grads = value_and_grad(params, microbatch, state)
        weight = jnp.asarray(out.weight, sums_dtype)
        factor = 1.0 if is_sum else weight
        grads = scale(grads, factor if scale_grads else 1.0, acc_dtype)
        # a microbatch of weight 0 (all padding) adds no aux: its own (a ratio over its tokens, say) may be 0/0
        aux = jax.tree.map(lambda a: jnp.where(weight == 0, jnp.zeros_like(a), a), scale(out.aux, weight))
        return Accum(grads, scale(loss, factor), aux, weight), out.state

    return f


def add(a: Accum, b: Accum) -> Accum:
    return jax.tree.map(jnp.add, a, b)


GradFn = Callable[[PyTree, PyTree, PyTree], tuple[Accum, PyTree]]


def accumulate_in_scan(
    spec: Spec,
    params: PyTree,
    batch: PyTree,
    state: PyTree = (),
    *,
    unroll: int | bool = 1,
    grad_fn: GradFn | None = None,
    zeros: Callable[[Accum], Accum] | None = None,
) -> tuple[Accum, PyTree]:
    """The whole batch's `Accum` and the last state, all microbatches inside one traced program (``lax.scan``).

    The state is carried through the scan with the sums, so microbatch ``i`` sees the state of ``i - 1``.
    ``grad_fn`` (default `weighted_grad`) gives one microbatch's sums; ``zeros`` makes the sums the scan
    starts from out of their shapes (on a mesh, device-varying zeros: `OnMesh.zeros_local`).
    """
    total = leading_size(batch)
    m = spec.microbatch_size
    full, rest = split(total, m)
    # The scanned microbatches weigh m each: their mean-loss gradients are added as they are and multiplied by m
    # once after the loop. Scaling each one in the loop would cost a pass over every gradient per microbatch
    # (XLA adds a scatter's gradient, an embedding's, into the sums in place only when nothing scales it).
    raw = grad_fn is None and spec.loss_reduction == "mean"
    grad_fn = weighted_grad(spec) if grad_fn is None else grad_fn
    body_grad_fn = weighted_grad(spec, scale_grads=False) if raw else grad_fn
    if full <= 1 and rest == 0:  # one microbatch: the plain full-batch step
        return grad_fn(params, batch, state)
    acc: Accum | None = None
    if full:
        stacked = jax.tree.map(lambda x: x[: full * m].reshape(full, m, *x.shape[1:]), batch)

        def body(carry: tuple[Accum, PyTree], microbatch: PyTree) -> tuple[tuple[Accum, PyTree], None]:
            acc, state = carry
            new, state = body_grad_fn(params, microbatch, state)
            return (add(acc, new), state), None

        first = jax.tree.map(lambda x: x[0], stacked)
        shapes, state_shapes = jax.eval_shape(lambda p, b, s: body_grad_fn(p, b, s), params, first, state)
        # (inside jax.shard_map the carry starts varying over the mesh axes the microbatch's sums vary over)
        start = jax.tree.map(lambda z, s: to_varying(z, varying(s)), (zeros or zero_accum)(shapes), shapes)
        state = jax.tree.map(lambda x, s: to_varying(x, varying(s)), state, state_shapes)
        (scanned, state), _ = jax.lax.scan(body, (start, state), stacked, unroll=unroll)
        weight = jnp.asarray(m, spec.accumulator_dtype)
        acc = scanned._replace(grads=jax.tree.map(lambda g: g * weight, scanned.grads)) if raw else scanned
    if rest:
        last, state = grad_fn(params, jax.tree.map(lambda x: x[full * m :], batch), state)
        acc = last if acc is None else add(acc, last)
    assert acc is not None
    return acc, state


def varying(x: Any) -> frozenset[str]:
    """The manual mesh axes an array (or ``ShapeDtypeStruct``) varies over inside ``jax.shard_map``; else empty."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # (jax >= 0.10; before, the aval's ``vma``)
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def to_varying(x: Any, axes: frozenset[str]) -> Any:
    """``x`` made varying over ``axes`` (those it does not vary over already), as ``jax.lax.pcast`` does."""
    missing = tuple(sorted(axes - varying(x)))
    if not missing:
        return x
    pcast = getattr(jax.lax, "pcast", None)
    return pcast(x, missing, to="varying") if pcast is not None else jax.lax.pvary(x, missing)  # type: ignore[attr-defined]


def zero_accum(shapes: Accum) -> Accum:
    """Zero sums of ``shapes`` (one device)."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


class OutDtypes(NamedTuple):
    """What ``loss_fn`` returns: the loss's dtype, the aux leaves' dtypes and shapes, the aux structure.

    Hashable, so it can be a static argument of a jitted function.
    """

    loss: Any
    aux: tuple[Any, ...]
    aux_shapes: tuple[tuple[int, ...], ...] = ()
    aux_treedef: Any = None

    def zero_sums(self, dtype: Any) -> Accum:
        """Zero loss, aux and weight sums (no gradients) in ``dtype`` (`Spec.sums_dtype`), to accumulate from."""
        aux = [jnp.zeros(shape, dtype) for shape in self.aux_shapes]
        treedef = self.aux_treedef if self.aux_treedef is not None else jax.tree.structure(())
        loss, weight = jnp.zeros((), dtype), jnp.zeros((), dtype)  # two buffers: both donated
        return Accum((), loss, jax.tree.unflatten(treedef, aux), weight)


def output_dtypes(spec: Spec, params: PyTree, batch: PyTree, state: PyTree = (), rows: int | None = None) -> OutDtypes:
    """The dtypes of ``loss_fn``'s loss and aux on one microbatch of ``batch`` (``rows`` examples; default: as many
    as ``spec.microbatch_size`` where the batch has them).

    Traces ``loss_fn`` abstractly (``jax.eval_shape``); runs nothing.
    """
    microbatch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((rows or min(spec.microbatch_size, x.shape[0]), *x.shape[1:]), x.dtype), batch
    )
    params, state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)), (params, state))
    loss, out = jax.eval_shape(checked_loss(spec), params, microbatch, state)
    leaves, treedef = jax.tree.flatten(out.aux)
    return OutDtypes(loss.dtype, tuple(x.dtype for x in leaves), tuple(tuple(x.shape) for x in leaves), treedef)


def apply_optimizer(
    spec: Spec, params: PyTree, opt_state: PyTree, acc: Accum, dtypes: OutDtypes, layout: Layout | None = None
) -> tuple[PyTree, PyTree, Any]:
    """One optimizer step on the accumulated gradient; returns ``(params, opt_state, loss)``.

    The sums are divided by the total weight; the gradient is cast back like ``params``, the loss and floating
    aux leaves back to ``dtypes`` (`finish_loss`). On a mesh the new parameters keep ``layout``'s (an optimizer
    state laid out otherwise, ZeRO's sharded over the batch's axes, does not re-lay them).
    """
    updates, opt_state = spec.optimizer.update(mean_grads(params, acc), opt_state, params)
    params = optax.apply_updates(params, updates)
    return params if layout is None else layout.constrain(params), opt_state, finish_loss(spec, acc, dtypes)


def check_optimizer_step(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree) -> None:
    """Traces (abstractly) the one ``optimizer.update(grads, opt_state, params)`` an update makes; where that fails,
    raises a TypeError naming the argument at fault: an optimizer that needs more arguments (a line search's loss),
    or an ``opt_state`` that is not this optimizer's state of these parameters."""
    try:
        jax.eval_shape(lambda p, s: optimizer.update(p, s, p), params, opt_state)
    except Exception as e:
        first = (str(e).strip() or type(e).__name__).splitlines()[0][:300]
        if "required keyword-only argument" in first:
            raise TypeError(
                f"`optimizer`.update needs arguments besides (grads, opt_state, params) ({first}): an update calls it "
                "once with the accumulated gradient alone, so an optimizer that needs the loss too (optax.lbfgs's "
                "line search, reduce_on_plateau's value) is not supported; use one that takes the gradient alone, "
                "e.g. optax.adamw(1e-3)."
            ) from e
        whole = " ".join(str(e).split())[:600]
        if not _is_state_of(optimizer, params, opt_state):
            raise TypeError(
                f"optimizer.update(grads, opt_state, params) fails on these arguments ({type(e).__name__}: {whole}); "
                "`opt_state` must be the optimizer's state of these parameters: pass update.init(params)."
            ) from e
        raise TypeError(
            f"`optimizer`.update fails on a gradient shaped like the whole `params` ({type(e).__name__}: {whole}), "
            "though `opt_state` is its state of these parameters: an update gives it the gradient of every leaf of "
            "params, so an optimizer that wants another tree (optax.lookahead: the gradient of params.fast alone) is "
            "not supported here; in your own step, differentiate what it wants with autoaccum.value_and_grad."
        ) from e


def _is_state_of(optimizer: optax.GradientTransformation, params: PyTree, opt_state: PyTree) -> bool:
    """Whether ``opt_state`` has the structure, shapes and dtypes of ``optimizer.init(params)`` (False where init
    fails)."""
    try:
        expected, given = jax.eval_shape(optimizer.init, params), jax.eval_shape(lambda s: s, opt_state)
    except Exception:
        return False
    shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), tree) for tree in (expected, given)]
    return shapes[0] == shapes[1]


def mean_grads(params: PyTree, acc: Accum) -> PyTree:
    """The whole batch's gradient: the accumulated sums divided by the total weight, cast back like ``params``."""
    # A multiply by one scalar reciprocal, not a divide per element: XLA fuses a cheap multiply into each of the
    # optimizer's fusions that read the gradient; a divide it keeps as a pass of its own over every gradient. The
    # reciprocal in float32 at least (a bfloat16 one would round the scale itself by up to 0.4%).
    scale = 1 / acc.weight.astype(jnp.promote_types(acc.weight.dtype, jnp.float32))
    return optax.tree.cast_like(jax.tree.map(lambda g: g * scale, acc.grads), params)


def finish_loss(spec: Spec, acc: Accum, dtypes: OutDtypes) -> Any:
    """The accumulated loss, or ``(loss, aux)``, divided by the total weight and cast back to ``dtypes``."""
    loss = (acc.loss / acc.weight).astype(dtypes.loss)
    if not spec.has_aux:
        return loss
    leaves, treedef = jax.tree.flatten(acc.aux)
    aux = [
        (x / acc.weight).astype(d) if jnp.issubdtype(d, jnp.floating) else x / acc.weight
        for x, d in zip(leaves, dtypes.aux, strict=True)
    ]
    return loss, jax.tree.unflatten(treedef, aux)
