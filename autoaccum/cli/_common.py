"""Options and helpers the CLI commands share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from autoaccum._workload import Workload, WorkloadError, load_workload

F = TypeVar("F", bound=Callable[..., Any])


def workload_arguments(fn: F) -> F:
    """``WORKLOAD`` (``path/file.py:function`` or ``package.module:function``) or ``--demo``."""
    fn = click.option("--demo", is_flag=True, help="Use the built-in demo workload (a small transformer LM).")(fn)
    fn = click.argument("workload", required=False, metavar="[WORKLOAD]")(fn)
    return fn


def resolve_workload(workload: str | None, demo: bool) -> Workload:
    """The `Workload` named on the command line; a ``click.UsageError`` (exit 2) when it cannot be loaded."""
    if demo and workload:
        raise click.UsageError("give either WORKLOAD or --demo, not both.")
    if demo:
        from autoaccum.workloads import demo as demo_workload

        return demo_workload()
    if not workload:
        raise click.UsageError("give a WORKLOAD (path/to/file.py:function or package.module:function) or --demo.")
    try:
        return load_workload(workload)
    except WorkloadError as e:
        raise click.BadParameter(str(e), param_hint="WORKLOAD") from e
