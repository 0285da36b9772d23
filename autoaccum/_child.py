"""Entry point of a child process: ``python -m autoaccum._child KIND PAYLOAD ARGS... RESULT``.

Kept apart from `autoaccum._trial` (which the package imports) so that ``-m`` runs a module not imported yet;
the work is `autoaccum._trial.child_main`.
"""

from __future__ import annotations

import sys

from autoaccum._trial import child_main

if __name__ == "__main__":
    kind, payload, *args, result = sys.argv[1:]
    if kind not in ("trial", "estimate"):
        raise SystemExit(f"autoaccum._child: unknown kind {kind!r}; expected 'trial' or 'estimate'.")
    child_main(kind, payload, args, result)
