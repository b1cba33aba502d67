"""The devices ``ferry plan`` knows: a built-in table of GPUs with rough prices,
``cpu:<bytes>`` budgets, and ``custom:<name>:<GiB>`` devices, plus the size and
price parsing the planner's flags share.

Memory is what the driver reports as total (nvidia-smi's MiB figure), not the
marketing number: an "80 GB" H100 shows 81559 MiB. Prices are rough on-demand
USD per GPU-hour from public cloud listings in 2025-26; they vary by provider,
region and commitment, so operators should pass their own with ``--price``.
Bandwidth (bytes/s) feeds only the decode-throughput ceiling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_bytes: int
    usd_per_hour: float  # 0: unknown
    bandwidth_bytes_per_s: float  # 0: unknown
    note: str = ""


BUILTIN_DEVICES: tuple[Device, ...] = (
    Device("H100-SXM-80GB", "gpu", 81559 * MIB, 2.50, 3.35e12, "nvidia-smi total"),
    Device("H200-141GB", "gpu", 143771 * MIB, 3.50, 4.8e12, "nvidia-smi total"),
    # 192 GB of HBM on the package, 180 GB exposed; nvidia-smi reports 183359 MiB.
    Device("B200-180GB", "gpu", 183359 * MIB, 5.50, 7.7e12, "nvidia-smi total (180 GB usable of 192)"),
    # 288 GB HBM3e; usable size assumed at B200's usable/physical ratio.
    Device("B300-288GB", "gpu", 275040 * MIB, 7.50, 8.0e12, "estimated usable of 288 GB"),
    Device("A100-80GB", "gpu", 81920 * MIB, 1.50, 2.039e12, "nvidia-smi total"),
    Device("RTX-5090-32GB", "gpu", 32607 * MIB, 0.70, 1.792e12, "nvidia-smi total"),
)

_ALIASES = {
    "h100": "H100-SXM-80GB", "h100-sxm": "H100-SXM-80GB", "h200": "H200-141GB", "b200": "B200-180GB",
    "b300": "B300-288GB", "a100": "A100-80GB", "a100-80gb": "A100-80GB", "rtx5090": "RTX-5090-32GB",
    "rtx-5090": "RTX-5090-32GB", "5090": "RTX-5090-32GB",
}

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}


def parse_bytes(text: str) -> int:
    """'1073741824', '8GiB', '8G' (binary), '8GB' (decimal) -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 8GiB, 512MiB, 80GB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def readable_size(num_bytes: int) -> str:
    """The shortest exact binary-unit spelling: 17179869184 -> '16GiB', 1536 MiB -> '1536MiB'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f}{unit}"
    return f"{num_bytes}B"


def find_builtin(name: str) -> Device | None:
    key = _ALIASES.get(name.lower(), name)
    for device in BUILTIN_DEVICES:
        if device.name.lower() == key.lower():
            return device
    return None


def parse_device(spec: str) -> Device:
    """One --devices entry: a built-in name, cpu:<bytes> or custom:<name>:<GiB>."""
    spec = spec.strip()
    if spec.lower().startswith("cpu:"):
        size = parse_bytes(spec[4:])
        return Device(f"cpu:{readable_size(size)}", "cpu", size, 0.0, 0.0, "KV budget = exactly these bytes")
    if spec.lower().startswith("custom:"):
        parts = spec.split(":")
        if len(parts) != 3 or not parts[1]:
            raise ValueError(f"custom device {spec!r}: expected custom:<name>:<GiB>")
        try:
            gib = float(parts[2])
        except ValueError:
            raise ValueError(f"custom device {spec!r}: memory {parts[2]!r} is not a number of GiB") from None
        return Device(parts[1], "gpu", int(gib * GIB), 0.0, 0.0, "custom")
    device = find_builtin(spec)
    if device is None:
        known = ", ".join(d.name for d in BUILTIN_DEVICES)
        raise ValueError(f"unknown device {spec!r}; known: {known}; or cpu:<bytes>, custom:<name>:<GiB>")
    return device


def parse_devices(specs: list[str]) -> list[Device]:
    """Comma lists (possibly repeated flags) -> devices; empty means the built-in GPUs."""
    entries = [part for spec in specs for part in spec.split(",") if part.strip()]
    if not entries:
        return list(BUILTIN_DEVICES)
    return [parse_device(entry) for entry in entries]


def parse_name_values(items: list[str], flag: str) -> tuple[float | None, dict[str, float]]:
    """'NAME=VALUE' items (and at most one bare VALUE for every device) -> (default, per name)."""
    default: float | None = None
    per_name: dict[str, float] = {}
    for item in items:
        name, sep, value = item.rpartition("=")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{flag} {item!r}: {value!r} is not a number") from None
        if number < 0:
            raise ValueError(f"{flag} {item!r}: must not be negative")
        if sep:
            per_name[name.strip()] = number
        else:
            default = number
    return default, per_name


def lookup(per_name: dict[str, float], device: Device) -> float | None:
    """A per-device value given by the device's name or a built-in alias of it."""
    for name, value in per_name.items():
        if name.lower() == device.name.lower():
            return value
        builtin = find_builtin(name)
        if builtin is not None and builtin.name == device.name:
            return value
    return None


def with_prices(devices: list[Device], items: list[str]) -> list[Device]:
    """Apply --price overrides; a name that matches no listed device is an error."""
    default, per_name = parse_name_values(items, "--price")
    for name in per_name:
        if not any(lookup({name: 0.0}, d) is not None for d in devices):
            raise ValueError(f"--price {name}=...: no device named {name!r} in --devices")
    out = []
    for device in devices:
        price = lookup(per_name, device)
        if price is None and default is not None:
            price = default
        out.append(device if price is None else replace(device, usd_per_hour=price))
    return out
