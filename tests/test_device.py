"""Device detection: the CPU here, a simulated NVIDIA GPU through a fake NVML, and a machine without a driver."""

from __future__ import annotations

import dataclasses
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import autoaccum
from autoaccum._device import (
    GPU_CONTEXT_BYTES,
    MemoryLimitWarning,
    detect_device,
    nvml_memory,
    resolve_memory_limit,
    visible_entry,
)
from autoaccum._isolation import child_env

GiB = 2**30
UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", "GPU-bbbc3333-0000"]


class FakeNVMLError(Exception):
    pass


class FakeLibraryNotFound(FakeNVMLError):
    pass


def fake_pynvml(*, missing: bool = False, used: float | None = None) -> types.ModuleType:
    """A stand-in for ``pynvml`` with three 80 GiB cards (PCI order), card i having i GiB in use (or ``used``
    GiB on every card)."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError  # type: ignore[attr-defined]
    m.NVMLError_LibraryNotFound = FakeLibraryNotFound  # type: ignore[attr-defined]

    def init() -> None:
        if missing:
            raise FakeLibraryNotFound("NVML Shared Library Not Found")

    m.nvmlInit = init  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: len(UUIDS)  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: UUIDS[h[1]]  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3" if h[1] == 1 else "NVIDIA A100-SXM4-80GB"  # type: ignore[attr-defined]
    in_use = (lambda h: h[1] * GiB) if used is None else (lambda h: int(used * GiB))
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=80 * GiB, free=80 * GiB - in_use(h), used=in_use(h)
    )
    return m


class FakeGpu:
    """Looks like a ``jax.Device`` on CUDA to `detect_device`."""

    platform = "gpu"
    device_kind = "NVIDIA H100 80GB HBM3"

    def __init__(self, ordinal: int, stats: dict[str, int] | None = None) -> None:
        self.id = self.local_hardware_id = ordinal
        self._stats = (
            {"bytes_limit": 60 * GiB, "bytes_in_use": GiB, "peak_bytes_in_use": GiB} if stats is None else stats
        )

    def memory_stats(self) -> dict[str, int]:
        return self._stats

    def __str__(self) -> str:
        return f"cuda:{self.id}"


def test_cpu_figures_come_from_the_os() -> None:
    info = autoaccum.detect_device()
    assert info.platform == "cpu" and info.limit_bytes is None
    assert info.total_bytes and info.free_bytes and 0 < info.free_bytes <= info.total_bytes
    assert info.sources["total_bytes"] in ("/proc/meminfo", "cgroup", "sysconf")
    limit, source = resolve_memory_limit(info, None)
    assert source == f"50% of available RAM ({info.sources['free_bytes']}), rounded down"
    assert 0.5 * 7 / 8 * info.free_bytes <= limit <= 0.5 * info.free_bytes
    # steady while the available RAM moves a little: the same limit 1% either side
    for moved in (0.99 * info.free_bytes, 1.01 * info.free_bytes):
        near = resolve_memory_limit(dataclasses.replace(info, free_bytes=int(moved)), None)[0]
        assert near == limit or abs(near - limit) / limit <= 1 / 7
    assert info.to_dict()["platform"] == "cpu"
    with pytest.raises(TypeError, match=r"`device` must be a jax\.Device"):
        detect_device("cuda:0")


def test_visible_devices_map_to_nvml_indices() -> None:
    assert visible_entry(0, {}) == "0"
    assert visible_entry(1, {"CUDA_VISIBLE_DEVICES": "2, GPU-bbbb"}) == "GPU-bbbb"
    assert visible_entry(0, {"CUDA_VISIBLE_DEVICES": ""}) == "0"


def test_nvml_lookup_by_index_and_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    assert nvml_memory("2") == (2, "NVIDIA A100-SXM4-80GB", 80 * GiB, 78 * GiB)
    assert nvml_memory("GPU-bbbb2222-0000") == (1, "NVIDIA H100 80GB HBM3", 80 * GiB, 79 * GiB)
    assert nvml_memory("GPU-aaaa")[0] == 0  # type: ignore[index]  # a unique prefix, as CUDA accepts
    assert nvml_memory("GPU-bbb") is None  # ambiguous prefix: no guess
    assert nvml_memory("7") is None and nvml_memory("MIG-1234") is None


def test_simulated_gpu_through_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-bbbb2222")
    info = detect_device(FakeGpu(1))  # CUDA ordinal 1 = the second visible entry = NVML index 1
    assert (info.platform, info.name, info.nvml_index, info.visible_id) == (
        "gpu", "NVIDIA H100 80GB HBM3", 1, "GPU-bbbb2222",
    )  # fmt: skip
    assert (info.total_bytes, info.free_bytes, info.limit_bytes) == (80 * GiB, 79 * GiB, 60 * GiB)
    assert info.sources == {
        "limit_bytes": "jax.memory_stats", "name": "nvml", "total_bytes": "nvml", "free_bytes": "nvml",
    }  # fmt: skip
    first = detect_device(FakeGpu(0))
    assert first.nvml_index == 2 and first.free_bytes == 78 * GiB


def test_no_driver_falls_back_to_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(missing=True))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = detect_device(FakeGpu(0))
    assert info.name == "NVIDIA H100 80GB HBM3" and info.nvml_index is None
    assert (info.total_bytes, info.free_bytes, info.limit_bytes) == (60 * GiB, 59 * GiB, 60 * GiB)
    assert info.sources["total_bytes"].startswith("jax.memory_stats")
    bare = detect_device(FakeGpu(0, stats={}))
    assert bare.total_bytes is None and bare.limit_bytes is None


def test_gpu_child_is_capped_through_xla_and_sees_one_card(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,GPU-bbbb2222")
    info = detect_device(FakeGpu(1))
    env = child_env(info, 20 * GiB, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".9", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb2222" and env["JAX_PLATFORMS"] == "cuda"
    assert env["XLA_CLIENT_MEM_FRACTION"] == "0.250000" and env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env and "XLA_PYTHON_CLIENT_ALLOCATOR" not in env
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    limit, source = resolve_memory_limit(info, None)  # nothing preallocated: JAX's 75% share of the card
    assert limit == 60 * GiB and source.startswith("JAX's default allocator share")
    with pytest.raises(ValueError, match=r"above the 79\.00 GiB free"):
        resolve_memory_limit(info, 79 * GiB)
    with pytest.raises(ValueError, match="needs isolate=True"):
        resolve_memory_limit(info, GiB, isolate=False)
    assert resolve_memory_limit(info, None, isolate=False)[0] == 60 * GiB


def test_gpu_default_limit_when_this_process_has_preallocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """JAX's default: the process that touched the GPU holds 75% of it (60 GiB of 80) plus its CUDA context;
    NVML then shows about 19.5 GiB free, and a trial's child can only get that, less its own context."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(used=60.5))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    info = detect_device(FakeGpu(0, stats={"bytes_limit": 60 * GiB, "bytes_in_use": GiB, "peak_bytes_in_use": GiB}))
    assert info.free_bytes == int(19.5 * GiB)
    limit, source = resolve_memory_limit(info, None)  # runs, instead of refusing
    assert limit == int(19.5 * GiB) - GPU_CONTEXT_BYTES
    assert "preallocates" in source and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in source
    with pytest.raises(ValueError, match=r"above the 19\.50 GiB free .*XLA_PYTHON_CLIENT_PREALLOCATE=false"):
        resolve_memory_limit(info, 30 * GiB)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(used=79.9))  # the card is full: say so
    with pytest.raises(ValueError, match=r"only 102\.40 MiB is free"):
        resolve_memory_limit(detect_device(FakeGpu(0)), None)


