"""``autoaccum devices``: each JAX device, its memory, and where each figure came from."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from autoaccum._device import DeviceInfo


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print only JSON (one object per device).")
def devices(as_json: bool) -> None:
    """List the JAX devices with their total and free memory, and the default memory limit a probe uses.

    \b
    Exit codes: 0 success; 2 bad usage.
    """
    from rich.console import Console
    from rich.table import Table

    from autoaccum._device import all_devices, resolve_memory_limit
    from autoaccum._units import format_bytes

    infos = all_devices()

    def limit(info: DeviceInfo) -> int | None:
        try:
            return resolve_memory_limit(info, None)[0]
        except ValueError:  # the policy cannot give a default here (the table says "?")
            return None

    if as_json:
        click.echo(json.dumps([{**i.to_dict(), "memory_limit_bytes": limit(i)} for i in infos], indent=2))
        return

    def size(n: int | None) -> str:
        return "?" if n is None else format_bytes(n)

    table = Table()
    for column in ("id", "platform", "name", "total", "free", "memory limit", "sources"):
        table.add_column(column)
    for i in infos:
        sources = ", ".join(f"{k}: {v}" for k, v in sorted(i.sources.items()))
        table.add_row(
            str(i.id), i.platform, i.name, size(i.total_bytes), size(i.free_bytes), size(limit(i)),
            sources,
        )  # fmt: skip
    Console().print(table)
