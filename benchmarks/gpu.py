"""The GPU evidence kit (issue 28): every GPU promise checked on a lent card, one stage per command.

Stages (``--stage``, repeatable; default all of them, in this order):

* ``devices``: what NVML, JAX's ``memory_stats()`` and the default memory-limit policy say, each read in a fresh
  process with JAX's preallocation on (its default) and off; ``autoaccum devices --target-config`` for the card,
  saved as ``card.txtpb`` beside the report.
* ``probe``: `autoaccum.probe` on a transformer LM of about 125M parameters in bfloat16 and float32 under two
  memory limits, and on a convnet; for each, the boundary M, the runs it took, the compile-only estimate the
  search started from, and an independent check in two fresh processes: M fits, M + granularity does not (on a
  GPU the check reads XLA's ``RESOURCE_EXHAUSTED``).
* ``estimate``: against each boundary (of this run's probe, or of ``--probe-report``), the compile-only estimate
  on the card, and the plans XLA's GPU compiler makes on compile-only devices (no GPU used): from the card's own
  description, from the catalogued one of its kind and from the catalogued H100 (goal: within 5%).
* ``tune``: `autoaccum.tune` with its defaults on the demo transformer under the demo's limit, against the
  exhaustive grid of its space timed in the same run, the pick and the grid's best then re-timed side by side;
  the pick's measured peak against the limit; tune's wall time in units of one compile plus five steps of the
  pick.
* ``throughput``: on the bfloat16 LM, the update `autoaccum.build_update` emits against the three hand-written
  options (``benchmarks/strategies.py``'s: manual accumulate and apply, ``optax.MultiSteps``,
  ``optax.microbatching``), each with TFLOP/s (the full-batch step's FLOPs, from XLA's cost analysis) and MFU
  (the catalogue's peak); beside them the cost of accumulating at all: the emitted update over the full-batch
  step, and over k microbatch forward-backward passes plus one optimizer apply, each timed alone.

Each stage writes ``gpu-report.json`` and ``gpu-report.md`` to ``--out`` (``$OUT`` when set) after every case, so a
command stopped at its time limit still returns what it finished; a stage starts no case that its ``--budget`` (or
what is left of the command's ``--deadline``) would not hold, and names the command that runs it. ``--merge A.json
B.json`` joins the reports of several commands into one. Where a figure does not exist on the CPU (NVML, XLA's GPU
allocator and its ``RESOURCE_EXHAUSTED``, a catalogued peak FLOP/s, a GPU compiler not installed) the report says
why instead.

Presets: ``full`` (the evidence, on an H100 or H200), ``small`` (the ``gpu``-marked tests: minutes on a card) and
``tiny`` (the CPU dry run of ``tests/test_gpu_kit.py``: tiny models, every stage). The commands a session with a
card runs are in benchmarks/README.md, "GPU evidence".

    python benchmarks/gpu.py --stage devices --stage probe --out "$OUT"
    python benchmarks/gpu.py --preset tiny --out /tmp/kit     # every stage on the CPU (~100 CPU-seconds)

Exit status: 0 when the stages ran (each figure, met or not, is in the report), 2 for bad arguments.
"""

from __future__ import annotations

import os

# Before JAX starts: this process must not take 75% of the card that the probe's children need.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import functools
import importlib.util
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autoaccum
from autoaccum import workloads
from autoaccum._catalog import entry_for, lookup, suggest
from autoaccum._gpu_compile import compiler_status
from autoaccum._probe import TrialRunner, prepare
from autoaccum._tune.space import microbatch_candidates, program_key, variants
from autoaccum._units import format_bytes
from autoaccum._worker import is_oom

NA_CPU = "not applicable on cpu"
"""What the report says of a figure that exists only on a GPU (NVML, XLA's GPU allocator, a catalogued peak)."""

FORMAT = "autoaccum.gpu-kit/1"
STAGES = ("devices", "probe", "estimate", "tune", "throughput")
WITHIN = 0.05
"""Issue 13's goal: the GPU-compiled plan's largest microbatch within 5% of the real probe's boundary."""
OUTSIDE = tempfile.gettempdir()
"""Where the kit's own child processes start: from the checkout's root, ``python -c`` would import its
``autoaccum/`` folder (no ``autoaccum.strategies``: setuptools maps ``strategies/`` there) over the installed one."""


# -- presets ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LM:
    """A transformer LM's shape (`autoaccum.workloads.transformer`, blocks under ``nnx.scan``)."""

    vocab: int
    dim: int
    heads: int
    layers: int
    seq_len: int


@dataclasses.dataclass(frozen=True)
class Case:
    """One probe: a model (``"lm"`` or ``"convnet"``) in a dtype under a memory limit."""

    model: str
    dtype: str
    memory_limit: str
    granularity: int = 1
    max_microbatch: int = 16384

    @property
    def name(self) -> str:
        return f"{self.model}-{self.dtype}-{self.memory_limit}"


@dataclasses.dataclass(frozen=True)
class Preset:
    """Every size the stages use.

    Attributes:
      lm: the transformer LM of the probe and throughput stages.
      convnet: the `autoaccum.workloads` builder of the convnet case.
      cases: the probe's cases, the most telling first (a stage's budget may leave the last ones out).
      probe_isolated: probe in child processes (the library's default; the fresh-process check always is).
      tune_lm: the tune stage's transformer; ``tune_batch`` sequences under ``tune_limit``.
      tune_min_microbatch: the floor of tune's search and of the grid.
      tune_strategies: the strategies tuned and gridded (None: every registered one).
      tune_probes: tune probes its bound (its default); False bounds it by the effective batch (no probe).
      batch, microbatch: the throughput stage's effective batch and microbatch (k = batch / microbatch).
      warmup, steps, rounds, round_ms: its timing (``benchmarks/strategies.py``'s rounds).
    """

    lm: LM
    convnet: str
    cases: tuple[Case, ...]
    probe_isolated: bool
    tune_lm: LM
    tune_batch: int
    tune_limit: str
    tune_min_microbatch: int
    tune_strategies: tuple[str, ...] | None
    tune_probes: bool
    batch: int
    microbatch: int
    warmup: int
    steps: int
    rounds: int
    round_ms: float


