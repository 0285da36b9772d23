"""Child processes that may run out of memory, crash or hang without taking the caller down.

The caller writes a *payload* (`payload`: the job pickled with cloudpickle, parameters as shapes only), then
`autoaccum._worker.Worker` starts a child (`child_command`: this interpreter, this process's `autoaccum`, from any
working folder) under `child_env` (one device or the caller's mesh, its allocator capped on a GPU; glibc malloc
made predictable on the CPU). A child that dies is classified from its exit status and output (`classify_exit`),
and one killed from outside (not by the kernel's OOM killer) runs once more (`dead_child`). A child ends with its
parent (`die_with_parent`); interrupted, the parent ends its children before it goes on.

What "does not fit" means for a dead child, exactly (`classify_exit`):

* it dies from a signal after an allocation failure it could not report: ``SIGABRT``/``SIGSEGV`` with
  ``std::bad_alloc``, ``RESOURCE_EXHAUSTED``, ``Out of memory`` or ``Cannot allocate memory`` in its output
  (C++ ``terminate`` on ``bad_alloc``), or ``SIGKILL`` from the kernel's OOM killer (an OOM-kill count,
  `autoaccum._device.oom_kills`, rose while it ran; where none can be read, a ``SIGKILL`` is not taken for one).

Anything else (a plain ``os.abort()``, a segfault with no allocation failure in the output, a kill from outside,
a non-zero exit, a time-out) is an error, reported with its message.
"""

from __future__ import annotations

import collections
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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from autoaccum._device import DeviceInfo, oom_kills
from autoaccum._json import JsonMixin

OOM_MARKERS = (
    "RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "std::bad_alloc", "MemoryError",
    "Cannot allocate memory", "threads to join the rendezvous, but only",
)  # fmt: skip
"""Text that says an allocation failed: XLA's status, the CPU cap's failed allocation (XLA's "Out of memory
allocating N bytes", C++'s ``bad_alloc``, Python's ``MemoryError``, ``ENOMEM``). The last: on a CPU mesh (every
device a thread of the capped child), a device whose allocation failed never reaches the step's collective, and
XLA aborts the others when they have waited for it (`_CPU_COLLECTIVE_TIMEOUT`)."""


def says_out_of_memory(text: str) -> bool:
    """The one rule for "does not fit" in a message or a dead child's output: it holds one of `OOM_MARKERS`.

    Example:
      >>> says_out_of_memory("INTERNAL: Error dispatching computation: Out of memory allocating 8 bytes")
      True
      >>> says_out_of_memory("INTERNAL: something else")
      False
    """
    return any(m in text for m in OOM_MARKERS)


@dataclasses.dataclass(frozen=True)
class Outcome(JsonMixin):
    """What one run in a child (or in this process) found.

    Attributes:
      status: ``"fits"``, ``"oom"`` or ``"error"``.
      seconds: the second (steady-state) update step's wall time, when it fit.
      first_seconds: the first step's wall time (its programs were compiled before), when it fit.
      peak_bytes: memory used at the peak, counted like the limit (CPU: growth of the address space since the
        cap was set; GPU: XLA's ``peak_bytes_in_use``); None where not measurable.
      message: the OOM or error message.
      compile_seconds: time spent compiling.
      times: each timed step's wall time (``seconds`` is their median), when it fit.
      estimate: a compile-only estimate's `autoaccum.Estimate` (as `to_dict` writes it), for an estimate request.
    """

    status: str
    seconds: float | None = None
    first_seconds: float | None = None
    peak_bytes: int | None = None
    message: str | None = None
    compile_seconds: float | None = None
    times: list[float] | None = None
    estimate: dict[str, Any] | None = None


def classify_exit(returncode: int, output: str, oom_killed: bool | None) -> Outcome:
    """The outcome of a child that died without writing its result.

    Args:
      returncode: the child's exit status (``-N`` for signal ``N``).
      output: the end of its stdout and stderr.
      oom_killed: whether an OOM-kill count rose while it ran (`autoaccum._device.oom_kills`; None: unknown).
    """
    tail = output.strip()[-1500:]
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            if oom_killed:
                return Outcome("oom", message=f"the trial's child was killed by {name} (the kernel's OOM killer).")
            why = "no OOM-kill count rose" if oom_killed is False else "no OOM-kill count can be read here"
            return Outcome(
                "error", message=f"the trial's child was killed by {name} ({why}: not counted as out of memory)."
            )
        if says_out_of_memory(output):
            return Outcome("oom", message=f"the trial's child died of {name} after an allocation failure: {tail}")
        return Outcome("error", message=f"the trial's child crashed with {name}; its output ends: {tail or '(none)'}")
    if says_out_of_memory(output):
        return Outcome("oom", message=f"the trial's child ran out of memory: {tail}")
    return Outcome(
        "error", message=f"the trial's child exited with status {returncode}; its output ends: {tail or '(none)'}"
    )


