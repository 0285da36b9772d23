"""Reading a compiled program's text: which cross-device collectives it runs, and whether inside a loop."""

from __future__ import annotations

import collections
import dataclasses
import re

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
"""HLO ops that move data between devices (``-start`` forms of the async ones included)."""

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s+(?:\(.*)?\{\s*$")
_CALLED = re.compile(r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class Collectives:
    """Collective ops of one compiled program: ``loop`` inside a while loop's body (run once per iteration),
    ``outside`` the rest (run once per call), each as ``{op: count}``."""

    loop: dict[str, int]
    outside: dict[str, int]

    @property
    def in_loop(self) -> int:
        return sum(self.loop.values())

    @property
    def total(self) -> int:
        return self.in_loop + sum(self.outside.values())


def _computations(text: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        match = _COMPUTATION.match(line) if name is None else None
        if match:
            name = match.group(1)
            blocks[name] = []
        elif name is not None:
            if line.strip() == "}":
                name = None
            else:
                blocks[name].append(line)
    return blocks


def collectives(hlo_text: str) -> Collectives:
    """Counts the collectives in ``hlo_text`` (``jax.stages.Compiled.as_text()``), split by whether they run
    inside a while loop (e.g. a ``lax.scan`` over microbatches) or once.

    Example:
      >>> text = '''
      ... %body (p: f32[]) -> f32[] {
      ...   %ar = f32[] all-reduce(f32[] %p), to_apply=%add
      ... }
      ... ENTRY %main (x: f32[]) -> f32[] {
      ...   %w = f32[] while(f32[] %x), condition=%cond, body=%body
      ...   %g = f32[8] all-gather(f32[1] %x), dimensions={0}
      ... }
      ... '''
      >>> c = collectives(text)
      >>> c.loop, c.outside
      ({'all-reduce': 1}, {'all-gather': 1})
    """
    blocks = _computations(hlo_text)
    in_loop: set[str] = set()
    pending = [m.group(1) for lines in blocks.values() for line in lines for m in [_WHILE_BODY.search(line)] if m]
    while pending:
        name = pending.pop()
        if name in in_loop or name not in blocks:
            continue
        in_loop.add(name)
        for line in blocks[name]:
            pending += _CALLED.findall(line)
            for group in _BRANCHES.findall(line):
                pending += [b.strip().lstrip("%") for b in group.split(",")]
    loop: collections.Counter[str] = collections.Counter()
    outside: collections.Counter[str] = collections.Counter()
    for name, lines in blocks.items():
        for line in lines:
            match = _OP.search(line)
            if match:
                (loop if name in in_loop else outside)[match.group(1)] += 1
    return Collectives(dict(loop), dict(outside))
