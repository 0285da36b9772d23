"""Claims: which trial measures which configuration, and the study's budget, shared by every worker on a study.

Several processes (one per host) may tune one study through an RDB storage. Optuna alone lets two of them
sample the same configuration at once (two `GridSampler`s with one seed pick the same first grid point; TPE
proposes what another worker is timing) and lets each run its own ``n_trials``. A claim is a row of a small
table beside Optuna's, in the same database: ``(study, slot) -> (configuration, trial number)``, unique per
slot and per configuration. A trial measures a configuration only after winning its claim with an INSERT that
either succeeds or fails on a unique key, on SQLite and PostgreSQL alike, so of two workers racing for one
configuration, or for the study's last slot, exactly one wins. ``slot < budget`` makes the budget the study's:
two workers asked for 6 trials settle 6 configurations together, not 12.

A claim whose trial died without settling (killed, interrupted, failed for a reason that is not the
configuration's) is taken over by a compare-and-set, so the configuration (or the slot) is not lost.
"""

from __future__ import annotations

import abc
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

import optuna

_RUNNING = optuna.trial.TrialState.RUNNING
_COMPLETE = optuna.trial.TrialState.COMPLETE
_FAIL = optuna.trial.TrialState.FAIL
TABLE = "autoaccum_claims"
ATTEMPTS = 200
"""Claim attempts before giving up: each failed attempt means another worker's claim went through first."""

Row = tuple[str, int]  # (configuration, trial number)


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
    return trial.state == _COMPLETE or (trial.state == _FAIL and "reason" in trial.user_attrs)


def holds(trial: optuna.trial.FrozenTrial | None, config: str) -> bool:
    """Whether ``trial`` still holds its claim on ``config``: it is that configuration's trial and is running or
    has settled it. A trial that died, was interrupted or does not exist (a claim left by a deleted study) does
    not."""
    if trial is None or config_key(trial.params) != config:
        return False
    return trial.state == _RUNNING or settled(trial)


class Claims(abc.ABC):
    """The claims of one study: ``{slot: (configuration, trial number)}``, one slot per configuration.

    Subclasses store the rows and make `insert` and `replace` atomic; `claim` is the policy.
    """

    @abc.abstractmethod
    def rows(self) -> dict[int, Row]:
        """Every claim of the study, ``{slot: (configuration, trial number)}``."""

    @abc.abstractmethod
    def insert(self, slot: int, row: Row) -> bool:
        """Adds ``row`` at ``slot``; False when the slot or the configuration is claimed already."""

    @abc.abstractmethod
    def replace(self, slot: int, old: Row, new: Row) -> bool:
        """Compare-and-set: ``slot`` becomes ``new`` if it still holds ``old``; False otherwise."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Forgets every claim of the study (``fresh=True``)."""

    def claim(
        self,
        config: str,
        number: int,
        budget: int | None,
        trials: Callable[[], Mapping[int, optuna.trial.FrozenTrial]],
    ) -> int | None:
        """Claims ``config`` for trial ``number``.

        Args:
          config: the configuration (`config_key`).
          number: the claiming trial's number.
          budget: the study's number of slots (configurations); None: no limit (recording earlier trials).
          trials: the study's trials by number, read fresh (after the claims, so no new claim looks dead).

        Returns:
          The number of the trial that holds ``config``: ``number`` when the claim is won, another trial when
          that one is running or has settled it; None when ``budget`` configurations are claimed.
        """
        for _ in range(ATTEMPTS):
            rows = self.rows()
            by_config = {row[0]: (slot, row) for slot, row in rows.items()}
            if config in by_config:
                slot, row = by_config[config]
                if row[1] == number or holds(trials().get(row[1]), config):
                    return row[1]
                if self.replace(slot, row, (config, number)):  # its trial died: take the claim over
                    return number
                continue
            slots = range(budget) if budget is not None else range(len(rows) + 1)
            free = [s for s in slots if s not in rows]
            if free:
                if self.insert(free[0], (config, number)):
                    return number
                continue
            assert budget is not None
            now = trials()
            dead = [(s, row) for s, row in sorted(rows.items()) if s < budget and not holds(now.get(row[1]), row[0])]
            if not dead:
                return None
            slot, row = dead[0]
            if self.replace(slot, row, (config, number)):  # a slot whose trial died: this configuration takes it
                return number
        raise RuntimeError(f"could not claim {config} in {ATTEMPTS} attempts: the claims table is contended.")