OUTSIDE_KILLS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
"""Signals that end a child from outside (a user, a scheduler, a stray ``kill``): a child they end, unless the
kernel's OOM killer sent it, runs once more (`dead_child`)."""


def dead_child(returncode: int, log: Path, kills_before: int | None) -> tuple[Outcome, bool]:
    """A child that died without answering: its outcome (`classify_exit`, from the end of its ``log`` and whether an
    OOM-kill count rose since ``kills_before``, `oom_kills` when it started), and whether to run it once more: it
    was killed from outside (`OUTSIDE_KILLS`), not for its memory."""
    output = log.read_bytes()[-20000:].decode(errors="replace")
    after = oom_kills()
    oom_killed = None if kills_before is None or after is None else after > kills_before
    outcome = classify_exit(returncode, output, oom_killed)
    return outcome, -returncode in OUTSIDE_KILLS and outcome.status != "oom"


def killed_again(outcome: Outcome) -> Outcome:
    """``outcome`` of a child killed from outside a second time, after running once more (`dead_child`).

    Example:
      >>> killed_again(Outcome("error", message="killed by SIGKILL.")).message
      'killed by SIGKILL. Run once more, it was killed again.'
    """
    return dataclasses.replace(outcome, message=f"{outcome.message} Run once more, it was killed again.")


_CPU_MALLOC = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "65536",
    "MALLOC_TOP_PAD_": "0",
    "MALLOC_TRIM_THRESHOLD_": "0",
}


_CPU_COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=10"
"""On a CPU mesh, a device whose allocation failed under the cap never reaches the step's collective; the
others give up after this long (XLA's default: 40 s) and the trial counts as out of memory (`OOM_MARKERS`)."""


