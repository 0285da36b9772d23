"""Where autoaccum keeps things: the cache folder (studies, compiled programs) and the study storage."""

from __future__ import annotations

import os
import sys
import time
import urllib.parse
import warnings
from pathlib import Path
from typing import NoReturn

import optuna

STORAGE_ATTEMPTS = 5
HEARTBEAT_INTERVAL = 30
"""Seconds between a running trial's heartbeats in an RDB storage."""
GRACE_PERIOD = 90
"""Seconds without a heartbeat after which a running trial's worker is taken for dead and the trial re-queued."""


CACHE_FIX = (
    "set AUTOACCUM_CACHE to a folder you can write to, or pass storage=':memory:' (on the command line "
    "--storage :memory:) to keep no study"
)


def cache_folder() -> tuple[Path, str]:
    """The default storage's folder and what chose it: ``$AUTOACCUM_CACHE``, else ``$XDG_CACHE_HOME/autoaccum``,
    else ``~/.cache/autoaccum``."""
    if os.environ.get("AUTOACCUM_CACHE"):
        return Path(os.environ["AUTOACCUM_CACHE"]), "`AUTOACCUM_CACHE`"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "autoaccum", "the default cache ($XDG_CACHE_HOME/autoaccum)"
    return Path.home() / ".cache" / "autoaccum", "the default cache (~/.cache/autoaccum)"


def default_storage() -> str:
    """The default Optuna storage: a SQLite file ``studies.db`` in `cache_folder` (made if missing).

    Raises:
      ValueError: the folder cannot be made (e.g. ``AUTOACCUM_CACHE=/proc/nope``); the message names the variable
        and the fix. No silent fallback: a study kept nowhere could not be resumed.
    """
    root, what = cache_folder()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(
            f"{what}={str(root)!r} cannot hold the study database ({type(e).__name__}: {e.strerror or e}); {CACHE_FIX}."
        ) from e
    return "sqlite:///" + urllib.parse.quote(str(root / "studies.db"), safe="/")  # ('?', '%' in a folder's name)


def raise_unopenable(url: str, *, default: bool = False) -> NoReturn:
    """Re-raises the error being handled as a ``ValueError`` that names ``storage`` (or, for the ``default``
    storage, the cache folder) and the fix."""
    e = sys.exc_info()[1]
    reason = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if default:
        root, what = cache_folder()
        fix = CACHE_FIX
        if "file is not a database" in reason:  # (a file of another kind in its place: nothing to resume)
            fix = f"move {str(root / 'studies.db')!r} aside (it is not a SQLite database) to start a new one, or {fix}"
        raise ValueError(f"{what}={str(root)!r} cannot hold the study database ({reason}); {fix}.") from e
    missing = isinstance(e, ImportError)  # the database's driver: name the extra that installs PostgreSQL's
    driver = ' (no driver for it; PostgreSQL: pip install "autoaccum[postgres]")' if missing else ""
    raise ValueError(
        f"`storage`={url!r} cannot be opened ({reason}){driver}; pass an RDB "
        "URL such as 'sqlite:///studies.db' or 'postgresql+psycopg://user@host/db', or ':memory:'."
    ) from e


def open_storage(
    storage: str | optuna.storages.BaseStorage | None,
    *,
    heartbeat_interval: int = HEARTBEAT_INTERVAL,
    grace_period: int = GRACE_PERIOD,
) -> tuple[optuna.storages.BaseStorage, str]:
    """Opens ``storage`` before any trial runs; ``ValueError`` naming it when it cannot be opened.

    An RDB storage gets heartbeats every ``heartbeat_interval`` seconds: a trial whose worker died (no
    heartbeat for ``grace_period`` seconds) is re-queued once by Optuna's ``RetryHeartbeatStaleTrialCallback``.
    A storage object is used as it is.
    """
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage, type(storage).__name__
    if storage == ":memory:":
        return optuna.storages.InMemoryStorage(), ":memory:"
    url = default_storage() if storage is None else storage
    if not isinstance(url, str):
        raise TypeError(f"`storage` must be an RDB URL string, ':memory:' or an optuna storage, got {storage!r}.")
    import sqlalchemy.exc

    # Workers that open a new database at the same moment race to create its tables (IntegrityError on
    # alembic_version, or "database is locked"): the loser retries and finds them made.
    races = (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError)
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            with warnings.catch_warnings():  # heartbeats are "experimental" in Optuna; we rely on them knowingly
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                opened = optuna.storages.RDBStorage(
                    url,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                    heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
                )
            break
        except races:
            if attempt + 1 == STORAGE_ATTEMPTS:
                raise_unopenable(url, default=storage is None)
            time.sleep(0.2 * (attempt + 1))
        except (sqlalchemy.exc.SQLAlchemyError, ValueError, ImportError, OSError):
            raise_unopenable(url, default=storage is None)
    return opened, url
