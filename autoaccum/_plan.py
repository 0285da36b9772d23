"""`Plan`: how to run one accumulated update, as the tuner measured it; saved to and loaded from JSON."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from autoaccum._batch import abstract, as_arrays
from autoaccum._catalog import entry_for
from autoaccum._device import device_kind
from autoaccum._json import JsonMixin
from autoaccum._knobs import Knobs, resolve
from autoaccum._units import format_bytes
from autoaccum._update import Update, build_update
from autoaccum._value_and_grad import value_and_grad
from autoaccum.strategies import Auto, PyTree, Scan, Schedule, tree_bytes
from autoaccum.strategies import get as get_strategy


def params_signature(params: PyTree) -> dict[str, str]:
    """``{path: "dtype[shape]"}`` for every leaf of ``params`` (nnx Variables by their values' paths): what a plan
    was tuned for."""
    return {
        jax.tree_util.keystr(path) or "<root>": f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract(as_arrays(params), sharded=False))
    }


def opt_state_bytes(optimizer: optax.GradientTransformation, params: PyTree) -> int:
    """The bytes of ``optimizer.init(params)``, from shapes (nothing is allocated)."""
    return tree_bytes(jax.eval_shape(optimizer.init, abstract(params, sharded=False)))


def versions() -> dict[str, str]:
    """The versions of autoaccum and the libraries a plan was made with."""
    import flax
    import jaxlib
    import optuna

    from autoaccum._version import __version__

    return {
        "autoaccum": __version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
        "flax": flax.__version__, "optuna": optuna.__version__,
    }  # fmt: skip


def describe_difference(expected: dict[str, str], actual: dict[str, str], limit: int = 5) -> str:
    """A short human description of how two `params_signature` dicts differ ("" when equal)."""
    lines = [f"missing {k} ({v})" for k, v in expected.items() if k not in actual]
    lines += [f"unexpected {k} ({v})" for k, v in actual.items() if k not in expected]
    lines += [
        f"{k}: plan has {v}, params have {actual[k]}" for k, v in expected.items() if k in actual and actual[k] != v
    ]
    more = f"; and {len(lines) - limit} more" if len(lines) > limit else ""
    return "; ".join(lines[:limit]) + more


@dataclasses.dataclass(frozen=True)
class Plan(JsonMixin):
    """How to run one accumulated update: the tuner's best configuration, with what it was measured on.

    Attributes:
      effective_batch: examples per update (``B``).
      microbatch_size: examples per microbatch.
      accumulation_steps: microbatches per update, ``ceil(B / microbatch_size)``.
      strategy: the accumulation strategy (``autoaccum.strategies.available()``).
      options: the strategy's options, e.g. ``{"unroll": 2}``.
      throughput: measured examples per second of the whole update (0.0 if not measured).
      source: ``"measured"`` (by `autoaccum.tune`) or ``"predicted"`` (by ``autoaccum plan --out``, from the
        compile-only estimate for ``device``; nothing was run).
      device: the device it was measured on (`autoaccum._device.device_kind`), e.g. ``"NVIDIA H100 80GB HBM3"``, or
        on the CPU its model and cores, ``"AMD EPYC 7B13 (2 cores)"``.
      has_aux: whether the loss returns ``(loss, aux)``.
      has_state: whether the loss threads a model state (``loss_fn(params, batch, state)``).
      loss_reduction: ``"mean"`` or ``"sum"`` (`autoaccum.build_update`).
      accumulator_dtype: the accumulator dtype's name.
      remat: the ``jax.checkpoint`` policy around each microbatch's loss (`autoaccum.build_update`'s ``remat``),
        or None.
      knobs: the values of the loss's own knobs (`autoaccum.Knobs`) it was tuned with, ``{}`` without any.
      params: the parameters it was tuned for, as `params_signature`.
      versions: autoaccum and jax versions at tuning time.
      opt_state_bytes: the optimizer's state of those parameters, in bytes (`opt_state_bytes`; None: not recorded):
        `build` with ``params`` warns where another optimizer's state of them needs more (its microbatch may then
        not fit).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> plan = Plan(effective_batch=10, microbatch_size=4, accumulation_steps=3, strategy="scan")
      >>> Plan.from_json(plan.to_json()) == plan
      True
    """

    effective_batch: int
    microbatch_size: int
    accumulation_steps: int
    strategy: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    throughput: float = 0.0
    source: str = "measured"
    device: str = ""
    has_aux: bool = False
    has_state: bool = False
    loss_reduction: str = "mean"
    accumulator_dtype: str = "float32"
    remat: str | None = None
    knobs: dict[str, Any] = dataclasses.field(default_factory=dict)
    params: dict[str, str] = dataclasses.field(default_factory=dict)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    opt_state_bytes: int | None = None

    json_format = "autoaccum.plan/1"

    def __post_init__(self) -> None:
        for name in ("effective_batch", "microbatch_size", "accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Plan `{name}` must be an int >= 1, got {value!r}.")
        if self.microbatch_size > self.effective_batch:
            raise ValueError(
                f"Plan microbatch_size={self.microbatch_size} is above effective_batch={self.effective_batch}; a "
                "microbatch is at most the whole batch."
            )
        if self.accumulation_steps != -(-self.effective_batch // self.microbatch_size):
            raise ValueError(
                f"Plan accumulation_steps={self.accumulation_steps} does not match "
                f"ceil(effective_batch / microbatch_size) = ceil({self.effective_batch} / {self.microbatch_size})."
            )
        for name, allowed in (("loss_reduction", ("mean", "sum")), ("source", ("measured", "predicted"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"Plan `{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.accumulator_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(
                f"Plan `accumulator_dtype` must name a floating dtype ('float32', 'bfloat16', ...), got "
                f"{self.accumulator_dtype!r}."
            )

    def save(self, path: str | Path) -> Path:
        """Writes the plan as JSON to ``path`` and returns the path."""
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Reads a plan saved by `save`.

        Raises:
          FileNotFoundError: no file at ``path``.
          ValueError: the file is not a valid plan (corrupt, truncated, another format).
        """
        path = Path(path)
        if not path.is_file():
            what = "is a folder, not a file" if path.is_dir() else "does not exist"
            raise FileNotFoundError(
                f"plan file {str(path)!r} {what}; create one with `autoaccum tune --out` (or, for a card you do not "
                "have, `autoaccum plan --out`)."
            )
        return cls.from_json(
            path.read_text(), source=f"plan file {str(path)!r} (re-create it with `autoaccum tune --out`)"
        )

    def check_params(self, params: PyTree) -> None:
        """Raises ``ValueError`` saying what differs if ``params`` are not the ones this plan was tuned for."""
        if not self.params:
            return
        actual = params_signature(params)
        difference = describe_difference(self.params, actual)
        if difference:  # a plan that recorded nnx Variables' paths (".value" last), as plans did before
            recorded = {k.removesuffix(".value"): v for k, v in self.params.items()}
            difference = difference if recorded == self.params else describe_difference(recorded, actual)
        if difference:
            raise ValueError(f"this plan was tuned for different params: {difference}.")

    def check_optimizer(self, optimizer: optax.GradientTransformation, params: PyTree, stacklevel: int = 2) -> None:
        """Warns where ``optimizer``'s state of ``params`` needs more bytes than the plan was made with."""
        if self.opt_state_bytes is None:  # (a plan that did not record it)
            return
        now = opt_state_bytes(optimizer, params)
        if now > self.opt_state_bytes:
            warnings.warn(
                f"this optimizer's state of these params needs {format_bytes(now)}, and the plan was made with one of "
                f"{format_bytes(self.opt_state_bytes)}: its microbatch may not fit; tune again with it.",
                UserWarning,
                stacklevel=stacklevel + 1,
            )

    def update_options(self) -> dict[str, Any]:
        """The `autoaccum.build_update` arguments this plan sets, besides the loss, the optimizer, ``has_state``
        and ``donate``.

        Example:
          >>> plan = Plan(effective_batch=10, microbatch_size=4, accumulation_steps=3, strategy="scan")
          >>> plan.update_options()["microbatch_size"]
          4

        Warns:
          UserWarning: the plan was measured on another device or jax version than this process runs, or predicted
            for a catalogued card this process does not run on (its microbatch may not fit, or not be the fastest,
            here: tune again).
        """
        here = {"device": device_kind(), "jax": jax.__version__}
        if self.device == jax.devices()[0].platform == "cpu":  # (a plan saved before the CPU's model was recorded)
            here["device"] = "cpu"
        there = {"device": self.device, "jax": self.versions.get("jax", here["jax"])}
        target = entry_for(self.device) if self.source == "predicted" else None  # (a catalogued card's name)
        if target is not None and target != entry_for(here["device"]):
            warnings.warn(
                f"this plan was predicted for {self.device} from XLA's compiler (nothing ran), and this process runs "
                f"{here['device']}: its microbatch may not fit here; tune here (autoaccum.tune, or `autoaccum tune "
                "--out`).",
                UserWarning,
                stacklevel=3,
            )
        if self.source == "measured" and self.device and there != here:
            warnings.warn(
                f"this plan was measured on {there['device']} with jax {there['jax']}, and this process runs "
                f"{here['device']} with jax {here['jax']}: its microbatch may not fit or be the fastest here; tune "
                "again here (autoaccum.tune, or `autoaccum tune --out`).",
                UserWarning,
                stacklevel=3,
            )
        return dict(
            microbatch_size=self.microbatch_size,
            strategy=self.strategy,
            has_aux=self.has_aux,
            loss_reduction=self.loss_reduction,
            accumulator_dtype=np.dtype(self.accumulator_dtype),
            remat=self.remat,
            **self.options,
        )

    def value_and_grad(
        self, loss_fn: Callable[..., Any] | Knobs, *, params: PyTree | None = None, has_aux: bool | None = None
    ) -> Callable[..., Any]:
        """The `autoaccum.value_and_grad` this plan describes, for a training step of your own.

        ``loss_fn`` is as for `build` (``has_state`` is the plan's); ``params``, if given, are checked first;
        ``has_aux`` says whether ``loss_fn`` returns ``(loss, aux)`` (default: the plan's; it describes the loss
        you pass, which may return metrics the tuned one did not). For an nnx model:
        ``autoaccum.nnx.value_and_grad(loss_fn, plan=plan)``.

        Raises:
          ValueError: the plan's strategy runs its microbatches from the host (``loop``, ``multisteps``), which
            cannot live inside a jit; or ``params`` differ from the plan's.

        Example:
          >>> import jax.numpy as jnp
          >>> plan = Plan(effective_batch=10, microbatch_size=4, accumulation_steps=3, strategy="scan")
          >>> grad_fn = plan.value_and_grad(lambda w, b: jnp.mean(b @ w))
          >>> loss, grads = grad_fn(jnp.ones(3), jnp.ones((10, 3)))
          >>> float(loss)
          3.0
        """
        if params is not None:
            self.check_params(params)
        options = self.value_and_grad_options(has_aux=has_aux)
        return value_and_grad(resolve(loss_fn, self.knobs), has_state=self.has_state, **options)

    def value_and_grad_options(self, entry: str = "autoaccum", has_aux: bool | None = None) -> dict[str, Any]:
        """The `autoaccum.value_and_grad` arguments this plan sets, besides the loss and ``has_state`` (``has_aux``
        the plan's unless given: it describes the loss passed); a refusal's fixes name ``entry``'s functions
        (``"autoaccum.nnx"`` for an nnx model).

        Raises:
          ValueError: the plan's strategy runs on the host and cannot live inside a jit.
        """
        if self.strategy != Auto.name and not issubclass(get_strategy(self.strategy), Scan):
            raise ValueError(
                f"this plan's strategy {self.strategy!r} runs its microbatches from a host loop, which cannot live "
                "inside a jit (value_and_grad runs in your jitted step); use the scan strategy at the plan's "
                f"microbatch: {entry}.value_and_grad(loss_fn, microbatch_size={self.microbatch_size}, ...)"
                + (
                    ", or dataclasses.replace(plan, strategy='scan').value_and_grad(loss_fn); or build the whole step,"
                    " plan.build(loss_fn, optimizer)."
                    if entry == "autoaccum"
                    else f", or plan=dataclasses.replace(plan, strategy='scan'); or build the whole step, "
                    f"{entry}.build_update(loss_fn, plan=plan)."
                )
            )
        options = self.update_options()
        del options["strategy"]
        return options if has_aux is None else {**options, "has_aux": has_aux}

    def build(
        self,
        loss_fn: Callable[..., Any] | Knobs,
        optimizer: optax.GradientTransformation,
        *,
        params: PyTree | None = None,
        donate: bool = True,
        state_update: Schedule = "per_microbatch",
    ) -> Update:
        """The `Update` this plan describes (``params``, if given, are checked against the plan first).

        ``loss_fn`` is the loss function, or, for a plan tuned with knobs of the loss's own, the `autoaccum.Knobs`
        it was tuned with: the loss is then ``make_loss(**plan.knobs)``. ``donate`` and ``state_update`` are as
        for `autoaccum.build_update` (a plan does not record them). For an nnx model and optimizer build the nnx
        step instead: ``autoaccum.nnx.build_update(loss_fn, plan=plan)``.

        Raises:
          ValueError: ``params`` differ from the plan's, or the plan has knobs and ``loss_fn`` is a plain function
            (or the other way round, a `Knobs` whose names differ from the plan's).
        """
        if params is not None:
            self.check_params(params)
            self.check_optimizer(optimizer, params, stacklevel=2)
        return build_update(
            resolve(loss_fn, self.knobs),
            optimizer,
            has_state=self.has_state,
            donate=donate,
            state_update=state_update,
            **self.update_options(),
        )
