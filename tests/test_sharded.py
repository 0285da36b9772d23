"""The update on a mesh of 8 CPU devices (``--xla_force_host_platform_device_count=8``, tests/conftest.py).

The batch is sharded along its example axis; parameters are replicated (data parallel) or sharded over the
same axis (FSDP), on meshes of both axis types. Results are checked against the single-device full-batch step
computed without the library (``jax.grad`` on the whole batch, one optax step), atol 1e-6 in float32; the
compiled programs are read for the collectives they run, and where.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_close, count_backend_compiles
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autoaccum
from autoaccum._hlo import collectives

ATOL = 1e-6  # float32, losses near 1: a few ulps
FSDP_STRATEGIES = ("scan", "loop", "unrolled")  # multisteps refuses FSDP (test_multisteps_refuses_fsdp)


def mlp(seed: int = 0, batch_size: int = 64) -> tuple[Any, Any]:
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": 0.3 * jax.random.normal(k[0], (8, 16)), "w2": 0.3 * jax.random.normal(k[1], (16,))}
    batch = {"x": jax.random.normal(k[2], (batch_size, 8)), "y": jax.random.normal(k[3], (batch_size,))}
    return params, batch


def loss_fn(params: Any, batch: Any) -> jax.Array:
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def reference(params: Any, batch: Any, optimizer: optax.GradientTransformation) -> tuple[Any, jax.Array]:
    """One optimizer step on the whole batch's gradient, on one device, without the library."""
    params, batch = jax.device_get((params, batch))
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates), loss


def mesh_of(axis_type: AxisType, shape: tuple[int, ...] = (8,), names: tuple[str, ...] = ("data",)) -> Any:
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape))


def place(tree: Any, mesh: Any, spec: Any) -> Any:
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


FSDP = {"w1": P("data"), "w2": P("data")}


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_equals_the_single_device_full_batch_step(strategy: str, axis_type: AxisType, fsdp: bool) -> None:
    params, batch = mlp()
    optimizer = optax.adam(1e-2)
    want, want_loss = reference(params, batch, optimizer)
    mesh = mesh_of(axis_type)
    if fsdp:
        sharded_params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP)
    else:
        sharded_params = place(params, mesh, P())
    sharded_batch = place(batch, mesh, P("data"))
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=24, strategy=strategy)  # 24, 24, 16: uneven
    if fsdp and strategy not in FSDP_STRATEGIES:
        pytest.skip(f"{strategy} refuses sharded parameters (test_multisteps_refuses_fsdp)")
    got, _, loss = update(sharded_params, update.init(sharded_params), sharded_batch)
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)
    for leaf in jax.tree.leaves(got):  # laid out as given
        assert tuple(leaf.sharding.spec)[:1] == ("data",) if fsdp else not any(leaf.sharding.spec)


def test_an_optimizer_without_array_state_on_jax_make_meshs_default_mesh(strategy: str) -> None:
    """SGD's state holds no array, so ``MultiSteps``'s counters were the first arrays multisteps made, outside the
    Explicit mesh's context (JAX refused them); every strategy steps like the full batch, no ``jax.set_mesh``."""
    params, batch = mlp()
    want, want_loss = reference(params, batch, optax.sgd(0.1))
    mesh = jax.make_mesh((8,), ("data",))
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=24, strategy=strategy)
    sharded = place(params, mesh, P())
    got, _, loss = update(sharded, update.init(sharded), place(batch, mesh, P("data")))
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_every_strategy_under_jax_set_mesh_of_an_explicit_mesh(strategy: str, fsdp: bool) -> None:
    """Inside ``with jax.set_mesh(mesh)``, the usual way to use an Explicit mesh, every strategy steps like the full
    batch (the loop's microbatch offset, typed by the mesh there, was closed over by its shard_map: JAX refused)."""
    if fsdp and strategy not in FSDP_STRATEGIES:
        pytest.skip(f"{strategy} refuses sharded parameters (test_multisteps_refuses_fsdp)")
    params, batch = mlp()
    want, want_loss = reference(params, batch, optax.adam(1e-2))
    mesh = mesh_of(AxisType.Explicit)
    with jax.set_mesh(mesh):
        sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s if fsdp else P())), params, FSDP)
        update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=24, strategy=strategy)
        got, _, loss = update(sharded, update.init(sharded), place(batch, mesh, P("data")))
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)


