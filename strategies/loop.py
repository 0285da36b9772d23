"""``loop``: two jitted functions, "accumulate gradient" and "apply update", driven from a host loop."""

from __future__ import annotations

from typing import Any

import jax
from autoaccum.strategies._base import (
    Accum,
    OutDtypes,
    Program,
    PyTree,
    Spec,
    add,
    take,
    tree_bytes,
)
from autoaccum.strategies._layout import Layout
from autoaccum.strategies._strategy import Call, Strategy, microbatch_shapes


class Loop(Strategy):
    """The classic hand-written accumulation loop.

    ``accumulate(acc, params, batch, start, state)`` adds one microbatch's weighted sums to ``acc`` (donated,
    so it is updated in place) and returns them with the microbatch's new state; ``apply(params, opt_state, acc)``
    divides by the total weight and runs the optimizer once. Each microbatch is one dispatch from Python; the batch
    stays on the device and each microbatch is sliced inside the compiled function. On one device the sums start
    from zeros (a program of broadcasts), so the first microbatch runs the program the others run, and
    the last microbatch and the optimizer step are one program (``finish``): two programs compute gradients, and
    an update takes ``k + 1`` dispatches, one of them the zeros (on the example convnet a separate optimizer step
    cost 1 ms of 9 a step); on a mesh the last microbatch and the step stay apart, so the gathered parameters are
    freed before the optimizer runs.
    """

    name = "loop"

    def __init__(self, spec: Spec, **options: Any) -> None:
        super().__init__(spec, **options)
        self._accumulate = jax.jit(
            self._accumulate_fn,
            donate_argnums=(0, *self.donate_argnums(4)),
            static_argnames=("size", "dtypes", "layout"),
        )
        self._finish = jax.jit(
            self._finish_fn, donate_argnums=self.donate_argnums(1, 2, 5), static_argnames=("size", "dtypes")
        )

    def _accumulate_fn(
        self,
        acc: Accum | None,
        params: PyTree,
        batch: PyTree,
        start: Any,
        state: PyTree,
        *,
        size: int,
        dtypes: OutDtypes,
        layout: Layout | None,
    ) -> tuple[Accum, PyTree]:
        if layout is not None:  # each device adds its own rows to its own partial sums
            return self.on_mesh(layout, host_loop=True).add(acc, params, batch, state, start, size, dtypes)
        new, state = self._grad(params, take(batch, start, size), state)
        return (new if acc is None else add(acc, new)), state

    def _finish_fn(
        self,
        acc: Accum | None,
        params: PyTree,
        opt_state: PyTree,
        batch: PyTree,
        start: Any,
        state: PyTree,
        *,
        size: int,
        dtypes: OutDtypes,
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        """The last microbatch's sums added, then the optimizer step (one device)."""
        acc, state = self._accumulate_fn(acc, params, batch, start, state, size=size, dtypes=dtypes, layout=None)
        params, opt_state, loss = self._apply_fn(params, opt_state, acc, dtypes=dtypes)
        return params, opt_state, loss, state

    def run(
        self, call: Call, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree
    ) -> tuple[PyTree, PyTree, Any, PyTree]:
        dtypes = self.out_dtypes(params, batch, state, key=call.key)
        layout = call.layout
        acc = None
        if layout is None:
            *rest, (last, last_size) = call.microbatches
            if rest:
                acc = self.zeros(params, batch, state, rest[0][1])
            for start, size in rest:
                acc, state = self._accumulate(acc, params, batch, start, state, size=size, dtypes=dtypes, layout=None)
            return self._finish(acc, params, opt_state, batch, last, state, size=last_size, dtypes=dtypes)
        # On a mesh: the parameters each microbatch's program takes, gathered once per update (or as they are),
        # and each device's own copy of the state.
        mesh = self.on_mesh(layout, host_loop=True)
        inputs, state = mesh.gathered(params), mesh.stack_state(state)
        for start, size in call.microbatches:
            acc, state = self._accumulate(acc, inputs, batch, start, state, size=size, dtypes=dtypes, layout=layout)
        del inputs  # the gathered copy, if any, is freed before the optimizer step
        params, opt_state, loss = self._apply(params, opt_state, acc, dtypes=dtypes, layout=layout)
        return params, opt_state, loss, self._combine(state)

    def programs(self, params: PyTree, opt_state: PyTree, batch: PyTree, state: PyTree = ()) -> list[Program]:
        dtypes = self.out_dtypes(params, batch, state)
        layout = self.layout(params, batch, state)
        inputs, state_in = params, state
        if layout is not None:
            mesh = self.on_mesh(layout, host_loop=True)
            inputs = mesh.gathered(params)
            state_in = jax.eval_shape(mesh.stack_state, state)
        microbatches = self.microbatches(batch)
        first = microbatches[0][1]
        kwargs: dict[str, Any] = {"dtypes": dtypes, "layout": layout}

        def accumulate(acc: Accum | None, size: int) -> jax.stages.Lowered:
            return self._accumulate.lower(acc, inputs, batch, 0, state_in, size=size, **kwargs)

        acc, _ = jax.eval_shape(
            lambda p, b, s: self._accumulate_fn(None, p, b, 0, s, size=first, **kwargs), inputs, batch, state_in
        )
        if layout is None:  # zero sums, each microbatch but the last, then the last with the optimizer step
            (*rest, (_, last)) = microbatches
            start = [self._zeros.lower(params, state, rows=microbatch_shapes(batch, first))] if rest else []
            lowered = start + [accumulate(acc, n) for n in sorted({n for _, n in rest})]
            programs = [Program(low, tree_bytes(opt_state)) for low in lowered]
            finish = self._finish.lower(
                acc if rest else None, params, opt_state, batch, 0, state, size=last, dtypes=dtypes
            )
            return [*programs, Program(finish, 0)]
        lowered = [accumulate(None, first)] + [accumulate(acc, n) for n in sorted({n for _, n in microbatches[1:]})]
        programs = [Program(low, tree_bytes(opt_state)) for low in lowered]
        programs.append(Program(self._apply.lower(params, opt_state, acc, **kwargs), tree_bytes(batch)))
        return programs
