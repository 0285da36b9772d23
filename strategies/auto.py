"""``auto``: `build_update`'s default; ``scan``, except on XLA:CPU for a loss with a convolution, ``loop``.

XLA:CPU hands a convolution to its fast library kernels (Eigen) only in the canonical layout (input NHWC,
kernel HWIO), and its pass that rewrites convolutions into that layout visits the program's entry computation
only. A convolution inside a ``while`` loop's body, which is where ``lax.scan`` puts the microbatch, keeps its
layout; the gradient's convolutions (with respect to the kernel and the input) are not canonical, so they run as
XLA's naive loop nests: an update of a small CNN took about 10x as long in ``scan`` as in ``loop`` (jax-ml/jax#12868
reports the same for any convolution in a loop body). Unrolling the scan fully takes the convolutions out of
the loop, but XLA:CPU then keeps every microbatch's activations alive at once (the memory of the whole batch),
which is what accumulation exists to avoid. So on XLA:CPU a loss with a convolution runs from a host loop, one
compiled microbatch at a time; everywhere else (other losses, GPUs, TPUs) the whole update is one ``scan``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from autoaccum.strategies._base import Program, PyTree, Spec, checked_loss, dtype_of
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._strategy import Call, Strategy
from autoaccum.strategies.loop import Loop
from autoaccum.strategies.scan import Scan
from jax.extend import core as jax_core


def has_convolution(jaxpr: jax_core.Jaxpr) -> bool:
    """Whether ``jaxpr`` or one of the jaxprs inside it (calls, remat, loops, branches) has a convolution."""
    return any(eqn.primitive.name == "conv_general_dilated" for eqn in jaxpr.eqns) or any(
        has_convolution(sub) for sub in _inner_jaxprs(jaxpr)
    )


def _inner_jaxprs(jaxpr: jax_core.Jaxpr) -> list[jax_core.Jaxpr]:
    """The jaxprs in the parameters of ``jaxpr``'s equations (``jax.extend.core.subjaxprs`` is newer than our
    jax floor)."""
    found = []
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds its Jaxpr
                if isinstance(inner, jax_core.Jaxpr):
                    found.append(inner)
    return found


def platform_of(batch: PyTree) -> str:
    """The platform the batch lives on (``"cpu"``, ``"gpu"``, ``"tpu"``); JAX's default for shapes only."""
    for leaf in jax.tree.leaves(batch):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return str(next(iter(sharding.device_set)).platform)
    return jax.default_backend()


class Auto(Strategy):
    """Picks the accumulation per platform and loss, once per argument shapes: `Loop` on XLA:CPU when the loss
    has a convolution (see the module's docstring), `Scan` otherwise. Its options are `Scan`'s, for when it
    runs `Scan`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, autoaccum
      >>> def loss_fn(w, b):
      ...     y = jax.lax.conv_general_dilated(b, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
      ...     return jnp.mean(y**2)
      >>> update = autoaccum.build_update(loss_fn, optax.sgd(0.1), microbatch_size=2)
      >>> w, batch = jnp.ones((3, 3, 1, 4)), jnp.ones((4, 8, 8, 1))
      >>> update.accumulation.choose(w, batch).name  # this doctest runs on the CPU
      'loop'
    """

    name = "auto"
    options = Scan.options

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._scan = Scan(spec, **self.config)
        self._loop = Loop(spec)
        self._chosen: dict[Any, Strategy] = {}

    def choose(self, params: PyTree, batch: PyTree, state: PyTree = (), platform: str | None = None) -> Strategy:
        """The strategy that runs these arguments (`Loop` or `Scan`), decided once per `signature` (whose
        shardings tell the platform), or on ``platform`` (``"cpu"``, ``"gpu"``, ...) when given: where a
        plan made here will run."""
        call = self.checked(params, batch, state)
        if platform is not None:
            return self._loop if platform == "cpu" and self._convolves(params, batch, state) else self._scan
        return self._choice(call, params, batch, state)

    def _choice(self, call: Call, params: PyTree, batch: PyTree, state: PyTree) -> Strategy:
        if call.key not in self._chosen:
            self._chosen[call.key] = self.choose(params, batch, state, platform_of(batch))
        return self._chosen[call.key]

    def _convolves(self, params: PyTree, batch: PyTree, state: PyTree) -> bool:
        """Whether one microbatch's loss has a convolution (traced abstractly; nothing runs)."""
        size = min(self.spec.microbatch_size, jax.tree.leaves(batch)[0].shape[0])
        microbatch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)[1:]), dtype_of(x)), batch)
        params, state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)), (params, state))
        closed = jax.make_jaxpr(checked_loss(self.spec))(params, microbatch, state)
        return has_convolution(closed.jaxpr)

    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        return self._choice(call, params, batch, state).run(call, params, opt_state, batch, state)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        return self.choose(params, batch, state).programs(params, opt_state, batch, state)

    @classmethod
    def supports(cls, layout: Layout) -> bool:
        return Scan.supports(layout) and Loop.supports(layout)
