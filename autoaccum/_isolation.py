"""Child processes that may run out of memory, crash or hang without taking the caller down.

A job travels pickled (`payload`) to a child that runs this process's `autoaccum` from any folder (`child_command`)
under a capped allocator (`child_env`) and ends with its parent (`die_with_parent`). A child that dies without
answering is judged by `classify_exit`.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import io
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from autoaccum._device import DeviceInfo
from autoaccum._json import JsonMixin

OOM_MARKERS = (
    "RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "std::bad_alloc", "MemoryError",
    "Cannot allocate memory", "threads to join the rendezvous, but only",
)  # fmt: skip
"""Text that says an allocation failed. The last: on a CPU mesh, a device whose allocation failed never reaches
the step's collective, and XLA aborts the others (`_CPU_COLLECTIVE_TIMEOUT`)."""


def says_out_of_memory(text: str) -> bool:
    """The one rule for "does not fit" in a message or a dead child's output: it holds one of `OOM_MARKERS`.

    Example:
      >>> says_out_of_memory("Out of memory allocating 8 bytes"), says_out_of_memory("INTERNAL: something else")
      (True, False)
    """
    return any(m in text for m in OOM_MARKERS)


@dataclasses.dataclass(frozen=True)
class Outcome(JsonMixin):
    """What one run in a child (or in this process) found.

    Attributes:
      status: ``"fits"``, ``"oom"`` or ``"error"``.
      seconds: the median timed step, when it fit; ``times`` each timed step; ``first_seconds`` the first step.
      peak_bytes: memory used at the peak, counted like the limit; None where not measurable.
      message: the OOM or error message; ``compile_seconds``: time spent compiling; ``cached_seconds``: compile
        time JAX's persistent cache saved; ``costs``: ``[flops, bytes accessed]`` of each program the step runs.
      estimate: an estimate request's `autoaccum.Estimate`, as `to_dict` writes it.
      need_bytes: XLA's buffer-assignment bytes, where they alone refused the step (it was not run).
      loss: a loss request's value at the caller's parameters (`autoaccum._preflight.initial_loss`).
    """

    status: str
    seconds: float | None = None
    first_seconds: float | None = None
    peak_bytes: int | None = None
    message: str | None = None
    compile_seconds: float | None = None
    times: list[float] | None = None
    estimate: dict[str, Any] | None = None
    cached_seconds: float | None = None
    costs: list[list[float]] | None = None
    need_bytes: int | None = None
    loss: float | None = None


def classify_exit(returncode: int, output: str, oom_killed: bool | None) -> Outcome:
    """The outcome of a child that died without answering, from its ``returncode`` (``-N``: signal ``N``) and the end of
    its ``output``: out of memory only after an allocation failure (`says_out_of_memory`) or a ``SIGKILL`` while an
    OOM-kill count rose (``oom_killed``; None: unknown); anything else an error with the output's end."""
    tail = output.strip()
    if len(tail) > 1500:  # (from the first whole line, where one starts near the cut)
        tail, line = tail[-1500:], tail[-1500:].find("\n")
        tail = "..." + (tail[line:] if 0 <= line < 200 else tail)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGKILL and oom_killed:
            return Outcome("oom", message=f"the trial's child was killed by {name} (the kernel's OOM killer).")
        if -returncode == signal.SIGKILL:
            why = "no OOM-kill count rose" if oom_killed is False else "no OOM-kill count can be read here"
            return Outcome("error", message=f"the trial's child was killed by {name} ({why}: not counted as out of "
                           "memory).")  # fmt: skip
        if says_out_of_memory(output):
            return Outcome("oom", message=f"the trial's child died of {name} after an allocation failure: {tail}")
        return Outcome("error", message=f"the trial's child crashed with {name}; its output ends: {tail or '(none)'}")
    if says_out_of_memory(output):
        return Outcome("oom", message=f"the trial's child ran out of memory: {tail}")
    return Outcome(
        "error", message=f"the trial's child exited with status {returncode}; its output ends: {tail or '(none)'}"
    )


