"""A catalog of common accelerators: memory, peak FLOP/s and bandwidth from the vendors' datasheets.

Plan runs for hardware you do not have: `lookup` finds an accelerator by name (``"A100-40GB"``,
``"a100_40gb"``, ``"H100"``), and `Accelerator.memory_limit_bytes` says how much of its memory a JAX program can
count on.

Usable memory. On a GPU, JAX's XLA client preallocates ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the card's
memory when the first array is placed (0.75 by default) and serves every buffer from that pool, so a step
has about 75% of the card, not all of it. You can change this before starting Python:
``XLA_PYTHON_CLIENT_MEM_FRACTION=.95`` raises the fraction, ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` grows
the pool on demand instead (up to the whole card, at the price of fragmentation); pass the fraction you use
as ``mem_fraction`` (``--mem-fraction`` on the command line). TPUs have no such pool (``mem_fraction``
defaults to 1.0 there). On top of that a ``safety_margin`` (5% of the card by default) is kept free for
what the compiler's accounting leaves out: the CUDA context and cuDNN/cuBLAS workspaces, allocator
fragmentation, the driver's reserved memory (the card shows a little less than its nominal size, e.g. an
H100 80GB SXM reports 81,559 MiB of 81,920 MiB).

Figures. ``memory_bytes`` is the datasheet's capacity read in GiB (HBM and GDDR parts are binary-sized);
``bf16_flops`` is the peak *dense* bfloat16 tensor-core rate with float32 accumulation (datasheets print
the rate "with sparsity", twice the dense one; the dense one is used here), ``fp32_flops`` the peak
non-tensor float32 rate, ``tf32_flops`` the dense TF32 tensor rate (Ampere and later: what JAX's default precision
runs float32 matmuls at), ``bandwidth`` the peak memory bandwidth in bytes/s. Every entry cites its source.

Example:
  >>> from autoaccum._catalog import lookup
  >>> a100 = lookup("a100_40gb")
  >>> a100.name, a100.memory_bytes // 2**30
  ('A100-40GB', 40)
  >>> round(a100.memory_limit_bytes() / 2**30, 1)  # 40 GiB * 0.75 - 5% of 40 GiB
  28.0
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re

GiB = 2**30
TERA = 1e12
GIGA = 1e9

DEFAULT_GPU_MEM_FRACTION = 0.75
"""The fraction of a GPU that JAX preallocates by default (``XLA_PYTHON_CLIENT_MEM_FRACTION``)."""

DEFAULT_SAFETY_MARGIN = 0.05
"""The fraction of the card's memory kept free by default for what XLA's accounting leaves out."""


def usable_bytes(
    memory_bytes: int,
    default_fraction: float = DEFAULT_GPU_MEM_FRACTION,
    mem_fraction: float | None = None,
    safety_margin: float = DEFAULT_SAFETY_MARGIN,
) -> int:
    """The bytes one JAX program can count on of ``memory_bytes``: ``memory * mem_fraction - memory *
    safety_margin`` (``mem_fraction`` None: ``default_fraction``, the platform's).

    Example:
      >>> usable_bytes(80 * 2**30) / 2**30  # a GPU's 0.75 share less the 0.05 margin
      56.0
    """
    fraction = default_fraction if mem_fraction is None else mem_fraction
    check_fraction(fraction, "mem_fraction", lo_open=True)
    check_fraction(safety_margin, "safety_margin")
    if safety_margin >= fraction:
        raise ValueError(
            f"`safety_margin`={safety_margin} leaves nothing of `mem_fraction`={fraction}; "
            "use a margin smaller than the fraction."
        )
    return int(memory_bytes * (fraction - safety_margin))


class Platform(enum.Enum):
    """The kind of accelerator, which decides the framework's default memory reservation."""

    GPU = "gpu"
    TPU = "tpu"

    @property
    def default_mem_fraction(self) -> float:
        """The fraction of the device's memory JAX lets a program use by default."""
        return DEFAULT_GPU_MEM_FRACTION if self is Platform.GPU else 1.0


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator (one GPU, or one TPU chip) and its datasheet figures.

    Attributes:
      name: the canonical name, e.g. ``"A100-40GB"``.
      platform: `Platform.GPU` or `Platform.TPU`.
      memory_bytes: the datasheet's memory capacity, in bytes.
      bf16_flops: peak dense bfloat16 FLOP/s (tensor cores / MXUs; for the T4, which has no bfloat16,
        its float16 rate).
      fp32_flops: peak float32 FLOP/s (``None`` where the vendor publishes none: TPUs, whose float32
        matmuls JAX computes in one bfloat16 pass by default, so the bf16 peak is used instead).
      bandwidth: peak memory bandwidth, bytes/s.
      source: where the figures come from (document name and URL).
      aliases: other names it is known by (matched after normalising case and punctuation).
      interconnect: the device-to-device bandwidth, bytes/s, both directions together as datasheets print it
        (NVLink, TPU ICI; PCIe for cards without NVLink); gradients are reduced over it on several devices.
      tf32_flops: peak dense TF32 tensor FLOP/s (Ampere and later; None before): JAX's default precision runs
        float32 matmuls on a GPU in TF32 where the card has it.
    """

    name: str
    platform: Platform
    memory_bytes: int
    bf16_flops: float
    fp32_flops: float | None
    bandwidth: float
    source: str
    aliases: tuple[str, ...] = ()
    interconnect: float | None = None
    tf32_flops: float | None = None

    def __post_init__(self) -> None:
        for field in ("memory_bytes", "bf16_flops", "bandwidth"):
            if not getattr(self, field) > 0:
                raise ValueError(f"`Accelerator.{field}` must be positive, got {field}={getattr(self, field)!r}.")

    def memory_limit_bytes(
        self, mem_fraction: float | None = None, safety_margin: float = DEFAULT_SAFETY_MARGIN
    ) -> int:
        """The bytes one JAX program can count on: ``memory * mem_fraction - memory * safety_margin``.

        Args:
          mem_fraction: the fraction JAX reserves for programs; ``None`` means the platform's default
            (0.75 on a GPU, as ``XLA_PYTHON_CLIENT_MEM_FRACTION``; 1.0 on a TPU).
          safety_margin: the fraction of the whole memory kept free on top (0.05 by default).

        Example:
          >>> lookup("H100").memory_limit_bytes(mem_fraction=0.95, safety_margin=0.0) // 2**30
          76
        """
        return usable_bytes(self.memory_bytes, self.platform.default_mem_fraction, mem_fraction, safety_margin)

    def peak_flops(self, dtype_name: str) -> float:
        """Peak FLOP/s for arithmetic in ``dtype_name`` at JAX's default precision: the bf16 rate for 16-bit floats;
        for float32 the TF32 rate where the card has one, else the fp32 rate (a TPU's: the bf16 rate).

        Example:
          >>> lookup("A100").peak_flops("float32") / 1e12, lookup("T4").peak_flops("float32") / 1e12
          (156.0, 8.1)
        """
        if dtype_name in ("bfloat16", "float16") or self.fp32_flops is None:
            return self.bf16_flops
        return self.fp32_flops if self.tf32_flops is None else self.tf32_flops


def check_fraction(value: float, name: str, *, lo_open: bool = False) -> float:
    """``value`` if it is a number in [0, 1] (in (0, 1] with ``lo_open``), else a ValueError naming ``name``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (0 < value <= 1 if lo_open else 0 <= value <= 1)
    if not ok:
        bounds = "(0, 1]" if lo_open else "[0, 1]"
        raise ValueError(f"`{name}` must be a fraction in {bounds}, got {name}={value!r}.")
    return float(value)


_NVIDIA_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM figures), "
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_NVIDIA_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-tensor-core/"
    "nvidia-tensor-core-gpu-datasheet"
)

