"""What the daemon measures: the host (psutil) and its GPUs (NVML, when present).

GPU figures come from NVML through ``nvidia-ml-py``. Where no GPU (or no
driver) exists, nothing here invents a figure: the daemon reports a GPU
workload's *allocation* and marks those metrics as declared.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import Any

import psutil

from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog

#: a device counts as a catalogue model when it has at least this share of the model's
#: VRAM: drivers report less than the marketed size (a T4 or an A10 shows ~6 % less,
#: 15,360 of 16,384 MiB and 23,028 of 24,576 MiB; an H200 143,771 of 144,384)
VRAM_SLACK = 0.93


@dataclass(frozen=True)
class GpuDevice:
    index: int
    name: str
    memory_mib: int


class Nvml:
    """A thin, failure-tolerant wrapper over NVML (``pynvml`` from nvidia-ml-py)."""

    def __init__(self) -> None:
        import pynvml  # type: ignore[import-untyped]

        pynvml.nvmlInit()
        self._nv: Any = pynvml
        n = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        devices = []
        for i, h in enumerate(self._handles):
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            devices.append(GpuDevice(i, str(name), int(mem.total) // 2**20))
        self.devices: tuple[GpuDevice, ...] = tuple(devices)

    @classmethod
    def open(cls) -> Nvml | None:
        """NVML if a driver and at least one GPU are present, else None."""
        try:
            nv = cls()
        except Exception:  # no library, no driver, no permission: no GPUs to measure
            return None
        return nv if nv.devices else None

    def sample(self, index: int) -> dict[str, float]:
        """Utilisation (0..1), VRAM used (MiB) and power (W) of one device."""
        nv, h = self._nv, self._handles[index]
        out: dict[str, float] = {}
        with contextlib.suppress(Exception):
            out["gpu_util"] = nv.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
        with contextlib.suppress(Exception):
            out["vram_used_mib"] = nv.nvmlDeviceGetMemoryInfo(h).used / 2**20
        with contextlib.suppress(Exception):
            out["gpu_power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
        return out

    def process_vram(self, index: int) -> dict[int, float]:
        """VRAM used per process on one device (MiB), where the driver tells."""
        nv, h = self._nv, self._handles[index]
        out: dict[int, float] = {}
        with contextlib.suppress(Exception):
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = getattr(p, "usedGpuMemory", None)
                if used is not None:
                    out[int(p.pid)] = out.get(int(p.pid), 0.0) + used / 2**20
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._nv.nvmlShutdown()


def catalog_model(memory_mib: int, name: str = "", catalog: GpuCatalog = DEFAULT_CATALOG
                  ) -> str | None:
    """The catalogue model a device can be declared as: among the models its memory
    holds, those whose family its NVML name names (``NVIDIA A100-SXM4-80GB``: A100),
    else all of them; of those the biggest (then the highest ranked). None if every
    model is bigger than the device."""
    fits = [catalog[m] for m in catalog.names() if catalog[m].vram_mib * VRAM_SLACK <= memory_mib]
    named = [m for m in fits
             if re.search(rf"\b{re.escape(m.name.split('-')[0])}\b", name, re.IGNORECASE)]
    pool = named or fits
    if not pool:
        return None
    return max(pool, key=lambda m: (m.vram_mib, m.rank)).name


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity), not merely those the machine has."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def machine_memory_mib() -> int:
    return int(psutil.virtual_memory().total // 2**20)


def host_sample() -> dict[str, float]:
    """The machine as a whole: CPU (percent of all CPUs since the last call), memory, load."""
    vm = psutil.virtual_memory()
    out = {
        "host_cpu_pct": psutil.cpu_percent(None),
        "host_mem_used_mib": (vm.total - vm.available) / 2**20,
        "host_mem_total_mib": vm.total / 2**20,
    }
    with contextlib.suppress(OSError, AttributeError):
        l1, l5, l15 = os.getloadavg()
        out.update(host_load1=l1, host_load5=l5, host_load15=l15)
    return out
