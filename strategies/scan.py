"""``scan``: one compiled program accumulates every microbatch in a ``lax.scan``, then updates once."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    accumulate_in_scan,
    apply_optimizer,
    output_dtypes,
)
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._sharding import OnMesh
from autoaccum.strategies._strategy import Call, Strategy


def accumulate_in_jit(
    spec: Spec, params: PyTree, batch: PyTree, state: PyTree, *, layout: Layout | None, unroll: int | bool = 1
) -> tuple[Accum, PyTree, OutDtypes]:
    """The whole batch's `Accum`, the state after the last microbatch and ``loss_fn``'s output dtypes, traced.

    The in-jit accumulation that the ``scan`` strategy's update and `autoaccum.value_and_grad` share: the
    microbatches in one ``lax.scan`` (`accumulate_in_scan`); with a ``layout`` (a batch sharded over a mesh), each
    device accumulates its own rows and the sums are reduced once, after the loop (`OnMesh.accumulate`).
    """
    dtypes = output_dtypes(spec, params, batch, state)
    accumulate_local = functools.partial(accumulate_in_scan, unroll=unroll)
    if layout is None:
        acc, state = accumulate_local(spec, params, batch, state)
    else:  # each device accumulates its own rows; one reduction after the loop
        acc, state = OnMesh(spec, layout).accumulate(accumulate_local, params, batch, state, dtypes)
    return acc, state, dtypes


class Scan(Strategy):
    """All microbatches and the optimizer step in a single jitted call (no host round-trips).

    Options:
      unroll: ``lax.scan`` unroll factor: microbatches per iteration of the loop. More unrolling trades compile
        time, code size and memory (XLA schedules the unrolled microbatches side by side, so their temporaries add
        up) for speed. With no more accumulation steps than ``unroll`` no loop is left: on XLA:CPU a convolution
        then runs its fast kernel, which it does not inside a loop (the example cnn, 4 and 8 steps: 1.2x and 1.5x
        the fastest hand-written accumulation, ``benchmarks/strategies.py``). The tuner tries 1, 2 and 8.
    """

    name = "scan"
    options: ClassVar[Mapping[str, Sequence[Any]]] = {"unroll": (1, 2, 8)}
    memory_grows_with: ClassVar[tuple[str, ...]] = ("unroll",)

    @classmethod
    def program_options(cls, options: Mapping[str, Any], steps: int) -> dict[str, Any]:
        """Every ``unroll`` of at least ``steps`` unrolls the whole loop (``lax.scan`` then lowers no loop): one
        program.

        Example:
          >>> Scan.program_options({"unroll": 8}, 2) == Scan.program_options({"unroll": 2}, 2)
          True
          >>> Scan.program_options({"unroll": 2}, 4)
          {'unroll': 2}
        """
        unroll = options.get("unroll", cls.options["unroll"][0])
        whole = unroll is True or (unroll is not False and (unroll == 0 or unroll >= steps))
        return {**options, "unroll": "whole" if whole else unroll}

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        check_unroll(self.config["unroll"], "scan's option `unroll`")
        self._step = jax.jit(self._update, donate_argnums=self.donate_argnums(0, 1, 3), static_argnames=("layout",))

    def _update(
        self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree, layout: Layout | None = None
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        acc, state, dtypes = accumulate_in_jit(
            self.spec, params, batch, state, layout=layout, unroll=self.config["unroll"]
        )
        params, opt_state, loss = apply_optimizer(self.spec, params, opt_state, acc, dtypes, layout)
        return params, opt_state, loss, state

    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        return self._step(params, opt_state, batch, state, layout=call.layout)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        layout = self.layout(params, batch, state)
        return [Program(self._step.lower(params, opt_state, batch, state, layout=layout), resident_bytes=0)]


def check_unroll(unroll: Any, what: str = "`unroll`") -> None:
    """Raises ValueError, naming ``what``, unless ``unroll`` is a ``lax.scan`` unroll: an int >= 0 or a bool.

    Example:
      >>> check_unroll(2), check_unroll(True)
      (None, None)
    """
    if not isinstance(unroll, (bool, numbers.Integral)) or unroll < 0:
        raise ValueError(
            f"{what} must be an int >= 1 (microbatches per loop iteration; 0 or True: the whole loop) or False, got "
            f"unroll={unroll!r}; e.g. unroll=2."
        )
