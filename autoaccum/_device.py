"""Which device a step runs on and how much memory it has: NVML and XLA on NVIDIA GPUs, the OS on the CPU.

Every figure in a `DeviceInfo` says where it came from (``sources``), so a report can be trusted or checked:

* ``"nvml"``: the NVIDIA driver (``nvidia-ml-py``), for the card's name, total and free bytes. NVML numbers
  devices in PCI order and ignores ``CUDA_VISIBLE_DEVICES``; `nvml_index` maps a JAX device through it
  (indices or ``GPU-<uuid>`` entries, unique UUID prefixes included). With ``CUDA_DEVICE_ORDER`` left at
  CUDA's default (fastest first), identical cards are still in PCI order; mixed cards need
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` for the mapping to be exact.
* ``"jax.memory_stats"``: XLA's allocator; ``bytes_limit`` is what it will really hand out (by default 75% of
  the card, see ``XLA_CLIENT_MEM_FRACTION``).
* ``"/proc/meminfo"``, ``"cgroup"``, ``"sysconf"``: host RAM for the CPU (a container's cgroup limit wins
  over the machine's RAM).

No NVIDIA driver (``NVMLError_LibraryNotFound``, ``NVMLError_DriverNotLoaded``, ...) is not an error: the
figures then come from XLA, or from the OS on the CPU.

`resolve_memory_limit` is THE memory-limit policy: the probe, the estimate, the tuner and the CLI all ask it
what a step may use when the user gives no ``memory_limit``, and it checks the one they give.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax

from autoaccum._json import NOT_JSON, JsonMixin
from autoaccum._units import format_bytes, parse_bytes

CPU_MEMORY_FRACTION = 0.5
"""With no ``memory_limit`` on the CPU, a step may use this fraction of the RAM available now (never swap)."""

GPU_CONTEXT_BYTES = 512 * 2**20
"""What a trial's child process needs on a GPU outside its XLA allocator (CUDA context, cuBLAS/cuDNN
handles): kept free when the default limit is taken from the memory free on the card."""

_GPU_PLATFORMS = {"gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"}


class MemoryLimitWarning(UserWarning):
    """A ``memory_limit`` given above what the device has (`resolve_memory_limit` uses the smaller figure).

    Filter it like any warning: ``warnings.filterwarnings("ignore", category=autoaccum.MemoryLimitWarning)``.
    """


@dataclasses.dataclass(frozen=True)
class DeviceInfo(JsonMixin):
    """One device and its memory, each figure with its source.

    Attributes:
      platform: ``"gpu"``, ``"cpu"`` or ``"tpu"``.
      name: e.g. ``"NVIDIA H100 80GB HBM3"``, or the CPU's model name.
      total_bytes: the device's memory (host RAM, or the cgroup limit, on the CPU); None if unknown.
      free_bytes: memory free now on the whole device (other processes count); None if unknown.
      limit_bytes: what XLA's allocator will give this process (``memory_stats()["bytes_limit"]``); on the
        CPU there is no allocator limit and this is None.
      device: the ``jax.Device``.
      sources: where each figure came from, e.g. ``{"total_bytes": "nvml", "limit_bytes": "jax.memory_stats"}``.
      nvml_index: the NVML (PCI-order) index of a GPU, when the driver answered.
      visible_id: the entry that selects this GPU in ``CUDA_VISIBLE_DEVICES`` (for child processes).
      id: the JAX device id.

    Example:
      >>> import autoaccum
      >>> info = autoaccum.detect_device()
      >>> info.platform in ("cpu", "gpu", "tpu")
      True
    """

    platform: str
    name: str
    total_bytes: int | None
    free_bytes: int | None
    limit_bytes: int | None
    device: Any = dataclasses.field(metadata=NOT_JSON, default=None, repr=False, compare=False, hash=False)
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    nvml_index: int | None = None
    visible_id: str | None = None
    id: int | None = None
    """The JAX device id (``device``'s when not given; kept in JSON, where ``device`` is not)."""

    def __post_init__(self) -> None:
        if self.id is None and self.device is not None:
            object.__setattr__(self, "id", int(self.device.id))


def detect_device(device: Any = None) -> DeviceInfo:
    """Describes ``device`` (default: the first JAX device) and its memory; never fails for lack of a GPU.

    Args:
      device: a ``jax.Device``, or None for ``jax.devices()[0]``.

    Returns:
      A `DeviceInfo`. On NVIDIA GPUs the name, total and free bytes come from NVML when the driver answers,
      ``limit_bytes`` from XLA's allocator; without NVML they come from ``memory_stats()``. On the CPU, total
      and free bytes come from ``/proc/meminfo`` (``MemAvailable``), capped by a cgroup memory limit.

    Raises:
      TypeError: ``device`` is not a ``jax.Device``.

    Example:
      >>> import autoaccum
      >>> autoaccum.detect_device().total_bytes > 0
      True
    """
    if device is None:
        device = jax.devices()[0]
    if not (hasattr(device, "platform") and hasattr(device, "memory_stats")):
        raise TypeError(f"`device` must be a jax.Device or None, got {type(device).__name__}: {device!r}.")
    platform = _GPU_PLATFORMS.get(str(device.platform).lower(), str(device.platform).lower())
    stats = memory_stats(device)
    sources: dict[str, str] = {}
    limit = stats.get("bytes_limit")
    if limit is not None:
        sources["limit_bytes"] = "jax.memory_stats"
    if platform == "cpu":
        total, free, where = host_memory()
        sources.update(total_bytes=where, free_bytes=where, name="/proc/cpuinfo")
        return DeviceInfo("cpu", cpu_name(), total, free, None, device, sources)
    name = str(getattr(device, "device_kind", platform))
    sources["name"] = "jax"
    total = free = None
    nvml_index = visible_id = None
    if platform == "gpu":
        visible_id = visible_entry(int(device.local_hardware_id))
        nvml = nvml_memory(visible_id)
        if nvml is not None:
            nvml_index, name, total, free = nvml
            sources.update(name="nvml", total_bytes="nvml", free_bytes="nvml")
    if total is None and limit is not None:
        total = int(limit)
        sources["total_bytes"] = "jax.memory_stats (bytes_limit)"
    if free is None and limit is not None:
        free = int(limit) - int(stats.get("bytes_in_use", 0))
        sources["free_bytes"] = "jax.memory_stats (bytes_limit - bytes_in_use)"
    return DeviceInfo(
        platform, name, total, free, None if limit is None else int(limit), device, sources, nvml_index, visible_id
    )


def memory_stats(device: Any) -> dict[str, int]:
    """``device.memory_stats()``, or ``{}`` where the backend keeps none (the CPU returns None)."""
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError, AttributeError):  # backends without allocator statistics
        return {}
    return dict(stats or {})


