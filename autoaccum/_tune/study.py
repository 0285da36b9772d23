"""A tune's Optuna study: what identifies it (`fingerprint`), opening or resuming it (`open_study`), which of its
trials settle a configuration (`settled`, `measuring`), and Optuna kept quiet."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna

from autoaccum._isolation import _owner_alive, _process_tag
from autoaccum._tune.job import Space

State = optuna.trial.TrialState

MEASURES = "measures"
"""The user attribute a trial sets before it looks for another that measures its configuration: ``[its owner
(`owner`), its number]`` (a retried copy of a killed trial inherits the attribute; its number tells it apart)."""


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


def config_key(params: Mapping[str, Any]) -> str:
    """One configuration as a short string: a hash of its parameters (of any length: a strategy's options).

    Example:
      >>> key = config_key({"strategy": "scan", "microbatch_size": 4})
      >>> key == config_key({"microbatch_size": 4, "strategy": "scan"}), len(key)
      (True, 32)
    """
    return hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).hexdigest()[:32]


def settled(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` settled its configuration: measured it, or failed it for a reason of the configuration's
    own (out of memory, over the time limit). A copy reusing another trial's result settles nothing."""
    if "duplicate_of" in trial.user_attrs:
        return False
    return trial.state == State.COMPLETE or (trial.state == State.FAIL and "reason" in trial.user_attrs)


def measuring(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` (of any worker) is measuring its configuration or has settled it."""
    if trial.state == State.RUNNING:
        attrs = trial.user_attrs
        return bool(attrs.get(MEASURES)) and not ({"duplicate_of", "over_budget"} & attrs.keys())
    return settled(trial)


def settled_configs(study: optuna.Study) -> dict[str, int]:
    """``{configuration: trial number}`` of the configurations the study has settled (by any worker)."""
    return {config_key(t.params): t.number for t in study.get_trials(deepcopy=False) if settled(t)}


def open_study(
    storage: optuna.storages.BaseStorage, name: str, key: str, fresh: bool, bound: Callable[[], Space]
) -> tuple[optuna.Study, Space, bool]:
    """The study ``name`` of the tune of fingerprint ``key`` (created, or resumed), the sizes each setting may time,
    and whether this worker bounded them: stored with the study by the worker that bounded them first, else
    ``bound()`` now (workers that start a study at once each probe; the first to store its bounds is every one's).

    Raises:
      ValueError: the study holds the trials of another fingerprint (a ``study_name`` given twice).
    """
    if fresh:
        with contextlib.suppress(KeyError):  # no such study yet
            optuna.delete_study(study_name=name, storage=storage)
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize", load_if_exists=True)
    held = study.user_attrs.get("fingerprint")
    if held is not None and held != key:
        raise ValueError(
            f"`study_name`={name!r} holds the trials of another tune (fingerprint {held}, this one's {key}: the loss, "
            "optimizer, shapes, limit, device or search differ); pass fresh=True to start it over, or another "
            "`study_name` (by default each fingerprint has its own)."
        )
    if held is None:
        study.set_user_attr("fingerprint", key)
    with warnings.catch_warnings():  # "experimental" in some Optuna releases
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study.set_metric_names(["examples/s"])
    stored = study.user_attrs.get("space")
    if stored is None:
        space = bound()
        stored = study.user_attrs.get("space")  # another worker's, if it finished first
        if stored is None:
            study.set_user_attr("space", space.to_dict())
    mine = stored is None
    if stored is not None:
        space = Space.from_dict(stored)
    return study, space, mine


def owner() -> str:
    """This process as the owner of the trials it measures: its host, the host's boot and `_process_tag`."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "-"
    return f"{socket.gethostname()} {boot} {_process_tag(os.getpid())}"


def _process_here(tag: Any) -> str | None:
    """The process of owner ``tag`` (`owner`) where it is of this host and boot (its `_process_tag`), else None."""
    theirs, here = str(tag).split(" ", 2), owner().split(" ", 2)
    return theirs[2] if len(theirs) == 3 and theirs[:2] == here[:2] else None


def on_this_host(trial: optuna.trial.FrozenTrial) -> bool:
    """Whether ``trial`` was claimed (`MEASURES`) by a process of this host and boot."""
    claim = trial.user_attrs.get(MEASURES)
    return isinstance(claim, list) and _process_here(claim[0]) is not None


def _ended(tag: Any) -> bool:
    """Whether owner ``tag`` (`owner`) is a process of this host and boot that has ended."""
    process = _process_here(tag)
    return process is not None and not _owner_alive(process)


def fail_stale_trials(study: optuna.Study, storage: optuna.storages.BaseStorage) -> None:
    """Optuna's ``fail_stale_trials`` (a dead worker's running trial failed, and queued again by the storage's
    ``RetryHeartbeatStaleTrialCallback``), without its ``ExperimentalWarning``: the tuner relies on it knowingly.
    A running trial whose owner on this host has ended (killed) is failed and queued at once, not after the grace
    (queued by hand where the storage keeps no heartbeats)."""
    retry = getattr(storage, "get_heartbeat_stale_trial_callback", lambda: None)()
    study_id = storage.get_study_id_from_name(study.study_name)
    for t in study.get_trials(deepcopy=False, states=(State.RUNNING,)):
        claim = t.user_attrs.get(MEASURES)
        if isinstance(claim, list) and claim[1:] == [t.number] and _ended(claim[0]):
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):  # another worker failed it
                if storage.set_trial_state_values(trial_id, State.FAIL):
                    if retry is None:
                        study.enqueue_trial(t.params)
                    else:
                        retry(study, storage.get_trial(trial_id))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's per-trial log lines are not printed inside it (the tuner reports trials through its callbacks and
    its result); the user's verbosity is restored after. Also a decorator (``@quiet_optuna()``)."""
    before = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(max(before, optuna.logging.ERROR))
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)
