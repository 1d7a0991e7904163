"""A local cluster with one workload daemon per node (the case studies' cluster).

A :class:`LocalNodes` is the Backend the engine drives (it delegates to a
:class:`mlwe.backends.local.LocalBackend`), with one ``mlwe daemon`` process
per node so that a node can fail on its own: :meth:`fail_node` kills that
node's daemon, whose workloads die with it (the daemon makes them die with
their parent), and the LocalBackend reports the node lost once its heartbeats
stop; :meth:`recover_node` starts a daemon for it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from mlwe.backends.local import LocalBackend
from mlwe.core.backend import Command, Event, RunningAttempt, Telemetry
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec, NodeSpec


class LocalNodes:
    name = "local"

    def __init__(
        self,
        cluster: ClusterSpec,
        work_dir: str | Path,
        clock: Clock,
        *,
        heartbeat_s: float = 0.25,
        missed_heartbeats: int = 6,
        register_timeout_s: float = 30.0,
    ) -> None:
        work = Path(work_dir)
        work.mkdir(parents=True, exist_ok=True)
        self.backend = LocalBackend(
            cluster,
            heartbeat_s=heartbeat_s,
            missed_heartbeats=missed_heartbeats,
            telemetry_s=1.0,
            report_s=0.2,
            register_timeout_s=register_timeout_s,
            checkpoint_root=work / "checkpoints",
            work_dir=work,
            clock=clock,
        )
        self.register_timeout_s = register_timeout_s
        self.specs: dict[str, NodeSpec] = {n.name: n for n in cluster.all_nodes()}
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        try:
            for name, spec in self.specs.items():
                self.daemons[name] = self.backend.spawn_daemon([spec])
            self.backend.wait_for_nodes(timeout=register_timeout_s)
        except BaseException:
            self.backend.close()
            raise

    # ---------------------------------------------------------- Backend protocol
    def send(self, commands: Sequence[Command]) -> None:
        self.backend.send(commands)

    def poll(self) -> list[Event]:
        return self.backend.poll()

    def drain_telemetry(self) -> list[Telemetry]:
        return self.backend.drain_telemetry()

    def inventory(self) -> list[RunningAttempt]:
        return self.backend.inventory()

    def close(self) -> None:
        self.backend.close()

    # ---------------------------------------------------------------- faults
    def fail_node(self, node: str) -> None:
        """The node's machine dies: its daemon and every workload on it are killed."""
        proc = self.daemons.get(node)
        if proc is None:
            raise KeyError(f"unknown node {node!r} (nodes: {', '.join(self.specs)})")
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def recover_node(self, node: str) -> None:
        """A new daemon serves the node again (the engine sees it come back)."""
        proc = self.daemons.get(node)
        if proc is not None and proc.poll() is None:
            return
        self.daemons[node] = self.backend.spawn_daemon([self.specs[node]])