@pytest.mark.parametrize("strategy_name", ["scan", "loop"])
@pytest.mark.parametrize("gather_params", ["once", "per_microbatch"])
@pytest.mark.parametrize("reduce_grads", ["once", "per_microbatch"])
def test_fsdp_schedules_give_the_same_step(strategy_name: str, gather_params: str, reduce_grads: str) -> None:
    params, batch = mlp(seed=1)
    optimizer = optax.sgd(0.1, momentum=0.9)
    want, want_loss = reference(params, batch, optimizer)
    mesh = mesh_of(AxisType.Explicit)
    mixed = {"w1": P("data"), "w2": P()}  # a leaf left replicated (e.g. a bias too small to shard)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, mixed)
    update = autoaccum.build_update(
        loss_fn,
        optimizer,
        microbatch_size=16,
        strategy=strategy_name,
        gather_params=gather_params,
        reduce_grads=reduce_grads,
    )
    got, _, loss = update(sharded, update.init(sharded), place(batch, mesh, P("data")))
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)


def program_collectives(update: autoaccum.Update, params: Any, batch: Any) -> list[Any]:
    return [collectives(p.lowered.compile().as_text()) for p in update.programs(params, update.init(params), batch)]


GRADIENT_OPS = ("all-reduce", "reduce-scatter", "all-gather")


def test_data_parallel_scan_reduces_once_after_the_loop() -> None:
    params, batch = mlp(batch_size=256)  # 16 microbatches: XLA keeps the loop (it unrolls very short ones)
    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=16)
    (program,) = program_collectives(update, place(params, mesh, P()), place(batch, mesh, P("data")))
    assert program.in_loop == 0, program
    # One all-reduce (gradients, loss and weight together), and no all-gather: microbatches are each device's
    # own rows, so forming them moves no data.
    assert program.outside == {"all-reduce": 1}, program
    # The check can fail: reducing per microbatch puts the all-reduce in the loop body.
    eager = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=16, reduce_grads="per_microbatch")
    (program,) = program_collectives(eager, place(params, mesh, P()), place(batch, mesh, P("data")))
    assert program.loop == {"all-reduce": 1}, program


def test_data_parallel_loop_has_no_collective_in_its_per_microbatch_program() -> None:
    params, batch = mlp(batch_size=256)
    mesh = mesh_of(AxisType.Explicit)
    update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=48, strategy="loop")  # 5 x 48 + 16
    *per_microbatch, apply = program_collectives(update, place(params, mesh, P()), place(batch, mesh, P("data")))
    assert len(per_microbatch) == 3  # the first microbatch, the others, the smaller last one
    assert all(c.total == 0 for c in per_microbatch), per_microbatch
    assert apply.in_loop == 0 and apply.outside == {"all-reduce": 1}, apply


@pytest.mark.parametrize(
    ("gather_params", "reduce_grads", "in_loop", "once"),
    [
        ("once", "once", {}, {"all-gather", "reduce-scatter"}),
        ("per_microbatch", "once", {"all-gather"}, {"reduce-scatter"}),
        ("once", "per_microbatch", {"reduce-scatter"}, {"all-gather"}),
        ("per_microbatch", "per_microbatch", {"all-gather", "reduce-scatter"}, set()),
    ],
)
def test_fsdp_schedules_put_their_collectives_where_they_say(
    gather_params: str, reduce_grads: str, in_loop: set[str], once: set[str]
) -> None:
    params, batch = mlp(batch_size=256)
    mesh = mesh_of(AxisType.Auto)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP)
    update = autoaccum.build_update(
        loss_fn, optax.adam(1e-2), microbatch_size=16, gather_params=gather_params, reduce_grads=reduce_grads
    )
    (program,) = program_collectives(update, sharded, place(batch, mesh, P("data")))
    assert set(program.loop) == set(in_loop), program
    assert set(program.outside) - {"all-reduce"} == once, program  # the all-reduce: loss and weight, once
    assert program.outside.get("all-reduce") == 1, program


