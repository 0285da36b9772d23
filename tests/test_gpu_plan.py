"""Plans from XLA's real GPU compiler, on compile-only devices (the gpu-plan extra): no GPU needed.

Every test that compiles for a GPU needs ``jax-cuda12-plugin`` (or ``-cuda13-``) at jax's version. Without it
they skip, except under CI (``CI`` set), where a missing compiler fails them: CI installs the extra.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from click.testing import CliRunner, Result
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoaccum
from autoaccum import _gpu_compile, workloads
from autoaccum._catalog import UnknownAcceleratorError
from autoaccum._gpu_compile import (
    COMPILE_MEMORY_BYTES,
    GPU_COMPILER_OPTIONS,
    check_gpu,
    compiler_status,
    describe,
    gpu_cost,
    gpu_mesh,
    known_targets,
)
from autoaccum._target_config import TargetConfigError, target_config_text
from autoaccum.cli import main


@pytest.fixture
def gpu_compiler() -> None:
    status = compiler_status()
    if status is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the gpu-plan extra, yet: {status}")
        pytest.skip(status)


def _compile(description: str, fn, *shapes: tuple[int, ...], options=None):  # type: ignore[no-untyped-def]
    """``fn`` compiled for one compile-only GPU described by ``description`` through jax's API (the devices are
    ``topologies.get_topology_desc(platform="cuda", ...)``'s, loaded directly where jax did not register the
    plugin: `_gpu_compile._devices`)."""
    devices = _gpu_compile._devices(description, 1)
    mesh = jax.sharding.Mesh(np.asarray(devices, dtype=object), ("data",))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in shapes]
    lowered = jax.jit(fn).lower(*args)
    return lowered, lowered.compile(compiler_options=options or dict(GPU_COMPILER_OPTIONS))


def _peak(compiled) -> int:  # type: ignore[no-untyped-def]
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def mlp_step(*args):  # type: ignore[no-untyped-def]
    """An MLP's weight gradients (``*weights, x``; the compilers of sm_80 and sm_90 lay this one out differently)."""
    *params, x = args

    def loss(params):  # type: ignore[no-untyped-def]
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    return jax.grad(loss)(params)


# -- the compile really targets the GPU ---------------------------------------------------------------------------


def test_estimate_compiles_for_the_gpu(gpu_compiler: None) -> None:
    w = workloads.linear()
    est = autoaccum.estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, target="H100")
    assert est.compiler == "XLA:GPU sm_90 (compile-only)" and est.platform == "gpu" and est.target == "H100-80GB"
    assert est.memory_limit_bytes == autoaccum.Target.gpu("H100").memory_limit_bytes
    assert all(p.runtime_bytes == 0 for p in est.points)  # no CPU runtime added to a GPU's figures
    # the largest one-microbatch point, checked against the same step compiled through jax's API directly
    point = max(est.single_points, key=lambda p: p.microbatch_size)
    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=point.microbatch_size)
    params, batch, _ = _gpu_compile.on_gpu("H100", w.params, w.batch, None)
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((point.microbatch_size, *x.shape[1:]), x.dtype, sharding=x.sharding), batch
    )
    (program,) = update.programs(params, jax.eval_shape(update.init, params), batch)
    compiled = program.lowered.compile(
        compiler_options={**GPU_COMPILER_OPTIONS, **autoaccum._estimate.COMPILER_OPTIONS}
    )
    check_gpu(compiled)
    assert {d.platform for s in jax.tree.leaves(compiled.input_shardings) for d in s.device_set} == {"gpu"}
    assert point.peak_bytes == _peak(compiled) + program.resident_bytes
    capacity = est.capacity(4096, "H100")
    assert capacity.compiler == "XLA:GPU sm_90 (compile-only)" and capacity.fits_in_one_step
    assert est.capacity(4096, "L4").compiler == "XLA:GPU sm_90 for H100-80GB (proxy)"


