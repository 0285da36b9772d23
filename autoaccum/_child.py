"""Entry point of a probe's child process (kept apart from `autoaccum._trial`, which the package imports, so
that ``-m`` runs a module not imported yet):

* ``python -m autoaccum._child trial PAYLOAD SIZE LIMIT RESULT``: one trial (`autoaccum._trial.child_main`);
* ``python -m autoaccum._child estimate PAYLOAD LIMIT MAX_SIZE GRANULARITY RESULT``: the compile-only estimate
  (it traces the user's loss, which must not happen in the caller's process either).
"""

from __future__ import annotations

import sys

from autoaccum._trial import child_estimate, child_main

if __name__ == "__main__":
    kind, *args = sys.argv[1:]
    if kind == "trial":
        child_main(args[0], int(args[1]), int(args[2]), args[3])
    elif kind == "estimate":
        child_estimate(args[0], int(args[1]), int(args[2]), int(args[3]), args[4])
    else:
        raise SystemExit(f"autoaccum._child: unknown kind {kind!r}; expected 'trial' or 'estimate'.")
