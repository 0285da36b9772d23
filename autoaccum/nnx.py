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
from flax import nnx

from autoaccum._checks import check_loss_fn
from autoaccum._estimate import estimate as _estimate
from autoaccum._knobs import Knobs, resolve
from autoaccum._plan import Plan
from autoaccum._probe import probe as _probe
from autoaccum._tune import run as _run
from autoaccum._update import Update as _Update
from autoaccum._update import build_update as _build_update
from autoaccum._workload import Workload
from autoaccum.strategies import PyTree

_as_pure: Callable[[Any], Any] = getattr(nnx, "as_pure", None) or nnx.pure  # flax < 0.12.7 calls it `pure`


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
    wrt = optimizer.wrt
    graphdef, params, rest = nnx.split(model, wrt, ...)  # type: ignore[misc]

    def pure_loss(params: PyTree, batch: PyTree, state: PyTree) -> tuple[Any, PyTree]:
        local = nnx.merge(graphdef, params, state)
        out = loss_fn(local, batch)
        _, _, new_state = nnx.split(local, wrt, ...)  # type: ignore[misc]
        return out, _as_pure(new_state)

    return Functional(
        pure_loss, _as_pure(params), _as_pure(rest), optimizer.tx, _as_pure(optimizer.opt_state), graphdef
    )


class Update:
    """An accumulating step for an nnx model: ``loss = step(model, optimizer, batch)``, in place.

    The result equals one ``optimizer.update(model, grads)`` with the gradient of the whole batch (see
    `autoaccum.build_update` for the exact semantics, ``loss_reduction`` included); the model's other state
    (batch statistics, RNG counters) is threaded through the microbatches in order. ``optimizer.step`` advances
    by one per call. Programs are built per model structure and cached.
    """

    def __init__(self, loss_fn: Callable[..., Any], options: dict[str, Any], plan: Plan | None = None) -> None:
        self.loss_fn = loss_fn
        self.options = options
        self.plan = plan
        self._cache: dict[Any, _Update] = {}

    def _prepare(self, model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[Functional, _Update]:
        f = functional(self.loss_fn, model, optimizer)
        # Keyed as nnx.jit's cache is (jax.jit's, by the treedef of the model's GraphDef): compared with ==, never
        # hashed itself, so a model holding a list attribute (an unhashable GraphDef) is accepted as nnx.jit does.
        key = (jax.tree.structure(f.graphdef), id(f.tx))
        if key not in self._cache:
            if self.plan is not None:
                self.plan.check_params(f.params)
            self._cache[key] = _build_update(f.loss_fn, f.tx, has_state=True, **self.options)
        return f, self._cache[key]

    @staticmethod
    def _write_back(model: nnx.Module, optimizer: nnx.Optimizer, out: tuple[Any, ...]) -> Any:
        params, opt_state, loss, state = out
        nnx.update(model, params, state)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        optimizer.step[...] += 1
        return loss

    def __call__(self, model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree) -> Any:
        """One update on ``batch``; returns the loss (``(loss, aux)`` with ``has_aux``)."""
        f, update = self._prepare(model, optimizer)
        return self._write_back(model, optimizer, update(f.params, f.opt_state, batch, f.state))

    def stream(self, model: nnx.Module, optimizer: nnx.Optimizer, microbatches: Iterable[PyTree]) -> Any:
        """One update on microbatches that arrive one at a time (`autoaccum.Update.stream`); returns the loss."""
        f, update = self._prepare(model, optimizer)
        return self._write_back(model, optimizer, update.stream(f.params, f.opt_state, microbatches, f.state))

    def compiled_for(self, model: nnx.Module, optimizer: nnx.Optimizer) -> _Update:
        """The functional `autoaccum.Update` this step runs for ``model`` (e.g. for its ``programs``)."""
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
) -> Update:
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
    check_loss_fn(loss_fn)
    options = dict(options, donate=donate)
    _build_update(lambda p, b, s: (0.0, s), _NoOptimizer(), has_state=True, **options)  # bad arguments raise now
    return Update(loss_fn, options, plan)


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
    loss_fn: Callable[..., Any], model: nnx.Module, optimizer: nnx.Optimizer, batch: PyTree, name: str = "nnx"
) -> Workload:
    """An `autoaccum.Workload` of ``loss_fn(model, batch)``, for the command line (``autoaccum probe FILE:fn``)."""
    f = functional(loss_fn, model, optimizer)
    return Workload(f.loss_fn, f.params, batch, f.tx, state=f.state, name=name)


__all__ = ["Functional", "Update", "build_update", "estimate", "functional", "probe", "tune", "workload"]
