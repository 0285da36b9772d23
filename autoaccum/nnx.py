"""The flax nnx front door: gradient accumulation for an ``nnx.Module`` trained with ``nnx.Optimizer``.

Write the loss the nnx way, ``loss_fn(model, batch) -> loss``, and step the model and its optimizer in place::

    model = Net(rngs=nnx.Rngs(0, dropout=1))                        # with nnx.Dropout and nnx.BatchNorm
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = autoaccum.nnx.build_update(loss_fn, microbatch_size=16)  # loss_fn(model, batch) -> loss
    loss = step(model, optimizer, batch)                            # updates model and optimizer in place

Only what the optimizer's ``wrt`` selects is differentiated. Everything else the model holds (``nnx.BatchStat``
running statistics, the ``nnx.Rngs`` streams' keys and counters, any other ``nnx.Variable``) is model state:
it flows through the microbatches in order, as `autoaccum.build_update`'s ``has_state`` does, so each
microbatch of each update draws its own dropout mask and BatchNorm statistics advance once per microbatch,
as they would over the same examples fed one microbatch at a time; with ``state_update="once"`` the
``nnx.BatchStat`` statistics (every floating state) move once per update instead, by the mean of the
microbatches' statistics. The step equals one full-batch step for per-example losses; BatchNorm in training
mode normalises each microbatch by its own statistics, and a loss coupling the batch's examples is computed per
microbatch (see `autoaccum.build_update`). One program is compiled per shape; the second call does not retrace.
A tuned plan, saved and loaded, builds the same step: ``autoaccum.nnx.build_update(loss_fn, plan=plan)``.

`probe`, `estimate` and `tune` take the same ``(loss_fn, model, optimizer, batch)`` and answer for the model as
`autoaccum.probe`, `autoaccum.estimate` and `autoaccum.tune` do for a function of a parameters pytree (they
never change the model); `functional` gives that pure view, and `workload` makes an `autoaccum.Workload` of it
for the command line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from autoaccum._batch import as_arrays
from autoaccum._checks import check_loss_fn
from autoaccum._deprecated import moved_names
from autoaccum._estimate import estimate as _estimate
from autoaccum._knobs import Knobs, resolve
from autoaccum._plan import Plan
from autoaccum._probe import probe as _probe
from autoaccum._tune import run as _run
from autoaccum._update import Update as _Update
from autoaccum._update import build_update as _build_update
from autoaccum._value_and_grad import value_and_grad as _value_and_grad
from autoaccum._workload import Workload
from autoaccum.strategies import PyTree


def _check(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(f"`model` must be an nnx.Module, got {type(model).__name__}: {model!r}.")
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"`optimizer` must be an nnx.Optimizer(model, tx, wrt=...), got {type(optimizer).__name__}; for an optax "
            "optimizer and a parameters pytree use autoaccum.build_update instead."
        )


@dataclasses.dataclass(frozen=True)
class Functional:
    """The pure view of an nnx model and optimizer that autoaccum's functions work with.

    Attributes:
      loss_fn: ``loss_fn(params, batch, state) -> (loss, state)`` (``has_state=True`` form).
      params: what the optimizer's ``wrt`` selects, as plain arrays (an ``nnx.State``).
      state: everything else the model holds, as plain arrays (an ``nnx.State``).
      tx: the optax optimizer inside the ``nnx.Optimizer``.
      opt_state: its state, as plain arrays.
      graphdef: the model's structure.
    """

    loss_fn: Callable[..., Any]
    params: PyTree
    state: PyTree
    tx: Any
    opt_state: PyTree
    graphdef: Any


def _split(model: nnx.Module, wrt: Any, name: str) -> tuple[Any, Any, Any]:
    """``nnx.split(model, wrt, ...)``; a ValueError naming ``wrt`` (``name``) where it selects no variable."""
    graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]
    if not jax.tree.leaves(params):
        kinds = sorted({type(v).__name__ for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)})
        raise ValueError(
            f"{name}={wrt!r} selects no variable of the model, which holds {', '.join(kinds) or 'none'}: nothing to "
            "differentiate; pass a filter of its parameters, e.g. nnx.Param."
        )
    return graphdef, params, rest


def functional(loss_fn: Callable[..., Any], model: nnx.Module, optimizer: nnx.Optimizer) -> Functional:
    """The pure view of ``loss_fn(model, batch)`` over ``model`` and ``optimizer`` (nothing is changed).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> f = functional(lambda m, b: jnp.mean(m(b)), model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
      >>> sorted(f.params.keys())
      ['bias', 'kernel']
    """
    check_loss_fn(loss_fn)
    _check(model, optimizer)
    graphdef, params, rest = _split(model, optimizer.wrt, "the optimizer's `wrt`")
    return Functional(
        _pure_loss(loss_fn, graphdef, optimizer.wrt),
        as_arrays(params),
        as_arrays(rest),
        optimizer.tx,
        as_arrays(optimizer.opt_state),
        graphdef,
    )


def _pure_loss(loss_fn: Callable[..., Any], graphdef: Any, wrt: Any) -> Callable[..., tuple[Any, PyTree]]:
    """``loss_fn(model, batch)`` as ``f(params, batch, state) -> (loss, state)`` over the model's pure arrays."""

    def pure_loss(params: PyTree, batch: PyTree, state: PyTree) -> tuple[Any, PyTree]:
        local = nnx.merge(graphdef, params, state)
        out = loss_fn(local, batch)
        _, _, new_state = nnx.split(local, wrt, ...)  # type: ignore[misc]
        return out, as_arrays(new_state)

    return pure_loss


class ModelUpdate:
    """An accumulating step for an nnx model: ``loss = step(model, optimizer, batch)``, in place (the functional
    `autoaccum.Update` is its pure counterpart).

    The result equals one ``optimizer.update(model, grads)`` with the gradient of the whole batch (see
    `autoaccum.build_update` for the exact semantics, ``loss_reduction`` included); the model's other state
    (batch statistics, RNG counters) is threaded through the microbatches in order. ``optimizer.step`` advances
    by one per call. The strategy accumulates the gradient, then ``optimizer.update(model, grads)`` (nnx's own)
    applies it in a ``jax.jit`` program of its own. Programs are built per model structure and cached.
    """

    def __init__(self, loss_fn: Callable[..., Any], options: dict[str, Any], plan: Plan | None = None) -> None:
        self.loss_fn = loss_fn
        self.options = options
        self.plan = plan
        self._cache: dict[Any, tuple[_Update, list[Any], Any]] = {}

    def _prepare(self, model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Functional, _Update]:
        """The pure view and the update for ``model``; checks first that ``optimizer`` holds the state of what its
        ``wrt`` selects in ``model`` (nothing is donated before)."""
        f = functional(self.loss_fn, model, optimizer)
        # Keyed as nnx.jit's cache is (jax.jit's, by the treedef of the model's GraphDef): compared with ==, never
        # hashed itself, so a model holding a list attribute (an unhashable GraphDef) is accepted as nnx.jit does.
        key = (jax.tree.structure(f.graphdef), jax.tree.structure(f.params), id(f.tx))
        if key not in self._cache:
            if self.plan is not None:
                self.plan.check_params(f.params)
                self.plan.check_optimizer(f.tx, f.params, stacklevel=3)
            update = _build_update(f.loss_fn, _last_gradient(), has_state=True, **self.options)
            shapes = [x.shape for x in jax.tree.leaves(jax.eval_shape(f.tx.init, f.params))]
            self._cache[key] = update, shapes, f.tx  # (holding the transformation: its id is not given again)
        update, shapes, _ = self._cache[key]
        if [np.shape(x) for x in jax.tree.leaves(f.opt_state)] != shapes:
            raise ValueError(
                "`optimizer`'s state is not its optax optimizer's state of what its `wrt` selects in `model` (an "
                "nnx.Optimizer made for another model?); make it for this one: nnx.Optimizer(model, tx, wrt=...)."
            )
        return f, update

    def _apply(self, model: nnx.Module, optimizer: nnx.Optimizer, graphdef: Any, out: tuple[Any, ...]) -> Any:
        """The accumulated gradient applied by ``optimizer.update`` (nnx's own), with the model's new state."""
        params, grads, loss, state = out  # params: the arrays the accumulation was given (donated, so returned)
        _optimizer_update(model, optimizer, graphdef, (params, state), grads, donate=self.options["donate"])
        return loss

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """One update on ``batch``; returns the loss (``(loss, aux)`` with ``has_aux``)."""
        f, update = self._prepare(model, optimizer)
        return self._apply(model, optimizer, f.graphdef, update(f.params, update.init(f.params), batch, f.state))

    def stream(self, model: nnx.Module, optimizer: nnx.Optimizer, microbatches: Iterable[PyTree]) -> Any:
        """One update on microbatches that arrive one at a time (`autoaccum.Update.stream`); returns the loss."""
        f, update = self._prepare(model, optimizer)
        out = update.stream(f.params, update.init(f.params), microbatches, f.state)
        return self._apply(model, optimizer, f.graphdef, out)

    def compiled_for(self, model: nnx.Module, optimizer: nnx.Optimizer) -> _Update:
        """The functional `autoaccum.Update` this step accumulates with for ``model`` (its spec, its ``programs``).

        Its optimizer hands the whole batch's gradient back for ``optimizer.update``, which runs in a program of
        its own; `estimate`, `probe` and `tune` measure the step with the optimizer's own transformation."""
        return self._prepare(model, optimizer)[1]


def build_update(
    loss_fn: Callable[..., Any] | Knobs,
    *,
    microbatch_size: int | None = None,
    strategy: str = "auto",
    has_aux: bool = False,
    loss_reduction: str = "mean",
    accumulator_dtype: Any = jnp.float32,
    donate: bool = True,
    plan: Plan | None = None,
    **options: Any,
) -> ModelUpdate:
    """An accumulating step for nnx models: ``loss = step(model, optimizer, batch)`` updates both in place.

    The step equals one full-batch step for a loss of per-example terms; with BatchNorm in training mode, or a
    loss coupling the batch's examples, it does not (each microbatch is a batch of its own: see
    `autoaccum.build_update`). Pass ``state_update="once"`` to move the ``nnx.BatchStat`` running statistics once
    per update (by the mean of the microbatches' statistics) instead of once per microbatch.

    Args:
      loss_fn: ``loss_fn(model, batch) -> loss`` (the mean over the batch's examples); with ``has_aux``,
        ``-> (loss, aux)``; with ``loss_reduction="sum"``, ``loss`` is ``(loss_sum, weight)``. With a ``plan``
        tuned with knobs of the loss's own, the `autoaccum.Knobs` it was tuned with.
      microbatch_size, strategy, has_aux, loss_reduction, accumulator_dtype, donate, **options: as for
        `autoaccum.build_update` (``state_update`` and ``remat`` among the options). With ``donate`` the model's
        and optimizer's arrays are reused for the results (the model and optimizer are updated in place either
        way).
      plan: a tuned `autoaccum.Plan` (e.g. ``autoaccum.Plan.load("plan.json")``) in place of ``microbatch_size``,
        ``strategy``, ``has_aux``, ``loss_reduction``, ``accumulator_dtype``, ``remat`` and the strategy's
        options, which it sets (its knobs too); ``donate`` and ``state_update`` may be given beside it. The
        model's parameters are checked against the plan's at the first call.

    Raises:
      TypeError, ValueError: bad arguments, or a ``plan`` with arguments it sets.

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> step = autoaccum.nnx.build_update(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), microbatch_size=4)
      >>> loss = step(model, optimizer, {"x": jnp.ones((10, 3)), "y": jnp.zeros((10, 1))})
      >>> int(optimizer.step[...])
      1
      >>> plan = autoaccum.Plan(effective_batch=10, microbatch_size=5, accumulation_steps=2, strategy="loop")
      >>> step = autoaccum.nnx.build_update(lambda m, b: jnp.mean(m(b["x"]) ** 2), plan=plan)
      >>> step.options["microbatch_size"], step.options["strategy"]
      (5, 'loop')
    """
    if plan is not None:
        given = dict(
            microbatch_size=microbatch_size, strategy=strategy, has_aux=has_aux, loss_reduction=loss_reduction,
            accumulator_dtype=accumulator_dtype, **options,
        )  # fmt: skip
        loss_fn, options = _from_plan(loss_fn, plan, given)
    elif isinstance(loss_fn, Knobs):
        raise TypeError(
            "`loss_fn` is an autoaccum.Knobs: pass the plan tuned with it (plan=...), whose knob values make the "
            "loss, or a loss function made with chosen values, loss_fn=knobs.loss_fn(**values)."
        )
    elif microbatch_size is None:
        raise TypeError(
            "`microbatch_size` is required: pass microbatch_size=..., or a tuned plan, plan=autoaccum.Plan.load(path)."
        )
    else:
        options = dict(
            microbatch_size=microbatch_size, strategy=strategy, has_aux=has_aux, loss_reduction=loss_reduction,
            accumulator_dtype=accumulator_dtype, **options,
        )  # fmt: skip
    check_loss_fn(loss_fn, ("model", "batch"))
    options = dict(options, donate=donate)
    _build_update(lambda p, b, s: (0.0, s), _NoOptimizer(), has_state=True, **options)  # bad arguments raise now
    return ModelUpdate(loss_fn, options, plan)


class ValueAndGrad:
    """``(loss, grads) = grad_fn(model, batch)``: `autoaccum.value_and_grad` for an nnx model (`value_and_grad`).

    Attributes:
      loss_fn: ``loss_fn(model, batch)``.
      wrt: the filter of what is differentiated (``nnx.Param`` by default).
      options: the `autoaccum.value_and_grad` arguments (``has_state`` aside).
      plan: the plan they came from, if any: the model's parameters are checked against it at the first call.
    """

    def __init__(
        self, loss_fn: Callable[..., Any], wrt: Any, options: dict[str, Any], plan: Plan | None = None
    ) -> None:
        self.loss_fn = loss_fn
        self.wrt = wrt
        self.options = options
        self.plan = plan
        self._cache: dict[Any, Callable[..., Any]] = {}

    def __call__(self, model: nnx.Module, batch: PyTree) -> tuple[Any, PyTree]:
        """The whole batch's loss (``(loss, aux)`` with ``has_aux``) and gradient, an ``nnx.State`` like
        ``nnx.grad``'s; the model's other state (BatchNorm statistics, ``nnx.Rngs`` streams) moves as the
        microbatches run, in order."""
        if not isinstance(model, nnx.Module):
            raise TypeError(f"`model` must be an nnx.Module, got {type(model).__name__}: {model!r}.")
        graphdef, params, rest = _split(model, self.wrt, "`wrt`")
        key = jax.tree.structure(graphdef)  # as nnx.jit keys its cache (compared with ==)
        if key not in self._cache:
            if self.plan is not None:
                self.plan.check_params(params)
            pure = _pure_loss(self.loss_fn, graphdef, self.wrt)
            self._cache[key] = _value_and_grad(pure, has_state=True, **self.options)
        loss, grads, state = self._cache[key](as_arrays(params), batch, as_arrays(rest))
        nnx.update(model, state)
        return loss, jax.tree.unflatten(jax.tree.structure(params), jax.tree.leaves(grads))


def value_and_grad(
    loss_fn: Callable[..., Any] | Knobs,
    *,
    microbatch_size: int | None = None,
    has_aux: bool | None = None,
    wrt: Any = nnx.Param,
    plan: Plan | None = None,
    **options: Any,
) -> ValueAndGrad:
    """``nnx.value_and_grad(loss_fn)`` over the whole batch, accumulated over microbatches, for your own step.

    Use it as nnx's own, inside your ``@nnx.jit`` step: ``(loss, grads) = grad_fn(model, batch)``, then
    ``optimizer.update(model, grads)`` and your metrics. The gradient equals nnx's on the whole batch for a
    loss of per-example terms (see `autoaccum.value_and_grad`); what ``wrt`` does not select (``nnx.BatchStat``,
    the ``nnx.Rngs`` streams) is model state, threaded through the microbatches in order as in `build_update`:
    each microbatch draws its own dropout mask and BatchNorm's statistics take one step per microbatch.

    Args:
      loss_fn: ``loss_fn(model, batch) -> loss`` (``(loss, aux)`` with ``has_aux``); with a ``plan`` tuned with
        knobs of the loss's own, the `autoaccum.Knobs` it was tuned with.
      microbatch_size: examples per microbatch (a positive int), unless a ``plan`` gives it.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; default: the ``plan``'s, else False (it describes the
        loss you pass, so it may differ from the tuned loss's: a step of your own returning metrics).
      wrt: the ``nnx`` filter of what is differentiated.
      plan: a tuned `autoaccum.Plan` in place of ``microbatch_size`` and ``options`` (its strategy must run inside
        a jit: ``scan``).
      **options: `autoaccum.value_and_grad`'s ``loss_reduction``, ``accumulator_dtype``, ``remat``, ``unroll``.

    Raises:
      TypeError, ValueError: bad arguments, a ``plan`` beside arguments it sets, or a plan whose strategy runs
        on the host (``loop``, ``multisteps``).

    Example:
      >>> import jax.numpy as jnp, optax, autoaccum
      >>> from flax import nnx
      >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
      >>> grad_fn = autoaccum.nnx.value_and_grad(lambda m, b: jnp.mean(m(b) ** 2), microbatch_size=4)
      >>> @nnx.jit
      ... def train_step(model, optimizer, batch):
      ...     loss, grads = grad_fn(model, batch)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> loss = train_step(model, optimizer, jnp.ones((10, 3)))
      >>> int(optimizer.step[...])
      1
    """
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"`plan` must be an autoaccum.Plan (e.g. Plan.load(path)), got {type(plan).__name__}.")
        given = dict(microbatch_size=microbatch_size, **options)
        clashing = sorted(n for n, v in given.items() if not (n in _DEFAULTS and v == _DEFAULTS[n]))
        if clashing:
            raise ValueError(
                f"`plan` sets {', '.join(f'`{n}`' for n in clashing)}; pass either the plan or these arguments, "
                "not both."
            )
        loss_fn, options = resolve(loss_fn, plan.knobs), plan.value_and_grad_options("autoaccum.nnx", has_aux)
    elif isinstance(loss_fn, Knobs):
        raise TypeError("`loss_fn` is an autoaccum.Knobs: pass the plan tuned with it (plan=...).")
    elif microbatch_size is None:
        raise TypeError("`microbatch_size` is required: pass microbatch_size=..., or a tuned plan, plan=...")
    else:
        options = dict(microbatch_size=microbatch_size, has_aux=bool(has_aux), **options)
    check_loss_fn(loss_fn, ("model", "batch"))
    _value_and_grad(lambda p, b, s: (0.0, s), has_state=True, **options)  # bad arguments raise now
    return ValueAndGrad(loss_fn, wrt, options, plan)


