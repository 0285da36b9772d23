"""The study: what identifies it (so a result is never another setup's), and Optuna kept quiet."""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Iterator
from typing import Any

import optuna


def fail_stale_trials(study: optuna.Study) -> None:
    """Optuna's ``fail_stale_trials``: the running trials whose worker's heartbeat stopped are failed (and queued
    again by the storage's ``RetryHeartbeatStaleTrialCallback``). Without Optuna's ``ExperimentalWarning``: the
    tuner relies on the feature knowingly, and the warning, meant for developers, would reach the user's terminal
    with a line of source each time a resumed study waits on a dead worker's trial."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def fingerprint(program_text: str, context: dict[str, Any]) -> str:
    """A short hash of ``program_text`` (the lowered update: the loss's body, the optimizer, shapes, dtypes)
    and ``context`` (device, memory limit, search space, versions, ...): what determines the timings.

    Example:
      >>> fingerprint("module @a {}", {"device": "cpu"}) == fingerprint("module @a {}", {"device": "cpu"})
      True
      >>> fingerprint("module @a {}", {"device": "cpu"}) == fingerprint("module @b {}", {"device": "cpu"})
      False
    """
    digest = hashlib.sha256(program_text.encode())
    digest.update(json.dumps(context, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial lines (``[I ...] Trial 3 finished ...``, and ``[W ...] Trial 0 failed ...`` with a
    traceback, for a trial that ran out of memory) are not printed while the tuner runs; the verbosity the user
    had is restored after. The tuner reports trials, and why one failed, through its callbacks and its result.
    Usable as a decorator too (``@quiet_optuna()``)."""
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(before, optuna.logging.ERROR))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)