ACCELERATORS: tuple[Accelerator, ...] = (
    # NVIDIA T4 Tensor Core GPU datasheet (WP-09640):
    # https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf
    # 16 GB GDDR6, 320 GB/s, 8.1 TFLOPS FP32, 65 TFLOPS mixed-precision FP16/FP32 (Turing has no bf16).
    Accelerator(
        "T4", Platform.GPU, 16 * GiB, 65 * TERA, 8.1 * TERA, 320 * GIGA,
        "NVIDIA T4 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
        "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf (no bf16: the fp16 tensor rate is used)",
        ("tesla-t4", "t4-16gb"),
        interconnect=32 * GIGA,  # PCIe Gen3 x16: 32 GB/s (T4 datasheet)
    ),
    # NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s, 30.3 TFLOPS FP32,
    # 242 TFLOPS BF16 "with sparsity" -> 121 dense.
    Accelerator(
        "L4", Platform.GPU, 24 * GiB, 121 * TERA, 30.3 * TERA, 300 * GIGA,
        "NVIDIA L4 Tensor Core GPU datasheet, https://resources.nvidia.com/en-us-data-center-overview/"
        "l4-gpu-datasheet",
        ("l4-24gb",),
        interconnect=64 * GIGA,  # PCIe Gen4 x16: 64 GB/s (L4 datasheet)
        tf32_flops=60 * TERA,  # TF32 120 TFLOPS "with sparsity" -> 60 dense (L4 datasheet)
    ),
    # NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s, 31.2 TFLOPS FP32,
    # BF16 125 | 250 TFLOPS (dense | sparse).
    Accelerator(
        "A10", Platform.GPU, 24 * GiB, 125 * TERA, 31.2 * TERA, 600 * GIGA,
        "NVIDIA A10 Tensor Core GPU datasheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
        "Data-Center/a10/pdf/a10-datasheet.pdf",
        ("a10-24gb", "a10g"),
        interconnect=64 * GIGA,  # PCIe Gen4: 64 GB/s (A10 datasheet)
        tf32_flops=62.5 * TERA,  # TF32 62.5 | 125 TFLOPS (dense | sparse) (A10 datasheet)
    ),
    # NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A, GeForce RTX 4090: 24 GB GDDR6X,
    # 1008 GB/s, 82.6 TFLOPS FP32, 165.2 TFLOPS BF16 tensor with FP32 accumulate (330.4 with sparsity).
    Accelerator(
        "RTX-4090", Platform.GPU, 24 * GiB, 165.2 * TERA, 82.6 * TERA, 1008 * GIGA,
        "NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A, https://images.nvidia.com/aem-dam/"
        "Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf",
        ("4090", "geforce-rtx-4090"),
        interconnect=64 * GIGA,  # no NVLink; PCIe 4.0 x16: 64 GB/s both directions (PCI-SIG PCIe 4.0)
        tf32_flops=82.6 * TERA,  # TF32 tensor 82.6 TFLOPS (165.2 with sparsity) (Ada whitepaper, Appendix A)
    ),
    # NVIDIA A100 datasheet: 40 GB HBM2 at 1,555 GB/s; 80 GB HBM2e at 2,039 GB/s (SXM; PCIe 1,935 GB/s);
    # 19.5 TFLOPS FP32; BF16 312 | 624 TFLOPS (dense | sparse).
    Accelerator(
        "A100-40GB", Platform.GPU, 40 * GiB, 312 * TERA, 19.5 * TERA, 1555 * GIGA, _NVIDIA_A100,
        ("a100", "a100-sxm4-40gb", "a100-pcie-40gb"),
        interconnect=600 * GIGA,  # NVLink: 600 GB/s (A100 datasheet, SXM)
        tf32_flops=156 * TERA,  # TF32 156 | 312 TFLOPS (dense | sparse) (A100 datasheet)
    ),
    Accelerator(
        "A100-80GB", Platform.GPU, 80 * GiB, 312 * TERA, 19.5 * TERA, 2039 * GIGA, _NVIDIA_A100,
        ("a100-sxm4-80gb",),
        interconnect=600 * GIGA,  # NVLink: 600 GB/s (A100 datasheet, SXM)
        tf32_flops=156 * TERA,
    ),
    # NVIDIA H100 datasheet, H100 SXM: 80 GB HBM3, 3.35 TB/s, 67 TFLOPS FP32,
    # BF16 1,979 TFLOPS "with sparsity" -> 989.5 dense. H100 PCIe: 80 GB, 2 TB/s, 51 TFLOPS FP32, 1,513 -> 756.5.
    Accelerator(
        "H100-80GB", Platform.GPU, 80 * GiB, 989.5 * TERA, 67 * TERA, 3350 * GIGA, _NVIDIA_H100,
        ("h100", "h100-sxm", "h100-sxm5-80gb", "h100-80gb-hbm3"),
        interconnect=900 * GIGA,  # NVLink: 900 GB/s (H100 datasheet, SXM)
        tf32_flops=494.7 * TERA,  # TF32 989 TFLOPS "with sparsity" -> 494.7 dense (H100 datasheet, SXM)
    ),
    Accelerator(
        "H100-PCIe", Platform.GPU, 80 * GiB, 756.5 * TERA, 51 * TERA, 2000 * GIGA, _NVIDIA_H100,
        ("h100-pcie-80gb",),
        interconnect=600 * GIGA,  # NVLink bridge: 600 GB/s (H100 datasheet, PCIe)
        tf32_flops=378 * TERA,  # TF32 756 TFLOPS "with sparsity" -> 378 dense (H100 datasheet, PCIe)
    ),
    # NVIDIA H200 Tensor Core GPU product page / datasheet, H200 SXM: 141 GB HBM3e, 4.8 TB/s,
    # 67 TFLOPS FP32, BF16 1,979 TFLOPS "with sparsity" -> 989.5 dense.
    Accelerator(
        "H200", Platform.GPU, 141 * GiB, 989.5 * TERA, 67 * TERA, 4800 * GIGA,
        "NVIDIA H200 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/",
        ("h200-141gb", "h200-sxm"),
        interconnect=900 * GIGA,  # NVLink: 900 GB/s (H200 datasheet, SXM)
        tf32_flops=494.7 * TERA,  # TF32 989 TFLOPS "with sparsity" -> 494.7 dense (H200 datasheet)
    ),
    # Google Cloud TPU documentation, "TPU v4": per chip 275 TFLOPS bf16, 32 GiB HBM2 at 1,200 GB/s.
    Accelerator(
        "TPU-v4", Platform.TPU, 32 * GiB, 275 * TERA, None, 1200 * GIGA,
        "Google Cloud TPU documentation, TPU v4, https://cloud.google.com/tpu/docs/v4",
        ("v4",),
        interconnect=300 * GIGA,  # ICI: 2,400 Gbps per chip (TPU v4 documentation)
    ),
    # "TPU v5e": per chip 197 TFLOPS bf16, 16 GB HBM2 at 819 GB/s.
    Accelerator(
        "TPU-v5e", Platform.TPU, 16 * GiB, 197 * TERA, None, 819 * GIGA,
        "Google Cloud TPU documentation, TPU v5e, https://cloud.google.com/tpu/docs/v5e",
        ("v5e", "v5-lite", "v5litepod"),
        interconnect=200 * GIGA,  # ICI: 1,600 Gbps per chip (TPU v5e documentation)
    ),
    # "TPU v5p": per chip 459 TFLOPS bf16, 95 GB HBM2e at 2,765 GB/s.
    Accelerator(
        "TPU-v5p", Platform.TPU, 95 * GiB, 459 * TERA, None, 2765 * GIGA,
        "Google Cloud TPU documentation, TPU v5p, https://cloud.google.com/tpu/docs/v5p",
        ("v5p",),
        interconnect=600 * GIGA,  # ICI: 4,800 Gbps per chip (TPU v5p documentation)
    ),
    # "TPU v6e" (Trillium): per chip 918 TFLOPS bf16, 32 GB HBM at 1,640 GB/s.
    Accelerator(
        "TPU-v6e", Platform.TPU, 32 * GiB, 918 * TERA, None, 1640 * GIGA,
        "Google Cloud TPU documentation, TPU v6e, https://cloud.google.com/tpu/docs/v6e",
        ("v6e", "trillium"),
        interconnect=400 * GIGA,  # ICI: 3,200 Gbps per chip (TPU v6e documentation)
    ),
)  # fmt: skip