_BESIDE_A_PLAN = ("state_update",)
_DEFAULTS: dict[str, Any] = dict(
    microbatch_size=None, strategy="auto", has_aux=False, loss_reduction="mean", accumulator_dtype=jnp.float32
)


def _from_plan(loss_fn: Any, plan: Any, given: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The loss and `build_update` options a plan sets; arguments it sets, given beside it, are refused."""
    if not isinstance(plan, Plan):
        raise TypeError(f"`plan` must be an autoaccum.Plan (e.g. Plan.load(path)), got {type(plan).__name__}.")
    clashing = sorted(
        name
        for name, value in given.items()
        if name not in _BESIDE_A_PLAN
        and not (name in _DEFAULTS and (value is _DEFAULTS[name] or value == _DEFAULTS[name]))
    )
    if clashing:
        raise ValueError(
            f"`plan` sets {', '.join(f'`{n}`' for n in clashing)} (the plan has "
            f"{', '.join(f'{n}={plan.update_options().get(n)!r}' for n in clashing)}); pass either the plan or "
            "these arguments, not both (beside a plan only `donate` and `state_update` are taken)."
        )
    options = {**plan.update_options(), **{n: given[n] for n in _BESIDE_A_PLAN if n in given}}
    return resolve(loss_fn, plan.knobs), options


_APPLY: dict[Any, Callable[..., Any]] = {}


def _optimizer_update(
    model: nnx.Module, optimizer: nnx.Optimizer, graphdef: Any, split: tuple[PyTree, PyTree], grads: PyTree,
    *, donate: bool,
) -> None:  # fmt: skip
    """nnx's own ``optimizer.update(model, grads)`` on the model split as ``graphdef`` and ``split`` (its ``wrt``
    parameters, the rest), which are then written into ``model``: one program compiled per structure (keyed as
    nnx.jit keys its cache, by the treedefs of the GraphDefs), through ``jax.jit`` on the pure arrays (nnx.jit
    itself does not run at every jax release autoaccum supports). The model is not split again here: only the
    optimizer is. With ``donate`` the program takes over the parameters and the optimizer's state."""
    optimizer_def, optimizer_state = nnx.split(optimizer)
    key = (jax.tree.structure(graphdef), jax.tree.structure(optimizer_def), donate)
    if key not in _APPLY:

        def apply(params: PyTree, rest: PyTree, optimizer_state: Any, grads: PyTree) -> tuple[Any, Any]:
            model = nnx.merge(graphdef, params, rest)
            optimizer = nnx.merge(optimizer_def, optimizer_state)
            wrt = jax.tree.structure(nnx.state(model, optimizer.wrt))  # the gradient as nnx.grad gives it
            optimizer.update(model, jax.tree.unflatten(wrt, jax.tree.leaves(grads)))
            return as_arrays(nnx.state(model, optimizer.wrt)), nnx.state(optimizer)

        _APPLY[key] = jax.jit(apply, donate_argnums=(0, 2) if donate else ())  # the parameters, the optimizer state
    params, rest = split
    params, optimizer_state = _APPLY[key](params, rest, optimizer_state, grads)
    nnx.update(model, params, rest)
    nnx.update(optimizer, optimizer_state)


