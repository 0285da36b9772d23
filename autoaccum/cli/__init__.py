"""The ``autoaccum`` command line: ``devices``, ``probe``, ``tune``, ``plan``.

Each command only parses its options, builds the library call and prints the result; the work is in the
library. Exit codes (every command): 0 success, 1 the job ran but failed (e.g. nothing fits), 2 bad usage or
bad input (unknown workload, unparsable size, ...).
"""

from __future__ import annotations

import os

import click

from autoaccum._version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="autoaccum")
def main() -> None:
    """Memory-aware auto-tuner for gradient accumulation in JAX.

    \b
    Exit codes: 0 success; 1 the job ran but failed (e.g. nothing fits);
                2 bad usage or bad input.
    """
    # Before JAX starts: this process must not take 75% of the GPU that trials (child processes) need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


__all__ = ["main"]

from autoaccum.cli.tune import tune as _tune  # noqa: E402

main.add_command(_tune)

from autoaccum.cli.devices import devices as _devices  # noqa: E402
from autoaccum.cli.probe import probe as _probe  # noqa: E402

main.add_command(_devices)
main.add_command(_probe)

from autoaccum.cli.plan import plan as _plan  # noqa: E402

main.add_command(_plan)
