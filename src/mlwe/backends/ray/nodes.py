"""The Ray backend's node watching and node-loss handling.

Ray's node table is watched; a Ray node serving an mlwe node that dies becomes
``NodeDown`` (after the attempts that had a replica there are torn down, so
their surviving replicas no longer hold other nodes), and one that comes back,
``NodeUp``. A raylet that refuses connections is taken as a direct witness of
its node's death before the GCS notices.
"""

from __future__ import annotations

import socket
import time

from mlwe.backends.ray.cluster import node_problems, node_resource, ray_node_table
from mlwe.backends.ray.state import _Outcome, _Phase, _ray, log
from mlwe.backends.ray.teardown import _Teardown
from mlwe.core.backend import NodeDown, NodeUp


class _NodeWatch(_Teardown):
    """Watching Ray's nodes: losses, returns and the NodeDown facts they become."""

    def _check_nodes(self, *, initial: bool = False) -> None:
        alive: dict[str, tuple[str, dict[str, float]]] = {}
        for name, entries in ray_node_table().items():
            for node_id, is_alive, res in entries:
                if is_alive and node_id not in self._dead_ray_nodes:
                    alive[name] = (node_id, res)
        if initial:
            problems = [
                p
                for name, spec in self.node_specs.items()
                if name in alive
                for p in node_problems(spec, alive[name][1])
            ]
            if problems:
                raise ValueError("Ray cluster does not match the cluster spec: " + "; ".join(problems))
        for name in self.node_specs:
            got = alive.get(name)
            was = self._ray_node.get(name)
            if got is not None and was is not None and was != got[0] and name not in self._down:
                # replaced between two checks: the Ray node we knew died
                self._node_lost(name, f"Ray node {was[:12]} died (replaced by {got[0][:12]})")
            if got is None:
                if name not in self._down:
                    reason = (
                        f"no Ray node advertises {node_resource(name)}"
                        if was is None
                        else f"Ray node {was[:12]} died"
                    )
                    self._node_lost(name, reason)
                self._ray_node.pop(name, None)
                continue
            self._ray_node[name] = got[0]
            if name in self._down and name not in self._pending_down:
                # back (a NodeDown still waiting to be reported goes first)
                self._down.discard(name)
                self._emit(NodeUp(name))

    def _node_lost(self, name: str, reason: str) -> None:
        self._down.add(name)
        for warm in self._pool.pop(name, []):
            self._kill_quietly(warm.actor)
        self._pending_down[name] = (time.monotonic(), reason)
        for a in self._attempts.values():
            if a.outcome is _Outcome.EXITED and a.exit_code == 0:
                continue  # every replica had exited 0 before the node died: it succeeded
            if name in a.nodes and a.phase is not _Phase.DONE and a.outcome is not _Outcome.NODE_LOST:
                # its replicas elsewhere must go too: the reconciler frees the whole gang
                a.outcome = _Outcome.NODE_LOST
                a.cause = "node-lost"
                self._begin_teardown(a, force=True, drain=False)

    def _flush_node_downs(self) -> None:
        now = time.monotonic()
        for name, (since, reason) in list(self._pending_down.items()):
            # the attempts it ended go first, and so does a success it did not undo: the
            # reconciler reads NodeDown as the end of whatever still runs there
            busy = any(
                name in a.nodes and a.phase is not _Phase.DONE and (
                    a.outcome is _Outcome.NODE_LOST
                    or (a.outcome is _Outcome.EXITED and a.exit_code == 0))
                for a in self._attempts.values()
            )
            if busy and now - since < self.config.node_settle_s:
                continue
            if busy:
                self._error(f"node {name}: attempts not confirmed gone {self.config.node_settle_s}s"
                            " after its Ray node died; reporting it down anyway")
            del self._pending_down[name]
            self._emit(NodeDown(name, reason))

    def _node_alive(self, node: str) -> bool:
        self._check_nodes()
        return node not in self._down

    def _raylet_gone(self, node: str, ray_node_id: str | None) -> bool | None:
        """Settle an actor death before blaming the workload: did its node die with it?

        The GCS marks a Ray node dead only after several missed health checks
        (seconds; longer on a loaded machine), while the actors of a killed node
        are reported dead at once. A dead raylet's port refuses connections the
        moment its process is gone, so a refused connection is a direct witness
        of the node's death: the node is lost (NodeDown), and the attempt ends as
        node-lost, not as the workload's error. True: gone (and reported so);
        False: the raylet answers, the node lives; None: no proof either way (a
        timeout, no address), the caller keeps its settle time.
        """
        if node in self._down:
            return True
        rid = ray_node_id or self._ray_node.get(node)
        if rid is None:
            return None
        addr = None
        try:
            for n in _ray().nodes():
                if str(n.get("NodeID")) == rid:
                    addr = (str(n["NodeManagerAddress"]), int(n["NodeManagerPort"]))
                    break
        except Exception as exc:  # the GCS itself is unreachable: no witness
            log.debug("node table unavailable: %s", exc)
            return None
        if addr is None:
            return None
        try:
            with socket.create_connection(addr, timeout=2.0):
                return False  # the raylet answers: the node is alive
        except ConnectionRefusedError:
            pass
        except OSError:
            return None  # unreachable or slow: not proof either way
        self._dead_ray_nodes.add(rid)
        self._node_lost(node, f"Ray node {rid[:12]} died (its raylet at {addr[0]}:{addr[1]} refuses"
                              " connections; its actors died with it)")
        return True
