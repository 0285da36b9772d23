"""Entry point of a child process (`autoaccum._isolation.child_command` starts it): ``PARENT_PID THREAD KIND PAYLOAD
ARGS... RESULT``, KIND ``trial``, ``estimate``, or ``worker`` (a tuning worker that answers on a pipe,
`autoaccum._tune.worker`).

Kept apart from `autoaccum._trial` (which the package imports) so that a child's entry is a module of its own;
the work is `autoaccum._trial.child_main`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the child's work; ends at once when its parent (``PARENT_PID``) does (`die_with_parent`)."""
    from autoaccum._isolation import die_with_parent

    parent, thread, kind, payload, *args, result = sys.argv[1:] if argv is None else argv
    die_with_parent(int(parent), at_once=thread == "main")
    if kind == "worker":  # a tuning worker: `autoaccum._tune.worker.serve` (FD LIMIT)
        from autoaccum._tune.worker import serve

        serve(payload, int(args[0]), int(args[1]))
    elif kind in ("trial", "estimate"):
        from autoaccum._trial import child_main

        child_main(kind, payload, args, result)
    else:
        raise SystemExit(f"autoaccum._child: unknown kind {kind!r}; expected 'trial', 'estimate' or 'worker'.")


if __name__ == "__main__":
    main()