def _key(name: str) -> str:
    """``name`` lower-cased with every run of non-alphanumerics dropped: ``"A100_40 GB"`` -> ``"a10040gb"``."""
    return re.sub(r"[^a-z0-9]+", "", name.lower())


_BY_KEY: dict[str, Accelerator] = {}
for _acc in ACCELERATORS:
    for _name in (_acc.name, *_acc.aliases):
        assert _key(_name) not in _BY_KEY, f"duplicate catalog name {_name!r}"
        _BY_KEY[_key(_name)] = _acc


def names() -> tuple[str, ...]:
    """The canonical names in the catalog, in catalog order.

    Example:
      >>> "L4" in names()
      True
    """
    return tuple(a.name for a in ACCELERATORS)


class UnknownAcceleratorError(ValueError):
    """An accelerator name the catalog does not know (a ``ValueError``; the message lists the known ones)."""


def suggest(name: str) -> str | None:
    """The catalog name closest to ``name``, or ``None`` when nothing is close.

    Example:
      >>> suggest("A100-40")
      'A100-40GB'
    """
    matches = difflib.get_close_matches(_key(name), list(_BY_KEY), n=1, cutoff=0.5)
    return _BY_KEY[matches[0]].name if matches else None


def entry_for(kind: str) -> str | None:
    """The catalog's name for a device as JAX or NVML names it (``"NVIDIA H100 80GB HBM3"`` -> ``"H100-80GB"``: its
    name or an alias, the vendor's name aside), None where it is not catalogued (no guess: "cpu" is no TPU).

    Example:
      >>> entry_for("NVIDIA H100 80GB HBM3"), entry_for("NVIDIA L4"), entry_for("AMD EPYC 7B13 (2 cores)")
      ('H100-80GB', 'L4', None)
    """
    bare = re.sub(r"^(nvidia|google)\s+", "", kind.strip(), flags=re.IGNORECASE)  # (the vendor's name first)
    found = _BY_KEY.get(_key(kind)) or _BY_KEY.get(_key(bare))
    return None if found is None else found.name


def lookup(name: str) -> Accelerator:
    """The accelerator called ``name`` (its canonical name or an alias; case and punctuation are ignored).

    Raises:
      UnknownAcceleratorError: ``name`` is not in the catalog; the message lists the known names and
        suggests the closest.

    Example:
      >>> lookup("h100").name
      'H100-80GB'
    """
    if not isinstance(name, str):
        raise TypeError(f"`gpu` must be a name such as 'A100-40GB', got {type(name).__name__} {name!r}.")
    found = _BY_KEY.get(_key(name))
    if found is not None:
        return found
    close = suggest(name)
    hint = f" Did you mean {close!r}?" if close else ""
    raise UnknownAcceleratorError(
        f"unknown accelerator `gpu`={name!r}.{hint} Known: {', '.join(names())} "
        "(or give a memory size instead: '24GiB', on the command line --memory-limit 24GiB)."
    )
