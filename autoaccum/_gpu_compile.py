"""XLA's real GPU compiler on a machine without a GPU: compile-only devices for a catalogued GPU.

With ``jax-cuda12-plugin`` (or ``jax-cuda13-plugin``) installed at the installed jax's version (the
``gpu-plan`` extra), ``jax.experimental.topologies.get_topology_desc(platform="cuda", topology="1x1xN",
target_config=...)`` gives N compile-only GPU devices described by a ``GpuTargetConfigProto``; a program lowered
with arguments on their shardings compiles with XLA's GPU compiler for that card, and
``Compiled.memory_analysis()`` is the GPU compiler's. No driver, no CUDA libraries, no GPU are needed.

The target descriptions (compute capability, SM count, memory, shared memory, L2, clock, bandwidth, registers,
cuDNN version) are data files in ``autoaccum/targets/``, written from the vendors' documents with each figure's
source beside it; `autoaccum devices --target-config` prints a real card's, so users can add their own
(`target_config` reads a path too).

Traps handled here:

* XLA's GPU compiler rematerialises to fit the card's memory: a step that does not fit would come back smaller
  than it is (and slower). Programs are compiled against `COMPILE_MEMORY_BYTES` instead of the card's size, and
  the budget is applied to the figures afterwards (`tests/test_gpu_plan.py` shows the difference).
* A program whose arguments carry no GPU sharding compiles for the default backend (the CPU) without a word:
  `check_gpu` raises unless every compiled program's devices are GPUs.
* ``Compiled.cost_analysis()`` is empty for compile-only executables and ``Lowered.cost_analysis()`` is not
  implemented for a PJRT plugin: `gpu_cost` runs XLA's HLO cost analysis on the GPU-optimised modules
  (FLOPs at least those of the unoptimised program, whose matmuls the GPU compiler may hand to cuBLAS calls
  that the analysis cannot count).
* cuDNN fused attention: the targets name cuDNN 9.8, so XLA may plan cuDNN fusions as it would on the card;
  ``jax.nn.dot_product_attention(implementation="cudnn")`` lowers to a cuDNN custom call whose workspace the
  compile-only analysis cannot size; use ``implementation="xla"`` (the default picks XLA off a live GPU).

Example:
  >>> from autoaccum._gpu_compile import describe
  >>> describe("H100").arch, describe("a100").memory_bytes // 2**30
  ('sm_90', 40)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from autoaccum._batch import abstract
from autoaccum._catalog import UnknownAcceleratorError, lookup, suggest
from autoaccum._driver_noise import has_driver, without_driver_noise
from autoaccum.strategies import PyTree

PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
"""The distributions that carry XLA's CUDA compiler, newest CUDA last."""

COMPILE_MEMORY_BYTES = 2**44
"""The device memory size the GPU compiler is told (16 TiB): far above any card, so that it never
rematerialises a step to fit; the card's real budget is applied to the figures afterwards."""

GPU_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_disable_gpuasm_optimizations": True,
    "xla_llvm_disable_expensive_passes": True,
}
"""Options for GPU programs compiled to be analysed, not run: compile-only ones, and the estimate's on a card
(`autoaccum.estimate`). Matrix products go to cuBLAS, as XLA falls back to when it cannot autotune: without a GPU
nothing is autotuned, and XLA's Triton GEMM tiling then fails on some small products (jax 0.10.2: ``Couldn't find
output tile sizes`` for an f32[784,32] weight gradient); on a card, no Triton tiling is autotuned. Code generation
is not optimised (ptxas and LLVM's expensive passes off: 2.4 s to 1.4 s for the MLP's step): buffer assignment comes
before it, so the memory figures are the same (``tests/test_gpu_plan.py`` checks it)."""

_FILES = {
    "H100-80GB": "h100_80gb",
    "H100-PCIe": "h100_pcie",
    "H200": "h200",
    "A100-40GB": "a100_40gb",
    "A100-80GB": "a100_80gb",
    "L4": "l4",
    "A10": "a10",
    "RTX-4090": "rtx_4090",
    "T4": "t4",
}


