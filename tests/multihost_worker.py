"""One process of tests/test_multihost.py: ``python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUT``.

Joins a ``jax.distributed`` job on 127.0.0.1 (CPU devices, gloo collectives), builds a mesh over every
process's devices, feeds this process's rows of each case's global batch with
``jax.make_array_from_process_local_data``, runs ``autoaccum.build_update`` and writes what the updates
returned, gathered to the host, to OUT as JSON. The cases and their data are defined here (numpy only at import)
so that the test computes its reference, without autoaccum, from the same definitions.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, NamedTuple

import numpy as np

FEATURES = 4  # w is sharded over the 4 devices in the FSDP case
UPDATES = 2
SEEN0 = 0.5  # the float state leaf's value before the first update


class Case(NamedTuple):
    """One configuration, run for `UPDATES` updates on the same global batch.

    ``state``: ``has_state=True`` and ``loss_reduction="sum"`` over padded rows; ``fsdp``: ``w`` sharded over the
    batch's axis; ``stream``: ``update.stream`` over global microbatches of ``microbatch_size`` rows (the last
    smaller) instead of one call on the batch.
    """

    name: str
    strategy: str
    batch_size: int
    microbatch_size: int
    axis_type: str = "Explicit"  # jax.make_mesh's default in jax 0.10
    state: bool = False
    fsdp: bool = False
    stream: bool = False


# Global batch sizes that the microbatch does not divide (8 + 8 + 4) and one that it does (8 + 8 + 8); each
# device takes a quarter of every microbatch.
CASES = (
    Case("scan_uneven", "scan", 20, 8),
    Case("loop_uneven_auto", "loop", 20, 8, axis_type="Auto"),
    Case("scan_state_sum_even_auto", "scan", 24, 8, axis_type="Auto", state=True),
    Case("loop_state_sum", "loop", 20, 8, state=True),
    Case("loop_fsdp", "loop", 20, 8, fsdp=True),
    Case("stream_auto", "loop", 20, 8, axis_type="Auto", stream=True),
)


def batch(case: Case) -> dict[str, np.ndarray]:
    """The case's global batch: float32 features and targets, and a mask of real rows (every third is padding)."""
    rng = np.random.default_rng(case.batch_size * 100 + case.microbatch_size)
    x = rng.normal(size=(case.batch_size, FEATURES)).astype(np.float32)
    y = rng.normal(size=(case.batch_size,)).astype(np.float32)
    mask = (np.arange(case.batch_size) % 3 != 2).astype(np.float32)
    return {"x": x, "y": y, "mask": mask}


def params() -> dict[str, np.ndarray]:
    return {"w": np.array([0.3, -0.2, 0.1, 0.4], np.float32), "b": np.array(0.05, np.float32)}


def errors(p: Any, b: Any) -> Any:
    return (b["x"] @ p["w"] + p["b"] - b["y"]) ** 2


def mean_loss(p: Any, b: Any) -> Any:
    return errors(p, b).mean()


def sum_loss(p: Any, b: Any) -> Any:
    """``(loss_sum, weight)``: the squared errors of the real rows, and how many there are."""
    return (errors(p, b) * b["mask"]).sum(), b["mask"].sum()


def state_loss(p: Any, b: Any, state: Any) -> Any:
    """`sum_loss`, threading a count of microbatches (int32) and a running sum of the targets seen (float32)."""
    return sum_loss(p, b), {"count": state["count"] + 1, "seen": state["seen"] + b["y"].sum()}


def initial_state() -> dict[str, np.ndarray]:
    return {"count": np.array(0, np.int32), "seen": np.array(SEEN0, np.float32)}


def optimizer() -> Any:
    import optax

    return optax.adam(0.1)


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the default in jax 0.9.1 and 0.10, said here
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes, process_id=process_id
    )
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    import autoaccum

    def feed(sharding: NamedSharding, tree: Any) -> Any:
        """The global arrays whose rows this process holds, each made from only this process's rows of ``tree``."""

        def one(x: np.ndarray) -> jax.Array:
            starts = sorted(i[0].start or 0 for i in sharding.addressable_devices_indices_map(x.shape).values())
            per_device = x.shape[0] // sharding.mesh.size
            assert starts == list(range(starts[0], starts[0] + per_device * len(starts), per_device))  # contiguous
            stop = starts[-1] + per_device
            return jax.make_array_from_process_local_data(sharding, x[starts[0] : stop], x.shape)

        return jax.tree.map(one, tree)

    def gather(tree: Any) -> Any:
        return jax.tree.map(lambda x: np.asarray(x).tolist(), multihost_utils.process_allgather(tree, tiled=True))

    results: dict[str, Any] = {"process_count": jax.process_count(), "device_count": jax.device_count()}
    for case in CASES:
        mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(getattr(AxisType, case.axis_type),))
        rows = NamedSharding(mesh, PartitionSpec("data"))
        replicated = NamedSharding(mesh, PartitionSpec())
        data = batch(case)
        p = {k: jax.device_put(v, replicated) for k, v in params().items()}  # the same values in every process
        if case.fsdp:
            w = params()["w"]
            p["w"] = jax.make_array_from_callback(w.shape, rows, lambda index, w=w: w[index])
        update = autoaccum.build_update(
            state_loss if case.state else mean_loss,
            optimizer(),
            microbatch_size=case.microbatch_size,
            strategy=case.strategy,
            has_state=case.state,
            loss_reduction="sum" if case.state else "mean",
        )
        opt_state = update.init(p)
        state = (jax.device_put(initial_state(), replicated),) if case.state else ()
        losses = []
        for _ in range(UPDATES):
            if case.stream:
                m = case.microbatch_size
                loader = (feed(rows, {k: v[i : i + m] for k, v in data.items()}) for i in range(0, case.batch_size, m))
                p, opt_state, loss, *state = update.stream(p, opt_state, loader, *state)
            else:
                p, opt_state, loss, *state = update(p, opt_state, feed(rows, data), *state)
            losses.append(gather(loss))
        results[case.name] = {"params": gather(p), "losses": losses, "state": gather(state[0]) if state else None}
    with open(out, "w") as f:
        json.dump(results, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    try:
        main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    except BaseException:
        # Exit at once: jax.distributed's exit handler would wait for the other processes, which wait for this one.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
