"""Seams into the library for tests: `autoaccum.tune` timed by a deterministic stand-in (``measure=``), which the
public signature does not take (`autoaccum._tune.trials.timed_by`)."""

from __future__ import annotations

from typing import Any

import autoaccum
from autoaccum._tune.trials import timed_by


def tune(*args: Any, measure: Any = None, **kwargs: Any) -> Any:
    """`autoaccum.tune`, its configurations timed by ``measure(update, params, batch[, state=]) -> Timing``."""
    with timed_by(measure):
        return autoaccum.tune(*args, **kwargs)


def nnx_tune(*args: Any, measure: Any = None, **kwargs: Any) -> Any:
    """`autoaccum.nnx.tune`, likewise."""
    with timed_by(measure):
        return autoaccum.nnx.tune(*args, **kwargs)
