"""Entry point of a child process: ``python -m autoaccum._child KIND PAYLOAD ARGS... RESULT`` (KIND ``trial``,
``estimate``, or ``worker``: a tuning worker that answers on a pipe, `autoaccum._tune.worker`).

Kept apart from `autoaccum._trial` (which the package imports) so that ``-m`` runs a module not imported yet;
the work is `autoaccum._trial.child_main`.
"""

from __future__ import annotations

import sys

from autoaccum._trial import child_main

if __name__ == "__main__":
    kind, payload, *args, result = sys.argv[1:]
    if kind == "worker":  # a tuning worker: `autoaccum._tune.worker.serve` (FD LIMIT)
        from autoaccum._tune.worker import serve

        serve(payload, int(args[0]), int(args[1]))
    elif kind in ("trial", "estimate"):
        child_main(kind, payload, args, result)
    else:
        raise SystemExit(f"autoaccum._child: unknown kind {kind!r}; expected 'trial', 'estimate' or 'worker'.")