def visible_entry(ordinal: int, env: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry that selects CUDA device ``ordinal`` of this process.

    Example:
      >>> visible_entry(1, {"CUDA_VISIBLE_DEVICES": "3,GPU-8a2c"})
      'GPU-8a2c'
      >>> visible_entry(1, {})
      '1'
    """
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return str(ordinal)
    entries = [e.strip() for e in raw.split(",") if e.strip()]
    if ordinal >= len(entries):
        return str(ordinal)
    return entries[ordinal]


def nvml_memory(entry: str) -> tuple[int, str, int, int] | None:
    """``(nvml_index, name, total, free)`` of the GPU that ``CUDA_VISIBLE_DEVICES`` entry ``entry`` selects.

    ``entry`` is an NVML/PCI-order index or a (prefix of a) ``GPU-<uuid>``. None when NVML is missing or
    cannot answer (no driver, a MIG instance, an entry it does not know): callers fall back to XLA's figures.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable NVIDIA driver
        return None
    try:
        index = _nvml_index(pynvml, entry)
        if index is None:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(handle)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        return index, name, int(mem.total), int(mem.free)
    except pynvml.NVMLError:  # e.g. NVMLError_NotSupported, GpuIsLost: report XLA's figures instead
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvml_index(pynvml: Any, entry: str) -> int | None:
    if entry.isdigit():
        index = int(entry)
        return index if index < pynvml.nvmlDeviceGetCount() else None
    if entry.upper().startswith("GPU-"):
        prefix = entry.lower()
        matches = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if uuid.lower().startswith(prefix):
                matches.append(index)
        return matches[0] if len(matches) == 1 else None
    return None  # MIG-<uuid> instances: NVML's per-card figures would be wrong, use XLA's


def host_memory() -> tuple[int | None, int | None, str]:
    """``(total, available, source)`` of host RAM, capped by this process's cgroup memory limit if lower."""
    total = available = None
    source = "/proc/meminfo"
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        text = ""
    fields = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0]) * 1024
    total, available = fields.get("MemTotal"), fields.get("MemAvailable", fields.get("MemFree"))
    if total is None:
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page
            available = os.sysconf("SC_AVPHYS_PAGES") * page
            source = "sysconf"
        except (ValueError, OSError, AttributeError):  # not POSIX, or the names are unknown here
            return None, None, "unknown"
    cap = cgroup_limit()
    if cap is not None and total is not None and cap[0] < total:
        limit, used = cap
        total = limit
        available = max(0, limit - used) if available is None else min(available, max(0, limit - used))
        source = "cgroup"
    return total, available, source


