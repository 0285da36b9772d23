"""Accumulation on a mesh: each device accumulates its own rows, gradients are reduced once per update.

When ``batch`` is sharded over a `jax.sharding.Mesh` along its example axis, every strategy runs its
per-microbatch work inside ``jax.shard_map``: device ``d`` holds rows of the batch, cuts them into microbatches
of ``microbatch_size / shards`` rows (global microbatch ``i`` is made of every device's own ``i``-th block, so
forming microbatches moves no data), and adds up its unnormalised sums. The parameters are marked
device-varying before the loop, so their gradient is each device's partial sum and nothing is reduced inside
the loop (a replicated input's gradient would otherwise be summed across devices for every microbatch).
After the last microbatch, one ``psum`` (replicated parameters) or ``psum_scatter`` (parameters sharded over
the batch axes, FSDP) reduces the gradient sums, and one ``psum`` the loss, aux and weight sums. The optimizer
then runs once, outside ``shard_map``, on the global arrays.

With sharded parameters, two choices trade memory for communication (`Spec.gather_params`,
`Spec.reduce_grads`): gather the parameters once per update (a full copy on each device) or for each
microbatch, and reduce the gradients once per update (a full-size gradient sum on each device) or
reduce-scatter them for each microbatch (sharded sums, more communication).

``loss_fn`` runs on each device's share of a microbatch: per-example losses (mean or summed) give exactly the
single-device result. A model state is threaded through each device's microbatches separately and combined
after the loop: floating leaves are averaged over the devices (e.g. BatchNorm's running statistics, as
data-parallel training averages them), other leaves (keys, counters) are taken from the first device. A typed PRNG
key is the first device's as given, ``fold_in(key, d)`` on device ``d``: each device draws its own numbers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from autoaccum.strategies._base import Accum, OutDtypes, PyTree, Spec, weighted_grad
from autoaccum.strategies._layout import Layout
from jax.sharding import NamedSharding, PartitionSpec


def _vary(tree: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Marks ``tree`` as differing across ``axes``: its gradient is then each device's own partial sum.

    Axes a value already varies over are left as they are (JAX refuses to cast them again; how a traced
    value shows which axes it varies over differs between JAX releases, so each axis is cast on its own).
    """

    def one(x: jax.Array) -> jax.Array:
        for axis in axes:
            try:
                x = jax.lax.pcast(x, (axis,), to="varying")
            except ValueError as e:  # "Unsupported pcast from=varying, to='varying'": it varies already
                if "from=varying" not in str(e):
                    raise
        return x

    return jax.tree.map(one, tree)


