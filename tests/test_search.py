"""The tuner's search (`autoaccum._tune.search`), on synthetic throughput landscapes: no JAX, no Optuna."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from autoaccum._tune.run import default_budget
from autoaccum._tune.search import MIN_GAIN, Config, Search, Trial, clearly_faster

STRATEGIES = ("scan", "scan:unroll=2", "loop", "multisteps")
SIZES = (1, 2, 4, 8, 16, 32, 64)  # a probe's bound of 83 at an effective batch of 256: sizes up to 64


def run(
    search: Search,
    seconds: Callable[[Config], float | None],
    rng: random.Random,
    budget: int,
    noise: float = 0.10,
) -> list[Trial]:
    """Times what ``search`` proposes, one at a time, until it proposes nothing or ``budget`` trials are spent.
    ``seconds(config)``: the true step time (None: out of memory); each trial reads it scaled by a drift of up to
    ``noise`` (the machine's speed in that trial), its five steps spread by 1% around that."""
    trials: list[Trial] = []
    while len(trials) < budget:
        proposed = search.propose(trials)
        if not proposed:
            break
        config = proposed[0]
        true = seconds(config)
        if true is None:
            trials.append(Trial(config, None))
            continue
        drift = 1 + rng.uniform(-noise, noise)
        times = tuple(true * drift * (1 + rng.uniform(-0.01, 0.01)) for _ in range(5))
        trials.append(Trial(config, search.effective_batch / sorted(times)[2], times))
    return trials


def convnet(config: Config) -> float:
    """The WideResNet's shape on a CPU: scan 8x slower than the others at every size, faster as the size shrinks;
    the others flat."""
    if config.strategy.startswith("scan"):
        return 8.0 * (config.microbatch_size / 64) ** 0.3
    return 1.0


@pytest.mark.parametrize("seed", range(40))
def test_a_strategy_slower_at_every_size_never_hides_the_fast_ones(seed: int) -> None:
    """Every strategy is timed at the largest size before any smaller size is, so the fast strategies are found
    at a large size; the descent, level on the fast ones up to the noise, stops instead of running to 1."""
    search = Search([SIZES], STRATEGIES, 256)
    budget = default_budget(len(SIZES) * len(STRATEGIES), len(STRATEGIES))
    trials = run(search, convnet, random.Random(seed), budget)
    first_small = next(i for i, t in enumerate(trials) if t.config.microbatch_size < 64)
    assert {t.config.strategy for t in trials[:first_small]} == set(STRATEGIES)
    best = max(trials, key=lambda t: t.throughput or 0.0)
    assert not best.config.strategy.startswith("scan")
    assert min(t.config.microbatch_size for t in trials) >= 8, [t.config for t in trials]


def test_a_descent_that_gains_less_than_the_noise_stops() -> None:
    """Each halving is 1% faster, with no spread at all: below `MIN_GAIN`, so the descent stops after one step."""
    search = Search([SIZES], ("loop",), 256)
    trials = run(search, lambda c: 1.0 * 0.99 ** (6 - math.log2(c.microbatch_size)), random.Random(0), 20, noise=0)
    assert sorted(t.config.microbatch_size for t in trials) == [32, 64]


def test_a_descent_goes_on_while_each_half_is_clearly_faster() -> None:
    """Fastest at 8, each halving from 64 to 8 at least 20% faster, slower below: the descent times 32, 16, 8
    and 4 (where it is slower), then the other strategies at 8."""
    speed = {64: 2.0, 32: 1.6, 16: 1.3, 8: 1.0, 4: 1.2, 2: 1.5, 1: 2.0}
    search = Search([SIZES], ("scan", "loop"), 256)
    trials = run(
        search, lambda c: speed[c.microbatch_size] * (1.1 if c.strategy == "loop" else 1.0), random.Random(0), 30, 0
    )
    configs = [(t.config.microbatch_size, t.config.strategy) for t in trials]
    assert configs[:2] == [(64, "scan"), (64, "loop")]
    assert [m for m, s in configs[2:6]] == [32, 16, 8, 4] and (8, "loop") in configs
    assert not any(m < 4 for m, _ in configs)


def test_a_strategy_out_of_memory_at_the_largest_size_goes_on_at_the_next_size_down() -> None:
    """loop's accumulating step runs out of memory from 16 up: it is tried at 32, 16, then 8, where it fits, before
    the descent begins; the other knob setting (index 1, a smaller bound) starts at its own largest size."""
    search = Search([SIZES, (1, 2, 4, 8)], ("scan", "loop"), 256)
    oom = {("loop", 64), ("loop", 32), ("loop", 16)}
    seconds = lambda c: None if (c.strategy, c.microbatch_size) in oom else 1.0 + 0.1 * c.setting  # noqa: E731
    trials = run(search, seconds, random.Random(0), 6, noise=0)
    configs = [dataclass_tuple(t.config) for t in trials]
    assert configs == [
        (64, "scan", 0),
        (64, "loop", 0),
        (32, "loop", 0),
        (16, "loop", 0),
        (8, "loop", 0),
        (8, "scan", 1),
    ]


def dataclass_tuple(config: Config) -> tuple[int, str, int]:
    return config.microbatch_size, config.strategy, config.setting


def test_configurations_of_one_program_are_proposed_once() -> None:
    """The search asks for each program once: at two steps scan's unrolls compile alike, and so does every
    strategy at the whole batch."""

    def program(c: Config) -> tuple[object, ...]:
        steps = -(-64 // c.microbatch_size)
        if steps == 1:
            return ("plain",)
        return (c.strategy.split(":")[0], c.microbatch_size) if steps <= 2 else (c.strategy, c.microbatch_size)

    search = Search([(8, 16, 32, 64)], ("scan", "scan:unroll=2", "scan:unroll=8", "loop"), 64, program)
    proposed = search.propose([])
    assert [(c.microbatch_size, c.strategy) for c in proposed] == [(64, "scan"), (32, "scan"), (32, "loop")]


def test_the_proposal_is_a_function_of_the_trials_alone() -> None:
    """The same trials in another order give the same proposal (several workers read one study)."""
    rng = random.Random(3)
    search = Search([SIZES, (1, 2, 4)], STRATEGIES, 256)
    trials = run(search, convnet, rng, 7)
    shuffled = trials[:]
    rng.shuffle(shuffled)
    assert search.propose(trials) == search.propose(shuffled)


def test_clearly_faster_needs_the_gain_and_the_spreads_apart() -> None:
    c = Config(8, "loop")
    fast, slow = (1.00, 1.01, 1.02, 1.03, 1.04), (1.10, 1.11, 1.12, 1.13, 1.14)
    assert clearly_faster(Trial(c, 1 / 1.02, fast), Trial(c, 1 / 1.12, slow))
    assert not clearly_faster(Trial(c, 1 / 1.12, slow), Trial(c, 1 / 1.02, fast))
    wide = (0.80, 0.90, 1.02, 1.20, 1.30)  # a 10% gain inside a 20% spread
    assert not clearly_faster(Trial(c, 1 / 1.02, wide), Trial(c, 1 / 1.12, slow))
    assert not clearly_faster(Trial(c, 1 + MIN_GAIN / 2), Trial(c, 1.0))
    assert not clearly_faster(Trial(c, None), Trial(c, 1.0)) and not clearly_faster(Trial(c, 1.0), Trial(c, None))
