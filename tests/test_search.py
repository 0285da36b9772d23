"""The tuner's search (`autoaccum._tune.search`), on synthetic throughput landscapes: no JAX, no Optuna."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable

import pytest

from autoaccum._tune.race import FINALISTS, race
from autoaccum._tune.search import MIN_GAIN, Config, Search, Trial, clearly_faster
from autoaccum._tune.trials import ceiling

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
    at a large size; the descent, level on the fast ones up to the noise, stops within a few halvings instead of
    running to 1."""
    search = Search([SIZES], STRATEGIES, 256)
    trials = run(search, convnet, random.Random(seed), len(SIZES) * len(STRATEGIES))
    first_small = next(i for i, t in enumerate(trials) if t.config.microbatch_size < 64)
    assert {t.config.strategy for t in trials[:first_small]} == set(STRATEGIES)
    best = max(trials, key=lambda t: t.throughput or 0.0)
    assert not best.config.strategy.startswith("scan")
    assert min(t.config.microbatch_size for t in trials) > 1, [t.config for t in trials]


def test_a_descent_that_gains_less_than_the_noise_stops() -> None:
    """Each halving is 1% faster, with no spread at all: below `MIN_GAIN`, so the descent stops after two
    halvings without a clear gain."""
    search = Search([SIZES], ("loop",), 256)
    trials = run(search, lambda c: 1.0 * 0.99 ** (6 - math.log2(c.microbatch_size)), random.Random(0), 20, noise=0)
    assert sorted(t.config.microbatch_size for t in trials) == [16, 32, 64]


def test_a_descent_goes_on_while_each_half_is_clearly_faster() -> None:
    """Fastest at 8, each halving from 64 to 8 at least 20% faster, 30% slower below: the descent times 32, 16,
    8 and 4 (slower beyond two readings' drift: it stops there), then the other strategies at 8."""
    speed = {64: 2.0, 32: 1.6, 16: 1.3, 8: 1.0, 4: 1.3, 2: 1.5, 1: 2.0}
    search = Search([SIZES], ("scan", "loop"), 256)
    trials = run(
        search, lambda c: speed[c.microbatch_size] * (1.1 if c.strategy == "loop" else 1.0), random.Random(0), 30, 0
    )
    configs = [(t.config.microbatch_size, t.config.strategy) for t in trials]
    assert configs[:2] == [(64, "scan"), (64, "loop")]
    assert [m for m, s in configs[2:6]] == [32, 16, 8, 4] and (8, "loop") in configs
    assert not any(m < 4 for m, _ in configs)


def test_a_strategy_out_of_memory_at_the_largest_size_goes_on_at_the_next_size_down() -> None:
    """loop's accumulating step runs out of memory at 64 only: it is tried next at 32, where it fits, before the
    descent begins; the other knob setting (index 1, a smaller bound) starts at its own largest size."""
    search = Search([SIZES, (1, 2, 4, 8)], ("scan", "loop"), 256)
    seconds = lambda c: None if (c.strategy, c.microbatch_size) == ("loop", 64) else 1.0 + 0.1 * c.setting  # noqa: E731
    trials = run(search, seconds, random.Random(0), 4, noise=0)
    assert {dataclass_tuple(t.config) for t in trials} == {(64, "scan", 0), (64, "loop", 0), (32, "loop", 0),
                                                            (8, "scan", 1)}  # fmt: skip


def test_another_knob_setting_starts_with_the_fastest_variant_that_fit_the_defaults_largest_size() -> None:
    """unroll=2 runs out of memory at 32 and is the fastest at 16: the other setting, bounded like the probed
    variant, starts with scan at its largest size, not with unroll=2, which ran out there too (three trials of a
    new user's twelve)."""
    search = Search([(4, 8, 16, 32), (4, 8, 16, 32)], ("scan", "scan:unroll=2"), 64)
    seen = [Trial(Config(32, "scan"), 100.0), Trial(Config(32, "scan:unroll=2"), None),
            Trial(Config(16, "scan:unroll=2"), 150.0)]  # fmt: skip
    assert search.propose(seen) == [Config(32, "scan", 1)]


@pytest.mark.parametrize("seed", range(10))
def test_a_strategy_out_of_memory_at_the_largest_two_sizes_is_timed_only_where_the_descent_goes(seed: int) -> None:
    """loop's step runs out of memory down to 16 and fits at 8, where scan (faster at every smaller size) is best:
    loop is not walked down one size at a time (each a failed compile; a new user's tune walked two such variants to
    microbatch 1), but timed at the best size the descent finds."""
    search = Search([SIZES], ("scan", "loop"), 256)
    speed = {64: 4.0, 32: 3.0, 16: 2.0, 8: 1.0, 4: 1.6, 2: 2.5, 1: 4.0}
    seconds = lambda c: None if c.strategy == "loop" and c.microbatch_size >= 16 else speed[c.microbatch_size]  # noqa: E731
    trials = run(search, seconds, random.Random(seed), 4 * len(SIZES))
    assert sorted(t.config.microbatch_size for t in trials if t.config.strategy == "loop") == [8, 32, 64]
    best = max(trials, key=lambda t: t.throughput or 0.0)
    assert best.config.microbatch_size == 8


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


