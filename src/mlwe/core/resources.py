"""Integer resource vectors and quantity parsing.

Every quantity the scheduler compares is an integer: milli-GPU, MiB of VRAM,
milli-CPU and MiB of RAM. Integers make capacity checks exact (no float drift
after thousands of allocate/release cycles) and make decision logs
byte-identical across runs.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

RESOURCE_NAMES: Final = ("gpu", "vram", "cpu", "ram")
RESOURCE_UNITS: Final = {"gpu": "milli-GPU", "vram": "MiB", "cpu": "milli-CPU", "ram": "MiB"}

#: Stands for "no limit" in quotas; large enough never to be reached, small
#: enough to stay an exact int in every arithmetic we do.
UNLIMITED: Final = 1 << 60

#: The largest quantities a spec may give (every edge checks them, so that nothing
#: non-finite or overflowing reaches the control plane, the store or a stream):
#: 1 EiB of memory, a million cores, 10,000 GPUs, a century of seconds.
MAX_MEMORY_MIB: Final = 1 << 40
MAX_CPU_MILLI: Final = 1_000_000_000
MAX_GPU_MILLI: Final = 10_000_000
MAX_SECONDS: Final = 100 * 365 * 86400.0
#: Quantity strings longer than this are refused before any arithmetic.
_MAX_QTY_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class Resources:
    """A resource vector: milli-GPU, MiB of VRAM, milli-CPU, MiB of RAM."""

    gpu: int = 0
    vram: int = 0
    cpu: int = 0
    ram: int = 0

    def __add__(self, other: Resources) -> Resources:
        return Resources(
            self.gpu + other.gpu, self.vram + other.vram, self.cpu + other.cpu, self.ram + other.ram
        )

    def __sub__(self, other: Resources) -> Resources:
        return Resources(
            self.gpu - other.gpu, self.vram - other.vram, self.cpu - other.cpu, self.ram - other.ram
        )

    def __mul__(self, n: int) -> Resources:
        return Resources(self.gpu * n, self.vram * n, self.cpu * n, self.ram * n)

    def as_tuple(self) -> tuple[int, int, int, int]:
        return (self.gpu, self.vram, self.cpu, self.ram)

    def fits_in(self, capacity: Resources) -> bool:
        return (
            self.gpu <= capacity.gpu
            and self.vram <= capacity.vram
            and self.cpu <= capacity.cpu
            and self.ram <= capacity.ram
        )

    def exceeded(self, capacity: Resources) -> list[str]:
        """Names of the resources where self is larger than capacity."""
        return [n for n, a, c in zip(RESOURCE_NAMES, self.as_tuple(), capacity.as_tuple()) if a > c]

    def negative(self) -> list[str]:
        return [n for n, a in zip(RESOURCE_NAMES, self.as_tuple()) if a < 0]

    def is_zero(self) -> bool:
        return self.gpu == 0 and self.vram == 0 and self.cpu == 0 and self.ram == 0

    def __str__(self) -> str:
        parts = []
        if self.gpu:
            parts.append(f"gpu={format_gpu(self.gpu)}")
        if self.vram:
            parts.append(f"vram={format_mib(self.vram)}")
        if self.cpu:
            parts.append(f"cpu={format_cpu(self.cpu)}")
        if self.ram:
            parts.append(f"ram={format_mib(self.ram)}")
        return "{" + ", ".join(parts) + "}" if parts else "{}"


ZERO: Final = Resources()


def format_gpu(milli: int) -> str:
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli / 1000:g}"


def format_cpu(milli: int) -> str:
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def format_mib(mib: int) -> str:
    if mib % 1024 == 0 and mib:
        return f"{mib // 1024}Gi"
    return f"{mib}Mi"


_MEM_UNITS: Final = {
    "": 1 / (1024 * 1024),  # plain number = bytes, as in Kubernetes
    "ki": 1 / 1024,
    "mi": 1,
    "gi": 1024,
    "ti": 1024 * 1024,
    "k": 1000 / (1024 * 1024),
    "m": 1000**2 / (1024 * 1024),
    "g": 1000**3 / (1024 * 1024),
    "t": 1000**4 / (1024 * 1024),
    "mb": 1000**2 / (1024 * 1024),
    "gb": 1000**3 / (1024 * 1024),
    "mib": 1,
    "gib": 1024,
    "tib": 1024 * 1024,
}
_QTY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _number(value: int | float, what: str, limit: float) -> float | int:
    """``value`` if it is a finite number in [0, limit] (in the quantity's own unit)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, not {value}")
    if value < 0:
        raise ValueError(f"{what} must not be negative")
    if value > limit:
        raise ValueError(f"{what} is too large (at most {int(limit):,})")
    return value


def _qty_text(value: str, what: str) -> str:
    if len(value) > _MAX_QTY_CHARS:
        raise ValueError(f"{what} {value[:20]!r}... is too long ({len(value)} characters)")
    return value


def parse_memory_mib(value: object) -> int:
    """Parse a memory quantity into MiB.

    An int or float is taken as MiB (the unit the engine works in); a string
    takes Kubernetes-style suffixes: ``16Gi``, ``512Mi``, ``80GB``, ``1Ti``.
    """
    if isinstance(value, bool):
        raise ValueError("memory quantity must be a number or a string like '16Gi'")
    if isinstance(value, int | float):
        return round(_number(value, "memory quantity (MiB)", MAX_MEMORY_MIB))
    if not isinstance(value, str):
        raise ValueError("memory quantity must be a number (MiB) or a string like '16Gi'")
    m = _QTY.match(_qty_text(value, "memory quantity"))
    if not m:
        raise ValueError(f"cannot parse memory quantity {value!r} (expected e.g. '16Gi', '512Mi')")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _MEM_UNITS:
        raise ValueError(
            f"unknown memory unit {m.group(2)!r} in {value!r} (use Mi, Gi, Ti, MB, GB)"
        )
    return round(_number(number * _MEM_UNITS[unit], f"memory quantity {value!r} in MiB", MAX_MEMORY_MIB))


def parse_cpu_milli(value: object) -> int:
    """Parse a CPU quantity into milli-CPU: ``4`` or ``"4"`` cores, ``"500m"``."""
    if isinstance(value, bool):
        raise ValueError("cpu quantity must be a number of cores or a string like '500m'")
    if isinstance(value, int | float):
        return round(_number(value, "cpu quantity (cores)", MAX_CPU_MILLI / 1000) * 1000)
    if not isinstance(value, str):
        raise ValueError("cpu quantity must be a number of cores or a string like '500m'")
    m = _QTY.match(_qty_text(value, "cpu quantity"))
    if not m or m.group(2) not in ("", "m"):
        raise ValueError(f"cannot parse cpu quantity {value!r} (expected e.g. '4', '1.5', '500m')")
    number = float(m.group(1))
    milli = number if m.group(2) == "m" else number * 1000
    return round(_number(milli, f"cpu quantity {value!r} in milli-CPU", MAX_CPU_MILLI))


def parse_gpu_milli(value: object) -> int:
    """Parse a GPU count into milli-GPU: ``2`` GPUs, ``0.5`` of one, ``"250m"``."""
    if isinstance(value, bool):
        raise ValueError("gpu quantity must be a number of GPUs")
    if isinstance(value, str):
        m = _QTY.match(_qty_text(value, "gpu quantity"))
        if not m or m.group(2) not in ("", "m"):
            raise ValueError(f"cannot parse gpu quantity {value!r} (expected e.g. 1, 0.5, '250m')")
        number = float(m.group(1))
        milli = number if m.group(2) == "m" else number * 1000
        return round(_number(milli, f"gpu quantity {value!r} in milli-GPU", MAX_GPU_MILLI))
    if isinstance(value, int | float):
        return round(_number(value, "gpu quantity (GPUs)", MAX_GPU_MILLI / 1000) * 1000)
    raise ValueError("gpu quantity must be a number of GPUs")


_DUR = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|d|h|m|s)")  # "ms" before "m": first match wins


