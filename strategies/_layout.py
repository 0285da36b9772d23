"""Where an update's inputs live: the mesh a batch is sharded over, and how each parameter is laid out."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

PyTree = Any

AxisEntry = Any  # one PartitionSpec entry: None, a mesh axis name, or a tuple of them


def _names(entry: AxisEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _named_spec(x: Any) -> tuple[Any, PartitionSpec] | None:
    """``(mesh, spec)`` of an array or ``ShapeDtypeStruct`` laid out by a ``NamedSharding``; else None."""
    sharding = getattr(x, "sharding", None)
    if sharding is None and isinstance(x, jax.core.Tracer):  # inside jit: explicit mesh axes are in its type
        sharding = jax.typeof(x).sharding
    if isinstance(sharding, NamedSharding):
        return sharding.mesh, sharding.spec
    return None


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the batch and the parameters live: the mesh, the batch's axes, each parameter's sharded dimension.

    Hashable, so it is a static argument of the strategies' jitted functions.

    Attributes:
      mesh: the mesh the batch is sharded over.
      batch_axes: the mesh axes the batch's example axis is sharded over (its ``PartitionSpec`` entry).
      param_dims: for each ``params`` leaf (flattened order), ``(dim, axes)``: the dimension sharded over
        ``axes`` (a subset of ``batch_axes``), or ``(None, ())`` for a replicated leaf.
    """

    mesh: Any
    batch_axes: tuple[str, ...]
    param_dims: tuple[tuple[int | None, tuple[str, ...]], ...]

    @property
    def shards(self) -> int:
        """How many pieces the batch's example axis is cut into."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def sharded_params(self) -> bool:
        """Whether any parameter is sharded over the batch axes (FSDP)."""
        return any(dim is not None for dim, _ in self.param_dims)

    def batch_spec(self) -> PartitionSpec:
        return PartitionSpec(self.batch_axes if len(self.batch_axes) > 1 else self.batch_axes[0])

    def param_specs(self, params: PyTree) -> PyTree:
        """One ``PartitionSpec`` per ``params`` leaf: the leaf's sharded dimension, or replicated."""
        leaves, treedef = jax.tree.flatten(params)
        specs = []
        for leaf, (dim, axes) in zip(leaves, self.param_dims, strict=True):
            entries: list[AxisEntry] = [None] * len(leaf.shape)
            if dim is not None:
                entries[dim] = axes if len(axes) > 1 else axes[0]
            specs.append(PartitionSpec(*entries))
        return jax.tree.unflatten(treedef, specs)

    def constrain(self, params: PyTree) -> PyTree:
        """``params`` (traced) laid out as `param_specs` says: ``reshard`` on an explicit mesh, else a constraint."""
        explicit = jax.sharding.AxisType.Explicit in tuple(getattr(self.mesh, "axis_types", ()))

        def place(x: Any, spec: PartitionSpec) -> Any:
            sharding = NamedSharding(self.mesh, spec)
            return jax.sharding.reshard(x, sharding) if explicit else jax.lax.with_sharding_constraint(x, sharding)

        return jax.tree.map(place, params, self.param_specs(params))


