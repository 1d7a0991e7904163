"""LocalBackend: the engine's side of the workload daemons (the core Backend protocol).

It listens on a TCP address; daemons connect, register the nodes they serve
(checked against the cluster spec), heartbeat and run what they are sent.
It turns the engine's commands into per-replica messages and the daemons'
per-replica reports back into the workload-level facts the control plane
expects:

- ``Started`` once every replica of the attempt has a process;
- ``Exited`` once every replica's process tree is gone (the first failure
  decides the code and cause; the other replicas of a failed gang are
  force-stopped first);
- ``Released`` after a stop request, once every replica's tree is gone, with
  the progress of the last checkpoint the workload reported;
- ``Progress`` from replica 0's reports, ``NodeDown`` after missed heartbeats
  (or when a cluster node never gets a daemon), ``NodeUp`` when it returns.

Commands are idempotent by request id. Telemetry from the daemons (psutil,
NVML) and the workloads' own reports (loss, step, metrics) comes out of
:meth:`drain_telemetry`. Everything here is guarded by one lock; reads run
on one thread per daemon, writes on another, so a slow daemon never blocks
the engine.

Its parts: the bookkeeping (:mod:`.engine_state`), one daemon's connection
(:mod:`.link`), commands and attempt facts (:mod:`.attempts`), the daemons'
messages (:mod:`.messages`) and their registration (:mod:`.registry`); this
module is :class:`LocalBackend` itself: the protocol and the engine's helpers.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlwe.backends.common import WallClock
from mlwe.backends.local.engine_state import _Attempt, _Node
from mlwe.backends.local.link import _Daemon
from mlwe.backends.local.protocol import parse_address
from mlwe.backends.local.registry import _Registry
from mlwe.core.backend import Command, Event, RunningAttempt, Telemetry, dispatch
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec, NodeSpec


class LocalBackend(_Registry):
    """The Backend protocol over workload daemons (``mlwe daemon``) on real machines."""

    name = "local"

    def __init__(
        self,
        cluster: ClusterSpec | None = None,
        *,
        listen: str = "127.0.0.1:0",
        token: str | None = None,
        heartbeat_s: float = 1.0,
        missed_heartbeats: int = 3,
        telemetry_s: float = 1.0,
        report_s: float = 1.0,
        register_timeout_s: float | None = None,
        checkpoint_root: str | Path | None = None,
        work_dir: str | Path | None = None,
        clock: Clock | None = None,
    ) -> None:
        if heartbeat_s <= 0 or missed_heartbeats < 1 or telemetry_s <= 0 or report_s <= 0:
            raise ValueError("heartbeat_s, telemetry_s and report_s must be positive;"
                             " missed_heartbeats at least 1")
        self.cluster = cluster
        self.token = token
        self.heartbeat_s = heartbeat_s
        self.missed_heartbeats = missed_heartbeats
        self.telemetry_s = telemetry_s
        self.report_s = report_s
        self.register_timeout_s = (
            register_timeout_s if register_timeout_s is not None else heartbeat_s * missed_heartbeats
        )
        self.checkpoint_root = Path(checkpoint_root) if checkpoint_root is not None else None
        self._work_dir = Path(work_dir) if work_dir is not None else None
        self.clock: Clock = clock or WallClock()
        self._iid = uuid.uuid4().hex[:8]
        self._n = itertools.count(1)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        #: Called (from the backend's threads) whenever an event is ready to poll:
        #: the runtime engine registers its wake-up here, so it reacts at once.
        self.event_listeners: list[Callable[[], None]] = []
        self._events: list[Event] = []
        self._telemetry: deque[Telemetry] = deque(maxlen=200_000)
        self._seen: set[str] = set()
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._daemons: dict[str, _Daemon] = {}
        self._nodes: dict[str, _Node] = {}
        if cluster is not None:
            for spec in cluster.all_nodes():
                self._nodes[spec.name] = _Node(spec.name, spec)
        self.errors: deque[str] = deque(maxlen=1000)
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self._closing = False
        self._t0 = time.monotonic()
        host, port = parse_address(listen, any_port=True)
        self._server = socket.create_server((host, port))
        self._server.settimeout(0.2)
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        t = threading.Thread(target=self._accept_loop, name="mlwe-local-accept", daemon=True)
        t.start()
        self._threads.append(t)

    # ================================================================ protocol
    def send(self, commands: Sequence[Command]) -> None:
        with self._lock:
            dispatch(commands, self._seen, self._start, self._stop)

    def poll(self) -> list[Event]:
        with self._lock:
            self._check_heartbeats()
            out, self._events = self._events, []
            self._wake.clear()
            return out

    def drain_telemetry(self) -> list[Telemetry]:
        with self._lock:
            out = list(self._telemetry)
            self._telemetry.clear()
            return out

    def inventory(self) -> list[RunningAttempt]:
        """What runs now; first waits (up to the registration timeout) for the
        cluster's daemons to register, since only they know what runs."""
        deadline = self._t0 + self.register_timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if all(n.daemon is not None or n.down for n in self._nodes.values()):
                    break
            time.sleep(0.02)
        with self._lock:
            return [
                RunningAttempt(
                    a.workload, a.attempt,
                    tuple(dict.fromkeys(r.node for r in a.replicas.values() if r.node != "?")),
                )
                for a in self._attempts.values()
                if not a.final and any(r.state in ("sent", "running") for r in a.replicas.values())
            ]

    def close(self) -> None:
        """Force-stop every workload, wait for the daemons to confirm, stop spawned daemons."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            live = [a for a in self._attempts.values() if not a.final]
            for a in live:
                a.stop_requested = True
                for r in a.replicas.values():
                    if r.state in ("sent", "running"):
                        self._send_stop(a, r, 0.0, "close")
        end = time.monotonic() + 10.0
        while time.monotonic() < end and self._unconfirmed(live):
            time.sleep(0.02)
        with self._lock:
            self._closed = True
        for p in self._spawned:
            if p.poll() is None:
                p.terminate()
        for p in self._spawned:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        with self._lock:
            for d in self._daemons.values():
                d.close()
        self._server.close()
        for t in self._threads:
            t.join(timeout=2)

    def detach(self) -> None:
        """Stop serving without stopping anything: the daemons and their workloads keep
        running and reconnect to whoever listens on this address next (an engine
        restarted or upgraded in place), which adopts them through :meth:`inventory`."""
        with self._lock:
            self._closed = True
            for d in self._daemons.values():
                d.close()
        self._server.close()
        for t in self._threads:
            t.join(timeout=2)
        self._spawned.clear()  # no longer ours to stop

    def _unconfirmed(self, attempts: list[_Attempt]) -> bool:
        """Whether any of ``attempts`` still runs on a daemon that can still confirm its end."""
        with self._lock:
            for a in attempts:
                if a.final:
                    continue
                for r in a.replicas.values():
                    node = self._nodes.get(r.node)
                    d = node.daemon if node is not None else None
                    if r.state in ("sent", "running") and d is not None and d.connected:
                        return True
            return False

    # ========================================================== engine helpers
    def wait(self, timeout: float) -> bool:
        """Block until an event is ready to poll (or ``timeout``); lets a driver loop
        react at once instead of sleeping a fixed period."""
        return self._wake.wait(timeout)

    def wait_for_nodes(self, names: Sequence[str] | None = None, timeout: float = 30.0) -> None:
        """Wait until every named node (default: the whole cluster) has a daemon."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                wanted = list(names) if names is not None else list(self._nodes)
                missing = [
                    n for n in wanted
                    if n not in self._nodes or self._nodes[n].daemon is None
                    or not self._nodes[n].daemon.connected  # type: ignore[union-attr]
                ]
            if not missing:
                return
            if time.monotonic() >= end:
                errors = "; ".join(list(self.errors)[-5:])
                dead = [
                    f"daemon pid {p.pid} exited with {p.returncode}"
                    for p in self._spawned if p.poll() is not None
                ]
                raise TimeoutError(
                    f"no daemon registered for node(s) {', '.join(missing)} within {timeout}s"
                    + (f" ({'; '.join(dead)})" if dead else "")
                    + (f"; errors: {errors}" if errors else "")
                )
            time.sleep(0.02)

    def spawn_daemon(
        self,
        nodes: Sequence[NodeSpec | tuple[NodeSpec, Sequence[int]]],
        *,
        declared_gpus: bool = False,
        state_dir: str | Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> subprocess.Popen[bytes]:
        """Start a daemon process on this machine serving ``nodes`` (for tests and demos).

        It exits with this process and is stopped by :meth:`close`. Its log is
        ``daemon.log`` in its state directory."""
        base = self._base_dir()
        sdir = Path(state_dir) if state_dir is not None else Path(
            tempfile.mkdtemp(prefix="daemon-", dir=base)
        )
        sdir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable, "-m", "mlwe.backends.local", "--engine", self.address,
            "--state-dir", str(sdir), "--parent-pid", str(os.getpid()),
            "--checkpoint-root", str(self.checkpoint_root or base / "checkpoints"),
        ]
        for item in nodes:
            spec, indices = item if isinstance(item, tuple) else (item, None)
            data = spec.model_dump(mode="json")
            if indices is not None:
                data["gpu_indices"] = list(indices)
            args += ["--node", json.dumps(data)]
        if declared_gpus:
            args.append("--declared-gpus")
        args += list(extra_args)
        env = dict(os.environ)
        if self.token:
            env["MLWE_DAEMON_TOKEN"] = self.token  # not on the command line, where ps shows it
        with open(sdir / "daemon.log", "ab") as logf:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._spawned.append(proc)
        return proc

    def stop_wait_s(self, workload: str, attempt: int) -> float | None:
        """How long the attempt's slowest replica took between SIGTERM and its exit (its
        own checkpoint and shutdown, inside the grace period); None if not stopped so."""
        with self._lock:
            att = self._attempts.get((workload, attempt))
            if att is None:
                return None
            waits = [r.term_to_exit_s for r in att.replicas.values() if r.term_to_exit_s is not None]
            return max(waits) if waits else None

    def daemons(self) -> list[dict[str, Any]]:
        """The registered daemons, for status displays."""
        now = time.monotonic()
        with self._lock:
            return [
                {"id": d.id, "host": d.host, "pid": d.pid, "nodes": list(d.nodes),
                 "connected": d.connected, "seen_s_ago": round(now - d.last_seen, 3),
                 "machine": d.machine}
                for d in self._daemons.values()
            ]

    def _base_dir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="mlwe-local-"))
        self._work_dir.mkdir(parents=True, exist_ok=True)
        return self._work_dir
