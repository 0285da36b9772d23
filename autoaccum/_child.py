"""Entry point of the worker process (`autoaccum._isolation.child_command` starts it):
``PARENT_PID THREAD PAYLOAD FD LIMIT``; the work is `autoaccum._worker.serve`.

A module of its own, which the package does not import, so that a child's entry is visible in its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Serves the worker's requests; ends at once when its parent (``PARENT_PID``) does (`die_with_parent`)."""
    from autoaccum._isolation import die_with_parent
    from autoaccum._worker import serve

    parent, thread, payload, fd, limit = sys.argv[1:] if argv is None else argv
    die_with_parent(int(parent), at_once=thread == "main")
    serve(payload, int(fd), int(limit))


if __name__ == "__main__":
    main()
