#!/usr/bin/env bash
# Downloads, here, the wheels the lent GPU machine lacks for benchmarks/gpu.py: optuna and, of what it needs
# (recursively), whatever that machine does not hold; for CPython 3.12 on x86-64 (the machine's python3).
#
#   benchmarks/gpu-wheels.sh [DEST]      # DEST: .whl at the checkout's root (git-ignored), the device tool's folder
#
# Each wheel is the version installed here when this checkout's environment has it (what the tests ran with) and
# the requirement allows it, else the newest pip finds; one version of each is kept (two stop the whole install).
# It also builds this checkout's own wheel (rebuild after every change to autoaccum/). There, with `.whl` carried,
# the first command of a call installs them all:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site || exit;
#
# benchmarks/README.md ("GPU evidence") gives every command in order. Exit status: 0 when every wheel was saved.
set -euo pipefail

root=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
dest=${1:-$root/.whl}
python=${PYTHON:-python3}
mkdir -p "$dest"

# The machine's Python packages (the device tool's KINDS.md, "Python packages already there", read 2026-11-17):
# a requirement named here is not fetched.
present="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"

ROOT="$root" PRESENT="$present" DEST="$dest" "$python" - <<'EOF'
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]
THERE = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
         "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
         "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


present = {norm(n) for n in os.environ["PRESENT"].split()}
dest = Path(os.environ["DEST"])


def wheels_of(name):
    return [p for p in dest.glob("*.whl") if norm(p.name.split("-")[0]) == norm(name)]


def download(req):
    """Saves one wheel of ``req`` in dest (the version installed here when ``req`` allows it); returns its path."""
    try:
        mine = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        mine = None
    pin = f"{req.name}=={mine}" if mine and req.specifier.contains(Version(mine), prereleases=True) else str(req)
    for old in wheels_of(req.name):  # one version of each: two stop `pip install --no-index` there
        old.unlink()
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), pin]
    for platform in PLATFORMS:
        command[6:6] = ["--platform", platform]
    subprocess.run(command, check=True)
    (saved,) = wheels_of(req.name)
    return saved


def needs(wheel):
    """The requirements in a wheel's METADATA that apply on that machine (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(THERE):
                out.append(req)
    return out


queue, seen = [Requirement("optuna")], set()
while queue:
    req = queue.pop(0)
    if norm(req.name) in seen or norm(req.name) in present:
        continue
    seen.add(norm(req.name))
    wheel = download(req)
    print(f"{wheel.name}  ({wheel.stat().st_size / 2**20:.1f} MiB)")
    queue += needs(wheel)
for old in wheels_of("autoaccum"):
    old.unlink()
subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dest), os.environ["ROOT"]], check=True)
print(f"{wheels_of('autoaccum')[0].name}  (this checkout, built here: no build backend is needed there)")
total = sum(p.stat().st_size for p in dest.glob("*.whl"))
print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}, {total / 2**20:.1f} MiB (a call carries at most 64 MiB)")
EOF
