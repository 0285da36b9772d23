"""The race: the study's best configurations (up to `FINALISTS` distinct programs, none `SLOWER_OUT` times slower
than the fastest) re-timed side by side.

Rounds are interleaved (each times every finalist still in, in an order rotated round by round), and each step
time is divided by its round's median over all finalists, so the machine's drift falls on all of them alike; only
the race's own times count. From round `MIN_ROUNDS` on, a finalist is out when it is clearly worse than the
leader: its lower quartile above the leader's upper quartile, or its median's `notch` wholly above the leader's.
The race spends ``rounds`` timings per finalist (those an early leaver leaves go to more rounds of the others),
ends when one is left or the timings are spent, and the fastest pooled relative median wins.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from autoaccum._json import JsonMixin

FINALISTS = 3
"""Configurations the race re-times at most: the study's fastest by their trials (distinct programs)."""

ROUNDS = 4
"""Rounds the race runs while every finalist stays in (its budget: this many timings per finalist)."""

MIN_ROUNDS = 2
"""Rounds every finalist runs before any is out."""

SLOWER_OUT = 2.0
"""A configuration whose trial read this many times slower than the fastest's is no finalist: beyond the drift seen
between two timings of one program on a noisy CPU (0.76-1.10, benchmarks/README.md), and its steps cost the most."""

K = TypeVar("K", bound=Hashable)


def quartiles(times: Sequence[float]) -> tuple[float, float, float]:
    """``(q1, median, q3)`` of ``times`` (one time: itself three times).

    Example:
      >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
      (1.5, 3.0, 4.5)
    """
    if len(times) == 1:
        return (times[0],) * 3
    q1, q2, q3 = statistics.quantiles(times, n=4)
    return q1, q2, q3


def notch(times: Sequence[float]) -> tuple[float, float]:
    """The median's notch, ``median -+ 1.57 IQR / sqrt(n)`` (McGill, Tukey and Larsen, 1978): about a 95% interval.

    Example:
      >>> lo, hi = notch([1.0, 2.0, 3.0, 4.0, 5.0] * 4)
      >>> round(lo, 3), round(hi, 3)
      (2.298, 3.702)
    """
    q1, median, q3 = quartiles(times)
    half = 1.57 * (q3 - q1) / math.sqrt(len(times))
    return median - half, median + half


@dataclasses.dataclass(frozen=True)
class Runner(JsonMixin):
    """One finalist of the race.

    Attributes:
      trial: the study's trial number of the configuration.
      times: every step time of its rounds, seconds (none run: its study trial's).
      rounds: the rounds it ran; out_after: the round after which it was dropped (None: it finished).
      relative: the median of its step times, each over its round's median (what the race ranks by).
      failed: why its timing failed in round `out_after` (None: it ran, or was dropped as slower).
    """

    trial: int
    times: tuple[float, ...]
    rounds: int
    out_after: int | None = None
    relative: float | None = None
    failed: str | None = None

    @property
    def quartiles(self) -> tuple[float, float, float]:
        """``(q1, median, q3)`` of `times`."""
        return quartiles(self.times)


def race(
    finalists: Sequence[tuple[K, int, Sequence[float]]],
    time_one: Callable[[K], Sequence[float] | str],
    *,
    rounds: int = ROUNDS,
) -> list[Runner]:
    """Races ``finalists`` (``(key, trial number, its trial's step times)``); ``time_one(key)`` returns a new
    timing's step times (a string: why it failed; it is out). Returns the runners ranked, the winner first. Pure
    Python.

    Example:
      >>> fast = iter([[1.0, 1.1], [0.9, 1.0]])
      >>> slow = iter([[2.0, 2.1], [2.2, 1.9]])
      >>> [r.trial for r in race([("a", 0, [1.5]), ("b", 1, [0.4])], lambda k: next(fast if k == "a" else slow))]
      [0, 1]
    """
    pooled: dict[K, list[float]] = {key: [] for key, _, _ in finalists}
    relative: dict[K, list[float]] = {key: [] for key in pooled}  # each time over its round's median
    ran = dict.fromkeys(pooled, 0)
    out: dict[K, int] = {}
    failed: dict[K, str] = {}
    alive = [key for key, _, _ in finalists]
    budget = rounds * len(alive)  # timings
    r = 0
    while len(alive) >= 2 and len(alive) <= budget:
        r += 1
        budget -= len(alive)
        shift = (r - 1) % len(alive)
        this_round: dict[K, Sequence[float]] = {}
        for key in alive[shift:] + alive[:shift]:
            times = time_one(key)
            if isinstance(times, str) or not times:  # it failed this time
                out[key], failed[key] = r, str(times or "no step time")
                continue
            this_round[key] = times
            pooled[key].extend(times)
            ran[key] += 1
        alive = [k for k in alive if k not in out]
        if not alive:
            break
        speed = statistics.median([t for times in this_round.values() for t in times])
        for key, times in this_round.items():
            relative[key].extend(t / speed for t in times)
        if r < min(MIN_ROUNDS, rounds):
            continue
        leader = min(alive, key=lambda k: quartiles(relative[k])[1])
        worst_of_leader, leader_notch = quartiles(relative[leader])[2], notch(relative[leader])[1]
        for key in alive:
            slower = quartiles(relative[key])[0] > worst_of_leader or notch(relative[key])[0] > leader_notch
            if key != leader and slower:
                out[key] = r
        alive = [k for k in alive if k not in out]
    runners = [
        Runner(
            number,
            tuple(pooled[k] or times),
            ran[k],
            out.get(k),
            quartiles(relative[k])[1] if ran[k] else None,
            failed.get(k),
        )
        for k, number, times in finalists
    ]
    return sorted(runners, key=lambda x: (x.out_after is not None, x.relative is None, x.relative or 0.0))
