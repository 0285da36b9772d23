"""The dependency floors in pyproject.toml are the ones CI installs and tests (.ci/floors.txt)."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).parent.parent


def declared() -> dict[str, Version]:
    """``{name: floor}`` of pyproject's dependencies and its test extra's pytest (read as text: no tomllib on 3.10)."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert deps is not None
    requirements = re.findall(r'^\s*"([^"]+)"', deps.group(1), re.M) + re.findall(r'"(pytest[^"]*)"', text)
    out = {}
    for req in requirements:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", req)
        assert m, f"{req!r} has no `>=` floor: every direct dependency needs one"
        out[m.group(1).lower()] = Version(m.group(2))
    return out


def test_ci_installs_every_floor_pyproject_declares() -> None:
    pinned: dict[str, Version] = {}
    for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pinned[name.strip().lower()] = Version(version.strip())
    assert pinned.pop("jaxlib") == pinned["jax"]  # they move together
    assert pinned == declared()