def test_a_batch_sharded_over_two_mesh_axes_with_params_sharded_over_one() -> None:
    params, batch = mlp(seed=2)
    optimizer = optax.adam(1e-2)
    want, _ = reference(params, batch, optimizer)
    mesh = mesh_of(AxisType.Explicit, (4, 2), ("data", "fsdp"))
    sharded = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, {"w1": P(None, "fsdp"), "w2": P("fsdp")}
    )
    for strategy in ("scan", "loop"):
        update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=16, strategy=strategy, donate=False)
        got, _, _ = update(sharded, update.init(sharded), place(batch, mesh, P(("data", "fsdp"))))
        assert_trees_close(jax.device_get(got), want, atol=ATOL)
        assert got["w1"].sharding.spec == P(None, "fsdp")


def test_stream_on_a_mesh_equals_the_full_batch_step() -> None:
    params, batch = mlp(seed=3)
    optimizer = optax.adam(1e-2)
    want, want_loss = reference(params, batch, optimizer)
    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=8)
    halves = [{k: v[a:b] for k, v in batch.items()} for a, b in ((0, 32), (32, 64))]
    microbatches = [place(half, mesh, P("data")) for half in halves]
    replicated = place(params, mesh, P())
    got, _, loss = update.stream(replicated, update.init(replicated), iter(microbatches))
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
@pytest.mark.parametrize("strategy_name", ["scan", "loop"])
def test_state_is_threaded_per_device_and_combined_after_the_loop(strategy_name: str, axis_type: AxisType) -> None:
    """Each device threads its own state through its microbatches; floats are averaged, integers kept."""
    params, batch = mlp(seed=4)

    def stateful(params: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
        count, running = state
        return loss_fn(params, batch), (count + 1, 0.5 * running + jnp.mean(batch["x"]))

    mesh = mesh_of(axis_type)
    update = autoaccum.build_update(
        stateful, optax.sgd(0.1), microbatch_size=16, strategy=strategy_name, has_state=True
    )
    state = place((jnp.asarray(0, jnp.int32), jnp.asarray(1.0)), mesh, P())
    replicated = place(params, mesh, P())
    *_, (count, running) = update(replicated, update.init(replicated), place(batch, mesh, P("data")), state)
    # Reference without the library: device d holds rows [8d, 8d + 8) and its microbatch i is rows
    # [8d + 2i, 8d + 2i + 2) (16 / 8 devices = 2 rows each, 4 microbatches).
    x = np.asarray(batch["x"])
    finals = []
    for d in range(8):
        r = 1.0
        for i in range(4):
            r = 0.5 * r + x[8 * d + 2 * i : 8 * d + 2 * i + 2].mean()
        finals.append(r)
    assert int(count) == 4
    np.testing.assert_allclose(running, np.mean(finals), atol=ATOL)


@pytest.mark.parametrize("keys", [0, 2], ids=["a-key", "two-keys"])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
def test_each_device_draws_from_its_own_key_and_the_first_keeps_the_single_device_chain(
    strategy: str, axis_type: AxisType, keys: int
) -> None:
    """A typed key in the state (or each key of an array of them): device 0 runs the single-device key chain (the
    key returned is one device's), every other device ``fold_in(key, d)``'s, so no two devices draw the same dropout
    mask. Reference without the library: the gradient of row j is its mask bit over the batch."""
    rows, microbatch = 64, 16  # 8 devices: 2 rows each per microbatch, 4 microbatches

    def masked(w: Any, batch: Any, state: Any) -> tuple[jax.Array, Any]:
        key, sub = jax.random.split(state["key"] if keys == 0 else state["key"][0])
        keep = jax.random.bernoulli(sub, 0.5, (batch["x"].shape[0],)).astype(jnp.float32)
        return jnp.mean(keep * (batch["x"] @ w)), {"key": key if keys == 0 else state["key"].at[0].set(key)}

    def chain(key: jax.Array) -> tuple[np.ndarray, jax.Array]:  # one device's 4 microbatches of 2 rows
        bits = []
        for _ in range(rows // microbatch):
            key, sub = jax.random.split(key)
            bits.append(np.asarray(jax.random.bernoulli(sub, 0.5, (2,))))
        return np.concatenate(bits), key

    given = jax.random.key(0) if keys == 0 else jax.random.split(jax.random.key(0), keys)
    first = given if keys == 0 else given[0]
    want = [chain(first if d == 0 else jax.random.fold_in(first, d)) for d in range(8)]
    given_data = np.asarray(jax.random.key_data(given)).reshape(-1, 2)  # (before the update donates a copy of it)
    mesh = mesh_of(axis_type)
    update = autoaccum.build_update(
        masked, optax.sgd(1.0), microbatch_size=microbatch, strategy=strategy, has_state=True
    )
    w = place(jnp.zeros(rows), mesh, P())
    batch, state = place({"x": jnp.eye(rows)}, mesh, P("data")), place({"key": given}, mesh, P())
    got, _, _, state = update(w, update.init(w), batch, state)
    bits = (-np.asarray(got) * rows).round().reshape(8, -1)  # sgd(1): -grad; device d holds rows [8d, 8d + 8)
    np.testing.assert_array_equal(bits, np.stack([b for b, _ in want]))
    assert len({tuple(b) for b in bits}) > 1
    returned = np.asarray(jax.random.key_data(state["key"])).reshape(-1, 2)
    np.testing.assert_array_equal(returned[0], jax.random.key_data(want[0][1]))
    np.testing.assert_array_equal(returned[1:], given_data[1:])  # (the other keys as given)


@pytest.mark.parametrize("strategy_name", ["scan", "loop"])
def test_state_moved_once_per_update_is_the_single_device_result(strategy_name: str) -> None:
    """With ``state_update="once"`` every microbatch starts from the incoming state and the floating state is the
    example-weighted mean of theirs: for a mean over the examples, the single-device result. Reference without the
    library: ``0.5 * 1.0 + mean(x)``, whichever rows make each microbatch."""
    params, batch = mlp(seed=5)

    def stateful(params: Any, batch: Any, running: Any) -> tuple[jax.Array, Any]:
        return loss_fn(params, batch), 0.5 * running + jnp.mean(batch["x"])

    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(
        stateful, optax.sgd(0.1), microbatch_size=16, strategy=strategy_name, has_state=True, state_update="once"
    )
    replicated = place(params, mesh, P())
    *_, running = update(replicated, update.init(replicated), place(batch, mesh, P("data")), place(1.0, mesh, P()))
    np.testing.assert_allclose(running, 0.5 + np.mean(np.asarray(batch["x"])), atol=ATOL)


def test_microbatch_size_must_be_a_multiple_of_the_shards() -> None:
    params, batch = mlp()
    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=12)
    replicated = place(params, mesh, P())
    with pytest.raises(ValueError, match=r"`microbatch_size`=12 is not a multiple of the 8 shards.*e\.g\. 8 or 16"):
        update(replicated, update.init(replicated), place(batch, mesh, P("data")))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=lambda t: t.name)