OUTSIDE_KILLS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Signals that end a child from outside; a child they end, unless for its memory, runs once more."""


_CPU_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TOP_PAD_": "0",
    "MALLOC_TRIM_THRESHOLD_": "0",
}
"""glibc malloc made predictable under the CPU cap: no per-thread arenas, every large buffer its own mapping."""

_CPU_COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=10"
"""On a CPU mesh, how long devices wait for one whose allocation failed (XLA's default: 40 s)."""


def backend_name(info: DeviceInfo) -> str:
    """The JAX backend of ``info``'s device as ``JAX_PLATFORMS`` takes it: ``"cpu"``, ``"tpu"``, ``"cuda"`` or
    ``"rocm"``; never ``"gpu"``, which makes jax 0.11 start every GPU backend it knows.

    Example:
      >>> backend_name(DeviceInfo("cpu", "cpu", 2**33, 2**32, None))
      'cpu'
    """
    if info.platform != "gpu":
        return info.platform
    client = getattr(info.device, "client", None)
    if client is not None:
        from autoaccum._jax_private import xla_bridge  # the registry of initialised backends, by name

        for name, backend in xla_bridge().backends().items():
            if backend is client and name != "gpu":
                return str(name)
    return "rocm" if any(v in info.name for v in ("AMD", "Radeon", "Instinct")) else "cuda"


def child_env(
    info: DeviceInfo, limit: int, env: Mapping[str, str] | None = None, *, devices: int = 1
) -> dict[str, str]:
    """The environment of a child: one device (or a mesh's ``devices``), its allocator capped at ``limit``.

    On a GPU: that card (all cards for a mesh), ``XLA_CLIENT_MEM_FRACTION`` = ``limit`` / its total, preallocated (one
    region of exactly the limit, as training holds it). On the CPU: glibc malloc made predictable (`_CPU_MALLOC`), and
    on a mesh ``JAX_NUM_CPU_DEVICES`` unless ``XLA_FLAGS`` sets the devices.

    Example:
      >>> child_env(DeviceInfo("cpu", "cpu", 2**33, 2**32, None), 2**30, {})["JAX_PLATFORMS"]
      'cpu'
    """
    out = dict(os.environ if env is None else env)
    out["JAX_PLATFORMS"] = backend_name(info)
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's info lines would crowd the output a dead child is judged by
    if info.platform == "gpu":
        if info.total_bytes is None:
            raise ValueError(f"cannot cap {info.name}: its total memory is unknown (no NVML, no memory_stats).")
        if devices == 1:
            out["CUDA_VISIBLE_DEVICES"] = info.visible_id or "0"
        out.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
        out["XLA_CLIENT_MEM_FRACTION"] = f"{math.floor(limit / info.total_bytes * 1e6) / 1e6:.6f}"
        out["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        out.pop("XLA_PYTHON_CLIENT_ALLOCATOR", None)
    elif info.platform == "cpu":
        for name, value in _CPU_MALLOC.items():
            out.setdefault(name, value)
        flags = out.get("XLA_FLAGS", "")
        if devices > 1 and _CPU_COLLECTIVE_TIMEOUT.split("=")[0] not in flags:
            out["XLA_FLAGS"] = f"{flags} {_CPU_COLLECTIVE_TIMEOUT}".strip()
        if devices > 1 and "xla_force_host_platform_device_count" not in flags:  # the caller's mesh, however made
            out.setdefault("JAX_NUM_CPU_DEVICES", str(devices))
    return out


def payload(job: Any, platform: str, functions: Sequence[Any] = ()) -> bytes:
    """``job`` pickled for a child, with the strategies registered here beyond autoaccum's own (each that pickles)
    and the JAX settings that change lowering: ``(sys.path, platform, job, strategies, file modules, settings)``.

    A module loaded from a file under a name a fresh interpreter cannot import (a workload file) travels as its path
    (`load_payload` loads it under the same name); ``functions`` (the user's loss) from other such modules are pickled
    by value, keeping their file's name (`_dumps`).
    """
    import jax

    from autoaccum import strategies

    files = _file_modules()
    names = [getattr(fn, "__module__", None) for fn in functions]
    by_value = [
        sys.modules[n] for n in names
        if isinstance(n, str) and n in sys.modules and n != "__main__" and n not in files
        and not _findable(n.partition(".")[0])
    ]  # fmt: skip
    own = {}
    for cls in map(strategies.get, strategies.available()):
        if not cls.__module__.startswith("autoaccum."):
            with contextlib.suppress(Exception):  # (one that does not pickle is unknown there: a trial of it says so)
                own[cls.name] = _dumps(cls, by_value)
    values = jax.config.values
    settings = {name: values[name] for name in LOWERING_SETTINGS if name in values}
    return pickle.dumps(([p for p in sys.path if p], platform, _dumps(job, by_value), own, files, settings))


LOWERING_SETTINGS = (
    "jax_enable_x64", "jax_explicit_x64_dtypes", "jax_default_matmul_precision", "jax_default_prng_impl",
    "jax_enable_custom_prng", "jax_threefry_partitionable", "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion",
    "jax_softmax_custom_jvp", "jax_use_shardy_partitioner", "jax_compiler_enable_remat_pass",
    "jax_use_direct_linearize",
)  # fmt: skip
"""The JAX settings a child takes from its parent (``jax.config``, contexts such as ``jax.default_matmul_precision``
included): those that change what the loss lowers to, not those that police the caller's code, log or pick
devices."""


def load_payload(payload_path: str) -> tuple[Any, str]:
    """The job and platform a parent pickled (`payload`): its ``sys.path`` restored, its file modules found, its JAX
    settings taken before anything is unpickled, and its strategies registered (in place of another of the name)."""
    import cloudpickle
    import jax

    from autoaccum import strategies

    with open(payload_path, "rb") as f:
        sys_path, platform, body, own, files, settings = pickle.load(f)
    for name, value in settings.items():
        if jax.config.values.get(name) != value:
            with contextlib.suppress(Exception):  # (one that cannot change here: the loss's check says if it matters)
                jax.config.update(name, value)
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    sys.meta_path.append(_FileModules(files))
    for name, data in own.items():
        cls = cloudpickle.loads(data)
        if name in strategies.available() and strategies.get(name) is not cls:
            strategies.unregister(name)  # (the child's own class of the name: the parent's is the one registered)
        strategies.register(cls)
    return cloudpickle.loads(body), platform


class _FileModules(importlib.abc.MetaPathFinder):
    """Finds the parent's modules loaded from files under names of their own (`payload`), after every other finder."""

    def __init__(self, files: Mapping[str, tuple[str, list[str] | None]]) -> None:
        self.files = dict(files)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.files:
            return None
        origin, folders = self.files[fullname]
        return importlib.util.spec_from_file_location(fullname, origin, submodule_search_locations=folders)


def _findable(top: str) -> bool:
    """Whether a fresh interpreter finds the top-level module ``top`` (on ``sys.path``, or built in)."""
    return top in sys.builtin_module_names or (
        importlib.machinery.PathFinder.find_spec(top, [p for p in sys.path if p]) is not None
    )


def _file_modules() -> dict[str, tuple[str, list[str] | None]]:
    """``{name: (file, package folders or None)}`` of the modules loaded from a file under a top-level name a fresh
    interpreter cannot find (autoaccum aside)."""
    findable: dict[str, bool] = {__name__.partition(".")[0]: True}
    files = {}
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if name == "__main__" or spec is None or spec.name != name or not spec.has_location:
            continue
        top = name.partition(".")[0]
        if top not in findable:
            findable[top] = _findable(top)
        if not findable[top] and spec.origin is not None and os.path.isfile(spec.origin):
            folders = spec.submodule_search_locations
            files[name] = (spec.origin, None if folders is None else list(folders))
    return files


def _dumps(obj: Any, by_value: Sequence[ModuleType]) -> bytes:
    """``cloudpickle.dumps(obj)``, the modules ``by_value`` pickled by value, their code keeping its file's name
    (cloudpickle 3 names it ``<dynamic-code>``, and a traceback would not say where the user's line is)."""
    import cloudpickle

    for m in by_value:
        cloudpickle.register_pickle_by_value(m)
    try:
        with io.BytesIO() as file:
            _pickler()(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
            return file.getvalue()
    finally:
        for m in by_value:
            cloudpickle.unregister_pickle_by_value(m)


@functools.cache
def _pickler() -> type[pickle.Pickler]:
    import cloudpickle

    reduce_code = cloudpickle.Pickler.dispatch_table.get(types.CodeType)
    if reduce_code is None:  # (an older cloudpickle, which keeps the name)
        return cloudpickle.Pickler

    def reduce(code: types.CodeType) -> tuple[Any, ...]:
        rebuild, args = reduce_code(code)
        return _code_in_file, (rebuild, args, code.co_filename)

    class Pickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({types.CodeType: reduce}, cloudpickle.Pickler.dispatch_table)  # noqa: RUF012

    return Pickler


def _code_in_file(rebuild: Any, args: tuple[Any, ...], filename: str) -> types.CodeType:
    code: types.CodeType = rebuild(*args)
    return code.replace(co_filename=filename)


_BOOT = """\
import importlib.util, os, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
origin, folders = sys.argv.pop(1), sys.argv.pop(1).split(os.pathsep)
spec = importlib.util.spec_from_file_location("autoaccum", origin, submodule_search_locations=folders)
sys.modules["autoaccum"] = package = importlib.util.module_from_spec(spec)
spec.loader.exec_module(package)
from autoaccum._child import main
main()
"""
"""A child's first lines: the parent's own `autoaccum` package, from where the parent has it, and not the working
folder on ``sys.path`` (where a checkout of the repository would shadow an installed autoaccum)."""


def child_command(payload_path: Path, args: Sequence[str]) -> list[str]:
    """The command that starts a worker (`autoaccum._child.main`) on this process's `autoaccum` (`_BOOT`), told this
    process's id and thread (`die_with_parent`).

    Example:
      >>> command = child_command(Path("job.pkl"), ["5", "1024"])
      >>> command[1], command[-3:]
      ('-c', ['job.pkl', '5', '1024'])
    """
    import autoaccum

    spec = autoaccum.__spec__
    assert spec is not None and spec.origin is not None, "autoaccum is a package loaded from its files"
    folders = os.pathsep.join(spec.submodule_search_locations or ())
    thread = "main" if threading.current_thread() is threading.main_thread() else "other"
    return [sys.executable, "-c", _BOOT, spec.origin, folders, str(os.getpid()), thread, str(payload_path), *args]


def die_with_parent(parent: int, *, at_once: bool) -> None:
    """Ends this process (a child) when its ``parent`` ends: at once on Linux when started from the parent's main thread
    (``PR_SET_PDEATHSIG`` fires when the starting *thread* ends), else within a quarter of a second."""
    if at_once and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # no C library to ask, or one without prctl
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="autoaccum-parent", daemon=True).start()


TEMP_PREFIX = "autoaccum-"
"""The prefix of the children's temporary folders (`make_directory`)."""


def make_directory() -> Path:
    """A new temporary folder for one job's children, owned by this process (its ``owner`` file), made after removing
    those of earlier runs whose owner is gone (`remove_stale_directories`)."""
    remove_stale_directories()
    directory = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    (directory / "owner").write_text(_process_tag(os.getpid()))
    return directory


def remove_stale_directories(root: Path | None = None) -> list[Path]:
    """Removes (and returns) this user's ``autoaccum-*`` folders in ``root`` (default: the temporary directory) whose
    owner has ended; a folder without an ``owner`` file is left alone."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    for directory in root.glob(TEMP_PREFIX + "*"):
        try:
            if directory.stat().st_uid != os.getuid():
                continue
            tag = (directory / "owner").read_text()
        except OSError:  # gone meanwhile, no owner file, or not a folder
            continue
        if not _owner_alive(tag):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def _process_tag(pid: int) -> str:
    """``"PID START"``: a process's id and start time, which tell it from a later process given the same id."""
    status = _process_status(pid)
    return str(pid) if status is None else f"{pid} {status[1]}"


def _process_status(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time (``/proc/PID/stat``), or None where it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], fields[19]  # fields 3 (state) and 22 (starttime); the name before ")" may hold spaces


def _owner_alive(tag: str) -> bool:
    """Whether the process of a folder's ``tag`` (`_process_tag`) still runs; True for a tag of another form."""
    pid, _, start = tag.strip().partition(" ")
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process (with our folder: the id was given again): alive
        pass
    status = _process_status(int(pid))
    return status is None or (status[0] != "Z" and start in ("", status[1]))


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kills ``proc`` with its process group (a child started in a session of its own), and waits for it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