class _QuietWithoutDriver(logging.Filter):
    """Drops jax's "Jax plugin configuration error ... Unable to load CUDA" traceback on a machine with no NVIDIA
    driver: there the CUDA plugin (the gpu-plan extra) is installed for its compiler only, and the card-less
    start it reports is expected. With a driver the message stands (it explains a broken CUDA install)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (
            record.getMessage().startswith("Jax plugin configuration error")
            and error is not None
            and "Unable to load CUDA" in str(error)
        )


def quiet_plugin_start() -> None:
    """Installs `_QuietWithoutDriver` on jax's backend logger when this machine has no NVIDIA driver (no
    ``/proc/driver/nvidia``); called when autoaccum is imported, before jax starts its backends."""
    if not has_driver():
        from autoaccum._jax_private import BACKEND_LOGGER

        logger = logging.getLogger(BACKEND_LOGGER)
        if not any(isinstance(f, _QuietWithoutDriver) for f in logger.filters):
            logger.addFilter(_QuietWithoutDriver())


class GpuCompilerUnavailable(RuntimeError):
    """XLA's GPU compiler cannot be used here (the message says why and what to install)."""


@dataclasses.dataclass(frozen=True)
class TargetDescription:
    """What a target description says, in brief: for labels and checks.

    Attributes:
      name: the catalog name (``"H100-80GB"``) or the file's stem for a description given by path.
      compute_capability: ``(major, minor)``.
      core_count: streaming multiprocessors.
      memory_bytes: the card's memory in the description.
      text: the description itself (``GpuTargetConfigProto`` text format).
    """

    name: str
    compute_capability: tuple[int, int]
    core_count: int
    memory_bytes: int
    text: str

    @property
    def arch(self) -> str:
        """``"sm_90"`` for compute capability 9.0."""
        return f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"

    def with_memory(self, memory_bytes: int) -> str:
        """The description with ``device_memory_size`` replaced by ``memory_bytes``."""
        text, n = re.subn(r"(device_memory_size:\s*)\d+", rf"\g<1>{int(memory_bytes)}", self.text)
        if n != 1:
            raise ValueError(f"the target description of {self.name} must set device_memory_size once.")
        return text


def known_targets() -> tuple[str, ...]:
    """The catalogued GPUs that have a target description.

    Example:
      >>> "A100-40GB" in known_targets()
      True
    """
    return tuple(_FILES)


def _field(text: str, name: str, default: int | None = None) -> int:
    m = re.search(rf"\b{name}:\s*(\d+)", text)
    if m is None and default is None:
        raise ValueError(f"the target description has no {name}.")
    return default if m is None else int(m.group(1))  # type: ignore[return-value]


def describe(target: str | Path) -> TargetDescription:
    """The target description of a catalogued GPU (by any of its names), or of a file (a `Path`).

    Raises:
      UnknownAcceleratorError: no description for ``target``; the message names the known ones.
    """
    if isinstance(target, Path):
        text, name = target.read_text(), target.stem
    else:
        try:
            name = lookup(target).name
        except UnknownAcceleratorError:
            name = target
        if name not in _FILES:
            close = suggest(target)
            hint = f" Did you mean {close!r}?" if close in _FILES else ""
            raise UnknownAcceleratorError(
                f"no GPU target description for `target`={target!r}.{hint} Known: {', '.join(known_targets())}; or "
                "pass the path of a description (`autoaccum devices --target-config` prints a real card's)."
            )
        text = importlib.resources.files("autoaccum").joinpath(f"targets/{_FILES[name]}.txtpb").read_text()
    body = re.sub(r"#.*", "", text)
    capability = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", body)
    if capability is None:
        raise ValueError(f"the target description of {name} has no cuda_compute_capability.")
    # proto3 text leaves out zeros: a real card's description says "{ major: 9 }" for 9.0.
    major, minor = _field(capability.group(1), "major"), _field(capability.group(1), "minor", default=0)
    return TargetDescription(name, (major, minor), _field(body, "core_count"), _field(body, "device_memory_size"), body)


# -- is the compiler here ------------------------------------------------------------------------------------


def _installed_plugin() -> tuple[str, str] | None:
    """``(distribution, version)`` of the CUDA plugin installed, preferring one at jax's version."""
    found = []
    for dist in PLUGINS:
        try:
            found.append((dist, importlib.metadata.version(dist)))
        except importlib.metadata.PackageNotFoundError:
            continue
    for dist, version in found:
        if version == jax.__version__:
            return dist, version
    return found[0] if found else None


def compiler_status() -> str | None:
    """``None`` when XLA's GPU compiler can be used here, else why not and the exact command that fixes it.

    Example:
      >>> status = compiler_status()
      >>> status is None or "pip install" in status
      True
    """
    plugin = _installed_plugin()
    fix = f'pip install "jax-cuda12-plugin=={jax.__version__}"'
    if plugin is None:
        return f"XLA's GPU compiler is not installed (the gpu-plan extra): {fix}"
    dist, version = plugin
    if version != jax.__version__:
        return f"{dist} {version} does not match jax {jax.__version__}: {fix.replace('jax-cuda12-plugin', dist)}"
    return None


