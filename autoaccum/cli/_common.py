"""Options and helpers the CLI commands share."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from autoaccum._workload import Workload, WorkloadError, load_workload

F = TypeVar("F", bound=Callable[..., Any])


def workload_arguments(fn: F) -> F:
    """``WORKLOAD`` (``path/file.py:function`` or ``package.module:function``) or ``--demo``."""
    fn = click.option("--demo", is_flag=True, help="Use the built-in demo workload (a small transformer LM).")(fn)
    fn = click.argument("workload", required=False, metavar="[WORKLOAD]")(fn)
    return fn


def renamed_option(new: str, value: Any, old: str, old_value: Any) -> Any:
    """``value`` of option ``new``, or ``old_value`` given under its hidden, deprecated name ``old`` (a warning line
    on stderr); both given is a usage error (exit 2)."""
    if old_value is None or old_value == ():
        return value
    ctx = click.get_current_context()
    name = new.lstrip("-").replace("-", "_")
    if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(f"give {new} alone; {old} is its deprecated name.")
    click.echo(f"warning: {old} is deprecated: use {new}.", err=True)
    return old_value


def check_output(path: Path | None, option: str) -> None:
    """A usage error (exit 2) before any work where ``path``, the file ``option`` writes, cannot be written there: its
    folder is missing or not writable."""
    if path is None:
        return
    folder = path.parent
    if not folder.is_dir():
        raise click.UsageError(f"{option} {str(path)!r}: the folder {str(folder)!r} does not exist; make it first.")
    if not os.access(folder, os.W_OK):
        raise click.UsageError(f"{option} {str(path)!r}: the folder {str(folder)!r} is not writable; write elsewhere.")


STRATEGY_HELP = "{what} [{choices}, or a strategy the workload's file registers]"


def strategy_help(what: str, *, auto: bool) -> str:
    """An option's help naming the strategies known now (the workload's own are checked once it is loaded)."""
    from autoaccum import strategies

    return STRATEGY_HELP.format(what=what, choices="|".join(("auto",) * auto + strategies.available()))


def check_strategies(names: Sequence[str], *, auto: bool) -> None:
    """A usage error (exit 2) unless each of ``names`` is registered (or ``"auto"``, where ``auto``): called once
    the workload is loaded, so a strategy its file registers can be named on the command line."""
    from autoaccum import strategies

    known = ("auto",) * auto + strategies.available()
    for name in names:
        if name not in known:
            raise click.BadParameter(
                f"{name!r} is not a registered strategy; choose from {', '.join(known)}, or register yours in the "
                "workload's file (autoaccum.strategies.register).",
                param_hint="'--strategy'",
            )


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
        loaded = load_workload(workload)
    except WorkloadError as e:
        raise click.BadParameter(str(e), param_hint="WORKLOAD") from e
    check_loss_traces(loaded, workload)
    return loaded


def check_loss_traces(w: Workload, target: str) -> None:
    """Traces the workload's loss on one example, abstractly (`autoaccum._preflight.trace_loss`), before any child
    starts; an error of the loss's own is bad input (exit 2) shown with the user's frames: file, line, code."""
    import traceback

    from autoaccum._preflight import trace_loss

    try:
        trace_loss(w.loss_fn, w.params, w.batch, w.state)
    except Exception as e:  # the user's loss raised: shown with their own frames, whatever it was
        package = str(Path(__file__).resolve().parents[1])
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(package)]
        where = "".join(traceback.format_list(frames)).rstrip()
        raise click.BadParameter(
            f"`loss_fn` of {target!r} raised {type(e).__name__}: {e}, traced on the batch's shapes before any "
            f"trial:\n{where}",
            param_hint="WORKLOAD",
        ) from e


def usage_error(error: Exception) -> click.UsageError:
    """Bad input the library refused, for the command line (exit 2): its message and the notes autoaccum added
    (which knob setting, how the loss was called), arguments named by their flags (`as_flags`)."""
    notes = [n for n in getattr(error, "__notes__", ()) if not n.startswith("-")]  # (not JAX's traceback note)
    return click.UsageError(as_flags(" ".join([str(error), *notes])))


def as_flags(message: str, command: click.Command | None = None) -> str:
    """``message`` (the library's, naming its arguments in backticks) with each argument that ``command`` (default:
    the command running now, if any) has as an option named by its flag, and ``pass name=True`` by its switch.

    Example:
      >>> command = click.Command("tune", params=[click.Option(["--min-microbatch"], type=int),
      ...                                         click.Option(["--fresh"], is_flag=True)])
      >>> as_flags("`min_microbatch`=600 is above `effective_batch`; pass fresh=True, not f(fresh=True)", command)
      '`--min-microbatch`=600 is above `effective_batch`; pass --fresh, not f(fresh=True)'
    """
    if command is None:
        ctx = click.get_current_context(silent=True)
        if ctx is None:
            return message
        command = ctx.command
    flags = {p.name: p.opts[0] for p in command.params if isinstance(p, click.Option) and p.opts[0].startswith("--")}
    switches = {p.name: p.opts[0] for p in command.params if isinstance(p, click.Option) and p.is_flag}
    message = re.sub(
        r"\bpass (\w+)=True\b", lambda m: f"pass {switches.get(m.group(1), m.group(1) + '=True')}", message
    )
    return re.sub(r"`(\w+)`", lambda m: f"`{flags.get(m.group(1), m.group(1))}`", message)
