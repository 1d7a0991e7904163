"""The Slurm backend's node watching: the cluster spec against Slurm, NodeDown, NodeUp.

A node that is DOWN / FAIL / ... (or NOT_RESPONDING for ``not_responding_s``)
becomes ``NodeDown`` and its attempts are cancelled (the control plane fails
them as node-lost); one that comes back, ``NodeUp``. Each reading of Slurm's
node table is also per-node telemetry (load, memory, allocated CPUs).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from mlwe.backends.slurm.commands import DOWN_NODE_STATES, SlurmNodeInfo
from mlwe.backends.slurm.reports import _Reports
from mlwe.backends.slurm.state import log
from mlwe.core.backend import NodeDown, NodeUp, Telemetry


class _NodeWatch(_Reports):
    """Checking and following Slurm's node table."""

    def _check_nodes(self, nodes: Iterable[SlurmNodeInfo]) -> list[str]:
        have = {n.name: n for n in nodes}
        problems = []
        for name, spec in self._specs.items():
            n = have.get(name)
            if n is None:
                problems.append(f"node {name} is not a Slurm node (Slurm has:"
                                f" {', '.join(sorted(have)[:20]) or 'none'})")
                continue
            if self.config.partition and n.partitions and self.config.partition not in n.partitions:
                problems.append(f"node {name} is not in partition {self.config.partition}")
            if n.cpus * 1000 < spec.cpu:
                problems.append(f"node {name}: declares {spec.cpu}m CPU, Slurm has {n.cpus}")
            if n.memory_mib and n.memory_mib < spec.memory:
                problems.append(f"node {name}: declares {spec.memory} MiB, Slurm has"
                                f" {n.memory_mib}")
            if spec.gpus:
                count = sum(n.gpus.values())
                if count < spec.gpus:
                    problems.append(f"node {name}: declares {spec.gpus} GPUs, Slurm's GRES has"
                                    f" {count}")
                types = [t for t, c in n.gpus.items() if c > 0]
                if len(types) == 1:
                    self._gres[name] = types[0]
        return problems

    def _on_nodes(self, nodes: Iterable[SlurmNodeInfo]) -> None:
        seen = set()
        now = self.clock.now()
        for n in nodes:
            if n.name not in self._specs:
                continue
            seen.add(n.name)
            down = n.down
            if down and not (n.flags - {"NOT_RESPONDING"}) & DOWN_NODE_STATES:
                # only NOT_RESPONDING: lost once it lasts (Slurm's own DOWN comes later)
                since = self._not_responding.setdefault(n.name, time.monotonic())
                down = time.monotonic() - since >= self.config.not_responding_s
            else:
                self._not_responding.pop(n.name, None)
            self._node_state(n.name, down, f"Slurm says {n.describe()}")
            metrics = {"slurm_cpus": float(n.cpus), "slurm_alloc_cpus": float(n.alloc_cpus),
                       "slurm_alloc_memory_mib": float(n.alloc_memory_mib),
                       "up": 0.0 if self._down.get(n.name) else 1.0}
            if n.cpu_load is not None:
                metrics["load_1m"] = n.cpu_load
            if n.free_memory_mib is not None:
                metrics["mem_free_mib"] = float(n.free_memory_mib)
            self._telemetry.append(Telemetry(now, n.name, None, metrics))
        for name in self._specs:
            if name not in seen:
                self._node_state(name, True, "no longer a Slurm node")

    def _node_state(self, name: str, down: bool, reason: str) -> None:
        if down == self._down.get(name):
            return
        self._down[name] = down
        if not down:
            self._emit(NodeUp(name))
            return
        log.warning("node %s down: %s", name, reason)
        self._emit(NodeDown(name, reason))
        for a in self._attempts.values():
            if a.final or name not in a.nodes:
                continue
            # the control plane fails it (node-lost) when it handles NodeDown; the
            # replicas elsewhere must not keep running
            a.final = a.lost = True
            if a.job_id is not None:
                self._work.put(("cancel", a))
