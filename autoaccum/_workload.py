"""`Workload`: what a user hands the CLI (loss, parameters, an example batch, an optimizer), and its loader."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optax

from autoaccum._checks import check_loss_fn, check_optimizer
from autoaccum._knobs import Knobs
from autoaccum.strategies import PyTree, leading_size


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
      state: the model state, when ``loss_fn(params, batch, state) -> (loss, state)`` takes one.
      loss_reduction: ``"mean"`` or ``"sum"`` (`autoaccum.build_update`).
      name: a short name for reports.
      memory_limit: the memory limit the CLI uses when ``--memory-limit`` is not given (e.g. ``"64MiB"``);
        None: the device's default. The demo sets one, so that its effective batch does not fit in one step.
      knobs: the loss's own knobs (`autoaccum.Knobs`), which ``autoaccum tune`` searches beside the built-in
        ones; ``loss_fn`` is then the loss of their default values (what ``probe`` and ``plan`` use).
      api: how the user trains with a plan, which the CLI's code snippet shows: ``"pytree"`` (`autoaccum.Plan.build`)
        or ``"nnx"`` (`autoaccum.nnx.build_update`, set by `autoaccum.nnx.workload`).
    """

    loss_fn: Callable[..., Any]
    params: PyTree
    batch: PyTree
    optimizer: optax.GradientTransformation
    has_aux: bool = False
    state: PyTree | None = None
    loss_reduction: str = "mean"
    name: str = "workload"
    memory_limit: str | int | None = None
    knobs: Knobs | None = None
    api: str = "pytree"

    def __post_init__(self) -> None:
        check_loss_fn(self.loss_fn)
        if self.api not in ("pytree", "nnx"):
            raise ValueError(f'`Workload.api` must be "pytree" or "nnx", got api={self.api!r}.')
        if self.knobs is not None and not isinstance(self.knobs, Knobs):
            raise TypeError(
                f"`Workload.knobs` must be an autoaccum.Knobs (a loss factory and the values to try) or None, got "
                f"{type(self.knobs).__name__}: {self.knobs!r}."
            )
        check_optimizer(self.optimizer, "Workload.optimizer")
        leading_size(self.batch)

    @property
    def batch_size(self) -> int:
        return leading_size(self.batch)


class WorkloadError(ValueError):
    """A workload cannot be loaded: the message says which file, module or function, what went wrong, and how
    to fix it (the CLI turns it into exit code 2)."""


def load_workload(target: str) -> Workload:
    """Loads ``target`` = ``path/to/file.py:function`` or ``package.module:function`` and calls the function.

    A file is loaded the way ``python path/to/file.py`` would run it: its folder first on ``sys.path``, so
    that it can import the modules beside it (``from models import ResNet18``). It gets a module name of its own,
    which child processes (probe trials, the tuning worker) cannot import: they load the same file under the same
    name when a trial's job refers to it (`autoaccum._isolation.payload`).

    Raises:
      WorkloadError: the file, module or function does not exist, importing or calling it raised (the
        message carries the end of its traceback), or the function returns something other than a `Workload`.
    """
    if not isinstance(target, str) or ":" not in target:
        raise WorkloadError(
            f"workload {target!r} must look like `path/to/file.py:function` or `package.module:function`."
        )
    where, _, attr = target.rpartition(":")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise WorkloadError(f"workload file {str(path)!r} does not exist (from {target!r}).")
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)  # as `python path/to/file.py` does: its siblings are importable
        name = f"_autoaccum_workload_{abs(hash(path.resolve()))}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        _run(lambda: spec.loader.exec_module(module), f"importing workload file {str(path)!r}", target)  # type: ignore[union-attr]
    else:
        try:
            found = importlib.util.find_spec(where)
        except (ImportError, ValueError):
            found = None
        if found is None:
            file = Path(*where.split(".")).with_suffix(".py")
            hint = f"; the file {str(file)!r} is here: give {f'{file}:{attr}'!r}" if file.is_file() else ""
            raise WorkloadError(
                f"workload module {where!r} cannot be found (from {target!r}); give an importable module or a "
                f"path to a .py file{hint}."
            )
        module = _run(lambda: importlib.import_module(where), f"importing workload module {where!r}", target)
    fn = getattr(module, attr, None)
    if not callable(fn):
        known = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        what = f"no function {attr!r}" if fn is None else f"{attr!r}, but it is {type(fn).__name__}, not a function"
        raise WorkloadError(
            f"{where!r} has {what} (from {target!r}); it defines: {', '.join(known) or 'nothing callable'}."
        )
    workload = _run(fn, f"calling {attr}() from {where!r}", target)
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"{target!r} returned {type(workload).__name__}, not an autoaccum.Workload; return "
            "autoaccum.Workload(loss_fn, params, batch, optimizer)."
        )
    return workload


def _run(fn: Callable[[], Any], doing: str, target: str) -> Any:
    """``fn()``; any exception it raises becomes a `WorkloadError` that says what was being done and shows the
    end of the traceback (the workload's own code is the user's: anything may go wrong in it)."""
    try:
        return fn()
    except Exception as e:  # the user's code: every failure is reported as a bad workload
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith((_OWN, "<"))][-2:]
        tail = "".join(traceback.format_list(frames)).rstrip()  # the user's frames (none: the call itself failed)
        said = f"{doing} failed ({type(e).__name__}: {e}) for {target!r}"
        raise WorkloadError(said + f":\n{tail}" * bool(tail)) from e


_OWN = str(Path(__file__).resolve().parent)
"""This package's folder: its frames are left out of a workload's traceback."""
