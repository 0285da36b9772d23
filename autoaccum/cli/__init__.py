"""The ``autoaccum`` command line: ``devices``, ``probe``, ``tune``, ``plan``.

Each command only parses its options, builds the library call and prints the result; the work is in the
library. Exit codes (every command): 0 success, 1 the job ran but failed (e.g. nothing fits), 2 bad usage or
bad input (unknown workload, unparsable size, ...), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Sequence
from typing import Any

import click

from autoaccum._version import __version__
from autoaccum.cli._common import as_flags


class _Terminated(KeyboardInterrupt):
    """SIGTERM (what a job scheduler sends), raised where Ctrl-C raises ``KeyboardInterrupt``, so that the same
    clean-up runs on the way out: the children ended, the temporary files removed, a running trial marked failed."""


def _terminate(signum: int, frame: Any) -> None:
    raise _Terminated()


def interrupted(command: str | None, args: Sequence[str], terminated: bool) -> str:
    """What a command interrupted by Ctrl-C (or, ``terminated``, by SIGTERM) says on its way out; ``args``: the
    command's own arguments.

    Example:
      >>> interrupted("probe", [], terminated=True)
      'autoaccum probe: terminated (SIGTERM); its child processes were ended and its temporary files removed.'
    """
    how = "terminated (SIGTERM)" if terminated else "interrupted (Ctrl-C)"
    text = f"autoaccum {command or ''}: {how}; its child processes were ended and its temporary files removed."
    if command == "tune":
        if any(a == ":memory:" or a.endswith("=:memory:") for a in args):
            text += " Nothing of the study is kept (--storage :memory:)."
        else:
            again = " (without --fresh)" if "--fresh" in args else ""
            text += (
                f" The study is kept: run the same command again{again} to resume it; the trials that finished "
                "are not run again."
            )
    return text


class _Main(click.Group):
    """The command group: a command interrupted by Ctrl-C exits with 130, terminated by SIGTERM with 143 (not click's
    bare "Aborted!" and 1, or SIGTERM's silent death, which left the children and the temporary files behind),
    saying so (`interrupted`); with ``--json``, bad usage or input (exit 2) is also ``{"error", "exit_code"}`` on
    stdout, as a failure (exit 1) is."""

    def invoke(self, ctx: click.Context) -> Any:
        args = list(ctx.args)  # (the command's own, before click hands them on)
        handles = threading.current_thread() is threading.main_thread()  # (only the main thread sets handlers)
        previous = signal.signal(signal.SIGTERM, _terminate) if handles else None
        try:
            return super().invoke(ctx)
        except click.ClickException as e:  # bad usage or input (exit 2): with --json, as JSON on stdout too
            command = self.get_command(ctx, ctx.invoked_subcommand or "")
            error = e
            if command is not None and type(e) is click.UsageError:  # (not click's own BadParameter: flags already)
                error = click.UsageError(as_flags(e.message, command), e.ctx)
            if "--json" in args:
                click.echo(json.dumps({"error": error.format_message(), "exit_code": error.exit_code}))
            raise error from e.__cause__
        except KeyboardInterrupt as e:
            terminated = isinstance(e, _Terminated)
            click.echo(interrupted(ctx.invoked_subcommand, args, terminated), err=True)
            ctx.exit(143 if terminated else 130)
        finally:
            if handles:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="autoaccum")
def main() -> None:
    """Memory-aware auto-tuner for gradient accumulation in JAX.

    \b
    Exit codes: 0 success; 1 the job ran but failed (e.g. nothing fits);
                2 bad usage or bad input; 130 interrupted (Ctrl-C);
                143 terminated (SIGTERM). An interrupted tune keeps its study:
                running it again resumes it.
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