def _own_keys(state: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Inside ``shard_map``: each typed PRNG key of ``state`` (each key of an array of them) as device ``d`` of the
    batch's axes draws from it, the key itself on device 0 (the single-device chain) and ``fold_in(key, d)`` on the
    others, so that no two devices draw the same numbers for their rows."""
    index = jax.lax.axis_index(axes)

    def one(x: jax.Array) -> jax.Array:
        if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        fold = jax.vmap(lambda k: jax.random.fold_in(k, index))  # (an array of keys: each one)
        return jax.lax.cond(index == 0, lambda k: k, lambda k: fold(k.reshape(-1)).reshape(k.shape), x)

    return jax.tree.map(one, state)


class OnMesh:
    """The per-device pieces every strategy uses on a mesh, for one `Spec` and one `Layout`.

    ``local_spec`` is the spec each device runs (``microbatch_size / shards`` rows per microbatch). Functions
    named ``*_local`` run inside ``shard_map``; `run` wraps one.
    """

    def __init__(self, spec: Spec, layout: Layout, *, params_gathered: bool = False) -> None:
        self.spec = spec
        self.layout = layout
        self.params_gathered = params_gathered
        self.local_spec = dataclasses.replace(spec, microbatch_size=spec.microbatch_size // layout.shards)
        self._grad = weighted_grad(self.local_spec)
        self._axes = layout.batch_axes

    # -- shard_map --------------------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], in_specs: Any, out_specs: Any, *, check_vma: bool = True) -> Any:
        return jax.shard_map(fn, mesh=self.layout.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)

    def stacked(self, tree: PyTree) -> PyTree:
        """Specs for values with a leading per-device axis (one row per batch shard)."""
        return jax.tree.map(lambda _: self.layout.batch_spec(), tree)

    def accum_specs(self, params: PyTree, dtypes: OutDtypes, *, reduced: bool) -> Accum:
        """Specs of an `Accum`: reduced sums (grads laid out like ``params``, the rest replicated), or per-device
        partial sums stacked along a leading axis (grads reduced per microbatch are already laid out like
        ``params``)."""
        grads_reduced = reduced or self.spec.reduce_grads == "per_microbatch"
        grads = self.layout.param_specs(params) if grads_reduced else self.stacked(params)
        aux = jax.tree.unflatten(dtypes.aux_treedef or jax.tree.structure(()), list(dtypes.aux))
        rest = (0, aux, 0)
        loss, aux, weight = jax.tree.map(lambda _: PartitionSpec(), rest) if reduced else self.stacked(rest)
        return Accum(grads, loss, aux, weight)

    # -- inside shard_map -------------------------------------------------------------------------------------

    def gather_local(self, params: PyTree) -> PyTree:
        """Each device's full parameters, marked device-varying over every batch axis."""
        leaves, treedef = jax.tree.flatten(params)
        out = []
        for leaf, (dim, axes) in zip(leaves, self.layout.param_dims, strict=True):
            if dim is not None:
                leaf = jax.lax.all_gather(leaf, axes, axis=dim, tiled=True)  # varying over `axes` already
            out.append(_vary(leaf, tuple(a for a in self._axes if a not in axes)))
        return jax.tree.unflatten(treedef, out)

    def reduce_grads_local(self, grads: PyTree) -> PyTree:
        """Sums each device's partial gradient across the batch axes, scattered back like the parameters."""
        leaves, treedef = jax.tree.flatten(grads)
        out = []
        for leaf, (dim, axes) in zip(leaves, self.layout.param_dims, strict=True):
            if dim is not None:
                leaf = jax.lax.psum_scatter(leaf, axes, scatter_dimension=dim, tiled=True)
            rest = tuple(a for a in self._axes if a not in axes)
            out.append(jax.lax.psum(leaf, rest) if rest else leaf)
        return jax.tree.unflatten(treedef, out)

    @property
    def gathers_per_microbatch(self) -> bool:
        return self.spec.gather_params == "per_microbatch" and self.layout.sharded_params and not self.params_gathered

    def start_local(self, params: PyTree, state: PyTree) -> tuple[PyTree, PyTree]:
        """The parameters the microbatches use (gathered here when gathered once) and the device's state."""
        if self.params_gathered:
            params = _vary(params, self._axes)
        elif not self.gathers_per_microbatch:
            params = self.gather_local(params)
        return params, _own_keys(_vary(state, self._axes), self._axes)

    def grad_fn(self) -> Callable[[PyTree, PyTree, PyTree], tuple[Accum, PyTree]]:
        """``f(params, microbatch, state) -> (Accum, state)`` for one device's share of a microbatch.

        ``params`` are what `start_local` returned; they are gathered here when gathered per microbatch, and
        the gradient is reduce-scattered here when reduced per microbatch.
        """
        gather = self.gathers_per_microbatch
        scatter = self.spec.reduce_grads == "per_microbatch"

        def f(params: PyTree, microbatch: PyTree, state: PyTree) -> tuple[Accum, PyTree]:
            if gather:  # tied to the microbatch, so the compiler cannot hoist the gather out of the loop
                params, microbatch = jax.lax.optimization_barrier((params, microbatch))
                params = self.gather_local(params)
            acc, state = self._grad(params, microbatch, state)
            return (acc._replace(grads=self.reduce_grads_local(acc.grads)) if scatter else acc), state

        return f

    def zeros_local(self, shapes: Accum) -> Accum:
        """Zero sums to start a device's loop from, typed like the sums its microbatches add: partial sums vary
        across the batch axes; gradients reduced per microbatch vary only over the axes they are scattered on."""
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        rest = _vary((zeros.loss, zeros.aux, zeros.weight), self._axes)
        if self.spec.reduce_grads == "per_microbatch":
            leaves, treedef = jax.tree.flatten(zeros.grads)
            grads = jax.tree.unflatten(
                treedef, [_vary(g, axes) for g, (_, axes) in zip(leaves, self.layout.param_dims, strict=True)]
            )
        else:
            grads = _vary(zeros.grads, self._axes)
        return Accum(grads, *rest)

    def reduce_local(self, acc: Accum) -> Accum:
        """One reduction of every device's partial sums (gradients unless already reduced per microbatch)."""
        grads = acc.grads if self.spec.reduce_grads == "per_microbatch" else self.reduce_grads_local(acc.grads)
        loss, aux, weight = jax.lax.psum((acc.loss, acc.aux, acc.weight), self._axes)
        return Accum(grads, loss, aux, weight)

    # -- outside shard_map ------------------------------------------------------------------------------------

    def accumulate(
        self,
        accumulate_local: Callable[..., tuple[Accum, PyTree]],
        params: PyTree,
        batch: PyTree,
        state: PyTree,
        dtypes: OutDtypes,
    ) -> tuple[Accum, PyTree]:
        """Runs ``accumulate_local(spec, params, batch, state, grad_fn=..., zeros=...)`` on each device's rows
        and reduces once: the whole batch's `Accum` (global arrays) and the combined state."""

        def local(params: PyTree, batch: PyTree, state: PyTree) -> tuple[Accum, PyTree]:
            params, state = self.start_local(params, state)
            acc, state = accumulate_local(
                self.local_spec, params, batch, state, grad_fn=self.grad_fn(), zeros=self.zeros_local
            )
            return self.reduce_local(acc), expand(state)

        in_specs = (self.layout.param_specs(params), self.batch_specs(batch), jax.tree.map(lambda _: P0, state))
        out_specs = (self.accum_specs(params, dtypes, reduced=True), self.stacked(state))
        acc, stacked = self.run(local, in_specs, out_specs)(params, batch, state)
        return acc, combine_state(stacked)

    def params_in_specs(self, params: PyTree) -> PyTree:
        if self.params_gathered:
            return jax.tree.map(lambda _: P0, params)
        return self.layout.param_specs(params)

    def gathered(self, params: PyTree) -> PyTree:
        """For host loops that gather once per update: the parameters replicated on every device of the mesh
        (one all-gather per update), passed to each microbatch's program. Unchanged when nothing is sharded
        or when they are gathered per microbatch. Shapes (``ShapeDtypeStruct``) are answered in kind."""
        if not self.layout.sharded_params or self.spec.gather_params == "per_microbatch":
            return params
        replicated = NamedSharding(self.layout.mesh, P0)
        if all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params)
        return jax.device_put(params, replicated)

    def stacked_shapes(self, tree: PyTree) -> PyTree:
        """``ShapeDtypeStruct`` of ``tree`` with a leading per-device axis, sharded over the batch's axes."""
        sharding = NamedSharding(self.layout.mesh, self.layout.batch_spec())
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.layout.shards, *x.shape), x.dtype, sharding=sharding), tree
        )

    def stacked_zeros(self, tree: PyTree) -> PyTree:
        """Zeros shaped like ``tree`` for each device, stacked along a leading axis (per-device sums)."""
        shapes = self.stacked_shapes(tree)
        return jax.tree.map(lambda s: jax.device_put(jnp.zeros(s.shape, s.dtype), s.sharding), shapes)

    def stack_state(self, state: PyTree) -> PyTree:
        """Each device's own copy of the state, stacked along a leading axis (threaded between host calls)."""
        specs = jax.tree.map(lambda _: P0, state)

        def own(state: PyTree) -> PyTree:
            return expand(_own_keys(_vary(state, self._axes), self._axes))

        return self.run(own, (specs,), self.stacked(state))(state)

    def stacked_accum(self, acc: Accum, *, stack: bool) -> Accum:
        """Adds (``stack``) or drops the leading per-device axis of partial sums (not of reduced gradients)."""
        f = expand if stack else own_row
        grads = acc.grads if self.spec.reduce_grads == "per_microbatch" else f(acc.grads)
        return Accum(grads, *f((acc.loss, acc.aux, acc.weight)))

    def add(
        self, acc: Accum | None, params: PyTree, batch: PyTree, state: PyTree, start: Any, size: int, dtypes: OutDtypes
    ) -> tuple[Accum, PyTree]:
        """One host-loop step: rows ``[start, start + size)`` of the global batch (each device's own share of
        them) added to the per-device partial sums ``acc`` (None: start new sums); ``state`` is stacked."""
        local_size = size // self.layout.shards

        def local(
            acc: Accum | None, params: PyTree, batch: PyTree, state: PyTree, start: Any
        ) -> tuple[Accum, PyTree]:  # (``start`` an argument: shard_map closes over no value typed by an Explicit mesh)
            params, _ = self.start_local(params, ())
            local_start = start // self.layout.shards
            microbatch = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, local_start, local_size), batch)
            new, state = self.grad_fn()(params, microbatch, own_row(state))
            if acc is not None:
                new = jax.tree.map(jnp.add, self.stacked_accum(acc, stack=False), new)
            return self.stacked_accum(new, stack=True), expand(state)

        acc_specs = self.accum_specs(params, dtypes, reduced=False)
        in_specs = (self.params_in_specs(params), self.batch_specs(batch), self.stacked(state), PartitionSpec())
        out_specs = (acc_specs, self.stacked(state))
        if acc is None:
            return self.run(functools.partial(local, None), in_specs, out_specs)(params, batch, state, start)
        return self.run(local, (acc_specs, *in_specs), out_specs)(acc, params, batch, state, start)

    def reduce(self, params: PyTree, acc: Accum, dtypes: OutDtypes) -> Accum:
        """The host loop's one reduction: per-device partial sums (stacked) to the whole batch's `Accum`."""

        def local(acc: Accum) -> Accum:
            return self.reduce_local(self.stacked_accum(acc, stack=False))

        in_specs = (self.accum_specs(params, dtypes, reduced=False),)
        return self.run(local, in_specs, self.accum_specs(params, dtypes, reduced=True))(acc)

    def batch_specs(self, batch: PyTree) -> PyTree:
        return jax.tree.map(lambda _: self.layout.batch_spec(), batch)


P0 = PartitionSpec()


def expand(tree: PyTree) -> PyTree:
    """A leading axis of size one: each device's row of a stacked per-device value."""
    return jax.tree.map(lambda x: x[None], tree)


def own_row(tree: PyTree) -> PyTree:
    """Inside ``shard_map``, a device's own value of a stacked per-device value (`expand`'s inverse)."""
    return jax.tree.map(lambda x: x[0], tree)


def combine_state(stacked: PyTree) -> PyTree:
    """The state after the loop from each device's own: floating leaves averaged, others from the first."""

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.mean(x, axis=0, dtype=x.dtype)
        sharding = jax.typeof(x).sharding
        if sharding.spec and sharding.spec[0] is not None:  # Explicit mesh axes: slicing a sharded axis raises
            x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P0))
        return x[0]

    return jax.tree.map(one, stacked)
