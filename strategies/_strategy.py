"""The `Strategy` interface: one way to accumulate gradients, on one device or on a mesh."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax
import numpy as np
from autoaccum.strategies import _state
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    add,
    apply_optimizer,
    check_distinct,
    check_optimizer_step,
    check_params,
    dtype_of,
    leading_size,
    output_dtypes,
    signature,
    split,
    weighted_grad,
    zero_accum,
)
from autoaccum.strategies._layout import Layout, check_microbatch, layout_of
from autoaccum.strategies._sharding import OnMesh, combine_state

MAX_SIGNATURES = 64
"""Argument signatures a strategy remembers its checks and output dtypes for (a training loop sees one or two)."""

NOT_GIVEN: Any = object()
"""`Strategy.checked`'s ``opt_state`` when there is none to check (None is an ``opt_state`` given, and refused)."""


class Call(NamedTuple):
    """What a strategy decided for one signature of its arguments (`Strategy.checked`).

    Attributes:
      key: the arguments' `signature`.
      layout: where the batch is sharded, or None on one device.
      microbatches: ``(start, size)`` of each microbatch, in order.
    """

    key: Any
    layout: Layout | None
    microbatches: tuple[tuple[int, int], ...]
    stepped: bool = False
    """Whether the optimizer's step was checked on these arguments' ``opt_state`` (`check_optimizer_step`)."""


