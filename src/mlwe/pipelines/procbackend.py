"""A minimal Backend that runs each workload replica as a local subprocess.

Interim: it lets pipelines run real processes until the local workload daemon
(``mlwe.backends.local``) is available, and stays as the smallest real
Backend for tests that need nothing more. It implements the Backend protocol
(idempotent commands by request id, events with unique ids): a start spawns
``spec.command`` once per replica in its own session, with the engine's
``MLWE_*`` variables; a stop sends SIGTERM to each process group, waits up to
the grace period, then SIGKILL, and confirms the release only once every
process has exited; ``fail_node`` kills what runs on a node and reports it
lost (fault injection for tests and the case studies). Output goes to
``<log_dir>/<workload>.<attempt>.<replica>.log``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mlwe.core.actions import Exited, Released, Started
from mlwe.core.backend import (
    Command,
    Event,
    Fact,
    NodeDown,
    NodeUp,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
)
from mlwe.core.clock import Clock


@dataclass
class _Attempt:
    workload: str
    attempt: int
    nodes: tuple[str, ...]
    procs: list[subprocess.Popen[bytes]]
    stop_deadline: float | None = None  # when a stop escalates to SIGKILL
    stopping: bool = False
    lost: bool = False
    done: bool = False
    codes: list[int] = field(default_factory=list)


class SubprocessBackend:
    """Runs workload replicas as subprocesses of this process (see the module docstring)."""

    name = "subprocess"

    def __init__(self, clock: Clock, log_dir: str | Path, *, cwd: str | Path | None = None) -> None:
        self.clock = clock
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cwd = str(cwd) if cwd is not None else None
        self._seen: set[str] = set()
        self._runs: dict[tuple[str, int], _Attempt] = {}
        self._out: list[Event] = []
        self._n = 0
        self._down: set[str] = set()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- protocol
    def send(self, commands: Sequence[Command]) -> None:
        with self._lock:
            for c in commands:
                if c.request_id in self._seen:
                    continue
                self._seen.add(c.request_id)
                if isinstance(c, StartCommand):
                    self._start(c)
                elif isinstance(c, StopCommand):
                    self._stop(c)

    def poll(self) -> list[Event]:
        with self._lock:
            self._reap()
            out, self._out = self._out, []
            return out

    def drain_telemetry(self) -> list[Telemetry]:
        return []

    def inventory(self) -> list[RunningAttempt]:
        with self._lock:
            return [
                RunningAttempt(a.workload, a.attempt, a.nodes)
                for a in self._runs.values()
                if not a.done
            ]

    def close(self) -> None:
        with self._lock:
            for a in self._runs.values():
                if not a.done:
                    self._signal(a, signal.SIGKILL)
            for a in self._runs.values():
                for p in a.procs:
                    with contextlib.suppress(Exception):
                        p.wait(timeout=5)
                a.done = True

    # -------------------------------------------------------------- injection
    def fail_node(self, node: str) -> None:
        """The node dies: everything on it is killed, and the node is reported lost."""
        with self._lock:
            self._down.add(node)
            for a in self._runs.values():
                if not a.done and node in a.nodes:
                    a.lost = True
                    self._signal(a, signal.SIGKILL)
            self._emit(NodeDown(node, "injected failure"))

    def recover_node(self, node: str) -> None:
        with self._lock:
            self._down.discard(node)
            self._emit(NodeUp(node))

    # --------------------------------------------------------------- internals
    def _emit(self, fact: Fact) -> None:
        self._n += 1
        self._out.append(Event(f"proc-{os.getpid()}-{self._n}", self.clock.now(), fact))

    def _start(self, c: StartCommand) -> None:
        nodes = tuple(a.node for a in c.placement)
        if any(n in self._down for n in nodes):
            self._emit(Exited(c.workload, c.attempt, -1, "node-lost"))
            return
        if not c.spec.command:
            self._emit(Exited(c.workload, c.attempt, 127, "start-failed"))
            return
        procs = []
        for i, alloc in enumerate(c.placement):
            env = {
                **os.environ,
                **c.spec.env,
                "MLWE_WORKLOAD_ID": c.workload,
                "MLWE_ATTEMPT": str(c.attempt),
                "MLWE_REPLICA": str(i),
                "MLWE_NODE": alloc.node,
            }
            log = self.log_dir / f"{c.workload}.{c.attempt}.{i}.log"
            try:
                with open(log, "ab") as fh:
                    procs.append(
                        subprocess.Popen(
                            list(c.spec.command),
                            stdin=subprocess.DEVNULL,
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            env=env,
                            cwd=self.cwd,
                            start_new_session=True,  # its own process group: signals reach all
                        )
                    )
            except OSError as exc:
                with open(log, "a", encoding="utf-8") as fh:
                    fh.write(f"mlwe: cannot start {c.spec.command[0]!r}: {exc}\n")
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                self._emit(Exited(c.workload, c.attempt, 127, "start-failed"))
                return
        self._runs[(c.workload, c.attempt)] = _Attempt(c.workload, c.attempt, nodes, procs)
        self._emit(Started(c.workload, c.attempt))

    def _stop(self, c: StopCommand) -> None:
        a = self._runs.get((c.workload, c.attempt))
        if a is None or a.done:
            self._emit(Released(c.workload, c.attempt))
            return
        a.stopping = True
        a.stop_deadline = self.clock.now() + max(0.0, c.grace_s)
        self._signal(a, signal.SIGKILL if c.grace_s <= 0 else signal.SIGTERM)

    @staticmethod
    def _signal(a: _Attempt, sig: signal.Signals) -> None:
        for p in a.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, sig)

    def _reap(self) -> None:
        now = self.clock.now()
        for a in self._runs.values():
            if a.done:
                continue
            codes = [p.poll() for p in a.procs]
            if a.stopping and a.stop_deadline is not None and now >= a.stop_deadline:
                self._signal(a, signal.SIGKILL)
            if any(x is None for x in codes):
                if not a.stopping and not a.lost and any(x not in (None, 0) for x in codes):
                    # one replica of a gang failed: the attempt fails, stop the others
                    self._signal(a, signal.SIGKILL)
                continue
            a.done = True
            a.codes = [int(x) for x in codes if x is not None]
            if a.lost:
                continue  # the node loss (already reported) stands for these exits
            if a.stopping:
                self._emit(Released(a.workload, a.attempt))
                continue
            bad = [x for x in a.codes if x != 0]
            code = bad[0] if bad else 0
            cause = "" if code == 0 else ("killed" if code < 0 else "error")
            self._emit(Exited(a.workload, a.attempt, code, cause))
