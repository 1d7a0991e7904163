"""The workload daemon's telemetry: what one sample of its replicas and nodes says.

Per replica: CPU and RSS of its whole process tree (psutil) and, where NVML
reads its GPUs, their utilisation, power and the VRAM its processes use;
without NVML a GPU replica's figures are its allocation, labelled declared.
Per node: its replicas' aggregates, the host's figures and its GPUs' readings
(or, without NVML, the allocation, labelled declared).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from mlwe.backends.local.daemon_config import NodeConfig
from mlwe.backends.local.procs import sample_trees
from mlwe.backends.local.replica import Replica
from mlwe.backends.local.telemetry import Nvml, host_sample


def daemon_samples(
    replicas: Iterable[Replica], nodes: dict[str, NodeConfig], nvml: Nvml | None
) -> list[dict[str, Any]]:
    """One telemetry message's samples: one per live replica, then one per node."""
    live = [r for r in replicas if r.tree is not None and r.returncode is None]
    trees = sample_trees([r.tree for r in live if r.tree is not None], time.monotonic())
    host = host_sample()
    gpu_dev: dict[int, dict[str, float]] = {}
    proc_vram: dict[int, dict[int, float]] = {}
    if nvml is not None:
        for node in nodes.values():
            for i in node.gpu_indices:
                gpu_dev[i] = nvml.sample(i)
                proc_vram[i] = nvml.process_vram(i)
    samples: list[dict[str, Any]] = []
    per_node: dict[str, dict[str, float]] = {
        n: {"cpu_pct": 0.0, "rss_mib": 0.0, "workloads": 0.0, "gpus_allocated": 0.0,
            "vram_allocated_mib": 0.0}
        for n in nodes
    }
    for rep in live:
        assert rep.tree is not None
        s = trees.get(rep.tree.root)
        if s is None:
            continue
        metrics: dict[str, float] = {
            "cpu_pct": round(s.cpu_pct, 2), "rss_mib": round(s.rss_bytes / 2**20, 2),
            "processes": float(len(s.pids)),
        }
        declared: list[str] = []
        if rep.gpu_milli:
            if nvml is not None and rep.devices:
                devs = [gpu_dev.get(i, {}) for i in rep.devices]
                utils = [d["gpu_util"] for d in devs if "gpu_util" in d]
                if utils:
                    metrics["gpu_util"] = sum(utils) / len(utils)
                pids = set(s.pids)
                mine = [v for i in rep.devices for pid, v in proc_vram.get(i, {}).items()
                        if pid in pids]
                if mine:
                    metrics["vram_used_mib"] = sum(mine)
                power = [d["gpu_power_w"] for d in devs if "gpu_power_w" in d]
                if power:
                    metrics["gpu_power_w"] = sum(power)
            else:
                metrics["gpus"] = rep.gpu_milli / 1000
                metrics["vram_used_mib"] = float(rep.vram_mib)
                declared = ["gpus", "vram_used_mib"]
        samples.append({"node": rep.node, "workload": rep.key[0], "attempt": rep.key[1],
                        "replica": rep.key[2], "metrics": metrics, "declared": declared})
        agg = per_node[rep.node]
        agg["cpu_pct"] += s.cpu_pct
        agg["rss_mib"] += s.rss_bytes / 2**20
        agg["workloads"] += 1
        agg["gpus_allocated"] += rep.gpu_milli / 1000
        agg["vram_allocated_mib"] += rep.vram_mib
    for name, node in nodes.items():
        agg = per_node[name]
        metrics = {k: round(v, 2) for k, v in agg.items()}
        metrics["cpu_util"] = round(agg["cpu_pct"] / 100 / (node.spec.cpu / 1000), 4)
        metrics.update(host)
        declared = []
        if node.gpu_indices and nvml is not None:
            devs = [gpu_dev.get(i, {}) for i in node.gpu_indices]
            for k in ("gpu_util", "vram_used_mib", "gpu_power_w"):
                vals = [d[k] for d in devs if k in d]
                if vals:
                    metrics[k] = sum(vals) / len(vals) if k == "gpu_util" else sum(vals)
        elif node.spec.gpus:
            metrics["vram_used_mib"] = agg["vram_allocated_mib"]
            declared = ["gpus_allocated", "vram_allocated_mib", "vram_used_mib"]
        samples.append({"node": name, "workload": None, "metrics": metrics,
                        "declared": declared})
    return samples

