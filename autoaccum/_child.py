"""Entry point of a probe trial's child process: ``python -m autoaccum._child PAYLOAD SIZE LIMIT RESULT``.

Kept apart from `autoaccum._trial` (which the package imports) so that ``-m`` runs a module not yet imported.
"""

from __future__ import annotations

import sys

from autoaccum._trial import child_main

if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
