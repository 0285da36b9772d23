"""Child processes (probe trials, the tuning worker): what they import, what reaches them, how they end."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import probe_workloads
import pytest
from click.testing import CliRunner

import autoaccum
import autoaccum._worker
from autoaccum._device import oom_kills
from autoaccum._isolation import classify_exit, payload, remove_stale_directories
from autoaccum._probe import prepare
from autoaccum._worker import Request, Worker
from autoaccum.cli import main


def test_children_run_the_parents_autoaccum_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From a folder holding another `autoaccum` (a checkout of the repository, with an installed autoaccum), the
    probe's children and the tuning worker import the package this process runs, not the folder's."""
    decoy = tmp_path / "autoaccum"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the working folder`s autoaccum was imported')\n")
    monkeypatch.chdir(tmp_path)
    loss_fn, params, batch = probe_workloads.linear(features=8)
    result = autoaccum.probe(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="64MiB", microbatch_cap=8)
    assert result.max_microbatch == 8 and all(t.error is None for t in result.trials), result.trials
    setup = prepare(loss_fn, params, batch, optimizer=optax.sgd(0.1), memory_limit="64MiB")
    with Worker(setup.job, setup.device, setup.memory_limit_bytes, compile_timeout=120, step_timeout=60) as w:
        assert w.time(Request({"strategy": "scan"}, 4, 8, 2, 0)).status == "fits"


WORKLOAD_FILE = '''\
import functools

import jax.numpy as jnp
import optax
import probe_workloads

import autoaccum


def criterion(predicted, target):
    return jnp.mean((predicted - target) ** 2)


def scaled_loss(params, batch, scale):
    return scale * criterion(batch["x"] @ params["w"] + params["b"], batch["y"])


def schedule(count):
    return 0.1 / (1.0 + count)


def problem():
    return probe_workloads.linear(features=8)[1:]


def helper_in_the_loss():
    """The loss (a partial) calls a function of this file."""
    return autoaccum.Workload(functools.partial(scaled_loss, scale=2.0), *problem(), optax.sgd(0.1), name="helper")


def schedule_in_the_optimizer():
    """The loss is another module's; the optimizer's learning rate is a function of this file."""
    return autoaccum.Workload(probe_workloads.linear_loss, *problem(), optax.sgd(schedule), name="schedule")
'''


@pytest.mark.parametrize("function", ["helper_in_the_loss", "schedule_in_the_optimizer"])
def test_a_workload_files_own_functions_reach_the_children(tmp_path: Path, function: str) -> None:
    """A workload file is loaded under a name of its own, which a child cannot import: the functions it defines
    (a helper of the loss, the optimizer's schedule) still reach the probe's children."""
    (tmp_path / "wl.py").write_text(WORKLOAD_FILE)
    args = ["probe", f"{tmp_path / 'wl.py'}:{function}", "--memory-limit", "64MiB", "--max-microbatch", "8"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "microbatch 8 (the largest tried) fits" in result.output, result.output


FAILING_LOSS_FILE = """\
import jax

import jax.numpy as jnp
import optax
import probe_workloads

import autoaccum


def criterion(predicted, batch):
    if predicted.shape[0] > 4:  # (not on the batch's 4 rows the caller traces first: only in a child's trials)
        return jnp.mean((predicted - batch["nope"]) ** 2)
    return jnp.mean((predicted - batch["y"]) ** 2)


def loss(params, batch):
    return criterion(batch["x"] @ params["w"] + params["b"], batch)


def module_level():
    return autoaccum.Workload(loss, *probe_workloads.linear(features=8)[1:], optax.sgd(0.1))


def nested():
    def inner_loss(params, batch):
        return criterion(batch["x"] @ params["w"] + params["b"], batch)

    return autoaccum.Workload(inner_loss, *probe_workloads.linear(features=8)[1:], optax.sgd(0.1))


def refuse(x):
    if x.shape[0] > 4:
        raise ValueError(f"no {x.shape[0]} rows")
    return x.sum()


def in_callback():
    def callback_loss(params, batch):
        checked = jax.pure_callback(refuse, jax.ShapeDtypeStruct((), jnp.float32), batch["y"])
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2) + 0.0 * checked

    return autoaccum.Workload(callback_loss, *probe_workloads.linear(features=8)[1:], optax.sgd(0.1))
"""


RAISED = {
    "module_level": ("KeyError: 'nope'", 12, "criterion"),
    "nested": ("KeyError: 'nope'", 12, "criterion"),
    "in_callback": ("ValueError: no 8 rows", 33, "refuse"),
}


@pytest.mark.parametrize("function", list(RAISED))
def test_a_loss_raising_in_a_child_is_reported_from_the_users_file_first(tmp_path: Path, function: str) -> None:
    """The child's report leads with the exception and the user's own frames, by their file and line (a loss
    defined at the file's top level, one defined in a function: its code travels by value; an exception raised in
    a host callback, which reaches the child as an XLA error holding the callback's traceback as text), before
    autoaccum's."""
    path = tmp_path / "wl.py"
    path.write_text(FAILING_LOSS_FILE)
    result = CliRunner().invoke(
        main, ["probe", f"{path}:{function}", "--memory-limit", "64MiB", "--max-microbatch", "8"]
    )
    assert result.exit_code == 1, result.output
    report = result.output[result.output.index("failed: ") :]
    exception, line, name = RAISED[function]
    where = f'File "{path}", line {line}, in {name}'
    assert report.startswith(f"failed: {exception}\n") and where in report, report
    assert report.index(where) < report.index("_worker.py") and "<dynamic-code>" not in report, report


def pids(attempts: Path) -> set[str]:
    return set(attempts.read_text().split())


def killed_in_children(attempts: Path, kills: int) -> Any:
    """A loss that kills the first ``kills`` children tracing it by SIGKILL, as from outside (each child's id is
    written to the file ``attempts``); never this process (where pytest's collection may have imported
    autoaccum._child, and the caller traces the loss too)."""
    parent = os.getpid()

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        if os.getpid() != parent and "autoaccum._child" in sys.modules:
            with attempts.open("a") as f:
                f.write(f"{os.getpid()}\n")
            if len(pids(attempts)) <= kills:
                os.kill(os.getpid(), signal.SIGKILL)
        return probe_workloads.linear_loss(params, batch)

    return loss_fn


@pytest.mark.parametrize("kills", [1, 2])
def test_a_child_killed_from_outside_runs_once_more_and_is_never_taken_for_out_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kills: int
) -> None:
    """A probe trial's child and a tuning worker killed by SIGKILL, where no OOM-kill count can be read: run once
    more; killed again, an error that says so, not "out of memory"."""
    monkeypatch.setattr(autoaccum._worker, "oom_kills", lambda: None)
    _, params, batch = probe_workloads.linear(features=8)
    for where in ("probe", "worker"):
        attempts = tmp_path / f"{where}-attempts"
        setup = prepare(
            killed_in_children(attempts, kills), params, batch, optimizer=optax.sgd(0.1), memory_limit="64MiB"
        )
        request = Request({}, 4, 4, kind="fits") if where == "probe" else Request({"strategy": "scan"}, 4, 8, 2, 0)
        limit = setup.memory_limit_bytes
        with Worker(setup.job, setup.device, limit, compile_timeout=120, step_timeout=60) as worker:
            outcome = worker.ask(request)
        assert len(pids(attempts)) == 2, where  # once more, never twice more
        if kills == 1:
            assert outcome.status == "fits", (where, outcome)
        else:
            assert outcome.status == "error" and "SIGKILL" in (outcome.message or ""), (where, outcome)
            assert "again" in (outcome.message or ""), (where, outcome)


def test_a_dead_childs_output_is_quoted_from_the_start_of_a_line() -> None:
    """A long output's end starts at a line where one starts near the cut (it started mid-word), else at the cut (a
    long last line is kept); a short one is quoted whole."""
    output = "\n".join(f"frame {i}: " + "x" * 50 for i in range(100)) + "\nOut of memory allocating 8 bytes"
    message = classify_exit(-signal.SIGABRT, output, None).message or ""
    quoted = message.split("after an allocation failure: ", 1)[1]
    assert quoted.startswith("...\nframe ") and quoted.endswith("allocating 8 bytes"), quoted[:80]
    assert classify_exit(3, "short\n", None).message == "the trial's child exited with status 3; its output ends: short"
    one_line = "start\nF Out of memory allocating " + "buffer " * 300 + "\n*** Check failure stack trace: ***"
    kept = (classify_exit(-signal.SIGABRT, one_line, None).message or "").split("allocation failure: ", 1)[1]
    assert kept.startswith("...") and "buffer buffer" in kept and kept.endswith("stack trace: ***"), kept[:80]


def test_only_the_kernels_oom_killer_counts_as_out_of_memory(tmp_path: Path) -> None:
    """SIGKILL is out of memory only when an OOM-kill count rose while the child ran; unknown, it is an error."""
    assert classify_exit(-signal.SIGKILL, "", True).status == "oom"
    for unknown_or_not in (None, False):
        outcome = classify_exit(-signal.SIGKILL, "", unknown_or_not)
        assert outcome.status == "error" and "not counted as out of memory" in (outcome.message or ""), outcome
    # The count: this process's cgroup (v2, v1), else the cgroup as mounted, else the kernel's; None without one.
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/job\n")
    assert oom_kills(cgroup, proc) is None
    (proc / "vmstat").write_text("nr_free_pages 1\noom_kill 7\n")
    assert oom_kills(cgroup, proc) == 7
    (cgroup / "memory").mkdir(parents=True)
    (cgroup / "memory" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert oom_kills(cgroup, proc) == 3
    (cgroup / "memory" / "job").mkdir()
    (cgroup / "memory" / "job" / "memory.oom_control").write_text("oom_kill_disable 0\noom_kill 2\n")
    assert oom_kills(cgroup, proc) == 2
    (cgroup / "job").mkdir()
    (cgroup / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    assert oom_kills(cgroup, proc) == 1


HANGING_FILE = """\
import os
import sys
import time

import jax.numpy as jnp
import optax

import autoaccum


def loss(params, batch):
    if "autoaccum._child" in sys.modules:  # where a child traces it: says so, then hangs
        with open(os.environ["HANG_MARKER"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(600)
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def workload():
    return autoaccum.Workload(loss, {"w": jnp.zeros(8)}, {"x": jnp.ones((4, 8)), "y": jnp.ones(4)}, optax.sgd(0.1))
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_hanging(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], int]:
    """``autoaccum ARGS...`` on `HANGING_FILE` in a process of its own, once a child of it hangs: the process and
    the child's id."""
    (tmp_path / "wl.py").write_text(HANGING_FILE)
    (tmp_path / "tmp").mkdir()
    marker = tmp_path / "hanging"
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "HANG_MARKER": str(marker)}
    command = [sys.executable, "-m", "autoaccum", args[0], f"{tmp_path / 'wl.py'}:workload", *args[1:]]
    # Ctrl-C as a terminal sends it: the command starts with SIGINT handled, also where this run inherited it
    # ignored (a background job's), which the command would keep
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc, int(marker.read_text().split()[0])


@pytest.mark.parametrize(
    ("command", "signum", "code", "says"),
    [
        ("tune", signal.SIGINT, 130, "interrupted (Ctrl-C); its child processes were ended"),
        ("tune", signal.SIGTERM, 143, "terminated (SIGTERM); its child processes were ended"),
        ("probe", signal.SIGTERM, 143, "autoaccum probe: terminated (SIGTERM)"),
    ],
)
def test_an_interrupted_command_ends_its_children_removes_its_files_and_says_so(
    tmp_path: Path, command: str, signum: int, code: int, says: str
) -> None:
    """Ctrl-C exits with 130, SIGTERM (a job scheduler's) with 143; either way the hanging child (a tuning worker,
    a probe's trial) is ended and the temporary folder (the pickled job) removed; tune says its study is kept."""
    args = ["--memory-limit", "64MiB", "--max-microbatch", "4"]
    if command == "tune":
        args += ["--storage", f"sqlite:///{tmp_path / 'studies.db'}"]
    proc, child = start_hanging(tmp_path, command, *args)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert says in err and "Aborted!" not in err, err
    if command == "tune":
        assert "The study is kept: run the same command again to resume it" in err, err
    assert not alive(child), child
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_killed_commands_children_end_with_it_and_its_files_go_with_the_next_run(tmp_path: Path) -> None:
    """SIGKILL leaves no way to clean up: the child ends with its parent anyway, and the next run removes the
    temporary folder whose owner is gone (not a live run's, nor a folder with no owner)."""
    proc, child = start_hanging(tmp_path, "probe", "--memory-limit", "64MiB", "--max-microbatch", "4")
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)
    (left,) = (tmp_path / "tmp").iterdir()
    live = Path(tempfile.mkdtemp(prefix="autoaccum-", dir=tmp_path / "tmp"))
    (live / "owner").write_text(str(os.getpid()))
    unowned = Path(tempfile.mkdtemp(prefix="autoaccum-", dir=tmp_path / "tmp"))
    assert remove_stale_directories(tmp_path / "tmp") == [left]
    assert sorted((tmp_path / "tmp").iterdir()) == sorted([live, unowned])


# Big models: a trial's payload carries shapes, not the parameters' values.
def test_probe_payload_carries_shapes_not_weights() -> None:
    params = {"w": jnp.zeros((4096, 4096)), "b": jnp.zeros(4096)}  # 64 MiB of weights
    batch = {"x": jnp.ones((2, 4096))}
    setup = prepare(
        lambda p, b: jnp.mean(b["x"] @ p["w"] + p["b"][None]), params, batch, optimizer=optax.sgd(0.1),
        memory_limit="2GiB",
    )  # fmt: skip
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(setup.job.params))
    data = payload(setup.job, "cpu", [setup.job.loss_fn])
    assert len(data) < 2**20, len(data)  # the 64 MiB are not in it
    assert pickle.loads(data)[1] == "cpu"


# Hung children: a per-trial time limit, reported as the trial's reason.
@pytest.mark.slow
def test_a_hung_trial_is_killed_and_reported() -> None:
    _, params, batch = probe_workloads.linear()
    hung = r"timed out: (compiling|stepping .*) ran over `trial_timeout`=15 s"  # (the argument named)
    with pytest.raises(autoaccum.ProbeError, match=hung) as caught:
        autoaccum.probe(
            probe_workloads.hang_past_64, params, batch, optimizer=optax.sgd(0.1), memory_limit="256MiB",
            microbatch_cap=128, granularity=32, trial_timeout=15,
        )  # fmt: skip
    assert caught.value.trial.microbatch_size > 64 and not caught.value.trial.fits
