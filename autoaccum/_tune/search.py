"""The tuner's search: a pure function of the trials so far that proposes the configurations to time next.

`Search.propose` takes these steps in order, each once the one before has nothing left to propose:

1. **Breadth.** The whole batch in one step, where it fits, then every strategy variant at the default knob
   setting's largest accumulating microbatch (one that runs out of memory there goes on at the next size down,
   and no further: one that needs much more memory than the others is timed only at the descent's best size).
2. **Knobs.** Every other setting of the knobs at its own largest size, with the fastest variant that ran at the
   default setting's largest (one that ran out of memory there would at the others' too).
3. **Descent.** From the fastest of those, halve the microbatch; stop after two halvings in a row not
   `clearly_faster` than the best so far, or at one slower by more than two readings' drift (`DRIFT`).
4. **Coordinates.** Where the descent went down, the other variants at its best size (but those whose first
   trial read clearly slower than the leader's, beyond two readings' drift, at any knob setting); then, where it
   went on level past that size, the variants level with the fastest at the best size, at the last size it found
   level (a variant's gain can grow with the steps: scan unrolled).

Then the sampler spends what is left of the budget, and the race settles the finalists. No JAX, no Optuna.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping, Sequence

from autoaccum._tune.race import quartiles

MIN_GAIN = 0.03
"""The least gain in throughput one trial's reading can show against another's (the machine drifts)."""

DRIFT = 0.10
"""How far one trial's reading may be off: a half is judged slower when it reads slower by over twice this."""


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the space: a microbatch size, a strategy variant (its label) and a knob setting (its index in
    the tune's settings, 0 the default)."""

    microbatch_size: int
    strategy: str
    setting: int = 0


@dataclasses.dataclass(frozen=True)
class Trial:
    """A configuration's settled trial: its throughput (None: it failed: out of memory, timed out) and the step
    times it was measured with (seconds)."""

    config: Config
    throughput: float | None
    times: tuple[float, ...] = ()


def clearly_faster(a: Trial, b: Trial) -> bool:
    """Whether ``a`` is faster than ``b`` by at least `MIN_GAIN`, and (with three step times or more each) with
    ``a``'s slower quartile step faster than ``b``'s faster quartile step.

    Example:
      >>> c = Config(8, "scan")
      >>> clearly_faster(Trial(c, 110.0, (1.0, 1.0, 1.01)), Trial(c, 100.0, (1.1, 1.1, 1.12)))
      True
      >>> clearly_faster(Trial(c, 102.0), Trial(c, 100.0))
      False
    """
    if a.throughput is None or b.throughput is None or a.throughput < b.throughput * (1 + MIN_GAIN):
        return False
    return min(len(a.times), len(b.times)) < 3 or quartiles(a.times)[2] < quartiles(b.times)[0]


@dataclasses.dataclass(frozen=True)
class Search:
    """The search over one tune's space (see the module docstring).

    Attributes:
      sizes: per knob setting (by index, the default first), the microbatch sizes that may be timed.
      strategies: the strategy variants' labels, the default strategy first.
      effective_batch: examples per update.
      program: what a configuration compiles to; configurations with equal keys are timed once.
    """

    sizes: Sequence[Sequence[int]]
    strategies: Sequence[str]
    effective_batch: int
    program: Callable[[Config], Hashable] = lambda config: config

    def propose(self, trials: Sequence[Trial]) -> list[Config]:
        """The configurations to time next, given the settled ``trials`` (any order, any worker's); empty: none.

        Example:
          >>> search = Search(sizes=[[1, 2, 4, 8]], strategies=["scan", "loop"], effective_batch=8)
          >>> [(c.microbatch_size, c.strategy) for c in search.propose([])]
          [(8, 'scan'), (4, 'scan'), (4, 'loop')]
        """
        seen = {t.config: t for t in trials}
        for step in (self._breadth, self._knobs, self._descent, self._coordinates):
            wanted = step(seen)
            if wanted:
                return wanted
        return []

    def _top(self, setting: int) -> int | None:
        """The largest accumulating size of ``setting`` (the largest there is, if only the whole batch fits)."""
        below = [m for m in self.sizes[setting] if m < self.effective_batch]
        return max(below) if below else max(self.sizes[setting], default=None)

    def _start(self, strategy: str, setting: int, seen: Mapping[Config, Trial]) -> Config | Trial | None:
        """``strategy``'s first trial at ``setting``: its settled trial at the largest accumulating size where it
        did not fail, of the largest two, or the configuration to time there next (None: it failed at both: it
        needs much more memory than the others, and is timed only where the descent brings the others down)."""
        top = self._top(setting)
        for m in sorted((m for m in self.sizes[setting] if top is not None and m <= top), reverse=True)[:2]:
            config = Config(m, strategy, setting)
            trial = self._timed(config, seen)
            if trial is None:
                return config
            if trial.throughput is not None:
                return trial
        return None

    def _timed(self, config: Config, seen: Mapping[Config, Trial]) -> Trial | None:
        """The settled trial of ``config``, else of another configuration of its program (None: neither)."""
        if config in seen:
            return seen[config]
        key = self.program(config)
        return next((t for c, t in seen.items() if self.program(c) == key), None)

    def _wanted(self, configs: Sequence[Config], seen: Mapping[Config, Trial]) -> list[Config]:
        """``configs`` not timed yet, one per program."""
        out: list[Config] = []
        for config in configs:
            if self._timed(config, seen) is None and all(self.program(c) != self.program(config) for c in out):
                out.append(config)
        return out

    def _breadth(self, seen: Mapping[Config, Trial]) -> list[Config]:
        starts = [self._start(s, 0, seen) for s in self.strategies]
        whole = [Config(self.effective_batch, self.strategies[0])] if self.effective_batch in self.sizes[0] else []
        return self._wanted(whole + [c for c in starts if isinstance(c, Config)], seen)

    def _best(self, seen: Mapping[Config, Trial], settings: Sequence[int]) -> Trial | None:
        """The fastest settled trial of ``settings`` at an accumulating size (the whole batch if none)."""
        done = [t for t in seen.values() if t.throughput is not None and t.config.setting in settings]
        accumulating = [t for t in done if t.config.microbatch_size < self.effective_batch] or done
        return max(accumulating, key=lambda t: (t.throughput, -t.config.microbatch_size), default=None)

    def _knobs(self, seen: Mapping[Config, Trial]) -> list[Config]:
        top = self._top(0)  # the fastest variant that fit there: the others' bounds are the probed variant's
        fit = [t for t in seen.values() if t.config.setting == 0 and t.config.microbatch_size == top and t.throughput]
        best = max(fit, key=lambda t: t.throughput or 0.0, default=None)
        strategy = self.strategies[0] if best is None else best.config.strategy
        starts = [self._start(strategy, s, seen) for s in range(1, len(self.sizes))]
        return self._wanted([c for c in starts if isinstance(c, Config)], seen)

    def _walk(self, seen: Mapping[Config, Trial]) -> tuple[Trial | None, Trial | None, Config | None]:
        """The descent from the fastest first trial: the best trial it found, the last it found level with (or
        faster than) the best, and the next size to time (None: it has stopped)."""
        tops = {s: self._top(s) for s in range(len(self.sizes))}
        firsts = [t for t in seen.values() if t.config.microbatch_size == tops[t.config.setting]]
        best = max((t for t in firsts if t.throughput is not None), key=lambda t: t.throughput or 0.0, default=None)
        here, flat = best, 0
        while here is not None and best is not None and best.throughput is not None:
            m, strategy, setting = dataclasses.astuple(here.config)
            half = [c for c in self.sizes[setting] if c <= m // 2]
            below = Config(max(half), strategy, setting) if half else None
            trial = None if below is None else self._timed(below, seen)
            if below is None or trial is None:
                return best, here, below
            if not level(trial, best):
                return best, here, None
            flat = 0 if clearly_faster(trial, best) else flat + 1
            if flat >= 2:
                return best, trial, None
            best = max(best, trial, key=lambda t: t.throughput or 0.0)
            here = trial
        return best, here, None

    def _descent(self, seen: Mapping[Config, Trial]) -> list[Config]:
        _, _, below = self._walk(seen)
        return [] if below is None else self._wanted([below], seen)

    def _coordinates(self, seen: Mapping[Config, Trial]) -> list[Config]:
        best, last, _ = self._walk(seen)
        if best is None or last is None:
            return []
        m, leader, setting = dataclasses.astuple(best.config)
        kept = [s for s in self.strategies if not self._slower(s, leader, seen)]
        wanted = [] if m == self._top(setting) else self._wanted([Config(m, s, setting) for s in kept], seen)
        if wanted or last.config.microbatch_size >= m:
            return wanted
        at_best = {s: self._timed(Config(m, s, setting), seen) for s in kept}
        timed = {s: t for s, t in at_best.items() if t is not None and t.throughput is not None}
        fastest = max(timed.values(), key=lambda t: t.throughput or 0.0)
        close = [s for s, t in timed.items() if level(t, fastest)]
        return self._wanted([Config(last.config.microbatch_size, s, setting) for s in close], seen)

    def _slower(self, strategy: str, leader: str, seen: Mapping[Config, Trial]) -> bool:
        """Whether ``strategy``'s first trial read clearly slower than ``leader``'s (beyond two readings' drift) at a
        knob setting where both have one: the strategies' ranking is taken not to turn with the knobs."""
        for setting in range(len(self.sizes)):
            mine, lead = self._start(strategy, setting, seen), self._start(leader, setting, seen)
            if isinstance(mine, Trial) and isinstance(lead, Trial) and not level(mine, lead):
                return True
        return False


def level(a: Trial, b: Trial) -> bool:
    """Whether ``a`` reads at most two trials' drift (`DRIFT`) slower than ``b`` (a failed one never is)."""
    return a.throughput is not None and b.throughput is not None and a.throughput * (1 + 2 * DRIFT) >= b.throughput
