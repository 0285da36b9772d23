"""A real GPU's target description, read from XLA on a machine with the GPU (``autoaccum devices --target-config``).

XLA describes each GPU it runs on as a ``GpuTargetConfigProto`` (compute capability, SMs, memory, shared memory,
L2, clocks, driver and library versions): what its compiler needs to compile for the card without it. jax does
not hand it out as text, but the topology of the devices (``jax._src.lib._jax.get_topology_for_devices``)
serializes to a ``PjRtTopologyDescriptionProto`` that carries it: `target_config_text` finds it there and writes
it in protobuf text format, the format of the descriptions in ``autoaccum/targets/``, which `estimate`'s and
``autoaccum plan``'s ``target`` accept as a path. Protobuf's own library is not a dependency: the wire format is
read here, for the fields of XLA's ``xla/stream_executor/device_description.proto``; fields not listed there
(XLA's execution-unit tables, its autotuning results) are left out, so the compiler uses its defaults for them.

Example:
  >>> text = target_config_text(
  ...     b"J\\x1b\\n\\x05x/Any\\x12\\x12B\\x10\\n\\n0\\x84\\x01\\x82\\x01\\x04\\x08\\t\\x10\\x00\\"\\x02ab"
  ... )
  >>> print(text)
  gpu_device_info {
    core_count: 132
    cuda_compute_capability { major: 9 minor: 0 }
  }
  platform_name: "ab"
  <BLANKLINE>
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Sequence
from typing import Any

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5

# Field numbers and names of the messages written out (XLA's device_description.proto); a name ending in "{}"
# is a message of the schema named after it, ``float`` a 32-bit float, ``str`` a string, else an integer.
_SCHEMAS: dict[str, dict[int, tuple[str, str]]] = {
    "GpuTargetConfigProto": {
        1: ("gpu_device_info", "GpuDeviceInfoProto"),
        4: ("platform_name", "str"),
        5: ("dnn_version_info", "VersionProto"),
        8: ("runtime_version", "VersionProto"),
        7: ("device_description_str", "str"),
    },
    "GpuDeviceInfoProto": {
        1: ("threads_per_block_limit", "int"),
        2: ("threads_per_warp", "int"),
        3: ("shared_memory_per_block", "int"),
        4: ("shared_memory_per_core", "int"),
        5: ("threads_per_core_limit", "int"),
        6: ("core_count", "int"),
        7: ("fpus_per_core", "int"),
        8: ("block_dim_limit_x", "int"),
        9: ("block_dim_limit_y", "int"),
        10: ("block_dim_limit_z", "int"),
        11: ("memory_bandwidth", "int"),
        12: ("l2_cache_size", "int"),
        13: ("clock_rate_ghz", "float"),
        14: ("device_memory_size", "int"),
        15: ("shared_memory_per_block_optin", "int"),
        16: ("cuda_compute_capability", "CudaComputeCapabilityProto"),
        18: ("registers_per_core_limit", "int"),
        19: ("registers_per_block_limit", "int"),
        23: ("driver_version", "str"),
        24: ("kernel_mode_driver_version", "str"),
        25: ("runtime_version", "str"),
        26: ("compile_time_toolkit_version", "str"),
        27: ("dnn_version", "str"),
        28: ("cub_version", "str"),
        30: ("device_vendor", "str"),
        31: ("platform_version", "str"),
        34: ("name", "str"),
        35: ("model_str", "str"),
    },
    # The compute capability's major and minor only: the proto's further fields (the "a" of sm_90a) differ
    # across XLA releases; without them the compiler targets the plain architecture (sm_90).
    "CudaComputeCapabilityProto": {1: ("major", "int"), 2: ("minor", "int")},
    "VersionProto": {1: ("major", "int"), 2: ("minor", "int"), 3: ("patch", "int")},
}

_ANY_FIELD = 9
"""``PjRtTopologyDescriptionProto.platform_specific_topology`` (a ``google.protobuf.Any``)."""
_TARGET_CONFIG_FIELD = 8
"""``GpuTopologyProto.gpu_target_config``."""


class TargetConfigError(ValueError):
    """The serialized topology does not hold a GPU target description this module can read."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise TargetConfigError("truncated varint in the serialized topology.")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """``(number, wire type, value)`` of each field of a serialized message: ints, or bytes for length-delimited."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == _VARINT:
            value, at = _varint(data, at)
        elif wire == _FIXED64:
            value, at = data[at : at + 8], at + 8
        elif wire == _FIXED32:
            value, at = data[at : at + 4], at + 4
        elif wire == _BYTES:
            size, at = _varint(data, at)
            value, at = data[at : at + size], at + size
        else:
            raise TargetConfigError(f"unsupported wire type {wire} (field {number}) in the serialized topology.")
        if at > len(data):
            raise TargetConfigError("truncated field in the serialized topology.")
        yield number, wire, value