def test_every_cli_command_starts_jax_without_preallocation(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from autoaccum.cli import main

    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    result = CliRunner().invoke(main, ["devices", "--json"])
    assert result.exit_code == 0, result.output
    import os

    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_cpu_child_gets_predictable_malloc() -> None:
    env: dict[str, Any] = child_env(autoaccum.detect_device(), GiB, {"PATH": "/bin"})
    assert env["JAX_PLATFORMS"] == "cpu" and env["MALLOC_ARENA_MAX"] == "1" and env["PATH"] == "/bin"


def test_a_cpu_limit_above_the_ram_warns_and_uses_the_ram() -> None:
    info = autoaccum.DeviceInfo("cpu", "cpu", 8 * GiB, 6 * GiB, None, sources={"total_bytes": "/proc/meminfo"})
    with pytest.warns(MemoryLimitWarning, match=r"`memory_limit`=10\.00 TiB is above this machine's RAM .*8\.00 GiB"):
        limit, source = resolve_memory_limit(info, "10TiB")
    assert limit == 8 * GiB and "RAM" in source and "10.00 TiB" in source
    assert resolve_memory_limit(info, 7 * GiB) == (7 * GiB, "memory_limit")  # below the RAM: taken as given


def test_a_gpu_limit_above_the_card_warns_and_uses_what_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    info = detect_device(FakeGpu(1))  # 80 GiB, 1 GiB in use
    with pytest.warns(MemoryLimitWarning, match=r"is above the 79\.00 GiB free on NVIDIA H100 80GB HBM3"):
        limit, _ = resolve_memory_limit(info, "1TiB")
    assert limit == 79 * GiB - GPU_CONTEXT_BYTES


def test_the_library_probe_gets_the_policy_too() -> None:
    import jax.numpy as jnp
    import optax

    batch = {"x": jnp.ones((4, 8)), "y": jnp.zeros(4)}
    with pytest.warns(MemoryLimitWarning, match="above this machine's RAM"):
        result = autoaccum.probe(
            lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2), jnp.zeros(8), batch, optimizer=optax.sgd(0.1),
            memory_limit="10TiB", microbatch_cap=8, isolate=False,
        )  # fmt: skip
    assert result.memory_limit_bytes == autoaccum.detect_device().total_bytes
    assert "10.00 TiB" not in result.message