def backend_name(info: DeviceInfo) -> str:
    """The name of the JAX backend that runs ``info``'s device, as ``JAX_PLATFORMS`` takes it: ``"cpu"``,
    ``"tpu"``, ``"cuda"`` or ``"rocm"``; never ``"gpu"``, which jax 0.11 resolves to every GPU backend it knows,
    failing on the one not installed (seen on an H100 with jax 0.11.2: "Unable to initialize backend 'rocm'").

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
    """The environment of a child: one device (or a mesh's ``devices``: on the CPU ``JAX_NUM_CPU_DEVICES`` where
    ``XLA_FLAGS`` does not set them), its allocator capped at ``limit``.

    On a GPU: ``CUDA_VISIBLE_DEVICES`` selects the probed card (with a mesh, every card stays visible),
    ``XLA_CLIENT_MEM_FRACTION`` = ``limit`` /
    the card's total, preallocated (``XLA_PYTHON_CLIENT_PREALLOCATE=true``: one region of exactly the limit, as a
    training process holds its share; growing the pool instead splits it into regions that compilation's scratch
    fragments, so that a size that fits in a fresh process ran out of memory after an earlier compile) and the
    default allocator (the fraction is ignored by ``platform``), ``JAX_PLATFORMS`` naming the backend
    (``cuda``; ``rocm`` for a ROCm device). On the CPU: ``JAX_PLATFORMS=cpu``
    and glibc malloc made predictable under the cap: ``MALLOC_ARENA_MAX=1`` (no per-thread arenas, which reserve
    address space in 64 MiB heaps), ``MALLOC_MMAP_THRESHOLD_=65536`` (every large buffer is its own mapping,
    released when freed; no dynamic threshold), ``MALLOC_TOP_PAD_=0`` and ``MALLOC_TRIM_THRESHOLD_=0``. Without
    them the same size fits in one child and not in the next (measured: +-50 examples at 100 MiB).

    Example:
      >>> info = DeviceInfo("cpu", "cpu", 2**33, 2**32, None)
      >>> child_env(info, 2**30, {})["JAX_PLATFORMS"]
      'cpu'
    """
    out = dict(os.environ if env is None else env)
    out["JAX_PLATFORMS"] = backend_name(info)
    # XLA's informational log lines (e.g. a CUDA plugin installed for GPU-compiled plans on a machine with no
    # driver says so in every process) would crowd a dead child's output, which is how its end is classified.
    out.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
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
    """``job`` pickled for a child: ``(sys.path, platform, cloudpickle bytes, file modules)``.

    A module loaded from a file under a name a fresh interpreter cannot import (a workload file, which
    `autoaccum.load_workload` loads as ``python file.py`` would run it) travels as its file's path: the child loads
    the same file under the same name when the job refers to it (`load_payload`), so that every function, class and
    schedule of the file reaches the child, each with its file and line in tracebacks. ``functions`` (the user's
    loss) defined in other modules a fresh interpreter cannot import, with no file, are pickled by value, as
    ``__main__``'s are; code pickled by value keeps its file's name too (`_dumps`).
    """
    files = _file_modules()
    with _by_value([m for fn in functions for m in _unimportable_modules(fn) if m.__name__ not in files]):
        body = _dumps(job)
    return pickle.dumps(([p for p in sys.path if p], platform, body, files))


def load_payload(payload_path: str) -> tuple[Any, str]:
    """The job and platform a parent pickled (`payload`), its ``sys.path`` restored and its file modules found."""
    with open(payload_path, "rb") as f:
        sys_path, platform, body, files = pickle.load(f)
    sys.path[:0] = [p for p in sys_path if p not in sys.path]
    sys.meta_path.append(_FileModules(files))
    import cloudpickle

    return cloudpickle.loads(body), platform


class _FileModules(importlib.abc.MetaPathFinder):
    """Finds the parent's modules that it loaded from files under names of their own (`payload`), from their
    files; asked after every other finder."""

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
    """``{name: (file, package folders or None)}`` of the modules loaded from a file under a top-level name a
    fresh interpreter cannot find (autoaccum's own aside: a child has it)."""
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


def _dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, with the code of functions pickled by value keeping its file's name (cloudpickle
    3 names it ``<dynamic-code>``, and a child's traceback would not say where the user's line is)."""
    with io.BytesIO() as file:
        _pickler()(file, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return file.getvalue()


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


def _unimportable_modules(fn: Any) -> list[ModuleType]:
    modules: list[ModuleType] = []
    name = getattr(fn, "__module__", None)
    if not isinstance(name, str):
        return modules
    module = sys.modules.get(name)
    if module is not None and name != "__main__" and not _findable(name.partition(".")[0]):
        modules.append(module)
    return modules


@contextmanager
def _by_value(modules: list[ModuleType]) -> Iterator[None]:
    import cloudpickle

    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        yield
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)


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
"""A child's first lines (``python -c``): the parent's own `autoaccum` package, from where the parent has it
(``python -m`` would put the working folder first on ``sys.path``, and a checkout of the repository there would
shadow an installed autoaccum), and not the working folder on ``sys.path`` (``-c`` puts it first)."""


def child_command(payload_path: Path, args: Sequence[str]) -> list[str]:
    """The command that starts a worker (`autoaccum._child.main`): this interpreter, running the `autoaccum` package
    this process runs, from any working folder (`_BOOT`), told this process's id (it ends when this process does,
    `die_with_parent`).

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
    """Ends this process (a child) when its ``parent`` ends, so that no child outlives the run that started it (a
    parent killed by SIGKILL cannot end them itself): at once on Linux when the parent started it from its main
    thread (``PR_SET_PDEATHSIG``; the kernel sends it when the starting *thread* ends), else within a quarter of a
    second (a thread that watches the parent's process id, which changes when the child is re-parented).
    """
    if at_once and sys.platform.startswith("linux"):
        _parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the line above
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), name="autoaccum-parent", daemon=True).start()


def _parent_death_signal(signum: int) -> None:
    """Asks Linux to send ``signum`` to this process when its parent ends (``prctl(PR_SET_PDEATHSIG)``)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no C library to ask, or one without prctl
        return
    prctl(1, signum, 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def _watch_parent(parent: int, every: float = 0.25) -> None:
    while os.getppid() == parent:
        time.sleep(every)
    os._exit(1)


TEMP_PREFIX = "autoaccum-"
"""The names of the temporary folders of children (`make_directory`): ``autoaccum-*`` in the temporary directory."""


def make_directory() -> Path:
    """A new temporary folder for one job's children, with its owner (this process) written in its ``owner`` file,
    made after removing the folders of earlier runs whose owner is gone (`remove_stale_directories`)."""
    remove_stale_directories()
    directory = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
    (directory / "owner").write_text(_process_tag(os.getpid()))
    return directory


def remove_stale_directories(root: Path | None = None) -> list[Path]:
    """Removes this user's ``autoaccum-*`` folders in ``root`` (default: the temporary directory) whose owner process
    ended without removing them (killed by SIGKILL, or crashed), and returns them. A folder without an ``owner``
    file (being made, or not one of ours) is left alone.
    """
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
    """``"PID START"``: a process's id and its start time (Linux's ``/proc``; left out where unknown), which tell it
    from a later process given the same id."""
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