@jax.jit
def _zeros_like(params: PyTree) -> PyTree:
    return jax.tree.map(jnp.zeros_like, params)


def _last_gradient() -> optax.GradientTransformation:
    """An optax transformation whose state is the last gradient it was given, and whose updates are zeros.

    Every strategy runs it as its optimizer (``optax.MultiSteps`` included): the update then hands back the
    whole batch's gradient, cast like the parameters, as its optimizer state, for ``optimizer.update``.
    """

    def update(grads: PyTree, state: PyTree, params: PyTree | None = None) -> tuple[PyTree, PyTree]:
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(_zeros_like, update)


class _NoOptimizer:
    """Stands in for the optimizer while `build_update` checks its other arguments."""

    def init(self, params: PyTree) -> PyTree:
        return ()

    def update(self, updates: PyTree, state: PyTree, params: PyTree | None = None) -> tuple[PyTree, PyTree]:
        return updates, state


def probe(
    loss_fn: Callable[..., Any], model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, **kwargs: Any
) -> Any:
    """`autoaccum.probe` for ``loss_fn(model, batch)``; the model and optimizer are not changed."""
    f = functional(loss_fn, model, optimizer)
    return _probe(f.loss_fn, f.params, batch, optimizer=f.tx, state=f.state, **kwargs)