def cgroup_limit(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> tuple[int, int] | None:
    """``(limit, used)`` of the tightest memory limit on this process: its own cgroup's or an ancestor's (v2
    ``memory.max``, v1 ``memory.limit_in_bytes``), None where none is set. ``used`` leaves out the page cache the
    kernel can drop (``inactive_file``): the working set, as container runtimes count it."""
    own = _own_cgroups(proc)
    found: list[tuple[int, int]] = []
    for base, key, limit_name, usage_name, cache in (
        (root, "", "memory.max", "memory.current", "inactive_file"),
        (root / "memory", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
    ):
        folder = base / own.get(key, "")
        for place in [folder, *folder.parents]:
            try:
                limit_text = (place / limit_name).read_text().strip()
                usage_text = (place / usage_name).read_text().strip()
            except OSError:
                limit_text = usage_text = ""
            if limit_text.isdigit() and usage_text.isdigit() and int(limit_text) < 1 << 60:
                found.append((int(limit_text), max(0, int(usage_text) - _stat(place / "memory.stat", cache))))
            if place == base:
                break
    return min(found, default=None)


def _stat(path: Path, key: str) -> int:
    """``key``'s value in a cgroup's ``memory.stat`` (0 where it cannot be read)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _own_cgroups(proc: Path = Path("/proc")) -> dict[str, str]:
    """This process's cgroup by controller (``""`` for cgroup v2), from ``/proc/self/cgroup``."""
    own: dict[str, str] = {}
    try:
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(","):
                own[controller] = path.strip("/")
    except (OSError, ValueError):  # no cgroups here, or a line of another form
        pass
    return own


def oom_kills(root: Path = Path("/sys/fs/cgroup"), proc: Path = Path("/proc")) -> int | None:
    """Processes the kernel's OOM killer has killed, counted where this process's memory is: by its cgroup (v2
    ``memory.events``, v1 ``memory.oom_control``; the cgroup mounted at ``root`` when this process's own is not
    there), else by the kernel (``/proc/vmstat``: every process of the machine); None where no count can be read.

    A count that rose while a child ran says the OOM killer killed it (with the kernel's count: it, or another
    process at the same time).
    """
    own = _own_cgroups(proc)
    places = [root / own.get("", "") / "memory.events", root / "memory.events"]
    places += [root / "memory" / own.get("memory", "") / "memory.oom_control", root / "memory" / "memory.oom_control"]
    for place in [*places, proc / "vmstat"]:
        try:
            text = place.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``, else ``"cpu"``."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"


def device_kind() -> str:
    """What this process measures on: the first JAX device's kind; on the CPU (whose kind is just ``"cpu"``), its
    model and the cores this process may use, which both change a timing (``"AMD EPYC 7B13 (2 cores)"``)."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        return str(device.device_kind)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu_name()} ({cores} cores)"


def all_devices() -> list[DeviceInfo]:
    """`detect_device` for every JAX device."""
    return [detect_device(d) for d in jax.devices()]


def default_gpu_fraction(env: Mapping[str, str] | None = None) -> float:
    """The fraction of a GPU that JAX's allocator takes in a new process: ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    (or ``XLA_CLIENT_MEM_FRACTION``), else JAX's default 0.75.

    Example:
      >>> default_gpu_fraction({}), default_gpu_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9"})
      (0.75, 0.9)
    """
    env = os.environ if env is None else env
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        raw = env.get(name)
        if raw:
            try:
                value = float(raw)
            except ValueError:
                continue
            if 0 < value <= 1:
                return value
    return 0.75


def resolve_memory_limit(
    info: DeviceInfo, memory_limit: int | float | str | None, *, isolate: bool = True, devices: int = 1
) -> tuple[int, str]:
    """THE memory-limit policy: the bytes a step may use on ``info``'s device, and where that figure came from.

    The limit is per device; on the CPU, ``devices`` (a mesh's) share the RAM, each an equal part of it.

    ``memory_limit`` given: it is checked and used as is (on a GPU it must fit in the memory free now, since
    a trial's process allocates it), unless it is above the device's memory (the RAM on the CPU, the card's
    memory on a GPU): then a `MemoryLimitWarning` says so and the smaller figure is used (the RAM; on a GPU
    what is free on the card now, less `GPU_CONTEXT_BYTES` for the trial's CUDA context). With none:

    * CPU: `CPU_MEMORY_FRACTION` of the RAM available now (never more, so a probe never drives the machine
      into swap or the OOM killer), rounded down to an eighth of its leading power of two, so that it stays
      the same while the available RAM moves a little (a tune's study, under a fingerprint of the limit,
      resumes);
    * GPU, ``isolate=True`` (trials in child processes): what JAX's allocator takes in a new process (its
      fraction of the card, `default_gpu_fraction`), but never more than is free on the card now less
      `GPU_CONTEXT_BYTES` for the child's CUDA context. When this process has preallocated (JAX's default:
      75% of the card as soon as it touches the GPU) the free memory is what is left, and the source says so;
    * GPU or TPU, ``isolate=False``: this process's own allocator limit (``bytes_limit``).

    Raises:
      ValueError, TypeError: the limit does not parse, exceeds the memory free on the card (but not the card's
        memory), needs isolation, or cannot be determined (the message says what to pass).

    Warns:
      MemoryLimitWarning: ``memory_limit`` is above the device's memory (the smaller is used).

    Example:
      >>> info = DeviceInfo("cpu", "cpu", 8 * 2**30, 6 * 2**30, None)
      >>> resolve_memory_limit(info, None)[0] == 3 * 2**30
      True
      >>> [resolve_memory_limit(DeviceInfo("cpu", "cpu", 2**36, f, None), None)[0] / 2**30 for f in (20.3e9, 20.9e9)]
      [9.0, 9.0]
      >>> resolve_memory_limit(info, None, devices=8)[0] == 3 * 2**30 // 8  # a CPU mesh's devices share the RAM
      True
    """
    limit = None if memory_limit is None else parse_bytes(memory_limit, "memory_limit")
    if info.platform == "cpu":
        each = "" if devices == 1 else f" over {devices} devices"
        if limit is not None and info.total_bytes is not None and limit > info.total_bytes // devices:
            where = info.sources.get("total_bytes", "?")
            return _above_device(limit, info.total_bytes // devices, f"this machine's RAM ({where}){each}")
        if limit is not None:
            return limit, "memory_limit"
        if info.free_bytes is None:
            raise ValueError(
                "`memory_limit` is None and this machine's available RAM cannot be read; pass memory_limit, "
                "e.g. '4GiB'."
            )
        where = info.sources.get("free_bytes", "?")
        share = int(info.free_bytes * CPU_MEMORY_FRACTION) // devices
        steady = share // (step := 1 << max(share.bit_length() - 4, 0)) * step  # a tune's study resumes
        return steady, f"{CPU_MEMORY_FRACTION:.0%} of available RAM ({where}){each}, rounded down"
    if info.platform == "tpu" and isolate:
        raise ValueError("`isolate=True` cannot run trials on a TPU (one process owns the chip); pass isolate=False.")
    if not isolate:
        if limit is not None:
            raise ValueError(
                f"`memory_limit`={format_bytes(limit)} needs isolate=True on {info.platform}: the cap is set on a "
                "trial process's allocator when it starts; with isolate=False trials use this process's allocator "
                f"(bytes_limit={info.limit_bytes}). Drop memory_limit or keep isolate=True."
            )
        if info.limit_bytes is None:
            raise ValueError(f"`memory_limit` is None and {info.name} reports no allocator limit; pass memory_limit.")
        return info.limit_bytes, "this process's XLA allocator limit (memory_stats bytes_limit)"
    if info.total_bytes is None:
        raise ValueError(f"`memory_limit` cannot be resolved: {info.name}'s total memory is unknown (no NVML).")
    if limit is not None:
        if limit > info.total_bytes:
            if info.free_bytes is None:
                return _above_device(limit, info.total_bytes, f"{info.name}'s memory")
            usable = info.free_bytes - GPU_CONTEXT_BYTES
            if usable > 0:
                return _above_device(
                    limit,
                    usable,
                    f"the {format_bytes(info.free_bytes)} free on {info.name} (of its "
                    f"{format_bytes(info.total_bytes)}) less {format_bytes(GPU_CONTEXT_BYTES)} for a trial's CUDA "
                    "context",
                )
        if info.free_bytes is not None and limit > info.free_bytes - GPU_CONTEXT_BYTES:
            raise ValueError(
                f"`memory_limit`={format_bytes(limit)} is above the {format_bytes(info.free_bytes)} free on "
                f"{info.name} now, less {format_bytes(GPU_CONTEXT_BYTES)} for a trial's CUDA context (a process "
                "holds the rest: JAX preallocates 75% of the card unless XLA_PYTHON_CLIENT_PREALLOCATE=false is "
                "set before JAX starts). Free it, set that variable, or pass a smaller memory_limit."
            )
        return limit, "memory_limit"
    fraction = default_gpu_fraction()
    allocator = int(info.total_bytes * fraction)
    source = f"JAX's default allocator share of {info.name} ({fraction:g} of {format_bytes(info.total_bytes)})"
    if info.free_bytes is None:
        return allocator, source
    available = info.free_bytes - GPU_CONTEXT_BYTES
    if available >= allocator:
        return allocator, source
    if available <= 0:
        raise ValueError(
            f"`memory_limit` is None and only {format_bytes(info.free_bytes)} is free on {info.name}: another "
            "process (or this one: JAX preallocates 75% of the card unless XLA_PYTHON_CLIENT_PREALLOCATE=false "
            "is set before JAX starts) holds the rest. Free it or set that variable."
        )
    return available, (
        f"the {format_bytes(info.free_bytes)} free on {info.name} now, less {format_bytes(GPU_CONTEXT_BYTES)} for "
        f"the trial's CUDA context; below the allocator's share ({format_bytes(allocator)}) because a process "
        "holds the rest (JAX preallocates 75% of the card: set XLA_PYTHON_CLIENT_PREALLOCATE=false before JAX "
        "starts to probe up to the full share)"
    )


def _above_device(limit: int, device_bytes: int, what: str) -> tuple[int, str]:
    """``(device_bytes, source)`` for a ``memory_limit`` above the device's memory, after a `MemoryLimitWarning`."""
    warnings.warn(
        f"`memory_limit`={format_bytes(limit)} is above {what}, {format_bytes(device_bytes)}: using "
        f"{format_bytes(device_bytes)} (pass a smaller memory_limit to silence this warning).",
        MemoryLimitWarning,
        stacklevel=3,
    )
    return device_bytes, f"{what}: memory_limit={format_bytes(limit)} is above it"