_DEMO_BATCH, _DEMO_SEQ, _DEMO_LIMIT = workloads.DEMO["gpu"]
_DEMO_LM = LM(vocab=256, dim=64, heads=4, layers=2, seq_len=_DEMO_SEQ)  # workloads.transformer's defaults
# fmt: off
PRESETS = {
    "full": Preset(
        lm=LM(vocab=25_000, dim=768, heads=12, layers=12, seq_len=1024),  # 124M parameters: GPT-2 small's body
        convnet="mnist",
        cases=(
            Case("lm", "bfloat16", "8GiB"),
            Case("lm", "bfloat16", "24GiB"),
            Case("convnet", "float32", "2GiB", granularity=8),
            Case("lm", "float32", "8GiB"),
            Case("lm", "float32", "24GiB"),
        ),
        probe_isolated=True,
        tune_lm=_DEMO_LM, tune_batch=_DEMO_BATCH, tune_limit=_DEMO_LIMIT, tune_min_microbatch=8,
        tune_strategies=None, tune_probes=True,
        batch=32, microbatch=8, warmup=2, steps=3, rounds=8, round_ms=50.0,
    ),
    "small": Preset(
        lm=LM(vocab=4096, dim=256, heads=4, layers=4, seq_len=256),
        convnet="mnist",
        cases=(Case("lm", "bfloat16", "1GiB"), Case("convnet", "float32", "1GiB", granularity=8)),
        probe_isolated=True,
        tune_lm=_DEMO_LM, tune_batch=256, tune_limit=_DEMO_LIMIT, tune_min_microbatch=32,
        tune_strategies=("scan", "loop"), tune_probes=True,
        batch=32, microbatch=8, warmup=1, steps=2, rounds=3, round_ms=20.0,
    ),
    "tiny": Preset(
        lm=LM(vocab=32, dim=16, heads=2, layers=1, seq_len=8),
        convnet="cnn",
        cases=(Case("lm", "bfloat16", "24MiB", 512, 4096),),
        probe_isolated=True,
        tune_lm=LM(vocab=32, dim=16, heads=2, layers=1, seq_len=8), tune_batch=16, tune_limit="256MiB",
        tune_min_microbatch=8, tune_strategies=("scan",), tune_probes=False,
        batch=8, microbatch=2, warmup=2, steps=1, rounds=2, round_ms=0.0,
    ),
}
# fmt: on


# -- the report -------------------------------------------------------------------------------------------------


class Report:
    """The JSON report of one command, written (with its markdown) after every change."""

    def __init__(self, out: Path, preset: str, argv: Sequence[str]) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            "format": FORMAT,
            "preset": preset,
            "command": "python benchmarks/gpu.py " + " ".join(argv),
            "machine": machine(),
            "platform": platform_name(),
            "stages": {},
        }

    def stage(self, name: str) -> dict[str, Any]:
        return self.data["stages"].setdefault(name, {})

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-report.json").write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        (self.out / "gpu-report.md").write_text(render(self.data))


class Clock:
    """A stage's time budget: a case starts only when the longest case so far still fits in what is left."""

    def __init__(self, budget: float) -> None:
        self.start, self.budget, self.longest = time.perf_counter(), budget, 0.0

    def allows(self) -> bool:
        return time.perf_counter() - self.start + self.longest <= self.budget

    def lap(self, since: float) -> float:
        seconds = time.perf_counter() - since
        self.longest = max(self.longest, seconds)
        return seconds


def platform_name() -> str:
    """``"gpu"``, ``"cpu"`` or ``"tpu"``, as `autoaccum.DeviceInfo` names the default device's platform."""
    return autoaccum.detect_device().platform


def machine() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "device": str(getattr(device, "device_kind", device.platform)),
        "devices": jax.device_count(),
        "host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "jax": jax.__version__,
        "optax": optax.__version__,
        "autoaccum": autoaccum.__version__,
        "commit": _git_commit(),
        "gpu_compiler": compiler_status() or "XLA's GPU compiler is installed",
    }


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
    except OSError:
        return None
    return out.stdout.strip() or None


def catalog_entry(name: str) -> str | None:
    """The catalogue's name for a device (``"NVIDIA H100 80GB HBM3"`` -> ``"H100-80GB"``), else the closest, None if
    none is close."""
    return entry_for(name) or suggest(name)


def _sibling(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, imported by path (this folder is no package, and ``strategies`` also names the
    library's strategies folder)."""
    key = f"_autoaccum_benchmarks_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _first_line(text: str | None, limit: int = 300) -> str | None:
    return None if not text else text.strip().splitlines()[0][:limit]


# -- workloads --------------------------------------------------------------------------------------------------


LM_ROWS = 32
"""Distinct sequences the LM's batch is drawn from; a larger batch repeats them (as the probe's trials do)."""


@functools.cache
def _lm_float32(shape: LM) -> autoaccum.Workload:
    with jax.default_device(jax.devices("cpu")[0]):  # built on the host: the card stays untouched here
        return workloads.transformer(
            batch_size=LM_ROWS, seq_len=shape.seq_len, vocab=shape.vocab, dim=shape.dim, heads=shape.heads,
            layers=shape.layers, scan_layers=True,
        )  # fmt: skip


def lm(shape: LM, dtype: str, batch_size: int) -> autoaccum.Workload:
    """The transformer LM with its parameters (and so its arithmetic and AdamW's moments) in ``dtype``, on a
    batch of ``batch_size`` sequences."""
    w = _lm_float32(shape)
    params = jax.tree.map(lambda x: x.astype(dtype), w.params)
    tokens = np.resize(np.asarray(w.batch["tokens"]), (batch_size, shape.seq_len + 1))  # rows repeated in order
    n = n_params(params)
    name = f"transformer LM, {n:,} parameters, {dtype}, {shape.layers} x {shape.dim}, seq {shape.seq_len}"
    return dataclasses.replace(w, params=params, batch={"tokens": tokens}, name=name)


def convnet(builder: str, batch_size: int) -> autoaccum.Workload:
    with jax.default_device(jax.devices("cpu")[0]):
        w = workloads.BUILTIN[builder](batch_size=batch_size)
    return dataclasses.replace(w, name=f"workloads.{builder} (convnet), {n_params(w.params):,} parameters")


def case_workload(preset: Preset, case: Case, batch_size: int = 8) -> autoaccum.Workload:
    if case.model == "lm":
        return lm(preset.lm, case.dtype, batch_size)
    return convnet(preset.convnet, batch_size)


def n_params(params: Any) -> int:
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))