def test_a_program_without_gpu_shardings_is_refused(gpu_compiler: None) -> None:
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)  # no sharding: compiles for the CPU, silently
    compiled = jax.jit(lambda x: x @ x).lower(x).compile()
    with pytest.raises(RuntimeError, match="compiled for cpu"):
        check_gpu(compiled)


def test_sharded_batch_compiles_for_as_many_gpus(gpu_compiler: None) -> None:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    w = workloads.linear(batch_size=64)
    batch = jax.device_put(w.batch, NamedSharding(mesh, P("data")))
    params = jax.device_put(w.params, NamedSharding(mesh, P()))
    est = autoaccum.estimate(
        w.loss_fn, params, batch, optimizer=w.optimizer, target="A100-40GB", accumulation=False, microbatch_cap=256
    )
    assert est.shards == 8 and est.compiler == "XLA:GPU sm_80 (compile-only)"
    assert all(p.microbatch_size % 8 == 0 for p in est.points)
    assert gpu_mesh("A100-40GB", (8,)).devices.size == 8


# -- the figures are the GPU compiler's, per generation ------------------------------------------------------------


@pytest.mark.slow
def test_h100_and_a100_give_different_figures_for_the_same_step(gpu_compiler: None) -> None:
    w = workloads.mlp()
    update = autoaccum.build_update(w.loss_fn, w.optimizer, microbatch_size=1024)
    peaks = {}
    for target in ("H100", "A100-40GB"):
        params, batch, _ = _gpu_compile.on_gpu(target, w.params, w.batch, None)
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((1024, *x.shape[1:]), x.dtype, sharding=x.sharding), batch)
        (program,) = update.programs(params, jax.eval_shape(update.init, params), batch)
        compiled = program.lowered.compile(compiler_options=dict(GPU_COMPILER_OPTIONS))
        check_gpu(compiled)
        peaks[target] = _peak(compiled)
    assert peaks["H100"] != peaks["A100-40GB"], peaks


def test_codegen_options_leave_the_memory_figures_alone(gpu_compiler: None) -> None:
    description = describe("H100").with_memory(COMPILE_MEMORY_BYTES)
    fast = _compile(description, mlp_step, (512, 512), (512, 512), (4096, 512))[1]
    full = _compile(
        description, mlp_step, (512, 512), (512, 512), (4096, 512), options={"xla_gpu_enable_triton_gemm": False}
    )[1]
    assert fast.memory_analysis().temp_size_in_bytes == full.memory_analysis().temp_size_in_bytes


def test_costs_come_from_the_gpu_program(gpu_compiler: None) -> None:
    lowered, compiled = _compile(describe("H100").with_memory(COMPILE_MEMORY_BYTES), jnp.matmul, (256, 512), (512, 128))
    assert compiled.cost_analysis() in (None, {}, [])  # the trap: compile-only executables have none
    flops, moved = gpu_cost(compiled, lowered)
    assert flops == 2 * 256 * 512 * 128
    assert moved == 4 * (256 * 512 + 512 * 128 + 256 * 128)  # its operands and result, once (one cuBLAS call)


# -- the rematerialisation trap ------------------------------------------------------------------------------------


def recomputable(u, v, w):  # type: ignore[no-untyped-def]
    """Eight 64 MiB values, each cheap to recompute from u and v, all needed after a pass over every one."""
    big = [jnp.cumsum(jnp.outer(u + i, v), axis=0) for i in range(8)]
    s = sum(jnp.sum(jnp.tanh(b @ w)) for b in big)
    return sum(b * s for b in big)


