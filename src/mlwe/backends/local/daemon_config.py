"""What a workload daemon serves: its configuration, and the check of its nodes.

:func:`check_nodes` checks the declared nodes against this machine (CPU,
memory, GPUs and their VRAM) and gives each node the physical GPUs it is
served with (:class:`NodeConfig`); :class:`DaemonConfig` is everything the
daemon (:mod:`.daemon`) is started with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlwe.backends.local.telemetry import (
    VRAM_SLACK,
    Nvml,
    machine_memory_mib,
    usable_cpus,
)
from mlwe.core.catalog import DEFAULT_CATALOG
from mlwe.core.spec import NodeSpec


class DaemonConfigError(ValueError):
    """The daemon cannot serve what it was asked to (e.g. a node larger than the machine)."""


@dataclass(frozen=True)
class NodeConfig:
    spec: NodeSpec
    gpu_indices: tuple[int, ...]  # physical GPU index of each of the node's devices

    def to_wire(self) -> dict[str, Any]:
        d = self.spec.model_dump(mode="json")
        d["gpu_indices"] = list(self.gpu_indices)
        return d


@dataclass
class DaemonConfig:
    engine: tuple[str, int]
    nodes: list[NodeConfig]
    state_dir: Path
    checkpoint_root: Path | None = None
    token: str | None = None
    parent_pid: int | None = None
    shutdown_grace_s: float = 10.0
    connect_timeout_s: float = 5.0
    gpu_source: str = "none"  # "nvml", "declared" or "none"



def check_nodes(
    specs: list[NodeSpec],
    gpu_indices: dict[str, tuple[int, ...]] | None = None,
    *,
    nvml: Nvml | None,
    declared_gpus: bool,
    cpus: int | None = None,
    memory_mib: int | None = None,
) -> tuple[list[NodeConfig], str]:
    """Check the declared nodes against this machine; every problem in one error.

    A node may not declare more CPU, memory or GPUs than the machine has.
    Several nodes may share the machine's CPU and memory (that is the point of
    serving several nodes for tests and demos), but never a GPU. On a machine
    without GPUs, GPU nodes are accepted only with ``declared_gpus``: their
    GPUs exist as an allocation only, and every GPU figure says so."""
    cpus = usable_cpus() if cpus is None else cpus
    memory_mib = machine_memory_mib() if memory_mib is None else memory_mib
    gpu_indices = gpu_indices or {}
    problems = _capacity_problems(specs, cpus, memory_mib)
    wants_gpus = [s for s in specs if s.gpus]
    if nvml is None and wants_gpus and not declared_gpus:
        problems.append(
            "node(s) " + ", ".join(f"{s.name} ({s.gpus} GPUs)" for s in wants_gpus)
            + " declare GPUs but this machine has none (NVML found no GPU); pass"
            " --declared-gpus to serve them as an allocation only (GPU figures are then labelled"
            " declared)"
        )
    configs = _assign_gpus(specs, gpu_indices, nvml, problems)
    if problems:
        raise DaemonConfigError("; ".join(problems))
    source = "nvml" if nvml is not None else ("declared" if wants_gpus else "none")
    return configs, source


def _capacity_problems(specs: list[NodeSpec], cpus: int, memory_mib: int) -> list[str]:
    """Nodes missing, declared twice, or larger (CPU, memory) than the machine."""
    problems: list[str] = []
    names = [s.name for s in specs]
    if not specs:
        problems.append("no node to serve (give --node or --cluster)")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        problems.append(f"node(s) declared twice: {', '.join(dup)}")
    for s in specs:
        if s.cpu > cpus * 1000:
            problems.append(
                f"node {s.name} declares {s.cpu / 1000:g} CPUs but this machine has {cpus}"
            )
        if s.memory > memory_mib:
            problems.append(
                f"node {s.name} declares {s.memory} MiB of memory but this machine has"
                f" {memory_mib} MiB"
            )
    return problems


def _assign_gpus(
    specs: list[NodeSpec],
    gpu_indices: dict[str, tuple[int, ...]],
    nvml: Nvml | None,
    problems: list[str],
) -> list[NodeConfig]:
    """Each node's physical GPUs (given, or the next free ones); problems are appended."""
    configs: list[NodeConfig] = []
    used: dict[int, str] = {}
    cursor = 0
    n_dev = len(nvml.devices) if nvml is not None else None
    for s in specs:
        idx = gpu_indices.get(s.name)
        if idx is None:
            idx = tuple(range(cursor, cursor + s.gpus))
        cursor = max([cursor, *(i + 1 for i in idx)])
        if len(idx) != s.gpus:
            problems.append(f"node {s.name}: {len(idx)} gpu_indices for {s.gpus} GPUs")
        for i in idx:
            if i in used:
                problems.append(f"GPU {i} given to both {used[i]} and {s.name}")
            used[i] = s.name
        if n_dev is not None and s.gpus:
            bad = [i for i in idx if i >= n_dev]
            if bad:
                problems.append(
                    f"node {s.name} declares {s.gpus} GPUs (indices {list(idx)}) but this machine"
                    f" has {n_dev}"
                )
            elif s.gpu_model and nvml is not None:
                need = DEFAULT_CATALOG[s.gpu_model].vram_mib if s.gpu_model in DEFAULT_CATALOG else 0
                small = [d for d in (nvml.devices[i] for i in idx)
                         if d.memory_mib < need * VRAM_SLACK]
                if small:
                    d = small[0]
                    problems.append(
                        f"node {s.name} declares {s.gpu_model} ({need} MiB per GPU) but GPU"
                        f" {d.index} is {d.name} with {d.memory_mib} MiB"
                    )
        configs.append(NodeConfig(s, tuple(idx)))
    return configs