def test_an_optimizer_state_sharded_zero_style_keeps_every_layout(strategy: str, axis_type: AxisType) -> None:
    """Replicated parameters, Adam's moments sharded over the batch's axis (ZeRO-1): the result is the full-batch
    step, laid out as given (the parameters came back sharded like the moments; multisteps failed in shard_map)."""
    params, batch = mlp()
    optimizer = optax.adam(1e-2)
    want, want_loss = reference(params, batch, optimizer)
    mesh = mesh_of(axis_type)
    replicated, data = place(params, mesh, P()), place(batch, mesh, P("data"))
    update = autoaccum.build_update(loss_fn, optimizer, microbatch_size=24, strategy=strategy)
    zero = jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, P("data"))) if x.ndim else x, update.init(replicated)
    )
    if strategy == "multisteps":
        with pytest.raises(
            NotImplementedError, match=r"`opt_state` leaf \[0\]\.mu\['w1'\] is sharded .*'scan' or 'loop'"
        ):
            update(replicated, zero, data)
        return
    got, opt_state, loss = update(replicated, zero, data)
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(loss, want_loss, atol=ATOL)
    assert all(not any(leaf.sharding.spec) for leaf in jax.tree.leaves(got)), jax.tree.map(lambda x: x.sharding, got)
    moments = [leaf for leaf in jax.tree.leaves(opt_state) if leaf.ndim]
    assert all(tuple(leaf.sharding.spec)[:1] == ("data",) for leaf in moments), [m.sharding for m in moments]