VARIANTS = ("scan", "scan:unroll=2", "scan:unroll=8", "loop", "multisteps")


def program_of(effective_batch: int) -> Callable[[Config], tuple[object, ...]]:
    """As `autoaccum._tune.space.program_key`: one step runs the plain step; scan unrolled at least as many times as
    there are steps runs them all unrolled."""

    def program(c: Config) -> tuple[object, ...]:
        steps = -(-effective_batch // c.microbatch_size)
        if steps == 1:
            return ("plain",)
        _, _, unroll = c.strategy.partition(":unroll=")
        return (c.microbatch_size, "scan:unrolled" if unroll and int(unroll) >= steps else c.strategy)

    return program


def landscape(rng: random.Random) -> tuple[list[int], int, Callable[[Config], float]]:
    """A random unimodal landscape: sizes 1 to a bound of 8 to 128, an effective batch of 1 to 4 times it, the
    throughput falling away from a peak at a random size by 3% to 50% per halving or doubling, a factor per
    strategy (scan's variants within 5% of scan, unrolling likewise) and 3% of interaction per configuration.
    Configurations of one program have one throughput. Returns the sizes, the effective batch and the step time."""
    top = rng.choice([8, 16, 32, 64, 128])
    effective_batch = top * rng.choice([1, 2, 4])
    sizes = [2**i for i in range(top.bit_length())]
    peak, below, above = rng.choice(sizes), rng.uniform(0.03, 0.5), rng.uniform(0.03, 0.5)
    factor = {name: rng.uniform(0.4, 1.0) for name in ("scan", "loop", "multisteps")}
    factor.update({v: factor["scan"] * rng.uniform(0.95, 1.05) for v in (*VARIANTS[1:3], "scan:unrolled")})
    program = program_of(effective_batch)
    interaction = {program(Config(m, v)): rng.uniform(0.97, 1.03) for m in sizes for v in VARIANTS}

    def seconds(c: Config) -> float:
        key = program(c)
        d = math.log2(c.microbatch_size / peak)
        throughput = math.exp(-(above * d if d > 0 else below * -d)) * (1.0 if key == ("plain",) else factor[key[1]])
        return 1.0 / (throughput * interaction[key])

    return sizes, effective_batch, seconds


def pick(search: Search, trials: list[Trial], seconds: Callable[[Config], float], rng: random.Random) -> Config:
    """The race's winner among the fastest `FINALISTS` programs of ``trials``: each round a drift of up to 10% that
    every finalist of the round shares, each timing 2% of its own."""
    best: dict[object, Trial] = {}
    for t in sorted(trials, key=lambda t: -(t.throughput or 0.0)):
        if t.throughput is not None:
            best.setdefault(search.program(t.config), t)
    finalists = list(best.values())[:FINALISTS]
    drift = {"round": 1.0}

    def time_one(c: Config) -> list[float]:
        if c == finalists[0].config or rng.random() < 0.2:
            drift["round"] = 1 + rng.uniform(-0.1, 0.1)
        return [seconds(c) * drift["round"] * (1 + rng.uniform(-0.02, 0.02)) for _ in range(5)]

    if len(finalists) == 1:
        return finalists[0].config
    runners = race([(f.config, i, f.times) for i, f in enumerate(finalists)], time_one)
    return finalists[runners[0].trial].config


def test_the_search_and_the_race_find_the_best_of_95_percent_of_landscapes() -> None:
    """On 200 seeded landscapes (`landscape`; each trial's reading off by up to 10%), the search, run until it
    proposes nothing, and the race then find a configuration within 5% of the best in at least 95% of them, timing
    at most half of the grid on average."""
    found, timed, grid = 0, 0, 0
    for seed in range(200):
        rng = random.Random(seed)
        sizes, effective_batch, seconds = landscape(rng)
        search = Search([sizes], VARIANTS, effective_batch, program_of(effective_batch))
        trials = run(search, seconds, rng, len(sizes) * len(VARIANTS))
        best = min(seconds(Config(m, v)) for m in sizes for v in VARIANTS)
        found += best / seconds(pick(search, trials, seconds, rng)) >= 0.95
        timed, grid = timed + len(trials), grid + len(sizes) * len(VARIANTS)
    assert found >= 0.95 * 200, found
    assert timed <= grid / 2, (timed, grid)


def test_a_variant_that_gains_where_the_leader_is_level_is_found() -> None:
    """scan and scan unrolled twice are level at the largest size; scan stays level down to 8 while the unrolled
    one (more steps amortised) is 15% faster there, its best. On 200 seeds (each reading off by up to 10%), the
    search and the race find it (within 5%) in at least 90% (58% when the other variants were timed only at the
    descent's best size)."""
    scan = {32: 1.0, 16: 1.0, 8: 1.0, 4: 1.1, 2: 1.3, 1: 1.6}
    unrolled = {32: 1.0, 16: 0.95, 8: 0.85, 4: 0.9, 2: 1.1, 1: 1.4}
    table = {"scan": scan, "scan:unroll=2": unrolled}
    seconds = lambda c: table.get(c.strategy, dict.fromkeys(scan, 1.5))[c.microbatch_size]  # noqa: E731
    found = 0
    for seed in range(200):
        rng = random.Random(seed)
        search = Search([sorted(scan)], STRATEGIES, 64)
        trials = run(search, seconds, rng, len(scan) * len(STRATEGIES))
        found += 0.85 / seconds(pick(search, trials, seconds, rng)) >= 0.95
    assert found >= 0.9 * 200, found


@pytest.mark.parametrize("seed", range(20))
def test_a_variant_clearly_slower_at_the_top_is_not_timed_again_below(seed: int) -> None:
    """loop reads twice as slow as scan at every size; scan is fastest at 8: the descent goes down, and the other
    variants are timed at 8, but not loop (slower beyond two readings' drift at the top), which the best still is."""
    speed = {64: 2.0, 32: 1.6, 16: 1.3, 8: 1.0, 4: 1.3, 2: 1.5, 1: 2.0}
    seconds = lambda c: speed[c.microbatch_size] * (2.0 if c.strategy == "loop" else 1.0)  # noqa: E731
    search = Search([SIZES], STRATEGIES, 256)
    trials = run(search, seconds, random.Random(seed), len(SIZES) * len(STRATEGIES))
    assert [t.config.microbatch_size for t in trials if t.config.strategy == "loop"] == [64]
    assert {t.config.strategy for t in trials if t.config.microbatch_size == 8} == set(STRATEGIES) - {"loop"}
    best = max(trials, key=lambda t: t.throughput or 0.0)
    assert best.config.microbatch_size == 8 and best.config.strategy != "loop"


@pytest.mark.parametrize("seed", range(20))
def test_a_variant_clearly_slower_at_one_knob_setting_is_not_timed_at_another(seed: int) -> None:
    """loop reads twice as slow as scan at every size and both knob settings; the second setting is faster (scan
    fastest at 8 there): the descent goes down with it, and the variants timed at its best size leave out loop, which
    read slower at the first setting's top size (it has no trial at the second's), and which the best still is."""
    speed = {64: 2.0, 32: 1.6, 16: 1.3, 8: 1.0, 4: 1.3, 2: 1.5, 1: 2.0}
    seconds = lambda c: speed[c.microbatch_size] * (2.0 if c.strategy == "loop" else 1.0) / (1 + c.setting)  # noqa: E731
    search = Search([SIZES, SIZES], STRATEGIES, 256)
    trials = run(search, seconds, random.Random(seed), 2 * len(SIZES) * len(STRATEGIES))
    assert [dataclass_tuple(t.config) for t in trials if t.config.strategy == "loop"] == [(64, "loop", 0)]
    at_best = {t.config.strategy for t in trials if (t.config.microbatch_size, t.config.setting) == (8, 1)}
    assert at_best == set(STRATEGIES) - {"loop"}
    best = max(trials, key=lambda t: t.throughput or 0.0)
    assert dataclass_tuple(best.config)[::2] == (8, 1) and best.config.strategy != "loop"


@pytest.mark.parametrize("seed", range(20))
def test_a_refused_size_bounds_its_variant_without_passing_over_a_size_that_fits(seed: int) -> None:
    """After a size that splits the batch evenly is refused on XLA's compile-only bytes, `ceiling` keeps every size
    that fits (on a step of ``fixed + per_example * m`` bytes whose fixed part is at least the state's) and
    excludes the refused size; reference: the largest fitting size counted by hand."""
    rng = random.Random(seed)
    state = rng.randrange(1, 1 << 20)
    fixed, per_example = state + rng.randrange(0, 1 << 20), rng.randrange(1, 1 << 16)
    effective_batch = 2 ** rng.randrange(4, 11)
    limit = fixed + per_example * rng.randrange(1, effective_batch)  # fits 1 .. some m' below the batch
    refused = [m for m in (2**k for k in range(11)) if m <= effective_batch and fixed + per_example * m > limit]
    for m in refused:
        largest_fitting = max(k for k in range(1, m) if fixed + per_example * k <= limit)
        c = ceiling(m, (fixed + per_example * m, limit), state, effective_batch)
        assert largest_fitting <= c < m, (m, c, largest_fitting)
        exact = ceiling(m, (state + per_example * m, state + per_example * largest_fitting), state, effective_batch)
        assert exact == largest_fitting  # where nothing beyond the state is fixed, the jump lands on the answer
    for big, m in itertools.pairwise(refused[::-1]):  # a second refusal: the line through both lands on the answer
        before = (big, fixed + per_example * big)
        assert ceiling(m, (fixed + per_example * m, limit), state, effective_batch, before) == max(
            k for k in range(1, m) if fixed + per_example * k <= limit
        )
    assert ceiling(48, (10**9, 10**6), 0, 128) == 47  # an uneven split: the next size down, no more
    # a variant whose bytes hardly fall with the size (a fixed part over the limit): no size is left to time
    assert ceiling(256, (62 * 10**6, 50 * 10**6), 10**6, 1024, before=(512, 63 * 10**6)) == 0
