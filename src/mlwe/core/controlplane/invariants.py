"""The invariants the control plane guarantees: what one batch touched, checked
after it, and the full sweep."""

from __future__ import annotations

from mlwe.core.capacity import FULL
from mlwe.core.controlplane.state import (
    InvariantViolation,
    PlaneState,
    _add,
    _Txn,
)
from mlwe.core.lifecycle import QUEUED, TRANSITIONS
from mlwe.core.model import Workload


class Invariants(PlaneState):
    """The invariants the control plane guarantees: what one batch touched, checked"""

    def _check_touched(self, txn: _Txn) -> list[str]:
        self.invariant_checks += 1
        problems: list[str] = []
        for node in txn.touched_nodes:
            problems += self._node_problems(node)
        for wid in txn.touched_workloads:
            problems += (
                self._workload_problems(self.workloads[wid]) if wid in self.workloads else []
            )
        for wid in txn.touched_workloads:
            w = self.workloads.get(wid)
            q = self.queues.get(w.queue) if w is not None else None
            if q is not None and (q.usage[0] < 0 or q.usage[1] < 0 or q.usage[2] < 0 or q.usage[3] < 0):
                problems.append(f"queue {q.name}: negative usage {q.usage}")
        return problems

    def _node_problems(self, node: str) -> list[str]:
        info = self.capacity.info(node)
        used = [0, 0, 0, 0]
        dev_used = [0] * info.gpu_count
        for wid in self.on_node.get(node, ()):
            w = self.workloads[wid]
            if not w.holding:
                return [f"node {node}: {wid} listed but {w.state.value}"]
            for a in w.placement:
                if a.node == node:
                    _add(used, a.res, 1)
                    for d in a.devices:
                        dev_used[d] += a.gpu_per_device
        cap = info.capacity.as_tuple()
        free = self.capacity.free(node).as_tuple()
        out = []
        for name, c, u, f in zip(("gpu", "vram", "cpu", "ram"), cap, used, free):
            if u > c:
                out.append(f"node {node}: {name} allocated {u} > capacity {c}")
            if c - u != f:
                out.append(f"node {node}: {name} free {f} != capacity {c} - allocated {u}")
        devfree = self.capacity.free_devices(node)
        for d, (u, f) in enumerate(zip(dev_used, devfree)):
            if u > FULL or FULL - u != f:
                out.append(f"node {node}: GPU {d} used {u} milli, free {f}")
        return out

    def _workload_problems(self, w: Workload) -> list[str]:
        out = []
        if w.holding:
            if len(w.placement) != w.spec.replicas:
                out.append(
                    f"{w.id}: {w.state.value} with {len(w.placement)}/{w.spec.replicas} replicas"
                )
            for a in w.placement:
                if w.id not in self.on_node.get(a.node, {}):
                    out.append(f"{w.id}: placed on {a.node} but not indexed there")
        elif w.placement:
            out.append(f"{w.id}: {w.state.value} but still holds {len(w.placement)} replicas")
        if (w.state in QUEUED) != (w.id in self.queued):
            out.append(f"{w.id}: queue index disagrees with state {w.state.value}")
        if w.history and w.history[-1].target is not w.state:
            out.append(f"{w.id}: history ends in {w.history[-1].target}, state is {w.state}")
        return out

    def validate_state(self) -> list[str]:
        """The full invariant sweep; an empty list means every rule holds."""
        self.invariant_checks += 1
        problems: list[str] = []
        for node in self.capacity.node_names():
            problems += self._node_problems(node)
        problems += self.capacity.recompute_keys_ok()
        usage: dict[str, list[int]] = {q: [0, 0, 0, 0] for q in self.queues}
        for w in self.workloads.values():
            problems += self._workload_problems(w)
            for a in w.placement:
                _add(usage[w.queue], a.res, 1)
            for prev, nxt in zip(w.history, w.history[1:]):
                if prev.target is not nxt.source or nxt.target not in TRANSITIONS[prev.target]:
                    problems.append(
                        f"{w.id}: history has an illegal step {prev.target} -> {nxt.target}"
                    )
        by_prio: dict[int, int] = {}
        for w in self.workloads.values():
            if w.placement:
                by_prio[w.priority] = by_prio.get(w.priority, 0) + 1
        counted = {p: n for p, n in self.holding_by_priority.items() if n}
        if by_prio != counted:
            problems.append(f"holders by priority {counted} != recount {by_prio}")
        for name, q in self.queues.items():
            if usage[name] != q.usage:
                problems.append(f"queue {name}: usage {q.usage} != sum of placements {usage[name]}")
        for wid in self.queued:
            if self.workloads[wid].state not in QUEUED:
                problems.append(f"{wid}: in queue index while {self.workloads[wid].state.value}")
        return problems

    def assert_valid(self) -> None:
        problems = self.validate_state()
        if problems:
            raise InvariantViolation("; ".join(problems[:20]))