def test_layouts_it_does_not_run_are_refused_with_the_fix() -> None:
    params, batch = mlp()
    mesh = mesh_of(AxisType.Auto, (4, 2), ("data", "model"))
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=8)
    data = place(batch, mesh, P("data"))
    tensor_parallel = jax.tree.map(
        lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, {"w1": P(None, "model"), "w2": P("model")}
    )
    with pytest.raises(ValueError, match=r"`params` leaf \['w1'\] is sharded as .*'model'.*FSDP"):
        update(tensor_parallel, update.init(tensor_parallel), data)
    sideways = {"x": jax.device_put(batch["x"], NamedSharding(mesh, P("data", "model"))), "y": data["y"]}
    with pytest.raises(ValueError, match=r"`batch` leaf \['x'\] is sharded as .*beyond its example axis"):
        update(place(params, mesh, P()), update.init(params), sideways)


def test_params_or_state_on_other_devices_than_the_batchs_mesh_are_named(strategy: str) -> None:
    params, batch = mlp()
    devices = np.array(jax.devices())
    data_mesh, other_mesh = jax.sharding.Mesh(devices[:4], ("data",)), jax.sharding.Mesh(devices[4:], ("data",))
    data = place(batch, data_mesh, P("data"))
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=8, strategy=strategy, donate=False)
    elsewhere = [
        place(params, other_mesh, P()),
        {**place(params, data_mesh, P()), "w2": jax.device_put(params["w2"], devices[5])},
    ]
    for bad in elsewhere:
        with pytest.raises(ValueError, match=r"`params` leaf \['w\d'\] is on devices \[.*\], not on the mesh"):
            update(bad, update.init(bad), data)
    update = autoaccum.build_update(
        lambda p, b, s: (loss_fn(p, b), s), optax.sgd(0.1), microbatch_size=8, strategy=strategy, has_state=True
    )
    good = place(params, data_mesh, P())
    with pytest.raises(ValueError, match=r"`state` leaf \['n'\] is on devices \[5\]"):
        update(good, update.init(good), data, {"n": jax.device_put(jnp.zeros(()), devices[5])})


def test_multisteps_on_a_mesh_reduces_only_in_the_last_microbatch_program() -> None:
    params, batch = mlp(batch_size=256)
    mesh = mesh_of(AxisType.Explicit)
    update = autoaccum.build_update(loss_fn, optax.adam(1e-2), microbatch_size=48, strategy="multisteps")
    wrap, *steps = program_collectives(update, place(params, mesh, P()), place(batch, mesh, P("data")))
    # 48 and 16 rows, each as a middle and as the last microbatch's program: 4 programs.
    middle, last = steps[0::2], steps[1::2]
    assert wrap.total == 0 and all(c.total == 0 for c in middle), (wrap, middle)
    assert all(c.outside == {"all-reduce": 1} and c.in_loop == 0 for c in last), last


def test_multisteps_refuses_fsdp() -> None:
    params, batch = mlp()
    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=8, strategy="multisteps")
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP)
    with pytest.raises(NotImplementedError, match="strategy='scan' or 'loop'"):
        update(sharded, update.init(sharded), place(batch, mesh, P("data")))


def test_probe_and_estimate_refuse_what_the_mesh_cannot_run_before_any_trial() -> None:
    """An effective batch that does not split over the shards, and multisteps with FSDP parameters: named before any
    trial or compile (the probe failed after a trial with JAX's IndivisibleError, the estimate answered 16384)."""
    params, batch = mlp()
    mesh = mesh_of(AxisType.Auto)
    replicated, rows = place(params, mesh, P()), place(batch, mesh, P("data"))
    kw = dict(optimizer=optax.sgd(0.1), memory_limit="256MiB", microbatch_cap=16)
    uneven = r"`effective_batch`=30 is not a multiple of the 8 shards .* e\.g\. 24 or 32"
    fsdp = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP)
    with count_backend_compiles() as compiles:
        with pytest.raises(ValueError, match=uneven):
            autoaccum.probe(loss_fn, replicated, rows, effective_batch=30, **kw)
        with pytest.raises(ValueError, match=uneven):
            autoaccum.estimate(loss_fn, replicated, rows, effective_batch=30, **kw)
        with pytest.raises(ValueError, match=r"`strategy`='multisteps' does not run .* strategy='scan' or 'loop'"):
            autoaccum.probe(loss_fn, fsdp, rows, strategy="multisteps", **kw)
    assert compiles == []


