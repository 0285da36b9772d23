"""Every private JAX API autoaccum uses (``jax._src``, jaxlib's internals, ``Lowered._lowering``), in one place.

Each accessor checks the jax version first (`check_version`): on a release outside `TESTED_MINORS` it fails with a
message naming the tested versions, rather than with an ``AttributeError`` deep in a private module.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

TESTED_MINORS = ((0, 9), (0, 10), (0, 11))
"""The jax minor releases these private APIs were run on: CI's floor (0.9.1) and main (0.10.2), and the GPU kit's
image (0.11.2)."""

BACKEND_LOGGER = "jax._src.xla_bridge"
"""The name of the logger jax's backends log their start-up on."""


@functools.cache
def check_version() -> None:
    """Raises a RuntimeError naming the tested versions unless the installed jax is one of `TESTED_MINORS`."""
    import jax

    minor = tuple(int(p) for p in jax.__version__.split(".")[:2])
    if minor not in TESTED_MINORS:
        tested = ", ".join(f"{a}.{b}" for a, b in TESTED_MINORS)
        raise RuntimeError(
            f"autoaccum uses private JAX APIs here that were tested on jax {tested}, not on the installed jax "
            f"{jax.__version__}; install one of those (pip install 'jax>=0.9.1,<0.12') or an autoaccum that "
            "supports it."
        )


def xla_bridge() -> ModuleType:
    """``jax._src.xla_bridge``: the registry of backends (``backends()``, ``get_backend``, ``_backend_factories``)."""
    check_version()
    from jax._src import xla_bridge as module

    return module


def xla_client() -> ModuleType:
    """``jax._src.lib.xla_client``: PJRT plugins and compile-only topologies."""
    check_version()
    from jax._src.lib import xla_client as module

    return module


def jaxlib_extension() -> ModuleType:
    """``jax._src.lib._jax``: jaxlib's C++ extension (HLO cost analysis, device topologies)."""
    check_version()
    from jax._src.lib import _jax

    return _jax


def lowered_hlo(lowered: Any) -> Any:
    """The HLO module of a ``jax.stages.Lowered``, before XLA optimises it (``Lowered._lowering.hlo()``)."""
    check_version()
    return lowered._lowering.hlo().as_hlo_module()
