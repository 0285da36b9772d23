"""The CUDA plugin's start-up lines on a machine without an NVIDIA driver, kept off the terminal.

Where the ``gpu-plan`` extra is installed for XLA's GPU compiler alone (no driver), ``import jax`` and the first
compile-only GPU devices print, from the plugin's C++ (absl, straight to file descriptor 2)::

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 00:00:1795640669.473219   18869 cudart_stub.cc:31] Could not find cuda drivers on your machine, ...

`without_driver_noise` drops exactly those lines while its block runs; whatever else is written to file
descriptor 2 meanwhile is passed on when the block ends. Importing this module (first, in
``autoaccum/__init__.py``) imports jax that way when nothing has imported it yet. With a driver nothing is
dropped: there the lines would explain a broken CUDA install.

Example:
  >>> with without_driver_noise():
  ...     pass
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

NOISE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR\s*"
    rb"|I\d{4} [\d:.]+\s+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be "
    rb"used\.\s*"
)
"""The lines dropped (each whole line must match)."""


def has_driver() -> bool:
    """Whether this machine has an NVIDIA driver (``/proc/driver/nvidia``)."""
    return Path("/proc/driver/nvidia").exists()


def drop_noise(text: bytes) -> bytes:
    """``text`` without the lines that `NOISE` matches whole.

    Example:
      >>> drop_noise(b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\nok\\n")
      b'ok\\n'
    """
    return b"".join(line for line in text.splitlines(keepends=True) if not NOISE.fullmatch(line))


@contextlib.contextmanager
def without_driver_noise() -> Iterator[None]:
    """Runs the block with file descriptor 2 captured, then writes back what it got less `NOISE` (nothing is
    captured on a machine with an NVIDIA driver, or where descriptor 2 is not open)."""
    if has_driver():
        yield
        return
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = drop_noise(capture.read())
            while kept:
                kept = kept[os.write(2, kept) :]


if "jax" not in sys.modules:
    with without_driver_noise():
        import jax  # noqa: F401
