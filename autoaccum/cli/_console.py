"""Where the commands print: consoles sized for the terminal that never split a word, and warnings as one line.

On a terminal, rich wraps text at its width, at spaces (a word longer than a line is the only one broken), and
tables fit it. Elsewhere (a pipe, a file, a CI log) nothing is cut or wrapped: lines and tables keep their
natural width, unless ``COLUMNS`` asks for a width.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

UNBOUNDED = 10_000
"""The width off a terminal with no ``COLUMNS``: wide enough that no line or table is ever cut or folded."""


def make_console(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A rich console on stdout (or stderr): the terminal's width on a terminal, ``COLUMNS`` where it is set,
    else `UNBOUNDED`."""
    from rich.console import Console

    console = Console(stderr=stderr, quiet=quiet)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console.width = UNBOUNDED
    return console


@contextlib.contextmanager
def warnings_as_lines(console: Console) -> Iterator[None]:
    """Inside it, each warning is printed on ``console`` as one line, ``warning: <message>``, once per message
    (Python's own shows two, the second a line of autoaccum's source). autoaccum's warnings (a
    `autoaccum._device.MemoryLimitWarning`, ...) are always shown; other warnings follow the filters in force."""
    from rich.text import Text

    seen: set[str] = set()

    def show(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, file: TextIO | None = None,
        line: str | None = None,
    ) -> None:  # fmt: skip
        text = " ".join(str(message).split())
        if text not in seen:
            seen.add(text)
            console.print(Text.assemble(("warning: ", "yellow"), text))

    with warnings.catch_warnings():
        warnings.filterwarnings("always", category=UserWarning, module=r"autoaccum(\.|$)")
        warnings.showwarning = show
        yield