def estimate(
    loss_fn: Callable[..., Any], model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, **kwargs: Any
) -> Any:
    """`autoaccum.estimate` for ``loss_fn(model, batch)``; nothing is run, the model is not changed."""
    f = functional(loss_fn, model, optimizer)
    return _estimate(f.loss_fn, f.params, batch, optimizer=f.tx, state=f.state, **kwargs)


def tune(
    loss_fn: Callable[..., Any] | Knobs, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, **kwargs: Any
) -> Any:
    """`autoaccum.tune` for ``loss_fn(model, batch)``; the model and optimizer are not changed.

    ``loss_fn`` may be an `autoaccum.Knobs` whose factory makes ``loss_fn(model, batch)`` for each value of the
    loss's own knobs (e.g. which ``nnx.remat`` policy wraps the blocks it calls). The result's ``step`` is the
    tuned plan as an nnx step: ``loss = result.step(model, optimizer, batch)``, the same as
    ``autoaccum.nnx.build_update(loss_fn, plan=result.plan)``; build it so with ``state_update="once"`` to move
    BatchNorm's statistics once per update. With BatchNorm in training mode, set a floor on the microbatch
    (``min_microbatch``): below it the model changes, not just the speed.
    """
    if isinstance(loss_fn, Knobs):
        knobs = loss_fn
        f = functional(knobs.loss_fn(**knobs.default), model, optimizer)
        pure: Any = Knobs(
            lambda **values: functional(knobs.loss_fn(**values), model, optimizer).loss_fn, **knobs.choices
        )
    else:
        f = functional(loss_fn, model, optimizer)
        pure = f.loss_fn
    result = _run.tune(pure, f.params, batch, optimizer=f.tx, state=f.state, **kwargs)
    step = build_update(loss_fn, plan=result.plan)
    return dataclasses.replace(result, step=step)


def workload(
    loss_fn: Callable[..., Any],
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    batch: PyTree,
    name: str = "nnx",
    *,
    has_aux: bool = False,
    loss_reduction: str = "mean",
    memory_limit: str | int | None = None,
) -> Workload:
    """An `autoaccum.Workload` of ``loss_fn(model, batch)``, for the command line (``autoaccum probe FILE:fn``);
    ``has_aux``, ``loss_reduction`` (``"sum"``: a token-weighted loss) and ``memory_limit`` as for `Workload`."""
    f = functional(loss_fn, model, optimizer)
    return Workload(
        f.loss_fn, f.params, batch, f.tx, has_aux=has_aux, state=f.state, loss_reduction=loss_reduction, name=name,
        memory_limit=memory_limit, api="nnx",
    )  # fmt: skip


__all__ = [
    "Functional",
    "ModelUpdate",
    "ValueAndGrad",
    "build_update",
    "estimate",
    "functional",
    "probe",
    "tune",
    "value_and_grad",
    "workload",
]

__getattr__ = moved_names(__name__, {"Update": ("autoaccum.nnx.ModelUpdate", ModelUpdate)})  # the old name
