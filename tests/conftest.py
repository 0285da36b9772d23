"""Strict test set-up: rank promotion raises, 8 CPU devices (meshes), warnings are errors (pyproject), and XLA's
LLVM backend at -O0: compiling is most of the suite's time, and -O0 leaves XLA's own passes (fusion, buffer
assignment: the memory figures tests check) as they are. A run of your own: set XLA_FLAGS first."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")

from collections.abc import Iterator

import jax
import pytest

from autoaccum import strategies

jax.config.update("jax_numpy_rank_promotion", "raise")


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    report = os.environ.get("AUTOACCUM_GPU_REPORT")  # the kit's checks then read a card's report, here too
    for item in items:
        if "gpu" in item.keywords and not (report and "card" in getattr(item, "fixturenames", ())):
            item.add_marker(skip)


class Unrolled(strategies.Scan):
    """A strategy of a user's own, built on the toolkit and registered: ``scan`` fully unrolled."""

    name = "unrolled"
    options = {"unroll": (True,)}  # noqa: RUF012


# The conformance suites (test_strategies, test_state) run over every registered strategy, a user's own included
# (registered for the test).
@pytest.fixture(params=[*strategies.available(), Unrolled.name], ids=lambda name: f"strategy={name}")
def strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    added = request.param not in strategies.available()
    if added:
        strategies.register(Unrolled)
    try:
        yield request.param
    finally:
        if added:
            strategies.unregister(Unrolled.name)
