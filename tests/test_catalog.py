"""The accelerator catalog: names and aliases, datasheet figures with sources, usable memory, suggestions."""

from __future__ import annotations

import pytest

from autoaccum import _catalog as catalog
from autoaccum._catalog import ACCELERATORS, GiB, Platform, UnknownAcceleratorError, lookup, names, suggest


def test_the_catalog_covers_the_common_accelerators() -> None:
    required = {"T4", "L4", "A10", "RTX-4090", "A100-40GB", "A100-80GB", "H100-80GB", "H200"}
    assert required <= set(names())
    assert sum(a.platform is Platform.TPU for a in ACCELERATORS) >= 3


@pytest.mark.parametrize("accelerator", ACCELERATORS, ids=lambda a: a.name)
def test_every_entry_has_sane_figures_and_cites_its_source(accelerator: catalog.Accelerator) -> None:
    a = accelerator
    assert 8 * GiB <= a.memory_bytes <= 192 * GiB
    assert 10e12 <= a.bf16_flops <= 2e15 and 100e9 <= a.bandwidth <= 10e12
    assert a.fp32_flops is None or 1e12 <= a.fp32_flops <= a.bf16_flops
    assert a.tf32_flops is None or (a.fp32_flops is not None and a.fp32_flops <= a.tf32_flops <= a.bf16_flops)
    assert "https://" in a.source, a.source
    assert lookup(a.name) is a and all(lookup(alias) is a for alias in a.aliases)


@pytest.mark.parametrize(
    ("name", "expected"),
    [("A100-40GB", "A100-40GB"), ("a100_40gb", "A100-40GB"), ("A100 40GB", "A100-40GB"), ("a100", "A100-40GB"),
     ("H100", "H100-80GB"), ("h100-sxm", "H100-80GB"), ("rtx4090", "RTX-4090"), ("4090", "RTX-4090"),
     ("tpu v5e", "TPU-v5e"), ("l4", "L4")],
)  # fmt: skip
def test_lookup_ignores_case_and_punctuation(name: str, expected: str) -> None:
    assert lookup(name).name == expected


def test_usable_memory_takes_the_reservation_and_the_margin_off() -> None:
    a100 = lookup("A100-40GB")
    assert a100.memory_limit_bytes() == int(40 * GiB * (0.75 - 0.05))
    assert a100.memory_limit_bytes(mem_fraction=0.9, safety_margin=0.0) == int(40 * GiB * 0.9)
    tpu = lookup("TPU-v4")  # no preallocated pool on a TPU: the fraction defaults to 1
    assert tpu.memory_limit_bytes() == int(32 * GiB * 0.95)
    with pytest.raises(ValueError, match=r"`mem_fraction` must be a fraction in \(0, 1\], got mem_fraction=1.5"):
        a100.memory_limit_bytes(mem_fraction=1.5)
    with pytest.raises(ValueError, match=r"`safety_margin`=0\.8 leaves nothing"):
        a100.memory_limit_bytes(safety_margin=0.8)


def test_peak_flops_follow_the_dtype() -> None:
    a100 = lookup("A100-40GB")
    # float32 at JAX's default precision: TF32 where the card has it (Ampere and later), else the fp32 rate
    assert a100.peak_flops("bfloat16") == 312e12 and a100.peak_flops("float32") == 156e12
    assert lookup("T4").peak_flops("float32") == 8.1e12  # (Turing: no TF32)
    assert lookup("TPU-v5e").peak_flops("float32") == lookup("TPU-v5e").bf16_flops  # none published for fp32


def test_an_unknown_name_lists_the_known_ones_and_suggests_the_closest() -> None:
    assert suggest("A100-40") == "A100-40GB" and suggest("H20") in ("H200", "H100-80GB")
    with pytest.raises(UnknownAcceleratorError, match="Did you mean 'A100-40GB'") as info:
        lookup("A100-40")
    assert isinstance(info.value, ValueError)
    assert all(n in str(info.value) for n in names())
    with pytest.raises(UnknownAcceleratorError) as info:
        lookup("zzzz")
    assert "Did you mean" not in str(info.value)
    with pytest.raises(TypeError, match="`gpu` must be a name"):
        lookup(40)  # type: ignore[arg-type]