class Strategy(abc.ABC):
    """One way to accumulate gradients; subclasses are small and registered by `name`.

    A subclass implements ``run`` (one update, given the `Call` that `checked` made of the arguments) and
    ``programs``; ``__call__`` checks the arguments once per signature and runs; ``stream`` (microbatches from a
    data loader) is shared. ``state`` is the model state (``()`` when ``spec.has_state`` is False).

    Attributes:
      name: the registry key (``strategies.available()``).
      options: tunable options and the values worth trying, e.g. ``{"unroll": (1, 2)}``; the first value is
        the default.
      memory_grows_with: options whose larger value, the others equal, needs no less memory at any microbatch
        size: the tuner does not compile a variant at a size where a lighter one ran out of memory.
    """

    name: ClassVar[str]
    options: ClassVar[Mapping[str, Sequence[Any]]] = {}
    memory_grows_with: ClassVar[tuple[str, ...]] = ()

    def __init__(self, spec: Spec, **options: Any) -> None:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            known = ", ".join(f"`{k}`" for k in self.options) or "none"
            raise ValueError(f"strategy {self.name!r} has no option(s) {unknown}; its options: {known}.")
        self.spec = spec
        self.config = {k: options.get(k, v[0]) for k, v in self.options.items()}
        self._dtypes: dict[Any, OutDtypes] = {}
        self._calls: dict[Any, Call] = {}
        self._streamed = False  # whether `stream` has checked the optimizer's step
        self._grad = weighted_grad(spec)
        # Shared by the host-loop strategies and `stream`: the optimizer step on accumulated sums.
        self._apply = jax.jit(
            self._apply_fn, donate_argnums=self.donate_argnums(0, 1), static_argnames=("dtypes", "layout")
        )
        self._combine = jax.jit(combine_state)  # each device's state, combined after the loop on a mesh
        self._add = jax.jit(
            self._add_fn, donate_argnums=(0, *self.donate_argnums(3)), static_argnames=("dtypes", "layout")
        )
        # With state_update="once": the state carried through the microbatches (one small program per update).
        self._carry = jax.jit(_state.begin, donate_argnums=self.donate_argnums(0))
        # Zero sums on one device, so that the first microbatch runs the program the others run (`zeros`).
        self._zeros = jax.jit(self._zeros_fn, static_argnames=("rows",), keep_unused=True)

    def zeros(self, params: PyTree, batch: PyTree, state: PyTree, size: int) -> Accum:
        """Zero sums shaped like those of ``batch``'s first ``size`` rows, made where ``params`` are (only the
        batch's shapes go to the program: a host batch is not copied)."""
        return self._zeros(params, state, rows=microbatch_shapes(batch, size))

    def _zeros_fn(self, params: PyTree, state: PyTree, *, rows: Any) -> Accum:
        treedef, leaves = rows
        microbatch = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in leaves])
        return zero_accum(jax.eval_shape(lambda p, b, s: self._grad(p, b, s)[0], params, microbatch, state))

    @classmethod
    def program_options(cls, options: Mapping[str, Any], steps: int) -> dict[str, Any]:
        """``options`` as they shape the compiled program of an update of ``steps`` accumulation steps: two sets
        whose results are equal compile to the same program, and the tuner times one of them. By default every
        option matters."""
        return dict(options)

    def init(self, params: PyTree) -> PyTree:
        """The optimizer's own state (``optimizer.init(params)``): the same type for every strategy, each array once
        (an optimizer may put one zero array in two fields, L-BFGS's memories: a call could not donate it twice)."""
        seen = {id(x) for x in jax.tree.leaves(params)}  # (some keep the initial parameters themselves: prodigy)

        def once(x: Any) -> Any:
            if isinstance(x, jax.Array) and (id(x) in seen or seen.add(id(x))):  # type: ignore[func-returns-value]
                return x.copy()
            return x

        return jax.tree.map(once, self.spec.optimizer.init(params))

    def __call__(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        """One full-batch-equivalent update: ``(params, opt_state, loss, state)`` (loss is ``(loss, aux)`` with
        aux; state is the one the last microbatch returned).

        With ``spec.state_update="once"`` the state is carried through the microbatches as a `MeanState`
        (`carried`), and its mean returned.

        Raises:
          ValueError, TypeError: the batch or parameters are malformed (checked before anything is traced), or
            an input was donated to an earlier call (named by leaf).
        """
        try:
            return self._call(params, opt_state, batch, state)
        except (ValueError, RuntimeError) as e:
            _name_donated(e, params=params, opt_state=opt_state, state=state)
            raise

    def _call(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        if self.spec.state_update != "once":
            return self.run(self.checked(params, batch, state, opt_state), params, opt_state, batch, state)
        if not self._calls:  # the first call checks the optimizer's step before the carry donates ``state``
            check_optimizer_step(self.spec.optimizer, params, opt_state)
            if self.spec.donate:
                check_distinct(params=params, state=state, opt_state=opt_state)
        carried = self._carry(state)
        call = self.checked(params, batch, carried, opt_state)
        params, opt_state, loss, carried = self.run(call, params, opt_state, batch, carried)
        return params, opt_state, loss, _state.end(carried)

    def carried(self, state: PyTree) -> PyTree:
        """What the strategy carries through the microbatches for the model ``state``, as shapes: the state
        itself, or with ``spec.state_update="once"`` a `MeanState` (what `run` and `programs` take)."""
        return jax.eval_shape(_state.begin, state) if self.spec.state_update == "once" else state

    @abc.abstractmethod
    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        """`__call__` on arguments already checked: ``call`` is what `checked` made of them."""

    def checked(self, params: PyTree, batch: PyTree, state: PyTree = (), opt_state: Any = NOT_GIVEN) -> Call:
        """The arguments checked (the batch's leading sizes, the parameters' dtypes, ``opt_state`` against the
        optimizer when given, None too, the layout and ``microbatch_size`` against it) and the update's `Call`, once
        per `signature`: later calls with the same structure, shapes, dtypes and shardings pay one flatten.

        Raises:
          ValueError, TypeError: as `leading_size`, `check_params`, `check_optimizer_step` and `layout` do.
        """
        key = signature(params, batch, state)
        call = self._calls.get(key)
        if call is None or (opt_state is not NOT_GIVEN and not call.stepped):
            if call is None:
                leading_size(batch)
                self.check_params(params)
                if self.spec.donate:
                    check_distinct(params=params, state=state, opt_state=() if opt_state is NOT_GIVEN else opt_state)
                call = Call(key, self.layout(params, batch, state), tuple(self.microbatches(batch)))
            if opt_state is not NOT_GIVEN:
                check_optimizer_step(self.spec.optimizer, params, opt_state)
                call = call._replace(stepped=True)
            if len(self._calls) >= MAX_SIGNATURES:
                self._calls.clear()
            self._calls[key] = call
        return call

    def check_params(self, params: PyTree) -> None:
        """Raises ``TypeError`` for parameters this strategy cannot step (`check_params`)."""
        check_params(params)

    @abc.abstractmethod
    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        """The programs one call at these shapes runs, lowered (arguments may be ``ShapeDtypeStruct``)."""

    def stream(
        self, params: PyTree, opt_state: PyTree, microbatches: Iterable[PyTree], state: PyTree = ()
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        """One update on microbatches that arrive one at a time: ``(params, opt_state, loss, state)``.

        Equals one full-batch step on their concatenation. Each microbatch is added to the sums by one jitted
        call (one compiled program per distinct microbatch size), then one jitted call divides by the total
        weight and runs the optimizer. The sums start from zeros (one small program), so the first microbatch's call
        compiles the program the others run.

        The inputs are donated as `__call__` donates them, once the update is made: a stream that fails (a loader
        that raises, a malformed microbatch) leaves them as they were. The stream's programs take a copy of
        ``state`` (with ``donate``), so the state is held twice while it runs.

        Raises:
          ValueError: ``microbatches`` is empty, or one of them is malformed (named by its index), or an input was
            donated to an earlier call (named by leaf).
          TypeError: ``microbatches`` is one batch, or the first stream's ``opt_state`` does not fit the optimizer
            (`check_optimizer_step`).
        """
        if isinstance(microbatches, Mapping) or hasattr(microbatches, "shape"):
            raise TypeError(
                f"`microbatches` must be an iterable of batches, got one {type(microbatches).__name__} (a batch?); "
                "pass [batch, ...] or a generator of them."
            )
        if self.spec.donate:
            check_distinct(params=params, state=state, opt_state=opt_state)
        try:
            out = self._stream(params, opt_state, microbatches, _copies(state) if self.spec.donate else state)
        except (ValueError, RuntimeError) as e:
            _name_donated(e, params=params, opt_state=opt_state, state=state)
            raise
        if self.spec.donate:  # (the stream's programs took copies: a failure above left these)
            for leaf in jax.tree.leaves(state):
                if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                    leaf.delete()
        return out

    def _stream(
        self, params: PyTree, opt_state: PyTree, microbatches: Iterable[PyTree], state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        if not self._streamed:  # (once per strategy: tracing the optimizer every update would cost each update)
            check_optimizer_step(self.spec.optimizer, params, opt_state)
            self._streamed = True
        once = self.spec.state_update == "once"
        state = self._carry(state) if once else state
        acc: Accum | None = None
        dtypes: OutDtypes | None = None
        layout: Layout | None = None
        first: Any = None
        for i, microbatch in enumerate(microbatches):
            try:
                leading_size(microbatch)
            except ValueError as e:
                raise ValueError(f"microbatch {i} of `microbatches`: {e}") from e
            structure = jax.tree.structure(microbatch)
            first = structure if first is None else first
            if structure != first:
                raise ValueError(
                    f"microbatch {i} of `microbatches` is a {structure}, unlike microbatch 0's "
                    f"{first}; give every microbatch the same structure (the same keys)."
                )
            if dtypes is None:  # (traced at the microbatch's own size: `microbatch_size` plays no part here)
                key = ("stream", signature(params, microbatch, state))
                dtypes = self.out_dtypes(params, microbatch, state, key=key, rows=leading_size(microbatch))
                layout = self.layout(params, microbatch, state)
                if layout is None:  # the first call compiles the same program as the others
                    acc = self.zeros(params, microbatch, state, leading_size(microbatch))
                else:
                    state = self.on_mesh(layout).stack_state(state)
            acc, state = self._add(acc, params, microbatch, state, dtypes=dtypes, layout=layout)
        if acc is None or dtypes is None:
            raise ValueError(
                "`microbatches` is empty: it yielded no microbatch, so there is no gradient to apply; pass an "
                "iterable of at least one batch pytree."
            )
        params, opt_state, loss = self._apply(params, opt_state, acc, dtypes=dtypes, layout=layout)
        state = state if layout is None else self._combine(state)
        return params, opt_state, loss, (_state.end(state) if once else state)

    def on_mesh(self, layout: Layout, *, host_loop: bool = False) -> OnMesh:
        """The per-device pieces for this strategy's spec on ``layout`` (`OnMesh`). A ``host_loop`` passes the
        parameters to each microbatch's program already gathered, unless they are gathered per microbatch."""
        gathered = host_loop and (not layout.sharded_params or self.spec.gather_params == "once")
        return OnMesh(self.spec, layout, params_gathered=gathered)

    def _add_fn(
        self,
        acc: Accum | None,
        params: PyTree,
        microbatch: PyTree,
        state: PyTree,
        *,
        dtypes: OutDtypes,
        layout: Layout | None,
    ) -> tuple[Accum, PyTree]:
        if layout is not None:
            return self.on_mesh(layout).add(acc, params, microbatch, state, 0, leading_size(microbatch), dtypes)
        new, state = self._grad(params, microbatch, state)
        return (new if acc is None else add(acc, new)), state

    def _apply_fn(
        self, params: PyTree, opt_state: PyTree, acc: Accum, *, dtypes: OutDtypes, layout: Layout | None = None
    ) -> tuple[PyTree, PyTree, Any]:
        if layout is not None:  # the one reduction of the devices' partial sums
            acc = self.on_mesh(layout).reduce(params, acc, dtypes)
        return apply_optimizer(self.spec, params, opt_state, acc, dtypes, layout)

    @classmethod
    def supports(cls, layout: Layout) -> bool:
        """Whether it runs with inputs laid out as ``layout`` (the tuner leaves it out where not)."""
        return True

    def layout(self, params: PyTree, batch: PyTree, state: PyTree = ()) -> Layout | None:
        """Where the batch is sharded (`Layout`), or None on one device; checks ``microbatch_size`` against it.

        Raises:
          ValueError: the batch, parameters or state are laid out in a way the strategies do not run, or
            ``microbatch_size`` is not a multiple of the number of batch shards.
        """
        layout = layout_of(params, batch, state)
        if layout is not None:
            check_microbatch(self.spec.microbatch_size, layout, leading_size(batch))
        return layout

    def donate_argnums(self, *argnums: int) -> tuple[int, ...]:
        return argnums if self.spec.donate else ()

    def out_dtypes(
        self, params: PyTree, batch: PyTree, state: PyTree = (), *, key: Any = None, rows: int | None = None
    ) -> OutDtypes:
        """`output_dtypes` (at ``rows`` examples), remembered per argument `signature` (``key``, if known) so a host
        loop traces ``loss_fn`` once (the last `MAX_SIGNATURES` signatures, as `checked`)."""
        key = signature(params, batch, state) if key is None else key
        if key not in self._dtypes:
            if len(self._dtypes) >= MAX_SIGNATURES:
                self._dtypes.clear()
            self._dtypes[key] = output_dtypes(self.spec, params, batch, state, rows=rows)
        return self._dtypes[key]

    def microbatches(self, batch: PyTree) -> list[tuple[int, int]]:
        """``(start, size)`` of each microbatch of ``batch``, in order."""
        m = self.spec.microbatch_size
        full, rest = split(leading_size(batch), m)
        return [(i * m, m) for i in range(full)] + ([(full * m, rest)] if rest else [])


def _copies(tree: PyTree) -> PyTree:
    """``tree`` with each array copied (where it lives): what a call may donate and the caller keeps."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _name_donated(error: Exception, **trees: PyTree) -> None:
    """Raises a ValueError naming the leaf of ``trees`` that an earlier call donated, where ``error`` is XLA's
    "deleted or donated" (else returns: the caller re-raises ``error``)."""
    if "deleted or donated" not in str(error) and "has been deleted" not in str(error):
        return
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.Array) and leaf.is_deleted():
                raise ValueError(
                    f"`{name}` leaf {jax.tree_util.keystr(path) or '<root>'} was donated to an earlier call (the "
                    "update donates params, opt_state and state by default): pass what that call returned, or build "
                    "with donate=False to keep the inputs."
                ) from error


def microbatch_shapes(batch: PyTree, size: int) -> tuple[Any, tuple[tuple[tuple[int, ...], Any], ...]]:
    """The structure and ``(shape, dtype)`` of each leaf of ``batch``'s first ``size`` rows (hashable, static)."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple(((size, *np.shape(x)[1:]), dtype_of(x)) for x in leaves)