def layout_of(params: PyTree, batch: PyTree, state: PyTree = ()) -> Layout | None:
    """The `Layout` of a batch sharded along its example axis, or None when it is not (one device).

    Arrays and ``jax.ShapeDtypeStruct`` (with a ``sharding``) are read alike.

    Raises:
      ValueError: batch leaves are sharded differently (or some not at all) or along another axis than the first,
        a parameter is sharded over mesh axes the batch is not sharded over, over several dimensions, or the state
        is sharded.
    """
    found: dict[tuple[Any, tuple[str, ...]], list[str]] = {}
    whole: list[str] = []  # leaves not sharded along their example axis
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        named = _named_spec(leaf)
        name = jax.tree_util.keystr(path) or "<root>"
        if named is None or not any(named[1]):
            whole.append(name)
            continue
        mesh, spec = named
        if any(entry is not None for entry in tuple(spec)[1:]):
            raise ValueError(
                f"`batch` leaf {name} is sharded as {spec}, beyond its example axis; shard only axis 0, e.g. "
                "NamedSharding(mesh, P('data')), so each device holds whole examples."
            )
        found.setdefault((mesh, _names(spec[0])), []).append(name)
    if not found:
        return None
    if len(found) > 1:
        listing = "; ".join(f"{axes} on {mesh.axis_names}: {', '.join(n)}" for (mesh, axes), n in found.items())
        raise ValueError(
            f"`batch` leaves are sharded over different meshes or axes ({listing}); put every leaf on one "
            "NamedSharding(mesh, P(axes)) along its example axis."
        )
    ((mesh, batch_axes),) = found
    if whole:
        spec = PartitionSpec(batch_axes if len(batch_axes) > 1 else batch_axes[0])
        raise ValueError(
            f"`batch` leaves {', '.join(whole)} are not sharded along their example axis while "
            f"{', '.join(found[mesh, batch_axes])} are, over {batch_axes}; put every leaf on one sharding: "
            f"jax.device_put(batch, NamedSharding(mesh, {spec}))."
        )
    _check_devices(mesh, batch_axes, params=params, state=state)
    param_dims = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        named = _named_spec(leaf)
        entries: tuple[Any, ...] = tuple(named[1]) if named is not None else ()
        dims = [(i, _names(e)) for i, e in enumerate(entries) if e is not None]
        name = jax.tree_util.keystr(path) or "<root>"
        if len(dims) > 1 or any(not set(axes) <= set(batch_axes) for _, axes in dims):
            raise ValueError(
                f"`params` leaf {name} is sharded as {PartitionSpec(*entries)} while the batch is sharded over "
                f"{batch_axes}; parameters may be replicated (data parallel) or sharded along one dimension over "
                "the batch's axes (FSDP). Reshard it, e.g. jax.device_put(leaf, NamedSharding(mesh, P())), or "
                "over the batch's axis on one dimension."
            )
        param_dims.append(dims[0] if dims else (None, ()))
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        named = _named_spec(leaf)
        if named is not None and any(named[1]):
            raise ValueError(
                f"`state` leaf {jax.tree_util.keystr(path) or '<root>'} is sharded as {named[1]}; the model state "
                "must be replicated (NamedSharding(mesh, P())): each device threads its own copy through its "
                "microbatches."
            )
    return Layout(mesh, batch_axes, tuple(param_dims))


def _check_devices(mesh: Any, batch_axes: tuple[str, ...], **trees: PyTree) -> None:
    """Raises ``ValueError`` naming the first leaf of ``trees`` placed on devices other than ``mesh``'s."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return  # (inside a jit: the arrays are placed already)
    devices = set(mesh.devices.flat)
    for arg, tree in trees.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.core.Tracer) or not getattr(leaf, "committed", False):
                continue  # (an uncommitted array goes where the step runs)
            placed = leaf.sharding.device_set
            if placed != devices:
                ids = sorted(d.id for d in placed)
                raise ValueError(
                    f"`{arg}` leaf {jax.tree_util.keystr(path) or '<root>'} is on devices {ids}, not on the mesh "
                    f"the batch is sharded over (devices {sorted(d.id for d in devices)}, axes {batch_axes}); put it "
                    "on that mesh, e.g. jax.device_put(leaf, NamedSharding(mesh, P())) (replicated)."
                )


def check_effective_batch(effective_batch: int, layout: Layout, name: str = "effective_batch", why: str = "") -> None:
    """``effective_batch`` (or the size ``name``) is global: it must be a multiple of the number of batch shards."""
    if effective_batch % layout.shards:
        lower = max(layout.shards, effective_batch // layout.shards * layout.shards)
        raise ValueError(
            f"`{name}`={effective_batch} is not a multiple of the {layout.shards} shards the batch is split into over "
            f"mesh axes {layout.batch_axes}{why}; use a multiple of {layout.shards}, e.g. {lower} or "
            f"{lower + layout.shards}."
        )


def check_microbatch(microbatch_size: int, layout: Layout, batch_size: int) -> None:
    """``microbatch_size`` is global: it must be a multiple of the number of batch shards."""
    check_effective_batch(microbatch_size, layout, "microbatch_size", " (microbatch_size counts all devices together)")
    if batch_size % layout.shards:
        raise ValueError(
            f"`batch` has {batch_size} examples, not a multiple of the {layout.shards} shards over "
            f"{layout.batch_axes}; pad or trim it to a multiple of {layout.shards}."
        )
