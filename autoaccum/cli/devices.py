"""``autoaccum devices``: each JAX device, its memory, and where each figure came from."""

from __future__ import annotations

import json

import click


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print only JSON (one object per device).")
def devices(as_json: bool) -> None:
    """List the JAX devices with their total, free and usable memory (NVML, XLA or the OS).

    \b
    Exit codes: 0 success; 2 bad usage.
    """
    from rich.console import Console
    from rich.table import Table

    from autoaccum.device import all_devices
    from autoaccum.units import format_bytes

    infos = all_devices()
    if as_json:
        click.echo(json.dumps([i.to_dict() for i in infos], indent=2))
        return

    def size(n: int | None) -> str:
        return "?" if n is None else format_bytes(n)

    table = Table()
    for column in ("id", "platform", "name", "total", "free", "usable", "sources"):
        table.add_column(column)
    for i in infos:
        sources = ", ".join(f"{k}: {v}" for k, v in sorted(i.sources.items()))
        table.add_row(
            str(i.id), i.platform, i.name, size(i.total_bytes), size(i.free_bytes), size(i.memory_limit_bytes),
            sources,
        )  # fmt: skip
    Console().print(table)