def parse_duration_s(value: object) -> float:
    """Parse a duration into seconds: ``3600``, ``"90m"``, ``"1h30m"``, ``"2d"``."""
    if isinstance(value, bool):
        raise ValueError("duration must be seconds or a string like '1h30m'")
    if isinstance(value, int | float):
        return float(_number(value, "duration (seconds)", MAX_SECONDS))
    if not isinstance(value, str):
        raise ValueError("duration must be seconds or a string like '1h30m'")
    text = _qty_text(value, "duration").strip().lower().replace(" ", "")
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return float(_number(number, f"duration {value!r}", MAX_SECONDS))
    pos, total = 0, 0.0
    scale = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    for m in _DUR.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * scale[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"cannot parse duration {value!r} (expected e.g. 3600, '90m', '1h30m')")
    return float(_number(total, f"duration {value!r} in seconds", MAX_SECONDS))


def format_duration(seconds: float) -> str:
    """Short human form: 1h50m, 12m, 45s, 2d3h."""
    if seconds == float("inf"):
        return "never"
    neg = seconds < 0
    s = round(abs(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        out = f"{d}d{h}h" if h else f"{d}d"
    elif h:
        out = f"{h}h{m}m" if m else f"{h}h"
    elif m:
        out = f"{m}m{s}s" if s and m < 10 else f"{m}m"
    else:
        out = f"{s}s"
    return "-" + out if neg else out