def test_a_batch_leaf_left_unsharded_beside_sharded_ones_is_named(strategy: str) -> None:
    """One batch leaf on the mesh's example axis and another not (replicated, a numpy array): the leaf and the fix
    are named before anything compiles (shard_map's own error named an ``arg: float32[..]``)."""
    params, batch = mlp()
    mesh = mesh_of(AxisType.Auto)
    update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=24, strategy=strategy)
    sharded = place(params, mesh, P())
    for y in (place(batch["y"], mesh, P()), np.asarray(batch["y"])):
        mixed = {"x": place(batch["x"], mesh, P("data")), "y": y}
        with pytest.raises(ValueError, match=r"`batch` leaves \['y'\] are not sharded .* while \['x'\] are"):
            update(sharded, update.init(sharded), mixed)


def test_bad_schedule_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"`gather_params` must be 'once' or 'per_microbatch', got .*'always'"):
        autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=8, gather_params="always")


def test_estimate_on_a_mesh_answers_per_device_in_multiples_of_the_shards() -> None:
    """Per-device figures: with FSDP each device holds an eighth of the parameters and of Adam's two moments."""
    mesh = mesh_of(AxisType.Auto)
    params = {"w1": jnp.zeros((256, 512)), "w2": jnp.zeros((512,))}  # 513 KiB
    batch = place({"x": jnp.zeros((64, 256)), "y": jnp.zeros((64,))}, mesh, P("data"))
    kwargs = {"optimizer": optax.adam(1e-3), "memory_limit": "64MiB", "accumulation": False}
    replicated = autoaccum.estimate(loss_fn, place(params, mesh, P()), batch, **kwargs)
    fsdp = autoaccum.estimate(
        loss_fn, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP), batch, **kwargs
    )
    single = autoaccum.estimate(loss_fn, params, jax.device_get(batch), **kwargs)
    assert (replicated.shards, fsdp.shards, single.shards) == (8, 8, 1)
    assert all(p.microbatch_size % 8 == 0 for p in replicated.points + fsdp.points)
    assert replicated.max_microbatch % 8 == 0 and replicated.max_microbatch > single.max_microbatch
    # Parameters, gradient and Adam's two moments: 4 parameter-sized buffers, an eighth of each with FSDP.
    param_bytes = (256 * 512 + 512) * 4
    saved = replicated.bytes_at(64) - fsdp.bytes_at(64)
    assert saved == pytest.approx(4 * param_bytes * 7 / 8, rel=0.15), (saved, param_bytes)


def test_probe_on_a_mesh_runs_the_sharded_step_in_children_that_see_the_mesh() -> None:
    """Trial sizes are global multiples of the shards; the peak is per device: an eighth of the batch's
    activations each, so well under the single-device step's peak at the same microbatch."""
    mesh = mesh_of(AxisType.Explicit)
    params = {"w1": jnp.zeros((64, 1024)), "w2": jnp.zeros((1024,))}
    batch = {"x": jnp.zeros((64, 64)), "y": jnp.zeros((64,))}
    kwargs = {"optimizer": optax.sgd(0.1), "memory_limit": "256MiB", "microbatch_cap": 1024, "granularity": 3}
    sharded = autoaccum.probe(loss_fn, place(params, mesh, P()), place(batch, mesh, P("data")), **kwargs)
    single = autoaccum.probe(loss_fn, params, batch, **kwargs)
    assert sharded.granularity == 24 and single.granularity == 3  # lcm(3, 8 shards)
    assert sharded.max_microbatch == 1008 and single.max_microbatch == 1023  # both reach the cap
    assert all(t.microbatch_size % 24 == 0 for t in sharded.trials)
    mesh_peak, single_peak = sharded.trials[-1].peak_bytes, single.trials[-1].peak_bytes
    assert mesh_peak is not None and single_peak is not None
    # The activations: 1008 x 1024 floats (4 MiB) on one device, 126 x 1024 on each of 8.
    assert single_peak - mesh_peak > 2 * 2**20, (single_peak, mesh_peak)