def require_compiler() -> None:
    """Raises `GpuCompilerUnavailable` (with the fix) unless XLA's GPU compiler can be used here."""
    status = compiler_status()
    if status is not None:
        raise GpuCompilerUnavailable(status)


# -- compile-only GPU devices ------------------------------------------------------------------------------------


def _plugin_library() -> Path:
    """The installed CUDA plugin's shared library (its PJRT C API, which holds the compiler)."""
    plugin = _installed_plugin()
    assert plugin is not None
    package = "jax_plugins.xla_cuda" + plugin[0].split("cuda")[1].split("-")[0]
    for name in ("xla_cuda_plugin.so", "pjrt_c_api_gpu_plugin.so"):
        path = Path(str(importlib.resources.files(package).joinpath(name)))
        if path.exists():
            return path
    raise GpuCompilerUnavailable(f"{plugin[0]} is installed but its library is missing; reinstall it.")


@functools.cache
def _devices(config: str, count: int) -> tuple[Any, ...]:
    """``count`` compile-only GPU devices described by ``config`` (cached: one topology per description)."""
    from jax.experimental import topologies

    require_compiler()
    topology = f"1x1x{count}"
    with without_driver_noise():  # the plugin's "Could not find cuda drivers" when it loads
        try:
            described = topologies.get_topology_desc(platform="cuda", topology=topology, target_config=config)
            return tuple(described.devices)
        except NotImplementedError:
            # jax registers the plugin only after checking the CUDA libraries it would run with, which a machine
            # without a GPU lacks (unless JAX_PLATFORMS leaves cuda out): load its compiler directly.
            c_api = _c_api()
            from autoaccum._jax_private import xla_client

            made = xla_client().make_c_api_device_topology(c_api, "", topology=topology, target_config=config)
            return tuple(made._make_compile_only_devices())


@functools.lru_cache(maxsize=1)
def _c_api() -> Any:
    """The CUDA plugin's PJRT C API, loaded from its library when jax did not register it."""
    from autoaccum._jax_private import xla_bridge, xla_client

    registered = xla_bridge()._backend_factories.get("cuda")
    if registered is not None and registered.c_api is not None:
        return registered.c_api
    if xla_client().pjrt_plugin_loaded("cuda"):
        raise GpuCompilerUnavailable(
            "the CUDA plugin is loaded but not registered with jax; start Python with JAX_PLATFORMS=cpu (or cuda)."
        )
    return xla_client().load_pjrt_plugin_dynamically("cuda", str(_plugin_library()))


def gpu_mesh(
    target: str | Path,
    shape: Sequence[int] = (1,),
    axis_names: Sequence[str] = ("data",),
    axis_types: Sequence[Any] | None = None,
) -> jax.sharding.Mesh:
    """A mesh of compile-only devices of ``target`` (memory raised to `COMPILE_MEMORY_BYTES`)."""
    config = describe(target).with_memory(COMPILE_MEMORY_BYTES)
    count = int(np.prod(shape))
    devices = np.asarray(_devices(config, count), dtype=object).reshape(tuple(shape))
    kwargs = {} if axis_types is None else {"axis_types": tuple(axis_types)}
    return jax.sharding.Mesh(devices, tuple(axis_names), **kwargs)


def on_gpu(target: str | Path, *trees: PyTree) -> tuple[PyTree, ...]:
    """``trees`` as ``jax.ShapeDtypeStruct`` on compile-only devices of ``target`` (nothing is allocated).

    Leaves laid out over a mesh keep their ``PartitionSpec`` on a GPU mesh of the same shape, axis names and
    axis types; other leaves are placed on one GPU (on the mesh, replicated).
    """
    meshes = {
        (s.mesh.axis_names, s.mesh.devices.shape, tuple(getattr(s.mesh, "axis_types", ()) or ()))
        for tree in trees
        for x in jax.tree.leaves(tree)
        if isinstance(s := getattr(x, "sharding", None), jax.sharding.NamedSharding) and s.mesh.size > 1
    }
    if len(meshes) > 1:
        raise ValueError(f"the arguments are laid out over {len(meshes)} different meshes; use one.")
    if meshes:
        ((names, shape, types),) = meshes
        mesh = gpu_mesh(target, shape, names, types or None)
    else:
        mesh = gpu_mesh(target)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(x: Any) -> jax.ShapeDtypeStruct:
        s = getattr(x, "sharding", None)
        spec = s.spec if isinstance(s, jax.sharding.NamedSharding) and s.mesh.size > 1 else None
        sharding = replicated if spec is None else jax.sharding.NamedSharding(mesh, spec)
        plain = abstract(x, sharded=False)
        return jax.ShapeDtypeStruct(plain.shape, plain.dtype, sharding=sharding, weak_type=plain.weak_type)

    return tuple(jax.tree.map(place, tree) for tree in trees)


