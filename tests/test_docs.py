"""The documentation site stays true: every Python block in docs/ runs, page by page, in order."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent / "docs"
FENCE = re.compile(r"^(?:<!-- not run: (?P<why>[^\n]+?) -->\n)?```(?P<lang>[\w+-]*)\n(?P<body>.*?)^```", re.S | re.M)
PYTHON = {"python", "py", "python3", "pycon"}


def fences(page: Path) -> list[re.Match[str]]:
    return list(FENCE.finditer(page.read_text()))


PAGES = [page for page in sorted(DOCS.rglob("*.md")) if any(f["lang"] == "python" for f in fences(page))]


def test_the_pages_have_python_to_run() -> None:
    names = {page.relative_to(DOCS).as_posix() for page in PAGES}
    assert {"getting-started.md", "concepts/update.md", "guides/nnx.md", "guides/linen.md"} <= names, names


def test_every_python_block_runs_or_says_why_not() -> None:
    """A block fenced other than ```python is not run, so it must say why (``<!-- not run: reason -->``), and a
    ```python block carries no such comment (it runs anyway)."""
    for page in sorted(DOCS.rglob("*.md")):
        for fence in fences(page):
            where = f"{page.relative_to(DOCS)} at {fence['body'][:60]!r}"
            if fence["lang"] == "python":
                assert fence["why"] is None, f"{where}: a ```python block runs; drop its 'not run' comment"
            elif fence["lang"] in PYTHON:
                assert fence["why"], f"{where}: fence it ```python (it then runs) or say <!-- not run: why -->"


def measures(code: str) -> bool:
    """Whether code tunes or probes (real runs in child processes: tens of seconds on 2 shared cores)."""
    return re.search(r"\b(tune|probe)\(", code) is not None


@pytest.mark.parametrize(
    "page",
    [pytest.param(page, marks=[pytest.mark.slow] if measures(page.read_text()) else []) for page in PAGES],
    ids=[page.relative_to(DOCS).as_posix() for page in PAGES],
)
def test_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The page's ```python blocks, in order, in one namespace (a later block may use an earlier one's names)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOACCUM_CACHE", str(tmp_path))  # a study a block stores goes here, not the user's cache
    namespace = {"__name__": "__docs__"}
    for fence in fences(page):
        if fence["lang"] == "python":
            exec(compile(fence["body"], str(page), "exec"), namespace)