def test_the_compiler_is_never_told_the_real_memory_size(gpu_compiler: None, tmp_path: Path) -> None:
    # A card of 400 MiB: XLA rematerialises this program to fit it, and its figure would come out smaller than the
    # program that runs without recomputing; autoaccum compiles against COMPILE_MEMORY_BYTES and applies the budget.
    small = describe("H100").with_memory(400 * 2**20)
    shapes = ((8192,), (2048,), (2048, 2048))
    squeezed = _peak(_compile(small, recomputable, *shapes)[1])
    honest = _peak(_compile(describe("H100").with_memory(COMPILE_MEMORY_BYTES), recomputable, *shapes)[1])
    assert squeezed < honest  # the trap is real
    card = tmp_path / "card.txtpb"
    card.write_text(small)
    devices = gpu_mesh(card).devices.ravel()
    mesh = jax.sharding.Mesh(devices, ("data",))
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in shapes]
    assert _peak(jax.jit(recomputable).lower(*args).compile(compiler_options=dict(GPU_COMPILER_OPTIONS))) == honest


# -- without the extra, and bad targets ----------------------------------------------------------------------------


def test_a_missing_extra_gives_the_labelled_cpu_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gpu_compile, "_installed_plugin", lambda: None)
    assert compiler_status() == (
        f'XLA\'s GPU compiler is not installed (the gpu-plan extra): pip install "jax-cuda12-plugin=={jax.__version__}"'
    )
    w = workloads.linear()
    est = autoaccum.estimate(w.loss_fn, w.params, w.batch, optimizer=w.optimizer, target="A100", accumulation=False)
    assert est.compiler == "XLA:CPU (proxy)" and est.platform == "cpu" and est.target == "A100-40GB"
    assert est.capacity(64, "A100").compiler == "XLA:CPU (proxy)"
    result = CliRunner().invoke(main, ["plan", "autoaccum.workloads:linear", "--gpu", "A100", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["targets"][0]["compiler"] == "XLA:CPU (proxy)"
    assert data["gpu_compiler"].startswith("XLA's GPU compiler is not installed")


def test_a_plugin_of_another_version_says_which_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_gpu_compile, "_installed_plugin", lambda: ("jax-cuda12-plugin", "0.0.1"))
    assert compiler_status() == (
        f"jax-cuda12-plugin 0.0.1 does not match jax {jax.__version__}: "
        f'pip install "jax-cuda12-plugin=={jax.__version__}"'
    )


def test_an_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(UnknownAcceleratorError, match=r"Known: H100-80GB, H100-PCIe, H200, A100-40GB") as e:
        autoaccum.estimate(
            lambda w, b: jnp.mean(b @ w), jnp.ones(3), jnp.ones((4, 3)), optimizer=optax.sgd(0.1), target="B300"
        )
    assert all(name in str(e.value) for name in known_targets())
    with pytest.raises(UnknownAcceleratorError, match="no GPU target description for `target`='TPU-v5e'"):
        describe("TPU-v5e")


def test_every_description_matches_the_catalog() -> None:
    from autoaccum._catalog import lookup

    for name in known_targets():
        d = describe(name)
        assert d.memory_bytes == lookup(name).memory_bytes, name
        assert d.arch.startswith("sm_") and d.core_count > 0
    assert describe("H100").arch == "sm_90" and describe("A100-40GB").arch == "sm_80" and describe("L4").arch == "sm_89"


# -- the command line ------------------------------------------------------------------------------------------------


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["plan", *args])


def test_plan_compiles_each_gpu_target(gpu_compiler: None) -> None:
    result = run(
        "autoaccum.workloads:linear", "--gpu", "H100", "--gpu", "A100-40GB", "--memory-limit", "1GiB", "--json"
    )
    assert result.exit_code == 0, result.output
    h100, a100, budget = json.loads(result.stdout)["targets"]
    assert h100["compiler"] == "XLA:GPU sm_90 (compile-only)" and a100["compiler"] == "XLA:GPU sm_80 (compile-only)"
    assert budget["compiler"] == "XLA:CPU"
    assert h100["step_seconds"] > 0 and h100["flops"] > 0
    # the targets compile at once, each to the figures of its own estimate made alone
    w = workloads.linear()
    for row, name in ((h100, "H100"), (a100, "A100-40GB")):
        target = autoaccum.Target.gpu(name)
        alone = autoaccum.estimate(
            w.loss_fn, w.params, w.batch, optimizer=w.optimizer, memory_limit=target.memory_limit_bytes,
            refine_for=[target.memory_limit_bytes], effective_batch=w.batch_size, target=name,
        ).capacity(w.batch_size, target)  # fmt: skip
        assert row == {**alone.to_dict(), "accelerator": target.accelerator}


