"""``autoaccum devices``: each JAX device, its memory, and where each figure came from."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from autoaccum._device import DeviceInfo


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print only JSON (one object per device).")
@click.option(
    "--target-config", is_flag=True,
    help="Print this machine's GPU as XLA describes it (a target description, text format): save it as a .txtpb "
    "file and pass its path to `autoaccum plan --gpu` or estimate(target=Path(...)) to plan for this card "
    "anywhere.",
)  # fmt: skip
def devices(as_json: bool, target_config: bool) -> None:
    """List the JAX devices with their total and free memory, and the default memory limit a probe uses.

    \b
    Exit codes: 0 success; 1 --target-config on a machine without an NVIDIA GPU; 2 bad usage.
    """
    from autoaccum._device import all_devices, resolve_memory_limit
    from autoaccum._units import format_bytes
    from autoaccum.cli._console import fit_table, make_console

    if target_config:
        _print_target_config()
        return
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

    columns = [(header, "left") for header in ("id", "platform", "name", "total", "free", "memory limit", "sources")]
    rows = [
        (str(i.id), i.platform, i.name, size(i.total_bytes), size(i.free_bytes), size(limit(i)),
         ", ".join(f"{k}: {v}" for k, v in sorted(i.sources.items())))
        for i in infos
    ]  # fmt: skip
    console = make_console()
    console.print(fit_table(console, None, columns, rows))
    cpus = [i for i in infos if i.platform == "cpu"]
    if len(cpus) > 1:  # one process's host devices: a run over them all splits the RAM
        each = size(resolve_memory_limit(cpus[0], None, devices=len(cpus))[0])
        click.echo(f"The {len(cpus)} CPU devices share the RAM: a run over all of them gets {each} per device.")


def _print_target_config() -> None:
    """Prints the target description of this machine's first GPU of each kind (exit 1 without one)."""
    import jax

    from autoaccum._target_config import TargetConfigError, device_target_config

    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if not gpus:
        from autoaccum._gpu_compile import known_targets

        click.echo(
            f"no NVIDIA GPU here (jax sees: {', '.join(sorted({d.platform for d in jax.devices()}))}): "
            "--target-config prints a real card's description, on the machine that has it. Descriptions shipped "
            f"with autoaccum (autoaccum/targets/): {', '.join(known_targets())}.",
            err=True,
        )
        raise SystemExit(1)
    kinds: dict[str, list] = {}
    for d in gpus:
        kinds.setdefault(d.device_kind, []).append(d)
    for kind, same in kinds.items():
        try:
            text = device_target_config(same[:1])
        except TargetConfigError as e:
            click.echo(f"{kind}: {e}", err=True)
            raise SystemExit(1) from e
        click.echo(f"# GPU target description of {kind}, as XLA describes it (jax {jax.__version__})")
        click.echo(text, nl=False)
