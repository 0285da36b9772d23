"""Claims (`autoaccum._tune.claims`): a configuration is measured by one trial of the study, the budget is the
study's, and a claim whose trial died is taken over. The same rules in this process and in an RDB table."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from autoaccum._tune.claims import Claims, LocalClaims, TableClaims, config_key, open_claims

FAIL, COMPLETE = optuna.trial.TrialState.FAIL, optuna.trial.TrialState.COMPLETE


@pytest.fixture(params=["local", "sqlite"])
def study_and_claims(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[optuna.Study, Claims]]:
    if request.param == "local":
        study = optuna.create_study()
        yield study, LocalClaims()
        return
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'claims.db'}")
    study = optuna.create_study(storage=storage, study_name="s")
    claims = open_claims(storage, storage.get_study_id_from_name("s"))
    assert isinstance(claims, TableClaims)
    yield study, claims
    storage.remove_session()
    storage.engine.dispose()


def test_one_trial_per_configuration_within_the_studys_budget(study_and_claims: tuple[optuna.Study, Claims]) -> None:
    study, claims = study_and_claims

    def trials() -> dict[int, optuna.trial.FrozenTrial]:
        return {t.number: t for t in study.get_trials(deepcopy=False)}

    def trial(m: int) -> tuple[optuna.Trial, str]:
        study.enqueue_trial({"microbatch_size": m})
        t = study.ask()
        assert t.suggest_categorical("microbatch_size", [1, 2, 3]) == m
        return t, config_key(t.params)

    def claim(t: optuna.Trial, key: str) -> int | None:
        return claims.claim(key, t.number, 2, trials)

    (a, one), (b, one_again), (c, two), (d, three) = trial(1), trial(1), trial(2), trial(3)
    assert claim(a, one) == a.number
    assert claim(b, one_again) == a.number  # running elsewhere: not measured twice
    assert claim(c, two) == c.number
    assert claim(d, three) is None  # the budget (2) is claimed
    assert len(claims.rows()) == 2

    study.tell(a, state=FAIL)  # its worker died: the configuration is free again, for one trial
    assert claim(b, one_again) == b.number
    assert claim(a, one) == b.number
    study.tell(c, 1.0)
    assert claim(d, three) is None  # b runs, c settled: no slot is free
    study.tell(b, state=FAIL)
    assert claim(d, three) == d.number  # a dead claim's slot goes to another configuration
    assert sorted(row for row in claims.rows().values()) == sorted([(two, c.number), (three, d.number)])

    claims.clear()
    assert claims.rows() == {}