def _field(data: bytes, number: int) -> bytes:
    for n, wire, value in _fields(data):
        if n == number and wire == _BYTES:
            return bytes(value)
    raise TargetConfigError(f"no field {number} in the serialized topology.")


def _text(data: bytes, schema: str, indent: str) -> list[str]:
    lines = []
    fields = _SCHEMAS[schema]
    for number, wire, value in _fields(data):
        if number not in fields:
            continue
        name, kind = fields[number]
        if kind in _SCHEMAS and wire == _BYTES:
            inner = _text(value, kind, indent + "  ")
            if kind == "GpuDeviceInfoProto":
                lines += [f"{indent}{name} {{", *inner, f"{indent}}}"]
            else:
                lines.append(f"{indent}{name} {{ {' '.join(line.strip() for line in inner)} }}")
        elif kind == "str" and wire == _BYTES:
            escaped = value.decode("utf-8", "replace").replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{indent}{name}: "{escaped}"')
        elif kind == "float" and wire == _FIXED32:
            lines.append(f"{indent}{name}: {struct.unpack('<f', value)[0]:.6g}")
        elif kind == "int" and wire == _VARINT:
            lines.append(f"{indent}{name}: {value - (1 << 64) if value >= 1 << 63 else value}")
    return lines


def target_config_text(serialized_topology: bytes) -> str:
    """The ``GpuTargetConfigProto`` inside a serialized GPU topology, in protobuf text format.

    Raises:
      TargetConfigError: the bytes are not a GPU topology holding a device description.
    """
    topology = _field(_field(bytes(serialized_topology), _ANY_FIELD), 2)  # Any.value
    lines = _text(_field(topology, _TARGET_CONFIG_FIELD), "GpuTargetConfigProto", "")
    dnn = re.search(r'^  dnn_version: "(\d+)\.(\d+)\.(\d+)"', "\n".join(lines), re.M)
    if dnn is not None and not any(line.startswith("dnn_version_info") for line in lines):
        # A live card's description names cuDNN in the device info only; compiling without the card reads it
        # from dnn_version_info (cuDNN fusions are planned for that release).
        lines.append("dnn_version_info {{ major: {} minor: {} patch: {} }}".format(*dnn.groups()))
    text = "\n".join(lines) + "\n"
    if "core_count:" not in text or "cuda_compute_capability" not in text:
        raise TargetConfigError(
            "the serialized topology holds no CUDA device description (a GPU of another vendor, or a layout this "
            "release of autoaccum does not know)."
        )
    return text


def device_target_config(devices: Sequence[Any]) -> str:
    """The target description of real GPUs (``jax.devices("cuda")``), as XLA sees them, in text format.

    Raises:
      TargetConfigError: this jax cannot serialize a topology, or the devices are not CUDA GPUs.
    """
    from autoaccum._jax_private import jaxlib_extension

    topology = jaxlib_extension().get_topology_for_devices(list(devices))
    serialize = getattr(topology, "serialize", None)
    if serialize is None:
        import jax

        raise TargetConfigError(f"jax {jax.__version__} cannot serialize a device topology; upgrade jax.")
    return target_config_text(serialize())