@pytest.mark.parametrize("version", [1, 2])
def test_the_memory_limit_of_this_process_is_its_own_cgroups_or_an_ancestors(tmp_path: Path, version: int) -> None:
    """A container's, a Slurm job's or a systemd scope's limit sits on this process's own cgroup, below the mount's
    root: only the root was read (no limit found; a reviewer's report). The tightest limit on the way up counts, and
    its usage leaves out the page cache the kernel can drop (the working set: it halved the default limit)."""
    from autoaccum._device import cgroup_limit

    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    base = root if version == 2 else root / "memory"
    names = ("memory.max", "memory.current", "inactive_file")
    if version == 1:
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    (proc / "self" / "cgroup").write_text("0::/jobs/job7/step\n" if version == 2 else "9:memory:/jobs/job7/step\n")
    unlimited = "max" if version == 2 else str(2**63 - 4096)
    for folder, limit, usage, cache in [(base, unlimited, 9, 0), (base / "jobs", unlimited, 9, 0),
                                        (base / "jobs/job7", str(4 << 30), 3 << 30, 1 << 30),
                                        (base / "jobs/job7/step", str(6 << 30), 3 << 30, 1 << 30)]:  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        (folder / names[0]).write_text(limit + "\n")
        (folder / names[1]).write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"anon 5\n{names[2]} {cache}\n")
    assert cgroup_limit(root, proc) == (4 << 30, 2 << 30)  # the job's 4 GiB, tighter than its step's 6
    (proc / "self" / "cgroup").write_text("0::/\n" if version == 2 else "9:memory:/\n")  # the root: no limit
    assert cgroup_limit(root, proc) is None