class LocalClaims(Claims):
    """Claims kept in this process: for storages only this process uses (``":memory:"``)."""

    def __init__(self) -> None:
        self._rows: dict[int, Row] = {}

    def rows(self) -> dict[int, Row]:
        return dict(self._rows)

    def insert(self, slot: int, row: Row) -> bool:
        if slot in self._rows or any(r[0] == row[0] for r in self._rows.values()):
            return False
        self._rows[slot] = row
        return True

    def replace(self, slot: int, old: Row, new: Row) -> bool:
        if self._rows.get(slot) != old or any(r[0] == new[0] for s, r in self._rows.items() if s != slot):
            return False
        self._rows[slot] = new
        return True

    def clear(self) -> None:
        self._rows.clear()


class TableClaims(Claims):
    """Claims in the table ``autoaccum_claims`` of an RDB storage's database, keyed by Optuna's study id.

    The table is created when first needed; its unique keys make `insert` and `replace` atomic.
    """

    def __init__(self, engine: Any, study_id: int) -> None:
        import sqlalchemy as sa

        self._sa = sa
        self._engine = engine
        self._study_id = study_id
        metadata = sa.MetaData()
        self._table = sa.Table(
            TABLE,
            metadata,
            sa.Column("study_id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("slot", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("config", sa.String(32), nullable=False),
            sa.Column("trial_number", sa.Integer, nullable=False),
            sa.UniqueConstraint("study_id", "config"),
        )
        for attempt in range(5):  # workers starting together race to create it: the loser finds it made
            try:
                metadata.create_all(engine, checkfirst=True)
                break
            except sa.exc.SQLAlchemyError:
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))

    def _run(self, statement: Any) -> Any:
        """Runs ``statement`` in its own transaction; a locked SQLite database is retried."""
        sa = self._sa
        for attempt in range(20):
            try:
                with self._engine.begin() as connection:
                    result = connection.execute(statement)
                    return result.fetchall() if result.returns_rows else result.rowcount
            except sa.exc.OperationalError:
                if attempt == 19:
                    raise
                time.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def rows(self) -> dict[int, Row]:
        t = self._table
        found = self._run(self._sa.select(t.c.slot, t.c.config, t.c.trial_number).where(t.c.study_id == self._study_id))
        return {int(slot): (str(config), int(number)) for slot, config, number in found}

    def insert(self, slot: int, row: Row) -> bool:
        values = {"study_id": self._study_id, "slot": slot, "config": row[0], "trial_number": row[1]}
        try:
            self._run(self._table.insert().values(**values))
        except self._sa.exc.IntegrityError:
            return False
        return True

    def replace(self, slot: int, old: Row, new: Row) -> bool:
        t = self._table
        statement = (
            t.update()
            .where(t.c.study_id == self._study_id, t.c.slot == slot)
            .where(t.c.config == old[0], t.c.trial_number == old[1])
            .values(config=new[0], trial_number=new[1])
        )
        try:
            return bool(self._run(statement) == 1)
        except self._sa.exc.IntegrityError:  # ``new``'s configuration was claimed meanwhile
            return False

    def clear(self) -> None:
        self._run(self._table.delete().where(self._table.c.study_id == self._study_id))


def open_claims(storage: optuna.storages.BaseStorage, study_id: int) -> Claims:
    """The claims of study ``study_id``: in its database for an RDB storage, else in this process (other
    storages are coordinated only as far as Optuna itself does)."""
    if isinstance(storage, optuna.storages.RDBStorage):
        return TableClaims(storage.engine, study_id)
    return LocalClaims()