def shapes(tree: Any) -> Any:
    """Shapes and dtypes only (nothing is placed on a device)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


# -- stage 1: devices -------------------------------------------------------------------------------------------

_DEVICE_CHILD = r"""
import json, jax, jax.numpy as jnp
from autoaccum._device import detect_device, memory_stats, resolve_memory_limit
jnp.zeros(()).block_until_ready()  # JAX's allocator starts (and preallocates, unless told not to)
info = detect_device()
try:
    limit, source = resolve_memory_limit(info, None)
except ValueError as e:
    limit, source = None, f"refused: {e}"
print(json.dumps({"info": info.to_dict(), "memory_stats": memory_stats(info.device), "default_limit_bytes": limit,
                  "default_limit_source": source}))
"""


def _fresh_device_reading(preallocate: bool) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("XLA_PYTHON_CLIENT_PREALLOCATE", None)
    if not preallocate:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    done = subprocess.run(
        [sys.executable, "-c", _DEVICE_CHILD], env=env, capture_output=True, text=True, timeout=300, cwd=OUTSIDE
    )
    if done.returncode != 0:
        return {"preallocate": preallocate, "error": done.stderr[-2000:]}
    reading = json.loads(done.stdout.strip().splitlines()[-1])
    return {"preallocate": preallocate, **reading}


def _policy_checks(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    """What the memory-limit policy promises on a GPU, read off the two fresh processes."""
    if on["info"]["platform"] != "gpu":
        return {"nvml": NA_CPU, "preallocated": NA_CPU, "not preallocated": NA_CPU}
    total = off["info"]["total_bytes"]
    share = int(total * 0.75)
    return {
        "nvml": off["info"]["sources"].get("total_bytes") == "nvml",
        "allocator limit is 0.75 of the card": abs(off["memory_stats"].get("bytes_limit", 0) - share) < 2**30,
        "preallocated: limit below the share, says why": on["default_limit_bytes"] is not None
        and on["default_limit_bytes"] < share
        and "holds the rest" in on["default_limit_source"],
        "not preallocated: limit is the share": off["default_limit_bytes"] == share,
    }


def stage_devices(report: Report, args: argparse.Namespace) -> None:
    """NVML, ``memory_stats()`` and the default limit in fresh processes (preallocation on, off); the card's
    target description."""
    out = report.stage("devices")
    readings = [_fresh_device_reading(p) for p in (True, False)]
    out["fresh_processes"] = readings
    if not any("error" in r for r in readings):
        out["checks"] = _policy_checks(*readings)
    report.write()
    cli = [sys.executable, "-m", "autoaccum", "devices", "--target-config"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300, cwd=OUTSIDE)
    if platform_name() != "gpu":
        out["target_config"] = {"exit_code": done.returncode, "file": NA_CPU, "message": done.stderr.strip()[-500:]}
    elif done.returncode == 0:
        path = report.out / "card.txtpb"
        path.write_text(done.stdout)
        out["target_config"] = {"exit_code": 0, "file": path.name, "text": done.stdout}
    else:
        out["target_config"] = {"exit_code": done.returncode, "file": None, "message": done.stderr.strip()[-2000:]}
    report.write()


# -- stage 2: probe ---------------------------------------------------------------------------------------------


def _probe_kwargs(w: autoaccum.Workload, case: Case) -> dict[str, Any]:
    return dict(
        optimizer=w.optimizer, memory_limit=case.memory_limit, granularity=case.granularity,
        microbatch_cap=case.max_microbatch,
    )  # fmt: skip


def fresh_check(w: autoaccum.Workload, case: Case, boundary: int, gpu: bool) -> dict[str, Any]:
    """M and M + granularity, each run once more in a fresh child process (the probe's `TrialRunner`)."""
    above = boundary + case.granularity
    if boundary == 0 or above > case.max_microbatch:
        return {"skipped": f"no boundary below the cap to check (M = {boundary}, cap {case.max_microbatch})"}
    setup = prepare(w.loss_fn, shapes(w.params), w.batch, isolate=True, **_probe_kwargs(w, case))
    try:
        with TrialRunner(setup) as run:
            fits, over = run(boundary), run(above)
    except autoaccum.ProbeError as e:
        return {"error": str(e)[-2000:]}
    detail = over.detail or over.error
    return {
        "microbatch": boundary,
        "fits": fits.fits,
        "above": above,
        "above_fits": over.fits,
        "above_detail": _first_line(detail),
        "resource_exhausted": ("RESOURCE_EXHAUSTED" in (detail or "")) if gpu else NA_CPU,
        "agrees": fits.fits and not over.fits,
        "seconds": (fits.wall_seconds or 0) + (over.wall_seconds or 0),
    }


def probe_case(preset: Preset, case: Case) -> dict[str, Any]:
    """One probe and its fresh-process check."""
    w = case_workload(preset, case)
    row: dict[str, Any] = {"case": case.name, "workload": w.name, **dataclasses.asdict(case)}
    try:
        result = autoaccum.probe(
            w.loss_fn, shapes(w.params), w.batch, isolate=preset.probe_isolated, **_probe_kwargs(w, case)
        )
    except autoaccum.ProbeError as e:
        row["error"] = str(e)[-2000:]
        row["trials"] = [dataclasses.asdict(t) for t in e.trials]
        return row
    except ValueError as e:  # the limit refused before anything ran (e.g. above the memory free on the card)
        row["error"] = str(e)
        return row
    estimate = None if result.estimate is None else result.estimate.max_microbatch
    m = result.max_microbatch
    row.update(
        boundary=m,
        reached_cap=result.reached_cap,
        runs=result.runs,
        seconds=result.seconds,
        isolated=result.isolate,
        memory_limit_bytes=result.memory_limit_bytes,
        limit_source=result.limit_source,
        estimate=estimate,
        estimate_ratio=None if not (estimate and m) else estimate / m,
        estimate_seconds=None if result.estimate is None else result.estimate.seconds,
        message=result.message,
        trials=[
            {"microbatch": t.microbatch_size, "fits": t.fits, "wall_seconds": t.wall_seconds,
             "peak_bytes": t.peak_bytes, "detail": _first_line(t.detail)}
            for t in result.trials
        ],
    )  # fmt: skip
    row["check"] = fresh_check(w, case, m, platform_name() == "gpu")
    return row


def stage_probe(report: Report, args: argparse.Namespace) -> None:
    preset = PRESETS[args.preset]
    out = report.stage("probe")
    rows: list[dict[str, Any]] = out.setdefault("cases", [])
    clock = Clock(args.stage_budget)
    for case in _selected(preset, args):
        if not clock.allows():
            rows.append({"case": case.name, "skipped": _budget_note(args, case)})
            continue
        start = time.perf_counter()
        print(f"probe {case.name} ...", flush=True)
        rows.append(probe_case(preset, case))
        rows[-1]["case_seconds"] = clock.lap(start)
        report.write()
    report.write()


def _selected(preset: Preset, args: argparse.Namespace) -> list[Case]:
    cases = [c for c in preset.cases if not args.case or c.name in args.case]
    unknown = set(args.case or ()) - {c.name for c in preset.cases}
    if unknown:
        raise SystemExit(f"unknown --case {sorted(unknown)}; the preset's: {[c.name for c in preset.cases]}")
    return cases


def _budget_note(args: argparse.Namespace, case: Case) -> str:
    return (
        f"not run: the stage's budget ({args.stage_budget:.0f} s) would not hold it; run it with "
        f"--preset {args.preset} --stage probe --stage estimate --case {case.name}"
    )


# -- stage 3: estimate ------------------------------------------------------------------------------------------


def _targets(report: Report, args: argparse.Namespace) -> list[tuple[str, str | Path]]:
    """``(label, target)``: the card's own description (when there is one), the catalogue's of its kind, H100."""
    out: list[tuple[str, str | Path]] = []
    card = args.target_config or (report.out / "card.txtpb")
    if card.exists():
        out.append(("card's own description", card))
    elif platform_name() == "gpu":
        from autoaccum._target_config import device_target_config

        path = report.out / "card.txtpb"
        path.write_text(device_target_config(jax.devices("cuda")[:1]))
        out.append(("card's own description", path))
    kind = catalog_entry(autoaccum.detect_device().name) if platform_name() == "gpu" else None
    for name in dict.fromkeys(n for n in (kind, "H100-80GB") if n):
        out.append((f"catalogued {name}", name))
    return out


def _probe_rows(report: Report, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = list(report.data["stages"].get("probe", {}).get("cases", []))
    for path in args.probe_report or ():
        rows += json.loads(Path(path).read_text())["stages"].get("probe", {}).get("cases", [])
    return [r for r in rows if r.get("boundary")]


def gpu_estimate(w: autoaccum.Workload, limits: Sequence[int], cap: int, target: str | Path) -> dict[str, Any]:
    """XLA's GPU compiler's estimate for ``target``, compile-only, refined around each of ``limits`` (one estimate
    answers every limit a model was probed under)."""
    start = time.perf_counter()
    est = autoaccum.estimate(
        w.loss_fn, shapes(w.params), shapes(w.batch), optimizer=w.optimizer, memory_limit=max(limits),
        microbatch_cap=cap, accumulation=False, refine_for=list(limits), target=target,
    )  # fmt: skip
    return {"estimate": est, "seconds": time.perf_counter() - start}


def gpu_compiled(made: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The GPU-compiled largest microbatch under the probe's limit (a multiple of its granularity) against M."""
    g = row["granularity"]
    predicted = made["estimate"].largest_microbatch(row["memory_limit_bytes"], runtime=False) // g * g
    ratio = predicted / row["boundary"]
    return {
        "compiler": made["estimate"].compiler,
        "max_microbatch": predicted,
        "ratio": ratio,
        "within_5%": abs(ratio - 1) <= WITHIN,
        "estimate_seconds": made["seconds"],
    }


def stage_estimate(report: Report, args: argparse.Namespace) -> None:
    preset = PRESETS[args.preset]
    out = report.stage("estimate")
    rows: list[dict[str, Any]] = out.setdefault("cases", [])
    probed = _probe_rows(report, args)
    if not probed:
        out["note"] = "no probe boundary to compare with: run the probe stage first, or pass --probe-report"
    status = compiler_status()
    targets = _targets(report, args) if status is None else []
    out["targets"] = [str(t) for _, t in targets] or f"XLA's GPU compiler unavailable here: {status}"
    limits: dict[tuple[str, str], set[int]] = {}
    for r in probed:
        limits.setdefault((r["model"], r["dtype"]), set()).add(r["memory_limit_bytes"])
    made: dict[tuple[str, str, str], dict[str, Any]] = {}
    clock = Clock(args.stage_budget)
    for probe_row in probed:
        case = Case(probe_row["model"], probe_row["dtype"], probe_row["memory_limit"], probe_row["granularity"],
                    probe_row["max_microbatch"])  # fmt: skip
        row: dict[str, Any] = {"case": case.name, "boundary": probe_row["boundary"]}
        row["compile_only_on_this_device"] = {"max_microbatch": probe_row["estimate"],
                                              "ratio": probe_row["estimate_ratio"]}  # fmt: skip
        rows.append(row)
        if status is not None:
            row["gpu_compiled"] = f"XLA's GPU compiler unavailable here: {status}"
            continue
        model = (case.model, case.dtype)
        if any((*model, label) not in made for label, _ in targets) and not clock.allows():
            row["gpu_compiled"] = f"not run: the stage's budget ({args.stage_budget:.0f} s) would not hold it"
            continue
        start = time.perf_counter()
        for label, target in targets:
            if (*model, label) not in made:
                w = case_workload(preset, case)
                made[(*model, label)] = gpu_estimate(w, sorted(limits[model]), case.max_microbatch, target)
        row["gpu_compiled"] = {label: gpu_compiled(made[(*model, label)], probe_row) for label, _ in targets}
        clock.lap(start)
        report.write()
    report.write()


# -- stage 4: tune ----------------------------------------------------------------------------------------------


def _pick(result: autoaccum.TuneResult) -> tuple[autoaccum.TrialRecord, autoaccum.TrialRecord]:
    """The plan's trial, and the trial that timed its program (itself, or the one it shares a program with)."""
    number = result.race[0].trial if result.race else result.trials[0].number
    trials = {t.number: t for t in result.trials}
    pick = trials[number]
    return pick, trials.get(pick.same_program_as, pick) if pick.same_program_as is not None else pick


def _label(labels: dict[str, tuple[str, dict[str, Any]]], strategy: str, options: dict[str, Any]) -> str:
    return next(k for k, v in labels.items() if v == (strategy, dict(options)))


def time_grid(
    worker: Any, labels: dict[str, Any], sizes: list[int], batch: int, clock: Clock
) -> tuple[dict[tuple[int, str], float], int, dict[tuple[int, str], list[list[float]]]]:
    """Examples/s of every configuration of the grid (each program once, `program_key`), in one worker, and the
    costs (XLA's ``[flops, bytes accessed]`` per program) the worker compiled each with."""
    bench = _sibling("tune")
    timed: dict[Any, tuple[float, list[list[float]]]] = {}
    grid: dict[tuple[int, str], float] = {}
    costs: dict[tuple[int, str], list[list[float]]] = {}
    for m in sizes:
        for label, variant in labels.items():
            key = program_key(m, variant, batch)
            if key not in timed:
                if not clock.allows():
                    continue
                start = time.perf_counter()
                outcomes: dict[str, Any] = {}
                rate = bench.side_by_side(worker, {"c": (m, label, None)}, labels, batch, 1, outcomes=outcomes)["c"]
                timed[key] = (rate, outcomes["c"].costs or [])
                clock.lap(start)
            if timed[key][0]:
                grid[(m, label)], costs[(m, label)] = timed[key]
    return grid, len(timed), costs


def cost_ranking(
    w: autoaccum.Workload, grid: dict[tuple[int, str], float], costs: dict[tuple[int, str], list[list[float]]],
    labels: dict[str, Any], batch: int,
) -> dict[str, Any]:  # fmt: skip
    """How well XLA's cost analysis orders the grid's configurations with their strategies' default options
    (`benchmarks/scaling.py`'s roofline and ranking, with this device's rates): Spearman's rho and the best of the
    3 predicted fastest over the grid's best."""
    scaling = _sibling("scaling")
    rates, opt = scaling.machine_rates(), scaling.optimizer_cost(w)
    rows = []
    for (m, label), rate in grid.items():
        name, options = labels[label]
        if ":" in label or not costs.get((m, label)):  # (unrolled variants run other bodies than the roofline's)
            continue
        predicted = scaling.predicted_seconds(name, -(-batch // m), [tuple(c) for c in costs[(m, label)]], opt, rates)
        row = {"microbatch_size": m, "strategy": name, "options": options, "remat": None}
        rows.append({**row, "predicted_seconds": predicted, "step_seconds": batch / rate, "examples_per_second": rate})
    if len(rows) < 2:
        return {"cost_ranking": f"not enough configurations with costs ({len(rows)})"}
    ranked = scaling.ranking(rows)
    return {"cost_ranking": {**ranked, "configurations": len(rows), "rates": rates}}


def stage_tune(report: Report, args: argparse.Namespace) -> None:
    preset = PRESETS[args.preset]
    bench = _sibling("tune")
    w = lm(preset.tune_lm, "float32", preset.tune_batch)
    w = dataclasses.replace(w, params=jax.device_put(w.params), batch=jax.device_put(w.batch))
    out = report.stage("tune")
    out["workload"] = f"{w.name}, effective batch {preset.tune_batch}, limit {preset.tune_limit}"
    start = time.perf_counter()
    result = autoaccum.tune(
        w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=preset.tune_limit, storage=":memory:",
        strategies=preset.tune_strategies, min_microbatch=preset.tune_min_microbatch,
        microbatch_bound=None if preset.tune_probes else preset.tune_batch,
    )  # fmt: skip
    tune_seconds = time.perf_counter() - start
    pick, timed = _pick(result)
    unit = timed.unit_seconds
    peak, limit = result.peak_bytes, result.memory_limit_bytes
    labels = variants(list(preset.tune_strategies or autoaccum.strategies.available()))
    plan = result.plan
    pick_config = (plan.microbatch_size, _label(labels, plan.strategy, plan.options), plan.remat)
    bound = result.probe.max_microbatch if result.probe is not None else preset.tune_batch
    out.update(
        pick=f"{pick_config[0]} x {pick_config[1]}", pick_examples_per_second=pick.throughput,
        trials=len(result.trials), bound=bound, probe_runs=None if result.probe is None else result.probe.runs,
        peak_bytes=peak, memory_limit_bytes=limit, peak_over_limit=None if peak is None else peak / limit,
        tune_seconds=tune_seconds, unit_seconds=unit, tune_units=tune_seconds / unit if unit else None,
        tune_phases=result.phases, tune_result_units=result.units,
        tune_trials=[
            {"config": f"{t.microbatch_size} x {_label(labels, t.strategy, t.options)}", "knobs": t.knobs,
             "remat": t.remat, "state": t.state, "compile_seconds": t.compile_seconds, "throughput": t.throughput,
             "reason": None if t.reason is None else t.reason[:300]}
            for t in result.trials
        ],  # what each trial cost and why one failed: where the next change goes
    )  # fmt: skip
    report.write()
    sizes = [m for m in microbatch_candidates(preset.tune_batch, bound) if m >= preset.tune_min_microbatch]
    setup = prepare(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=preset.tune_limit)
    clock = Clock(args.stage_budget - tune_seconds)
    with bench.worker_for(setup) as worker:
        start = time.perf_counter()
        grid, programs, costs = time_grid(worker, labels, sizes, preset.tune_batch, clock)
        grid_seconds = time.perf_counter() - start
        if not grid:
            out["grid"] = f"not run: no configuration of the grid fit in the stage's budget ({args.stage_budget:.0f} s)"
            report.write()
            return
        best = max(grid, key=grid.__getitem__)
        configs = {"pick": pick_config, "grid": (*best, None), "control": (*best, None)}
        rates = bench.side_by_side(worker, configs, labels, preset.tune_batch, 3)
    out.update(
        grid_configurations=len(sizes) * len(labels), grid_programs=programs, grid_seconds=grid_seconds,
        grid_best=f"{best[0]} x {best[1]}", grid_best_examples_per_second=grid[best],
        pick_is_grid_best=(pick_config[0], pick_config[1]) == best,
        side_by_side=rates, pick_over_grid_best=1.0 if pick_config[:2] == best else rates["pick"] / rates["grid"],
        control=rates["control"] / rates["grid"],
    )  # fmt: skip
    try:  # evidence for a compile-only ranking (issue 31); its failure is a finding, not the stage's
        out.update(cost_ranking(w, grid, costs, labels, preset.tune_batch))
    except Exception as e:
        out["cost_ranking"] = f"failed: {_first_line(str(e))}"
    report.write()


# -- stage 5: throughput ----------------------------------------------------------------------------------------


def step_flops(w: autoaccum.Workload) -> float:
    """FLOPs of one full-batch update (forward, backward, optimizer): XLA's cost analysis of the unoptimised
    program, lowered for the host (the algorithm's count: no fusion or library call hides any)."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    on_host = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), tree)  # noqa: E731

    def update(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(w.loss_fn)(params, batch)
        updates, opt_state = w.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state = jax.eval_shape(w.optimizer.init, shapes(w.params))
    lowered = jax.jit(update).lower(on_host(shapes(w.params)), on_host(opt_state), on_host(shapes(w.batch)))
    cost = lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


def components(w: autoaccum.Workload, microbatch: Any) -> list[Any]:
    """One microbatch's forward and backward pass, and one optimizer apply, each a `benchmarks/strategies.py`
    ``Method`` of its own (timed beside the others, checked against nothing)."""
    bench = _sibling("strategies")
    grad = jax.jit(jax.value_and_grad(w.loss_fn))

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def apply(params: Any, opt_state: Any, grads: Any) -> Any:
        updates, opt_state = w.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    fb = bench.Method("one microbatch's forward + backward", "component", lambda p: (p,),
                      lambda s: (s[0], grad(s[0], microbatch)))  # fmt: skip
    zeros = lambda p: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
    opt = bench.Method("one optimizer apply", "component", lambda p: (p, w.optimizer.init(p), zeros(p)),
                       lambda s: (*apply(s[0], s[1], s[2]), s[2]))  # fmt: skip
    return [fb, opt]


def _methods(w: autoaccum.Workload, preset: Preset) -> tuple[list[Any], list[Any]]:
    bench = _sibling("strategies")
    m, k = preset.microbatch, preset.batch // preset.microbatch
    mbs = [jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], w.batch) for i in range(k)]
    ours = bench.our_methods(w.loss_fn, w.optimizer, w.batch, m, [1])[0]  # the default: strategy="auto"
    methods = [
        bench.full_batch(w.loss_fn, w.optimizer, w.batch),
        ours,
        bench.ours(w.loss_fn, w.optimizer, w.batch, m, "loop"),  # the tuner's other variant (benchmarks/gpu_bytes.py)
        bench.manual(w.loss_fn, w.optimizer, mbs),
        bench.multisteps(w.loss_fn, w.optimizer, mbs),
        bench.microbatch(w.loss_fn, w.optimizer, w.batch, m),
    ]
    return methods, components(w, mbs[0])


def _timing_args(preset: Preset, dtype: str) -> argparse.Namespace:
    # One step from the same start is checked against the reference's (benchmarks/strategies.py): bfloat16
    # parameters round each update to a bfloat16 ulp (2**-7 at 1.0), and hand-written accumulators sum bfloat16
    # gradients in bfloat16, so its tolerances are an ulp's.
    low = dtype == "bfloat16"
    return argparse.Namespace(
        atol=1e-2 if low else 1e-4, grad_atol=5e-3 if low else 1e-6, warmup=preset.warmup, steps=preset.steps,
        rounds=preset.rounds, round_ms=preset.round_ms,
    )  # fmt: skip


def stage_throughput(report: Report, args: argparse.Namespace) -> None:
    preset = PRESETS[args.preset]
    bench = _sibling("strategies")
    out = report.stage("throughput")
    w = lm(preset.lm, "bfloat16", preset.batch)
    w = dataclasses.replace(w, params=jax.device_put(w.params, jax.devices()[0]),
                            batch=jax.device_put(w.batch, jax.devices()[0]))  # fmt: skip
    k = preset.batch // preset.microbatch
    out["workload"] = f"{w.name}; effective batch {preset.batch}, microbatch {preset.microbatch} (k = {k})"
    flops = step_flops(w)
    info = autoaccum.detect_device()
    entry = catalog_entry(info.name) if info.platform == "gpu" else None
    peak = lookup(entry).peak_flops("bfloat16") if entry else None
    out.update(step_flops=flops, catalog=entry or NA_CPU, peak_flops=peak or NA_CPU)
    timing = _timing_args(preset, "bfloat16")
    methods, parts = _methods(w, preset)
    try:  # the full-batch step alone first: on the card it may not fit where accumulating does
        bench.check_and_warm(methods[:1], w.params, timing)
    except (jax.errors.JaxRuntimeError, MemoryError) as e:
        if not is_oom(e):
            raise
        out["full_batch"] = f"does not fit on the card: {_first_line(str(e))}"
        methods = methods[1:]  # checked against the emitted update instead
    states, first_call, failed, worst = bench.check_and_warm(methods, w.params, timing)
    out["check"] = {"passed": not failed, "failures": failed, "max_param_diff": worst[0], "max_mu_diff": worst[1]}
    for part in parts:
        state = jax.block_until_ready(part.step(part.init(bench.copy(w.params))))
        states[part.name] = state
    times = bench.time_rounds([*methods, *parts], states, timing)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    rows = []
    for method in methods:
        t = med[method.name]
        rows.append({
            "method": method.name, "by": method.by, "ms_per_step": 1e3 * t, "examples_per_second": preset.batch / t,
            "first_call_seconds": first_call[method.name], "tflops": flops / t / 1e12,
            "mfu": flops / t / peak if peak else NA_CPU,
        })  # fmt: skip
    out["methods"] = rows
    ours = med[bench.DEFAULT]
    alone = k * med[parts[0].name] + med[parts[1].name]
    out["components_ms"] = {part.name: 1e3 * med[part.name] for part in parts}
    full = med.get(methods[0].name) if methods[0].by == "reference" else None
    out["accumulating_over_full_batch"] = ours / full if full else out["full_batch"]
    out["accumulating_over_parts_alone"] = ours / alone
    hand = min((m for m in methods if m.by == "hand-written"), key=lambda m: med[m.name])
    out["ours_over_best_hand_written"] = med[hand.name] / ours  # throughput ratio (> 1: ours faster)
    out["best_hand_written"] = hand.name
    report.write()


# -- markdown ---------------------------------------------------------------------------------------------------


def _fmt(x: Any, digits: int = 3) -> str:
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return str(x)
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def _size(n: Any) -> str:
    return format_bytes(n) if isinstance(n, int) else str(n)


def _table(header: Sequence[str], rows: list[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]


def _md_devices(s: dict[str, Any]) -> list[str]:
    rows = []
    for r in s.get("fresh_processes", []):
        if "error" in r:
            rows.append((r["preallocate"], "error", r["error"][-200:], "", "", "", ""))
            continue
        i = r["info"]
        rows.append((
            "on (default)" if r["preallocate"] else "off", i["name"], _size(i["total_bytes"]), _size(i["free_bytes"]),
            _size(r["memory_stats"].get("bytes_limit", NA_CPU)), _size(r["default_limit_bytes"]),
            r["default_limit_source"],
        ))  # fmt: skip
    header = ("preallocation", "device", "total", "free", "allocator limit", "default memory limit", "its source")
    lines = _table(header, rows)
    lines += [f"- {k}: {v}" for k, v in s.get("checks", {}).items()]
    tc = s.get("target_config", {})
    lines.append(f"- `autoaccum devices --target-config`: exit {tc.get('exit_code')}, file {tc.get('file')}")
    return lines


def _md_probe(s: dict[str, Any]) -> list[str]:
    rows = []
    for r in s.get("cases", []):
        if "boundary" not in r:
            rows.append((r["case"], r.get("skipped") or r.get("error", "")[-200:], *[""] * 8))
            continue
        c = r["check"]
        check = c.get("skipped") or c.get("error") or f"{c['fits']} / {c['above_fits']} ({c['above']})"
        rows.append((
            r["case"], _size(r["memory_limit_bytes"]), r["boundary"], r["runs"], r["seconds"],
            r.get("estimate_seconds"), r["estimate"], r["estimate_ratio"], check, c.get("resource_exhausted", ""),
        ))  # fmt: skip
    header = ("case", "limit", "boundary M", "runs", "probe s", "its estimate s", "compile-only estimate",
              "estimate / M", "fresh: M fits / M+g fits", "M+g RESOURCE_EXHAUSTED")  # fmt: skip
    return _table(header, rows)


def _md_estimate(s: dict[str, Any]) -> list[str]:
    rows = []
    for r in s.get("cases", []):
        gpu = r.get("gpu_compiled")
        figures = (
            "; ".join(f"{label}: {g['max_microbatch']} ({g['ratio']:.3f}{', within 5%' if g['within_5%'] else ''})"
                      for label, g in gpu.items())
            if isinstance(gpu, dict) else gpu
        )  # fmt: skip
        on_device = r["compile_only_on_this_device"]
        rows.append((r["case"], r["boundary"], on_device["max_microbatch"], on_device["ratio"], figures))
    lines = _table(("case", "probe M", "compile-only here", "/ M", "GPU-compiled, compile-only devices (/ M)"), rows)
    return lines + ([f"- {s['note']}"] if "note" in s else [])


def _md_tune(s: dict[str, Any]) -> list[str]:
    keys = ("workload", "pick", "grid_best", "pick_over_grid_best", "control", "peak_bytes", "memory_limit_bytes",
            "peak_over_limit", "tune_seconds", "unit_seconds", "tune_units", "grid_seconds", "grid_programs",
            "trials", "probe_runs")  # fmt: skip
    lines = _table(("figure", "value"), [(k, s[k]) for k in keys if k in s])
    failed = [f"{t['config']} {t['knobs'] or ''}: {t['reason']}" for t in s.get("tune_trials", []) if t["reason"]]
    return lines + [f"- failed: {f}" for f in failed]


def _md_throughput(s: dict[str, Any]) -> list[str]:
    rows = [
        (r["method"], r["by"], r["ms_per_step"], r["examples_per_second"], r["tflops"], r["mfu"])
        for r in s.get("methods", [])
    ]
    lines = _table(("method", "by", "ms/step (median)", "examples/s", "TFLOP/s", "MFU"), rows)
    keys = ("workload", "step_flops", "catalog", "peak_flops", "check", "components_ms",
            "accumulating_over_full_batch", "accumulating_over_parts_alone", "ours_over_best_hand_written")  # fmt: skip
    return lines + [f"- {k}: {_fmt(s[k])}" for k in keys if k in s]


def render(data: dict[str, Any]) -> str:
    """The report as markdown: a table per stage."""
    m = data["machine"]
    lines = [
        f"# GPU evidence ({data['preset']} preset, platform {data['platform']})",
        "",
        f"{m['device']}; jax {m['jax']}; autoaccum {m['autoaccum']} at {m['commit']}; `{data['command']}`",
    ]
    makers: dict[str, Callable[[dict[str, Any]], list[str]]] = {
        "devices": _md_devices, "probe": _md_probe, "estimate": _md_estimate, "tune": _md_tune,
        "throughput": _md_throughput,
    }  # fmt: skip
    for name, stage in data["stages"].items():
        lines += ["", f"## {name}", "", *([stage["skipped"]] if "skipped" in stage else makers[name](stage))]
    return "\n".join(lines) + "\n"


def merge(paths: Sequence[Path]) -> dict[str, Any]:
    """Several commands' reports as one: each stage from the last report that has it, probe cases joined."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    merged = {**reports[0], "command": "; ".join(r["command"] for r in reports), "stages": {}}
    for r in reports:
        for name, stage in r["stages"].items():
            if "skipped" in stage and name in merged["stages"]:
                continue
            if name in ("probe", "estimate") and name in merged["stages"]:
                merged["stages"][name]["cases"] += stage.get("cases", [])
            else:
                merged["stages"][name] = json.loads(json.dumps(stage))
    return merged


# -- main -------------------------------------------------------------------------------------------------------

RUNNERS: dict[str, Callable[[Report, argparse.Namespace], None]] = {
    "devices": stage_devices, "probe": stage_probe, "estimate": stage_estimate, "tune": stage_tune,
    "throughput": stage_throughput,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog="exit status: 0 when the stages ran, 2 for bad arguments.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )  # fmt: skip
    p.add_argument("--stage", action="append", choices=STAGES, help="a stage to run (repeat) [all, in order]")
    p.add_argument("--preset", choices=sorted(PRESETS), help="sizes [full with a GPU, else tiny]")
    p.add_argument("--case", action="append", help="probe only this case (repeat), e.g. lm-bfloat16-8GiB")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-report"), help="report folder")
    p.add_argument("--budget", type=float, default=420.0, help="seconds a stage may take before it skips cases")
    p.add_argument(
        "--deadline", type=float, default=480.0, help="seconds the whole command may take (each stage's budget shrinks)"
    )
    p.add_argument("--probe-report", type=Path, action="append", help="estimate: an earlier report's probe")
    p.add_argument("--target-config", type=Path, help="estimate: the card's description [OUT/card.txtpb]")
    p.add_argument("--merge", type=Path, nargs="+", help="join these reports into --out and stop")
    p.add_argument("--compile-cache", type=Path, help="JAX's persistent compilation cache [a new temporary folder]")
    return p.parse_args(argv)


def use_compile_cache(folder: Path | None) -> Path:
    """JAX's persistent compilation cache in ``folder`` (a new one by default), here and in every child process:
    the fresh-process check re-runs programs the probe compiled, the grid those tune compiled. A new folder per
    command keeps every first compile (the compile times reported) a real one."""
    folder = folder or Path(tempfile.mkdtemp(prefix="autoaccum-gpu-kit-cache-"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return folder


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge:
        data = merge(args.merge)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-report.json").write_text(json.dumps(data, indent=2) + "\n")
        (args.out / "gpu-report.md").write_text(render(data))
        print(render(data))
        return 0
    args.preset = args.preset or ("full" if platform_name() == "gpu" else "tiny")
    report = Report(args.out, args.preset, argv)
    cache = use_compile_cache(args.compile_cache)
    report.data["compilation_cache"] = str(cache)
    deadline = time.perf_counter() + args.deadline
    try:
        for name in [s for s in STAGES if s in (args.stage or STAGES)]:
            start = time.perf_counter()
            args.stage_budget = min(args.budget, deadline - start)
            if args.stage_budget <= 0:
                report.stage(name)["skipped"] = f"not run: the command's --deadline ({args.deadline:g} s) was spent"
                continue
            print(f"== {name} ({args.preset} preset)", flush=True)
            RUNNERS[name](report, args)
            report.stage(name)["stage_seconds"] = time.perf_counter() - start
            report.write()
            print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    finally:
        if args.compile_cache is None:
            shutil.rmtree(cache, ignore_errors=True)
    print(render(report.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