def test_a_cpu_meshs_devices_share_the_ram_in_the_default_limit() -> None:
    """The default limit is per device: on a CPU mesh the 8 devices are one process's, so each gets an eighth of
    the RAM's share (a per-device half of the RAM made 4x the RAM for the process), and a given limit above an
    eighth of the RAM is lowered to it with a warning."""
    from autoaccum._device import detect_device

    mesh = mesh_of(AxisType.Explicit)
    params, batch = mlp()
    sharded, rows = place(params, mesh, P()), place(batch, mesh, P("data"))
    info = detect_device()
    assert info.platform == "cpu" and info.free_bytes is not None and info.total_bytes is not None
    kw = dict(optimizer=optax.sgd(0.1), sizes=[8], isolate=False)
    found = autoaccum.probe(loss_fn, sharded, rows, **kw)
    assert found.memory_limit_bytes <= info.total_bytes // 2 // 8 and "over 8 devices" in found.limit_source
    with pytest.warns(autoaccum.MemoryLimitWarning, match="over 8 devices"):
        capped = autoaccum.probe(loss_fn, sharded, rows, memory_limit=info.total_bytes // 4, **kw)
    assert capped.memory_limit_bytes == info.total_bytes // 8


def embedding_loss(p: Any, b: Any) -> jax.Array:
    return jnp.mean((p["emb"][b["tokens"]] @ p["out"]) ** 2)  # a gather of rows, as every LM's first layer


def test_tune_takes_fsdp_parameters_that_a_loss_gathers_from_on_an_explicit_mesh() -> None:
    """The check that traces the loss before any trial ran it on the sharded parameters themselves: on an Explicit
    mesh the embedding's gather then needs an ``out_sharding``, a ShardingTypeError blamed on the loss, while the
    update (which gathers the parameters first) runs it. Traced without shardings, the tune goes on."""
    mesh = mesh_of(AxisType.Explicit)
    params = {"emb": jnp.full((64, 32), 0.1), "out": jnp.full((32, 8), 0.1)}
    batch = {"tokens": jnp.arange(64 * 16).reshape(64, 16) % 64}
    sharded, tokens = place(params, mesh, P("data")), place(batch, mesh, P("data"))
    result = autoaccum.tune(
        embedding_loss, sharded, tokens, optimizer=optax.sgd(0.1), microbatch_bound=16, strategies=["loop"],
        budget=1, race_rounds=0, storage=":memory:", isolate=False,
    )  # fmt: skip
    update = result.plan.build(embedding_loss, optax.sgd(0.1))
    got, _, loss = update(sharded, update.init(sharded), tokens)
    want, want_loss = jax.device_get(params), jax.value_and_grad(embedding_loss)(params, batch)
    want = jax.tree.map(lambda w, g: w - 0.1 * g, want, want_loss[1])
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    np.testing.assert_allclose(float(loss), float(want_loss[0]), rtol=1e-5)


@pytest.mark.slow
def test_tune_on_a_mesh_searches_global_multiples_of_the_shards_and_the_fsdp_schedules() -> None:
    mesh = mesh_of(AxisType.Explicit)
    params, batch = mlp(seed=5)
    sharded = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, FSDP)
    result = autoaccum.tune(
        loss_fn, sharded, place(batch, mesh, P("data")), optimizer=optax.adam(1e-2), memory_limit="256MiB",
        effective_batch=128, microbatch_bound=64, strategies=["loop"], budget=6, storage=":memory:", seed=0,
    )  # fmt: skip
    assert {t.microbatch_size for t in result.trials} <= {8, 16, 32, 64}
    assert any(t.options["gather_params"] == "per_microbatch" for t in result.trials)
    # The plan's knobs build the same update again; its step on the mesh equals the single-device one.
    update = result.plan.build(loss_fn, optax.adam(1e-2))
    assert (update.accumulation.spec.gather_params, update.accumulation.spec.reduce_grads) == (
        result.plan.options["gather_params"],
        result.plan.options["reduce_grads"],
    )
    full = {k: jnp.concatenate([v, v]) for k, v in batch.items()}  # 128 examples
    want, _ = reference(params, full, optax.adam(1e-2))
    got, _, _ = update(sharded, update.init(sharded), place(full, mesh, P("data")))
    assert_trees_close(jax.device_get(got), want, atol=ATOL)
    refused = r"`strategies` \['multisteps'\] do not run .* on a mesh \(.*FSDP.*e\.g\. strategies=\['scan', 'loop'\]"
    with pytest.raises(ValueError, match=refused):
        autoaccum.tune(loss_fn, sharded, place(batch, mesh, P("data")), optimizer=optax.sgd(0.1),
                       strategies=["multisteps"], microbatch_bound=8, storage=":memory:")  # fmt: skip
