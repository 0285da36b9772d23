"""`Workload`: what a user hands the CLI (loss, parameters, an example batch, an optimizer), and its loader."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optax

from strategies._base import PyTree, leading_size


@dataclasses.dataclass(frozen=True)
class Workload:
    """A training problem: ``loss_fn(params, batch)``, ``params``, one example ``batch`` and an optimizer.

    The CLI loads a function returning one of these (``path/to/file.py:function`` or
    ``package.module:function``); ``autoaccum.workloads`` has the built-in ones.

    Attributes:
      loss_fn: the mean loss over the batch's examples (``-> (loss, aux)`` when ``has_aux``).
      params: the parameters pytree.
      batch: an example batch; its leading size is the default effective batch.
      optimizer: the optax optimizer to step.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      name: a short name for reports.
    """

    loss_fn: Callable[..., Any]
    params: PyTree
    batch: PyTree
    optimizer: optax.GradientTransformation
    has_aux: bool = False
    name: str = "workload"

    def __post_init__(self) -> None:
        if not callable(self.loss_fn):
            raise TypeError(f"`Workload.loss_fn` must be callable, got {type(self.loss_fn).__name__}.")
        if not (hasattr(self.optimizer, "init") and hasattr(self.optimizer, "update")):
            raise TypeError(
                f"`Workload.optimizer` must be an optax.GradientTransformation, got {type(self.optimizer).__name__}."
            )
        leading_size(self.batch)

    @property
    def batch_size(self) -> int:
        return leading_size(self.batch)


def load_workload(target: str) -> Workload:
    """Loads ``target`` = ``path/to/file.py:function`` or ``package.module:function`` and calls the function.

    Raises:
      click-friendly ``ValueError``: the file, module or function does not exist, or the function returns
      something other than a `Workload`.
    """
    if not isinstance(target, str) or ":" not in target:
        raise ValueError(f"workload {target!r} must look like `path/to/file.py:function` or `package.module:function`.")
    where, _, attr = target.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"workload file {str(path)!r} does not exist (from {target!r}).")
        name = f"_autoaccum_workload_{abs(hash(path.resolve()))}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            raise ValueError(f"workload module {where!r} cannot be imported ({e}); from {target!r}.") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        known = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ValueError(f"{where!r} has no function {attr!r} (from {target!r}); it defines: {', '.join(known)}.")
    workload = fn()
    if not isinstance(workload, Workload):
        raise ValueError(
            f"{target!r} returned {type(workload).__name__}, not an autoaccum.Workload; return "
            "autoaccum.Workload(loss_fn, params, batch, optimizer)."
        )
    return workload


def resize_batch(batch: PyTree, size: int) -> PyTree:
    """A new batch of ``size`` examples made from ``batch`` by repeating its rows cyclically (on the host).

    ``batch`` itself is not changed. Example:
      >>> import numpy as np
      >>> resize_batch({"x": np.arange(3)}, 5)["x"].tolist()
      [0, 1, 2, 0, 1]
    """
    import jax
    import numpy as np

    total = leading_size(batch)
    index = np.arange(size) % total
    return jax.tree.map(lambda x: np.take(np.asarray(x), index, axis=0), batch)
