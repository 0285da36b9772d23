"""``multisteps``: ``optax.MultiSteps`` wraps the optimizer; one jitted call per microbatch from a host loop."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    add,
    dtype_of,
    finish_loss,
    take,
    tree_bytes,
    weighted_grad,
)
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._sharding import expand, own_row
from autoaccum.strategies._strategy import Call, Strategy
from jax.sharding import PartitionSpec


class MultiSteps(Strategy):
    """Accumulation by `optax.MultiSteps` (``every_k_schedule`` = the number of microbatches).

    ``MultiSteps`` averages the k gradients it is given with equal weights, while every strategy divides the
    summed gradients by the total weight (``B`` examples, or the weights ``loss_fn`` returns with
    ``loss_reduction="sum"``), which is only known once the last microbatch has run. So microbatch ``i`` hands
    it ``k`` times its unnormalised gradient sum, and at the last microbatch, where the total weight ``W`` is
    known, both that gradient and ``MultiSteps``'s running mean are divided by ``W`` (the mean is linear, so
    the inner optimizer sees exactly the summed gradients over ``W``). Accumulation happens in
    ``MultiSteps``'s ``accumulator_dtype``. The model state goes through each per-microbatch call.

    The optimizer state it takes and returns is the optimizer's own, as for every strategy (a checkpoint
    saved under one plan restores under another): each call wraps it in an ``optax.MultiStepsState`` with a
    fresh accumulator, runs the ``k`` microbatches, and hands back the inner state.
    """

    name = "multisteps"

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._step = jax.jit(
            self._step_fn,
            donate_argnums=(2, *self.donate_argnums(0, 1, 5)),
            static_argnames=("size", "k", "final", "layout", "even"),
        )
        self._mean_grad = weighted_grad(spec, scale_grads=False)
        self._wrap = jax.jit(self._wrap_fn, donate_argnums=self.donate_argnums(0))
        # One device: the wrapped state and the zero sums in one program, the loss divided out in one more.
        self._begin = jax.jit(self._begin_fn, donate_argnums=self.donate_argnums(0), static_argnames=("dtypes",))
        self._loss = jax.jit(functools.partial(finish_loss, spec), static_argnames=("dtypes",))
        self._total = jax.jit(lambda sums: jax.tree.map(lambda x: x.sum(0), sums))  # the devices' loss sums

    def _wrapped(
        self, k: int, inner: optax.GradientTransformation | None = None, mini_step: Any = None
    ) -> optax.MultiSteps:
        """``MultiSteps`` over the optimizer (or ``inner``); at ``mini_step`` (traced) before the last of ``k``, the
        inner updates it drops are zeros: it multiplies them by 0, which keeps a NaN or an infinity of an update on
        a partial sum (an adaptive optimizer's first zero gradient, say) in the parameters."""
        inner = optax.with_extra_args_support(self.spec.optimizer if inner is None else inner)

        def update(updates: PyTree, state: PyTree, params: PyTree = None, **extra: Any) -> tuple[PyTree, PyTree]:
            # the mean gradient cast like the parameters, as every strategy hands it to the optimizer (`mean_grads`)
            out, state = inner.update(optax.tree.cast_like(updates, params), state, params, **extra)
            if mini_step is not None:
                out = jax.tree.map(lambda u: jnp.where(mini_step == k - 1, u, jnp.zeros_like(u)), out)
            return out, state

        cast = optax.GradientTransformationExtraArgs(inner.init, update)
        return optax.MultiSteps(cast, every_k_schedule=k, accumulator_dtype=self.spec.accumulator_dtype)

    def _wrap_fn(self, opt_state: PyTree, params: PyTree) -> optax.MultiStepsState:
        """A ``MultiStepsState`` around ``opt_state`` with a zero accumulator (the inner init is dead code)."""
        return self._wrapped(1).init(params)._replace(inner_opt_state=opt_state)  # the state does not depend on k

    def _begin_fn(self, opt_state: PyTree, params: PyTree, *, dtypes: OutDtypes) -> tuple[optax.MultiStepsState, Accum]:
        return self._wrap_fn(opt_state, params), dtypes.zero_sums(self.spec.sums_dtype)

    def _microbatch_step(
        self,
        grad: Callable[..., tuple[Accum, PyTree]],
        params: PyTree,
        opt_state: optax.MultiStepsState,
        sums: Accum,
        microbatch: PyTree,
        state: PyTree,
        *,
        k: int,
        divisor: Callable[[optax.MultiStepsState, Accum], jax.Array],
        inner: Callable[[Accum], optax.GradientTransformation] | None = None,
    ) -> tuple[PyTree, optax.MultiStepsState, Accum, PyTree]:
        """One microbatch through ``MultiSteps``: its gradient times ``k`` over ``divisor`` (1 before the last
        microbatch, the total weight at the last), the running mean divided likewise. ``inner(sums)``: the inner
        optimizer, given the sums so far (default: the spec's)."""
        new, state = grad(params, microbatch, state)
        sums = add(sums, new._replace(grads=()))
        d = divisor(opt_state, sums)
        dtype = self.spec.accumulator_dtype  # (k times a low-precision sum can overflow the gradient's own dtype)
        grads = jax.tree.map(lambda g: g.astype(dtype) * jnp.asarray(k, dtype) / d.astype(dtype), new.grads)
        acc_grads = jax.tree.map(lambda a: a / d.astype(a.dtype), opt_state.acc_grads)
        wrapped = self._wrapped(k, None if inner is None else inner(sums), opt_state.mini_step)
        updates, opt_state = wrapped.update(grads, opt_state._replace(acc_grads=acc_grads), params)
        return optax.apply_updates(params, updates), opt_state, sums, state

    def _step_fn(
        self,
        params: PyTree,
        opt_state: optax.MultiStepsState,
        sums: Accum,
        batch: PyTree,
        start: Any,
        state: PyTree,
        *,
        size: int,
        k: int,
        final: bool = False,
        layout: Layout | None = None,
        even: bool = False,
    ) -> tuple[PyTree, optax.MultiStepsState, Accum, PyTree]:
        if layout is not None:
            return self._mesh_step(
                params, opt_state, sums, batch, start, state, size=size, k=k, final=final, layout=layout
            )
        if even:  # k equal microbatches of a mean loss: the equal-weight mean of their mean gradients is exact
            new, state = self._mean_grad(params, take(batch, start, size), state)
            updates, opt_state = self._wrapped(k, mini_step=opt_state.mini_step).update(new.grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, add(sums, new._replace(grads=())), state

        def divisor(opt_state: optax.MultiStepsState, sums: Accum) -> jax.Array:  # traced: one program per size
            return jnp.where(opt_state.mini_step == k - 1, sums.weight, jnp.ones_like(sums.weight))

        return self._microbatch_step(
            self._grad, params, opt_state, sums, take(batch, start, size), state, k=k, divisor=divisor
        )

    def _mesh_step(
        self,
        params: PyTree,
        opt_state: optax.MultiStepsState,
        sums: Accum,
        batch: PyTree,
        start: Any,
        state: PyTree,
        *,
        size: int,
        k: int,
        final: bool,
        layout: Layout,
    ) -> tuple[PyTree, optax.MultiStepsState, Accum, PyTree]:
        """On a mesh each device runs ``MultiSteps`` on its own rows, its accumulator holding its partial sum
        (stacked between calls); only the last microbatch's program reduces: the accumulated gradient and the
        total weight together, inside the inner optimizer. The others run no collective. ``MultiSteps`` runs
        the inner optimizer at every call and keeps its result only at the last, so the inner optimizer of the
        other programs (whose result is dropped) is the plain one."""
        mesh = self.on_mesh(layout, host_loop=True)
        axes, shards = layout.batch_axes, layout.shards
        grad = weighted_grad(mesh.local_spec)

        def inner(sums: Accum) -> optax.GradientTransformation:
            """The last microbatch's inner optimizer: the update's one reduction (each device's accumulated
            gradient and weight together), then the division by the total weight, then the optimizer."""

            def update(updates: PyTree, inner_state: PyTree, params: PyTree = None) -> tuple[PyTree, PyTree]:
                total, weight = jax.lax.psum((updates, sums.weight), axes)
                grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), total)
                return self.spec.optimizer.update(grads, inner_state, params)

            return optax.GradientTransformation(self.spec.optimizer.init, update)

        def divisor(opt_state: optax.MultiStepsState, sums: Accum) -> jax.Array:
            return jnp.ones_like(sums.weight)  # the division happens after the reduction, in `inner`

        def local(params: PyTree, opt_state: Any, sums: Accum, batch: PyTree, state: PyTree) -> tuple[Any, ...]:
            microbatch = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start // shards, size // shards), batch)
            opt_state = opt_state._replace(acc_grads=own_row(opt_state.acc_grads))
            params, opt_state, sums, state = self._microbatch_step(
                grad, params, opt_state, own_row(sums), microbatch, own_row(state), k=k, divisor=divisor,
                inner=inner if final else None,
            )  # fmt: skip
            return params, opt_state._replace(acc_grads=expand(opt_state.acc_grads)), expand(sums), expand(state)

        replicated = functools.partial(jax.tree.map, lambda _: PartitionSpec())
        opt_specs = replicated(opt_state)._replace(acc_grads=mesh.stacked(opt_state.acc_grads))
        in_specs = (replicated(params), opt_specs, mesh.stacked(sums), mesh.batch_specs(batch), mesh.stacked(state))
        out_specs = (replicated(params), opt_specs, mesh.stacked(sums), mesh.stacked(state))
        # Unchecked: MultiSteps selects between the inner optimizer's result and the old values, which JAX's
        # replication typing cannot follow; the values it keeps are the same on every device.
        return mesh.run(local, in_specs, out_specs, check_vma=False)(params, opt_state, sums, batch, state)

    def check_params(self, params: PyTree) -> None:
        """As `Strategy.check_params`; complex parameters too are refused: ``MultiSteps`` accumulates in one real
        dtype, which would drop their gradients' imaginary parts."""
        super().check_params(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if jnp.issubdtype(dtype_of(leaf), jnp.complexfloating):
                name = jax.tree_util.keystr(path) or "<root>"
                raise TypeError(
                    f"`params` leaf {name} is {dtype_of(leaf)}: strategy 'multisteps' accumulates in "
                    "optax.MultiSteps's one real dtype, which drops a complex gradient's imaginary part; use "
                    "strategy='scan' or 'loop'."
                )

    @classmethod
    def supports(cls, layout: Layout) -> bool:
        """Replicated parameters only: the inner optimizer sees whole parameters."""
        return not layout.sharded_params

    def _start(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[Layout | None, optax.MultiStepsState, Accum, PyTree, OutDtypes]:
        layout = call.layout
        if layout is not None and not self.supports(layout):
            raise NotImplementedError(
                "strategy 'multisteps' runs optax.MultiSteps, whose inner optimizer sees whole parameters; with "
                "parameters sharded over the mesh (FSDP) use strategy='scan' or 'loop'."
            )
        if layout is not None:
            for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
                spec = getattr(getattr(leaf, "sharding", None), "spec", ())
                if any(spec):
                    raise NotImplementedError(
                        f"`opt_state` leaf {jax.tree_util.keystr(path)} is sharded as {spec}: strategy 'multisteps' "
                        "runs optax.MultiSteps on whole, replicated optimizer state; with a sharded optimizer state "
                        "(ZeRO) use strategy='scan' or 'loop', or pass update.init(params)."
                    )
        dtypes = self.out_dtypes(params, batch, state, key=call.key)
        if layout is None:  # zero sums: the same step program for every microbatch
            return None, *self._begin(opt_state, params, dtypes=dtypes), state, dtypes
        # On a mesh: each device's own accumulator and sums, stacked.
        mesh = self.on_mesh(layout, host_loop=True)
        sums, state = mesh.stacked_zeros(dtypes.zero_sums(self.spec.sums_dtype)), mesh.stack_state(state)
        with jax.set_mesh(layout.mesh):  # (MultiSteps's counters are made here: on an Explicit mesh, typed by it)
            wrapped = self._wrap(opt_state, params)
        wrapped = wrapped._replace(acc_grads=mesh.stacked_zeros(wrapped.acc_grads))
        return layout, wrapped, sums, state, dtypes

    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        calls = call.microbatches
        layout, wrapped, sums, state, dtypes = self._start(call, params, opt_state, batch, state)
        even = self._even(calls, layout)
        for i, (start, size) in enumerate(calls):
            final = layout is not None and i == len(calls) - 1
            params, wrapped, sums, state = self._step(
                params, wrapped, sums, batch, start, state, size=size, k=len(calls), final=final, layout=layout,
                even=even,
            )  # fmt: skip
        if layout is not None:
            sums, state = self._total(sums), self._combine(state)
        return params, wrapped.inner_opt_state, self._loss(sums, dtypes=dtypes), state

    def _even(self, microbatches: Sequence[tuple[int, int]], layout: Layout | None) -> bool:
        """Whether the microbatches' mean-loss gradients go to ``MultiSteps`` as they are (one device, a mean
        loss, every microbatch of one size): its mean of them is then the full batch's, with no scaling by
        the weights (which costs passes over the gradients and the accumulator in every microbatch's step)."""
        return layout is None and self.spec.loss_reduction == "mean" and len({n for _, n in microbatches}) == 1

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        calls = self.microbatches(batch)
        layout = self.layout(params, batch, state)
        dtypes = self.out_dtypes(params, batch, state)
        sums = jax.eval_shape(lambda: dtypes.zero_sums(self.spec.sums_dtype))
        wrapped = jax.eval_shape(self._wrap_fn, opt_state, params)
        if layout is not None:
            mesh = self.on_mesh(layout, host_loop=True)
            sums, state = mesh.stacked_shapes(sums), jax.eval_shape(mesh.stack_state, state)
            wrapped = wrapped._replace(acc_grads=mesh.stacked_shapes(wrapped.acc_grads))
        sizes = sorted({n for _, n in calls})
        finals = (False, True) if layout is not None else (False,)
        even = self._even(calls, layout)
        steps = [
            Program(
                self._step.lower(
                    params, wrapped, sums, batch, 0, state, size=n, k=len(calls), final=f, layout=layout, even=even
                ),
                0,
            )
            for n in sizes
            for f in finals
        ]  # fmt: skip
        begin = (
            self._wrap.lower(opt_state, params)
            if layout is not None
            else self._begin.lower(opt_state, params, dtypes=dtypes)
        )
        return [Program(begin, tree_bytes(batch)), *steps]