def test_a_target_xla_cannot_compile_for_is_shown_and_the_others_planned(
    gpu_compiler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autoaccum import _estimate

    real = _estimate.estimate

    def estimate(*args, target=None, **kwargs):  # type: ignore[no-untyped-def]
        if target == "L4":
            raise jax.errors.JaxRuntimeError("INTERNAL: Couldn't find output tile sizes")
        return real(*args, target=target, **kwargs)

    monkeypatch.setattr(_estimate, "estimate", estimate)
    result = run("autoaccum.workloads:linear", "--gpu", "H100", "--gpu", "L4")
    assert result.exit_code == 0, result.output
    assert "L4: not planned" in result.output and "Couldn't find output tile sizes" in result.output
    assert "XLA:GPU sm_90 (compile-only)" in result.output


def test_no_driver_lines_on_the_terminal(gpu_compiler: None) -> None:
    """Without an NVIDIA driver the CUDA plugin's C++ prints absl's preamble and "Could not find cuda drivers"
    on file descriptor 2 (at ``import jax`` and when its compiler loads); ``autoaccum plan`` shows neither."""
    import subprocess
    import sys

    command = "from autoaccum.cli import main; main()"
    args = ["plan", "autoaccum.workloads:linear", "--gpu", "H100"]
    done = subprocess.run([sys.executable, "-c", command, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "XLA:GPU sm_90 (compile-only)" in done.stdout
    if not Path("/proc/driver/nvidia").exists():
        assert "absl" not in done.stderr + done.stdout and "cuda drivers" not in done.stderr + done.stdout


# -- a real card's description (`autoaccum devices --target-config`) ------------------------------------------------

REAL_H100 = Path(__file__).parent / "data" / "h100_topology.bin"
"""An NVIDIA H100 80GB HBM3's device topology as XLA serialized it on the card (jax 0.11.2, CUDA 13, driver
580.159.04: ``jax._src.lib._jax.get_topology_for_devices(jax.devices()).serialize()``), captured on a lent GPU."""


def test_a_real_cards_topology_reads_as_a_target_description(tmp_path: Path) -> None:
    text = target_config_text(REAL_H100.read_bytes())
    # XLA's figures for the card, as its driver reported them (proto3 text leaves out minor: 0)
    assert "  core_count: 132\n" in text and "  cuda_compute_capability { major: 9 }\n" in text
    assert "  device_memory_size: 85017493504\n" in text and "  l2_cache_size: 52428800\n" in text
    assert '  name: "NVIDIA H100 80GB HBM3"\n' in text and 'platform_name: "CUDA"\n' in text
    assert "dnn_version_info { major: 9 minor: 19 patch: 0 }\n" in text  # from the card's "9.19.0"
    path = tmp_path / "my_h100.txtpb"
    path.write_text(text)
    d = describe(path)
    assert (d.name, d.compute_capability, d.core_count, d.memory_bytes) == ("my_h100", (9, 0), 132, 85017493504)
    # ours, written from NVIDIA's documents, agrees with the card on what the compiler is told
    ours = describe("H100")
    assert (ours.compute_capability, ours.core_count) == (d.compute_capability, d.core_count)


@pytest.mark.parametrize("cut", [3, 100, 500])
def test_a_truncated_topology_is_refused(cut: int) -> None:
    with pytest.raises(TargetConfigError):
        target_config_text(REAL_H100.read_bytes()[:cut])


def test_a_real_cards_description_compiles_like_ours(gpu_compiler: None, tmp_path: Path) -> None:
    path = tmp_path / "my_h100.txtpb"
    path.write_text(target_config_text(REAL_H100.read_bytes()))
    w = workloads.mlp()
    kw = dict(optimizer=w.optimizer, memory_limit="2GiB", accumulation=False)
    real = autoaccum.estimate(w.loss_fn, w.params, w.batch, target=path, **kw)
    ours = autoaccum.estimate(w.loss_fn, w.params, w.batch, target="H100", **kw)
    assert real.compiler == ours.compiler == "XLA:GPU sm_90 (compile-only)"
    # the same step for the same architecture: the same buffers (the memory size is raised for both)
    assert real.bytes_at(1024) == pytest.approx(ours.bytes_at(1024), rel=0.01)


def test_target_config_without_a_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda(platform: str | None = None) -> list:  # type: ignore[type-arg]
        if platform == "cuda":
            raise RuntimeError("Unknown backend cuda")
        return [jax.local_devices(backend="cpu")[0]]

    monkeypatch.setattr(jax, "devices", no_cuda)
    result = CliRunner().invoke(main, ["devices", "--target-config"])
    assert result.exit_code == 1
    assert "no NVIDIA GPU here (jax sees: cpu)" in result.output and "H100-80GB" in result.output


@pytest.mark.gpu
def test_target_config_on_a_gpu_describes_the_card(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["devices", "--target-config"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "card.txtpb"
    path.write_text(result.stdout)
    d = describe(path)
    card = jax.devices("cuda")[0]
    assert d.compute_capability == tuple(int(v) for v in card.compute_capability.split("."))
    assert d.core_count == card.core_count


def test_plan_compiles_for_a_cards_own_description_file(gpu_compiler: None, tmp_path: Path) -> None:
    path = tmp_path / "my_h100.txtpb"
    path.write_text(target_config_text(REAL_H100.read_bytes()))
    result = run("autoaccum.workloads:linear", "--gpu", str(path), "--gpu", "H100", "--json")
    assert result.exit_code == 0, result.output
    mine, h100 = json.loads(result.stdout)["targets"]
    assert mine["target"] == "my_h100" and mine["compiler"] == h100["compiler"] == "XLA:GPU sm_90 (compile-only)"
    # the GPU policy on the card's own memory size (85,017,493,504 B as its driver says; ours: 80 GiB)
    assert mine["memory_limit_bytes"] == int(85017493504 * (0.75 - 0.05))
    assert mine["step_seconds"] is None and h100["step_seconds"] > 0  # a file holds no FLOP rates


@pytest.mark.slow
def test_plan_demo_plans_each_model(gpu_compiler: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``autoaccum plan --demo``'s path, with its model shrunk (the real one, GPT-2 small at sequence 1024, takes
    minutes to compile on a CPU; here a tiny one) and one card, compiled for the card."""
    tiny = workloads.sized_transformer("tiny", vocab=64, dim=16, heads=2, layers=1, seq_len=8, batch_size=64)
    monkeypatch.setattr(workloads, "planning_demos", lambda large=False: (tiny,))
    result = run("--demo", "--gpu", "H100")
    assert result.exit_code == 0, result.output
    assert "workload tiny" in result.output and "XLA:GPU sm_90 (compile-only)" in result.output


def test_gpu_bytes_reads_one_microbatch_per_program(gpu_compiler: None) -> None:
    """``benchmarks/gpu_bytes.py`` at the kit's tiny preset: the scan's one program and each of the loop's are one
    microbatch's work (XLA's cost analysis counts a ``while`` body once), so their FLOPs agree within the optimizer
    step's share, not 4x apart (k = 4)."""
    from helpers import load_benchmark

    module = load_benchmark("gpu_bytes")
    rows = module.measure("H200", module.kit.PRESETS["tiny"])
    scan = [r for r in rows if r["strategy"] == "scan"]
    loop = [r for r in rows if r["strategy"] == "loop"]
    assert len(scan) == 1 and len(loop) >= 2
    assert all(r["flops"] > 0 and r["bytes_accessed"] > 0 for r in rows)
    most = max(r["flops"] for r in loop)
    assert most / 2 < scan[0]["flops"] < 2 * most, (scan, loop)
