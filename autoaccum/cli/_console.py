"""Where the commands print: consoles sized for the terminal that never split a word, and warnings as one line.

On a terminal, rich wraps text at its width (``COLUMNS`` where set), at spaces (a word longer than a line is the
only one broken), and tables fit it (`fit_table`). Elsewhere (a pipe, a file, a CI log) nothing is cut or
wrapped: lines and tables keep their natural width, whatever ``COLUMNS`` says (a shell's, or pytest-xdist's 80,
describes a terminal that is not there).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.text import Text

UNBOUNDED = 10_000
"""The width off a terminal: wide enough that no line or table is ever cut or folded."""


def make_console(*, stderr: bool = False, quiet: bool = False) -> Console:
    """A rich console on stdout (or stderr): the terminal's width on a terminal, else `UNBOUNDED`."""
    from rich.console import Console

    console = Console(stderr=stderr, quiet=quiet)
    if not console.is_terminal:
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


def fit_table(
    console: Console, title: str | None, columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[str | Text]]
) -> RenderableType:
    """A table of ``columns`` (``(header, justify)``) and ``rows`` of text (strings are never markup; a
    ``rich.text.Text`` keeps its style) sized for ``console``: at its natural width where that fits, else each
    column at least as wide as its longest word (cells wrap at spaces, never inside a word) and the room left
    shared out by `column_widths`. Where even that is too wide (a narrow terminal), one line per row instead,
    ``header value`` pairs wrapped at spaces. Nothing is cut."""
    from rich.cells import cell_len
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    plain = [[cell if isinstance(cell, str) else cell.plain for cell in row] for row in rows]
    cells = [[header for header, _ in columns], *plain]
    natural = [max(cell_len(row[i]) for row in cells) for i in range(len(columns))]
    longest = [max(cell_len(word) for row in cells for word in row[i].split() or [""]) for i in range(len(columns))]
    room = console.width - 3 * len(columns) - 1  # a box's lines and one space of padding either side of a cell
    if sum(longest) > room:
        lines = [_row_line([header for header, _ in columns], row) for row in plain]
        return Group(*(Text(line) for line in ([] if title is None else [title]) + lines))
    table = Table(title=None if title is None else Text(title))
    for (header, justify), width in zip(columns, column_widths(natural, longest, room), strict=True):
        table.add_column(Text(header), justify=justify, width=width)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in row))
    return table


def _row_line(headers: Sequence[str], row: Sequence[str]) -> str:
    """``"#3: microbatch 16, steps 4, ..."``: a table's row as one line (its empty cells left out), named by its
    first cell (a number with its header).

    Example:
      >>> _row_line(["#", "size", "peak"], ["3", "16", ""])
      '#3: size 16'
      >>> _row_line(["name", "memory"], ["T4", "16 GiB"])
      'T4: memory 16 GiB'
    """
    name = row[0] if not row[0].isdigit() else f"#{row[0]}" if headers[0] == "#" else f"{headers[0]} {row[0]}"
    pairs = [f"{header} {value}" for header, value in zip(headers[1:], row[1:], strict=True) if value]
    return f"{name}: " + ", ".join(pairs)


def column_widths(natural: Sequence[int], longest: Sequence[int], room: int) -> list[int | None]:
    """Widths of columns whose cells are at most ``natural`` wide, with words at most ``longest`` wide, in
    ``room`` character cells: None each (their natural widths) where they fit; else each its longest word, plus
    the room left shared in proportion to what each still lacks of its natural width; each its longest word
    where even that does not fit.

    Example:
      >>> column_widths([10, 30], [4, 8], 40)
      [None, None]
      >>> column_widths([10, 30], [4, 8], 22)
      [6, 16]
      >>> column_widths([10, 30], [4, 8], 5)
      [4, 8]
    """
    if sum(natural) <= room:
        return [None] * len(natural)
    widths = list(longest)
    spare = room - sum(longest)
    lacking = [n - w for n, w in zip(natural, longest, strict=True)]
    if spare <= 0:
        return list(widths)
    shares = [spare * lack // sum(lacking) for lack in lacking]
    for i in sorted(range(len(widths)), key=lambda i: lacking[i] - shares[i], reverse=True)[: spare - sum(shares)]:
        shares[i] += 1
    return [w + s for w, s in zip(widths, shares, strict=True)]