def check_gpu(compiled: jax.stages.Compiled) -> None:
    """Raises ``RuntimeError`` unless ``compiled`` was compiled for GPUs (its arguments' and results' devices).

    A program none of whose arguments carries a GPU sharding compiles for the default backend, the CPU,
    without a word: its figures would be the CPU compiler's under a GPU's name.
    """
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    platforms = {d.platform for s in shardings for d in s.device_set}
    if platforms != {"gpu"}:
        found = ", ".join(sorted(platforms)) or "none"
        raise RuntimeError(
            f"a program meant for the GPU compiler was compiled for {found}: its arguments must carry the "
            "compile-only GPU devices' shardings (autoaccum._gpu_compile.on_gpu)."
        )


def _cost(module: Any) -> dict[str, float]:
    from autoaccum._jax_private import jaxlib_extension, xla_bridge

    for platform in ("cpu", None):  # XLA's HLO cost analysis runs on any client that implements it
        try:
            backend = xla_bridge().get_backend(platform)
            return dict(jaxlib_extension().hlo_module_cost_analysis(backend, module))
        except (RuntimeError, NotImplementedError, jax.errors.JaxRuntimeError):
            continue
    return {}


def gpu_cost(compiled: jax.stages.Compiled, lowered: jax.stages.Lowered) -> tuple[float, float]:
    """``(flops, bytes_accessed)`` of a GPU compile-only program, from XLA's HLO cost analysis.

    Bytes accessed are the GPU-optimised program's (what its fused kernels read and write); FLOPs are the larger
    of the optimised and the unoptimised program's: matmuls the compiler hands to cuBLAS are custom calls the
    analysis cannot count, and the unoptimised program's count is the algorithm's.
    """
    flops = moved = 0.0
    executable: Any = compiled.runtime_executable()
    for module in executable.hlo_modules():
        cost = _cost(module)
        flops += max(float(cost.get("flops", 0.0)), 0.0)
        moved += float(cost.get("bytes accessed", 0.0))
    calls, call_bytes = _custom_calls(compiled.as_text() or "")
    moved = max(moved + calls + call_bytes, 0.0)  # the analysis counts each custom call (cuBLAS) as -1 byte
    from autoaccum._jax_private import lowered_hlo

    unoptimised = _cost(lowered_hlo(lowered))  # Lowered.cost_analysis(), on a client that has it
    return max(flops, float(unoptimised.get("flops", 0.0))), moved


_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+([\w-]+)\(([^)]*)\)"
)
_ARRAY = re.compile(r"([a-z]+)(\d*)\[([0-9,]*)\]")


def _array_bytes(shape: str, skip_workspace: bool = False) -> int:
    """Bytes of an HLO shape (a tuple's elements summed; with ``skip_workspace``, a trailing ``s8`` scratch
    buffer left out)."""
    arrays = _ARRAY.findall(shape)
    if skip_workspace and len(arrays) > 1 and arrays[-1][:2] == ("s", "8"):
        arrays = arrays[:-1]
    total = 0
    for kind, bits, dims in arrays:
        size = 1 if kind == "pred" else max(int(bits or 8) // 8, 1)
        total += size * int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
    return total


def _custom_calls(hlo_text: str) -> tuple[int, int]:
    """``(count, bytes)`` of the custom calls in a compiled program: their operands and results (workspace left
    out), which XLA's cost analysis cannot see into.

    Example:
      >>> text = '''
      ... %a = f32[4,8]{1,0} parameter(0)
      ... %b = f32[8,2]{1,0} parameter(1)
      ... %c = (f32[4,2]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm"
      ... '''
      >>> _custom_calls(text) == (1, 4 * (32 + 16 + 8))
      True
    """
    shapes: dict[str, str] = {}
    count = total = 0
    for line in hlo_text.splitlines():
        m = _DEFINITION.match(line)
        if m is None:
            continue
        name, shape, op, operands = m.groups()
        shapes[name] = shape
        if op == "custom-call":
            count += 1
            total += _array_bytes(shape, skip_workspace=True)
            names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
            total += sum(_array_bytes(shapes.get(n, "")) for n in names)
    return count, total
